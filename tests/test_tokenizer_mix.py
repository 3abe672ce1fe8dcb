"""The default tokenizer's build (scripts/build_default_tokenizer.py): the mix it draws, its held-out split, its
measures, and its errors. The shipped tokenizer's own numbers are checked against its compression.json."""
from __future__ import annotations

import json
import sys
from collections import Counter

import pytest

from dataset.tokenizer import DEFAULT_TOKENIZER_DIR, Tokenizer

from conftest import ROOT, write_jsonl

sys.path.insert(0, str(ROOT / "scripts"))
import build_default_tokenizer as build  # noqa: E402

EN = ["The {} fox jumps over the lazy dog number {}.", "A small model reads {} books on day {}."]
POEM = ["床前明月光{}疑是地上霜{}", "白日依山尽{}黄河入海流{}"]
MODERN = ["这个命令用于建立和修改档案{}，第{}个文件。", "内核文档的中文翻译{}，第{}章。"]


def corpus(tmp_path, n=60):
    rows = []
    for i in range(n):
        rows.append({"text": EN[i % 2].format(i, i * 7), "source": "sotu:x", "lang": "en"})
        rows.append({"text": POEM[i % 2].format(i, i + 1), "source": "poetry:tang", "lang": "zh"})
        rows.append({"text": MODERN[i % 2].format(i, i + 3), "source": "linux-docs-zh", "lang": "zh"})
    return write_jsonl(tmp_path / "corpus.jsonl", rows)


def test_groups_split_and_draw(tmp_path):
    split = build.read_split([corpus(tmp_path)], heldout_percent=20)
    assert set(split.train) == {"en", "zh-classic", "zh-modern"}
    train = {t for texts in split.train.values() for t in texts}
    held = {r["text"] for r in split.heldout}
    assert held and not held & train and len(held) + len(train) == 180  # every document on one side
    assert all(build.is_heldout(t, 20) for t in held)
    # the split is the text's, not the file's: reversed lines split the same
    rows = (tmp_path / "corpus.jsonl").read_text().splitlines(True)
    (tmp_path / "reversed.jsonl").write_text("".join(reversed(rows)))
    assert {r["text"] for r in build.read_split([tmp_path / "reversed.jsonl"], 20).heldout} == held

    have = {g: sum(len(t.encode()) for t in texts) for g, texts in split.train.items()}
    longest = max(len(t.encode()) for texts in split.train.values() for t in texts)
    # a group larger than its target is sampled, a smaller one repeated: each near its target, in bytes (a
    # sample is drawn document by document, so within a few documents of it)
    for zh_share, modern in [(0.5, 0.6), (0.2, 0.9), (0.8, 0.1)]:
        total_mb = sum(have.values()) / 1e6
        targets = build.group_targets(zh_share, modern, total_mb)
        drawn: Counter = Counter()
        texts = list(build.mix(split, targets, drawn))
        assert sum(len(t.encode()) for t in texts) == sum(drawn.values())
        for group, target in targets.items():
            assert drawn[group] == pytest.approx(target, rel=0.1, abs=5 * longest), (zh_share, modern, group)
        assert texts == list(build.mix(split, targets))  # the same draw every time
    twice = build.group_targets(0.5, 0.5, 2 * sum(have.values()) / 1e6)
    drawn = Counter()
    list(build.mix(split, {g: twice[g] for g in twice}, drawn))
    assert drawn["zh-modern"] == pytest.approx(2 * 0.5 * 0.5 * sum(have.values()), rel=0.15)
    assert not list(build.draw(split.train["en"], 0))


def test_evaluation_sets_and_measures(tmp_path):
    split = build.read_split([corpus(tmp_path)], heldout_percent=30)
    sets = build.evaluation_sets(split, build.chat_texts())
    assert {"en", "zh", "zh-modern", "chat-en", "chat-zh"} <= set(sets)
    assert set(sets["zh-modern"]) < set(sets["zh"]) and not set(sets["zh-modern"]) & set(POEM)
    tok = Tokenizer(DEFAULT_TOKENIZER_DIR)
    comp = build.measure(tok, sets, batch_size=7)  # batches that do not divide the sets
    for name, texts in sets.items():
        tokens = sum(len(tok.encode(t)) for t in texts)
        assert comp[name]["tokens"] == tokens and comp[name]["docs"] == len(texts)
        assert comp[name]["bytes_per_token"] == round(sum(len(t.encode()) for t in texts) / tokens, 4)
    assert build.geometric_mean_bpt({"a": {"bytes_per_token": 2.0}, "b": {"bytes_per_token": 8.0}}) == \
        pytest.approx(4.0)


