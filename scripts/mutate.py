"""Mutation testing (`make mutate`): small changes made to the modules that decide outcomes, one at a time, each
run against the test files that exercise its module (TARGETS). A change no test notices (a survivor) is a line the
tests do not check: it gets a test, or an entry in its module's equivalent list saying why no test can tell it from
the original.

    python scripts/mutate.py                          # every module of TARGETS
    python scripts/mutate.py common/tools.py          # one (make: MODULES=common/tools.py make mutate)
    python scripts/mutate.py 'dataset/ingest/*.py'    # a folder's modules, together
    python scripts/mutate.py dataset/ingest/split.py --only _pieces x_split_document__mutmut_7   # functions or mutants

The tester is mutmut (pinned in requirements-mutate.txt, which `make mutate` installs): it writes every mutant of a
function into one copy of the module behind a switch, runs the tests once to learn which tests call which function,
then forks a process per mutant that runs only those tests. On a 2-core AMD EPYC (Zen 4), for common/tools.py: 0.5 s
a mutant, against 8.0 s for cosmic-ray, which rewrites the file and starts pytest afresh for each one (dev/LOG.md,
2026-12-06).

mutmut mutates a tree of its own (`mutants/`) beside the code it is given; it is given a copy of this checkout (its
tracked and untracked files, ignored ones left out) in a temporary folder, so the working tree is never touched.
mutmut leaves decorated functions alone (a decorator runs when the function is defined); in the copy, each
decorated function of the module is defined bare and decorated at the end of the file instead (same lines, same
behaviour), so `@torch.no_grad()` functions and properties are mutated too. Module-level constants are not
mutated (mutmut changes function bodies only).

Per module it prints the mutants, how many were killed (a test failed), survived, timed out (counted as killed: the
tests did not finish) and were declared equivalent, the score (killed and timed out over the mutants not
equivalent), each survivor as file:line with the mutation, and the time it took.
"""
from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL = 90.0  # percent killed, equivalent mutants excluded (the project's goal; --fail_under makes it a check)


@dataclass(frozen=True)
class Equivalent:
    """Surviving mutants no test can tell from the original: those of `function` ("Class.method" for a method)
    whose mutated line, as the report prints it, contains one of `mutants`; and why they are equivalent."""

    function: str
    mutants: tuple[str, ...]
    why: str


@dataclass(frozen=True)
class Target:
    """A module to mutate: the test files that exercise it, and its known equivalent mutants."""

    tests: tuple[str, ...]
    equivalent: tuple[Equivalent, ...] = ()


FALSY_NONE = "json.dumps reads ensure_ascii and allow_nan as truth values: None is False"
TOOLS_EQUIVALENT = (
    Equivalent("_evaluate", ("if (isinstance(node, ast.expr)) or True",),
               "every node _evaluate is given is an expression (the parsed body, an operator's operands)"),
    Equivalent("lookup_element", ("_BY_NAME.get(None) or", "_BY_NAME.get(name.strip().upper()) or"),
               "no name in the table ends in 元素: the second lookup (the name without it) finds what the first would"),
    Equivalent("check_arguments", ("ensure_ascii=None",), FALSY_NONE),
    Equivalent("run_tool", ("ensure_ascii=None", "allow_nan=None"), FALSY_NONE),
)
REWARDS_EQUIVALENT = (
    Equivalent("RewardModel.__init__", ("batch_size: int = 17",),
               "batches only group the forward passes: each completion's score is read at its own last token"),
    Equivalent("RewardModel._load", ("local_files_only=None", "local_files_only=False",
                                     "self.path, trust_remote_code=True)"),
               "the path is an existing directory (parse_reward checks), which transformers reads from disk whatever "
               "local_files_only says: the flag only keeps a name from being looked up on the Hub"),
    Equivalent("RewardModel.text", ('"chat_template", )', "tokenize=None"),
               "every transformers tokenizer has a chat_template attribute (None without one); apply_chat_template "
               "tests `not tokenize`"),
    Equivalent("RewardModel.__call__", ("logits.shape[+1]", "softmax(+1)"),
               "the logits are (completions, labels): dimension 1 is the last"),
    Equivalent("user_reward", ("bind(None, {})", 'bind("completion", None)', 'bind("XXcompletionXX", {})',
                               'bind("COMPLETION", {})'),
               "bind only checks that the function takes two arguments; the values bound are never used"),
    Equivalent("parse_reward", ('(part, "", "XXXX")',),
               "without '=' the weight's text is never read (eq is empty: the weight is 1)"),
    Equivalent("score", ("dtype=None", "torch.tensor(t.fn(completions), )"),
               "every term gives Python floats (a user's reward goes through float()), which torch makes float32, "
               "the default dtype, which PocketLM never changes"),
)
INFERRED_DTYPES = ("torch infers the same dtype: int64 from integers, float32 (the default dtype, which PocketLM never "
                   "changes) from floats and for zeros")
