"""Devices and the number formats that are fast on them: the one precision policy every dtype choice asks.

A reduced precision pays only where the hardware computes it. Emulated bf16 is the trap: an AVX2-only CPU runs
a bf16 matmul at ~1% of its fp32 speed (measured: 0.9 against 108 GFLOP/s on an AMD EPYC), and
`torch.cuda.is_bf16_supported()` says yes on pre-Ampere GPUs, where bf16 is emulated too. So the policy asks
the hardware, once per device:

    cpu   bf16 where the CPU has AVX512-BF16 / AMX (x86) or BF16 (Arm) and a short timing probe confirms it
          (a flag can be present while the kernels cannot use it: a hypervisor, an old kernel without AMX
          state, ONEDNN_MAX_CPU_ISA); else fp32.
    cuda  bf16 from compute capability 8.0 (Ampere); below it fp16 with loss scaling where fp16 runs at full
          speed (sm_53, 60, 62, 70+; not the consumer Pascal cards, whose fp16 runs at 1/64), else fp32.
    mps   fp32 for training (autocast and loss scaling on MPS are young; --dtype float16/bfloat16 opt in);
          bf16 from macOS 14, fp16 everywhere, for the arithmetic that needs no scaling.

Every choice derives from that: training autocast (`--dtype auto`), the optimizer's own arithmetic (Muon's
Newton-Schulz), MoE grouped matmuls, evaluation/serving weights, benchmarks. `PrecisionPolicy.reason` is the
line a run header prints ("cpu without native bf16 (no avx512_bf16, amx_bf16 or bf16 flag): float32").

POCKETLM_CPU_BF16=0 (or 1) overrides the CPU's answer: to time the fp32 path on a bf16-capable machine, or to
reproduce an fp32 machine's run.
"""
from __future__ import annotations

import os
import platform
import re
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

import torch

from .errors import ConfigError

# The oldest PyTorch the code runs on: device-generic autocast queries (torch.is_autocast_enabled(device),
# torch.get_autocast_dtype(device)) and the fused AdamW on CPU with its found_inf step skip are new in 2.4.
TORCH_FLOOR = (2, 4)


def torch_version_problem(version: str) -> str | None:
    """Why PyTorch `version` ("2.3.1+cpu", "2.4.0a0+git...") is too old for PocketLM, or None."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) >= TORCH_FLOOR:
        return None
    floor = ".".join(map(str, TORCH_FLOOR))
    return (f"PocketLM needs PyTorch >= {floor}, this is {version}: install a newer one for your platform "
            "(README \"Quick start\"; the CPU build: pip install torch==2.13.0)")


# Checked on import, before any command parses its flags: an older PyTorch would otherwise fail later, deep in
# a step, with a TypeError about autocast or the fused optimizer.
if (_problem := torch_version_problem(torch.__version__)) is not None:
    raise SystemExit(f"error: {_problem}")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICE_KINDS = ("auto", "cpu", "cuda", "cuda:N", "mps")
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 flags / the Arm "Features" word
CPU_BF16_ENV = "POCKETLM_CPU_BF16"
# fp16 at full speed or better below compute capability 7.0: Jetson TX1 (5.3), P100 (6.0), Jetson TX2 (6.2)
FAST_FP16_BEFORE_VOLTA = ((5, 3), (6, 0), (6, 2))


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16", the spelling of --dtype and of every log and config file."""
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------------------ devices
def mps_available() -> bool:
    """Apple's Metal backend is built into this PyTorch and usable on this machine."""
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def parse_device(name: str | None = None) -> torch.device:
    """The device a --device flag names: auto (CUDA, else MPS, else CPU), cpu, cuda, cuda:N or mps.

    Anything else, or a device this machine lacks, is one ConfigError naming what is supported: PyTorch's own
    answers are tracebacks ("PyTorch is not linked with support for mps devices", an AssertionError for xpu)
    or worse, a run on a device we never tested (meta)."""
    if not name or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if mps_available() else "cpu")
    if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", name):
        raise ConfigError(f"--device {name}: expected one of {', '.join(DEVICE_KINDS)}")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name}: CUDA is not available (this PyTorch {torch.__version__} "
                              f"{'has no CUDA support' if torch.version.cuda is None else 'sees no GPU'})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type == "mps" and not mps_available():
        raise ConfigError(f"--device {name}: Apple MPS is not available (it needs an Apple-silicon Mac, macOS 12.3+ "
                          "and a PyTorch built with MPS)")
    return device


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (CUDA and MPS run asynchronously; the CPU has nothing to wait for)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def timed(work: Callable[[], Any], device: torch.device) -> float:
    """Seconds `work()` takes on `device`, its queued work included (what a training step's timing needs)."""
    synchronize(device)
    t0 = time.perf_counter()
    work()
    synchronize(device)
    return time.perf_counter() - t0


# ------------------------------------------------------------------------ capabilities
@dataclass(frozen=True)
class Capabilities:
    """Which reduced precisions a device computes in hardware, and what that was read from."""

    kind: str      # cpu | cuda | mps
    bf16: bool     # bf16 arithmetic at least as fast as fp32
    fp16: bool     # fp16 arithmetic at least as fast as fp32
    detail: str    # "amx_bf16, avx512_bf16; a bf16 matmul ran 6.1x fp32's speed", "Tesla T4, sm_75", ...


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (x86 "flags", Arm "Features"), or None where there is none."""
    try:
        text = open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return flags or None


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else the architecture."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def cpu_description() -> str:
    """The CPU's model name and its kind, for speed reports: "Intel(R) Xeon(R) Processor (amx_bf16, avx512_bf16,
    avx2)"; "no bf16 flags" names a CPU where bf16 is emulated."""
    flags = cpu_flags() or set()
    native = sorted(set(CPU_BF16_FLAGS) & flags)
    return f"{cpu_model()} ({', '.join(native) if native else 'no bf16 flags'}{', avx2' if 'avx2' in flags else ''})"


