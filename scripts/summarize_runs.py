"""The last logged value of each run's key metrics, side by side: a quick comparison of runs.

    python scripts/summarize_runs.py out/demo-distill out/demo-student
    python scripts/summarize_runs.py out/demo-dpo --keys loss reward_accuracy val_reward_accuracy

Reads out/<run>/metrics.jsonl; a column shows the value of the last record that has the key (so a training
loss and a validation loss logged at different steps both appear). Malformed lines are skipped.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_KEYS = ("loss", "val_loss", "val_ppl", "val_bpb", "reward_accuracy", "val_reward_accuracy", "val_reward_margin",
                "ce", "kl", "router_balance", "router_max_load", "tokens_per_s")


def last_values(run_dir: Path) -> dict[str, float | int]:
    """For each key of the run's metrics.jsonl, its value in the last record that has it (and "step")."""
    values: dict[str, float | int] = {}
    with open(run_dir / "metrics.jsonl", "rb") as f:
        for raw in f:
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(record, dict):
                values.update({k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "time"})
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories (out/<run>)")
    p.add_argument("--keys", nargs="+", help=f"columns (default: those of {', '.join(DEFAULT_KEYS)} any run has)")
    args = p.parse_args(argv)
    rows = {}
    for run in args.runs:
        if not (Path(run) / "metrics.jsonl").is_file():
            print(f"error: {run}: no metrics.jsonl (not a run directory?)", file=sys.stderr)
            return 2
        rows[run] = last_values(Path(run))
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
