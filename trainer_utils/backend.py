"""Execution backends behind one small interface, so the training loop never changes when scaling out.

A backend is composed of a communicator (`Comm`: who the other ranks are, and the collectives) and a way of
turning losses into weight updates. The loop calls only:

    wrap(model, build_optimizer) -> (module to run forward, optimizer)     no_sync(model): accumulation
    backward(loss)                                          step() -> (grad_norm, applied) as device tensors
    save_state(dir) -> small state for training_state.pt    restore_state(dir, state)
    all_reduce_sum(t)   slowest(seconds)   barrier()   close()   rank, world_size, is_main, device, precision
    set_precision(p) when can_switch_precision              (precision fallback, before a re-wrap)

TorchBackend (here) is plain autograd, one process or DDP; DeepSpeedBackend (distributed.py) drives a ZeRO
engine. A step whose gradients are not finite is never applied, by any backend.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable

import torch

from common.errors import CheckpointError

from .runtime import Precision

OptimizerFactory = Callable[[torch.nn.Module], torch.optim.Optimizer]  # the optimizer over a model's parameters


class Comm:
    """A world of one process: every collective is the identity."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


class Backend:
    """What the loop is written against. Rank 0 (`is_main`) logs and completes checkpoints."""

    name: str  # "single" | "ddp" | "deepspeed", as train_config.json reports it

    def __init__(self, comm: Comm, device: torch.device, precision: Precision) -> None:
        self.comm, self.device, self.precision = comm, device, precision

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def is_main(self) -> bool:
        return self.comm.rank == 0

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce_sum(tensor)

    def slowest(self, seconds: list[float]) -> list[float]:
        """Each of `seconds` as the slowest rank measured it, the same on every rank: ranks wait for each other at
        the next collective, so what one rank spends alone (rank 0's samples, its checkpoint) every rank pays.
        One all-reduce of a table with a row per rank, each rank filling its own."""
        table = torch.zeros(self.world_size, len(seconds), device=self.device, dtype=torch.float64)
        table[self.rank] = torch.tensor(seconds, dtype=torch.float64)
        return self.all_reduce_sum(table).amax(0).tolist()

    # Whether set_precision works mid-run (a DeepSpeed engine fixes its precision when it is built).
    can_switch_precision: bool = True

    def set_precision(self, precision: Precision) -> None:
        """Train in another precision from now on (a precision fallback; the model is re-wrapped after)."""
        self.precision = precision

    def barrier(self) -> None:
        self.comm.barrier()

    def close(self) -> None:
        self.comm.close()

    def wrap(self, model: torch.nn.Module, build_optimizer: OptimizerFactory
             ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Wrap the model for this backend, then build the optimizer over what it trains (a sharded backend
        would shard first); return the module the loop runs forward and the optimizer, which it owns."""
        raise NotImplementedError

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Context for accumulation micro-steps whose gradients need no cross-rank reduction yet."""
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip and apply the accumulated gradients unless they are non-finite; then clear them.

        Returns (grad_norm, applied) as device tensors, so the loop needs no host sync per step.
        """
        raise NotImplementedError

    def save_state(self, checkpoint_dir: Path) -> dict[str, Any]:
        """Collective (every rank): write what each rank owns into the checkpoint being assembled, and return
        the small state rank 0 stores in training_state.pt."""
        raise NotImplementedError

    def master_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """Collective: the weights a checkpoint should hold when they are not the model's own tensors (a
        DeepSpeed bf16 engine trains a bf16 copy; its fp32 masters are sharded in the optimizer). None: the
        model's state_dict."""
        return None

    def restore_state(self, checkpoint_dir: Path, state: dict[str, Any]) -> None:
        """Restore what save_state wrote (after wrap)."""
        raise NotImplementedError


class TorchBackend(Backend):
    """Plain autograd with optional fp16 loss scaling: one process, or DistributedDataParallel when the
    communicator has several ranks (gradients averaged, synchronised only on a step's last micro-batch)."""

    def __init__(self, comm: Comm, device: torch.device, precision: Precision, grad_clip: float) -> None:
        super().__init__(comm, device, precision)
        self.grad_clip = grad_clip
        self.optimizer: torch.optim.Optimizer | None = None

    @property
    def ddp(self) -> bool:
        return self.world_size > 1

    @property
    def name(self) -> str:
        return "ddp" if self.ddp else "single"

    def wrap(self, model: torch.nn.Module, build_optimizer: OptimizerFactory
             ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        wrapped = model
        if self.ddp:
            from torch.nn.parallel import DistributedDataParallel as DDP
            # gradients as views into the all-reduce buckets: one copy of the gradients instead of two
            wrapped = DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                          gradient_as_bucket_view=True)
        self.optimizer = build_optimizer(model)  # DDP replicates: the same parameters
        return wrapped, self.optimizer

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return model.no_sync() if self.ddp else contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.scaler.scale(loss).backward()

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        optimizer, scaler = self.optimizer, self.precision.scaler
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip if self.grad_clip > 0 else float("inf"))
        if scaler.is_enabled():
            # fp16: the scaler skips non-finite steps itself (and lowers its scale); read its verdict on device.
            scaler.step(optimizer)
            found = sum(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
            scaler.update()
            applied = found == 0
        else:
            bad = ~torch.isfinite(norm)
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

    def save_state(self, checkpoint_dir: Path) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scaler": self.precision.scaler.state_dict()}

    def restore_state(self, checkpoint_dir: Path, state: dict[str, Any]) -> None:
        if "optimizer" not in state:
            raise CheckpointError(f"{checkpoint_dir}: written by DeepSpeed (optimizer shards in deepspeed/); resume "
                                  "it with --deepspeed, or start a new run from its weights with --init_from")
        self.optimizer.load_state_dict(state["optimizer"])
        scaler = state.get("scaler") or state.get("backend", {}).get("scaler")  # older checkpoints nest it
        if scaler:
            self.precision.scaler.load_state_dict(scaler)
