"""The training loop: overfitting, exact resume, accumulation, masking, schedule, atomic checkpoints, signals."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

import train_full_sft
import train_pretrain
from model import PocketLM, load_model
from trainer_utils import checkpoint as ckpt_mod
from trainer_utils import loop as loop_mod
from trainer_utils.components.log import TrainLog
from trainer_utils.metrics import flops_per_token, peak_flops
from trainer_utils.optim import WarmupCosine
from trainer_utils.stages import parse_train_config

from conftest import (
    ROOT,
    cli_flags,
    demo_records,
    fake_cpu,
    read_metrics,
    strict_records,
    tiny_config,
    train_through_an_empty_step,
    wait_for_metrics,
    write_jsonl,
)

TEXTS = [r["text"] for r in demo_records("pretrain_demo.jsonl", 40)]


def flags(corpus, tmp_path, run="run", **over) -> list[str]:
    """A tiny run's flags. AdamW, not pretraining's default Muon: the loop's tests compare runs to 1e-5, and Muon's
    bf16 Newton-Schulz rounds gradients equal to ~1e-7 an ulp apart (Muon's own tests: tests/test_muon.py)."""
    base = {"data_path": corpus["pretrain"], "cache_dir": corpus["cache"], "out_dir": tmp_path, "run_name": run,
            "preset": "tiny", "batch_size": 4, "max_steps": 8, "dtype": "float32", "log_interval": 2,
            "eval_interval": 4, "save_interval": 4, "num_workers": 0, "learning_rate": 1e-3, "warmup_steps": 2,
            "optimizer": "adamw"}
    return cli_flags(base, **over)


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    model, _ = load_model(run_dir)
    return model.state_dict()


def stop_at(monkeypatch, step: int) -> None:
    """Deliver SIGTERM to this process right after optimizer step `step` is logged."""
    real = TrainLog.run

    def log_then_signal(self, trainer):
        real(self, trainer)
        if trainer.state.step == step:
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(TrainLog, "run", log_then_signal)


def straight_and_resumed(monkeypatch, main: Callable[[list[str]], int], argv: Callable[..., list[str]],
                         stop: int) -> None:
    """What a resume test compares: run "straight" trained to its end, and run "resumed" stopped by a SIGTERM after
    step `stop`, then continued with --resume. `argv(run, **flags)` gives a run's command line."""
    assert main(argv("straight")) == 0
    stop_at(monkeypatch, stop)
    assert main(argv("resumed")) == 0
    monkeypatch.undo()
    assert main(argv("resumed", resume=True)) == 0


def test_overfits_a_few_samples(corpus, tmp_path):
    data = write_jsonl(tmp_path / "few.jsonl", [{"text": TEXTS[0][:300]}])
    rc = train_pretrain.main(flags(corpus, tmp_path, data_path=data, batch_size=2, max_steps=150,
                                   learning_rate=1e-2, warmup_steps=5, log_interval=10, eval_interval=1000,
                                   save_interval=1000, val_fraction=0))
    assert rc == 0
    losses = [m["loss"] for m in read_metrics(tmp_path / "run")]
    assert losses[0] > 3 and losses[-1] < 0.05, losses  # from ~ln(6400) = 8.8 to memorised


MUON = dict(optimizer="muon", muon_lr=3e-3)


@pytest.mark.parametrize("extra,cpu_bf16", [(dict(optimizer="adamw"), None), (MUON, None), (MUON, False)],
                         ids=["adamw", "muon", "muon-fp32-newton-schulz"])
def test_resume_is_bit_identical_to_an_uninterrupted_run(corpus, tmp_path, monkeypatch, extra, cpu_bf16):
    fake = (lambda: fake_cpu(monkeypatch, cpu_bf16)) if cpu_bf16 is not None else (lambda: None)
    fake()
    assert train_pretrain.main(flags(corpus, tmp_path, "straight", **extra)) == 0
    stop_at(monkeypatch, 4)
    assert train_pretrain.main(flags(corpus, tmp_path, "resumed", **extra)) == 0
    assert (tmp_path / "resumed" / "latest").read_text().strip().endswith("step_00000004")
    monkeypatch.undo()
    fake()
    assert train_pretrain.main(flags(corpus, tmp_path, "resumed", resume=True, **extra)) == 0
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    for name in a:
        assert torch.equal(a[name], b[name]), name
    steps = [m["step"] for m in read_metrics(tmp_path / "resumed")]
    assert steps == [2, 4, 6, 8]  # no step repeated or skipped


def test_fp16_grad_scaler_state_survives_resume(corpus, tmp_path, monkeypatch):
    assert train_pretrain.main(flags(corpus, tmp_path, "straight", dtype="float16")) == 0
    stop_at(monkeypatch, 4)
    assert train_pretrain.main(flags(corpus, tmp_path, "resumed", dtype="float16")) == 0
    state = torch.load(tmp_path / "resumed/checkpoints/step_00000004/training_state.pt", weights_only=True)
    assert state["scaler"]["scale"] > 0
    monkeypatch.undo()
    assert train_pretrain.main(flags(corpus, tmp_path, "resumed", dtype="float16", resume=True)) == 0
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_accumulation_matches_a_bigger_batch(corpus, tmp_path):
    common = dict(max_steps=2, log_interval=1, eval_interval=100, save_interval=100)
    assert train_pretrain.main(flags(corpus, tmp_path, "big", batch_size=8, **common)) == 0
    assert train_pretrain.main(flags(corpus, tmp_path, "acc", batch_size=4, accumulation_steps=2, **common)) == 0
    a, b = weights(tmp_path / "big"), weights(tmp_path / "acc")
    for name in a:
        # 2e-5: kernels held to AVX2 sum in another order, and AdamW's normalised update turns that into 1.02e-5 at
        # one weight of 409,600 (a lost micro-batch moves weights by ~the learning rate, 1e-3)
        torch.testing.assert_close(a[name], b[name], atol=2e-5, rtol=0)
    la = [m["loss"] for m in read_metrics(tmp_path / "big")]
    lb = [m["loss"] for m in read_metrics(tmp_path / "acc")]
    assert la == pytest.approx(lb, abs=1e-5)


def test_fully_masked_micro_batch_contributes_zero(corpus, tmp_path):
    config = parse_train_config("sft", flags(corpus, tmp_path, data_path=corpus["sft"], max_seq_len=64), "")
    trainer = loop_mod.Trainer(loop_mod.Session(config, "sft"))
    x, y = trainer.session.train_data.batch(trainer.session.train_data.global_indices(0, 4))
    masked = torch.full_like(y, -100)
    n_valid = torch.tensor(float((y != -100).sum()))
    params = [p for p in trainer.model.parameters()]

    def grads(micro):
        trainer.optimizer.zero_grad(set_to_none=True)
        loss = trainer.train_step(micro, n_valid)
        return loss, [p.grad.clone() for p in params]

    loss_a, ga = grads([(x, y)])
    loss_b, gb = grads([(x, masked), (x, y)])  # an extra micro-batch with no targets at all
    assert torch.isfinite(loss_b) and loss_a == loss_b
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_warmup_cosine_schedule_values():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    s = WarmupCosine(opt, max_lr=1.0, min_lr=0.1, warmup=10, total=110)
    assert s.lr_at(0) == pytest.approx(0.1) and s.lr_at(4) == pytest.approx(0.5)
    assert s.lr_at(9) == pytest.approx(1.0)  # peak at the end of warmup
    assert s.lr_at(60) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert s.lr_at(110) == pytest.approx(0.1) and s.lr_at(500) == pytest.approx(0.1)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)  # applied to the optimizer at once
    for _ in range(9):
        s.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0)


