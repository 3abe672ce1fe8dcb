"""A time budget planned on the run's own first steps (trainer_utils/components/first_steps.py): when it applies,
that the run it trains is the `--max_steps N` run of its plan bit for bit (the measured steps kept, the rehearsed
checkpoint and evaluation leaving no trace), the plan's arithmetic from the step it is made at, resume, a stop
before the plan, and the schedule it relies on. The throwaway probe it replaces there: tests/test_time_budget.py
(whose runs have a 2-step warm-up, too short to plan on)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_time_budget import budget_flags, resolved, virtual_clock
from test_train import flags, stop_at, weights

import train_pretrain
from model.inference import read_train_info
from trainer_utils import budget as budget_mod
from trainer_utils import driver as driver_mod
from trainer_utils.budget import IN_RUN_LEAST, TARGET, Costs, in_run_steps, make_plan
from trainer_utils.checkpoint import latest_checkpoint
from trainer_utils.components.first_steps import FirstStepsPlan
from trainer_utils.optim import WarmupCosine

from conftest import read_metrics, strict_records

TIMING = ("time", "tokens_per_s", "step_time_s", "data_wait_frac", "elapsed_s", "peak_rss_gb", "mfu")


def records(run_dir) -> list[dict]:
    """Every record of a run's metrics.jsonl but its clock readings: what two equal runs share exactly."""
    return [{k: v for k, v in r.items() if k not in TIMING} for r in strict_records(run_dir)
            if r.get("event") is None and "step" in r]


def first_steps_flags(corpus, tmp_path, run, **over):
    """A budget run that plans on its first steps: a 10-step warm-up, evaluations and checkpoints every 10."""
    return budget_flags(corpus, tmp_path, run, warmup_steps=10, **over)


@pytest.mark.parametrize("warmup,eval_interval,save_interval,limit,most", [
    (20, 500, 500, 10_000, 20),  # the warm-up bounds it
    (20, 8, 500, 10_000, 7), (20, 500, 6, 10_000, 5),  # the first evaluation or checkpoint: before it
    (20, 500, None, 10_000, 20),  # no checkpoints
    (20, 500, 500, 9, 8),  # not the run's last step
    (None, 500, 500, 10_000, 0),  # a warm-up by ratio: its length is the plan's to decide
    (IN_RUN_LEAST - 1, 500, 500, 10_000, 0), (IN_RUN_LEAST, 500, 500, 10_000, IN_RUN_LEAST),  # too few to time
    (20, IN_RUN_LEAST, 500, 10_000, 0),
])
def test_a_run_plans_on_its_first_steps_only_where_they_train_as_in_any_run(warmup, eval_interval, save_interval,
                                                                            limit, most):
    assert in_run_steps(warmup, eval_interval, save_interval, limit) == most


def test_setting_the_total_during_the_warm_up_is_the_schedule_of_that_total_exactly():
    param = torch.nn.Parameter(torch.zeros(1))
    for total in (5, 11, 40, 1000):
        for taken in range(0, 7):
            moved = WarmupCosine(torch.optim.SGD([param], lr=1.0), 1e-3, 1e-4, 6, 10_000)
            for _ in range(taken):
                moved.step()
            moved.set_total(total)
            fresh = WarmupCosine(torch.optim.SGD([param], lr=1.0), 1e-3, 1e-4, 6, total)
            assert moved.end == total and [moved.lr_at(s) for s in range(total + 2)] == \
                [fresh.lr_at(s) for s in range(total + 2)]
    late = WarmupCosine(torch.optim.SGD([param], lr=1.0), 1e-3, 1e-4, 6, 100)
    for _ in range(7):
        late.step()
    with pytest.raises(ValueError, match="after step 7 of a 6-step warm-up"):
        late.set_total(50)  # step 7 ran on the cosine of 100 steps
    replanned = WarmupCosine(torch.optim.SGD([param], lr=1.0), 1e-3, 1e-4, 6, 100)
    replanned.end_at(0, 50)
    with pytest.raises(ValueError, match="re-plan"):
        replanned.set_total(60)


