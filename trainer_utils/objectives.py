"""What a training step minimises: a micro-batch in; a summed loss, the count it is normalised by, metrics out.

The loop does not know which objective it runs. Objectives return sums, never means: the loop divides by the
count of the whole optimizer step (all micro-batches, all ranks), so accumulation and DDP give the loss of one
big batch, and a micro-batch with nothing to learn adds exactly 0.

    LanguageModeling  next-token cross-entropy over the target tokens (pretraining, SFT, LoRA); count = tokens
    Distillation      the labels' cross-entropy mixed with the KL divergence from a frozen teacher's softened
                      distribution, over the same target tokens; count = tokens
    DPO               direct preference optimisation over (chosen, rejected) pairs, against the reference
                      model's log-probabilities computed once before training; count = pairs
    PolicyGradient    GRPO's clipped surrogate or CISPO's clipped importance weight over sampled completions,
                      with their advantages, and an optional KL to a frozen reference; count = completion tokens
Frozen helpers (the teacher, the reference log-probabilities) belong to the objective; the loop never sees them.
A mixture-of-experts model's routers report beside the logits (StepOutput.router); the loop adds their balancing
losses (trainer_utils/routing.py), whatever the objective.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from common.tokens import IGNORE_INDEX
from model.model import RouterStats

Batch = tuple[torch.Tensor, ...]  # (inputs, targets, ...) as the dataset's batch() returns it
Autocast = Callable[[], contextlib.AbstractContextManager]


@dataclass
class StepOutput:
    """A micro-batch's summed loss, and metrics summed over the same units (the loop averages them per unit);
    for a mixture-of-experts model, what its routers did."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    router: RouterStats | None = None


def trained_forward(forward: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, RouterStats | None]:
    """The logits of the model being trained, and its routers' statistics (None for a dense model)."""
    return forward(x, return_router=True)


class Objective:
    """Turns micro-batches into losses. `unit` names what count() counts (the loss is per unit)."""

    unit = "tokens"
    eval_metrics: tuple[str, ...] = ()  # what evaluate() reports beside the loss, summed per unit

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
    # over (tokens, vocab) rows: the class dimension contiguous, as the kernel is fastest with it
    logp = -F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                            reduction="none")
    return logp.view(targets.shape)  # ignored targets come back as 0


def target_bytes(targets: torch.Tensor, token_bytes: torch.Tensor) -> torch.Tensor:
    """The UTF-8 bytes the target tokens stand for, summed (token_bytes: bytes per token id, on targets' device);
    a masked sum, not indexing by the mask: no host sync."""
    valid = targets != IGNORE_INDEX
    return torch.where(valid, token_bytes[targets.clamp(min=0)], 0).sum()


class LanguageModeling(Objective):
    """Next-token cross-entropy, summed over the target tokens."""

    def count(self, batch: Batch) -> torch.Tensor:
        return (batch[1] != IGNORE_INDEX).sum()

    def __call__(self, forward: torch.nn.Module, batch: Batch, autocast: Autocast) -> StepOutput:
        x, y = batch[0], batch[1]
        with autocast():
            logits, router = trained_forward(forward, x)
        # reduction="sum": a micro-batch without targets adds exactly 0 (a mean would be 0/0 = NaN)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        return StepOutput(loss, router=router)


