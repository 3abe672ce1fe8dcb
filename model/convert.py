"""Convert between PocketLM checkpoints and Hugging Face `transformers` directories (both directions).

    python -m model.convert --checkpoint out/<run> --out_dir hf_dir        # -> LlamaForCausalLM / GPT2LMHeadModel
    python -m model.convert --from_hf hf_dir --out_dir pocketlm_dir         # <- same shapes back

The export writes safetensors + config.json (+ generation_config.json and tokenizer files) directly, so it
needs no `transformers` install and the result loads with AutoModelForCausalLM without remote code.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .config import ConfigError, ModelConfig, get_preset
from .inference import DTYPES
from .loading import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    copy_tokenizer_files,
    load_model,
    read_state_dict,
    special_token_ids,
)
from .model import PocketLM

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
    """Rename (and for GPT-2 fuse/transpose) PocketLM tensors into transformers' layout."""
    if cfg.style == "llama":
        return {(k if k == "lm_head.weight" else "model." + k): v for k, v in state.items()
                if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
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


def from_hf_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of to_hf_state (transformers names -> PocketLM names)."""
    if cfg.style == "llama":
        return dict(state)  # read_state_dict already removed the "model." prefix
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


# ---------------------------------------------------------------------- config mapping
def to_hf_config(cfg: ModelConfig, dtype: torch.dtype, token_ids: dict[str, int]) -> dict:
    """A transformers config.json dict for cfg; token ids come from the tokenizer shipped alongside."""
    eos = [token_ids[t] for t in ("<|im_end|>", "<|endoftext|>") if t in token_ids]
    common = {"vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_word_embeddings,
              "initializer_range": cfg.initializer_range, "torch_dtype": str(dtype).removeprefix("torch."),
              "bos_token_id": token_ids.get("<|im_start|>"), "eos_token_id": eos or None,
              "pad_token_id": token_ids.get("<|endoftext|>")}
    if cfg.style == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
                "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
                "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
                "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings,
                "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
                "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0}
    if cfg.style == "gpt2":
        if cfg.num_key_value_heads != cfg.num_attention_heads:
            raise ConfigError("GPT-2 has no grouped-query attention: export needs num_key_value_heads == "
                              f"num_attention_heads, got {cfg.num_key_value_heads} and {cfg.num_attention_heads}")
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common,
                "n_embd": cfg.hidden_size, "n_layer": cfg.num_hidden_layers, "n_head": cfg.num_attention_heads,
                "n_inner": cfg.intermediate_size, "n_positions": cfg.max_position_embeddings,
                "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}
    raise ConfigError(f"no transformers class matches this architecture (norm={cfg.norm}, "
                      f"position_embedding={cfg.position_embedding}, mlp={cfg.mlp}, bias={cfg.bias}); "
                      "export supports the Llama style (rmsnorm/rope/swiglu, no bias) and the GPT-2 style "
                      "(layernorm/learned/gelu)")


def from_hf_config(hf: dict, source: str) -> ModelConfig:
    """A ModelConfig equivalent to a transformers Llama or GPT-2 config.json, or a ConfigError saying why not."""
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ConfigError(f"{source}: unsupported {hf.get('model_type')} config: {what}")

    kind = hf.get("model_type")
    if kind == "llama":
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        need(rope.get("rope_type", rope.get("type", "default")) == "default",
             f"rope scaling {rope} (only plain RoPE is implemented)")
        need(hf.get("hidden_act", "silu") == "silu", f"hidden_act={hf.get('hidden_act')} (expected silu)")
        need(not hf.get("attention_bias") and not hf.get("mlp_bias"), "attention/mlp biases")
        d, heads = hf["hidden_size"], hf["num_attention_heads"]
        need(hf.get("head_dim") in (None, d // heads), f"head_dim={hf.get('head_dim')} != hidden/heads")
        max_pos = hf.get("max_position_embeddings", 2048)
        return ModelConfig(
            vocab_size=hf["vocab_size"], hidden_size=d, num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads") or heads,
            intermediate_size=hf["intermediate_size"], max_position_embeddings=max_pos,
            max_seq_len=min(max_pos, 2048), rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 1e4))),
            norm_eps=hf.get("rms_norm_eps", 1e-6), tie_word_embeddings=hf.get("tie_word_embeddings", False),
            initializer_range=hf.get("initializer_range", 0.02))
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
    raise ConfigError(f"{source}: model_type {kind!r} is not supported; expected 'llama' or 'gpt2'")


# ----------------------------------------------------------------------------- drivers
def export_hf(checkpoint: str | Path, out_dir: str | Path, config: ModelConfig | None = None,
              dtype: torch.dtype = torch.float32) -> Path:
    """Write a transformers-loadable directory for a PocketLM checkpoint; return out_dir."""
    from safetensors.torch import save_file

    model, model_dir = load_model(checkpoint, config=config)
    cfg = model.config
    token_ids = special_token_ids(model_dir)
    hf_config = to_hf_config(cfg, dtype, token_ids)  # validates exportability before anything is written
    state = {k: v.to(dtype).contiguous() for k, v in model.state_dict().items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(to_hf_state(cfg, state), str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    (out / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2) + "\n")
    generation = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if hf_config[k] is not None}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    copy_tokenizer_files(model_dir, out)
    return out


def import_hf(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """Write a PocketLM model directory from a transformers Llama/GPT-2 directory of matching architecture."""
    from .loading import load_state_into, save_model

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
    try:
        cfg = from_hf_config(hf_config, str(config_path))
    except KeyError as e:
        raise ConfigError(f"{config_path}: missing key {e}") from None
    state: dict[str, torch.Tensor] = {}
    shards = sorted(hf_dir.glob("*.safetensors")) or sorted(hf_dir.glob("pytorch_model*.bin"))
    if not shards:
        raise CheckpointError(f"{hf_dir}: no *.safetensors or pytorch_model*.bin weights")
    for shard in shards:
        # read_state_dict strips Llama's "model." prefix; GPT-2's "transformer." names pass through
        state.update({k: v.float() for k, v in read_state_dict(shard).items()})
    model = PocketLM(cfg)
    load_state_into(model, from_hf_state(cfg, state), str(hf_dir))
    return save_model(model, out_dir, tokenizer_dir=hf_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="PocketLM run dir, model dir, or weights file (.safetensors/.pth)")
    src.add_argument("--from_hf", help="transformers Llama or GPT-2 directory to import")
    p.add_argument("--out_dir", required=True)
    p.add_argument("--preset", help="config for a bare weights file without config.json (e.g. a MiniMind .pth)")
    p.add_argument("--config", help="config.json for a bare weights file")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype of exported weights")
    args = p.parse_args(argv)
    try:
        if args.from_hf:
            out = import_hf(args.from_hf, args.out_dir)
            print(f"wrote PocketLM model to {out}")
        else:
            config = get_preset(args.preset) if args.preset else ModelConfig.load(args.config) if args.config else None
            out = export_hf(args.checkpoint, args.out_dir, config=config, dtype=DTYPES[args.dtype])
            print(f"wrote transformers model to {out} (load with AutoModelForCausalLM.from_pretrained)")
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
