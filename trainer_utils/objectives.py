"""What a training step minimises: a micro-batch in; a summed loss, the count it is normalised by, metrics out.

The loop does not know which objective it runs. Objectives return sums, never means: the loop divides by the
count of the whole optimizer step (all micro-batches, all ranks), so accumulation and DDP give the loss of one
big batch, and a micro-batch with nothing to learn adds exactly 0.

    LanguageModeling  next-token cross-entropy over the target tokens (pretraining, SFT, LoRA); count = tokens
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from dataset.tokenizer import IGNORE_INDEX

Batch = tuple[torch.Tensor, ...]  # (inputs, targets, ...) as the dataset's batch() returns it
Autocast = Callable[[], contextlib.AbstractContextManager]


@dataclass
class StepOutput:
    """A micro-batch's summed loss, and metrics summed over the same units (the loop averages them per unit)."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


class Objective:
    """Turns micro-batches into losses. `unit` names what count() counts (the loss is per unit)."""

    unit = "tokens"

    def count(self, batch: Batch) -> torch.Tensor:
        """How many units the micro-batch holds (its loss is normalised by the step's total)."""
        raise NotImplementedError

    def __call__(self, forward: torch.nn.Module, batch: Batch, autocast: Autocast) -> StepOutput:
        """The summed training loss of a micro-batch (differentiable through `forward`)."""
        raise NotImplementedError

    def evaluate(self, model: torch.nn.Module, batch: Batch, autocast: Autocast) -> StepOutput:
        """The summed validation loss of a batch (no gradients are taken); the training loss by default."""
        return self(model, batch, autocast)


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) at every position, in fp32; 0 where the target is ignored."""
    logp = -F.cross_entropy(logits.float().transpose(1, 2), targets.clamp(min=0), reduction="none")
    return logp.masked_fill(targets == IGNORE_INDEX, 0.0)


class LanguageModeling(Objective):
    """Next-token cross-entropy, summed over the target tokens."""

    def count(self, batch: Batch) -> torch.Tensor:
        return (batch[1] != IGNORE_INDEX).sum()

    def __call__(self, forward: torch.nn.Module, batch: Batch, autocast: Autocast) -> StepOutput:
        x, y = batch[0], batch[1]
        with autocast():
            logits = forward(x)
        # reduction="sum": a micro-batch without targets adds exactly 0 (a mean would be 0/0 = NaN)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        return StepOutput(loss)
