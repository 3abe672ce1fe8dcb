"""Mixture-of-experts models to and from transformers: Mixtral, Qwen2-MoE and ERNIE 4.5 MoE (for a routing bias),
equal logits both ways, the Hub's per-expert layout, LoRA on MoE models, and what cannot be converted."""
from __future__ import annotations

import json

import pytest
import torch

from dataset.tokenizer import DEFAULT_TOKENIZER_DIR
from export.convert import export_hf, export_peft, from_hf_config, import_hf, main
from model import ConfigError, PocketLM, load_model, save_model
from model.config import architecture
from model.lora import LoRALinear, LoraSpec, apply_lora, base_reference, save_lora

from conftest import tiny_config

transformers = pytest.importorskip("transformers")
# raised inside transformers when peft loads an adapter, not by this code
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
# case -> (config overrides, transformers class, whether the routers get a non-zero selection bias)
CASES = {
    "mixtral": (dict(tie_word_embeddings=False, rope_theta=5e4), "MixtralForCausalLM", False),
    "qwen2_moe-1shared": (dict(num_shared_experts=1, norm_eps=1e-3), "Qwen2MoeForCausalLM", False),
    "qwen2_moe-2shared-unnormalised": (dict(num_shared_experts=2, norm_topk_prob=False), "Qwen2MoeForCausalLM",
                                       False),
    "qwen2_moe-switch": (dict(num_experts_per_tok=1, norm_topk_prob=False), "Qwen2MoeForCausalLM", False),
    "ernie-routing-bias": (dict(num_shared_experts=1, num_key_value_heads=4), "Ernie4_5_MoeForCausalLM", True),
}


