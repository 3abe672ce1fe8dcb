"""Save and load finished models for inference: weights (safetensors) + config.json + tokenizer files.

A model directory holds `model.safetensors`, `config.json` (a PocketLM ModelConfig) and, when known, the
tokenizer files. A LoRA checkpoint directory holds `adapter_model.safetensors` and `lora.json` instead of the
weights (model/lora.py); model/checkpoint.py's load_model merges its adapters into the base it names, so every
reader of models takes LoRA runs as they are. A run directory (`out/<run>`) points at its newest model directory
through a `latest` file. Single weight files (.safetensors, or MiniMind-style .pth state dicts) load too, with a
config beside them or given explicitly. Every failure raises CheckpointError with a one-line message naming the file.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from common.errors import CheckpointError
from common.files import BEST_NAME, LATEST_NAME

from .config import ConfigError, ModelConfig
from .model import PocketLM

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
# A LoRA checkpoint's files (model/lora.py), named here so that run directories resolve without importing it.
LORA_CONFIG_NAME = "lora.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"  # PEFT's file name, though with PocketLM's tensor names
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# Prefixes other tools wrap around parameter names: DDP, torch.compile, HF/MiniMind's inner `model.`.
STRIP_PREFIXES = ("module.", "_orig_mod.", "model.")


def copy_tokenizer_files(src_dir: str | Path, dst_dir: str | Path) -> list[str]:
    """Copy whichever tokenizer files exist in src_dir; return their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src_dir) / name).is_file():
            shutil.copy2(Path(src_dir) / name, Path(dst_dir) / name)
            copied.append(name)
    return copied


def save_model(model: PocketLM, out_dir: str | Path, tokenizer_dir: str | Path | None = None,
               weights: dict[str, torch.Tensor] | None = None) -> Path:
    """Write weights + config (+ tokenizer files) into out_dir. Callers wanting atomicity write to a temp dir.
    `weights` replaces the model's own tensors (a DeepSpeed run's fp32 master weights)."""
    from safetensors.torch import save_file

    # a model with adapters (model/lora.py): its tensors would be named "q_proj.base.weight", a file no plain model
    # loads
    if any(name.endswith(".lora_A.weight") for name in model.state_dict()):
        raise CheckpointError("save_model: the model has LoRA adapters; save them with model.lora.save_lora, or "
                              "merge them first with model.lora.merge_lora")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in (weights or model.state_dict()).items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")  # same tensor as embed_tokens.weight; safetensors refuses shared storage
    save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    model.config.save(out / CONFIG_NAME)
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, out)
    return out


def is_lora_dir(path: str | Path) -> bool:
    """Whether `path` is a LoRA checkpoint directory (adapters + lora.json, no model.safetensors)."""
    path = Path(path)
    return path.is_dir() and (path / LORA_CONFIG_NAME).is_file() and not (path / WEIGHTS_NAME).is_file()


def resolve_model_dir(path: str | Path) -> Path:
    """The model directory `path` names: itself, or where a run directory's `latest` pointer (or the pointer
    file given directly, e.g. out/<run>/best) points."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    pointer = path if path.is_file() and path.name in (LATEST_NAME, BEST_NAME) else path / LATEST_NAME
    if not (path / WEIGHTS_NAME).exists() and not is_lora_dir(path) and pointer.is_file():
        target = pointer.parent / pointer.read_text().strip()
        if not (target / WEIGHTS_NAME).is_file() and not is_lora_dir(target):
            raise CheckpointError(f"{pointer}: points at {target}, which holds no {WEIGHTS_NAME} (nor a LoRA "
                                  f"{LORA_CONFIG_NAME})")
        return target
    return path


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors from a .safetensors file or a torch state dict (.pth/.pt/.bin), with wrapper prefixes removed."""
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except Exception as e:  # noqa: BLE001 - any parse failure means "not a weights file"
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"{path}: not a readable weights file ({first_line[:200]})") from None
    for key in ("model", "state_dict", "model_state_dict"):  # common wrappers around a state dict
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: expected a dict of parameter tensors (a model state dict)")
    clean = {}
    for name, tensor in state.items():
        for prefix in STRIP_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
        clean[name] = tensor
    return clean


def check_tensors(expected: dict[str, tuple[int, ...]], state: dict[str, torch.Tensor], source: str,
                  not_matching: str, expecter: str, hint: str) -> None:
    """CheckpointError naming `source` unless `state` holds exactly the expected tensor names and shapes."""
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensors (e.g. {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected tensors (e.g. {unexpected[0]})")
        raise CheckpointError(f"{source}: {not_matching}: {'; '.join(parts)}")
    for name in sorted(expected):
        got, want = tuple(state[name].shape), tuple(expected[name])
        if got != want:
            raise CheckpointError(f"{source}: tensor {name} has shape {got} but {expecter} expects {want} ({hint})")


def load_state_into(model: PocketLM, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy tensors into model after checking names and shapes against its config."""
    expected = model.state_dict()
    state = dict(state)
    if model.config.tie_word_embeddings and "lm_head.weight" in state:
        head = state.pop("lm_head.weight")  # MiniMind .pth files store the tied tensor twice
        emb = state.get("embed_tokens.weight")
        if emb is not None and head.shape == emb.shape and not torch.equal(head, emb):
            raise CheckpointError(f"{source}: lm_head.weight differs from embed_tokens.weight but the config "
                                  "says tie_word_embeddings=true")
    wanted = {k for k in expected if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    layer_ids = {int(k.split(".")[1]) for k in state if k.startswith("layers.") and k.split(".")[1].isdigit()}
    if layer_ids and len(layer_ids) != model.config.num_hidden_layers:
        raise CheckpointError(f"{source}: checkpoint has {len(layer_ids)} layers but the config expects "
                              f"{model.config.num_hidden_layers} (was it trained with another preset or config?)")
    check_tensors({k: tuple(expected[k].shape) for k in wanted}, state, source,
                  "not a PocketLM checkpoint for this config", "the config", "was it trained with another preset "
                  "or config?")
    model.load_state_dict(state, strict=False)  # strictness checked above; lm_head is tied


def checkpoint_config(path: Path) -> ModelConfig:
    """The ModelConfig of a checkpoint's config.json; a broken one is a CheckpointError like the weights'."""
    try:
        return ModelConfig.load(path)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def model_with_weights(config: ModelConfig, weights: Path) -> PocketLM:
    """A PocketLM of `config` holding the tensors of the weights file (checked by name and shape)."""
    model = PocketLM(config)
    load_state_into(model, read_state_dict(weights), str(weights))
    return model


def special_token_ids(tokenizer_dir: str | Path) -> dict[str, int]:
    """Map special-token strings (e.g. '<|im_end|>') to ids from a tokenizer.json, if one is present."""
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        return {}
    try:
        added = json.loads(path.read_text(encoding="utf-8")).get("added_tokens", [])
        return {t["content"]: int(t["id"]) for t in added if t.get("special")}
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: unreadable tokenizer file ({e})") from None
