"""Rollout benchmark: RL's sampled completions per second, batched (trainer_utils/rollouts.py: every prompt's
group in one KV-cached generation) against sampling the same completions one sequence at a time.

    python bench/bench_rollouts.py --checkpoint out/demo-sft [--prompts 8] [--group 4] [--new_tokens 48]
    python bench/bench_rollouts.py --checkpoint out/demo-agent-sft --tools [--rounds 3] [--loss]

The prompts are the first --prompts questions of the bundled arithmetic task (dataset/demo/math_train.jsonl),
through the chat template. Both ways sample at temperature 1 with a stop at the end-of-turn token; the batched
completions' tokens (stop tokens included) over the batched time is compared with the one-at-a-time ones' over
theirs, the fastest of --repeats runs each, in turns. --tools: rollouts that call the bundled tools
(sample_tool_rollouts, up to --rounds rounds of calls) on the tool prompts (dataset/demo/tools_rl.jsonl), every
round of every rollout batched, against one conversation at a time; the tokens counted are the replies'.
--loss: also the policy loss's forward and backward on one batched sample, its rows packed as training packs
them (a group's prompt once, trainer_utils/rollouts.py pack_rollouts) against one row per completion. Writes
bench/results/rollouts[-tools]-<cores>core.json, the CPU named with its kind.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.portable import portable  # noqa: E402
from common.device import cpu_description  # noqa: E402
from dataset.prompts import PromptDataset  # noqa: E402
from dataset.tokenizer import DEFAULT_TOKENIZER_DIR, Tokenizer  # noqa: E402
from model import load_model  # noqa: E402
from trainer_utils.objectives import PolicyGradient  # noqa: E402
from trainer_utils.rollouts import Rollouts, sample_rollouts, sample_tool_rollouts  # noqa: E402
from trainer_utils.stages.agent import offered_tools  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data_path", default=None, help="default: the bundled math task (--tools: tool prompts)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--new_tokens", type=int, default=48, help="per completion (--tools: per reply)")
    p.add_argument("--tools", action="store_true", help="rollouts that call the bundled tools")
    p.add_argument("--rounds", type=int, default=3, help="--tools: rounds of calls a rollout may make")
    p.add_argument("--loss", action="store_true", help="also time the policy loss on packed rows against a row "
                                                       "per completion")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="default: bench/results/rollouts[-tools]-<cores>core.json")
    args = p.parse_args(argv)
    data = args.data_path or str(ROOT / "dataset" / "demo" / ("tools_rl.jsonl" if args.tools else "math_train.jsonl"))
    model, model_dir = load_model(args.checkpoint)
    tok = Tokenizer(model_dir if (model_dir / "tokenizer.json").is_file() else DEFAULT_TOKENIZER_DIR)
    max_len = model.config.max_position_embeddings
    dataset = PromptDataset(data, tok, max_len - args.new_tokens)
    prompts = dataset.prompts[:args.prompts]
    tools = offered_tools(dataset)[:args.prompts] if args.tools else []
    stop = tok.stop_ids(chat=True)

    def sample(indices: list[int], group: int) -> tuple[Rollouts, int]:
        """`group` rollouts of each prompt at `indices`, sampled together, and their reply (or completion) tokens."""
        chosen = [prompts[i] for i in indices]
        if args.tools:
            out = sample_tool_rollouts(model, chosen, group, args.new_tokens, args.rounds, max_len, tok,
                                       [tools[i] for i in indices])
            return out.rows, sum(out.policy_tokens)
        rows = sample_rollouts(model, chosen, group, args.new_tokens, stop, tok.pad_id)
        return rows, sum(map(len, rows.completions))

    def batched() -> int:
        return sample(list(range(len(prompts))), args.group)[1]

    def one_at_a_time() -> int:
        return sum(sample([i], 1)[1] for i in range(len(prompts)) for _ in range(args.group))

    times: dict[str, list[tuple[float, int]]] = {"batched": [], "one_at_a_time": []}
    torch.manual_seed(0)
    for _ in range(args.repeats):
        for name, fn in (("batched", batched), ("one_at_a_time", one_at_a_time)):
            t0 = time.perf_counter()
            tokens = fn()
            times[name].append((time.perf_counter() - t0, tokens))
    rate = {name: max(tokens / seconds for seconds, tokens in runs) for name, runs in times.items()}
    result = {"machine": f"{os.cpu_count()} cores, {cpu_description()}", "checkpoint": portable(args.checkpoint),
              "data": portable(data), "tools": args.tools, **({"rounds": args.rounds} if args.tools else {}),
              "prompts": args.prompts, "group": args.group, "new_tokens": args.new_tokens,
              "threads": torch.get_num_threads(),
              "batched_tokens_per_s": round(rate["batched"], 1),
              "one_at_a_time_tokens_per_s": round(rate["one_at_a_time"], 1),
              "speedup": round(rate["batched"] / rate["one_at_a_time"], 2),
              "note": f"sampled at temperature 1 (stop at the end-of-turn token), the best of {args.repeats} runs "
                      "each, in turns; each side's own completion tokens over its own time"}
    if args.loss:
        result["loss"] = loss_seconds(model, sample(list(range(len(prompts))), args.group)[0], tok.pad_id,
                                      args.repeats)
    name = f"rollouts{'-tools' if args.tools else ''}-{os.cpu_count()}core.json"
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / name
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


def loss_seconds(model: torch.nn.Module, rollouts: Rollouts, pad_id: int, repeats: int) -> dict[str, float]:
    """The policy loss's forward and backward on the rollouts' packed rows and on one row per completion (the
    fastest of `repeats` each, in turns), with the rows' shapes."""
    advantages = torch.randn(len(rollouts.completions), generator=torch.Generator().manual_seed(0))
    batches = {"packed": rollouts.policy_batch(advantages), "one_row_each": rollouts.one_row_each(advantages, pad_id)}
    objective, seconds = PolicyGradient("grpo"), {name: float("inf") for name in batches}
    model.train()
    for _ in range(repeats):
        for name, batch in batches.items():
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            objective(model, batch, contextlib.nullcontext).loss.backward()
            seconds[name] = min(seconds[name], time.perf_counter() - t0)
    model.eval()
    return {"packed_s": round(seconds["packed"], 3), "packed_rows": list(batches["packed"][0].shape),
            "one_row_each_s": round(seconds["one_row_each"], 3),
            "one_row_each_rows": list(batches["one_row_each"][0].shape),
            "speedup": round(seconds["one_row_each"] / seconds["packed"], 2)}


if __name__ == "__main__":
    sys.exit(main())
