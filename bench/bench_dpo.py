"""DPO step time with the reference log-probs cached once (PocketLM) against recomputed every step (MiniMind).

    python bench/bench_dpo.py [--preset mini-30m --hidden_size 256 --num_hidden_layers 4] [--batch_size 8]
                              [--max_seq_len 256] [--steps 4] [--repeats 9] [--out bench/results/dpo-<host>.json]

Both variants train the same policy on the same length-grouped batches of real preference pairs (the bundled
dataset/demo/dpo_demo.jsonl through the real token cache), in the same precision, with the same step: the DPO
objective's forward over chosen + rejected rows, backward, clip, AdamW.
  cached      the reference model's log-probs come from one pass over every pair before training (what
              train_dpo.py does); a step is the policy's forward/backward + optimizer step only.
  recomputed  every step first runs the frozen reference model's forward on the same 2B rows under no_grad
              (what MiniMind's train_dpo.py does), then the same policy step.
The reference is a frozen copy of the policy at step 0 (in a real run: the --init_from model).

After warm-up steps (excluded), each repeat times a short block of --steps steps of each variant (their order
alternating between repeats, so drift of a shared machine hits both alike); the median block's mean step time
is reported: with many short blocks, the median passes over the ones another process slowed down (the spread,
max / min, is reported, and warned about when large).

The one-off reference pass (what the cached variant pays before training) is the trainer's own: every pair of
the training split, shortest first, in batches REFERENCE_BATCH_FACTOR times the training ones, timed whole. It
is set against one epoch of cached training, whose step time is the measured one scaled by the epoch's padded
positions per step over the measured batches' (a step's time grows with the padded positions it computes).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.portable import portable  # noqa: E402
from common.device import choose_dtype, cpu_model, dtype_name, parse_device, synchronize, timed  # noqa: E402
from dataset.config import DataConfig, training_data  # noqa: E402
from dataset.preference import PreferenceDataset  # noqa: E402
from dataset.tokenizer import Tokenizer  # noqa: E402
from model import PocketLM  # noqa: E402
from model.config import reshape_preset  # noqa: E402
from trainer_utils.objectives import DPO, Batch, sequence_log_probs  # noqa: E402
from trainer_utils.optim import build_optimizer  # noqa: E402
from trainer_utils.runtime import Precision  # noqa: E402

DEMO_PAIRS = ROOT / "dataset" / "demo" / "dpo_demo.jsonl"
VARIANTS = ("cached", "recomputed")
REFERENCE_BATCH_FACTOR = 1  # the DPO stage's prepare hook walks the pairs in training-sized batches


def log(message: str) -> None:
    """Progress on stderr (stdout carries the table)."""
    print(message, file=sys.stderr, flush=True)


def load_pairs(data_path: str, cache_dir: str | None, num_workers: int | None, tokenizer: Tokenizer,
               max_seq_len: int, batch_size: int, seed: int) -> PreferenceDataset:
    """The training split of the pair file, tokenized through the real cache exactly as train_dpo.py reads it."""
    data = DataConfig(data_path=[data_path], cache_dir=cache_dir, num_workers=num_workers)
    return training_data(data, tokenizer, "dpo", max_seq_len, batch_size, seed, log=log).train


def reference_pass(reference: torch.nn.Module, batches: Iterable[tuple[np.ndarray, torch.Tensor, torch.Tensor]],
                   values: np.ndarray, precision: Precision, device: torch.device) -> tuple[float, list[np.ndarray]]:
    """Fill `values` [pair, chosen/rejected] with the reference log-probs of (indices, x, y) batches, as the DPO
    stage's prepare hook (trainer_utils/stages/dpo.py) does; the seconds it took (building the rows included, as
    there) and the batches' indices."""
    done = []
    synchronize(device)
    t0 = time.perf_counter()
    for indices, x, y in batches:
        logp = sequence_log_probs(reference, x.to(device), y.to(device), precision.autocast).cpu().numpy()
        values[indices, 0], values[indices, 1] = logp[:len(indices)], logp[len(indices):]
        done.append(indices)
    return time.perf_counter() - t0, done


def padded_positions(ds: PreferenceDataset, batches: list[np.ndarray]) -> int:
    """Input positions (padding included) the forwards over these batches compute: 2B rows of the longest."""
    return int(sum(2 * len(b) * (ds.row_lengths[b].max() - 1) for b in batches))


def make_step(policy: PocketLM, reference: PocketLM, optimizer: torch.optim.Optimizer, objective: DPO,
              precision: Precision, recompute: bool) -> Callable[[Batch], None]:
    """One optimizer step on a (x, y, ref) batch; with `recompute`, ref is replaced by the reference model's
    forward on the same rows first (MiniMind's way), so the cached values go unused."""
    scaler = precision.scaler

    def step(batch: Batch) -> None:
        x, y, ref = batch
        if recompute:
            ref = sequence_log_probs(reference, x, y, precision.autocast)  # no_grad inside
        out = objective(policy, (x, y, ref), precision.autocast)
        # as the loop normalises: the objective's summed loss over the pairs of the step
        scaler.scale(out.loss / objective.count(batch)).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)  # train_dpo.py's default --grad_clip
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return step


