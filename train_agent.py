"""Agentic reinforcement learning: GRPO (or CISPO) on rollouts that call tools, rewarded by the checked answer.

    python train_agent.py --init_from out/demo-tools-sft              # the bundled task: dataset/demo/tools_*.jsonl
    python train_agent.py --init_from out/tools-sft --data_path prompts.jsonl --max_rounds 4 --reward exact

Data: {"conversations": [{"role": "system", "content": "", "tools": [...]}, {"role": "user", ...}], "answer":
"84"}: the system turn offers tools in OpenAI's format, each one of the bundled tools (common/tools.py:
calculator, convert_units, add_days, days_between, lookup_element). Each step runs --num_generations rollouts
per prompt: a reply (up to --max_completion_tokens) whose tool calls are run and their results fed back, for up
to --max_rounds rounds of calls, then an answer. The reward (--reward: exact on the final answer, tool_use for
calls that were all well formed and ran; calls alone earn nothing) is compared within the group, and the loss
trains the replies' tokens only (prompt and tool results masked), as train_grpo.py does (--loss_type, --beta,
--epsilon, LoRA with --lora_rank N). Logged besides GRPO's: tool_calls and malformed per rollout, call_errors
per call, capped and overflow shares; rollouts.jsonl shows each logged rollout's turns. Flags: --help.
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    # Imported here: tokenizer worker processes re-import this file and must not pay for loading PyTorch.
    from trainer_utils.driver import main as train
    return train("agent", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
