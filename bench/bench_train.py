"""Training throughput per preset: tokens/s, step time, the optimizer's share, loop overhead, data wait, MFU, memory.

    python bench/bench_train.py [--presets tiny mini-30m minimind-26m] [--dtypes float32 auto] [--compile both]
    python bench/bench_train.py --recipe recipes/demo-pretrain.yaml --optimizers adamw muon --compile off

For every (preset, dtype, compile, optimizer) it measures
  - the bare step: forward + loss + backward + clip + optimizer step (--optimizers: AdamW and Muon by default)
    on one fixed batch, in a tight loop, and the optimizer step alone on the same gradients (optimizer_step_s,
    and optimizer_frac, its share of the bare step);
  - the real loop: train_pretrain.py in-process on the bundled corpus (data feeding, logging, bookkeeping);
each as the fastest of --repeats blocks of equal length. Muon's rows also get vs_adamw: their bare and loop step
times over AdamW's in the same setting (the goals in docs/precision.md: <= 1.3 on the demo recipe, <= 1.5 on
minimind-26m at 8 x 512 tokens, on any CPU). --recipe takes the model shape, context and batch size of a training recipe
instead of --presets. --dtypes auto is the precision policy's choice for this device (common/device.py): bf16
where it is native, fp32 on CPUs without it, where a bf16 row would only time emulation; each row says why.
It reports both step times, the loop overhead (the share of the loop's step time spent outside
forward/backward/optimizer: measured inside the same run on CPU, 1 - bare / loop step time on CUDA; target
<= 3%), the data-wait fraction, effective (non-padding) tokens/s,
MFU where the device's peak is known (the loop's, and the bare step's as bare_mfu), and the loop run's peak
memory (CUDA allocations, or the process's peak RSS).

Mixture-of-experts presets also report the dispatch share: the time one MoE layer's forward + backward spends
outside its experts' matmuls (routing, sorting, gathering and combining the tokens), times the layers, over the
bare step time. And a MoE preset measured beside a dense preset with the same active parameters (e.g.
minimind-26m-moe and minimind-26m) gets their bare step-time ratio, which docs/moe.md's target keeps below 1.3:

    python bench/bench_train.py --presets minimind-26m minimind-26m-moe --dtypes bfloat16 --compile off
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train_pretrain  # noqa: E402
from common.device import (  # noqa: E402
    DTYPES,
    choose_dtype,
    cpu_model,
    dtype_name,
    parse_device,
    precision_policy,
    timed,
)
from common.files import METRICS_NAME  # noqa: E402
from model import ModelConfig, PocketLM  # noqa: E402
from model.config import config_from_flags, get_preset  # noqa: E402
from model.model import MoE  # noqa: E402
from trainer_utils.backend import TorchBackend  # noqa: E402
from trainer_utils.config import TrainConfig  # noqa: E402
from trainer_utils.loop import Trainer  # noqa: E402
from trainer_utils.metrics import flops_per_token, peak_flops  # noqa: E402
from trainer_utils.optim import build_optimizer  # noqa: E402
from trainer_utils.runtime import Precision  # noqa: E402
from trainer_utils.stages import parse_train_config  # noqa: E402


def reset_peak_rss() -> None:
    """Restart the kernel's peak-RSS count (Linux >= 4.0), so each setting reports its own peak."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # elsewhere: the process-wide peak so far
        pass


def peak_rss_gb() -> float:
    """Peak resident memory of this process since the last reset, in GiB."""
    try:
        kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(kb / 2**20, 3)


def seconds_per_call(fn, n: int, device: torch.device) -> float:
    """Mean seconds of n calls of fn, the device's queued work included."""
    return timed(lambda: [fn() for _ in range(n)], device) / n


