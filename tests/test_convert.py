"""Export to / import from transformers, checkpoint loading, and the convert CLI's error messages."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dataset.tokenizer import DEFAULT_TOKENIZER_DIR
from export.convert import export_hf, from_hf_config, import_hf
from model import CheckpointError, ConfigError, PocketLM, get_preset, load_model, save_model
from model.config import parse_rope_scaling

from conftest import ROOT, tiny_config

transformers = pytest.importorskip("transformers")

CASES = {
    "llama-gqa-tied": tiny_config("llama", rope_theta=5e4),
    "llama-mha-untied": tiny_config("llama", num_key_value_heads=4, tie_word_embeddings=False),
    "qwen3-gqa-tied": tiny_config("qwen3", rope_theta=5e4, norm_eps=1e-6),  # Llama + QK-norm: Qwen3ForCausalLM
    "qwen3-mha-untied": tiny_config("qwen3", num_key_value_heads=4, tie_word_embeddings=False),
    "gpt2-tied": tiny_config("gpt2", norm_eps=1e-3),  # not GPT-2's default eps, so the export must write it
    "gpt2-untied-nobias": tiny_config("gpt2", tie_word_embeddings=False, bias=False),
}


def _random_model(cfg) -> PocketLM:
    model = PocketLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a mis-mapped one would show
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_logits_match_transformers(case, tmp_path):
    model = _random_model(CASES[case])
    save_model(model, tmp_path / "ours")
    export_hf(tmp_path / "ours", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    expected_cls = {"gpt2": "GPT2LMHeadModel", "qwen3": "Qwen3ForCausalLM"}.get(case.split("-")[0], "LlamaForCausalLM")
    assert type(hf).__name__ == expected_cls
    ids = torch.randint(0, 256, (2, 100))  # longer than max_seq_len (64): RoPE past the training context
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip_through_transformers_is_exact(case, tmp_path):
    model = _random_model(CASES[case])
    save_model(model, tmp_path / "ours", tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    export_hf(tmp_path / "ours", tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "back")
    back, _ = load_model(tmp_path / "back")
    assert back.config.style == model.config.style
    for field in ("norm_eps", "tie_word_embeddings", "rope_theta", "num_key_value_heads"):
        assert getattr(back.config, field) == getattr(model.config, field), field
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):  # travel both ways
        assert (tmp_path / "hf" / name).is_file() and (tmp_path / "back" / name).is_file(), name
    ids = torch.randint(0, 256, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(back(ids), model(ids), atol=1e-6, rtol=0)


def test_import_transformers_llama_with_gqa(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                                   rope_theta=20000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ours")
    ours, _ = load_model(tmp_path / "ours")
    assert ours.config.num_key_value_heads == 2 and ours.config.rope_theta == 20000.0
    ids = torch.randint(0, 300, (2, 50))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=0)


def test_import_transformers_gpt2(tmp_path):
    cfg = transformers.GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ours")
    ours, _ = load_model(tmp_path / "ours")
    ids = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------- RoPE scaling
def _spread_model(cfg) -> PocketLM:
    """_random_model with matrices 4x the init scale: attention is sharp, so positions (and how RoPE scaling
    places them) move the logits by far more than the comparisons' tolerance."""
    model = _random_model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(4)
    return model


@pytest.mark.parametrize("style", ["llama", "qwen3"])
@pytest.mark.parametrize("spec", ["linear:2", "linear:4", "yarn:2", "yarn:4"])
def test_rope_scaling_export_matches_transformers_past_the_training_context(spec, style, tmp_path):
    """Exported with --rope_scaling, transformers computes our logits over the whole scaled context (factor x the
    training context of 64); unscaled, both would be far off."""
    model = _spread_model(CASES[f"{style}-gqa-tied"])
    save_model(model, tmp_path / "ours")
    scaling = parse_rope_scaling(spec)
    export_hf(tmp_path / "ours", tmp_path / "hf", rope_scaling=scaling)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    kind, factor = spec.split(":")
    assert written["rope_scaling"]["rope_type"] == written["rope_parameters"]["rope_type"] == kind
    assert written["rope_scaling"]["factor"] == written["rope_parameters"]["factor"] == float(factor)
    assert written["max_position_embeddings"] == 64 * int(factor)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours, _ = load_model(tmp_path / "ours", rope_scaling=scaling)
    ids = torch.randint(0, 256, (2, 64 * int(factor)))
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(ours(ids), expected, atol=1e-4, rtol=0)
        assert (model(ids) - expected).abs().max() > 0.1  # the unscaled model: what a dropped scaling would give


