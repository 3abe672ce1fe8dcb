"""Data pipeline: bad input, tokenize-once cache (reuse, rebuild, atomicity), windows, SFT batches."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from common.tokens import IGNORE_INDEX
from dataset import token_cache
from dataset.datasets import PretrainDataset, SFTDataset
from dataset.jsonl import DataError, SkipReport, read_records
from dataset.token_cache import DEFAULT_SPLIT_SEED, in_validation, prepare, token_dtype

from conftest import ROOT, write_jsonl

DOCS = [f"Document number {i}. " + "Some words about topic %d. " % (i % 7) * (1 + i % 5) + "中文句子。" * (i % 3)
        for i in range(120)]
CONV = {"conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}


@pytest.fixture
def pretrain_file(tmp_path):
    return write_jsonl(tmp_path / "pretrain.jsonl", [{"text": d, "source": "test"} for d in DOCS])


# ----------------------------------------------------------------------------------- bad input
BAD_LINES = [
    ("text", '{"text": "ok"}\n{"text": broken}\n', "bad.jsonl:2: invalid JSON"),
    ("text", '{"text": "ok"}\n{"title": "x"}\n', 'bad.jsonl:2: missing "text" field'),
    ("text", '{"text": 42}\n', 'bad.jsonl:1: "text" must be a string, got int'),
    ("text", '{"text": "   "}\n', 'bad.jsonl:1: empty "text"'),
    ("text", '["a", "b"]\n', "bad.jsonl:1: expected a JSON object, got list"),
    ("conversations", '{"conversations": []}\n', 'bad.jsonl:1: empty "conversations"'),
    ("conversations", '{"conversations": "hi"}\n', 'bad.jsonl:1: "conversations" must be a list'),
    ("conversations", '{"conversations": [{"role": "bot", "content": "x"}]}\n', "unknown role 'bot'"),
    ("conversations", '{"conversations": [{"role": "user", "content": "x"}]}\n', "no assistant turn"),
    ("conversations", '{"conversations": [{"role": "user", "content": null}, {"role": "assistant", "content": "y"}]}\n',
     'turn 0 "content" must be a string'),
]


@pytest.mark.parametrize("kind, content, message", BAD_LINES)
def test_bad_lines_name_file_and_line(tmp_path, kind, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=message.replace("[", r"\[").replace("(", r"\(")):
        list(read_records(path, kind))


def test_invalid_utf8_and_bom(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match="bad.jsonl:2: invalid UTF-8 at byte"):
        list(read_records(path, "text"))
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes('\ufeff{"text": "first"}\r\n{"text": "second"}\r\n'.encode())
    assert [r["text"] for _, r in read_records(bom, "text")] == ["first", "second"]


def test_empty_missing_and_directory_paths(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="empty.jsonl: no usable records"):
        list(read_records(tmp_path / "empty.jsonl", "text"))
    with pytest.raises(DataError, match="nope.jsonl: no such file"):
        list(read_records(tmp_path / "nope.jsonl", "text"))
    with pytest.raises(DataError, match="is a directory"):
        list(read_records(tmp_path, "text"))


def test_enormous_line_is_refused_without_reading_it_whole(tmp_path):
    path = tmp_path / "huge.jsonl"
    path.write_text('{"text": "ok"}\n' + json.dumps({"text": "x" * 5000}) + "\n")
    with pytest.raises(DataError, match="huge.jsonl:2: line is longer than 1,000 bytes"):
        list(read_records(path, "text", max_line_bytes=1000))


def test_skip_bad_lines_counts_reasons(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"text": "a"}, "{oops", {"text": 3}, {"text": "b"}, "{oops"])
    report = SkipReport()
    kept = [r["text"] for _, r in read_records(path, "text", skip_bad_lines=True, report=report)]
    assert kept == ["a", "b"]
    assert report.counts == {"invalid JSON": 2, '"text" must be a string, got int': 1}
    assert "mixed.jsonl:2" in report.summary()


def test_all_lines_bad_is_an_error_even_when_skipping(tmp_path):
    path = write_jsonl(tmp_path / "allbad.jsonl", ["{x", "{y"])
    with pytest.raises(DataError, match="no usable records"):
        list(read_records(path, "text", skip_bad_lines=True))


# ---------------------------------------------------------------------------- tokenize once
def test_stream_is_documents_joined_by_endoftext(pretrain_file, tokenizer, tmp_path):
    cache = prepare(pretrain_file, tokenizer, val_fraction=0.1, num_workers=0, cache_dir=tmp_path / "c", log=str)
    val = in_validation(np.arange(1, len(DOCS) + 1), 0.1, DEFAULT_SPLIT_SEED)
    assert 0 < val.sum() < len(DOCS)
    for split, docs in (("train", [d for d, v in zip(DOCS, val) if not v]),
                        ("val", [d for d, v in zip(DOCS, val) if v])):
        expected = [t for d in docs for t in tokenizer.encode(d) + [tokenizer.eot_id]]
        assert cache.tokens(split).tolist() == expected
        offsets = cache.offsets(split)
        assert len(offsets) == len(docs) + 1 and offsets[-1] == len(expected)
        assert cache.tokens(split)[offsets[1] - 1] == tokenizer.eot_id
    assert cache.meta["splits"]["train"]["documents"] + cache.meta["splits"]["val"]["documents"] == len(DOCS)
    assert cache.dtype == np.uint16 and token_dtype(70000) == np.uint32


def test_parallel_chunked_preparation_equals_serial(pretrain_file, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(token_cache, "CHUNK_BYTES", 2000)  # many chunks, several in flight
    serial = prepare(pretrain_file, tokenizer, val_fraction=0.1, num_workers=0, cache_dir=tmp_path / "a", log=str)
    parallel = prepare(pretrain_file, tokenizer, val_fraction=0.1, num_workers=2, cache_dir=tmp_path / "b", log=str)
    for split in ("train", "val"):
        assert np.array_equal(serial.tokens(split), parallel.tokens(split))
        assert np.array_equal(serial.offsets(split), parallel.offsets(split))


def test_second_run_reuses_and_changes_rebuild(pretrain_file, tokenizer, tmp_path, monkeypatch):
    root = tmp_path / "c"
    first = prepare(pretrain_file, tokenizer, num_workers=0, cache_dir=root, log=str)
    builds = []
    real_build = token_cache._build
    monkeypatch.setattr(token_cache, "_build", lambda *a, **k: builds.append(1) or real_build(*a, **k))
    again = prepare(pretrain_file, tokenizer, num_workers=0, cache_dir=root, log=str)
    assert again.path == first.path and builds == []
    os.utime(pretrain_file, ns=(1, 1))  # touched but identical: the content hash says reuse
    prepare(pretrain_file, tokenizer, num_workers=0, cache_dir=root, log=str)
    assert builds == []
    write_jsonl(pretrain_file, [{"text": d} for d in DOCS[:50]])  # changed data: rebuild in place
    changed = prepare(pretrain_file, tokenizer, num_workers=0, cache_dir=root, log=str)
    assert builds == [1] and changed.path == first.path
    assert changed.meta["splits"]["train"]["documents"] == 50
    other = prepare(pretrain_file, tokenizer, val_fraction=0.2, num_workers=0, cache_dir=root, log=str)
    assert other.path != first.path  # settings are part of the key


def test_files_sharing_a_cache_dir_each_get_their_own_cache(tmp_path, tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in DOCS[:3]])
    (tmp_path / "sub").mkdir()
    b = write_jsonl(tmp_path / "sub" / "a.jsonl", [{"text": d} for d in DOCS[3:]])  # the same name elsewhere
    first = prepare(a, tokenizer, num_workers=0, cache_dir=tmp_path / "c", log=str)
    second = prepare(b, tokenizer, num_workers=0, cache_dir=tmp_path / "c", log=str)
    assert first.path != second.path
    assert first.meta["source"]["path"] == str(a.resolve()) and second.meta["source"]["path"] == str(b.resolve())
    assert not np.array_equal(first.tokens("train"), second.tokens("train"))
    assert prepare(a, tokenizer, num_workers=0, cache_dir=tmp_path / "c", log=str).path == first.path  # reused


def test_changed_tokenizer_uses_another_cache(pretrain_file, tokenizer, tmp_path):
    from dataset.tokenizer import Tokenizer, save_tokenizer, train_bpe
    save_tokenizer(train_bpe(iter(DOCS), vocab_size=300, min_frequency=1), tmp_path / "tok")
    a = prepare(pretrain_file, tokenizer, num_workers=0, cache_dir=tmp_path / "c", log=str)
    b = prepare(pretrain_file, Tokenizer(tmp_path / "tok"), num_workers=0, cache_dir=tmp_path / "c", log=str)
    assert a.path != b.path and a.meta["tokenizer"]["sha256"] != b.meta["tokenizer"]["sha256"]


def test_interrupted_preparation_leaves_no_complete_looking_cache(pretrain_file, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(token_cache, "CHUNK_BYTES", 1000)
    calls = []

    def dying(lines):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the file
        return token_cache.encode_pretrain_chunk(lines)

    monkeypatch.setitem(token_cache.ENCODERS, "pretrain", dying)
    cache_dir = tmp_path / "c"
    root = token_cache.cache_root(pretrain_file, cache_dir)  # the file's own folder under --cache_dir
    with pytest.raises(KeyboardInterrupt):
        prepare(pretrain_file, tokenizer, num_workers=0, cache_dir=cache_dir, log=str)
    assert not [p for p in root.iterdir() if p.name != ".lock"]  # nothing left, not even the temp dir
    # a temp dir from a killed process (no cleanup ran) is ignored and removed by the next run
    (root / "pretrain-0000000000000000.tmp-999").mkdir()
    (root / "pretrain-0000000000000000.tmp-999" / "train.bin").write_bytes(b"\0" * 10)
    monkeypatch.setitem(token_cache.ENCODERS, "pretrain", token_cache.encode_pretrain_chunk)
    cache = prepare(pretrain_file, tokenizer, num_workers=0, cache_dir=cache_dir, log=str)
    assert (cache.path / "meta.json").is_file()
    assert sorted(p.name for p in root.iterdir() if p.name != ".lock") == [cache.path.name]


def test_bad_line_stops_preparation_with_location(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": "good"}] * 3 + ['{"text": 1}'])
    with pytest.raises(DataError, match=r"p.jsonl:4: \"text\" must be a string"):
        prepare(path, tokenizer, num_workers=0, cache_dir=tmp_path / "c", log=str)
    cache = prepare(path, tokenizer, num_workers=0, cache_dir=tmp_path / "c", skip_bad_lines=True, log=str)
    assert cache.meta["skipped"] == {'"text" must be a string, got int': 1}
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(DataError, match="e.jsonl: empty file"):
        prepare(tmp_path / "e.jsonl", tokenizer, num_workers=0, cache_dir=tmp_path / "c", log=str)


def test_minimind_style_pretrain_file_just_works(tmp_path, tokenizer):
    """MiniMind's pretrain_hq.jsonl embeds ChatML markers in plain text; they stay text, never structure."""
    text = "<|im_start|>鉴别一组中文文章的风格和特点。<|im_end|> <|im_start|>Describe a sunset.<|im_end|>"
    path = write_jsonl(tmp_path / "pretrain_hq.jsonl", [{"text": text}] * 30)
    cache = prepare(path, tokenizer, num_workers=0, cache_dir=tmp_path / "c", log=str)
    ids = cache.tokens("train")
    assert tokenizer.im_start_id not in ids and tokenizer.im_end_id not in ids
    assert tokenizer.decode(ids[: cache.offsets("train")[1] - 1]) == text


