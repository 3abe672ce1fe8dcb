"""LoRA adapters for PocketLM: wrap the projections, train only the adapters, save them beside a reference to
their frozen base, load them back, and merge them into plain weights.

A LoRA checkpoint directory holds no copy of the base model:

    adapter_model.safetensors   the adapter tensors only (fp32), "layers.0.self_attn.q_proj.lora_A.weight", ...
    lora.json                   {"format_version", "lora": {rank, alpha, targets, dropout}, "base": {path, sha256}}
    config.json                 the model's ModelConfig (as save_model writes it)
    tokenizer files             as for any model directory

The base is named by its absolute directory and the sha256 of its model.safetensors: adapters only mean something
on the exact weights they were trained on, so loading refuses a base that moved away or changed.
Loading for inference merges by default (W + alpha/rank * B @ A is one matmul per projection, as fast as the base).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn as nn

from common.errors import CheckpointError, ConfigError
from common.files import file_sha256, read_json

from .config import ModelConfig, with_rope_scaling
from .loading import (
    ADAPTER_WEIGHTS_NAME,
    CONFIG_NAME,
    LORA_CONFIG_NAME,
    WEIGHTS_NAME,
    check_tensors,
    checkpoint_config,
    copy_tokenizer_files,
    is_lora_dir,
    model_with_weights,
    read_state_dict,
    resolve_model_dir,
)
from .model import PocketLM

FORMAT_VERSION = 1
# The projections that can carry adapters, and the submodule of a Block each lives in. The GELU (GPT-2-style)
# MLP has no gate_proj.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


# --------------------------------------------------------------------------- the spec
@dataclass
class LoraSpec:
    """Which projections get adapters, their rank, and the scale alpha / rank of their update."""

    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.targets, str):  # "q_proj,v_proj", as a flag gives it
            self.targets = tuple(t.strip() for t in self.targets.split(",") if t.strip())
        self.targets = tuple(self.targets)
        self.validate()
        self.alpha = float(self.alpha)  # 32 and 32.0 are one spec (equality, lora.json)

    def validate(self) -> None:
        """Raise ConfigError naming the first bad field."""
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank <= 0:
            raise ConfigError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not self.alpha > 0:
            raise ConfigError(f"LoRA alpha must be a positive number, got {self.alpha!r}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        if not self.targets:
            raise ConfigError(f"LoRA needs at least one target; expected some of {list(LORA_TARGETS)}")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown:
            raise ConfigError(f"unknown LoRA target {unknown[0]!r}; expected some of {list(LORA_TARGETS)}")
        if len(set(self.targets)) != len(self.targets):
            raise ConfigError(f"LoRA targets {list(self.targets)} name a projection twice")

    @property
    def scaling(self) -> float:
        """The factor of the low-rank update B @ A (PEFT's lora_alpha / r)."""
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (lora.json's "lora" object)."""
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets), "dropout": self.dropout}

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "lora config") -> "LoraSpec":
        """Inverse of to_dict; ConfigError naming `source` for unknown keys or bad values."""
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected an object with rank, alpha, targets, dropout")
        unknown = sorted(set(d) - {"rank", "alpha", "targets", "dropout"})
        if unknown:
            raise ConfigError(f"{source}: unknown LoRA keys {unknown}; expected rank, alpha, targets, dropout")
        try:
            return cls(**d)
        except (ConfigError, TypeError) as e:  # TypeError: e.g. targets given as a number
            raise ConfigError(f"{source}: {e}") from None


