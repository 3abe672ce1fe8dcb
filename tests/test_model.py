"""The decoder itself: causality, parameter counts, init, checkpointing, config validation."""
from __future__ import annotations

import json
import re

import pytest
import torch
import yaml

from model import PRESETS, ConfigError, ModelConfig, PocketLM, get_preset
from model.config import architecture, model_name, reshape_preset

from conftest import ROOT, tiny_config


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_changing_a_token_never_changes_earlier_logits(style):
    model = PocketLM(tiny_config(style)).eval()
    x = torch.randint(0, 256, (2, 24))
    base = model(x)
    for t in (0, 7, 23):
        y = x.clone()
        y[:, t] = (y[:, t] + 1) % 256
        out = model(y)
        torch.testing.assert_close(out[:, :t], base[:, :t], atol=0, rtol=0)  # bit-identical before t
        assert not torch.allclose(out[:, t], base[:, t])  # and the change is seen at t itself


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_logits_at_a_mask_are_those_positions_of_the_full_logits(style):
    """logits_at: the vocabulary projection only where the (B, T) mask is True, as rows in row-major order."""
    torch.manual_seed(0)
    model = PocketLM(tiny_config(style)).eval()
    x = torch.randint(0, 256, (3, 16))
    mask = torch.zeros(3, 16, dtype=torch.bool)
    mask[0, 3:7], mask[1, 15], mask[2, :] = True, True, True
    with torch.no_grad():
        full, some = model(x), model(x, logits_at=mask)
    assert some.shape == (4 + 1 + 16, 256)
    torch.testing.assert_close(some, full[mask], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_parameter_count_matches_closed_form(name):
    cfg = get_preset(name)
    with torch.device("meta"):  # no memory, no init cost: only shapes are needed
        model = PocketLM(cfg)
    assert model.num_parameters() == cfg.num_parameters()


def test_known_preset_sizes():
    assert round(get_preset("minimind-26m").num_parameters() / 1e6, 1) == 25.8
    assert round(get_preset("minimind-104m").num_parameters() / 1e6) == 104
    assert 95e6 < get_preset("gpt2-100m").num_parameters() < 105e6
    assert get_preset("minimind-26m").intermediate_size == 1408  # 64 * ceil(8/3 * 512 / 64)


@pytest.mark.parametrize("overrides", [dict(tie_word_embeddings=False), dict(bias=True),
                                       dict(norm="layernorm", bias=False), dict(qk_norm=True),
                                       dict(qk_norm=True, num_experts=4, moe_intermediate_size=32)])
def test_parameter_count_variants(overrides):
    cfg = tiny_config(**overrides)
    assert PocketLM(cfg).num_parameters() == cfg.num_parameters()


def test_tied_embeddings_share_storage():
    model = PocketLM(tiny_config())
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    untied = PocketLM(tiny_config(tie_word_embeddings=False))
    assert untied.lm_head.weight.data_ptr() != untied.embed_tokens.weight.data_ptr()


def test_init_scales_residual_projections():
    cfg = get_preset("mini-30m", num_hidden_layers=8)
    model = PocketLM(cfg)
    std_q = model.layers[0].self_attn.q_proj.weight.std().item()
    std_o = model.layers[0].self_attn.o_proj.weight.std().item()
    std_down = model.layers[0].mlp.down_proj.weight.std().item()
    assert abs(std_q - 0.02) < 1e-3
    for std in (std_o, std_down):
        assert abs(std - 0.02 / 4) < 5e-4  # 1/sqrt(2 * 8 layers) = 1/4
    assert torch.all(model.layers[0].input_layernorm.weight == 1)


def test_no_biases_in_llama_style():
    model = PocketLM(tiny_config())
    assert not [n for n, _ in model.named_parameters() if n.endswith("bias")]


def test_rmsnorm_computes_in_fp32_under_bf16():
    from model.model import RMSNorm
    norm = RMSNorm(64, 1e-5)
    x = torch.randn(4, 64) * 300  # squares overflow bf16 precision badly if summed in bf16
    ref = x / x.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()
    out = norm(x.bfloat16())
    torch.testing.assert_close(out.float(), ref.bfloat16().float(), atol=2e-2, rtol=2e-2)
    # That bound is wider than bf16's own error, so it cannot tell fp32 from bf16 statistics. Tight check: the
    # fp32 norm of the same bf16 input, rounded once to bf16. Computing in fp32 reproduces it (up to a rare
    # one-ulp double rounding); computing the mean of squares and rsqrt in bf16 is off on about a quarter of
    # the elements (measured: 25-30%).
    for scale in (1.0, 300.0):
        xb = (torch.randn(64, 64) * scale).bfloat16()
        xf = xb.float()
        want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16().float()
        got = norm(xb).float()
        torch.testing.assert_close(got, want, atol=0, rtol=2 ** -7)  # never more than one bf16 ulp
        mismatched = (got != want).float().mean().item()
        assert mismatched < 0.01, f"{mismatched:.1%} of outputs differ from the fp32 computation"


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_gradient_checkpointing_gives_same_gradients(style):
    cfg = tiny_config(style)
    model = PocketLM(cfg).train()
    x = torch.randint(0, 256, (2, 32))

    def grads(enabled: bool) -> dict[str, torch.Tensor]:
        model.zero_grad()
        model.set_gradient_checkpointing(enabled)
        logits = model(x)
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), x[:, 1:].reshape(-1)).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain, ckpt = grads(False), grads(True)
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], atol=1e-6, rtol=1e-5, msg=name)


