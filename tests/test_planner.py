"""`python -m model --plan`: measured and estimated speeds, the budget's arithmetic, the data's epochs, memory,
the recommendation and its command line, and bad input. The printed plan is checked whole against hand-written
text, and plan's, the timing's and the data estimate's arithmetic by hand, with the clock, the step, the presets and
the tokenizer stubbed."""
from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from common.device import NEWTON_SCHULZ_STEPS, DtypeChoice, choose_dtype
from common.errors import ConfigError, DataError
from model import PocketLM
from model import __main__ as model_cli
from model.config import get_preset
from model.memory import estimate_memory
from trainer_utils import planner
from trainer_utils.backend import Comm, TorchBackend
from trainer_utils.config import OptimConfig
from trainer_utils.optim import MuonWithAdamW
from trainer_utils.planner import PresetRow, data_tokens
from trainer_utils.runtime import Precision

from conftest import demo_records, write_jsonl


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("plan") / "small.jsonl", demo_records("pretrain_demo.jsonl", 30))


def test_the_table_of_tiny_presets_is_consistent(small_corpus):
    # tiny is timed; mini-30m's step, predicted from tiny's FLOP rate, exceeds max_step_s: it is estimated
    # 10 minutes, so that tiny reads the small corpus more than 4 times even on a loaded machine (> 121 tokens/s)
    rows, best, reason, header = planner.plan(600.0, "cpu", str(small_corpus), ["mini-30m", "tiny"],
                                              seq_len=64, max_step_s=1e-9, min_seconds=0.05)
    tiny, mini = rows
    assert (tiny.name, mini.name) == ("tiny", "mini-30m")  # cheapest step first
    assert tiny.speed_measured and not mini.speed_measured and not tiny.peak_measured  # CPU: memory estimated
    assert tiny.tokens_per_s > mini.tokens_per_s and tiny.batch_size == mini.batch_size == 8  # all fit at 8
    n_data = data_tokens(small_corpus)
    for r in rows:  # 10 minutes: 540 s of it in steps
        assert r.budget_tokens == pytest.approx(r.tokens_per_s * 540) and r.epochs == pytest.approx(
            r.budget_tokens / n_data)
    assert tiny.epochs > 4 and tiny.trained_tokens == pytest.approx(4 * n_data)  # 4 of its many epochs count
    assert best is tiny  # the most tokens for each parameter, still far below 20
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


def row(name, params, tokens_per_parameter=None, fits=True, tps=1e3):
    """A preset's row; tokens_per_parameter sets what it trains in the budget, by hand."""
    r = PresetRow(name, params, 8, 512, tps, True, 0, False, fits)
    if tokens_per_parameter is not None:
        r.budget_tokens = r.trained_tokens = tokens_per_parameter * params
    return r


def test_what_a_budget_buys_by_hand():
    r = row("a", 1e6, tps=1000.0)  # an hour at 1000 tokens/s, 90% of it in steps: 3,240,000 tokens
    planner.buy(r, 3600.0, n_data=500_000)  # 4 epochs of 500,000 tokens: 2,000,000 are worth training
    assert (r.budget_tokens, r.trained_tokens, r.epochs, r.tokens_per_parameter) == (3_240_000, 2_000_000, 6.48, 2.0)
    planner.buy(r, 3600.0, n_data=None)  # no data given: no limit
    assert (r.trained_tokens, r.epochs, r.tokens_per_parameter) == (3_240_000, None, 3.24)


def test_the_recommendation_is_nearest_twenty_tokens_per_parameter_by_ratio():
    assert planner.recommend([row("a", 10e6, 19.44), row("b", 25e6, 3.888), row("c", 100e6, 0.2592)]).name == "a"
    # 35 is 1.75x the rule, 8 is 2.5x below it: by ratio 35 is nearer (by difference 8 would be)
    assert planner.recommend([row("small", 10e6, 35.0), row("large", 40e6, 8.0)]).name == "small"
    assert planner.recommend([row("a", 10e6, 20.0, fits=False), row("b", 40e6, 2.0)]).name == "b"
    assert planner.recommend([row("a", 10e6, 20.0, fits=False)]) is None


def test_the_reason_says_what_holds_for_the_larger_presets():
    data_bound = row("a", 1e6, 4.0)
    data_bound.budget_tokens, data_bound.epochs = 60e6, 240.0
    assert "the data is the limit" in planner.why(data_bound, [data_bound], 1e6)
    assert "the smallest learns the most" in planner.why(row("a", 100e6, 1.0), [], None)
    assert planner.why(None, [], None).startswith("no preset fits")
    best = row("small", 10e6, 200.0)  # 10x the rule: why not larger?
    too_big = planner.why(best, [best, row("big", 100e6, fits=False)], None)
    assert "; big does not fit in memory" in too_big
    farther = planner.why(best, [best, row("big", 100e6, 2.0)], None)  # fits, and 10x below the rule
    assert "the next larger that fits, big, would train 2 tokens per parameter" in farther
    assert "fit in memory" not in farther
    assert "it is the largest preset planned" in planner.why(best, [best, row("smaller", 1e6, 2000.0)], None)


