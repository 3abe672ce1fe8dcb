"""What a training stage is: everything about it in one place, so the loop and the config never name one.

A stage declares its data kind, its flag defaults, the optional settings it has (`features`: "lora" adds the
LoRA flags, "preference" DPO's, ...), what it needs before training (checks), what it minimises (`objective`), and
hooks into the one loop: `prepare` runs once before the first step (DPO's reference pass), `before_loss` sees
each step's micro-batches before the loss (where rollouts would be sampled). The training scripts are one line
each: `trainer_utils.loop.main(<stage>, argv, __doc__)`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from common.errors import ConfigError

from ..objectives import Batch, LanguageModeling, Objective

if TYPE_CHECKING:  # hints only: the stages are imported by the config, the session and the loop
    from dataset.config import DataConfig

    from ..config import TrainConfig
    from ..loop import Trainer
    from ..session import Session


class Stage:
    """A training stage. Subclass it, set the class attributes, override the hooks it needs."""

    name: ClassVar[str]  # in run names (<name>-<model>), train_config.json and train_info.json's "method"
    script: ClassVar[str]  # the entry point, for messages
    defaults: ClassVar[dict[str, Any]] = {}  # its flag defaults, over the dataclasses'
    # optional settings it has (common.config.Scope): "adapters" (LoRA), "preference" (DPO), "teacher"
    # (distillation), "conversations" (chat data)
    features: ClassVar[frozenset[str]] = frozenset()
    needs_init: ClassVar[bool] = False  # trains on top of a trained model: --init_from is required
    memory_rows: ClassVar[int] = 1  # sequences per example in a batch, for the memory estimate
    estimates_memory: ClassVar[bool] = True  # whether python -m model --estimate describes its step

    @property
    def adapts(self) -> bool:
        """Whether it may train LoRA adapters instead of every weight."""
        return "adapters" in self.features

    def data_kind(self, data: DataConfig) -> str:
        """The records it trains on: dataset.config's TEXT, CONVERSATIONS or PAIRS."""
        raise NotImplementedError

    def check(self, config: TrainConfig) -> None:
        """What it needs that its flags cannot default (ConfigError), before anything slow."""
        if self.needs_init and config.model.init_from is None:
            raise ConfigError(f"{self.script} trains on top of a trained model: pass --init_from out/<run> (an SFT "
                              "run, or a pretraining run)")

    def check_session(self, session: Session) -> None:
        """Checks that need the tokenizer and the model config (before the data is prepared)."""

    def objective(self, session: Session, device: torch.device) -> Objective:
        """What it minimises, with its frozen helpers on the device."""
        return LanguageModeling()

    def prepare(self, trainer: Trainer) -> None:
        """Once, after the model, optimizer and objective are built and before the first step."""

    def before_loss(self, trainer: Trainer, micro: list[Batch]) -> list[Batch]:
        """Each step's micro-batches on their way to the loss (e.g. completed by rollouts); as they are here."""
        return micro

    def __repr__(self) -> str:
        return f"<stage {self.name}>"
