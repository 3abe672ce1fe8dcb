"""Is the loss on track (trainer_utils/components/on_track.py): the expected loss at each share of a run (the
progress table, by hand), when the loss model applies and when it does not, the lines it prints (once per kind of
trouble, and not again after a resume), and a real run that reports its expected loss."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_train import flags

import train_pretrain
from trainer_utils.components import on_track
from trainer_utils.components.on_track import SPIKE, OnTrack, not_applicable, same_file
from trainer_utils.config import OptimConfig
from trainer_utils.loss_model import FIT_RESULTS, FIT_SIZES, PROGRESS, LossModel, Progress

from conftest import ROOT, strict_records

TABLE = Progress(min_tokens=0, shares=(0.1, 0.5, 1.0), ratios=(0.9, 1.0, 1.0), tolerances=(0.1, 0.04, 0.02),
                 beyond=0.03)
FLAT = LossModel(E=2.0, A=0.0, alpha=1.0, B=1000.0, beta=1.0)  # 2 + 1000 / tokens, whatever the size
# 2 + 3e6 / N + 100,000 / tokens: the stand-in model's 3M non-embedding parameters make the middle term 1
FALLING = LossModel(E=2.0, A=3e6, alpha=1.0, B=1e5, beta=1.0)


@pytest.mark.parametrize("tokens,end,expected", [
    (100, 2000, None),  # 5% of the run: too early to expect anything
    (200, 2000, (0.9 * 7.0, 0.1)),  # the first share: 0.9 x (2 + 1000 / 200)
    (500, 2000, (0.9375 * 4.0, 0.0775)),  # a quarter: 0.375 of the way from 0.1 to 0.5
    (1000, 2000, (3.0, 0.04)),
    (2000, 2000, (2.5, 0.02)),  # the end
    (2100, 2000, (2.0 + 1000 / 2100, 0.02)),  # past the planned tokens: as at the end
])
def test_the_expected_loss_by_hand(tokens, end, expected):
    got = TABLE.expected(FLAT, 1e6, tokens, end)
    assert got == (None if expected is None else pytest.approx(expected, rel=1e-12))


@pytest.mark.parametrize("n,beyond", [(FIT_SIZES[0], 0.0), (FIT_SIZES[1], 0.0), (FIT_SIZES[0] - 1, 0.03),
                                      (FIT_SIZES[1] + 1, 0.03), (25e6, 0.03)])
def test_a_model_outside_the_fitted_sizes_gets_the_model_s_worst_error_on_top(n, beyond):
    """The runs' spread holds the loss model's error on the sizes it was fitted on, not on others."""
    assert TABLE.expected(FLAT, n, 1000, 2000) == pytest.approx((3.0, 0.04 + beyond), rel=1e-12)


def test_nothing_is_expected_before_the_fit_s_fewest_tokens():
    table = Progress(min_tokens=600, shares=(0.1, 1.0), ratios=(1.0, 1.0), tolerances=(0.05, 0.05), beyond=0.0)
    assert table.expected(FLAT, 1e6, 599, 1000) is None  # 60% of the run, but fewer tokens than any fitted run
    assert table.expected(FLAT, 1e6, 600, 1000) == (2.0 + 1000 / 600, 0.05)


def test_a_table_of_one_share_expects_its_ratio_from_there_on():
    single = Progress(min_tokens=0, shares=(0.5,), ratios=(1.25,), tolerances=(0.05,), beyond=0.0)
    assert single.expected(FLAT, 1e6, 400, 1000) is None
    assert single.expected(FLAT, 1e6, 500, 1000) == (1.25 * 4.0, 0.05)
    assert single.expected(FLAT, 1e6, 1000, 1000) == (1.25 * 3.0, 0.05)


def test_the_shipped_progress_table_is_the_recorded_one():
    fit = json.loads((ROOT / FIT_RESULTS).read_text())
    table = fit["progress"]
    assert Progress(table["min_tokens"], tuple(table["shares"]), tuple(table["ratios"]),
                    tuple(table["tolerances"]), table["beyond"]) == PROGRESS
    assert PROGRESS.min_tokens == min(r["tokens"] for r in fit["runs"])
    assert all(t >= 0.02 for t in PROGRESS.tolerances) and PROGRESS.shares[-1] == 1.0


# ---------------------------------------------------------------------------- the component, on a stand-in run
class Logger:
    def __init__(self):
        self.records, self.messages = [], []

    def log(self, record):
        self.records.append(record)

    def message(self, text):
        self.messages.append(text)


def fake_ctx(tmp_path=None, **over):
    """A pretraining run on the loss model's corpus, tokenizer and context, with 100 steps planned, evaluating
    every 10 and logging every 5; 4,096 tokens a step."""
    config = SimpleNamespace(
        data=SimpleNamespace(data_path=[str(ROOT / "dataset/demo/pretrain_demo.jsonl")], tokenizer=None),
        eval=SimpleNamespace(eval_interval=10), run=SimpleNamespace(log_interval=5),
        optim=OptimConfig(warmup_steps=20))
    ctx = SimpleNamespace(config=config, chat=False, objective=SimpleNamespace(unit="tokens"), init_dir=None,
                          adapters=False, max_seq_len=256, model=SimpleNamespace(config=SimpleNamespace(
                              num_parameters=lambda non_embedding: 3e6 if non_embedding else 5e6)),
                          control=SimpleNamespace(total_steps=100, sync_counters=lambda: None),
                          state=SimpleNamespace(step=0, tokens_seen=0),
                          measured={}, logger=Logger())
    for k, v in over.items():
        setattr(ctx, k, v)
    return ctx


@pytest.mark.parametrize("change,reason", [
    (dict(chat=True), "not pretraining"),
    (dict(objective=SimpleNamespace(unit="pairs")), "not pretraining"),
    (dict(init_dir=Path("out/run")), "the model starts from trained weights"),
    (dict(adapters=True), "the model starts from trained weights"),
    (dict(max_seq_len=512), "the loss model was fitted at a context of 256"),
])
def test_where_no_loss_model_applies_nothing_is_guessed(change, reason):
    assert not_applicable(fake_ctx()) is None
    ctx = fake_ctx(**change)
    assert not_applicable(ctx) == reason
    component = OnTrack(ctx)
    assert component.describe() == {"loss_model": f"not used: {reason}"}
    assert not any(component.due(step, 100) for step in range(1, 101))


def test_other_data_or_another_tokenizer_is_not_the_loss_model_s(tmp_path):
    ctx = fake_ctx()
    ctx.config.data.data_path = [str(ROOT / "dataset/demo/sft_demo.jsonl")]
    assert not_applicable(ctx) == "the loss model was fitted on dataset/demo/pretrain_demo.jsonl alone"
    ctx.config.data.data_path = [str(ROOT / "dataset/demo/pretrain_demo.jsonl"), str(tmp_path / "more.jsonl")]
    assert not_applicable(ctx) == "the loss model was fitted on dataset/demo/pretrain_demo.jsonl alone"
    ctx = fake_ctx()
    ctx.config.data.tokenizer = str(tmp_path)
    assert not_applicable(ctx) == "the loss model was fitted with the shipped tokenizer"
    ctx.config.data.tokenizer = str(ROOT / "model" / "tokenizer")
    assert not_applicable(ctx) is None


def at(ctx, component, step, train=None, val=None):
    """Step `step` of the stand-in run: its log window's loss and evaluation, as the components before report."""
    ctx.state.step, ctx.state.tokens_seen = step, 4096 * step
    ctx.measured = {"train_loss": train, "val_loss": val}
    assert component.due(step, 100) == (step % 5 == 0)
    component.run(ctx)