class Distillation(Objective):
    """alpha * CE(student, labels) + (1 - alpha) * T^2 * KL(softmax(teacher / T) || softmax(student / T)), summed
    over the target tokens (Hinton et al. 2015; T^2 keeps the soft term's gradients at the scale of the hard one's).

    The teacher runs in eval mode without gradients, under the same autocast, on the same batch. Validation
    scores the student alone (its cross-entropy on the labels), so held-out losses compare with and without a
    teacher; the KL is reported beside it.
    """

    eval_metrics = ("kl",)

    def __init__(self, teacher: torch.nn.Module, alpha: float, temperature: float) -> None:
        self.teacher = teacher.eval().requires_grad_(False)
        self.alpha, self.temperature = alpha, temperature

    def count(self, batch: Batch) -> torch.Tensor:
        return (batch[1] != IGNORE_INDEX).sum()

    def parts(self, forward: torch.nn.Module, batch: Batch, autocast: Autocast
              ) -> tuple[torch.Tensor, torch.Tensor, RouterStats | None]:
        """(summed cross-entropy on the labels, summed KL from the teacher, the student's routers) over the
        target tokens."""
        x, y = batch[0], batch[1]
        with autocast():
            logits, router = trained_forward(forward, x)
            with torch.no_grad():
                teacher_logits = self.teacher(x)
        ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        t = self.temperature
        log_student = F.log_softmax(logits.float() / t, dim=-1)
        log_teacher = F.log_softmax(teacher_logits.float() / t, dim=-1)
        kl_per_token = (log_teacher.exp() * (log_teacher - log_student)).sum(-1)
        # a product with the mask, not indexing by it: no host sync to count the targets
        kl = (kl_per_token * (y != IGNORE_INDEX)).sum()
        return ce, kl, router

    def __call__(self, forward: torch.nn.Module, batch: Batch, autocast: Autocast) -> StepOutput:
        ce, kl, router = self.parts(forward, batch, autocast)
        loss = self.alpha * ce + (1 - self.alpha) * self.temperature ** 2 * kl
        return StepOutput(loss, {"ce": ce.detach(), "kl": kl.detach()}, router)

    def evaluate(self, model: torch.nn.Module, batch: Batch, autocast: Autocast) -> StepOutput:
        ce, kl, _ = self.parts(model, batch, autocast)
        return StepOutput(ce, {"kl": kl})