# ------------------------------------------------------------------------------ pretrain windows
def test_windows_cover_the_stream_and_resume_in_o1(pretrain_file, tokenizer, tmp_path):
    cache = prepare(pretrain_file, tokenizer, num_workers=0, cache_dir=tmp_path / "c", log=str)
    L = 32
    ds = PretrainDataset(cache, "train", max_seq_len=L, seed=3)
    stream = cache.tokens("train")
    assert len(ds) == (len(stream) - 1) // L
    x, y = ds.batch(np.array([0, 5]))
    assert torch.equal(x[1], torch.from_numpy(stream[5 * L:6 * L].astype(np.int64)))
    assert torch.equal(y[1], torch.from_numpy(stream[5 * L + 1:6 * L + 1].astype(np.int64)))
    e0, e1 = ds.epoch_order(0), ds.epoch_order(1)
    assert sorted(e0) == list(range(len(ds))) and not np.array_equal(e0, e1)
    assert np.array_equal(e0, PretrainDataset(cache, "train", L, seed=3).epoch_order(0))  # deterministic
    everything = ds.global_indices(0, 3 * len(ds))
    fresh = PretrainDataset(cache, "train", L, seed=3)  # a "resumed" process
    g = len(ds) - 3  # straddles the epoch boundary
    assert np.array_equal(fresh.global_indices(g, 10), everything[g:g + 10])


