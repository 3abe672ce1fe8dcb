"""train_agent.py on the one loop: a model that calls the calculator (a tiny one taught the format on a handful of
conversations) runs multi-round rollouts, logs what its tools did, resumes bit-exactly and trains on two DDP ranks
as one process does; prompt files with bad tools and a reward that raises stop with one line."""
from __future__ import annotations

import json

import pytest
import torch
from test_distributed import single, torchrun
from test_train import flags, straight_and_resumed, weights

import train_agent
import train_full_sft
from common.tools import tool_schemas
from model import load_model

from conftest import read_metrics, write_jsonl

QUESTIONS = [(a, b) for a, b in ((2, 3), (4, 5), (7, 1), (6, 6), (3, 8), (9, 2), (5, 4), (8, 8))]


def chat(a: int, b: int) -> list[dict]:
    return [{"role": "system", "content": "", "tools": tool_schemas(["calculator"])},
            {"role": "user", "content": f"What is {a} + {b}?"}]


@pytest.fixture(scope="module")
def tool_model(corpus, tmp_path_factory):
    """A tiny model that has seen eight conversations calling the calculator (150 steps): its rollouts call, get
    results back and go on, so every round of the loop runs. And the prompts of those questions, with answers."""
    d = tmp_path_factory.mktemp("agent")
    conversations = [{"conversations": chat(a, b) + [
        {"role": "assistant", "content": "", "tool_calls": [{"name": "calculator",
                                                             "arguments": {"expression": f"{a} + {b}"}}]},
        {"role": "tool", "content": json.dumps({"result": a + b})},
        {"role": "assistant", "content": f"{a} + {b} = {a + b}. The answer is {a + b}."}]} for a, b in QUESTIONS]
    sft = write_jsonl(d / "calls.jsonl", conversations)
    assert train_full_sft.main(flags(corpus, d, "tools", data_path=sft, max_seq_len=448, batch_size=8,
                                     max_steps=150, learning_rate=3e-3, warmup_steps=10, log_interval=50,
                                     eval_interval=150, save_interval=150, sample_prompts="none")) == 0
    prompts = write_jsonl(d / "prompts.jsonl", [{"conversations": chat(a, b), "answer": str(a + b)}
                                                for a, b in QUESTIONS])
    return {"model": d / "tools", "prompts": prompts, "cache": d / "cache"}


def agent_flags(tool_model, tmp_path, run="agent", **over) -> list[str]:
    base = dict(data_path=tool_model["prompts"], init_from=tool_model["model"], preset=None, max_seq_len=448,
                batch_size=2, num_generations=4, max_completion_tokens=64, max_rounds=2, log_interval=1,
                learning_rate=1e-3, sample_prompts="none", eval_interval=2, temperature=0.5)
    return flags({"pretrain": None, "cache": tool_model["cache"]}, tmp_path, run, **{**base, **over})


def test_an_agent_run_calls_tools_and_logs_what_they_did(tool_model, tmp_path):
    assert train_agent.main(agent_flags(tool_model, tmp_path, max_steps=2)) == 0
    records = read_metrics(tmp_path / "agent")
    for key in ("reward", "reward/exact", "reward/tool_use", "tool_calls", "call_errors", "malformed", "capped",
                "overflow", "completion_tokens", "clip_frac", "ratio", "loss"):
        assert key in records[0], key
    assert "calls" not in records[0] and "completions" not in records[0]  # denominators
    assert sum(r["tool_calls"] for r in records) > 0.5  # the taught model calls: the rounds after the first run
    assert records[0]["ratio"] == pytest.approx(1.0, abs=1e-4)  # the replies' log-probs are the sampler's own
    rows = [json.loads(line) for line in (tmp_path / "agent/rollouts.jsonl").read_text().splitlines()]
    assert rows and all({"turns", "completion", "reward", "exact", "tool_use"} <= set(r) for r in rows)
    called = [r for r in rows if any(t["role"] == "tool" for t in r["turns"])]
    assert called and all(t["role"] in ("assistant", "tool") for r in called for t in r["turns"])
    info = json.loads((load_model(tmp_path / "agent")[1] / "train_info.json").read_text())
    assert (info["prompt_format"], info["method"]) == ("chat", "agent")


