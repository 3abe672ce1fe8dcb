"""Per-layer statistics (--layer_stats): at every evaluation, rank 0 records the attention entropy and activation
RMS of each layer on a fixed validation batch (model/stats.py), into metrics.jsonl and histograms. Attention
collapsing onto one token, or activations growing towards overflow, show here first.

A forward on rank 0 alone: with weights sharded across ranks it would need every rank (not possible yet).
"""
from __future__ import annotations

import torch

from dataset.kinds import TEXT
from model.stats import layer_stats

from ..context import RunContext, every
from ..data import eval_batches
from .base import Component


class LayerStats(Component):
    pauses_clock = True

    def __init__(self, ctx: RunContext) -> None:
        self.interval = ctx.config.eval.eval_interval
        on = ctx.config.eval.layer_stats and ctx.backend.is_main
        self.batch = self._batch(ctx) if on else None

    @staticmethod
    def _batch(ctx: RunContext) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The first 2 validation sequences, at most 1024 tokens (its attention weights are materialised:
        B x heads x T x T per layer), and which positions are not padding."""
        if not ctx.val_sets:
            return None
        x = next(eval_batches(ctx.val_sets[0].data, 2, 1, 0, 1))[0]
        x = x[:, :1024].to(ctx.device)
        if ctx.kind == TEXT:
            return x, None  # pretraining windows are never padded
        # SFT batches are right-padded: the trailing run of pad ids in each row
        real = (x != ctx.tokenizer.pad_id).flip(1).cumsum(1).flip(1) > 0
        return x, real.long()

    def due(self, step: int, last: int) -> bool:
        return self.batch is not None and every(self.interval, step, last)

    @torch.no_grad()
    def run(self, ctx: RunContext) -> None:
        x, real = self.batch
        with ctx.precision.autocast():
            stats = layer_stats(ctx.model, x, attention_mask=real)
        step = ctx.state.step
        ctx.logger.log({"step": step, **{k: round(v, 5) for k, v in stats.flat().items()}})
        ctx.logger.log_histograms(step, stats.histograms())