class BareStep:
    """Forward + loss + backward + clip + optimizer step on one fixed batch, for one model and optimizer."""

    def __init__(self, cfg: ModelConfig, dtype: str, compile_model: bool, batch: int, seq: int,
                 device: torch.device, optimizer: str) -> None:
        torch.manual_seed(0)  # every optimizer starts from the same weights
        self.model = PocketLM(cfg).to(device).train()
        self.opt = build_optimizer(self.model, optimizer, 1e-4, 0.1, (0.9, 0.95), 0.9, device)
        self.precision, self.device = Precision(device, DTYPES[dtype]), device
        self.fwd = torch.compile(self.model) if compile_model else self.model
        self.x = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
        self.y = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)

    def backward(self) -> None:
        with self.precision.autocast():
            logits = self.fwd(self.x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), self.y.flatten(), reduction="sum") / self.y.numel()
        self.precision.scaler.scale(loss).backward()

    def step(self) -> None:
        self.backward()
        scaler = self.precision.scaler
        scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        scaler.step(self.opt)
        scaler.update()
        self.opt.zero_grad(set_to_none=True)

    def seconds(self, n: int) -> float:
        """Mean seconds of n whole steps."""
        return seconds_per_call(self.step, n, self.device)

    def optimizer_seconds(self, n: int) -> float:
        """Mean seconds of n optimizer steps alone, on gradients left by one more backward (the weights drift a
        little with each call; the arithmetic per call is the same)."""
        self.backward()
        seconds = seconds_per_call(self.opt.step, n, self.device)
        self.opt.zero_grad(set_to_none=True)
        return seconds


def bare_steps(cfg: ModelConfig, dtype: str, compile_model: bool, batch: int, seq: int, steps: int | None,
               min_seconds: float, repeats: int, device: torch.device,
               optimizers: list[str]) -> tuple[int, dict[str, tuple[float, float]]]:
    """The steps per measured block, and per optimizer the time of a bare step and of its optimizer step alone.

    Each of `repeats` rounds times one block of `steps` steps per optimizer, the optimizers taking turns, so a
    machine whose speed drifts (a shared 2-core VM moves by 5-25% within minutes) slows them alike; the fastest
    block of each is reported, the one least disturbed (the loop is measured the same way, so the two compare
    like for like). With `steps` None a block lasts about `min_seconds` (at least 6 steps)."""
    runs = {name: BareStep(cfg, dtype, compile_model, batch, seq, device, name) for name in optimizers}
    for run in runs.values():
        run.seconds(3)  # warm-up (and compilation)
    if steps is None:
        steps = max(6, min(500, math.ceil(min_seconds / next(iter(runs.values())).seconds(2))))
    bare = {name: [] for name in runs}
    alone = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            bare[name].append(run.seconds(steps))
            alone[name].append(run.optimizer_seconds(steps))
    return steps, {name: (min(bare[name]), min(alone[name])) for name in runs}


