"""The last logged value of each run's key metrics, side by side: a quick comparison of runs.

    python scripts/summarize_runs.py out/demo-distill out/demo-student
    python scripts/summarize_runs.py out/demo-dpo --keys loss reward_accuracy val_reward_accuracy
    python scripts/summarize_runs.py out/demo-domain --before_after

Reads out/<run>/metrics.jsonl; a column shows the value of the last record that has the key (so a training
loss and a validation loss logged at different steps both appear). Malformed lines are skipped.
--before_after: each validation file's perplexity at the run's first evaluation and its last, and the change (a
run from trained weights is first evaluated before its first step: the start model).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.files import METRICS_NAME  # noqa: E402

DEFAULT_KEYS = ("loss", "val_loss", "val_ppl", "val_bpb", "reward_accuracy", "val_reward_accuracy", "val_reward_margin",
                "ce", "kl", "router_balance", "router_max_load", "tokens_per_s")


def records(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl records (malformed lines skipped)."""
    out = []
    with open(run_dir / METRICS_NAME, "rb") as f:
        for raw in f:
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(record, dict):
                out.append(record)
    return out


def last_values(run_dir: Path) -> dict[str, float | int]:
    """For each key of the run's metrics.jsonl, its value in the last record that has it (and "step")."""
    values: dict[str, float | int] = {}
    for record in records(run_dir):
        values.update({k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "time"})
    return values


def before_after(run_dir: Path) -> str:
    """A table of each validation file's perplexity at the first and the last evaluation."""
    evals = [r for r in records(run_dir) if "val_ppl" in r]
    if not evals:
        return f"{run_dir}: no perplexity in its metrics.jsonl (no validation split?)"
    first, last = evals[0], evals[-1]
    names = [k.split("/", 1)[1] for k in first if k.startswith("val_ppl/")] or ["(all)"]
    key = lambda name: "val_ppl" if name == "(all)" else f"val_ppl/{name}"  # noqa: E731
    width = max(len(n) for n in names)
    rows = [f"{run_dir}: validation perplexity, step {first['step']} -> step {last['step']}",
            f"  {'file':<{width}}  {'before':>9}  {'after':>9}  {'change':>7}"]
    for name in names:
        a, b = first[key(name)], last.get(key(name), float("nan"))
        rows.append(f"  {name:<{width}}  {a:>9.2f}  {b:>9.2f}  {100 * (b / a - 1):>+6.1f}%")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories (out/<run>)")
    p.add_argument("--keys", nargs="+", help=f"columns (default: those of {', '.join(DEFAULT_KEYS)} any run has)")
    p.add_argument("--before_after", action="store_true",
                   help="each validation file's perplexity at the first and the last evaluation")
    args = p.parse_args(argv)
    for run in args.runs:
        if not (Path(run) / METRICS_NAME).is_file():
            print(f"error: {run}: no metrics.jsonl (not a run directory?)", file=sys.stderr)
            return 2
    if args.before_after:
        print("\n".join(before_after(Path(run)) for run in args.runs))
        return 0
    rows = {run: last_values(Path(run)) for run in args.runs}
    keys = args.keys or [k for k in DEFAULT_KEYS if any(k in r for r in rows.values())]
    width = max(len(r) for r in rows)
    widths = [max(len(k), 8) for k in keys]
    print(f"{'run':<{width}}  {'step':>6}  " + "  ".join(f"{k:>{w}}" for k, w in zip(keys, widths)))
    for run, values in rows.items():
        cells = [f"{values[k]:>{w}.4f}" if k in values else f"{'-':>{w}}" for k, w in zip(keys, widths)]
        print(f"{run:<{width}}  {values.get('step', 0):>6}  " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