def time_block(step: Callable[[Batch], None], batches: list[Batch], steps: int, device: torch.device) -> float:
    """Mean seconds per step over `steps` steps cycling through `batches` from the first."""
    return timed(lambda: [step(batches[i % len(batches)]) for i in range(steps)], device) / steps


def time_variants(steps: dict[str, Callable[..., Any]], batches: list, args: argparse.Namespace,
                  device: torch.device) -> dict[str, list[float]]:
    """Each variant's seconds a step, per block of args.steps steps (after args.warmup), args.repeats blocks each;
    a warning when blocks vary so much that the machine was busy."""
    for v in VARIANTS:
        time_block(steps[v], batches, args.warmup, device)
    blocks: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.repeats):
        # alternating which variant goes first, so a drifting machine favours neither
        for v in VARIANTS if r % 2 == 0 else reversed(VARIANTS):
            blocks[v].append(time_block(steps[v], batches, args.steps, device))
            log(f"repeat {r + 1}/{args.repeats} {v}: {1000 * blocks[v][-1]:.1f} ms/step")
    spread = max(max(b) / min(b) for b in blocks.values())
    if spread > 1.5:
        log(f"warning: block times vary up to {spread:.1f}x: the machine was busy; the medians hold while fewer "
            "than half the blocks were disturbed, else rerun on a quiet machine")
    return blocks


def run(args: argparse.Namespace) -> dict:
    """Measure both variants and the one-off reference pass; the report as a JSON-ready dict."""
    # a shared machine's load skews step times: record what it was when the measurement began
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    device = parse_device(args.device)
    dtype = choose_dtype(args.dtype, device).dtype
    precision = Precision(device, dtype)
    torch.manual_seed(args.seed)
    tokenizer = Tokenizer()
    ds = load_pairs(args.data_path, args.cache_dir, args.num_workers, tokenizer, args.max_seq_len,
                    args.batch_size, args.seed)
    cfg = reshape_preset(args.preset, args.hidden_size, args.num_hidden_layers, args.max_seq_len,
                         vocab_size=tokenizer.vocab_size)
    policy = PocketLM(cfg).to(device).train()
    # the reference is the policy before DPO: a frozen copy, in eval mode (no dropout), without gradients
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    optimizer = build_optimizer(policy, "adamw", args.learning_rate, 0.1, (0.9, 0.95), 0.9, device)
    objective = DPO(beta=0.1)

    # The one-off cost: the reference pass the trainer makes before training, over the whole training split.
    b = args.batch_size
    values = np.zeros((ds.num_examples, 2), dtype=np.float32)
    ref_seconds, reference_batches = reference_pass(reference, ds.all_pairs_batches(REFERENCE_BATCH_FACTOR * b),
                                                    values, precision, device)
    ds.set_reference(values)
    log(f"reference pass over {ds.num_examples} pairs: {ref_seconds:.1f} s")

    # The measured batches: the first of epoch 0's length-grouped order, built up front (data loading is the
    # same for both variants and overlaps compute in the real loop, so it is no part of either step time).
    epoch = list(ds.epoch_order(0).reshape(-1, b))
    chosen = epoch[:args.batches]
    batches = [tuple(t.to(device) for t in ds.batch(indices)) for indices in chosen]

    # Sanity: the recomputed variant computes the cached values (on other batches, so at other padding).
    diffs = [(sequence_log_probs(reference, x, y, precision.autocast) - ref).abs().max().item()
             for x, y, ref in batches]
    scale = float(np.mean([ref.abs().mean().item() for _, _, ref in batches]))

    steps = {v: make_step(policy, reference, optimizer, objective, precision, v == "recomputed") for v in VARIANTS}
    blocks = time_variants(steps, batches, args, device)
    step_s = {v: statistics.median(blocks[v]) for v in VARIANTS}
    spread = {v: max(blocks[v]) / min(blocks[v]) for v in VARIANTS}
    # one epoch of cached training, scaled from the measured batches by the padded positions a step computes
    width_scale = padded_positions(ds, epoch) / len(epoch) / (padded_positions(ds, chosen) / len(chosen))
    epoch_cached = len(epoch) * step_s["cached"] * width_scale
    epoch_recomputed = len(epoch) * step_s["recomputed"] * width_scale
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu: {cpu_model()}",
        "threads": torch.get_num_threads(), "load_avg_1m_at_start": load, "torch": torch.__version__,
        "dtype": dtype_name(dtype), "dtype_requested": args.dtype,
        "model": {"preset": args.preset, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
                  "vocab_size": cfg.vocab_size, "parameters": cfg.num_parameters()},
        "data": {"path": portable(args.data_path), "train_pairs": ds.num_examples, "max_seq_len": args.max_seq_len},
        "batch_size_pairs": b, "measured_batches": len(batches), "steps_per_block": args.steps,
        "warmup_steps": args.warmup, "repeats": args.repeats,
        "padded_positions_per_step": round(padded_positions(ds, chosen) / len(chosen), 1),
        "cached_vs_recomputed_ref_max_abs_diff": round(max(diffs), 6),
        "ref_logp_mean_abs": round(scale, 3),
        **{v: {"step_s": round(step_s[v], 5), "pairs_per_s": round(b / step_s[v], 2),
               "block_step_s": [round(t, 5) for t in blocks[v]], "block_spread": round(spread[v], 3)}
           for v in VARIANTS},
        "speedup": round(step_s["recomputed"] / step_s["cached"], 3),
        # what the reference forward adds to a step, as a share of the policy's forward + backward + step
        "reference_forward_frac_of_step": round(step_s["recomputed"] / step_s["cached"] - 1, 3),
        "reference_pass": {"pairs": ds.num_examples, "batch_size_pairs": REFERENCE_BATCH_FACTOR * b,
                           "seconds": round(ref_seconds, 3),
                           "ms_per_pair": round(1000 * ref_seconds / ds.num_examples, 3),
                           "padded_positions": padded_positions(ds, reference_batches)},
        "epoch": {"steps": len(epoch), "padded_positions": padded_positions(ds, epoch),
                  "padded_positions_scale": round(width_scale, 4),
                  "cached_train_s": round(epoch_cached, 2), "recomputed_train_s": round(epoch_recomputed, 2),
                  # the one-off pass as a share of one epoch of cached training (paid once, not per epoch)
                  "reference_pass_frac": round(ref_seconds / epoch_cached, 4),
                  # one epoch end to end: recomputing against caching plus its one-off pass
                  "speedup_first_epoch": round(epoch_recomputed / (epoch_cached + ref_seconds), 3),
                  # training epochs after which the one-off pass has paid for itself
                  "break_even_epochs": round(ref_seconds / (epoch_recomputed - epoch_cached), 2)
                  if epoch_recomputed > epoch_cached else None},
    }


