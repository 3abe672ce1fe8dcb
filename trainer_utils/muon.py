"""Muon: momentum orthogonalised by a Newton-Schulz iteration, computed in the precision the device is fast in.

The update is torch.optim.Muon's (PyTorch >= 2.9), step for step: Nesterov momentum (a lerp), the quintic
Newton-Schulz iteration of Keller Jordan's Muon (coefficients 3.4445, -4.7750, 2.0315; 5 steps) on the wider
orientation of each matrix, decoupled weight decay, and a learning rate adjusted per shape. What differs is the
iteration's number format. torch's always casts to bf16, which an AVX2-only CPU emulates at ~1% of its fp32
speed: one step over the demo model's matrices took 8.4 s there, against 0.01 s for AdamW. Here the dtype is
the device's (common/device.py): bf16 where it is native, where this code computes exactly what torch's does
(tested bit for bit); fp32 on CPUs without native bf16; fp16 on GPUs without bf16 (pre-Ampere), where the
matrix is normalised in fp32 before the cast so tiny gradients do not underflow fp16's range. The iteration
count is the policy's too (`--muon_ns_steps` overrides it): torch's 5 in bf16 and fp16; 3 in fp32, where on a
CPU the iteration is about a quarter of a 26M step and 3 iterations learned more per second (docs/precision.md).
It is a group setting ("ns_steps"), so a checkpoint resumes with the count it was trained with.

The state ("momentum_buffer" per parameter) and the group keys are torch's, so optimizer state saved under
torch.optim.Muon loads here and resumes exactly; this code does not need torch.optim.Muon, which PyTorch
before 2.9 lacks.

Batching equal-shaped matrices into one bmm per shape was measured and not adopted: on a 2-core AMX Xeon it
was no faster for the 26M model in bf16 (0.41 s against 0.39 s per step) and would no longer match
torch.optim.Muon bit for bit, and in fp32 the iteration is compute-bound (~280 GFLOP per 26M step at the
matmul peak), where batching saves nothing (docs/precision.md).
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from common.device import NEWTON_SCHULZ_STEPS

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
EPS = 1e-7
ADJUST_LR_FNS = ("original", "match_rms_adamw")


def newton_schulz(grad: torch.Tensor, dtype: torch.dtype = torch.bfloat16, steps: int = NEWTON_SCHULZ_STEPS,
                  coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = EPS) -> torch.Tensor:
    """An approximately orthogonal matrix U S' V^T (S' ~ 1) for the 2-D `grad` = U S V^T, computed in `dtype`.

    Iterated on the wide orientation (rows <= columns), so the Gram matrix is the smaller one. The input is
    scaled to Frobenius norm 1 first (spectral norm <= 1, where the iteration converges). For bf16 and fp32
    the cast comes first, as in torch.optim.Muon; fp16 has too little range for raw gradients, so it is cast
    after the scaling."""
    if grad.ndim != 2:
        raise ValueError(f"Newton-Schulz takes a matrix, got shape {tuple(grad.shape)}")
    a, b, c = coefficients
    x = grad.to(torch.float32 if dtype == torch.float16 else dtype)
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = (x / x.norm().clamp(min=eps)).to(dtype)
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """The learning rate for one matrix: "original" (Keller Jordan) sqrt(max(1, rows/cols)); "match_rms_adamw"
    (Moonlight) 0.2 * sqrt(max(rows, cols)), which makes the update's RMS that of an AdamW update."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn {adjust_lr_fn!r}; expected one of {ADJUST_LR_FNS}")


class Muon(torch.optim.Optimizer):
    """Muon over 2-D parameters, with the Newton-Schulz iteration in `ns_dtype` (see the module docstring).

    `ns_dtype` belongs to the machine, not to the run: it is no group key and is not saved, so a checkpoint
    resumes on another kind of machine in that machine's precision."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                 eps: float = EPS, ns_steps: int = NEWTON_SCHULZ_STEPS, adjust_lr_fn: str | None = None,
                 ns_dtype: torch.dtype = torch.bfloat16) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"Muon needs lr, momentum and weight_decay >= 0, got {lr}, {momentum}, {weight_decay}")
        if adjust_lr_fn is not None and adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn {adjust_lr_fn!r}; expected one of {ADJUST_LR_FNS}")
        if ns_dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"ns_dtype {ns_dtype}; expected a floating-point dtype")
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                    "ns_coefficients": ns_coefficients, "eps": eps, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn}
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes 2-D parameters only, got one of shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One Muon step on every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = newton_schulz(update, self.ns_dtype, group["ns_steps"], group["ns_coefficients"],
                                       group["eps"])
                p.mul_(1 - lr * decay)
                p.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss
