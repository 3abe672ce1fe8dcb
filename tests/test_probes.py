"""Watching training: prompt and probe files, probe scoring, samples.jsonl / probes.jsonl during training."""
from __future__ import annotations

import json

import pytest
import torch

import train_full_sft
import train_pretrain
from common.errors import DataError
from evaluation.probes import Probe, continuation_ids, read_probe_file, read_prompt_file, run_probes, score_continuation
from model import PocketLM

from conftest import ROOT, cli_flags, tiny_config


def flags(corpus, tmp_path, run="run", **over) -> list[str]:
    base = {"data_path": corpus["pretrain"], "cache_dir": corpus["cache"], "out_dir": tmp_path, "run_name": run,
            "preset": "tiny", "batch_size": 4, "max_steps": 4, "dtype": "float32", "log_interval": 2,
            "eval_interval": 2, "save_interval": 100, "num_workers": 0, "learning_rate": 1e-3, "warmup_steps": 1,
            "sample_tokens": 8, "probes": ROOT / "dataset/prompts/probes.tsv"}
    return cli_flags(base, **over)


def rows(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------------- files
def test_prompt_files_parse_prompts_probes_and_comments(tmp_path):
    path = tmp_path / "p.tsv"
    path.write_text("# a comment\nOnce upon a time\n\nThe capital of France is\tParis \n中国的首都是\t北京\n",
                    encoding="utf-8")
    assert [(p.prompt, p.expected) for p in read_prompt_file(path)] == [
        ("Once upon a time", None), ("The capital of France is", "Paris"), ("中国的首都是", "北京")]
    with pytest.raises(DataError, match=r"p.tsv:2: a probe is `prompt<TAB>expected`"):
        read_probe_file(path)
    shipped = read_probe_file(ROOT / "dataset/prompts/probes.tsv")
    assert len(shipped) >= 4 and any(p.expected == "北京" for p in shipped)
    assert len(read_prompt_file(ROOT / "dataset/prompts/samples.txt")) >= 4


@pytest.mark.parametrize("text,message", [("# only comments\n", "no prompts"), ("\tParis\n", ":1: empty prompt")])
def test_bad_prompt_files_name_the_file(tmp_path, text, message):
    path = tmp_path / "bad.tsv"
    path.write_text(text)
    with pytest.raises(DataError, match=message):
        read_prompt_file(path)
    with pytest.raises(DataError, match="cannot read prompt file"):
        read_prompt_file(tmp_path / "missing.tsv")


def test_an_answer_continues_the_prompt_as_the_text_would(tokenizer):
    prompt = "The capital of France is"
    ids = tokenizer.encode(prompt)
    answer = continuation_ids(prompt, "Paris", tokenizer.encode, ids)
    assert ids + answer == tokenizer.encode(prompt + " Paris")  # the space belongs to the answer
    zh = tokenizer.encode("中国的首都是")
    assert continuation_ids("中国的首都是", "北京", tokenizer.encode, zh) == tokenizer.encode("北京")


# ---------------------------------------------------------------------------------- scoring
def test_probe_scores_match_an_independent_computation():
    model = PocketLM(tiny_config()).eval()
    prompt, answer = [5, 17, 42], [7, 99]
    logprob, rank = score_continuation(model, prompt, answer)
    with torch.no_grad():
        a = torch.log_softmax(model(torch.tensor([prompt]))[0, -1], -1)
        b = torch.log_softmax(model(torch.tensor([prompt + answer[:1]]))[0, -1], -1)
    assert logprob == pytest.approx(float(a[7] + b[99]), abs=1e-5)
    assert rank == 1 + int((a > a[7]).sum())
    top = int(a.argmax())
    assert score_continuation(model, prompt, [top])[1] == 1  # the model's favourite has rank 1


def test_a_probe_is_correct_when_greedy_decoding_contains_the_answer():
    model = PocketLM(tiny_config()).eval()
    decode = lambda ids: " ".join(map(str, ids))  # noqa: E731
    encode = lambda text: [int(t) for t in text.split()]  # noqa: E731
    prompt = [5, 17, 42]
    with torch.no_grad():
        first = int(model(torch.tensor([prompt]))[0, -1].argmax())
    probes = [Probe("5 17 42", str(first)), Probe("5 17 42", str((first + 1) % 256))]
    right, wrong = run_probes(model, probes, encode, encode, decode, chat=True, eos_token_ids=[],
                              pad_token_id=0, max_new_tokens=1)
    assert right.correct and right.greedy == str(first) and right.rank == 1
    assert not wrong.correct and wrong.rank > 1 and wrong.logprob < right.logprob


# ---------------------------------------------------------------------------------- training
def test_training_records_samples_and_probes_at_each_evaluation(corpus, tmp_path):
    assert train_pretrain.main(flags(corpus, tmp_path)) == 0
    run = tmp_path / "run"
    samples, probes = rows(run / "samples.jsonl"), rows(run / "probes.jsonl")
    n_samples = len(read_prompt_file(ROOT / "dataset/prompts/samples.txt"))
    n_probes = len(read_probe_file(ROOT / "dataset/prompts/probes.tsv"))
    assert [r["step"] for r in samples] == [2] * n_samples + [4] * n_samples
    assert [r["step"] for r in probes] == [2] * n_probes + [4] * n_probes
    assert {"prompt", "expected", "greedy", "correct", "logprob", "rank"} <= set(probes[0])
    assert all(r["logprob"] < 0 and 1 <= r["rank"] <= 6400 for r in probes)
    metrics = [r for r in rows(run / "metrics.jsonl") if "probes_correct" in r]
    assert [r["step"] for r in metrics] == [2, 4]
    # fixed sampling settings and seed: the same model gives the same samples, run after run
    assert train_pretrain.main(flags(corpus, tmp_path, "again")) == 0
    assert rows(tmp_path / "again/samples.jsonl") == samples


def test_sft_samples_are_prompted_as_chat(corpus, tmp_path):
    assert train_pretrain.main(flags(corpus, tmp_path, "base", probes=None, sample_prompts="none")) == 0
    assert not (tmp_path / "base/samples.jsonl").exists()
    sft = flags(corpus, tmp_path, "sft", preset=None, data_path=corpus["sft"], init_from=tmp_path / "base")
    assert train_full_sft.main(sft) == 0
    assert len(rows(tmp_path / "sft/probes.jsonl")) == 2 * len(read_probe_file(ROOT / "dataset/prompts/probes.tsv"))


def test_a_bad_probe_file_stops_before_data_preparation(corpus, tmp_path, capsys):
    bad = tmp_path / "bad.tsv"
    bad.write_text("no tab here\n")
    cache = tmp_path / "cache"
    assert train_pretrain.main(flags(corpus, tmp_path, cache_dir=cache, probes=bad)) == 2
    assert "bad.tsv:1: a probe is `prompt<TAB>expected`" in capsys.readouterr().err
    assert not cache.exists()
