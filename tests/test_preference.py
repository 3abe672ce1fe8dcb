"""DPO data: pair validation, the tokenize-once cache of pairs, PreferenceDataset batches and reference
log-probs, mixtures of pair files, and the bundled synthetic demo pairs."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from common.config import parse_config, settings
from common.tokens import IGNORE_INDEX
from dataset import token_cache
from dataset.config import CacheConfig, DataConfig, training_data
from dataset.jsonl import DataError, SkipReport, read_records
from dataset.mixture import Mixture
from dataset.preference import PreferenceDataset
from dataset.token_cache import DEFAULT_SPLIT_SEED, in_validation, prepare
from trainer_utils.stages import STAGES

from conftest import ROOT, demo_records, write_jsonl

sys.path.insert(0, str(ROOT / "scripts"))
import build_dpo_demo  # noqa: E402

DEMO = ROOT / "dataset" / "demo" / "dpo_demo.jsonl"


def msg(role: str, content) -> dict:
    return {"role": role, "content": content}


def pair(prompt: list[dict], chosen: str, rejected: str, **extra) -> dict:
    return {"chosen": [*prompt, msg("assistant", chosen)], "rejected": [*prompt, msg("assistant", rejected)],
            **extra}


GOOD = pair([msg("user", "What is 2+2?")], "4", "4 4 4 4 4")


def prepare_pairs(path, tokenizer, tmp_path, max_seq_len=64, overlong="truncate", **kw):
    kw = {"num_workers": 0, "cache_dir": tmp_path / "c", "log": str, **kw}
    return prepare(path, tokenizer, "dpo", max_seq_len=max_seq_len, overlong=overlong, **kw)


# ----------------------------------------------------------------------------------- validation
U, A = msg("user", "Hi"), msg("assistant", "Hello")
BAD_PAIRS = [
    ({"rejected": [U, A]}, "missing \"chosen\" field (keys: ['rejected'])"),
    ({"chosen": [U, A], "note": 1}, "missing \"rejected\" field (keys: ['chosen', 'note'])"),
    ({"chosen": "Hi", "rejected": [U, A]}, '"chosen" must be a list, got str'),
    ({"chosen": [U, A], "rejected": []}, 'empty "rejected"'),
    ({"chosen": [U, A], "rejected": [msg("bot", "x"), A]},
     "\"rejected\" turn 0 has unknown role 'bot'; expected one of ('system', 'user', 'assistant', 'tool')"),
    ({"chosen": [U, msg("assistant", None)], "rejected": [U, A]}, '"chosen" turn 1 "content" must be a string, '
                                                                  'got NoneType'),
    ({"chosen": [U, "x"], "rejected": [U, A]}, '"chosen" turn 1 must be an object, got str'),
    ({"chosen": [U, A], "rejected": [U, A, U]},
     "\"rejected\" does not end with an assistant answer (its last turn is 'user')"),
    (pair([U], "  ", "no"), '"chosen" ends with an empty assistant answer'),
    ({"chosen": [U, A], "rejected": [U, A, U, msg("assistant", "Bye")]},
     '"chosen" and "rejected" have different prompts (1 vs 3 turns before the answer)'),
    ({"chosen": [U, msg("assistant", "a")], "rejected": [msg("user", "Hey"), msg("assistant", "b")]},
     '"chosen" and "rejected" have different prompts (turn 0 differs)'),
    ({"chosen": [U, A, U, msg("assistant", "a")], "rejected": [U, msg("system", "Hello"), U, msg("assistant", "b")]},
     '"chosen" and "rejected" have different prompts (turn 1 differs)'),
    (pair([msg("system", "Be brief.")], "a", "b"),
     "the prompt has no user turn (every turn before the answer is system or assistant)"),
    ({"chosen": [A], "rejected": [msg("assistant", "b")]},
     "the prompt has no user turn (every turn before the answer is system or assistant)"),
    (pair([U], "Same answer", " Same answer\n"), '"chosen" and "rejected" answers are identical (nothing to prefer)'),
]


@pytest.mark.parametrize("record, reason", BAD_PAIRS)
def test_bad_pairs_name_file_and_line(tmp_path, record, reason):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, record])
    with pytest.raises(DataError) as e:
        list(read_records(path, "dpo"))
    assert str(e.value) == f"{path}:2: {reason} (use --skip_bad_lines to skip such lines)"


def test_prompts_equal_as_rendered_are_one_prompt(tmp_path):
    """The template trims content, so whitespace around a prompt turn does not make two prompts."""
    record = {"chosen": [msg("user", "Hi "), msg("assistant", "Hello")],
              "rejected": [msg("user", "\nHi"), msg("assistant", "Go away")], "source": "x"}
    path = write_jsonl(tmp_path / "ok.jsonl", [record])
    assert [r for _, r in read_records(path, "dpo")] == [record]


def test_skip_bad_pairs_counts_reasons(tmp_path, tokenizer):
    lines = [GOOD, {"chosen": [U, A]}, pair([U], "x", "x"), "{oops", GOOD, pair([U], "y", "y"),
             {"chosen": [U, A], "rejected": [U, A, U, msg("assistant", "z")]}]
    path = write_jsonl(tmp_path / "mixed.jsonl", lines)
    report = SkipReport()
    kept = [n for n, _ in read_records(path, "dpo", skip_bad_lines=True, report=report)]
    expected = {'missing "rejected" field': 1, '"chosen" and "rejected" answers are identical': 2,
                "invalid JSON": 1, '"chosen" and "rejected" have different prompts': 1}
    assert kept == [1, 5] and report.counts == expected
    assert report.examples[0] == 'mixed.jsonl:2: missing "rejected" field'
    with pytest.raises(DataError, match='mixed.jsonl:2: missing "rejected" field'):
        prepare_pairs(path, tokenizer, tmp_path)
    cache = prepare_pairs(path, tokenizer, tmp_path, skip_bad_lines=True)
    assert cache.meta["skipped"] == expected and cache.meta["splits"]["train"]["documents"] == 2


# ---------------------------------------------------------------------------- tokenization
MULTI = pair([msg("system", "Be brief."), msg("user", "Hi"), msg("assistant", "Hello!"), msg("user", "2+2?")],
             "4", "Four four four four.")


def test_rows_are_sft_sequences_labelled_only_on_the_final_answer(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [MULTI])
    cache = prepare_pairs(path, tokenizer, tmp_path)
    ds = PreferenceDataset(cache, batch_size=1, pad_id=tokenizer.pad_id)
    chosen, flags_c, ends = tokenizer.encode_chat(MULTI["chosen"])
    rejected, flags_r, _ = tokenizer.encode_chat(MULTI["rejected"])
    p = ends[-2]  # the prompt: every turn before the answer
    assert ds.segments.tolist() == [[p, len(chosen) - p, len(rejected) - p]]
    x, y = ds.rows([0])
    assert x.shape == y.shape == (2, len(rejected) - 1)  # padded to the longer row
    assert x[0, :len(chosen) - 1].tolist() == chosen[:-1] and x[1].tolist() == rejected[:-1]  # exactly SFT's ids
    assert torch.equal(x[0, :p], x[1, :p])  # one prompt for both rows
    for row, ids in ((0, chosen), (1, rejected)):
        targets = [t for t in y[row].tolist() if t != IGNORE_INDEX]
        answer = MULTI["chosen" if row == 0 else "rejected"][-1]["content"]
        assert targets == tokenizer.encode(answer) + [tokenizer.im_end_id]  # not "Hello!", an earlier answer
        for t in range(len(ids) - 1):  # the target at t is the token after t, when it is an answer token
            labelled = (flags_c if row == 0 else flags_r)[t + 1] and t + 1 >= p
            assert y[row, t].item() == (ids[t + 1] if labelled else IGNORE_INDEX)
    assert (y[0, len(chosen) - 1:] == IGNORE_INDEX).all() and (x[0, len(chosen) - 1:] == tokenizer.pad_id).all()


PAIRS = [pair([msg("user", f"Question number {i}?" + " Tell me more." * (i % 4))], f"Answer {i}." * (1 + i % 3),
              f"Wrong {i}! " * (2 + i % 5)) for i in range(40)]


@pytest.fixture
def pairs_ds(tmp_path, tokenizer):
    cache = prepare_pairs(write_jsonl(tmp_path / "pairs.jsonl", PAIRS), tokenizer, tmp_path, max_seq_len=128)
    return PreferenceDataset(cache, batch_size=4, seed=1, pad_id=7)


def fake_logprob(y: torch.Tensor) -> torch.Tensor:
    """A stand-in for the reference model: a per-row function of the labelled targets."""
    return torch.where(y == IGNORE_INDEX, 0, y).sum(dim=1).float() * -0.01 - (y != IGNORE_INDEX).sum(dim=1)


def test_batch_is_chosen_rows_then_rejected_rows_with_their_reference(pairs_ds, tokenizer):
    ds = pairs_ds
    ref = np.arange(2 * ds.num_examples, dtype=np.float64).reshape(-1, 2) * -1.5
    ds.set_reference(ref)
    order = np.array([5, 0, 17])
    x, y, r = ds.batch(order)
    assert x.shape == y.shape == (6, int(ds.row_lengths[order].max()) - 1)
    assert r.dtype == torch.float32
    assert r.tolist() == [ref[5, 0], ref[0, 0], ref[17, 0], ref[5, 1], ref[0, 1], ref[17, 1]]
    for row, i in enumerate(order):
        for side, name in ((0, "chosen"), (1, "rejected")):
            ids = tokenizer.encode_chat(PAIRS[i][name])[0]
            xr, yr = x[row + 3 * side], y[row + 3 * side]
            assert xr[:len(ids) - 1].tolist() == ids[:-1]
            assert (xr[len(ids) - 1:] == 7).all() and (yr[len(ids) - 1:] == IGNORE_INDEX).all()  # padding: no labels
            assert [t for t in yr.tolist() if t != IGNORE_INDEX] == \
                tokenizer.encode(PAIRS[i][name][-1]["content"].strip()) + [tokenizer.im_end_id]
    assert (x == 7).any()
    assert ds.input_tokens(order) == int((x != 7).sum())  # the pad id never occurs in chat text
    x2, y2 = ds.rows(order)
    assert torch.equal(x, x2) and torch.equal(y, y2)


def test_reference_is_required_and_checked(pairs_ds):
    with pytest.raises(DataError, match=r"needs the reference model's log-probabilities: compute them over "
                                        r"all_pairs_batches\(\) and call set_reference\(\) first"):
        pairs_ds.batch([0, 1])
    with pytest.raises(DataError, match=r"expected shape \(40, 2\) \[chosen, rejected\], got \(40,\)"):
        pairs_ds.set_reference(np.zeros(40))
    bad = np.zeros((40, 2))
    bad[3, 1] = np.nan
    with pytest.raises(DataError, match="1 values are not finite"):
        pairs_ds.set_reference(bad)
    values = np.ones((40, 2))
    pairs_ds.set_reference(values)
    values[:] = 5  # the dataset keeps its own copy
    assert pairs_ds.batch([0])[2].tolist() == [1.0, 1.0]


def test_reference_walk_covers_every_pair_once_and_lands_in_batch_order(pairs_ds):
    """The trainer's recipe: score all_pairs_batches (every pair once, shortest first), set_reference, and every
    training batch carries exactly the scores of its own rows."""
    ds = pairs_ds
    seen, ref = [], np.full((ds.num_examples, 2), np.nan)
    for indices, x, y in ds.all_pairs_batches(16):
        assert x.shape[0] == y.shape[0] == 2 * len(indices)
        scores = fake_logprob(y).numpy()
        ref[indices, 0], ref[indices, 1] = scores[:len(indices)], scores[len(indices):]
        seen.extend(indices.tolist())
    assert sorted(seen) == list(range(ds.num_examples))  # every pair once: 16, 16, 8
    lengths = ds.lengths[seen].tolist()
    assert lengths == sorted(lengths)  # grouped by length: little padding in the one-off pass
    ds.set_reference(ref)
    for k in range(3):
        x, y, r = ds.batch(ds.global_indices(4 * k, 4))
        assert torch.allclose(r, fake_logprob(y))


def test_epoch_order_is_seeded_length_grouped_whole_batches(pairs_ds, tmp_path, tokenizer):
    ds = pairs_ds
    assert len(ds) == 40 and ds.num_examples == 40
    e0, e1 = ds.epoch_order(0), ds.epoch_order(1)
    assert sorted(e0.tolist()) == list(range(40)) and not np.array_equal(e0, e1)
    assert np.array_equal(e0, PreferenceDataset(ds_cache(ds, tmp_path, tokenizer), batch_size=4, seed=1).epoch_order(0))
    assert np.array_equal(ds.global_indices(38, 4), np.concatenate([e0[38:], e1[:2]]))
    assert ds.lengths.tolist() == ds.row_lengths.max(axis=1).tolist()
    # batches of similar length: within a sorted group, each batch's spread is small compared with the data's
    spreads = [np.ptp(ds.lengths[e0[i:i + 4]]) for i in range(0, 40, 4)]
    assert max(spreads) < np.ptp(ds.lengths)
    odd = PreferenceDataset(ds_cache(ds, tmp_path, tokenizer), batch_size=6)
    assert len(odd) == 36 and odd.num_examples == 40  # whole batches, like SFT


def ds_cache(ds, tmp_path, tokenizer):
    return prepare_pairs(tmp_path / "pairs.jsonl", tokenizer, tmp_path, max_seq_len=128)


# ------------------------------------------------------------------------------- overlong
def test_overlong_pairs_drop_or_cut_oldest_prompt_turns_then_answer_ends(tmp_path, tokenizer):
    long_q = "Tell me everything about this long topic. " * 12
    a_prompt = [msg("system", "Be helpful."), msg("user", long_q), msg("assistant", "Sure."), msg("user", "Why?")]
    pairs = [pair(a_prompt, "Because.", "Because because because."),  # fits once the first exchange is gone
             pair([msg("user", "Say words.")], "word " * 80, "other " * 80),  # answers must be cut
             pair([msg("user", "Say words.")], "word " * 80 + "A", "word " * 80 + "B"),  # identical once cut
             GOOD]
    path = write_jsonl(tmp_path / "long.jsonl", pairs)
    limit = 64 + 1
    assert len(tokenizer.encode_chat(pairs[0]["rejected"])[0]) > limit  # really overlong
    drop = prepare_pairs(path, tokenizer, tmp_path, max_seq_len=64, overlong="drop")
    assert drop.meta["stats"] == {"truncated": 0, "dropped_too_long": 3}
    assert drop.meta["splits"]["train"]["documents"] == 1

    trunc = prepare_pairs(path, tokenizer, tmp_path, max_seq_len=64, overlong="truncate")
    assert trunc.meta["stats"] == {"truncated": 2, "dropped_too_long": 1}
    ds = PreferenceDataset(trunc, batch_size=1, pad_id=tokenizer.pad_id)
    assert ds.num_examples == 3 and (ds.row_lengths <= limit).all()
    x, y = ds.rows([0])
    # the prompt now starts at the last user turn: system, the long question and its answer are gone
    prompt = int(ds.segments[0, 0])
    assert tokenizer.decode(x[0, :prompt].tolist()) == "<|im_start|>user\nWhy?<|im_end|>\n"
    assert x[1, :len(tokenizer.encode_chat(pairs[0]["rejected"][3:])[0]) - 1].tolist() == \
        tokenizer.encode_chat(pairs[0]["rejected"][3:])[0][:-1]
    # the second pair keeps its prompt and both answers' beginnings, up to the limit; the cut answers keep labels
    assert ds.row_lengths[1].tolist() == [limit, limit]
    x, y = ds.rows([1])
    full = tokenizer.encode_chat(pairs[1]["chosen"])[0]
    assert x[0].tolist() == full[:limit - 1] and y[0, -1].item() == full[limit - 1] != tokenizer.im_end_id
    assert (y != IGNORE_INDEX).sum(dim=1).min() > 40


# -------------------------------------------------------------------------- cache and split
def test_cache_is_reused_and_rebuilt_when_max_seq_len_changes(tmp_path, tokenizer, monkeypatch):
    path = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    first = prepare_pairs(path, tokenizer, tmp_path, max_seq_len=128)
    assert first.path.name.startswith("dpo-") and first.meta["kind"] == "dpo"
    assert sorted(p.name for p in first.path.iterdir()) == sorted(
        [f"{s}.{e}" for s in ("train", "val") for e in ("bin", "idx", "lbl", "seg")] + ["meta.json"])
    builds = []
    real_build = token_cache._build
    monkeypatch.setattr(token_cache, "_build",
                        lambda *a, **k: builds.append(a[3]["max_seq_len"]) or real_build(*a, **k))
    again = prepare_pairs(path, tokenizer, tmp_path, max_seq_len=128)
    assert again.path == first.path and builds == []
    shorter = prepare_pairs(path, tokenizer, tmp_path, max_seq_len=32)
    assert builds == [32] and shorter.path != first.path
    assert shorter.meta["stats"]["truncated"] > 0 and first.meta["stats"]["truncated"] == 0
    dropping = prepare_pairs(path, tokenizer, tmp_path, max_seq_len=32, overlong="drop")
    assert dropping.path not in (first.path, shorter.path) and builds == [32, 32]


def test_train_val_split_is_by_line_like_the_other_kinds(tmp_path, tokenizer, monkeypatch):
    path = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    cache = prepare_pairs(path, tokenizer, tmp_path, max_seq_len=128, val_fraction=0.25)
    monkeypatch.setattr(token_cache, "CHUNK_BYTES", 500)  # many chunks: the same arrays, pair by pair
    chunked = prepare_pairs(path, tokenizer, tmp_path, max_seq_len=128, val_fraction=0.25, cache_dir=tmp_path / "d")
    for split in ("train", "val"):
        for array in ("tokens", "offsets", "labels", "segments"):
            assert np.array_equal(getattr(cache, array)(split), getattr(chunked, array)(split)), (split, array)
    expected = in_validation(np.arange(1, len(PAIRS) + 1), 0.25, DEFAULT_SPLIT_SEED)
    assert 0 < expected.sum() < len(PAIRS)
    for split, want in (("train", ~expected), ("val", expected)):
        ds = PreferenceDataset(cache, split, batch_size=2)
        x, _ = ds.rows(np.arange(ds.num_examples))
        numbers = [int(tokenizer.decode(row.tolist()).split("Question number ")[1].split("?")[0])
                   for row in x[:ds.num_examples]]
        assert numbers == np.flatnonzero(want).tolist()


def test_overlong_is_a_setting_of_sft_and_dpo_runs_only():
    overlong = settings(CacheConfig)["overlong"]
    assert overlong.applies_to(STAGES["dpo"]) and overlong.applies_to(STAGES["sft"])
    assert not overlong.applies_to(STAGES["pretrain"])
    config = parse_config(CacheConfig, ["--data_path", "p.jsonl", "--overlong", "drop"], scope=STAGES["dpo"])
    assert config.data.overlong == "drop"


# ------------------------------------------------------------------------ training_data
def test_training_data_builds_preference_datasets_and_mixtures(tmp_path, tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", PAIRS[:24])
    b = write_jsonl(tmp_path / "b.jsonl", PAIRS[24:])
    common = dict(cache_dir=str(tmp_path / "c"), num_workers=0, val_fraction=0.2)
    one = training_data(DataConfig(data_path=[str(a)], **common), tokenizer, "dpo", 128, 4, 0, log=str)
    assert isinstance(one.train, PreferenceDataset) and one.train.pad_id == tokenizer.pad_id
    assert one.val and all(isinstance(v.data, PreferenceDataset) for v in one.val)

    mixed = training_data(DataConfig(data_path=[str(a), str(b)], **common), tokenizer, "dpo", 128, 4, 0, log=str)
    mix = mixed.train
    assert isinstance(mix, Mixture) and mix.unit == 4
    for k in range(6):  # every batch of the global order comes from one file
        sources = np.searchsorted(mix.offsets, mix.global_indices(4 * k, 4), side="right") - 1
        assert len(set(sources.tolist())) == 1
    # each file's reference is set on its own dataset (the trainer computes and caches them file by file)
    for part in mix.parts:
        ref = np.zeros((part.num_examples, 2), dtype=np.float32)
        for indices, x, y in part.all_pairs_batches(8):
            scores = fake_logprob(y).numpy()
            ref[indices, 0], ref[indices, 1] = scores[:len(indices)], scores[len(indices):]
        part.set_reference(ref)
    # a batch that straddles the two files: chosen rows in the order asked, then the rejected rows
    part_a, part_b = mix.parts
    request = np.array([mix.offsets[1] + 2, 0, mix.offsets[1] + 0])
    x, y, r = mix.batch(request)
    xa, ya, ra = part_a.batch([0])
    xb, yb, rb = part_b.batch([2, 0])
    assert x.shape[0] == 6 and torch.allclose(r, fake_logprob(y))
    for row, (src_x, src_y, src_r, i) in enumerate([(xb, yb, rb, 0), (xa, ya, ra, 0), (xb, yb, rb, 1)]):
        n = len(src_r) // 2
        for side in (0, 1):
            w = src_x.shape[1]
            assert torch.equal(x[row + 3 * side, :w], src_x[i + n * side])
            assert torch.equal(y[row + 3 * side, :w], src_y[i + n * side])
            assert r[row + 3 * side] == src_r[i + n * side]
            assert (y[row + 3 * side, w:] == IGNORE_INDEX).all()


# ----------------------------------------------------------------------------- demo pairs
def test_demo_builder_is_deterministic_and_makes_both_kinds(tmp_path):
    src = write_jsonl(tmp_path / "sft.jsonl", demo_records("sft_demo.jsonl", 300))
    outs = [tmp_path / "one.jsonl", tmp_path / "two.jsonl"]
    for out in outs:
        assert build_dpo_demo.main(["--src", str(src), "--out", str(out), "--max_pairs", "120"]) == 0
    assert outs[0].read_bytes() == outs[1].read_bytes()
    pairs = [r for _, r in read_records(outs[0], "dpo")]
    assert len(pairs) == 120
    kinds = {p["rejected_kind"] for p in pairs}
    assert kinds == {"loop", "mismatch"}
    other_seed = tmp_path / "three.jsonl"
    build_dpo_demo.main(["--src", str(src), "--out", str(other_seed), "--max_pairs", "120", "--seed", "1"])
    assert other_seed.read_bytes() != outs[0].read_bytes()


def test_loop_and_mismatch_answers():
    loop = build_dpo_demo.loop_answer("Restart it. Then check the cable.", "en", __import__("random").Random(0))
    assert loop.startswith("Restart it. Restart it. Restart it.") and set(loop.split(". ")) <= {"Restart it",
                                                                                              "Restart it."}
    assert 2 * 33 <= len(loop) <= 3 * 33
    assert build_dpo_demo.loop_answer("Yes.", "en", __import__("random").Random(0)) is None  # too short to loop
    zh = build_dpo_demo.loop_answer("没问题。您不需要许可。", "zh", __import__("random").Random(0))
    assert zh.startswith("没问题。没问题。") and len(zh) >= 2 * len("没问题。您不需要许可。")
    assert build_dpo_demo.first_sentence("See docs.python.org for more. Then ask.") == "See docs.python.org for more."


def test_shipped_demo_pairs_are_valid_synthetic_and_rebuildable(tmp_path):
    pairs = [r for _, r in read_records(DEMO, "dpo")]  # every line passes validation (no skipping)
    assert len(pairs) == 2000
    sft = {}
    for r in demo_records("sft_demo.jsonl", 10_000):
        sft.setdefault(r["conversations"][-1]["content"], set()).add(r["source"])
    for p in pairs:
        chosen, rejected = p["chosen"][-1]["content"], p["rejected"][-1]["content"]
        assert chosen.strip() != rejected.strip() and chosen in sft
        if p["rejected_kind"] == "mismatch":  # another conversation's answer, from another source
            assert rejected in sft and sft[rejected] - {p["source"]}
        else:
            unit = build_dpo_demo.first_sentence(chosen)
            assert p["rejected_kind"] == "loop" and rejected.count(unit) >= 2
    # the shipped file is exactly what the script builds
    assert build_dpo_demo.main(["--out", str(tmp_path / "rebuilt.jsonl")]) == 0
    assert (tmp_path / "rebuilt.jsonl").read_bytes() == DEMO.read_bytes()
    notice = (ROOT / "dataset" / "demo" / "NOTICE.md").read_text()
    assert "dpo_demo.jsonl" in notice and "synthetic" in notice


def test_shipped_demo_pairs_tokenize(tmp_path, tokenizer):
    cache = prepare_pairs(DEMO, tokenizer, tmp_path, max_seq_len=512, val_fraction=0.05)
    splits = cache.meta["splits"]
    assert splits["train"]["documents"] + splits["val"]["documents"] + cache.meta["stats"]["dropped_too_long"] == 2000
    ds = PreferenceDataset(cache, batch_size=8, pad_id=tokenizer.pad_id)
    x, y = ds.rows(ds.global_indices(0, 8))
    assert x.shape[0] == 16 and (y != IGNORE_INDEX).any(dim=1).all()
    assert json.loads(DEMO.read_text().splitlines()[0])["rejected_kind"] in ("loop", "mismatch")
