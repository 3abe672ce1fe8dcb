"""Pretraining: next-token prediction over packed windows of raw text (train_pretrain.py)."""
from __future__ import annotations

from typing import Any, ClassVar

from dataset.config import DataConfig
from dataset.kinds import TEXT, DataKind

from ..config import AUTO_PRESET
from ..loss_model import RECIPE
from ..planner import MAX_EPOCHS
from .base import Stage


class Pretrain(Stage):
    name = "pretrain"
    script = "train_pretrain.py"
    # Muon learns more per token and per second than AdamW from scratch (docs/training.md, dev/LOG.md)
    defaults: ClassVar[dict[str, Any]] = dict(data_path=["dataset/demo/pretrain_demo.jsonl"], batch_size=32,
                                              learning_rate=5e-4, optimizer="auto")
    # Continued pretraining (--init_from a trained model, e.g. on your own documents; docs/training.md): a fresh
    # schedule that peaks lower, since the weights already hold what a high rate would overwrite (forgetting)
    continued: ClassVar[dict[str, Any]] = dict(learning_rate=1e-4, warmup_ratio=0.02)

    # --preset auto: the settings the planner's loss model was fitted with, and the epochs it may plan
    auto: ClassVar[dict[str, Any]] = dict(**RECIPE, epochs=MAX_EPOCHS)

    def defaults_for(self, given: dict[str, Any]) -> dict[str, Any]:
        if given.get("init_from"):
            return {**self.defaults, **self.continued}
        if given.get("preset") != AUTO_PRESET:
            return self.defaults
        auto = {**self.defaults, **self.auto}
        if "learning_rate" in given and "muon_lr" not in given:
            # a rate of the user's: Muon's is --learning_rate too, as its flag says, at any width
            del auto["muon_lr"], auto["muon_base_width"]
        return auto

    def data_kind(self, data: DataConfig) -> DataKind:
        return TEXT
