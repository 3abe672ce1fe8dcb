"""LoRA adapters: frozen base, gradients (with checkpointing), merge, checkpoints with a base reference, the
convert CLI's --merge_lora, and the peft export loaded by peft itself."""
from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

from dataset.tokenizer import DEFAULT_TOKENIZER_DIR
from export.convert import export_hf, export_peft, main
from model import CheckpointError, ConfigError, PocketLM, load_model, save_model
from model import model as model_module
from model.lora import (
    LORA_TARGETS,
    LoRALinear,
    LoraSpec,
    apply_lora,
    base_reference,
    has_lora,
    load_lora_model,
    load_lora_state_dict,
    lora_parameters,
    lora_state_dict,
    merge_lora,
    read_lora_config,
    save_lora,
)

from conftest import tiny_config

# raised inside transformers when peft loads an adapter, not by this code
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LLAMA = LORA_TARGETS
ALL_GPT2 = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")


def _base(style: str = "llama", **overrides) -> PocketLM:
    """A random tiny model with non-trivial norms and biases, so a mis-placed tensor would show."""
    model = PocketLM(tiny_config(style, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _randomize_adapters(model: PocketLM) -> None:
    """Non-zero B (a fresh adapter's B is zero, which would hide a wrong merge or a lost A gradient)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_A.weight.normal_(0, 0.1)
                m.lora_B.weight.normal_(0, 0.1)


def _lora_model(style: str = "llama", targets=ATTENTION, rank: int = 4, alpha: float = 8.0) -> PocketLM:
    model = _base(style)
    apply_lora(model, LoraSpec(rank=rank, alpha=alpha, targets=targets))
    _randomize_adapters(model)
    return model.eval()


def _ids(n: int = 2, t: int = 24) -> torch.Tensor:
    return torch.randint(0, 256, (n, t))


def _lm_loss(model: PocketLM, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


# ------------------------------------------------------------------------- the spec
def test_spec_defaults_round_trip_and_scaling():
    spec = LoraSpec()
    assert (spec.rank, spec.alpha, spec.targets, spec.dropout) == (16, 32.0, ATTENTION, 0.0)
    assert spec.scaling == 2.0
    custom = LoraSpec(rank=8, alpha=4, targets="q_proj, down_proj", dropout=0.1)
    assert custom.targets == ("q_proj", "down_proj") and custom.scaling == 0.5
    assert LoraSpec.from_dict(json.loads(json.dumps(custom.to_dict()))) == custom


@pytest.mark.parametrize("kwargs, message", [
    (dict(targets=("q_proj", "qkv")), "unknown LoRA target 'qkv'; expected some of ['q_proj', 'k_proj', 'v_proj', "
                                      "'o_proj', 'gate_proj', 'up_proj', 'down_proj']"),
    (dict(targets=()), "at least one target"),
    (dict(targets=("q_proj", "q_proj")), "name a projection twice"),
    (dict(rank=0), "rank must be a positive integer, got 0"),
    (dict(alpha=-1.0), "alpha must be a positive number"),
    (dict(dropout=1.0), "dropout must be in [0, 1)"),
])
def test_bad_spec_is_a_config_error(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        LoraSpec(**kwargs)


def test_target_the_model_lacks_and_applying_twice_are_refused():
    with pytest.raises(ConfigError, match=r"LoRA target 'gate_proj' does not exist in this model \(gelu MLP\); "
                                          r"expected some of \['q_proj', 'k_proj', 'v_proj', 'o_proj', 'up_proj', "
                                          r"'down_proj'\]"):
        apply_lora(_base("gpt2"), LoraSpec(targets=("q_proj", "gate_proj")))
    model = _base()
    apply_lora(model, LoraSpec())
    with pytest.raises(ConfigError, match="already has LoRA adapters"):
        apply_lora(model, LoraSpec())


# ----------------------------------------------------------------- the adapted model
@pytest.mark.parametrize("style, targets", [("llama", ATTENTION), ("llama", ALL_LLAMA), ("gpt2", ALL_GPT2)])
def test_fresh_adapters_leave_the_model_unchanged(style, targets):
    model = _base(style)
    ids = _ids()
    with torch.no_grad():
        before = model(ids)
        apply_lora(model, LoraSpec(targets=targets))
        after = model(ids)
    torch.testing.assert_close(after, before, atol=0, rtol=0)
    wrapped = model.layers[1].self_attn.q_proj if "q_proj" in targets else None
    assert isinstance(wrapped, LoRALinear) and wrapped.weight is wrapped.base.weight
    assert not bool(wrapped.lora_B.weight.any()) and bool(wrapped.lora_A.weight.any())
    # PEFT's init for A: kaiming-uniform with a=sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))
    assert wrapped.lora_A.weight.abs().max() <= 1 / math.sqrt(64)


@pytest.mark.parametrize("style, targets", [("llama", ATTENTION), ("llama", ALL_LLAMA), ("gpt2", ALL_GPT2)])
def test_only_adapters_require_grad(style, targets):
    model = _base(style)
    params = apply_lora(model, LoraSpec(rank=16, targets=targets))
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert len(params) == len(trainable) == 2 * len(targets) * model.config.num_hidden_layers
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert [id(p) for p in params] == [id(p) for p in lora_parameters(model)]
    q = model.layers[0].self_attn.q_proj
    assert q.lora_A.weight.shape == (16, 64) and q.lora_B.weight.shape == (64, 16)
    k = model.layers[0].self_attn.k_proj
    assert k.lora_B.weight.shape == (k.base.out_features, 16)
    keys = set(lora_state_dict(model))
    assert "layers.0.self_attn.q_proj.lora_A.weight" in keys and "layers.1.self_attn.o_proj.lora_B.weight" in keys
    assert len(keys) == len(params)


@pytest.mark.parametrize("targets", [ATTENTION, ALL_LLAMA])
def test_gradients_reach_the_adapters_and_not_the_base(targets):
    model = _lora_model(targets=targets).train()
    _lm_loss(model, _ids()).backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and bool(p.grad.abs().sum() > 0), name
        else:
            assert p.grad is None, name


def test_gradient_checkpointing_with_a_frozen_base(monkeypatch):
    """No input of a block requires grad when the embeddings are frozen: reentrant checkpointing would silently
    give the adapters no gradient. The gradients must be those of the plain backward."""
    model = _lora_model(targets=ALL_LLAMA).train()
    ids = _ids()
    _lm_loss(model, ids).backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)

    calls = []
    real = model_module.checkpoint
    monkeypatch.setattr(model_module, "checkpoint", lambda *a, **k: calls.append(k) or real(*a, **k))
    model.set_gradient_checkpointing(True)
    _lm_loss(model, ids).backward()
    assert len(calls) == model.config.num_hidden_layers  # the checkpointed path really ran
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, f"{name}: no gradient under gradient checkpointing"
            torch.testing.assert_close(p.grad, plain[name], atol=1e-6, rtol=1e-5)
        else:
            assert p.grad is None, name


def test_bf16_autocast_and_bf16_weights():
    model = _lora_model(targets=ALL_LLAMA).train()
    ids = _ids()
    with torch.no_grad():
        reference = model(ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), reference, atol=0.1, rtol=0.05)
    F.cross_entropy(logits.float().reshape(-1, 256), ids.reshape(-1)).backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in lora_parameters(model))
    # a model cast to bf16 (inference) runs without autocast too
    with torch.no_grad():
        assert model.to(torch.bfloat16)(ids).dtype == torch.bfloat16


def test_dropout_acts_in_training_only():
    model = _base()
    apply_lora(model, LoraSpec(targets=("q_proj",), dropout=0.5))
    _randomize_adapters(model)
    ids = _ids()
    with torch.no_grad():
        model.eval()
        assert torch.equal(model(ids), model(ids))
        model.train()
        assert not torch.equal(model(ids), model(ids))


# ------------------------------------------------------------------------------- merge
@pytest.mark.parametrize("style, targets", [("llama", ATTENTION), ("llama", ALL_LLAMA), ("gpt2", ALL_GPT2),
                                            ("gpt2", ("q_proj", "v_proj", "down_proj")), ("qwen3", ATTENTION)])
def test_merge_gives_the_same_logits(style, targets):
    model = _base(style)
    ids = _ids(t=40)
    with torch.no_grad():
        base_only = model(ids)
        apply_lora(model, LoraSpec(rank=4, alpha=8.0, targets=targets))
        _randomize_adapters(model)
        unmerged = model(ids)
    assert not torch.allclose(unmerged, base_only, atol=1e-3)  # the adapters matter, so a lost merge would show
    merged = merge_lora(model)
    assert merged is model and not has_lora(model)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), unmerged, atol=1e-5, rtol=0)
    # a plain PocketLM again: the same state-dict keys as a fresh one, every parameter trainable
    assert set(model.state_dict()) == set(PocketLM(model.config).state_dict())
    assert all(p.requires_grad for p in model.parameters())


def test_save_model_refuses_a_model_with_adapters(tmp_path):
    with pytest.raises(CheckpointError, match="has LoRA adapters; save them with model.lora.save_lora"):
        save_model(_lora_model(), tmp_path / "x")


def test_load_lora_state_dict_is_strict():
    model = _lora_model()
    state = lora_state_dict(model)
    load_lora_state_dict(model, {k: v.clone() for k, v in state.items()}, "ok")
    missing = dict(state)
    missing.pop("layers.1.self_attn.v_proj.lora_B.weight")
    with pytest.raises(CheckpointError, match=r"^src: adapters do not match the LoRA targets: missing 1 tensors "
                                              r"\(e.g. layers.1.self_attn.v_proj.lora_B.weight\)$"):
        load_lora_state_dict(model, missing, "src")
    extra = {**state, "layers.0.mlp.up_proj.lora_A.weight": torch.zeros(4, 64)}
    with pytest.raises(CheckpointError, match=r"1 unexpected tensors \(e.g. layers.0.mlp.up_proj.lora_A.weight\)"):
        load_lora_state_dict(model, extra, "src")
    wrong = {**state, "layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64)}
    with pytest.raises(CheckpointError, match=r"src: tensor layers.0.self_attn.q_proj.lora_A.weight has shape "
                                              r"\(8, 64\) but the LoRA spec expects \(4, 64\)"):
        load_lora_state_dict(model, wrong, "src")


# --------------------------------------------------------------- checkpoints on disk
def _lora_run(tmp_path, style: str = "llama", targets=ATTENTION, rank: int = 4, alpha: float = 8.0):
    """A base model dir and a LoRA run dir (out/<run>/checkpoints/step_.. + latest) trained on it (randomly)."""
    base = _base(style)
    base_dir = save_model(base, tmp_path / "base" / "checkpoints" / "step_00000010",
                          tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    (tmp_path / "base" / "latest").write_text("checkpoints/step_00000010\n")
    spec = LoraSpec(rank=rank, alpha=alpha, targets=targets)
    apply_lora(base, spec)
    _randomize_adapters(base)
    run = tmp_path / "lora-run"
    ckpt = save_lora(base, run / "checkpoints" / "step_00000002", spec, base_reference(tmp_path / "base"),
                     tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    (ckpt / "train_info.json").write_text(json.dumps({"stage": "sft", "step": 2}) + "\n")
    (run / "latest").write_text("checkpoints/step_00000002\n")
    return base.eval(), base_dir, run, ckpt


def test_save_lora_layout(tmp_path):
    from safetensors.torch import load_file
    model, base_dir, run, ckpt = _lora_run(tmp_path)
    assert not (ckpt / "model.safetensors").exists()
    for name in ("adapter_model.safetensors", "lora.json", "config.json", "tokenizer.json"):
        assert (ckpt / name).is_file(), name
    tensors = load_file(ckpt / "adapter_model.safetensors")
    assert set(tensors) == set(lora_state_dict(model)) and len(tensors) == 16
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    info = json.loads((ckpt / "lora.json").read_text())
    assert info["lora"] == {"rank": 4, "alpha": 8.0, "targets": list(ATTENTION), "dropout": 0.0}
    assert info["base"]["path"] == str(base_dir.resolve())  # the step dir, not the moving `latest` of its run
    import hashlib
    assert info["base"]["sha256"] == hashlib.sha256((base_dir / "model.safetensors").read_bytes()).hexdigest()
    spec, base = read_lora_config(ckpt)
    assert spec == LoraSpec(rank=4, alpha=8.0) and base == info["base"]


@pytest.mark.parametrize("style, targets", [("llama", ALL_LLAMA), ("gpt2", ("q_proj", "o_proj", "up_proj"))])
def test_lora_checkpoint_round_trip(tmp_path, style, targets):
    model, _, run, ckpt = _lora_run(tmp_path, style, targets)
    ids = _ids(t=30)
    with torch.no_grad():
        expected = model(ids)
        unmerged = load_lora_model(run, merge=False)
        assert has_lora(unmerged) and not unmerged.training
        assert {n for n, p in unmerged.named_parameters() if p.requires_grad} == {
            n for n, p in model.named_parameters() if p.requires_grad}
        torch.testing.assert_close(unmerged(ids), expected, atol=0, rtol=0)
        merged = load_lora_model(ckpt)
        assert not has_lora(merged)
        torch.testing.assert_close(merged(ids), expected, atol=1e-5, rtol=0)
        # every reader of models (eval_model, probes, convert) goes through load_model: the run dir works
        loaded, model_dir = load_model(run)
        assert model_dir == ckpt and not has_lora(loaded) and not loaded.training
        torch.testing.assert_close(loaded(ids), expected, atol=1e-5, rtol=0)
        half, _ = load_model(run, dtype=torch.bfloat16)
        assert {p.dtype for p in half.parameters()} == {torch.bfloat16}


def test_missing_base_is_named(tmp_path):
    import shutil
    _, base_dir, run, ckpt = _lora_run(tmp_path)
    shutil.rmtree(base_dir)
    with pytest.raises(CheckpointError) as e:
        load_model(run)
    message = str(e.value)
    assert message.startswith(f"{ckpt / 'lora.json'}: its base {base_dir.resolve()} is gone (no model.safetensors "
                              "there)"), message
    assert "set base.path in lora.json to where it is now" in message and "\n" not in message


def test_moved_base_loads_once_lora_json_points_at_it(tmp_path):
    import shutil
    model, base_dir, run, ckpt = _lora_run(tmp_path)
    moved = shutil.move(str(base_dir), str(tmp_path / "elsewhere"))
    info = json.loads((ckpt / "lora.json").read_text())
    info["base"]["path"] = moved
    (ckpt / "lora.json").write_text(json.dumps(info))
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(load_lora_model(run, merge=False)(ids), model(ids), atol=0, rtol=0)


def test_changed_base_is_refused(tmp_path):
    _, base_dir, run, ckpt = _lora_run(tmp_path)
    other = _base()
    with torch.no_grad():
        other.layers[0].mlp.up_proj.weight.add_(1.0)
    save_model(other, base_dir)  # e.g. the base run re-saved the same step
    with pytest.raises(CheckpointError, match=rf"^{ckpt / 'lora.json'}: its base {base_dir.resolve()} changed since "
                                              r"the adapters were trained \(sha256 [0-9a-f]{16}… there, "
                                              r"[0-9a-f]{16}… recorded\); restore the original base"):
        load_lora_model(ckpt)


def test_base_must_be_a_plain_model(tmp_path):
    _, _, run, _ = _lora_run(tmp_path)
    with pytest.raises(CheckpointError, match="no model.safetensors; LoRA needs a plain PocketLM model as its base "
                                              r"\(a LoRA run: merge it first"):
        base_reference(run)


def test_corrupt_lora_json_is_named(tmp_path):
    _, _, run, ckpt = _lora_run(tmp_path)
    (ckpt / "lora.json").write_text(json.dumps({"format_version": 1, "base": {"path": "x", "sha256": "y"},
                                                "lora": {"rank": 4, "targets": ["qkv"]}}))
    with pytest.raises(CheckpointError, match=rf"^{ckpt / 'lora.json'}: unknown LoRA target 'qkv'"):
        load_model(run)


# ------------------------------------------------------------------------ convert CLI
def test_convert_merge_lora(tmp_path, capsys):
    model, _, run, ckpt = _lora_run(tmp_path, targets=ALL_LLAMA)
    assert main(["--merge_lora", str(run), "--out_dir", str(tmp_path / "merged")]) == 0
    assert "wrote merged PocketLM model" in capsys.readouterr().out
    out = tmp_path / "merged"
    for name in ("model.safetensors", "config.json", "tokenizer.json", "train_info.json"):
        assert (out / name).is_file(), name
    assert not (out / "lora.json").exists()
    merged, model_dir = load_model(out)
    ids = _ids(t=40)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids), model(ids), atol=1e-5, rtol=0)
    # and it exports to transformers like any checkpoint
    transformers = pytest.importorskip("transformers")
    export_hf(out, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("args, message", [
    (["--merge_lora", "{base}", "--out_dir", "{d}/m"], "not a LoRA checkpoint (no lora.json beside the weights); "
                                                      "--merge_lora takes a LoRA run"),
    (["--merge_lora", "{d}/nowhere", "--out_dir", "{d}/m"], "nowhere: no such file or directory"),
    (["--merge_lora", "{run}"], "--out_dir is required"),
    (["--merge_lora", "{run}", "--out_dir", "{d}/m", "--preset", "tiny"], "--preset and --config apply to bare"),
    (["--checkpoint", "{run}", "--peft_dir", "{d}/p", "--out_dir", "{d}/m"], "--peft_dir writes the adapters alone"),
    (["--checkpoint", "{base}", "--peft_dir", "{d}/p"], "--peft_dir takes a LoRA run"),
    (["--checkpoint", "{run}", "--out_dir", "{d}/m", "--base_model", "x"], "--base_model applies to --peft_dir only"),
])
def test_convert_lora_errors_are_one_line(tmp_path, capsys, args, message):
    _, base_dir, run, _ = _lora_run(tmp_path)
    argv = [a.format(d=tmp_path, base=base_dir, run=run) for a in args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not (tmp_path / "m").exists() and not (tmp_path / "p").exists()


def test_hf_export_of_a_lora_run_is_the_merged_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    model, _, run, _ = _lora_run(tmp_path)
    assert main(["--checkpoint", str(run), "--out_dir", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-4, rtol=0)


# ------------------------------------------------------------------------ peft export
@pytest.mark.parametrize("style, targets", [("llama", ATTENTION), ("llama", ALL_LLAMA), ("gpt2", ALL_GPT2),
                                            ("gpt2", ("k_proj", "v_proj", "down_proj")), ("gpt2", ("q_proj",)),
                                            ("qwen3", ALL_LLAMA)])  # Qwen3ForCausalLM: the Llama module names
def test_peft_export_loads_in_peft_with_equal_logits(tmp_path, capsys, style, targets):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    model, base_dir, run, _ = _lora_run(tmp_path, style, targets, rank=4, alpha=12.0)
    assert main(["--checkpoint", str(base_dir), "--out_dir", str(tmp_path / "hf_base")]) == 0
    assert main(["--checkpoint", str(run), "--peft_dir", str(tmp_path / "adapters"),
                 "--base_model", str(tmp_path / "hf_base")]) == 0
    assert str(base_dir.resolve()) in capsys.readouterr().out  # says which base to export
    config = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"], config["bias"]) == (
        "LORA", "CAUSAL_LM", 4, 12.0, "none")
    assert config["base_model_name_or_path"] == str(tmp_path / "hf_base")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_base").eval()
    hf = peft.PeftModel.from_pretrained(base, tmp_path / "adapters").eval()
    ids = _ids(t=40)
    with torch.no_grad():
        ours = model(ids)
        torch.testing.assert_close(hf(input_ids=ids).logits, ours, atol=1e-4, rtol=0)
        # the adapters really changed the function (a peft load that silently skipped them would fail above too)
        with hf.disable_adapter():
            assert not torch.allclose(hf(input_ids=ids).logits, ours, atol=1e-3)


def test_peft_key_names_for_llama(tmp_path):
    from safetensors.torch import load_file
    _, _, run, _ = _lora_run(tmp_path, targets=("q_proj", "down_proj"))
    export_peft(run, tmp_path / "adapters")
    keys = set(load_file(tmp_path / "adapters" / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in keys and len(keys) == 8
    config = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "q_proj"] and config["base_model_name_or_path"] is None


def test_peft_export_refuses_what_transformers_cannot_hold(tmp_path):
    """GPT-2 with grouped-query attention has no transformers export, so its adapters have none either."""
    base = _base("gpt2", num_key_value_heads=2)
    save_model(base, tmp_path / "base")
    spec = LoraSpec(rank=4, targets=("q_proj",))
    apply_lora(base, spec)
    save_lora(base, tmp_path / "run", spec, base_reference(tmp_path / "base"))
    with pytest.raises(ConfigError, match="GPT-2 has no grouped-query attention"):
        export_peft(tmp_path / "run", tmp_path / "adapters")
    assert not (tmp_path / "adapters").exists()
