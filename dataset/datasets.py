"""Training datasets over a token cache: packed pretraining windows and length-grouped SFT conversations.

Both expose the same small interface the training loop needs:
    len(ds)                 samples per epoch
    ds.num_examples         distinct examples (evaluation walks indices 0 .. num_examples-1 in order)
    ds.global_indices(g, n) the samples at global positions g .. g+n-1 of the seeded, epoch-by-epoch order
    ds.batch(indices)       (inputs, targets) LongTensors; targets are -100 where there is nothing to learn
    ds.input_tokens(indices) how many input positions of that batch are not padding (for tokens/s and MFU)
A position g in the global order is world-size independent, so a resume (on any number of ranks) jumps
straight to sample g: each epoch's order is a seeded permutation computed on demand, never replayed.
"""
from __future__ import annotations

import numpy as np
import torch

from common.tokens import IGNORE_INDEX

from .jsonl import DataError
from .token_cache import TokenCache


class GlobalOrder:
    """Maps global sample positions to sample indices, one seeded order per epoch."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._cached: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        raise NotImplementedError

    def epoch_order(self, epoch: int) -> np.ndarray:
        raise NotImplementedError

    def _order(self, epoch: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, self.epoch_order(epoch))
        return self._cached[1]

    def global_indices(self, start: int, count: int) -> np.ndarray:
        """Sample indices at global positions [start, start + count), crossing epoch boundaries as needed."""
        n = len(self)
        out = []
        while count > 0:
            epoch, pos = divmod(start, n)
            take = min(count, n - pos)
            out.append(self._order(epoch)[pos:pos + take])
            start, count = start + take, count - take
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


class PretrainDataset(GlobalOrder):
    """Windows of max_seq_len + 1 tokens over the <|endoftext|>-joined token stream (no padding), each starting
    where the previous one ends: neighbours share exactly one token, the last target of one window being the
    first input of the next, so each token is a target once per epoch."""

    def __init__(self, cache: TokenCache, split: str = "train", max_seq_len: int = 512, seed: int = 0) -> None:
        super().__init__(seed)
        self.tokens = cache.tokens(split)
        self.max_seq_len = max_seq_len
        self.num_samples = max(0, (len(self.tokens) - 1) // max_seq_len)
        if self.num_samples == 0:
            raise DataError(f"{cache.meta['source']['path']}: the {split} split has {len(self.tokens)} tokens, "
                            f"fewer than one window of max_seq_len + 1 = {max_seq_len + 1}")
        self._window = np.arange(max_seq_len + 1)

    def __len__(self) -> int:
        return self.num_samples

    @property
    def num_examples(self) -> int:
        return self.num_samples

    def epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def input_tokens(self, indices: np.ndarray) -> int:
        """Non-padding input positions of batch(indices): windows are never padded."""
        return len(indices) * self.max_seq_len

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        # Window i covers tokens [i*L, i*L + L]: its last token is the next window's first input, so every
        # token of the stream is a target exactly once per epoch.
        rows = self.tokens[np.asarray(indices)[:, None] * self.max_seq_len + self._window]
        rows = torch.from_numpy(rows.astype(np.int64))
        return rows[:, :-1], rows[:, 1:]


def whole_batches(num_examples: int, batch_size: int) -> int:
    """Samples per epoch of a length-grouped dataset: whole batches only, so batch k of the global order always
    starts at a multiple of batch_size (also across epochs); at least one batch."""
    return max(batch_size, num_examples - num_examples % batch_size)


def length_grouped_order(rng: np.random.Generator, lengths: np.ndarray, batch_size: int, group_size: int,
                         count: int) -> np.ndarray:
    """One epoch's order of `count` examples in batches of similar length (see SFTDataset).

    Shuffles the examples, sorts them by length within mega-batches of `group_size` batches, cuts those into
    batches and shuffles the batches.
    """
    order = rng.permutation(len(lengths))
    if len(order) < batch_size:  # fewer examples than one batch: repeat them to fill it
        order = np.resize(order, batch_size)
    order = order[:count]
    mega = batch_size * group_size
    batches = []
    for start in range(0, len(order), mega):
        group = order[start:start + mega]
        group = group[np.argsort(-lengths[group], kind="stable")]
        batches.extend(group[i:i + batch_size] for i in range(0, len(group), batch_size))
    return np.concatenate([batches[i] for i in rng.permutation(len(batches))])


class SFTDataset(GlobalOrder):
    """Tokenized conversations with assistant-only targets, batched by similar length to waste little padding.

    Each epoch shuffles the conversations, sorts them by length within mega-batches of `group_size` batches,
    cuts those into batches and shuffles the batches: consecutive groups of `batch_size` samples in the
    global order have similar lengths, so right-padding each to its longest costs little. Larger groups pad
    less but make batch composition less random.
    """

    def __init__(self, cache: TokenCache, split: str = "train", batch_size: int = 8, seed: int = 0,
                 pad_id: int = 0, group_size: int = 64) -> None:
        super().__init__(seed)
        self.tokens, self.flags = cache.tokens(split), cache.labels(split)
        self.offsets = np.asarray(cache.offsets(split), dtype=np.int64)
        self.lengths = np.diff(self.offsets)
        if len(self.lengths) == 0:
            raise DataError(f"{cache.meta['source']['path']}: the {split} split has no conversations")
        self.batch_size, self.pad_id, self.group_size = batch_size, pad_id, group_size

    @property
    def num_examples(self) -> int:
        return len(self.lengths)

    def __len__(self) -> int:
        # Whole batches only, so batch k of the global order always starts at a multiple of batch_size
        # (also across epochs). The few left-over conversations differ from epoch to epoch.
        return whole_batches(len(self.lengths), self.batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        return length_grouped_order(np.random.default_rng([self.seed, epoch]), self.lengths, self.batch_size,
                                    self.group_size, len(self))

    def input_tokens(self, indices: np.ndarray) -> int:
        """Non-padding input positions of batch(indices): each conversation but its last token."""
        return int((self.lengths[indices] - 1).sum())

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = self.lengths[indices]
        width = int(lengths.max()) - 1
        x = np.full((len(indices), width), self.pad_id, dtype=np.int64)
        y = np.full((len(indices), width), IGNORE_INDEX, dtype=np.int64)
        for row, i in enumerate(indices):
            a, b = self.offsets[i], self.offsets[i + 1]
            ids = self.tokens[a:b].astype(np.int64)
            x[row, : b - a - 1] = ids[:-1]
            y[row, : b - a - 1] = np.where(self.flags[a + 1:b] == 1, ids[1:], IGNORE_INDEX)
        return torch.from_numpy(x), torch.from_numpy(y)

    def padding_fraction(self, epoch: int = 0) -> float:
        """Share of batch positions that are padding when batches are cut from this epoch's order."""
        lengths = self.lengths[self.epoch_order(epoch)] - 1
        padded = real = 0
        for start in range(0, len(lengths), self.batch_size):
            chunk = lengths[start:start + self.batch_size]
            padded += int(chunk.max()) * len(chunk)
            real += int(chunk.sum())
        return 1.0 - real / padded
