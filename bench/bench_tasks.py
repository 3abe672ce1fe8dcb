"""Benchmark scoring speed: eval_model.py --tasks against lm-evaluation-harness on the same model, items, machine.

    python bench/bench_tasks.py --checkpoint out/demo-pretrain --task arc_easy --items 200

Exports the checkpoint (python -m model.convert), writes the task's first --items items as a local lm-eval task
(dataset/tasks.py write_lm_eval_task), then runs, in turns, `eval_model.py --tasks` and
`lm_eval --model hf` (offline, float32, the same batch size), each a whole command as a user runs it, and
reports items/s of both, their ratio, and the accuracies (which must agree). Results go to
bench/results/tasks-<task>-<cores>core.json, with the machine's CPU named.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.portable import portable  # noqa: E402
from common.device import cpu_description  # noqa: E402
from dataset.tasks import packaged_task, write_lm_eval_task  # noqa: E402


def timed(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    run = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if run.returncode != 0:
        sys.exit(f"{' '.join(command[:4])} failed:\n{run.stderr[-3000:]}")
    return seconds, run.stdout + run.stderr


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--task", default="arc_easy")
    p.add_argument("--items", type=int, default=200)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="runs of each, in turns; the fastest counts")
    p.add_argument("--out", default=None, help="default: bench/results/tasks-<task>-<cores>core.json")
    args = p.parse_args()
    items = packaged_task(args.task).items[:args.items]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        subprocess.run([sys.executable, "-m", "model.convert", "--checkpoint", args.checkpoint, "--out_dir",
                        str(tmp / "hf")], cwd=ROOT, check=True, capture_output=True)
        write_lm_eval_task(items, tmp / "tasks", "pocketlm_bench")
        ours_cmd = [sys.executable, "eval_model.py", "--checkpoint", args.checkpoint, "--tasks", args.task,
                    "--limit", str(args.items), "--task_batch_size", str(args.batch_size), "--device", "cpu",
                    "--dtype", "float32"]
        theirs_cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                      f"pretrained={tmp / 'hf'},dtype=float32", "--tasks", "pocketlm_bench", "--include_path",
                      str(tmp / "tasks"), "--device", "cpu", "--batch_size", str(args.batch_size)]
        ours_s, theirs_s = [], []
        for _ in range(args.repeats):
            seconds, ours_out = timed(ours_cmd, ROOT, env)
            ours_s.append(seconds)
            seconds, theirs_out = timed(theirs_cmd, tmp, env)
            theirs_s.append(seconds)
    ours_acc = re.search(rf"\| {args.task} \| \d+ \| ([0-9.]+) \| ([0-9.]+) \|", ours_out)
    theirs_acc = re.search(r"\|acc\s*\|[^|]*\|\s*([0-9.]+)\|", theirs_out)
    result = {"machine": f"{os.cpu_count()} cores, {cpu_description()}", "checkpoint": portable(args.checkpoint),
              "task": args.task,
              "items": len(items), "continuations": sum(len(i.pairs) for i in items), "batch_size": args.batch_size,
              "ours_s": round(min(ours_s), 2), "lm_eval_s": round(min(theirs_s), 2),
              "ours_items_per_s": round(len(items) / min(ours_s), 2),
              "lm_eval_items_per_s": round(len(items) / min(theirs_s), 2),
              "speedup": round(min(theirs_s) / min(ours_s), 2),
              "ours_acc": float(ours_acc.group(1)) if ours_acc else None,
              "lm_eval_acc": float(theirs_acc.group(1)) if theirs_acc else None,
              "note": "whole commands as a user runs them (start-up, model load and scoring), the fastest of "
                      f"{args.repeats} runs each, in turns"}
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"tasks-{args.task}-{os.cpu_count()}core.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
