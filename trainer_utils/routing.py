"""Mixture-of-experts training: the routers' balancing losses over a whole optimizer step, the loss-free bias
update, and the per-layer load statistics the trainer logs.

The model returns what its routers did (model.model.RouterStats: per MoE layer, the tokens each expert received
and the router probabilities summed over the tokens); the losses are made here, because they are defined over
the whole step (all micro-batches, all ranks) like the language-model loss's normalisation:

    load balance  E * sum_e f_e * P_e  per layer, averaged over layers (1.0 when perfectly balanced;
                  Switch Transformer, DeepSeekMoE). f_e: the fraction of the step's (token, choice) pairs that
                  went to expert e, a constant; P_e: the mean router probability of expert e over the step's
                  tokens, the differentiable part.
    z-loss        mean over tokens of logsumexp(router logits)^2, averaged over layers (ST-MoE): keeps the
                  router logits small, so the fp32 softmax stays well conditioned.
    added loss    router_aux_loss_coef * load balance + router_z_loss_coef * z-loss

P_e and the z-loss are sums over tokens, divided by the step's token count: exact over any accumulation and
any number of ranks. f_e is a ratio; it is all-reduced over the ranks for every micro-batch, so with one
micro-batch per step (the default) it is the whole step's. With accumulation a micro-batch's backward cannot
wait for later micro-batches' routing: it uses the routing of the step's micro-batches so far (this one
included), and the last micro-batch sees the whole step. The logged value is the exact step value.
"""
from __future__ import annotations

from typing import Any

import torch

from model.config import ModelConfig
from model.model import PocketLM, RouterStats

from .backend import Backend


class RouterBalance:
    """The step's router losses, the loss-free bias update and the logging window, for one MoE model."""

    def __init__(self, cfg: ModelConfig, backend: Backend, device: torch.device) -> None:
        self.cfg, self.backend = cfg, backend
        L, E = cfg.num_hidden_layers, cfg.num_experts
        zeros = lambda *shape: torch.zeros(shape, device=device, dtype=torch.float64)  # noqa: E731
        self.step_counts = zeros(L, E)  # this step's choices per expert, all ranks, micro-batches so far
        self.step_probs, self.step_z, self.step_entropy = zeros(L, E), zeros(L), zeros(L)  # this rank's sums
        self.n_tokens = torch.ones((), device=device, dtype=torch.float64)
        # the logging window: loads (global), and per-step means of this rank's share (summed over ranks at log)
        self.window = {"counts": zeros(L, E), "balance": zeros(L), "z": zeros(L), "entropy": zeros(L), "steps": 0,
                       "tokens": zeros()}

    def start_step(self, n_tokens: torch.Tensor) -> None:
        """A new optimizer step routing n_tokens input tokens over all micro-batches and ranks."""
        self.n_tokens = n_tokens.double().clamp(min=1)
        for t in (self.step_counts, self.step_probs, self.step_z, self.step_entropy):
            t.zero_()

    def loss(self, router: RouterStats) -> torch.Tensor:
        """This micro-batch's share of the step's router loss (times the world size, like the objective's loss,
        because the backends average gradients over ranks)."""
        counts = router.counts.double()
        if self.backend.world_size > 1:
            counts = self.backend.all_reduce_sum(counts.clone())
        self.step_counts += counts
        f = self.step_counts / self.step_counts.sum(-1, keepdim=True)
        E, world = self.cfg.num_experts, self.backend.world_size
        balance = E * (f.float() * router.prob_sum).sum(-1).mean()
        z = router.z_sum.mean()
        self.step_probs += router.prob_sum.detach().double()
        self.step_z += router.z_sum.detach().double()
        self.step_entropy += router.entropy_sum.double()
        coef, z_coef = self.cfg.router_aux_loss_coef, self.cfg.router_z_loss_coef
        return (coef * balance + z_coef * z) * world / self.n_tokens.float()

    def end_step(self, model: PocketLM, applied: torch.Tensor) -> None:
        """After the optimizer step: move the routing biases (when balancing without a loss, and the step was
        applied), and add the step to the logging window."""
        rate = self.cfg.router_bias_update_rate
        if rate:
            model.update_router_bias(self.step_counts, applied.float() * rate)
        w, n = self.window, self.n_tokens
        f = self.step_counts / self.step_counts.sum(-1, keepdim=True)
        w["counts"] += self.step_counts
        w["balance"] += self.cfg.num_experts * (f * self.step_probs).sum(-1) / n
        w["z"] += self.step_z / n
        w["entropy"] += self.step_entropy / n
        w["tokens"] += self.n_tokens
        w["steps"] += 1

    def record(self) -> dict[str, Any]:
        """The window's router metrics (one collective), then a fresh window. Per layer: the fraction of choices
        each expert received, the most loaded expert's load over the mean, the router entropy (nats per token,
        ln E at uniform routing); and the step's balance and z-losses, the loss they added, the dropped tokens."""
        w = self.window
        steps = max(w["steps"], 1)
        # this rank's per-token means sum over ranks to the step's (each is divided by the step's token count)
        local = torch.stack([w["balance"], w["z"], w["entropy"]]) / steps
        balance, z, entropy = self.backend.all_reduce_sum(local).tolist()
        counts = w["counts"]
        load = counts / counts.sum(-1, keepdim=True).clamp(min=1)
        max_load = (load.max(-1).values * self.cfg.num_experts).tolist()
        # dropless dispatch: each token's k choices all reach their experts (tokens in, minus choices received)
        dropped = int(round(float((w["tokens"] * self.cfg.num_experts_per_tok - counts.sum(-1)).sum())))
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        coef, z_coef = self.cfg.router_aux_loss_coef, self.cfg.router_z_loss_coef
        record = {"aux_loss": round(coef * mean(balance) + z_coef * mean(z), 6),
                  "router_balance": round(mean(balance), 5), "router_z": round(mean(z), 4),
                  "router_max_load": round(max(max_load), 4), "router_dropped": dropped,
                  "router_load": [[round(x, 4) for x in row] for row in load.tolist()],
                  "router_max_load_layers": [round(x, 4) for x in max_load],
                  "router_entropy": [round(x, 4) for x in entropy]}
        for t in (w["counts"], w["balance"], w["z"], w["entropy"], w["tokens"]):
            t.zero_()
        w["steps"] = 0
        return record
