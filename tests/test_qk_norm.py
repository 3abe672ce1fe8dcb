"""Two model switches: QK-norm (qk_norm, the Qwen3 style) and zero-initialised residual projections
(zero_init_residual): what they compute, how they count, load, train and export, and the trainer flags for them."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from model import ConfigError, ModelConfig, PocketLM, get_preset, load_model, save_model
from model.config import architecture, config_from_flags, model_name
from model.model import KVCache
from model.stats import attention_probs
from trainer_utils.config import NEW_MODEL_FLAGS, ModelOptions
from trainer_utils.stages import parse_train_config

from conftest import tiny_config

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _randomize_norms(model: PocketLM) -> PocketLM:
    """Norm weights off one (as after training), so that a norm applied in the wrong place would show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


# ------------------------------------------------------------------------------ QK-norm: the config
def test_style_and_validation():
    assert tiny_config("qwen3").style == "qwen3" and tiny_config().style == "llama"
    assert tiny_config("qwen3", **MOE).style == "custom"  # no Qwen3-MoE mapping: exports refuse it
    assert tiny_config("qwen3", position_embedding="learned").style == "custom"
    with pytest.raises(ConfigError, match="qk_norm .* needs norm='rmsnorm', got norm='layernorm'"):
        tiny_config("gpt2", qk_norm=True)
    with pytest.raises(ConfigError, match="qk_norm must be true or false, got 'yes'"):
        tiny_config(qk_norm="yes")


@pytest.mark.parametrize("overrides", [dict(), dict(tie_word_embeddings=False, num_key_value_heads=4),
                                       dict(MOE, num_shared_experts=1), dict(position_embedding="learned")])
def test_closed_form_parameter_count_includes_the_qk_norms(overrides):
    cfg, plain = tiny_config("qwen3", **overrides), tiny_config(**overrides)
    model = PocketLM(cfg)
    assert model.num_parameters() == cfg.num_parameters()
    assert cfg.num_parameters() - plain.num_parameters() == 2 * cfg.head_dim * cfg.num_hidden_layers
    assert cfg.num_parameters(non_embedding=True) - plain.num_parameters(non_embedding=True) == 2 * 16 * 2
    names = {n for n, _ in model.named_parameters()}
    assert {"layers.1.self_attn.q_norm.weight", "layers.1.self_attn.k_norm.weight"} <= names  # Qwen3's names
    assert all(torch.equal(p, torch.ones(16)) for n, p in model.named_parameters() if "_norm" in n)  # init


def test_config_json_with_and_without_the_new_keys(tmp_path):
    cfg = tiny_config("qwen3", zero_init_residual=True)
    cfg.save(tmp_path / "new.json")
    assert ModelConfig.load(tmp_path / "new.json") == cfg
    old = {k: v for k, v in tiny_config().to_dict().items() if k not in ("qk_norm", "zero_init_residual")}
    (tmp_path / "old.json").write_text(json.dumps(old))  # a config.json written before the switches existed
    loaded = ModelConfig.load(tmp_path / "old.json")
    assert loaded == tiny_config() and not loaded.qk_norm and not loaded.zero_init_residual