def test_added_documents_are_the_trainers_training_split_without_heldout_passages(tmp_path):
    import numpy as np

    from dataset.token_cache import in_validation

    heldout = "A passage of the held-out side, long enough to be caught whatever its alignment: " * 2
    rows = [{"text": f"Demo document {i} about foxes and the lazy dog, told once more." * 3} for i in range(400)]
    rows[7]["text"] = "Its own words first. " + heldout[5:70] + " Then its own words again."
    rows[8]["text"] = "Shares only a short phrase: " + heldout[:build.WINDOW - 1]
    path = write_jsonl(tmp_path / "demo.jsonl", rows)
    is_val = in_validation(np.arange(1, 401), 0.05, 3)
    assert 0 < is_val.sum() < 400 and not is_val[7] and not is_val[8]
    added = build.added_documents([path], 0.05, 3, [heldout])
    expected = [r["text"] for i, r in enumerate(rows) if not is_val[i] and i != 7]
    assert added.texts == expected  # file order, the validation split and the shared passage left out
    assert added.files[0] | {"sha256": None} == {
        "file": "demo.jsonl", "sha256": None, "docs": 400, "validation_docs": int(is_val.sum()),
        "sharing_heldout_text": 1, "added_docs": len(expected), "added_bytes": sum(len(t.encode()) for t in expected)}
    # a 2 x WINDOW - 1 passage is caught at every offset; a passage shorter than WINDOW never is
    index = build.passage_index([heldout])
    for start in range(build.WINDOW):
        assert build.shares_passage("x" + heldout[start:start + 2 * build.WINDOW - 1] + "y", index)
    assert not build.shares_passage(heldout[:build.WINDOW - 1], index)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": 1}\n')
    with pytest.raises(build.DataError, match="bad.jsonl:2"):
        build.added_documents([bad], 0.0, 0, [])


def test_build_writes_a_checked_tokenizer_and_its_numbers(tmp_path, capsys):
    out = tmp_path / "tok"
    added = write_jsonl(tmp_path / "added.jsonl", [{"text": f"Zanzibar quokka {i}. " * 20} for i in range(40)])
    argv = ["--data_path", str(corpus(tmp_path)), "--vocab_size", "400", "--train_mb", "0.02"]
    assert build.main(argv + ["--out_dir", str(out), "--compare", str(DEFAULT_TOKENIZER_DIR),
                              "--add_train", str(added)]) == 0
    tok = Tokenizer(out)
    assert tok.vocab_size == 400 and (tok.eot_id, tok.im_start_id, tok.im_end_id) == (0, 1, 2)
    summary = json.loads((out / "compression.json").read_text())
    assert summary["tokenizer_sha256"] == tok.sha256
    assert summary["mix"]["zh_share"] == build.ZH_SHARE and set(summary["mix"]["drawn_bytes"]) == set(build.GROUPS)
    assert summary["compared"]["tokenizer"]["tokenizer_sha256"] == Tokenizer(DEFAULT_TOKENIZER_DIR).sha256
    assert summary["added"]["files"][0]["added_docs"] == 40 - summary["added"]["files"][0]["validation_docs"]
    assert set(summary["by_kind"]) == set(summary["compared"]["tokenizer"]["by_kind"]) and \
        {"the demo pretraining corpus, en", "the demo pretraining corpus, zh"} <= set(summary["by_kind"])
    printed = capsys.readouterr().out
    assert "chat-zh" in printed and "added added.jsonl: " in printed
    # the added documents are trained on: their words become tokens, which they do not without them
    without = tmp_path / "without"
    assert build.main(argv + ["--out_dir", str(without), "--add_train"]) == 0
    assert len(tok.encode(" Zanzibar quokka")) < len(Tokenizer(without).encode(" Zanzibar quokka"))
    assert json.loads((without / "compression.json").read_text())["added"]["files"] == []


def test_bad_input_is_a_one_line_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine", "lang": "en"}\n{broken\n')
    assert build.main(["--data_path", str(bad), "--out_dir", str(tmp_path / "t")]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert build.main(["--data_path", str(tmp_path / "missing.jsonl"), "--out_dir", str(tmp_path / "t")]) == 2
    assert "no such file" in capsys.readouterr().err
    for flag, value in (("--zh_share", "1.5"), ("--val_fraction", "1")):
        with pytest.raises(SystemExit):
            build.main(["--data_path", str(tmp_path / "x.jsonl"), flag, value])
        assert flag in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the corpus is the user's: no default path
        build.main([])
    assert "--data_path" in capsys.readouterr().err


def test_shipped_tokenizer_matches_its_compression_record():
    """model/tokenizer/compression.json describes the tokenizer beside it (rebuilt together, never apart)."""
    summary = json.loads((DEFAULT_TOKENIZER_DIR / "compression.json").read_text())
    tok = Tokenizer(DEFAULT_TOKENIZER_DIR)
    assert summary["tokenizer_sha256"] == tok.sha256 and summary["vocab_size"] == tok.vocab_size
    chat = build.chat_texts()  # the one held-out set that ships with the repository: re-measured here
    for name, texts in chat.items():
        assert build.measure(tok, {name: texts})[name] == summary["heldout_compression"][name]


def test_sweep_trains_every_point_and_writes_its_table_and_plot(tmp_path, capsys):
    import sweep_tokenizer_mix as sweep
    out = tmp_path / "sweep.json"
    assert sweep.main(["--data_path", str(corpus(tmp_path)), "--zh_share", "0.3", "0.6", "--zh_modern_share", "0.5",
                       "--train_mb", "0.02", "--vocab_size", "400", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(p["zh_share"], p["zh_modern_share"]) for p in result["points"]] == [(0.3, 0.5), (0.6, 0.5)]
    shipped = f"shipped {Tokenizer(DEFAULT_TOKENIZER_DIR).sha256[:8]}"
    assert list(result["compared"]) == [shipped]
    for point in result["points"]:
        assert point["geomean_bytes_per_token"] == round(build.geometric_mean_bpt(point["heldout_compression"]), 4)
    assert out.with_suffix(".png").stat().st_size > 0
    table = capsys.readouterr().out
    assert f"| {shipped} |" in table and "| 0.6 | 0.5 |" in table
    assert sweep.main(["--data_path", str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 2