def test_gradient_checkpointing_really_recomputes_each_block(monkeypatch):
    """Equal gradients alone would also hold if the switch were ignored: count the checkpointed blocks."""
    import model.model as model_module
    calls = []
    real = model_module.checkpoint
    monkeypatch.setattr(model_module, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = PocketLM(tiny_config()).train()
    x = torch.randint(0, 256, (2, 16))
    model(x).sum().backward()
    assert calls == []
    model.set_gradient_checkpointing(True)
    model(x).sum().backward()
    assert len(calls) == model.config.num_hidden_layers
    with torch.no_grad():  # nothing to recompute without a backward pass
        model(x)
    model.eval()
    model(x)
    assert len(calls) == model.config.num_hidden_layers


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_dropout_is_active_in_training_only(style):
    model = PocketLM(tiny_config(style, dropout=0.2))
    x = torch.randint(0, 256, (2, 16))
    model.eval()
    torch.testing.assert_close(model(x), model(x), atol=0, rtol=0)  # eval: attention dropout off too
    model.train()
    assert not torch.allclose(model(x), model(x))


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_norms_use_the_configured_eps(style):
    model = PocketLM(tiny_config(style, norm_eps=0.5))
    x = torch.randn(3, 64) * 0.3  # mean square ~0.09: an eps of 0.5 dominates it visibly
    for norm in (model.norm, model.layers[0].input_layernorm, model.layers[1].post_attention_layernorm):
        centred = x - x.mean(-1, keepdim=True) if style == "gpt2" else x  # LayerNorm centres, RMSNorm does not
        want = centred / (centred.pow(2).mean(-1, keepdim=True) + 0.5).sqrt()
        torch.testing.assert_close(norm(x), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_mlp_matches_its_formula(style):
    """SwiGLU is down(silu(gate(x)) * up(x)); GPT-2's GELU is the tanh approximation (as transformers' gelu_new)."""
    mlp = PocketLM(tiny_config(style)).layers[0].mlp
    x = torch.randn(5, 64) * 40  # pre-activations spread over about [-3, 3], where GELU variants differ by ~1e-3
    with torch.no_grad():
        up = x @ mlp.up_proj.weight.T + (mlp.up_proj.bias if mlp.up_proj.bias is not None else 0)
        if style == "llama":
            gate = x @ mlp.gate_proj.weight.T
            h = gate * torch.sigmoid(gate) * up
        else:
            assert up.abs().max() > 2
            h = 0.5 * up * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (up + 0.044715 * up ** 3)))
        want = h @ mlp.down_proj.weight.T + (mlp.down_proj.bias if mlp.down_proj.bias is not None else 0)
        torch.testing.assert_close(mlp(x), want, atol=1e-6, rtol=1e-5)