# ------------------------------------------------------------------------------ QK-norm: the model
def test_queries_and_keys_are_rms_normalised_per_head_before_rope():
    model = PocketLM(tiny_config("qwen3")).eval()
    attn = model.layers[0].self_attn
    x = torch.randn(2, 10, 64) * 3
    with torch.no_grad():
        q, k, _ = attn.qkv(x, None)  # no positions: the norms' output itself
        rms = lambda t: t.pow(2).mean(-1).sqrt()  # noqa: E731 - over head_dim, per (batch, head, position)
        torch.testing.assert_close(rms(q), torch.ones(2, 4, 10), atol=1e-4, rtol=0)  # unit weights at init
        torch.testing.assert_close(rms(k), torch.ones(2, 2, 10), atol=1e-4, rtol=0)
        # RoPE after it rotates pairs of dimensions, which keeps each head's norm
        rope = (model.rope_cos[:10][None, None], model.rope_sin[:10][None, None])
        q_rope, k_rope, _ = attn.qkv(x, rope)
        torch.testing.assert_close(rms(q_rope), rms(q), atol=1e-5, rtol=0)
        assert not torch.allclose(q_rope, q)
        # with learned weights: weight * the unit-RMS head, computed from the projection by hand
        _randomize_norms(model)
        q, _, _ = attn.qkv(x, None)
        raw = attn.q_proj(x).view(2, 10, 4, 16)
        want = attn.q_norm.weight * raw / (raw.pow(2).mean(-1, keepdim=True) + model.config.norm_eps).sqrt()
        torch.testing.assert_close(q, want.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_qk_norm_bounds_the_attention_logits():
    """However large the query and key projections grow, the logits stay below sqrt(D) times the norms'
    weights; without QK-norm they grow with the projections."""
    for qk_norm in (False, True):
        model = PocketLM(tiny_config(qk_norm=qk_norm)).eval()
        attn = model.layers[0].self_attn
        with torch.no_grad():
            attn.q_proj.weight.mul_(100)
            attn.k_proj.weight.mul_(100)
            q, k, _ = attn.qkv(torch.randn(1, 12, 64), None)
        logits = (q @ k.repeat_interleave(2, dim=1).transpose(-2, -1)) / 16 ** 0.5
        if qk_norm:
            assert logits.abs().max() <= 16 ** 0.5 + 1e-4
        else:
            assert logits.abs().max() > 100


def test_kv_cache_decoding_equals_full_recompute():
    model = _randomize_norms(PocketLM(tiny_config("qwen3"))).eval()
    x = torch.randint(0, 256, (2, 20))
    with torch.no_grad():
        full = model(x)
        cache = KVCache(model.config, batch_size=2, max_len=20)
        steps = [model(x[:, :8], kv_cache=cache)]  # prefill, then one token at a time
        steps += [model(x[:, t:t + 1], kv_cache=cache) for t in range(8, 20)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


def test_attention_statistics_see_the_normalised_queries_and_keys():
    """model/stats.py recomputes the attention weights from Attention.qkv; with QK-norm they must still reproduce
    the attention's real output."""
    model = _randomize_norms(PocketLM(tiny_config("qwen3"))).eval()
    seen = []
    hooks = [b.self_attn.register_forward_hook(lambda m, a, out: seen.append((m, a, out))) for b in model.layers]
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 16)))
        for attn, args, output in seen:
            probs, _ = attention_probs(attn, *args[:3])
            _, _, v = attn.qkv(args[0], args[1])
            y = attn.o_proj((probs @ v.repeat_interleave(2, dim=1)).transpose(1, 2).reshape(2, 16, -1))
            torch.testing.assert_close(y, output, atol=1e-5, rtol=0)
    for h in hooks:
        h.remove()


def test_bf16_autocast_and_checkpointing_with_qk_norm():
    model = PocketLM(tiny_config("qwen3")).train()
    x = torch.randint(0, 256, (2, 16))

    def grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        model.zero_grad()
        model.set_gradient_checkpointing(checkpointing)
        F.cross_entropy(model(x).reshape(-1, 256), x.reshape(-1)).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain, ckpt = grads(False), grads(True)
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], atol=1e-6, rtol=1e-5, msg=name)
    assert plain["layers.0.self_attn.q_norm.weight"].abs().sum() > 0
    model.set_gradient_checkpointing(False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    loss = F.cross_entropy(logits.float().reshape(-1, 256), x.reshape(-1))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(model.layers[1].self_attn.k_norm.weight.grad).all()


# ------------------------------------------------------------------------- QK-norm: transformers export
def test_exports_as_qwen3_with_equal_logits_and_imports_back_exactly(tmp_path):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from export.convert import export_hf, import_hf

    model = _randomize_norms(PocketLM(tiny_config("qwen3", rope_theta=5e4, norm_eps=1e-6))).eval()
    with torch.no_grad():  # 4x the init scale: logits of order 1, attention far from uniform
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(4)
    save_model(model, tmp_path / "ours")
    export_hf(tmp_path / "ours", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert (config["head_dim"], config["attention_bias"], config["use_sliding_window"], config["tie_word_embeddings"],
            config["rope_theta"], config["rms_norm_eps"]) == (16, False, False, True, 5e4, 1e-6)
    assert "model.layers.1.self_attn.k_norm.weight" in load_file(tmp_path / "hf" / "model.safetensors")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    ids = torch.randint(0, 256, (2, 100))  # past max_seq_len (64): RoPE beyond the training context
    with torch.no_grad():
        ours = model(ids)
        assert ours.abs().max() > 2
        torch.testing.assert_close(hf(ids).logits, ours, atol=1e-5, rtol=0)
        # the QK-norms' weights matter: one of them reset to its init changes the logits
        hf.model.layers[0].self_attn.q_norm.weight.fill_(1.0)
        assert not torch.allclose(hf(ids).logits, ours, atol=1e-2)
    import_hf(tmp_path / "hf", tmp_path / "back")
    back, _ = load_model(tmp_path / "back")
    assert architecture(back.config) == architecture(model.config)  # (not the training context, max_seq_len)
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name  # bit-exact


def test_transformers_qwen3_imports(tmp_path):
    transformers = pytest.importorskip("transformers")
    from export.convert import import_hf

    cfg = transformers.Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=True)
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # transformers initialises the QK-norms at one: make them matter
        for name, p in hf.named_parameters():
            if "_norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ours")
    ours, _ = load_model(tmp_path / "ours")
    assert ours.config.style == "qwen3" and ours.config.num_key_value_heads == 2
    ids = torch.randint(0, 300, (2, 50))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-5, rtol=0)


