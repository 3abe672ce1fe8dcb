"""bench/bench_vs_minimind.py's parts that decide its numbers: the held-out split, bits per byte, the steady step
time and the table (the two trainers themselves run only where a MiniMind checkout is given)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from bench import bench_vs_minimind as vs  # a module, not loaded from its path: its dataclasses need sys.modules
from common.errors import DataError
from dataset.tokenizer import Tokenizer
from model import PocketLM

from conftest import tiny_config, write_jsonl


def test_the_split_holds_out_every_nth_document_by_language(tmp_path):
    texts = [f"english document {i}" if i % 3 else f"中文文档第{i}号，内容" for i in range(40)]
    data = write_jsonl(tmp_path / "data.jsonl", [{"text": t} for t in texts])
    train, held = vs.split(data, tmp_path / "out", train_docs=10, every=4)
    held_texts = {k: vs.read_texts(v) for k, v in held.items()}
    assert held_texts["en"] + held_texts["zh"] and not set(held_texts["en"]) & set(held_texts["zh"])
    assert sorted(held_texts["en"] + held_texts["zh"]) == sorted(texts[3::4])
    assert all("中文" in t for t in held_texts["zh"]) and all("english" in t for t in held_texts["en"])
    trained = vs.read_texts(train)
    assert len(trained) == 10 and not set(trained) & set(texts[3::4])  # nothing held out is trained on


def test_a_bad_line_is_named(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a"}\n{"conversations": []}\n')
    with pytest.raises(DataError, match=r"data.jsonl:2: missing \"text\""):
        vs.split(data, tmp_path / "out", 10, 2)


def test_a_model_that_knows_nothing_scores_log2_vocab_bits_a_token():
    vocab, texts = 50, ["abcdef" * 150, "xyz"]  # 900 bytes: two windows of 512 predictions

    def encode(text: str) -> list[int]:
        return [ord(c) % vocab for c in text]  # one token a byte

    uniform = lambda x: torch.zeros(*x.shape, vocab)  # noqa: E731
    assert vs.bits_per_byte(uniform, encode, 0, texts) == pytest.approx(math.log2(vocab))


def test_bits_per_byte_of_a_real_model_agrees_with_its_mean_loss(tokenizer: Tokenizer):
    torch.manual_seed(0)
    model = PocketLM(tiny_config(vocab_size=tokenizer.vocab_size, max_seq_len=512,
                                 max_position_embeddings=512)).eval()
    text = "The quick brown fox jumps over the lazy dog. 床前明月光，疑是地上霜。" * 3
    ids = [tokenizer.eot_id] + tokenizer.encode(text)
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]))[0]
    nats = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").item()
    expected = nats / math.log(2) / len(text.encode("utf-8"))
    assert vs.bits_per_byte(model, tokenizer.encode, tokenizer.eot_id, [text]) == pytest.approx(expected, rel=1e-5)


def test_the_steady_step_leaves_the_first_steps_out():
    times = [(1, 10.0), (2, 12.0), (3, 13.0), (4, 14.0), (5, 15.0), (6, 16.0)]  # a slow first step
    assert vs.steady(times) == 1.0
    assert vs.steady([(1, 5.0), (3, 9.0)]) == 2.0  # a short run keeps what it has
    with pytest.raises(SystemExit, match="too few logged steps"):
        vs.steady([(1, 5.0)])


def test_the_rate_counts_the_tokens_a_step_the_run_trained():
    # 16 rows of 512 a step (a config's --batch_size 16, or 8 with --accumulation_steps 2), 2 s a step
    steps = [{"step": k, "elapsed_s": 3.0 + 2.0 * k, "tokens_seen": 16 * 512 * k} for k in range(1, 8)]
    assert vs.training_rate(steps) == (2.0, 16 * 512 / 2.0)


def test_the_table_compares_with_the_first_leg(tmp_path):
    base = vs.Leg("MiniMind", "mm", 600, 97, 6.0, 400, 1000, {"en": 2.0, "zh": 3.0})
    ours = vs.Leg("default", "pl", 590, 90, 6.5, 630, 2000, {"en": 1.6, "zh": 2.4})
    text = vs.table([base, ours])
    assert "| default | 590 | 90 | 6.50 | 630 | 2,000 | 2.00x | 1.6000 (-20.0%) | 2.4000 (-20.0%) |" in text
    json.dumps([vars(base), vars(ours)])  # the legs are what results.json holds
