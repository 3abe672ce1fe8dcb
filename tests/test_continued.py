"""Continued pretraining (train_pretrain.py --init_from): its own defaults, the start model evaluated before the
first step, each file's perplexity when new text is mixed with general text, resume, two DDP ranks, and the
warning for text the tokenizer compresses badly (dataset/config.py compression_note)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from test_train import flags, straight_and_resumed, weights

import train_pretrain
from common.errors import ConfigError
from dataset.config import compression_note
from dataset.token_cache import prepare
from dataset.tokenizer import DEFAULT_TOKENIZER_DIR, Tokenizer
from trainer_utils.stages import STAGES, parse_train_config

from conftest import strict_records, write_jsonl


@pytest.fixture(scope="module")
def start_run(two_sources, tmp_path_factory):
    """A tiny pretrained model (40 steps on the first file) to continue from."""
    out = tmp_path_factory.mktemp("start")
    assert train_pretrain.main(flags({"pretrain": two_sources["pretrain_a"], "cache": two_sources["cache"]}, out,
                                     "start", max_steps=40, learning_rate=1e-2, val_fraction=0.1,
                                     eval_interval=20, save_interval=40)) == 0
    return out / "start"


def continued(two_sources, start_run, tmp_path, run: str, **over) -> list[str]:
    """Continue the start model on the second file ("new text") with the first replayed at 30%."""
    settings = dict(data_path=None, val_fraction=0.1, preset=None, init_from=start_run, learning_rate=None,
                    warmup_steps=None)
    argv = flags({"pretrain": None, "cache": two_sources["cache"]}, tmp_path, run, **{**settings, **over})
    return argv + ["--data_path", f"{two_sources['pretrain_b']}:0.7", f"{two_sources['pretrain_a']}:0.3"]


def test_continued_pretraining_defaults_peak_lower_and_give_way_to_what_is_set(tmp_path):
    fresh = parse_train_config("pretrain", [], None)
    from_trained = parse_train_config("pretrain", ["--init_from", "out/demo-pretrain"], None)
    assert (fresh.optim.learning_rate, fresh.optim.warmup_ratio) == (5e-4, 0.01)
    assert (from_trained.optim.learning_rate, from_trained.optim.warmup_ratio) == (1e-4, 0.02)
    given = parse_train_config("pretrain", ["--init_from", "x", "--learning_rate", "3e-4"], None)
    assert given.optim.learning_rate == 3e-4 and given.optim.warmup_ratio == 0.02
    (tmp_path / "c.yaml").write_text("model:\n  init_from: x\noptim:\n  learning_rate: 2.0e-4\n")
    from_file = parse_train_config("pretrain", ["--config", str(tmp_path / "c.yaml")], None)
    assert from_file.optim.learning_rate == 2e-4 and from_file.optim.warmup_ratio == 0.02
    # SFT, always from a trained model, keeps its own defaults
    assert parse_train_config("sft", ["--init_from", "x"], None).optim.learning_rate == \
        STAGES["sft"].defaults["learning_rate"]
    with pytest.raises(ConfigError, match="cannot take effect with --init_from"):
        parse_train_config("pretrain", ["--init_from", "x", "--preset", "tiny"], None)


def test_the_start_model_is_evaluated_first_and_each_file_reports_its_perplexity(two_sources, start_run, tmp_path):
    evals = {}
    for run, lr in (("slow", 1e-4), ("fast", 3e-3)):
        argv = continued(two_sources, start_run, tmp_path, run, eval_interval=8, learning_rate=lr)
        assert train_pretrain.main(argv) == 0
        evals[run] = [r for r in strict_records(tmp_path / run) if "val_loss" in r]
        assert [r["step"] for r in evals[run]] == [0, 8]
        for r in evals[run]:
            for name in ("first", "second"):
                assert r[f"val_ppl/{name}"] == pytest.approx(math.exp(r[f"val_loss/{name}"]), rel=1e-4)
    first_eval = {run: {k: v for k, v in records[0].items() if k.startswith("val_")} for run, records in evals.items()}
    # step 0 is the start model, before any step: the same whatever the learning rate; step 8 is not
    assert first_eval["slow"] == first_eval["fast"]
    assert evals["slow"][1]["val_loss/second"] != evals["fast"][1]["val_loss/second"]
    assert evals["slow"][0]["val_loss/first"] != evals["slow"][0]["val_loss/second"]  # each file's own text
    assert json.loads((tmp_path / "slow/train_config.json").read_text())["optim"]["warmup_ratio"] == 0.02
    # a run from scratch has no step-0 evaluation
    assert [r["step"] for r in strict_records(start_run) if "val_loss" in r] == [20, 40]


def test_continued_pretraining_resumes_bit_exactly(two_sources, start_run, tmp_path, monkeypatch):
    straight_and_resumed(monkeypatch, train_pretrain.main,
                         lambda run, **kw: continued(two_sources, start_run, tmp_path, run, **kw), stop=4)
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = [r["step"] for r in strict_records(tmp_path / "resumed") if "val_loss" in r]
    assert steps == [0, 4, 8]  # the start model once, not again on resume


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(DEFAULT_TOKENIZER_DIR)


def test_text_the_tokenizer_compresses_badly_is_warned_about(tmp_path, tokenizer):
    english = write_jsonl(tmp_path / "en.jsonl", [{"text": "The keeper trimmed the lamp twice each night. " * 20}])
    russian = write_jsonl(tmp_path / "ru.jsonl", [{"text": "Смотритель маяка дважды за ночь подрезал фитиль. " * 20}])
    for path in (english, russian):
        prepare(path, tokenizer, "pretrain", cache_dir=tmp_path / "cache", num_workers=0, log=lambda _: None)
    note = lambda p: compression_note(str(p), prepare(p, tokenizer, "pretrain", cache_dir=tmp_path / "cache",  # noqa: E731
                                                      num_workers=0, log=lambda _: None), tokenizer)
    assert note(english) is None
    warning = note(russian)
    assert warning.startswith(f"warning: {russian}: 1.00 bytes per token, 2.9 times the tokens per byte")
    assert "train_tokenizer.py" in warning


def test_without_the_tokenizers_own_figure_the_byte_fallback_is_warned_about(tmp_path, tokenizer, monkeypatch):
    russian = write_jsonl(tmp_path / "ru.jsonl", [{"text": "Смотритель маяка дважды за ночь подрезал фитиль. " * 20}])
    english = write_jsonl(tmp_path / "en.jsonl", [{"text": "The keeper trimmed the lamp twice each night. " * 20}])
    monkeypatch.setattr(Tokenizer, "own_bytes_per_token", property(lambda self: None))
    caches = {p: prepare(p, tokenizer, "pretrain", cache_dir=tmp_path / "c", num_workers=0, log=lambda _: None)
              for p in (russian, english)}
    assert "falls back to single bytes" in compression_note(str(russian), caches[russian], tokenizer)
    assert compression_note(str(english), caches[english], tokenizer) is None


def test_an_eval_only_file_is_scored_whole_and_weighs_nothing_in_val_loss(two_sources, start_run, tmp_path):
    heldout = write_jsonl(tmp_path / "domain.heldout.jsonl",
                          [json.loads(x) for x in two_sources["pretrain_b"].read_text().splitlines()[:6]])
    argv = continued(two_sources, start_run, tmp_path, "scored", max_steps=4, eval_interval=4,
                     eval_data_path=heldout)
    assert train_pretrain.main(argv) == 0
    for r in [r for r in strict_records(tmp_path / "scored") if "val_loss" in r]:
        assert r["val_ppl/domain.heldout"] == pytest.approx(math.exp(r["val_loss/domain.heldout"]), rel=1e-4)
        assert r["val_loss"] == pytest.approx(0.7 * r["val_loss/second"] + 0.3 * r["val_loss/first"], abs=2e-5)


@pytest.mark.slow  # two ranks in real processes
def test_two_ranks_continue_like_one_process_and_evaluate_the_start_alike(two_sources, start_run, tmp_path):
    from test_distributed import losses, single, torchrun

    heldout = write_jsonl(tmp_path / "domain.heldout.jsonl",
                          [json.loads(x) for x in two_sources["pretrain_b"].read_text().splitlines()[:6]])
    argv = lambda run, batch: continued(two_sources, start_run, tmp_path, run, batch_size=batch,  # noqa: E731
                                        max_steps=4, eval_interval=4, eval_data_path=heldout, learning_rate=3e-3,
                                        sample_prompts="none")
    single(argv("single", 8))
    torchrun(2, argv("ddp", 4))
    assert losses(tmp_path / "single") == pytest.approx(losses(tmp_path / "ddp"), abs=1e-5)
    evals = [[r for r in strict_records(tmp_path / run) if "val_loss" in r] for run in ("single", "ddp")]
    assert [r["step"] for r in evals[0]] == [r["step"] for r in evals[1]] == [0, 4]
    for a, b in zip(*evals):
        for key in ("val_loss/first", "val_loss/second", "val_loss/domain.heldout"):
            assert a[key] == pytest.approx(b[key], abs=2e-5)
