"""Scoring benchmark items: continuations by log-likelihood (ranked choices, bits per byte), and answers by
generation (greedy, judged by common/answers.py).

Tokenization follows lm-evaluation-harness, so per-item log-likelihoods can be compared with it: trailing
spaces of the context move to the continuation, the pair is encoded whole, and the continuation's tokens are
those past the context's own encoding (so a merge across the boundary is the continuation's); an empty context
is the end-of-text token. Pairs are scored in batches of similar length, right-padded (causal attention: a
real token never sees the padding after it), the context cut from the left to fit the model's positions; the
vocabulary projection and the log-softmax run only at the positions that predict a continuation token.

Generation follows the harness's generate_until: the context encoded alone and cut from the left to leave room
for the new tokens, greedy decoding until the end-of-text token, a stop string or the item's budget (at most half
the model's positions), the text decoded without special tokens and cut before its first stop string. Items are
generated in left-padded batches of equal budget. A chat item (messages) is prompted through the chat template
and also ends at the end-of-turn token.

Nothing here imports dataset/: the tokenizer (encode, decode, end-of-text id) is passed in.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

import torch
import torch.nn.functional as F

from common.answers import judge
from model.generate import StopStrings, cut_at_stop, generate
from model.model import shared_context_mask

Encode = Callable[[str], list[int]]
Autocast = Callable[[], contextlib.AbstractContextManager]


class Codec(Protocol):
    """What scoring needs of a tokenizer (dataset/tokenizer.py Tokenizer)."""

    eot_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> list[int]: ...

    def stop_ids(self, chat: bool) -> list[int]: ...


def encode_pair(encode: Encode, context: str, continuation: str, eot_id: int) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-evaluation-harness splits them."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:
        return [eot_id], encode(continuation)
    whole, head = encode(context + continuation), encode(context)
    return head, whole[len(head):]


@dataclass(frozen=True)
class ContinuationScore:
    """A continuation's summed log-probability (nats), its token count, and whether greedy decoding from the
    context would produce exactly it."""

    logprob: float
    tokens: int
    greedy: bool


@torch.no_grad()
def score_pairs(model: torch.nn.Module, pairs: Sequence[tuple[list[int], list[int]]], batch_size: int = 16,
                autocast: Autocast = contextlib.nullcontext,
                pad_id: int = 0) -> list[ContinuationScore]:
    """Each (context ids, continuation ids) pair's score, in the order given. Longest first in batches (fewer
    pads; an out-of-memory shows on the first batch)."""
    max_len = model.config.max_position_embeddings
    device = next(model.parameters()).device
    order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
    was_training = model.training
    model.eval()
    scores: list[ContinuationScore | None] = [None] * len(pairs)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        rows = []
        for i in chunk:
            context, continuation = pairs[i]
            if not continuation:
                raise ValueError(f"pair {i}: the continuation encodes to no tokens")
            if len(continuation) > max_len:
                raise ValueError(f"pair {i}: a {len(continuation)}-token continuation exceeds the model's "
                                 f"{max_len} positions")
            ids = (context + continuation)[-(max_len + 1):]  # inputs are all but the last token
            rows.append((ids, len(continuation)))
        width = max(len(ids) - 1 for ids, _ in rows)
        x = torch.full((len(rows), width), pad_id, dtype=torch.long)
        wanted = torch.zeros((len(rows), width), dtype=torch.bool)  # the rows that predict a continuation token
        targets = []
        for r, (ids, n) in enumerate(rows):
            end = len(ids) - 1  # predictions of positions end-n .. end-1 are the continuation's tokens
            x[r, :end] = torch.tensor(ids[:-1])
            wanted[r, end - n:end] = True
            targets += ids[-n:]
        with autocast():
            logits = model(x.to(device), logits_at=wanted.to(device))  # (sum of n, vocab), row by row
        for i, score in zip(chunk, _scores(logits, None, targets, [n for _, n in rows])):
            scores[i] = score
    model.train(was_training)
    return scores  # type: ignore[return-value]


def _scores(logits: torch.Tensor, rows: torch.Tensor | None, targets: list[int], counts: list[int]
            ) -> list[ContinuationScore]:
    """Continuation scores from `logits` (N, vocab): rows[i] (or row i, when rows is None) predicts targets[i];
    the first counts[0] targets are the first continuation's, and so on. A continuation is greedy when each of
    its tokens has its row's highest log-probability."""
    logprobs = F.log_softmax(logits.float(), dim=-1)
    rows = torch.arange(len(targets), device=logits.device) if rows is None else rows
    targets_t = torch.tensor(targets, device=logits.device)
    picked = logprobs[rows, targets_t]
    hits = picked == logprobs.amax(-1)[rows]
    return [ContinuationScore(float(lp.sum()), n, bool(hit.all()))
            for n, lp, hit in zip(counts, picked.split(counts), hits.split(counts))]