PAD_UNSEEN = "generate masks the padding and cuts it from the completions: the pad id's value is never seen"
ROLLOUTS_EQUIVALENT = (
    Equivalent("ToolCodec.decode", ("skip_special_tokens: bool = True",),
               "a Protocol's signature: never called, it describes the tokenizer's"),
    Equivalent("Rollouts.per_token", ("dtype=None", "device=None", "torch.zeros((), device=spread.device)",
                                      "dtype=spread.dtype, )"),
               "a zero-dimensional tensor: torch.where takes it beside tensors on any device, and it does not change "
               "the result's dtype"),
    Equivalent("Rollouts.only", ("torch.tensor(rows, device=None)", "torch.tensor(rows, )"),
               "a CPU index tensor indexes tensors on any device"),
    Equivalent("sample_rollouts", ("top_k=top_k, top_p=top_p, stop=ends",), PAD_UNSEEN),
    Equivalent("sample_tool_rollouts", ("temperature=temperature, stop=lambda",), PAD_UNSEEN),
    Equivalent("sample_tool_rollouts", ("range(max_rounds + 2)",),
               "the last round leaves no rollout going (each answers, is cut or is capped): a further one has no rows"),
    Equivalent("pack_rollouts", ("dtype=None", "torch.full(shape, pad_id, )", "torch.full(shape, -1, )",
                                 "torch.full(shape, IGNORE_INDEX, )", "torch.zeros(shape, )",
                                 "torch.tensor(prompt[:-1], )", "torch.tensor([prompt[-1], *row.ids[:-1]], )",
                                 "torch.tensor(row.log_probs, )"),
               INFERRED_DTYPES),
)
DEFAULT_IGNORE = "IGNORE_INDEX is -100, cross_entropy's default ignore_index"
LAST_OF_TWO = "the tensor is 2-D: dimension 1 is the last (and log_softmax without one takes dimension 1 of a 2-D one)"
OBJECTIVES_EQUIVALENT = (
    Equivalent("token_log_probs", ('targets.flatten(), reduction="none")',), DEFAULT_IGNORE),
    Equivalent("LanguageModeling.__call__", ('y.flatten(), reduction="sum")',), DEFAULT_IGNORE),
    Equivalent("Distillation.parts", ('y.flatten(), reduction="sum")',), DEFAULT_IGNORE),
    Equivalent("DPO.count", ("batch[1].shape[0] // 2", "device=batch[1].device"),
               "a batch's inputs and targets have the same rows, on the same device"),
    Equivalent("DPO.__call__", (".sum(+1)",), LAST_OF_TWO),
    Equivalent("sequence_log_probs", (".sum(+1)",), LAST_OF_TWO),
    Equivalent("padded_selection", ("flat.numel() + chosen",),
               "the cap never limits: free.cumsum(0) <= extra selects at most the free positions there are"),
    Equivalent("PolicyGradient.__call__", ("dim=None", "self.temperature, )", "dim=+1", "gather(+1"), LAST_OF_TWO),
)

