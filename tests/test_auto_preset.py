"""`train_pretrain.py --preset auto --time_budget D`: the planner's pick is trained, with the settings its loss model
was fitted with as defaults; the plan pays from the budget; a resumed run keeps its model and plans nothing; and what
auto cannot do is refused in one line."""
from __future__ import annotations

import json

import pytest
from test_train import flags

import train_full_sft
import train_pretrain
from common.errors import ConfigError
from trainer_utils import driver as driver_mod
from trainer_utils import planner
from trainer_utils.loss_model import RECIPE
from trainer_utils.planner import PresetRow, resolve_auto
from trainer_utils.stages import parse_train_config

from conftest import strict_records


def auto_config(tmp_path, *extra):
    return parse_train_config("pretrain", ["--preset", "auto", "--time_budget", "10m", "--out_dir", str(tmp_path),
                                           *extra], None)


def test_auto_defaults_to_the_loss_model_s_recipe_and_four_epochs(tmp_path):
    o = auto_config(tmp_path).optim
    assert ((o.batch_size, o.learning_rate, o.muon_lr, o.muon_base_width, o.warmup_steps, o.epochs)
            == (16, 8e-3, 4e-3, 256, 20, 4)
            == (RECIPE["batch_size"], RECIPE["learning_rate"], RECIPE["muon_lr"], RECIPE["muon_base_width"],
                RECIPE["warmup_steps"], planner.MAX_EPOCHS))
    o = auto_config(tmp_path, "--learning_rate", "1e-3", "--batch_size", "8", "--epochs", "2").optim
    assert ((o.batch_size, o.learning_rate, o.muon_lr, o.muon_base_width, o.warmup_steps, o.epochs)
            == (8, 1e-3, None, None, 20, 2))  # given: one rate for all, at any width
    # flags win; Muon's rate is then the one given (its flag's default), unless given too
    o = auto_config(tmp_path, "--learning_rate", "1e-3", "--muon_lr", "2e-3").optim
    assert (o.learning_rate, o.muon_lr, o.muon_base_width) == (1e-3, 2e-3, 256)
    o = parse_train_config("pretrain", ["--preset", "depth-3"], None).optim  # a named preset: the stage's defaults
    assert ((o.batch_size, o.learning_rate, o.muon_lr, o.muon_base_width, o.warmup_steps, o.epochs)
            == (32, 5e-4, None, None, None, 1))
    for other in (["--optimizer", "adamw"], ["--optimizer", "sgd"]):  # no Muon: one rate for all, no refusal
        o = auto_config(tmp_path, *other).optim
        assert (o.optimizer, o.learning_rate, o.muon_lr, o.muon_base_width) == (other[1], 8e-3, None, None)