@torch.no_grad()
def score_groups(model: torch.nn.Module, groups: Sequence[tuple[list[int], list[list[int]]]], batch_size: int = 16,
                 autocast: Autocast = contextlib.nullcontext, pad_id: int = 0) -> list[list[ContinuationScore]]:
    """Each group's continuations scored after its shared context (an item's choices), with the context's tokens
    computed once instead of once per choice: what score_pairs gives for each (context, continuation) pair.

    A group is one row: its context, then each continuation's input tokens (all but its last), under a mask in
    which the context is causal and each continuation sees the context and its own earlier tokens, never another
    continuation; its positions go on from the context's end. The context's last position predicts every
    continuation's first token. Rows are right-padded in batches of similar length. Groups of one continuation,
    and groups whose context would have to be cut to fit the model's positions (the cut depends on the
    continuation), are scored by score_pairs. `batch_size` counts continuations.
    """
    max_len = model.config.max_position_embeddings
    out: list[list[ContinuationScore]] = [[] for _ in groups]
    shared, single = [], []
    for g, (context, continuations) in enumerate(groups):
        if not context or not continuations or not all(continuations):
            raise ValueError(f"group {g}: needs a context and continuations of at least one token each")
        row = len(context) + sum(len(c) - 1 for c in continuations)
        # a row's attention grows with the square of its length: many long choices go pair by pair
        fits = len(context) + max(map(len, continuations)) - 1 <= max_len and row <= 4 * max_len
        (shared if fits and len(continuations) > 1 else single).append(g)
    pairs = [(groups[g][0], c) for g in single for c in groups[g][1]]
    scores = iter(score_pairs(model, pairs, batch_size, autocast, pad_id))
    for g in single:
        out[g] = [next(scores) for _ in groups[g][1]]

    width = [len(groups[g][0]) + sum(len(c) - 1 for c in groups[g][1]) for g in range(len(groups))]
    shared.sort(key=lambda g: -width[g])  # rows of similar length together: few pads
    was_training = model.training
    model.eval()
    start = 0
    while start < len(shared):
        chunk, rows = [], 0  # whole groups, as many as keep the continuations within batch_size (one at least)
        while start < len(shared) and (not chunk or rows + len(groups[shared[start]][1]) <= batch_size):
            chunk.append(shared[start])
            rows += len(groups[shared[start]][1])
            start += 1
        for g, group_scores in zip(chunk, _score_rows(model, [groups[g] for g in chunk], autocast, pad_id)):
            out[g] = group_scores
    model.train(was_training)
    return out


def _score_rows(model: torch.nn.Module, groups: Sequence[tuple[list[int], list[list[int]]]], autocast: Autocast,
                pad_id: int) -> list[list[ContinuationScore]]:
    """One batch of score_groups: a row per group, one forward."""
    device = next(model.parameters()).device
    L = max(len(context) + sum(len(c) - 1 for c in cs) for context, cs in groups)
    x = torch.full((len(groups), L), pad_id, dtype=torch.long)
    positions = torch.zeros((len(groups), L), dtype=torch.long)
    segment = torch.full((len(groups), L), -1, dtype=torch.long)  # 0: the context, j: continuation j, -1: pad
    wanted = torch.zeros((len(groups), L), dtype=torch.bool)  # the positions whose predictions are scored
    picks: list[int] = []  # the flat position (row * L + column) of each scored prediction, in target order
    targets: list[int] = []
    for r, (context, continuations) in enumerate(groups):
        n = len(context)
        x[r, :n], positions[r, :n], segment[r, :n] = torch.tensor(context), torch.arange(n), 0
        wanted[r, n - 1] = True
        at = n
        for j, c in enumerate(continuations, start=1):
            m = len(c) - 1
            x[r, at:at + m], positions[r, at:at + m], segment[r, at:at + m] = torch.tensor(c[:-1]), \
                torch.arange(n, n + m), j
            wanted[r, at:at + m] = True
            picks += [r * L + n - 1, *range(r * L + at, r * L + at + m)]
            targets += c
            at += m
    with autocast():
        logits = model(x.to(device), position_ids=positions.to(device),
                       attention_mask=shared_context_mask(segment).to(device),
                       logits_at=wanted.to(device))  # (wanted positions, vocab), row-major
    index = wanted.flatten().cumsum(0) - 1  # a wanted position's row in `logits`
    rows = index[torch.tensor(picks)].to(device)
    scores = iter(_scores(logits, rows, targets, [len(c) for _, cs in groups for c in cs]))
    return [[next(scores) for _ in cs] for _, cs in groups]