def training_machine() -> dict[str, str]:
    """Where a training benchmark ran, as its results record it: the device --device auto picks, the CPU (model and
    kind) and the dtype the precision policy trains in there."""
    device = parse_device("auto")
    return {"device": str(device), "cpu": cpu_description(), "dtype": dtype_name(choose_dtype("auto", device,
                                                                                              "train").dtype)}


def bf16_speedup(n: int = 256, reps: int = 3) -> float:
    """fp32 matmul time / bf16 matmul time on the CPU (best of `reps`): ~2-20 where bf16 is native, ~0.01 where
    it is emulated. A 256x256 product takes well under a millisecond natively, ~40 ms emulated."""
    a, b = torch.randn(n, n), torch.randn(n, n)

    def best(x: torch.Tensor, y: torch.Tensor, least: int, most: int, enough_s: float) -> float:
        """The fastest of `least` to `most` products, stopping after `least` once they took `enough_s`."""
        x @ y  # warm-up: kernel selection, buffers
        times: list[float] = []
        while len(times) < least or len(times) < most and sum(times) < enough_s:
            t0 = time.perf_counter()
            x @ y
            times.append(time.perf_counter() - t0)
        return min(times)

    # A product that takes well under a millisecond can be delayed in every one of a few tries by another process
    # on a busy core, or by a first call's kernel set-up: on a loaded 2-core AVX2 EPYC emulated bf16 measured
    # 0.3-0.6x fp32's speed instead of ~0.01x, and on a quiet Zen 4 with avx512_bf16 native bf16 once measured
    # 0.26x in three tries (1.8-2.2x in every later process), which made a whole run fp32. So each side is timed
    # up to 7 * reps times, the best of many being its undisturbed time; emulated bf16 (~40 ms a product) stops
    # after `reps`, as it always did, its time already far beyond any disturbance.
    many = 7 * reps
    return best(a, b, many, many, 0.0) / max(best(a.bfloat16(), b.bfloat16(), reps, many, 0.1), 1e-9)


@lru_cache(maxsize=1)
def cpu_capabilities() -> Capabilities:
    forced = os.environ.get(CPU_BF16_ENV)
    if forced is not None:
        if forced not in ("0", "1"):
            raise ConfigError(f"{CPU_BF16_ENV}={forced!r}: expected 0 (no native bf16) or 1")
        return Capabilities("cpu", forced == "1", False, f"{CPU_BF16_ENV}={forced}")
    flags = cpu_flags()
    named = sorted(set(CPU_BF16_FLAGS) & flags) if flags is not None else []
    if flags is not None and not named:
        # each of CPU_BF16_FLAGS named: on an Arm CPU, "no avx512_bf16 or amx_bf16" would not say that its own
        # "bf16" was looked for
        return Capabilities("cpu", False, False, "no avx512_bf16, amx_bf16 or bf16 flag")
    speedup = bf16_speedup()
    # native bf16 is faster than fp32, emulated ~100x slower: half of fp32's speed separates them widely
    native = speedup >= 0.5
    seen = ", ".join(named) if named else "no cpu flags to read"
    return Capabilities("cpu", native, False, f"{seen}; a bf16 matmul ran {speedup:.2g}x fp32's speed"
                                              + ("" if native else ", so it is emulated"))


def cuda_capabilities(device: torch.device) -> Capabilities:
    major, minor = torch.cuda.get_device_capability(device)
    fp16 = (major, minor) >= (7, 0) or (major, minor) in FAST_FP16_BEFORE_VOLTA
    return Capabilities("cuda", (major, minor) >= (8, 0), fp16,
                        f"{torch.cuda.get_device_name(device)}, sm_{major}{minor}")


def mps_capabilities() -> Capabilities:
    macos14 = bool(getattr(torch.backends.mps, "is_macos_or_newer", lambda *v: False)(14, 0))
    return Capabilities("mps", macos14, True, "Apple MPS" + (", macOS 14+" if macos14 else ", macOS < 14 (no bf16)"))


