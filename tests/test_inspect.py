"""python -m dataset.inspect: batches decoded back to text, loss-carrying tokens marked, the label shift checked."""
from __future__ import annotations

import torch

from common.tokens import IGNORE_INDEX
from dataset import inspect


def sft_sample(tokenizer) -> tuple[list[int], list[int]]:
    ids, labelled, _ = tokenizer.encode_chat([{"role": "user", "content": "Hi there"},
                                              {"role": "assistant", "content": "Hello!"}])
    # the training layout: inputs are ids[:-1], each label is the next token where it is a target
    return ids[:-1], [t if flag else IGNORE_INDEX for t, flag in zip(ids[1:], labelled[1:])]


def test_only_the_assistant_answer_is_marked(tokenizer):
    inputs, labels = sft_sample(tokenizer)
    text = inspect.marked_text(tokenizer, inputs, labels)
    assert text.count(inspect.OPEN) == 1 and "⟦Hello!<|im_end|>⟧" in text
    assert text.startswith("<|im_start|>user\nHi there<|im_end|>")  # the prompt is context only


def test_every_pretraining_token_but_the_first_is_marked(tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    text = inspect.marked_text(tokenizer, ids[:-1], ids[1:])
    assert text == tokenizer.decode(ids[:1]) + "⟦" + tokenizer.decode(ids[1:]) + "⟧"


def test_an_unshifted_label_is_reported(tokenizer):
    inputs, labels = sft_sample(tokenizer)
    assert inspect.shift_problems(inputs, labels) == []
    unshifted = [t if label != IGNORE_INDEX else IGNORE_INDEX for t, label in zip(inputs, labels)]
    assert inspect.shift_problems(inputs, unshifted)  # labels equal to the inputs: the classic bug
    report = inspect.show(tokenizer, torch.tensor([inputs]), torch.tensor([unshifted]), 4, None)
    assert "BUG: at positions" in report


def test_cli_shows_the_first_training_batch(corpus, tmp_path, capsys):
    common = ["--cache_dir", str(corpus["cache"]), "--num_workers", "0", "--batch_size", "2"]
    assert inspect.main(["--data_path", str(corpus["sft"]), "--kind", "sft", "--max_seq_len", "64", *common]) == 0
    out = capsys.readouterr().out
    assert out.count("== sample") == 2 and out.count("labels are the inputs shifted by one: ok") == 2
    assert "<|im_start|>assistant\n⟦" in out
    assert inspect.main(["--data_path", str(corpus["pretrain"]), "--max_seq_len", "32", *common]) == 0
    assert "32 input tokens, 32 carry loss" in capsys.readouterr().out
    assert inspect.main(["--data_path", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl: no such file" in capsys.readouterr().err