@dataclass(frozen=True)
class ChoiceResult:
    """One ranked-choice item scored: the choice picked by total log-likelihood (acc) and by log-likelihood per
    character of the choice (acc_norm, lm-evaluation-harness's normalisation: the characters of the choice
    without the space that joins it to the context), and the gold one's index."""

    pick: int
    pick_norm: int
    gold: int


def rank_choices(scores: Sequence[ContinuationScore], choices: Sequence[str], gold: int) -> ChoiceResult:
    """The picks among one item's choices (ties: the first)."""
    logps = [s.logprob for s in scores]
    per_char = [lp / max(len(c.removeprefix(" ")), 1) for lp, c in zip(logps, choices)]
    return ChoiceResult(max(range(len(logps)), key=logps.__getitem__),
                        max(range(len(per_char)), key=per_char.__getitem__), gold)


class Item(Protocol):
    """What a ranked-choice or bits-per-byte item offers (dataset/tasks.py TaskItem): the scorer does not import
    the data layer."""

    pairs: tuple[tuple[str, str], ...]  # (context, continuation) of each choice
    gold: int


class GenerationItem(Protocol):
    """What a generation item offers (dataset/tasks.py GenerationItem)."""

    id: str
    context: str
    answers: tuple[str, ...]
    stop: tuple[str, ...]
    max_new_tokens: int
    messages: tuple[tuple[str, str], ...]  # a chat prompt instead of the context, when not empty


@dataclass(frozen=True)
class TaskScore:
    """A task's result: its size, and accuracy (ranked choices: acc, acc_norm, the chance of guessing and the
    chance-centred accuracy (acc - chance) / (1 - chance), 0 for guessing and 1 for all right; generation: acc,
    the exact-match rate, and `stated`, the share of outputs that stated a numeric answer in the taught format;
    tool use: acc, the answers reached with tools, and the call_* and bare_acc shares) or bits per byte."""

    name: str
    items: int
    acc: float | None = None
    acc_norm: float | None = None
    chance: float | None = None
    bpb: float | None = None
    stated: float | None = None
    call_valid: float | None = None  # tool items: the share of first replies with well-formed calls only,
    call_tool: float | None = None  # ... naming the right tool,
    call_acc: float | None = None  # ... with the right arguments;
    bare_acc: float | None = None  # and the answer accuracy without tools (acc: with them)
    samples: tuple[dict, ...] = ()  # a generation task's items: id, output, the answer read, correct

    @property
    def centred(self) -> float | None:
        if self.acc is None or self.chance is None or self.chance >= 1:
            return None
        return (self.acc - self.chance) / (1 - self.chance)


