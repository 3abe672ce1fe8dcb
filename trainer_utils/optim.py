"""Optimizer construction (decay / no-decay groups; Muon for hidden matrices) and the warmup + cosine schedule."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterable

import torch

from common.device import precision_policy
from common.errors import ConfigError

from .muon import Muon

if TYPE_CHECKING:
    from .config import OptimConfig

OPTIMIZERS = ("adamw", "muon", "sgd")


def is_embedding(name: str) -> bool:
    """Token / position tables: looked up, not multiplied, so neither decayed nor orthogonalised. A tied lm_head
    is listed once, under the embedding's name."""
    return name.endswith(("embed_tokens.weight", "embed_positions.weight"))


def param_groups(named: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only: never on norms, biases or embeddings (decaying embeddings of rare tokens
    toward zero only hurts). named_parameters() lists a tied lm_head once, as the embedding."""
    decay, no_decay = [], []
    for name, p in named:
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and not is_embedding(name) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """What Muon orthogonalises: the 2-D weights of the blocks' linear maps. Not the embeddings and the output
    head (an input lookup and a classifier, whose rows are per-token), not a MoE router (E rows) nor the 3-D
    expert stacks (torch's Muon takes matrices only): those stay on AdamW, as Muon's authors prescribe."""
    return p.ndim == 2 and not is_embedding(name) and not name.endswith(("lm_head.weight", "mlp.gate.weight"))


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon (trainer_utils/muon.py) on the hidden matrices and AdamW on everything else, as one optimizer.

    One object keeps the training loop unchanged: one param_groups list (clipping, GradScaler.unscale_ and the
    schedule see every parameter), one state dict (exact resume). The two inner optimizers work on the very
    same group dicts and share one state mapping; each group is tagged with the optimizer that owns it.

    Muon's update is an orthogonalised momentum: every direction of a matrix moves by the same amount, whatever
    the gradient's scale. adjust_lr_fn="match_rms_adamw" (Moonlight) scales it to the RMS an AdamW update has,
    so Muon's learning rate and weight decay mean what AdamW's do.
    """

    def __init__(self, muon_groups: list[dict[str, Any]], adamw_groups: list[dict[str, Any]], *,
                 momentum: float, betas: tuple[float, float], eps: float, fused: bool,
                 ns_dtype: torch.dtype) -> None:
        self.muon = Muon(muon_groups, momentum=momentum, nesterov=True, adjust_lr_fn="match_rms_adamw",
                         ns_dtype=ns_dtype)
        self.adamw = torch.optim.AdamW(adamw_groups, betas=betas, eps=eps, fused=fused)
        for owner, inner in (("muon", self.muon), ("adamw", self.adamw)):
            for group in inner.param_groups:
                group["owner"] = owner
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], defaults={})
        self._link()

    def _link(self) -> None:
        """Point both inner optimizers at this optimizer's groups and state (again after load_state_dict, which
        replaces both)."""
        for owner, inner in (("muon", self.muon), ("adamw", self.adamw)):
            inner.param_groups = [g for g in self.param_groups if g["owner"] == owner]
            inner.state = self.state

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # noqa: D102 - both inner optimizers, each on its groups
        if closure is not None:
            raise ValueError("MuonWithAdamW.step takes no closure")
        self.muon.step()
        self.adamw.step()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()


def newton_schulz_steps(optimizer: torch.optim.Optimizer) -> int | None:
    """The Newton-Schulz iterations the optimizer's Muon groups run (the count they were built or restored with);
    None for an optimizer without Muon."""
    return next((g["ns_steps"] for g in optimizer.param_groups if g.get("owner") == "muon"), None)


def build_optimizer(model: torch.nn.Module, name: str, lr: float, weight_decay: float, betas: tuple[float, float],
                    momentum: float, device: torch.device, eps: float = 1e-8, muon_lr: float | None = None,
                    muon_momentum: float = 0.95, muon_ns_steps: int | None = None,
                    muon_width_scale: float = 1.0) -> torch.optim.Optimizer:
    """AdamW, SGD or Muon+AdamW over `model`'s trainable parameters, weight decay on matrices only.

    Every group may carry an "lr_scale": its learning rate relative to the schedule's (WarmupCosine applies it),
    which is how Muon's matrices get their own learning rate under one schedule: `muon_lr` (default `lr`) times
    `muon_width_scale` (--muon_base_width / the model's width). Muon's Newton-Schulz iteration
    runs in the device's fast precision (common/device.py: bf16 where native, else fp32 or fp16).
    """
    # The fused AdamW kernel updates all parameters in one pass (3.5x faster than the default on CPU, one launch
    # on GPU) and can skip a step on a device-side flag, so non-finite steps need no host sync.
    fused = device.type in ("cuda", "cpu")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW(param_groups(named, weight_decay), lr=lr, betas=betas, eps=eps, fused=fused)
    if name == "sgd":
        # Not fused: torch's fused SGD leaves the momentum buffer uninitialised when its first step is skipped.
        return torch.optim.SGD(param_groups(named, weight_decay), lr=lr, momentum=momentum, nesterov=momentum > 0)
    if name == "muon":
        hidden = [p for n, p in named if is_hidden_matrix(n, p)]
        if not hidden:
            raise ConfigError("--optimizer muon found no hidden weight matrix to train (use adamw)")
        # the rest on AdamW, decayed as usual: MoE expert stacks, routers and an untied head decay, the others not
        rest = param_groups(((n, p) for n, p in named if not is_hidden_matrix(n, p)), weight_decay)
        scale = (muon_lr if muon_lr is not None else lr) / lr * muon_width_scale
        policy = precision_policy(device)
        muon_groups = [{"params": hidden, "lr": lr * scale, "lr_scale": scale, "weight_decay": weight_decay,
                        "ns_steps": muon_ns_steps or policy.newton_schulz_steps}]
        adamw_groups = [{**group, "lr": lr} for group in rest if group["params"]]
        return MuonWithAdamW(muon_groups, adamw_groups, momentum=muon_momentum, betas=betas, eps=eps, fused=fused,
                             ns_dtype=policy.optimizer)
    raise ValueError(f"unknown optimizer {name!r}; expected one of {OPTIMIZERS}")


