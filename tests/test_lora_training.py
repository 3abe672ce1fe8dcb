"""train_lora.py on the one loop: only the adapters train and are saved, the run resumes bit-exactly, loads for
evaluation and merges; a LoRA run on a few fixed conversations reproduces their answers greedily."""
from __future__ import annotations

import json

import pytest
import torch
from test_train import flags, straight_and_resumed

import eval_model
import train_lora
from export.convert import main as convert
from model import load_model
from model.generate import generate
from model.lora import has_lora, load_lora_model
from trainer_utils.checkpoint import latest_checkpoint

from conftest import read_metrics, write_jsonl


@pytest.fixture(scope="module")
def base(sft_run):
    """A tiny SFT run to adapt."""
    return sft_run


def lora_flags(corpus, tmp_path, base, run="lora", **over) -> list[str]:
    return flags(corpus, tmp_path, run, data_path=corpus["sft"], init_from=base, preset=None, **over)


def adapters(run_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(latest_checkpoint(run_dir) / "adapter_model.safetensors"))


def test_only_the_adapters_train_and_are_saved(corpus, tmp_path, base):
    assert train_lora.main(lora_flags(corpus, tmp_path, base)) == 0
    ckpt = latest_checkpoint(tmp_path / "lora")
    assert (ckpt / "lora.json").is_file() and not (ckpt / "model.safetensors").exists()
    spec = json.loads((ckpt / "lora.json").read_text())
    assert spec["lora"]["rank"] == 16 and spec["lora"]["targets"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert spec["base"]["path"] == str(latest_checkpoint(base).resolve())
    saved = adapters(tmp_path / "lora")
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)
    assert any(v.abs().sum() > 0 for k, v in saved.items() if ".lora_B." in k)  # B starts at 0: it moved
    size = (ckpt / "adapter_model.safetensors").stat().st_size
    full = (latest_checkpoint(base) / "model.safetensors").stat().st_size
    assert size < full / 3
    # the optimizer state holds the adapters only
    state = torch.load(ckpt / "training_state.pt", weights_only=True)
    assert sum(v["exp_avg"].numel() for v in state["optimizer"]["state"].values()) == sum(v.numel()
                                                                                          for v in saved.values())
    info = json.loads((ckpt / "train_info.json").read_text())
    assert (info["prompt_format"], info["method"]) == ("chat", "lora")


def test_a_lora_run_resumes_bit_exactly(corpus, tmp_path, base, monkeypatch):
    straight_and_resumed(monkeypatch, train_lora.main, lambda run, **o: lora_flags(corpus, tmp_path, base, run, **o), 4)
    a, b = adapters(tmp_path / "straight"), adapters(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [m["step"] for m in read_metrics(tmp_path / "resumed")] == [2, 4, 6, 8]


def test_gradient_checkpointing_trains_the_same_adapters(corpus, tmp_path, base):
    assert train_lora.main(lora_flags(corpus, tmp_path, base, "plain", max_steps=2)) == 0
    assert train_lora.main(lora_flags(corpus, tmp_path, base, "ckpt", max_steps=2, grad_checkpointing=True)) == 0
    a, b = adapters(tmp_path / "plain"), adapters(tmp_path / "ckpt")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_a_lora_run_evaluates_merges_and_refuses_changed_flags_on_resume(corpus, tmp_path, base, capsys):
    assert train_lora.main(lora_flags(corpus, tmp_path, base, lora_rank=4, lora_targets="v_proj")) == 0
    run = tmp_path / "lora"
    assert eval_model.main(["--checkpoint", str(run), "--prompt", "Hello", "--max_new_tokens", "4",
                            "--temperature", "0"]) == 0
    assert convert(["--merge_lora", str(run), "--out_dir", str(tmp_path / "merged")]) == 0
    merged, _ = load_model(tmp_path / "merged")
    unmerged = load_lora_model(run, merge=False).eval()
    assert has_lora(unmerged) and not has_lora(merged)
    x = torch.randint(0, merged.config.vocab_size, (2, 16))
    torch.testing.assert_close(merged(x), unmerged(x), rtol=1e-5, atol=1e-5)
    capsys.readouterr()
    assert train_lora.main(lora_flags(corpus, tmp_path, base, lora_rank=8, lora_targets="v_proj", resume=True)) == 2
    assert "the LoRA flags describe other adapters" in capsys.readouterr().err


def test_lora_needs_a_model_to_adapt(corpus, tmp_path, capsys):
    assert train_lora.main(flags(corpus, tmp_path, data_path=corpus["sft"])) == 2
    assert "train_lora.py trains on top of a trained model: pass --init_from" in capsys.readouterr().err


def test_lora_on_a_few_fixed_conversations_reproduces_their_answers_greedily(tmp_path, base, tokenizer):
    """The mechanism of the identity demo: what the adapters were taught, greedy decoding answers."""
    talks = [("Who are you?", "I am PocketLM, a small language model."),
             ("你是谁？", "我是PocketLM，一个小语言模型。"),
             ("What is your name?", "My name is PocketLM.")]
    data = write_jsonl(tmp_path / "identity.jsonl", [
        {"conversations": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in talks])
    argv = flags({"pretrain": data, "cache": tmp_path / "cache"}, tmp_path, "identity", init_from=base, preset=None,
                 val_fraction=0, batch_size=3, max_steps=120, learning_rate=1e-2, warmup_steps=5, log_interval=20,
                 eval_interval=1000, save_interval=1000, sample_prompts="none")
    argv += ["--lora_targets", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert train_lora.main(argv) == 0
    model, _ = load_model(tmp_path / "identity")
    eos = tokenizer.stop_ids(chat=True)
    prompts = [tokenizer.prompt_ids(q, chat=True) for q, _ in talks]
    out = generate(model, prompts, max_new_tokens=24, temperature=0, eos_token_ids=eos, pad_token_id=tokenizer.pad_id)
    assert [tokenizer.decode(ids) for ids in out] == [a for _, a in talks]
