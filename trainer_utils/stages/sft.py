"""Supervised fine-tuning on conversations, the loss on the assistant's turns only (train_full_sft.py), and its
LoRA variant (train_lora.py): the same data and loss, low-rank adapters trained instead of every weight."""
from __future__ import annotations

import sys
from typing import Any, ClassVar

from dataset.config import DataConfig
from dataset.kinds import CONVERSATIONS, DataKind

from ..context import SetupContext
from .base import Stage

SFT_DEMO = ["dataset/demo/sft_demo.jsonl"]


class SFT(Stage):
    name = "sft"
    script = "train_full_sft.py"
    # fine-tuning keeps AdamW, the optimizer most published checkpoints were trained with
    defaults: ClassVar[dict[str, Any]] = dict(data_path=SFT_DEMO, batch_size=16, learning_rate=5e-5)
    features = frozenset({"conversations"})

    def data_kind(self, data: DataConfig) -> DataKind:
        return CONVERSATIONS

    def check_session(self, setup: SetupContext) -> None:
        if setup.init_dir is None and setup.resume_from is None:
            print("note: no --init_from; fine-tuning a randomly initialised model", file=sys.stderr)


class LoRA(SFT):
    name = "lora"
    script = "train_lora.py"
    # adapters start at zero and have few parameters: a larger step than full fine-tuning
    defaults: ClassVar[dict[str, Any]] = dict(data_path=SFT_DEMO, batch_size=16, learning_rate=1e-4, lora_rank=16)
    features = frozenset({"conversations", "adapters"})
    needs_init = True  # so SFT's note on a random start never applies