def test_a_cpu_plan_checks_memory_at_the_batch_its_command_trains(monkeypatch):
    dtype = choose_dtype("auto", torch.device("cpu"), "train").dtype
    peak = {b: estimate_memory(get_preset("tiny"), b, 64, dtype, optimizer=planner.OPTIMIZER).peak for b in (4, 8)}
    assert peak[4] < peak[8]
    monkeypatch.setattr(planner, "device_memory", lambda device: math.ceil(peak[4] / planner.MEMORY_SHARE))
    rows, best, _, _ = planner.plan(60.0, "cpu", None, ["tiny"], seq_len=64, min_seconds=0.05)
    assert best.batch_size == 4 and best.peak_bytes == peak[4]  # batch 8 would not fit


def test_a_preset_that_does_not_fit_is_shown_and_never_recommended(monkeypatch):
    monkeypatch.setattr(planner, "device_memory", lambda device: 100 << 20)  # 100 MiB: only tiny fits
    rows, best, _, header = planner.plan(60.0, "cpu", None, ["tiny", "minimind-104m"], seq_len=64, min_seconds=0.05)
    assert [r.fits for r in rows] == [True, False] and best.name == "tiny"
    assert header.endswith("; 90% of it in training steps")  # no data given: nothing said of it
    assert "does not fit" in planner.table(rows, best)


