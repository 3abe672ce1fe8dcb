"""The time budget's guard (--time_budget): every `check_every` steps of a planned run (trainer_utils/budget.py),
the end is projected from the measured step time (run() says which); when it leaves [LOW, HIGH] of the budget
(the machine slowed down, or runs faster than the probe measured) the rest of the run is re-planned, the schedule
laid over the new number of steps, and the change logged. A re-plan that leaves no step ends the run at once,
with its evaluation and checkpoint. Ranks decide from the same numbers, the slowest rank's. A re-plan is a new plan
that records it (BudgetPlan.replanned), returned to the loop; every checkpoint carries the plan (loop.py
Trainer.save), and a resumed Trainer starts from it.
"""
from __future__ import annotations

from typing import Any

from ..budget import PLAN_KEY, format_duration, projected, replanned_end
from ..context import Report, RunContext, StepOutcome
from .base import Component

WINDOW_SHARE = 0.05  # the recent step time is measured over about this share of the budget
SLOWER = 1.25  # a recent step time this much above the run's is a slow-down, not the data's noise


class TimeBudgetGuard(Component):
    def __init__(self, ctx: RunContext) -> None:
        self.plan, self.clock = ctx.plan, ctx.budget_clock  # the plan the run starts with
        self.marks: list[tuple[float, int]] = []  # (training seconds, step) after the first step and at each check

    def describe(self) -> dict[str, Any]:
        return {} if self.plan is None else {PLAN_KEY: self.plan.to_dict()}

    def start(self, ctx: RunContext) -> None:
        self.marks.clear()

    def after_step(self, ctx: RunContext, outcome: StepOutcome) -> None:
        if self.plan is not None and not self.marks:  # measured from after the first step: it warms up
            self.marks.append((ctx.clock.elapsed(), ctx.state.step))

    def due(self, step: int, last: int) -> bool:
        return (self.plan is not None and bool(self.marks) and step > self.marks[-1][1] and step < last
                and step % self.plan.check_every == 0)

    def since(self, now: float, seconds: float) -> tuple[float, int]:
        """The newest mark at least `seconds` of training back (or the oldest there is)."""
        return next((m for m in reversed(self.marks) if now - m[0] >= seconds), self.marks[0])

    def run(self, ctx: RunContext) -> Report | None:
        """Two step times: the run's since its first step, which keeps the run within [LOW, HIGH] (a chat batch's
        step varies with its longest conversation, and batches grouped by length make whole stretches of the run
        faster or slower: only the run's own average is steady), and a recent one over WINDOW_SHARE of the budget.
        When the recent one is SLOWER than the run's and would overrun the budget, the machine has slowed down:
        it plans at once. A longer run needs both to agree there is time (else the two would take turns)."""
        plan, step, now = ctx.plan, ctx.state.step, ctx.clock.elapsed()
        window = WINDOW_SHARE * plan.budget_s
        measured = now - self.marks[0][0]
        steady_s, recent_s = ((now - t) / (step - s) for t, s in (self.marks[0], self.since(now, window)))
        spent = self.clock.spent()
        self.marks.append((now, step))
        # one decision on every rank: the slowest rank's numbers (the others wait for it anyway)
        steady_s, recent_s, spent, measured = ctx.backend.slowest([steady_s, recent_s, spent, measured])
        cautious = max(steady_s, recent_s)
        if recent_s > SLOWER * steady_s and projected(plan, step, spent, recent_s) > plan.budget_s:
            step_s = cautious  # a slow-down: act now
        elif measured < window:
            return None  # too few steps yet for the steady time to overrule the probe's
        else:
            step_s = steady_s
        end = replanned_end(plan, step, spent, step_s)
        if end is not None and end > plan.end and step_s < cautious:
            step_s, end = cautious, replanned_end(plan, step, spent, cautious)
            if end is None or end <= plan.end:
                return None
        if end is None:
            return None
        before = plan.end
        why = (f"steps take {step_s:.3g} s (planned {plan.step_s:.3g} s) with {format_duration(spent)} of "
               f"{format_duration(plan.budget_s)} spent")
        ctx.logger.log({"step": step, "event": "time_budget", "planned_steps": before, "steps": end,
                        "step_time_s": round(step_s, 6), "spent_s": round(spent, 3)})
        what = (f"ending at step {end} instead of {before}, the learning-rate decay completing there" if end > step
                else f"stopping now, at step {step} of {before}")
        ctx.logger.message(f"time budget: {why}: {what}")
        return Report(plan=plan.replanned(step, end, step_s, spent))
