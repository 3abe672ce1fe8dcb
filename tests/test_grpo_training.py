"""train_grpo.py on the one loop: what it logs and writes, a reward that rises, bit-exact resume (the rollouts'
random numbers included), the reference's KL, LoRA, reduced precision, and bad input that stops with a message
naming the file and line."""
from __future__ import annotations

import json

import pytest
from test_train import flags, straight_and_resumed, weights

import train_dpo
import train_grpo
from model import load_model

from conftest import ROOT, read_metrics, strict_records, write_jsonl

CJK_REWARD = '''
def chinese(completion, record):
    """The share of the completion's characters that are Chinese: any sampled text scores, and a near-uniform
    policy can raise it by moving mass between whole groups of tokens."""
    chars = [c for c in completion if not c.isspace()]
    return sum("\u4e00" <= c <= "\u9fff" for c in chars) / len(chars) if chars else 0.0
'''


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """40 questions of the bundled task, and a reward file of a user's own."""
    d = tmp_path_factory.mktemp("prompts")
    lines = (ROOT / "dataset/demo/math_train.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)[:40]
    (d / "math.jsonl").write_text("".join(lines), encoding="utf-8")
    (d / "rewards.py").write_text(CJK_REWARD, encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def sft(sft_run):
    return sft_run


def grpo_flags(prompts, tmp_path, init, run="grpo", **over) -> list[str]:
    base = dict(data_path=prompts / "math.jsonl", init_from=init, preset=None, max_seq_len=96, batch_size=2,
                num_generations=4, max_completion_tokens=16, log_interval=1, learning_rate=1e-3,
                sample_prompts="none", eval_interval=2)
    return flags({"pretrain": None, "cache": prompts / "cache"}, tmp_path, run, **{**base, **over})


def test_a_grpo_run_logs_its_rollouts_and_saves_a_chat_model(prompts, tmp_path, sft):
    assert train_grpo.main(grpo_flags(prompts, tmp_path, sft, max_steps=4)) == 0
    records = read_metrics(tmp_path / "grpo")
    first = records[0]
    for key in ("reward", "reward/exact", "reward/format", "reward_std", "completion_tokens", "truncated",
                "clip_frac", "ratio", "entropy", "rollout_tokens_per_s", "loss"):
        assert key in first, key
    for counting in ("completions", "groups", "rollout_s"):  # denominators, not metrics
        assert counting not in first
    # fp32, one update per rollout: the trained forward agrees with the sampler's own log-probabilities
    assert first["ratio"] == pytest.approx(1.0, abs=1e-4) and first["clip_frac"] == 0
    assert 0 < first["completion_tokens"] <= 16 and 0 <= first["truncated"] <= 1
    assert 0 <= first["reward"] <= 1.1 and "kl" not in first  # --beta 0 by default: no reference
    rows = [json.loads(line) for line in (tmp_path / "grpo/rollouts.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rows} == {2, 4} and len(rows) == 2 * 2 * 4  # two groups of four, twice
    for r in rows:
        assert {"prompt", "answer", "completion", "tokens", "reward", "exact", "format"} <= set(r)
        assert r["reward"] == pytest.approx(r["exact"] + 0.1 * r["format"], abs=1e-4)
    info = json.loads((load_model(tmp_path / "grpo")[1] / "train_info.json").read_text())
    assert (info["prompt_format"], info["method"]) == ("chat", "grpo")
    config = json.loads((tmp_path / "grpo/train_config.json").read_text())
    assert config["resolved"]["val_samples"] == 0 and config["resolved"]["train_samples"] == 40


@pytest.mark.parametrize("loss_type", ["grpo", "cispo"])
def test_a_reward_of_ones_own_rises(prompts, tmp_path, sft, loss_type):
    """A reward file's function, learnable by the barely trained fixture model (its entropy is near ln 6400, so a
    large step): the share of Chinese characters in what it says, about 0.3 at first with the shipped tokenizer
    (0.2 with the previous one, whose Chinese tokens held fewer characters). 40 steps: at 30 it had risen 0.14."""
    assert train_grpo.main(grpo_flags(prompts, tmp_path, sft, max_steps=40, log_interval=10, eval_interval=40,
                                      reward=f"{prompts / 'rewards.py'}:chinese", loss_type=loss_type,
                                      num_generations=8, batch_size=4, learning_rate=1e-2)) == 0
    rewards = [r["reward"] for r in read_metrics(tmp_path / "grpo")]
    assert rewards[-1] > rewards[0] + 0.15, rewards


def test_grpo_resumes_bit_exactly(prompts, tmp_path, sft, monkeypatch):
    """Rollouts are keyed by (seed, step, prompt, member): the resumed run samples what the straight one did."""
    kw = dict(max_steps=6, log_interval=2, save_interval=2)
    straight_and_resumed(monkeypatch, train_grpo.main,
                         lambda run, **o: grpo_flags(prompts, tmp_path, sft, run, **kw, **o), 2)
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert all((a[k] == b[k]).all() for k in a)
    straight, resumed = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [r["reward"] for r in straight] == [r["reward"] for r in resumed]


def test_the_kl_to_the_start_model_lora_and_reduced_precision(prompts, tmp_path, sft):
    assert train_grpo.main(grpo_flags(prompts, tmp_path, sft, max_steps=3, beta=0.05)) == 0
    kl = [r["kl"] for r in read_metrics(tmp_path / "grpo")]
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and kl[-1] > 0  # the policy starts as its reference, then moves
    assert train_grpo.main(grpo_flags(prompts, tmp_path, sft, "lora", max_steps=2, lora_rank=4, beta=0.05)) == 0
    ckpt = tmp_path / "lora" / (tmp_path / "lora/latest").read_text().strip()
    assert (ckpt / "lora.json").is_file()
    for dtype in ("bfloat16", "float16"):  # rollouts under the run's autocast; fp16 steps through the loss scaler
        assert train_grpo.main(grpo_flags(prompts, tmp_path, sft, dtype, max_steps=2, dtype=dtype)) == 0
        records = [r for r in strict_records(tmp_path / dtype) if "skipped_steps" in r]
        assert records and all(r["skipped_steps"] == 0 and r["loss"] is not None for r in records)


def test_a_reward_model_directory_rewards_in_training(prompts, tmp_path, sft, reward_model):
    assert train_grpo.main(grpo_flags(prompts, tmp_path, sft, max_steps=2, reward=f"exact,{reward_model}=0.5")) == 0
    first = read_metrics(tmp_path / "grpo")[0]
    assert f"reward/{reward_model.name}" in first and first[f"reward/{reward_model.name}"] != 0


def test_bad_prompts_and_settings_stop_with_a_message(prompts, tmp_path, sft, capsys):
    good = (prompts / "math.jsonl").read_text(encoding="utf-8").splitlines()
    bad = write_jsonl(tmp_path / "bad.jsonl", [*good[:3], '{"prompt": "What is 2 + 2?"}', "{not json", *good[3:8]])
    assert train_grpo.main(grpo_flags(prompts, tmp_path, sft, data_path=bad, max_steps=1)) == 2
    err = capsys.readouterr().err
    assert f"{bad}:4:" in err and "answer" in err and "--skip_bad_lines" in err
    assert train_grpo.main(grpo_flags(prompts, tmp_path, sft, data_path=bad, max_steps=1, skip_bad_lines=True,
                                      overwrite=True)) == 0
    assert "skipped 2 bad lines" in capsys.readouterr().err
    long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "word " * 200, "answer": "1"}])
    assert train_grpo.main(grpo_flags(prompts, tmp_path, sft, "long", data_path=long, max_steps=1)) == 2
    assert f"{long}:1:" in capsys.readouterr().err
    for over, message in ((dict(reward="exact,nonsense"), "reward nonsense: unknown"),
                          (dict(reward=f"{tmp_path}/none.py:f"), "no such file"),
                          (dict(max_completion_tokens=96), "leaves no room for a prompt"),
                          (dict(data_path=f"{prompts / 'math.jsonl'}:0.5"), "one prompt file"),
                          (dict(init_from=None), "--init_from")):
        assert train_grpo.main(grpo_flags(prompts, tmp_path, sft, "refused", max_steps=1, **over)) == 2
        assert message in capsys.readouterr().err, over
    (tmp_path / "nan.py").write_text("def f(completion, record):\n    return float('nan')\n")
    assert train_grpo.main(grpo_flags(prompts, tmp_path, sft, "nan", max_steps=1, reward=f"{tmp_path}/nan.py:f")) == 2
    assert "returned nan; a reward is a finite number" in capsys.readouterr().err
    # DPO has a --beta of its own, where 0 would mean no preference at all
    pairs = ROOT / "dataset/demo/dpo_demo.jsonl"
    assert train_dpo.main(grpo_flags(prompts, tmp_path, sft, "dpo", data_path=pairs, beta=0, max_steps=1,
                                     num_generations=None, max_completion_tokens=None)) == 2
    assert "--beta must be > 0, got 0" in capsys.readouterr().err
