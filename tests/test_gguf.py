"""GGUF export (export/gguf.py) checked against llama.cpp itself, through llama-cpp-python.

llama.cpp must tokenize like PocketLM, compute the same next-token logits, continue greedily token for token, and
find the chat template in the file. Without llama_cpp installed the llama.cpp tests skip, except where
POCKETLM_REQUIRE_GGUF=1 (set by .ci/run): there a missing llama_cpp (or gguf) fails.

Tolerances. llama.cpp keeps its KV cache in f16 by default; with an f32 cache (type_k/type_v) an f32 export
computes the same function as PocketLM up to float32 rounding (measured ~2e-6 on logits of magnitude ~3).
GPT-2-style models differ a little more (~1e-3) because llama.cpp's CPU GELU reads a table indexed by the fp16
value of its input; emulating that table in PocketLM brings almost every position back to float32 rounding.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common.device import cpu_flags
from dataset.tokenizer import DEFAULT_TOKENIZER_DIR, Tokenizer
from export.convert import main as convert_main
from export.gguf import export_gguf
from model import ConfigError, PocketLM, load_model, save_model
from model.config import parse_rope_scaling
from model.generate import generate
from model.model import interleave_rope_rows

from conftest import tiny_config

REQUIRED = os.environ.get("POCKETLM_REQUIRE_GGUF") == "1"  # .ci/run: a missing gguf or llama_cpp fails


def _import(name: str):
    if REQUIRED:
        return importlib.import_module(name)
    return pytest.importorskip(name)


gguf = _import("gguf")  # a runtime requirement (requirements.txt)

PROMPTS = ["It is a truth universally acknowledged, that a single man in possession of a good fortune",
           "床前明月光，疑是地上霜。举头望明月，低头思故乡。",
           "Emoji 🙂🚀👍🏽 and accents: naïve café, Ærøskøbing — “quotes” …",
           "def f(x):\n    return x ** 2  # squares\n\n\tindented\r\n",
           "  two leading spaces, numbers 1234567 and 3.14159, it's done",
           "a literal <|im_end|> in text stays text"]
CHAT = [{"role": "system", "content": "You are PocketLM."}, {"role": "user", "content": "你好！What is 2+2? 🙂"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "Thanks."}]
VOCAB = 6400  # the shipped tokenizer's


@pytest.fixture(scope="module")
def llama_cpp():
    return _import("llama_cpp")  # requirements-dev.txt; CI must run these tests, not skip them


def random_model(cfg, scale: float = 4) -> PocketLM:
    """Embeddings 4x and other matrices `scale` x the init scale, norms and biases off 1 and 0: logits spread, so
    a mis-mapped or mis-permuted tensor shows as an O(1) difference. At scale 8 greedy decoding wanders through
    the vocabulary instead of repeating one token (as it does at the init scale)."""
    torch.manual_seed(0)
    model = PocketLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.mul_(4 if "embed" in name else scale)
    return model


def load(llama_cpp, path, f32_cache: bool = True, n_ctx: int = 256):
    cache = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32} if f32_cache else {}
    with no_amx_repacking(llama_cpp):
        return llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=n_ctx, n_threads=1, n_threads_batch=1,
                               verbose=False, **cache)


@contextlib.contextmanager
def no_amx_repacking(llama_cpp):
    """Load without llama.cpp's "extra buffer types" (weights repacked for AMX and other CPU kernels) on CPUs
    with AMX: built natively there, llama-cpp-python 0.3.36's AMX q8_0 matmul dies of SIGILL (seen on a KVM
    Sapphire Rapids guest, with the process's AMX permission granted, for the 26M model too), taking the test
    process with it. Llama() exposes no such flag, so its default model parameters are patched for the call."""
    flags = cpu_flags() or set()
    if "amx_tile" not in flags and "amx_int8" not in flags:
        yield
        return
    module = sys.modules[llama_cpp.Llama.__module__].llama_cpp  # the low-level bindings llama.py calls
    default = module.llama_model_default_params

    def without_extra_buffers():
        params = default()
        params.use_extra_bufts = False
        return params

    module.llama_model_default_params = without_extra_buffers
    try:
        yield
    finally:
        module.llama_model_default_params = default


def llama_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def our_logits(model: PocketLM, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].float().numpy()


def position_diffs(llm, model: PocketLM, tok: Tokenizer) -> np.ndarray:
    """max |logit difference| at every position of every prompt."""
    return np.concatenate([np.abs(llama_logits(llm, ids) - our_logits(model, ids)).max(axis=1)
                           for ids in (tok.encode(p) for p in PROMPTS)])


def max_diff(llm, model: PocketLM, tok: Tokenizer) -> float:
    return float(position_diffs(llm, model, tok).max())


@pytest.fixture(scope="module")
def llama_model(tmp_path_factory):
    """A random Llama-style model (GQA, tied embeddings, non-default rope_theta and eps) with the shipped
    tokenizer, exported to GGUF in all three types."""
    d = tmp_path_factory.mktemp("gguf")
    model = random_model(tiny_config("llama", vocab_size=VOCAB, rope_theta=5e4, norm_eps=1e-5), scale=8)
    save_model(model, d / "model", tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    files = {}
    for outtype in ("f32", "f16", "q8_0"):
        files[outtype] = d / f"model-{outtype}.gguf"
        assert convert_main(["--checkpoint", str(d / "model"), "--to", "gguf", "--out", str(files[outtype]),
                             "--outtype", outtype]) == 0
    return {"model": model, "dir": d / "model", **files}


# ------------------------------------------------------------------------ tokenizer
def test_tokenization_matches(llama_cpp, llama_model, tokenizer):
    llm = load(llama_cpp, llama_model["f32"])
    for text in PROMPTS:
        ids = tokenizer.encode(text)
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == ids, text
        assert llm.detokenize(ids).decode() == text
    # a chat: the rendered template with its special tokens parsed equals the ids SFT trains on
    rendered = tokenizer.render_chat(CHAT, add_generation_prompt=True)
    assert llm.tokenize(rendered.encode(), add_bos=False, special=True) == tokenizer.chat_prompt(CHAT)
    assert (llm.token_bos(), llm.token_eos()) == (tokenizer.im_start_id, tokenizer.im_end_id)
    assert llm.n_vocab() == VOCAB


def test_metadata_and_chat_template(llama_cpp, llama_model, tokenizer):
    llm = load(llama_cpp, llama_model["f32"])
    meta, cfg = llm.metadata, llama_model["model"].config
    assert meta["general.architecture"] == "llama" and meta["tokenizer.ggml.pre"] == "gpt-2"
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.add_bos_token"] == "false"
    assert int(meta["llama.attention.head_count_kv"]) == cfg.num_key_value_heads == 2
    assert float(meta["llama.rope.freq_base"]) == 5e4
    template = json.loads((DEFAULT_TOKENIZER_DIR / "tokenizer_config.json").read_text())["chat_template"]
    assert meta["tokenizer.chat_template"] == template
    expected = tokenizer.render_chat(CHAT, add_generation_prompt=True)
    # llama-cpp-python renders the file's template with Jinja2 (its default chat format for this file) ...
    assert llm.chat_format == "chat_template.default"
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    formatter = Jinja2ChatFormatter(meta["tokenizer.chat_template"], eos_token="<|im_end|>", bos_token="<|im_start|>")
    assert formatter(messages=CHAT).prompt == expected
    from test_tokenizer import TOOL_CONVERSATION, TOOLS  # tool calls, tool results and thinking: the same text
    assert formatter(messages=TOOL_CONVERSATION[:5], tools=TOOLS).prompt == tokenizer.render_chat(
        TOOL_CONVERSATION[:5], add_generation_prompt=True, tools=TOOLS)
    # ... and llama.cpp's own C++ chat code (llama-cli / llama-server without --jinja) recognises it as ChatML
    import ctypes
    template_c = llama_cpp.llama_model_chat_template(llm._model.model, None)
    msgs = (llama_cpp.llama_chat_message * len(CHAT))(
        *[llama_cpp.llama_chat_message(role=m["role"].encode(), content=m["content"].encode()) for m in CHAT])
    buf = ctypes.create_string_buffer(4096)
    n = llama_cpp.llama_chat_apply_template(template_c, msgs, len(CHAT), True, buf, len(buf))
    assert buf.raw[:n].decode() == expected


# --------------------------------------------------------------------------- logits
def test_f32_logits_match(llama_cpp, llama_model, tokenizer):
    diff = max_diff(load(llama_cpp, llama_model["f32"]), llama_model["model"], tokenizer)
    scale = max(float(np.abs(our_logits(llama_model["model"], tokenizer.encode(p))).max()) for p in PROMPTS)
    print(f"f32 export, f32 KV cache: max |logit diff| = {diff:.2e} (max |logit| {scale:.1f})")
    assert diff < 1e-4
    # llama.cpp's defaults (f16 KV cache): what a user gets from llama-cli / Ollama
    diff = max_diff(load(llama_cpp, llama_model["f32"], f32_cache=False), llama_model["model"], tokenizer)
    print(f"f32 export, default f16 KV cache: max |logit diff| = {diff:.2e}")
    assert diff < 1e-2


def test_greedy_continuations_match(llama_cpp, llama_model, tokenizer):
    llm, model = load(llama_cpp, llama_model["f32"]), llama_model["model"]
    for text in PROMPTS[:3]:  # English, Chinese, emoji
        prompt = tokenizer.encode(text)
        ours = generate(model, [prompt], max_new_tokens=20, temperature=0)[0]
        theirs = []
        for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):  # llama.cpp's sampler, KV-cached decode
            theirs.append(token)
            if len(theirs) == len(ours):
                break
        assert len(ours) == 20 and theirs == ours, text
        assert len(set(ours)) > 10  # a walk through the vocabulary, not one token repeated


@pytest.mark.parametrize("outtype,tolerance,top1", [("f16", 0.01, 0.98), ("q8_0", 0.1, 0.85)])
def test_f16_and_q8_0_logits_are_close(llama_cpp, llama_model, tokenizer, outtype, tolerance, top1):
    """Quantised logits stay within `tolerance` of the logits' spread (max minus min per position, about 5 for
    this random model: an absolute bound would depend on the prompts' tokens), and the top-1 token is ours at
    `top1` of the positions (a random model's logits are flat: near ties swap under q8_0's rounding)."""
    llm, model = load(llama_cpp, llama_model[outtype]), llama_model["model"]
    theirs = np.concatenate([llama_logits(llm, tokenizer.encode(p)) for p in PROMPTS])
    ours = np.concatenate([our_logits(model, tokenizer.encode(p)) for p in PROMPTS])
    diff = float(np.abs(theirs - ours).max())
    spread = float((ours.max(axis=1) - ours.min(axis=1)).mean())
    same = theirs.argmax(-1) == ours.argmax(-1)
    print(f"{outtype} export: max |logit diff| = {diff:.2e} (spread {spread:.2f}), same top-1 at "
          f"{same.sum()}/{len(same)} positions")
    assert diff < tolerance * spread and same.mean() >= top1
    # norms stay f32; matrices take the type (the embedding too, as llama.cpp's converter does)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(llama_model[outtype]).tensors}
    assert types["output_norm.weight"] == types["blk.0.attn_norm.weight"] == "F32"
    assert types["blk.0.attn_q.weight"] == types["token_embd.weight"] == outtype.upper()
    assert "output.weight" not in types  # tied: llama.cpp reuses token_embd
    sizes = [llama_model[t].stat().st_size for t in ("f32", "f16", "q8_0")]
    assert sizes[0] > sizes[1] > sizes[2]


def test_permutation_is_llama_cpps():
    """The q/k row order is that of llama.cpp's convert_hf_to_gguf.py LlamaModel.permute: within a head of
    dimension D, output row 2i is input row i and row 2i+1 is input row i + D/2."""
    w = torch.arange(2 * 8, dtype=torch.float32).reshape(16, 1)  # 2 heads of dimension 8
    assert interleave_rope_rows(w, 8).flatten().tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]


# ------------------------------------------------------------------ other models
def _ggml_gelu_table() -> torch.Tensor:
    """ggml's CPU GELU table (ggml_table_gelu_f16): for each fp16 bit pattern, ggml_gelu_f32 in float32, as fp16."""
    x = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    c = torch.tensor(0.79788456080286535587989211986876, dtype=torch.float32)
    return (0.5 * x * (1.0 + torch.tanh(c * x * (1.0 + 0.044715 * x * x)))).half()


