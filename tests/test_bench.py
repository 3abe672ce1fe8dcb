"""Benchmark scripts: each runs end to end on tiny settings and writes well-formed results, and
bench/gpu_check.sh fails cleanly (a summary, no traceback, no hang) on a machine without a GPU."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from trainer_utils.loss_model import LossModel

from conftest import ROOT, demo_records, write_jsonl

pytestmark = pytest.mark.slow  # real processes: `make test-fast` leaves this module out


def bench_module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench_out(corpus, tmp_path_factory):
    """throughput.json and generation.json from real (tiny) runs, named as gpu_check.sh names them."""
    out = tmp_path_factory.mktemp("bench")
    bench_module("bench_train").main(
        ["--presets", "tiny", "--dtypes", "float32", "--compile", "off", "--steps", "3", "--batch_size", "2",
         "--max_seq_len", "32", "--optimizers", "adamw", "--data_path", str(corpus["pretrain"]),
         "--cache_dir", str(corpus["cache"]),
         "--out", str(out / "throughput.json")])
    bench_module("bench_generate").main(["--preset", "tiny", "--prompt_len", "8", "--new_tokens", "6", "--batch", "2",
                                         "--repeats", "1", "--device", "cpu", "--out", str(out / "generation.json")])
    return out


def test_bench_train_measures_bare_step_and_loop(bench_out):
    report = json.loads((bench_out / "throughput.json").read_text())
    assert report["device"].startswith("cpu") and report["torch"] == torch.__version__
    [row] = report["results"]
    assert (row["preset"], row["dtype"], row["compile"], row["measured_steps"]) == ("tiny", "float32", False, 3)
    assert row["bare_step_s"] > 0 and row["loop_step_s"] > 0 and 0 <= row["loop_overhead_frac"] < 1
    assert row["tokens_per_s"] > 0 and 0 <= row["data_wait_frac"] < 1 and row["peak_mem_gb"] > 0
    assert "mfu" not in row  # no known peak on CPU
    assert row["optimizer"] == "adamw" and 0 < row["optimizer_step_s"] < row["bare_step_s"]
    # Both times are rounded to 4 decimals (0.00005 either way), which at a tiny step is several percent of the
    # optimizer's time: the share must lie within what the unrounded times allow.
    opt, bare, half = row["optimizer_step_s"], row["bare_step_s"], 0.00005
    assert (opt - half) / (bare + half) - half <= row["optimizer_frac"] <= (opt + half) / (bare - half) + half
    assert row["precision"] == "float32 (--dtype float32; cpu: " + row["precision"].split("cpu: ", 1)[1]


def test_bench_train_puts_muon_beside_adamw_on_a_recipe(corpus, tmp_path):
    """--recipe measures a recipe's model; --dtypes auto is the policy's dtype; Muon's rows get their ratio to
    AdamW's and the optimizer's share of the step."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model:\n  preset: tiny\n  hidden_size: 32\n  num_hidden_layers: 1\n  max_seq_len: 32\n"
                      "  qk_norm: true\noptim:\n  batch_size: 2\n")
    out = tmp_path / "muon.json"
    bench_module("bench_train").main(
        ["--recipe", str(recipe), "--dtypes", "auto", "--compile", "off", "--steps", "2", "--repeats", "1",
         "--data_path", str(corpus["pretrain"]), "--cache_dir", str(corpus["cache"]), "--out", str(out)])
    report = json.loads(out.read_text())
    adamw, muon = report["results"]
    expected = "bfloat16" if report["precision"].startswith("cpu with native bf16") else "float32"
    for row in (adamw, muon):
        assert (row["preset"], row["batch_size"], row["seq_len"], row["dtype"]) == ("recipe", 2, 32, expected)
        assert row["bare_step_s"] > 0 and row["loop_step_s"] > 0 and row["optimizer_frac"] > 0
    # The optimizer step is timed on its own, apart from the bare step it is part of: on this one-layer model Muon's
    # Newton-Schulz is nearly the whole step, so two steps of timing noise can put its share a little above 1
    # (1.02 seen on a 2-core EPYC with avx512_bf16); AdamW's share is far below.
    assert adamw["optimizer_frac"] < 1 and muon["optimizer_frac"] < 1.5
    assert (adamw["optimizer"], muon["optimizer"], muon["newton_schulz_dtype"]) == ("adamw", "muon", expected)
    assert muon["vs_adamw"]["bare_step_ratio"] == pytest.approx(muon["bare_step_s"] / adamw["bare_step_s"], rel=0.01)
    assert "vs_adamw" not in adamw