def test_crash_while_checkpointing_keeps_the_previous_checkpoint(corpus, tmp_path, monkeypatch):
    real_save = torch.save
    calls = []

    def crash_on_second(obj, f, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            Path(f).write_bytes(b"partial")  # half-written file, then the machine "dies"
            raise OSError("disk full")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(ckpt_mod.torch, "save", crash_on_second)
    with pytest.raises(OSError, match="disk full"):
        train_pretrain.main(flags(corpus, tmp_path))
    run = tmp_path / "run"
    assert (run / "latest").read_text().strip() == "checkpoints/step_00000004"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000004"]  # no temp debris
    model, _ = load_model(run)  # still loadable for inference...
    monkeypatch.undo()
    assert train_pretrain.main(flags(corpus, tmp_path, resume=True)) == 0  # ...and for resuming
    assert (run / "latest").read_text().strip() == "checkpoints/step_00000008"


@pytest.mark.slow
def test_sigterm_to_a_training_process_checkpoints_and_resumes(corpus, tmp_path):
    cmd = [sys.executable, "train_pretrain.py", *flags(corpus, tmp_path, max_steps=100000, log_interval=1,
                                                       save_interval=100000, eval_interval=100000)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert wait_for_metrics(tmp_path / "run", lines=3), proc.kill() or proc.communicate()[1][-2000:]
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "SIGTERM received: checkpointed step" in err
    state = torch.load(next((tmp_path / "run/checkpoints").iterdir()) / "training_state.pt", weights_only=True)
    stopped = state["step"]
    assert 3 <= stopped < 100000
    rc = train_pretrain.main(flags(corpus, tmp_path, max_steps=stopped + 2, resume=True, log_interval=1))
    assert rc == 0
    assert [m["step"] for m in read_metrics(tmp_path / "run")][-2:] == [stopped + 1, stopped + 2]


def test_sft_from_pretrain_checkpoint(corpus, tmp_path):
    assert train_pretrain.main(flags(corpus, tmp_path, "pre", max_steps=4)) == 0
    rc = train_full_sft.main(flags(corpus, tmp_path, "sft", data_path=corpus["sft"], init_from=tmp_path / "pre",
                                   max_steps=4, max_seq_len=64, preset=None))
    assert rc == 0
    info = json.loads((tmp_path / "sft/checkpoints/step_00000004/train_info.json").read_text())
    assert info["prompt_format"] == "chat" and info["step"] == 4 and "stage" not in info
    pre, sft = weights(tmp_path / "pre"), weights(tmp_path / "sft")
    assert not torch.equal(pre["embed_tokens.weight"], sft["embed_tokens.weight"])


def test_existing_run_is_not_clobbered(corpus, tmp_path, capsys):
    assert train_pretrain.main(flags(corpus, tmp_path, max_steps=2)) == 0
    assert train_pretrain.main(flags(corpus, tmp_path, max_steps=2)) == 2
    assert "already holds a run; pass --resume" in capsys.readouterr().err
    assert train_pretrain.main(flags(corpus, tmp_path, max_steps=2, overwrite=True)) == 0


def test_a_run_without_checkpoints_is_not_appended_to(corpus, tmp_path, capsys):
    """A --no-checkpoints run leaves only its metrics: a second run of its name is refused like any other, and
    --overwrite starts its metrics afresh (it appended to the first run's, two runs' curves in one file)."""
    quiet = [*flags(corpus, tmp_path, max_steps=2, eval_interval=1), "--no-checkpoints"]
    assert train_pretrain.main(quiet) == 0
    assert train_pretrain.main(quiet) == 2
    assert "already holds a run; pass --resume" in capsys.readouterr().err
    assert train_pretrain.main([*quiet, "--overwrite"]) == 0
    evaluations = [r["step"] for r in map(json.loads, (tmp_path / "run/metrics.jsonl").open()) if "val_loss" in r]
    assert evaluations == [1, 2]


def test_bad_data_is_a_one_line_error(corpus, tmp_path, capsys):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, "{nope"])
    assert train_pretrain.main(flags(corpus, tmp_path, data_path=bad)) == 2
    assert "bad.jsonl:2: invalid JSON" in capsys.readouterr().err