@pytest.mark.parametrize("script,argv,message", [
    (train_pretrain, ["--preset", "auto"],
     "error: --preset auto sizes the model for a time budget: add --time_budget (90s, 10m, 2h)"),
    (train_pretrain, ["--preset", "auto", "--time_budget", "1m", "--hidden_size", "128", "--num_hidden_layers", "2"],
     "error: --preset auto picks the model's whole shape; drop --hidden_size, --num_hidden_layers"),
    (train_full_sft, ["--preset", "auto", "--time_budget", "1m"],
     "error: --preset auto sizes a new model for a pretraining run (train_pretrain.py); name a preset here"),
])
def test_what_auto_cannot_do_is_one_line(corpus, tmp_path, capsys, script, argv, message):
    base = [a for a in flags(corpus, tmp_path, data_path=corpus["sft"] if script is train_full_sft else None)
            if a not in ("--preset", "tiny")]
    assert script.main([*base, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [message] and not (tmp_path / "run").exists(), err


def pick(name, loss, measured=True):
    return PresetRow(name, 1000, 500, 16, 256, 10.0, measured, 0, False, True, 100.0, 100.0, 1.0, loss)


def stub_plan(monkeypatch, best):
    asked = []

    def plan(budget_s, device, data_path, **kw):
        asked.append((budget_s, device, data_path, kw))
        rows = [pick(f"depth-{d}", 4.0 + d, measured=False) for d in range(1, 13)] if best else [
            PresetRow("depth-9", 1, 1, 1, 256, None, False, 9, False, False)]
        if best:
            rows[2] = best  # the third of twelve: the table shows the rows around it
        return rows, best, "the reason", "the header"

    monkeypatch.setattr(planner, "plan", plan)
    return asked


def test_auto_sets_the_pick_and_a_name_resume_finds(monkeypatch, tmp_path, capsys):
    asked = stub_plan(monkeypatch, pick("depth-3", 3.5))
    config = auto_config(tmp_path, "--device", "cpu", "--dtype", "float32", "--tokenizer", "tok", "--max_seq_len",
                         "128", "--data_path", "a.jsonl:2", "b.jsonl")
    resolve_auto(config, "pretrain", 42.0)
    assert (config.model.preset, config.run.run_name) == ("depth-3", "pretrain-auto")
    # what is left of the budget, on the run's device, precision, data, tokenizer and context
    assert asked == [(558.0, "cpu", ["a.jsonl:2", "b.jsonl"], dict(seq_len=128, min_seconds=planner.AUTO_MIN_SECONDS,
                                                                   dtype="float32", tokenizer_dir="tok"))]
    err = capsys.readouterr().err.splitlines()
    rows = planner.plan(0, "cpu", [])[0]
    assert err == ["--preset auto: the header", *planner.table(planner.shown(rows, rows[2]), rows[2]).splitlines(),
                   "--preset auto: the reason"]
    assert len(err) == 2 + 2 + 5 and "| depth-3 ⭐ |" in err[5]  # depth-1 to depth-5 of the twelve
    named = auto_config(tmp_path, "--run_name", "mine")
    resolve_auto(named, "pretrain", 0.0)
    assert named.run.run_name == "mine"
    # a short budget times each candidate for a share of it: 0.5% of the 72 s left (at 558 s, the 1-s cap above)
    short = auto_config(tmp_path, "--time_budget", "80s")
    resolve_auto(short, "pretrain", 8.0)
    assert asked[-1][0] == 72.0 and asked[-1][3]["min_seconds"] == pytest.approx(0.36)


def test_a_resumed_auto_run_keeps_its_model_and_plans_nothing(monkeypatch, tmp_path):
    asked = stub_plan(monkeypatch, pick("depth-3", 3.5))
    config = auto_config(tmp_path, "--resume")
    resolve_auto(config, "pretrain", 0.0)  # nothing to resume yet: planned
    assert config.model.preset == "depth-3" and len(asked) == 1
    checkpoint = tmp_path / "pretrain-auto" / "step_00000010"
    checkpoint.mkdir(parents=True)
    (checkpoint / "training_state.pt").write_bytes(b"")
    (tmp_path / "pretrain-auto" / "latest").write_text("step_00000010")
    monkeypatch.setattr(planner, "latest_checkpoint", lambda run_dir: checkpoint if run_dir.name == "pretrain-auto"
                        else None)
    config = auto_config(tmp_path, "--resume")
    resolve_auto(config, "pretrain", 0.0)
    assert config.model.preset is None and len(asked) == 1  # the checkpoint's model


def test_auto_refuses_what_it_cannot_plan(monkeypatch, tmp_path):
    asked = stub_plan(monkeypatch, None)
    with pytest.raises(ConfigError, match="^--preset auto: the reason$"):
        resolve_auto(auto_config(tmp_path), "pretrain", 0.0)
    with pytest.raises(ConfigError) as e:  # the budget gone before the plan: nothing to plan for
        resolve_auto(auto_config(tmp_path), "pretrain", 600.0)
    assert str(e.value) == ("--time_budget 10m: setting up took 10m 00s, the whole budget, before the plan; give a "
                            "longer one") and len(asked) == 1
    with pytest.raises(ConfigError, match="^--preset auto: the reason$"):  # a second left is still a budget
        resolve_auto(auto_config(tmp_path), "pretrain", 599.0)
    assert asked[-1][0] == 1.0
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as e:
        resolve_auto(auto_config(tmp_path), "pretrain", 0.0)
    assert str(e.value) == ("--preset auto times candidates in one process; under torchrun, plan first with `python -m "
                            "model --plan --time_budget D` and pass the --preset it recommends")


def test_an_auto_run_trains_the_pick_within_its_budget(corpus, tmp_path, capsys, monkeypatch):
    # a context of 32 tokens: the depth family's smallest steps take milliseconds, so several are timed; the budget
    # counts from main(), not from the start of this long-lived test process
    monkeypatch.setattr(driver_mod, "process_age", lambda: 0.0)
    base = [a for a in flags(corpus, tmp_path, max_steps=None, batch_size=None, learning_rate=None,
                             warmup_steps=None, eval_interval=50, save_interval=50, log_interval=10)
            if a not in ("--preset", "tiny", "--run_name", "run")]
    assert train_pretrain.main([*base, "--preset", "auto", "--time_budget", "30s", "--max_seq_len", "32"]) == 0
    err = capsys.readouterr().err
    run_dir = tmp_path / "pretrain-auto"
    saved = json.loads((run_dir / "train_config.json").read_text())
    chosen = saved["model"]["preset"]
    assert chosen.startswith("depth-") and f"--preset auto: {chosen}: the lowest expected validation loss" in err
    assert saved["optim"]["batch_size"] == 16 and saved["optim"]["learning_rate"] == 8e-3
    assert saved["optim"]["muon_lr"] is None  # the tests' AdamW: one rate
    assert any("val_loss" in r for r in strict_records(run_dir))
    assert train_pretrain.main([*base, "--preset", "auto", "--time_budget", "30s", "--max_seq_len", "32",
                                "--resume"]) == 0  # resumed: its own model, the plan it recorded
    assert "--preset auto:" not in capsys.readouterr().err
