"""RoPE scaling (ModelConfig.rope_scaling): the tables against transformers', the load-time option, validation.

The exports' parity with transformers and llama.cpp is tested in test_convert.py and test_gguf.py, perplexity
past the training context in test_eval.py.
"""
from __future__ import annotations

import pytest
import torch

from model import ConfigError, ModelConfig, PocketLM, load_model, save_model
from model.config import parse_rope_scaling, with_rope_scaling
from model.inference import ContextConfig
from model.model import rope_tables

from conftest import tiny_config

transformers = pytest.importorskip("transformers")

# Scalings as transformers' rope_parameters write them; the YaRN ramp's bounds chosen so that they move the ramp
# for a head of 16 dimensions (at the defaults 32 / 1 and 16 / 2 it covers the same dimensions).
SCALINGS = {
    "linear-2": {"rope_type": "linear", "factor": 2.0},
    "linear-3.5": {"rope_type": "linear", "factor": 3.5},
    "yarn-4": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-2.5": {"rope_type": "yarn", "factor": 2.5, "original_max_position_embeddings": 64},
    "yarn-ramp": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 2.0,
                  "beta_slow": 0.1},
    "yarn-untruncated": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "truncate": False},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                              "attention_factor": 1.25},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 1.0,
                    "mscale_all_dim": 0.5},
}


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_tables_are_transformers_rotary_embedding(name):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaling, theta, positions = SCALINGS[name], 5e4, 300
    cos, sin = rope_tables(16, positions, theta, scaling)
    hf = LlamaRotaryEmbedding(transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=positions,
        rope_parameters={**scaling, "rope_theta": theta}))
    hf_cos, hf_sin = hf(torch.zeros(1, positions, 16), torch.arange(positions)[None])
    torch.testing.assert_close(cos, hf_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, hf_sin[0], atol=1e-6, rtol=0)
    plain_cos, _ = rope_tables(16, positions, theta)
    assert (cos - plain_cos).abs().max() > 0.1  # the scaling changed the tables (the comparison can fail)


def test_without_scaling_logits_are_bit_identical(tmp_path):
    """A checkpoint trained without scaling loads exactly as before when no scaling is asked for."""
    model = PocketLM(tiny_config()).eval()
    save_model(model, tmp_path / "m")
    loaded, _ = load_model(tmp_path / "m")
    ids = torch.randint(0, 256, (2, 200))  # past the training context (64)
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
        assert loaded.config.rope_scaling is None
        assert torch.equal(loaded.rope_cos, model.rope_cos) and torch.equal(loaded.rope_sin, model.rope_sin)
        scaled, _ = load_model(tmp_path / "m", rope_scaling=parse_rope_scaling("yarn:4"))
        assert not torch.equal(scaled(ids), model(ids))


def test_load_time_scaling_sets_the_longer_context(tmp_path):
    model = PocketLM(tiny_config(max_seq_len=64, max_position_embeddings=256)).eval()
    save_model(model, tmp_path / "m")
    yarn, _ = load_model(tmp_path / "m", rope_scaling=parse_rope_scaling("yarn:8"))
    # YaRN's original context is the training context; the tables cover factor x that (512 > the saved 256)
    assert yarn.config.rope_scaling == {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}
    assert yarn.config.max_position_embeddings == 512 == yarn.rope_cos.shape[0]
    assert yarn.config.max_seq_len == 64
    linear, _ = load_model(tmp_path / "m", rope_scaling=parse_rope_scaling("linear:2.5"))
    assert linear.config.rope_scaling == {"rope_type": "linear", "factor": 2.5}
    assert linear.config.max_position_embeddings == 160
    # the weights are the model's, whatever the scaling
    assert all(torch.equal(a, b) for a, b in zip(linear.state_dict().values(), model.state_dict().values())
               if a.shape == b.shape)
    # a model that has a scaling, scaled again: still from the context it was trained at
    rescaled, _ = load_model(tmp_path / "m", config=with_rope_scaling(
        tiny_config(max_seq_len=32), {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}),
        rope_scaling=parse_rope_scaling("yarn:4"))
    assert rescaled.config.rope_scaling["original_max_position_embeddings"] == 64
    assert rescaled.config.max_position_embeddings == 256
    # a config with a scaling saves and loads as it is
    save_model(yarn, tmp_path / "scaled")
    again, _ = load_model(tmp_path / "scaled")
    assert again.config == yarn.config
    ids = torch.randint(0, 256, (1, 300))
    with torch.no_grad():
        assert torch.equal(again(ids), yarn(ids))


def test_cached_decoding_under_scaling_equals_the_full_forward():
    """Generation reads the same scaled tables position by position through the KV cache."""
    from model import KVCache

    model = PocketLM(with_rope_scaling(tiny_config(), parse_rope_scaling("yarn:4"))).eval()
    ids = torch.randint(0, 256, (1, 150))
    cache = KVCache(model.config, 1, 150)
    with torch.no_grad():
        full = model(ids)
        prefill = model(ids[:, :100], kv_cache=cache)
        steps = [model(ids[:, t:t + 1], kv_cache=cache) for t in range(100, 150)]
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_type 'dynamic' is not supported"),
    ({"rope_type": "llama3", "factor": 8.0}, "rope_type 'llama3' is not supported"),
    ({"factor": 2.0}, "rope_type None is not supported"),
    ({"rope_type": "linear", "factor": 0.5}, "factor must be a number >= 1"),
    ({"rope_type": "linear", "factor": "2"}, "factor must be a number >= 1"),
    ({"rope_type": "linear"}, "factor must be a number >= 1"),
    ({"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 64}, "unknown keys"),
    ({"rope_type": "yarn", "factor": 4.0}, "yarn needs original_max_position_embeddings"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e4},
     "unknown keys ['rope_theta']"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 1, "beta_slow": 2},
     "beta_fast (1) must be at least beta_slow (2)"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 0},
     "attention_factor must be a positive number"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "truncate": "no"},
     "truncate must be true or false"),
    ("yarn:4", "rope_scaling must be an object"),
])
def test_bad_scalings_are_config_errors(scaling, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        tiny_config(rope_scaling=scaling)


def test_learned_positions_take_no_rope_scaling():
    with pytest.raises(ConfigError, match="rope_scaling applies to RoPE models"):
        tiny_config("gpt2", rope_scaling={"rope_type": "linear", "factor": 2.0})


def test_a_config_file_with_a_bad_scaling_is_a_config_error(tmp_path):
    cfg = tiny_config().to_dict()
    (tmp_path / "config.json").write_text(__import__("json").dumps({**cfg, "rope_scaling": {"rope_type": "ntk"}}))
    with pytest.raises(ConfigError, match="rope_type 'ntk' is not supported"):
        ModelConfig.load(tmp_path / "config.json")


@pytest.mark.parametrize("text", ["yarn", "yarn:", "yarn:x", "yarn:0.5", "ntk:2", "linear:inf", "4"])
def test_bad_flag_values_are_config_errors(text):
    with pytest.raises(ConfigError, match="--rope_scaling"):
        ContextConfig(rope_scaling=text).scaling()


def test_flag_values():
    assert ContextConfig().scaling() is None
    assert ContextConfig(rope_scaling="YaRN:4").scaling() == {"rope_type": "yarn", "factor": 4.0}
    assert ContextConfig(rope_scaling="linear:2").scaling() == {"rope_type": "linear", "factor": 2.0}
