"""The decoding sweep (evaluation/sweep.py, eval_model.py --sweep): metrics on hand-made ids, spec parsing, the
best-setting rule, and whole sweeps of a tiny checkpoint (JSON, table, plot, determinism, errors)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from test_eval import make_run

import eval_model
from common.errors import ConfigError
from evaluation.probes import read_prompt_file
from evaluation.sweep import (
    SettingResult,
    SweepReport,
    best_setting,
    continuation_nll,
    distinct_n,
    mean_repeated_ngram_rate,
    parse_sweep,
    repeated_ngram_rate,
)
from model import PocketLM
from model.generate import SamplingConfig

from conftest import ROOT, tiny_config

CPU = ["--device", "cpu", "--dtype", "float32"]


# ---------------------------------------------------------------------------- metrics
def test_distinct_2_pools_bigrams_over_samples_without_crossing_them():
    assert distinct_n([[1, 2, 1, 2]]) == pytest.approx(2 / 3)  # (1,2) (2,1) (1,2)
    # pooled: the second sample's (1,2) is no longer new (per-sample would say 1.0); the (2,1) across the
    # boundary is not a bigram (with it, 2/3)
    assert distinct_n([[1, 2], [1, 2]]) == 0.5
    assert distinct_n([[1, 2, 3], [4, 5]]) == 1.0
    assert distinct_n([[9, 9, 9, 9]]) == pytest.approx(1 / 3)
    assert math.isnan(distinct_n([[5], []]))  # no bigram anywhere: nothing to measure


def test_repeated_trigram_rate_counts_trigrams_seen_earlier_in_the_same_sample():
    assert repeated_ngram_rate([1, 2, 3, 1, 2, 3]) == 0.25  # (1,2,3) (2,3,1) (3,1,2) (1,2,3): the last repeats
    assert repeated_ngram_rate([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(2 / 6)
    assert repeated_ngram_rate([7, 7, 7, 7, 7]) == pytest.approx(2 / 3)
    assert repeated_ngram_rate([1, 2, 3, 4, 5]) == 0.0
    assert math.isnan(repeated_ngram_rate([1, 2]))
    # averaged per sample (each counts once, however long); a sample without a trigram is left out
    samples = [[1, 2, 3, 1, 2, 3], [7, 7, 7, 7, 7], [1, 2]]
    assert mean_repeated_ngram_rate(samples) == pytest.approx((0.25 + 2 / 3) / 2)
    # another sample's trigrams do not count: each is new within its own sample
    assert mean_repeated_ngram_rate([[1, 2, 3], [1, 2, 3]]) == 0.0
    assert math.isnan(mean_repeated_ngram_rate([[1], []]))


def test_self_nll_scores_only_the_generated_tokens_under_the_raw_distribution():
    model = PocketLM(tiny_config(initializer_range=0.3)).eval()
    prompts = [[5, 6, 7], [9], [3, 4], [8, 8, 8, 8]]
    continuations = [[10, 11], [12, 13, 14, 15], [], [16]]  # an empty sample adds nothing
    nats, tokens = continuation_nll(model, prompts, continuations, batch_size=2)  # padded batches, several

    expected = 0.0
    with torch.no_grad():
        for p, c in zip(prompts, continuations):
            if not c:
                continue
            ids = torch.tensor(p + c)
            logp = torch.log_softmax(model(ids[None, :-1])[0].float(), dim=-1)
            expected -= sum(float(logp[len(p) - 1 + i, t]) for i, t in enumerate(c))
    assert tokens == 7
    assert nats == pytest.approx(expected, rel=1e-5)


# ------------------------------------------------------------------------------ specs
def test_sweep_specs_give_exact_inclusive_ranges_and_sorted_lists():
    spec = parse_sweep("temperature=0.6:1.2:0.1")
    assert spec.parameter == "temperature"
    assert spec.values == (0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2)  # exact: no 0.7000000000000001, 1.2 included
    assert [spec.label(v) for v in spec.values[3:5]] == ["0.9", "1.0"]
    assert parse_sweep("temperature=0.6:1.25:0.1").values[-1] == 1.2  # STOP is a bound, reached or not
    assert parse_sweep("top_p=0.9:0.9:0.05").values == (0.9,)
    top_k = parse_sweep("top_k=0:40:10")
    assert top_k.values == (0, 10, 20, 30, 40) and all(type(v) is int for v in top_k.values)
    assert parse_sweep("top_p=0.95, 0.8,1").values == (0.8, 0.95, 1.0)  # ascending, for the table and plot
    assert parse_sweep("repetition_penalty=1.3").values == (1.3,)


@pytest.mark.parametrize("spec,message", [
    ("temp=1", "cannot sweep 'temp' (did you mean temperature?)"),
    ("seed=1:3:1", "cannot sweep 'seed'"),
    ("temperature", "expected NAME=START:STOP:STEP or NAME=V1,V2,..."),
    ("temperature=", "expected NAME="),
    ("temperature=1.2:0.6:0.1", "STOP 0.6 is below START 1.2"),
    ("temperature=0.6:1.2:0", "the step must be > 0"),
    ("temperature=0.6:1.2:-0.1", "the step must be > 0"),
    ("temperature=0.6:1.2", "a range is START:STOP:STEP"),
    ("temperature=a,b", "'a' is not a number"),
    ("temperature=nan", "not a finite number"),
    ("temperature=0.7,0.70", "given more than once"),
    ("temperature=0:10:0.001", "10001 values; at most 100"),
    ("temperature=-0.5,1", "temperature must be >= 0, got -0.5"),
    ("top_p=0.5,1.1", "top_p must be <= 1, got 1.1"),
    ("top_p=0:1:0.5", "top_p must be > 0, got 0"),
    ("top_k=1.5", "top_k takes whole numbers, got 1.5"),
    ("top_k=-10:10:10", "top_k must be >= 0, got -10"),
    ("repetition_penalty=0,1", "repetition_penalty must be > 0"),
])
def test_bad_sweep_specs_are_one_line_config_errors(spec, message):
    with pytest.raises(ConfigError) as e:
        parse_sweep(spec)
    assert str(e.value).startswith(f"--sweep {spec}: ") and message in str(e.value)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------- best setting
def _result(value: float, ppl: float, rep: float) -> SettingResult:
    return SettingResult(value, [[1, 2, 3]], ppl, 0.5, rep, 3.0, 0.0)


def test_best_is_the_lowest_self_ppl_whose_repetition_stays_under_the_threshold():
    results = [_result(0.2, 5.0, 0.3), _result(0.4, 8.0, 0.05), _result(0.6, 7.0, 0.1), _result(0.8, 7.0, 0.02),
               _result(1.0, math.nan, math.nan)]
    assert best_setting(results, 1.0).value == 0.2  # no threshold in the way: the lowest self-ppl
    assert best_setting(results, 0.1).value == 0.6  # at the threshold counts; 0.6 and 0.8 tie: the first wins
    assert best_setting(results, 0.05).value == 0.8
    assert best_setting(results, 0.01) is None

    report = SweepReport(parse_sweep("temperature=0.2:1.0:0.2"), SamplingConfig(), 0, 1, ["p"], 0.05, results)
    rows = report.table().splitlines()
    assert [r.split()[0] for r in rows[2:7]] == ["0.2", "0.4", "0.6", "0.8", "1.0"]
    assert [r.endswith("<- best") for r in rows[2:7]] == [False, False, False, True, False]
    assert rows[-1].startswith("best: temperature=0.8 (lowest self-ppl 7.000")
    none = SweepReport(report.spec, SamplingConfig(), 0, 1, ["p"], 0.01, results)
    assert "<- best" not in none.table()
    assert none.verdict() == ("best: none (every setting repeats more than 0.01 of its trigrams; the least, 0.020 "
                              "at temperature=0.8; raise the threshold or sweep a wider range)")
    doc = none.to_dict(lambda ids: " ".join(map(str, ids)))
    assert doc["best"] is None and doc["results"][-1]["self_ppl"] is None  # NaN is written as null
    json.dumps(doc, allow_nan=False)


# ---------------------------------------------------------------------- whole sweeps
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("sweep") / "pt", "pretrain", 1)


def _sweep(run, tmp_path, name: str, spec: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    argv = ["--checkpoint", str(run), "--sweep", spec, "--prompt", "Once upon a time", "--prompt", "床前明月光，",
            "--sweep_samples", "3", "--max_new_tokens", "12", "--out", str(out), *CPU, *extra]
    assert eval_model.main(argv) == 0
    return json.loads(out.read_text(encoding="utf-8"))


def test_a_sweep_writes_table_json_and_plot_and_repeats_exactly(run, tmp_path, capsys):
    png = tmp_path / "plots" / "sweep.png"
    doc = _sweep(run, tmp_path, "a", "temperature=0.5:1.5:0.5", "--plot", str(png), "--max_repeat", "0.2")
    table = capsys.readouterr().out

    assert doc["checkpoint"] == str(run) and doc["prompt_format"] == "text"
    assert doc["parameter"] == "temperature" and doc["values"] == [0.5, 1.0, 1.5]
    assert doc["fixed"] == {"top_k": 0, "top_p": 0.9, "repetition_penalty": 1.1, "max_new_tokens": 12}
    assert doc["seed"] == 0 and doc["samples_per_prompt"] == 3 and doc["max_repeat"] == 0.2
    assert doc["prompts"] == ["Once upon a time", "床前明月光，"]
    for r in doc["results"]:
        assert [s["prompt"] for s in r["samples"]] == [0, 0, 0, 1, 1, 1]
        assert r["self_ppl"] > 1 and 0 < r["distinct_2"] <= 1 and 0 <= r["repeated_trigram_rate"] <= 1
        assert 0 < r["mean_tokens"] <= 12 and 0 <= r["ended"] <= 1
    # a random model's text gets less likely to the model itself as the temperature rises
    assert doc["results"][0]["self_ppl"] < doc["results"][-1]["self_ppl"]
    ok = [r for r in doc["results"] if r["repeated_trigram_rate"] <= 0.2]
    assert doc["best"] == (min(ok, key=lambda r: r["self_ppl"])["value"] if ok else None)

    lines = table.splitlines()
    assert lines[0].startswith("sweep of temperature over 3 values: 2 prompts x 3 samples, seed 0; fixed: top_k 0")
    assert lines[1].split() == ["temperature", "self-ppl", "distinct-2", "rep-3gram", "tokens", "ended"]
    assert [line.split()[0] for line in lines[2:5]] == ["0.5", "1.0", "1.5"]
    assert lines[5] == doc["verdict"] and len(lines) == 6
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000

    again = _sweep(run, tmp_path, "b", "temperature=0.5:1.5:0.5", "--max_repeat", "0.2")
    assert again == doc and capsys.readouterr().out == table  # the same command, the same table
    # each value starts from the seed: 1.0 sampled alone gives the samples it had in the sweep
    alone = _sweep(run, tmp_path, "c", "temperature=1.0", "--max_repeat", "0.2")
    assert alone["results"] == doc["results"][1:2]
    reseeded = _sweep(run, tmp_path, "d", "temperature=1.0", "--max_repeat", "0.2", "--seed", "1")
    assert reseeded["seed"] == 1 and reseeded["results"][0]["samples"] != alone["results"][0]["samples"]


def test_a_sweep_reads_its_prompts_from_a_file_or_the_shipped_one(run, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# comment\nThe capital of France is\tParis\n\nHello\n", encoding="utf-8")
    base = ["--checkpoint", str(run), "--sweep", "top_k=1,50", "--sweep_samples", "1", "--max_new_tokens", "4", *CPU]
    out = tmp_path / "file.json"
    assert eval_model.main(base + ["--sweep_prompts", str(prompts), "--out", str(out)]) == 0
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert doc["prompts"] == ["The capital of France is", "Hello"]  # a probe's answer is not part of the prompt
    assert doc["values"] == [1, 50] and all(len(r["samples"]) == 2 for r in doc["results"])
    assert "sweep of top_k over 2 values: 2 prompts x 1 samples" in capsys.readouterr().out
    shipped = read_prompt_file(ROOT / "dataset" / "prompts" / "samples.txt")
    out = tmp_path / "default.json"
    assert eval_model.main(base + ["--out", str(out)]) == 0
    assert json.loads(out.read_text(encoding="utf-8"))["prompts"] == [p.prompt for p in shipped]


@pytest.mark.parametrize("args,message", [
    (["--sweep", "temp=1"], "--sweep temp=1: cannot sweep 'temp' (did you mean temperature?)"),
    (["--sweep", "temperature=1.2:0.6:0.1"], "STOP 0.6 is below START 1.2"),
    (["--sweep", "top_p=1.5"], "top_p must be <= 1, got 1.5"),
    (["--sweep", "temperature=1", "--sweep", "top_p=0.9"], "--sweep varies one setting per run; got 2"),
    (["--sweep", "temperature=1", "--ppl", "x.jsonl"], "--ppl and --sweep are alternatives"),
    (["--sweep", "temperature=1", "--prompt", "a", "--sweep_prompts", "p.txt"], "--prompt and --sweep_prompts"),
    (["--prompt", "a", "--out", "x.json"], "--out: only with --sweep"),
    (["--sweep", "temperature=1", "--max_repeat", "2"], "--max_repeat must be <= 1, got 2.0"),
    (["--sweep", "temperature=1", "--sweep_samples", "0"], "--sweep_samples must be >= 1"),
    (["--sweep", "temperature=1", "--sweep_prompts", "missing.txt"], "missing.txt: cannot read prompt file"),
    (["--sweep", "temperature=1", "--out", "."], "--out . is a directory"),
])
def test_bad_sweep_flags_fail_before_the_model_loads(tmp_path, capsys, args, message):
    # the checkpoint does not exist: the sweep's own mistake must be the one reported
    assert eval_model.main(["--checkpoint", str(tmp_path / "missing"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and message in err, err
