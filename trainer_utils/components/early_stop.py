"""Early stopping (--early_stop_patience, --overfit_gap): after each evaluation keep the best checkpoint (saved
then, with `best` pointing at it) and stop when the validation loss has not improved for --early_stop_patience
evaluations, or exceeds the last logged training loss by more than --overfit_gap. Runs after the evaluation
component; its memory (best loss and step, evaluations since) is checkpointed, so a resume counts on.
"""
from __future__ import annotations

from typing import Any

from common.files import BEST_NAME

from ..checkpoint import checkpoint_dir, mark_best
from ..context import Report, RunContext, Stop, every
from .base import Component


class EarlyStopping(Component):
    name = "early_stop"
    pauses_clock = True

    def __init__(self, ctx: RunContext) -> None:
        ev = ctx.config.eval
        self.interval, self.on = ev.eval_interval, ev.early_stopping
        self.patience, self.overfit_gap = ev.early_stop_patience, ev.overfit_gap
        self.best: dict[str, Any] = {"val_loss": None, "step": None, "evals_since": 0}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.best)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best.update(state)

    def due(self, step: int, last: int) -> bool:
        return self.on and every(self.interval, step, last)

    def run(self, ctx: RunContext) -> Report | None:
        val_loss, train_loss = ctx.measured.get("val_loss"), ctx.measured.get("train_loss")
        b, step = self.best, ctx.state.step
        if val_loss is None:
            return None
        if b["val_loss"] is None or val_loss < b["val_loss"]:
            b.update(val_loss=val_loss, step=step, evals_since=0)
            ctx.control.save()  # a no-op when this step is already saved
            if ctx.backend.is_main:
                mark_best(ctx.run_dir, checkpoint_dir(ctx.run_dir, step))
        else:
            b["evals_since"] += 1
        reason = None
        if self.patience is not None and b["evals_since"] >= self.patience:
            reason = (f"the validation loss has not improved for {b['evals_since']} evaluations "
                      f"(--early_stop_patience {self.patience})")
        gap = None if train_loss is None else val_loss - train_loss
        if reason is None and self.overfit_gap is not None and gap is not None and gap > self.overfit_gap:
            reason = (f"the validation loss {val_loss:.4f} exceeds the training loss {train_loss:.4f} by "
                      f"{gap:.4f} (--overfit_gap {self.overfit_gap})")
        if reason is None:
            return None
        return Report(stop=Stop(reason, save=True, announce=lambda: self.announce(ctx, reason)))

    def announce(self, ctx: RunContext, reason: str) -> None:
        b, step, run_dir = self.best, ctx.state.step, ctx.run_dir
        ctx.logger.log({"step": step, "event": "early_stop", "reason": reason, "best_step": b["step"],
                        "best_val_loss": b["val_loss"]})
        ctx.logger.message(f"early stop after step {step}: {reason}. Best: step {b['step']} (val_loss "
                           f"{b['val_loss']:.4f}), {run_dir / BEST_NAME}; last: {run_dir / 'latest'}")