@pytest.mark.parametrize("skip", [False, True])
def test_the_agent_resumes_bit_exactly(tool_model, tmp_path, monkeypatch, skip):
    """Each reply is keyed by (seed, step, prompt, member, round): the resumed run's rollouts are the straight
    run's, tool rounds and all; with --skip_uniform_groups too (which groups are left out follows from them)."""
    kw = {"max_steps": 4, "log_interval": 1, "save_interval": 2, f"{'' if skip else 'no-'}skip_uniform_groups": True}
    straight_and_resumed(monkeypatch, train_agent.main,
                         lambda run, **o: agent_flags(tool_model, tmp_path, run, **kw, **o), 2)
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert all((a[k] == b[k]).all() for k in a)
    straight, resumed = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    for key in ("reward", "tool_calls", "completion_tokens", "informative", "loss"):
        assert [r[key] for r in straight] == [r[key] for r in resumed], key
    if skip:  # groups were left out at some step, and some were trained
        assert any(0 < r["informative"] < 1 for r in straight), [r["informative"] for r in straight]


@pytest.mark.slow
def test_the_agent_under_ddp_is_one_process(tool_model, tmp_path):
    """Groups stay on the rank that holds their prompt, and every reply's sampling is keyed: two DDP ranks roll
    out, score and learn what one process does with two accumulation steps; with --skip_uniform_groups, each
    rank leaving out its own alike-scored groups, and the loss normalised over the tokens all ranks kept."""
    post = dict(max_steps=3, log_interval=1, save_interval=3, optimizer="adamw", skip_uniform_groups=True)
    single(agent_flags(tool_model, tmp_path, "single", accumulation_steps=2, **post), "train_agent.py")
    torchrun(2, agent_flags(tool_model, tmp_path, "ddp", **post), "train_agent.py")
    a, b = read_metrics(tmp_path / "single"), read_metrics(tmp_path / "ddp")
    assert len(a) == len(b) == 3
    for key in ("reward", "tool_calls", "completion_tokens", "capped", "informative"):
        assert [m[key] for m in a] == pytest.approx([m[key] for m in b], abs=1e-6), key
    assert max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b)) <= 1e-5
    wa, wb = weights(tmp_path / "single"), weights(tmp_path / "ddp")
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=1e-5, rtol=0)


def test_bad_prompts_and_rewards_stop_with_one_line(tool_model, tmp_path, capsys):
    good = json.loads(tool_model["prompts"].read_text().splitlines()[0])
    unknown = json.loads(json.dumps(good))
    unknown["conversations"][0]["tools"].append({"type": "function", "function": {"name": "get_weather"}})
    path = write_jsonl(tmp_path / "unknown.jsonl", [good, unknown])
    assert train_agent.main(agent_flags(tool_model, tmp_path, "unknown", data_path=path, max_steps=1)) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: offers tool 'get_weather'" in err and "Traceback" not in err
    schema = json.loads(json.dumps(good))
    schema["conversations"][0]["tools"] = [{"type": "function", "function": {"parameters": {}}}]
    path = write_jsonl(tmp_path / "schema.jsonl", [good, good, schema])
    assert train_agent.main(agent_flags(tool_model, tmp_path, "schema", data_path=path, max_steps=1)) == 2
    err = capsys.readouterr().err
    assert f"{path}:3:" in err and "not a function schema" in err
    (tmp_path / "boom.py").write_text("def f(completion, record):\n    return 1 / 0\n")
    assert train_agent.main(agent_flags(tool_model, tmp_path, "boom", max_steps=1,
                                        reward=f"{tmp_path}/boom.py:f")) == 1
    err = capsys.readouterr().err
    assert "raised ZeroDivisionError: division by zero" in err and "Traceback" not in err
    assert train_agent.main(agent_flags(tool_model, tmp_path, "rounds", max_steps=1, max_rounds=0)) == 2
    assert "--max_rounds must be >= 1" in capsys.readouterr().err