# ------------------------------------------------------------------------ the adapter
class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update: y = base(x) + B(A(dropout(x))) * alpha / rank."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.base = base
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, **factory)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, **factory)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """PEFT's default: A as nn.Linear's own init, B zero, so a fresh adapter leaves the model unchanged."""
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    # Code that reads a projection's weight (statistics, estimates) keeps working on a wrapped one.
    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        # Outside autocast a bf16 base with fp32 adapters would mix dtypes; under autocast both run in bf16.
        update = self.lora_B(self.lora_A(self.dropout(x.to(self.lora_A.weight.dtype)))) * self.scaling
        return y + update.to(y.dtype)

    def delta_weight(self) -> torch.Tensor:
        """The update as a dense (out, in) matrix in fp32: scaling * B @ A."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}"


def _lora_modules(model: PocketLM) -> Iterator[tuple[nn.Module, str, LoRALinear]]:
    """(parent module, attribute name, adapter) for every LoRALinear, in layer order."""
    for layer in model.layers:
        for target, parent_name in _PARENT.items():
            parent = getattr(layer, parent_name)
            module = getattr(parent, target, None)
            if isinstance(module, LoRALinear):
                yield parent, target, module


def has_lora(model: nn.Module) -> bool:
    """Whether any projection of `model` carries an (unmerged) adapter."""
    return any(isinstance(m, LoRALinear) for m in model.modules())


def lora_parameters(model: PocketLM) -> list[nn.Parameter]:
    """The adapter parameters in named_parameters() order (what the optimizer gets)."""
    return [p for name, p in model.named_parameters() if ".lora_A." in name or ".lora_B." in name]


def apply_lora(model: PocketLM, spec: LoraSpec) -> list[nn.Parameter]:
    """Freeze every parameter of `model`, wrap spec.targets of every layer in LoRALinear; return the adapter
    parameters, the only ones that require grad."""
    spec.validate()
    if has_lora(model):
        raise ConfigError("the model already has LoRA adapters; apply_lora once (or merge_lora first)")
    first = model.layers[0]
    absent = [t for t in spec.targets if not isinstance(getattr(getattr(first, _PARENT[t]), t, None), nn.Linear)]
    if absent:
        present = [t for t in LORA_TARGETS if isinstance(getattr(getattr(first, _PARENT[t]), t, None), nn.Linear)]
        raise ConfigError(f"LoRA target {absent[0]!r} does not exist in this model ({model.config.mlp} MLP); "
                          f"expected some of {present}")
    model.requires_grad_(False)
    for layer in model.layers:
        for target in spec.targets:
            parent = getattr(layer, _PARENT[target])
            base = getattr(parent, target)
            wrapped = LoRALinear(base, spec.rank, spec.alpha, spec.dropout)
            wrapped.train(base.training)
            setattr(parent, target, wrapped)  # same slot in _modules, so parameter order stays layer by layer
    return lora_parameters(model)


def lora_state_dict(model: PocketLM) -> dict[str, torch.Tensor]:
    """The adapter tensors only, named relative to the PocketLM ("layers.0.self_attn.q_proj.lora_A.weight")."""
    return {k: v for k, v in model.state_dict().items() if ".lora_A." in k or ".lora_B." in k}


def adapter_shapes(config: ModelConfig, spec: LoraSpec) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every adapter tensor `spec` gives a model of `config` (built on the meta device: no
    memory, no init)."""
    with torch.device("meta"):
        model = PocketLM(config)
    apply_lora(model, spec)
    return {k: tuple(v.shape) for k, v in lora_state_dict(model).items()}


def check_lora_state(expected: dict[str, tuple[int, ...]], state: dict[str, torch.Tensor], source: str) -> None:
    """Raise CheckpointError naming `source` unless `state` has exactly the expected adapter names and shapes."""
    check_tensors(expected, state, source, "adapters do not match the LoRA targets", "the LoRA spec",
                  "another rank or model shape?")


