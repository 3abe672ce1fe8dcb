"""Per-layer statistics (--layer_stats): at every evaluation, rank 0 records the attention entropy and activation
RMS of each layer on a fixed validation batch (model/stats.py), into metrics.jsonl and histograms. Attention
collapsing onto one token, or activations growing towards overflow, show here first.

A forward on rank 0 alone: with weights sharded across ranks it would need every rank (not possible yet).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dataset.config import TEXT
from model.stats import layer_stats

from ..data import eval_batches
from .base import Component, every

if TYPE_CHECKING:
    from ..loop import Trainer


class LayerStats(Component):
    pauses_clock = True

    def __init__(self, trainer: Trainer) -> None:
        self.interval = trainer.config.eval.eval_interval
        on = trainer.config.eval.layer_stats and trainer.backend.is_main
        self.batch = self._batch(trainer) if on else None

    @staticmethod
    def _batch(trainer: Trainer) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The first 2 validation sequences, at most 1024 tokens (its attention weights are materialised:
        B x heads x T x T per layer), and which positions are not padding."""
        s = trainer.session
        if not s.val_sets:
            return None
        x = next(eval_batches(s.val_sets[0].data, 2, 1, 0, 1))[0]
        x = x[:, :1024].to(trainer.device)
        if s.kind == TEXT:
            return x, None  # pretraining windows are never padded
        # SFT batches are right-padded: the trailing run of pad ids in each row
        real = (x != s.tokenizer.pad_id).flip(1).cumsum(1).flip(1) > 0
        return x, real.long()

    def due(self, step: int, last: int) -> bool:
        return self.batch is not None and every(self.interval, step, last)

    @torch.no_grad()
    def run(self, trainer: Trainer) -> None:
        x, real = self.batch
        with trainer.precision.autocast():
            stats = layer_stats(trainer.model, x, attention_mask=real)
        step = trainer.state.step
        trainer.logger.log({"step": step, **{k: round(v, 5) for k, v in stats.flat().items()}})
        trainer.logger.log_histograms(step, stats.histograms())
