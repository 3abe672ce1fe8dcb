"""--time_budget: durations, the plan's arithmetic, the schedule's re-plan, a budget run against --max_steps N,
resume of the recorded plan, re-planning when the machine slows down or speeds up, the guard's decisions at their
edges (without training: its recent window, the slow-down test and the rule for planning longer), and bad values.
The plan's arithmetic by itself, in more detail: tests/test_budget_plan.py."""
from __future__ import annotations

import json
import math
import random
import time as real_time
from types import SimpleNamespace

import pytest
import torch
from test_train import flags, stop_at, weights

import train_pretrain
from common import device as device_mod
from common.errors import ConfigError, TrainingError
from model.inference import read_train_info
from trainer_utils import budget as budget_mod
from trainer_utils import driver as driver_mod
from trainer_utils import loop as loop_mod
from trainer_utils import metrics as metrics_mod
from trainer_utils.backend import Backend, Comm
from trainer_utils.budget import TARGET, BudgetPlan, Costs, count_due, make_plan, parse_duration, replanned_end
from trainer_utils.checkpoint import latest_checkpoint
from trainer_utils.components.budget import TimeBudgetGuard, shown
from trainer_utils.components.evaluation import Evaluation
from trainer_utils.loss_model import RECIPE
from trainer_utils.optim import WarmupCosine
from trainer_utils.session import Session
from trainer_utils.stages import parse_train_config

from conftest import ROOT, read_metrics, strict_records


