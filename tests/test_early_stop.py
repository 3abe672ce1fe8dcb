"""Early stopping: patience on the validation loss, the overfitting gap, the `best` pointer, resume."""
from __future__ import annotations

import json

import pytest

import eval_model
import train_pretrain
from model.loading import resolve_model_dir
from trainer_utils.components.evaluation import Evaluation

from conftest import cli_flags, read_metrics


def flags(corpus, tmp_path, **over) -> list[str]:
    base = {"data_path": corpus["pretrain"], "cache_dir": corpus["cache"], "out_dir": tmp_path, "run_name": "run",
            "preset": "tiny", "batch_size": 4, "max_steps": 40, "dtype": "float32", "log_interval": 2,
            "eval_interval": 2, "save_interval": 1000, "num_workers": 0, "learning_rate": 1e-3, "warmup_steps": 1,
            "val_fraction": 0.1}
    return cli_flags(base, **over)


def scripted_val_losses(monkeypatch, values: list[float]) -> None:
    """The evaluation component returns these values in turn (then repeats the last)."""
    it = iter(values)
    last = [values[-1]]

    def evaluate(self, ctx):
        last[0] = next(it, last[0])
        return {ctx.val_sets[0].name: {"loss": last[0]}}

    monkeypatch.setattr(Evaluation, "evaluate", evaluate)


def events(run) -> list[dict]:
    with open(run / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if r.get("event") == "early_stop"]


def test_patience_stops_keeps_the_best_checkpoint_and_exits_0(corpus, tmp_path, monkeypatch, capsys):
    # evaluations at steps 2, 4, 6, ...: the best is at step 4; patience 3 runs out at step 10
    scripted_val_losses(monkeypatch, [5.0, 4.0, 4.5, 4.2, 4.1, 3.9])
    assert train_pretrain.main(flags(corpus, tmp_path, early_stop_patience=3, keep_last=1)) == 0
    run = tmp_path / "run"
    err = capsys.readouterr().err
    assert "early stop after step 10: the validation loss has not improved for 3 evaluations" in err
    assert "Best: step 4 (val_loss 4.0000)" in err
    assert (run / "best").read_text().strip() == "checkpoints/step_00000004"
    assert (run / "latest").read_text().strip() == "checkpoints/step_00000010"
    # keep_last 1 prunes older checkpoints, never the best one
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000004", "step_00000010"]
    assert resolve_model_dir(run / "best") == run / "checkpoints/step_00000004"
    [event] = events(run)
    assert (event["step"], event["best_step"], event["best_val_loss"]) == (10, 4, 4.0)
    assert read_metrics(run)[-1]["step"] == 10  # no step after the stop


def test_overfit_gap_stops_when_validation_drifts_above_training(corpus, tmp_path, monkeypatch, capsys):
    losses = iter([])

    def val_above_train(self, ctx):
        return {ctx.val_sets[0].name: {"loss": (ctx.measured.get("train_loss") or 9.0) + next(losses, 1.0)}}

    losses = iter([0.1, 0.2, 0.8])  # gaps at steps 2, 4, 6
    monkeypatch.setattr(Evaluation, "evaluate", val_above_train)
    assert train_pretrain.main(flags(corpus, tmp_path, overfit_gap=0.5)) == 0
    err = capsys.readouterr().err
    assert "early stop after step 6: the validation loss" in err and "by 0.8000 (--overfit_gap 0.5)" in err
    assert [e["step"] for e in events(tmp_path / "run")] == [6]


def test_without_early_stopping_nothing_changes(corpus, tmp_path, monkeypatch):
    scripted_val_losses(monkeypatch, [5.0, 6.0, 7.0, 8.0])
    assert train_pretrain.main(flags(corpus, tmp_path, max_steps=10)) == 0
    assert not (tmp_path / "run/best").exists() and events(tmp_path / "run") == []
    assert read_metrics(tmp_path / "run")[-1]["step"] == 10


def test_resume_remembers_the_best(corpus, tmp_path, monkeypatch):
    """The patience counter and the best loss are part of the checkpoint: stopping and resuming changes
    nothing about when early stopping fires."""
    values = [5.0, 4.0, 4.5, 4.6, 4.7]
    scripted_val_losses(monkeypatch, values)
    assert train_pretrain.main(flags(corpus, tmp_path, early_stop_patience=3, max_steps=6, save_interval=6)) == 0
    scripted_val_losses(monkeypatch, values[3:])  # the evaluations a straight run would see from step 8 on
    assert train_pretrain.main(flags(corpus, tmp_path, early_stop_patience=3, resume=True)) == 0
    [event] = events(tmp_path / "run")
    assert (event["step"], event["best_step"]) == (10, 4)


@pytest.mark.parametrize("extra,message", [
    (["--val_fraction", "0"], "need --val_fraction > 0"),
    (["--early_stop_patience", "0"], "--early_stop_patience must be >= 1"),
])
def test_early_stopping_needs_validation_data(corpus, tmp_path, capsys, extra, message):
    assert train_pretrain.main(flags(corpus, tmp_path, early_stop_patience=2) + extra) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_early_stopping_for_real_on_an_overfitting_run(corpus, tmp_path, capsys):
    """No scripted losses: a tiny model at a high learning rate on 40 documents stops improving on its held-out
    ones; the run stops by itself, and the best checkpoint loads for evaluation."""
    argv = flags(corpus, tmp_path, batch_size=8, max_steps=400, learning_rate=1e-2, warmup_steps=5,
                 eval_interval=10, log_interval=10, early_stop_patience=2)
    assert train_pretrain.main(argv) == 0
    run = tmp_path / "run"
    [event] = events(run)
    assert event["step"] < 400 and event["best_step"] < event["step"]
    vals = {r["step"]: r["val_loss"] for r in map(json.loads, open(run / "metrics.jsonl")) if "val_loss" in r}
    assert event["best_val_loss"] == pytest.approx(min(vals.values()), abs=1e-5)
    assert all(vals[s] >= event["best_val_loss"] - 1e-9 for s in vals if s > event["best_step"])
    capsys.readouterr()
    assert eval_model.main(["--checkpoint", str(run / "best"), "--prompt", "The", "--max_new_tokens", "4",
                            "--temperature", "0"]) == 0
    assert f"step_{event['best_step']:08d}" in capsys.readouterr().err