def test_the_command_line_trains_the_recommendation(small_corpus, capsys):
    # 5 minutes: more than 3 epochs of the small corpus (~16K tokens) at over ~180 tokens/s, even on a loaded machine
    assert model_cli.main(["--plan", "--time_budget", "5m", "--device", "cpu", "--data_path", str(small_corpus),
                           "--presets", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "| tiny ⭐ |" in out and "recommended: tiny" in out
    line = next(s for s in out.splitlines() if "train_pretrain.py" in s)
    assert f"--preset tiny --data_path {small_corpus} --time_budget 5m --batch_size 8" in line
    assert "--epochs 4" in line  # many epochs of a small file fit in the budget: --epochs must allow them


def test_a_short_run_gets_the_short_run_learning_rate():
    # batches of 8 x 512 = 4,096 tokens: 1,000 steps are 4,096,000 tokens
    short, long = row("a", 10e6, 0.4), row("a", 10e6, 0.5)  # 4,000,000 and 5,000,000 tokens
    for flag in planner.SHORT_RUN_FLAGS:
        assert flag in planner.command(short, "1h", "d.jsonl")
        assert flag not in planner.command(long, "1h", "d.jsonl")


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


# ---------------------------------------------------------------------------- the printed plan, checked whole
def fitting(name, params, batch, seq, tps, budget, trained, epochs, peak, speed_measured=True, peak_measured=False):
    """A row that fits, every figure set by hand (what plan and buy would fill in)."""
    return PresetRow(name, params, batch, seq, tps, speed_measured, peak, peak_measured, True, budget, trained, epochs)


def test_the_table_prints_every_figure():
    # alpha: 246,913,560 / 12,345,678 = exactly 20 tokens per parameter; 6.48 epochs print as 6.5
    alpha = fitting("alpha", 12_345_678, 8, 512, 12_345.6, 1e9, 246_913_560, 6.48, 3 << 30, peak_measured=True)
    # beta: estimated speed and memory; 999,950,500 tokens are 999.9505M, printed 1,000.0 (a unit off by a
    # millionth would be 0.001M less and print 999.9); 1e5 / 104e6 = 0.000961538... tokens per parameter
    beta = fitting("beta", 104_000_000, 2, 1024, 1_500.4, 999_950_500, 1e5, None, 1536 << 30, speed_measured=False)
    # eps: 1e5 tokens is where K turns to M
    eps = fitting("eps", 1e6, 1, 8, 0.5, 1e5, 1e5, 2.0, 0)
    # gamma: 99,999 tokens = 99.999K, printed 100.0K; 0.123 epochs print as 0.12
    gamma = fitting("gamma", 50_000, 1, 64, 1_234.4, 99_999, 100_000, 0.123, 1 << 29)
    # delta: 1,000,000,005,400,000 tokens are 1,000,000.0054B, printed .01 (a unit off by a billionth would be
    # 0.001B less and print .00)
    delta = fitting("delta", 1_000, 4, 256, 5e6, 1_000_000_005_400_000, 2_000, 1.0, 1 << 30)
    # huge: 100,000,040,000 parameters are 100,000.04M, printed .0 (a unit off by a millionth would be 0.1M less
    # and print 99999.9); not fitting, it prints no figures, and the rows after it are still printed
    huge = PresetRow("huge", 100_000_040_000, 1, 2048, None, False, 20 << 30, False, False)
    assert planner.table([alpha, beta, huge, gamma, delta, eps], alpha).splitlines() == [
        "| preset | params | batch | tokens/s | tokens in budget | tokens/param | epochs of data | peak memory |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
        "| alpha ⭐ | 12.3M | 8×512 | 12,346 | 1.00B | 20 | 6.5 | 3.00 GiB |",
        "| beta | 104.0M | 2×1024 | 1,500 (est.) | 1,000.0M | 0.000962 | – | 1,536.00 GiB (est.) |",
        "| huge | 100000.0M | – | does not fit | – | – | – | 20.00 GiB (est.) |",
        "| gamma | 0.1M | 1×64 | 1,234 | 100.0K | 2 | 0.12 | 0.50 GiB (est.) |",
        "| delta | 0.0M | 4×256 | 5,000,000 | 1,000,000.01B | 2 | 1 | 1.00 GiB (est.) |",
        "| eps | 1.0M | 1×8 | 0 | 0.1M | 0.1 | 2 | 0.00 GiB (est.) |",
    ]
    # the star follows the recommendation, and a plan without one stars nothing
    assert "| huge ⭐ | 100000.0M | – | does not fit |" in planner.table([alpha, huge], huge)
    assert "⭐" not in planner.table([alpha, huge], None)


REASON = ("a: {} tokens per parameter in the budget, the nearest to the ~20 of compute-optimal training (Hoffmann et "
          "al. 2022)")


@pytest.mark.parametrize("tpp,n_data,suffix", [
    (4.0, None, "; the budget is short for every preset, so the smallest learns the most"),  # below 20 / 4 = 5
    (5.0, None, ""),  # 5 is not short: the rule's quarter is the bound
    (80.0, None, ""),  # nor is 80 (4 x 20) too much
    (20.0, 1e6, ""),  # the data is known but all the budget's tokens count: it is no limit
])
def test_the_reason_whole_for_a_budget_near_the_rule(tpp, n_data, suffix):
    best = row("a", 1e6, tpp)
    assert planner.why(best, [best, row("b", 1e9, fits=False)], n_data) == REASON.format(f"{tpp:g}") + suffix


def test_the_reason_whole_when_the_data_is_the_limit():
    best = row("a", 1e6, 4.0)  # 4M of the 60M tokens the budget buys count: 4 epochs of 1M tokens
    best.budget_tokens, best.epochs = 60e6, 60.0
    assert planner.why(best, [best], 1e6) == REASON.format(4) + (
        "; the data is the limit: the budget would read it 60 times, and past 4 epochs repeating adds little, so "
        "larger presets would need more text")
    assert planner.why(None, [], None) == "no preset fits in this device's memory even at batch 1"


@pytest.mark.parametrize("others,suffix", [
    # listed out of order: the larger presets are taken by size, those that do not fit named in that order
    ([row("huge", 300e6, fits=False), row("big", 100e6, fits=False), row("bigger", 200e6, 2.0),
      row("smaller", 1e6, 2000.0), row("large", 250e6, 1.0)],
     "; big, huge do not fit in memory; the next larger that fits, bigger, would train 2 tokens per parameter, "
     "farther from it"),
    ([row("big", 100e6, fits=False)], "; big does not fit in memory"),  # larger presets, none fits
    ([row("twin", 10e6, fits=False), row("smaller", 1e6, 2000.0)], "; it is the largest preset planned"),  # same size
    ([row("twin", 10e6, 300.0)], "; it is the largest preset planned"),
])
def test_the_reason_whole_when_the_budget_buys_more_than_the_rule(others, suffix):
    best = row("a", 10e6, 81.0)  # just over 4 x 20
    assert planner.why(best, [best, *others], None) == REASON.format(81) + suffix


@pytest.mark.parametrize("trained,epochs,data_path,expected", [
    # 4,096,000 tokens in batches of 8 x 512 are 1,000 steps: not a short run; 6.48 epochs are capped at 4
    (4_096_000, 6.48, "d.jsonl", "--data_path d.jsonl --time_budget 1h --batch_size 8 --epochs 4"),
    # 4,095,999 tokens are just under 1,000 steps: the short run's flags; 1.2 epochs need --epochs 2
    (4_095_999, 1.2, "d.jsonl", "--data_path d.jsonl --time_budget 1h --batch_size 8 --epochs 2 --qk_norm "
                                "--learning_rate 4e-3 --warmup_steps 20"),
    (8e6, 2.0, "d.jsonl", "--data_path d.jsonl --time_budget 1h --batch_size 8 --epochs 2"),
    (8e6, 0.5, "d.jsonl", "--data_path d.jsonl --time_budget 1h --batch_size 8"),  # under an epoch: the default 1
    (8e6, None, None, "--data_path YOUR.jsonl --time_budget 1h --batch_size 8"),  # no data given
])
def test_the_command_line_whole(trained, epochs, data_path, expected):
    best = row("a", 10e6)
    best.trained_tokens, best.epochs = trained, epochs
    assert planner.command(best, "1h", data_path) == (
        "python train_pretrain.py --preset a " + expected)


# ---------------------------------------------------------------------------- plan's arithmetic, with stub presets
class FakeConfig:
    """A preset for plan with round numbers: FLOPs per token, Newton-Schulz FLOPs, bytes per sequence of a batch."""

    def __init__(self, params, max_seq_len, flops, ns, mem):
        self.params, self.max_seq_len, self.flops, self.ns, self.mem = params, max_seq_len, flops, ns, mem

    def num_parameters(self):
        return self.params


def stub_plan(monkeypatch, configs, steps, device, dtype, n_data, memory=1000):
    """plan over `configs` with every measurement stubbed: `steps` the StepTime each timed preset takes (by name),
    the data n_data tokens, the device's memory `memory` bytes. Returns the log of the calls plan made."""
    calls = {"get_preset": [], "flops": [], "memory": [], "ns": [], "timed": [], "data": [], "device": []}
    names = {id(c): n for n, c in configs.items()}

    def get_preset(name, **overrides):
        calls["get_preset"].append((name, overrides))
        return configs[name]

    def flops_per_token(cfg, seq):
        calls["flops"].append((names[id(cfg)], seq))
        return cfg.flops

    def estimate(cfg, batch, seq, dtype="float32", optimizer="adamw"):  # estimate_memory's defaults
        calls["memory"].append((names[id(cfg)], batch, seq, dtype, optimizer))
        return SimpleNamespace(peak=cfg.mem * batch)

    def newton_schulz(cfg, steps=NEWTON_SCHULZ_STEPS):
        calls["ns"].append((names[id(cfg)], steps))
        return cfg.ns

    def time_steps(cfg, dev, precision, batch, seq, min_seconds):
        calls["timed"].append((names[id(cfg)], dev, precision.dtype, batch, seq, min_seconds))
        return steps[names[id(cfg)]]

    def data_tokens(path):
        calls["data"].append(path)
        return n_data

    monkeypatch.setattr(planner, "PRESETS", configs)
    monkeypatch.setattr(planner, "get_preset", get_preset)
    monkeypatch.setattr(planner, "flops_per_token", flops_per_token)
    monkeypatch.setattr(planner, "estimate_memory", estimate)
    monkeypatch.setattr(planner, "newton_schulz_flops", newton_schulz)
    monkeypatch.setattr(planner, "time_steps", time_steps)
    monkeypatch.setattr(planner, "data_tokens", data_tokens)
    monkeypatch.setattr(planner, "device_memory", lambda dev: memory)
    def parse_device(name):
        calls["device"].append(name)
        return torch.device(device)

    monkeypatch.setattr(planner, "parse_device", parse_device)
    monkeypatch.setattr(planner, "choose_dtype", lambda name, dev, purpose="train": DtypeChoice(dtype, "the reason"))
    monkeypatch.setattr(planner, "precision_policy", lambda dev: SimpleNamespace(newton_schulz_steps=7))
    return calls


def assert_rows(rows, expected):
    """rows, field by field, against tuples in PresetRow's order (floats to 12 digits)."""
    assert [r.name for r in rows] == [e[0] for e in expected]
    for r, e in zip(rows, expected):
        for field, want in zip(fields(PresetRow), e):
            got = getattr(r, field.name)
            assert got == (pytest.approx(want, rel=1e-12) if isinstance(want, float) else want), (r.name, field.name)


def test_a_cpu_plan_by_hand(monkeypatch):
    configs = {  # plan takes them by FLOPs per token: a 16, b 24, e 32, c 64, d 128; tiny is never planned
        "tiny": None, "d": FakeConfig(10_000, 64, 128, 2048, 1), "c": FakeConfig(100_000, 64, 64, 0, 200),
        "e": FakeConfig(5e6, 64, 32, 512, 1000), "b": FakeConfig(2e6, 128, 24, 1024, 425),
        "a": FakeConfig(20_000, 64, 16, 512, 100)}
    steps = {"a": planner.StepTime(0.25, 0.5, None), "b": planner.StepTime(0.75, 1.0, None),
             "c": planner.StepTime(1.0, 0.0, None)}
    calls = stub_plan(monkeypatch, configs, steps, "cpu", torch.float32, n_data=100_000)
    rows, best, reason, header = planner.plan(3600.0, data_path="data.jsonl", max_step_s=5.25, min_seconds=0.5)
    # 850 of the 1000 bytes may be filled. A CPU times one sequence (timed batch 1) and scales its forward and
    # backward to the batch that fits: tokens/s = batch x seq / (batch x backward_s + update_s). An hour buys
    # tokens/s x 0.9 x 3600 = tokens/s x 3240 tokens, counted up to 4 epochs of the 100,000 data tokens.
    # a: 8 x 100 = 800 bytes fit. A step of 1 x 64 tokens: 16 x 64 = 1,024 FLOPs in 0.25 s (4,096 FLOP/s), the
    #    update's 512 in 0.5 s (1,024 FLOP/s). At batch 8: 512 tokens / (8 x 0.25 + 0.5 = 2.5 s) = 204.8 tokens/s,
    #    663,552 tokens, 6.63552 epochs, of which 4 (400,000 tokens) count
    # b: 2 x 425 = 850 bytes: exactly the bound, fits. Predicted (24 x 128 / 4,096 + 1,024 / 1,024) x 3 = 5.25 s,
    #    not over max_step_s: timed, 0.75 + 1.0 s (4,096 and 1,024 FLOP/s again). 256 / (2 x 0.75 + 1) = 102.4
    #    tokens/s, 331,776 tokens, 3.31776 epochs
    # e: 1 x 1000 bytes do not fit at batch 1
    # c: 4 x 200 fit; predicted (4,096 / 4,096 + 0) x 3 = 3 s: timed, 1 s and no Newton-Schulz work (its update's
    #    FLOP rate is infinite). 256 / (4 x 1) = 64 tokens/s, 207,360 tokens, 2.0736 epochs
    # d: 8 x 1 fit; predicted (8,192 / 4,096 + 2,048 / inf) x 3 = 6 s > 5.25: estimated, backward 2 s, update 0 s.
    #    512 / 16 = 32 tokens/s, 103,680 tokens, 1.0368 epochs
    assert_rows(rows, [
        ("a", 20_000, 8, 64, 204.8, True, 800, False, True, 663_552.0, 400_000.0, 6.63552),
        ("b", 2e6, 2, 128, 102.4, True, 850, False, True, 331_776.0, 331_776.0, 3.31776),
        ("e", 5e6, 1, 64, None, False, 1000, False, False, 0.0, 0.0, None),
        ("c", 100_000, 4, 64, 64.0, True, 800, False, True, 207_360.0, 207_360.0, 2.0736),
        ("d", 10_000, 8, 64, 32.0, False, 8, False, True, 103_680.0, 103_680.0, 1.0368)])
    # tokens per parameter: a 20, b 0.165888, c 2.0736, d 10.368: a, which the data limits
    assert best is rows[0]
    assert reason == ("a: 20 tokens per parameter in the budget, the nearest to the ~20 of compute-optimal "
                      "training (Hoffmann et al. 2022); the data is the limit: the budget would read it 6.64 times, "
                      "and past 4 epochs repeating adds little, so larger presets would need more text")
    assert header == ("time budget 1h 00m on cpu (float32: the reason); 90% of it in training steps; data.jsonl: "
                      "about 0.1M tokens (estimated from its first 2 MB)")
    assert calls["data"] == [Path("data.jsonl")] and calls["device"] == ["auto"]  # the default device
    assert calls["get_preset"] == [(n, {}) for n in "dceba"] + [
        (n, {"vocab_size": 6400}) for n in "dceba"]
    assert calls["timed"] == [(n, torch.device("cpu"), torch.float32, 1, seq, 0.5)
                              for n, seq in (("a", 64), ("b", 128), ("c", 64))]
    assert calls["memory"] == [(n, b, seq, torch.float32, "muon") for n, seq in
                               (("a", 64), ("b", 128), ("e", 64), ("c", 64), ("d", 64)) for b in (8, 4, 2, 1)]
    assert calls["ns"] == [(n, 7) for n in "abcd"]
    assert {seq for _, seq in calls["flops"]} == {64, 128}  # each preset's own context


def test_a_gpu_plan_by_hand(monkeypatch):
    configs = {"p": FakeConfig(4096, 999, 2, 1024, 10), "q": FakeConfig(4e6, 999, 54, 2048, 20),
               "r": FakeConfig(9e6, 999, 8, 0, 1000)}
    steps = {"p": planner.StepTime(0.5, 0.0, 777)}
    calls = stub_plan(monkeypatch, configs, steps, "cuda", torch.bfloat16, n_data=100_000_040_000)
    rows, best, reason, header = planner.plan(90.0, "cuda", "data.jsonl", ["q", "r", "p"], seq_len=32)
    # 850 of 1000 bytes. A GPU times the batch that fits, of 64, 32, ..., 1, and measures its peak memory; the
    # defaults: 2 s of timed steps, 20 s the longest step to time.
    # p: 64 x 10 = 640 bytes fit. Its step of 64 x 32 tokens: 2 x 2,048 = 4,096 FLOPs in 0.5 s (8,192 FLOP/s); its
    #    update's 1,024 took no time, counted as 1e-9 s (1.024e12 FLOP/s). 2,048 / 0.5 = 4,096 tokens/s, the peak
    #    measured: 777 bytes. 90 s buy 4,096 x 81 = 331,776 tokens, 81 per parameter
    # r: 1 x 1000 do not fit
    # q: 32 x 20 = 640 fit. Predicted (54 x 32 x 32 / 8,192 + 2,048 / 1.024e12) x 3 = (6.75 + 2e-9) x 3 = 20.25 s
    #    and a little, over 20: estimated. 1,024 / (6.75 + 2e-9) tokens/s (12,288 tokens in 81 s, bar a little),
    #    its memory estimated: 640 bytes
    # The data's 100,000,040,000 tokens (100,000.04M) are far more than either reads.
    q_speed, n_data = 1024 / (6.75 + 2e-9), 100_000_040_000
    assert_rows(rows, [
        ("p", 4096, 64, 32, 4096.0, True, 777, True, True, 331_776.0, 331_776.0, 331_776 / n_data),
        ("r", 9e6, 1, 32, None, False, 1000, False, False, 0.0, 0.0, None),
        ("q", 4e6, 32, 32, q_speed, False, 640, False, True, q_speed * 81, q_speed * 81, q_speed * 81 / n_data)])
    assert calls["timed"] == [("p", torch.device("cuda"), torch.bfloat16, 64, 32, 2.0)]
    assert calls["memory"][:7] == [("p", b, 32, torch.bfloat16, "muon") for b in (64, 32, 16, 8, 4, 2, 1)]
    assert {seq for _, seq in calls["flops"]} == {32} and calls["device"] == ["cuda"]
    assert header == ("time budget 1m 30s on cuda (bfloat16: the reason); 90% of it in training steps; data.jsonl: "
                      "about 100,000.0M tokens (estimated from its first 2 MB)")
    # 81 tokens per parameter are over 4 x 20: the reason says why not the larger presets (q: 12,288 / 4e6)
    assert best is rows[0] and reason == (
        "p: 81 tokens per parameter in the budget, the nearest to the ~20 of compute-optimal training (Hoffmann et "
        "al. 2022); r does not fit in memory; the next larger that fits, q, would train 0.00307 tokens per "
        "parameter, farther from it")


# ---------------------------------------------------------------------------- timing, on a stub clock
class StubStep:
    """Stands in for pretraining_step's step and for timed(): each timed backward or update takes the next of the
    given seconds, after a warm-up step (binary fractions: sums exact). Records what was asked of it."""

    def __init__(self, backward_s, update_s):
        self.seconds = {"backward": list(backward_s), "update": list(update_s)}
        self.built, self.events = [], []

    def build(self, cfg, device, precision, batch, seq_len):
        self.built.append((cfg, device, precision, batch, seq_len))
        return self

    def backward(self):
        self.events.append("backward")

    def update(self):
        self.events.append("update")

    def __call__(self):
        self.backward()
        self.update()

    def timed(self, work, device):
        work()
        return self.seconds[work.__name__].pop(0)


@pytest.mark.parametrize("min_seconds,backward_s,update_s", [
    (0.0, 0.3125, 0.375),  # at least 2 steps, however short: median(0.5, 0.125), median(0.25, 0.5)
    (1.375, 0.3125, 0.375),  # 0.75 + 0.625 s: exactly the time asked for, after 2 steps
    (1.5, 0.25, 0.5),  # 3 steps to pass 1.5 s (2.375 s): median(0.5, 0.125, 0.25), median(0.25, 0.5, 0.75)
])
def test_a_steady_step_is_the_median_of_the_timed_steps_after_a_warm_up(monkeypatch, min_seconds, backward_s,
                                                                        update_s):
    stub = StubStep([0.5, 0.125, 0.25, 1.0], [0.25, 0.5, 0.75, 1.0])
    monkeypatch.setattr(planner, "pretraining_step", stub.build)
    monkeypatch.setattr(planner, "timed", stub.timed)
    cfg, cpu = get_preset("tiny", vocab_size=256), torch.device("cpu")
    precision = Precision(cpu, torch.float32)
    step = planner.time_steps(cfg, cpu, precision, 16, 64, min_seconds)
    assert (step.backward_s, step.update_s, step.peak_bytes) == (backward_s, update_s, None)  # CPU: no peak
    assert stub.built == [(cfg, cpu, precision, 16, 64)]  # one model, one batch for every step
    assert stub.events == ["backward", "update"] * (3 if min_seconds < 1.5 else 4)  # the warm-up step first


# ---------------------------------------------------------------------------- the step, the data, the device
def test_the_timed_step_is_pretrainings_on_random_tokens():
    """A new model, a batch of random tokens of the whole vocabulary, their next tokens as targets (the last
    position's wrapping to the first), and pretraining's default --optimizer, muon: Muon on the hidden matrices
    (weight decay 0.1), AdamW (betas 0.9, 0.95) on the rest, at --learning_rate's default, 5e-4."""
    cpu = torch.device("cpu")
    step = planner.pretraining_step(get_preset("tiny", vocab_size=256), cpu, Precision(cpu, torch.float32), 16, 64)
    [(x, y)] = step.micro
    assert x.shape == (16, 64) and x.min() == 0 and x.max() == 255
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, 0]) and step.n_valid.item() == 16 * 64
    optimizer = step.backend.optimizer
    assert isinstance(optimizer, MuonWithAdamW)
    muon, *adamw = optimizer.param_groups
    assert (muon["owner"], muon["lr"], muon["weight_decay"]) == ("muon", 5e-4, 0.1)
    assert {g["owner"] for g in adamw} == {"adamw"} and all(g["lr"] == 5e-4 for g in adamw)
    assert optimizer.adamw.defaults["betas"] == (0.9, 0.95) and step.backend.grad_clip == 1.0