def test_a_plan_made_after_some_steps_fits_the_rest_and_keeps_them():
    costs = Costs(step_s=1.0, first_extra_s=0.0, eval_s=0.5, save_s=0.25, timed_steps=2)
    plan = make_plan(40.0, 3.75, costs, limit=100, eval_interval=10, save_interval=10, after=3)
    # by hand: 0.97 * 40 - 3.75 = 35.05 s from step 3; to step 35: 32 steps, evaluations and checkpoints at 10, 20,
    # 30 and 35 (4 * 0.75 s) = 35 s; step 36 would end at 36 s
    assert (plan.steps, plan.planned_at) == (35, 3)
    assert plan.time_for(3, 35, 1.0) <= TARGET * 40 - 3.75 < plan.time_for(3, 36, 1.0)
    assert make_plan(40.0, 3.75, costs, limit=100, eval_interval=10, save_interval=10).steps == 32  # from step 0
    spent = make_plan(40.0, 39.0, costs, limit=100, eval_interval=10, save_interval=10, after=3)
    assert spent.steps == 3  # nothing more fits: the run ends at the steps it took, not with an error
    assert "measured over the run's first 3 steps: a warm-up and 2 timed" in plan.summary()
    assert "ends at about 38.8s" in plan.summary()  # 3.75 s spent, 35 s to come


def test_a_run_planned_on_its_first_steps_trains_exactly_as_max_steps_of_its_plan(corpus, tmp_path, monkeypatch,
                                                                                  capsys):
    """With early stopping on: its first evaluation, rehearsed, would save a checkpoint and mark it best."""
    virtual_clock(monkeypatch, lambda step: 1.0, eval_s=0.5, save_s=0.25)
    monkeypatch.setattr(driver_mod, "measure_costs", lambda *a: pytest.fail("no throwaway Trainer is measured"))
    seen = []
    real_run = FirstStepsPlan.run

    def rehearsed(self, ctx):  # what the run is before the rehearsal and plan, and after
        def look():
            return (dataclasses.replace(ctx.state), ctx.control.last_saved, dict(ctx.measured), ctx.logger, ctx.run_dir,
                    [c.state_dict() for c in ctx.control.components if c.name],
                    sorted(p.relative_to(ctx.run_dir) for p in ctx.run_dir.rglob("*")), torch.get_rng_state())
        before = look()
        report = real_run(self, ctx)  # (the plan is recorded by the loop, after this)
        seen.append((before, look()))
        return report

    monkeypatch.setattr(FirstStepsPlan, "run", rehearsed)
    assert train_pretrain.main(first_steps_flags(corpus, tmp_path, "budget", early_stop_patience=5)) == 0
    [(before, after)] = seen
    assert before[:-1] == after[:-1] and torch.equal(before[-1], after[-1])
    plan = resolved(tmp_path / "budget")["time_budget"]
    # a warm-up step and 2 timed (budget.probe_count at 1 s of a 40-s budget), then a checkpoint (0.25 s) and an
    # evaluation (0.5 s) rehearsed: 3.75 s spent at step 3, and 35 steps fit (test above)
    assert (plan["planned_at"], plan["timed_steps"], plan["setup_s"], plan["steps"]) == (3, 2, 3.75, 35)
    assert (plan["step_s"], plan["eval_s"], plan["save_s"], plan["start_s"], plan["first_extra_s"]) == \
        (1.0, 0.5, 0.25, 0.0, 0.0)
    assert resolved(tmp_path / "budget")["total_steps"] == 35
    assert "time budget 40.0s: 35 steps at 1 s (measured over the run's first 3 steps" in capsys.readouterr().err
    assert not (tmp_path / "budget" / budget_mod.PROBE_DIR_NAME).exists()  # the rehearsed checkpoint is gone
    ckpts = sorted(p.name for p in (tmp_path / "budget" / "checkpoints").iterdir())
    monkeypatch.undo()
    assert train_pretrain.main(flags(corpus, tmp_path, "fixed", max_steps=35, eval_interval=10, save_interval=10,
                                     log_interval=1, warmup_steps=10, early_stop_patience=5)) == 0
    a, b = records(tmp_path / "budget"), records(tmp_path / "fixed")
    assert a == b and [r["step"] for r in a if "val_loss" in r] == [10, 20, 30, 35]  # no rehearsed evaluation
    wa, wb = weights(tmp_path / "budget"), weights(tmp_path / "fixed")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert ckpts == sorted(p.name for p in (tmp_path / "fixed" / "checkpoints").iterdir())
    assert (tmp_path / "budget" / "best").read_text() == (tmp_path / "fixed" / "best").read_text()
    samples = [(tmp_path / run / "samples.jsonl").read_text() for run in ("budget", "fixed")]
    assert samples[0] and [json.loads(x)["step"] for x in samples[0].splitlines()] == \
        [json.loads(x)["step"] for x in samples[1].splitlines()]
    assert [{k: v for k, v in json.loads(x).items() if k != "time"} for x in samples[0].splitlines()] == \
        [{k: v for k, v in json.loads(x).items() if k != "time"} for x in samples[1].splitlines()]


