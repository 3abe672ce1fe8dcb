"""Pretrain a PocketLM model on raw text: next-token prediction over packed windows of a JSONL corpus.

    python train_pretrain.py --batch_size 8                       # 26M model on the bundled demo corpus
    python train_pretrain.py --data_path pretrain_hq.jsonl --preset minimind-104m --accumulation_steps 4
    torchrun --nproc_per_node 2 train_pretrain.py ...             # same script, several GPUs

Every flag is listed by --help; the loop, checkpoints and logging live in trainer_utils/.
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    # Imported here, not at module level: tokenizer worker processes are spawned and re-import this file, and
    # must not pay for loading PyTorch (~0.4 GB each).
    from trainer_utils.driver import main as train

    return train("pretrain", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