def test_wandb_offline_and_tensorboard_logging(corpus, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert train_pretrain.main(flags(corpus, tmp_path, max_steps=4, use_wandb=True, use_tensorboard=True)) == 0
    run = tmp_path / "run"
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    offline = list((run / "wandb").glob("offline-run-*"))
    assert offline, "wandb must default to offline mode without an API key"
    record = read_metrics(run)[0]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "data_wait_frac", "peak_rss_gb"} <= set(record)
    assert "mfu" not in record  # no known peak FLOPs on CPU: omitted, not 0


def test_out_of_memory_stops_with_advice_and_keeps_the_last_checkpoint(corpus, tmp_path, monkeypatch, capsys):
    """The CUDA OOM path, exercised on CPU: a clear message naming the knobs, no traceback, checkpoint intact."""
    assert train_pretrain.main(flags(corpus, tmp_path, max_steps=4)) == 0
    original = loop_mod.Trainer.train_step

    def fail_at_step_6(self, micro, n_valid):
        if self.state.step == 5:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original(self, micro, n_valid)

    monkeypatch.setattr(loop_mod.Trainer, "train_step", fail_at_step_6)
    capsys.readouterr()
    assert train_pretrain.main(flags(corpus, tmp_path, max_steps=8, resume=True)) == 1
    message = capsys.readouterr().err.strip().splitlines()[-1]  # one line, no traceback
    assert message.startswith("error: out of GPU memory") and "--batch_size" in message
    assert "--grad_checkpointing" in message and "--max_seq_len" in message
    assert (tmp_path / "run/latest").read_text().strip().endswith("step_00000004")
    assert load_model(tmp_path / "run")[0].config.num_hidden_layers == 2  # the checkpoint still loads


