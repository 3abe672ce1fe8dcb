"""Loading any PocketLM checkpoint for use: a run dir, a checkpoint or model dir (plain weights, or LoRA adapters
with the base they name, merged), or a bare weights file. Above both model/loading.py (plain weights) and
model/lora.py (adapters), which import nothing from here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .config import ModelConfig, with_rope_scaling
from .loading import (
    CONFIG_NAME,
    LATEST_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    checkpoint_config,
    is_lora_dir,
    model_with_weights,
    resolve_model_dir,
)
from .lora import load_lora_model
from .model import PocketLM


def load_model(path: str | Path, config: ModelConfig | None = None, device: torch.device | str = "cpu",
               dtype: torch.dtype | None = None, rope_scaling: dict[str, Any] | None = None
               ) -> tuple[PocketLM, Path]:
    """Load a model from a run dir, a model dir, or a weights file; return (model in eval mode, its dir).

    The config comes from `config` if given, else from config.json next to the weights. A LoRA checkpoint
    loads as its base with the adapters merged (model.lora.load_lora_model). rope_scaling (ModelConfig's format,
    e.g. parse_rope_scaling("yarn:4")) replaces the config's for contexts longer than the trained one
    (with_rope_scaling); None keeps the config's own.
    """
    path = resolve_model_dir(path)
    if is_lora_dir(path):
        if config is not None:
            raise CheckpointError(f"{path}: a LoRA checkpoint brings its own config.json; load it without a "
                                  "preset or config")
        return load_lora_model(path, device=device, dtype=dtype, merge=True, rope_scaling=rope_scaling), path
    weights = path / WEIGHTS_NAME if path.is_dir() else path
    model_dir = weights.parent
    if path.is_dir() and not weights.is_file():
        raise CheckpointError(f"{path}: no {WEIGHTS_NAME} here and no `{LATEST_NAME}` pointer "
                              "(expected a PocketLM run or model directory)")
    if config is None:
        config_path = model_dir / CONFIG_NAME
        if not config_path.is_file():
            raise CheckpointError(f"{weights}: no {CONFIG_NAME} beside it; pass a preset or config explicitly")
        config = checkpoint_config(config_path)
    if rope_scaling is not None:
        config = with_rope_scaling(config, rope_scaling)
    model = model_with_weights(config, weights)
    model.to(device=device, dtype=dtype).eval()
    return model, model_dir
