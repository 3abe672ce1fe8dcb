"""The precision policy (common/device.py) for every device kind, with the hardware faked, and --device
parsing: which dtype training, inference and the optimizer get, what the run header says, what is refused."""
from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
import torch
from test_train import flags

import train_pretrain
from common import device as dev
from common.device import Capabilities, choose_dtype, parse_device, policy_for, precision_policy
from common.errors import ConfigError
from trainer_utils.runtime import Precision, fallback_dtype

from conftest import ROOT, fake_cpu

CPU, CUDA, MPS = torch.device("cpu"), torch.device("cuda", 0), torch.device("mps")
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def fake_cuda(monkeypatch, capability: tuple[int, int], name: str = "faked GPU") -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    # what PyTorch answers: bf16 "supported" on every GPU from sm_53, emulated below sm_80
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: capability >= (8, 0)
                        or (including_emulation and capability >= (5, 3)))


def fake_mps(monkeypatch, macos14: bool) -> None:
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda major, minor=0: macos14, raising=False)


# ------------------------------------------------------------------------------ cpu
@pytest.mark.parametrize("bf16", [True, False], ids=["native-bf16", "avx2-only"])
def test_cpu_policy(monkeypatch, bf16):
    fake_cpu(monkeypatch, bf16)
    p = precision_policy(CPU)
    expected = BF16 if bf16 else FP32
    assert (p.train, p.optimizer, p.inference) == (expected, expected, FP32)
    assert p.reason.startswith("cpu with native bf16" if bf16 else "cpu without native bf16")
    assert p.reason.endswith(": bfloat16" if bf16 else ": float32")
    assert choose_dtype("auto", CPU).dtype == expected
    assert choose_dtype("auto", CPU, "inference").dtype == FP32
    assert fallback_dtype(FP16, CPU) == expected  # fp16 trouble goes to bf16 only where bf16 is fast
    explicit = choose_dtype("bfloat16", CPU)
    assert explicit.dtype == BF16 and (explicit.warning is None) == bf16  # kept, but an emulated one is said
    if not bf16:
        assert "emulated on this cpu" in explicit.warning and "float32" in explicit.warning
    assert choose_dtype("float32", CPU).dtype == FP32 and choose_dtype("float32", CPU).warning is None


def test_cpu_without_a_bf16_flag_is_fp32_without_probing(monkeypatch):
    monkeypatch.delenv(dev.CPU_BF16_ENV, raising=False)
    monkeypatch.setattr(dev, "cpu_flags", lambda: {"sse2", "avx", "avx2", "fma"})
    monkeypatch.setattr(dev, "bf16_speedup", lambda: pytest.fail("probed although no flag claims bf16"))
    dev.cpu_capabilities.cache_clear()
    try:
        caps = dev.cpu_capabilities()
        assert not caps.bf16 and "no avx512_bf16, amx_bf16 or bf16 flag" in caps.detail
    finally:
        dev.cpu_capabilities.cache_clear()


@pytest.mark.parametrize("flags,speedup,native", [
    ({"avx2", "avx512_bf16", "amx_bf16"}, 8.0, True),    # Sapphire Rapids: AMX
    ({"avx2", "avx512_bf16"}, 1.9, True),                # Zen 4 / Cooper Lake: AVX512-BF16 only
    ({"avx2", "amx_bf16"}, 0.01, False),                 # a flag the kernels cannot use (no AMX state, an ISA cap)
    (None, 3.0, True),                                   # no /proc/cpuinfo (macOS): the probe decides
    (None, 0.02, False),
], ids=["amx", "avx512-bf16", "flag-but-emulated", "no-flags-fast", "no-flags-slow"])
def test_a_bf16_flag_is_confirmed_by_timing(monkeypatch, flags, speedup, native):
    monkeypatch.delenv(dev.CPU_BF16_ENV, raising=False)
    monkeypatch.setattr(dev, "cpu_flags", lambda: flags)
    monkeypatch.setattr(dev, "bf16_speedup", lambda: speedup)
    dev.cpu_capabilities.cache_clear()
    try:
        caps = dev.cpu_capabilities()
        assert caps.bf16 == native
        assert f"{speedup:.2g}x fp32's speed" in caps.detail and ("emulated" in caps.detail) != native
    finally:
        dev.cpu_capabilities.cache_clear()


