"""Model configuration: one dataclass, named presets, validation and a closed-form parameter count."""
from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.config import option
from common.errors import ConfigError
from common.files import read_json

# Marks a config.json as ours, so it is never confused with a transformers config.json.
MODEL_TYPE = "pocketlm"
DEFAULT_PRESET = "minimind-26m"

# A switch is a ModelConfig field that has a flag of the same name (--hidden_size, --qk_norm, ...), declared once
# here: the trainers' and `python -m model`'s flags, the checks of --init_from and --resume, and architecture()
# derive from it. Its role says what the flag does:
#   shape         reshapes the preset (head size kept); refused with --init_from (the weights bring their shape)
#   context       the training context; longer than the preset's grows the position table
#   architecture  set on a new model; refused with --init_from; must agree on --resume
#   init          how a new model's weights start: refused with --init_from, meaningless on --resume
#   training      how the model trains, not what it is: applies to --init_from weights too; must agree on --resume
SWITCH_ROLES = ("shape", "context", "architecture", "init", "training")


def switch(default: Any, role: str, help: str, **checks: Any) -> Any:
    """A ModelConfig field with a flag: its default (the config's), role, help line and bounds (common.config)."""
    assert role in SWITCH_ROLES, role
    return field(default=default, metadata={"role": role, "help": help, **checks})


@dataclass
class ModelConfig:
    """Shape and architecture switches of a PocketLM decoder (Llama-style by default, GPT-2-style by flags)."""

    vocab_size: int = 6400
    hidden_size: int = switch(512, "shape", "override the preset's width (head size kept)", at_least=1)
    num_hidden_layers: int = switch(8, "shape", "override the preset's depth", at_least=1)
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    # None -> 64 * ceil(8/3 * d / 64) for SwiGLU (same parameter budget as a 4d GELU MLP), 4 * d for GELU.
    intermediate_size: int | None = None
    max_seq_len: int = switch(512, "context", "training context in tokens (default: the model's)", at_least=1)
    # Longest sequence generation may reach. RoPE extrapolates past max_seq_len; learned positions cannot.
    max_position_embeddings: int = 32768
    rope_theta: float = switch(1e4, "architecture", "RoPE base frequency (default: the preset's, 10000)", above=0)
    # RoPE scaling for contexts longer than the one trained, in transformers' format (what the HF and GGUF exports
    # write, and what llama.cpp reads back): None, {"rope_type": "linear", "factor": F} or {"rope_type": "yarn",
    # "factor": F, "original_max_position_embeddings": N, ...}. Chosen when a model is loaded (with_rope_scaling,
    # eval_model.py / serve_openai_api.py --rope_scaling), not when it trains: the weights are the same.
    rope_scaling: dict[str, Any] | None = None
    norm_eps: float = 1e-5
    dropout: float = switch(0.0, "training", "dropout probability (default: the model's, 0 for presets); takes "
                                             "effect with --init_from too", at_least=0, below=1)
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    # Architecture switches. Llama style: rmsnorm + rope + swiglu, no biases.
    # GPT-2 style: layernorm + learned + gelu, with biases.
    norm: str = "rmsnorm"  # "rmsnorm" | "layernorm"
    position_embedding: str = "rope"  # "rope" | "learned"
    mlp: str = "swiglu"  # "swiglu" | "gelu" (tanh approximation, as GPT-2)
    bias: bool = False
    # QK-norm: RMSNorm of each head's queries and keys (over head_dim, a learned weight each) before RoPE, as
    # Qwen3, OLMo 2 and modded-nanogpt do. It bounds the attention logits, so higher learning rates train
    # stably. A Llama-style model with it is Qwen3-style (exports as Qwen3ForCausalLM / llama.cpp's qwen3).
    qk_norm: bool = switch(False, "architecture", "RMSNorm of each head's queries and keys before RoPE (Qwen3, "
                                                  "OLMo 2): bounds attention logits for higher learning rates; "
                                                  "exports as Qwen3")
    # An init choice, not architecture: start the residual branches' output projections (o_proj, down_proj,
    # the experts' down_proj) at zero, so every block starts as the identity (modded-nanogpt).
    zero_init_residual: bool = switch(False, "init", "start the blocks' output projections (o_proj, down_proj) at "
                                                     "zero, so each block starts as the identity (modded-nanogpt)")
    # Mixture of experts (model/model.py MoE): num_experts > 0 replaces every block's MLP by num_experts routed
    # SwiGLU experts of moe_intermediate_size (default: intermediate_size), of which each token uses
    # num_experts_per_tok, plus num_shared_experts that every token uses. norm_topk_prob rescales the chosen
    # experts' router probabilities to sum to 1 (refused with top-1: every weight would be 1 and the router would
    # get no gradient from the language-model loss). The router_* coefficients are training choices: the
    # load-balancing loss (1.0 when perfectly balanced), the router z-loss, and the step size of the
    # auxiliary-loss-free balancing bias (0 = off). See docs/moe.md.
    num_experts: int = switch(0, "architecture", "routed experts per block, 0 = a dense MLP (default: the "
                                                 "preset's)", at_least=0)
    num_experts_per_tok: int = switch(2, "architecture", "experts each token is routed to (top-k)", at_least=1)
    num_shared_experts: int = switch(0, "architecture", "experts every token uses besides its routed ones",
                                     at_least=0)
    moe_intermediate_size: int | None = switch(None, "architecture", "each expert's hidden width (default: the "
                                                                     "dense MLP's)", at_least=1)
    norm_topk_prob: bool = switch(True, "architecture", "rescale the chosen experts' router probabilities to sum "
                                                        "to 1 (not with top-1; default: on for top-k > 1)")
    router_aux_loss_coef: float = switch(0.01, "training", "weight of the load-balancing loss (1.0 when balanced; "
                                                           "default 0.01)", at_least=0)
    router_z_loss_coef: float = switch(0.0, "training", "weight of the router z-loss (default 0)", at_least=0)
    router_bias_update_rate: float = switch(0.0, "training", "auxiliary-loss-free balancing: step of the "
                                                             "per-expert routing bias after each optimizer step "
                                                             "(0 = off, DeepSeek-V3 uses 0.001)", at_least=0)
    # Runtime switch, not part of the architecture: recompute each block in backward to save activations.
    gradient_checkpointing: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if self.intermediate_size is None and isinstance(self.hidden_size, int):
            d = self.hidden_size
            self.intermediate_size = 64 * math.ceil(8 * d / 3 / 64) if self.mlp == "swiglu" else 4 * d
        if self.moe_intermediate_size is None and isinstance(self.num_experts, int) and self.num_experts > 0:
            self.moe_intermediate_size = self.intermediate_size
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise ConfigError naming the first inconsistency found."""
        choices = {"norm": ("rmsnorm", "layernorm"), "position_embedding": ("rope", "learned"),
                   "mlp": ("swiglu", "gelu")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r} is not supported; expected one of {allowed}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size", "max_seq_len", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                              f"({self.num_attention_heads})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if self.position_embedding == "rope" and self.head_dim % 2:
            raise ConfigError(f"RoPE needs an even head dimension, got {self.head_dim} "
                              f"(hidden_size {self.hidden_size} / {self.num_attention_heads} heads)")
        if self.max_position_embeddings < self.max_seq_len:
            raise ConfigError(f"max_position_embeddings ({self.max_position_embeddings}) must be >= "
                              f"max_seq_len ({self.max_seq_len})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ConfigError("rope_theta and norm_eps must be positive")
        for name in ("qk_norm", "zero_init_residual"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.rope_scaling is not None:
            if self.position_embedding != "rope":
                raise ConfigError("rope_scaling applies to RoPE models; this one has position_embedding="
                                  f"{self.position_embedding!r}")
            check_rope_scaling(self.rope_scaling)
        if self.qk_norm and self.norm != "rmsnorm":
            raise ConfigError(f"qk_norm normalises queries and keys with RMSNorm (as Qwen3 and OLMo 2 do); it needs "
                              f"norm='rmsnorm', got norm={self.norm!r}")
        self._validate_moe()

    def _validate_moe(self) -> None:
        for name in ("num_experts", "num_shared_experts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")
        for name in ("router_aux_loss_coef", "router_z_loss_coef", "router_bias_update_rate"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
                raise ConfigError(f"{name} must be a non-negative number, got {value!r}")
        if not self.moe:
            return
        if self.mlp != "swiglu":
            raise ConfigError(f"mixture-of-experts layers use SwiGLU experts; mlp={self.mlp!r} is not supported "
                              "with num_experts > 0")
        k, f = self.num_experts_per_tok, self.moe_intermediate_size
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok must be between 1 and num_experts ({self.num_experts}), got {k!r}")
        if not isinstance(f, int) or isinstance(f, bool) or f <= 0:
            raise ConfigError(f"moe_intermediate_size must be a positive integer, got {f!r}")
        if k == 1 and self.norm_topk_prob:
            raise ConfigError("norm_topk_prob with num_experts_per_tok=1 makes every gate weight exactly 1, so the "
                              "language-model loss never reaches the router; set norm_topk_prob=false (Switch-style: "
                              "the expert's output is scaled by its router probability)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def moe(self) -> bool:
        """Whether the blocks' MLPs are mixtures of experts."""
        return self.num_experts > 0

    @property
    def style(self) -> str:
        """'llama', 'qwen3' (Llama with QK-norm) or 'gpt2' when the switches match one of the reference
        architectures, 'moe' for a Llama-style model with mixture-of-experts MLPs (without QK-norm), else 'custom'.
        The exports choose their architecture by it."""
        if self.moe:  # (a Qwen3-MoE mapping for QK-norm would be possible; not implemented)
            llama_like = (self.norm, self.position_embedding, self.bias) == ("rmsnorm", "rope", False)
            return "moe" if llama_like and not self.qk_norm else "custom"
        if (self.norm, self.position_embedding, self.mlp, self.bias) == ("rmsnorm", "rope", "swiglu", False):
            return "qwen3" if self.qk_norm else "llama"
        if (self.norm, self.position_embedding, self.mlp) == ("layernorm", "learned", "gelu"):
            return "gpt2"
        return "custom"

    # ------------------------------------------------------------- parameters
    def num_parameters(self, non_embedding: bool = False, active: bool = False) -> int:
        """Closed-form parameter count; tests check it against the instantiated module. active=True counts the
        experts a token uses (num_experts_per_tok of the routed ones), which is what sets a step's compute."""
        d, f, L, V = self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.vocab_size
        kv = self.num_key_value_heads * self.head_dim
        b = int(self.bias)
        norm = d * (2 if self.norm == "layernorm" and self.bias else 1)
        attn = (d * d + b * d) * 2 + (d * kv + b * kv) * 2  # q, o and k, v
        if self.moe:  # router + routed experts + shared experts, SwiGLU without biases
            routed = self.num_experts_per_tok if active else self.num_experts
            mlp = d * self.num_experts + 3 * d * self.moe_intermediate_size * (routed + self.num_shared_experts)
        else:
            mlp = (3 if self.mlp == "swiglu" else 2) * d * f + b * ((2 * f if self.mlp == "swiglu" else f) + d)
        qk_norm = 2 * self.head_dim if self.qk_norm else 0  # one weight per head dimension, shared by the heads
        per_layer = attn + qk_norm + mlp + 2 * norm
        embeddings = V * d + (self.max_position_embeddings * d if self.position_embedding == "learned" else 0)
        head = 0 if self.tie_word_embeddings else V * d
        total = L * per_layer + norm + embeddings + head
        return total - embeddings - head if non_embedding else total

    # -------------------------------------------------------------- JSON I/O
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("gradient_checkpointing")
        return {"model_type": MODEL_TYPE, **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "ModelConfig":
        if d.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ConfigError(f"{source}: model_type is {d.get('model_type')!r}, expected {MODEL_TYPE!r} "
                              "(a transformers directory? import it with `python -m model.convert --from_hf`)")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known - {"model_type"})
        if unknown:
            raise ConfigError(f"{source}: unknown config keys {unknown}; expected a subset of {sorted(known)}")
        try:
            return cls(**{k: v for k, v in d.items() if k in known})
        except TypeError as e:  # e.g. a string where an int belongs breaks arithmetic in __post_init__
            raise ConfigError(f"{source}: {e}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        d = read_json(path, ConfigError)
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: expected a JSON object, got {type(d).__name__}")
        return cls.from_dict(d, source=str(path))


# ------------------------------------------------------------------ RoPE scaling
ROPE_SCALING_TYPES = ("linear", "yarn")
# The keys each type may carry, named and meant as in transformers' rope_parameters (modeling_rope_utils.py):
# YaRN's beta_fast / beta_slow bound the ramp between extrapolated and interpolated frequencies (default 32 / 1),
# attention_factor scales cos and sin (default 0.1 ln(factor) + 1, or from mscale / mscale_all_dim when both are
# given), truncate rounds the ramp's ends to whole dimensions (default true).
ROPE_SCALING_KEYS = {"linear": ("rope_type", "factor"),
                     "yarn": ("rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                              "attention_factor", "mscale", "mscale_all_dim", "truncate")}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_rope_scaling(scaling: Any) -> None:
    """Raise ConfigError unless `scaling` is a RoPE scaling PocketLM computes (see ModelConfig.rope_scaling)."""
    if not isinstance(scaling, dict):
        raise ConfigError(f"rope_scaling must be an object such as {{\"rope_type\": \"yarn\", \"factor\": 4, "
                          f"\"original_max_position_embeddings\": 512}}, got {scaling!r}")
    kind = scaling.get("rope_type")
    if kind not in ROPE_SCALING_TYPES:
        raise ConfigError(f"rope_scaling: rope_type {kind!r} is not supported; expected one of {ROPE_SCALING_TYPES}")
    unknown = sorted(set(scaling) - set(ROPE_SCALING_KEYS[kind]))
    if unknown:
        raise ConfigError(f"rope_scaling: unknown keys {unknown} for {kind}; expected a subset of "
                          f"{list(ROPE_SCALING_KEYS[kind])}")
    factor = scaling.get("factor")
    if not _is_number(factor) or factor < 1:
        raise ConfigError(f"rope_scaling: factor must be a number >= 1 (the context is stretched, never shrunk), "
                          f"got {factor!r}")
    if kind == "linear":
        return
    original = scaling.get("original_max_position_embeddings")
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        raise ConfigError("rope_scaling: yarn needs original_max_position_embeddings, the context the model was "
                          f"trained at (a positive integer), got {original!r}")
    for name in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
        if name in scaling and (not _is_number(scaling[name]) or scaling[name] <= 0):
            raise ConfigError(f"rope_scaling: {name} must be a positive number, got {scaling[name]!r}")
    if scaling.get("beta_fast", 32) < scaling.get("beta_slow", 1):
        raise ConfigError(f"rope_scaling: beta_fast ({scaling.get('beta_fast', 32)}) must be at least beta_slow "
                          f"({scaling.get('beta_slow', 1)})")
    if not isinstance(scaling.get("truncate", True), bool):
        raise ConfigError(f"rope_scaling: truncate must be true or false, got {scaling['truncate']!r}")


def parse_rope_scaling(text: str) -> dict[str, Any]:
    """--rope_scaling's value, "linear:F" or "yarn:F", as a scaling without YaRN's original context (which
    with_rope_scaling takes from the model)."""
    kind, _, factor = text.strip().lower().partition(":")
    try:
        value = float(factor)
    except ValueError:
        value = None
    if kind not in ROPE_SCALING_TYPES or value is None or not math.isfinite(value) or value < 1:
        raise ConfigError(f"--rope_scaling {text!r}: expected TYPE:FACTOR with TYPE linear or yarn and FACTOR a "
                          "number >= 1 (e.g. yarn:4 or linear:2)")
    return {"rope_type": kind, "factor": value}


def with_rope_scaling(config: ModelConfig, scaling: dict[str, Any]) -> ModelConfig:
    """`config` with RoPE scaling `scaling` (replacing any it had), for inference.

    YaRN's original_max_position_embeddings defaults to the training context: the one a scaling the config
    already has names (an imported YaRN model's), else max_seq_len, the positions the model has seen.
    max_position_embeddings becomes factor x that context, the context the scaling is for: the
    rotary tables and KV caches cover it, and beyond it positions would be extrapolated again (transformers
    reads the same ratio from an export's config.json).
    """
    scaling = dict(scaling)
    trained = (config.rope_scaling or {}).get("original_max_position_embeddings", config.max_seq_len)
    if scaling.get("rope_type") == "yarn":
        scaling.setdefault("original_max_position_embeddings", trained)
    check_rope_scaling(scaling)
    original = scaling.get("original_max_position_embeddings", trained)
    return dataclasses.replace(config, rope_scaling=scaling,
                               max_position_embeddings=math.ceil(scaling["factor"] * original))


# ---------------------------------------------------------------------- presets
# MiniMind shapes (vocab 6400, GQA with 2 KV heads) and a GPT-2-style 100M model with a 16384 vocabulary.
PRESETS: dict[str, dict[str, Any]] = {
    # RoPE θ is per preset: 1e4 (Llama 2) for contexts of a few thousand tokens; θ = 1e6 measured no better at the
    # demo's 256 (dev/LOG.md), it matters for long contexts (MiniMind's current models use it: --rope_theta 1e6)
    "minimind-26m": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                         rope_theta=1e4),
    "minimind-104m": dict(hidden_size=768, num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=2,
                          rope_theta=1e4),
    "mini-30m": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
                     rope_theta=1e4),
    "gpt2-100m": dict(vocab_size=16384, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                      num_key_value_heads=12, max_seq_len=512, max_position_embeddings=512,
                      norm="layernorm", position_embedding="learned", mlp="gelu", bias=True),
    # MiniMind2-MoE's shape: 4 routed experts (top-2) + 1 shared, each as wide as the dense MLP. 2 of 4 routed
    # plus the shared one: a token uses 3 MLPs' worth of weights.
    "minimind-moe": dict(hidden_size=640, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                         num_experts=4, num_experts_per_tok=2, num_shared_experts=1),
    # The MoE counterpart of minimind-26m at equal compute: 8 fine-grained experts of half the dense MLP's width,
    # top-2, so a token's active parameters (and FLOPs) equal minimind-26m's while the model holds 4x the MLP
    # weights. What bench/bench_train.py compares against the dense preset.
    "minimind-26m-moe": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=704),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_seq_len=64, max_position_embeddings=256),
}


# The depth family: models sized by one knob, their number of layers, every other dimension derived from it (as
# nanochat derives its models from their depth): 64 wide per layer, so heads of 64, one per layer; two key-value heads
# where the heads divide by two (else one per head); QK-norm (which keeps attention logits bounded at the high
# learning rate of a short run); a context of 256. `--preset depth-N` names one. The demo's model is depth 4, and
# mini-30m has depth 6's shape but for its key-value heads.
DEPTH_PREFIX = "depth-"
MAX_DEPTH = 48
DEPTH_WIDTH = 64  # d_model per layer, and the head size


def depth_shape(depth: int) -> dict[str, Any]:
    """The fields of the depth family's model of `depth` layers (ConfigError outside 1..MAX_DEPTH)."""
    if not 1 <= depth <= MAX_DEPTH:
        raise ConfigError(f"preset {DEPTH_PREFIX}{depth}: the depth family has 1 to {MAX_DEPTH} layers")
    heads = depth
    return dict(hidden_size=DEPTH_WIDTH * depth, num_hidden_layers=depth, num_attention_heads=heads,
                num_key_value_heads=2 if heads % 2 == 0 else heads, qk_norm=True, rope_theta=1e4, max_seq_len=256)


def preset_fields(name: str) -> dict[str, Any]:
    """A preset's fields: a named one (PRESETS), or the depth family's `depth-N`."""
    if name in PRESETS:
        return PRESETS[name]
    depth = name[len(DEPTH_PREFIX):] if name.startswith(DEPTH_PREFIX) else ""
    if depth.isdigit() and depth == str(int(depth)):
        return depth_shape(int(depth))
    raise ConfigError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)} or {DEPTH_PREFIX}N (N layers "
                      f"of the depth family, 1 to {MAX_DEPTH})")


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The named preset (or the depth family's `depth-N`), with optional field overrides (e.g. vocab_size from a
    tokenizer)."""
    fields = preset_fields(name)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    bad = sorted(set(overrides) - known)
    if bad:
        raise ConfigError(f"unknown config fields {bad}")
    return ModelConfig(**{**fields, **overrides})


def reshape_preset(name: str, hidden_size: int | None = None, num_hidden_layers: int | None = None,
                   max_seq_len: int | None = None, **overrides: Any) -> ModelConfig:
    """The named preset made wider, deeper or longer (what --hidden_size, --num_hidden_layers and --max_seq_len
    mean everywhere): a new width keeps the preset's head size, a longer context grows the position table."""
    preset = get_preset(name)
    if num_hidden_layers is not None:
        overrides["num_hidden_layers"] = num_hidden_layers
    if max_seq_len is not None:
        overrides.update(max_seq_len=max_seq_len,
                         max_position_embeddings=max(preset.max_position_embeddings, max_seq_len))
    if hidden_size is not None:
        heads = max(1, hidden_size // preset.head_dim)
        kv = preset.num_key_value_heads
        overrides.update(hidden_size=hidden_size, num_attention_heads=heads,
                         num_key_value_heads=kv if heads % kv == 0 else heads)
    return get_preset(name, **overrides)


# Fields that are not the network's architecture: the tokenizer sets the vocabulary, the run sets the context,
# dropout is a training choice, zero_init_residual an init choice. Two configs equal on every other field describe
# the same network shape.
def switches(*roles: str) -> tuple[str, ...]:
    """The ModelConfig fields that have a flag, in declaration order: those of `roles`, or all."""
    return tuple(f.name for f in dataclasses.fields(ModelConfig) if f.metadata.get("role") in (roles or SWITCH_ROLES))


def model_flags() -> list[tuple[str, Any, Any]]:
    """The model flags as settings for common.config (name, type, option): --preset and every switch, each
    defaulting to None ("the preset's", or for loaded weights "the model's"). The trainers' model group and
    `python -m model` are built from these, so they accept the same model flags with the same meaning."""
    hints = typing.get_type_hints(ModelConfig)
    flags: list[tuple[str, Any, Any]] = [(
        # not argparse choices: an unknown name is one `error:` line naming the presets, like every bad value
        "preset", str | None, option(None, f"model shape of a new model: {', '.join(PRESETS)}, or {DEPTH_PREFIX}N "
                                           f"(N layers of the depth family, docs/model.md) (default: "
                                           f"{DEFAULT_PRESET}); pretraining with --time_budget also takes auto, the "
                                           "depth the plan picks for it; not with --init_from, which brings its own",
                                     metavar="NAME"))]
    for f in dataclasses.fields(ModelConfig):
        if "role" in f.metadata:
            checks = {k: v for k, v in f.metadata.items() if k not in ("role", "help")}
            flags.append((f.name, hints[f.name] | None, option(None, f.metadata["help"], **checks)))
    return flags


def config_from_flags(flags: Any, vocab_size: int | None = None) -> ModelConfig:
    """The config of a new model from its flags (an object with the model_flags() attributes): the preset,
    reshaped by the shape and context switches, with every other switch given set as given, and the
    tokenizer's vocabulary (None: the preset's)."""
    extra: dict[str, Any] = {} if vocab_size is None else {"vocab_size": vocab_size}
    for name in switches("architecture", "init", "training"):
        if getattr(flags, name) is not None:
            extra[name] = getattr(flags, name)
    if flags.num_experts_per_tok == 1 and flags.norm_topk_prob is None:
        extra["norm_topk_prob"] = False  # top-1 is Switch-style: the default that works
    return reshape_preset(flags.preset or DEFAULT_PRESET, flags.hidden_size, flags.num_hidden_layers,
                          flags.max_seq_len, **extra)


# what does not fix the network's shape and kind: the tokenizer's size, how long it trains and generates (and
# how RoPE stretches to longer contexts), and the init and training switches
NOT_ARCHITECTURE = ("vocab_size", "max_position_embeddings", "rope_scaling", "gradient_checkpointing",
                    *switches("context", "init", "training"))


def architecture(config: ModelConfig) -> dict[str, Any]:
    """The fields of `config` that fix the network's shape and kind (see NOT_ARCHITECTURE)."""
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in NOT_ARCHITECTURE}


