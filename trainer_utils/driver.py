"""The run around the loop: every training script's entry point. It builds the session, decides how a --time_budget
run is planned (on its own first steps, or measured on a throwaway Trainer in a scratch run directory, or the plan
a resumed checkpoint recorded), hands the Trainer that plan, and after a precision fallback builds a new Trainer that
resumes in a wider precision.

    main(stage, argv, description)   parse the flags and --config, then run()
    run(config, stage)               (--preset auto: the planner's pick) -> session -> plan -> Trainer.fit()
                                     -> (fallback -> plan -> Trainer.fit()) ...
    plan_budget(session, clock)      the plan: resumed, left to the run's first steps (components/first_steps.py),
                                     or made from measure_costs() (trainer_utils/budget.py)

The Trainer (loop.py) knows nothing of how its plan was made: it trains to the plan's end, and its time budget's
guard (components/budget.py) replaces the plan with a re-planned one when the clock says so.
"""
from __future__ import annotations

import copy
import gc
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from common.device import timed
from common.errors import ConfigError, PocketLMError, TrainingError
from common.files import TRAIN_CONFIG_NAME
from model.inference import read_train_info

from .budget import (
    PLAN_KEY,
    PROBE_DIR_NAME,
    BudgetClock,
    BudgetPlan,
    Costs,
    format_duration,
    in_run_steps,
    make_plan,
    probe_count,
    process_age,
)
from .config import AUTO_PRESET, TrainConfig
from .data import StepFeeder
from .loop import Trainer, step_limit
from .metrics import MetricsLogger
from .planner import resolve_auto
from .runtime import tune_allocator
from .session import Session
from .stages import Stage, get_stage, parse_train_config


def main(stage: Stage | str, argv: list[str] | None, description: str | None) -> int:
    """A training script's whole entry point: parse its flags and --config, then train."""
    started = time.perf_counter() - process_age()  # a --time_budget counts from the process's start
    tune_allocator()  # before anything large is allocated
    try:
        config = parse_train_config(stage, argv, description)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run(config, stage, started)


def run(config: TrainConfig, stage: Stage | str, started: float | None = None) -> int:
    """Build the session and train. Errors that are the user's to fix become one `error: ...` line: exit 2
    for bad flags, data or checkpoints (nothing trained), 1 when training itself had to stop. `started`: the
    perf_counter() a --time_budget counts from (default: now)."""
    session = None
    clock = BudgetClock(time.perf_counter() if started is None else started)
    try:
        if config.model.preset == AUTO_PRESET:  # the plan's pick for the budget, before the model is built
            resolve_auto(config, get_stage(stage).name, clock.spent())
        session = Session(config, stage)
        while True:
            plan, first_steps = plan_budget(session, clock)  # after a precision fallback: the checkpoint's, resumed
            trainer = Trainer(session, plan, clock, first_steps)
            exit_code, fallback, plan = trainer.fit(), trainer.fallback, trainer.plan
            del trainer  # the next Trainer's model and optimizer must not coexist with this one's
            if plan is not None and session.env.rank == 0:
                print(f"time budget {format_duration(plan.budget_s)}: {format_duration(clock.spent())} spent "
                      f"({clock.spent() / plan.budget_s:.0%})", file=sys.stderr)
            if fallback is None:
                return exit_code
            free_memory(session.device)
            session.fall_back(fallback)
    except PocketLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1 if isinstance(e, TrainingError) else 2
    finally:
        if session is not None:
            session.backend.close()


