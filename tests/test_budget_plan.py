"""The time budget's plan (trainer_utils/budget.py) by itself: durations and their errors, the plan's arithmetic
(the seconds a stretch of steps costs, the most steps that fit, the plan and its refusal), re-plans at the edges of
their band, the plan's record and summary line, the process's age, the budget's clock and the probe's length. Every
number is worked out by hand (the arithmetic is in the comments); nothing here trains, so it is fast."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.errors import ConfigError, TrainingError
from trainer_utils import budget as budget_mod
from trainer_utils.budget import (
    BudgetClock,
    BudgetPlan,
    Costs,
    format_duration,
    make_plan,
    parse_duration,
    replanned_end,
)


# ------------------------------------------------------------------------ durations
@pytest.mark.parametrize("seconds,text", [
    (0.0, "0.0s"), (42.04, "42.0s"), (59.94, "59.9s"),  # under a minute: seconds, one decimal
    (60.0, "1m 00s"), (61.4, "1m 01s"), (581.0, "9m 41s"), (3599.4, "59m 59s"),  # minutes and seconds, rounded
    (3600.0, "1h 00m"), (3900.0, "1h 05m"), (7325.0, "2h 02m")])  # an hour or more: 7325 s = 122 min 5 s
def test_a_duration_is_written_in_its_largest_two_units(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize("text,seconds", [("1.5m", 90.0), ("0.5h30m", 3600.0), ("1h0.5s", 3600.5), ("2.5", 2.5),
                                          ("1H2M3S", 3723.0), (7.5, 7.5), ("1s", 1.0),
                                          ("0.5", 0.5)])  # under a second is still longer than zero
def test_decimal_and_mixed_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text,flag,message", [  # flag None: the default one
    ("10x", None, "--time_budget '10x': expected a duration such as 90s, 10m, 2h or 1h30m"),
    (" 2 hours ", "--budget", "--budget ' 2 hours ': expected a duration such as 90s, 10m, 2h or 1h30m"),
    ("0", None, "--time_budget '0': a budget must be longer than zero"),
    (0, "--total", "--total 0: a budget must be longer than zero"),
    ("0h0m", None, "--time_budget '0h0m': a budget must be longer than zero")])
def test_a_bad_duration_is_refused_with_the_flag_and_text_named(text, flag, message):
    with pytest.raises(ConfigError) as error:
        parse_duration(*((text,) if flag is None else (text, flag)))
    assert str(error.value) == message


# ------------------------------------------------------------------------ the plan's arithmetic
def plan_of(steps=0, eval_s=3.0, save_s=0.5, eval_interval=10):
    """A plan made by hand (not by make_plan), up to step 100: evaluations every 10 steps at 3 s, checkpoints every 4
    at 0.5 s."""
    return BudgetPlan(budget_s=100.0, steps=steps, limit=100, step_s=1.0, first_extra_s=0.0, eval_s=eval_s,
                      save_s=save_s, eval_interval=eval_interval, save_interval=4, setup_s=0.0, check_every=1)


@pytest.mark.parametrize("after,end,step_s,seconds", [
    (0, 0, 1.0, 0.0),  # step 0 has no evaluation or checkpoint
    (0, 10, 1.0, 14.5),  # 10 steps + an evaluation (10) * 3 + checkpoints (4, 8, 10) * 0.5 = 10 + 3 + 1.5
    (5, 12, 2.0, 21.0),  # steps 6-12 at 2 s = 14, evaluations 10 and 12 (the last) = 6, checkpoints 8 and 12 = 1
    (8, 12, 2.0, 15.0),  # 4 steps = 8, evaluations 10, 12 = 6, checkpoints 8 (step 8's own, still to come), 12 = 1
    (12, 12, 2.0, 3.5)])  # ending at step 12 itself: its own evaluation and checkpoint are still to come
def test_the_seconds_from_one_step_to_another_count_the_evaluations_and_checkpoints_due(after, end, step_s, seconds):
    assert plan_of().time_for(after, end, step_s) == seconds


def test_the_first_step_s_evaluation_is_still_to_come_after_it():
    """From step 1 (trained, the guard looking before its evaluation) to step 4 with an evaluation every step:
    3 steps and 4 evaluations; from step 0: 4 steps and the same 4."""
    plan = plan_of(eval_interval=1, save_s=0.0)
    assert (plan.time_for(1, 4, 1.0), plan.time_for(0, 4, 1.0)) == (3 + 4 * 3.0, 4 + 4 * 3.0)


def test_fit_is_the_last_step_reached_in_time_whole_steps_only():
    """With steps the only cost, the steps that fit in s seconds from step 0 are floor(s / step_s), up to the
    limit; from step 20, 20 more than that. Every half second from -1 s to 110 s: a bisection that skips or
    repeats a candidate gets one of them wrong."""
    plan = plan_of(eval_s=0.0, save_s=0.0)
    for half in range(-2, 221):
        seconds = half / 2
        assert plan.fit(seconds, 0, 1.0) == min(100, max(0, math.floor(seconds))), seconds
        assert plan.fit(seconds, 20, 0.5) == min(100, 20 + max(0, math.floor(seconds / 0.5))), seconds


def test_fit_counts_the_evaluations_and_checkpoints_and_takes_an_exact_fit():
    plan = plan_of()
    assert plan.fit(14.5, 0, 1.0) == 10  # exactly the 14.5 s of 10 steps (above)
    assert plan.fit(14.49, 0, 1.0) == 9  # 9 steps: 9 + an evaluation (the last) 3 + checkpoints 4, 8, 9 = 13.5 s
    assert plan.fit(142.5, 0, 1.0) == 100  # the whole limit: 100 + 10 evaluations * 3 + 25 checkpoints * 0.5
    assert plan.fit(0.5, 7, 1.0) == 7  # not one step more: the run ends where it is


def test_the_end_is_the_last_replans():
    plan = plan_of(steps=60)
    assert plan.end == 60
    again = plan.replanned(10, 50, 1.2, 20.0).replanned(20, 70, 0.8, 31.0)
    assert again.end == 70 and plan.end == 60  # a re-plan is a new plan: the first is as it was
    assert again.replans == ({"step": 10, "steps": 50, "step_s": 1.2, "spent_s": 20.0},
                             {"step": 20, "steps": 70, "step_s": 0.8, "spent_s": 31.0})
    assert plan.replanned(5, 9, 1.23456789, 7.12345).replans[0] == {"step": 5, "steps": 9, "step_s": 1.234568,
                                                                     "spent_s": 7.123}  # rounded as recorded


def test_projected_counts_from_the_step_to_the_plans_end_now():
    plan = plan_of(steps=60, eval_s=0.0, save_s=0.0)
    assert budget_mod.projected(plan, 20, 25.0, 2.0) == 25 + 40 * 2.0
    plan = plan.replanned(20, 30, 2.0, 25.0)
    assert budget_mod.projected(plan, 20, 25.0, 2.0) == 25 + 10 * 2.0


# ------------------------------------------------------------------------ the plan
# 100 s, 10.2 s spent, a 4-s start, a first step 1 s slower than the others (2 s), evaluations every 10 steps at 3 s,
# checkpoints every 15 at 1.5 s: 0.97 * 100 - 10.2 - 4 - 1 = 81.8 s for the steps. 32 steps take 64 + 4 evaluations
# (10, 20, 30, 32) * 3 + 3 checkpoints (15, 30, 32) * 1.5 = 80.5 s; 33 would take 66 + 12 + 4.5 = 82.5 s.
COSTS = Costs(step_s=2.0, first_extra_s=1.0, eval_s=3.0, save_s=1.5, timed_steps=4, start_s=4.0)


def test_the_plan_is_recorded_whole():
    plan = make_plan(100.0, 10.2, COSTS, limit=1000, eval_interval=10, save_interval=15)
    assert plan.to_dict() == {
        "budget_s": 100.0, "steps": 32, "limit": 1000, "step_s": 2.0, "first_extra_s": 1.0, "eval_s": 3.0,
        "save_s": 1.5, "eval_interval": 10, "save_interval": 15, "setup_s": 10.2,
        "check_every": 1,  # 1% of 100 s is half a step: every step
        "timed_steps": 4, "start_s": 4.0, "replans": [], "used_s": 0.0, "planned_at": 0}
    assert plan.summary() == ("time budget 1m 40s: 32 steps at 2 s (measured over 4 steps after a warm-up), "
                              "4 evaluations at 3 s, 3 checkpoints at 1.5 s, 14.2s set-up: ends at about 1m 36s")
    # (it ends at 10.2 + 4 + 1 + 80.5 = 95.7 s)


def test_the_guard_looks_about_every_hundredth_of_the_budget():
    costs = Costs(step_s=0.25, first_extra_s=0.0, eval_s=0.0, save_s=0.0, timed_steps=3)
    assert make_plan(600.0, 0.0, costs, 10_000, 100, 100).check_every == 24  # 6 s / 0.25 s


# 60 s, 5 s spent, 0.5-s steps, one evaluation (2 s) and one checkpoint (1 s) at the end: 40 steps take 20 + 2 + 1 =
# 23 s of the 53.2 s left, so the limit of 40 is the plan, and the run ends at about 5 + 23 = 28 s.
SMALL = Costs(step_s=0.5, first_extra_s=0.0, eval_s=2.0, save_s=1.0, timed_steps=12)
EARLY = "; --max_steps / --epochs allow no more, so it ends early"


@pytest.mark.parametrize("save_interval,what", [
    (1000, "1 checkpoint at 1 s, 5.0s set-up: ends at about 28.0s"),
    (None, "0 checkpoints at 0 s, 5.0s set-up: ends at about 27.0s")])  # --no-checkpoints: no checkpoint, no cost
def test_the_summary_of_a_plan_the_limit_ends(save_interval, what):
    plan = make_plan(60.0, 5.0, SMALL, limit=40, eval_interval=1000, save_interval=save_interval)
    assert plan.steps == 40 and plan.save_interval == (1000 if save_interval else 41)  # 41: never due
    assert plan.summary() == ("time budget 1m 00s: 40 steps at 0.5 s (measured over 12 steps after a warm-up), "
                              f"1 evaluation at 2 s, {what}{EARLY}")
    assert dataclasses.replace(plan, limit=41).summary().endswith(what)  # a step more was allowed: the budget ended it


def test_the_summary_counts_the_first_steps_evaluation_and_checkpoint():
    """An evaluation and a checkpoint after every step, 0.5 s each: 2 s a step, so 48 steps in 97 s, with 48 of
    each (the first step's included)."""
    plan = make_plan(100.0, 0.0, Costs(1.0, 0.0, 0.5, 0.5, 3), limit=1000, eval_interval=1, save_interval=1)
    assert plan.summary() == ("time budget 1m 40s: 48 steps at 1 s (measured over 3 steps after a warm-up), "
                              "48 evaluations at 0.5 s, 48 checkpoints at 0.5 s, 0.0s set-up: ends at about 1m 36s")


def test_one_step_that_fits_is_a_plan():
    """10 s: 9.7 s for 5-s steps, so one step and not two; the summary says so in the singular."""
    plan = make_plan(10.0, 0.0, Costs(5.0, 0.0, 0.0, 0.0, 3), limit=100, eval_interval=10, save_interval=10)
    assert plan.steps == 1 and plan.summary().startswith("time budget 10.0s: 1 step at 5 s (")


def test_a_budget_too_short_for_one_step_is_refused_with_its_numbers():
    """60 s with 50 s spent and a 3-s start: one step with its evaluation and checkpoint, and the first step's
    extra, take 1 + 5 + 0.5 + 2 = 8.5 s, more than 0.97 * 60 - 53 = 5.2 s."""
    costs = Costs(step_s=1.0, first_extra_s=2.0, eval_s=5.0, save_s=0.5, timed_steps=3, start_s=3.0)
    with pytest.raises(TrainingError) as error:
        make_plan(60.0, 50.0, costs, limit=100, eval_interval=100, save_interval=50)
    assert str(error.value) == ("--time_budget 1m 00s leaves no time to train: setting up takes 53.0s, and one step "
                                "with its evaluation and checkpoint takes 8.5s; give a longer budget")


def test_a_plan_recorded_before_the_newer_fields_reads_with_their_defaults():
    """A checkpoint written before `timed_steps`, `start_s`, `replans` and `used_s` existed; a key no field has
    is left out."""
    old = {"budget_s": 600.0, "steps": 500, "limit": 1000, "step_s": 1.0, "first_extra_s": 2.0, "eval_s": 5.0,
           "save_s": 0.5, "eval_interval": 100, "save_interval": 50, "setup_s": 30.0, "check_every": 6,
           "gone": "a field since removed"}
    plan = BudgetPlan.from_dict(old)
    assert (plan.steps, plan.timed_steps, plan.start_s, plan.replans, plan.used_s, plan.end) == (500, 0, 0.0, (), 0.0,
                                                                                                   500)


# ------------------------------------------------------------------------ re-plans at the band's edges
def steady_plan(limit: int = 2000) -> BudgetPlan:
    """1000 s, 1-s steps and nothing else: 970 steps. From step 100 the 870 left end at spent + 870 s."""
    return make_plan(1000.0, 0.0, Costs(1.0, 0.0, 0.0, 0.0, 3), limit=limit, eval_interval=10**9, save_interval=None)


@pytest.mark.parametrize("spent,new", [
    (70.0, None),  # ends at 940 s: LOW of the budget, inside the band
    (69.5, 1000),  # at 939.5 s: longer, to 0.97 * 1000 - 69.5 = 900.5 s of steps after step 100
    (125.0, None),  # at 995 s: HIGH, inside
    (125.5, 944)])  # at 995.5 s: shorter, 844.5 s of steps after step 100
def test_a_replan_keeps_an_end_on_the_bands_edges_and_moves_one_just_outside(spent, new):
    assert replanned_end(steady_plan(), 100, spent, 1.0) == new


def test_a_plan_at_its_limit_that_overruns_is_still_replanned_shorter():
    """--max_steps 970 leaves no room to plan longer, but an end at 1000 s must still come in: 840 steps after
    step 100 end by 970 s."""
    assert replanned_end(steady_plan(limit=970), 100, 130.0, 1.0) == 940


# ------------------------------------------------------------------------ the process's age, the clock, the probe
def proc(monkeypatch, stat: str | None, uptime: str = "1250.50 4000.00") -> None:
    """/proc as the budget module reads it: this stat and uptime, 100 clock ticks a second (None: no /proc)."""
    files = {"/proc/self/stat": stat, "/proc/uptime": uptime}

    def read_text(path):
        if files[path] is None:
            raise FileNotFoundError(path)
        return files[path]

    monkeypatch.setattr(budget_mod, "Path", lambda path: SimpleNamespace(read_text=lambda: read_text(path)))
    monkeypatch.setattr(budget_mod, "os", SimpleNamespace(sysconf={"SC_CLK_TCK": 100}.__getitem__))


def stat_line(starttime: int) -> str:
    """A /proc/self/stat line whose command name holds ') ' and spaces; fields 3-23, the 22nd the start time in
    clock ticks after boot, the 23rd the memory size."""
    fields = ["S", "1", "4242", "4242", "0", "-1", "4194304", "100", "0", "0", "0", "7", "3", "0", "0", "20", "0",
              "1", "0", str(starttime), "123456789"]
    return f"4242 (py (x) y) {' '.join(fields)}\n"


def test_the_process_age_is_read_from_proc(monkeypatch):
    proc(monkeypatch, stat_line(123_400))  # started 1234 s after boot, which was 1250.5 s ago
    assert budget_mod.process_age() == 16.5


@pytest.mark.parametrize("stat,uptime", [
    (stat_line(130_000), "1250.50 4000.00"),  # started after the uptime says: clock skew, not a negative age
    (None, "1250.50 4000.00"),  # no /proc (not Linux)
    ("4242 no command name", "1250.50 4000.00"),  # nothing after a ')'
    (stat_line(123_400), "up")])  # unreadable
def test_the_process_age_is_0_when_proc_cannot_tell_it(monkeypatch, stat, uptime):
    proc(monkeypatch, stat, uptime)
    assert budget_mod.process_age() == 0.0


def test_this_process_has_an_age_within_the_machines_uptime():
    if not Path("/proc/uptime").exists():
        pytest.skip("no /proc")
    assert 0.0 < budget_mod.process_age() < float(Path("/proc/uptime").read_text().split()[0])


def test_the_budget_clock_counts_from_its_start_and_adds_what_was_spent_before(monkeypatch):
    now = SimpleNamespace(t=1010.0)
    monkeypatch.setattr(budget_mod, "time", SimpleNamespace(perf_counter=lambda: now.t))
    clock = BudgetClock(1000.0)
    assert clock.spent_before is None  # how the loop tells the process's first plan (it sets what came before)
    assert clock.spent() == 10.0  # no plan yet: nothing before
    clock.spent_before = 0.0
    assert clock.spent() == 10.0
    clock.spent_before, now.t = 25.5, 1012.0
    assert clock.spent() == 37.5


@pytest.mark.parametrize("first_s,budget_s,count", [
    (0.1, 600.0, 12),  # 2 s / 0.1 s = 20: at most 12
    (0.25, 600.0, 8),  # 2 s / 0.25 s
    (0.3, 600.0, 7),  # 2 s / 0.3 s = 6.7: rounded up
    (0.0, 600.0, 12),  # an instant step: at most 12
    (0.2, 50.0, 5),  # 2% of 50 s is 1 s: 1 / 0.2
    (2.0, 100.0, 2),  # at least 3 (2 s / 2 s is 1), but 5% of 100 s is 2.5 s: 2 steps
    (1.0, 600.0, 3),  # at least 3
    (20.0, 600.0, 1),  # 30 s / 20 s
    (40.0, 600.0, 1)])  # a step longer than 5% of the budget: still one
def test_the_probe_times_enough_steps_within_five_percent_of_the_budget(first_s, budget_s, count):
    assert budget_mod.probe_count(first_s, budget_s) == count
