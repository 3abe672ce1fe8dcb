"""Knowledge distillation: a student learns from a frozen teacher's softened distributions and from the labels.

    python train_distillation.py --teacher out/sft-minimind-104m --init_from out/sft-minimind-26m
    python train_distillation.py --teacher out/demo-sft --preset tiny --data_path dataset/demo/pretrain_demo.jsonl

Loss per target token: alpha * CE(student, label) + (1 - alpha) * T^2 * KL(teacher_T || student_T), with
--alpha (0.5) and --temperature (1.5). The student is new (--preset ...) or --init_from a run; the teacher is any
PocketLM checkpoint with the same tokenizer, of any width and depth. Pretraining text or SFT conversations
(the first --data_path file decides). Validation reports the student's own cross-entropy. Flags: --help.
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    # Imported here: tokenizer worker processes re-import this file and must not pay for loading PyTorch.
    from trainer_utils.driver import main as train

    return train("distill", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
