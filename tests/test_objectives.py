"""What every objective (trainer_utils/objectives.py) shares, and the parts of the losses no other file pins, against
numbers worked out by hand: the language-modelling loss is a sum over the target tokens, the bytes the targets stand
for, the routers' statistics passed on by every objective (the loop's balancing losses read them), and DPO's count,
default and reported rewards. The losses themselves: tests/test_rl.py (GRPO, CISPO), tests/test_dpo.py,
tests/test_distillation.py."""
from __future__ import annotations

import contextlib
import math

import pytest
import torch

from trainer_utils.objectives import DPO, Distillation, LanguageModeling, PolicyGradient, target_bytes

IGNORED = -100


class Fixed(torch.nn.Module):
    """A model whose logits are a parameter (B, T, V), reporting `router` beside them when asked."""

    def __init__(self, logits: torch.Tensor, router: object = None) -> None:
        super().__init__()
        self.logits, self.router = torch.nn.Parameter(logits), router

    def forward(self, x, position_ids=None, attention_mask=None, return_router=False, logits_at=None):
        logits = self.logits if logits_at is None else self.logits[logits_at]
        return (logits, self.router) if return_router else logits


def targets() -> torch.Tensor:
    """Two rows of four positions: 3 targets, then 2 (the rest ignored)."""
    return torch.tensor([[IGNORED, 1, 2, 3], [IGNORED, IGNORED, 4, 0]])


def test_language_modelling_sums_the_cross_entropy_of_the_target_tokens():
    """Uniform logits over 8 tokens: every target costs ln 8, the ignored positions nothing."""
    y = targets()
    out = LanguageModeling()(Fixed(torch.zeros(2, 4, 8)), (torch.zeros_like(y), y), contextlib.nullcontext)
    assert out.loss.item() == pytest.approx(5 * math.log(8))
    assert LanguageModeling().count((torch.zeros_like(y), y)).item() == 5


def test_the_bytes_of_the_targets_leave_out_ignored_positions():
    token_bytes = torch.tensor([1, 2, 3, 4, 5])  # token 0 is one byte, token 1 two, ...
    assert target_bytes(targets(), token_bytes).item() == 2 + 3 + 4 + 5 + 1


@pytest.mark.parametrize("objective", ["language modelling", "distillation", "dpo", "grpo"])
def test_every_objective_passes_the_routers_statistics_on(objective):
    """A mixture-of-experts model's router statistics reach the loop beside the loss, whatever the objective (the
    loop adds the balancing losses from them)."""
    router = object()
    model, y = Fixed(torch.zeros(2, 4, 8), router), targets()
    x = torch.zeros_like(y)
    made = {"language modelling": lambda: (LanguageModeling(), (x, y)),
            "distillation": lambda: (Distillation(Fixed(torch.zeros(2, 4, 8)), 0.5, 1.0), (x, y)),
            "dpo": lambda: (DPO(0.1), (x, y, torch.zeros(2))),
            "grpo": lambda: (PolicyGradient(), (x, y, torch.zeros(2, 4), torch.ones(2, 4), None, None))}
    loss, batch = made[objective]()
    assert loss(model, batch, contextlib.nullcontext).router is router


def test_dpo_counts_pairs_smooths_nothing_by_default_and_reports_each_sides_reward():
    """Logits uniform over 2 tokens: the chosen answer's 2 targets have log p = 2 ln 1/2, the rejected one's single
    target ln 1/2; against reference log-probabilities -2 and -0.5, with beta 0.5."""
    y = torch.tensor([[IGNORED, 1, 0], [IGNORED, IGNORED, 1]])  # the chosen row, then the rejected one
    logp_chosen, logp_rejected = 2 * math.log(0.5), math.log(0.5)
    chosen, rejected = 0.5 * (logp_chosen + 2.0), 0.5 * (logp_rejected + 0.5)
    out = DPO(0.5)(Fixed(torch.zeros(2, 3, 2)), (torch.zeros_like(y), y, torch.tensor([-2.0, -0.5])),
                   contextlib.nullcontext)
    assert out.loss.item() == pytest.approx(math.log1p(math.exp(-(chosen - rejected))))  # -log sigmoid(margin)
    expected = {"reward_accuracy": 1.0, "reward_margin": chosen - rejected, "reward_chosen": chosen,
                "reward_rejected": rejected, "logp_chosen": logp_chosen, "logp_rejected": logp_rejected}
    assert {k: v.item() for k, v in out.metrics.items()} == pytest.approx(expected)
    six_rows = torch.zeros(6, 5, dtype=torch.long)
    count = DPO(0.5).count((six_rows, six_rows))
    assert (count.item(), count.dtype) == (3, torch.long)  # pairs, a whole number as every objective's count is
    assert DPO(0.5).count((six_rows.to("meta"), six_rows.to("meta"))).device.type == "meta"  # on the batch's device
