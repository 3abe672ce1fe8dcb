"""train_dpo.py on the one loop: ln 2 at the first step, reward accuracy that rises on the demo pairs, reference
log-probs computed once and cached by the reference's weights, exact resume, and DPO with LoRA."""
from __future__ import annotations

import json
import math

import pytest
import torch
from test_train import flags, straight_and_resumed, weights

import train_dpo
from model import load_model

from conftest import ROOT, read_metrics, strict_records


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """The first 200 demo preference pairs."""
    d = tmp_path_factory.mktemp("pairs")
    lines = (ROOT / "dataset/demo/dpo_demo.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)[:200]
    (d / "pairs.jsonl").write_text("".join(lines), encoding="utf-8")
    return {"path": d / "pairs.jsonl", "cache": d / "cache"}


@pytest.fixture(scope="module")
def sft(sft_run):
    return sft_run


def dpo_flags(pairs, tmp_path, init, run="dpo", **over) -> list[str]:
    base = dict(data_path=pairs["path"], init_from=init, preset=None, max_seq_len=128, val_fraction=0.1,
                log_interval=1, learning_rate=1e-3)
    return flags({"pretrain": None, "cache": pairs["cache"]}, tmp_path, run, **{**base, **over})


def reference_files(pairs) -> list:
    return sorted(pairs["cache"].rglob("reference-*.npy"))


def test_first_step_is_ln_2_and_the_reference_is_cached_by_its_weights(pairs, tmp_path, sft, capsys):
    for f in reference_files(pairs):
        f.unlink()
    assert train_dpo.main(dpo_flags(pairs, tmp_path, sft, max_steps=2)) == 0
    err = capsys.readouterr().err
    assert "reference log-probs of" in err and "computed once" in err
    first = read_metrics(tmp_path / "dpo")[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-4)  # the policy starts as the reference
    assert first["reward_margin"] == pytest.approx(0, abs=1e-3)
    for key in ("reward_accuracy", "reward_chosen", "reward_rejected", "logp_chosen", "logp_rejected"):
        assert key in first
    files = reference_files(pairs)
    assert [f.name.split("-")[1] for f in files] == ["train", "val"]
    # a second run from the same model reuses them; another reference model gets its own
    assert train_dpo.main(dpo_flags(pairs, tmp_path, sft, "again", max_steps=1)) == 0
    assert "computed once" not in capsys.readouterr().err and reference_files(pairs) == files
    assert train_dpo.main(dpo_flags(pairs, tmp_path, tmp_path / "dpo", "from_dpo", max_steps=1)) == 0
    assert "computed once" in capsys.readouterr().err and len(reference_files(pairs)) == 4
    info = json.loads((load_model(tmp_path / "dpo")[1] / "train_info.json").read_text())
    assert (info["prompt_format"], info["method"]) == ("chat", "dpo")


def test_reward_accuracy_rises_on_the_demo_pairs(pairs, tmp_path, sft):
    assert train_dpo.main(dpo_flags(pairs, tmp_path, sft, max_steps=60, log_interval=1, eval_interval=60,
                                    beta=0.5)) == 0
    records = read_metrics(tmp_path / "dpo")
    first, last = records[:10], records[-10:]
    assert sum(r["reward_accuracy"] for r in last) / 10 > 0.9, [r["reward_accuracy"] for r in records]
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-3)  # the policy starts as its reference
    assert sum(r["loss"] for r in last) < sum(r["loss"] for r in first) and last[-1]["loss"] < math.log(2)
    [val] = [r for r in strict_records(tmp_path / "dpo") if r.get("val_loss") is not None]
    assert val["val_reward_accuracy"] > 0.6 and val["val_loss"] < math.log(2)  # held-out pairs: 23 here


def test_dpo_resumes_bit_exactly(pairs, tmp_path, sft, monkeypatch):
    straight_and_resumed(monkeypatch, train_dpo.main,
                         lambda run, **o: dpo_flags(pairs, tmp_path, sft, run, max_steps=8, log_interval=2, **o), 4)
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_dpo_with_lora_adapters(pairs, tmp_path, sft):
    assert train_dpo.main(dpo_flags(pairs, tmp_path, sft, max_steps=3, lora_rank=8)) == 0
    run = tmp_path / "dpo"
    first = read_metrics(run)[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-4)
    ckpt = run / (run / "latest").read_text().strip()
    assert (ckpt / "lora.json").is_file() and not (ckpt / "model.safetensors").exists()
    load_model(run)  # evaluable as any checkpoint


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dpo_in_reduced_precision(pairs, tmp_path, sft, dtype):
    """The reference is computed under the run's autocast (cached per precision); fp16 steps go through the loss
    scaler: the first step is still ln 2 within the format's precision, and every step is applied."""
    assert train_dpo.main(dpo_flags(pairs, tmp_path, sft, max_steps=4, dtype=dtype)) == 0
    records = read_metrics(tmp_path / "dpo")
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=2e-3)
    assert all(r["skipped_steps"] == 0 and r["loss"] is not None for r in records)
    assert any(f"-{dtype}.npy" in f.name for f in reference_files(pairs))