def model_name(config: ModelConfig) -> str:
    """The preset `config` has the shape of (a depth family's "depth-4" too), else a short shape description such
    as "d512-l4" (run names)."""
    shape = architecture(config)
    family = [f"{DEPTH_PREFIX}{config.num_hidden_layers}"] if config.num_hidden_layers <= MAX_DEPTH else []
    return next((name for name in (*PRESETS, *family) if architecture(get_preset(name)) == shape),
                f"d{config.hidden_size}-l{config.num_hidden_layers}")


def preset_table() -> str:
    """Markdown table of the presets' shapes and parameter counts (pasted into docs/model.md)."""
    rows = ["| preset | style | d_model | layers | heads (kv) | ffn | vocab | ctx | RoPE θ | params | non-embedding "
            "| active |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in PRESETS:
        c = get_preset(name)
        ffn = (f"{c.num_experts}x{c.moe_intermediate_size} top-{c.num_experts_per_tok}"
               + (f" +{c.num_shared_experts} shared" if c.num_shared_experts else "")) if c.moe \
            else str(c.intermediate_size)
        rows.append(f"| `{name}` | {c.style} | {c.hidden_size} | {c.num_hidden_layers} | "
                    f"{c.num_attention_heads} ({c.num_key_value_heads}) | {ffn} | {c.vocab_size} | "
                    f"{c.max_seq_len} | {f'{c.rope_theta:g}' if c.position_embedding == 'rope' else '–'} | "
                    f"{c.num_parameters() / 1e6:.2f}M | "
                    f"{c.num_parameters(non_embedding=True) / 1e6:.2f}M | "
                    f"{c.num_parameters(active=True) / 1e6:.2f}M |")
    return "\n".join(rows)
