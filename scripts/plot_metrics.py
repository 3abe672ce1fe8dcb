"""Plot a run's training curves from out/<run>/metrics.jsonl into a PNG.

    python scripts/plot_metrics.py out/<run> [--out loss.png] [--smooth 0.9]

Top panel: train loss (faint), its smoothed curve and validation loss points (the legend gives the last
validation bits per byte, when logged), and for a reinforcement-learning run its mean reward on a second axis
(a policy loss says little of progress; the reward does); then, for a run with --eval_tasks, each task's
chance-centred accuracy and their average; bottom panel: learning rate.
Lines that are not JSON objects with a numeric "step" are skipped and counted. When a resumed run logs a
step again, the later line wins, so the curve shows the run as it continued.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.files import METRICS_NAME  # noqa: E402

SERIES = ("loss", "val_loss", "val_bpb", "lr", "reward")


def is_number(value: object) -> bool:
    """A finite int or float (bools and NaN/inf are not plotted)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_metrics(path: Path, names: tuple[str, ...] = SERIES) -> tuple[dict[str, dict[float, float]], int]:
    """Per series of `names` a {step: value} map (last line per step wins), and the number of malformed lines."""
    series: dict[str, dict[float, float]] = {name: {} for name in names}
    bad = 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                bad += 1
                continue
            if not isinstance(record, dict) or not is_number(record.get("step")):
                bad += 1
                continue
            for name, value in record.items():  # other keys (grad_norm, event, ...) are ignored
                if (name in names or is_task_series(name)) and is_number(value):
                    series.setdefault(name, {})[record["step"]] = float(value)
    return {name: dict(sorted(points.items())) for name, points in series.items()}, bad


def is_task_series(name: str) -> bool:
    """--eval_tasks' scores: task/<name>/centred (ranked choices) or task/<name>/acc (a generation task's exact
    matches, whose chance is 0, so that its accuracy is already centred), and tasks_centred, the average."""
    return name == "tasks_centred" or (name.startswith("task/") and name.endswith(("/centred", "/acc")))


def task_panel(series: dict[str, dict[float, float]]) -> dict[str, dict[float, float]]:
    """What the task panel draws, by label: each task's centred accuracy (its acc where it has none: a
    generation task), and the average."""
    panel = {"average": series["tasks_centred"]} if series.get("tasks_centred") else {}
    for name, points in series.items():
        task, _, metric = name.removeprefix("task/").rpartition("/")
        if name.startswith("task/") and points and (metric == "centred" or f"task/{task}/centred" not in series):
            panel[task] = points
    return panel


def smooth(values: list[float], weight: float) -> list[float]:
    """Debiased exponential moving average (as TensorBoard's smoothing): early points are not pulled to 0."""
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight ** i))
    return out


def plot(series: dict[str, dict[float, float]], out: Path, title: str, weight: float) -> None:
    """Write the two-panel figure (loss over step, LR over step) to out."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed (servers, CI)
    import matplotlib.pyplot as plt

    tasks = task_panel(series)
    rows = (3, 2, 1) if tasks else (3, 1)
    fig, axes = plt.subplots(len(rows), 1, sharex=True, figsize=(9, 6 + 2 * bool(tasks)),
                             gridspec_kw={"height_ratios": rows})
    ax_loss, ax_lr = axes[0], axes[-1]
    if tasks:
        ax_tasks = axes[1]
        for name, points in sorted(tasks.items()):
            average = name == "average"
            ax_tasks.plot(list(points), list(points.values()), "o-", markersize=3, linewidth=2 if average else 1,
                          color="black" if average else None, label=name)
        ax_tasks.axhline(0, color="gray", linewidth=0.8)
        ax_tasks.set_ylabel("centred accuracy")
        ax_tasks.grid(alpha=0.3)
        ax_tasks.legend(fontsize="small", ncol=3)
    train, val, lr = series["loss"], series["val_loss"], series["lr"]
    if train:
        steps, values = list(train), list(train.values())
        # An EMA lags a falling curve by ~1/(1-w) points: keep that lag under 5% of the run, so a short run
        # (where each logged point already averages log_interval steps) is shown unsmoothed.
        weight = min(weight, max(0.0, 1 - 20 / len(values)))
        ax_loss.plot(steps, values, color="tab:blue", alpha=0.25 if weight else 1.0, linewidth=1, label="train loss")
        if weight:
            ax_loss.plot(steps, smooth(values, weight), color="tab:blue", linewidth=2,
                         label=f"train (EMA {weight:.2f})")
    if val:
        bpb = series["val_bpb"]
        label = f"val loss (last: {list(bpb.values())[-1]:.3f} bits/byte)" if bpb else "val loss"
        ax_loss.plot(list(val), list(val.values()), "o-", color="tab:orange", markersize=4, label=label)
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.set_title(title)
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(loc="upper left")
    reward = series.get("reward")
    if reward:
        ax_reward = ax_loss.twinx()
        ax_reward.plot(list(reward), list(reward.values()), color="tab:red", linewidth=1.5, label="mean reward")
        ax_reward.set_ylabel("reward", color="tab:red")
        ax_reward.legend(loc="upper right")
    if lr:
        ax_lr.plot(list(lr), list(lr.values()), color="tab:green")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("step")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help=f"run directory (out/<run>) or its {METRICS_NAME}")
    p.add_argument("--out", help="PNG to write (default: <run>/loss.png)")
    p.add_argument("--smooth", type=float, default=0.9, help="EMA weight for the smoothed train loss, in [0, 1)")
    args = p.parse_args(argv)
    if not 0 <= args.smooth < 1:
        p.error("--smooth must be in [0, 1)")
    run = Path(args.run)
    path = run if run.is_file() else run / METRICS_NAME
    run_dir = path.parent
    try:
        series, bad = read_metrics(path)
    except OSError as e:
        print(f"error: {path}: cannot read ({e.strerror or e})", file=sys.stderr)
        return 2
    if bad:
        print(f"skipped {bad} malformed lines in {path}")
    if not any(series.values()):
        print(f"error: {path}: no loss, val_loss or lr values to plot", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else run_dir / "loss.png"
    try:
        plot(series, out, run_dir.name, args.smooth)
    except ImportError:
        print("error: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return 2
    print(f"wrote {out} ({len(series['loss'])} train, {len(series['val_loss'])} val points)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