@pytest.mark.parametrize("spec", ["linear:4", "yarn:4"])
def test_rope_scaling_survives_a_round_trip_through_transformers(spec, tmp_path):
    model = _spread_model(CASES["llama-gqa-tied"])
    save_model(model, tmp_path / "ours")
    export_hf(tmp_path / "ours", tmp_path / "hf", rope_scaling=parse_rope_scaling(spec))
    import_hf(tmp_path / "hf", tmp_path / "back")
    back, _ = load_model(tmp_path / "back")
    scaled, _ = load_model(tmp_path / "ours", rope_scaling=parse_rope_scaling(spec))
    assert back.config.rope_scaling == scaled.config.rope_scaling
    assert back.config.max_seq_len == 64 and back.config.max_position_embeddings == 256  # the training context
    ids = torch.randint(0, 256, (1, 256))
    with torch.no_grad():
        torch.testing.assert_close(back(ids), scaled(ids), atol=1e-6, rtol=0)


def test_import_a_transformers_yarn_model(tmp_path):
    """A transformers model configured with YaRN (non-default ramp and attention factor) imports and computes the
    same logits."""
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 8.0,
               "beta_slow": 0.5, "attention_factor": 1.2}
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   rope_parameters={**scaling, "rope_theta": 1e4}, tie_word_embeddings=True)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ours")
    ours, _ = load_model(tmp_path / "ours")
    assert ours.config.rope_scaling == scaling and ours.config.max_seq_len == 32
    ids = torch.randint(0, 300, (2, 128))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=0)


LLAMA_HF = dict(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                num_attention_heads=8)
GPT2_HF = dict(model_type="gpt2", vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=128)