def capabilities(device: torch.device) -> Capabilities:
    """What `device` computes natively (the CPU's answer is read once per process)."""
    if device.type == "cuda":  # torch caches the device's properties: cheap enough for every forward
        return cuda_capabilities(device)
    if device.type == "mps":
        return mps_capabilities()
    if device.type == "cpu":
        return cpu_capabilities()
    raise ConfigError(f"no precision policy for device {device}; expected one of {', '.join(DEVICE_KINDS[1:])}")


# ------------------------------------------------------------------------------ policy
NEWTON_SCHULZ_STEPS = 5  # torch.optim.Muon's (Keller Jordan's) count, for bf16 and fp16
FP32_NEWTON_SCHULZ_STEPS = 3


@dataclass(frozen=True)
class PrecisionPolicy:
    """The number formats of one device, derived from its capabilities in one place.

    train      autocast dtype of the trainers' --dtype auto (float16 comes with loss scaling)
    inference  weight dtype of --dtype auto in evaluation, serving and benchmarks of inference
    optimizer  the optimizer's own matrix arithmetic (Muon's Newton-Schulz iteration)
    newton_schulz_steps  Muon's iterations: torch.optim.Muon's 5 in a reduced format; 3 in fp32, where on a CPU
               the iteration is a quarter of a 26M step and 3 learned more per second than 5 on EN and ZH
               (docs/precision.md, bench/results/vs-minimind-avx2-epyc.json)
    """

    caps: Capabilities
    train: torch.dtype
    inference: torch.dtype
    optimizer: torch.dtype

    @property
    def newton_schulz_steps(self) -> int:
        return FP32_NEWTON_SCHULZ_STEPS if self.optimizer == torch.float32 else NEWTON_SCHULZ_STEPS

    @property
    def reason(self) -> str:
        """One line for a run header: what the device offers and what training chose."""
        kind = self.caps.kind
        if kind == "cpu":
            what = "cpu with native bf16" if self.caps.bf16 else "cpu without native bf16"
        elif kind == "cuda":
            what = "cuda with native bf16" if self.caps.bf16 else (
                "cuda without native bf16" + (", fp16 with loss scaling" if self.caps.fp16 else " or fast fp16"))
        else:
            what = "mps (autocast not used by default)"
        return f"{what} ({self.caps.detail}): {dtype_name(self.train)}"


def policy_for(caps: Capabilities) -> PrecisionPolicy:
    """The policy that follows from a device's capabilities (tests hand it faked ones)."""
    if caps.kind == "mps":
        fast = torch.bfloat16 if caps.bf16 else torch.float16
        return PrecisionPolicy(caps, train=torch.float32, inference=torch.float32, optimizer=fast)
    reduced = torch.bfloat16 if caps.bf16 else torch.float16 if caps.fp16 and caps.kind == "cuda" else torch.float32
    # Inference weights: bf16 only where it is native on a GPU. A CPU keeps fp32 (exact, and decoding a small
    # model there is bound by memory latency, not arithmetic); fp16 weights could overflow activations that a
    # bf16-trained model never had to keep below 65504, and nothing scales them at inference.
    inference = torch.bfloat16 if caps.bf16 and caps.kind == "cuda" else torch.float32
    return PrecisionPolicy(caps, train=reduced, inference=inference, optimizer=reduced)


def precision_policy(device: torch.device) -> PrecisionPolicy:
    """The precision policy of `device`."""
    return policy_for(capabilities(device))


@dataclass(frozen=True)
class DtypeChoice:
    """A resolved --dtype and the sentence that explains it."""

    dtype: torch.dtype
    reason: str
    warning: str | None = None  # an explicit choice that runs emulated: said once, not refused


def choose_dtype(name: str, device: torch.device, purpose: str = "train") -> DtypeChoice:
    """--dtype `name` (auto, float32, bfloat16, float16) on `device`, for "train" or "inference".

    auto asks the policy. An explicit reduced precision the device only emulates is kept (the user asked for
    it) with a warning; one PyTorch cannot run at all there is a ConfigError."""
    if purpose not in ("train", "inference"):
        raise ValueError(f"purpose {purpose!r}; expected train or inference")
    if name != "auto" and name not in DTYPES:
        raise ConfigError(f"--dtype {name!r}; expected auto or one of {sorted(DTYPES)}")
    policy = precision_policy(device)
    if name == "auto":
        dtype = getattr(policy, purpose)
        return DtypeChoice(dtype, policy.reason if purpose == "train" else
                           f"{device.type} inference ({policy.caps.detail}): {dtype_name(dtype)}")
    dtype = DTYPES[name]
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("this GPU has no bf16 support; use --dtype float16 (loss scaling is automatic)")
    emulated = (dtype == torch.bfloat16 and not policy.caps.bf16) or (
        dtype == torch.float16 and device.type == "cuda" and not policy.caps.fp16)
    warning = (f"--dtype {name} is emulated on this {device.type} ({policy.caps.detail}): expect it to be slower "
               f"than --dtype auto ({dtype_name(getattr(policy, purpose))})") if emulated else None
    return DtypeChoice(dtype, f"{name} (--dtype {name}; {device.type}: {policy.caps.detail})", warning)
