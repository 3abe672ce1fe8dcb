"""The precision fallback (--on_nonfinite): when steps keep failing in a reduced precision, stop this Trainer and
continue from the last checkpoint in a wider one (or stop, saying why).

Checked at log steps, after the log component has read the counters. Ranks agree without a collective: the
gradients whose finiteness they count are already all-reduced.
"""
from __future__ import annotations

from typing import Any

import torch

from common.device import dtype_name

from ..checkpoint import latest_checkpoint
from ..context import Report, RunContext, Stop, every
from ..runtime import fallback_dtype
from .base import Component


class NonfiniteGuard(Component):
    def __init__(self, ctx: RunContext) -> None:
        self.interval = ctx.config.run.log_interval
        self.max_bad_steps = ctx.config.optim.max_bad_steps
        self.option = ctx.config.precision.on_nonfinite

    def due(self, step: int, last: int) -> bool:
        return every(self.interval, step, last)

    def run(self, ctx: RunContext) -> Report | None:
        trouble = self.trouble(ctx)
        if trouble is None:
            return None
        event = self.fallback_event(ctx, trouble)
        return Report(stop=Stop(trouble, save=False, exit_code=0 if event else 1, fallback=event))

    def trouble(self, ctx: RunContext) -> str | None:
        """Why training cannot go on in this precision, or None."""
        if ctx.bad_in_a_row >= self.max_bad_steps:
            return f"{ctx.bad_in_a_row} consecutive steps had non-finite gradients"
        scaler = ctx.precision.scaler
        if scaler.is_enabled() and scaler.get_scale() < 1:
            # below 1 the scaler is shrinking gradients that overflow fp16 even unscaled: its range is too small
            return f"the fp16 loss scale fell to {scaler.get_scale():.3g} (below 1)"
        return None

    def fallback_event(self, ctx: RunContext, trouble: str) -> dict[str, Any] | None:
        """The precision fallback to make (logged), or None to stop without saving (after saying why)."""
        dtype, run_dir, step = ctx.precision.dtype, ctx.run_dir, ctx.state.step
        to = fallback_dtype(dtype, ctx.device) if self.option == "fallback" else None
        if to is None or not ctx.backend.can_switch_precision:
            if to is None:
                advice = ("Try a lower --learning_rate" + (", --dtype bfloat16 or float32" if dtype != torch.float32
                                                           else ""))
            else:
                advice = (f"DeepSpeed fixes its precision when the engine starts: continue with --resume --dtype "
                          f"{dtype_name(to)}")
            ctx.logger.message(f"error: {trouble}; stopping without saving. {advice}. The last checkpoint is "
                                   "intact.")
            return None
        last = latest_checkpoint(run_dir)
        event = {"step": step, "from": dtype_name(dtype), "to": dtype_name(to), "reason": trouble,
                 "reload": str(last.relative_to(run_dir)) if last else "initial weights"}
        ctx.logger.log({"event": "precision_fallback", **event})
        ctx.logger.message(f"step {step}: {trouble}. Falling back from {event['from']} to {event['to']}: "
                               f"continuing from {event['reload']} (--on_nonfinite fallback)")
        return event
