"""Execution backends behind one small interface, so the training loop never changes when scaling out.

The loop only calls: wrap(), no_sync(), backward(), step(), all_reduce_sum(), barrier(), close(), plus
save_extra()/load_extra() for backends that keep their own checkpoint files. SingleBackend is one process on
one device; distributed backends subclass it and override what differs.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from .runtime import Precision


class Backend:
    """Interface the loop is written against. Rank 0 (`is_main`) logs and writes checkpoints."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device
    precision: Precision

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        raise NotImplementedError

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Context for accumulation micro-steps whose gradients need no cross-rank reduction yet."""
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float) -> tuple[float, bool]:
        """Clip, check, and apply the accumulated gradients; return (grad_norm, applied)."""
        raise NotImplementedError

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass

    @property
    def owns_optimizer_state(self) -> bool:
        """True when the backend saves the optimizer itself (collectively, via save_extra)."""
        return False

    def save_extra(self, checkpoint_dir: Path) -> None:
        """Write backend-owned state (e.g. sharded optimizer) into a checkpoint being assembled; all ranks."""

    def load_extra(self, checkpoint_dir: Path) -> None:
        """Restore backend-owned state from a checkpoint."""

    def state_dict_extra(self) -> dict[str, Any]:
        """Small backend state stored in training_state.pt (the fp16 loss scaler)."""
        return {"scaler": self.precision.scaler.state_dict()}

    def load_state_dict_extra(self, state: dict[str, Any]) -> None:
        if state.get("scaler"):
            self.precision.scaler.load_state_dict(state["scaler"])


class SingleBackend(Backend):
    """One process, one device: plain autograd with optional fp16 loss scaling."""

    def __init__(self, device: torch.device, precision: Precision) -> None:
        self.device, self.precision = device, precision

    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        return model

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.scaler.scale(loss).backward()

    def step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float) -> tuple[float, bool]:
        scaler = self.precision.scaler
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        params = [p for group in optimizer.param_groups for p in group["params"]]
        max_norm = grad_clip if grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        norm_value = float(norm)  # one host sync per optimizer step: needed to decide whether to skip
        finite = norm_value == norm_value and norm_value != float("inf")
        if scaler.is_enabled():
            # The scaler skips the update itself on inf/nan and lowers its scale; that is loss-scale
            # calibration, not a broken step.
            scale_before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            applied = scaler.get_scale() >= scale_before
        elif finite:
            optimizer.step()
            applied = True
        else:
            applied = False
        optimizer.zero_grad(set_to_none=True)
        return norm_value, applied

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

