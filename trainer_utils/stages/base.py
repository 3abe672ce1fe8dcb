"""What a training stage is: everything about it in one place, so the loop and the config never name one.

A stage declares its data kind, its flag defaults, the optional settings it has (`features`: "adapters" adds the
LoRA flags, "preference" DPO's, ...), what it needs before training (checks), what it minimises (`objective`), and
hooks into the one loop: `prepare` runs once before the first step (DPO's reference pass; GRPO builds its
sampler, kept as trainer.stage_state), `before_loss` sees each step's micro-batches before the loss (GRPO turns
prompts into sampled completions there, with metrics of its own). The training scripts are one line each:
`trainer_utils.loop.main(<stage>, argv, __doc__)`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from common.errors import ConfigError

from ..objectives import Batch, LanguageModeling, Objective

if TYPE_CHECKING:  # hints only: the stages are imported by the config, the session and the loop
    from dataset.config import DataConfig

    from ..config import TrainConfig
    from ..loop import Trainer
    from ..session import Session


@dataclass
class StepBatches:
    """One optimizer step's micro-batches on this rank, their non-padding input tokens (counted on the host, for
    the log's throughput), and metrics the stage adds to the objective's (sums; Stage.metric_unit says per what)."""

    micro: list[Batch]
    input_tokens: int
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


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

    def record_tokens(self, session: Session) -> int:
        """The most tokens one training record may have (longer ones are cut or dropped as the data says)."""
        return session.max_seq_len

    def objective(self, session: Session, device: torch.device) -> Objective:
        """What it minimises, with its frozen helpers on the device."""
        return LanguageModeling()

    def prepare(self, trainer: Trainer) -> Any:
        """Once, after the model, optimizer and objective are built and before the first step; what it returns
        is this run's state for the other hooks (trainer.stage_state)."""
        return None

    def before_loss(self, trainer: Trainer, step: StepBatches) -> StepBatches:
        """Each step's micro-batches on their way to the loss (e.g. completed by rollouts); as they are here."""
        return step

    def metric_unit(self, name: str) -> str | None:
        """The metric that counts what `name` (one of before_loss's metrics) is averaged over in the log; None:
        the objective's unit. A metric that counts is not logged itself."""
        return None

    def __repr__(self) -> str:
        return f"<stage {self.name}>"