class _StreamCache:
    """Just enough of a TokenCache for PretrainDataset: a given token stream."""

    def __init__(self, n: int) -> None:
        self.stream = np.arange(n, dtype=np.uint16)
        self.meta = {"source": {"path": "stream"}}

    def tokens(self, split: str) -> np.ndarray:
        return self.stream


@pytest.mark.parametrize("n", [64, 65, 80])
def test_windows_at_the_end_of_the_stream(n):
    """(n - 1) // L windows: with n = 64 and L = 16 the 4th window would need a 65th token for its last target."""
    ds = PretrainDataset(_StreamCache(n), max_seq_len=16)
    assert len(ds) == (n - 1) // 16
    x, y = ds.batch(np.arange(len(ds)))
    assert torch.equal(x.flatten(), torch.arange(16 * len(ds)))  # every input once, in stream order
    assert torch.equal(y.flatten(), torch.arange(1, 16 * len(ds) + 1))


def test_epoch_orders_depend_on_seed_and_epoch_and_resume_anywhere():
    ds = PretrainDataset(_StreamCache(2000), max_seq_len=16, seed=3)
    n = len(ds)
    orders = [ds.epoch_order(e) for e in range(3)]
    assert all(sorted(o) == list(range(n)) for o in orders)
    assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[1], orders[2])
    assert not np.array_equal(orders[0], PretrainDataset(_StreamCache(2000), max_seq_len=16, seed=4).epoch_order(0))
    # one instance walking forward through epochs serves each epoch's own order
    assert np.array_equal(ds.global_indices(0, 3 * n), np.concatenate(orders))
    assert np.array_equal(ds.global_indices(n + 5, 10), orders[1][5:15])
    assert np.array_equal(ds.global_indices(2 * n - 4, 8), np.concatenate([orders[1][-4:], orders[2][:4]]))


