"""The CUDA paths' host side, exercised on CPU: what a first GPU run would otherwise trip on (pinned batches,
the check script's time limits, benchmark checkpoints, the compile toolchain check)."""
from __future__ import annotations

import torch

from trainer_utils.data import StepFeeder, host_batch

from conftest import tiny_config  # noqa: F401 (keeps conftest's path setup first)


class Pinned:
    """Records pin_memory() calls; CPU-only builds of PyTorch cannot pin, so the call is simulated."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[torch.Tensor] = []

        def pin_memory(t: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            self.calls.append(t)
            return t
        monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)


def test_a_batch_of_views_is_made_contiguous_before_pinning(monkeypatch):
    pinned = Pinned(monkeypatch)
    rows = torch.arange(40).view(4, 10)
    views = (rows[:, :-1], rows[:, 1:])  # what PretrainDataset.batch returns
    assert not any(v.is_contiguous() for v in views)
    out = host_batch(views, pin=True)
    assert len(pinned.calls) == 2 and all(t.is_contiguous() for t in pinned.calls)
    assert all(torch.equal(a, b) for a, b in zip(out, views))
    assert host_batch(views, pin=False)[0].is_contiguous() and len(pinned.calls) == 2  # no pinning for the CPU


def test_the_feeder_hands_a_gpu_pinned_contiguous_batches(corpus, monkeypatch):
    """The pretraining dataset's real batches, through the feeder's producer thread, as for a CUDA device."""
    from dataset.datasets import PretrainDataset
    from dataset.token_cache import prepare
    from dataset.tokenizer import Tokenizer
    pinned = Pinned(monkeypatch)
    cache = prepare(corpus["pretrain"], Tokenizer(), "pretrain", cache_dir=corpus["cache"], log=lambda _: None)
    data = PretrainDataset(cache, "train", 32)
    feeder = StepFeeder(data, 4, 2, rank=0, world_size=1, cursor=0, device=torch.device("cuda"))
    try:
        micro, _ = feeder._queue.get(timeout=30)
    finally:
        feeder.close()
    tensors = [t for batch in micro for t in batch]
    assert len(tensors) == 4 and all(t.is_contiguous() for t in tensors)
    assert len(pinned.calls) >= 4 and all(t.is_contiguous() for t in pinned.calls)


def test_compile_without_a_toolchain_is_one_clear_line(monkeypatch, tmp_path):
    """torch.compile builds C++ (CPU) or Triton's C launchers (GPU): without a compiler or Python's headers the
    run would fail inside a compile worker after start-up; it is refused up front instead."""
    import shutil
    import sysconfig

    import pytest

    from common.errors import ConfigError
    from trainer_utils.stages import parse_train_config
    assert parse_train_config("pretrain", ["--compile"], "").model.compile  # this machine has both
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="needs a C/C.. compiler"):
        parse_train_config("pretrain", ["--compile"], "")
    monkeypatch.undo()
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    with pytest.raises(ConfigError, match="Python.h is missing"):
        parse_train_config("pretrain", ["--compile"], "")
    assert not parse_train_config("pretrain", [], "").model.compile  # no check without --compile


def test_the_model_is_compiled_after_the_backend_wraps_it(corpus, tmp_path, monkeypatch):
    """DDP (or a DeepSpeed engine) first, then torch.compile: dynamo splits the graph at DDP's buckets so the
    all-reduces overlap backward; a compiled module inside DDP would reduce only after the whole backward."""
    from test_train import flags

    from trainer_utils import loop
    from trainer_utils.backend import TorchBackend
    from trainer_utils.stages import parse_train_config

    class Wrapper(torch.nn.Module):  # stands in for DDP, which needs a process group
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    real_wrap = TorchBackend.wrap
    def wrap(self, model, build_optimizer):
        wrapped, optimizer = real_wrap(self, model, build_optimizer)
        return Wrapper(wrapped), optimizer

    monkeypatch.setattr(TorchBackend, "wrap", wrap)
    config = parse_train_config("pretrain", flags(corpus, tmp_path) + ["--compile"], "")
    trainer = loop.Trainer(loop.Session(config, "pretrain"))
    assert isinstance(trainer.wrapped, Wrapper) and trainer.wrapped.module is trainer.model
    assert trainer.step.forward_model._orig_mod is trainer.wrapped  # torch.compile's OptimizedModule around the wrapper


def test_cuda_devices_get_the_attention_policy(monkeypatch):
    """cuDNN attention rebuilds a graph per shape (every decoded token, every SFT batch length): a CUDA device
    turns it off for SDPA, whichever command resolves the device."""
    from model.inference import resolve_device
    saved = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        resolve_device("cpu")
        assert torch.backends.cuda.cudnn_sdp_enabled()  # nothing changes for the CPU
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert resolve_device("auto").type == "cuda"
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(saved)