def test_the_timed_backward_is_the_mean_next_token_loss_scaled_for_fp16():
    """The gradients of the step's backward are those of the mean cross-entropy of the next tokens (the forward in
    the precision's autocast, the loss in fp32), computed here with torch alone; fp16's loss scaling multiplies
    them by the scaler's 65,536."""
    cpu, cfg = torch.device("cpu"), get_preset("tiny", vocab_size=64)
    for dtype, scale in ((torch.float32, 1.0), (torch.float16, 65536.0)):
        precision = Precision(cpu, dtype)
        step = planner.pretraining_step(cfg, cpu, precision, 2, 8)
        [(x, _)] = step.micro
        model = step.step.wrapped
        reference = PocketLM(cfg)
        reference.load_state_dict(model.state_dict())
        with precision.autocast():
            logits = reference(x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x.roll(-1, 1).flatten())
        (loss * scale).backward()
        step.backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6 * scale, msg=name)


def test_the_update_unscales_clips_to_norm_one_and_clears_the_gradients():
    """The update is the single-process backend's, clipping at --grad_clip's default, 1."""
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    precision = Precision(torch.device("cpu"), torch.float16)
    backend = TorchBackend(Comm(), torch.device("cpu"), precision, OptimConfig().grad_clip)
    backend.wrap(model, lambda m: torch.optim.SGD(m.parameters(), lr=1.0))
    precision.scaler.scale(model(torch.tensor([3.0, 4.0])).sum()).backward()  # gradient (3, 4) x 65,536
    planner.PretrainingStep(None, backend, [], torch.tensor(0.0)).update()
    # unscaled to (3, 4), norm 5, clipped to norm 1: (0.6, 0.8); one step of SGD at lr 1 from zero
    torch.testing.assert_close(model.weight.detach(), torch.tensor([[-0.6, -0.8]]))
    assert model.weight.grad is None