# aarch64 Linux names its features on a "Features" line per core (no "flags" line, no "model name"); BF16 is the
# word "bf16". Neoverse V2 (Graviton4, Grace) has it, Neoverse N1 (Graviton2, Ampere Altra) does not.
NEOVERSE_V2 = ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop "
               "sha3 sm3 sm4 asimddp sha512 asimdfhm dit uscat ilrcpc flagm ssbs sb paca pacg dcpodp sve2 sveaes "
               "svepmull svebitperm svesha3 svesm4 flagm2 frint svei8mm svebf16 i8mm bf16 dgh")
NEOVERSE_N1 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs"


def arm_cpuinfo(features: str, part: str, cores: int = 2) -> str:
    """/proc/cpuinfo as an aarch64 Linux writes it."""
    return "".join(f"processor\t: {i}\nBogoMIPS\t: 2000.00\nFeatures\t: {features}\nCPU implementer\t: 0x41\n"
                   f"CPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: {part}\nCPU revision\t: 1\n\n"
                   for i in range(cores))


def fake_cpuinfo(monkeypatch, text: str) -> None:
    """common.device reads `text` where it opens /proc/cpuinfo (the parsing runs for real, not a faked cpu_flags)."""
    def fake_open(path, *args, **kwargs):
        assert path == "/proc/cpuinfo", path
        return io.StringIO(text)

    monkeypatch.delenv(dev.CPU_BF16_ENV, raising=False)
    monkeypatch.setattr(dev, "open", fake_open, raising=False)  # found before the builtin by the module's code


@pytest.mark.parametrize("speedup,native", [(4.0, True), (0.01, False)], ids=["probe-fast", "probe-slow"])
def test_an_arm_cpu_with_bf16_is_confirmed_by_timing(monkeypatch, speedup, native):
    fake_cpuinfo(monkeypatch, arm_cpuinfo(NEOVERSE_V2, "0xd4f"))
    monkeypatch.setattr(dev, "bf16_speedup", lambda: speedup)
    dev.cpu_capabilities.cache_clear()
    try:
        assert dev.cpu_flags() == set(NEOVERSE_V2.split())
        caps = dev.cpu_capabilities()
        assert caps.bf16 == native
        assert caps.detail == f"bf16; a bf16 matmul ran {speedup:.2g}x fp32's speed" + ("" if native else
                                                                                          ", so it is emulated")
        p = precision_policy(CPU)
        assert (p.train, p.optimizer, p.inference) == ((BF16, BF16, FP32) if native else (FP32, FP32, FP32))
        assert p.reason.startswith("cpu with native bf16 (bf16;" if native else "cpu without native bf16 (bf16;")
        assert dev.cpu_description().endswith("(bf16)")
    finally:
        dev.cpu_capabilities.cache_clear()


@pytest.mark.parametrize("features,part", [(NEOVERSE_N1, "0xd0c"), (NEOVERSE_V2.replace(" bf16 ", " "), "0xd4f")],
                         ids=["neoverse-n1", "svebf16-only"])
def test_an_arm_cpu_without_bf16_is_fp32_without_probing(monkeypatch, features, part):
    """Flags are whole words: "bf16" is not found inside "svebf16". Rightly so: PyTorch's Arm bf16 kernels (oneDNN,
    ACL) ask for the base BF16 feature, the "bf16" word; "svebf16" (SVE's BF16 instructions) never comes without it
    on real hardware, and alone would be a hypervisor's odd mask, fp32 being the safe answer there."""
    assert "bf16" not in features.split()
    fake_cpuinfo(monkeypatch, arm_cpuinfo(features, part))
    monkeypatch.setattr(dev, "bf16_speedup", lambda: pytest.fail("probed although no flag claims bf16"))
    dev.cpu_capabilities.cache_clear()
    try:
        caps = dev.cpu_capabilities()
        assert not caps.bf16 and caps.detail == "no avx512_bf16, amx_bf16 or bf16 flag"
        assert precision_policy(CPU).reason == f"cpu without native bf16 ({caps.detail}): float32"
        assert dev.cpu_description().endswith("(no bf16 flags)")
    finally:
        dev.cpu_capabilities.cache_clear()