def test_bench_generate_checks_identical_outputs_then_times(bench_out):
    result = json.loads((bench_out / "generation.json").read_text())
    assert (result["preset"], result["batch"], result["new_tokens"]) == ("tiny", 2, 6)
    assert result["kv_cache_tokens_per_s"] > 0 and result["no_cache_tokens_per_s"] > 0
    if "transformers_tokens_per_s" in result:  # the dev requirements install transformers
        assert result["kv_cache_vs_transformers"] > 0


def test_gpu_check_summary_reads_the_bench_outputs(bench_out, capsys):
    """The summary formats what the bench scripts really write (an MFU added as a GPU run would have it)."""
    summarize = bench_module("gpu_check_summary").summarize
    report = json.loads((bench_out / "throughput.json").read_text())
    report["results"][0]["mfu"] = 0.4123
    (bench_out / "throughput.json").write_text(json.dumps(report))
    names = ["environment", "cuda_tests", "sdpa_backend", "throughput", "generation"]
    summary = summarize(bench_out, 470, names, ["PASS"] * 5, [1, 2, 3, 4, 5])
    printed = capsys.readouterr().out
    assert summary["passed"] and printed.rstrip().endswith("PASS") and "15 s of a 470 s budget" in printed
    assert "tokens/s, MFU 41.2%" in printed and "KV cache" in printed
    assert json.loads((bench_out / "summary.json").read_text())["throughput"]["results"][0]["mfu"] == 0.4123
    assert not summarize(bench_out, 470, names, ["PASS"] * 4 + ["FAIL (exit 1)"], [1] * 5)["passed"]
    assert not summarize(bench_out, 470, [], [], [])["passed"]  # nothing checked is not a pass


def test_bench_data_reports_prepare_and_padding(corpus, tmp_path):
    out = tmp_path / "data.json"
    bench_module("bench_data").main(["--data_path", str(corpus["pretrain"]), "--sft_path", str(corpus["sft"]),
                                     "--num_workers", "0", "--max_seq_len", "64", "--batch_size", "2",
                                     "--out", str(out)])
    report = json.loads(out.read_text())
    [prep] = report["prepare"].values()
    [sft] = report["sft"].values()
    assert prep and sft["conversations"] > 0
    assert all(0 <= sft[f"padding_fraction_bs{b}"] < 1 for b in (8, 16, 32))