@pytest.mark.parametrize("overrides", [{}, {"num_key_value_heads": 1}, {"tie_word_embeddings": False},
                                       {"style": "gpt2"}])
def test_mfu_flop_model_matches_counted_flops(overrides):
    """flops_per_token (the MFU numerator) against PyTorch's own count of one forward + backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    cfg = tiny_config(**overrides)
    model = PocketLM(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 64))
    # the math backend runs attention as counted matmuls; the CPU flash kernel is invisible to the counter
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x).float().sum().backward()
    # the model counts norm weights and biases as matmul weights: a <2% overestimate at d64, less when larger
    assert counter.get_total_flops() == pytest.approx(flops_per_token(cfg, 64) * x.numel(), rel=0.02)


@pytest.mark.parametrize("name,peak", [("NVIDIA H200", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                       ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A10G", 70e12),
                                       ("NVIDIA A10", 125e12), ("NVIDIA L40S", 362e12), ("NVIDIA L4", 121e12),
                                       ("NVIDIA GeForce RTX 4070 Ti", 80e12), ("NVIDIA GeForce RTX 4070", 58e12),
                                       ("NVIDIA H200 NVL", 835e12), ("NVIDIA H100 NVL", 835e12),
                                       ("Some Future GPU", None)])
def test_peak_flops_lookup_prefers_the_most_specific_name(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda", 0)) == peak
    assert peak_flops(torch.device("cpu")) is None


@pytest.mark.parametrize("flag", ["grad_checkpointing", pytest.param("compile", marks=pytest.mark.slow)])
def test_memory_and_speed_flags_train_the_same_model(corpus, tmp_path, flag):
    """--grad_checkpointing recomputes activations, --compile fuses kernels: neither changes the math."""
    common = dict(max_steps=3, log_interval=1, eval_interval=100, save_interval=100)
    assert train_pretrain.main(flags(corpus, tmp_path, "plain", **common)) == 0
    assert train_pretrain.main(flags(corpus, tmp_path, "flag", **{flag: True}, **common)) == 0
    a, b = weights(tmp_path / "plain"), weights(tmp_path / "flag")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4)


# fused (device-side skip), plain (host check) and two optimizers in one (host check)
@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "muon"])
def test_non_finite_steps_are_skipped_then_training_stops(corpus, tmp_path, monkeypatch, optimizer):
    config = parse_train_config(
        "pretrain", flags(corpus, tmp_path, optimizer=optimizer, max_bad_steps=3, log_interval=1, max_steps=20), "")
    trainer = loop_mod.Trainer(loop_mod.Session(config, "pretrain"))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    real_step = trainer.train_step

    def poisoned(micro, n_valid):
        loss = real_step(micro, n_valid)
        next(trainer.model.parameters()).grad.fill_(float("nan"))  # as an fp overflow would
        return loss

    monkeypatch.setattr(trainer, "train_step", poisoned)
    assert trainer.fit() == 1
    assert trainer.state.step == 3 and trainer.state.skipped == 3
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a skipped step must not touch the weights"
    assert not (tmp_path / "run" / "latest").exists()  # nothing saved from the broken run
    adam_steps = [float(state["step"]) for state in trainer.optimizer.state.values() if "step" in state]
    assert all(n == 0 for n in adam_steps)  # Adam's bias-correction clock did not advance either
    records = [r for r in strict_records(tmp_path / "run") if "loss" in r]  # strict JSON, no bare NaN
    assert [(r["loss"], r["grad_norm"], r["skipped_steps"]) for r in records] == [(None, None, n) for n in (1, 2, 3)]


def test_a_skipped_step_leaves_the_logged_loss_finite(corpus, tmp_path, monkeypatch):
    """The window's loss averages the applied steps only: a NaN step must not turn the whole window NaN."""
    config = parse_train_config("pretrain", flags(corpus, tmp_path, max_steps=4, log_interval=4), "")
    trainer = loop_mod.Trainer(loop_mod.Session(config, "pretrain"))
    real_step = trainer.train_step

    def poison_step_2(micro, n_valid):
        loss = real_step(micro, n_valid)
        if trainer.state.step == 1:  # the second step
            next(trainer.model.parameters()).grad.fill_(float("nan"))
            loss = loss * float("nan")
        return loss

    monkeypatch.setattr(trainer, "train_step", poison_step_2)
    assert trainer.fit() == 0
    [record] = [r for r in strict_records(tmp_path / "run") if "loss" in r]
    assert record["skipped_steps"] == 1 and math.isfinite(record["loss"]) and 3 < record["loss"] < 9


