"""DPO: the loss and its metrics against a hand-written reference (Rafailov et al. 2023, eq. 7; cDPO label
smoothing), ln 2 when the policy is the reference."""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from model import PocketLM
from trainer_utils.objectives import DPO, sequence_log_probs

from conftest import tiny_config


def no_autocast():
    return contextlib.nullcontext()


def pairs(b: int = 3, t: int = 10, vocab: int = 256, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """2b rows (b chosen, then b rejected) with targets on their last few positions only, like DPO batches."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (2 * b, t), generator=g)
    y = torch.full((2 * b, t), -100)
    for row in range(2 * b):
        start = 4 + row % 3
        y[row, start:] = torch.randint(0, vocab, (t - start,), generator=g)
    return x, y


def test_the_first_step_loss_is_ln_2_when_the_policy_is_the_reference():
    model = PocketLM(tiny_config())
    x, y = pairs()
    reference = sequence_log_probs(model, x, y, no_autocast)
    for eps in (0.0, 0.2):
        out = DPO(beta=0.1, label_smoothing=eps)(model, (x, y, reference), no_autocast)
        assert float(out.loss.detach()) / 3 == pytest.approx(math.log(2), abs=1e-6)
        assert float(out.metrics["reward_margin"]) == 0 and float(out.metrics["reward_accuracy"]) == 0


@pytest.mark.parametrize("beta,eps", [(0.1, 0.0), (0.5, 0.0), (0.1, 0.25)])
def test_loss_metrics_and_gradient_equal_a_hand_written_reference(beta, eps):
    torch.manual_seed(0)
    policy, ref_model = PocketLM(tiny_config()), PocketLM(tiny_config())
    x, y = pairs()
    reference = sequence_log_probs(ref_model, x, y, no_autocast)
    out = DPO(beta, eps)(policy, (x, y, reference), no_autocast)
    ours = torch.autograd.grad(out.loss, list(policy.parameters()))

    logits = policy(x)

    def logp(row: int, logits_: torch.Tensor) -> torch.Tensor:  # sum of log p(target) over the row's targets
        return sum(F.log_softmax(logits_[row, t], -1)[y[row, t]] for t in range(x.shape[1]) if y[row, t] != -100)

    ref_logits = ref_model(x).detach()
    loss, acc, margins, chosen_rewards = 0.0, 0.0, 0.0, 0.0
    for i in range(3):
        pc, pr = logp(i, logits), logp(i + 3, logits)
        rc, rr = logp(i, ref_logits), logp(i + 3, ref_logits)
        margin = beta * ((pc - rc) - (pr - rr))
        loss = loss - (1 - eps) * F.logsigmoid(margin) - eps * F.logsigmoid(-margin)
        acc += float(margin > 0)
        margins += float(margin.detach())
        chosen_rewards += float(beta * (pc - rc).detach())
    torch.testing.assert_close(out.loss, loss, rtol=1e-5, atol=1e-6)
    assert float(out.metrics["reward_accuracy"]) == acc
    assert float(out.metrics["reward_margin"]) == pytest.approx(margins, abs=1e-5)
    assert float(out.metrics["reward_chosen"]) == pytest.approx(chosen_rewards, abs=1e-5)
    expected = torch.autograd.grad(loss, list(policy.parameters()))
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
