"""Multi-process backends: launcher detection, DDP, and DeepSpeed ZeRO-2, behind the loop's Backend interface.

Launchers are recognised from their environment:
    torchrun / deepspeed   RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    srun (Slurm)           SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS (+ the rendezvous derived below)
    nothing                one process: TorchBackend over a one-process Comm
NCCL is used on CUDA, gloo on CPU. Every collective has a timeout, so a dead rank makes the others fail with a
message instead of hanging forever. Backends are composed: a communicator (Comm, DistComm) plus TorchBackend
(autograd, DDP when there are several ranks) or DeepSpeedBackend.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common.errors import CheckpointError, ConfigError
from common.files import rendezvous_port
from model.inference import resolve_device

from .backend import Backend, Comm, OptimizerFactory, TorchBackend
from .config import TrainConfig
from .runtime import Precision, set_cuda_tf32


@dataclass
class DistEnv:
    """Where this process sits in the job."""

    rank: int
    local_rank: int
    world_size: int
    launcher: str  # "torchrun" | "slurm" | "none"


def detect_env() -> DistEnv:
    e = os.environ
    if "RANK" in e and "WORLD_SIZE" in e:
        return DistEnv(int(e["RANK"]), int(e.get("LOCAL_RANK", 0)), int(e["WORLD_SIZE"]), "torchrun")
    if "SLURM_PROCID" in e and int(e.get("SLURM_NTASKS", "1")) > 1 and "SLURM_STEP_ID" in e:
        env = DistEnv(int(e["SLURM_PROCID"]), int(e.get("SLURM_LOCALID", 0)), int(e["SLURM_NTASKS"]), "slurm")
        # torch.distributed's env:// rendezvous reads these; srun does not set them.
        os.environ.setdefault("MASTER_ADDR", _first_slurm_host())
        os.environ.setdefault("MASTER_PORT", str(rendezvous_port(e.get("SLURM_JOB_ID", "0"))))
        os.environ.update(RANK=str(env.rank), LOCAL_RANK=str(env.local_rank), WORLD_SIZE=str(env.world_size))
        return env
    return DistEnv(0, 0, 1, "none")


def _first_slurm_host() -> str:
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "localhost")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=30, check=True).stdout.split()
        return out[0] if out else "localhost"
    except (OSError, subprocess.SubprocessError):
        return nodelist.split(",")[0]


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_for(env: DistEnv, requested: str) -> torch.device:
    """This process's device: the requested one, or the local rank's GPU. ConfigError if it is unusable."""
    device = resolve_device(requested)
    if device.type == "cuda":
        # one GPU per process: local rank picks it unless the user pinned one explicitly
        device = torch.device("cuda", env.local_rank if device.index is None else device.index)
        torch.cuda.set_device(device)
    return device


def lost_peer(e: RuntimeError, backend: Backend) -> bool:
    """Whether a collective of a multi-rank run failed because another rank died or hung (gloo and NCCL report
    it as a RuntimeError); if so, this rank says so on stderr, and how to go on."""
    peer = isinstance(e, getattr(dist, "DistError", ())) or re.search(
        r"(?i)connection (closed|reset|refused)|timed? ?out|by peer|nccl|gloo", str(e)) is not None
    if backend.world_size == 1 or not peer:
        return False
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    print(f"error: rank {backend.rank} lost contact with the other ranks ({first}); a rank died or hung. "
          f"Resume with --resume from the last checkpoint.", file=sys.stderr)
    return True


class DistComm(Comm):
    """torch.distributed collectives (NCCL on CUDA, gloo on CPU), each with a timeout. Joins the process group
    when one already exists (DeepSpeed starts its own)."""

    def __init__(self, env: DistEnv, device: torch.device, timeout_s: int) -> None:
        self.rank, self.local_rank, self.world_size = env.rank, env.local_rank, env.world_size
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=env.rank,
                                    world_size=env.world_size, timeout=datetime.timedelta(seconds=timeout_s),
                                    device_id=device if device.type == "cuda" else None)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor)
        return tensor

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class DeepSpeedBackend(Backend):
    """DeepSpeed ZeRO (stage from the JSON file): sharded optimizer state, engine-owned checkpoint shards.

    Our flags override the file for everything the loop also controls (micro-batch, accumulation, clipping,
    precision); the file supplies the ZeRO settings (stage, offload, bucket sizes).
    """

    name = "deepspeed"
    can_switch_precision = False  # bf16 on/off is part of the engine's config

    def __init__(self, env: DistEnv, device: torch.device, precision: Precision, config: TrainConfig) -> None:
        import deepspeed  # imported here so the other backends never need it

        o = config.optim
        self.ds_config = config.precision.deepspeed_config()
        self.ds_config.update({
            "train_micro_batch_size_per_gpu": o.batch_size,
            "gradient_accumulation_steps": o.accumulation_steps,
            "train_batch_size": o.batch_size * o.accumulation_steps * env.world_size,
            "gradient_clipping": o.grad_clip,
            "bf16": {"enabled": precision.dtype == torch.bfloat16},
            "fp16": {"enabled": False},  # TrainConfig.check refuses float16 with DeepSpeed
            "zero_allow_untested_optimizer": True,  # our torch AdamW/SGD, so flags and schedule stay ours
        })
        self.ds_config.pop("optimizer", None)
        self.ds_config.pop("scheduler", None)
        if not dist.is_initialized():
            if env.launcher == "none":  # plain `python`: a one-process group on this machine, no MPI lookup
                os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
                os.environ.setdefault("MASTER_PORT", str(_free_port()))
                os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
            deepspeed.init_distributed("nccl" if device.type == "cuda" else "gloo", auto_mpi_discovery=False,
                                       timeout=datetime.timedelta(seconds=config.precision.dist_timeout),
                                       rank=env.rank, world_size=env.world_size)
        super().__init__(DistComm(env, device, config.precision.dist_timeout), device, precision)
        self.engine: Any = None

    def wrap(self, model: torch.nn.Module, build_optimizer: OptimizerFactory
             ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        import deepspeed
        buffers = {name: b.detach().clone() for name, b in model.named_buffers() if b.is_floating_point()}
        # ZeRO-2 partitions the optimizer state of a whole model's optimizer as it takes it in: built here, over
        # the unsharded model (ZeRO-3, which shards the weights themselves, is not supported)
        optimizer = build_optimizer(model)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.ds_config)
        # bf16 mode casts the whole module, buffers included: give back the fp32 RoPE tables (the model casts
        # them per use) and routing biases (updates of 1e-3 would round away in bf16)
        for name, b in model.named_buffers():
            if name in buffers and b.dtype != buffers[name].dtype:
                b.data = buffers[name].to(b.device)
        return self.engine, optimizer

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the engine knows the accumulation boundary itself

    def backward(self, loss: torch.Tensor) -> None:
        # The loop already normalised the loss over the whole step; stop DeepSpeed dividing by the
        # accumulation steps again. step() after every micro-batch is DeepSpeed's protocol: it only updates
        # at the accumulation boundary (and skips the update when the gradients are not finite).
        self.engine.backward(loss, scale_wrt_gas=False)
        self.engine.step()

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        # The engine already stepped (at the accumulation boundary, inside backward()).
        norm = self.engine.get_global_grad_norm()
        norm = torch.as_tensor(float("nan") if norm is None else norm, device=self.device, dtype=torch.float32)
        overflow = bool(getattr(self.engine.optimizer, "overflow", False))
        return norm, torch.tensor(not overflow, device=self.device)

    def save_state(self, checkpoint_dir: Path) -> dict[str, Any]:
        # Collective: every rank writes its optimizer shard.
        self.engine.save_checkpoint(str(checkpoint_dir), tag="deepspeed", save_latest=False)
        return {}

    def master_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The fp32 master weights, gathered from the ZeRO shards (every rank takes part), with the persistent
        buffers in fp32 too: the engine's module is bf16, and a checkpoint of it would lose the low bits."""
        if self.precision.dtype != torch.bfloat16:
            return None
        from deepspeed.utils import safe_get_full_fp32_param
        weights = {}
        for name, p in model.named_parameters():
            full = safe_get_full_fp32_param(p)
            weights[name] = (full if full is not None else p.detach()).float().cpu()
        names = set(weights)
        weights.update({k: v.detach().float().cpu() for k, v in model.state_dict().items() if k not in names})
        return weights

    def restore_state(self, checkpoint_dir: Path, state: dict[str, Any]) -> None:
        path, _ = self.engine.load_checkpoint(str(checkpoint_dir), tag="deepspeed", load_module_strict=True)
        if path is None:
            raise CheckpointError(f"{checkpoint_dir} holds no DeepSpeed state (was it saved without --deepspeed?); "
                                  "resume it without --deepspeed, or start a new run with --init_from")


def make_backend(config: TrainConfig, env: DistEnv, device: torch.device, precision: Precision) -> Backend:
    """The backend for this process, from the flags and the launcher's environment."""
    if device.type == "cuda":
        set_cuda_tf32(config.precision.tf32)
    if device.type == "mps" and (env.world_size > 1 or config.precision.deepspeed):
        raise ConfigError(f"{'DeepSpeed' if config.precision.deepspeed else f'{env.world_size} processes'} on Apple "
                          "MPS: PyTorch has no collective backend for MPS tensors; train in one process there")
    if config.precision.deepspeed:
        return DeepSpeedBackend(env, device, precision, config)
    comm = DistComm(env, device, config.precision.dist_timeout) if env.world_size > 1 else Comm()
    return TorchBackend(comm, device, precision, config.optim.grad_clip)