def test_rope_rotates_each_half_pair_by_its_position_angle():
    """Dimension i pairs with i + D/2 (Hugging Face rotate_half layout) and turns by position * theta^(-2i/D)."""
    from model.model import apply_rope, rope_tables
    D, theta = 16, 100.0
    cos, sin = rope_tables(D, 40, theta)
    x = torch.randn(1, 1, 40, D)
    got = apply_rope(x, cos[None, None], sin[None, None])
    pairs = torch.complex(x[..., :D // 2], x[..., D // 2:])
    angle = torch.arange(40.0)[:, None] * theta ** (-torch.arange(0, D, 2) / D)
    rotated = pairs * torch.polar(torch.ones_like(angle), angle)
    torch.testing.assert_close(got, torch.cat([rotated.real, rotated.imag], dim=-1), atol=1e-5, rtol=1e-5)


def test_every_query_may_attend_somewhere():
    """A query row with no allowed key makes some SDPA backends return NaN (CPU returns 0, hiding it): padding
    queries attend to themselves only, real ones causally to the real tokens."""
    model = PocketLM(tiny_config()).eval()
    pad = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    mask = model._attention_mask(pad, 0, 5, torch.device("cpu"))
    assert mask.any(-1).all()
    eye = torch.eye(5, dtype=torch.bool)
    assert torch.equal(mask[0, 0, :2], eye[:2])  # padding queries: themselves only
    assert torch.equal(mask[0, 0, 2:], torch.tril(torch.ones(5, 5, dtype=torch.bool))[2:] & pad[0].bool())
    assert torch.equal(mask[1, 0], torch.tril(torch.ones(5, 5, dtype=torch.bool)))


def test_bf16_autocast_forward_backward():
    model = PocketLM(tiny_config()).train()
    x = torch.randint(0, 256, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), x.reshape(-1))
    loss.backward()
    assert torch.isfinite(loss) and model.embed_tokens.weight.grad is not None


def test_config_json_round_trip(tmp_path):
    for name in PRESETS:
        cfg = get_preset(name)
        cfg.save(tmp_path / "c.json")
        assert ModelConfig.load(tmp_path / "c.json") == cfg
    assert json.loads((tmp_path / "c.json").read_text())["model_type"] == "pocketlm"
    # gradient checkpointing is a runtime switch, not architecture: it never lands in config.json
    cfg = tiny_config()
    cfg.gradient_checkpointing = True
    assert "gradient_checkpointing" not in cfg.to_dict()


@pytest.mark.parametrize("kwargs, message", [
    (dict(hidden_size=100, num_attention_heads=8), "divisible by num_attention_heads"),
    (dict(num_attention_heads=8, num_key_value_heads=3), "divisible by num_key_value_heads"),
    (dict(norm="batchnorm"), "norm='batchnorm' is not supported"),
    (dict(vocab_size=0), "vocab_size must be a positive integer"),
    (dict(max_seq_len=1024, max_position_embeddings=512), "max_position_embeddings (512) must be >="),
    (dict(hidden_size=36, num_attention_heads=4, num_key_value_heads=2), "RoPE needs an even head dimension, got 9"),
    (dict(dropout=1.0), "dropout must be in [0, 1), got 1.0"),
    (dict(dropout=-0.1), "dropout must be in [0, 1)"),
    (dict(rope_theta=0.0), "rope_theta and norm_eps must be positive"),
    (dict(norm_eps=0.0), "rope_theta and norm_eps must be positive"),
    (dict(num_hidden_layers=True), "num_hidden_layers must be a positive integer, got True"),
])
def test_inconsistent_configs_are_rejected(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig(**kwargs)


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="unknown preset 'gpt5'.*minimind-26m"):
        get_preset("gpt5")
    with pytest.raises(ConfigError, match=r"unknown config fields \['n_embd'\]"):
        get_preset("tiny", n_embd=64)  # a ConfigError naming the field, not a TypeError from the dataclass


def test_the_depth_family_is_sized_by_its_layers():
    """depth-N: 64 x N wide, heads of 64, two key-value heads where N is even (else one per head), QK-norm,
    context 256; depth 4, the demo recipe's model, is mini-30m narrowed to d256/L4 with QK-norm, by name too."""
    for depth, kv in ((1, 1), (3, 3), (4, 2), (6, 2), (12, 2)):
        c = get_preset(f"depth-{depth}")
        assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.head_dim, c.num_key_value_heads) == (
            64 * depth, depth, depth, 64, kv)
        assert c.qk_norm and c.max_seq_len == 256
        PocketLM(c)  # a valid network
    assert yaml.safe_load((ROOT / "recipes" / "demo-pretrain.yaml").read_text())["model"] == {"preset": "depth-4"}
    demo = reshape_preset("mini-30m", 256, 4, 256, qk_norm=True)
    assert architecture(demo) == architecture(get_preset("depth-4")) and model_name(demo) == "depth-4"
    assert model_name(get_preset("depth-4", hidden_size=512, num_attention_heads=8)) == "d512-l4"