QWEN3_HF = dict(model_type="qwen3", vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                num_attention_heads=8, head_dim=8)


@pytest.mark.parametrize("hf, message", [
    ({**QWEN3_HF, "attention_bias": True}, "attention biases"),
    ({**QWEN3_HF, "use_sliding_window": True}, "sliding-window attention"),
    ({**QWEN3_HF, "layer_types": ["full_attention", "sliding_attention"]}, "sliding-window attention"),
    ({k: v for k, v in QWEN3_HF.items() if k != "head_dim"}, "head_dim=128 != hidden/heads"),  # Qwen3's default
    ({**QWEN3_HF, "rope_scaling": {"rope_type": "llama3", "factor": 4.0}}, "rope scaling"),  # yarn is computed
])
def test_transformers_qwen3_configs_we_cannot_compute_are_refused(hf, message):
    from export.convert import from_hf_config

    with pytest.raises(ConfigError, match=message):
        from_hf_config(hf, "config.json")


def test_transformers_qwen3_config_defaults():
    from export.convert import from_hf_config

    cfg = from_hf_config(QWEN3_HF, "config.json")
    assert cfg.qk_norm and cfg.style == "qwen3" and cfg.tie_word_embeddings is False and cfg.norm_eps == 1e-6
    assert cfg.max_position_embeddings == 32768 and cfg.max_seq_len == 2048 and cfg.num_key_value_heads == 8


def test_exports_refuse_qk_norm_where_no_architecture_has_it(tmp_path):
    from export.convert import export_hf
    from export.gguf import llama_tensors

    save_model(PocketLM(tiny_config("qwen3", **MOE)), tmp_path / "moe")
    with pytest.raises(ConfigError, match="no transformers class matches .*qk_norm=True"):
        export_hf(tmp_path / "moe", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    model = PocketLM(tiny_config("qwen3"))
    with pytest.raises(ConfigError, match="llama architecture does not match this model"):
        llama_tensors(model.config, model.state_dict(), "llama")  # would drop the QK-norms


# --------------------------------------------------------------------------- zero_init_residual
@pytest.mark.parametrize("style, overrides", [("llama", {}), ("qwen3", {}), ("gpt2", {}),
                                              ("llama", dict(MOE, num_shared_experts=1))])
def test_zero_init_residual_makes_every_block_the_identity(style, overrides):
    model = PocketLM(tiny_config(style, zero_init_residual=True, **overrides)).eval()
    zeroed = [n for n, p in model.named_parameters() if not p.any()]
    assert zeroed and all(n.endswith(("o_proj.weight", "down_proj.weight", "down_proj", "bias")) for n in zeroed)
    assert any(n.endswith("experts.down_proj") for n in zeroed) == bool(overrides)
    seen = []
    hooks = [b.register_forward_hook(lambda m, args, out: seen.append((args[0], out[0]))) for b in model.layers]
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 16)))
    for h in hooks:
        h.remove()
    assert len(seen) == 2 and all(torch.equal(x, y) for x, y in seen)
    # the scaled normal init otherwise
    default = PocketLM(tiny_config(style, **overrides))
    assert default.layers[0].self_attn.o_proj.weight.std() > 0.005


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("style", ["llama", "qwen3"])
def test_gradients_reach_every_parameter_by_the_second_step(style, optimizer):
    """Step 1 gives the output projections a gradient (their inputs are not zero) but nothing behind them: the
    zero projections block it. After one update they are non-zero, and step 2 reaches every parameter."""
    model = PocketLM(tiny_config(style, zero_init_residual=True)).train()
    params = dict(model.named_parameters())
    opt = (torch.optim.SGD(model.parameters(), lr=0.1) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0))
    initial = {n: p.detach().clone() for n, p in params.items()}
    x = torch.randint(0, 256, (4, 32))
    with_grad = []
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(model(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1)).backward()
        with_grad.append({n for n, p in params.items() if p.grad is not None and p.grad.any()})
        opt.step()
    assert {"layers.0.self_attn.o_proj.weight", "layers.1.mlp.down_proj.weight", "embed_tokens.weight"} <= with_grad[0]
    assert "layers.0.self_attn.q_proj.weight" not in with_grad[0]  # behind the zero o_proj
    assert with_grad[1] == set(params), set(params) - with_grad[1]
    assert [n for n, p in params.items() if torch.equal(p, initial[n])] == []  # every parameter moved


