"""How close a --time_budget run ends to its budget: each budget trains the demo recipe in a real train_pretrain.py
process, and the wall time of the whole process (interpreter start to exit, as a user's clock sees it) is
compared with the budget. The goal: every run ends within 90-105% of its budget.

    python bench/bench_time_budget.py --budgets 1m 5m 20m 60m --out bench/results/time-budget-$(hostname).json

Each record: the budget, the process's wall seconds and their share of the budget, the steps planned and trained
in the end, the re-plans the guard made, the last validation loss, what the probe measured (planned_at: the step
the run planned after, on its own first steps; 0: before its first step, on a throwaway copy), and the machine (CPU
model and kind, precision). Runs go one at a time (in parallel they would slow each other down).

A busy machine: --beside CMD keeps a shell command line running from before the first run to the end of the last,
started again whenever it ends (the goal: with a test suite beside, the budget still kept, and no single slow step
stopping a run early). The results count its starts; each record has its slowest logged step.

    python bench/bench_time_budget.py --budgets 40s 4m 10m --beside "python -m pytest -q -n 2 tests"
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.portable import portable  # noqa: E402
from common.device import training_machine  # noqa: E402
from trainer_utils.budget import parse_duration  # noqa: E402

GOAL = (0.90, 1.05)


class Beside:
    """Other work on the machine while the runs last: a shell command line started on entering, started again each
    time it ends, and stopped with its whole process group on leaving (`starts` counts its starts)."""

    def __init__(self, command: str | None):
        self.command, self.starts = command, 0
        self._stop = threading.Event()
        self._proc: subprocess.Popen | None = None
        self._thread = threading.Thread(target=self._keep, daemon=True)

    def _keep(self) -> None:
        while not self._stop.is_set():
            self._proc = subprocess.Popen(self.command, shell=True, cwd=ROOT, start_new_session=True,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.starts += 1
            while self._proc.poll() is None and not self._stop.wait(0.2):
                pass

    def __enter__(self) -> Beside:
        if self.command:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if not self.command:
            return
        self._stop.set()
        self._thread.join()
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)  # the shell and what it started (pytest's workers)
            self._proc.wait()


def run_budget(budget: str, recipe: str, out: Path, extra: list[str]) -> dict:
    """One train_pretrain.py process on `budget`; its wall time and what its plan recorded."""
    name = f"budget-{budget}"
    cmd = [sys.executable, "train_pretrain.py", "--config", recipe, "--out_dir", str(out), "--run_name", name,
           "--overwrite", "--time_budget", budget, "--max_steps", "1000000", "--epochs", "1000", *extra]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    plan = json.loads((out / name / "train_config.json").read_text())["resolved"]["time_budget"]
    metrics = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    trained = max(m["step"] for m in metrics if "loss" in m)
    replans = [m for m in metrics if m.get("event") == "time_budget"]
    val = [m["val_loss"] for m in metrics if m.get("val_loss") is not None]
    seconds = parse_duration(budget)
    return {"budget": budget, "budget_s": seconds, "wall_s": round(wall, 2), "share": round(wall / seconds, 4),
            "within_goal": GOAL[0] <= wall / seconds <= GOAL[1], "planned_steps": plan["steps"],
            "trained_steps": trained, "replans": len(replans), "val_loss": val[-1] if val else None,
            "slowest_step_s": max((m["step_time_s"] for m in metrics if "step_time_s" in m), default=None),
            "probe": {k: plan.get(k, 0) for k in ("step_s", "first_extra_s", "eval_s", "save_s", "setup_s", "start_s",
                                                  "timed_steps", "planned_at")}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", nargs="+", default=["1m", "5m"], help="durations to run (90s, 10m, 1h)")
    parser.add_argument("--recipe", default="recipes/demo-pretrain.yaml")
    parser.add_argument("--out", type=Path, help="write the records here as JSON")
    parser.add_argument("--runs_dir", type=Path, default=ROOT / "out" / "bench-time-budget")
    parser.add_argument("--beside", metavar="CMD", help="a shell command line to keep running beside the runs")
    parser.add_argument("extra", nargs="*", help="more train_pretrain.py flags (after --)")
    args = parser.parse_args(argv)
    for b in args.budgets:
        parse_duration(b)  # every budget is valid before the first run
    machine = training_machine()
    records = []
    with Beside(args.beside) as other:
        for budget in args.budgets:
            r = run_budget(budget, args.recipe, args.runs_dir, args.extra)
            records.append(r)
            print(f"{budget:>6}: {r['wall_s']:8.1f} s = {r['share']:.1%} of the budget, {r['trained_steps']} steps "
                  f"({r['planned_steps']} planned, {r['replans']} re-plans)", flush=True)
    result = {"machine": machine, "goal": list(GOAL), "recipe": portable(args.recipe), "runs": records,
              **({"beside": {"command": args.beside, "starts": other.starts}} if args.beside else {})}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(r["within_goal"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
