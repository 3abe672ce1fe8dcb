"""A time budget planned on the run's own first steps (--time_budget with a fixed --warmup_steps: trainer_utils/
budget.py in_run_steps says when). The first step warms up and the next few are timed (budget.py probe_count, as
many as the warm-up and the first evaluation and checkpoint leave room for); after the last of them the run
rehearses one checkpoint, into a scratch directory removed after it, and one evaluation round, both timed and
leaving no trace on the run (Trainer.rehearsal), then makes its plan from the slowest rank's numbers and the budget
spent so far, and hands it to the loop. The loop lays the schedule over it (WarmupCosine.set_total: every step so
far was a warm-up step, whose learning rate is the same in a run of any length), so the measured steps are trained,
not thrown away, and the run is the one `--max_steps N` trains, bit for bit. From then on the guard
(components/budget.py) keeps the run to its plan.
"""
from __future__ import annotations

import shutil
import statistics
from typing import Callable

from common.device import timed

from ..budget import PROBE_DIR_NAME, Costs, make_plan, probe_count
from ..context import Report, RunContext
from .base import Component


class FirstStepsPlan(Component):
    def __init__(self, ctx: RunContext) -> None:
        self.most = ctx.first_steps  # the most steps it may measure (0: the run is not planned here)
        self.times: list[float] = []  # seconds of each step measured, the warm-up step's first
        self.last = 0  # the step it plans after, set when the warm-up step is timed (0: none)

    def wrap_step(self, ctx: RunContext, step: Callable[[], None]) -> Callable[[], None]:
        if not self.most or ctx.plan is not None:
            return step

        def measured() -> None:
            seconds = timed(step, ctx.device)
            if not self.times:  # the warm-up step: every rank times as many steps after it, the slowest's count
                seconds = ctx.backend.slowest([seconds])[0]
                self.last = 1 + min(probe_count(seconds, ctx.config.optim.budget_s), self.most - 1)
            self.times.append(seconds)
        return measured

    def due(self, step: int, last: int) -> bool:
        return step == self.last  # once: the steps go on past it

    def run(self, ctx: RunContext) -> Report:
        c, backend, scratch = ctx.config, ctx.backend, ctx.run_dir / PROBE_DIR_NAME
        # not training time (not pauses_clock: that would make it part of the evaluation round it rehearses)
        with ctx.clock.pause(), ctx.control.rehearsal(scratch):
            save_s = timed(ctx.control.save, ctx.device)
            eval_s = timed(ctx.control.evaluation_round, ctx.device)
        backend.barrier()
        if backend.is_main:
            shutil.rmtree(scratch, ignore_errors=True)
        # one plan on every rank: the slowest rank's numbers (the others wait for it at every collective)
        step_s, eval_s, save_s, spent = backend.slowest([statistics.median(self.times[1:]), eval_s, save_s,
                                                         ctx.budget_clock.spent()])
        costs = Costs(step_s=step_s, first_extra_s=0.0, eval_s=eval_s, save_s=save_s,
                      timed_steps=len(self.times) - 1)
        plan = make_plan(c.optim.budget_s, spent, costs, ctx.control.total_steps, c.eval.eval_interval,
                         c.run.checkpoint_every, after=ctx.state.step)
        ctx.logger.message(plan.summary())
        return Report(plan=plan)  # the loop records it: from the next step on, the run has its plan