@pytest.mark.parametrize("text,seconds", [("90s", 90), ("10m", 600), ("2h", 7200), ("1h30m", 5400), ("1.5h", 5400),
                                          ("600", 600), (" 45S ", 45), ("2m30s", 150), (300, 300)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["0", "0s", "-5m", "2 hours", "", "10x", "m", "1h-5m", "1e3", "30m1h"])
def test_bad_durations_are_refused(text):
    with pytest.raises(ConfigError, match="--time_budget"):
        parse_duration(text)


@pytest.mark.parametrize("value", ["0", "-5m", "2 hours"])
def test_a_bad_budget_is_a_one_line_error_before_anything_runs(corpus, tmp_path, capsys, value):
    assert train_pretrain.main([*flags(corpus, tmp_path), f"--time_budget={value}"]) == 2  # '=': "-5m" is no flag
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --time_budget") and not (tmp_path / "run").exists(), err


def test_count_due_counts_what_every_counts():
    for interval in (1, 3, 4, 7):
        for after in range(0, 12):
            for end in range(after, 25):
                expected = sum(1 for s in range(after + 1, end + 1) if s % interval == 0 or s == end)
                assert count_due(after, end, interval) == expected, (after, end, interval)


COSTS = Costs(step_s=1.0, first_extra_s=2.0, eval_s=5.0, save_s=0.5, timed_steps=3)


def test_the_plan_is_the_most_steps_that_fit():
    plan = make_plan(600.0, 30.0, COSTS, limit=10_000, eval_interval=100, save_interval=50)
    left = TARGET * 600 - 30 - 2
    n = plan.steps
    assert plan.time_for(0, n, 1.0) <= left < plan.time_for(0, n + 1, 1.0)
    # 514 steps: 514 s + 6 evaluations (5 multiples of 100 and the last) * 5 s + 11 checkpoints * 0.5 s = 549.5 s
    assert (n, count_due(0, n, 100), count_due(0, n, 50)) == (514, 6, 11)
    assert "514 steps" in plan.summary() and "6 evaluations" in plan.summary()
    assert make_plan(600.0, 30.0, COSTS, limit=300, eval_interval=100, save_interval=50).steps == 300  # the bound
    no_saves = make_plan(600.0, 30.0, COSTS, limit=10_000, eval_interval=100, save_interval=None)
    assert no_saves.save_s == 0 and no_saves.steps > n
    with pytest.raises(TrainingError, match="leaves no time to train"):
        make_plan(60.0, 50.0, COSTS, limit=100, eval_interval=100, save_interval=50)


def test_replan_keeps_a_plan_on_time_and_moves_one_that_is_not():
    plan = make_plan(1000.0, 0.0, Costs(1.0, 0.0, 0.0, 0.0, 3), limit=2000, eval_interval=10**9, save_interval=None)
    assert plan.steps == 970
    assert replanned_end(plan, 100, 100.0, 1.0) is None  # on time
    slower = replanned_end(plan, 100, 100.0, 1.5)  # 870 steps left would end at 1405 s
    assert slower == 100 + int((970 - 100) / 1.5)
    faster = replanned_end(plan, 100, 100.0, 0.8)  # would end at 796 s: more steps fit, and --max_steps allows them
    assert faster == 100 + int(870 / 0.8)
    capped = make_plan(1000.0, 0.0, Costs(1.0, 0.0, 0.0, 0.0, 3), limit=970, eval_interval=10**9, save_interval=None)
    assert replanned_end(capped, 100, 100.0, 0.5) is None  # no room above the limit
    assert replanned_end(plan, 500, 995.0, 1.0) == 500  # the budget is spent: end here


def test_a_replanned_schedule_is_continuous_and_still_reaches_the_minimum():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    plain = WarmupCosine(opt, max_lr=1.0, min_lr=0.1, warmup=10, total=100)
    moved = WarmupCosine(opt, max_lr=1.0, min_lr=0.1, warmup=10, total=100)
    assert [plain.lr_at(s) for s in range(100)] == [moved.lr_at(s) for s in range(100)]
    moved.end_at(40, 70)  # slower: the last 60 steps' decay in 30
    assert [moved.lr_at(s) for s in range(41)] == [plain.lr_at(s) for s in range(41)]  # the past is kept
    assert moved.end == 70 and moved.lr_at(70) == pytest.approx(0.1)
    assert moved.lr_at(55) == pytest.approx(plain.lr_at(70))  # halfway through what is left
    lrs = [moved.lr_at(s) for s in range(10, 71)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # still decaying, no jump
    moved.end_at(60, 90)  # then faster again
    assert moved.lr_at(60) == pytest.approx(plain.lr_at(80)) and moved.lr_at(90) == pytest.approx(0.1)
    moved.end_at(62, 62)  # no time left: ends at once
    assert moved.end == 62


class VirtualTime:
    """time.perf_counter for the loop, the train clock and the budget: seconds advanced by the test (each
    optimizer step costs step_cost(step)), so the budget's decisions are deterministic."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return real_time.time()


def virtual_clock(monkeypatch, step_cost, *, eval_s: float = 0.0, save_s: float = 0.0, build_s: float = 0.0,
                  age_s: float = 0.0) -> VirtualTime:
    """Each optimizer step costs step_cost(step) virtual seconds; an evaluation round eval_s, a checkpoint save_s,
    building a model build_s; the process was age_s old when main() began (the interpreter and imports)."""
    # The CPU's bf16 speed is timed once a process and cached: timed first under the frozen clock, it read 0x,
    # and every later test in the process (a Muon run's Newton-Schulz format) took this CPU for one without bf16
    device_mod.cpu_capabilities()
    clock = VirtualTime()
    for module in (loop_mod, driver_mod, metrics_mod, budget_mod, device_mod):  # device_mod: timed()
        monkeypatch.setattr(module, "time", clock)
    monkeypatch.setattr(driver_mod, "process_age", lambda: age_s)

    def costs(seconds, real):
        def charged(*args, **kwargs):
            clock.now += seconds
            return real(*args, **kwargs)
        return charged

    real_step = loop_mod.Trainer.optimizer_step
    monkeypatch.setattr(loop_mod.Trainer, "optimizer_step",  # the step's time passes while it runs
                        lambda self, feeder: costs(step_cost(self.state.step + 1), real_step)(self, feeder))
    monkeypatch.setattr(Evaluation, "evaluate", costs(eval_s, Evaluation.evaluate))
    monkeypatch.setattr(loop_mod, "save_checkpoint", costs(save_s, loop_mod.save_checkpoint))
    monkeypatch.setattr(Session, "build_model", costs(build_s, Session.build_model))
    return clock


def budget_flags(corpus, tmp_path, run, **over):
    return flags(corpus, tmp_path, run, **{"time_budget": "40s", "max_steps": 100, "eval_interval": 10,
                                           "save_interval": 10, "log_interval": 1, **over})


def resolved(run_dir) -> dict:
    return json.loads((run_dir / "train_config.json").read_text())["resolved"]


def test_a_budget_run_trains_exactly_as_max_steps_of_its_plan(corpus, tmp_path, monkeypatch):
    virtual_clock(monkeypatch, lambda step: 1.0)
    assert train_pretrain.main(budget_flags(corpus, tmp_path, "budget")) == 0
    plan = resolved(tmp_path / "budget")["time_budget"]
    # a virtual second a step, nothing else costs: 0.97 * 40 s less the probe's steps (a warm-up and 2 timed)
    assert (plan["step_s"], plan["timed_steps"], plan["setup_s"]) == (1.0, 2, 3.0)
    assert plan["steps"] == 35 == resolved(tmp_path / "budget")["total_steps"] and plan["replans"] == []
    monkeypatch.undo()
    assert train_pretrain.main(flags(corpus, tmp_path, "fixed", max_steps=35, eval_interval=10, save_interval=10,
                                     log_interval=1)) == 0
    a, b = read_metrics(tmp_path / "budget"), read_metrics(tmp_path / "fixed")
    assert [m["loss"] for m in a] == [m["loss"] for m in b] and [m["lr"] for m in a] == [m["lr"] for m in b]
    wa, wb = weights(tmp_path / "budget"), weights(tmp_path / "fixed")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not (tmp_path / "budget" / budget_mod.PROBE_DIR_NAME).exists()  # the probe's scratch checkpoint


def test_the_plan_counts_everything_the_run_pays_and_ends_in_its_band(corpus, tmp_path, monkeypatch):
    """Every cost the run pays is virtual here: the process's age, building each model, an --init_from model's
    baseline evaluation, evaluations and checkpoints. A plan that counts them all ends the run inside [LOW, HIGH]
    of the budget on a steady machine, with no re-plan to rescue it."""
    virtual_clock(monkeypatch, lambda step: 1.0)
    assert train_pretrain.main(flags(corpus, tmp_path, "base", max_steps=2)) == 0  # what --init_from starts from
    monkeypatch.undo()
    clock = virtual_clock(monkeypatch, lambda step: 1.0, eval_s=2.0, save_s=1.0, build_s=3.0, age_s=5.0)
    began = clock.now - 5.0
    init = {"init_from": str(tmp_path / "base"), "preset": None}
    assert train_pretrain.main(budget_flags(corpus, tmp_path, "run", **init)) == 0
    plan = resolved(tmp_path / "run")["time_budget"]
    # by hand: when the plan is made, 16 s are spent: the age 5, the probe's model 3, its baseline evaluation 2,
    # a warm-up step 1, two timed steps 2, a checkpoint 1, an evaluation 2. The run will pay 5 more before its first
    # step (its model, its baseline). 0.97 * 40 - 21 = 17.8 s: 11 steps + 2 evaluations (10, 11) + 2 checkpoints =
    # 17 s fit; 12 steps would take 18.
    assert (plan["setup_s"], plan["start_s"], plan["eval_s"], plan["save_s"]) == (16.0, 5.0, 2.0, 1.0)
    assert plan["steps"] == 11
    assert not [r for r in strict_records(tmp_path / "run") if r.get("event") == "time_budget"]  # no re-plan
    assert read_train_info(latest_checkpoint(tmp_path / "run"))["time_budget"]["replans"] == []
    spent = clock.now - began  # 16 + 5 + 11 + 4 + 2 = 38 s
    assert budget_mod.LOW * 40 <= spent <= budget_mod.HIGH * 40 and spent == 38.0


def test_resume_continues_the_recorded_plan_bit_exactly(corpus, tmp_path, monkeypatch):
    virtual_clock(monkeypatch, lambda step: 1.0)
    assert train_pretrain.main(budget_flags(corpus, tmp_path, "straight")) == 0
    stop_at(monkeypatch, 20)
    assert train_pretrain.main(budget_flags(corpus, tmp_path, "resumed")) == 0
    state = read_train_info(latest_checkpoint(tmp_path / "resumed"))
    assert state["time_budget"]["steps"] == 35 and state["time_budget"]["used_s"] > 20
    monkeypatch.undo()
    virtual_clock(monkeypatch, lambda step: 1.0)
    monkeypatch.setattr(driver_mod, "measure_costs", lambda *a: pytest.fail("a resumed plan is not measured again"))
    assert train_pretrain.main(budget_flags(corpus, tmp_path, "resumed", resume=True)) == 0
    wa, wb = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [m["step"] for m in read_metrics(tmp_path / "resumed")] == list(range(1, 36))
    # another budget than the plan's is refused
    assert train_pretrain.main(budget_flags(corpus, tmp_path, "resumed", resume=True, time_budget="1h")) == 2


def test_resume_after_a_replan_continues_it_bit_exactly(corpus, tmp_path, monkeypatch):
    def slower(step):
        return 1.0 if step < 10 else 3.0

    virtual_clock(monkeypatch, slower, eval_s=0.5, save_s=0.25)
    assert train_pretrain.main(budget_flags(corpus, tmp_path, "straight")) == 0
    events = [r for r in strict_records(tmp_path / "straight") if r.get("event") == "time_budget"]
    assert events and events[0]["steps"] < 35  # re-planned shorter, then trained to the new end
    stop_at(monkeypatch, events[0]["step"] + 2)  # stopped after the re-plan
    assert train_pretrain.main(budget_flags(corpus, tmp_path, "resumed")) == 0
    assert read_train_info(latest_checkpoint(tmp_path / "resumed"))["time_budget"]["replans"]
    monkeypatch.undo()
    virtual_clock(monkeypatch, slower, eval_s=0.5, save_s=0.25)
    monkeypatch.setattr(driver_mod, "measure_costs", lambda *a: pytest.fail("a resumed plan is not measured again"))
    assert train_pretrain.main(budget_flags(corpus, tmp_path, "resumed", resume=True)) == 0
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [(m["step"], m["loss"], m["lr"]) for m in a] == [(m["step"], m["loss"], m["lr"]) for m in b]
    assert a[-1]["lr"] == pytest.approx(1e-4)  # the re-planned decay completed
    wa, wb = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_run_without_a_budget_is_not_resumed_with_one(corpus, tmp_path, capsys):
    assert train_pretrain.main(flags(corpus, tmp_path, "plain", max_steps=4)) == 0
    assert train_pretrain.main(flags(corpus, tmp_path, "plain", max_steps=8, resume=True, time_budget="1m")) == 2
    assert "started without one" in capsys.readouterr().err


@pytest.mark.parametrize("cost,ends", [(3.0, "earlier"), (0.5, "later")])
def test_a_slower_or_faster_machine_is_replanned_to_end_within_the_budget(corpus, tmp_path, monkeypatch, capsys,
                                                                           cost, ends):
    # 1 s a step while the probe measures, then `cost` from step 10 on
    clock = virtual_clock(monkeypatch, lambda step: 1.0 if step < 10 else cost)
    started = clock.now
    assert train_pretrain.main(budget_flags(corpus, tmp_path, "run")) == 0
    records = strict_records(tmp_path / "run")
    events = [r for r in records if r.get("event") == "time_budget"]
    last = read_metrics(tmp_path / "run")[-1]
    assert events and events[0]["planned_steps"] == 35
    assert (last["step"] < 35) if ends == "earlier" else (last["step"] > 35)
    # on screen, the re-plans that moved the end a tenth or more from the last end shown (35 at first): 3 s steps
    # re-plan 35 -> 33 (hidden), then 33 -> 17; 0.5-s steps lengthen it a few steps at a time
    lines, last_shown = [], 35
    for e in events:
        if abs(e["steps"] - last_shown) >= 0.1 * last_shown:
            lines.append(f"time budget: steps take {e['step_time_s']:.3g} s (planned 1 s) with "
                         f"{budget_mod.format_duration(e['spent_s'])} of 40.0s spent: ending at step {e['steps']} "
                         f"instead of {e['planned_steps']}, the learning-rate decay completing there")
            last_shown = e["steps"]
    screen = [line for line in capsys.readouterr().err.splitlines() if line.startswith("time budget: ")]
    assert screen == lines and 1 <= len(lines) < len(events)
    assert last["step"] == events[-1]["steps"]
    spent = clock.now - started
    assert 0.90 * 40 <= spent <= 40, spent  # the goal: 90-105% of the budget; with virtual time, within it
    min_lr = 1e-3 / 10
    assert last["lr"] == pytest.approx(min_lr)  # the decay completed at the new last step
    assert (tmp_path / "run" / "latest").read_text().strip().endswith(f"step_{last['step']:08d}")
    plan = read_train_info(latest_checkpoint(tmp_path / "run"))["time_budget"]
    assert plan["replans"] and plan["replans"][-1]["steps"] == last["step"]


def test_a_replan_that_stops_now_makes_this_step_the_last_with_its_evaluation_and_checkpoint(corpus, tmp_path,
                                                                                              monkeypatch, capsys):
    hang = 27.87654321  # step 9 hangs: 3 s of probe + 8 steps + this = 38.87654321 s of 40 spent
    virtual_clock(monkeypatch, lambda step: hang if step == 9 else 1.0)
    assert train_pretrain.main(budget_flags(corpus, tmp_path, "run")) == 0
    [event] = [r for r in strict_records(tmp_path / "run") if r.get("event") == "time_budget"]
    # one slow look is not expected again (the run's step time leaves it out, 1 s), but its time is spent: not one
    # more 1-s step fits before 97% of the budget (38.8 s)
    assert {k: v for k, v in event.items() if k != "time"} == {
        "step": 9, "event": "time_budget", "planned_steps": 35, "steps": 9, "step_time_s": 1.0, "spent_s": 38.877}
    assert ("time budget: steps take 1 s (planned 1 s) with 38.9s of 40.0s spent: stopping now, at step 9 of 35"
            in capsys.readouterr().err)
    replans = read_train_info(latest_checkpoint(tmp_path / "run"))["time_budget"]["replans"]
    assert replans == [{"step": 9, "steps": 9, "step_s": 1.0, "spent_s": 38.877}]
    assert [r["step"] for r in strict_records(tmp_path / "run") if "val_loss" in r] == [9]  # not a multiple of 10
    assert latest_checkpoint(tmp_path / "run").name.endswith("step_00000009")


def test_a_hang_is_paid_but_the_rest_is_planned_at_the_runs_step_time(corpus, tmp_path, monkeypatch):
    """Step 9 hangs for 24.9 s (35.9 s of 40 spent): the rest is planned at the run's 1 s, not at the hang's time
    (which would stop the run there): 2.9 s to 38.8 s hold 2 more steps."""
    virtual_clock(monkeypatch, lambda step: 24.87654321 if step == 9 else 1.0)
    assert train_pretrain.main(budget_flags(corpus, tmp_path, "run")) == 0
    [event] = [r for r in strict_records(tmp_path / "run") if r.get("event") == "time_budget"]
    assert (event["step"], event["steps"], event["step_time_s"]) == (9, 11, 1.0)
    assert read_metrics(tmp_path / "run")[-1]["step"] == 11


def test_the_plan_refuses_a_budget_setting_up_already_spent(corpus, tmp_path, monkeypatch, capsys):
    virtual_clock(monkeypatch, lambda step: 10.0)
    assert train_pretrain.main(budget_flags(corpus, tmp_path, "run", time_budget="30s")) == 1
    err = capsys.readouterr().err
    assert "error: --time_budget 30.0s leaves no time to train" in err, err


def test_every_rank_plans_with_the_slowest_ranks_costs():
    """Ranks wait for each other at every collective: what rank 0 alone spends (its samples at an evaluation, its
    share of a checkpoint) every rank pays, so a plan counts the slowest rank's seconds, not their mean."""
    theirs = [0.5, 4.0]  # rank 0's step and evaluation round

    class SecondOfTwo(Comm):
        rank, world_size = 1, 2

        def all_reduce_sum(self, tensor):  # what the collective adds: rank 0's row
            other = torch.zeros_like(tensor)
            other[0] = torch.tensor(theirs, dtype=tensor.dtype)
            return tensor + other

    backend = Backend(SecondOfTwo(), torch.device("cpu"), None)
    assert backend.slowest([0.625, 0.25]) == [0.625, 4.0]


def test_the_probe_times_a_few_steps_within_a_share_of_the_budget():
    assert budget_mod.probe_count(0.01, 600) == 12  # fast steps: up to 12
    assert budget_mod.probe_count(1.0, 600) == 3  # at least 3
    assert budget_mod.probe_count(20.0, 600) == 1  # slow steps: within 5% of the budget
    assert math.isclose(parse_duration("1h"), 3600)


def test_the_plan_round_trips_through_a_checkpoint_dict():
    planned = make_plan(600.0, 30.0, COSTS, limit=10_000, eval_interval=100, save_interval=50)
    plan = planned.replanned(10, 400, 1.2, 50.0)
    assert plan.replans == ({"step": 10, "steps": 400, "step_s": 1.2, "spent_s": 50.0},) and planned.replans == ()
    again = BudgetPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan and again.end == 400


# ------------------------------------------------------------------------ the guard alone, one look at a time
# The guard's decisions at their edges, without training: a run is its first mark (training seconds, step) and the
# looks the loop would have it take. A 100-s budget: the recent step time is measured over 5 s (WINDOW_SHARE), the
# band is [94, 99.5] s and a re-plan aims at 97 s. Steps are the only cost.
def guard_plan(steps: int, limit: int, check_every: int = 1) -> BudgetPlan:
    return BudgetPlan(budget_s=100.0, steps=steps, limit=limit, step_s=1.0, first_extra_s=0.0, eval_s=0.0,
                      save_s=0.0, eval_interval=10**6, save_interval=10**6, setup_s=0.0, check_every=check_every)


class GuardRun:
    """A TimeBudgetGuard on a fake run: the clocks and step are set by the test, the backend is one rank, and the
    re-plans it returns, its records and messages are kept."""

    def __init__(self, plan: BudgetPlan | None) -> None:
        self.elapsed, self.spent, self.ends, self.records, self.messages = 0.0, 0.0, [], [], []
        self.ctx = SimpleNamespace(
            plan=plan, budget_clock=SimpleNamespace(spent=lambda: self.spent), state=SimpleNamespace(step=0),
            clock=SimpleNamespace(elapsed=lambda: self.elapsed), backend=SimpleNamespace(slowest=list),
            logger=SimpleNamespace(log=self.records.append, message=self.messages.append))
        self.guard = TimeBudgetGuard(self.ctx)
        self.guard.start(self.ctx)

    def replan(self, plan: BudgetPlan) -> None:
        """As the loop does with a re-planned plan: it trains to its end from now on."""
        self.ends.append(plan.end)
        self.ctx.plan = plan

    def step(self, elapsed: float, step: int, spent: float = 0.0) -> None:
        """As the loop does after an optimizer step, before the components that are due run."""
        self.elapsed, self.ctx.state.step, self.spent = elapsed, step, spent
        self.guard.after_step(self.ctx, None)

    def look(self, elapsed: float, step: int, spent: float) -> None:
        """A step at which the guard is due, and runs."""
        self.step(elapsed, step, spent)
        assert self.guard.due(step, self.ctx.plan.end)
        report = self.guard.run(self.ctx)
        if report is not None:
            assert report.stop is None and report.measured == {}
            self.replan(report.plan)


def guard_ends(plan: BudgetPlan, *looks: tuple[float, int, float]) -> list[int]:
    """The ends the guard re-plans `plan` to: its first mark after step 1 at 2 s of training (the first step's
    extra), then a look at each (training seconds, step, budget seconds spent)."""
    run = GuardRun(plan)
    run.step(2.0, 1)
    for look in looks:
        run.look(*look)
    return run.ends


def test_the_guard_looks_every_check_every_steps_after_its_first_mark_and_before_the_last():
    run = GuardRun(guard_plan(steps=10, limit=10, check_every=3))
    assert not run.guard.due(3, 10)  # no mark yet: the first step has not been measured
    run.step(2.0, 1)
    assert [s for s in range(1, 11) if run.guard.due(s, 10)] == [3, 6, 9]  # not 10: nothing left to plan there
    assert not run.guard.due(9, 9)
    every = GuardRun(guard_plan(steps=10, limit=10))
    every.step(2.0, 1)
    assert [s for s in range(1, 11) if every.guard.due(s, 10)] == list(range(2, 10))  # not the first mark's step
    alone = GuardRun(None)  # no budget: no guard
    alone.step(2.0, 1)
    assert not [s for s in range(1, 11) if alone.guard.due(s, 10)] and alone.guard.describe() == {}
    plan = guard_plan(steps=10, limit=10)
    assert GuardRun(plan).guard.describe() == {"time_budget": plan.to_dict()}


def test_the_step_times_take_the_recent_median_and_leave_out_a_look_far_above_it():
    """Looks (seconds a step since the mark before): 0.2 (8 s / 40 steps), 0.4 (8 / 20), 0.4 (2 / 5), 1.0 (3 / 3),
    0.5 (1 / 2), 70 s / 70 steps in all. The recent step time is the median of the looks since the newest mark at
    least the window back, three looks at least; the run's leaves out the looks over twice the recent one."""
    guard = GuardRun(guard_plan(steps=100, limit=100)).guard
    guard.marks[:] = [(2.0, 1), (10.0, 41), (18.0, 61), (20.0, 66), (23.0, 69), (24.0, 71)]
    assert guard.step_times(5.0) == (22 / 70, 0.5)  # since 18 s: 0.4, 1.0, 0.5; 1.0 is not over 2 x 0.5
    assert guard.step_times(6.0)[1] == 0.5  # 18 s is exactly 6 s back: far enough
    assert guard.step_times(6.5) == (19 / 67, 0.45)  # since 10 s: 0.4, 0.4, 1.0, 0.5; 1.0 is over 2 x 0.45
    assert guard.step_times(1.0)[1] == 0.5  # since 23 s: 0.5 alone, so the last three looks


def test_the_guard_waits_out_its_first_window_whatever_the_last_steps_took():
    """4.5 s of training after the first step (under 5 s): at 1.5 s a step the 46 steps left would end at 113.5 s,
    and the last two steps took 2 s each, but the guard keeps the probe's plan until its window has passed."""
    assert guard_ends(guard_plan(steps=50, limit=50), (2.5, 2, 40.5), (6.5, 4, 44.5)) == []


def test_the_guard_plans_from_its_steady_time_once_a_window_has_passed():
    """Exactly 5 s after the first step, at 0.5 s a step: the 39 steps left would end at 64.5 s, so it plans
    longer, 52 s of steps after step 11 at 0.5 s: to step 115."""
    assert guard_ends(guard_plan(steps=50, limit=200), (7.0, 11, 45.0)) == [115]


def decision(plan: BudgetPlan, marks: list[tuple[float, int]], look: tuple[float, int, float]) -> GuardRun:
    """The guard's look at (training seconds, step, budget seconds spent) after the marks of its earlier looks
    (the first after step 1), with no re-plan among them."""
    run = GuardRun(plan)
    run.guard.marks[:] = marks
    run.look(*look)
    return run


def test_a_recent_step_time_exactly_a_quarter_above_the_runs_is_no_slow_down():
    """Looks of 0.5 s a step (4.5 s / 9 steps), then 1.25 s (10 s / 8, 7.5 s / 6, 5 s / 4): the run's step time is
    27 s / 27 steps = 1 s, the recent one the median of the last three looks, 1.25 s: exactly SLOWER times it, not
    a slow-down. At 1 s the 31 steps left end at 97 s, inside the band; at 1.25 s they would end at 104.75 s and
    the run would be cut."""
    marks = [(2.0, 1), (6.5, 10), (16.5, 18), (24.0, 24)]
    assert decision(guard_plan(steps=59, limit=59), marks, (29.0, 28, 66.0)).ends == []


def test_a_slow_down_is_planned_at_once_from_the_recent_step_time():
    """Looks of 1 s a step, then two of 3 s (9 s / 3 steps each): the recent step time, the median of the last
    three looks (1, 3, 3), is 3 s; the run's leaves out the looks over twice the median look's (1 s): 30 s / 30
    steps = 1 s. At 3 s the 22 steps left would end at 154 s: a slow-down, planned at once at 3 s: the 9 s to 97 s
    hold 3 steps, to step 40."""
    marks = [(2.0, 1), (12.0, 11), (22.0, 21), (32.0, 31), (41.0, 34)]
    assert decision(guard_plan(steps=59, limit=59), marks, (50.0, 37, 88.0)).ends == [40]


def test_one_slow_look_is_paid_but_not_expected_again():
    """The same run one look earlier: one look of 3 s a step among looks of 1 s is no slow-down (the recent median
    is 1 s), and it is left out of the run's step time, 1 s. Its time is spent, though: at 1 s the 25 steps left
    end at 104 s, so the run is planned shorter at 1 s, the 18 s to 97 s holding 18 steps: step 52 (at 3 s, 6)."""
    marks = [(2.0, 1), (12.0, 11), (22.0, 21), (32.0, 31)]
    assert decision(guard_plan(steps=59, limit=59), marks, (41.0, 34, 79.0)).ends == [52]


@pytest.mark.parametrize("spent,ends", [
    (64.75, []),  # at 1 s the 35 steps left end at 99.75 s: no slow-down (within the budget), and too long to go on
    (65.0, []),  # ... end at 100 s: still within it
    (66.0, [57])])  # ... end at 101 s: a slow-down; 31 s to 97 s hold 31 steps
def test_planning_longer_needs_the_recent_step_time_to_agree(spent, ends):
    """Steps 2-11 at 0.4 s, then 12-26 at 1 s: the run's step time is 19 s / 25 = 0.76 s, the recent one (the median
    of the last three looks) 1 s, more than SLOWER times it. At 0.76 s the 35 steps left would end early (at most
    66 + 26.6 = 92.6 s) and the run could go on, but at the recent 1 s they do not end early: the plan is kept,
    unless the recent time overruns the budget, which is a slow-down."""
    marks = [(2.0, 1), (6.0, 11), (11.0, 16), (16.0, 21)]
    assert decision(guard_plan(steps=61, limit=200), marks, (21.0, 26, spent)).ends == ends


def test_a_longer_plan_is_the_recent_step_times_when_both_agree():
    """The run's step time 19 s / 28 = 0.679 s, the recent one the median of three looks of 5 s / 6 steps, 0.833 s
    (not a slow-down: under 1.25 x 0.679 = 0.848): both end the 32 steps left early (at 71.8 s and 76.8 s). The
    longer run is planned at the slower 0.833 s: 46.9 s to 97 s hold 56 steps after step 29 (at 0.679 s, 69)."""
    run = decision(guard_plan(steps=61, limit=200), [(2.0, 1), (6.0, 11), (11.0, 17), (16.0, 23)],
                   (21.0, 29, 50.12345))  # (recorded to the millisecond)
    assert run.ends == [85]
    assert run.ctx.plan.replans == ({"step": 29, "steps": 85, "step_s": 0.833333, "spent_s": 50.123},)
    assert run.records == [{"step": 29, "event": "time_budget", "planned_steps": 61, "steps": 85,
                            "step_time_s": 0.833333, "spent_s": 50.123}]
    assert run.messages == ["time budget: steps take 0.833 s (planned 1 s) with 50.1s of 1m 40s spent: ending at "
                            "step 85 instead of 61, the learning-rate decay completing there"]


def test_within_the_first_window_the_recent_time_is_the_median_of_every_look():
    """Looks of 0.2, 1, 1 and 0.2 s a step in the first 2.4 s (under the 5-s window): the recent time is their
    median, 0.6 s, the run's too (2.4 s / 4 steps): no slow-down, and too early for anything else. (From the last
    three looks alone it would be 1 s, 1.67x the run's: the 95 steps left would overrun and the run be cut.)"""
    marks = [(2.0, 1), (2.2, 2), (3.2, 3), (4.2, 4)]
    assert decision(guard_plan(steps=100, limit=100), marks, (4.4, 5, 10.0)).ends == []


def test_a_shorter_plan_is_the_runs_step_time_even_when_the_recent_one_is_slower():
    """The run's step time 19 s / 26 = 0.731 s, the recent one 0.833 s (5 s / 6 steps, not a slow-down: under
    1.25 x 0.731): at 0.731 s the 34 steps left end at 100.8 s, so it plans shorter at the run's time: 21 s to 97 s
    hold 28 steps, to step 55 (planning at the recent time is for a longer run only)."""
    marks = [(2.0, 1), (6.0, 9), (11.0, 15), (16.0, 21)]
    assert decision(guard_plan(steps=61, limit=61), marks, (21.0, 27, 76.0)).ends == [55]


def test_after_a_replan_the_guard_waits_a_few_looks_before_the_next():
    """Steps at 1 s, then at 0.8 s from step 32 on. At step 41 (8 s / 10 steps) the run's time is 38 s / 40 = 0.95
    s and the recent one 1 s: at 1 s the 18 steps left end at 78 s, so it plans longer at 1 s: 37 s to 97 s, to
    step 78. At step 51 the steps left would still end early (at the run's 0.92 s: at 92.8 s), but it is one look
    after the re-plan: it waits SETTLE looks. At step 61 the last three looks (0.8 s each, since step 31) are all
    over a tenth below the run's 54 s / 60 = 0.9 s: the machine sped up, and the run's time counts from step 31 on.
    At step 71, the third look after the re-plan: the run's time 32 s / 40 = 0.8 s; the 7 steps left end at
    89.6 s: 13 s to 97 s hold 16 steps, to step 87 (counted from step 1, 0.886 s: 14 steps, and the next looks
    would lengthen it again as the slower steps weigh less)."""
    run = GuardRun(guard_plan(steps=59, limit=200))
    run.guard.marks[:] = [(2.0, 1), (12.0, 11), (22.0, 21), (32.0, 31)]
    run.look(40.0, 41, 60.0)
    assert run.ends == [78]
    run.look(48.0, 51, 68.0)
    run.look(56.0, 61, 76.0)
    assert run.ends == [78]
    run.look(64.0, 71, 84.0)
    assert run.ends == [78, 87]
    assert [(r["steps"], r["step_time_s"]) for r in run.records] == [(78, 1.0), (87, 0.8)]


def test_a_replan_that_moves_the_end_less_than_a_tenth_is_recorded_but_not_shown():
    """Steps at 1 s, then at 0.85 s from step 32 on. At step 41 the run's time is 38.5 s / 40 = 0.9625 s, the
    recent one 1 s: the 18 steps left end at 77.8 s, so it plans longer at 1 s: 36.5 s to 97 s, to step 77 (30%
    from 59: shown). At step 71, the third look after it, the run's time is 64 s / 70 = 0.914 s, and the recent
    looks of 0.85 s are not a tenth below it (no speed-up): the 6 steps left end at 91.5 s, so 11 s to 97 s hold 12
    steps, to step 83: 7.8% from 77, recorded (the progress bar follows it) but not shown."""
    run = GuardRun(guard_plan(steps=59, limit=200))
    run.guard.marks[:] = [(2.0, 1), (12.0, 11), (22.0, 21), (32.0, 31)]
    for look in (40.5, 41, 60.5), (49.0, 51, 69.0), (57.5, 61, 77.5), (66.0, 71, 86.0):
        run.look(*look)
    assert run.ends == [77, 83] and run.guard.since == 0
    assert [r["steps"] for r in run.records] == [77, 83]
    assert run.messages == ["time budget: steps take 1 s (planned 1 s) with 1m 00s of 1m 40s spent: ending at step 77 "
                            "instead of 59, the learning-rate decay completing there"]


@pytest.mark.parametrize("end,step,last_shown,expected", [
    (85, 71, 78, False),  # 7 steps, 9.0% of 78
    (86, 71, 78, True),  # 8 steps, 10.3%
    (72, 40, 80, True),  # exactly 10% shorter
    (73, 40, 80, False),
    (30, 30, 31, True),  # it stops the run: always shown
    (134, 13, 67, True)])
def test_a_replan_is_shown_when_it_moves_the_end_a_tenth_from_the_last_shown_or_stops_the_run(
        end, step, last_shown, expected):
    assert shown(end, step, last_shown) is expected


def test_a_slow_down_with_no_time_left_stops_the_run_at_this_step():
    """Steps 12-23 took 3.75 s each (15 s / 4 steps a look), against the run's 53 s / 22 = 2.41 s, and 96 s are
    spent: a slow-down, and not even one more step fits in the 1 s left to 97 s, so the run ends here, at step 23."""
    run = decision(guard_plan(steps=59, limit=59), [(2.0, 1), (10.0, 11), (25.0, 15), (40.0, 19)], (55.0, 23, 96.0))
    assert run.ends == [23] and run.records[0]["step_time_s"] == 3.75
    assert run.messages == ["time budget: steps take 3.75 s (planned 1 s) with 1m 36s of 1m 40s spent: stopping now, "
                            "at step 23 of 59"]


def test_a_shorter_plan_is_the_runs_step_times_when_it_overruns_without_a_slow_down():
    """Looks of 0.5 s and 0.833 s a step (the recent median 0.667 s, the run's 14 s / 20 = 0.7 s) with 75 s spent: at
    0.7 s the 40 steps left end at 103 s. Planned shorter from the run's own time, which is steady: 22 s to 97 s
    hold 31 steps after step 21."""
    assert guard_ends(guard_plan(steps=61, limit=61), (6.0, 9, 65.0), (16.0, 21, 75.0)) == [52]


# ------------------------------------------------------------------------ make demo
def demo_budget():
    import importlib.util
    spec = importlib.util.spec_from_file_location("demo_budget", ROOT / "scripts" / "demo_budget.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demo_gives_each_stage_a_share_of_the_time_left():
    d = demo_budget()
    after, share = d.AFTER_S, d.PRETRAIN_SHARE
    flags, note = d.stage_flags("pretrain", 1000.0, 600.0, now=1120.0, steps=None)
    assert flags == (f"--time_budget {round(share * (600 - 120 - after))}s --max_steps {d.MAX_STEPS['pretrain']} "
                     "--preset auto")  # the plan sizes pretraining's model for its share
    assert note is None
    flags, _ = d.stage_flags("sft", 1000.0, 600.0, now=1450.0, steps=None)  # the rest goes to SFT
    assert flags == f"--time_budget {round(600 - 450 - after)}s --max_steps {d.MAX_STEPS['sft']}"
    flags, note = d.stage_flags("sft", 1000.0, 600.0, now=1590.0, steps=None)  # late: a minimum, said
    assert flags.startswith(f"--time_budget {round(d.MIN_STAGE_S)}s") and note.startswith("note: the demo has 10.0s")
    assert d.stage_flags("pretrain", 1000.0, 600.0, now=5000.0, steps=450) == ("--max_steps 450", None)
    # what it prints is a valid training command line with the demo's recipe
    config = parse_train_config("pretrain", ["--config", str(ROOT / "recipes/demo-pretrain.yaml"),
                                             *d.stage_flags("pretrain", 0.0, 600.0, 60.0, None)[0].split()], None)
    assert config.optim.time_budget.endswith("s") and config.optim.max_steps == d.MAX_STEPS["pretrain"]
    assert config.model.preset == "auto"
    # with the settings the loss model was fitted with, so its expected losses and the plan's pick hold for the demo
    assert {key: getattr(config.optim, key) for key in RECIPE} == RECIPE == {
        "learning_rate": 8e-3, "muon_lr": 4e-3, "muon_base_width": 256, "warmup_steps": 20, "batch_size": 16}
    fixed = parse_train_config("pretrain", ["--config", str(ROOT / "recipes/demo-pretrain.yaml"),
                                            *d.stage_flags("pretrain", 0.0, 600.0, 60.0, 450)[0].split()], None)
    assert fixed.model.preset == "depth-4" and fixed.optim.time_budget is None  # fixed steps: the recipe's model


@pytest.mark.parametrize("argv,message", [(["pretrain", "--start", "0", "--total", "ten"], "DEMO_BUDGET 'ten'"),
                                          (["sft", "--start", "0", "--steps", "-3"], "--steps '-3'")])
def test_the_demo_budget_refuses_bad_values(argv, message, capsys):
    assert demo_budget().main(argv) == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------------ the guard over a whole run, simulated
def simulate(step_cost, budget_s: float = 600.0, setup_s: float = 20.0) -> tuple[list[int], float]:
    """A whole run under the guard alone: a 10-minute budget planned at 1 s a step (20 s of it set up), each step
    costing step_cost(step) seconds, the guard looking every 1% of the budget. Returns its re-planned ends and
    the budget's share spent when the run ends."""
    steps = int(TARGET * budget_s - setup_s)
    plan = BudgetPlan(budget_s=budget_s, steps=steps, limit=10 * steps, step_s=1.0, first_extra_s=0.0, eval_s=0.0,
                      save_s=0.0, eval_interval=10**6, save_interval=10**6, setup_s=setup_s,
                      check_every=int(0.01 * budget_s))
    run, elapsed, step = GuardRun(plan), 0.0, 0
    while step < run.ctx.plan.end:
        step += 1
        elapsed += step_cost(step)
        run.step(elapsed, step, setup_s + elapsed)
        if run.guard.due(step, run.ctx.plan.end):
            run.look(elapsed, step, setup_s + elapsed)
    return run.ends, (setup_s + elapsed) / budget_s


def test_a_quiet_machine_with_noisy_steps_keeps_its_plan():
    """Steps of 1 s +- 10% (a chat batch's length, the OS): the plan holds."""
    rng = random.Random(0)
    ends, spent = simulate(lambda step: 1.0 + 0.1 * rng.gauss(0, 1))
    assert len(ends) <= 1 and 0.94 <= spent <= 1.0


def test_a_burst_of_other_work_at_the_start_is_one_replan_and_its_correction():
    """Steps 2-30 take 3 s (another program's start-up), the rest 1 s: the guard cuts the run while the burst looks
    like the machine's speed, and plans it longer once, after the burst, rather than step by step as the average
    recovers; the run ends within its budget."""
    ends, spent = simulate(lambda step: 3.0 if step <= 30 else 1.0)
    assert len(ends) <= 2 and 0.94 <= spent <= 1.0  # (21 re-plans when the run's time was its plain average)


def test_a_lasting_slow_down_is_followed_within_the_budget():
    """From step 200 on, steps take 1.5 s: the run is planned shorter, and ends within its budget."""
    ends, spent = simulate(lambda step: 1.5 if step >= 200 else 1.0)
    assert ends and ends[-1] < 562 and 0.94 <= spent <= 1.0


@pytest.mark.parametrize("step_cost,most", [
    (lambda step: 1.0 if step < 150 else 0.5, 4),  # other work on the machine ends (14 re-plans, 94.8%)
    (lambda step: 2.0 if step < 100 else 1.0, 4),  # slow first steps (12 re-plans, 94.0%)
    (lambda step: 1.0 if step < 150 else 0.8, 2)],  # (4 re-plans, 94.0%)
    ids=["other work ends", "slow first steps", "a fifth faster"])
def test_a_lasting_speed_up_is_planned_in_a_few_replans_not_a_few_steps_at_every_look(step_cost, most):
    """Once every recent look is a tenth faster than the run's step time, the run's time counts from them on: the
    run is planned longer at the new speed, rather than a few steps at each look while the slower steps before
    weigh less and less in the run's average, each re-plan ending it near LOW of the budget (in brackets: when
    the run's time counted every step)."""
    ends, spent = simulate(step_cost)
    assert 1 <= len(ends) <= most and ends[-1] == max(ends) and 0.945 <= spent <= 1.0, (ends, spent)


def test_a_speed_up_that_ends_is_followed_by_a_shorter_plan_within_the_budget():
    """Steps 150-229 take 0.5 s, the rest 1 s: the run is planned longer at 0.5 s, and shorter again once the steps
    are slow again (a slow-down that would overrun), ending within its budget."""
    ends, spent = simulate(lambda step: 0.5 if 150 <= step < 230 else 1.0)
    assert max(ends) > 900 and ends[-1] < 700 and 0.94 <= spent <= 1.0, (ends, spent)


def test_hangs_are_paid_one_replan_each_and_never_stop_the_run():
    """Every 100th step hangs for 20 s: each hang's time is spent, so each moves the end once (not the dozens of
    re-plans of a run whose step time averages the hangs in), and the run still ends within its budget."""
    ends, spent = simulate(lambda step: 20.0 if step % 100 == 50 else 1.0)
    assert len(ends) <= 5 and ends == sorted(ends, reverse=True) and 0.94 <= spent <= 1.0


def test_every_rank_plans_from_the_slowest_rank_s_time_spent(corpus, tmp_path, monkeypatch):
    """The plan's time spent is the slowest rank's, as its costs are: ranks that started a few milliseconds apart
    must not plan a step apart (one would wait at the end for the other). Here every rank's numbers come back 7 s
    later from the all-reduce, as if another rank were that much slower."""
    seen = []
    real_make_plan = driver_mod.make_plan

    def spy(budget_s, spent_s, *rest):
        seen.append(spent_s)
        return real_make_plan(budget_s, spent_s, *rest)

    monkeypatch.setattr(driver_mod, "process_age", lambda: 0.0)
    monkeypatch.setattr(driver_mod, "make_plan", spy)
    monkeypatch.setattr(Backend, "slowest", lambda self, seconds: [s + 7.0 for s in seconds])
    assert train_pretrain.main(budget_flags(corpus, tmp_path, "run", time_budget="1h", max_steps=4)) == 0
    assert len(seen) == 1 and seen[0] >= 7.0  # this process alone had spent far less