@pytest.mark.parametrize("name", ["depth-0", "depth-49", "depth-x", "depth-04", "depth-", "depth--1"])
def test_a_depth_outside_the_family_is_refused(name):
    with pytest.raises(ConfigError, match="depth family|unknown preset"):
        get_preset(name)


def test_style_names_only_the_reference_architectures():
    assert tiny_config().style == "llama" and tiny_config("gpt2").style == "gpt2"
    assert tiny_config("gpt2", bias=False).style == "gpt2"  # GPT-2 export writes zero biases
    assert tiny_config("qwen3").style == "qwen3"  # Llama with QK-norm: exports as Qwen3
    # a Llama with biases, or a mix of switches, has no transformers class: export must refuse it
    for overrides in (dict(bias=True), dict(norm="layernorm"), dict(mlp="gelu"), dict(position_embedding="learned")):
        assert tiny_config(**overrides).style == "custom", overrides


def test_bad_config_files(tmp_path):
    (tmp_path / "a.json").write_text("{not json")
    with pytest.raises(ConfigError, match="a.json: not valid JSON"):
        ModelConfig.load(tmp_path / "a.json")
    (tmp_path / "b.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ConfigError, match="model_type is 'llama'"):
        ModelConfig.load(tmp_path / "b.json")
    (tmp_path / "c.json").write_text(json.dumps({"hidden_size": 64, "n_embd": 3}))
    with pytest.raises(ConfigError, match=r"unknown config keys \['n_embd'\]"):
        ModelConfig.load(tmp_path / "c.json")
    (tmp_path / "d.json").write_text(json.dumps({"hidden_size": "64"}))
    with pytest.raises(ConfigError, match="hidden_size must be a positive integer, got .64."):
        ModelConfig.load(tmp_path / "d.json")


def test_learned_positions_refuse_positions_past_the_table():
    model = PocketLM(tiny_config("gpt2", max_position_embeddings=64)).eval()
    with pytest.raises(ValueError, match="beyond max_position_embeddings"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_readme_preset_table_is_current():
    from model.config import preset_table

    from conftest import ROOT
    assert preset_table() in (ROOT / "docs/model.md").read_text(), "stale preset table in docs/model.md"


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_a_decoded_tokens_logits_match_the_full_forward_whatever_the_query_groups(kv_heads):
    # Decoding one token folds each KV head's query heads into query rows (no copy of the cache): its logits
    # must be those of attending with the expanded keys, as the full forward over the sequence does.
    from model.model import KVCache

    torch.manual_seed(0)
    model = PocketLM(tiny_config(num_key_value_heads=kv_heads)).eval()
    ids = torch.randint(1, 256, (3, 10))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[0, :4] = 0  # a left-padded row
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = KVCache(model.config, 3, 10)
    with torch.no_grad():
        model(ids[:, :9], position_ids=positions[:, :9], attention_mask=mask[:, :9], kv_cache=cache)
        step = model(ids[:, 9:], position_ids=positions[:, 9:], attention_mask=mask, kv_cache=cache)[:, -1]
        full = model(ids, position_ids=positions, attention_mask=mask)[:, -1]
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)
