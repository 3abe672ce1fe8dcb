"""Training to a time budget (--time_budget 10m): how many optimizer steps fit, decided once from measured costs.

The run is measured where its first steps do not depend on the plan: when its warm-up is a fixed number of steps
(--warmup_steps W; the learning rate of a warm-up step is the same for any length of run), the run plans on its
own first steps (components/first_steps.py: a warm-up step, a few timed steps, then one checkpoint into a scratch
directory and one evaluation round, rehearsed so that they leave no trace on the run), all within the warm-up and
before its first evaluation and checkpoint (in_run_steps()); those steps are trained, not thrown away. Otherwise
(a warm-up by ratio, of the length the plan decides) it is probed before its first step (driver.py
measure_costs: a throwaway Trainer, built in a scratch run directory, does what the run does before its first step,
takes a warm-up step, a few timed steps, one evaluation round and one checkpoint, exactly as the run will), and
what the run then pays before its first step is planned too: building its own Trainer again (a GRPO run's
reference model included) and its start (the baseline evaluation of an --init_from model). The budget's clock
starts when the process does, so setting up (the interpreter, tokenizing, the measuring) is paid from it. The plan
is then the most steps whose time, with every evaluation and checkpoint they bring, ends the run at TARGET of the
budget; planned at step `after` (0 for the throwaway probe, the measured steps' last in the run):

    start_s + first_extra_s + (steps - after) * step_s + evaluations(after, steps) * eval_s
        + checkpoints(after, steps) * save_s  <=  TARGET * budget - spent

and the learning-rate schedule (warm-up, cosine to the minimum) is laid over exactly those steps, so a budget run
that plans N steps trains as `--max_steps N` does, bit for bit. --max_steps and --epochs stay upper bounds.

While training, the guard component (components/budget.py) projects the end from the recent step time every
`check_every` steps (about every 1% of the budget). When the machine slows down (or runs faster than measured)
and the projection leaves [LOW, HIGH] of the budget, the run is re-planned from that step: the rest of the
schedule is stretched or compressed so the decay still completes at the new last step (optim.py
WarmupCosine.end_at), and the change is logged. The plan and its re-plans are saved in every checkpoint
(train_info.json): --resume continues them, measuring nothing again, so resume stays bit-exact; every rank of a
distributed run decides from the same numbers: the slowest rank's (ranks wait for each other at every collective,
so a rank-0-only evaluation such as the samples costs every rank its time).
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import ConfigError, TrainingError

TARGET = 0.97  # the plan ends the run here: 3% of the budget absorbs the noise of the measured step time
HIGH = 0.995  # a projected end past this share of the budget re-plans shorter
LOW = 0.94  # one before it re-plans longer (when --max_steps / --epochs leave room)
CHECK_SHARE = 0.01  # the guard looks at the clock about this often (a share of the budget)
PLAN_KEY = "time_budget"  # the plan's key in a checkpoint's train_info.json and in train_config.json
PROBE_DIR_NAME = ".time-budget-probe"  # the probe's scratch checkpoints, inside the run directory
IN_RUN_LEAST = 4  # a run plans on its own first steps when it may take this many (a warm-up and 3 timed)

_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0}
_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?")


def parse_duration(text: str | int | float, flag: str = "--time_budget") -> float:
    """Seconds in a duration: '90s', '10m', '2h', '1h30m', '1.5h', or a bare number of seconds ('600').
    ConfigError (naming `flag`) for anything else, and for zero."""
    s = str(text).strip().lower()
    seconds = None
    if re.fullmatch(r"\d+(?:\.\d+)?", s):
        seconds = float(s)
    elif s and (m := _DURATION.fullmatch(s)) and any(m.groups()):
        seconds = sum(float(v) * unit for v, unit in zip(m.groups(), _UNITS.values()) if v)
    if seconds is None:
        raise ConfigError(f"{flag} {text!r}: expected a duration such as 90s, 10m, 2h or 1h30m")
    if seconds <= 0:
        raise ConfigError(f"{flag} {text!r}: a budget must be longer than zero")
    return seconds


def format_duration(seconds: float) -> str:
    """'1h 05m', '9m 41s', '42.0s'."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(round(seconds), 60)
    return f"{m // 60}h {m % 60:02d}m" if m >= 60 else f"{m}m {s:02d}s"