def load_lora_state_dict(model: PocketLM, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy adapter tensors into a LoRA-wrapped model; names and shapes must match exactly (CheckpointError)."""
    expected = {k: tuple(v.shape) for k, v in lora_state_dict(model).items()}
    if not expected:
        raise CheckpointError(f"{source}: the model has no LoRA adapters to load into (apply_lora first)")
    check_lora_state(expected, state, source)
    model.load_state_dict(state, strict=False)  # strictness checked above; base tensors are not in `state`


def merge_lora(model: PocketLM) -> PocketLM:
    """Fold every adapter into its base weight (W += alpha/rank * B @ A, in fp32) and unwrap it, in place.

    The result is a plain PocketLM: its state_dict is a base checkpoint's, and every parameter requires grad
    again, as in a freshly built model.
    """
    for parent, name, lora in list(_lora_modules(model)):
        base = lora.base
        with torch.no_grad():
            base.weight.copy_((base.weight.float() + lora.delta_weight()).to(base.weight.dtype))
        setattr(parent, name, base)
    model.requires_grad_(True)
    return model


# ---------------------------------------------------------------- files on disk
def base_reference(base_dir: str | Path) -> dict[str, str]:
    """{"path": absolute base model dir, "sha256": of its model.safetensors}; hashing reads the whole file, so
    compute it once per run."""
    model_dir = resolve_model_dir(base_dir)
    weights = model_dir / WEIGHTS_NAME
    if not weights.is_file():
        hint = " (a LoRA run: merge it first with `python -m model.convert --merge_lora`)" if is_lora_dir(
            model_dir) else ""
        raise CheckpointError(f"{model_dir}: no {WEIGHTS_NAME}; LoRA needs a plain PocketLM model as its base{hint}")
    return {"path": str(model_dir.resolve()), "sha256": file_sha256(weights)}


def save_lora(model: PocketLM, out_dir: str | Path, spec: LoraSpec, base_ref: dict[str, str],
              tokenizer_dir: str | Path | None = None) -> Path:
    """Write adapters (fp32) + lora.json + config.json (+ tokenizer files) into out_dir; return it. Callers
    wanting atomicity write to a temporary directory and rename it."""
    from safetensors.torch import save_file

    if not has_lora(model):
        raise ConfigError("save_lora: the model has no LoRA adapters (save plain models with save_model)")
    if not isinstance(base_ref, dict) or not {"path", "sha256"} <= set(base_ref):
        raise ConfigError(f"save_lora: base_ref must be base_reference()'s {{'path', 'sha256'}}, got {base_ref!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous().cpu() for k, v in lora_state_dict(model).items()}
    save_file(state, str(out / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
    info = {"format_version": FORMAT_VERSION, "lora": spec.to_dict(),
            "base": {"path": str(base_ref["path"]), "sha256": str(base_ref["sha256"])}}
    (out / LORA_CONFIG_NAME).write_text(json.dumps(info, indent=2) + "\n")
    model.config.save(out / CONFIG_NAME)
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, out)
    return out


def read_lora_config(model_dir: str | Path) -> tuple[LoraSpec, dict[str, str]]:
    """The spec and base reference ({"path", "sha256"}) of a LoRA checkpoint directory."""
    path = Path(model_dir) / LORA_CONFIG_NAME
    info = read_json(path, CheckpointError, missing="no such file (not a LoRA checkpoint)")
    if not isinstance(info, dict) or not isinstance(info.get("base"), dict):
        raise CheckpointError(f"{path}: expected an object with \"lora\" and \"base\"")
    if info.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {info.get('format_version')!r} is not supported "
                              f"(this code reads {FORMAT_VERSION})")
    base = info["base"]
    if not all(isinstance(base.get(k), str) for k in ("path", "sha256")):
        raise CheckpointError(f"{path}: \"base\" needs string fields path and sha256, got {base!r}")
    try:
        spec = LoraSpec.from_dict(info.get("lora"), source=str(path))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    return spec, base


def _check_base(lora_json: Path, base: dict[str, str]) -> Path:
    """The recorded base's weights file, after checking it is still there and unchanged."""
    weights = Path(base["path"]) / WEIGHTS_NAME
    if not weights.is_file():
        raise CheckpointError(f"{lora_json}: its base {base['path']} is gone (no {WEIGHTS_NAME} there); the "
                              "adapters need the exact weights they were trained on: restore that directory, or "
                              f"set base.path in {LORA_CONFIG_NAME} to where it is now (its sha256 is checked)")
    found = file_sha256(weights)
    if found != base["sha256"]:
        raise CheckpointError(f"{lora_json}: its base {base['path']} changed since the adapters were trained "
                              f"(sha256 {found[:16]}… there, {base['sha256'][:16]}… recorded); restore the original "
                              "base or train the adapters again on this one")
    return weights


def load_lora_model(model_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                    merge: bool = True, rope_scaling: dict[str, Any] | None = None) -> PocketLM:
    """Base (checked against its recorded hash) + adapters of a LoRA checkpoint, merged by default, in eval mode.

    Unmerged (merge=False) the base stays frozen and the adapters require grad, as apply_lora left them.
    Everything is computed in fp32 and cast to `dtype` last, so a bf16 merge rounds once. rope_scaling: as
    model.checkpoint.load_model's.
    """
    model_dir = resolve_model_dir(model_dir)
    spec, base = read_lora_config(model_dir)
    lora_json = model_dir / LORA_CONFIG_NAME
    base_weights = _check_base(lora_json, base)
    # The run's own config.json (its max_seq_len may differ from the base's); the base's when there is none.
    config_path = model_dir / CONFIG_NAME if (model_dir / CONFIG_NAME).is_file() else base_weights.parent / CONFIG_NAME
    config = checkpoint_config(config_path)
    if rope_scaling is not None:
        config = with_rope_scaling(config, rope_scaling)
    model = model_with_weights(config, base_weights)
    model.to(device=device)
    apply_lora(model, spec)
    adapters = model_dir / ADAPTER_WEIGHTS_NAME
    load_lora_state_dict(model, read_state_dict(adapters), str(adapters))
    if merge:
        merge_lora(model)
    return model.to(dtype=dtype).eval()
