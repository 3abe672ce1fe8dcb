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

    def step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float,
             skip: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip, check and apply the accumulated gradients unless they are non-finite (or `skip` is true).

        Returns (grad_norm, applied) as device tensors, so the loop needs no host sync per step.
        """
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

    def step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float,
             skip: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        scaler = self.precision.scaler
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
        if scaler.is_enabled():
            # fp16: the scaler skips non-finite steps itself (and lowers its scale); read its verdict on device.
            scaler.step(optimizer)
            found = sum(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
            scaler.update()
            applied = found == 0
        else:
            bad = ~torch.isfinite(norm)
            if skip is not None:
                bad = bad | skip
            if optimizer.defaults.get("fused"):
                # Fused optimizers skip on a device-side flag (the mechanism GradScaler uses): no host sync.
                optimizer.grad_scale, optimizer.found_inf = None, bad.float()
                optimizer.step()
                del optimizer.grad_scale, optimizer.found_inf
            elif not bool(bad):  # other optimizers: one host sync to decide
                optimizer.step()
            applied = ~bad
        optimizer.zero_grad(set_to_none=True)
        return norm.detach(), applied

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