def test_zero_init_residual_is_an_init_choice_not_architecture():
    cfg = get_preset("minimind-26m", zero_init_residual=True)
    assert model_name(cfg) == "minimind-26m" and "zero_init_residual" not in architecture(cfg)
    assert cfg.num_parameters() == get_preset("minimind-26m").num_parameters()
    # QK-norm is architecture: minimind-26m with it is another shape, the depth family's depth-8
    assert model_name(get_preset("minimind-26m", qk_norm=True)) == "depth-8"
    assert model_name(get_preset("minimind-26m", qk_norm=True, num_key_value_heads=4)) == "d512-l8"


# ------------------------------------------------------------------------------ trainer flags
def test_trainer_flags_reach_the_model_config():
    argv = ["--preset", "tiny", "--qk_norm", "--zero_init_residual", "--rope_theta", "50000"]
    cfg = config_from_flags(parse_train_config("pretrain", argv, "").model, vocab_size=256)
    assert (cfg.qk_norm, cfg.zero_init_residual, cfg.rope_theta, cfg.style) == (True, True, 5e4, "qwen3")
    default = config_from_flags(parse_train_config("pretrain", ["--preset", "tiny"], "").model)
    assert (default.qk_norm, default.zero_init_residual, default.rope_theta) == (False, False, 1e4)
    off = config_from_flags(parse_train_config("pretrain", ["--preset", "tiny", "--no-qk_norm"], "").model)
    assert off.qk_norm is False
    with pytest.raises(ConfigError, match="--rope_theta must be > 0"):
        parse_train_config("pretrain", ["--rope_theta", "0"], "")
    with pytest.raises(ConfigError, match="qk_norm .* needs norm='rmsnorm'"):  # a GPT-2-style preset
        config_from_flags(parse_train_config("pretrain", ["--preset", "gpt2-100m", "--qk_norm"], "").model)


@pytest.mark.parametrize("flag", [["--qk_norm"], ["--zero_init_residual"], ["--rope_theta", "5e5"]])
def test_trainer_flags_are_refused_with_init_from(flag):
    assert flag[0][2:] in NEW_MODEL_FLAGS
    with pytest.raises(ConfigError, match=f"{flag[0]} cannot take effect with --init_from"):
        parse_train_config("sft", ["--init_from", "out/base", *flag], "")


def test_memory_estimate_command_describes_the_trainers_qk_norm_model():
    from model.__main__ import StepOptions, model_config

    ours = model_config(StepOptions(preset="tiny", qk_norm=True))
    assert dataclasses.asdict(ours) == dataclasses.asdict(config_from_flags(ModelOptions(preset="tiny",
                                                                                       qk_norm=True)))


@pytest.mark.slow  # trains (a few seconds)
def test_a_training_run_builds_and_saves_the_switched_model(corpus, tmp_path):
    from test_train import flags

    import train_pretrain

    argv = flags(corpus, tmp_path, "qk", max_steps=2, qk_norm=True, zero_init_residual=True, rope_theta=5e4)
    assert train_pretrain.main(argv) == 0
    model, _ = load_model(tmp_path / "qk")
    assert (model.config.qk_norm, model.config.zero_init_residual, model.config.rope_theta) == (True, True, 5e4)
    assert model.layers[0].self_attn.o_proj.weight.any()  # trained away from its zero init
