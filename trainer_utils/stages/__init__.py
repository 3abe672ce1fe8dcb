"""The training stages, one module each, the registry the scripts look them up in, and how a stage's command line
becomes its checked configuration.

    pretrain  text, next-token loss                 sft      conversations, loss on the assistant's turns
    lora      sft's data and loss, LoRA adapters    dpo      preference pairs against the start model
    distill   either kind, a frozen teacher's KL beside the labels' cross-entropy
    grpo      prompts with checked answers, sampled completions rewarded by checks (GRPO / CISPO)
    agent     grpo with rollouts that call tools, rewarded by the checked final answer

A new stage is a module here with a Stage subclass (and its options), one line in STAGES, and its script; the
loop, the session, the config and the other stages stay as they are.
"""
from __future__ import annotations

from common.config import parse_config
from common.errors import ConfigError

from ..config import TrainConfig
from .agent import AgentRL
from .base import Stage, StepBatches
from .distill import Distill
from .dpo import PreferenceOptimization
from .grpo import GRPO
from .pretrain import Pretrain
from .sft import SFT, LoRA

STAGES: dict[str, Stage] = {s.name: s for s in (Pretrain(), SFT(), LoRA(), PreferenceOptimization(), Distill(),
                                                     GRPO(), AgentRL())}


def get_stage(stage: Stage | str) -> Stage:
    """The stage itself, or the registered one of that name."""
    if isinstance(stage, Stage):
        return stage
    if stage not in STAGES:
        raise ConfigError(f"unknown stage {stage!r}; known: {', '.join(STAGES)}")
    return STAGES[stage]


def parse_train_config(stage: Stage | str, argv: list[str] | None, description: str | None) -> TrainConfig:
    """The checked configuration of a training stage's command line (and --config file), with its defaults."""
    stage = get_stage(stage)
    config = parse_config(stage.config_class, argv, description, stage, stage.defaults_for)
    stage.check(config)
    return config


__all__ = ["STAGES", "Stage", "StepBatches", "get_stage", "parse_train_config"]