def _moe_model(case: str) -> PocketLM:
    """A random tiny MoE model: perturbed norms, a router sharp enough that no top-k choice is a near tie (which
    rounding could flip), and for a bias case a routing bias large enough to change choices."""
    overrides, _, biased = CASES[case]
    model = PocketLM(tiny_config(**{**MOE, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):
                p.mul_(20)
        if biased:
            for layer in model.layers:
                layer.mlp.router_bias.copy_(torch.randn(4) * 0.2)
    return model


def _left_padded() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention_mask, position_ids) of a batch whose rows have 0, 7 and 25 padding tokens on the left."""
    ids = torch.randint(0, 256, (3, 40))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    mask[2, :25] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp_min(0)


def _exported(case: str, tmp_path) -> tuple[PocketLM, object]:
    """(our model, its transformers export loaded in fp32), checking that every tensor was used."""
    model = _moe_model(case)
    save_model(model, tmp_path / "ours", tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    export_hf(tmp_path / "ours", tmp_path / "hf")
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info  # nothing missing (newly initialised), unexpected or mismatched
    return model, hf.eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_logits_match_transformers(case, tmp_path):
    model, hf = _exported(case, tmp_path)
    assert type(hf).__name__ == CASES[case][1]
    ids = torch.randint(0, 256, (2, 100))  # longer than max_seq_len (64): RoPE past the training context
    padded, mask, positions = _left_padded()
    real = mask.bool()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-4, rtol=0)
        theirs = hf(input_ids=padded, attention_mask=mask, position_ids=positions).logits
        ours = model(padded, position_ids=positions, attention_mask=mask)
        torch.testing.assert_close(theirs[real], ours[real], atol=1e-4, rtol=0)
        if CASES[case][2]:  # the bias really changes which experts run, so the match above shows it is exported
            for layer in model.layers:
                layer.mlp.router_bias.zero_()
            assert not torch.allclose(model(ids), hf(ids).logits, atol=1e-3)


@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip_through_transformers_is_exact(case, tmp_path):
    model, _ = _exported(case, tmp_path)
    import_hf(tmp_path / "hf", tmp_path / "back")
    back, _ = load_model(tmp_path / "back")
    assert architecture(back.config) == architecture(model.config)
    assert back.config.router_aux_loss_coef == model.config.router_aux_loss_coef
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "back" / name).is_file(), name
    for ours, theirs in zip(model.layers, back.layers):
        assert torch.equal(ours.mlp.router_bias, theirs.mlp.router_bias)
    ids = torch.randint(0, 256, (2, 50))
    with torch.no_grad():
        torch.testing.assert_close(back(ids), model(ids), atol=0, rtol=0)  # the same weights, bit for bit


def test_export_writes_the_hub_layout(tmp_path):
    """One tensor per expert, as the Hub checkpoints are (transformers fuses them when loading); Qwen2-MoE's
    shared expert gated by exactly 1/2 with its down_proj doubled, or all zero when the model has none."""
    from safetensors.torch import load_file
    model = _moe_model("qwen2_moe-1shared")
    save_model(model, tmp_path / "ours")
    export_hf(tmp_path / "ours", tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    mlp = model.layers[1].mlp
    assert torch.equal(tensors["model.layers.1.mlp.experts.3.up_proj.weight"], mlp.experts.up_proj[3])
    assert torch.equal(tensors["model.layers.1.mlp.shared_expert.down_proj.weight"],
                       2 * mlp.shared_experts.down_proj.weight)
    assert not tensors["model.layers.1.mlp.shared_expert_gate.weight"].any()
    assert not any("gate_up_proj" in k or "router_bias" in k for k in tensors)

    save_model(_moe_model("qwen2_moe-switch"), tmp_path / "switch")
    export_hf(tmp_path / "switch", tmp_path / "hf_switch")
    tensors = load_file(tmp_path / "hf_switch" / "model.safetensors")
    assert tensors["model.layers.0.mlp.shared_expert.up_proj.weight"].shape == (1, 64)
    assert not any(v.any() for k, v in tensors.items() if ".shared_expert" in k)
    hf_config = json.loads((tmp_path / "hf_switch" / "config.json").read_text())
    assert (hf_config["shared_expert_intermediate_size"], hf_config["num_experts_per_tok"],
            hf_config["norm_topk_prob"], hf_config["qkv_bias"]) == (1, 1, False, False)

    save_model(_moe_model("mixtral"), tmp_path / "mixtral")
    export_hf(tmp_path / "mixtral", tmp_path / "hf_mixtral")
    names = set(load_file(tmp_path / "hf_mixtral" / "model.safetensors"))
    assert {f"model.layers.0.block_sparse_moe.experts.2.w{i}.weight" for i in (1, 2, 3)} <= names


def test_export_in_bfloat16_keeps_the_routing_bias_in_float32(tmp_path):
    from safetensors.torch import load_file
    save_model(_moe_model("ernie-routing-bias"), tmp_path / "ours")
    export_hf(tmp_path / "ours", tmp_path / "hf", dtype=torch.bfloat16)
    dtypes = {k: v.dtype for k, v in load_file(tmp_path / "hf" / "model.safetensors").items()}
    assert {dtypes.pop(f"model.layers.{i}.mlp.moe_statics.e_score_correction_bias") for i in (0, 1)} == {
        torch.float32}
    assert set(dtypes.values()) == {torch.bfloat16}


def test_routing_bias_without_renormalisation_is_refused(tmp_path, capsys):
    model = PocketLM(tiny_config(**MOE, norm_topk_prob=False))
    with torch.no_grad():
        model.layers[1].mlp.router_bias[2] = 0.01
    save_model(model, tmp_path / "ours")
    with pytest.raises(ConfigError, match=r"learned routing bias .* no transformers architecture computes that: "
                                          r"Mixtral and Qwen2-MoE routers have no selection bias, and ERNIE 4.5's"):
        export_hf(tmp_path / "ours", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()  # refused before anything is written
    assert main(["--checkpoint", str(tmp_path / "ours"), "--out_dir", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "router_bias_update_rate=0" in err[0], err


def test_cli_names_the_architecture_it_chose(tmp_path, capsys):
    save_model(_moe_model("ernie-routing-bias"), tmp_path / "ours")
    assert main(["--checkpoint", str(tmp_path / "ours"), "--out_dir", str(tmp_path / "hf")]) == 0
    assert "(Ernie4_5_MoeForCausalLM; load with" in capsys.readouterr().out
    assert main(["--from_hf", str(tmp_path / "hf"), "--out_dir", str(tmp_path / "back")]) == 0
    assert load_model(tmp_path / "back")[0].config.num_shared_experts == 1


# ----------------------------------------------------------- models made by transformers
def _save_transformers_moe(kind: str, path, **overrides) -> object:
    """A randomly initialised transformers Mixtral or Qwen2-MoE (GQA, untied) saved to `path`."""
    shape = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                 max_position_embeddings=128, rms_norm_eps=1e-6, num_experts_per_tok=2)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(**shape, intermediate_size=40, num_local_experts=4, **overrides)
        hf = transformers.MixtralForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2MoeConfig(**shape, intermediate_size=160, moe_intermediate_size=40, num_experts=4,
                                          shared_expert_intermediate_size=80, qkv_bias=False, **overrides)
        hf = transformers.Qwen2MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("shared_expert_gate.weight"):
                p.zero_()  # what PocketLM can compute (a gate of 1/2)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)  # sharp routing: no near-tie choices
    hf.save_pretrained(path)
    return hf.eval()


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_import_transformers_moe(kind, tmp_path):
    hf = _save_transformers_moe(kind, tmp_path / "hf", norm_topk_prob=False) if kind == "qwen2_moe" else \
        _save_transformers_moe(kind, tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ours")
    ours, _ = load_model(tmp_path / "ours")
    c = ours.config
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.num_key_value_heads) == (4, 2, 40, 2)
    assert (c.num_shared_experts, c.norm_topk_prob) == ((0, True) if kind == "mixtral" else (2, False))
    ids = torch.randint(0, 300, (2, 50))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=0)


def test_import_refuses_a_gated_shared_expert(tmp_path):
    hf = _save_transformers_moe("qwen2_moe", tmp_path / "hf")
    with torch.no_grad():
        hf.model.layers[1].mlp.shared_expert_gate.weight[0, 5] = 0.1
    hf.save_pretrained(tmp_path / "hf")
    with pytest.raises(ConfigError, match="a non-zero shared_expert_gate: the shared expert's output is scaled per "
                                          r"token by sigmoid\(gate . x\)"):
        import_hf(tmp_path / "hf", tmp_path / "ours")
    assert not (tmp_path / "ours").exists()


MIXTRAL_HF = dict(model_type="mixtral", vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, intermediate_size=40, num_local_experts=4, num_experts_per_tok=2)
QWEN2_MOE_HF = dict(model_type="qwen2_moe", vocab_size=300, hidden_size=64, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=2, moe_intermediate_size=40, num_experts=4,
                    num_experts_per_tok=2, shared_expert_intermediate_size=80, qkv_bias=False)
ERNIE_HF = dict(model_type="ernie4_5_moe", vocab_size=300, hidden_size=64, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=2, moe_intermediate_size=40, moe_num_experts=4, moe_k=2,
                moe_num_shared_experts=1, moe_layer_start_index=0)


@pytest.mark.parametrize("hf, message", [
    ({**QWEN2_MOE_HF, "qkv_bias": True}, "qkv_bias=true (PocketLM's attention has no biases)"),
    ({k: v for k, v in QWEN2_MOE_HF.items() if k != "qkv_bias"}, "qkv_bias=true"),  # transformers' default
    ({**QWEN2_MOE_HF, "use_sliding_window": True}, "sliding-window attention"),
    ({**QWEN2_MOE_HF, "layer_types": ["sliding_attention", "full_attention"]}, "sliding-window attention"),
    ({**QWEN2_MOE_HF, "decoder_sparse_step": 2}, "dense MLP layers among the MoE ones (decoder_sparse_step=2"),
    ({**QWEN2_MOE_HF, "mlp_only_layers": [0]}, "mlp_only_layers=[0]"),
    ({**QWEN2_MOE_HF, "num_experts_per_tok": 1, "norm_topk_prob": True}, "top-1 routing with renormalised weights"),
    ({**QWEN2_MOE_HF, "shared_expert_intermediate_size": 60},
     "shared_expert_intermediate_size=60 is not a multiple of moe_intermediate_size=40"),
    ({**QWEN2_MOE_HF, "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0}}, "rope scaling"),
    ({**QWEN2_MOE_HF, "num_experts": 0}, "no experts"),
    ({**MIXTRAL_HF, "num_experts_per_tok": 1}, "top-1 routing with renormalised weights"),
    ({**MIXTRAL_HF, "sliding_window": 4096, "max_position_embeddings": 32768}, "sliding_window=4096"),
    ({**MIXTRAL_HF, "head_dim": 16}, "head_dim=16 != hidden/heads"),
    ({**ERNIE_HF, "use_bias": True}, "use_bias=true"),
    ({k: v for k, v in ERNIE_HF.items() if k != "moe_layer_start_index"}, "moe_layer_start_index=1"),
    ({**ERNIE_HF, "moe_layer_interval": 2}, "moe_layer_interval=2"),
    ({**ERNIE_HF, "moe_layer_end_index": 0}, "moe_layer_end_index=0"),
    ({**ERNIE_HF, "moe_k": 1}, "top-1 routing with renormalised weights"),
    ({**MIXTRAL_HF, "model_type": "deepseek_v3"}, "model_type 'deepseek_v3' is not supported"),
])
def test_transformers_moe_configs_we_cannot_compute_are_refused(hf, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        from_hf_config(hf, "config.json")


def test_transformers_moe_config_defaults_and_shared_expert_width():
    mixtral = from_hf_config(MIXTRAL_HF, "c")
    assert (mixtral.style, mixtral.norm_topk_prob, mixtral.num_shared_experts, mixtral.rope_theta,
            mixtral.norm_eps, mixtral.tie_word_embeddings) == ("moe", True, 0, 1e6, 1e-5, False)
    assert mixtral.intermediate_size == 192  # no dense width in Mixtral: PocketLM's default for d64
    qwen = from_hf_config(QWEN2_MOE_HF, "c")
    assert (qwen.num_shared_experts, qwen.norm_topk_prob, qwen.rope_theta) == (2, False, 1e4)
    # YaRN reads as it does for dense models: its original context defaults to max_position_embeddings, and the
    # context becomes factor x that
    yarn = from_hf_config({**QWEN2_MOE_HF, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
                          "c")
    assert yarn.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert yarn.max_position_embeddings == 4 * 32768
    ernie = from_hf_config(ERNIE_HF, "c")
    assert (ernie.num_shared_experts, ernie.norm_topk_prob, ernie.tie_word_embeddings) == (1, True, True)
    # an all-zero shared expert (what the export writes for a model without one) is no shared expert, whatever its
    # width; a non-zero one must be a whole number of experts wide
    narrow = {**QWEN2_MOE_HF, "shared_expert_intermediate_size": 1}
    zero = {f"layers.{i}.mlp.shared_expert.{p}.weight": torch.zeros(1, 1) for i in (0, 1) for p in ("up_proj",)}
    assert from_hf_config(narrow, "c", zero).num_shared_experts == 0
    assert from_hf_config(QWEN2_MOE_HF, "c", zero).num_shared_experts == 0
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size=1 is not a multiple"):
        from_hf_config(narrow, "c", {**zero, "layers.1.mlp.shared_expert.up_proj.weight": torch.ones(1, 1)})


# ----------------------------------------------------------------------------- LoRA
def _moe_lora_run(case: str, tmp_path) -> tuple[PocketLM, object]:
    """(a MoE model with random attention adapters, its LoRA run dir) on a saved base."""
    model = _moe_model(case)
    save_model(model, tmp_path / "base", tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    spec = LoraSpec(rank=4, alpha=8.0)  # the default targets: the attention projections
    apply_lora(model, spec)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_A.weight.normal_(0, 0.1)
                m.lora_B.weight.normal_(0, 0.1)
    run = save_lora(model, tmp_path / "run", spec, base_reference(tmp_path / "base"),
                    tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    return model.eval(), run


def test_lora_on_moe_needs_attention_targets():
    with pytest.raises(ConfigError, match="LoRA target 'up_proj' does not exist in this model"):
        apply_lora(_moe_model("mixtral"), LoraSpec(targets=("q_proj", "up_proj")))


@pytest.mark.slow  # several exports and transformers/peft loads
@pytest.mark.parametrize("case", ["mixtral", "ernie-routing-bias"])
def test_lora_exports_of_a_moe_model(case, tmp_path, capsys):
    """A MoE LoRA run exports merged (--checkpoint, --merge_lora) and as peft adapters for its base's export,
    whose q/k rows ERNIE's interleaved RoPE reorders."""
    peft = pytest.importorskip("peft")
    model, run = _moe_lora_run(case, tmp_path)
    ids = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        expected = model(ids)
    assert main(["--checkpoint", str(run), "--out_dir", str(tmp_path / "hf_merged")]) == 0
    assert main(["--merge_lora", str(run), "--out_dir", str(tmp_path / "merged")]) == 0
    assert main(["--checkpoint", str(tmp_path / "base"), "--out_dir", str(tmp_path / "hf_base")]) == 0
    export_peft(run, tmp_path / "adapters")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_merged").eval()
    assert type(merged).__name__ == CASES[case][1]
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_base").eval()
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapters").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, expected, atol=1e-4, rtol=0)
        torch.testing.assert_close(load_model(tmp_path / "merged")[0](ids), expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(adapted(input_ids=ids).logits, expected, atol=1e-4, rtol=0)
        with adapted.disable_adapter():  # the adapters really changed the function
            assert not torch.allclose(adapted(input_ids=ids).logits, expected, atol=1e-3)