def test_an_evaluation_beside_its_expectation_and_each_trouble_flagged_once(monkeypatch):
    table = Progress(min_tokens=0, shares=(0.1, 0.5, 1.0), ratios=(0.9, 1.0, 1.0), tolerances=(0.1, 0.04, 0.0123),
                     beyond=0.0)
    monkeypatch.setattr(on_track, "PROGRESS", table)
    monkeypatch.setattr(on_track, "SHIPPED", FALLING)
    ctx = fake_ctx()
    component = OnTrack(ctx)
    assert component.describe() == {"loss_model": "applies"}
    log = ctx.logger

    def expected(step):
        return 3 + 1e5 / (4096 * step)

    at(ctx, component, 5, train=6.0)  # 5% of the run: nothing expected yet
    at(ctx, component, 10, train=5.0, val=5.0)  # 10%: 0.9 x 5.441 = 4.897, and 5.0 is within 10% of it
    assert log.messages == [f"step 10: expected val_loss {0.9 * expected(10):.4f} (±10%): on track"]
    assert log.records == [{"step": 10, "expected_val_loss": round(0.9 * expected(10), 5), "expected_tolerance": 0.1}]
    at(ctx, component, 15, train=7.0)  # 7 > 1.3 x 5, but still warming up (20 steps): no spike
    at(ctx, component, 20, train=7.0)  # the warm-up's last step: still none
    assert SPIKE * 5.0 == 6.5
    at(ctx, component, 25, train=6.5)  # exactly 1.3 x the lowest: not yet a spike
    assert len(log.messages) == 1
    at(ctx, component, 30, train=6.6)  # above it, after the warm-up: a spike
    at(ctx, component, 35, train=6.6)  # the same again: said once
    assert log.messages[1] == ("off track: the training loss jumped to 6.6000 at step 30 (its lowest was 5.0000): "
                               "check the data around this step (a repeated or garbled document), the learning rate "
                               "and --grad_clip")
    assert len(log.messages) == 2 and {"step": 30, "event": "off_track", "kind": "spike"} in log.records
    at(ctx, component, 50, val=expected(50) * 1.039)  # within 4%: on track
    assert log.messages[-1] == f"step 50: expected val_loss {expected(50):.4f} (±4%): on track"
    # 60%: a fifth of the way from 0.04 to 0.0123, 0.03446, recorded to 4 digits; 4.01% above it is behind
    at(ctx, component, 60, val=expected(60) * 1.0401)
    assert log.records[-2:] == [{"step": 60, "expected_val_loss": round(expected(60), 5), "expected_tolerance": 0.0345},
                                {"step": 60, "event": "off_track", "kind": "behind"}]
    assert log.messages[-2:] == [
        f"step 60: expected val_loss {expected(60):.4f} (±3%): behind",
        f"off track: the validation loss is {expected(60) * 1.0401:.4f} at step 60, 4% above the {expected(60):.4f} "
        "the loss model expects here (its runs spread ±3%): check the learning rate (its runs: --learning_rate "
        "0.008 --muon_lr 0.004 --muon_base_width 256 --warmup_steps 20), the data and --dtype"]
    at(ctx, component, 70, val=9.0)  # over 5% above the best so far: diverging, and behind (said before)
    assert log.messages[-2] == (f"off track: the validation loss rose to 9.0000 at step 70 from its best, "
                                f"{expected(60) * 1.0401:.4f}: lower --learning_rate, or check --grad_clip and --dtype "
                                "(fp16 can overflow)")
    assert log.messages[-1].endswith("behind")
    count = len(log.messages)
    at(ctx, component, 80, val=float("nan"))  # not finite: diverging, said before; nothing to compare
    assert len(log.messages) == count
    at(ctx, component, 100, val=3.5)  # the end: actual against expected
    assert log.messages[-1] == (f"step 100: val_loss 3.5000 at the end, the loss model expected {expected(100):.4f} "
                                f"({3.5 / expected(100) - 1:+.1%})")
    resumed = OnTrack(fake_ctx())
    resumed.load_state_dict(component.state_dict())
    assert resumed.state_dict() == {"flagged": ["spike", "behind", "diverging"], "best_val": 3.5, "lowest_train": 5.0}


