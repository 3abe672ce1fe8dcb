"""GGUF export for llama.cpp and Ollama: one self-contained .gguf file, written with llama.cpp's own `gguf` package.

    python -m model.convert --checkpoint out/<run> --to gguf --out model.gguf [--outtype f32|f16|q8_0]

What llama.cpp needs, and how each PocketLM piece maps onto it:

- Architecture. Llama-style models are `llama`; with QK-norm (qk_norm) `qwen3`, whose attn_q_norm / attn_k_norm
  normalise each head before RoPE as PocketLM's q_norm / k_norm do; GPT-2-style ones `gpt2` (q, k, v fused into
  attn_qkv, zero biases written where the model has none, as the transformers export does); a mixture of experts
  whose routing is Mixtral's (no shared experts, top-k renormalised, no routing bias) is `llama` with expert
  tensors, which llama.cpp computes the Mixtral way. Other MoE models are refused: no llama.cpp architecture
  computes them (nor a mixture of experts with QK-norm).
- RoPE. PocketLM rotates the pairs (i, i + D/2) of each head (Hugging Face's rotate_half); llama.cpp's `llama`
  rotates adjacent pairs (2i, 2i + 1). Like llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute), the rows of
  q and k are reordered within each head, which leaves every attention score unchanged. `qwen3` rotates the
  halves as PocketLM does (NEOX RoPE), so its rows stay as they are (and so do the per-dimension weights of the
  QK-norms, which a reordering would have to follow).
- RoPE scaling (rope_scaling, set when the model was loaded with --rope_scaling). `{arch}.rope.scaling.type`
  linear or yarn, `.factor`, for YaRN `.original_context_length`, and `.attn_factor` when YaRN's attention factor is
  not the default. llama.cpp then computes what transformers does (tested at 4x the training context); a YaRN ramp
  other than beta_fast 32 / beta_slow 1 (truncated) is refused, llama.cpp would not follow it.
- Tokenizer. Byte-level BPE with GPT-2's pre-tokenizer regex: tokenizer.ggml.model = "gpt2" and
  tokenizer.ggml.pre = "gpt-2" (llama.cpp's name for that regex; "gpt2" does not load). Tokens in id order,
  special ones as CONTROL, merges, bos/eos/pad/unk ids as tokenizer_config.json names them, no BOS added (PocketLM
  never adds one), and the chat template so that llama.cpp's and Ollama's chat use PocketLM's ChatML.
- Types (--outtype). Like llama.cpp's converter: norms, biases, position embeddings and MoE routers stay f32;
  the other matrices become f16 or q8_0 (a q8_0 row must be a multiple of 32 values, else that tensor is f16).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.errors import TokenizerError
from common.files import DEFAULT_TOKENIZER_DIR, read_json
from model.checkpoint import load_model
from model.config import ConfigError, ModelConfig
from model.model import interleave_rope_rows, yarn_attention_factor, yarn_mscale

OUTTYPES = ("f32", "f16", "q8_0")
# tokenizer.ggml.pre for a byte-level BPE split by GPT-2's regex (llama-vocab.cpp: LLAMA_VOCAB_PRE_TYPE_GPT2).
GPT2_PRE_TOKENIZER = "gpt-2"
# PocketLM -> llama.cpp tensor names within a layer, for the llama and qwen3 architectures.
LLAMA_LAYER_TENSORS = {"input_layernorm.weight": "attn_norm.weight",
                       "post_attention_layernorm.weight": "ffn_norm.weight",
                       "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                       "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
                       "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
                       "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                       "mlp.down_proj.weight": "ffn_down.weight",
                       # Mixtral-style experts, stacked (experts, out, in) as llama.cpp's *_exps tensors are
                       "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.experts.gate_proj": "ffn_gate_exps.weight",
                       "mlp.experts.up_proj": "ffn_up_exps.weight", "mlp.experts.down_proj": "ffn_down_exps.weight"}
GPT2_LAYER_TENSORS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                      "self_attn.o_proj": "attn_output", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


@dataclass
class GGUFExport:
    """What export_gguf wrote: the file, llama.cpp architecture, --outtype, and the tokenizer directory used."""

    path: Path
    architecture: str
    outtype: str
    tokenizer_dir: Path
    chat_template: bool


# ----------------------------------------------------------------------------- weights
def gguf_architecture(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> str:
    """The llama.cpp architecture that computes a model of `cfg` exactly ('llama', 'qwen3' or 'gpt2'), or a
    ConfigError."""
    if cfg.style in ("llama", "qwen3", "gpt2"):
        return cfg.style
    if cfg.style == "moe":
        router_bias = any(bool(v.any()) for k, v in state.items() if k.endswith("mlp.router_bias"))
        problems = [why for bad, why in (
            (cfg.num_shared_experts > 0, f"{cfg.num_shared_experts} shared experts"),
            (not cfg.norm_topk_prob, "top-k weights not renormalised (norm_topk_prob=false)"),
            (router_bias, "a learned routing bias (auxiliary-loss-free balancing)")) if bad]
        if not problems:
            return "llama"  # llama.cpp's llama MoE: softmax, top-k, renormalise (Mixtral)
        raise ConfigError(
            f"GGUF export of this mixture-of-experts model is not supported ({'; '.join(problems)}): llama.cpp's "
            "llama architecture computes only Mixtral routing (no shared experts, renormalised top-k, no routing "
            "bias). Export it to transformers instead (--to hf)")
    raise ConfigError(f"GGUF export supports the Llama style (rmsnorm/rope/swiglu, no bias; with qk_norm: Qwen3) "
                      f"and the GPT-2 style (layernorm/learned/gelu); this model has norm={cfg.norm}, "
                      f"position_embedding={cfg.position_embedding}, mlp={cfg.mlp}, bias={cfg.bias}, "
                      f"qk_norm={cfg.qk_norm}, num_experts={cfg.num_experts}")


def check_gguf_rope_scaling(cfg: ModelConfig) -> None:
    """ConfigError for a RoPE scaling llama.cpp would compute otherwise: for these architectures it ramps YaRN
    between beta_fast = 32 and beta_slow = 1 (its yarn_beta_* keys are not read: measured with
    llama-cpp-python 0.3.36) and always rounds the ramp's ends to whole dimensions."""
    scaling = cfg.rope_scaling or {}
    fixed = {"beta_fast": 32, "beta_slow": 1, "truncate": True}
    other = {k: scaling[k] for k, v in fixed.items() if k in scaling and scaling[k] != v}
    if other:
        raise ConfigError(f"GGUF export: llama.cpp's YaRN uses beta_fast=32, beta_slow=1, truncate=true; this "
                          f"model's rope_scaling sets {other}. Export it to transformers instead (--to hf), or "
                          "load it with another --rope_scaling")