def test_the_environment_can_force_the_cpus_answer(monkeypatch):
    """POCKETLM_CPU_BF16=0 times the fp32 path on a bf16 machine; a bad value is refused, not ignored."""
    try:
        for value, native in (("0", False), ("1", True)):
            monkeypatch.setenv(dev.CPU_BF16_ENV, value)
            dev.cpu_capabilities.cache_clear()
            assert dev.cpu_capabilities().bf16 == native
            assert precision_policy(CPU).train == (BF16 if native else FP32)
        monkeypatch.setenv(dev.CPU_BF16_ENV, "yes")
        dev.cpu_capabilities.cache_clear()
        with pytest.raises(ConfigError, match="POCKETLM_CPU_BF16='yes': expected 0"):
            dev.cpu_capabilities()
    finally:
        dev.cpu_capabilities.cache_clear()


def test_the_probe_measures_this_machine():
    """The real probe: a positive ratio, and on this machine it agrees with the policy's answer."""
    ratio = dev.bf16_speedup()
    assert ratio > 0
    flags = dev.cpu_flags()
    if flags is not None and not set(dev.CPU_BF16_FLAGS) & flags:
        assert ratio < 0.5, f"no bf16 flag, yet bf16 matmuls ran {ratio:.2f}x fp32's speed"


# ----------------------------------------------------------------------------- cuda
@pytest.mark.parametrize("capability,name,train,inference", [
    ((9, 0), "NVIDIA H100", BF16, BF16),
    ((8, 6), "NVIDIA GeForce RTX 3090", BF16, BF16),
    ((8, 0), "NVIDIA A100", BF16, BF16),
    ((7, 5), "Tesla T4", FP16, FP32),
    ((7, 0), "Tesla V100", FP16, FP32),
    ((6, 0), "Tesla P100", FP16, FP32),
    ((6, 1), "NVIDIA GeForce GTX 1080", FP32, FP32),  # Pascal consumer cards: fp16 at 1/64 of fp32
], ids=["h100", "rtx3090", "a100", "t4", "v100", "p100", "gtx1080"])
def test_cuda_policy_by_compute_capability(monkeypatch, capability, name, train, inference):
    fake_cuda(monkeypatch, capability, name)
    p = precision_policy(CUDA)
    assert (p.train, p.inference, p.optimizer) == (train, inference, train)
    assert f"{name}, sm_{capability[0]}{capability[1]}" in p.reason and p.reason.endswith(str(train)[6:])
    assert choose_dtype("auto", CUDA).dtype == train
    assert choose_dtype("auto", CUDA, "inference").dtype == inference
    assert fallback_dtype(FP16, CUDA) == (BF16 if capability >= (8, 0) else FP32)
    # torch.cuda.is_bf16_supported() says yes on a T4 (emulation): an explicit bf16 runs, with a warning
    explicit = choose_dtype("bfloat16", CUDA)
    assert explicit.dtype == BF16 and (explicit.warning is None) == (capability >= (8, 0))


def test_bf16_is_refused_on_a_gpu_that_cannot_run_it(monkeypatch):
    fake_cuda(monkeypatch, (5, 2), "GeForce GTX 980")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    with pytest.raises(ConfigError, match="no bf16 support; use --dtype float16"):
        choose_dtype("bfloat16", CUDA)
    assert choose_dtype("float16", CUDA).warning is not None  # sm_52's fp16 is not fast either: said
    assert choose_dtype("auto", CUDA).dtype == FP32


def test_moe_grouped_matmuls_follow_the_policy(monkeypatch):
    """Grouped matmuls run in bf16: only on GPUs where it is native (the portable path elsewhere)."""
    from model import model as model_mod
    if not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("this PyTorch has no grouped_mm")
    x = torch.empty(4, 64, dtype=BF16)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: CUDA))
    fake_cuda(monkeypatch, (9, 0))
    assert model_mod.use_grouped_mm(x)
    fake_cuda(monkeypatch, (7, 5))
    assert not model_mod.use_grouped_mm(x)


# ------------------------------------------------------------------------------ mps
@pytest.mark.parametrize("macos14", [True, False])
def test_mps_policy(monkeypatch, macos14):
    fake_mps(monkeypatch, macos14)
    p = precision_policy(MPS)
    assert (p.train, p.inference) == (FP32, FP32)
    assert p.optimizer == (BF16 if macos14 else FP16)
    assert p.reason.startswith("mps") and p.reason.endswith(": float32")
    assert (choose_dtype("bfloat16", MPS).warning is None) == macos14
    assert Precision(MPS, FP16).scaler.is_enabled()  # loss scaling where fp16 is asked for


