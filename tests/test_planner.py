"""`python -m model --plan` and `train_pretrain.py --preset auto`: measured and estimated speeds, which candidates
are timed, the budget's arithmetic, the data's epochs, memory, the loss each candidate expects and the pick, its
command line, and bad input. The printed plan is checked whole against hand-written text, and plan's, the timing's
and the data estimate's arithmetic by hand, with the clock, the step, the presets, the loss model and the
tokenizer stubbed."""
from __future__ import annotations

import json
import math
import random
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
from trainer_utils.loss_model import FIT_RESULTS, SHIPPED, LossModel
from trainer_utils.optim import MuonWithAdamW
from trainer_utils.planner import PresetRow, data_tokens
from trainer_utils.runtime import Precision

from conftest import ROOT, demo_records, write_jsonl


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("plan") / "small.jsonl", demo_records("pretrain_demo.jsonl", 30))


def test_the_table_of_tiny_presets_is_consistent(small_corpus):
    # tiny is timed (the cheapest step is timed first); mini-30m's step, predicted from tiny's FLOP rate, exceeds
    # max_step_s: it is estimated. 10 minutes: tiny reads the small corpus more than 4 times even on a loaded
    # machine (> 121 tokens/s)
    rows, best, reason, header = planner.plan(600.0, "cpu", str(small_corpus), ["mini-30m", "tiny"],
                                              seq_len=64, max_step_s=1e-9, min_seconds=0.05)
    tiny, mini = rows
    assert (tiny.name, mini.name) == ("tiny", "mini-30m")  # cheapest step first
    assert tiny.speed_measured and not mini.speed_measured and not tiny.peak_measured  # CPU: memory estimated
    assert tiny.tokens_per_s > mini.tokens_per_s and tiny.batch_size == mini.batch_size == 16  # the recipe's batch
    n_data = data_tokens(small_corpus)
    for r in rows:  # 10 minutes: 540 s of it in steps
        assert r.budget_tokens == pytest.approx(r.tokens_per_s * 540) and r.epochs == pytest.approx(
            r.budget_tokens / n_data)
        assert r.expected_loss == SHIPPED.loss(r.non_embedding, r.trained_tokens)
    assert tiny.epochs > 4 and tiny.trained_tokens == pytest.approx(4 * n_data)  # 4 of its many epochs count
    # 4 epochs of ~16K tokens are under 0.04 tokens per parameter for mini-30m (11.9M): tiny, whatever it expects
    assert best is tiny and mini.trained_tokens / mini.parameters < planner.MIN_TOKENS_PER_PARAMETER
    assert "(estimated from the first" in header and "cpu" in header
    text = planner.table(rows, best)
    assert "(est.)" in text.splitlines()[3] and "⭐" in text
    assert best.name in reason


def test_the_family_is_every_depth():
    names = planner.family()
    assert names[0] == "depth-1" and names[-1] == "depth-48" and len(names) == 48
    assert names == [f"depth-{n}" for n in range(1, 49)]


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


@pytest.fixture
def any_size(monkeypatch):
    """The reasons without the note on sizes outside the loss model's fit (tested on its own)."""
    monkeypatch.setattr(planner, "FIT_SIZES", (0, math.inf))


def row(name, params, loss=None, fits=True, tps=1e3, trained=1e6, non_embedding=None):
    """A candidate's row, its expected loss and tokens set by hand."""
    r = PresetRow(name, params, non_embedding or params, 16, 256, tps, True, 0, False, fits)
    if fits:
        r.budget_tokens = r.trained_tokens = trained
        r.expected_loss = loss
    return r


def test_what_a_budget_buys_by_hand():
    r = row("a", 1e6, tps=1000.0, non_embedding=1e4)  # an hour at 1000 tokens/s, 90% of it in steps: 3,240,000
    model = LossModel(E=2.0, A=100.0, alpha=0.5, B=1000.0, beta=0.5)  # 2 + 100 / 100 + 1000 / sqrt(tokens)
    planner.buy(r, 3600.0, n_data=250_000, loss_model=model)  # 4 epochs of 250,000 tokens: 1,000,000 count
    assert (r.budget_tokens, r.trained_tokens, r.epochs, r.tokens_per_parameter) == (3_240_000, 1_000_000, 12.96, 1.0)
    assert r.expected_loss == 4.0  # 2 + 1 + 1000 / 1000: the tokens that count, the non-embedding parameters
    planner.buy(r, 3600.0, n_data=None, loss_model=model)  # no data given: no limit
    assert (r.trained_tokens, r.epochs, r.tokens_per_parameter) == (3_240_000, None, 3.24)
    assert r.expected_loss == pytest.approx(3.0 + 1000 / 1800)
    planner.buy(r, 3600.0, n_data=None)  # the shipped loss model by default
    assert r.expected_loss == SHIPPED.loss(1e4, 3_240_000)


