"""Scoring continuations by log-likelihood: the engine of benchmark tasks (ranked choices, bits per byte).

Tokenization follows lm-evaluation-harness, so per-item log-likelihoods can be compared with it: trailing
spaces of the context move to the continuation, the pair is encoded whole, and the continuation's tokens are
those past the context's own encoding (so a merge across the boundary is the continuation's); an empty context
is the end-of-text token. Pairs are scored in batches of similar length, right-padded (causal attention: a
real token never sees the padding after it), the context cut from the left to fit the model's positions.

Nothing here imports dataset/: the tokenizer's encode function and end-of-text id are passed in.
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

Encode = Callable[[str], list[int]]


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
                autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
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
        for r, (ids, _) in enumerate(rows):
            x[r, :len(ids) - 1] = torch.tensor(ids[:-1])
        with autocast():
            logits = model(x.to(device))
        for r, (i, (ids, n)) in enumerate(zip(chunk, rows)):
            end = len(ids) - 1  # predictions of positions end-n .. end-1 are the continuation's tokens
            targets = torch.tensor(ids[-n:], device=device)
            row = F.log_softmax(logits[r, end - n:end].float(), dim=-1)  # the continuation's rows only
            picked = row.gather(1, targets[:, None])[:, 0]
            scores[i] = ContinuationScore(float(picked.sum()), n, bool((row.argmax(-1) == targets).all()))
    model.train(was_training)
    return scores  # type: ignore[return-value]


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
    """What a task item offers (dataset/tasks.py TaskItem): the scorer does not import the data layer."""

    pairs: tuple[tuple[str, str], ...]  # (context, continuation) of each choice
    gold: int


@dataclass(frozen=True)
class TaskScore:
    """A task's result: its size, and accuracy (ranked choices: acc, acc_norm, the chance of guessing and the
    chance-centred accuracy (acc - chance) / (1 - chance), 0 for guessing and 1 for all right) or bits per byte."""

    name: str
    items: int
    acc: float | None = None
    acc_norm: float | None = None
    chance: float | None = None
    bpb: float | None = None

    @property
    def centred(self) -> float | None:
        if self.acc is None or self.chance is None or self.chance >= 1:
            return None
        return (self.acc - self.chance) / (1 - self.chance)


@dataclass(frozen=True)
class TaskTotals:
    """A task's sums over some of its items (one rank's share): what ranks add up before a TaskScore is made.
    kind: "choice" (counts of right picks) or "bpb" (nats and bytes of the continuations)."""

    kind: str
    items: int = 0
    correct: int = 0
    correct_norm: int = 0
    chance: float = 0.0  # summed 1 / choices
    nats: float = 0.0
    bytes: int = 0

    def as_list(self) -> list[float]:
        return [self.items, self.correct, self.correct_norm, self.chance, self.nats, self.bytes]

    @classmethod
    def from_list(cls, kind: str, values: Sequence[float]) -> TaskTotals:
        items, correct, correct_norm, chance, nats, n_bytes = values
        return cls(kind, round(items), round(correct), round(correct_norm), chance, nats, round(n_bytes))

    def score(self, name: str) -> TaskScore:
        n = self.items
        if self.kind == "bpb":
            return TaskScore(name, n, bpb=self.nats / math.log(2) / self.bytes if self.bytes else None)
        if n == 0:
            return TaskScore(name, 0)
        return TaskScore(name, n, acc=self.correct / n, acc_norm=self.correct_norm / n, chance=self.chance / n)


def task_totals(model: torch.nn.Module, items: Sequence[Item], encode: Encode, eot_id: int, batch_size: int = 16,
                autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                kind: str | None = None) -> TaskTotals:
    """Score items (every continuation of every item in one batched pass) into their sums. `kind` is the
    task's (needed when `items` may be empty, e.g. a rank's share); by default, what the items are."""
    kind = kind or ("bpb" if all(len(item.pairs) == 1 for item in items) else "choice")
    pairs, owner = [], []
    for k, item in enumerate(items):
        for context, continuation in item.pairs:
            pairs.append(encode_pair(encode, context, continuation, eot_id))
            owner.append(k)
    scores = score_pairs(model, pairs, batch_size, autocast, pad_id=eot_id)
    if kind == "bpb":
        return TaskTotals(kind, len(items), nats=-sum(s.logprob for s in scores),
                          bytes=sum(len(item.pairs[0][1].encode("utf-8")) for item in items))
    per_item: list[list[ContinuationScore]] = [[] for _ in items]
    for k, score in zip(owner, scores):
        per_item[k].append(score)
    results = [rank_choices(s, [c for _, c in item.pairs], item.gold) for s, item in zip(per_item, items)]
    return TaskTotals(kind, len(results), sum(r.pick == r.gold for r in results),
                      sum(r.pick_norm == r.gold for r in results), sum(1 / len(item.pairs) for item in items))


def score_items(model: torch.nn.Module, name: str, items: Sequence[Item], encode: Encode, eot_id: int,
                batch_size: int = 16, autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                ) -> TaskScore:
    """A task's score over `items`."""
    return task_totals(model, items, encode, eot_id, batch_size, autocast).score(name)


def centred_average(scores: Sequence[TaskScore]) -> float | None:
    """The chance-centred accuracy averaged over the ranked-choice tasks (None without any)."""
    centred = [s.centred for s in scores if s.centred is not None]
    return sum(centred) / len(centred) if centred else None


def task_table(scores: Sequence[TaskScore]) -> str:
    """The scores as a Markdown table, with the chance-centred average of the ranked-choice tasks."""
    def cell(value: float | None) -> str:
        return "" if value is None else f"{value:.4f}"
    rows = ["| task | items | acc | acc_norm | chance | centred | bits/byte |", "|---|--:|--:|--:|--:|--:|--:|"]
    rows += [f"| {s.name} | {s.items} | {cell(s.acc)} | {cell(s.acc_norm)} | {cell(s.chance)} | {cell(s.centred)} | "
             f"{cell(s.bpb)} |" for s in scores]
    average = centred_average(scores)
    if average is not None:
        n = sum(s.centred is not None for s in scores)
        rows.append(f"\ncentred accuracy, averaged over {n} ranked-choice tasks: {average:.4f} (0: guessing, "
                    "1: all right)")
    return "\n".join(rows)


def write_scores(path: str | Path, scores: Sequence[TaskScore], **extra: object) -> None:
    """The scores as strict JSON: `extra` (e.g. the checkpoint), each task's, and the centred average."""
    doc = {**extra, "tasks": [{**dataclasses.asdict(s), "centred": s.centred} for s in scores],
           "centred_average": centred_average(scores)}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n", encoding="utf-8")