def test_too_little_data_for_one_window(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "small.jsonl", [{"text": "tiny"}])
    cache = prepare(path, tokenizer, num_workers=0, cache_dir=tmp_path / "c", log=str)
    with pytest.raises(DataError, match="fewer than one window"):
        PretrainDataset(cache, "train", max_seq_len=512)


# -------------------------------------------------------------------------------------- SFT
def test_sft_targets_are_the_assistant_answers(tmp_path, tokenizer):
    conv = {"conversations": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                              {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"},
                              {"role": "assistant", "content": "4"}]}
    path = write_jsonl(tmp_path / "sft.jsonl", [conv])
    cache = prepare(path, tokenizer, "sft", num_workers=0, cache_dir=tmp_path / "c", max_seq_len=64,
                    overlong="truncate", log=str)
    ds = SFTDataset(cache, batch_size=1, pad_id=tokenizer.pad_id)
    x, y = ds.batch(np.array([0]))
    ids, labelled, _ = tokenizer.encode_chat(conv["conversations"])
    assert x[0].tolist() == ids[:-1]  # inputs: everything but the last token
    targets = [t for t in y[0].tolist() if t != IGNORE_INDEX]
    assert targets == tokenizer.encode("Hello!") + [2] + tokenizer.encode("4") + [2]
    # each target sits where the model sees the token before it
    for t in range(len(ids) - 1):
        assert y[0, t].item() == (ids[t + 1] if labelled[t + 1] else IGNORE_INDEX)