def llama_tensors(cfg: ModelConfig, state: dict[str, torch.Tensor], arch: str = "llama") -> dict[str, torch.Tensor]:
    """PocketLM Llama (or Mixtral-style MoE) tensors under llama.cpp's names, q and k rows permuted for `llama`;
    with arch 'qwen3', a Qwen3-style model's, QK-norms included and nothing permuted."""
    if cfg.qk_norm != (arch == "qwen3"):  # llama would drop the QK-norms; qwen3 needs them
        raise ConfigError(f"llama.cpp's {arch} architecture does not match this model (qk_norm={cfg.qk_norm})")
    out = {"token_embd.weight": state["embed_tokens.weight"], "output_norm.weight": state["norm.weight"]}
    if not cfg.tie_word_embeddings:  # tied: llama.cpp reuses token_embd when output.weight is absent
        out["output.weight"] = state["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        for ours, theirs in LLAMA_LAYER_TENSORS.items():
            w = state.get(f"layers.{i}.{ours}")
            if w is None:
                continue  # dense models have no experts, MoE models no dense MLP
            if arch == "llama" and ours in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
                w = interleave_rope_rows(w, cfg.head_dim)
            out[f"blk.{i}.{theirs}"] = w
    return out


def gpt2_tensors(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PocketLM GPT-2-style tensors under llama.cpp's gpt2 names; absent biases become zeros (same function)."""
    def bias(prefix: str) -> torch.Tensor:
        weight = state[prefix + ".weight"]
        return state.get(prefix + ".bias", torch.zeros(weight.shape[0], dtype=weight.dtype))

    out = {"token_embd.weight": state["embed_tokens.weight"], "position_embd.weight": state["embed_positions.weight"],
           "output_norm.weight": state["norm.weight"], "output_norm.bias": bias("norm")}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = state["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        ours, theirs = f"layers.{i}.", f"blk.{i}."
        for a, b in GPT2_LAYER_TENSORS.items():
            out[f"{theirs}{b}.weight"] = state[f"{ours}{a}.weight"]
            out[f"{theirs}{b}.bias"] = bias(ours + a)
        qkv = [ours + "self_attn." + p for p in ("q_proj", "k_proj", "v_proj")]
        out[theirs + "attn_qkv.weight"] = torch.cat([state[p + ".weight"] for p in qkv])
        out[theirs + "attn_qkv.bias"] = torch.cat([bias(p) for p in qkv])
    return out


def tensor_type(name: str, array: np.ndarray, outtype: str):
    """The GGML type llama.cpp's converter gives this tensor under --outtype (see the module docstring)."""
    from gguf import GGMLQuantizationType as T

    keep_f32 = (array.ndim <= 1 or name.endswith(("_norm.weight", ".bias"))
                or name.startswith("position_embd.") or ".ffn_gate_inp." in name)
    if keep_f32 or outtype == "f32":
        return T.F32
    if outtype == "q8_0" and array.shape[-1] % 32 == 0:
        return T.Q8_0
    return T.F16


# --------------------------------------------------------------------------- tokenizer
def _read_json(path: Path) -> dict:
    data = read_json(path, TokenizerError)
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def _is_gpt2_byte_level(tok: dict) -> bool:
    """Whether a tokenizer.json pre-tokenizes exactly like GPT-2 (byte-level, GPT-2's regex, no prefix space)."""
    pre, norm = tok.get("pre_tokenizer") or {}, tok.get("normalizer")
    return (tok.get("model", {}).get("type") == "BPE" and norm is None and pre.get("type") == "ByteLevel"
            and pre.get("use_regex", True) and not pre.get("add_prefix_space", False))


def read_tokenizer(tokenizer_dir: Path, vocab_size: int) -> dict:
    """tokens, token types, merges, special ids and chat template of a PocketLM tokenizer directory, for GGUF."""
    from gguf import TokenType

    path = tokenizer_dir / "tokenizer.json"
    tok = _read_json(path)
    if not _is_gpt2_byte_level(tok):
        raise TokenizerError(f"{path}: GGUF export needs a byte-level BPE tokenizer with GPT-2's pre-tokenizer "
                             "(what train_tokenizer.py writes); llama.cpp would split this one differently")
    by_id: dict[int, tuple[str, int]] = {int(i): (t, TokenType.NORMAL) for t, i in tok["model"]["vocab"].items()}
    for added in tok.get("added_tokens", []):
        kind = TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED
        by_id[int(added["id"])] = (added["content"], kind)
    if max(by_id) >= vocab_size:
        raise TokenizerError(f"{path}: token id {max(by_id)} does not fit the model's vocab_size {vocab_size}; "
                             "is this the tokenizer the model was trained with?")
    # ids the tokenizer never produces (a model vocab rounded up) get placeholders, as llama.cpp's converter does
    tokens = [by_id.get(i, (f"[PAD{i}]", TokenType.UNUSED)) for i in range(vocab_size)]
    merges = tok["model"].get("merges") or []
    # tokenizers >= 0.20 writes merges as pairs; GGUF stores "left right" with a space inside a part as U+0120
    merges = [m if isinstance(m, str) else " ".join(p.replace(" ", chr(ord(" ") + 256)) for p in m) for m in merges]
    config_path = tokenizer_dir / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    template = config.get("chat_template")
    if template is None and (tokenizer_dir / "chat_template.jinja").is_file():
        template = (tokenizer_dir / "chat_template.jinja").read_text(encoding="utf-8")
    ids = {t: i for i, (t, _) in enumerate(tokens)}
    special = {}
    for role in ("bos", "eos", "unk", "pad"):
        name = config.get(f"{role}_token")
        if isinstance(name, dict):  # transformers' AddedToken form
            name = name.get("content")
        if name in ids:
            special[role] = ids[name]
    return {"tokens": [t for t, _ in tokens], "types": [int(k) for _, k in tokens], "merges": merges,
            "special": special, "chat_template": template if isinstance(template, str) else None,
            "add_bos": bool(config.get("add_bos_token", False)), "add_eos": bool(config.get("add_eos_token", False))}


def _tokenizer_dir(model_dir: Path, vocab_size: int) -> Path:
    """The model's own tokenizer, else the shipped default when it matches the model's vocabulary size."""
    if (model_dir / "tokenizer.json").is_file():
        return model_dir
    default_size = len(_read_json(DEFAULT_TOKENIZER_DIR / "tokenizer.json")["model"]["vocab"])
    if default_size != vocab_size:
        raise TokenizerError(f"{model_dir}: no tokenizer.json beside the model, and the shipped tokenizer "
                             f"({default_size} tokens) does not match its vocab_size {vocab_size}; copy the "
                             "tokenizer files the model was trained with into that directory")
    return DEFAULT_TOKENIZER_DIR


# ------------------------------------------------------------------------------ writer
def export_gguf(checkpoint: str | Path, out: str | Path, outtype: str = "f32",
                config: ModelConfig | None = None, rope_scaling: dict | None = None) -> GGUFExport:
    """Write a PocketLM checkpoint (run dir, model dir, weights file; a LoRA run merged) as one .gguf file, with
    RoPE scaled as rope_scaling says (load_model's argument; None: the checkpoint's own)."""
    if outtype not in OUTTYPES:
        raise ConfigError(f"unknown --outtype {outtype!r}; expected one of {list(OUTTYPES)}")
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory; give the .gguf file to write")
    try:
        import gguf  # noqa: F401 - fail before the model is loaded
    except ImportError:
        raise ConfigError("GGUF export needs the `gguf` package: pip install -r requirements.txt") from None

    model, model_dir = load_model(checkpoint, config=config, rope_scaling=rope_scaling)
    cfg = model.config
    state = {k: v.detach().float() for k, v in model.state_dict().items()}  # bf16 weights upcast exactly
    arch = gguf_architecture(cfg, state)  # refuses what llama.cpp cannot compute before anything is written
    check_gguf_rope_scaling(cfg)
    tokenizer_dir = _tokenizer_dir(model_dir, cfg.vocab_size)
    vocab = read_tokenizer(tokenizer_dir, cfg.vocab_size)
    tensors = gpt2_tensors(cfg, state) if arch == "gpt2" else llama_tensors(cfg, state, arch)
    name = Path(checkpoint).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    try:
        _write(tmp, arch, cfg, vocab, tensors, outtype, name.stem if name.is_file() else name.name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out)  # a failed export leaves no half-written file under the final name
    return GGUFExport(out, arch, outtype, tokenizer_dir, bool(vocab["chat_template"]))


def _write(path: Path, arch: str, cfg: ModelConfig, vocab: dict, tensors: dict[str, torch.Tensor], outtype: str,
           name: str) -> None:
    """The GGUF file itself: llama.cpp's hyperparameter keys for `arch`, the tokenizer, then the tensors."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_vocab_size(cfg.vocab_size)
    if arch == "gpt2":
        writer.add_feed_forward_length(cfg.intermediate_size)
        writer.add_layer_norm_eps(cfg.norm_eps)
    else:
        writer.add_feed_forward_length(cfg.moe_intermediate_size if cfg.moe else cfg.intermediate_size)
        writer.add_layer_norm_rms_eps(cfg.norm_eps)
        writer.add_rope_freq_base(cfg.rope_theta)
        writer.add_rope_dimension_count(cfg.head_dim)
        if cfg.rope_scaling is not None:
            _write_rope_scaling(writer, cfg)
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        if cfg.moe:
            writer.add_expert_count(cfg.num_experts)
            writer.add_expert_used_count(cfg.num_experts_per_tok)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(GPT2_PRE_TOKENIZER)
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    writer.add_token_merges(vocab["merges"])
    for role, token_id in vocab["special"].items():
        getattr(writer, f"add_{role}_token_id")(token_id)
    writer.add_add_bos_token(vocab["add_bos"])
    writer.add_add_eos_token(vocab["add_eos"])
    if vocab["chat_template"]:
        writer.add_chat_template(vocab["chat_template"])

    for tensor_name, t in tensors.items():
        array = t.contiguous().numpy()
        qtype = tensor_type(tensor_name, array, outtype)
        # quantized blocks come back as bytes: the writer takes the GGML type to record the logical shape
        writer.add_tensor(tensor_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def _write_rope_scaling(writer, cfg: ModelConfig) -> None:
    """llama.cpp's keys for ModelConfig.rope_scaling (those its convert_hf_to_gguf.py writes for a config.json's
    rope_scaling; check_gguf_rope_scaling refused what they cannot say)."""
    import gguf

    scaling = cfg.rope_scaling
    writer.add_rope_scaling_factor(float(scaling["factor"]))
    if scaling["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        return
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    # llama.cpp multiplies cos and sin by attn_factor x (0.1 ln(factor) + 1): a YaRN attention factor other
    # than that default (transformers' attention_factor, or DeepSeek's mscale / mscale_all_dim) is the ratio
    # (measured: llama.cpp then matches transformers; its yarn_attn_factor key changes nothing for these
    # architectures)
    ratio = yarn_attention_factor(scaling) / yarn_mscale(float(scaling["factor"]))
    if ratio != 1.0:
        writer.add_rope_scaling_attn_factors(ratio)