@dataclass(frozen=True)
class TaskTotals:
    """A task's sums over some of its items (one rank's share): what ranks add up before a TaskScore is made.
    kind: "choice" (counts of right picks), "bpb" (nats and bytes of the continuations), "generate" (counts of
    right and of stated answers) or "tools" (counts of right answers and of valid, right-tool and right calls,
    and of right answers without tools)."""

    kind: str
    items: int = 0
    correct: int = 0
    correct_norm: int = 0
    chance: float = 0.0  # summed 1 / choices
    nats: float = 0.0
    bytes: int = 0
    stated: int = 0
    valid: int = 0
    right_tool: int = 0
    right_call: int = 0
    bare: int = 0
    samples: tuple[dict, ...] = ()  # not summed across ranks: eval_model.py writes them, one process

    def as_list(self) -> list[float]:
        return [float(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name not in ("kind", "samples")]

    @classmethod
    def from_list(cls, kind: str, values: Sequence[float]) -> TaskTotals:
        names = [f for f in dataclasses.fields(cls) if f.name not in ("kind", "samples")]
        return cls(kind, **{f.name: v if f.type == "float" else round(v) for f, v in zip(names, values)})

    def score(self, name: str) -> TaskScore:
        n = self.items
        if self.kind == "bpb":
            return TaskScore(name, n, bpb=self.nats / math.log(2) / self.bytes if self.bytes else None)
        if n == 0:
            return TaskScore(name, 0)
        if self.kind == "generate":
            return TaskScore(name, n, acc=self.correct / n, stated=self.stated / n, samples=self.samples)
        if self.kind == "tools":
            return TaskScore(name, n, acc=self.correct / n, call_valid=self.valid / n, call_tool=self.right_tool / n,
                             call_acc=self.right_call / n, bare_acc=self.bare / n, samples=self.samples)
        return TaskScore(name, n, acc=self.correct / n, acc_norm=self.correct_norm / n, chance=self.chance / n)


def task_totals(model: torch.nn.Module, kind: str, items: Sequence[Item] | Sequence[GenerationItem], tok: Codec,
                batch_size: int = 16, autocast: Autocast = contextlib.nullcontext) -> TaskTotals:
    """Score a task's items (all of one `kind`: "choice", "bpb", "generate" or "tools"; possibly none, e.g. a
    rank's share) into their sums."""
    if kind == "tools":
        from .tool_use import judge_tool_items  # it builds on this module's generation
        verdicts, samples = judge_tool_items(model, items, tok, batch_size, autocast)  # type: ignore[arg-type]
        return TaskTotals(kind, len(items), correct=sum(v.correct for v in verdicts),
                          valid=sum(v.valid for v in verdicts), right_tool=sum(v.right_tool for v in verdicts),
                          right_call=sum(v.right_call for v in verdicts), bare=sum(v.bare for v in verdicts),
                          samples=tuple(samples))
    if kind == "generate":
        outputs = generate_outputs(model, items, tok, batch_size, autocast)  # type: ignore[arg-type]
        verdicts = [judge(output, item.answers) for output, item in zip(outputs, items)]  # type: ignore[union-attr]
        samples = tuple({"id": item.id, **({"kind": item.kind} if item.kind else {}), "output": output,
                         "answer": v.answer, "correct": v.correct}
                        for item, output, v in zip(items, outputs, verdicts))  # type: ignore[union-attr]
        return TaskTotals(kind, len(items), correct=sum(v.correct for v in verdicts),
                          stated=sum(v.stated for v in verdicts), samples=samples)
    groups: list[tuple[list[int], list[list[int]]]] = []  # the continuations after one encoded context
    owner = []  # the item of each group (WinoGrande's choices differ in their context: a group each)
    for k, item in enumerate(items):
        for context, continuation in item.pairs:  # type: ignore[union-attr]
            head, tail = encode_pair(tok.encode, context, continuation, tok.eot_id)
            if owner and owner[-1] == k and groups[-1][0] == head:
                groups[-1][1].append(tail)
            else:
                groups.append((head, [tail]))
                owner.append(k)
    scores = [s for group in score_groups(model, groups, batch_size, autocast, pad_id=tok.eot_id) for s in group]
    owner = [k for k, (_, tails) in zip(owner, groups) for _ in tails]
    if kind == "bpb":
        return TaskTotals(kind, len(items), nats=-sum(s.logprob for s in scores),
                          bytes=sum(len(item.pairs[0][1].encode("utf-8")) for item in items))  # type: ignore
    per_item: list[list[ContinuationScore]] = [[] for _ in items]
    for k, score in zip(owner, scores):
        per_item[k].append(score)
    results = [rank_choices(s, [c for _, c in item.pairs], item.gold) for s, item in zip(per_item, items)]
    return TaskTotals(kind, len(results), sum(r.pick == r.gold for r in results),
                      sum(r.pick_norm == r.gold for r in results), sum(1 / len(item.pairs) for item in items))


@torch.no_grad()
def generate_outputs(model: torch.nn.Module, items: Sequence[GenerationItem], tok: Codec, batch_size: int = 16,
                     autocast: Autocast = contextlib.nullcontext) -> list[str]:
    """Each item's greedy output, in the order given, as the module docstring says it is made."""
    max_len = model.config.max_position_embeddings
    prompts = []
    for item in items:
        budget = min(item.max_new_tokens, max_len // 2)
        if item.messages:
            ids = tok.chat_prompt([{"role": role, "content": content} for role, content in item.messages])
        else:
            ids = tok.encode(item.context) or [tok.eot_id]
        prompts.append((ids[-(max_len - budget):], budget, bool(item.messages)))
    # equal budgets (and prompt kinds) together, longest first within them (fewer pads; an out-of-memory shows on
    # the first batch)
    order = sorted(range(len(items)), key=lambda i: (prompts[i][1], prompts[i][2], -len(prompts[i][0])))
    outputs: list[str] = [""] * len(items)
    start = 0
    while start < len(order):
        _, budget, chat = prompts[order[start]]
        chunk = [i for i in order[start:start + batch_size] if prompts[i][1:] == (budget, chat)]
        start += len(chunk)
        with autocast():
            new = generate(model, [prompts[i][0] for i in chunk], budget, temperature=0.0,
                           eos_token_ids=tok.stop_ids(chat), pad_token_id=tok.eot_id,
                           stop=StopStrings(tok.decode, [items[i].stop for i in chunk]))
        for i, ids in zip(chunk, new):
            outputs[i] = cut_at_stop(tok.decode(ids, skip_special_tokens=True), items[i].stop)
    return outputs


def score_items(model: torch.nn.Module, name: str, kind: str, items: Sequence[Item] | Sequence[GenerationItem],
                tok: Codec, batch_size: int = 16, autocast: Autocast = contextlib.nullcontext) -> TaskScore:
    """A task's score over `items`."""
    return task_totals(model, kind, items, tok, batch_size, autocast).score(name)


def centred_average(scores: Sequence[TaskScore]) -> float | None:
    """The chance-centred accuracy averaged over the ranked-choice tasks (None without any)."""
    centred = [s.centred for s in scores if s.centred is not None]
    return sum(centred) / len(centred) if centred else None


def by_kind(score: TaskScore) -> dict[str, tuple[int, int]]:
    """A generation or tool task's (right, items) per kind of item (its task file's "kind" labels), in order of
    first appearance; empty when its items have no kinds."""
    counts: dict[str, list[int]] = {}
    for sample in score.samples:
        if "kind" in sample:
            count = counts.setdefault(sample["kind"], [0, 0])
            count[0] += bool(sample["correct"])
            count[1] += 1
    return {kind: (right, n) for kind, (right, n) in counts.items()}


def kind_table(scores: Sequence[TaskScore]) -> str:
    """Each labelled generation or tool task's accuracy by kind, as a Markdown table ("" when no task has
    kinds)."""
    rows = [f"| {s.name} | {kind} | {n} | {right / n:.4f} |"
            for s in scores for kind, (right, n) in sorted(by_kind(s).items())]
    return "\n".join(["| task | kind | items | acc |", "|---|---|--:|--:|", *rows]) if rows else ""


def task_table(scores: Sequence[TaskScore]) -> str:
    """The scores as a Markdown table (a `stated` column when a generation task is among them, the tool-call
    columns when a tool task is), with the chance-centred average of the ranked-choice tasks."""
    def cell(value: float | None) -> str:
        return "" if value is None else f"{value:.4f}"
    columns = ["acc", "acc_norm", "chance", "centred", "bpb"]
    columns += [c for c in ("stated", "call_valid", "call_tool", "call_acc", "bare_acc")
                if any(getattr(s, c) is not None for s in scores)]
    heads = {"bpb": "bits/byte", "call_valid": "valid call", "call_tool": "right tool", "call_acc": "right call",
             "bare_acc": "acc without tools"}
    rows = ["| task | items | " + " | ".join(heads.get(c, c) for c in columns) + " |",
            "|---|--:|" + "--:|" * len(columns)]
    rows += [f"| {s.name} | {s.items} | " + " | ".join(cell(getattr(s, c)) for c in columns) + " |" for s in scores]
    average = centred_average(scores)
    if average is not None:
        n = sum(s.centred is not None for s in scores)
        rows.append(f"\ncentred accuracy, averaged over {n} ranked-choice tasks: {average:.4f} (0: guessing, "
                    "1: all right)")
    return "\n".join(rows)


def write_scores(path: str | Path, scores: Sequence[TaskScore], **extra: object) -> None:
    """The scores as strict JSON: `extra` (e.g. the checkpoint), each task's (a generation task's outputs
    too, and its accuracy by kind), and the centred average."""
    def task_doc(s: TaskScore) -> dict[str, object]:
        kinds = {k: {"items": n, "acc": r / n} for k, (r, n) in by_kind(s).items()}
        return {**dataclasses.asdict(s), "centred": s.centred, **({"by_kind": kinds} if kinds else {})}
    doc = {**extra, "tasks": [task_doc(s) for s in scores], "centred_average": centred_average(scores)}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n", encoding="utf-8")