def test_the_bounds_are_not_yet_trouble_and_the_last_step_is_compared(monkeypatch):
    # exactly 2.0 expected everywhere (1.75 + 0.25 / N^0 + 0 / D), with 25% of tolerance
    monkeypatch.setattr(on_track, "PROGRESS", Progress(0, (0.1, 1.0), (1.0, 1.0), (0.25, 0.25), 0.0))
    monkeypatch.setattr(on_track, "SHIPPED", LossModel(E=1.75, A=0.25, alpha=0.0, B=0.0, beta=1.0))
    ctx = fake_ctx(control=SimpleNamespace(total_steps=23, sync_counters=lambda: None))
    component = OnTrack(ctx)
    ctx.state.step, ctx.state.tokens_seen, ctx.measured = 10, 40960, {"val_loss": 2.5}
    component.run(ctx)  # 25% above 2.0: at the bound, on track
    assert ctx.logger.messages == ["step 10: expected val_loss 2.0000 (±25%): on track"]
    assert 1.05 * 2.5 == 2.625
    ctx.state.step, ctx.state.tokens_seen, ctx.measured = 20, 81920, {"val_loss": 2.625}
    component.run(ctx)  # exactly 5% above the best: not diverging (but behind)
    assert component.state_dict()["flagged"] == ["behind"]
    assert component.due(23, 23) and not component.due(22, 23)  # the last step, though no multiple of 5 or 10
    ctx.state.step, ctx.state.tokens_seen, ctx.measured = 23, 94208, {"val_loss": 2.2, "train_loss": 2.3}
    component.run(ctx)
    assert ctx.logger.messages[-1] == "step 23: val_loss 2.2000 at the end, the loss model expected 2.0000 (+10.0%)"
    assert component.state_dict()["lowest_train"] == 2.3