def test_the_shipped_loss_model_is_the_recorded_fit():
    recorded = json.loads((ROOT / FIT_RESULTS).read_text())
    assert LossModel.from_dict(recorded["model"]) == SHIPPED
    assert recorded["recipe"] == planner.RECIPE and recorded["parameters"] == "non-embedding"
    sizes = [r["parameters"] for r in recorded["runs"]]  # fitted (a run held out tests the fit beyond them)
    assert planner.FIT_SIZES == (min(sizes), max(sizes))


def test_the_pick_is_the_lowest_expected_loss_that_fits():
    many = 1e9  # tokens: every row reads enough of them for its size
    assert planner.recommend([row("a", 10e6, 4.0, trained=many), row("b", 25e6, 3.5, trained=many),
                              row("c", 100e6, 3.9, trained=many)]).name == "b"
    assert planner.recommend([row("a", 10e6, 4.0, trained=many), row("b", 40e6, 4.0, trained=many)]).name == "a"
    assert planner.recommend([row("a", 10e6, fits=False), row("b", 40e6, 9.0, trained=many)]).name == "b"
    assert planner.recommend([row("a", 10e6, fits=False)]) is None
    rng = random.Random(0)  # and for any rows, the minimum of those that fit
    for _ in range(200):
        rows = [row(str(i), 1e6, rng.uniform(2, 6), fits=rng.random() < 0.7) for i in range(rng.randint(1, 8))]
        fitting = [r.expected_loss for r in rows if r.fits]
        best = planner.recommend(rows)
        assert (best is None) == (not fitting) and (best is None or best.expected_loss == min(fitting))


def test_a_model_that_reads_too_few_tokens_per_parameter_is_not_picked(any_size):
    fits_data = json.loads((ROOT / FIT_RESULTS).read_text())
    fewest = min(r["tokens"] / r["parameters_total"] for r in fits_data["runs"])
    assert planner.MIN_TOKENS_PER_PARAMETER <= fewest < planner.MIN_TOKENS_PER_PARAMETER + 0.01  # the fit's, rounded
    small, big = row("small", 1e6, 3.5, trained=1e6), row("big", 1e8, 3.0, trained=4e6)  # big reads 0.04 a parameter
    assert planner.recommend([small, big]) is big  # at the bound: seen
    big.trained_tokens = 3.99e6
    assert planner.recommend([small, big]) is small
    assert planner.why(small, [small, big]) == (
        "small: the lowest expected validation loss, 3.50, after 1.0M tokens (1 per parameter); big expects 3.00 after "
        "4.0M; big would expect less, but read fewer than 0.04 tokens per parameter, fewer than any run the loss "
        "model was fitted on")
    big2 = row("big2", 2e8, 2.9, trained=4e6)
    assert "; big, big2 would expect less, but read fewer" in planner.why(small, [small, big, big2])
    huge = row("huge", 1e9, 2.0, trained=1e6)  # every one reads too few: the one that reads the most
    bigger = row("bigger", 1e9, 2.5, trained=2e6)
    assert planner.recommend([huge, bigger, row("none", 1e6, fits=False)]) is bigger


def test_a_cpu_plan_checks_memory_at_the_batch_its_command_trains(monkeypatch):
    dtype = choose_dtype("auto", torch.device("cpu"), "train").dtype
    peak = {b: estimate_memory(get_preset("tiny"), b, 64, dtype, optimizer=planner.OPTIMIZER).peak for b in (8, 16)}
    assert peak[8] < peak[16]
    monkeypatch.setattr(planner, "device_memory", lambda device: math.ceil(peak[8] / planner.MEMORY_SHARE))
    rows, best, _, _ = planner.plan(60.0, "cpu", None, ["tiny"], seq_len=64, min_seconds=0.05)
    assert best.batch_size == 8 and best.peak_bytes == peak[8]  # the recipe's 16 would not fit


def test_a_preset_that_does_not_fit_is_shown_and_never_recommended(monkeypatch):
    monkeypatch.setattr(planner, "device_memory", lambda device: 100 << 20)  # 100 MiB: only tiny fits
    rows, best, reason, header = planner.plan(60.0, "cpu", None, ["tiny", "minimind-104m"], seq_len=64,
                                              min_seconds=0.05)
    assert [r.fits for r in rows] == [True, False] and best.name == "tiny"
    assert header.endswith("; 90% of it in training steps")  # no data given: nothing said of it
    assert "; larger ones do not fit in memory" in reason
    assert "does not fit" in planner.table(rows, best)


