"""The time budget's guard (--time_budget): every `check_every` steps of a planned run (trainer_utils/budget.py),
the end is projected from the recent step time; when it leaves [LOW, HIGH] of the budget (the machine slowed
down, or runs faster than the probe measured) the rest of the run is re-planned, the schedule laid over the new
number of steps, and the change logged. A re-plan that leaves no step ends the run at once, with its evaluation
and checkpoint. Ranks decide from the same all-reduced numbers. The plan, its re-plans and the budget spent are
this component's checkpoint state (the loop reads them back before building a resumed Trainer).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..budget import PLAN_KEY, format_duration, replan
from .base import Component, StepOutcome

if TYPE_CHECKING:
    from ..loop import Trainer

SMOOTHING = 0.5  # weight of the newest window in the step time the projection uses


class TimeBudgetGuard(Component):
    name = PLAN_KEY

    def __init__(self, trainer: Trainer) -> None:
        self.plan, self.clock = trainer.plan, trainer.budget_clock
        self.mark: tuple[float, int] | None = None  # (training seconds, step) the next window starts at
        self.step_s: float | None = None

    def describe(self) -> dict[str, Any]:
        return {} if self.plan is None else {PLAN_KEY: self.plan.to_dict()}

    def start(self, trainer: Trainer) -> None:
        self.mark, self.step_s = None, None

    def after_step(self, trainer: Trainer, outcome: StepOutcome) -> None:
        if self.plan is not None and self.mark is None:  # windows start after the first step: it warms up
            self.mark = (trainer.clock.elapsed(), trainer.state.step)

    def due(self, step: int, last: int) -> bool:
        return (self.plan is not None and self.mark is not None and step > self.mark[1] and step < last
                and step % self.plan.check_every == 0)

    def run(self, trainer: Trainer) -> None:
        plan, step, now = self.plan, trainer.state.step, trainer.clock.elapsed()
        window, spent = (now - self.mark[0]) / (step - self.mark[1]), self.clock.spent()
        if trainer.backend.world_size > 1:  # one decision: every rank's numbers averaged
            both = torch.tensor([window, spent], device=trainer.device, dtype=torch.float64)
            window, spent = (trainer.backend.all_reduce_sum(both) / trainer.backend.world_size).tolist()
        self.mark = (now, step)
        self.step_s = window if self.step_s is None else SMOOTHING * window + (1 - SMOOTHING) * self.step_s
        end = replan(plan, step, spent, self.step_s)
        if end is None:
            return
        before = plan.end
        why = (f"steps take {self.step_s:.3g} s (planned {plan.step_s:.3g} s) with {format_duration(spent)} of "
               f"{format_duration(plan.budget_s)} spent")
        plan.replans.append({"step": step, "steps": end, "step_s": round(self.step_s, 6), "spent_s": round(spent, 3)})
        trainer.replan(end)
        trainer.logger.log({"step": step, "event": "time_budget", "planned_steps": before, "steps": end,
                            "step_time_s": round(self.step_s, 6), "spent_s": round(spent, 3)})
        what = (f"ending at step {end} instead of {before}, the learning-rate decay completing there" if end > step
                else f"stopping now, at step {step} of {before}")
        trainer.logger.message(f"time budget: {why}: {what}")

    def state_dict(self) -> dict[str, Any]:
        if self.plan is None:
            return {}
        self.plan.used_s = round(self.clock.spent(), 3)
        return self.plan.to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass  # the loop read the plan before building the Trainer (loop.py plan_budget): it is self.plan
