"""Convert between PocketLM checkpoints and Hugging Face `transformers` directories (both directions); export GGUF.

    python -m model.convert --checkpoint out/<run> --out_dir hf_dir        # -> LlamaForCausalLM / GPT2LMHeadModel
    python -m model.convert --from_hf hf_dir --out_dir pocketlm_dir         # <- same shapes back

--rope_scaling yarn:4 (or linear:2) exports the model stretched to 4x its training context: config.json's
rope_scaling (and rope_parameters), which transformers and llama.cpp's converter read; --to gguf writes llama.cpp's
rope.scaling keys. Imports read linear and YaRN scalings back.

The export writes safetensors + config.json (+ generation_config.json and tokenizer files) directly, so it
needs no `transformers` install and the result loads with AutoModelForCausalLM without remote code. A Llama-style
model with QK-norm (qk_norm) exports as Qwen3ForCausalLM, Llama's decoder with q_norm / k_norm in every attention
(--from_hf imports it back; a Hub Qwen3 model only when its head_dim is hidden_size / heads, the one head size
PocketLM computes).

Mixture-of-experts models (num_experts > 0) export to the transformers architecture that computes them exactly,
with experts stored one tensor each as the Hub checkpoints are (what transformers and llama.cpp read):

    MixtralForCausalLM        no shared experts and norm_topk_prob=true (Mixtral always renormalises the top-k)
    Qwen2MoeForCausalLM       otherwise; Qwen2-MoE's shared expert is gated by sigmoid(w.x), so the export writes
                              w = 0 (a gate of exactly 1/2) and doubles the shared down_proj; without shared
                              experts it writes an all-zero shared expert of width 1, which adds exactly 0
    Ernie4_5_MoeForCausalLM   a model whose router_bias is not zero (auxiliary-loss-free balancing): ERNIE 4.5's
                              router adds such a bias when choosing experts, as PocketLM's does. It always
                              renormalises the top-k, so a biased model with norm_topk_prob=false is refused.

--from_hf imports all three back (refusing what PocketLM cannot compute: attention biases, sliding windows, dense
layers among the MoE ones, a Qwen2-MoE shared expert with a non-zero gate, ...).

GGUF for llama.cpp and Ollama (export/gguf.py: llama.cpp's `gguf` writer, Llama / Qwen3 / GPT-2 / Mixtral-style MoE):

    python -m model.convert --checkpoint out/<run> --to gguf --out model.gguf [--outtype f32|f16|q8_0]

A LoRA run exports merged. GGUF puts the tokenizer and chat template in the file: llama.cpp and Ollama run it as is.

LoRA runs (model/lora.py: adapters + a reference to their base):

    python -m model.convert --checkpoint out/<lora run> --out_dir hf_dir     # the merged model, as above
    python -m model.convert --merge_lora out/<lora run> --out_dir merged    # a plain PocketLM model dir, merged
    python -m model.convert --checkpoint out/<lora run> --peft_dir adapters [--base_model hf_base]

--peft_dir writes the adapters alone in the `peft` layout (adapter_config.json + adapter_model.safetensors),
for the transformers export of their base (the directory lora.json names; the command prints it):

    python -m model.convert --checkpoint <base> --out_dir hf_base
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("hf_base"), "adapters")  # = the LoRA run

--base_model is recorded as base_model_name_or_path (default: none). GPT-2-style models are supported too:
transformers fuses their q, k and v into one c_attn, so their adapters become one c_attn adapter of rank
r x (number of q/k/v targets) whose B is block-diagonal, which computes exactly the separate updates
(rank_pattern and alpha_pattern keep peft's scale at alpha / r). Mixture-of-experts models take adapters on
their attention projections only (model/lora.py); for an ERNIE 4.5 export their q/k rows are reordered like the
base's.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Callable

import torch

from common.device import DTYPES, dtype_name
from common.errors import TokenizerError
from model.checkpoint import load_model
from model.config import (
    ROPE_SCALING_TYPES,
    ConfigError,
    ModelConfig,
    check_rope_scaling,
    get_preset,
    parse_rope_scaling,
)
from model.loading import (
    ADAPTER_WEIGHTS_NAME,
    CONFIG_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    copy_tokenizer_files,
    is_lora_dir,
    read_state_dict,
    resolve_model_dir,
    save_model,
    special_token_ids,
)
from model.lora import LoraSpec, adapter_shapes, check_lora_state, load_lora_model, read_lora_config
from model.model import PocketLM, interleave_rope_rows, rotate_half_rows

from .gguf import OUTTYPES, export_gguf

# PocketLM's GELU is the tanh approximation; these transformers activation names compute exactly that.
GPT2_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")


# ------------------------------------------------------------------------ name mapping
def _gpt2_pairs(cfg: ModelConfig) -> list[tuple[str, str, bool]]:
    """(pocketlm name, transformers name, transpose?) for every GPT-2 tensor except the fused qkv."""
    pairs = [("embed_tokens.weight", "transformer.wte.weight", False),
             ("embed_positions.weight", "transformer.wpe.weight", False),
             ("norm.weight", "transformer.ln_f.weight", False), ("norm.bias", "transformer.ln_f.bias", False)]
    for i in range(cfg.num_hidden_layers):
        ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
        for a, b, t in (("input_layernorm", "ln_1", False), ("post_attention_layernorm", "ln_2", False),
                        ("self_attn.o_proj", "attn.c_proj", True), ("mlp.up_proj", "mlp.c_fc", True),
                        ("mlp.down_proj", "mlp.c_proj", True)):
            pairs.append((ours + a + ".weight", theirs + b + ".weight", t))  # GPT-2 Conv1D stores (in, out)
            pairs.append((ours + a + ".bias", theirs + b + ".bias", False))
    if not cfg.tie_word_embeddings:
        pairs.append(("lm_head.weight", "lm_head.weight", False))
    return pairs


def to_hf_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename (and for GPT-2 fuse/transpose, for MoE split per expert) PocketLM tensors into transformers' layout."""
    if cfg.style in ("llama", "qwen3"):  # Qwen3's q_norm / k_norm have PocketLM's names too
        return {(k if k == "lm_head.weight" else "model." + k): v for k, v in state.items()
                if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    if cfg.style == "moe":
        return _moe_to_hf_state(cfg, state, hf_model_type(cfg, has_router_bias(state)))
    # GPT-2: a model trained without biases exports zero biases, which computes exactly the same function.
    def get(name: str, like: str, size: int) -> torch.Tensor:
        return state[name] if name in state else torch.zeros(size, dtype=state[like].dtype)

    d = cfg.hidden_size
    out = {}
    for ours, theirs, transpose in _gpt2_pairs(cfg):
        if ours.endswith(".bias"):
            weight = ours[:-len("bias")] + "weight"
            size = state[weight].shape[0]
            out[theirs] = get(ours, weight, size)
        else:
            out[theirs] = state[ours].t().contiguous() if transpose else state[ours]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}.self_attn."
        qkv = torch.cat([state[p + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj")], dim=0)
        out[f"transformer.h.{i}.attn.c_attn.weight"] = qkv.t().contiguous()
        out[f"transformer.h.{i}.attn.c_attn.bias"] = torch.cat(
            [get(p + n + ".bias", p + n + ".weight", d) for n in ("q_proj", "k_proj", "v_proj")])
    return out


def from_hf_state(cfg: ModelConfig, state: dict[str, torch.Tensor], model_type: str = "llama"
                  ) -> dict[str, torch.Tensor]:
    """Inverse of to_hf_state (transformers names -> PocketLM names); model_type is the source's (config.json)."""
    if cfg.style in ("llama", "qwen3"):
        return dict(state)  # read_state_dict already removed the "model." prefix
    if cfg.style == "moe":
        return _moe_from_hf_state(cfg, state, model_type)
    out = {}
    for ours, theirs, transpose in _gpt2_pairs(cfg):
        if theirs in state:
            out[ours] = state[theirs].t().contiguous() if transpose else state[theirs]
    d = cfg.hidden_size
    for i in range(cfg.num_hidden_layers):
        hf = f"transformer.h.{i}.attn.c_attn."
        if hf + "weight" not in state:
            continue  # reported as missing by load_state_into
        q, k, v = state[hf + "weight"].t().split(d, dim=0)
        b_q, b_k, b_v = state[hf + "bias"].split(d)
        for name, w, b in (("q_proj", q, b_q), ("k_proj", k, b_k), ("v_proj", v, b_v)):
            out[f"layers.{i}.self_attn.{name}.weight"] = w.contiguous()
            out[f"layers.{i}.self_attn.{name}.bias"] = b
    return out


# ----------------------------------------------------------------- mixture of experts
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "ernie4_5_moe")
# PocketLM's stacked expert tensors -> the per-expert names of the Hub checkpoints (transformers fuses them into
# gate_up_proj / down_proj when loading, transformers/conversion_mapping.py).
EXPERT_NAMES = {"mixtral": {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"},
                "qwen2_moe": {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"},
                "ernie4_5_moe": {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}}
SWIGLU = ("gate_proj", "up_proj", "down_proj")
# Where each architecture keeps a layer's router and experts.
MOE_BLOCK = {"mixtral": "block_sparse_moe.", "qwen2_moe": "mlp.", "ernie4_5_moe": "mlp."}
ERNIE_BIAS = "moe_statics.e_score_correction_bias"


def has_router_bias(state: dict[str, torch.Tensor]) -> bool:
    """Whether any MoE layer of a PocketLM state dict chooses its experts with a non-zero routing bias."""
    return any(bool(v.any()) for k, v in state.items() if k.endswith("mlp.router_bias"))


def hf_model_type(cfg: ModelConfig, router_bias: bool = False) -> str:
    """The transformers model_type that computes a model of `cfg` exactly (router_bias: whether its MoE routers
    have a non-zero selection bias, which only the weights tell), or a ConfigError saying why none does."""
    if cfg.style in ("llama", "qwen3", "gpt2"):
        return cfg.style
    if cfg.style != "moe":
        raise ConfigError(f"no transformers class matches this architecture (norm={cfg.norm}, "
                          f"position_embedding={cfg.position_embedding}, mlp={cfg.mlp}, bias={cfg.bias}, "
                          f"qk_norm={cfg.qk_norm}, num_experts={cfg.num_experts}); export supports the Llama style "
                          "(rmsnorm/rope/swiglu, no bias; dense or mixture of experts), the Qwen3 style (dense "
                          "Llama style with qk_norm) and the GPT-2 style (layernorm/learned/gelu)")
    if router_bias:
        if not cfg.norm_topk_prob:
            raise ConfigError(
                "this mixture-of-experts model chooses experts with a learned routing bias (router_bias, from "
                "auxiliary-loss-free balancing) and weighs them without renormalising (norm_topk_prob=false); no "
                "transformers architecture computes that: Mixtral and Qwen2-MoE routers have no selection bias, "
                "and ERNIE 4.5's, which has one, always renormalises the top-k. Train with norm_topk_prob=true "
                "(exports as Ernie4_5_MoeForCausalLM) or with router_bias_update_rate=0 (Mixtral / Qwen2-MoE)")
        return "ernie4_5_moe"
    return "mixtral" if cfg.num_shared_experts == 0 and cfg.norm_topk_prob else "qwen2_moe"


def _is_qk(name: str) -> bool:
    return name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight"))


def _moe_to_hf_state(cfg: ModelConfig, state: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """PocketLM MoE tensors -> the Hub layout of `kind` (one of MOE_MODEL_TYPES)."""
    out = {}
    for name, v in state.items():  # attention, norms, embeddings: the Llama names
        if ".mlp." in name or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            continue
        if kind == "ernie4_5_moe" and _is_qk(name):
            v = interleave_rope_rows(v, cfg.head_dim)
        out[name if name == "lm_head.weight" else "model." + name] = v
    d = cfg.hidden_size
    for i in range(cfg.num_hidden_layers):
        ours, theirs = f"layers.{i}.mlp.", f"model.layers.{i}.{MOE_BLOCK[kind]}"
        out[theirs + "gate.weight"] = state[ours + "gate.weight"]
        for ours_name, their_name in EXPERT_NAMES[kind].items():
            stacked = state[ours + "experts." + ours_name]
            for j in range(cfg.num_experts):  # clones: safetensors refuses tensors that share storage
                out[f"{theirs}experts.{j}.{their_name}.weight"] = stacked[j].clone()
        shared = {p: state[f"{ours}shared_experts.{p}.weight"] for p in SWIGLU} if cfg.num_shared_experts else {}
        if kind == "qwen2_moe":
            gate = state[ours + "gate.weight"]
            # sigmoid(0 . x) = 1/2 exactly, and 2 * down_proj is exact, so the gated expert computes ours
            out[theirs + "shared_expert_gate.weight"] = torch.zeros(1, d, dtype=gate.dtype)
            if not shared:  # the narrowest expert transformers builds, all zero: it adds exactly 0
                shared = {"gate_proj": torch.zeros(1, d, dtype=gate.dtype),
                          "up_proj": torch.zeros(1, d, dtype=gate.dtype),
                          "down_proj": torch.zeros(d, 1, dtype=gate.dtype)}
            else:
                shared = {**shared, "down_proj": shared["down_proj"] * 2}
            out.update({f"{theirs}shared_expert.{p}.weight": w for p, w in shared.items()})
        elif kind == "ernie4_5_moe":
            out.update({f"{theirs}shared_experts.{p}.weight": w for p, w in shared.items()})  # ungated, as ours
            out[theirs + ERNIE_BIAS] = state[ours + "router_bias"].float().reshape(1, -1)
    return out


def _moe_from_hf_state(cfg: ModelConfig, state: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """Inverse of _moe_to_hf_state. Tensors left over or missing are reported by load_state_into."""
    rest, out = dict(state), {}
    for i in range(cfg.num_hidden_layers):
        ours, theirs = f"layers.{i}.mlp.", f"layers.{i}.{MOE_BLOCK[kind]}"
        if theirs + "gate.weight" in rest:
            out[ours + "gate.weight"] = rest.pop(theirs + "gate.weight")
        for ours_name, their_name in EXPERT_NAMES[kind].items():
            names = [f"{theirs}experts.{j}.{their_name}.weight" for j in range(cfg.num_experts)]
            if all(n in rest for n in names):
                out[ours + "experts." + ours_name] = torch.stack([rest.pop(n) for n in names])
        if kind == "qwen2_moe":
            rest.pop(theirs + "shared_expert_gate.weight", None)  # zero: from_hf_config refuses any other
            for p in SWIGLU:
                w = rest.pop(f"{theirs}shared_expert.{p}.weight", None)
                if w is not None and cfg.num_shared_experts:  # else all zero (from_hf_config): adds nothing
                    out[f"{ours}shared_experts.{p}.weight"] = w / 2 if p == "down_proj" else w  # undo the gate's 1/2
        if kind == "ernie4_5_moe":
            for p in SWIGLU:
                if f"{theirs}shared_experts.{p}.weight" in rest:
                    out[f"{ours}shared_experts.{p}.weight"] = rest.pop(f"{theirs}shared_experts.{p}.weight")
            if theirs + ERNIE_BIAS in rest:
                out[ours + "router_bias"] = rest.pop(theirs + ERNIE_BIAS).reshape(-1)
        else:  # Mixtral and Qwen2-MoE choose by probability alone
            out[ours + "router_bias"] = torch.zeros(cfg.num_experts)
    for name, v in rest.items():
        out[name] = rotate_half_rows(v, cfg.head_dim) if kind == "ernie4_5_moe" and _is_qk(name) else v
    return out


# ---------------------------------------------------------------------- config mapping
def _decoder_config(cfg: ModelConfig) -> dict:
    """The config.json fields a Llama-family decoder (GQA attention, rotate_half RoPE, RMSNorm) shares.

    RoPE scaling is written twice: transformers 5 reads rope_parameters (rope_theta inside), transformers 4 and
    llama.cpp's convert_hf_to_gguf.py read rope_scaling (transformers 5 too, which prefers it when both are
    there: they are the same scaling)."""
    scaling = {k: float(v) if k in ("factor", "attention_factor") else v for k, v in (cfg.rope_scaling or {}).items()}
    rope = {"rope_type": "default", **scaling, "rope_theta": cfg.rope_theta}
    return {"hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "rope_parameters": rope,
            **({"rope_scaling": scaling} if scaling else {}), "attention_dropout": 0.0}


def _moe_config(cfg: ModelConfig, kind: str) -> dict:
    """The config.json fields of `kind` (one of MOE_MODEL_TYPES) for a PocketLM MoE model."""
    E, k, f, S = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.num_shared_experts
    # The same coefficient, passed as is, though transformers' balancing loss is k (num_experts_per_tok) when the
    # load is perfectly balanced where PocketLM's is 1: training in transformers weighs it k times more.
    moe = {"router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": False}
    if kind == "mixtral":
        return {"architectures": ["MixtralForCausalLM"], "model_type": kind, **moe, "head_dim": cfg.head_dim,
                "intermediate_size": f, "num_local_experts": E, "num_experts_per_tok": k, "sliding_window": None,
                "router_jitter_noise": 0.0}
    if kind == "qwen2_moe":
        return {"architectures": ["Qwen2MoeForCausalLM"], "model_type": kind, **moe,
                "intermediate_size": cfg.intermediate_size,  # the width of dense layers, of which there are none
                "moe_intermediate_size": f, "num_experts": E, "num_experts_per_tok": k,
                "norm_topk_prob": cfg.norm_topk_prob, "shared_expert_intermediate_size": S * f or 1,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "qkv_bias": False, "use_sliding_window": False}
    # ERNIE divides the chosen probabilities by max(their sum, moe_norm_min = 1e-12): our renormalisation, unless a
    # routing bias picks experts whose probabilities sum below 1e-12.
    return {"architectures": ["Ernie4_5_MoeForCausalLM"], "model_type": kind, **moe,
            "intermediate_size": cfg.intermediate_size, "moe_intermediate_size": f, "moe_num_experts": E,
            "moe_k": k, "moe_num_shared_experts": S, "moe_layer_start_index": 0,
            "moe_layer_end_index": cfg.num_hidden_layers - 1, "moe_layer_interval": 1, "use_bias": False}


def to_hf_config(cfg: ModelConfig, dtype: torch.dtype, token_ids: dict[str, int], router_bias: bool = False) -> dict:
    """A transformers config.json dict for cfg; token ids come from the tokenizer shipped alongside. router_bias:
    whether the model's MoE routers have a non-zero selection bias (has_router_bias of its weights)."""
    kind = hf_model_type(cfg, router_bias)
    eos = [token_ids[t] for t in ("<|im_end|>", "<|endoftext|>") if t in token_ids]
    common = {"vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_word_embeddings,
              "initializer_range": cfg.initializer_range, "torch_dtype": dtype_name(dtype),
              "bos_token_id": token_ids.get("<|im_start|>"), "eos_token_id": eos or None,
              "pad_token_id": token_ids.get("<|endoftext|>")}
    if kind == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common, **_decoder_config(cfg),
                "intermediate_size": cfg.intermediate_size, "head_dim": cfg.head_dim,
                "attention_bias": False, "mlp_bias": False}
    if kind == "qwen3":  # every layer attends to the whole context: no sliding window anywhere
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **common, **_decoder_config(cfg),
                "intermediate_size": cfg.intermediate_size, "head_dim": cfg.head_dim, "attention_bias": False,
                "use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.num_hidden_layers,
                "layer_types": ["full_attention"] * cfg.num_hidden_layers}
    if kind == "gpt2":
        if cfg.num_key_value_heads != cfg.num_attention_heads:
            raise ConfigError("GPT-2 has no grouped-query attention: export needs num_key_value_heads == "
                              f"num_attention_heads, got {cfg.num_key_value_heads} and {cfg.num_attention_heads}")
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common,
                "n_embd": cfg.hidden_size, "n_layer": cfg.num_hidden_layers, "n_head": cfg.num_attention_heads,
                "n_inner": cfg.intermediate_size, "n_positions": cfg.max_position_embeddings,
                "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}
    moe = _moe_config(cfg, kind)
    return {**{k: moe.pop(k) for k in ("architectures", "model_type")}, **common, **_decoder_config(cfg), **moe}


# transformers' defaults for keys a config.json may leave out, per model type:
# (rms_norm_eps, rope_theta, max_position_embeddings, tie_word_embeddings)
HF_DEFAULTS = {"llama": (1e-6, 1e4, 2048, False), "qwen3": (1e-6, 1e4, 32768, False),
               "mixtral": (1e-5, 1e6, 131072, False),
               "qwen2_moe": (1e-6, 1e4, 32768, False), "ernie4_5_moe": (1e-5, 5e5, 131072, True)}


def _decoder_fields(hf: dict, need: Callable[[bool, str], None]) -> dict:
    """ModelConfig fields of a Llama-family transformers config (GQA attention, plain RoPE, RMSNorm, SiLU)."""
    eps, theta, max_pos, tie = HF_DEFAULTS[hf["model_type"]]
    # transformers 5 prefers rope_scaling when both are given (configuration_utils: convert_rope_params_to_dict)
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    need(isinstance(rope, dict), f"rope_scaling={rope!r} (expected an object)")
    max_pos = hf.get("max_position_embeddings", max_pos)
    scaling = _rope_scaling_from_hf(rope, max_pos, need)
    need(hf.get("hidden_act", "silu") == "silu", f"hidden_act={hf.get('hidden_act')} (expected silu)")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    need(hf.get("head_dim") in (None, d // heads), f"head_dim={hf.get('head_dim')} != hidden/heads")
    # the context the model was trained at, max_seq_len: YaRN names it; a linear scaling stretched it by its factor
    # to max_position_embeddings (what PocketLM's exports write, and the usual convention)
    trained = max_pos
    if scaling:
        trained = scaling.get("original_max_position_embeddings") or max(1, round(max_pos / scaling["factor"]))
        # the context the scaling is for, which some configs leave at the original (Qwen's YaRN: 32768 and 4 x
        # 32768): PocketLM's rotary tables must cover it
        max_pos = max(max_pos, math.ceil(scaling["factor"] * trained))
    return dict(vocab_size=hf["vocab_size"], hidden_size=d, num_hidden_layers=hf["num_hidden_layers"],
                num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads") or heads,
                max_position_embeddings=max_pos, max_seq_len=min(trained, max_pos, 2048), rope_scaling=scaling,
                rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", theta))),
                norm_eps=hf.get("rms_norm_eps", eps), tie_word_embeddings=hf.get("tie_word_embeddings", tie),
                initializer_range=hf.get("initializer_range", 0.02))


def _rope_scaling_from_hf(rope: dict, max_pos: int, need: Callable[[bool, str], None]) -> dict | None:
    """ModelConfig.rope_scaling of a transformers rope_scaling / rope_parameters dict: None for plain RoPE, linear
    and YaRN as they are (YaRN's original context defaulting, as in transformers, to max_position_embeddings),
    any other type refused."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    need(kind in ROPE_SCALING_TYPES, f"rope scaling {rope} (PocketLM computes plain RoPE, linear and yarn)")
    scaling = {k: v for k, v in rope.items() if k not in ("type", "rope_theta")}
    scaling["rope_type"] = kind
    if kind == "yarn":
        scaling.setdefault("original_max_position_embeddings", max_pos)
    try:
        check_rope_scaling(scaling)
    except ConfigError as e:
        need(False, f"rope scaling {rope}: {e}")
    return scaling


def from_hf_config(hf: dict, source: str, state: dict[str, torch.Tensor] | None = None) -> ModelConfig:
    """A ModelConfig equivalent to a transformers Llama, Qwen3, GPT-2, Mixtral, Qwen2-MoE or ERNIE 4.5 MoE config.json,
    or a ConfigError saying why not. state (the weights, names without "model."): what only they tell, whether a
    Qwen2-MoE shared expert is gated (refused) or all zero (no shared experts)."""
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ConfigError(f"{source}: unsupported {hf.get('model_type')} config: {what}")

    kind = hf.get("model_type")
    if kind == "llama":
        need(not hf.get("attention_bias") and not hf.get("mlp_bias"), "attention/mlp biases")
        return ModelConfig(**_decoder_fields(hf, need), intermediate_size=hf["intermediate_size"])
    if kind == "qwen3":
        need(not hf.get("attention_bias"), "attention biases")
        need(not hf.get("use_sliding_window") and all(t == "full_attention" for t in hf.get("layer_types") or []),
             "sliding-window attention (PocketLM attends to the whole context)")
        hf = {"head_dim": 128, **hf}  # Qwen3Config's default, not hidden_size / heads
        return ModelConfig(**_decoder_fields(hf, need), intermediate_size=hf.get("intermediate_size", 22016),
                           qk_norm=True)
    if kind in MOE_MODEL_TYPES:
        return _moe_from_hf_config(hf, need, state)
    if kind == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        need(act in GPT2_TANH_GELUS, f"activation_function={act} (expected one of {GPT2_TANH_GELUS})")
        need(not hf.get("scale_attn_by_inverse_layer_idx") and hf.get("scale_attn_weights", True),
             "non-standard attention scaling")
        d, n_pos = hf.get("n_embd", 768), hf.get("n_positions", 1024)
        return ModelConfig(
            vocab_size=hf["vocab_size"], hidden_size=d, num_hidden_layers=hf.get("n_layer", 12),
            num_attention_heads=hf.get("n_head", 12), num_key_value_heads=hf.get("n_head", 12),
            intermediate_size=hf.get("n_inner") or 4 * d, max_position_embeddings=n_pos, max_seq_len=n_pos,
            norm_eps=hf.get("layer_norm_epsilon", 1e-5), tie_word_embeddings=hf.get("tie_word_embeddings", True),
            initializer_range=hf.get("initializer_range", 0.02),
            norm="layernorm", position_embedding="learned", mlp="gelu", bias=True)
    raise ConfigError(f"{source}: model_type {kind!r} is not supported; expected one of "
                      f"{['llama', 'qwen3', 'gpt2', *MOE_MODEL_TYPES]}")


def _moe_from_hf_config(hf: dict, need: Callable[[bool, str], None],
                        state: dict[str, torch.Tensor] | None) -> ModelConfig:
    """from_hf_config for MOE_MODEL_TYPES (transformers' defaults for absent keys)."""
    kind, fields = hf["model_type"], _decoder_fields(hf, need)
    every_layer = "dense MLP layers among the MoE ones ({}); PocketLM's num_experts makes every layer a mixture"
    if kind == "mixtral":
        window = hf.get("sliding_window")
        need(window is None or window >= fields["max_position_embeddings"],
             f"sliding_window={window} (PocketLM attends to the whole context)")
        # router_jitter_noise only acts in training. Mixtral has no dense MLP width: intermediate_size is left to
        # PocketLM's default for this hidden size, which keeps a preset's shape recognisable after a round trip.
        E, k, f = hf.get("num_local_experts", 8), hf.get("num_experts_per_tok", 2), hf.get("intermediate_size", 14336)
        norm, shared, dense = True, 0, None
    elif kind == "qwen2_moe":
        need(not hf.get("qkv_bias", True), "qkv_bias=true (PocketLM's attention has no biases)")
        need(not hf.get("use_sliding_window") and all(t == "full_attention" for t in hf.get("layer_types") or []),
             "sliding-window attention (PocketLM attends to the whole context)")
        need(hf.get("decoder_sparse_step", 1) == 1 and not hf.get("mlp_only_layers"),
             every_layer.format(f"decoder_sparse_step={hf.get('decoder_sparse_step', 1)}, "
                                f"mlp_only_layers={hf.get('mlp_only_layers')}"))
        E, k, f = hf.get("num_experts", 60), hf.get("num_experts_per_tok", 4), hf.get("moe_intermediate_size", 1408)
        norm, dense = hf.get("norm_topk_prob", False), hf.get("intermediate_size", 5632)
        shared = _qwen2_moe_shared_experts(hf, f, need, state)
    else:  # ernie4_5_moe
        need(not hf.get("use_bias"), "use_bias=true (PocketLM's projections have no biases)")
        start, end, step = (hf.get("moe_layer_start_index", 1), hf.get("moe_layer_end_index", -1),
                            hf.get("moe_layer_interval", 1))
        need(start == 0 and step == 1 and (end == -1 or end >= fields["num_hidden_layers"] - 1),
             every_layer.format(f"moe_layer_start_index={start}, moe_layer_end_index={end}, "
                                f"moe_layer_interval={step}"))
        E, k, f = hf.get("moe_num_experts", 64), hf.get("moe_k", 6), hf.get("moe_intermediate_size", 1536)
        norm, shared, dense = True, hf.get("moe_num_shared_experts", 2), hf.get("intermediate_size", 12288)
    need(E > 0, "no experts")
    need(not (k == 1 and norm), "top-1 routing with renormalised weights (every chosen expert weighs exactly 1), "
                                "which PocketLM refuses: norm_topk_prob with num_experts_per_tok=1 gives the router "
                                "no gradient")
    return ModelConfig(**fields, intermediate_size=dense, num_experts=E, num_experts_per_tok=k,
                       num_shared_experts=shared, moe_intermediate_size=f, norm_topk_prob=norm,
                       router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001))  # see _moe_config


def _qwen2_moe_shared_experts(hf: dict, f: int, need: Callable[[bool, str], None],
                              state: dict[str, torch.Tensor] | None) -> int:
    """num_shared_experts for a Qwen2-MoE config: its one shared expert, as wide as that many routed experts."""
    width = hf.get("shared_expert_intermediate_size", 5632)
    if state is not None:
        need(not any(bool(v.any()) for k, v in state.items() if k.endswith("mlp.shared_expert_gate.weight")),
             "a non-zero shared_expert_gate: the shared expert's output is scaled per token by sigmoid(gate . x), "
             "which PocketLM's ungated shared experts cannot compute")
        if not any(bool(v.any()) for k, v in state.items() if ".mlp.shared_expert." in k):
            return 0  # an all-zero shared expert adds nothing (what the export writes for no shared experts)
    need(width % f == 0, f"shared_expert_intermediate_size={width} is not a multiple of moe_intermediate_size={f}: "
                         "PocketLM's shared experts are num_shared_experts experts of moe_intermediate_size each")
    return width // f


# ----------------------------------------------------------------------------- drivers
def export_hf(checkpoint: str | Path, out_dir: str | Path, config: ModelConfig | None = None,
              dtype: torch.dtype = torch.float32, rope_scaling: dict | None = None) -> Path:
    """Write a transformers-loadable directory for a PocketLM checkpoint; return out_dir. rope_scaling (as
    load_model takes it) is written into config.json, where transformers and llama.cpp's converter read it."""
    from safetensors.torch import save_file

    model, model_dir = load_model(checkpoint, config=config, rope_scaling=rope_scaling)
    cfg = model.config
    token_ids = special_token_ids(model_dir)
    state = model.state_dict()
    # validates exportability before anything is written
    hf_config = to_hf_config(cfg, dtype, token_ids, router_bias=has_router_bias(state))
    # ERNIE's routing bias stays fp32, as transformers keeps it: it decides close calls between experts
    tensors = {k: (v if k.endswith(ERNIE_BIAS) else v.to(dtype)).contiguous()
               for k, v in to_hf_state(cfg, state).items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    (out / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2) + "\n")
    generation = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if hf_config[k] is not None}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    copy_tokenizer_files(model_dir, out)
    return out


def import_hf(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """Write a PocketLM model directory from a transformers Llama, Qwen3, GPT-2, Mixtral, Qwen2-MoE or ERNIE 4.5
    MoE directory of an architecture PocketLM computes."""
    from model.loading import load_state_into

    hf_dir = Path(hf_dir)
    config_path = hf_dir / CONFIG_NAME
    if not config_path.is_file():
        raise CheckpointError(f"{hf_dir}: no {CONFIG_NAME}; expected a transformers model directory")
    try:
        hf_config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config_path}: not valid JSON ({e})") from None
    if not isinstance(hf_config, dict):
        raise CheckpointError(f"{config_path}: expected a JSON object")
    state: dict[str, torch.Tensor] = {}
    shards = sorted(hf_dir.glob("*.safetensors")) or sorted(hf_dir.glob("pytorch_model*.bin"))
    if not shards:
        raise CheckpointError(f"{hf_dir}: no *.safetensors or pytorch_model*.bin weights")
    for shard in shards:
        # read_state_dict strips Llama's "model." prefix; GPT-2's "transformer." names pass through
        state.update({k: v.float() for k, v in read_state_dict(shard).items()})
    try:
        cfg = from_hf_config(hf_config, str(config_path), state)  # the weights settle Qwen2-MoE's shared expert
    except KeyError as e:
        raise ConfigError(f"{config_path}: missing key {e}") from None
    model = PocketLM(cfg)
    load_state_into(model, from_hf_state(cfg, state, hf_config.get("model_type", "")), str(hf_dir))
    return save_model(model, out_dir, tokenizer_dir=hf_dir)


# ------------------------------------------------------------------------------ LoRA
PEFT_CONFIG_NAME = "adapter_config.json"
PEFT_WEIGHTS_NAME = "adapter_model.safetensors"  # the name of our own adapter file too, but with peft's tensor names
PEFT_PREFIX = "base_model.model."  # what PeftModel wraps around the transformers model's own names
# transformers GPT-2 modules the unfused PocketLM projections live in (q, k and v all go into c_attn).
GPT2_LORA_MODULES = {"q_proj": "attn.c_attn", "k_proj": "attn.c_attn", "v_proj": "attn.c_attn",
                     "o_proj": "attn.c_proj", "up_proj": "mlp.c_fc", "down_proj": "mlp.c_proj"}


def _lora_dir(checkpoint: str | Path, flag: str) -> Path:
    model_dir = resolve_model_dir(checkpoint)
    if not is_lora_dir(model_dir):
        raise CheckpointError(f"{model_dir}: not a LoRA checkpoint (no lora.json beside the weights); {flag} "
                              "takes a LoRA run or checkpoint directory")
    return model_dir


def merge_lora_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write a plain PocketLM model directory holding a LoRA run's base with its adapters merged; return it."""
    from common.files import TRAIN_INFO_NAME

    model_dir = _lora_dir(checkpoint, "--merge_lora")
    model = load_lora_model(model_dir, merge=True).to(dtype)  # merged in fp32, rounded once
    out = save_model(model, out_dir, tokenizer_dir=model_dir)
    if (model_dir / TRAIN_INFO_NAME).is_file():
        shutil.copy2(model_dir / TRAIN_INFO_NAME, out / TRAIN_INFO_NAME)
    return out


def to_peft_state(cfg: ModelConfig, spec: LoraSpec, state: dict[str, torch.Tensor], router_bias: bool = False
                  ) -> tuple[dict[str, torch.Tensor], list[str], dict[str, int], dict[str, float]]:
    """PocketLM adapter tensors -> (peft tensors, target_modules, rank_pattern, alpha_pattern) for the
    transformers export of a model of `cfg` (router_bias: whether the base's MoE routers have a selection bias)."""
    if cfg.style in ("llama", "qwen3", "moe"):  # same module names, under the transformers model's "model."
        if hf_model_type(cfg, router_bias) == "ernie4_5_moe":  # B's rows follow the base's q/k rows
            state = {k: interleave_rope_rows(v, cfg.head_dim) if _is_qk(k.replace(".lora_B", "")) else v
                     for k, v in state.items()}
        return {PEFT_PREFIX + "model." + k: v for k, v in state.items()}, sorted(spec.targets), {}, {}
    # GPT-2: q, k, v share one fused c_attn (rows q | k | v). Stacking their A's and placing their B's on a block
    # diagonal gives one adapter of rank n * r whose update is exactly the n separate updates, rows in place.
    d, r = cfg.hidden_size, spec.rank
    fused = [t for t in ("q_proj", "k_proj", "v_proj") if t in spec.targets]
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_hidden_layers):
        ours, theirs = f"layers.{i}.", f"{PEFT_PREFIX}transformer.h.{i}."
        for target in ("o_proj", "up_proj", "down_proj"):
            if target in spec.targets:
                module = ("self_attn." if target == "o_proj" else "mlp.") + target
                for ab in ("lora_A", "lora_B"):
                    out[f"{theirs}{GPT2_LORA_MODULES[target]}.{ab}.weight"] = state[f"{ours}{module}.{ab}.weight"]
        if fused:
            a = torch.cat([state[f"{ours}self_attn.{t}.lora_A.weight"] for t in fused])
            b = torch.zeros(3 * d, len(fused) * r, dtype=a.dtype)
            for j, t in enumerate(fused):
                row = ("q_proj", "k_proj", "v_proj").index(t) * d
                b[row:row + d, j * r:(j + 1) * r] = state[f"{ours}self_attn.{t}.lora_B.weight"]
            out[f"{theirs}attn.c_attn.lora_A.weight"] = a
            out[f"{theirs}attn.c_attn.lora_B.weight"] = b
    modules = sorted({GPT2_LORA_MODULES[t] for t in spec.targets})
    # peft's scale is lora_alpha / r per module: grow both for c_attn so alpha / r stays the run's
    ranks = {"c_attn": len(fused) * r} if len(fused) > 1 else {}
    alphas = {"c_attn": len(fused) * spec.alpha} if len(fused) > 1 else {}
    return out, modules, ranks, alphas


def export_peft(checkpoint: str | Path, peft_dir: str | Path, base_model: str | None = None,
                dtype: torch.dtype = torch.float32) -> Path:
    """Write a LoRA run's adapters as a `peft` adapter directory for the transformers export of its base."""
    from safetensors.torch import save_file

    model_dir = _lora_dir(checkpoint, "--peft_dir")
    spec, base = read_lora_config(model_dir)
    try:
        cfg = ModelConfig.load(model_dir / CONFIG_NAME)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    # the base's weights choose a MoE model's transformers architecture
    router_bias = cfg.moe and _base_has_router_bias(Path(base["path"]) / WEIGHTS_NAME)
    to_hf_config(cfg, dtype, {}, router_bias)  # the base must be exportable (refuses custom styles, GPT-2 with GQA)
    adapters = model_dir / ADAPTER_WEIGHTS_NAME
    state = read_state_dict(adapters)
    check_lora_state(adapter_shapes(cfg, spec), state, str(adapters))
    tensors, modules, ranks, alphas = to_peft_state(cfg, spec, {k: v.float() for k, v in state.items()},
                                                    router_bias)
    peft_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model or None,
        "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout, "target_modules": modules,
        "rank_pattern": ranks, "alpha_pattern": alphas, "bias": "none",
        "fan_in_fan_out": cfg.style == "gpt2",  # GPT-2's Conv1D stores (in, out)
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None, "revision": None}
    out = Path(peft_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(out / PEFT_WEIGHTS_NAME),
              metadata={"format": "pt"})
    (out / PEFT_CONFIG_NAME).write_text(json.dumps(peft_config, indent=2) + "\n")
    return out


def _base_has_router_bias(weights: Path) -> bool:
    """has_router_bias of a model.safetensors, reading only the router_bias tensors."""
    from safetensors import safe_open

    if not weights.is_file():
        raise CheckpointError(f"{weights}: no such file; the adapters' base must be present to tell which "
                              "transformers architecture its mixture-of-experts layers export to")
    with safe_open(str(weights), "pt") as f:
        return any(bool(f.get_tensor(k).any()) for k in f.keys() if k.endswith("mlp.router_bias"))


def main(argv: list[str] | None = None) -> int:
    # prog: the same usage line from `python -m model.convert` (the documented command) and `python -m export.convert`
    p = argparse.ArgumentParser(prog="convert.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="PocketLM run dir, model dir, or weights file (.safetensors/.pth); a LoRA "
                                          "run exports merged")
    src.add_argument("--from_hf", help="transformers directory to import (Llama, Qwen3, GPT-2, Mixtral, Qwen2-MoE "
                                       "or ERNIE 4.5 MoE)")
    src.add_argument("--merge_lora", metavar="RUN_OR_DIR",
                     help="LoRA run or checkpoint: write its merged weights as a plain PocketLM dir to --out_dir")
    p.add_argument("--to", choices=("hf", "gguf"), default="hf",
                   help="with --checkpoint: a transformers directory (--out_dir; default) or one GGUF file for "
                        "llama.cpp / Ollama (--out)")
    p.add_argument("--out", help="with --to gguf: the .gguf file to write")
    p.add_argument("--outtype", choices=OUTTYPES, help="with --to gguf: type of the weight matrices (default f32; "
                                                        "norms and biases stay f32)")
    p.add_argument("--out_dir", help="output directory (all modes but --peft_dir and --to gguf)")
    p.add_argument("--peft_dir", help="with --checkpoint of a LoRA run: write its adapters in the peft layout here "
                                      "(instead of --out_dir)")
    p.add_argument("--base_model", help="with --peft_dir: base_model_name_or_path to record (e.g. the transformers "
                                        "export of the adapters' base)")
    p.add_argument("--preset", help="config for a bare weights file without config.json (e.g. a MiniMind .pth)")
    p.add_argument("--config", help="config.json for a bare weights file")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="dtype of exported weights (default float32; "
                                                            "--to gguf takes --outtype)")
    p.add_argument("--rope_scaling", metavar="TYPE:FACTOR",
                   help="with --checkpoint: export with RoPE scaled to FACTOR x the training context, linear:FACTOR "
                        "or yarn:FACTOR (as eval_model.py's flag), written as config.json's rope_scaling or GGUF's "
                        "rope.scaling keys")
    args = p.parse_args(argv)
    try:
        _check_flags(args)
        dtype = DTYPES[args.dtype or "float32"]
        scaling = parse_rope_scaling(args.rope_scaling) if args.rope_scaling else None
        if args.to == "gguf":
            config = get_preset(args.preset) if args.preset else ModelConfig.load(args.config) if args.config else None
            done = export_gguf(args.checkpoint, args.out, outtype=args.outtype or "f32", config=config,
                               rope_scaling=scaling)
            note = "" if done.chat_template else "; no chat template in the tokenizer files"
            print(f"wrote GGUF to {done.path} ({done.architecture}, {done.outtype}, tokenizer from "
                  f"{done.tokenizer_dir}{note}; run with llama.cpp or `ollama create`)")
        elif args.from_hf:
            out = import_hf(args.from_hf, args.out_dir)
            print(f"wrote PocketLM model to {out}")
        elif args.merge_lora:
            out = merge_lora_checkpoint(args.merge_lora, args.out_dir, dtype=dtype)
            print(f"wrote merged PocketLM model to {out}")
        elif args.peft_dir:
            out = export_peft(args.checkpoint, args.peft_dir, base_model=args.base_model, dtype=dtype)
            _, base = read_lora_config(resolve_model_dir(args.checkpoint))
            print(f"wrote peft adapters to {out}; their base is {base['path']} (export it with --checkpoint "
                  "<base> --out_dir, then load with PeftModel.from_pretrained)")
        else:
            config = get_preset(args.preset) if args.preset else ModelConfig.load(args.config) if args.config else None
            out = export_hf(args.checkpoint, args.out_dir, config=config, dtype=dtype, rope_scaling=scaling)
            architecture = json.loads((out / CONFIG_NAME).read_text())["architectures"][0]  # MoE: chosen by weights
            print(f"wrote transformers model to {out} ({architecture}; load with AutoModelForCausalLM.from_pretrained)")
    except (ConfigError, CheckpointError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _check_flags(args: argparse.Namespace) -> None:
    """Combinations argparse cannot express, refused with one line each."""
    if args.rope_scaling and not args.checkpoint or args.rope_scaling and args.peft_dir:
        raise ConfigError("--rope_scaling applies to exports of a --checkpoint (--to hf or gguf); an imported "
                          "model keeps its config.json's, adapters have none of their own")
    if args.to == "gguf":
        if not args.checkpoint:
            raise ConfigError("--to gguf exports a PocketLM --checkpoint (a LoRA run exports merged)")
        if not args.out:
            raise ConfigError("--to gguf needs --out FILE.gguf (the one file llama.cpp and Ollama load)")
        for flag in ("out_dir", "peft_dir", "base_model", "dtype"):
            if getattr(args, flag):
                hint = "; choose the weights' type with --outtype" if flag == "dtype" else ""
                raise ConfigError(f"--{flag} does not apply to --to gguf (it writes one file, --out){hint}")
        return
    if args.out or args.outtype:
        raise ConfigError(f"--{'out' if args.out else 'outtype'} applies to --to gguf only (the transformers "
                          "export writes a directory: --out_dir, --dtype)")
    if args.peft_dir:
        if not args.checkpoint:
            raise ConfigError("--peft_dir needs --checkpoint (a LoRA run)")
        if args.out_dir:
            raise ConfigError("--peft_dir writes the adapters alone, --out_dir a whole model; give one of them "
                              "(export the adapters' base with its own --checkpoint ... --out_dir)")
    elif not args.out_dir:
        raise ConfigError("--out_dir is required (or --peft_dir with a LoRA --checkpoint)")
    if args.base_model and not args.peft_dir:
        raise ConfigError("--base_model applies to --peft_dir only")
    if (args.preset or args.config) and (args.merge_lora or args.peft_dir):
        raise ConfigError("--preset and --config apply to bare weights files; a LoRA run brings its config.json")


if __name__ == "__main__":
    sys.exit(main())
