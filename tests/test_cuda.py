"""CUDA-only checks (marked `cuda`; skipped without a GPU): precision paths, flash attention, fused AdamW, compile.

bench/gpu_check.sh runs these on a GPU machine; the CPU suite covers the same logic elsewhere.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from model import KVCache, PocketLM

from conftest import ROOT, read_metrics, tiny_config

# bench/gpu_check.sh sets POCKETLM_REQUIRE_CUDA=1: there a missing GPU must fail, not skip.
if not torch.cuda.is_available() and os.environ.get("POCKETLM_REQUIRE_CUDA") == "1":
    raise RuntimeError("POCKETLM_REQUIRE_CUDA=1 but torch.cuda.is_available() is False")
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _train(tmp_path, *extra: str) -> list[dict]:
    import train_pretrain
    argv = ["--preset", "tiny", "--max_steps", "6", "--batch_size", "8", "--log_interval", "1",
            "--eval_interval", "3", "--save_interval", "3", "--out_dir", str(tmp_path), "--run_name", "r",
            "--data_path", str(ROOT / "dataset/demo/pretrain_demo.jsonl"), "--device", "cuda",
            "--learning_rate", "3e-3", "--warmup_steps", "1", *extra]  # moves the loss clearly within 6 steps
    assert train_pretrain.main(argv) == 0
    return read_metrics(tmp_path / "r")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])  # float32 runs its matmuls in TF32
def test_training_steps_per_precision(tmp_path, dtype):
    records = _train(tmp_path, "--dtype", dtype)
    losses = [r["loss"] for r in records]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0] - 0.05, losses
    assert all("peak_mem_gb" in r for r in records)
    if dtype == "float16":
        state = torch.load(tmp_path / "r/checkpoints/step_00000006/training_state.pt", weights_only=True)
        assert state["backend"]["scaler"]["scale"] > 0


def test_flash_attention_serves_the_training_path():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    model = PocketLM(tiny_config(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)).cuda().bfloat16()
    x = torch.randint(0, 256, (2, 64), device="cuda")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # raises if flash cannot run this call
        out = model(x)
    torch.testing.assert_close(out.float(), model(x).float(), atol=2e-2, rtol=0)


def test_fused_adamw_is_used_on_cuda():
    from trainer_utils.optim import build_optimizer
    model = PocketLM(tiny_config()).cuda()
    opt = build_optimizer(model, "adamw", 1e-3, 0.1, (0.9, 0.95), 0.9, torch.device("cuda"))
    assert opt.defaults["fused"] is True


def test_kv_cache_matches_full_recompute_on_cuda():
    model = PocketLM(tiny_config()).cuda().eval()
    ids = torch.randint(0, 256, (1, 40), device="cuda")
    full = model(ids)
    cache = KVCache(model.config, 1, 40, device="cuda")
    steps = [model(ids[:, :12], kv_cache=cache)] + [model(ids[:, t:t + 1], kv_cache=cache) for t in range(12, 40)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=0)


def test_compile_on_cuda(tmp_path):
    records = _train(tmp_path, "--dtype", "bfloat16", "--compile")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
