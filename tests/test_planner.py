"""`python -m model --plan`: measured and estimated speeds, the budget's arithmetic, the data's epochs, memory,
the recommendation and its command line, and bad input."""
from __future__ import annotations

import math

import pytest
import torch

from common.errors import DataError
from model import __main__ as model_cli
from model.config import get_preset
from trainer_utils import planner
from trainer_utils.planner import MAX_EPOCHS, TRAINING_SHARE, PresetRow, data_tokens

from conftest import demo_records, write_jsonl


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("plan") / "small.jsonl", demo_records("pretrain_demo.jsonl", 30))


def test_the_table_of_tiny_presets_is_consistent(small_corpus):
    # tiny is timed; mini-30m's step, predicted from tiny's FLOP rate, exceeds max_step_s: it is estimated
    rows, best, reason, header = planner.plan(60.0, "cpu", str(small_corpus), ["mini-30m", "tiny"],
                                              seq_len=64, max_step_s=1e-9, min_seconds=0.05)
    tiny, mini = rows
    assert (tiny.name, mini.name) == ("tiny", "mini-30m")  # cheapest step first
    assert tiny.speed_measured and not mini.speed_measured and not tiny.peak_measured  # CPU: memory estimated
    assert tiny.tokens_per_s > mini.tokens_per_s and tiny.batch_size == mini.batch_size == planner.CPU_COMMAND_BATCH
    n_data = data_tokens(small_corpus)
    for r in rows:
        assert r.budget_tokens == pytest.approx(r.tokens_per_s * TRAINING_SHARE * 60)
        assert r.epochs == pytest.approx(r.budget_tokens / n_data)
        assert r.trained_tokens == pytest.approx(min(r.budget_tokens, MAX_EPOCHS * n_data))
    assert best is min(rows, key=lambda r: abs(math.log(r.tokens_per_parameter / 20)))
    assert "(estimated from its first" in header and "cpu" in header
    text = planner.table(rows, best)
    assert "(est.)" in text.splitlines()[3] and "⭐" in text
    assert best.name in reason


def test_the_data_estimate_is_the_tokenized_count(small_corpus, tokenizer):
    records = demo_records("pretrain_demo.jsonl", 30)
    exact = sum(len(tokenizer.encode(r["text"])) + 1 for r in records)
    assert data_tokens(small_corpus) == pytest.approx(exact, rel=0.001)  # the whole file is the sample


def test_bad_data_names_its_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"conversations": []}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: expected a JSON object with a \"text\""):
        data_tokens(bad)
    with pytest.raises(DataError, match="missing.jsonl"):
        data_tokens(tmp_path / "missing.jsonl")


def row(name, params, tps, n_data=None, fits=True):
    r = PresetRow(name, params, 8, 512, tps, True, 0, False, fits)
    r.budget_tokens = tps * TRAINING_SHARE * 3600
    r.trained_tokens = min(r.budget_tokens, MAX_EPOCHS * n_data) if n_data else r.budget_tokens
    r.epochs = r.budget_tokens / n_data if n_data else None
    return r


def test_the_recommendation_follows_tokens_per_parameter():
    rows = [row("a", 10e6, 60e3), row("b", 25e6, 30e3), row("c", 100e6, 8e3)]  # 19.4, 3.9, 0.26 tokens/param
    best = min(rows, key=lambda r: abs(math.log(r.tokens_per_parameter / 20)))
    assert best.name == "a"
    capped = [row("a", 10e6, 60e3, n_data=10e6), row("b", 25e6, 30e3, n_data=10e6)]  # 4 epochs: 40M tokens
    assert capped[0].tokens_per_parameter == 4.0 and capped[1].tokens_per_parameter == 1.6
    assert "the data is the limit" in planner.why(row("a", 1e6, 60e3, n_data=1e6), [], 1e6)
    assert "the smallest learns the most" in planner.why(row("a", 100e6, 1e3), [], None)
    assert planner.why(None, [], None).startswith("no preset fits")


def test_a_preset_that_does_not_fit_is_shown_and_never_recommended(monkeypatch):
    monkeypatch.setattr(planner, "device_memory", lambda device: 100 << 20)  # 100 MiB: only tiny fits
    rows, best, _, _ = planner.plan(60.0, "cpu", None, ["tiny", "minimind-104m"], seq_len=64, min_seconds=0.05)
    assert [r.fits for r in rows] == [True, False] and best.name == "tiny"
    assert "does not fit" in planner.table(rows, best)


def test_the_command_line_trains_the_recommendation(small_corpus, capsys):
    assert model_cli.main(["--plan", "--time_budget", "30s", "--device", "cpu", "--data_path", str(small_corpus),
                           "--presets", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "| tiny ⭐ |" in out and "recommended: tiny" in out
    line = next(s for s in out.splitlines() if "train_pretrain.py" in s)
    assert f"--preset tiny --data_path {small_corpus} --time_budget 30s --batch_size 8" in line
    assert "--epochs 4" in line  # many epochs of a small file fit in the budget: --epochs must allow them


def test_a_short_run_gets_the_short_run_learning_rate():
    short, long = row("a", 10e6, 1e3), row("a", 10e6, 1e6)  # an hour: ~790 steps of 8 x 512, ~790,000
    assert short.trained_tokens / (8 * 512) < planner.SHORT_RUN_STEPS < long.trained_tokens / (8 * 512)
    for flag in planner.SHORT_RUN_FLAGS:
        assert flag in planner.command(short, "1h", "d.jsonl", torch.device("cpu"))
        assert flag not in planner.command(long, "1h", "d.jsonl", torch.device("cpu"))


@pytest.mark.parametrize("argv,message", [
    (["--plan"], "--plan needs --time_budget"),
    (["--plan", "--time_budget", "2 hours"], "--time_budget '2 hours'"),
    (["--plan", "--time_budget", "1m", "--presets", "nope"], "unknown preset 'nope'"),
    (["--plan", "--time_budget", "1m", "--device", "tpu"], "tpu"),
    (["--time_budget", "1m"], "add one of them"),
])
def test_bad_plan_flags_are_one_line_errors(argv, message, capsys):
    assert model_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err


def test_an_update_costs_the_same_for_any_batch():
    t = planner.StepTime(backward_s=0.5, update_s=2.0, peak_bytes=None)
    assert t.step_s() == 2.5 and t.step_s(8) == 6.0  # 8x the batch: 8x the backward, one update
    cfg = get_preset("tiny")  # d64, 2 layers, 4 heads of 16, 2 key heads, ffn 192: q, k, v, o, gate, up, down
    d, kv, f = 64, 32, 192
    shapes = [(d, d), (kv, d), (kv, d), (d, d), (f, d), (f, d), (d, f)] * 2
    expected = sum(5 * (4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3) for s in shapes)
    assert planner.newton_schulz_flops(cfg) == expected