@pytest.mark.parametrize("extra", [[], ["--dtype", "float16"], ["--optimizer", "sgd"], ["--optimizer", "muon"],
                                   ["--optimizer", "muon", "--dtype", "float16"]],
                         ids=["fused-adamw", "fp16-scaler", "sgd", "muon", "muon-fp16"])
def test_a_step_without_targets_is_skipped(corpus, tmp_path, monkeypatch, extra):
    """No valid target in the whole step: nothing to learn, so no weight decay or momentum either."""
    out = train_through_an_empty_step(flags(corpus, tmp_path, max_steps=1, log_interval=1) + extra, monkeypatch)
    assert out["weights_moved"] == [] and not out["optimizer_moved"] and out["skipped"] == 1
    [record] = [r for r in out["records"] if "loss" in r]
    assert record["loss"] is None and record["skipped_steps"] == 1 and record["tokens_seen"] == 0


def test_tf32_switch_sets_cuda_matmul_precision_only():
    """Every view of the CUDA TF32 setting agrees and reads without error (Inductor reads the legacy one), and
    oneDNN's CPU matmul precision is untouched. tests/conftest.py restores the setting after every test."""
    from trainer_utils import runtime
    matmul = torch.backends.cuda.matmul
    cpu_before = torch.backends.mkldnn.matmul.fp32_precision
    for enabled, new, generic in ((True, "tf32", "high"), (False, "ieee", "highest")):
        runtime.set_cuda_tf32(enabled)
        assert matmul.allow_tf32 is enabled
        assert matmul.fp32_precision == new
        assert torch.get_float32_matmul_precision() == generic
        assert torch.backends.mkldnn.matmul.fp32_precision == cpu_before
    assert parse_train_config("pretrain", ["--no-tf32"], "").precision.tf32 is False


