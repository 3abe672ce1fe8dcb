"""Supervised fine-tuning: teach a pretrained PocketLM model to chat (loss on assistant answers only).

    python train_full_sft.py --init_from out/pretrain-minimind-26m          # bundled demo conversations
    python train_full_sft.py --init_from out/pretrain-minimind-26m --data_path sft_mini_512.jsonl

Conversations ({"conversations": [{"role", "content"}, ...]}) are rendered with the tokenizer's ChatML
template; system, user and template tokens are context, never targets. Flags: --help.
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    # Imported here, not at module level: tokenizer worker processes are spawned and re-import this file, and
    # must not pay for loading PyTorch (~0.4 GB each).
    from trainer_utils.driver import main as train

    return train("sft", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