class CharTokenizer:
    """One token a character: token counts by hand. Remembers the directory it was given."""

    dirs = []

    def __init__(self, directory):
        self.dirs.append(directory)

    def encode(self, text):
        return list(text)


@pytest.fixture
def char_tokens(monkeypatch):
    from dataset import tokenizer
    CharTokenizer.dirs = []
    monkeypatch.setattr(tokenizer, "Tokenizer", CharTokenizer)
    return CharTokenizer.dirs


ABCD, EF, XYZ = '{"text": "abcd"}', '{"text": "ef"}', '{"text": "xyz"}'  # 16, 14 and 15 bytes; 4, 2, 3 tokens


@pytest.mark.parametrize("content,sample_bytes,tokens", [
    # the whole file, 32 bytes: records of 17 and 15 bytes with their newlines (the last has none) and a blank
    # line (skipped), 4 + 1 and 2 + 1 tokens with the separators: 32 x 8 / 32 = 8
    (ABCD + "\n\n" + EF, 1000, 8),
    # a sample of 24 bytes: the first record and 7 bytes of the next, cut (left out): 17 bytes, 5 tokens; the file's
    # 17 + 30 x 16 = 497 bytes hold about 497 x 5 / 17 = 146.2
    (ABCD + "\n" + (XYZ + "\n") * 30, 24, 146),
    # a sample of 40 bytes: two records (17 + 16 bytes, 5 + 4 tokens) and 7 bytes cut: 497 x 9 / 33 = 135.5
    (ABCD + "\n" + (XYZ + "\n") * 30, 40, 136),
    # a sample of exactly one record with no newline: nothing is cut; 16 x 5 / 17 = 4.7
    (ABCD, 16, 5),
])
def test_the_data_estimate_by_hand(monkeypatch, tmp_path, char_tokens, content, sample_bytes, tokens):
    monkeypatch.setattr(planner, "SAMPLE_BYTES", sample_bytes)
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    assert data_tokens(path) == tokens
    assert data_tokens(path, tmp_path) == tokens
    from dataset.tokenizer import DEFAULT_TOKENIZER_DIR
    assert char_tokens == [DEFAULT_TOKENIZER_DIR, tmp_path]