def test_sft_on_minimind_tool_records_trains_calls_and_answers_not_tool_results(tmp_path, tokenizer):
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    conv = [{"role": "system", "content": "", "tools": json.dumps(tools)},  # MiniMind's JSON strings
            {"role": "user", "content": "12*7?"},
            {"role": "assistant", "content": "", "tool_calls": json.dumps([{"name": "calculator",
                                                                             "arguments": {"expr": "12*7"}}])},
            {"role": "tool", "content": "84"},
            {"role": "assistant", "content": "It is 84.", "reasoning_content": "Read the tool."}]
    path = write_jsonl(tmp_path / "sft.jsonl", [{"conversations": conv}])
    cache = prepare(path, tokenizer, "sft", num_workers=0, cache_dir=tmp_path / "c", max_seq_len=512,
                    overlong="drop", log=str)
    assert cache.meta["stats"] == {"truncated": 0, "dropped_too_long": 0}
    _, y = SFTDataset(cache, batch_size=1, pad_id=tokenizer.pad_id).batch(np.array([0]))
    parsed = [{**m, **{k: json.loads(m[k]) for k in ("tools", "tool_calls") if k in m}} for m in conv]
    text = tokenizer.decode(tokenizer.encode_chat(parsed)[0])
    assert "<tools>" in text and "<tool_response>\n84\n</tool_response>" in text
    targets = tokenizer.decode(t for t in y[0].tolist() if t != IGNORE_INDEX)
    assert targets == ('<tool_call>\n{"name": "calculator", "arguments": {"expr": "12*7"}}\n</tool_call><|im_end|>'
                       "<think>\nRead the tool.\n</think>\n\nIt is 84.<|im_end|>")


def test_overlong_conversations_truncate_at_turn_boundary_or_drop(tmp_path, tokenizer):
    long_answer = "word " * 200
    convs = [{"conversations": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "short a1"},
                                {"role": "user", "content": "q2"}, {"role": "assistant", "content": long_answer}]},
             {"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": long_answer}]},
             CONV]
    path = write_jsonl(tmp_path / "sft.jsonl", convs)
    kw = dict(num_workers=0, cache_dir=tmp_path / "c", max_seq_len=64, log=str)
    trunc = prepare(path, tokenizer, "sft", overlong="truncate", **kw)
    assert trunc.meta["stats"] == {"truncated": 1, "dropped_too_long": 1}
    first = trunc.tokens("train")[: trunc.offsets("train")[1]]
    assert tokenizer.decode(first).endswith("short a1<|im_end|>\n")  # cut after the first complete answer
    drop = prepare(path, tokenizer, "sft", overlong="drop", **kw)
    assert drop.meta["stats"] == {"truncated": 0, "dropped_too_long": 2}
    assert drop.meta["splits"]["train"]["documents"] == 1


