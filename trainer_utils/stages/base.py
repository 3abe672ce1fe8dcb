"""What a training stage is: everything about it in one place, so the loop and the config never name one.

A stage declares its data kind, its flag defaults, its own settings (`options`: a dataclass that becomes the
`objective` group of its config and the flags only its script has), the shared optional settings it takes
(`features`: "adapters" adds the LoRA flags, "conversations" the chat-data ones), what it needs before training
(checks), what it minimises (`objective`), and hooks into the one loop: `prepare` runs once before the first
step (DPO's reference pass; GRPO builds its sampler, kept as ctx.stage_state), `before_loss` sees each step's
micro-batches before the loss (GRPO turns prompts into sampled completions there, with metrics of its own).

Its hooks see the run through narrow views (trainer_utils/context.py): a SetupContext before the data and the
model exist, a RunContext once the Trainer is built; never the Session or the Trainer. A new stage is a module
in this package (a Stage subclass with its options), one line in STAGES, and its script, one line:
`trainer_utils.driver.main(<stage>, argv, __doc__)`.
"""
from __future__ import annotations

from functools import cached_property
from typing import Any, ClassVar

from common.errors import ConfigError
from dataset.config import DataConfig
from dataset.kinds import DataKind

from ..config import NoOptions, TrainConfig, train_config_class
from ..context import RunContext, SetupContext, StepBatches
from ..objectives import LanguageModeling, Objective


class Stage:
    """A training stage. Subclass it, set the class attributes, override the hooks it needs."""

    name: ClassVar[str]  # in run names (<name>-<model>), train_config.json and train_info.json's "method"
    script: ClassVar[str]  # the entry point, for messages
    options: ClassVar[type] = NoOptions  # its own settings: a dataclass of common.config options (config.objective)
    defaults: ClassVar[dict[str, Any]] = {}  # its defaults for shared flags, over the dataclasses' (tested: known)
    # shared optional settings it has (common.config.Scope): "adapters" (LoRA), "conversations" (chat data)
    features: ClassVar[frozenset[str]] = frozenset()
    needs_init: ClassVar[bool] = False  # trains on top of a trained model: --init_from is required
    memory_rows: ClassVar[int] = 1  # sequences per example in a batch, for the memory estimate
    estimates_memory: ClassVar[bool] = True  # whether python -m model --estimate describes its step

    def defaults_for(self, given: dict[str, Any]) -> dict[str, Any]:
        """Its defaults for shared flags, given the settings set on the command line or in --config: `defaults`,
        which a stage may vary with them."""
        return self.defaults

    @property
    def adapts(self) -> bool:
        """Whether it may train LoRA adapters instead of every weight."""
        return "adapters" in self.features

    @cached_property
    def config_class(self) -> type[TrainConfig]:
        """Its configuration: the shared groups, and its options as the `objective` group."""
        return train_config_class(self.options)

    def data_kind(self, data: DataConfig) -> DataKind:
        """The records it trains on: dataset.config's TEXT, CONVERSATIONS, PAIRS or PROMPTS."""
        raise NotImplementedError

    def check(self, config: TrainConfig) -> None:
        """What it needs that its flags cannot default (ConfigError), before anything slow."""
        if self.needs_init and config.model.init_from is None:
            raise ConfigError(f"{self.script} trains on top of a trained model: pass --init_from out/<run> (an SFT "
                              "run, or a pretraining run)")

    def check_session(self, setup: SetupContext) -> None:
        """Checks that need the tokenizer and the model config (before the data is prepared)."""

    def record_tokens(self, setup: SetupContext) -> int:
        """The most tokens one training record may have (longer ones are cut or dropped as the data says)."""
        return setup.max_seq_len

    def objective(self, setup: SetupContext) -> Objective:
        """What it minimises, with its frozen helpers on setup.device."""
        return LanguageModeling()

    def prepare(self, ctx: RunContext) -> Any:
        """Once, after the model, optimizer and objective are built and before the first step; what it returns
        is this run's state for the other hooks (ctx.stage_state)."""
        return None

    def before_loss(self, ctx: RunContext, step: StepBatches) -> StepBatches:
        """Each step's micro-batches on their way to the loss (e.g. completed by rollouts); as they are here."""
        return step

    def metric_unit(self, name: str) -> str | None:
        """The metric that counts what `name` (one of before_loss's metrics) is averaged over in the log; None:
        the objective's unit. A metric that counts is not logged itself."""
        return None

    def __repr__(self) -> str:
        return f"<stage {self.name}>"