TOOL_TESTS = ("tests/test_tools.py", "tests/test_agent.py", "tests/test_properties.py")
RL_TESTS = ("tests/test_rl.py", "tests/test_agent.py")
PLANNER_EQUIVALENT = (
    Equivalent("plan", ("choose_dtype(dtype, device, )",), 'choose_dtype\'s purpose defaults to "train"'),
    Equivalent("plan", ("fitting[max(1, fitting.index(best) - 1)",),
               "fitting[0], the cheapest, is timed in the first round: leaving it out of the pick's neighbours times "
               "nothing less"),
)
ON_TRACK_EQUIVALENT = (
    Equivalent("OnTrack.watch_training", ("or train_loss <= lowest)",), "an equal loss leaves the lowest as it was"),
    Equivalent("OnTrack.compare", ("or val_loss <= best:",), "an equal loss leaves the best as it was"),
)
FIRST_STEPS_EQUIVALENT = (
    Equivalent("FirstStepsPlan.__init__", ("self.last = None", "self.last = 1"),
               "the first step's wrapper sets it before due() is first asked, after that step"),
)
EXTRACT_EQUIVALENT = (
    Equivalent("decode_text", ('encoding or "UTF-8"',), "codec names are case-insensitive: UTF-8 is the utf-8 codec"),
    Equivalent("_slug", ('.encode("ASCII", "ignore")', '.strip("XX-XX")'),
               "codec names are case-insensitive; strip takes a set of characters and a lower-cased slug holds no X"),
    Equivalent("prepare_page", ('else "XXXX", _slug',),
               'a slug is lower-case: "XXXX" neither equals the id\'s slug nor ends in "-" + it, just as "" does not'),
    Equivalent("_frame_body", ('getattr(xpaths, "BODY_XPATH", )',),
               "the installed trafilatura has BODY_XPATH: the None default only serves versions without it"),
    Equivalent("_frame_body", ("(callable(f)) or True", "tree.xpath(None)"),
               "the installed trafilatura's BODY_XPATH holds compiled XPaths, all callable: the string branch never "
               "runs"),
    Equivalent("_frame_body", ('makeelement("main", None)', 'makeelement("main", )'),
               "lxml reads attrib None (or none given) as no attributes, like {}"),
    Equivalent("read_html", ('"&AMP;"',),
               "&AMP; is an HTML5 named reference for & too: trafilatura's unescape gives back the same &"),
    Equivalent("read_html", ("include_comments=None", "deduplicate=None", "include_comments=False, deduplicate=False)",
                             "include_tables=True, )"),
               "trafilatura.extract reads its flags as truth values (None is False); its defaults are "
               "include_tables=True, deduplicate=False"),
    Equivalent("block_text", ('rsplit("}", )', 'tag.split("}", 1)', 'rsplit("}", 2)'),
               'a Clark-notation tag holds one "}" (lxml ends the namespace at the first): every split gives the same '
               'name'),
    Equivalent("block_text", ('else "XXXX"',), '"XXXX" is no block tag, as "" is not (comments stay no block)'),
    Equivalent("block_text", ("with_tail=None", 'method="TEXT"', 'encoding="UNICODE"'),
               "lxml reads with_tail as a truth value (None is False), method and encoding names case-insensitively"),
    Equivalent("join_wrapped_lines", ("_CJK.match(line[:2])",),
               "re.match anchors at the slice's first character: line[:2] starts with CJK exactly when line[:1] is "
               "CJK"),
    Equivalent("read_pdf", (r'replace("XX\r\nXX", "\n")',),
               "the next replace makes each CR LF two line breaks, and the empty line between them is dropped"),
    Equivalent("read_pdf", ("raise Unreadable(None)", '"XXa PDF with no pagesXX"', '"a pdf with no pages"',
                            '"A PDF WITH NO PAGES"'),
               "unreachable: PDFium refuses to open a document with no pages (Failed to load document)"),
    Equivalent("read_epub", ("options=None", "read_epub(str(path), )", '"XXignore_ncxXX": True', '"IGNORE_NCX": True'),
               "ebooklib's own default is ignore_ncx=True (EpubReader.DEFAULT_OPTIONS)"),
    Equivalent("read_docx", ("raise Unreadable(None) from None", "XXnot a Word .docx file", "not a word .docx file",
                             "NOT A WORD .DOCX FILE"),
               "unreachable: python-docx raises PackageNotFoundError only for a non-zip path, which check_zip "
               "refused"),
)
PLAN_EQUIVALENT = (
    Equivalent("BudgetPlan.fit", ("time_for(after, hi, step_s) < seconds",),
               "the early return only skips the bisection, which finds the limit too when it fits exactly "
               "(time_for never falls as the end grows)"),
    Equivalent("BudgetPlan.fit", ("(lo + hi + 2) // 2",),
               "mid stays within lo+1..hi while lo < hi: still a bisection over a non-decreasing time_for, to the "
               "same step"),
    Equivalent("make_plan", ("budget_s=budget_s, steps=1,", "budget_s=budget_s, steps=None,"),
               "the steps are set from plan.fit on the next line; nothing reads them before (fit and time_for do "
               "not)"),
    Equivalent("replanned_end", ("at <= LOW * plan.budget_s and", "at < LOW / plan.budget_s", "end > plan.limit"),
               "the clause only saves a search: an early end already at the limit fits, so fit finds the limit "
               "again and new_end == end keeps the plan (an end exactly at LOW is kept by the band's own test)"),
)
GUARD_EQUIVALENT = (
    Equivalent("TimeBudgetGuard.__init__", ('self.replanned_at: int | None = ""', 'self.shown_end: int | None = ""'),
               "start() sets it to None before the guard's first look"),
    Equivalent("TimeBudgetGuard.__init__", ("self.since = None", "self.since = 1"),
               "start() sets it to 0 before the guard's first look"),
    Equivalent("TimeBudgetGuard.step_times", ("if first >= self.since and",),
               "when first equals since, moving since to first changes nothing and the run's time is computed from "
               "the same looks again"),
    Equivalent("TimeBudgetGuard.step_times", ("* FASTER <= steady_s",),
               "differs only when the slowest recent look is exactly 1/FASTER of the run's time, a float equality of "
               "measured times; either side of it is tested (a lasting speed-up moves since, a small one does not)"),
    Equivalent("TimeBudgetGuard.run", ("self.shown_end = None",),
               "after a re-plan shown on screen the plan's end is the end shown, which the next re-plan takes as the "
               "last shown when it finds None"),
    Equivalent("TimeBudgetGuard.run", ("end >= plan.end and", "end is None or end < plan.end"),
               "replanned_end returns None rather than the plan's own end: an end it returns is never equal to "
               "plan.end"),
    Equivalent("TimeBudgetGuard.run", ("step_s <= cautious",),
               "when the step time is already the cautious one, planning again with it gives the same end "
               "(replanned_end is pure), which passes the same checks"),
)
INGEST_EQUIVALENT = (
    Equivalent("_pieces", ("len(sentences) > 1 or max(", "len(sentences) >= 1 and max("),
               "one sentence is shorter than the text only by its trailing whitespace; split_document asks _pieces "
               "to cut only a text longer than max_chars once stripped, so the sentence is cut at the same last space"),
    Equivalent("_pieces", ("max(map(len, sentences)) <= len(text)",),
               "sentence pieces are never empty: with more than one, each is shorter than the text"),
    Equivalent("_pieces", ('text.rfind(" ", None, max_chars)', 'text.rfind(" ", 1, max_chars)'),
               "a start of None is 0; a space at 0 gives cut 0, which falls back to max_chars as no space (-1) does"),
    Equivalent("is_heldout", ('encode("UTF-8", "surrogatepass")',), "codec names are case-insensitive"),
    Equivalent("is_heldout", ("int.from_bytes(digest[:8], )",),
               'byteorder defaults to "big" from Python 3.11 (on 3.10 the call raises, which every test sees)'),
    Equivalent("_listed", ('read_text(encoding="UTF-8")',), "codec names are case-insensitive"),
    Equivalent("json_line", ('encode("UTF-8", "backslashreplace")', "ensure_ascii=None"),
               "codec names are case-insensitive; json reads ensure_ascii as a truth value (None is False)"),
    Equivalent("split_document", ("if len(piece) >= max_chars:",),
               "a piece of exactly max_chars ends its record either way: alone, or as the record the next piece "
               "flushes (any next piece overflows it)"),
    Equivalent("ingest", ("disable=not progress, file=None,", "disable=not progress, dynamic_ncols=True)",
                          "dynamic_ncols=None)", "dynamic_ncols=False)", "file=sys.stderr, )"),
               "tqdm writes to sys.stderr by default (file None or left out); dynamic_ncols only follows a "
               "terminal's resizing, and without it the bar keeps the width it read at the start"),
    Equivalent("ingest", ('yield 1, {"text": chunk',),
               "clean_records takes (line number, record) pairs and reads only the record: the number is a "
               "placeholder"),
    Equivalent("ingest", ("CleanOptions(strip_html=None)",), "strip_html is read as a truth value (None is False)"),
    Equivalent("main", ('files.out or "XXXX"',),
               "without --out, run() stops with a ConfigError before anything is written: the fallback never names "
               "an error"),
)
LOSS_MODEL_EQUIVALENT = (
    Equivalent("_log_predicted", ("theta.unbind(+1)",), "theta is (rows, 5): its last dimension is dimension 1"),
    Equivalent("_objective", ("delta=HUBER_DELTA).sum(+1)",),
               "the residuals are (rows, points): their last dimension is dimension 1"),
    Equivalent("fit", ("max_iter=501,",), "L-BFGS stops on tolerance_change long before 500 iterations"),
    Equivalent("fit", ("if value <= best_value:",),
               "two starts ending at exactly the same objective are the same optimum: either may be kept"),
)
TARGETS: dict[str, Target] = {
    "trainer_utils/budget.py": Target(("tests/test_time_budget.py", "tests/test_budget_plan.py",
                                       "tests/test_first_steps_plan.py", "tests/test_properties.py"),
                                      PLAN_EQUIVALENT),
    "trainer_utils/components/budget.py": Target(("tests/test_time_budget.py", "tests/test_first_steps_plan.py"),
                                                 GUARD_EQUIVALENT),
    "trainer_utils/components/first_steps.py": Target(("tests/test_first_steps_plan.py",), FIRST_STEPS_EQUIVALENT),
    "trainer_utils/planner.py": Target(("tests/test_planner.py", "tests/test_auto_preset.py"), PLANNER_EQUIVALENT),
    "trainer_utils/rollouts.py": Target(RL_TESTS, ROLLOUTS_EQUIVALENT),
    "trainer_utils/rewards.py": Target(RL_TESTS, REWARDS_EQUIVALENT),
    "trainer_utils/objectives.py": Target(("tests/test_objectives.py", "tests/test_rl.py", "tests/test_dpo.py",
                                           "tests/test_distillation.py", "tests/test_stages.py"),
                                          OBJECTIVES_EQUIVALENT),
    "dataset/ingest/*.py": Target(("tests/test_ingest.py", "tests/test_properties.py", "tests/test_config.py"),
                                  INGEST_EQUIVALENT),
    "dataset/ingest/formats/*.py": Target(("tests/test_ingest.py", "tests/test_extract.py"), EXTRACT_EQUIVALENT),
    "common/tools.py": Target(TOOL_TESTS, TOOLS_EQUIVALENT),
    "trainer_utils/loss_model.py": Target(("tests/test_loss_model.py", "tests/test_on_track.py"),
                                          LOSS_MODEL_EQUIVALENT),
    "trainer_utils/components/on_track.py": Target(("tests/test_on_track.py",), ON_TRACK_EQUIVALENT),
}