REUSE_PROBE = """
import resource, sys, torch
from trainer_utils.runtime import tune_allocator
applied = tune_allocator() if sys.argv[1] == "tuned" else None

def faults_of_a_buffer() -> int:  # a step's large buffer: allocated, written, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(64 << 20, dtype=torch.uint8)
    del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults = [faults_of_a_buffer() for _ in range(16)]  # the first ones grow the heap to hold it (the first steps)
print(applied, min(faults[2:]), max(faults[-4:]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux")
def test_the_tuned_allocator_reuses_a_freed_buffer_without_faulting_its_pages_again():
    """The kernel's count of page faults: glibc by default returns a freed 64 MiB buffer to the system, so every next
    one faults its 16,384 pages in again; after tune_allocator() (what every training run does first), once the
    heap has grown to hold it, it comes back from the heap. An allocator the environment chose is left alone.

    The heap takes a few buffers to get there: torch asks for 64-byte aligned memory, for which glibc asks itself
    for a little more (room to align) and gives the excess back, so when a small block still in use lies after a
    freed buffer, its block is a little too small for the next request of the same size: that one goes on top of
    the heap, until freed blocks lie side by side and merge (with ctypes, a 64 MiB malloc reused its freed block at
    once, posix_memalign faulted 5 to 9 more times). In 20 processes the last buffer that faulted was at most the
    6th; a loop of 24 grew the heap to 467 MiB and no further."""
    def probe(mode: str, **env: str) -> tuple[str, int, int]:
        """Whether it applied; the fewest page faults of a buffer after the first two, and the most of the last 4."""
        done = subprocess.run([sys.executable, "-c", REUSE_PROBE, mode], capture_output=True, text=True, check=True,
                              cwd=ROOT, env={**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")},
                                             **env})
        applied, fewest, last = done.stdout.split()
        return applied, int(fewest), int(last)

    applied, fewest, _ = probe("default")
    assert fewest >= 16384 * 0.9  # every one of them faulted
    applied, _, last = probe("tuned")
    assert applied == "True" and last < 100  # the last buffers came from the heap
    assert probe("tuned", MALLOC_ARENA_MAX="2")[0] == "False"


SPIN_PROBE = """
import resource, sys, time
if sys.argv[1] == "trainer_utils":
    import trainer_utils  # as every training script imports it: before PyTorch
import torch
torch.set_num_threads(2)
x = torch.ones(1 << 20)
def cpu_s():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
for _ in range(20):
    x.add_(1)  # the thread pool is up
t0 = cpu_s()
for _ in range(100):  # a parallel add, then a pause in which the pool's threads wait
    x.add_(1)
    time.sleep(0.005)
print(cpu_s() - t0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or (os.cpu_count() or 1) < 2,
                    reason="GNU OpenMP (PyTorch's Linux thread pool), two threads")