def dispatch_share(cfg: ModelConfig, dtype: str, batch: int, seq: int, bare_step: float, repeats: int,
                   device: torch.device) -> dict:
    """Seconds of one MoE layer's forward + backward on batch*seq tokens, of its experts alone on the same
    tokens already grouped by expert, and the difference (the dispatch) times the layers over the bare step."""
    torch.manual_seed(0)
    layer: MoE = PocketLM(cfg).layers[0].mlp.to(device)  # initialised as in training
    precision = Precision(device, DTYPES[dtype])
    x = torch.randn(batch, seq, cfg.hidden_size, device=device, requires_grad=True)
    with torch.no_grad(), precision.autocast():
        choice = layer.route(layer.gate(x.reshape(-1, cfg.hidden_size)).float())[1].flatten()
    counts = torch.bincount(choice, minlength=cfg.num_experts)
    grouped = x.detach().reshape(-1, cfg.hidden_size)[choice.argsort(stable=True) // cfg.num_experts_per_tok]
    grouped.requires_grad_(True)

    def whole() -> None:
        with precision.autocast():
            out, _ = layer(x)
        out.float().sum().backward()

    def experts() -> None:
        with precision.autocast():
            out = layer.experts(grouped, counts)
        if layer.shared_experts is not None:  # every token's shared experts are not dispatch either
            with precision.autocast():
                out = out.sum() + layer.shared_experts(x).sum()
        out.float().sum().backward()

    whole(), experts()  # warm-up
    t_whole = min(seconds_per_call(whole, 5, device) for _ in range(repeats))
    t_experts = min(seconds_per_call(experts, 5, device) for _ in range(repeats))
    dispatch = max(0.0, t_whole - t_experts)
    return {"moe_layer_s": round(t_whole, 5), "experts_s": round(t_experts, 5),
            "dispatch_share": round(dispatch * cfg.num_hidden_layers / bare_step, 4)}


def same_compute(ca: ModelConfig, cb: ModelConfig) -> bool:
    """Whether model a is a mixture of experts and b a dense model of the same shape and active parameters."""
    return (ca.moe and not cb.moe and (ca.hidden_size, ca.num_hidden_layers) == (cb.hidden_size, cb.num_hidden_layers)
            and abs(ca.num_parameters(active=True) / cb.num_parameters() - 1) < 0.01)


@contextlib.contextmanager
def timing_compute() -> Iterator[list[float]]:
    """Records the seconds each training step spends in compute (Trainer.train_step + the backend's step).

    Whatever else a step takes (data hand-off, counters, scheduler, logging) is loop overhead. Measuring both
    inside one run makes the overhead immune to the machine's speed drifting between two separate runs,
    which on a shared 2-core VM moves step times by 5-10%. CPU only: CUDA runs asynchronously, so there the
    compute calls return after launching kernels, and synchronising to time them would serialise the very
    overlap of host work and GPU work the loop is built for."""
    per_step: list[float] = []
    originals = {(Trainer, "train_step"): Trainer.train_step, (TorchBackend, "step"): TorchBackend.step}

    def timed(fn, closes_step: bool):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            spent = time.perf_counter() - t0
            if closes_step:
                per_step[-1] += spent
            else:
                per_step.append(spent)
            return out
        return wrapper

    Trainer.train_step = timed(Trainer.train_step, closes_step=False)
    TorchBackend.step = timed(TorchBackend.step, closes_step=True)
    try:
        yield per_step
    finally:
        for (cls, name), fn in originals.items():
            setattr(cls, name, fn)


def loop_metrics(model_args: list[str], name: str, dtype: str, compile_model: bool, batch: int, seq: int, steps: int,
                 repeats: int, out: Path, data: list[str], device: torch.device, optimizer: str = "adamw") -> dict:
    """The fastest logged window of `steps` steps of a real train_pretrain.py run, after one warm-up window,
    with the share of its time spent outside compute (on CPU; None on CUDA, see timing_compute). `model_args`
    name the model: --preset P, or --config RECIPE."""
    run = f"{name}-{dtype}-{'compile' if compile_model else 'eager'}-{optimizer}"
    argv = [*model_args, *data, "--dtype", dtype, "--batch_size", str(batch), "--max_seq_len", str(seq),
            "--max_steps", str((1 + repeats) * steps), "--log_interval", str(steps), "--eval_interval", "1000000",
            "--save_interval", "1000000", "--no-checkpoints", "--out_dir", str(out), "--run_name", run, "--overwrite",
            "--optimizer", optimizer]
    if compile_model:
        argv.append("--compile")
    with timing_compute() if device.type == "cpu" else contextlib.nullcontext() as compute:
        assert train_pretrain.main(argv) == 0
    records = [json.loads(line) for line in open(out / run / METRICS_NAME) if '"loss"' in line]
    best = min(range(1, len(records)), key=lambda i: records[i]["step_time_s"])
    if compute is None:
        return {**records[best], "overhead_frac": None}
    assert len(compute) == len(records) * steps, "a step ran without compute: steps and windows misalign"
    overhead = 1 - sum(compute[best * steps:(best + 1) * steps]) / (records[best]["step_time_s"] * steps)
    return {**records[best], "overhead_frac": round(max(0.0, overhead), 4)}


def models(args: argparse.Namespace, recipe: TrainConfig | None, seq: int) -> list[tuple[str, ModelConfig, list[str]]]:
    """(name, config at context `seq`, the train_pretrain.py flags that build it) per preset, or for --recipe."""
    if recipe is not None:
        options = dataclasses.replace(recipe.model, max_seq_len=seq)
        return [(Path(args.recipe).stem, config_from_flags(options), ["--config", args.recipe])]
    return [(preset, get_preset(preset, max_seq_len=seq,
                                max_position_embeddings=max(seq, get_preset(preset).max_position_embeddings)),
             ["--preset", preset]) for preset in args.presets]


def dtypes(names: list[str], device: torch.device) -> list[tuple[str, str]]:
    """(dtype, why) per --dtypes entry, auto resolved by the precision policy, each dtype once."""
    chosen: dict[str, str] = {}
    for name in names:
        choice = choose_dtype(name, device)
        chosen.setdefault(dtype_name(choice.dtype), choice.reason)
    return list(chosen.items())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "mini-30m", "minimind-26m"])
    p.add_argument("--recipe", default=None, help="measure a recipe's model, context and batch size instead "
                                                  "(e.g. recipes/demo-pretrain.yaml)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "auto"],
                   help="autocast dtypes; auto: the precision policy's for this device (default: float32 auto)")
    p.add_argument("--compile", choices=("off", "on", "both"), default="both")
    p.add_argument("--batch_size", type=int, default=None, help="default: the recipe's; else 8 on CPU, 32 on GPU")
    p.add_argument("--max_seq_len", type=int, default=None, help="default: the recipe's; else 256 on CPU, 512 on GPU")
    p.add_argument("--steps", type=int, default=None,
                   help="measured steps (default: enough to fill --min_seconds, at least 6)")
    p.add_argument("--min_seconds", type=float, default=3.0, help="default block length when --steps is unset")
    p.add_argument("--repeats", type=int, default=3, help="measured blocks per setting; the fastest is reported")
    p.add_argument("--optimizers", "--optimizer", nargs="+", choices=("adamw", "muon"), default=["adamw", "muon"],
                   help="optimizers measured, each in both measurements (muon: its Newton-Schulz step included)")
    p.add_argument("--data_path", default=None, help="corpus for the loop run (default: the recipe's or the demo)")
    p.add_argument("--cache_dir", default=None, help="its token cache (default: beside the corpus)")
    p.add_argument("--device", default="auto", help="auto (CUDA, else MPS, else CPU) | cpu | cuda[:N] | mps")
    p.add_argument("--out", default=None, help="write the results JSON here")
    return p.parse_args(argv)