def test_bench_dpo_times_cached_and_recomputed_reference(tmp_path, capsys):
    """Both DPO variants run on real pairs and report their step times, the speed-up and the one-off reference
    pass (no speed asserted: targets belong to the benchmark's results, not to tests)."""
    pairs = write_jsonl(tmp_path / "pairs.jsonl", demo_records("dpo_demo.jsonl", 40))
    out = tmp_path / "dpo.json"
    bench_module("bench_dpo").main(["--preset", "tiny", "--hidden_size", "64", "--num_hidden_layers", "1",
                                    "--max_seq_len", "64", "--batch_size", "2", "--batches", "2", "--steps", "2",
                                    "--warmup", "1", "--repeats", "2", "--dtype", "float32", "--data_path", str(pairs),
                                    "--cache_dir", str(tmp_path / "cache"), "--num_workers", "0", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["device"].startswith("cpu") and report["dtype"] == "float32" and report["threads"] > 0
    assert (report["model"]["hidden_size"], report["model"]["num_hidden_layers"]) == (64, 1)
    assert (report["batch_size_pairs"], report["measured_batches"], report["repeats"]) == (2, 2, 2)
    for variant in ("cached", "recomputed"):
        row = report[variant]
        assert row["step_s"] > 0 and len(row["block_step_s"]) == 2
        assert row["pairs_per_s"] == pytest.approx(2 / row["step_s"], rel=0.01)
    assert report["speedup"] == pytest.approx(report["recomputed"]["step_s"] / report["cached"]["step_s"], rel=0.01)
    # the cached reference is what the recomputed variant computes (fp32: only the batches' padding differs)
    assert report["cached_vs_recomputed_ref_max_abs_diff"] < 1e-4 * report["ref_logp_mean_abs"]
    ref, epoch = report["reference_pass"], report["epoch"]
    assert ref["pairs"] == report["data"]["train_pairs"] > 0 and ref["seconds"] > 0
    assert epoch["steps"] == ref["pairs"] // 2 and 0 < epoch["reference_pass_frac"] and epoch["cached_train_s"] > 0
    printed = capsys.readouterr().out
    assert "cached" in printed and "recomputed" in printed and "speed-up" in printed


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script runs its real checks")
def test_gpu_check_without_a_gpu_fails_fast_with_a_summary(tmp_path):
    (tmp_path / "throughput.json").write_text('{"results": []}')  # a previous run's: must not be reported
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": "python3"}
    proc = subprocess.run(["bash", str(ROOT / "bench/gpu_check.sh")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout.split("GPU check summary")[1]
    assert proc.stdout.rstrip().endswith("FAIL")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["passed"] is False
    results = {c["check"]: c["result"] for c in summary["checks"]}
    assert results["environment"].startswith("FAIL")
    assert set(results) == {"environment", "cuda_tests", "sdpa_backend", "throughput", "generation", "plan",
                            "time_budget"}
    assert all(r.startswith("SKIPPED (no usable CUDA environment)") for name, r in results.items()
               if name != "environment")
    assert "CUDA is not available" in (tmp_path / "gpu_check.log").read_text()
    assert "throughput" not in summary
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.log", "summary.json"]


def test_gpu_check_time_budget_skips_what_does_not_fit(tmp_path):
    """A budget already spent skips every check instead of overrunning the promised time."""
    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_BUDGET_S": "0"}
    proc = subprocess.run(["bash", str(ROOT / "bench/gpu_check.sh")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert all(c["result"].startswith("SKIPPED (time budget of 0s spent)") for c in summary["checks"])


def test_gpu_check_kills_a_check_that_ignores_sigterm(tmp_path):
    """The trainer answers SIGTERM by checkpointing and exiting 0, and a hung CUDA call may not answer at all: a
    check past its limit must be killed, and reported as timed out, within the budget plus the kill grace."""
    fake = tmp_path / "python"
    fake.write_text('#!/usr/bin/env bash\n'
                    '# the summary runs for real; every check ignores SIGTERM and outlives its limit\n'
                    'if [ "${1:-}" = bench/gpu_check_summary.py ]; then exec python3 "$@"; fi\n'
                    "trap '' TERM\nsleep 120\n")
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": str(fake), "GPU_CHECK_BUDGET_S": "13"}
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(ROOT / "bench/gpu_check.sh")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert time.monotonic() - t0 < 13 + 10 + 5, proc.stdout  # budget + kill grace + start-up
    results = {c["check"]: c["result"] for c in json.loads((out / "summary.json").read_text())["checks"]}
    # its limit is what the budget leaves: 13 - 10 s of kill grace - the script's own start-up second(s)
    assert re.fullmatch(r"FAIL \(timed out after [123]s\)", results["environment"]), results
    assert proc.returncode == 1


def test_bench_tasks_times_ours_and_lm_eval_on_the_same_items(tmp_path):
    import sys

    from dataset.tokenizer import DEFAULT_TOKENIZER_DIR
    from model import PocketLM
    from model.loading import save_model

    from conftest import tiny_config
    save_model(PocketLM(tiny_config(vocab_size=6400)), tmp_path / "m", tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    out = tmp_path / "tasks.json"
    run = subprocess.run([sys.executable, "bench/bench_tasks.py", "--checkpoint", str(tmp_path / "m"), "--items", "12",
                          "--repeats", "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["items"] == 12 and result["ours_s"] > 0 and result["lm_eval_s"] > 0 and "cores" in result["machine"]
    assert result["ours_acc"] == result["lm_eval_acc"] is not None  # the same scores, or the timing means nothing


@pytest.mark.parametrize("tools", [False, True])
def test_bench_rollouts_compares_batched_with_one_at_a_time(tmp_path, tools):
    """RL rollouts, batched and one sequence at a time, on a tiny chat checkpoint and the bundled prompts; with
    --tools, rollouts that may call the bundled tools, on the tool prompts."""
    from dataset.tokenizer import DEFAULT_TOKENIZER_DIR
    from model import PocketLM
    from model.loading import save_model

    from conftest import tiny_config
    save_model(PocketLM(tiny_config(vocab_size=6400, max_position_embeddings=1024)), tmp_path / "m",
               tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    out = tmp_path / "rollouts.json"
    assert bench_module("bench_rollouts").main(["--checkpoint", str(tmp_path / "m"), "--prompts", "2", "--group", "2",
                                                "--new_tokens", "4", "--repeats", "1", "--out", str(out),
                                                *(["--tools", "--rounds", "2", "--loss"] if tools else [])]) == 0
    report = json.loads(out.read_text())
    assert (report["prompts"], report["group"], report["new_tokens"]) == (2, 2, 4) and "cores" in report["machine"]
    assert report["tools"] is tools and report["data"].endswith("tools_rl.jsonl" if tools else "math_train.jsonl")
    assert report["batched_tokens_per_s"] > 0 and report["one_at_a_time_tokens_per_s"] > 0
    assert report["speedup"] == pytest.approx(report["batched_tokens_per_s"] / report["one_at_a_time_tokens_per_s"],
                                              rel=0.01)
    if tools:  # the policy loss on packed rows (a row per prompt) against a row per completion
        loss = report["loss"]
        assert loss["packed_rows"][0] == 2 and loss["one_row_each_rows"][0] == 4
        assert loss["packed_s"] > 0 and loss["one_row_each_s"] > 0 and loss["speedup"] > 0
    else:
        assert "loss" not in report


def test_bench_tool_serving_times_reading_against_a_pass_through(tmp_path):
    """The same streamed tool-offering request, read for tool calls and passed through, on a real server."""
    out = tmp_path / "tools.json"
    assert bench_module("bench_tool_serving").main(["--checkpoint", str(tmp_path / "none"), "--requests", "2",
                                                    "--max_tokens", "4", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["requests_each"] == 2 and "cores" in report["machine"]
    assert report["ratio"] == pytest.approx(report["median_s_read"] / report["median_s_pass_through"], rel=0.01)
    assert 0 < report["reader_us_per_token"] < 1000


def test_bench_time_budget_records_each_budget_against_its_wall_time(corpus, tmp_path):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(f"data:\n  data_path: {corpus['pretrain']}\n  cache_dir: {corpus['cache']}\nmodel:\n"
                      "  preset: tiny\noptim:\n  batch_size: 4\n  optimizer: adamw\nrun:\n  log_interval: 1\n"
                      "eval:\n  eval_interval: 1000\n  sample_prompts: none\n")
    out = tmp_path / "budget.json"
    t0 = time.perf_counter()
    rc = bench_module("bench_time_budget").main(["--budgets", "12s", "--recipe", str(recipe), "--out", str(out),
                                                 "--runs_dir", str(tmp_path / "runs"), "--beside", "sleep 5.125"])
    elapsed = time.perf_counter() - t0
    result = json.loads(out.read_text())
    run = result["runs"][0]
    assert result["machine"]["device"] == "cpu" and result["goal"] == [0.9, 1.05]
    # the other work ran from the start to the end (started again as it ended) and is gone
    assert result["beside"]["command"] == "sleep 5.125" and result["beside"]["starts"] >= 2
    assert not [p for p in os.popen("ps -eo args").read().splitlines() if p == "sleep 5.125"]
    assert 0 < run["slowest_step_s"] < run["wall_s"]
    # the process's wall time, as this test's clock sees it too (whether this machine meets the goal is the
    # benchmark's finding, not this test's): the verdict and the exit status follow from it
    assert 1.0 < run["wall_s"] <= elapsed and run["budget_s"] == 12
    assert run["share"] == pytest.approx(run["wall_s"] / 12, rel=1e-3)
    assert run["within_goal"] is (10.8 <= run["wall_s"] <= 12.6) and rc == (0 if run["within_goal"] else 1)
    assert run["trained_steps"] >= 1 and run["probe"]["step_s"] > 0
    assert run["probe"]["planned_at"] == 0  # a warm-up by ratio: probed on a throwaway copy
    val = [json.loads(x) for x in (tmp_path / "runs" / "budget-12s" / "metrics.jsonl").read_text().splitlines()]
    assert run["val_loss"] == [r["val_loss"] for r in val if "val_loss" in r][-1]


def test_bench_install_summarises_a_run_from_its_metrics(tmp_path):
    """The fresh-clone benchmark's summary of a demo run: the last evaluation, the first and last logged training
    loss and the median rate, from records written as the trainer writes them (evaluations and events between)."""
    import bench.bench_install as bench_install
    records = [{"step": 10, "loss": 8.0, "tokens_per_s": 100, "step_time_s": 4.0},
               {"step": 12, "event": "time_budget", "steps": 30},
               {"step": 20, "loss": 6.0, "tokens_per_s": 300, "step_time_s": 1.0},
               {"step": 20, "val_loss": 6.5, "val_bpb": 3.0, "val_ppl": 665.1},
               {"step": 30, "loss": 5.0, "tokens_per_s": 200, "step_time_s": 2.0},
               {"step": 30, "val_loss": 5.5, "val_bpb": 2.5, "val_ppl": 244.7},
               {"step": 31, "probes_correct": 0.0}]
    write_jsonl(tmp_path / "metrics.jsonl", records)
    assert bench_install.run_summary(tmp_path) == {
        "steps": 31, "val_loss": 5.5, "val_bpb": 2.5, "val_ppl": 244.7, "first_logged_loss": 8.0,
        "last_logged_loss": 5.0, "median_tokens_per_s": 200, "median_step_time_s": 2.0}
    assert bench_install.run_summary(tmp_path / "missing") is None
    # the pin the benchmark resolves is the one make installs (make's own reading of the Makefile)
    dry_run = subprocess.run(["make", "-n", "install"], cwd=ROOT, capture_output=True, text=True).stdout
    assert f'"torch=={bench_install.torch_version()}"' in dry_run


def fake_training(tmp_path, losses, expected, calls):
    """Stands in for train_pretrain.py processes: a run of `preset` (auto resolves to depth-3) ends at step 10
    with validation loss losses[its preset] (bits per byte half of it; a list: one loss per seed, the default
    seed's first, then --seed 1's and 2's); the auto run expected `expected`. A call is recorded as its preset,
    or 'preset:seed' where it names a seed."""
    def run(cmd, cwd, capture_output, text):
        preset, name = cmd[cmd.index("--preset") + 1], cmd[cmd.index("--run_name") + 1]
        seed = int(cmd[cmd.index("--seed") + 1]) if "--seed" in cmd else 0
        calls.append(f"{preset}:{seed}" if seed else preset)
        resolved = "depth-3" if preset == "auto" else preset
        loss = losses[resolved][seed] if isinstance(losses[resolved], list) else losses[resolved]
        run_dir = tmp_path / name
        run_dir.mkdir()
        (run_dir / "train_config.json").write_text(json.dumps({"model": {"preset": resolved}}))
        records = [{"step": 5, "val_loss": 9.0}, {"step": 8, "event": "time_budget"}, {"step": 10, "loss": 5.0},
                   {"step": 10, "val_loss": loss, "val_bpb": loss / 2}]
        if preset == "auto":
            records.append({"step": 10, "expected_val_loss": expected})
        (run_dir / "metrics.jsonl").write_text("\n".join(map(json.dumps, records)) + "\n")
        return subprocess.CompletedProcess(cmd, 0, "", "time budget 1m 00s: 58.2s spent (97%)\n")
    return run


def test_bench_auto_trains_the_pick_its_neighbours_and_the_hand_sized_model_once(tmp_path, monkeypatch):
    b = bench_module("bench_auto")
    calls = []
    monkeypatch.setattr(b.subprocess, "run", fake_training(tmp_path, {"depth-2": 3.9, "depth-3": 3.8,
                                                                     "depth-4": 3.95, "mini-30m": 4.0}, 3.7, calls))
    out = tmp_path / "auto.json"
    assert b.main(["--budgets", "1m", "--presets", "mini-30m", "--runs_dir", str(tmp_path), "--out", str(out)]) == 0
    assert calls == ["auto", "depth-4", "depth-2", "mini-30m"]  # depth-4: hand-sized and a neighbour, trained once
    r = json.loads(out.read_text())["results"][0]
    assert r["pick"] == {"budget": "1m", "run": "auto-1m", "preset": "depth-3", "steps": 10, "val_loss": 3.8,
                         "val_bpb": 1.9, "spent_share": 0.97, "replans": 1, "expected_val_loss": 3.7}
    assert [o["preset"] for o in r["others"]] == ["depth-4", "depth-2", "mini-30m"]
    assert r["pick_beats_all"] and r["prediction_error"] == round(3.8 / 3.7 - 1, 4) and r["prediction_within_goal"]
    calls.clear()
    assert b.main(["--budgets", "1m", "--presets", "mini-30m", "--runs_dir", str(tmp_path)]) == 0
    assert calls == []  # every run finished before: read, not trained again


@pytest.mark.parametrize("losses,expected", [
    ({"depth-2": 3.79, "depth-3": 3.8, "depth-4": 3.95}, 3.8),  # a neighbour does better
    ({"depth-2": 3.9, "depth-3": 3.8, "depth-4": 3.95}, 3.68),  # 3.3% off the expected loss
])
def test_bench_auto_fails_a_goal_it_misses(tmp_path, monkeypatch, losses, expected):
    b = bench_module("bench_auto")
    monkeypatch.setattr(b.subprocess, "run", fake_training(tmp_path, losses, expected, []))
    assert b.main(["--budgets", "1m", "--runs_dir", str(tmp_path)]) == 1
    assert b.neighbours("depth-1") == ["depth-2"] and b.neighbours("depth-48") == ["depth-47"]
    assert b.neighbours("mini-30m") == []


@pytest.mark.parametrize("depth2,verdict,rc", [
    ([3.81, 3.74, 3.86], "ties", 0),  # means 3.8033 against 3.8 (bpb half): 0.0017 apart, within 2 SE (0.035)
    ([3.78, 3.77, 3.76], "loses", 1),  # 0.015 bpb better, beyond 2 SE (0.0082)
    ([3.83, 3.84, 3.82], "beats", 0),  # 0.015 bpb worse; the first run 0.8% off the pick's, within NEAR
])
def test_bench_auto_judges_a_near_tie_over_seeds(tmp_path, monkeypatch, depth2, verdict, rc):
    b = bench_module("bench_auto")
    calls = []
    losses = {"depth-2": depth2, "depth-3": [3.8, 3.81, 3.79], "depth-4": 3.95}
    monkeypatch.setattr(b.subprocess, "run", fake_training(tmp_path, losses, 3.8, calls))
    out = tmp_path / "auto.json"
    assert b.main(["--budgets", "1m", "--seeds", "3", "--runs_dir", str(tmp_path), "--out", str(out)]) == rc
    # depth-4 is 3.9% off the pick: one run; depth-2 is within 1%: it and the pick, by its name, two seeds more
    assert calls == ["auto", "depth-4", "depth-2", "depth-3:1", "depth-3:2", "depth-2:1", "depth-2:2"]
    r = json.loads(out.read_text())["results"][0]
    assert r["pick"]["val_bpb_seeds"] == [1.9, 1.905, 1.895] and "val_bpb_seeds" not in r["others"][0]
    assert [o["verdict"] for o in r["others"]] == ["beats", verdict]
    assert r["pick_beats_all"] is (verdict == "beats") and r["pick_loses_to_none"] is (verdict != "loses")
    calls.clear()
    assert b.main(["--budgets", "1m", "--seeds", "3", "--runs_dir", str(tmp_path)]) == rc and calls == []
    assert b.main(["--budgets", "1m", "--runs_dir", str(tmp_path)]) == (1 if depth2[0] < 3.8 else 0)  # one seed


def test_bench_sharing_times_a_step_alone_and_beside_another_training_process(tmp_path):
    out = tmp_path / "sharing.json"
    rc = bench_module("bench_sharing").main(["--preset", "tiny", "--batch_size", "2", "--seq_len", "32", "--steps",
                                             "3", "--settle", "0.5", "--settings", "one_thread", "--out", str(out)])
    report = json.loads(out.read_text())
    r = report["results"]["one_thread"]
    assert report["goal"] == 2.5 and report["cores"] == os.cpu_count() and 0 < r["alone_s"] < 5
    assert r["ratio"] == pytest.approx(r["beside_s"] / r["alone_s"], rel=1e-2)
    assert r["within_goal"] is (r["beside_s"] / r["alone_s"] <= 2.5) and rc == (0 if r["within_goal"] else 1)
    assert not [p for p in os.popen("ps -eo args").read().splitlines() if "--steps 1000000" in p]  # the other: gone


def test_the_progress_table_is_each_shares_median_ratio_with_the_spread_and_errors_added():
    """Runs whose curves sit at known ratios of a loss model: each share's ratio is their median, its tolerance the
    farthest run from it plus ELSEWHERE, and the model's error what a size outside the runs gets on top ("beyond");
    points before min_tokens are left out."""
    fit = bench_module("fit_loss_model")
    model = LossModel(E=2.0, A=10.0, alpha=0.5, B=100.0, beta=0.5)
    per_step = fit.RECIPE["batch_size"] * fit.FIT_CONTEXT

    def run(n, steps, ratio):
        return {"parameters": n, "steps": steps,
                "curve": [[s, ratio * model.loss(n, s * per_step)] for s in range(steps // 10, steps + 1, steps // 10)]}

    runs = [run(1e4, 100, 1.00), run(1e5, 200, 1.02), run(1e6, 400, 1.04)]
    table = fit.progress(runs, model, model_error=0.01, min_tokens=40 * per_step)
    # share 0.2: the runs at steps 20 (left out: fewer than 40 steps' tokens), 40 and 80
    assert table["shares"] == [0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0] and table["points"][0] == 2
    assert table["ratios"][0] == pytest.approx(1.03) and table["ratios"][-1] == pytest.approx(1.02)
    assert table["tolerances"][-1] == pytest.approx(0.02 / 1.02 + fit.ELSEWHERE, abs=1e-3)
    assert table["beyond"] == 0.01
    assert fit.progress(runs[:1], model, 0.01, 0) is None  # one run: no share has two points


def test_the_fit_reads_a_finished_run_only_if_it_was_trained_with_the_recipe(tmp_path):
    """A run of an earlier recipe (another learning rate) is trained again, not fitted: its loss answers another
    question."""
    fit = bench_module("fit_loss_model")
    run = tmp_path / "depth2-steps8"
    run.mkdir()
    write_jsonl(run / "metrics.jsonl", [{"step": 4, "val_loss": 5.0}, {"step": 8, "loss": 4.6, "tokens_seen": 32768},
                                        {"step": 8, "val_loss": 4.5}])
    assert fit.last_record(run, 8) is None  # no train_config.json: its settings are unknown
    optim = {"learning_rate": 8e-3, "muon_lr": 4e-3, "muon_base_width": 256, "warmup_steps": 20, "batch_size": 16,
             "epochs": 1}
    (run / "train_config.json").write_text(json.dumps({"optim": optim}))
    assert fit.last_record(run, 8) == {"step": 8, "loss": 4.6, "tokens_seen": 32768, "val_loss": 4.5,
                                       "curve": [[4, 5.0], [8, 4.5]]}
    assert fit.last_record(run, 16) is None  # not finished
    for key, other in (("learning_rate", 4e-3), ("muon_lr", None), ("muon_base_width", None), ("warmup_steps", 10),
                       ("batch_size", 8)):
        (run / "train_config.json").write_text(json.dumps({"optim": {**optim, key: other}}))
        assert fit.last_record(run, 8) is None, key


def test_the_fit_refuses_too_few_runs_before_training_any(tmp_path, monkeypatch, capsys):
    """Four runs cannot fit five constants: said at once (exit 2), not after the hours of training them."""
    fit = bench_module("fit_loss_model")
    monkeypatch.setattr(fit, "run_point", lambda *a: pytest.fail("a run was trained"))
    monkeypatch.setattr(sys, "argv", ["fit_loss_model.py", "--depths", "1", "--steps", "120", "240",
                                      "--more", "2:120", "2:240", "--runs_dir", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        fit.main()
    assert e.value.code == 2
    assert "needs at least 5 runs (--depths x --steps, and --more), got 4" in capsys.readouterr().err
