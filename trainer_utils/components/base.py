"""What an in-loop extra is: a Component the loop calls at its own cadence, with its own state for resume.

The loop calls, for every component in order:
    describe()           once: what it adds to the run header and train_config.json's "resolved"
    start(trainer)       once, when fit() begins (the logger exists)
    wrap_step(trainer, step) -> step     around each optimizer step (e.g. to measure its memory)
    after_step(trainer, outcome)          after each optimizer step: its device-side results, no host sync
    due(step, last) / run(trainer)        when due: its work; a Stop ends training
    state_dict() / load_state_dict(s)     saved in each checkpoint under `name`, restored on resume
A component reads the Trainer's public surface only (session, config, model, backend, device, precision,
logger, state, val_loss, train_loss, save()); adding one is its own module plus a line in COMPONENTS.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

if TYPE_CHECKING:
    from ..loop import Trainer


@dataclass
class StepOutcome:
    """One optimizer step's results, as device tensors (reading them would sync): the summed loss and metrics
    of this rank's micro-batches, whether the update was applied, and what it counted."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    applied: torch.Tensor
    n_valid_local: torch.Tensor  # this rank's valid targets (the loss's units)
    n_input: int  # this rank's input tokens
    wait_s: float  # host seconds spent waiting for the batches


@dataclass
class Stop:
    """Why training ends after this step. save: checkpoint it first; announce: said after that checkpoint;
    fallback: continue in a wider precision (run() builds the next Trainer)."""

    reason: str
    save: bool
    exit_code: int = 0
    fallback: dict[str, Any] | None = None
    announce: Callable[[], None] | None = None


def every(interval: int, step: int, last: int) -> bool:
    """Whether the step just taken is a multiple of `interval`, or the last one."""
    return step % interval == 0 or step == last


class Component:
    """An in-loop extra. Override what it needs; the defaults do nothing."""

    name: ClassVar[str] = ""  # its key in a checkpoint's training state ("": it keeps none)
    pauses_clock: ClassVar[bool] = False  # its run() is not training time (elapsed_s leaves it out)

    def describe(self) -> dict[str, Any]:
        return {}

    def start(self, trainer: Trainer) -> None:
        pass

    def wrap_step(self, trainer: Trainer, step: Callable[[], None]) -> Callable[[], None]:
        return step

    def after_step(self, trainer: Trainer, outcome: StepOutcome) -> None:
        pass

    def due(self, step: int, last: int) -> bool:
        return False

    def run(self, trainer: Trainer) -> Stop | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
