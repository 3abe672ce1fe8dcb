"""Memory: `python -m model --estimate` for this run, printed at the start and written into the run header, and
one step measured (rank 0; the second step, which has the optimizer state, or the first after a resume) and
logged beside it. Left out where the formula does not describe the step: DeepSpeed's sharding, SGD, a compiled
model, dropout, LoRA, or a stage that runs another model beside the trained one.
"""
from __future__ import annotations

from typing import Any, Callable

from dataset.kinds import TEXT
from model.config import model_name
from model.memory import MemoryEstimate, estimate_memory, measure_step_peak

from ..context import RunContext
from .base import Component

MEMORY_KINDS = ("parameters", "gradients", "optimizer", "activations", "logits")


class MemoryCheck(Component):
    def __init__(self, ctx: RunContext) -> None:
        self.estimate = self._estimate(ctx)
        self.measure_at = 1

    @staticmethod
    def _estimate(ctx: RunContext) -> MemoryEstimate | None:
        c, cfg = ctx.config, ctx.model.config
        o = c.optim
        if ctx.backend.name == "deepspeed" or o.optimizer == "sgd" or c.model.compile or cfg.dropout > 0 or \
                ctx.adapters or not ctx.estimates_memory:
            # the formula is one eager model with AdamW (or Muon + AdamW) on every weight, unsharded, no dropout
            return None
        return estimate_memory(cfg, o.batch_size * ctx.memory_rows, ctx.max_seq_len, ctx.precision.dtype,
                               c.model.grad_checkpointing, o.accumulation_steps, name=model_name(cfg),
                               optimizer=o.optimizer)

    def describe(self) -> dict[str, Any]:
        if self.estimate is None:
            return {}
        e = self.estimate
        return {"memory_estimate": {"peak_bytes": e.peak, "at": e.peak_moment,
                                    **{k: getattr(e, k) for k in MEMORY_KINDS}}}

    def start(self, ctx: RunContext) -> None:
        self.measure_at = ctx.state.step if ctx.state.step > 0 else 1
        if self.estimate is not None and ctx.backend.is_main:
            ctx.logger.message(self.estimate.summary())

    def wrap_step(self, ctx: RunContext, step: Callable[[], None]) -> Callable[[], None]:
        if self.estimate is None or ctx.state.step != self.measure_at or not ctx.backend.is_main:
            return step
        return lambda: self._measure(ctx, step)

    def _measure(self, ctx: RunContext, step: Callable[[], None]) -> None:
        measured = measure_step_peak(step, ctx.device, ctx.model, ctx.optimizer)
        if measured is None:  # a device without a peak statistic (MPS): the estimate printed at the start stands
            return
        # the step just taken is measure_at + 1
        ctx.logger.log({"step": ctx.state.step, "memory_estimated_gb": round(self.estimate.peak / 2**30, 4),
                            "memory_measured_gb": round(measured / 2**30, 4)})
        note = ("; the estimate is for batches of --max_seq_len tokens, chat batches are as long as their longest "
                "example" if ctx.kind != TEXT else "")
        ctx.logger.message(self.estimate.summary(measured) + note)