# ---------------------------------------------------------------------- the devices
def test_auto_picks_cuda_then_mps_then_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert parse_device("auto") == CPU and parse_device(None) == CPU
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert parse_device("auto").type == "mps" and parse_device("mps").type == "mps"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert parse_device("auto").type == "cuda" and parse_device("cuda:1") == torch.device("cuda", 1)


@pytest.mark.parametrize("name,message", [
    ("xpu", "expected one of auto, cpu, cuda, cuda:N, mps"),
    ("meta", "expected one of"),
    ("gpu", "expected one of"),
    ("cuda:x", "expected one of"),
    ("CPU", "expected one of"),
    ("mps", "Apple MPS is not available"),
    ("cuda", "CUDA is not available"),
])
def test_unsupported_devices_are_one_clear_error(monkeypatch, name, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=message):
        parse_device(name)


def test_a_missing_gpu_index_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="this machine has 1 CUDA device"):
        parse_device("cuda:3")


@pytest.mark.parametrize("script", ["train_pretrain", "eval_model", "serve_openai_api"])
def test_every_entry_point_refuses_a_bad_device_in_one_line(script, corpus, tmp_path, capsys):
    module = __import__(script)
    argv = (flags(corpus, tmp_path) if script == "train_pretrain" else ["--checkpoint", str(tmp_path)])
    assert module.main([*argv, "--device", "xpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: --device xpu: expected one of auto, cpu, cuda, cuda:N, mps", err


# ---------------------------------------------------------------------- run header
@pytest.mark.parametrize("bf16", [True, False], ids=["native-bf16", "avx2-only"])
def test_the_run_header_says_what_was_chosen_and_why(corpus, tmp_path, monkeypatch, capsys, bf16):
    fake_cpu(monkeypatch, bf16)
    argv = flags(corpus, tmp_path, max_steps=1, dtype="auto", optimizer="muon", eval_interval=100)
    assert train_pretrain.main(argv) == 0
    resolved = json.loads((tmp_path / "run" / "train_config.json").read_text())["resolved"]
    expected = "bfloat16" if bf16 else "float32"
    assert resolved["dtype"] == expected and resolved["newton_schulz_dtype"] == expected
    assert resolved["newton_schulz_steps"] == (5 if bf16 else 3)
    assert resolved["precision"] == f"cpu {'with' if bf16 else 'without'} native bf16 (faked: " \
                                    f"{'native' if bf16 else 'no native'} bf16): {expected}"
    assert resolved["precision"] in capsys.readouterr().err


def test_unknown_dtypes_are_refused_and_only_fp16_gets_a_loss_scaler():
    with pytest.raises(ConfigError, match="expected auto or one of"):
        choose_dtype("fp8", CPU)
    assert Precision(CPU, FP16).scaler.is_enabled()
    assert not Precision(CPU, BF16).scaler.is_enabled() and not Precision(CPU, FP32).scaler.is_enabled()


def test_policy_for_is_the_only_decision():
    """Capabilities in, policy out: the same answer for the same hardware, whatever asked."""
    caps = Capabilities("cuda", bf16=False, fp16=True, detail="x")
    assert policy_for(caps) == policy_for(Capabilities("cuda", False, True, "x"))
    assert policy_for(caps).train == FP16


# --------------------------------------------------------------------- torch floor
@pytest.mark.parametrize("version,too_old", [("2.3.1+cpu", True), ("2.1.0", True), ("1.13.1", True),
                                             ("2.4.0", False), ("2.4.0a0+git1234", False), ("2.13.0+cpu", False),
                                             ("3.0.0", False)])
def test_the_pytorch_floor(version, too_old):
    problem = dev.torch_version_problem(version)
    assert (problem is not None) == too_old
    if too_old:
        assert problem.startswith(f"PocketLM needs PyTorch >= 2.4, this is {version}")


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train_pretrain.py", "eval_model.py", "serve_openai_api.py"])
def test_an_older_pytorch_stops_every_command_in_one_line(script):
    """Before any flag is parsed: `--help` too, since an old PyTorch would otherwise fail mid-run."""
    code = ("import runpy, sys, torch; torch.__version__ = '2.3.1+cpu'; "
            f"sys.argv = [{script!r}, '--help']; runpy.run_path({script!r}, run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "error: PocketLM needs PyTorch >= 2.4, this is 2.3.1+cpu: install a newer one for your platform (README "
        "\"Quick start\"; the CPU build: pip install torch==2.13.0)"]