def test_the_command_line_trains_the_recommendation(small_corpus, capsys):
    # 5 minutes: more than 3 epochs of the small corpus (~16K tokens) at over ~180 tokens/s, even on a loaded machine
    assert model_cli.main(["--plan", "--time_budget", "5m", "--device", "cpu", "--data_path", str(small_corpus),
                           "--presets", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "| tiny ⭐ |" in out and "recommended: tiny" in out
    line = next(s for s in out.splitlines() if "train_pretrain.py --preset tiny" in s)
    assert f"--preset tiny --data_path {small_corpus} --time_budget 5m --batch_size 16" in line
    assert "--epochs 4" in line  # many epochs of a small file fit in the budget: --epochs must allow them
    assert f"--preset auto --time_budget 5m --data_path {small_corpus}" in out


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


def test_an_update_costs_its_newton_schulz_flops():
    t = planner.StepTime(backward_s=0.5, update_s=2.0, peak_bytes=None)
    assert t.step_s == 2.5
    cfg = get_preset("tiny")  # d64, 2 layers, 4 heads of 16, 2 key heads, ffn 192: q, k, v, o, gate, up, down
    d, kv, f = 64, 32, 192
    shapes = [(d, d), (kv, d), (kv, d), (d, d), (f, d), (f, d), (d, f)] * 2
    expected = sum(5 * (4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3) for s in shapes)
    assert planner.newton_schulz_flops(cfg) == expected


def test_an_estimated_step_takes_each_part_at_its_own_rate():
    # timed: 1,000 backward FLOPs in 0.5 s (2,000/s), 300 Newton-Schulz FLOPs in 0.25 s (1,200/s)
    timed, t = planner.Work(None, 1000.0, 300.0), planner.StepTime(0.5, 0.25, None)
    assert planner.Work(None, 4000.0, 600.0).seconds(timed, t) == 2.0 + 0.5
    assert planner.Work(None, 4000.0, 0.0).seconds(timed, t) == 2.0
    # a timed step without Newton-Schulz work (AdamW): its update tells nothing of another's, counted as free
    assert planner.Work(None, 4000.0, 600.0).seconds(planner.Work(None, 1000.0, 0.0), t) == 2.0
    work = {"a": planner.Work(None, 100.0, 0.0), "b": planner.Work(None, 1000.0, 0.0)}
    times = {"a": planner.StepTime(1.0, 0.0, None), "b": planner.StepTime(1.0, 0.0, None)}
    # 400 FLOPs are nearer 100 than 1,000 by ratio (4x against 2.5x): b's rate, 1,000/s; 300 is nearer 100 (3x)
    assert planner.estimated_step_s(planner.Work(None, 400.0, 0.0), work, times) == 0.4
    assert planner.estimated_step_s(planner.Work(None, 300.0, 0.0), work, times) == 3.0


# ---------------------------------------------------------------------------- the printed plan, checked whole
def fitting(name, params, batch, seq, tps, budget, trained, epochs, peak, loss, speed_measured=True,
            peak_measured=False):
    """A row that fits, every figure set by hand (what plan and buy would fill in)."""
    return PresetRow(name, params, params, batch, seq, tps, speed_measured, peak, peak_measured, True, budget, trained,
                     epochs, loss)


def test_the_table_prints_every_figure():
    # alpha: 246,913,560 / 12,345,678 = exactly 20 tokens per parameter; 6.48 epochs print as 6.5
    alpha = fitting("alpha", 12_345_678, 8, 512, 12_345.6, 1e9, 246_913_560, 6.48, 3 << 30, 3.456,
                    peak_measured=True)
    # beta: estimated speed and memory; 999,950,500 tokens are 999.9505M, printed 1,000.0 (a unit off by a
    # millionth would be 0.001M less and print 999.9); 1e5 / 104e6 = 0.000961538... tokens per parameter
    beta = fitting("beta", 104_000_000, 2, 1024, 1_500.4, 999_950_500, 1e5, None, 1536 << 30, 10.0,
                   speed_measured=False)
    # eps: 1e5 tokens is where K turns to M
    eps = fitting("eps", 1e6, 1, 8, 0.5, 1e5, 1e5, 2.0, 0, 123.456)
    # gamma: 99,999 tokens = 99.999K, printed 100.0K; 0.123 epochs print as 0.12
    gamma = fitting("gamma", 50_000, 1, 64, 1_234.4, 99_999, 100_000, 0.123, 1 << 29, 4.994)
    # delta: 1,000,000,005,400,000 tokens are 1,000,000.0054B, printed .01 (a unit off by a billionth would be
    # 0.001B less and print .00)
    delta = fitting("delta", 1_000, 4, 256, 5e6, 1_000_000_005_400_000, 2_000, 1.0, 1 << 30, 0.0)
    # huge: 100,000,040,000 parameters are 100,000.04M, printed .0 (a unit off by a millionth would be 0.1M less
    # and print 99999.9); not fitting, it prints no figures, and the rows after it are still printed
    huge = PresetRow("huge", 100_000_040_000, 1, 1, 2048, None, False, 20 << 30, False, False)
    assert planner.table([alpha, beta, huge, gamma, delta, eps], alpha).splitlines() == [
        "| preset | params | batch | tokens/s | tokens in budget | tokens/param | epochs of data | expected loss "
        "| peak memory |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|",
        "| alpha ⭐ | 12.3M | 8×512 | 12,346 | 1.00B | 20 | 6.5 | 3.46 | 3.00 GiB |",
        "| beta | 104.0M | 2×1024 | 1,500 (est.) | 1,000.0M | 0.000962 | – | 10.00 | 1,536.00 GiB (est.) |",
        "| huge | 100000.0M | – | does not fit | – | – | – | – | 20.00 GiB (est.) |",
        "| gamma | 0.1M | 1×64 | 1,234 | 100.0K | 2 | 0.12 | 4.99 | 0.50 GiB (est.) |",
        "| delta | 0.0M | 4×256 | 5,000,000 | 1,000,000.01B | 2 | 1 | 0.00 | 1.00 GiB (est.) |",
        "| eps | 1.0M | 1×8 | 0 | 0.1M | 0.1 | 2 | 123.46 | 0.00 GiB (est.) |",
    ]
    # the star follows the recommendation, and a plan without one stars nothing
    assert "| huge ⭐ | 100000.0M | – | does not fit |" in planner.table([alpha, huge], huge)
    assert "⭐" not in planner.table([alpha, huge], None)


def test_the_rows_shown_are_the_timed_the_pick_s_neighbours_and_the_first_too_big():
    rows = [row(f"d{i}", 1e6 * i, 5.0, tps=1.0) for i in range(1, 16)] + [row("big", 1e9, fits=False),
                                                                            row("bigger", 2e9, fits=False)]
    for r in rows:
        r.speed_measured = r.name in ("d1", "d6", "d7")
    best = rows[9]  # d10
    assert [r.name for r in planner.shown(rows, best)] == ["d1", "d6", "d7", "d8", "d9", "d10", "d11", "d12", "big"]
    assert [r.name for r in planner.shown(rows, rows[0])] == ["d1", "d2", "d3", "d6", "d7", "big"]  # the first
    assert [r.name for r in planner.shown(rows, None)] == ["d1", "d6", "d7", "big"]
    assert planner.shown(rows[:8], rows[3]) == rows[:8]  # few: every row
    assert [r.name for r in planner.shown(rows[:9], rows[4])] == ["d1", "d3", "d4", "d5", "d6", "d7"]  # 9: not few
    for r in rows:
        r.speed_measured = False
    assert [r.name for r in planner.shown(rows, rows[1])] == ["d1", "d2", "d3", "d4", "big"]


REASON = "b: the lowest expected validation loss, 3.50, after 2.0M tokens (0.1 per parameter)"


@pytest.mark.parametrize("others,suffix", [
    # its neighbours in size, the smaller first, whatever order the rows come in (by non-embedding parameters)
    ([row("c", 40e6, 3.75, trained=1e6), row("a", 10e6, 3.625, trained=4e6), row("z", 1e6, 9.0)],
     "; a expects 3.62 after 4.0M, c expects 3.75 after 1.0M"),
    ([row("a", 10e6, 4.0, trained=4e6)], "; a expects 4.00 after 4.0M"),  # the largest: no larger one planned
    ([row("a", 10e6, 4.0, trained=4e6), row("big", 1e9, fits=False)],
     "; a expects 4.00 after 4.0M; larger ones do not fit in memory"),
    ([row("c", 40e6, 4.0), row("big", 1e9, fits=False)], "; c expects 4.00 after 1.0M"),  # one larger fits
    ([row("small", 1e6, fits=False)], ""),  # alone
    ([row("twin", 20e6, 3.9), row("c", 40e6, 4.0)], "; c expects 4.00 after 1.0M"),  # as large: no neighbour
    ([row("twin", 20e6, fits=False)], ""),  # as large, not fitting: no larger one
])
def test_the_reason_whole(others, suffix, any_size):
    best = row("b", 20e6, 3.5, trained=2e6)
    assert planner.why(best, [best, *others]) == REASON + suffix


def test_the_reason_says_when_the_pick_is_outside_the_fitted_sizes():
    for size in (53_568, 9_442_944):  # the smallest and the largest fitted run's size (depths 1 and 6), exactly
        inside = row("inside", size, 3.5)
        assert "outside" not in planner.why(inside, [inside])
    for size, written in ((53_567, "53,567"), (9_442_945, "9,442,945")):
        outside = row("out", size, 3.5)
        assert planner.why(outside, [outside]).endswith(
            f"; at {written} non-embedding parameters it is outside the sizes the loss model was fitted on "
            "(53,568-9,442,944): its expected loss is extrapolated")


def test_the_reason_whole_when_the_data_is_the_limit(any_size):
    best = row("b", 20e6, 3.5, trained=2e6)  # 2M of the 60M tokens the budget buys count: 4 epochs of 0.5M
    best.budget_tokens, best.epochs = 60e6, 120.0
    assert planner.why(best, [best]) == REASON + (
        "; the data is the limit: the budget would read it 120 times, and past 4 epochs repeating adds little")
    assert planner.why(None, []) == "nothing fits in this device's memory even at batch 1"


@pytest.mark.parametrize("name,epochs,data_path,expected", [
    # the recipe's settings the loss model was fitted with; 6.48 epochs are capped at 4
    ("depth-3", 6.48, "d.jsonl", "--data_path d.jsonl --time_budget 1h --batch_size 16 --learning_rate 0.008 "
                                 "--muon_lr 0.004 --muon_base_width 256 --warmup_steps 20 --epochs 4"),
    ("depth-3", 1.2, "d.jsonl", "--data_path d.jsonl --time_budget 1h --batch_size 16 --learning_rate 0.008 "
                                "--muon_lr 0.004 --muon_base_width 256 --warmup_steps 20 --epochs 2"),
    ("depth-3", 0.5, "d.jsonl", "--data_path d.jsonl --time_budget 1h --batch_size 16 --learning_rate 0.008 "
                                "--muon_lr 0.004 --muon_base_width 256 --warmup_steps 20"),  # under an epoch: 1
    ("depth-3", None, None, "--data_path YOUR.jsonl --time_budget 1h --batch_size 16 --learning_rate 0.008 "
                            "--muon_lr 0.004 --muon_base_width 256 --warmup_steps 20"),  # no data given
    # a preset without QK-norm gets it (the depth family has it): the recipe's learning rate needs it
    ("mini-30m", 2.0, "d.jsonl", "--data_path d.jsonl --time_budget 1h --batch_size 16 --learning_rate 0.008 "
                                 "--muon_lr 0.004 --muon_base_width 256 --warmup_steps 20 --epochs 2 --qk_norm"),
])
def test_the_command_line_whole(name, epochs, data_path, expected):
    best = row(name, 10e6)
    best.epochs = epochs
    assert planner.command(best, "1h", data_path) == f"python train_pretrain.py --preset {name} " + expected


# ---------------------------------------------------------------------------- plan's arithmetic, with stub presets
class FakeConfig:
    """A candidate for plan with round numbers: parameters (all, non-embedding), FLOPs per token, Newton-Schulz
    FLOPs, bytes per sequence of a batch."""

    def __init__(self, params, non_embedding, max_seq_len, flops, ns, mem):
        self.params, self.non_embedding, self.max_seq_len = params, non_embedding, max_seq_len
        self.flops, self.ns, self.mem = flops, ns, mem

    def num_parameters(self, non_embedding=False):
        return self.non_embedding if non_embedding else self.params


def stub_plan(monkeypatch, configs, steps, device, dtype, n_data, memory=1000):
    """plan over `configs` with every measurement stubbed: `steps` the StepTime each timed candidate takes (by
    name), the data n_data tokens, the device's memory `memory` bytes. Returns the log of the calls plan made."""
    calls = {"get_preset": [], "flops": [], "memory": [], "ns": [], "timed": [], "data": [], "device": [],
             "dtype": []}
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

    def data_tokens(path, tokenizer_dir=None):
        calls["data"].append((path, tokenizer_dir))
        return n_data

    def parse_device(name):
        calls["device"].append(name)
        return torch.device(device)

    def choose_dtype(name, dev, purpose="train"):
        calls["dtype"].append(name)
        return DtypeChoice(dtype, "the reason")

    monkeypatch.setattr(planner, "family", lambda: list(configs))
    monkeypatch.setattr(planner, "get_preset", get_preset)
    monkeypatch.setattr(planner, "flops_per_token", flops_per_token)
    monkeypatch.setattr(planner, "estimate_memory", estimate)
    monkeypatch.setattr(planner, "newton_schulz_flops", newton_schulz)
    monkeypatch.setattr(planner, "time_steps", time_steps)
    monkeypatch.setattr(planner, "data_tokens", data_tokens)
    monkeypatch.setattr(planner, "device_memory", lambda dev: memory)
    monkeypatch.setattr(planner, "parse_device", parse_device)
    monkeypatch.setattr(planner, "choose_dtype", choose_dtype)
    monkeypatch.setattr(planner, "precision_policy", lambda dev: SimpleNamespace(newton_schulz_steps=7))
    return calls


def assert_rows(rows, expected):
    """rows, field by field, against tuples in PresetRow's order (floats to 12 digits)."""
    assert [r.name for r in rows] == [e[0] for e in expected]
    for r, e in zip(rows, expected):
        for field, want in zip(fields(PresetRow), e):
            got = getattr(r, field.name)
            assert got == (pytest.approx(want, rel=1e-12) if isinstance(want, float) else want), (r.name, field.name)


def test_a_cpu_plan_by_hand(monkeypatch, any_size):
    configs = {  # plan takes them by FLOPs per token: a 16, b 32, c 80, d 128, e 256
        "e": FakeConfig(20_000, 10_000, 64, 256, 0, 10), "d": FakeConfig(9_000, 5_000, 64, 128, 0, 1000),
        "c": FakeConfig(3_000, 1_000, 64, 80, 0, 106.25), "b": FakeConfig(2_000, 400, 64, 32, 512, 50),
        "a": FakeConfig(1_000, 100, 64, 16, 0, 50)}
    steps = {"a": planner.StepTime(1.0, 0.0, None), "b": planner.StepTime(1.0, 0.5, None),
             "c": planner.StepTime(5.0, 0.0, None)}
    calls = stub_plan(monkeypatch, configs, steps, "cpu", torch.float32, n_data=None)
    model = LossModel(E=0.5, A=1000.0, alpha=1.0, B=921_600.0, beta=1.0)  # 0.5 + 1000 / N + 921,600 / D
    rows, best, reason, header = planner.plan(1000.0, max_step_s=6.0, min_seconds=0.5, loss_model=model)
    # 850 of the 1000 bytes may be filled: a, b and e at the recipe's batch, 16 (800, 800, 160 bytes), c at 8 (850,
    # exactly the bound),
    # d not even at 1. 1000 s: 900 of them in steps, each of 16 (c: 8) x 64 tokens.
    # Round 1 times the cheapest, a: 16 x 16 x 64 = 16,384 FLOPs in 1 s. From its rate: b's 32,768 in 2 s, c's
    #    40,960 in 2.5 s, e's 262,144 in 16 s: 1,024, 512, 204.8 and 64 tokens/s; 921,600, 460,800, 184,320 and
    #    57,600 tokens; losses 0.5 + 10 + 1 = 11.5, 0.5 + 2.5 + 2 = 5, 0.5 + 1 + 5 = 6.5, 0.5 + 0.1 + 16 = 16.6: b.
    # Round 2 times b's untimed neighbours whose 3 steps take at most 6 s: b (3 x 2), not c (3 x 2.5). b takes
    #    1 + 0.5 s: 682.67 tokens/s, 614,400 tokens, 0.5 + 2.5 + 1.5 = 4.5. c and e are now nearer b in FLOPs (by
    #    ratio): its backward's 32,768 FLOP/s make c's step 1.25 s (409.6 tokens/s, 368,640 tokens, 0.5 + 1 + 2.5
    #    = 4) and e's 8 s (128 tokens/s, 115,200 tokens, 8.6): c.
    # Round 3 times c (3 x 1.25 s), not e (3 x 8): 5 s, 102.4 tokens/s, 92,160 tokens, 0.5 + 1 + 10 = 11.5. e is
    #    nearer c now: 262,144 / 8,192 = 32 s, 32 tokens/s, 28,800 tokens, 0.5 + 0.1 + 32 = 32.6. b again.
    # Round 4: b's neighbours are timed: done.
    assert_rows(rows, [
        ("a", 1_000, 100, 16, 64, 1024.0, True, 800, False, True, 921_600.0, 921_600.0, None, 11.5),
        ("b", 2_000, 400, 16, 64, 1024 / 1.5, True, 800, False, True, 614_400.0, 614_400.0, None, 4.5),
        ("c", 3_000, 1_000, 8, 64, 102.4, True, 850, False, True, 92_160.0, 92_160.0, None, 11.5),
        ("d", 9_000, 5_000, 1, 64, None, False, 1000, False, False, 0.0, 0.0, None, None),
        ("e", 20_000, 10_000, 16, 64, 32.0, False, 160, False, True, 28_800.0, 28_800.0, None, 32.6)])
    assert best is rows[1]
    assert calls["timed"] == [(n, torch.device("cpu"), torch.float32, batch, 64, 0.5) for n, batch in
                              (("a", 16), ("b", 16), ("c", 8))]
    assert header == "time budget 16m 40s on cpu (float32: the reason); 90% of it in training steps"
    assert calls["data"] == [] and calls["device"] == ["auto"] and calls["dtype"] == ["auto"]  # the defaults
    assert calls["get_preset"] == [(n, {"vocab_size": 6400}) for n in "edcba"]
    assert calls["memory"] == [(n, b, 64, torch.float32, "muon") for n in "abcde" for b in (16, 8, 4, 2, 1)]
    assert calls["ns"] == [(n, 7) for n in "abce"]
    assert reason == ("b: the lowest expected validation loss, 4.50, after 0.6M tokens (307 per parameter); a "
                      "expects 11.50 after 0.9M, c expects 11.50 after 92.2K")


def test_a_gpu_plan_by_hand(monkeypatch, any_size):
    configs = {"p": FakeConfig(4096, 1000, 999, 2, 1024, 10), "q": FakeConfig(100_000, 50_000, 999, 27, 2048, 20),
               "r": FakeConfig(9e6, 1e7, 999, 8, 0, 1000)}
    steps = {"p": planner.StepTime(0.5, 0.0, 777)}
    calls = stub_plan(monkeypatch, configs, steps, "cuda", torch.bfloat16, n_data=525_000)
    model = LossModel(E=1.0, A=1000.0, alpha=1.0, B=3072.0, beta=1.0)  # 1 + 1000 / N + 3,072 / D
    rows, best, reason, header = planner.plan(90.0, "cuda", ["data.jsonl:0.5", "more.jsonl"], ["q", "r", "p"],
                                              seq_len=32, dtype="float16", loss_model=model, tokenizer_dir="tok")
    # 850 of 1000 bytes; the defaults: 2 s of timed steps, 20 s the longest step to time; 81 s in steps; the two
    # files hold 1,050,000 tokens.
    # p: 16 x 10 = 160 bytes fit. Its step of 16 x 32 tokens: 2 x 512 = 1,024 FLOPs in 0.5 s (2,048 FLOP/s), its
    #    update's 1,024 in no time (counted as 1e-9 s), its peak measured: 777 bytes. 1,024 tokens/s: 82,944
    #    tokens, 0.079 epochs: 1 + 1 + 3,072 / 82,944
    # r: 1 x 1000 do not fit
    # q: 16 x 20 = 320 fit. Predicted 27 x 512 / 2,048 + 2,048 / 1.024e12 = 6.75 s and a little: 512 / 6.75
    #    tokens/s, 6,144 tokens (bar a little, 0.061 a parameter), 1 + 0.02 + 0.5 = 1.52: the pick. Timing it would
    #    take 3 x 6.75 = 20.25 s, just over 20: it stays estimated, its memory too: 320 bytes.
    q_speed = 512 / (6.75 + 2e-9)
    q_tokens = q_speed * 81
    assert_rows(rows, [
        ("p", 4096, 1000, 16, 32, 1024.0, True, 777, True, True, 82_944.0, 82_944.0, 82_944 / 1.05e6,
         2 + 3072 / 82_944),
        ("r", 9e6, 1e7, 1, 32, None, False, 1000, False, False, 0.0, 0.0, None, None),
        ("q", 100_000, 50_000, 16, 32, q_speed, False, 320, False, True, q_tokens, q_tokens, q_tokens / 1.05e6,
         1.02 + 3072 / q_tokens)])
    assert best is rows[2]
    assert calls["timed"] == [("p", torch.device("cuda"), torch.bfloat16, 16, 32, 2.0)]
    assert calls["data"] == [(Path("data.jsonl"), Path("tok")), (Path("more.jsonl"), Path("tok"))]  # no weights
    assert {seq for _, seq in calls["flops"]} == {32} and calls["device"] == ["cuda"] and calls["dtype"] == ["float16"]
    assert header == ("time budget 1m 30s on cuda (bfloat16: the reason); 90% of it in training steps; data.jsonl, "
                      "more.jsonl: about 1.1M tokens (estimated from the first 2 MB of each file)")
    assert reason == ("q: the lowest expected validation loss, 1.52, after 6.1K tokens (0.0614 per parameter); p "
                      "expects 2.04 after 82.9K; larger ones do not fit in memory")


def test_only_the_pick_and_its_neighbours_are_timed(monkeypatch):
    # steps whose seconds are their FLOPs at a's rate, so every estimate is what timing would measure: a's 1 x 16 x
    # 64 FLOPs a token... f's context is 128 (twice the tokens a step, so 64 s)
    configs = {n: FakeConfig(1_000, 2 ** k, 64 * (2 if n == "f" else 1), 2 ** k, 0, 1)
               for k, n in enumerate("abcdef")}
    steps = {n: planner.StepTime(2.0 ** k, 0.0, None) for k, n in enumerate("abcde")}
    calls = stub_plan(monkeypatch, configs, steps, "cpu", torch.float32, n_data=None)
    # 0 + 64 / N + 921,600 / D: at 2^k non-embedding parameters and 921,600 / 2^k tokens (k < 5), 64 / 2^k + 2^k:
    # 65, 34, 20, 16, 20 for a to e; f reads 28,800 tokens (2,048 a step, 32 tokens/s): 2 + 32 = 34
    model = LossModel(E=0.0, A=64.0, alpha=1.0, B=921_600.0, beta=1.0)
    rows, best, _, _ = planner.plan(1000.0, max_step_s=200.0, min_seconds=0.5, loss_model=model)  # f: 3 x 64 s
    assert best.name == "d" and [r.expected_loss for r in rows] == pytest.approx([65.0, 34.0, 20.0, 16.0, 20.0, 34.0])
    # a first, then d's neighbours: never b, two below it, nor f, two above
    assert [name for name, *_ in calls["timed"]] == ["a", "c", "d", "e"]
    assert rows[-1].tokens_per_s == 32.0 and not rows[-1].speed_measured


def test_nothing_fits_nothing_is_timed(monkeypatch):
    configs = {"a": FakeConfig(1_000, 100, 64, 16, 0, 1000)}
    calls = stub_plan(monkeypatch, configs, {}, "cpu", torch.float32, n_data=None)
    rows, best, reason, _ = planner.plan(60.0)
    assert best is None and not rows[0].fits and calls["timed"] == []
    assert reason == "nothing fits in this device's memory even at batch 1"


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


def test_the_step_is_built_on_the_device_asked_for(monkeypatch):
    """Every part of the step is put on the device given (on a CPU, one left out would land there too: spied)."""
    cpu, seen = torch.device("cpu"), []
    real_to, real_backend, real_router = PocketLM.to, planner.TorchBackend, planner.RouterBalance
    real_randint, real_tensor = torch.randint, torch.tensor
    monkeypatch.setattr(PocketLM, "to", lambda self, *a, **k: seen.append(("model", a, k)) or real_to(self, *a, **k))
    monkeypatch.setattr(planner, "TorchBackend", lambda comm, device, *a: seen.append(("backend", device))
                        or real_backend(comm, device, *a))
    monkeypatch.setattr(planner, "RouterBalance", lambda cfg, backend, device: seen.append(("router", cfg, device))
                        or real_router(cfg, backend, device))
    monkeypatch.setattr(torch, "randint", lambda *a, **k: seen.append(("tokens", a, k)) or real_randint(*a, **k))
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: (seen.append(("count", a, k)) if a == (32.0,) else None)
                        or real_tensor(*a, **k))
    moe = get_preset("tiny", vocab_size=64, num_experts=4, num_experts_per_tok=2)
    step = planner.pretraining_step(moe, cpu, Precision(cpu, torch.float32), 4, 8)
    assert seen == [("model", (cpu,), {}), ("backend", cpu), ("router", moe, cpu),
                    ("tokens", (0, 64, (4, 8)), {"device": cpu}), ("count", (32.0,), {"device": cpu})]
    assert step.step.router is not None and step.backend.device == cpu
    step.backward()  # a mixture of experts: the router is told the step's tokens first
    assert step.step.router.n_tokens.item() == 32.0
    dense = planner.pretraining_step(get_preset("tiny", vocab_size=64), cpu, Precision(cpu, torch.float32), 4, 8)
    assert dense.step.router is None


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
    best = fitting("depth-3", 1e6, 16, 256, 1000.0, 3_240_000, 2_000_000, 6.48, 1 << 30, 3.5)
    other = PresetRow("huge", 1e9, 1e9, 1, 256, None, False, 1 << 40, False, False)
    asked = []

    def plan(*args):
        asked.append(args)
        return [best, other], (best if len(asked) == 1 else None), "the reason", "the header"

    monkeypatch.setattr(planner, "plan", plan)
    table = planner.table([best, other], best).splitlines()
    assert planner.main("2h", "cpu", "d.jsonl", ["depth-3", "huge"]) == 0
    assert capsys.readouterr().out.splitlines() == ["the header", *table, "recommended: the reason",
        "  python train_pretrain.py --preset depth-3 --data_path d.jsonl --time_budget 2h --batch_size 16 "
        "--learning_rate 0.008 --muon_lr 0.004 --muon_base_width 256 --warmup_steps 20 --epochs 4",
        "  or: python train_pretrain.py --preset auto --time_budget 2h --data_path d.jsonl (plans again, then trains "
        "the pick)", planner.FOOTER]
    assert planner.main("90s", "cpu", None, None) == 0  # nothing fits: no command line
    table = planner.table([best, other], None).splitlines()
    assert capsys.readouterr().out.splitlines() == ["the header", *table, "recommended: the reason", planner.FOOTER]
    assert asked == [(7200.0, "cpu", "d.jsonl", ["depth-3", "huge"]), (90.0, "cpu", None, None)]
    with pytest.raises(ConfigError) as e:
        planner.main(None, "cpu", None, None)
    assert str(e.value) == "--plan needs --time_budget (90s, 10m, 2h)"


def test_the_footer_names_the_loss_model_s_source():
    assert "bench/results/loss-model-demo.json" in planner.FOOTER
    assert "--learning_rate 0.008 --muon_lr 0.004 --muon_base_width 256 --warmup_steps 20" in planner.FOOTER


def test_a_long_plan_hides_the_rows_far_from_the_pick(monkeypatch, capsys):
    rows = [row(f"depth-{i}", 1e6 * i, 5.0 - (i == 10)) for i in range(1, 21)]
    for r in rows:
        r.speed_measured = False
    monkeypatch.setattr(planner, "plan", lambda *args: (rows, rows[9], "the reason", "the header"))
    assert planner.main("1h", "cpu", None, None) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:8] == planner.table(rows[7:12], rows[9]).splitlines()
    assert out[8] == "(15 more of the depth family, estimated, not shown: --presets NAME ... plans only those)"
    assert out[11] == ("  or: python train_pretrain.py --preset auto --time_budget 1h (plans again, then trains the "
                       "pick)")


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
