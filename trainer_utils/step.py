"""A training step's forward and backward, as the loop takes it and as `--plan` times it: one definition of what a
step computes, so the planner's step times are the loop's.

    step = Step(model, wrapped, objective, backend, router)   wrapped: what the backend returned (DDP, an engine)
    loss_sum = step.backward(micro, n_valid)                   then backend.step(): clip, update, clear

Gradients are of sum(unit losses) / n_valid, where n_valid counts the valid targets of the whole step (every
micro-batch, every rank): each micro-batch's loss is a sum, so a step's gradient does not depend on how it is cut
into micro-batches or ranks. A mixture of experts adds its routers' losses (trainer_utils/routing.py), normalised
over the step's input tokens (RouterBalance.start_step), logged apart from the loss.
"""
from __future__ import annotations

import contextlib

import torch

from .backend import Backend
from .objectives import Batch, Objective
from .routing import RouterBalance


class Step:
    """Forward and backward over one optimizer step's micro-batches; the objective's metrics of the last call,
    summed over its micro-batches, are left in `metrics`."""

    def __init__(self, model: torch.nn.Module, wrapped: torch.nn.Module, objective: Objective, backend: Backend,
                 router: RouterBalance | None = None, compile: bool = False) -> None:
        self.wrapped, self.objective, self.backend, self.router = wrapped, objective, backend, router
        self.device, self.precision = backend.device, backend.precision
        # the parameter through which an empty step's gradients are made NaN (see backward)
        self.empty_step_anchor = min((p for p in model.parameters() if p.requires_grad), key=torch.numel)
        # compiled after wrapping, as PyTorch recommends: dynamo then splits the graph at DDP's bucket boundaries,
        # so gradient all-reduces overlap the backward (a compiled module inside DDP reduces only at the end)
        self.forward_model = torch.compile(wrapped) if compile else wrapped
        self.metrics: dict[str, torch.Tensor] = {}

    def backward(self, micro: list[Batch], n_valid: torch.Tensor) -> torch.Tensor:
        """Forward and backward every micro-batch (the backend synchronises ranks on the last); returns the
        summed loss.

        A step with no target anywhere (n_valid == 0) has nothing to learn from, yet an optimizer step would still
        apply weight decay and momentum. Its gradients are made NaN instead (through the smallest trainable
        parameter: free when the step is not empty), so every backend skips it like any other non-finite step,
        with no host sync to decide.
        """
        loss_sum = torch.zeros((), device=self.device)
        self.metrics = {}
        scale = self.backend.world_size / n_valid.clamp(min=1)  # backends average over ranks; * world: / n_valid
        poison = torch.where(n_valid > 0, 0.0, float("nan"))
        for i, batch in enumerate(micro):
            last = i == len(micro) - 1
            with contextlib.nullcontext() if last else self.backend.no_sync(self.wrapped):
                out = self.objective(self.forward_model, batch, self.precision.autocast)
                loss = out.loss * scale + (poison * self.empty_step_anchor.sum() if last else 0.0)
                if out.router is not None:
                    loss = loss + self.router.loss(out.router)
                self.backend.backward(loss)
            loss_sum += out.loss.detach()
            for k, v in out.metrics.items():
                self.metrics[k] = self.metrics.get(k, 0.0) + v.detach().double()
        return loss_sum