def _table_gelu(table: torch.Tensor):
    """ggml_vec_gelu_f32: 0 below -10, x above 10, else the table entry of x rounded to fp16."""
    def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        index = x.half().view(torch.int16).to(torch.int64) & 0xFFFF
        y = table[index].float()
        return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))
    return gelu


@pytest.mark.parametrize("untied_nobias", [False, True], ids=["gpt2-tied", "gpt2-untied-nobias"])
def test_gpt2_style_exports_as_gpt2(llama_cpp, tmp_path, tokenizer, monkeypatch, untied_nobias):
    over = dict(tie_word_embeddings=False, bias=False) if untied_nobias else {}
    model = random_model(tiny_config("gpt2", vocab_size=VOCAB, norm_eps=1e-3, **over))
    save_model(model, tmp_path / "m", tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    done = export_gguf(tmp_path / "m", tmp_path / "m.gguf")
    assert done.architecture == "gpt2"
    llm = load(llama_cpp, done.path)
    assert llm.metadata["general.architecture"] == "gpt2"
    plain = max_diff(llm, model, tokenizer)
    print(f"gpt2 f32: max |logit diff| = {plain:.2e} (llama.cpp's fp16 GELU table)")
    assert plain < 1e-2
    monkeypatch.setattr(F, "gelu", _table_gelu(_ggml_gelu_table()))
    emulated = position_diffs(llm, model, tokenizer)
    print(f"gpt2 f32 against the emulated GELU table: median over positions {np.median(emulated):.2e}, "
          f"max {emulated.max():.2e}")
    # float32 rounding at almost every position; at a few, a last-bit difference in a GELU input crosses an fp16
    # rounding boundary of the table's index, and that one entry differs by an fp16 ulp
    assert np.median(emulated) < 1e-5 and emulated.max() < 1e-3


def test_mixtral_style_moe_exports_as_llama_with_experts(llama_cpp, tmp_path, tokenizer):
    cfg = tiny_config("llama", vocab_size=VOCAB, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      tie_word_embeddings=False)
    model = random_model(cfg)
    save_model(model, tmp_path / "m", tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    done = export_gguf(tmp_path / "m", tmp_path / "m.gguf")
    llm = load(llama_cpp, done.path)
    assert llm.metadata["llama.expert_count"] == "4" and llm.metadata["llama.expert_used_count"] == "2"
    diff = max_diff(llm, model, tokenizer)
    print(f"Mixtral-style MoE f32: max |logit diff| = {diff:.2e}")
    assert diff < 1e-4


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_qk_norm_model_exports_as_qwen3(llama_cpp, tmp_path, tokenizer, tied):
    """A Llama-style model with QK-norm is llama.cpp's qwen3: the norms as attn_q_norm / attn_k_norm (f32), and q/k
    rows as they are, since qwen3 rotates the halves of each head (NEOX RoPE) as PocketLM does. Tied: llama.cpp
    reuses token_embd as the output."""
    cfg = tiny_config("qwen3", vocab_size=VOCAB, rope_theta=5e4, norm_eps=1e-6, tie_word_embeddings=tied)
    model = random_model(cfg, scale=8)
    save_model(model, tmp_path / "m", tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    done = export_gguf(tmp_path / "m", tmp_path / "m.gguf", outtype="f16")
    assert done.architecture == "qwen3"
    reader = gguf.GGUFReader(done.path)
    tensors = {t.name: t for t in reader.tensors}
    assert {tensors[f"blk.1.attn_{n}_norm.weight"].tensor_type.name for n in "qk"} == {"F32"}
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == "F16" and ("output.weight" in tensors) != tied
    q_rows = np.asarray(tensors["blk.0.attn_q.weight"].data, dtype=np.float32)  # (out, in): not permuted
    want = model.layers[0].self_attn.q_proj.weight.detach().half().float().numpy()
    assert np.array_equal(q_rows, want)
    export_gguf(tmp_path / "m", tmp_path / "m32.gguf")
    llm = load(llama_cpp, tmp_path / "m32.gguf")
    assert llm.metadata["general.architecture"] == "qwen3" and float(llm.metadata["qwen3.rope.freq_base"]) == 5e4
    diff = max_diff(llm, model, tokenizer)
    print(f"qwen3 f32: max |logit diff| = {diff:.2e}")
    assert diff < 1e-4
    for text in PROMPTS[:3]:  # greedy decoding through llama.cpp's KV cache, token for token
        prompt = tokenizer.encode(text)
        ours = generate(model, [prompt], max_new_tokens=20, temperature=0)[0]
        theirs = []
        for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            theirs.append(token)
            if len(theirs) == len(ours):
                break
        assert len(ours) == 20 and theirs == ours, text
        assert len(set(ours)) > 10


@pytest.mark.parametrize("style", ["llama", "qwen3"])
@pytest.mark.parametrize("spec", ["linear:2", "yarn:4", "yarn:4,attention_factor=1.3"])
def test_rope_scaling_matches_llama_cpp_past_the_training_context(llama_cpp, tmp_path, style, spec):
    """Exported with --rope_scaling, llama.cpp computes our logits over the whole scaled context (factor x the
    training context of 64): linear, YaRN, and YaRN with its own attention factor (a checkpoint whose config
    carries the scaling, exported as it is)."""
    model = random_model(tiny_config(style, vocab_size=VOCAB, rope_theta=5e4, norm_eps=1e-5), scale=8)
    save_model(model, tmp_path / "m", tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    flag, _, extra = spec.partition(",")
    scaling = parse_rope_scaling(flag)
    if extra:
        key, value = extra.split("=")
        scaled, _ = load_model(tmp_path / "m", rope_scaling={**scaling, key: float(value)})
        save_model(scaled, tmp_path / "scaled", tokenizer_dir=DEFAULT_TOKENIZER_DIR)
        assert convert_main(["--checkpoint", str(tmp_path / "scaled"), "--to", "gguf", "--out",
                             str(tmp_path / "m.gguf")]) == 0
    else:
        scaled, _ = load_model(tmp_path / "m", rope_scaling=scaling)
        assert convert_main(["--checkpoint", str(tmp_path / "m"), "--to", "gguf", "--out", str(tmp_path / "m.gguf"),
                             "--rope_scaling", flag]) == 0
    n = scaled.config.max_position_embeddings
    assert n == 64 * scaling["factor"]
    llm = load(llama_cpp, tmp_path / "m.gguf", n_ctx=n)
    meta = {k.removeprefix(f"{style}.rope.scaling."): v for k, v in llm.metadata.items()
            if k.startswith(f"{style}.rope.scaling.")}
    assert meta.pop("type") == scaling["rope_type"] and float(meta.pop("factor")) == scaling["factor"]
    if scaling["rope_type"] == "yarn":
        assert int(meta.pop("original_context_length")) == 64
    if extra:  # llama.cpp multiplies this by its own 0.1 ln(factor) + 1
        assert float(meta.pop("attn_factor")) == pytest.approx(1.3 / (0.1 * np.log(4) + 1))
    assert not meta
    ids = torch.randint(0, VOCAB, (n,)).tolist()
    theirs = llama_logits(llm, ids)
    diff = float(np.abs(theirs - our_logits(scaled, ids)).max())
    print(f"{style} {spec}, {n} positions: max |logit diff| = {diff:.2e}")
    assert diff < 1e-4
    assert np.abs(theirs - our_logits(model, ids)).max() > 0.1  # unscaled logits: what a lost scaling would give


def test_rope_scaling_llama_cpp_would_compute_otherwise_is_refused(tmp_path):
    """llama.cpp ramps YaRN between 32 and 1 rotations, truncated, whatever the file says: other ramps are
    refused, before anything is written."""
    model = random_model(tiny_config("llama", vocab_size=VOCAB))
    for extra in ({"beta_fast": 16.0}, {"beta_slow": 2.0}, {"truncate": False}):
        scaled, _ = load_model(save_model(model, tmp_path / "m", tokenizer_dir=DEFAULT_TOKENIZER_DIR),
                               rope_scaling={"rope_type": "yarn", "factor": 4.0, **extra})
        save_model(scaled, tmp_path / "scaled", tokenizer_dir=DEFAULT_TOKENIZER_DIR)
        with pytest.raises(ConfigError, match="llama.cpp's YaRN uses beta_fast=32, beta_slow=1, truncate=true"):
            export_gguf(tmp_path / "scaled", tmp_path / "x.gguf")
    assert not list(tmp_path.glob("*.gguf*"))


def test_bf16_weights_and_a_padded_vocabulary(llama_cpp, tmp_path, tokenizer):
    """A bf16 checkpoint exports exactly (upcast) and a vocabulary rounded up past the tokenizer's 6400 tokens gets
    unused placeholder tokens, as llama.cpp's converter writes them."""
    model = random_model(tiny_config("llama", vocab_size=VOCAB + 64)).to(torch.bfloat16)
    save_model(model, tmp_path / "m", tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    loaded, _ = load_model(tmp_path / "m")  # fp32 holding the bf16 values
    done = export_gguf(tmp_path / "m", tmp_path / "m.gguf")
    llm = load(llama_cpp, done.path)
    assert llm.n_vocab() == VOCAB + 64
    assert llm.tokenize(PROMPTS[1].encode(), add_bos=False) == tokenizer.encode(PROMPTS[1])
    assert max_diff(llm, loaded, tokenizer) < 1e-4
    reader = gguf.GGUFReader(done.path)
    types = reader.fields["tokenizer.ggml.token_type"]
    assert [int(types.parts[i][0]) for i in types.data[-64:]] == [gguf.TokenType.UNUSED] * 64


def test_lora_run_exports_merged(llama_cpp, tmp_path, tokenizer):
    from model.lora import LoraSpec, apply_lora, base_reference, save_lora

    base = random_model(tiny_config("llama", vocab_size=VOCAB))
    save_model(base, tmp_path / "base", tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    apply_lora(base, LoraSpec(rank=4, targets=("q_proj", "k_proj", "v_proj", "gate_proj")))
    with torch.no_grad():  # adapters start as a no-op (B = 0): give them an update that shows
        for name, p in base.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    save_lora(base, tmp_path / "lora", LoraSpec(rank=4, targets=("q_proj", "k_proj", "v_proj", "gate_proj")),
              base_reference(tmp_path / "base"), tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    merged, _ = load_model(tmp_path / "lora")
    plain, _ = load_model(tmp_path / "base")
    out = tmp_path / "lora.gguf"
    assert convert_main(["--checkpoint", str(tmp_path / "lora"), "--to", "gguf", "--out", str(out)]) == 0
    llm = load(llama_cpp, out)
    assert max_diff(llm, merged, tokenizer) < 1e-4
    assert max_diff(llm, plain, tokenizer) > 1e-2  # the adapters are in it


@pytest.mark.slow  # trains (a few seconds)
def test_trained_sft_run_exports_from_its_run_dir(llama_cpp, sft_run, tmp_path, tokenizer, capsys):
    """A real run directory (latest pointer, the tokenizer files training copied): the CLI as a user runs it."""
    out = tmp_path / "sft.gguf"
    assert convert_main(["--checkpoint", str(sft_run), "--to", "gguf", "--out", str(out), "--outtype", "f32"]) == 0
    assert "wrote GGUF" in capsys.readouterr().out
    model, model_dir = load_model(sft_run)
    llm = load(llama_cpp, out)
    assert llm.metadata["tokenizer.chat_template"]
    ids = tokenizer.chat_prompt(CHAT)
    assert float(np.abs(llama_logits(llm, ids) - our_logits(model, ids)).max()) < 1e-4


# -------------------------------------------------------------------------- errors
def _run(argv, capsys) -> tuple[int, str]:
    rc = convert_main(argv)
    return rc, capsys.readouterr().err


def test_cli_errors(tmp_path, capsys):
    m = str(save_model(random_model(tiny_config("llama", vocab_size=VOCAB)), tmp_path / "m",
                       tokenizer_dir=DEFAULT_TOKENIZER_DIR))
    rc, err = _run(["--checkpoint", m, "--to", "gguf"], capsys)
    assert rc == 2 and "--out" in err
    rc, err = _run(["--checkpoint", m, "--to", "gguf", "--out", str(tmp_path / "x.gguf"), "--out_dir", m], capsys)
    assert rc == 2 and "--out_dir does not apply" in err
    rc, err = _run(["--checkpoint", m, "--to", "gguf", "--out", str(tmp_path / "x.gguf"), "--dtype", "float16"],
                   capsys)
    assert rc == 2 and "--outtype" in err
    rc, err = _run(["--checkpoint", m, "--out_dir", str(tmp_path / "hf"), "--outtype", "f16"], capsys)
    assert rc == 2 and "--to gguf only" in err
    rc, err = _run(["--from_hf", m, "--to", "gguf", "--out", str(tmp_path / "x.gguf")], capsys)
    assert rc == 2 and "--checkpoint" in err
    rc, err = _run(["--checkpoint", m, "--to", "gguf", "--out", str(tmp_path)], capsys)
    assert rc == 2 and "is a directory" in err
    with pytest.raises(SystemExit) as e:
        convert_main(["--checkpoint", m, "--to", "gguf", "--out", str(tmp_path / "x.gguf"), "--outtype", "q4_k"])
    assert e.value.code == 2 and "invalid choice: 'q4_k'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="unknown --outtype 'q4_k'"):
        export_gguf(m, tmp_path / "x.gguf", outtype="q4_k")
    assert not list(tmp_path.glob("*.gguf*"))  # nothing half-written


def test_unsupported_models_are_refused(tmp_path, capsys):
    moe = tiny_config("llama", vocab_size=VOCAB, num_experts=4, num_experts_per_tok=2, num_shared_experts=1)
    save_model(random_model(moe), tmp_path / "moe", tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    rc, err = _run(["--checkpoint", str(tmp_path / "moe"), "--to", "gguf", "--out", str(tmp_path / "x.gguf")], capsys)
    assert rc == 2 and "1 shared experts" in err and "--to hf" in err
    custom = tiny_config("llama", vocab_size=VOCAB, position_embedding="learned")
    save_model(random_model(custom), tmp_path / "custom", tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    with pytest.raises(ConfigError, match="position_embedding=learned"):
        export_gguf(tmp_path / "custom", tmp_path / "x.gguf")
    small = tiny_config("llama")  # vocab 256 with the 6400-token tokenizer beside it
    save_model(random_model(small), tmp_path / "small", tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    rc, err = _run(["--checkpoint", str(tmp_path / "small"), "--to", "gguf", "--out", str(tmp_path / "x.gguf")], capsys)
    assert rc == 2 and "does not fit the model's vocab_size 256" in err
    assert not list(tmp_path.glob("*.gguf*"))
