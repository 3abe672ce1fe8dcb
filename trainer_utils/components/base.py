"""What an in-loop extra is: a Component the loop calls at its own cadence, with its own state for resume.

The loop calls, for every component in order:
    Component(ctx)                     built with the run's context, before a resumed state is restored
    describe()                         once: what it adds to the run header and train_config.json's "resolved"
    start(ctx) -> Report | None        once, when fit() begins (the logger exists)
    wrap_step(ctx, step) -> step       around each optimizer step (e.g. to measure its memory)
    after_step(ctx, outcome)           after each optimizer step: its device-side results, no host sync
    due(step, last) / run(ctx)         when due: its work, and a Report of what it produced (None: nothing)
    state_dict() / load_state_dict(s)  saved in each checkpoint under `name`, restored on resume
A component sees the run through its RunContext only (trainer_utils/context.py: the settings, model, data,
backend, logger, state, what the components before it measured; a checkpoint through ctx.control). What it
produces it returns: the numbers it measured (the loop records them in ctx.measured), a re-planned time budget,
or a Stop. Adding one is its own module plus a line in COMPONENTS.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar

from ..context import Report, RunContext, StepOutcome


class Component:
    """An in-loop extra. Override what it needs; the defaults do nothing."""

    name: ClassVar[str] = ""  # its key in a checkpoint's training state ("": it keeps none)
    pauses_clock: ClassVar[bool] = False  # its run() is not training time (elapsed_s leaves it out)

    def describe(self) -> dict[str, Any]:
        return {}

    def start(self, ctx: RunContext) -> Report | None:
        return None

    def wrap_step(self, ctx: RunContext, step: Callable[[], None]) -> Callable[[], None]:
        return step

    def after_step(self, ctx: RunContext, outcome: StepOutcome) -> None:
        pass

    def due(self, step: int, last: int) -> bool:
        return False

    def run(self, ctx: RunContext) -> Report | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
