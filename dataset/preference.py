"""DPO preference pairs over a token cache: chosen and rejected rows in one batch, with reference log-probs.

The interface of dataset/datasets.py (len, num_examples, global_indices, input_tokens), except that
    ds.batch(indices)  (x, y, ref): x and y are (2B, T) LongTensors, rows 0..B-1 the chosen sequences and rows
                       B..2B-1 the rejected ones in the same pair order; y holds -100 everywhere but the final
                       answer's tokens; ref (2B,) float32 is the reference model's summed log-probability of
                       each row's labelled tokens, in the same row order.
The reference comes from the trainer, once, before training: it walks every pair in index order with
`all_pairs_batches` (which needs no reference), scores the rows with the frozen model, and hands the
(num_examples, 2) [chosen, rejected] array to `set_reference`.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from common.tokens import IGNORE_INDEX

from .datasets import GlobalOrder, length_grouped_order, whole_batches
from .jsonl import DataError
from .kinds import PAIRS
from .token_cache import TokenCache


class PreferenceDataset(GlobalOrder):
    """Tokenized preference pairs (shared prompt, chosen answer, rejected answer), batched by similar length.

    The epoch order is SFTDataset's: seeded, length-grouped by each pair's longer row, whole batches only.
    """

    def __init__(self, cache: TokenCache, split: str = "train", batch_size: int = 8, seed: int = 0,
                 pad_id: int = 0, group_size: int = 64) -> None:
        super().__init__(seed)
        if cache.meta.get("kind") != PAIRS:
            raise DataError(f"{cache.path}: a {cache.meta.get('kind')!r} cache, not preference pairs (kind {PAIRS!r})")
        self.tokens, self.flags = cache.tokens(split), cache.labels(split)
        self.offsets = np.asarray(cache.offsets(split), dtype=np.int64)
        self.segments = np.asarray(cache.segments(split), dtype=np.int64)  # (pairs, 3): prompt, chosen, rejected
        if len(self.segments) == 0:
            raise DataError(f"{cache.meta['source']['path']}: the {split} split has no preference pairs")
        prompt, chosen, rejected = self.segments.T
        self.row_lengths = np.stack([prompt + chosen, prompt + rejected], axis=1)  # (pairs, 2) tokens per row
        self.lengths = self.row_lengths.max(axis=1)  # what a pair's rows pad to: the grouping key
        self.batch_size, self.pad_id, self.group_size = batch_size, pad_id, group_size
        self.reference: np.ndarray | None = None
        self.cache_path, self.split = cache.path, split  # where the trainer caches the reference log-probs

    @property
    def num_examples(self) -> int:
        return len(self.segments)

    def __len__(self) -> int:
        return whole_batches(self.num_examples, self.batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        return length_grouped_order(np.random.default_rng([self.seed, epoch]), self.lengths, self.batch_size,
                                    self.group_size, len(self))

    def input_tokens(self, indices: np.ndarray) -> int:
        """Non-padding input positions of batch(indices): each of the 2B rows but its last token."""
        return int((self.row_lengths[np.asarray(indices, dtype=np.int64)] - 1).sum())

    def rows(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of shape (2B, T): chosen rows, then rejected rows, right-padded with pad_id; y is x shifted by
        one, IGNORE_INDEX except on the final answer's content and <|im_end|>."""
        indices = np.asarray(indices, dtype=np.int64)
        b = len(indices)
        width = int(self.row_lengths[indices].max()) - 1
        x = np.full((2 * b, width), self.pad_id, dtype=np.int64)
        y = np.full((2 * b, width), IGNORE_INDEX, dtype=np.int64)
        for row, i in enumerate(indices):
            start = self.offsets[i]
            prompt, chosen, rejected = self.segments[i]
            answers = ((start + prompt, chosen), (start + prompt + chosen, rejected))
            for side, (a, n) in enumerate(answers):
                span = np.r_[start:start + prompt, a:a + n]  # the shared prompt, then this side's answer
                ids, labelled = self.tokens[span].astype(np.int64), self.flags[span]
                r = row + side * b
                x[r, :len(span) - 1] = ids[:-1]
                y[r, :len(span) - 1] = np.where(labelled[1:] == 1, ids[1:], IGNORE_INDEX)
        return torch.from_numpy(x), torch.from_numpy(y)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, y, ref): rows(indices) and the reference log-probs of those rows, chosen then rejected."""
        if self.reference is None:
            raise DataError("PreferenceDataset.batch needs the reference model's log-probabilities: compute them "
                            "over all_pairs_batches() and call set_reference() first")
        indices = np.asarray(indices, dtype=np.int64)
        x, y = self.rows(indices)
        ref = torch.from_numpy(np.concatenate([self.reference[indices, 0], self.reference[indices, 1]]))
        return x, y, ref

    def all_pairs_batches(self, batch_size: int) -> Iterator[tuple[np.ndarray, torch.Tensor, torch.Tensor]]:
        """(indices, x, y) covering every pair once, for computing the reference (x, y as in rows()). Pairs of
        similar length go together, shortest first, so the one-off pass pads little."""
        order = np.argsort(self.lengths, kind="stable")
        for start in range(0, self.num_examples, batch_size):
            indices = order[start:start + batch_size]
            yield (indices, *self.rows(indices))

    def set_reference(self, values: np.ndarray) -> None:
        """The reference model's summed log-probs of every pair's labelled tokens: (num_examples, 2) [chosen,
        rejected], row i for pair i (the index order of all_pairs_batches)."""
        values = np.asarray(values, dtype=np.float32)
        if values.shape != (self.num_examples, 2):
            raise DataError(f"reference log-probs: expected shape ({self.num_examples}, 2) [chosen, rejected], "
                            f"got {values.shape}")
        if not np.isfinite(values).all():
            raise DataError(f"reference log-probs: {int((~np.isfinite(values)).sum())} values are not finite")
        self.reference = values.copy()
