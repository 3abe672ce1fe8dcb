"""Convert between PocketLM checkpoints and Hugging Face `transformers` directories (both directions).

    python -m model.convert --checkpoint out/<run> --out_dir hf_dir        # -> LlamaForCausalLM / GPT2LMHeadModel
    python -m model.convert --from_hf hf_dir --out_dir pocketlm_dir         # <- same shapes back

The export writes safetensors + config.json (+ generation_config.json and tokenizer files) directly, so it
needs no `transformers` install and the result loads with AutoModelForCausalLM without remote code.

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
(rank_pattern and alpha_pattern keep peft's scale at alpha / r).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from .config import ConfigError, ModelConfig, get_preset
from .inference import DTYPES
from .loading import (
    ADAPTER_WEIGHTS_NAME,
    CONFIG_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    copy_tokenizer_files,
    is_lora_dir,
    load_model,
    read_state_dict,
    resolve_model_dir,
    save_model,
    special_token_ids,
)
from .lora import LoraSpec, adapter_shapes, check_lora_state, load_lora_model, read_lora_config
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
    from .loading import load_state_into

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


def to_peft_state(cfg: ModelConfig, spec: LoraSpec, state: dict[str, torch.Tensor]
                  ) -> tuple[dict[str, torch.Tensor], list[str], dict[str, int], dict[str, float]]:
    """PocketLM adapter tensors -> (peft tensors, target_modules, rank_pattern, alpha_pattern) for the
    transformers export of a model of `cfg`."""
    if cfg.style == "llama":  # same module names, under LlamaForCausalLM's "model."
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
    spec, _ = read_lora_config(model_dir)
    try:
        cfg = ModelConfig.load(model_dir / CONFIG_NAME)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    to_hf_config(cfg, dtype, {})  # the base must be exportable (refuses custom styles, GPT-2 with GQA)
    adapters = model_dir / ADAPTER_WEIGHTS_NAME
    state = read_state_dict(adapters)
    check_lora_state(adapter_shapes(cfg, spec), state, str(adapters))
    tensors, modules, ranks, alphas = to_peft_state(cfg, spec, {k: v.float() for k, v in state.items()})
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="PocketLM run dir, model dir, or weights file (.safetensors/.pth); a LoRA "
                                          "run exports merged")
    src.add_argument("--from_hf", help="transformers Llama or GPT-2 directory to import")
    src.add_argument("--merge_lora", metavar="RUN_OR_DIR",
                     help="LoRA run or checkpoint: write its merged weights as a plain PocketLM dir to --out_dir")
    p.add_argument("--out_dir", help="output directory (all modes but --peft_dir)")
    p.add_argument("--peft_dir", help="with --checkpoint of a LoRA run: write its adapters in the peft layout here "
                                      "(instead of --out_dir)")
    p.add_argument("--base_model", help="with --peft_dir: base_model_name_or_path to record (e.g. the transformers "
                                        "export of the adapters' base)")
    p.add_argument("--preset", help="config for a bare weights file without config.json (e.g. a MiniMind .pth)")
    p.add_argument("--config", help="config.json for a bare weights file")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype of exported weights")
    args = p.parse_args(argv)
    try:
        _check_flags(args)
        dtype = DTYPES[args.dtype]
        if args.from_hf:
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
            out = export_hf(args.checkpoint, args.out_dir, config=config, dtype=dtype)
            print(f"wrote transformers model to {out} (load with AutoModelForCausalLM.from_pretrained)")
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _check_flags(args: argparse.Namespace) -> None:
    """Combinations argparse cannot express, refused with one line each."""
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
