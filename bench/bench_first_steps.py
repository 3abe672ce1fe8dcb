"""The first steps of a run against its settled ones, per memory-allocator setting: why the first minute is slower.

    python bench/bench_first_steps.py                                   # minimind-26m, 8 x 512, fp32
    python bench/bench_first_steps.py --preset mini-30m --hidden_size 256 --num_hidden_layers 4 --batch_size 16 \
        --seq_len 256 --qk_norm                                         # the demo recipe's model and batch
    python bench/bench_first_steps.py --settings default fixed --out bench/results/first-steps.json

Each setting runs in a process of its own (an allocator's state is the process's): a new model and pretraining's
optimizer take --steps training steps on one batch of random tokens, as --plan times them (trainer_utils/planner.py
pretraining_step: the loop's forward and backward, trainer_utils/step.py, then the backend's update), each step
timed alone, with the page faults it caused. It reports the mean time of the --first steps after the first one
(which also builds the optimizer's state) over the settled steps' median (the last half), and the minor page
faults per step in each part: a step whose buffers come from fresh pages pays for faulting them in.

Settings:
  default   glibc's malloc as it starts: a block of 128 KiB or more is mmap()ed and unmapped when freed, and the
            threshold rises to the size of each such block freed (up to 32 MiB), so a run's first steps map and
            fault in pages that later steps reuse from the heap
  fixed     the threshold fixed at 32 MiB and the heap never trimmed (MALLOC_MMAP_THRESHOLD_,
            MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_): blocks above 32 MiB (the logits) are still mmap()ed
  tuned     what training does: trainer_utils/runtime.py tune_allocator(), mallopt() called in the process once
            torch is loaded (the same settings as no_mmap)
  no_mmap   no block mmap()ed at all, however large (MALLOC_MMAP_MAX_=0), the heap never trimmed: every buffer
            comes from the heap, where a freed one is reused without faulting its pages in again
  jemalloc, tcmalloc   preloaded (LD_PRELOAD), where the library is installed (Debian: libjemalloc2,
            libtcmalloc-minimal4)
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MiB = 1 << 20
FIXED = {"MALLOC_MMAP_THRESHOLD_": str(32 * MiB), "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
         "MALLOC_TOP_PAD_": str(64 * MiB)}
NO_MMAP = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40), "MALLOC_TOP_PAD_": str(64 * MiB)}
PRELOADS = {"jemalloc": ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2"),
            "tcmalloc": ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                         "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")}


def child(args: argparse.Namespace) -> None:
    """Time the steps in this process; print one JSON line: each step's seconds and minor page faults."""
    import torch

    from common.device import parse_device
    from model.config import reshape_preset
    from trainer_utils.planner import pretraining_step
    from trainer_utils.runtime import Precision, tune_allocator

    if args.tuned and not tune_allocator():
        raise SystemExit("tune_allocator() did not apply here")
    device = parse_device("cpu")
    cfg = reshape_preset(args.preset, args.hidden_size, args.num_hidden_layers, args.seq_len, vocab_size=6400,
                         qk_norm=args.qk_norm)
    torch.manual_seed(0)
    step = pretraining_step(cfg, device, Precision(device, torch.float32), args.batch_size, args.seq_len)
    seconds, faults = [], []
    for _ in range(args.steps):
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        step()
        seconds.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    print(json.dumps({"seconds": seconds, "faults": faults, "parameters": cfg.num_parameters(),
                      "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))


def setting_env(name: str) -> dict[str, str] | None:
    """The environment of a setting's process (None: its library is not installed here)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    if name == "fixed":
        env.update(FIXED)
    elif name == "no_mmap":
        env.update(NO_MMAP)
    elif name in PRELOADS:
        library = next((p for p in PRELOADS[name] if Path(p).is_file()), None)
        if library is None:
            return None
        env["LD_PRELOAD"] = library
    return env


def summary(run: dict, first: int) -> dict:
    seconds, faults = run["seconds"], run["faults"]
    settled = seconds[len(seconds) // 2:]
    settled_s = statistics.median(settled)
    early = seconds[1:first + 1]  # the step after the first (which builds the optimizer's state) and on
    return {"first_mean_s": round(statistics.mean(early), 4), "settled_median_s": round(settled_s, 4),
            "first_over_settled": round(statistics.mean(early) / settled_s, 3),
            "first_step_s": round(seconds[0], 4),
            "faults_first": round(statistics.mean(faults[1:first + 1])),
            "faults_settled": round(statistics.mean(faults[len(faults) // 2:])),
            "peak_rss_gb": round(run["peak_rss_gb"], 3), "seconds": [round(s, 4) for s in seconds]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="minimind-26m")
    parser.add_argument("--hidden_size", type=int)
    parser.add_argument("--num_hidden_layers", type=int)
    parser.add_argument("--qk_norm", action="store_true")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--first", type=int, default=5, help="the steps after step 1 that count as the first")
    parser.add_argument("--settings", nargs="+",
                        default=["default", "tuned", "fixed", "no_mmap", "jemalloc", "tcmalloc"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tuned", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.threads:
            import torch
            torch.set_num_threads(args.threads)
        return child(args)
    from common.device import cpu_model

    argv = [a for a in sys.argv[1:] if a not in ("--out", str(args.out))]
    results = {}
    for name in args.settings:
        env = setting_env(name)
        if env is None:
            print(f"{name}: not installed here, skipped", file=sys.stderr)
            continue
        tuned = ["--tuned"] if name == "tuned" else []
        done = subprocess.run([sys.executable, __file__, *argv, "--child", *tuned], env=env, capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise SystemExit(f"{name}: the timed process failed:\n{done.stderr[-2000:]}")
        run = json.loads(done.stdout.strip().splitlines()[-1])
        results[name] = summary(run, args.first)
        r = results[name]
        print(f"{name:>9}: first {args.first} steps {r['first_mean_s']:.3f} s, settled {r['settled_median_s']:.3f} s "
              f"({r['first_over_settled']:.2f}x), step 1 {r['first_step_s']:.2f} s; page faults a step "
              f"{r['faults_first']:,} first, {r['faults_settled']:,} settled; peak RSS {r['peak_rss_gb']:.2f} GB",
              flush=True)
    # an instruction set narrowed by the environment (docs/precision.md: AVX2 on a newer CPU) is part of the machine
    isa = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
           if k in os.environ}
    report = {"machine": cpu_model(), "cores": os.cpu_count(), "isa_environment": isa, "preset": args.preset,
              "hidden_size": args.hidden_size, "num_hidden_layers": args.num_hidden_layers,
              "batch_size": args.batch_size, "seq_len": args.seq_len, "steps": args.steps, "first": args.first,
              "dtype": "float32", "results": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