class DPO(Objective):
    """Direct preference optimisation (Rafailov et al. 2023, eq. 7), with conservative label smoothing (cDPO):

        margin = beta * ((log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected)))
        loss   = -(1 - eps) * log sigmoid(margin) - eps * log sigmoid(-margin)          per pair

    A batch is (inputs, targets, reference): the B chosen sequences, then the B rejected ones of the same pairs,
    with targets only on each final answer, and the reference model's summed log-probability of each row's
    targets. Rewards are beta * (log pi - log ref); the logged metrics average them per pair.
    """

    unit = "pairs"
    eval_metrics = ("reward_accuracy", "reward_margin", "reward_chosen", "reward_rejected")

    def __init__(self, beta: float, label_smoothing: float = 0.0) -> None:
        self.beta, self.label_smoothing = beta, label_smoothing

    def count(self, batch: Batch) -> torch.Tensor:
        return torch.tensor(batch[0].shape[0] // 2, device=batch[0].device)

    def __call__(self, forward: torch.nn.Module, batch: Batch, autocast: Autocast) -> StepOutput:
        x, y, reference = batch[0], batch[1], batch[2]
        with autocast():
            logits, router = trained_forward(forward, x)
        policy = token_log_probs(logits, y).sum(-1)  # (2B,): each row's answer
        b = x.shape[0] // 2
        chosen = self.beta * (policy[:b] - reference[:b].float())
        rejected = self.beta * (policy[b:] - reference[b:].float())
        margin = chosen - rejected
        eps = self.label_smoothing
        loss = -(1 - eps) * F.logsigmoid(margin) - eps * F.logsigmoid(-margin)
        metrics = {"reward_accuracy": (margin > 0).float().sum(), "reward_margin": margin.sum(),
                   "reward_chosen": chosen.sum(), "reward_rejected": rejected.sum(),
                   "logp_chosen": policy[:b].sum(), "logp_rejected": policy[b:].sum()}
        return StepOutput(loss.sum(), {k: v.detach() for k, v in metrics.items()}, router)


POLICY_LOSSES = ("grpo", "cispo")
# Sampled batches differ in shape at every step. On a CPU in bf16, oneDNN caches a primitive (with its memory)
# per matrix-product shape, up to 1,024 of them: a GRPO run's memory grew by 3 GB over 500 steps of the demo
# model (fp32, which does not go through oneDNN, stayed flat). Rows padded to a multiple of SHAPE_STEP tokens and
# the vocabulary projection to a multiple of VOCAB_ROWS_STEP rows leave a few shapes that recur.
SHAPE_STEP, VOCAB_ROWS_STEP = 16, 64


def padded_selection(valid: torch.Tensor, step: int) -> torch.Tensor:
    """`valid` (a bool mask) with the first ignored positions added, so that it selects a multiple of `step`
    positions (all of them at most)."""
    flat = valid.flatten()
    chosen = int(flat.sum())
    extra = min((-chosen) % step, flat.numel() - chosen)
    free = ~flat
    return (flat | (free & (free.cumsum(0) <= extra))).view_as(valid)


def completion_logits(model: torch.nn.Module, x: torch.Tensor, valid: torch.Tensor, autocast: Autocast,
                      positions: torch.Tensor | None = None, attention: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, RouterStats | None]:
    """The logits where `valid` (n, vocab, row-major) and the routers' statistics: the vocabulary projection
    runs at those positions only, padded to a multiple of VOCAB_ROWS_STEP rows. positions and a 4-D attention
    mask: rows packed as trainer_utils/rollouts.py packs them (plain causal rows without)."""
    projected = padded_selection(valid, VOCAB_ROWS_STEP)
    with autocast():
        logits, router = model(x, position_ids=positions, attention_mask=attention, return_router=True,
                               logits_at=projected)
    return logits[valid[projected]], router


class PolicyGradient(Objective):
    """The policy loss of reinforcement learning on sampled completions (trainer_utils/rewards.py makes the
    advantages), summed over the completion tokens, so that the loop's normalisation by the step's completion
    tokens is the token-level normalisation across each group (DAPO, Dr. GRPO):

        ratio = pi(token) / pi_old(token)            pi_old: the policy that sampled the completion
        grpo:   -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A)          (PPO's surrogate)
        cispo:  -sg(min(ratio, 1 + epsilon_high)) * A * log pi(token)                     (MiniMax-M1)
        + beta * (exp(r) - r - 1), r = log ref(token) - log pi(token)                    (KL, the k3 estimator)

    GRPO's clip drops the gradient of a token whose ratio left the trust region in the advantage's direction;
    CISPO clips only the weight, so every token keeps a gradient. A batch is (inputs, targets, old log-probs,
    advantages, positions, attention[, reference log-probs]), rows packed as trainer_utils/rollouts.py packs
    them (a group's prompt, then its completions; positions and the 4-D attention mask say which is which):
    targets are IGNORE_INDEX except at the completions' tokens, the log-probs and each token's advantage (its
    completion's) per target position (B, T). The policy is softmax(logits / temperature), the distribution the
    completions were sampled from. Logged per token: the clipped share, the ratio, the KL (with a reference) and
    the policy's entropy.
    """

    def __init__(self, loss_type: str = "grpo", epsilon: float = 0.2, epsilon_high: float = 0.2,
                 beta: float = 0.0, temperature: float = 1.0) -> None:
        if loss_type not in POLICY_LOSSES:
            raise ValueError(f"loss_type must be one of {POLICY_LOSSES}, got {loss_type!r}")
        self.loss_type, self.epsilon, self.epsilon_high, self.beta = loss_type, epsilon, epsilon_high, beta
        self.temperature = temperature

    def count(self, batch: Batch) -> torch.Tensor:
        return (batch[1] != IGNORE_INDEX).sum()

    def __call__(self, forward: torch.nn.Module, batch: Batch, autocast: Autocast) -> StepOutput:
        x, y = batch[0], batch[1]
        valid = y != IGNORE_INDEX
        logits, router = completion_logits(forward, x, valid, autocast, batch[4], batch[5])
        # every per-token quantity below is over the (n,) completion tokens, in row-major order
        targets, old, advantage = y[valid], batch[2].float()[valid], batch[3].float()[valid]
        # one log-softmax serves the targets' log-probs and the logged entropy
        logprobs = F.log_softmax(logits.float() / self.temperature, dim=-1)
        logp = logprobs.gather(-1, targets[:, None])[:, 0]
        ratio = torch.exp(logp - old)
        high = 1 + self.epsilon_high
        if self.loss_type == "grpo":
            clipped = torch.clamp(ratio, 1 - self.epsilon, high) * advantage
            per_token = -torch.minimum(ratio * advantage, clipped)
            was_clipped = clipped < ratio * advantage
        else:
            per_token = -torch.clamp(ratio, max=high).detach() * advantage * logp
            was_clipped = ratio > high
        metrics = {"clip_frac": was_clipped.float().sum(), "ratio": ratio.sum()}
        if self.beta > 0:
            r = batch[6].float()[valid] - logp
            kl = torch.exp(r) - r - 1
            per_token = per_token + self.beta * kl
            metrics["kl"] = kl.sum()
        with torch.no_grad():
            metrics["entropy"] = -(logprobs.exp() * logprobs).sum()
        return StepOutput(per_token.sum(), {k: v.detach() for k, v in metrics.items()}, router)


@torch.no_grad()
def sequence_log_probs(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, autocast: Autocast) -> torch.Tensor:
    """Each row's summed log-probability of its targets: what DPO's reference contributes, computed once."""
    with autocast():
        logits = model(x)
    return token_log_probs(logits, y).sum(-1)
