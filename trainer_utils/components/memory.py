"""Memory: `python -m model --estimate` for this run, printed at the start and written into the run header, and
one step measured (rank 0; the second step, which has the optimizer state, or the first after a resume) and
logged beside it. Left out where the formula does not describe the step: DeepSpeed's sharding, SGD, a compiled
model, dropout, LoRA, or a stage that runs another model beside the trained one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from dataset.config import TEXT
from model.config import model_name
from model.memory import MemoryEstimate, estimate_memory, measure_step_peak

from .base import Component

if TYPE_CHECKING:
    from ..loop import Trainer

MEMORY_KINDS = ("parameters", "gradients", "optimizer", "activations", "logits")


class MemoryCheck(Component):
    def __init__(self, trainer: Trainer) -> None:
        self.estimate = self._estimate(trainer)
        self.measure_at = 1

    @staticmethod
    def _estimate(trainer: Trainer) -> MemoryEstimate | None:
        c, s, cfg = trainer.config, trainer.session, trainer.model.config
        o = c.optim
        if trainer.backend.name == "deepspeed" or o.optimizer == "sgd" or c.model.compile or cfg.dropout > 0 or \
                s.lora is not None or not s.stage.estimates_memory:
            # the formula is one eager model with AdamW (or Muon + AdamW) on every weight, unsharded, no dropout
            return None
        return estimate_memory(cfg, o.batch_size * s.stage.memory_rows, s.max_seq_len, trainer.precision.dtype,
                               c.model.grad_checkpointing, o.accumulation_steps, name=model_name(cfg),
                               optimizer=o.optimizer)

    def describe(self) -> dict[str, Any]:
        if self.estimate is None:
            return {}
        e = self.estimate
        return {"memory_estimate": {"peak_bytes": e.peak, "at": e.peak_moment,
                                    **{k: getattr(e, k) for k in MEMORY_KINDS}}}

    def start(self, trainer: Trainer) -> None:
        self.measure_at = trainer.state.step if trainer.state.step > 0 else 1
        if self.estimate is not None and trainer.backend.is_main:
            trainer.logger.message(self.estimate.summary())

    def wrap_step(self, trainer: Trainer, step: Callable[[], None]) -> Callable[[], None]:
        if self.estimate is None or trainer.state.step != self.measure_at or not trainer.backend.is_main:
            return step
        return lambda: self._measure(trainer, step)

    def _measure(self, trainer: Trainer, step: Callable[[], None]) -> None:
        measured = measure_step_peak(step, trainer.device, trainer.model, trainer.optimizer)
        if measured is None:  # a device without a peak statistic (MPS): the estimate printed at the start stands
            return
        # the step just taken is measure_at + 1
        trainer.logger.log({"step": trainer.state.step, "memory_estimated_gb": round(self.estimate.peak / 2**30, 4),
                            "memory_measured_gb": round(measured / 2**30, 4)})
        note = ("; the estimate is for batches of --max_seq_len tokens, chat batches are as long as their longest "
                "example" if trainer.session.kind != TEXT else "")
        trainer.logger.message(self.estimate.summary(measured) + note)