def count_due(after: int, end: int, interval: int) -> int:
    """How many of the steps after+1 .. end are multiples of `interval` or the last (what every() counts)."""
    if end <= after:
        return 0
    return end // interval - after // interval + (1 if end % interval else 0)


@dataclass
class Costs:
    """What the probe measured, in seconds (the slowest rank's)."""

    step_s: float  # a steady optimizer step (the median of the timed ones)
    first_extra_s: float  # what the first step took beyond a steady one (allocation, compilation)
    eval_s: float  # one evaluation round: every component that runs at an evaluation step
    save_s: float  # one checkpoint (0 with --no-checkpoints)
    timed_steps: int  # steps the median is of
    start_s: float = 0.0  # building the run's Trainer and what it does before its first step


@dataclass(frozen=True)
class BudgetPlan:
    """The decision of a --time_budget run: saved in its checkpoints and continued on --resume. A re-plan is a
    new plan (replanned()), whose record of re-plans is this one's and the new one."""

    budget_s: float
    steps: int  # the steps planned before the first one (the schedule's length, re-plans aside)
    limit: int  # the most steps --max_steps / --epochs allow
    step_s: float
    first_extra_s: float
    eval_s: float
    save_s: float
    eval_interval: int
    save_interval: int  # a huge number with --no-checkpoints: the cost is 0 then anyway
    setup_s: float  # seconds spent when the plan was made (the process's start, setting up, the measured steps)
    check_every: int  # steps between the guard's looks at the clock
    timed_steps: int = 0
    start_s: float = 0.0  # then building the run's Trainer and what it does before its first step
    replans: tuple[dict[str, Any], ...] = ()  # {"step", "steps", "step_s", "spent_s"}
    used_s: float = 0.0  # seconds of the budget spent when the last checkpoint was written
    planned_at: int = 0  # the step the plan was made after (the run's own measured steps; 0: before the first)

    @property
    def end(self) -> int:
        """The step the run ends at now: the plan's, or its last re-plan's."""
        return self.replans[-1]["steps"] if self.replans else self.steps

    def replanned(self, step: int, end: int, step_s: float, spent_s: float) -> BudgetPlan:
        """This plan, re-planned at `step` to end at `end` (steps taking `step_s`, `spent_s` of the budget gone)."""
        record = {"step": step, "steps": end, "step_s": round(step_s, 6), "spent_s": round(spent_s, 3)}
        return dataclasses.replace(self, replans=(*self.replans, record))

    def time_for(self, after: int, end: int, step_s: float) -> float:
        """Seconds from step `after` to the end of step `end`, with the evaluations and checkpoints due in them.
        Step `after`'s own evaluation and checkpoint, when due (with `end` the last step), are still to come: the
        guard looks at the clock before them (its component runs first), and ending at `after` itself makes them
        due. Step 0 has none."""
        first = max(after - 1, 0)
        return ((end - after) * step_s + count_due(first, end, self.eval_interval) * self.eval_s
                + count_due(first, end, self.save_interval) * self.save_s)

    def fit(self, seconds: float, after: int, step_s: float) -> int:
        """The last step (>= after, <= limit) that the run can reach within `seconds` from step `after`."""
        lo, hi = after, self.limit  # time_for grows with the end: bisect for the largest that fits
        if self.time_for(after, hi, step_s) <= seconds:
            return hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.time_for(after, mid, step_s) <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def summary(self) -> str:
        """The one line the run prints when it has planned."""
        at = self.planned_at
        evals = count_due(at, self.steps, self.eval_interval)
        saves = count_due(at, self.steps, self.save_interval) if self.save_s > 0 else 0
        planned = self.setup_s + self.start_s + self.first_extra_s + self.time_for(at, self.steps, self.step_s)
        why = "" if self.steps < self.limit else "; --max_steps / --epochs allow no more, so it ends early"
        where = f"the run's first {at} steps: a warm-up and {self.timed_steps} timed" if at else \
            f"{self.timed_steps} steps after a warm-up"
        return (f"time budget {format_duration(self.budget_s)}: {self.steps} step{'s' if self.steps != 1 else ''} "
                f"at {self.step_s:.3g} s "
                f"(measured over {where}), {evals} evaluation"
                f"{'s' if evals != 1 else ''} at {self.eval_s:.3g} s, {saves} checkpoint{'s' if saves != 1 else ''} "
                f"at {self.save_s:.3g} s, {format_duration(self.setup_s + self.start_s)} set-up: ends at about "
                f"{format_duration(planned)}{why}")

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "replans": list(self.replans)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BudgetPlan:
        given = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d}
        return cls(**{**given, "replans": tuple(given.get("replans", ()))})