def table(report: dict) -> str:
    """The human-readable summary printed on stdout."""
    lines = [f"{report['device']}, {report['threads']} threads, {report['dtype']}, "
             f"{report['model']['parameters'] / 1e6:.1f}M parameters, {report['batch_size_pairs']} pairs/step, "
             f"max_seq_len {report['data']['max_seq_len']}",
             f"{'variant':<12}{'step (ms)':>12}{'pairs/s':>10}"]
    for v in VARIANTS:
        lines.append(f"{v:<12}{1000 * report[v]['step_s']:>12.1f}{report[v]['pairs_per_s']:>10.1f}")
    ref, ep = report["reference_pass"], report["epoch"]
    lines += [f"speed-up per step (recomputed / cached): {report['speedup']:.2f}x; the reference forward adds "
              f"{100 * report['reference_forward_frac_of_step']:.0f}% to a policy step",
              f"one-off reference pass: {ref['pairs']} pairs in {ref['seconds']:.1f} s = "
              f"{100 * ep['reference_pass_frac']:.1f}% of one epoch of cached training ({ep['cached_train_s']:.0f} s)",
              f"first epoch with the pass, recomputed / cached: {ep['speedup_first_epoch']:.2f}x; the pass pays for "
              f"itself after {ep['break_even_epochs']} epochs"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mini-30m")
    p.add_argument("--hidden_size", type=int, default=256)
    p.add_argument("--num_hidden_layers", type=int, default=4)
    p.add_argument("--max_seq_len", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=8, help="pairs per step (2x rows: chosen + rejected)")
    p.add_argument("--batches", type=int, default=4, help="distinct batches the measured steps cycle through")
    p.add_argument("--steps", type=int, default=4, help="measured steps per block (default: one per batch)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps of each variant first")
    p.add_argument("--repeats", type=int, default=9, help="measured blocks per variant; the median is reported")
    p.add_argument("--dtype", default="auto", help="autocast dtype; auto: bf16 where the CPU has it natively")
    p.add_argument("--learning_rate", type=float, default=5e-6, help="train_dpo.py's default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (CUDA, else MPS, else CPU) | cpu | cuda[:N] | mps")
    p.add_argument("--data_path", default=str(DEMO_PAIRS), help="preference pairs (default: the bundled demo)")
    p.add_argument("--cache_dir", default=None, help="its token cache (default: beside the data)")
    p.add_argument("--num_workers", type=int, default=None, help="tokenization processes (default: CPUs, <= 8)")
    p.add_argument("--out", default=None, help="results JSON (default: bench/results/dpo-<hostname>.json)")
    args = p.parse_args(argv)
    report = run(args)
    print(table(report), flush=True)
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"dpo-{socket.gethostname()}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
