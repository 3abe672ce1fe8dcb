"""Atomic, resumable checkpoints of a run directory.

    out/<run>/latest                          "checkpoints/step_00000200" (updated last)
    out/<run>/best                            the lowest validation loss so far (with early stopping)
    out/<run>/checkpoints/step_00000200/      model.safetensors, config.json, tokenizer files  (inference)
                                              train_info.json                                  (stage, step)
                                              training_state.pt                                (resume)

A checkpoint is written into a temporary directory, fsynced, renamed into place, and only then does `latest`
move to it (itself via a temp file + rename). A crash at any point leaves the previous checkpoint and pointer
intact. The last `keep_last` checkpoints are kept, and the one `best` points to. Weights for inference are
loaded by model.loading; this module owns the training state only.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from common.errors import CheckpointError, ConfigError, TokenizerError
from common.files import BEST_NAME, LATEST_NAME, TRAIN_INFO_NAME, write_atomic
from model.loading import save_model

STATE_NAME = "training_state.pt"
CHECKPOINTS = "checkpoints"


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """Where checkpoint `step` of a run lives once complete."""
    return run_dir / CHECKPOINTS / f"step_{step:08d}"


def staging_dir(run_dir: Path, step: int) -> Path:
    """Where checkpoint `step` is assembled before its rename; every rank can compute it."""
    return run_dir / CHECKPOINTS / f".tmp-step_{step:08d}"


def new_staging_dir(run_dir: Path, step: int) -> Path:
    """An empty staging_dir (debris of an earlier crash at this same step removed); rank 0 calls it."""
    tmp = staging_dir(run_dir, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, training_state: dict[str, Any] | None,
                    info: dict[str, Any], tokenizer_dir: Path | None, keep_last: int = 3,
                    write_model: Callable[[Path], Any] | None = None,
                    weights: dict[str, torch.Tensor] | None = None) -> Path:
    """Complete checkpoint `step` in its staging_dir (which may already hold other ranks' files), rename it into
    place atomically and point `latest` at it; return its directory. `write_model(dir)` replaces the default
    save_model (LoRA runs write their adapters only); `weights` replace the model's tensors in it."""
    final = checkpoint_dir(run_dir, step)
    tmp = staging_dir(run_dir, step)
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        if write_model is not None:
            write_model(tmp)
        else:
            save_model(model, tmp, tokenizer_dir=tokenizer_dir, weights=weights)
        (tmp / TRAIN_INFO_NAME).write_text(json.dumps({**info, "step": step}, indent=2) + "\n")
        if training_state is not None:
            torch.save(training_state, tmp / STATE_NAME)
        _fsync_tree(tmp)
        if final.exists():  # re-saving the same step (e.g. final save right after an interval save)
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_atomic(run_dir / LATEST_NAME, f"{final.relative_to(run_dir)}\n")
    _prune(run_dir, keep_last, keep=final)
    return final


def mark_best(run_dir: Path, checkpoint_dir: Path) -> None:
    """Point `best` at a complete checkpoint of this run (atomically, like `latest`)."""
    write_atomic(run_dir / BEST_NAME, f"{checkpoint_dir.relative_to(run_dir)}\n")


def _prune(run_dir: Path, keep_last: int, keep: Path) -> None:
    root = run_dir / CHECKPOINTS
    best = run_dir / BEST_NAME
    protected = {keep, run_dir / best.read_text().strip()} if best.is_file() else {keep}
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in steps[: max(0, len(steps) - keep_last)]:
        if old not in protected:
            shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-*"):  # debris of a crashed earlier save
        shutil.rmtree(stale, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / LATEST_NAME
    if not pointer.is_file():
        return None
    target = run_dir / pointer.read_text().strip()
    if not target.is_dir():
        raise CheckpointError(f"{pointer} points at {target}, which does not exist")
    return target


def check_resumable(checkpoint_dir: Path, state: dict[str, Any], optimizer: str, tokenizer_sha256: str,
                    tokenizer: Path) -> None:
    """Refuse to resume a checkpoint's training `state` with another --optimizer (its state cannot turn into
    another's mid-run) or another tokenizer."""
    saved = state.get("config", {}).get("optim", {}).get("optimizer")
    if saved not in (None, optimizer):  # e.g. a run begun before pretraining's default was Muon
        raise ConfigError(f"{checkpoint_dir}: trained with --optimizer {saved}, whose state cannot turn into "
                          f"{optimizer}'s mid-run; resume it with --optimizer {saved}")
    if state.get("tokenizer_sha256") not in (None, tokenizer_sha256):
        raise TokenizerError(f"{checkpoint_dir}: trained with another tokenizer (sha256 "
                             f"{state['tokenizer_sha256'][:12]}), not {tokenizer}")


def load_training_state(checkpoint_dir: Path) -> dict[str, Any]:
    path = checkpoint_dir / STATE_NAME
    if not path.is_file():
        raise CheckpointError(f"{checkpoint_dir} has no {STATE_NAME}; it can be used with --init_from, not "
                              "--resume")
    return torch.load(path, map_location="cpu", weights_only=True)