def plan_budget(session: Session, clock: BudgetClock) -> tuple[BudgetPlan | None, int]:
    """A --time_budget run's plan: the one its checkpoint recorded when it resumes (nothing measured again), else
    (None, n) when the run plans on its own first n steps at most (budget.py in_run_steps), else made from this
    run's costs, measured on a throwaway Trainer. (None, 0) without a budget."""
    c, is_main = session.config, session.env.rank == 0
    o, budget_s = c.optim, c.optim.budget_s
    # train_info.json, not training_state.pt: the latter holds the optimizer's state, which the Trainer loads
    saved = read_train_info(session.resume_from).get(PLAN_KEY) if session.resume_from is not None else None
    if saved:
        plan = BudgetPlan.from_dict(saved)
        if budget_s is not None and budget_s != plan.budget_s:
            raise ConfigError(f"--time_budget {o.time_budget}: {session.run_dir} was planned for "
                              f"{format_duration(plan.budget_s)} ({plan.steps} steps); resume it with that budget "
                              "or none (the plan is kept), or start a new run")
        if clock.spent_before is None:  # this process's first plan: the budget spent before it goes on counting
            clock.spent_before = plan.used_s
        if is_main:
            print(f"time budget {format_duration(plan.budget_s)}: resuming the plan of {plan.end} steps, "
                  f"{format_duration(clock.spent())} of it spent", file=sys.stderr)
        return plan, 0
    if budget_s is None:
        return None, 0
    if session.resume_from is not None:
        if started_with_budget(session.run_dir):
            raise ConfigError(f"--time_budget: {session.resume_from} was saved before its run had planned its "
                              "budget (stopped while it measured its first steps); start the run again")
        raise ConfigError(f"--time_budget: {session.run_dir} was started without one; its steps are fixed (resume "
                          "it without --time_budget, or start a new run)")
    clock.spent_before = 0.0
    limit = step_limit(session)
    first_steps = in_run_steps(o.warmup_steps, c.eval.eval_interval, c.run.checkpoint_every, limit)
    if first_steps:
        return None, first_steps
    # the throwaway Trainer's run directory is a scratch one: its checkpoint, evaluation and marks go there
    scratch = copy.copy(session)
    scratch.run_dir = session.run_dir / PROBE_DIR_NAME
    t0 = time.perf_counter()
    probe = Trainer(scratch)
    try:  # the run builds its Trainer again after the plan: as long as this one took
        costs = measure_costs(probe, budget_s, time.perf_counter() - t0)
    finally:
        del probe  # its model and optimizer must not coexist with the run's
        free_memory(session.device)
        session.backend.barrier()
        if is_main:
            shutil.rmtree(scratch.run_dir, ignore_errors=True)
    # every rank plans from the same numbers: the slowest rank's costs and time spent (ranks that started a few
    # milliseconds apart could otherwise plan a step apart, and one would wait for the other at the end)
    spent = session.backend.slowest([clock.spent()])[0]
    plan = make_plan(budget_s, spent, costs, limit, c.eval.eval_interval, c.run.checkpoint_every)
    if is_main:
        print(plan.summary(), file=sys.stderr)
    return plan, 0


def started_with_budget(run_dir: Path) -> bool:
    """Whether the run in `run_dir` was started with a --time_budget (its train_config.json says)."""
    try:
        return bool(json.loads((run_dir / TRAIN_CONFIG_NAME).read_text()).get("optim", {}).get("time_budget"))
    except (OSError, ValueError, AttributeError):
        return False


def measure_costs(trainer: Trainer, budget_s: float, built_s: float) -> Costs:
    """What a run costs, measured as fit() pays it, on a Trainer built for this (it trains: discard it after):
    building it (built_s: this one took that), what fit() does before its first step (the components' start: an
    --init_from model's baseline evaluation), a warm-up step, a few timed steps, one checkpoint and one evaluation
    round. Every rank takes the same number of steps and gets the same costs: the slowest rank's."""
    s, backend = trainer.session, trainer.backend
    trainer.logger = MetricsLogger(s.run_dir, False, 0, 0, {})  # measuring logs nothing
    feeder = StepFeeder(s.train_data, trainer.config.optim.batch_size, trainer.config.optim.accumulation_steps,
                        backend.rank, backend.world_size, 0, trainer.device)
    step, device = lambda: trainer.optimizer_step(feeder), trainer.device  # noqa: E731
    trainer.model.train()
    try:
        start_s = built_s + timed(trainer.start_components, device)
        first_s = backend.slowest([timed(step, device)])[0]
        steps = [timed(step, device) for _ in range(probe_count(first_s, budget_s))]
    finally:
        feeder.close()
    save_s = timed(trainer.save, device) if trainer.config.run.checkpoints else 0.0
    eval_s = timed(trainer.evaluation_round, device)
    step_s, eval_s, save_s, start_s = backend.slowest([statistics.median(steps), eval_s, save_s, start_s])
    return Costs(step_s=step_s, first_extra_s=max(0.0, first_s - step_s), eval_s=eval_s, save_s=save_s,
                 timed_steps=len(steps), start_s=start_s)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