def make_plan(budget_s: float, spent_s: float, costs: Costs, limit: int, eval_interval: int,
              save_interval: int | None, after: int = 0) -> BudgetPlan:
    """The steps that fit in what is left of the budget, from step `after` on (the steps the run measured itself
    on are taken: a plan ends no earlier). TrainingError when a plan made before the first step fits not one."""
    plan = BudgetPlan(budget_s=budget_s, steps=0, limit=limit, step_s=costs.step_s,
                      first_extra_s=costs.first_extra_s, eval_s=costs.eval_s,
                      save_s=costs.save_s if save_interval is not None else 0.0, eval_interval=eval_interval,
                      save_interval=save_interval or limit + 1, setup_s=spent_s, timed_steps=costs.timed_steps,
                      start_s=costs.start_s, planned_at=after,
                      check_every=max(1, int(CHECK_SHARE * budget_s / max(costs.step_s, 1e-9))))
    left = TARGET * budget_s - spent_s - costs.start_s - costs.first_extra_s
    plan = dataclasses.replace(plan, steps=plan.fit(left, after, costs.step_s))  # fit() reads the rest, not steps
    if plan.steps < 1:
        one = plan.time_for(0, 1, costs.step_s) + costs.first_extra_s
        raise TrainingError(f"--time_budget {format_duration(budget_s)} leaves no time to train: setting up takes "
                            f"{format_duration(spent_s + costs.start_s)}, and one step with its evaluation and "
                            f"checkpoint takes {format_duration(one)}; give a longer budget")
    return plan


def projected(plan: BudgetPlan, step: int, spent_s: float, step_s: float) -> float:
    """The budget's seconds spent at the end of the plan, from step `step` on at `step_s` a step."""
    return spent_s + plan.time_for(step, plan.end, step_s)


def replanned_end(plan: BudgetPlan, step: int, spent_s: float, step_s: float) -> int | None:
    """The new last step when the end projected from `step` (at `step_s` a step, `spent_s` of the budget gone)
    falls outside [LOW, HIGH] of the budget; None to keep the plan. Never past the limit, never before `step`."""
    end, at = plan.end, projected(plan, step, spent_s, step_s)
    if LOW * plan.budget_s <= at <= HIGH * plan.budget_s or (at < LOW * plan.budget_s and end >= plan.limit):
        return None
    new_end = plan.fit(TARGET * plan.budget_s - spent_s, step, step_s)
    return None if new_end == end else new_end


def process_age() -> float:
    """Seconds since this process started (Linux: /proc; elsewhere 0): a budget counts the interpreter's start
    and the imports too, which take seconds before the script's first line runs."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


class BudgetClock:
    """Seconds of the budget spent: since the script started, plus what the run spent before a --resume."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.spent_before: float | None = None  # set by the process's first plan: the checkpoint's, or 0

    def spent(self) -> float:
        return (self.spent_before or 0.0) + time.perf_counter() - self.started


def probe_count(first_s: float, budget_s: float) -> int:
    """Steps the probe times after its warm-up step (which took first_s, more than a steady one): 3 to 12,
    enough for 2 s or 2% of the budget, and never more than take 5% of it (a step of minutes is timed once)."""
    n = min(12, max(3, math.ceil(min(2.0, 0.02 * budget_s) / max(first_s, 1e-9))))
    return max(1, min(n, int(0.05 * budget_s / max(first_s, 1e-9))))


def in_run_steps(warmup_steps: int | None, eval_interval: int, save_interval: int | None, limit: int) -> int:
    """The most first steps a budget run may plan on (components/first_steps.py), or 0: it is probed on a
    throwaway Trainer instead. They must train as they would in a run of any length, so all of them are warm-up
    steps of a fixed --warmup_steps (not a --warmup_ratio of the length to be planned), and none is due for an
    evaluation or a checkpoint (save_interval None: checkpoints are off) or is the last the run may take; and they
    must be at least IN_RUN_LEAST."""
    if warmup_steps is None:
        return 0
    most = min(warmup_steps, eval_interval - 1, limit - 1, save_interval - 1 if save_interval else limit)
    return most if most >= IN_RUN_LEAST else 0
