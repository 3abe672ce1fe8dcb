"""The training stages, one module each, and the registry the scripts look them up in.

    pretrain  text, next-token loss                 sft      conversations, loss on the assistant's turns
    lora      sft's data and loss, LoRA adapters    dpo      preference pairs against the start model
    distill   either kind, a frozen teacher's KL beside the labels' cross-entropy
    grpo      prompts with checked answers, sampled completions rewarded by checks (GRPO / CISPO)

A new stage is a module here with a Stage subclass, one line in STAGES, and its script; nothing else changes.
"""
from __future__ import annotations

from common.errors import ConfigError

from .base import Stage, StepBatches
from .distill import Distill
from .dpo import PreferenceOptimization
from .grpo import GRPO
from .pretrain import Pretrain
from .sft import SFT, LoRA

STAGES: dict[str, Stage] = {s.name: s for s in (Pretrain(), SFT(), LoRA(), PreferenceOptimization(), Distill(),
                                                     GRPO())}


def get_stage(stage: Stage | str) -> Stage:
    """The stage itself, or the registered one of that name."""
    if isinstance(stage, Stage):
        return stage
    if stage not in STAGES:
        raise ConfigError(f"unknown stage {stage!r}; known: {', '.join(STAGES)}")
    return STAGES[stage]


__all__ = ["STAGES", "Stage", "StepBatches", "get_stage"]