def test_a_warm_up_by_ratio_ends_where_the_schedule_s_does():
    ctx = fake_ctx()
    ctx.config.optim = OptimConfig(warmup_ratio=0.1)  # 10 of the 100 steps
    component = OnTrack(ctx)
    at(ctx, component, 5, train=5.0)
    at(ctx, component, 15, train=7.0)  # past the warm-up
    assert component.state_dict()["flagged"] == ["spike"]


def test_a_missing_file_is_no_file_of_the_loss_model(tmp_path):
    assert not same_file(tmp_path / "missing.jsonl", ROOT / "dataset/demo/pretrain_demo.jsonl")
    ctx = fake_ctx()
    ctx.config.data.data_path = [str(tmp_path / "missing.jsonl")]
    assert not_applicable(ctx) == "the loss model was fitted on dataset/demo/pretrain_demo.jsonl alone"


def test_the_tokens_are_read_as_of_the_evaluation_step(monkeypatch):
    """The device-side token counter is synced first: the log syncs it only every --log_interval, which need not
    divide --eval_interval (here the state still holds step 45's count at step 50's evaluation)."""
    monkeypatch.setattr(on_track, "PROGRESS", Progress(0, (0.1, 1.0), (1.0, 1.0), (0.05, 0.05), 0.0))
    monkeypatch.setattr(on_track, "SHIPPED", FALLING)
    ctx = fake_ctx()
    ctx.control.sync_counters = lambda: setattr(ctx.state, "tokens_seen", 4096 * ctx.state.step)
    component = OnTrack(ctx)
    ctx.state.step, ctx.state.tokens_seen, ctx.measured = 50, 4096 * 45, {"val_loss": 3.0}
    component.run(ctx)
    assert ctx.logger.records == [{"step": 50, "expected_val_loss": round(3 + 1e5 / (4096 * 50), 5),
                                   "expected_tolerance": 0.05}]


def test_a_run_without_a_validation_split_expects_nothing(monkeypatch):
    ctx = fake_ctx()
    component = OnTrack(ctx)
    at(ctx, component, 10, train=5.0, val=None)
    assert ctx.logger.messages == [] and ctx.logger.records == []


# ---------------------------------------------------------------------------- a real run
def test_a_pretraining_run_on_the_loss_model_s_corpus_reports_its_expectation(corpus, tmp_path, capsys,
                                                                              monkeypatch):
    monkeypatch.setattr(on_track, "FIT_DATA", str(corpus["pretrain"]))  # the small corpus stands in for the demo's
    monkeypatch.setattr(on_track, "PROGRESS", dataclasses.replace(PROGRESS, min_tokens=0))  # and its 8K tokens count
    assert train_pretrain.main(flags(corpus, tmp_path, max_seq_len=256, max_steps=8)) == 0
    err = capsys.readouterr().err
    records = strict_records(tmp_path / "run")
    expected = [r for r in records if "expected_val_loss" in r]
    assert [r["step"] for r in expected] == [4, 8]
    assert "step 4: expected val_loss" in err and "step 8: val_loss" in err and "at the end, the loss model" in err
    config = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert config["resolved"]["loss_model"] == "applies"
    assert train_pretrain.main(flags(corpus, tmp_path, "other", max_seq_len=64, max_steps=4)) == 0
    assert "expected val_loss" not in capsys.readouterr().err  # another context: nothing guessed
    assert not any("expected_val_loss" in r for r in strict_records(tmp_path / "other"))