def test_training_processes_leave_the_cores_soon_after_a_parallel_region():
    """OpenMP's threads spin on their cores for a while after each parallel region before they sleep: the CPU time
    of a process that adds in parallel and pauses 100 times. With the training machinery imported first (its
    GOMP_SPINCOUNT, trainer_utils/__init__.py) they sleep ten times sooner here; another process beside a run gets
    the cores back (bench/bench_sharing.py)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}

    def cpu_s(mode: str) -> float:
        done = subprocess.run([sys.executable, "-c", SPIN_PROBE, mode], capture_output=True, text=True, check=True,
                              cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)})
        return float(done.stdout)

    assert cpu_s("plain") > 3 * cpu_s("trainer_utils")


def test_the_spin_count_is_left_to_an_environment_that_chooses_it(monkeypatch):
    import trainer_utils

    for chosen in ({"GOMP_SPINCOUNT": "INFINITE"}, {"OMP_WAIT_POLICY": "ACTIVE"}):
        monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        for k, v in chosen.items():
            monkeypatch.setenv(k, v)
        assert trainer_utils.share_cores() is False and os.environ.get("GOMP_SPINCOUNT") == chosen.get("GOMP_SPINCOUNT")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert trainer_utils.share_cores() is True and os.environ["GOMP_SPINCOUNT"] == trainer_utils.SPIN_COUNT == "10000"


def test_the_skipped_step_count_survives_a_resume(corpus, tmp_path, monkeypatch):
    real = loop_mod.Trainer.train_step

    def poison_step_2(self, micro, n_valid):
        loss = real(self, micro, n_valid)
        if self.state.step == 1:
            next(self.model.parameters()).grad.fill_(float("nan"))
        return loss

    monkeypatch.setattr(loop_mod.Trainer, "train_step", poison_step_2)
    stop_at(monkeypatch, 4)
    assert train_pretrain.main(flags(corpus, tmp_path)) == 0
    monkeypatch.undo()
    assert train_pretrain.main(flags(corpus, tmp_path, resume=True)) == 0
    assert [(r["step"], r["skipped_steps"]) for r in read_metrics(tmp_path / "run")] == [(2, 1), (4, 1), (6, 1),
                                                                                         (8, 1)]


def test_no_checkpoints_writes_none(corpus, tmp_path, capsys):
    """What the throughput benchmark runs with: a 104M model's final checkpoint is 1.25 GB with its optimizer
    state, fsynced, for nothing."""
    assert train_pretrain.main(flags(corpus, tmp_path, max_steps=4) + ["--no-checkpoints"]) == 0
    run = tmp_path / "run"
    assert not (run / "checkpoints").exists() and not (run / "latest").exists()
    assert [m["step"] for m in read_metrics(run)] == [2, 4]
    argv = flags(corpus, tmp_path, "early", early_stop_patience=2, val_fraction=0.1) + ["--no-checkpoints"]
    assert train_pretrain.main(argv) != 0
    assert "need checkpoints" in capsys.readouterr().err


def test_init_from_refuses_another_tokenizer(corpus, tmp_path, capsys):
    """The --init_from weights learned their tokenizer's ids: fine-tuning them through another --tokenizer would
    train silently on mismatched ids. The checkpoint's own tokenizer (or no --tokenizer) is fine."""
    import shutil
    assert train_pretrain.main(flags(corpus, tmp_path, "base", max_steps=2)) == 0
    other = tmp_path / "other_tokenizer"
    shutil.copytree(ROOT / "model" / "tokenizer", other)
    (other / "tokenizer.json").write_text(json.dumps(json.loads((other / "tokenizer.json").read_text())) + "\n")
    sft = flags(corpus, tmp_path, "sft", data_path=corpus["sft"], preset=None, max_steps=1, init_from=tmp_path / "base")
    assert train_full_sft.main([*sft, "--tokenizer", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"error: --tokenizer {other} is not the tokenizer --init_from" in err and "Traceback" not in err
    assert train_full_sft.main([*sft, "--overwrite"]) == 0  # the checkpoint's tokenizer


def test_a_run_made_with_the_previous_default_tokenizer_keeps_it(corpus, tmp_path, monkeypatch):
    """A run begun when model/tokenizer-v1 was the default (no --tokenizer) resumes bit-identically with it after
    the default changed, and fine-tunes and loads with it: a checkpoint carries its tokenizer, checked by hash."""
    import trainer_utils.session as session_mod
    from dataset.tokenizer import DEFAULT_TOKENIZER_DIR, Tokenizer

    previous = Tokenizer(ROOT / "model" / "tokenizer-v1")
    assert previous.sha256 != Tokenizer(DEFAULT_TOKENIZER_DIR).sha256
    monkeypatch.setattr(session_mod, "DEFAULT_TOKENIZER_DIR", previous.path)  # the default of that time
    assert train_pretrain.main(flags(corpus, tmp_path, "straight")) == 0
    stop_at(monkeypatch, 4)
    assert train_pretrain.main(flags(corpus, tmp_path, "resumed")) == 0
    monkeypatch.undo()  # the default is the shipped tokenizer again
    assert train_pretrain.main(flags(corpus, tmp_path, "resumed", resume=True)) == 0
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert Tokenizer(load_model(tmp_path / "resumed")[1]).sha256 == previous.sha256
    sft = cli_flags({"data_path": corpus["sft"], "cache_dir": corpus["cache"], "out_dir": tmp_path, "run_name": "sft",
                     "batch_size": 2, "max_steps": 2, "dtype": "float32", "num_workers": 0,
                     "init_from": tmp_path / "resumed"})
    assert train_full_sft.main(sft) == 0
    model, where = load_model(tmp_path / "sft")
    assert Tokenizer(where).sha256 == previous.sha256 and model is not None