def compare(results: list[tuple[ModelConfig, dict]]) -> None:
    """Add to each row what it is against its peers, and print it: Muon against AdamW on the same model and
    setting (what the default optimizer costs per step), a mixture of experts against the dense model of equal
    active parameters (same dtype, compile setting and optimizer)."""
    for cfg, row in results:
        same = [(c, r) for c, r in results if (r["dtype"], r["compile"]) == (row["dtype"], row["compile"])]
        adamw = next((r for c, r in same if r["preset"] == row["preset"] and r["optimizer"] == "adamw"), None)
        if row["optimizer"] == "muon" and adamw is not None:
            row["vs_adamw"] = {"bare_step_ratio": round(row["bare_step_s"] / adamw["bare_step_s"], 3),
                               "loop_step_ratio": round(row["loop_step_s"] / adamw["loop_step_s"], 3)}
            print(f"{row['preset']} ({row['dtype']}): Muon's step x{row['vs_adamw']['bare_step_ratio']} AdamW's "
                  f"(loop x{row['vs_adamw']['loop_step_ratio']}); optimizer {row['optimizer_frac']:.0%} of the step "
                  f"against {adamw['optimizer_frac']:.0%}", flush=True)
        dense = next((r for c, r in same if same_compute(cfg, c) and r["optimizer"] == row["optimizer"]), None)
        if dense is not None:
            row["vs_dense"] = {"preset": dense["preset"], "bare_step_ratio": round(row["bare_step_s"] /
                                                                                   dense["bare_step_s"], 3),
                               "tokens_per_s_ratio": round(row["tokens_per_s"] / dense["tokens_per_s"], 3)}
            print(f"{row['preset']} vs {dense['preset']} ({row['dtype']}): step time x"
                  f"{row['vs_dense']['bare_step_ratio']}, tokens/s x{row['vs_dense']['tokens_per_s_ratio']}",
                  flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    data = [f"--{k}={v}" for k in ("data_path", "cache_dir") if (v := getattr(args, k)) is not None]
    device = parse_device(args.device)
    gpu = device.type == "cuda"
    recipe = parse_train_config("pretrain", ["--config", args.recipe], None) if args.recipe else None
    batch = args.batch_size or (recipe.optim.batch_size if recipe else 32 if gpu else 8)
    seq = args.max_seq_len or (recipe.model.max_seq_len if recipe and recipe.model.max_seq_len else
                               512 if gpu else 256)
    compiles = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    peak = peak_flops(device)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg, model_args in models(args, recipe, seq):
            for dtype, why in dtypes(args.dtypes, device):
                for comp in compiles:
                    n, timings = bare_steps(cfg, dtype, comp, batch, seq, args.steps, args.min_seconds, args.repeats,
                                            device, args.optimizers)
                    gc.collect()  # the bare steps' models and optimizers are gone before the loop runs
                    for optimizer, (bare, opt_s) in timings.items():
                        if gpu:  # the peak of this loop run
                            torch.cuda.reset_peak_memory_stats()
                        else:
                            reset_peak_rss()
                        loop = loop_metrics(model_args, name, dtype, comp, batch, seq, n, args.repeats, Path(tmp),
                                            data, device, optimizer)
                        row = {"preset": name, "dtype": dtype, "precision": why, "compile": comp,
                               "optimizer": optimizer, "batch_size": batch, "seq_len": seq, "measured_steps": n,
                               "bare_step_s": round(bare, 4), "loop_step_s": loop["step_time_s"],
                               "optimizer_step_s": round(opt_s, 4), "optimizer_frac": round(opt_s / bare, 4),
                               # on CUDA (async, a dedicated machine): the loop's step time against the bare step's
                               "loop_overhead_frac": loop["overhead_frac"] if loop["overhead_frac"] is not None
                               else round(max(0.0, 1 - bare / loop["step_time_s"]), 4),
                               "data_wait_frac": loop["data_wait_frac"], "tokens_per_s": loop["tokens_per_s"]}
                        if optimizer == "muon":
                            row["newton_schulz_dtype"] = dtype_name(precision_policy(device).optimizer)
                        if peak is not None:  # the loop's own MFU (what training gets) and the bare step's
                            fpt = flops_per_token(cfg, seq)
                            row["mfu"] = loop.get("mfu")
                            row["bare_mfu"] = round(fpt * batch * seq / bare / peak, 4)
                        row["peak_mem_gb"] = (round(torch.cuda.max_memory_allocated() / 2**30, 3) if gpu
                                              else peak_rss_gb())
                        if cfg.moe:
                            row.update(dispatch_share(cfg, dtype, batch, seq, bare, args.repeats, device))
                        results.append((cfg, row))
                        print(json.dumps(row), flush=True)
    compare(results)
    report = {"device": torch.cuda.get_device_name() if gpu else f"cpu: {cpu_model()}",
              "precision": precision_policy(device).reason, "threads": torch.get_num_threads(),
              "torch": torch.__version__, "results": [row for _, row in results]}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
