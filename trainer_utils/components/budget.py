"""The time budget's guard (--time_budget): every `check_every` steps of a planned run (trainer_utils/budget.py), the
end is projected from the measured step times (step_times: the run's, without its outlying looks and from a lasting
speed-up on, and the recent median; run() says which decides); when it leaves [LOW, HIGH] of the budget (the
machine slowed down, or runs faster than the probe measured) the rest of the run is re-planned, the schedule laid
over the new number of steps, and the change logged; the next re-plan waits SETTLE looks, unless the machine slows
down. Every re-plan moves the progress bar's end and goes into metrics.jsonl; the screen gets a line for the real
ones only (shown(): the end moved by SHOWN or more since the last line, or the run stops), so other work on the
machine coming and going does not fill it. A re-plan that leaves no step ends the run at once, with its evaluation
and checkpoint. Ranks decide from the same numbers, the slowest rank's. A re-plan is a new plan that records it
(BudgetPlan.replanned), returned to the loop; every checkpoint carries the plan (loop.py Trainer.save), and a
resumed Trainer starts from it.
"""
from __future__ import annotations

import statistics
from typing import Any

from ..budget import PLAN_KEY, format_duration, projected, replanned_end
from ..context import Report, RunContext, StepOutcome
from .base import Component

WINDOW_SHARE = 0.05  # the recent step time is measured over about this share of the budget...
RECENT_LOOKS = 3  # ...and over at least this many looks, whose median it is: one slow stretch is not a trend
SLOWER = 1.25  # a recent step time this much above the run's is a slow-down, not the data's noise
FASTER = 1.1  # every recent look this much below the run's step time is a lasting speed-up
OUTLIER = 2.0  # a look's step time over this many times the recent one is left out of the run's
SETTLE = 3  # looks after a re-plan before the next one, unless a slow-down would overrun the budget
SHOWN = 0.1  # a re-plan that moves the end this share of the last end shown (or more) is shown on screen


def shown(end: int, step: int, last_shown: int) -> bool:
    """Whether a re-plan to `end` at `step` gets a line on screen: it stops the run, or moves the end by SHOWN or
    more from the last end the screen showed (a test suite beside a 4-minute run moved it 17 times, mostly by a
    few steps: the progress bar and metrics.jsonl follow each)."""
    return end <= step or abs(end - last_shown) >= SHOWN * last_shown


class TimeBudgetGuard(Component):
    def __init__(self, ctx: RunContext) -> None:
        self.plan, self.clock = ctx.plan, ctx.budget_clock  # the plan the run starts with (None until one is made)
        self.marks: list[tuple[float, int]] = []  # (training seconds, step) after the first step and at each check
        self.replanned_at: int | None = None  # how many marks there were at the last re-plan
        self.since = 0  # the mark the run's step time counts from: the first, or where a lasting speed-up began
        self.shown_end: int | None = None  # the end the screen showed last

    def describe(self) -> dict[str, Any]:
        return {} if self.plan is None else {PLAN_KEY: self.plan.to_dict()}

    def start(self, ctx: RunContext) -> None:
        self.marks.clear()
        self.replanned_at = self.shown_end = None
        self.since = 0

    def after_step(self, ctx: RunContext, outcome: StepOutcome) -> None:
        self.plan = ctx.plan  # a plan made on the run's first steps arrives after them
        if self.plan is not None and not self.marks:  # measured from after its first step: it warms up
            self.marks.append((ctx.clock.elapsed(), ctx.state.step))

    def due(self, step: int, last: int) -> bool:
        return (self.plan is not None and bool(self.marks) and step > self.marks[-1][1] and step < last
                and step % self.plan.check_every == 0)

    def step_times(self, window: float) -> tuple[float, float]:
        """The run's step time and the recent one, from the looks so far (a look: the steps since the mark before,
        and the seconds they took). The recent one is the median look's over the looks since the newest mark at
        least `window` seconds back, RECENT_LOOKS of them at least: a single slow look is left out, a slow-down
        that lasts over half of them is not. The run's is its time over its steps, without the looks whose steps
        took over OUTLIER times the recent one (a hang, a burst of other work on the machine: paid once, in the
        time spent, and not expected again), and from the mark `since` on: when every recent look was FASTER than
        the run's time, the machine sped up (other work ended, the first steps were slow), and the steps before
        would slow the run's time down for the rest of the run, lengthening it a few steps at every look."""
        looks = [(t1 - t0, s1 - s0) for (t0, s0), (t1, s1) in zip(self.marks, self.marks[1:])]
        per_step = [seconds / steps for seconds, steps in looks]
        now = self.marks[-1][0]
        first = max((i for i, (t, _) in enumerate(self.marks) if now - t >= window), default=0)
        first = max(0, min(first, len(looks) - RECENT_LOOKS))
        recent_s = statistics.median(per_step[first:])

        def run_s() -> float:
            kept = [(seconds, steps) for seconds, steps in looks[self.since:] if seconds / steps <= OUTLIER * recent_s]
            return sum(seconds for seconds, _ in kept) / sum(steps for _, steps in kept)

        steady_s = run_s()
        if first > self.since and max(per_step[first:]) * FASTER < steady_s:  # (first > 0: a whole window back)
            self.since = first
            steady_s = run_s()
        return steady_s, recent_s

    def run(self, ctx: RunContext) -> Report | None:
        """Two step times (step_times): the run's, which keeps the run within [LOW, HIGH] (a chat batch's step
        varies with its longest conversation, and batches grouped by length make whole stretches of the run faster
        or slower: only the run's own average is steady), and a recent one over WINDOW_SHARE of the budget. When
        the recent one is SLOWER than the run's and would overrun the budget, the machine has slowed down: it plans
        at once. Otherwise it plans only once a window has passed since the first step, and SETTLE looks after a
        re-plan (the first steps' noise, or the end of a slow-down, would move the end back and forth). A longer
        run needs both step times to agree there is time (else the two would take turns)."""
        plan, step, now = ctx.plan, ctx.state.step, ctx.clock.elapsed()
        window = WINDOW_SHARE * plan.budget_s
        self.marks.append((now, step))
        measured = now - self.marks[0][0]
        steady_s, recent_s = self.step_times(window)
        spent = self.clock.spent()
        # one decision on every rank: the slowest rank's numbers (the others wait for it anyway)
        steady_s, recent_s, spent, measured = ctx.backend.slowest([steady_s, recent_s, spent, measured])
        cautious = max(steady_s, recent_s)
        settled = self.replanned_at is None or len(self.marks) - self.replanned_at >= SETTLE
        if recent_s > SLOWER * steady_s and projected(plan, step, spent, recent_s) > plan.budget_s:
            step_s = cautious  # a slow-down: act now
        elif measured < window or not settled:
            return None  # too few steps yet for the steady time to overrule the probe's, or the last re-plan's
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
        self.shown_end = self.shown_end or before
        why = (f"steps take {step_s:.3g} s (planned {plan.step_s:.3g} s) with {format_duration(spent)} of "
               f"{format_duration(plan.budget_s)} spent")
        ctx.logger.log({"step": step, "event": "time_budget", "planned_steps": before, "steps": end,
                        "step_time_s": round(step_s, 6), "spent_s": round(spent, 3)})
        what = (f"ending at step {end} instead of {before}, the learning-rate decay completing there" if end > step
                else f"stopping now, at step {step} of {before}")
        if shown(end, step, self.shown_end):
            ctx.logger.message(f"time budget: {why}: {what}")
            self.shown_end = end
        self.replanned_at = len(self.marks)
        return Report(plan=plan.replanned(step, end, step_s, spent))
