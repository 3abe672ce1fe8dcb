"""Rollout benchmark: RL's sampled completions per second, batched (trainer_utils/rollouts.py: every prompt's
group in one KV-cached generation) against sampling the same completions one sequence at a time.

    python bench/bench_rollouts.py --checkpoint out/demo-sft [--prompts 8] [--group 4] [--new_tokens 48]
    python bench/bench_rollouts.py --checkpoint out/demo-agent-sft --tools [--rounds 3]

The prompts are the first --prompts questions of the bundled arithmetic task (dataset/demo/math_train.jsonl),
through the chat template. Both ways sample at temperature 1 with a stop at the end-of-turn token; the batched
completions' tokens (stop tokens included) over the batched time is compared with the one-at-a-time ones' over
theirs, the fastest of --repeats runs each, in turns. --tools: rollouts that call the bundled tools
(sample_tool_rollouts, up to --rounds rounds of calls) on the tool prompts (dataset/demo/tools_rl.jsonl), every
round of every rollout batched, against one conversation at a time; the tokens counted are the replies'. Writes
bench/results/rollouts[-tools]-<cores>core.json, the CPU named with its kind.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.device import cpu_description  # noqa: E402
from dataset.prompts import PromptDataset  # noqa: E402
from dataset.tokenizer import DEFAULT_TOKENIZER_DIR, Tokenizer  # noqa: E402
from model import load_model  # noqa: E402
from trainer_utils.rollouts import sample_rollouts, sample_tool_rollouts  # noqa: E402
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

    def sample(indices: list[int], group: int) -> int:
        """The reply (or completion) tokens of `group` rollouts of each prompt at `indices`, sampled together."""
        chosen = [prompts[i] for i in indices]
        if args.tools:
            out = sample_tool_rollouts(model, chosen, group, args.new_tokens, args.rounds, max_len, tok,
                                       [tools[i] for i in indices])
            return sum(out.policy_tokens)
        return sum(map(len, sample_rollouts(model, chosen, group, args.new_tokens, stop, tok.pad_id).completions))

    def batched() -> int:
        return sample(list(range(len(prompts))), args.group)

    def one_at_a_time() -> int:
        return sum(sample([i], 1) for i in range(len(prompts)) for _ in range(args.group))

    times: dict[str, list[tuple[float, int]]] = {"batched": [], "one_at_a_time": []}
    torch.manual_seed(0)
    for _ in range(args.repeats):
        for name, fn in (("batched", batched), ("one_at_a_time", one_at_a_time)):
            t0 = time.perf_counter()
            tokens = fn()
            times[name].append((time.perf_counter() - t0, tokens))
    rate = {name: max(tokens / seconds for seconds, tokens in runs) for name, runs in times.items()}
    result = {"machine": f"{os.cpu_count()} cores, {cpu_description()}", "checkpoint": args.checkpoint,
              "data": data, "tools": args.tools, **({"rounds": args.rounds} if args.tools else {}),
              "prompts": args.prompts, "group": args.group, "new_tokens": args.new_tokens,
              "threads": torch.get_num_threads(),
              "batched_tokens_per_s": round(rate["batched"], 1),
              "one_at_a_time_tokens_per_s": round(rate["one_at_a_time"], 1),
              "speedup": round(rate["batched"] / rate["one_at_a_time"], 2),
              "note": f"sampled at temperature 1 (stop at the end-of-turn token), the best of {args.repeats} runs "
                      "each, in turns; each side's own completion tokens over its own time"}
    name = f"rollouts{'-tools' if args.tools else ''}-{os.cpu_count()}core.json"
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / name
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
