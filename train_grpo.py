"""Reinforcement learning with verifiable rewards: GRPO (or CISPO) on prompts whose answers are checked.

    python train_grpo.py --init_from out/math-sft                      # the bundled task: dataset/demo/math_*.jsonl
    python train_grpo.py --init_from out/sft-minimind-26m --data_path prompts.jsonl --reward exact,format=0.1
    python train_grpo.py --init_from out/math-sft --loss_type cispo --eval_tasks dataset/demo/math_heldout.jsonl

Data: {"prompt": "...", "answer": "12"} or {"conversations": [...], "answer": ...} (MiniMind's RL format: a last
assistant turn is left out); any other field reaches a reward of your own. Each step samples --num_generations
completions per prompt (--batch_size prompts per micro-batch) at --temperature, scores them with --reward
(exact: the record's answer; format: "The answer is N."; length; FILE.py:FUNCTION), compares each with its
group, and trains on the completion tokens: --loss_type grpo (PPO's clipped ratio, --epsilon, --epsilon_high) or
cispo (a clipped stop-gradient weight), with --beta's KL to the --init_from model (0: none kept). No reward
model: every reward is computed from the text. Full fine-tuning, or LoRA adapters with --lora_rank N. Logged:
reward and its terms, reward_std, completion_tokens, truncated, clip_frac, ratio, entropy, kl, rollout
tokens/s; rollouts.jsonl at every evaluation. Flags: --help.
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    # Imported here: tokenizer worker processes re-import this file and must not pay for loading PyTorch.
    from trainer_utils.driver import main as train
    return train("grpo", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