def test_resume_continues_a_plan_made_on_the_first_steps_bit_exactly(corpus, tmp_path, monkeypatch):
    virtual_clock(monkeypatch, lambda step: 1.0)
    assert train_pretrain.main(first_steps_flags(corpus, tmp_path, "straight")) == 0
    stop_at(monkeypatch, 12)
    assert train_pretrain.main(first_steps_flags(corpus, tmp_path, "resumed")) == 0
    assert read_train_info(latest_checkpoint(tmp_path / "resumed"))["time_budget"]["planned_at"] == 3
    monkeypatch.undo()
    virtual_clock(monkeypatch, lambda step: 1.0)
    assert train_pretrain.main(first_steps_flags(corpus, tmp_path, "resumed", resume=True)) == 0
    a, b = records(tmp_path / "straight"), records(tmp_path / "resumed")  # (a resumed run measures its memory again)
    assert [r for r in a if "loss" in r or "val_loss" in r] == [r for r in b if "loss" in r or "val_loss" in r]
    wa, wb = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [m["step"] for m in read_metrics(tmp_path / "resumed")] == list(range(1, 39))  # 38 steps: 0.97 * 40 - 3


def test_a_run_stopped_before_its_plan_is_made_says_to_start_again(corpus, tmp_path, monkeypatch, capsys):
    virtual_clock(monkeypatch, lambda step: 1.0)
    stop_at(monkeypatch, 2)  # the third step would have made the plan
    assert train_pretrain.main(first_steps_flags(corpus, tmp_path, "run")) == 0
    assert "time_budget" not in read_train_info(latest_checkpoint(tmp_path / "run"))
    monkeypatch.undo()
    assert train_pretrain.main(first_steps_flags(corpus, tmp_path, "run", resume=True)) == 2
    err = capsys.readouterr().err
    assert "was saved before its run had planned its budget" in err and "start the run again" in err, err


@pytest.mark.parametrize("first_s,planned_at,timed", [
    (5.0, 2, 1),  # a slow warm-up step: budget.probe_count times one more step within 5% of 40 s
    (1.0, 3, 2),
])
def test_the_warm_up_step_decides_how_many_steps_are_timed_and_is_not_one_of_them(corpus, tmp_path, monkeypatch,
                                                                                  first_s, planned_at, timed):
    virtual_clock(monkeypatch, lambda step: first_s if step == 1 else 1.0)
    assert train_pretrain.main(first_steps_flags(corpus, tmp_path, "run")) == 0
    plan = resolved(tmp_path / "run")["time_budget"]
    assert (plan["planned_at"], plan["timed_steps"], plan["step_s"]) == (planned_at, timed, 1.0)
    assert plan["setup_s"] == first_s + timed  # the warm-up step's time is spent, not expected again


def test_fast_steps_are_timed_up_to_the_step_before_the_first_evaluation(corpus, tmp_path, monkeypatch):
    virtual_clock(monkeypatch, lambda step: 0.01)  # budget.probe_count would time 12
    assert train_pretrain.main(first_steps_flags(corpus, tmp_path, "run", eval_interval=6)) == 0
    plan = resolved(tmp_path / "run")["time_budget"]
    assert (plan["planned_at"], plan["timed_steps"]) == (5, 4)  # steps 1-5: a warm-up and 4 timed
    assert [r["step"] for r in strict_records(tmp_path / "run") if "val_loss" in r][:2] == [6, 12]


def test_without_checkpoints_the_plan_counts_none(corpus, tmp_path, monkeypatch):
    virtual_clock(monkeypatch, lambda step: 1.0, save_s=5.0)
    assert train_pretrain.main(first_steps_flags(corpus, tmp_path, "run", **{"no-checkpoints": True})) == 0
    plan = resolved(tmp_path / "run")["time_budget"]
    assert (plan["planned_at"], plan["save_s"], plan["save_interval"], plan["steps"]) == (3, 0.0, 101, 38)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_guard_keeps_a_plan_made_on_the_first_steps(corpus, tmp_path, monkeypatch):
    """The guard takes the plan when it arrives: a machine 3x slower from step 10 on is re-planned shorter, and the
    run still ends within its budget."""
    clock = virtual_clock(monkeypatch, lambda step: 1.0 if step < 10 else 3.0)
    started = clock.now
    assert train_pretrain.main(first_steps_flags(corpus, tmp_path, "run")) == 0
    events = [r for r in strict_records(tmp_path / "run") if r.get("event") == "time_budget"]
    assert events and events[0]["planned_steps"] == 38 and events[-1]["steps"] < 38
    assert read_metrics(tmp_path / "run")[-1]["step"] == events[-1]["steps"]
    assert 0.90 * 40 <= clock.now - started <= 40
