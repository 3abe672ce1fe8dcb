"""A training step beside another training process, against the same step alone: what sharing the cores costs.

    python bench/bench_sharing.py                                        # the demo's model: depth-4, 16 x 256, fp32
    python bench/bench_sharing.py --settings default passive spin_10k --out bench/results/sharing-$(hostname).json

Two processes that each run a thread pool as wide as the machine contend for its cores: when a pool's threads
wait for each other at the end of every parallel region while the other pool holds the cores, a step can take
far more than twice its time alone. The goal (issue 51): a step beside one other training process at most ~2.5x
its time alone. For each setting, a process times --steps training steps of the model (bench/bench_first_steps.py's
timed child: the loop's forward and backward, then the optimizer's update, as `--plan` times them) alone, then
again while a second process of the same setting trains the same model without end beside it (started first, and
given --settle seconds to warm up). The median of the steps after the first two is compared.

Settings (both processes):
  default     torch's own threads (one per core) and OpenMP's own wait policy
  passive     OMP_WAIT_POLICY=PASSIVE: a thread that waits sleeps at once instead of spinning on a core
  spin_10k, spin_100k   GOMP_SPINCOUNT: a waiting thread spins that many times before it sleeps (GNU OpenMP, which
              PyTorch's Linux wheels use; its own default spins 300,000 times). spin_10k is what training processes
              set (trainer_utils/__init__.py)
  one_thread  one thread per process (torch.set_num_threads(1)): two processes, one core each
Nothing else should run meanwhile: every number names the machine it was measured on.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer_utils import WAIT_SETTINGS  # noqa: E402

GOAL = 2.5  # a step beside one other training process, over its time alone
SETTINGS = {"default": ({}, []), "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, []),
            "spin_10k": ({"GOMP_SPINCOUNT": "10000"}, []), "spin_100k": ({"GOMP_SPINCOUNT": "100000"}, []),
            "one_thread": ({}, ["--threads", "1"])}


def timed_child(args: argparse.Namespace, steps: int, setting: str) -> list[str]:
    """The command of bench_first_steps.py's timed child for the model under test, in `setting`."""
    return [sys.executable, str(ROOT / "bench" / "bench_first_steps.py"), "--child", "--tuned", "--preset",
            args.preset, "--batch_size", str(args.batch_size), "--seq_len", str(args.seq_len), "--steps", str(steps),
            *(["--qk_norm"] if args.qk_norm else []), *SETTINGS[setting][1]]


def step_s(args: argparse.Namespace, setting: str, env: dict[str, str]) -> float:
    """The median step of a timed process (the first two steps left out: they build buffers and state)."""
    done = subprocess.run(timed_child(args, args.steps, setting), env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{setting}: the timed process failed:\n{done.stderr[-2000:]}")
    return statistics.median(json.loads(done.stdout.strip().splitlines()[-1])["seconds"][2:])


def measure(args: argparse.Namespace, setting: str) -> dict:
    # each setting alone decides how OpenMP waits: nothing of this process's environment
    env = {**{k: v for k, v in os.environ.items() if k not in WAIT_SETTINGS},
           **SETTINGS[setting][0]}
    alone = step_s(args, setting, env)
    other = subprocess.Popen(timed_child(args, 10**6, setting), env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        time.sleep(args.settle)
        beside = step_s(args, setting, env)
    finally:
        other.kill()
        other.wait()
    return {"alone_s": round(alone, 4), "beside_s": round(beside, 4), "ratio": round(beside / alone, 3),
            "within_goal": beside / alone <= GOAL}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--preset", default="depth-4")
    parser.add_argument("--qk_norm", action="store_true")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12, help="timed steps in each measurement (2 more warm up)")
    parser.add_argument("--settle", type=float, default=8.0, help="seconds the other process warms up first")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from common.device import cpu_model

    results = {}
    for setting in args.settings:
        r = results[setting] = measure(args, setting)
        print(f"{setting:>10}: {r['alone_s']:.3f} s alone, {r['beside_s']:.3f} s beside another training process "
              f"({r['ratio']:.2f}x)", flush=True)
    isa = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if k in os.environ}
    report = {"machine": cpu_model(), "cores": os.cpu_count(), "isa_environment": isa, "preset": args.preset,
              "batch_size": args.batch_size, "seq_len": args.seq_len, "dtype": "float32", "goal": GOAL,
              "results": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(r["within_goal"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
