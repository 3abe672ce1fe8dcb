"""`python -m dataset.inspect`: the batches training would see, decoded back to text.

    python -m dataset.inspect --data_path dataset/demo/sft_demo.jsonl --kind sft --max_seq_len 256
    python -m dataset.inspect --data_path dataset/demo/pretrain_demo.jsonl --batch_size 2 --positions 16

Each sample is shown as text with the tokens that carry loss inside ⟦ ⟧ (for SFT: the assistant answers and
their <|im_end|>, nothing else), then the positions where the loss begins as `input → label`, then a check
that every label is the next input token. These are the two bugs a from-scratch pipeline most often has:
loss on the wrong tokens, and labels not shifted (or shifted twice). The data flags are the trainers' (one
DataConfig), so what is shown comes from the same cache, in the same seeded order, as the first steps of
training.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from common.config import option, parse_config
from common.errors import PocketLMError
from common.tokens import IGNORE_INDEX

from .config import CacheConfig, CacheTarget, training_data
from .kinds import CONVERSATIONS
from .tokenizer import DEFAULT_TOKENIZER_DIR, Tokenizer

OPEN, CLOSE = "⟦", "⟧"


@dataclass
class InspectTarget(CacheTarget):
    """Which batches to show: the cache's kind and context, plus the batch and the order."""

    title: ClassVar[str] = "what to show"
    # the context also cuts the pretraining windows shown, not only the SFT cache
    max_seq_len: int = option(512, "the training context (SFT caches depend on it)", at_least=1)
    batch_size: int = option(2, "samples shown: the first batch of this size in the training order", at_least=1)
    seed: int = option(42, "the training --seed (it orders the samples)")
    positions: int = option(12, "positions listed as input → label per sample, from just before the first "
                                "one with loss", at_least=1)


@dataclass
class InspectConfig(CacheConfig):
    """`python -m dataset.inspect`'s settings: those of `python -m dataset.cache`, and which batch to show."""

    target: InspectTarget


def marked_text(tok: Tokenizer, inputs: list[int], labels: list[int]) -> str:
    """The sample as text, the tokens that are predicted with loss wrapped in ⟦ ⟧.

    Token j of the sequence (the inputs, then the last label) carries loss when labels[j - 1] is not ignored.
    Runs are decoded whole, so a character spread over several byte-level tokens stays intact.
    """
    sequence = inputs + ([labels[-1]] if labels[-1] != IGNORE_INDEX else [])
    carries = [False] + [label != IGNORE_INDEX for label in labels]
    pieces, start = [], 0
    for j in range(1, len(sequence) + 1):
        if j == len(sequence) or carries[j] != carries[start]:
            text = tok.decode(sequence[start:j])
            pieces.append(f"{OPEN}{text}{CLOSE}" if carries[start] else text)
            start = j
    return "".join(pieces)


def shift_problems(inputs: list[int], labels: list[int]) -> list[int]:
    """Positions whose label is not the next input token (labels must be the inputs shifted by one)."""
    return [t for t in range(len(inputs) - 1) if labels[t] != IGNORE_INDEX and labels[t] != inputs[t + 1]]


def show(tok: Tokenizer, x: torch.Tensor, y: torch.Tensor, positions: int, pad_id: int | None) -> str:
    """The report for one batch."""
    lines = []
    for i, (row_x, row_y) in enumerate(zip(x.tolist(), y.tolist())):
        if pad_id is not None:  # drop right padding (SFT batches), which never carries loss
            while len(row_x) > 1 and row_x[-1] == pad_id and row_y[-1] == IGNORE_INDEX:
                row_x, row_y = row_x[:-1], row_y[:-1]
        n_loss = sum(label != IGNORE_INDEX for label in row_y)
        lines.append(f"== sample {i + 1}/{len(x)}: {len(row_x)} input tokens, {n_loss} carry loss "
                     f"({OPEN} {CLOSE} below) ==")
        lines.append(marked_text(tok, row_x, row_y))
        # the positions around the first target: where context ends and the loss begins
        first = next((t for t, label in enumerate(row_y) if label != IGNORE_INDEX), 0)
        start = max(0, first - 2)
        end = min(len(row_x), start + positions)
        lines.append(f"-- positions {start}..{end - 1}: input → label (- = no loss)")
        for t in range(start, end):
            label = "-" if row_y[t] == IGNORE_INDEX else repr(tok.decode([row_y[t]]))
            lines.append(f"{t:5d}  {tok.decode([row_x[t]])!r:>18} → {label}")
        bad = shift_problems(row_x, row_y)
        lines.append("-- labels are the inputs shifted by one: ok" if not bad else
                     f"-- BUG: at positions {bad[:10]} the label is not the next input token")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_config(InspectConfig, argv, __doc__)
        d, t = config.data, config.target
        tok = Tokenizer(d.tokenizer or DEFAULT_TOKENIZER_DIR)
        dataset = training_data(d, tok, t.kind, t.max_seq_len, t.batch_size, t.seed,
                                log=lambda m: print(m, file=sys.stderr)).train
        x, y = dataset.batch(np.asarray(dataset.global_indices(0, t.batch_size)))
    except PocketLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(show(tok, x, y, t.positions, tok.pad_id if t.kind == CONVERSATIONS else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