def test_sft_batches_are_aligned_and_pad_little(tokenizer, tmp_path):
    cache = prepare(ROOT / "dataset/demo/sft_demo.jsonl", tokenizer, "sft", num_workers=0, cache_dir=tmp_path / "c",
                    max_seq_len=512, overlong="truncate", log=str)
    ds = SFTDataset(cache, batch_size=8, pad_id=tokenizer.pad_id)
    assert len(ds) % 8 == 0
    assert ds.padding_fraction(0) <= 0.10 and ds.padding_fraction(1) <= 0.10
    order = ds.global_indices(0, 2 * len(ds))
    x, y = ds.batch(order[8:16])
    assert x.shape[1] == ds.lengths[order[8:16]].max() - 1
    assert (y != IGNORE_INDEX).any(dim=1).all()  # every conversation has something to learn


def test_sft_epoch_order_is_seeded_shuffled_and_padded_with_pad_id(tokenizer, tmp_path):
    cache = prepare(ROOT / "dataset/demo/sft_demo.jsonl", tokenizer, "sft", num_workers=0, cache_dir=tmp_path / "c",
                    max_seq_len=512, overlong="truncate", log=str)
    ds = SFTDataset(cache, batch_size=8, seed=1)
    e0, e1 = ds.epoch_order(0), ds.epoch_order(1)
    assert len(e0) == len(ds) and len(set(e0.tolist())) == len(e0)  # distinct conversations
    assert np.array_equal(e0, SFTDataset(cache, batch_size=8, seed=1).epoch_order(0))  # deterministic
    assert not np.array_equal(e0, e1)  # a new order each epoch
    assert not np.array_equal(e0, SFTDataset(cache, batch_size=8, seed=2).epoch_order(0))  # and per seed
    # length-sorted batches are shuffled: the batches do not come longest first
    mega = 8 * ds.group_size  # conversations sorted together
    longest = [int(ds.lengths[e0[i:i + 8]].max()) for i in range(0, min(len(e0), mega), 8)]
    assert len(longest) > 4 and longest != sorted(longest, reverse=True)
    padded = SFTDataset(cache, batch_size=8, seed=1, pad_id=7)
    mixed = np.array([int(np.argmin(padded.lengths)), int(np.argmax(padded.lengths))])
    x, y = padded.batch(mixed)
    for row, i in enumerate(mixed):
        n = int(padded.lengths[i]) - 1
        assert (x[row, n:] == 7).all() and (y[row, n:] == IGNORE_INDEX).all()
    assert (x == 7).any()  # some row really is padded


def test_sft_fewer_conversations_than_a_batch(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "one.jsonl", [CONV])
    cache = prepare(path, tokenizer, "sft", num_workers=0, cache_dir=tmp_path / "c", max_seq_len=64,
                    overlong="truncate", log=str)
    ds = SFTDataset(cache, batch_size=4)
    assert len(ds) == 4 and sorted(ds.epoch_order(0)) == [0, 0, 0, 0]


def test_feeder_counts_real_inputs_so_padding_cannot_inflate_throughput(corpus, tokenizer):
    """tokens/s and MFU are computed from the feeder's non-padding input count; targets are counted apart."""
    from trainer_utils.data import StepFeeder
    sft = prepare(corpus["sft"], tokenizer, "sft", num_workers=0, cache_dir=corpus["cache"], max_seq_len=128,
                  overlong="truncate", log=str)
    pre = prepare(corpus["pretrain"], tokenizer, num_workers=0, cache_dir=corpus["cache"], log=str)
    for ds in (SFTDataset(sft, batch_size=4, pad_id=tokenizer.pad_id), PretrainDataset(pre, "train", 32)):
        feeder = StepFeeder(ds, batch_size=4, accumulation_steps=2, rank=0, world_size=1, cursor=8,
                            device=torch.device("cpu"))
        try:
            micro, n_input = feeder.next_step()
        finally:
            feeder.close()
        # conversations never contain <|endoftext|> (the pad); pretraining windows hold it as a real token
        real = sum(int((x != tokenizer.pad_id).sum()) for x, _ in micro) if isinstance(ds, SFTDataset) else \
            sum(x.numel() for x, _ in micro)
        assert n_input == real <= sum(x.numel() for x, _ in micro)
        assert sum(int((y != IGNORE_INDEX).sum()) for _, y in micro) <= n_input
