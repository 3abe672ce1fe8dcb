"""Runtime plumbing: device and precision choice, seeding, RNG state capture, graceful-stop signals, and the
memory allocator's settings for training."""
from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import random
import shutil
import signal
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.device import capabilities

# From least to most numeric range and precision: a precision fallback only ever moves right.
FALLBACK_ORDER = (torch.float16, torch.bfloat16, torch.float32)


def fallback_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype | None:
    """The precision to continue in when `dtype` keeps producing non-finite gradients, or None from fp32.

    fp16 overflows at 65504, so its trouble is usually range: bf16 has fp32's exponent range and is the
    cheapest cure where the device computes it natively (common/device.py: Ampere+ GPUs, CPUs with
    AVX512-BF16/AMX); elsewhere fp32. bf16 goes to fp32 (its 8-bit mantissa is the remaining suspect)."""
    if dtype == torch.float16:
        return torch.bfloat16 if capabilities(device).bf16 else torch.float32
    if dtype == torch.bfloat16:
        return torch.float32
    return None


def wider_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The one of two autocast dtypes further along FALLBACK_ORDER."""
    return max(a, b, key=FALLBACK_ORDER.index)


def compile_toolchain_problem() -> str | None:
    """Why torch.compile cannot build kernels here, or None. Inductor compiles C++ for the CPU and Triton
    compiles C launchers for the GPU; both need a compiler and Python's headers, and without them the first
    step fails deep inside a compile worker with a long log instead of one clear line."""
    compilers = [c for c in (os.environ.get("CXX"), os.environ.get("CC"), "c++", "g++", "clang++", "cc", "gcc",
                             "clang") if c]
    if not any(shutil.which(c) for c in compilers):
        return ("--compile needs a C/C++ compiler to build its kernels (none of c++, g++, clang++, cc, gcc, clang "
                "is on PATH): install one (Debian/Ubuntu: apt-get install build-essential) or drop --compile")
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.is_file():
        return (f"--compile needs Python's C headers ({headers} is missing): install them (Debian/Ubuntu: "
                f"apt-get install python3-dev) or drop --compile")
    return None


def set_cuda_tf32(enabled: bool) -> None:
    """Let fp32 matmuls on Ampere and newer GPUs use TF32 tensor cores (inputs rounded to a 10-bit mantissa,
    fp32 accumulation): several times faster for --dtype float32, no effect on bf16/fp16 autocast matmuls.
    CUDA matmuls only; CPU numerics are left alone.

    Set through `allow_tf32`, the one switch every view agrees with: on PyTorch >= 2.9 it also sets the new
    `matmul.fp32_precision` ("tf32"/"ieee") and `get_float32_matmul_precision()` ("high"/"highest"), while
    setting only `fp32_precision` leaves the old views in a state whose reading raises "mix of the legacy and new
    APIs" (Inductor reads them under --compile). set_float32_matmul_precision would also switch oneDNN's CPU
    matmuls to TF32."""
    torch.backends.cuda.matmul.allow_tf32 = enabled


@dataclass
class Precision:
    """Mixed-precision policy: fp32 master weights, autocast to `dtype`, loss scaling for fp16."""

    device: torch.device
    dtype: torch.dtype

    def __post_init__(self) -> None:
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype == torch.float16)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)


# ------------------------------------------------------------------------------ the memory allocator
# mallopt()'s parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
TOP_PAD = 64 << 20  # the heap grows by this much beyond what is asked: fewer, larger extensions


def tune_allocator() -> bool:
    """Keep a training step's freed buffers for the next step. glibc's malloc gives a block of 128 KiB or more
    (32 MiB or more once it has adapted) fresh pages of its own (mmap) and returns them to the system when it is
    freed; a step frees and allocates its activations, logits and gradients again every step, so every step
    faults 100-300 thousand pages back in: 12-16% of the demo model's step on a 2-core Xeon, fp32
    (bench/bench_first_steps.py). From here on every block comes from the heap, which keeps up to 2 GiB free at its
    top, so a freed buffer is reused as it is (the peak resident memory is 6-20% higher). glibc on Linux only, and
    left alone when the environment chooses an allocator or its settings (LD_PRELOAD, MALLOC_*). Returns whether
    it applied."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if "LD_PRELOAD" in os.environ or any(k.startswith("MALLOC_") for k in os.environ):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in
               ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1), (M_TOP_PAD, TOP_PAD)))


# ------------------------------------------------------------------------------ RNG state
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def rng_state() -> dict[str, Any]:
    """All RNG states as tensors and plain lists, so torch.load(weights_only=True) can read them back."""
    np_state = np.random.get_state()
    state = {"python": [list(random.getstate()[1]), random.getstate()[2]],
             "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                       "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    internal, gauss = state["python"]
    random.setstate((3, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------- stop signals
class StopSignal:
    """Turns SIGTERM / SIGINT / SIGUSR1 / SIGUSR2 into a flag the loop checks between optimizer steps.

    SIGUSR2 is what submitit asks Slurm to send before a time-out.

    The step in flight finishes, a checkpoint is written, and the process exits 0. A second Ctrl-C while
    stopping restores the default handler's behaviour (immediate KeyboardInterrupt).
    """

    SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignal":
        for name in self.SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                try:
                    self._previous[sig] = signal.signal(sig, self._handle)
                except ValueError:  # not the main thread (e.g. inside some test runners): no graceful stop
                    pass
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
