"""bench/bench_learning.py, the ablation harness: the budget arithmetic, the time-to-target interpolation and the
input checks in process; real tiny ablations (equal tokens, equal time with seeds, a failing run) as subprocesses
of the harness, marked slow."""
from __future__ import annotations

import json

import pytest

from bench import bench_learning as bl  # a module, not loaded from its path: its dataclasses need sys.modules

from conftest import ROOT


def point(elapsed_s: float, val_loss: float) -> dict[str, float]:
    return {"step": 0, "tokens": 0, "elapsed_s": elapsed_s, "val_loss": val_loss}


def test_time_to_reach_interpolates_between_evaluations():
    curve = [point(10, 5.0), point(20, 4.0), point(30, 3.5)]
    assert bl.time_to_reach(curve, 4.5) == pytest.approx(15)  # halfway from 5.0 to 4.0
    assert bl.time_to_reach(curve, 3.75) == pytest.approx(25)
    assert bl.time_to_reach(curve, 4.0) == pytest.approx(20)  # exactly at an evaluation
    assert bl.time_to_reach(curve, 6.0) == 10  # already at the first evaluation: its time, an upper bound
    assert bl.time_to_reach(curve, 3.0) is None  # never
    # the first time it gets there counts, even when a later evaluation is worse again
    assert bl.time_to_reach([point(10, 5.0), point(20, 3.0), point(30, 4.5)], 4.0) == pytest.approx(15)


def test_steps_and_evaluations_of_a_budget():
    assert bl.steps_for_tokens(819_200, 16 * 256) == 200
    assert bl.steps_for_tokens(819_199, 16 * 256) == 199  # never more tokens than the budget
    assert bl.steps_for_tokens(10, 4096) == 1
    assert bl.steps_for_seconds(120, 0.65) == 184
    assert bl.steps_for_seconds(1, 5.0) == 1
    assert bl.steps_for_seconds(120, 0.65, startup_s=10) == 169  # the run's one-off warm-up is spent too
    assert bl.eval_interval(200, 10) == 20 and bl.eval_interval(200, 12) == 17 and bl.eval_interval(5, 12) == 1


def test_flags_from_an_ablation_file_value():
    assert bl.flag_list({"learning_rate": 1e-3, "compile": False, "grad_checkpointing": True,
                         "data_path": ["a.jsonl", "b.jsonl"], "dropout": None}, "x") == \
        ["--learning_rate", "0.001", "--no-compile", "--grad_checkpointing", "--data_path", "a.jsonl", "b.jsonl"]
    assert bl.flag_list("--warmup_steps 50 --optimizer sgd", "x") == ["--warmup_steps", "50", "--optimizer", "sgd"]
    assert bl.flag_list(["--seed", 3], "x") == ["--seed", "3"] and bl.flag_list({}, "x") == []
    assert bl.parse_config_arg('lr=--learning_rate 1e-3 --min_lr "1e-5"') == \
        bl.Config("lr", ["--learning_rate", "1e-3", "--min_lr", "1e-5"])


@pytest.mark.parametrize("name,configs", [("demo-recipe", 3), ("demo-muon-switches", 6), ("minimind-26m-recipe", 3)])
def test_the_shipped_ablation_files_check_and_plan_equal_tokens(capsys, name, configs):
    assert bl.main(["--ablation", str(ROOT / f"bench/ablations/{name}.yaml"), "--dry_run", "--out", "o"]) == 0
    commands = capsys.readouterr().out.splitlines()
    assert len(commands) == configs
    assert len({c.split("--max_steps ")[1] for c in commands}) == 1  # every configuration: the same steps


def test_the_demo_recipe_ablation_pins_what_it_compares(capsys):
    """before/after are spelled out in full, so the ablation means the same after the recipe changes."""
    assert bl.main(["--ablation", str(ROOT / "bench/ablations/demo-recipe.yaml"), "--dry_run", "--out", "o"]) == 0
    before, _, after = capsys.readouterr().out.splitlines()
    assert "--optimizer adamw --no-qk_norm --learning_rate 0.002" in before and "--max_steps 450" in before
    assert "--optimizer muon --qk_norm --learning_rate 0.004" in after


def test_an_equal_time_dry_run_shows_the_calibrations_and_the_seeds(capsys):
    argv = ["--recipe", str(ROOT / "recipes/demo-pretrain.yaml"), "--config", "a=", "--config",
            "b=--learning_rate 1e-3", "--seconds", "60", "--seeds", "1", "2", "--dry_run"]
    assert bl.main(argv) == 0
    commands = capsys.readouterr().out.splitlines()
    assert [c.split("--run_name ")[1].split()[0] for c in commands] == \
        ["a-calibration", "b-calibration", "a-seed1", "b-seed1", "a-seed2", "b-seed2"]
    assert "--max_steps 10 --log_interval 2" in commands[0] and commands[-1].endswith("--seed 2")


@pytest.mark.parametrize("argv,message", [
    (["--ablation", "missing.yaml", "--tokens", "10"], "missing.yaml: no such ablation file"),
    (["--config", "a=--bogus 1", "--tokens", "10"], "configuration 'a': train_pretrain.py rejects its flags: "
                                                     "unrecognized arguments: --bogus 1"),
    (["--config", "a=--learning_rate -1", "--tokens", "10"], "configuration 'a': --learning_rate must be > 0"),
    (["--config", "a=--max_steps 5", "--tokens", "10"], "configuration 'a' set --max_steps: the harness sets"),
    (["--base", "--epochs 2", "--config", "a=", "--tokens", "10"], "the shared flags set --epochs"),
    (["--config", "a=--seed 3", "--tokens", "10", "--seeds", "1"], "configuration 'a' set --seed"),
    (["--config", "a=", "--config", "a=", "--tokens", "10"], "configuration names must differ"),
    (["--config", "a/b=", "--tokens", "10"], "configuration name 'a/b'"),
    (["--config", "a", "--tokens", "10"], 'expected NAME="FLAGS"'),
    (["--config", "a="], "give one budget"),
    (["--config", "a=", "--tokens", "0"], "the budget must be positive"),
    (["--tokens", "10"], "no configurations"),
    (["--recipe", "nope.yaml", "--config", "a=", "--tokens", "10"], "recipe nope.yaml: no such file"),
])
def test_bad_input_is_a_one_line_error(argv, message, capsys):
    assert bl.main(argv + ["--dry_run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_configurations_with_different_tokenizers_are_compared_by_bits_per_byte(capsys):
    """A loss per token is no measure across tokenizers (their tokens differ): the default metric becomes val_bpb,
    and asking for val_loss there is refused."""
    recipe = ["--recipe", str(ROOT / "recipes/demo-pretrain.yaml"), "--tokens", "4096"]
    same = ["--config", "a=", "--config", f"b=--tokenizer {ROOT / 'model/tokenizer'}"]
    other = ["--config", "a=", "--config", f"v1=--tokenizer {ROOT / 'model/tokenizer-v1'}"]
    assert bl.setup(bl.parse_args(recipe + same))[-1] == "val_loss"  # the default tokenizer, named or not
    assert bl.setup(bl.parse_args(recipe + other))[-1] == "val_bpb"
    assert bl.setup(bl.parse_args(recipe + same + ["--metric", "val_bpb"]))[-1] == "val_bpb"
    assert bl.setup(bl.parse_args(["--ablation", str(ROOT / "bench/ablations/demo-tokenizer.yaml")]))[-1] == \
        "val_bpb"
    assert bl.main(recipe + other + ["--metric", "val_loss", "--dry_run"]) == 2
    assert "different tokenizers" in capsys.readouterr().err


def test_the_metric_decides_the_order_the_difference_and_the_time_to_the_baseline():
    """Two configurations where loss and bits per byte disagree (a coarser tokenizer: more nats per token, fewer
    bits per byte): compared by val_bpb, the table puts the better bpb first and differences bpb."""
    def curve(*points):
        return [{"step": i + 1, "tokens": 0, "elapsed_s": 10.0 * (i + 1), "val_loss": loss, "val_bpb": bpb}
                for i, (loss, bpb) in enumerate(points)]

    plans = [bl.Plan(bl.Config(name, []), 256, 42, steps=2) for name in ("base", "coarse")]
    runs = [[bl.Run(1, [], ROOT, curve=curve((5.0, 2.0), (4.0, 1.80))),
             bl.Run(2, [], ROOT, curve=curve((5.0, 2.0), (4.2, 1.84)))],
            [bl.Run(1, [], ROOT, curve=curve((5.5, 1.9), (4.5, 1.70))),
             bl.Run(2, [], ROOT, curve=curve((5.5, 1.9), (4.7, 1.74)))]]
    rows = [bl.summarize(p, r) for p, r in zip(plans, runs)]
    assert (rows[0]["final_val_bpb"], rows[0]["final_val_bpb_min"], rows[0]["final_val_bpb_max"]) == (1.82, 1.8, 1.84)
    bl.compare(rows, "val_bpb")
    assert rows[1]["delta_vs_baseline"] == pytest.approx(-0.1)
    # the baseline's final 1.82 is reached between the coarse curve's points 1.9 (10 s) and 1.72 (20 s)
    assert rows[1]["time_to_baseline_s"] == pytest.approx(10 + 10 * 0.08 / 0.18, abs=1e-3)
    report = {"budget": {"mode": "tokens", "tokens": 512}, "seeds": [1, 2], "shared_flags": [], "baseline": "base",
              "metric": "val_bpb", "device": "cpu", "host": "x", "torch": "t", "configs": rows}
    table = bl.table(report)
    names = [line.split("|")[1].strip() for line in table.splitlines()
             if line.startswith("| ") and "config" not in line]
    assert names == ["coarse", "**base**"] and "Δ bpb vs baseline" in table
    assert "| 1.7200 (1.7000–1.7400) | -0.1000 |" in table  # the seeds' range is the metric's
    bl.compare(rows, "val_loss")
    assert rows[1]["delta_vs_baseline"] == pytest.approx(0.5)  # by loss per token, the other way round


def test_an_ablation_file_with_unknown_keys_is_refused(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text("configs: {a: {}}\ntokenz: 5\n")
    assert bl.main(["--ablation", str(tmp_path / "a.yaml"), "--tokens", "5", "--dry_run"]) == 2
    assert "unknown keys tokenz" in capsys.readouterr().err


def tiny_base(corpus) -> str:
    return (f"--preset tiny --data_path {corpus['pretrain']} --cache_dir {corpus['cache']} --max_seq_len 64 "
            "--dtype float32 --num_workers 0 --log_interval 2 --learning_rate 1e-3")


@pytest.mark.slow  # trains in subprocesses (two tiny runs)
def test_equal_tokens_ablation_writes_results_table_and_plot(corpus, tmp_path, capsys):
    """Two configurations with different tokens per step train the same tokens; the table's time to the
    baseline's loss is the one the curves give."""
    out = tmp_path / "ablation"
    argv = ["--base", tiny_base(corpus) + " --batch_size 4", "--config", "baseline=",
            "--config", "small-batch-fast=--batch_size 2 --learning_rate 4e-3", "--tokens", "2048", "--evals", "4",
            "--out", str(out)]
    assert bl.main(argv) == 0
    report = json.loads((out / "results.json").read_text())
    assert report["budget"] == {"mode": "tokens", "tokens": 2048} and report["baseline"] == "baseline"
    base, other = report["configs"]
    assert (base["steps"], base["tokens_per_step"], other["steps"], other["tokens_per_step"]) == (8, 256, 16, 128)
    assert base["tokens"] == other["tokens"] == 2048
    for row in (base, other):
        [run] = row["runs"]
        assert run["command"].endswith(f"--max_steps {row['steps']} --eval_interval {row['eval_interval']}")
        assert [p["step"] for p in row["curve"]] == list(range(row["eval_interval"], row["steps"] + 1,
                                                                row["eval_interval"]))
        assert row["curve"][-1]["tokens"] == 2048 and row["final_val_loss"] == row["curve"][-1]["val_loss"]
        assert row["final_val_bpb"] == row["curve"][-1]["val_bpb"] > 0
        assert row["wall_s"] == row["curve"][-1]["elapsed_s"] > 0 and run["process_s"] > row["wall_s"]
        assert row["tokens_per_s"] == round(2048 / row["wall_s"])
        times = [p["elapsed_s"] for p in row["curve"]]
        assert times == sorted(times)
    # the baseline reaches its own final loss at its end, or earlier when its curve dips below it before
    assert base["delta_vs_baseline"] == 0 and base["time_to_baseline_frac"] <= 1
    reached = bl.time_to_reach(other["curve"], base["final_val_loss"])
    frac = None if reached is None else round(reached / base["wall_s"], 4)
    assert other["time_to_baseline_frac"] == frac
    table = (out / "results.md").read_text()
    [row] = [line for line in table.splitlines() if line.startswith("| small-batch-fast |")]
    assert row.split("|")[-2].strip() == ("not reached" if frac is None else
                                          f"{'≤ ' if other['time_to_baseline_upper_bound'] else ''}{frac:.2f}×")
    assert "| **baseline** | 8 | 2,048 |" in table
    rows = [line for line in table.splitlines() if line.startswith("| ") and "config" not in line]
    losses = [float(line.split("|")[6]) for line in rows]
    assert losses == sorted(losses)  # best first
    png = out / "loss_vs_time.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["baseline", "small-batch-fast"]
    printed = capsys.readouterr().out
    assert "[1/2] baseline: 8 steps, 2,048 tokens" in printed and "step 8: val_loss" in printed


@pytest.mark.slow  # trains in subprocesses (a calibration and two seeds)
def test_equal_time_ablation_calibrates_and_repeats_seeds(corpus, tmp_path):
    out = tmp_path / "ablation"
    argv = ["--base", tiny_base(corpus) + " --batch_size 2", "--config", "only=", "--seconds", "3",
            "--seeds", "1", "2", "--evals", "3", "--calibration_steps", "4", "--out", str(out)]
    assert bl.main(argv) == 0
    [row] = json.loads((out / "results.json").read_text())["configs"]
    assert row["steps"] == bl.steps_for_seconds(3, row["calibrated_seconds_per_step"], row["calibrated_startup_s"])
    assert [r["seed"] for r in row["runs"]] == [1, 2]
    finals = [r["final_val_loss"] for r in row["runs"]]
    assert row["final_val_loss"] == pytest.approx(sum(finals) / 2, abs=1e-5)
    assert (row["final_val_loss_min"], row["final_val_loss_max"]) == (min(finals), max(finals))
    assert row["wall_s"] == pytest.approx(sum(r["wall_s"] for r in row["runs"]) / 2, abs=1e-3)
    assert "(" in (out / "results.md").read_text().split("| **only** |")[1].split("|")[4]  # the seeds' range
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["only-calibration", "only-seed1", "only-seed2"]


@pytest.mark.slow  # starts train_pretrain.py
def test_a_failing_run_reports_its_configuration_and_output(corpus, tmp_path, capsys):
    """Bad input only train_pretrain.py finds (a missing data file) stops the ablation: the others would fail
    alike."""
    argv = ["--base", tiny_base(corpus) + " --batch_size 2",
            "--config", f"bad=--data_path {tmp_path / 'missing.jsonl'}", "--config", "good=", "--tokens", "256",
            "--out", str(tmp_path)]
    assert bl.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: configuration 'bad' (seed 42): train_pretrain.py exited with 2")
    assert "missing.jsonl" in err and str(tmp_path / "logs" / "bad.log") in err
    assert not (tmp_path / "results.json").exists() and not (tmp_path / "runs" / "good").exists()