@pytest.mark.parametrize("content,line", [
    (ABCD + "\n\n" + '{"conversations": []}', 3),  # no "text" (the blank line is counted)
    ('{"text": 5}', 1),  # not a string
    ('["text"]', 1),  # not an object
    ("not json\n" + ABCD, 1),
    (b'{"text": "\xff"}', 1),  # not UTF-8
])
def test_a_bad_record_is_named_by_its_line(tmp_path, char_tokens, content, line):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DataError) as e:
        data_tokens(path)
    assert str(e.value) == f'{path}:{line}: expected a JSON object with a "text" string (a pretraining record)'


def test_a_file_without_records_or_missing_is_a_data_error(tmp_path, char_tokens):
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")
    with pytest.raises(DataError) as e:
        data_tokens(blank)
    assert str(e.value) == f"{blank}: no records"
    with pytest.raises(DataError) as e:
        data_tokens(tmp_path / "missing.jsonl")
    assert str(e.value) == f"--data_path {tmp_path / 'missing.jsonl'}: No such file or directory"


def test_the_memory_a_plan_may_fill(monkeypatch):
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 1000}
    monkeypatch.setattr(planner.os, "sysconf", lambda name: pages[name])
    assert planner.device_memory(torch.device("cpu")) == 4_096_000  # the machine's RAM: pages x page size
    for error in (ValueError, OSError, AttributeError):  # no way to ask: 16 GiB
        def sysconf(name, error=error):
            raise error
        monkeypatch.setattr(planner.os, "sysconf", sysconf)
        assert planner.device_memory(torch.device("cpu")) == 16 << 30
    gpus = {torch.device("cuda:1"): SimpleNamespace(total_memory=12345)}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: gpus[device])
    assert planner.device_memory(torch.device("cuda:1")) == 12345  # the GPU's own memory