def optimizer_for(model: torch.nn.Module, o: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """build_optimizer with a run's optimization settings (--optimizer, its learning rates and hyperparameters)."""
    # --muon_base_width: Muon's rate is for that width, and a model of another width takes it in inverse proportion
    width_scale = 1.0 if o.muon_base_width is None else o.muon_base_width / model.config.hidden_size
    return build_optimizer(model, o.optimizer, o.learning_rate, o.weight_decay, (o.beta1, o.beta2), o.momentum,
                           device, o.adam_eps, o.muon_lr, o.muon_momentum, o.muon_ns_steps, width_scale)


class WarmupCosine:
    """Linear warmup from 0 to max_lr over `warmup` steps, then cosine decay to min_lr at `total` steps.

    A group with an "lr_scale" gets that multiple of the schedule (Muon's matrices). The optimizer step count
    is the only state, so resuming restores the schedule exactly.

    end_at(step, end) (a --time_budget run whose machine ran slower or faster than measured, trainer_utils/
    budget.py) lays the rest of the schedule, from `step` on, over the steps up to `end` instead: the learning
    rate stays continuous and still reaches min_lr at the new last step. The re-plans are the budget plan's, which
    the checkpoint keeps; the Trainer applies them again on resume. set_total(total) makes it the schedule of
    `total` steps exactly, while only warm-up steps have been taken (a budget planned on the run's first steps).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, max_lr: float, min_lr: float, warmup: int,
                 total: int) -> None:
        self.optimizer, self.max_lr, self.min_lr = optimizer, max_lr, min_lr
        self.warmup, self.total = warmup, max(total, 1)
        self.end = self.total  # the step the schedule ends at (total, until a re-plan)
        # (from step, the schedule's position there, positions per step): one segment until a re-plan
        self.segments: list[tuple[int, float, float]] = [(0, 0.0, 1.0)]
        self.step_count = 0
        self._apply()

    def position(self, step: int) -> float:
        """Where optimizer step `step` is on the schedule of `total` steps (the step itself, until a re-plan)."""
        start, at, rate = next(seg for seg in reversed(self.segments) if seg[0] <= step)
        return at + (step - start) * rate

    def set_total(self, total: int) -> None:
        """Make this the schedule of `total` steps, exactly (a time budget planned on the run's first steps,
        components/first_steps.py): only while every step taken was a warm-up step, whose learning rate is the
        same for any total, and before any end_at()."""
        if self.step_count > self.warmup or len(self.segments) > 1:
            raise ValueError(f"set_total({total}) after step {self.step_count} of a {self.warmup}-step warm-up "
                             "or a re-plan: the steps taken would not be the new schedule's")
        self.total = self.end = max(total, 1)
        self._apply()

    def end_at(self, step: int, end: int) -> None:
        """From optimizer step `step` on, finish the schedule at `end` (ending at `step` itself stops it there)."""
        if end > step:
            at = self.position(step)
            self.segments.append((step, at, (self.total - at) / (end - step)))
        self.end = end

    def lr_at(self, step: int) -> float:
        """Learning rate used for optimizer step number `step` (0-based)."""
        x = self.position(step)
        if x < self.warmup:
            return self.max_lr * (x + 1) / self.warmup
        progress = min(1.0, (x - self.warmup) / max(1, self.total - self.warmup))
        return self.min_lr + 0.5 * (self.max_lr - self.min_lr) * (1 + math.cos(math.pi * progress))

    def _apply(self) -> None:
        lr = self.lr_at(self.step_count)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)

    @property
    def lr(self) -> float:
        """The schedule's current learning rate (groups with an lr_scale use a multiple of it)."""
        return self.lr_at(self.step_count)

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        return {"step_count": self.step_count, "max_lr": self.max_lr, "min_lr": self.min_lr,
                "warmup": self.warmup, "total": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count = state["step_count"]
        self._apply()