@pytest.mark.parametrize("hf, message", [
    ({**LLAMA_HF, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope scaling"),
    ({**LLAMA_HF, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope scaling"),
    ({**LLAMA_HF, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "factor must be a number >= 1"),
    ({**LLAMA_HF, "rope_scaling": {"type": "linear", "factor": 2.0, "low_freq_factor": 1}}, "unknown keys"),
    ({**LLAMA_HF, "rope_scaling": "yarn"}, "expected an object"),
    ({**LLAMA_HF, "attention_bias": True}, "attention/mlp biases"),
    ({**LLAMA_HF, "mlp_bias": True}, "attention/mlp biases"),
    ({**LLAMA_HF, "head_dim": 16}, "head_dim=16 != hidden/heads"),
    ({**GPT2_HF, "activation_function": "gelu"}, "activation_function=gelu"),
    ({**GPT2_HF, "activation_function": "relu"}, "activation_function=relu"),
    ({**GPT2_HF, "scale_attn_by_inverse_layer_idx": True}, "non-standard attention scaling"),
    ({**GPT2_HF, "scale_attn_weights": False}, "non-standard attention scaling"),
    ({**LLAMA_HF, "model_type": "mistral"}, "model_type 'mistral' is not supported"),
])
def test_transformers_configs_we_cannot_compute_are_refused(hf, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        from_hf_config(hf, "config.json")


def test_transformers_config_defaults():
    """Keys a config.json may leave out take transformers' defaults for that model type."""
    llama = from_hf_config(LLAMA_HF, "config.json")
    assert llama.tie_word_embeddings is False and llama.num_key_value_heads == 8 and llama.norm_eps == 1e-6
    assert llama.max_position_embeddings == 2048 and llama.style == "llama"
    assert from_hf_config({**LLAMA_HF, "num_key_value_heads": 2, "max_position_embeddings": 8192},
                          "c").num_key_value_heads == 2
    gpt2 = from_hf_config(GPT2_HF, "config.json")
    assert gpt2.tie_word_embeddings is True and gpt2.norm_eps == 1e-5 and gpt2.intermediate_size == 256
    assert gpt2.max_seq_len == gpt2.max_position_embeddings == 128 and gpt2.style == "gpt2"
    assert from_hf_config({**GPT2_HF, "n_positions": 1024}, "c").max_seq_len == 1024  # GPT-2 trains at full context


def test_unsupported_transformers_config_is_named(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, hidden_act="gelu")
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="hidden_act=gelu"):
        import_hf(tmp_path / "hf", tmp_path / "ours")


def test_export_copies_tokenizer_and_sets_special_ids(tmp_path):
    model = _random_model(CASES["llama-gqa-tied"])
    save_model(model, tmp_path / "ours")
    added = [{"id": i, "content": c, "special": True} for i, c in
             enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])]
    (tmp_path / "ours" / "tokenizer.json").write_text(json.dumps({"added_tokens": added}))
    export_hf(tmp_path / "ours", tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_cfg["eos_token_id"] == [2, 0] and hf_cfg["pad_token_id"] == 0
    assert hf_cfg["bos_token_id"] == 1  # <|im_start|>
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": [2, 0], "pad_token_id": 0}
    # only tokens marked special count: an ordinary added token named like one is text
    added.append({"id": 7, "content": "<|im_end|>x", "special": False})
    (tmp_path / "ours" / "tokenizer.json").write_text(json.dumps({"added_tokens": added}))
    from model.loading import special_token_ids
    assert special_token_ids(tmp_path / "ours") == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}


def test_export_in_bfloat16(tmp_path):
    from safetensors.torch import load_file
    model = _random_model(CASES["llama-gqa-tied"])
    save_model(model, tmp_path / "ours")
    export_hf(tmp_path / "ours", tmp_path / "hf", dtype=torch.bfloat16)
    assert {t.dtype for t in load_file(tmp_path / "hf" / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_gpt2_export_refuses_grouped_query_attention(tmp_path):
    save_model(PocketLM(tiny_config("gpt2", num_key_value_heads=2)), tmp_path / "ours")
    with pytest.raises(ConfigError, match="GPT-2 has no grouped-query attention"):
        export_hf(tmp_path / "ours", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()  # refused before anything is written


def test_run_dir_latest_pointer_and_minimind_style_pth(tmp_path):
    model = _random_model(CASES["llama-gqa-tied"])
    save_model(model, tmp_path / "run" / "step_00000010")
    (tmp_path / "run" / "latest").write_text("step_00000010\n")
    loaded, model_dir = load_model(tmp_path / "run")
    assert model_dir.name == "step_00000010"
    # MiniMind saves a plain state dict with HF names ("model." prefix) and the tied head stored twice
    sd = {("model." + k if not k.startswith("lm_head") else k): v for k, v in model.state_dict().items()}
    torch.save(sd, tmp_path / "mm.pth")
    pth_model, _ = load_model(tmp_path / "mm.pth", config=model.config)
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(pth_model(ids), model(ids), atol=0, rtol=0)


def test_wrapped_and_prefixed_state_dicts_load(tmp_path):
    """DDP ("module."), torch.compile ("_orig_mod.") prefixes and {"model": ...}-style wrappers are unwrapped."""
    model = _random_model(CASES["llama-gqa-tied"])
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    ids = torch.randint(0, 256, (1, 20))
    for i, wrapped in enumerate([{"module." + k: v for k, v in state.items()},
                                 {"module._orig_mod." + k: v for k, v in state.items()},
                                 {"model": state, "step": 3}, {"state_dict": state}, {"model_state_dict": state}]):
        torch.save(wrapped, tmp_path / f"w{i}.pth")
        loaded, _ = load_model(tmp_path / f"w{i}.pth", config=model.config)
        assert not loaded.training
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids), model(ids), atol=0, rtol=0)


def test_load_model_casts_to_the_requested_dtype(tmp_path):
    save_model(_random_model(CASES["llama-gqa-tied"]), tmp_path / "ours")
    model, _ = load_model(tmp_path / "ours", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and not model.training


@pytest.mark.parametrize("edit, message", [
    ("drop", "missing 1 tensors (e.g. layers.1.mlp.up_proj.weight)"),
    ("extra", "1 unexpected tensors (e.g. layers.0.self_attn.rotary.inv_freq)"),
    ("untie", "lm_head.weight differs from embed_tokens.weight but the config says tie_word_embeddings=true"),
])
def test_checkpoint_that_does_not_match_the_config(tmp_path, edit, message):
    model = _random_model(CASES["llama-gqa-tied"])
    state = dict(model.state_dict())
    if edit == "drop":
        del state["layers.1.mlp.up_proj.weight"]
    elif edit == "extra":
        state["layers.0.self_attn.rotary.inv_freq"] = torch.ones(8)
    else:
        state["lm_head.weight"] = state["embed_tokens.weight"] + 1
    torch.save(state, tmp_path / "w.pth")
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model(tmp_path / "w.pth", config=model.config)


def test_shape_mismatch_names_the_tensor(tmp_path):
    model = _random_model(CASES["llama-gqa-tied"])
    save_model(model, tmp_path / "ours")
    wrong = tiny_config("llama", num_key_value_heads=4)
    with pytest.raises(CheckpointError, match=r"k_proj.weight has shape \(32, 64\) but the config expects \(64, 64\)"):
        load_model(tmp_path / "ours", config=wrong)


def _convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "model.convert", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("setup, args, message", [
    ("text", ["--checkpoint", "{d}/notes.txt", "--preset", "tiny"], "notes.txt: not a readable weights file"),
    ("none", ["--checkpoint", "{d}/missing"], "missing: no such file or directory"),
    ("emptydir", ["--checkpoint", "{d}"], "no model.safetensors here"),
    ("ours", ["--checkpoint", "{d}/ours", "--preset", "minimind-26m"], "has 2 layers but the config expects 8"),
    ("ours", ["--checkpoint", "{d}/ours/model.safetensors", "--preset", "mini-30m"], "has 2 layers"),
    ("ours", ["--checkpoint", "{d}/ours", "--preset", "nope"], "unknown preset 'nope'"),
    ("foreign", ["--checkpoint", "{d}/foreign.pth", "--preset", "tiny"], "expected a dict of parameter tensors"),
    ("custom", ["--checkpoint", "{d}/custom"], "no transformers class matches"),
    ("none", ["--from_hf", "{d}", "--out_dir", "{d}/x"], "no config.json"),
    ("ours", ["--checkpoint", "{d}/ours", "--rope_scaling", "yarn:x"], "--rope_scaling 'yarn:x': expected"),
    ("ours", ["--from_hf", "{d}/ours", "--rope_scaling", "yarn:4"], "--rope_scaling applies to exports"),
    ("gpt2", ["--checkpoint", "{d}/gpt2", "--rope_scaling", "linear:2"], "rope_scaling applies to RoPE models"),
])
@pytest.mark.slow  # starts a process
def test_convert_cli_errors_are_one_line(tmp_path, setup, args, message):
    if setup == "text":
        (tmp_path / "notes.txt").write_text("hello")
    elif setup == "ours":
        save_model(PocketLM(tiny_config()), tmp_path / "ours")
    elif setup == "foreign":
        torch.save([1, 2, 3], tmp_path / "foreign.pth")
    elif setup == "custom":
        save_model(PocketLM(tiny_config(norm="layernorm")), tmp_path / "custom")
    elif setup == "gpt2":
        save_model(PocketLM(tiny_config("gpt2")), tmp_path / "gpt2")
    args = [a.format(d=tmp_path) for a in args]
    if "--out_dir" not in args:
        args += ["--out_dir", str(tmp_path / "hf_out")]
    result = _convert(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert message in lines[0]


@pytest.mark.slow  # starts a process
def test_convert_cli_success(tmp_path):
    save_model(PocketLM(get_preset("tiny")), tmp_path / "ours")
    result = _convert("--checkpoint", str(tmp_path / "ours"), "--out_dir", str(tmp_path / "hf"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "hf" / "model.safetensors").is_file()