@dataclass(frozen=True)
class Mutant:
    """One mutant of a module: mutmut's name for it, its status, where it is and what it changed."""

    name: str
    status: str  # mutmut's: killed, survived, timeout, no tests, ...
    module: str  # its file
    function: str  # "function" or "Class.method"
    line: int  # in the module as it is in the working tree
    before: str
    after: str


# ---------------------------------------------------------------------- the copy mutmut works in
def copy_checkout(dest: Path) -> None:
    """The checkout's files (tracked, and untracked ones git does not ignore) copied under `dest`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the working tree is listed too
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def decorate_at_end(path: Path) -> None:
    """Rewrite `path` so that each decorated function (module level or a class's) is defined bare and decorated
    at the end of the file: mutmut then mutates it. The decorator lines are blanked, not removed, so every line
    keeps its number. Staticmethods and classmethods stay (mutmut takes them as they are)."""
    lines = path.read_text().splitlines(keepends=True)
    tree = ast.parse("".join(lines))
    rewraps = []
    scopes = [(node, "") for node in tree.body] + [(node, f"{c.name}.") for c in tree.body
                                                   if isinstance(c, ast.ClassDef) for node in c.body]
    for node, owner in scopes:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.decorator_list:
            continue
        if any(isinstance(d, ast.Name) and d.id in ("staticmethod", "classmethod") for d in node.decorator_list):
            continue
        wrapped = f"{owner}__dict__[{node.name!r}]" if owner else node.name
        for decorator in reversed(node.decorator_list):  # the one nearest the def applies first
            wrapped = f"({ast.unparse(decorator)})({wrapped})"
            for n in range(decorator.lineno - 1, decorator.end_lineno):
                lines[n] = "\n"
        rewraps.append(f"{owner}{node.name} = {wrapped}\n")
    if rewraps:
        path.write_text("".join(lines) + "\n\n# scripts/mutate.py: the decorators, applied here\n" + "".join(rewraps))


def modules_of(target: str) -> list[str]:
    """The files a TARGETS key names: itself, or those its glob matches ("dataset/ingest/*.py": one folder's)."""
    return sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(target)) if "*" in target else [target]


def write_config(copy: Path, modules: list[str], tests: tuple[str, ...]) -> None:
    """mutmut's settings (setup.cfg in the copy): everything copied into its tree, `modules` mutated, these tests."""
    skip = {"tests", "setup.cfg"}  # mutmut copies tests/ itself
    entries = sorted(p.name for p in copy.iterdir() if not p.name.startswith(".") and p.name not in skip)
    listed = lambda values: "".join(f"\n    {v}" for v in values)  # noqa: E731
    (copy / "setup.cfg").write_text(
        "[mutmut]\n"
        f"source_paths ={listed(entries)}\n"
        f"only_mutate ={listed(modules)}\n"
        f"pytest_add_cli_args_test_selection ={listed(tests)}\n"
        "pytest_add_cli_args = -p no:cacheprovider\n"
        "use_git_change_detection = false\n")


# ---------------------------------------------------------------------- reading the results
def function_lines(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """Every function of a module by name, methods as "Class.method" (mutmut's own copies by their own names)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            found.update({f"{node.name}.{f.name}": f for f in node.body if isinstance(f, ast.FunctionDef)})
        if isinstance(node, ast.FunctionDef):
            found[node.name] = node
    found.update({f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and "__mutmut_" in f.name})
    return found


def read_mutants(copy: Path, module: str) -> list[Mutant]:
    """The module's mutants with mutmut's verdicts, each located in the original file by comparing its function
    with mutmut's unmutated copy of it."""
    from mutmut.stats import status_by_exit_code

    meta = json.loads((copy / "mutants" / f"{module}.meta").read_text())
    original = function_lines(ast.parse((copy / module).read_text()))
    mutated_source = (copy / "mutants" / module).read_text()
    mutated_lines = mutated_source.splitlines()
    mutated = function_lines(ast.parse(mutated_source))

    def body(generated: str, function: str) -> list[str]:  # its lines, under the function's own name
        f = mutated[generated]
        return [line.replace(f.name, function.rpartition(".")[2]) for line in mutated_lines[f.lineno - 1:f.end_lineno]]

    mutants = []
    for name, code in meta["exit_code_by_key"].items():
        generated = name.rpartition(".")[2]  # x_check_arguments__mutmut_10, xǁToolǁschema__mutmut_3
        mangled = generated.partition("__mutmut_")[0]
        function = mangled[2:].replace("ǁ", ".")  # x_ before a function, xǁ before Classǁmethod
        before, after = body(f"{mangled}__mutmut_orig", function), body(generated, function)
        opcode = next(op for op in difflib.SequenceMatcher(a=before, b=after).get_opcodes() if op[0] != "equal")
        _, b1, b2, a1, a2 = opcode
        mutants.append(Mutant(name, status_by_exit_code[code], module, function, original[function].lineno + b1,
                              before[b1].strip() if b1 < b2 else "", after[a1].strip() if a1 < a2 else ""))
    return sorted(mutants, key=lambda m: (m.line, m.name))  # one module's: in the order of its lines


@dataclass
class Score:
    """A module's counts, and the seconds its run took."""

    module: str
    mutants: int
    killed: int
    survived: int
    timed_out: int
    equivalent: int
    seconds: float

    @property
    def percent(self) -> float:
        counted = self.mutants - self.equivalent
        return 100.0 * (self.killed + self.timed_out) / counted if counted else 100.0


def report(module: str, mutants: list[Mutant], equivalent: tuple[Equivalent, ...], seconds: float,
           whole: bool = True) -> Score:
    """Print the module's counts and survivors; its score. Of a `whole` module's run, also the declared
    equivalents that no survivor matches any more."""
    survivors = [m for m in mutants if m.status not in ("killed", "timeout")]
    matched: set[tuple[str, str]] = set()  # (function, fragment) pairs that named a survivor

    def why_equivalent(m: Mutant) -> str | None:
        for e in equivalent:
            for fragment in e.mutants:
                if e.function == m.function and fragment in m.after:
                    matched.add((e.function, fragment))
                    return e.why
        return None

    alive = [m for m in survivors if why_equivalent(m) is None]
    score = Score(module, len(mutants), sum(m.status == "killed" for m in mutants), len(alive),
                  sum(m.status == "timeout" for m in mutants), len(survivors) - len(alive), seconds)
    print(f"\n{module}: {score.mutants} mutants, {score.killed} killed, {score.survived} survived, "
          f"{score.timed_out} timed out, {score.equivalent} equivalent: {score.percent:.1f}% killed "
          f"({seconds / 60:.1f} min)")
    for m in alive:
        note = "" if m.status == "survived" else f"  [{m.status}]"
        print(f"  {m.module}:{m.line} {m.function}: {m.before}  ->  {m.after or '(removed)'}{note}  [{short_name(m)}]")
    for e in equivalent if whole else ():
        for fragment in e.mutants:
            if (e.function, fragment) not in matched:
                print(f"  note: no survivor of {e.function} matches the equivalent {fragment!r} any more; drop it")
    return score


# ---------------------------------------------------------------------- running
def mutant_pattern(only: str) -> str:
    """mutmut's name pattern for a mutant named as the report prints it (x_split__mutmut_7), or for the mutants of a
    function ("Class.method" for a method)."""
    if "__mutmut_" in only:
        return f"*.{only}"
    owner, _, name = only.rpartition(".")
    return f"*.x{'ǁ' + owner + 'ǁ' if owner else '_'}{name}__mutmut_*"


def short_name(m: Mutant) -> str:
    return m.name.rpartition(".")[2]


def mutate(name: str, target: Target, jobs: int, keep: bool, only: tuple[str, ...] = ()) -> Score:
    """Copy the checkout, run mutmut on a target's modules there (on the mutants `only` names alone when given:
    functions or mutants), report; the copy is removed unless `keep` (or mutmut failed: its log is then kept and
    named)."""
    start = time.monotonic()
    modules = modules_of(name)
    copy = Path(tempfile.mkdtemp(prefix="pocketlm-mutate-"))
    copy_checkout(copy)
    for module in modules:
        decorate_at_end(copy / module)
    write_config(copy, modules, target.tests)
    log = copy / "mutmut.log"
    print(f"{name}: mutmut on {', '.join(target.tests)} (in {copy}, log mutmut.log)", flush=True)
    with open(log, "w") as out:  # property tests unshrunk (tests/test_properties.py: the mutation profile)
        done = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(jobs),
                               *map(mutant_pattern, only)], cwd=copy, stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, "HYPOTHESIS_PROFILE": "mutation"})
    # a module with no function to mutate (a package's __init__ of imports) has no results
    if done.returncode != 0 or not any((copy / "mutants" / f"{m}.meta").is_file() for m in modules):
        tail = log.read_text(errors="replace").replace("\r", "\n").splitlines()[-30:]
        raise SystemExit(f"mutmut failed on {name} (exit {done.returncode}); the end of {log}:\n" + "\n".join(tail))
    mutants = [m for module in modules if (copy / "mutants" / f"{module}.meta").is_file()
               for m in read_mutants(copy, module) if not only or m.function in only or short_name(m) in only]
    score = report(name, mutants, target.equivalent, time.monotonic() - start, whole=not only)
    if keep:
        print(f"  kept: {copy} (`python -m mutmut show NAME` there shows a mutant)")
    else:
        shutil.rmtree(copy)
    return score


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", help=f"modules to mutate (default: all of {', '.join(TARGETS)})")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="mutants tested at once")
    parser.add_argument("--keep", action="store_true", help="keep each module's copy (to inspect its mutants)")
    parser.add_argument("--only", nargs="+", default=(),
                        help='only these mutants (as the report names them) or functions\' ("Class.method" for a '
                             "method), to check them again after a new test")
    parser.add_argument("--fail_under", type=float, default=None,
                        help=f"exit 1 when a module scores below this percentage (the goal: {GOAL:g})")
    args = parser.parse_args(argv)
    unknown = [m for m in args.modules if m not in TARGETS]
    if unknown:
        parser.error(f"no tests are mapped for {', '.join(unknown)}; known: {', '.join(TARGETS)}")
    missing = sorted({t for m in args.modules or TARGETS for t in TARGETS[m].tests if not (ROOT / t).is_file()})
    if missing:
        parser.error(f"TARGETS maps test files that do not exist: {', '.join(missing)}")
    try:
        import mutmut  # noqa: F401
    except ImportError:
        parser.error("mutmut is not installed: `make mutate` installs it (pip install -r requirements-mutate.txt)")
    if args.only and len(args.modules) != 1:
        parser.error("--only needs exactly one module")
    scores = [mutate(m, TARGETS[m], args.jobs, args.keep, tuple(args.only)) for m in args.modules or TARGETS]
    print(f"\n{'module':<36} {'mutants':>7} {'killed':>6} {'survived':>8} {'timeout':>7} {'equiv':>5} "
          f"{'score':>6} {'minutes':>7}")
    for s in scores:
        print(f"{s.module:<36} {s.mutants:>7} {s.killed:>6} {s.survived:>8} {s.timed_out:>7} {s.equivalent:>5} "
              f"{s.percent:>5.1f}% {s.seconds / 60:>7.1f}")
    below = [s.module for s in scores if args.fail_under is not None and s.percent < args.fail_under]
    if below:
        print(f"below {args.fail_under:g}%: {', '.join(below)}", file=sys.stderr)
    return 1 if below else 0


if __name__ == "__main__":
    sys.exit(main())