def test_the_command_prints_the_plan_whole(monkeypatch, capsys):
    best = fitting("a", 1e6, 8, 512, 1000.0, 3_240_000, 2_000_000, 6.48, 1 << 30)
    other = PresetRow("huge", 1e9, 1, 512, None, False, 1 << 40, False, False)
    asked = []

    def plan(*args):
        asked.append(args)
        return [best, other], (best if len(asked) == 1 else None), "the reason", "the header"

    monkeypatch.setattr(planner, "plan", plan)
    table = planner.table([best, other], best).splitlines()
    footer = ("tokens/s: measured by timing training steps here (est.: scaled from the last measured preset's FLOP "
              "rate); peak memory: model/memory.py's estimate (est.), measured on CUDA")
    assert planner.main("2h", "cpu", "d.jsonl", ["a", "huge"]) == 0
    assert capsys.readouterr().out.splitlines() == ["the header", *table, "recommended: the reason",
        "  python train_pretrain.py --preset a --data_path d.jsonl --time_budget 2h --batch_size 8 --epochs 4 "
        "--qk_norm --learning_rate 4e-3 --warmup_steps 20", footer]  # 2,000,000 tokens: 488 steps of 4,096
    assert planner.main("90s", "cpu", None, None) == 0  # nothing fits: no command line
    table = planner.table([best, other], None).splitlines()
    assert capsys.readouterr().out.splitlines() == ["the header", *table, "recommended: the reason", footer]
    assert asked == [(7200.0, "cpu", "d.jsonl", ["a", "huge"]), (90.0, "cpu", None, None)]
    with pytest.raises(ConfigError) as e:
        planner.main(None, "cpu", None, None)
    assert str(e.value) == "--plan needs --time_budget (90s, 10m, 2h)"


def test_a_gpu_step_is_built_there_and_measures_its_peak_memory(monkeypatch):
    """time_steps on a stand-in CUDA device: the step is built there, its peak-memory counter is reset after the
    warm-up step and read after the timed ones, and its cache emptied for the next preset."""
    stub = StubStep([0.5, 0.5], [0.5, 0.5])
    events = stub.events
    cuda = torch.device("cuda")

    def cuda_call(name, result=None):
        return lambda *args: events.append((name, *args)) or result

    monkeypatch.setattr(planner, "pretraining_step", stub.build)
    monkeypatch.setattr(planner, "timed", stub.timed)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", cuda_call("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", cuda_call("peak", 4242))
    monkeypatch.setattr(torch.cuda, "empty_cache", cuda_call("empty_cache"))
    step = planner.time_steps(get_preset("tiny"), cuda, Precision(torch.device("cpu"), torch.float32), 2, 8, 0.0)
    assert step.peak_bytes == 4242 and stub.built[0][1] == cuda
    assert events == ["backward", "update", ("reset", cuda), "backward", "update", "backward", "update",
                      ("peak", cuda), ("empty_cache",)]
