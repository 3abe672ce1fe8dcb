"""Several training files drawn by weight into one sample order: `--data_path a.jsonl:0.7 b.jsonl:0.3`.

Each source is a dataset of its own (its own cache, its own seeded epoch-by-epoch order). The mixture decides,
for every global position, which source it comes from, and is random-access like the sources, so a resume
(on any number of ranks) jumps straight to its cursor and DDP ranks read disjoint positions:

    positions are grouped into units (one sample for pretraining; one whole batch for SFT, so batches stay
    length-grouped and single-source), and units into blocks of BLOCK units. Every block holds exactly
    quota_k = round(BLOCK * w_k) units of source k (largest remainders), in a seeded random arrangement
    that differs from block to block. Source k's j-th unit in the mixture is unit j of its own order.

So the proportions are exact over every block (no drift from sampling noise), the draw is deterministic from
the seed, and a source with more weight than data simply starts its next epoch (a new permutation) sooner.
"""
from __future__ import annotations

import numpy as np
import torch

from common.errors import ConfigError
from common.tokens import IGNORE_INDEX

BLOCK = 1000  # units per block: the resolution of the weights (a source needs at least 1/2000 of the mix)
MIX_TAG = 0x6D6978  # "mix": separates this generator's seeds from the sources' own epoch orders


def quotas(weights: list[float], block: int = BLOCK) -> np.ndarray:
    """Units per block for each source: block * weight, rounded by largest remainder to sum to block."""
    w = np.asarray(weights, dtype=np.float64)
    exact = block * w / w.sum()
    counts = np.floor(exact).astype(np.int64)
    short = block - counts.sum()
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


class Mixture:
    """The training datasets of several sources as one (the interface of dataset/datasets.py).

    Indices handed out by global_indices encode (source, index in source) as offset[source] + index, so
    batch() and input_tokens() take them back apart.
    """

    def __init__(self, parts: list, weights: list[float], unit: int, seed: int, names: list[str] | None = None,
                 block: int = BLOCK) -> None:
        self.parts, self.unit, self.seed, self.block = parts, unit, seed, block
        self.names = names or [str(i) for i in range(len(parts))]
        self.weights = [w / sum(weights) for w in weights]
        self.quota = quotas(weights, block)
        if (self.quota == 0).any():
            k = int(np.argmin(self.quota))
            raise ConfigError(f"{self.names[k]}: weight {self.weights[k]:.2g} of the mixture is below its resolution "
                              f"(1/{2 * block}); raise it or leave the file out")
        self.offsets = np.concatenate([[0], np.cumsum([p.num_examples for p in parts])])
        self._pattern = np.repeat(np.arange(len(parts)), self.quota)
        self._cached: tuple[int, np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        """Samples per epoch of the mixture: all sources' together (each source is seen about once per epoch
        when the weights are proportional to the sizes, the default)."""
        return sum(len(p) for p in self.parts)

    @property
    def num_examples(self) -> int:
        return int(self.offsets[-1])

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Block b's units: the source of each, and its unit number in that source's own order."""
        if self._cached is None or self._cached[0] != b:
            source = np.random.default_rng([self.seed, MIX_TAG, b]).permutation(self._pattern)
            local = np.empty(self.block, dtype=np.int64)
            for k in range(len(self.parts)):
                at = source == k
                local[at] = b * self.quota[k] + np.arange(self.quota[k])
            self._cached = (b, source, local)
        return self._cached[1], self._cached[2]

    def global_indices(self, start: int, count: int) -> np.ndarray:
        """Encoded indices of the samples at global positions [start, start + count)."""
        positions = np.arange(start, start + count, dtype=np.int64)
        units, within = np.divmod(positions, self.unit)
        source = np.empty(count, dtype=np.int64)
        local = np.empty(count, dtype=np.int64)  # position in the source's own order
        for b in np.unique(units // self.block):
            at = units // self.block == b
            src, loc = self._block(int(b))
            source[at] = src[units[at] % self.block]
            local[at] = loc[units[at] % self.block] * self.unit + within[at]
        out = np.empty(count, dtype=np.int64)
        for k, part in enumerate(self.parts):
            at = np.flatnonzero(source == k)
            if len(at):
                # A source's positions in a contiguous request are consecutive in its own order (block b holds
                # its units b*quota .. b*quota + quota - 1), so one lookup serves them all.
                out[at] = part.global_indices(int(local[at[0]]), len(at)) + self.offsets[k]
        return out

    def _split(self, indices: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(source, rows of the batch, indices in the source) for each source present in indices."""
        indices = np.asarray(indices, dtype=np.int64)
        source = np.searchsorted(self.offsets, indices, side="right") - 1
        return [(k, np.flatnonzero(source == k), indices[source == k] - self.offsets[k])
                for k in range(len(self.parts)) if (source == k).any()]

    def input_tokens(self, indices: np.ndarray) -> int:
        return sum(self.parts[k].input_tokens(local) for k, _, local in self._split(indices))

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, ...]:
        """Each source's rows from its own batch(), in the order asked for; SFT rows right-padded to the longest.

        Preference sources (DPO) return (x, y, ref) with 2B rows, chosen then rejected: so does the mixture,
        each source's chosen rows at the positions asked for and its rejected rows at those positions + B.
        """
        n = len(indices)
        pieces = []
        for k, rows, local in self._split(indices):
            out = self.parts[k].batch(local)
            if len(out) == 3:
                rows = np.concatenate([rows, rows + n])
            pieces.append((rows, out, getattr(self.parts[k], "pad_id", 0)))
        paired = {len(out) == 3 for _, out, _ in pieces}
        if len(paired) != 1:
            raise ConfigError("a mixture cannot combine preference pairs with other training data")
        width = max(out[0].shape[1] for _, out, _ in pieces)
        total = sum(len(rows) for rows, _, _ in pieces)
        x_out = torch.empty(total, width, dtype=torch.long)
        y_out = torch.full((total, width), IGNORE_INDEX, dtype=torch.long)
        ref_out = torch.empty(total, dtype=torch.float32)
        for rows, (x, y, *ref), pad in pieces:
            x_out[rows] = pad
            x_out[rows, :x.shape[1]] = x
            y_out[rows, :y.shape[1]] = y
            if ref:
                ref_out[rows] = ref[0]
        return (x_out, y_out, ref_out) if paired == {True} else (x_out, y_out)
