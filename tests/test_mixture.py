"""Data mixtures: --data_path a.jsonl:0.7 b.jsonl:0.3 draws exact, seeded, random-access proportions from
per-file caches, trains pretraining and SFT, resumes bit-exactly and reports each file's validation loss."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_train import flags, stop_at, weights

import train_full_sft
import train_pretrain
from common.config import parse_config
from common.errors import ConfigError
from dataset import cache as cache_mod
from dataset import inspect as inspect_mod
from dataset.config import CacheConfig, DataSource, parse_source
from dataset.mixture import Mixture, quotas

from conftest import read_metrics, strict_records


class Order:
    """A stand-in source: `n` samples whose order in epoch e is a seeded permutation (like the real datasets)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.num_examples = n, seed, n

    def __len__(self) -> int:
        return self.n

    def global_indices(self, start: int, count: int) -> np.ndarray:
        g = np.arange(start, start + count)
        return np.array([np.random.default_rng([self.seed, p // self.n]).permutation(self.n)[p % self.n] for p in g],
                        dtype=np.int64)


def decode(mix: Mixture, indices: np.ndarray) -> list[tuple[int, int]]:
    """(source, index in source) of encoded indices."""
    source = np.searchsorted(mix.offsets, indices, side="right") - 1
    return [(int(k), int(i - mix.offsets[k])) for k, i in zip(source, indices)]


def test_quotas_are_largest_remainder_and_sum_to_the_block():
    assert quotas([0.7, 0.3]).tolist() == [700, 300]
    assert quotas([1, 1, 1]).tolist() == [334, 333, 333]
    assert quotas([3, 1], block=10).tolist() == [8, 2]  # 7.5 / 2.5: the tie goes to the first
    assert quotas([0.5, 0.25, 0.25], block=7).tolist() == [3, 2, 2]  # 3.5, 1.75, 1.75


def test_every_block_holds_the_exact_proportions_in_a_seeded_arrangement():
    mix = Mixture([Order(50, 1), Order(7, 2)], [0.7, 0.3], unit=1, seed=5, block=100)
    for b in range(4):
        drawn = [k for k, _ in decode(mix, mix.global_indices(b * 100, 100))]
        assert drawn.count(0) == 70 and drawn.count(1) == 30
    first, second = mix.global_indices(0, 100), mix.global_indices(100, 100)
    assert [k for k, _ in decode(mix, first)] != [k for k, _ in decode(mix, second)]  # not one fixed pattern
    again = Mixture([Order(50, 1), Order(7, 2)], [0.7, 0.3], unit=1, seed=5, block=100)
    assert np.array_equal(again.global_indices(0, 400), mix.global_indices(0, 400))
    other = Mixture([Order(50, 1), Order(7, 2)], [0.7, 0.3], unit=1, seed=6, block=100)
    assert not np.array_equal(other.global_indices(0, 400), mix.global_indices(0, 400))


def test_each_source_is_read_in_its_own_order_and_repeats_by_epochs():
    """Source k's samples appear in the mixture exactly in its own order: an over-weighted small source starts
    its next epoch (a new permutation), a large one continues where it was."""
    parts = [Order(50, 1), Order(7, 2)]
    mix = Mixture(parts, [0.7, 0.3], unit=1, seed=5, block=100)
    drawn = decode(mix, mix.global_indices(0, 300))
    for k, part in enumerate(parts):
        seen = [i for s, i in drawn if s == k]
        assert seen == part.global_indices(0, len(seen)).tolist()
    assert len([i for s, i in drawn if s == 1]) == 90  # 90 samples of a 7-sample source: almost 13 epochs


@pytest.mark.parametrize("unit", [1, 4])
def test_random_access_equals_reading_the_stream_in_order(unit):
    """What a resume or a DDP rank asks for (any start, any count) is the same as the uninterrupted stream."""
    mix = Mixture([Order(30, 1), Order(11, 2), Order(5, 3)], [0.5, 0.3, 0.2], unit=unit, seed=0, block=20)
    stream = mix.global_indices(0, 700)
    rng = np.random.default_rng(0)
    for start, count in [(0, 1), (19, 3), (79, 2), (81, 200), *zip(rng.integers(0, 600, 20), rng.integers(1, 99, 20))]:
        assert np.array_equal(mix.global_indices(int(start), int(count)), stream[start:start + count]), (start, count)


def test_units_keep_sft_batches_whole_and_from_one_source():
    parts = [Order(40, 1), Order(24, 2)]
    mix = Mixture(parts, [0.5, 0.5], unit=8, seed=0, block=10)
    taken = {0: 0, 1: 0}
    for b in range(20):
        batch = decode(mix, mix.global_indices(b * 8, 8))
        [k] = {s for s, _ in batch}
        # the source's own batch: its positions j*8 .. j*8+7
        assert [i for _, i in batch] == parts[k].global_indices(taken[k] * 8, 8).tolist()
        taken[k] += 1


def test_a_weight_below_the_resolution_is_refused():
    with pytest.raises(ConfigError, match="tiny: weight 0.0001 of the mixture is below its resolution"):
        Mixture([Order(5, 1), Order(5, 2)], [0.9999, 0.0001], unit=1, seed=0, names=["big", "tiny"])


@pytest.mark.parametrize("spec,source", [
    ("a.jsonl", DataSource("a.jsonl")), ("a.jsonl:0.7", DataSource("a.jsonl", 0.7)),
    ("dir/a.jsonl:3", DataSource("dir/a.jsonl", 3.0)), ("C:/data/a.jsonl", DataSource("C:/data/a.jsonl")),
    ("s3:bucket.jsonl", DataSource("s3:bucket.jsonl")),
])
def test_data_path_weights_parse(spec, source):
    assert parse_source(spec) == source


@pytest.mark.parametrize("argv,message", [
    (["a.jsonl:0"], "the weight must be a positive number, got 0"),
    (["a.jsonl:-1"], "must be a positive number"),
    (["a.jsonl:nan"], "must be a positive number"),
    (["a.jsonl:0.5", "b.jsonl"], "give a weight to every file"),
    (["a.jsonl", "./a.jsonl"], "names a.jsonl, ./a.jsonl more than once"),
])
def test_bad_mixtures_are_one_line_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(CacheConfig, ["--data_path", *argv])


def mixed(two_sources, stage: str, weights: tuple[float, float] | None = (0.7, 0.3)) -> list[str]:
    a, b = (two_sources[f"{'sft' if stage == 'sft' else 'pretrain'}_{x}"] for x in "ab")
    if weights is None:
        return ["--data_path", str(a), str(b)]
    return ["--data_path", f"{a}:{weights[0]}", f"{b}:{weights[1]}"]


def corpus_of(two_sources) -> dict:
    """The `corpus` argument of test_train.flags, without its single --data_path."""
    return {"pretrain": None, "cache": two_sources["cache"]}


def run_flags(two_sources, tmp_path, run: str, stage: str, **over) -> list[str]:
    return flags(corpus_of(two_sources), tmp_path, run, data_path=None, val_fraction=0.1, **over) + \
        mixed(two_sources, stage)


@pytest.mark.parametrize("stage", ["pretrain", "sft"])
def test_a_mixture_trains_resumes_bit_exactly_and_reports_each_files_validation_loss(two_sources, tmp_path,
                                                                                      monkeypatch, stage):
    main = (train_full_sft if stage == "sft" else train_pretrain).main
    assert main(run_flags(two_sources, tmp_path, "straight", stage)) == 0
    stop_at(monkeypatch, 4)
    assert main(run_flags(two_sources, tmp_path, "resumed", stage)) == 0
    monkeypatch.undo()
    assert main(run_flags(two_sources, tmp_path, "resumed", stage, resume=True)) == 0
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [m["step"] for m in read_metrics(tmp_path / "resumed")] == [2, 4, 6, 8]

    names = ("chat_a", "chat_b") if stage == "sft" else ("first", "second")
    [val] = [r for r in strict_records(tmp_path / "straight") if r.get("val_loss") is not None and r["step"] == 8]
    each = [val[f"val_loss/{n}"] for n in names]
    assert each[0] != each[1]  # each file its own split (a shared --cache_dir once gave both the last file's)
    assert val["val_loss"] == pytest.approx(0.7 * each[0] + 0.3 * each[1], abs=2e-5)  # weighted as trained
    mixture = json.loads((tmp_path / "straight/train_config.json").read_text())["resolved"]["data_mixture"]
    assert [(m["name"], m["weight"]) for m in mixture] == list(zip(names, (0.7, 0.3)))


def test_default_weights_are_proportional_to_size_and_one_file_is_unchanged(two_sources, tmp_path):
    argv = flags(corpus_of(two_sources), tmp_path, "mix", data_path=None, max_steps=2, val_fraction=0.1)
    assert train_pretrain.main(argv + mixed(two_sources, "pretrain", weights=None)) == 0
    resolved = json.loads((tmp_path / "mix/train_config.json").read_text())["resolved"]
    sizes = [m["train_samples"] for m in resolved["data_mixture"]]
    assert [m["weight"] for m in resolved["data_mixture"]] == [round(s / sum(sizes), 6) for s in sizes]
    assert resolved["train_samples"] == sum(sizes)
    # a single file (weighted or not) is read exactly as before mixtures existed: no data_mixture, no per-file loss
    one = flags(corpus_of(two_sources), tmp_path, "one", data_path=f"{two_sources['pretrain_a']}:2",
                max_steps=2, val_fraction=0.1, eval_interval=2)
    assert train_pretrain.main(one) == 0
    resolved = json.loads((tmp_path / "one/train_config.json").read_text())["resolved"]
    assert "data_mixture" not in resolved
    assert not [k for r in strict_records(tmp_path / "one") for k in r if k.startswith("val_loss/")]


def test_cache_and_inspect_take_a_mixture(two_sources, capsys):
    common = ["--cache_dir", str(two_sources["cache"]), "--num_workers", "0"]
    assert cache_mod.main(mixed(two_sources, "pretrain") + common) == 0
    out = capsys.readouterr().out
    assert out.count("cache: ") == 2
    argv = mixed(two_sources, "sft") + common + ["--kind", "sft", "--batch_size", "2", "--max_seq_len", "128"]
    assert inspect_mod.main(argv) == 0
    assert "== sample 2/2" in capsys.readouterr().out
