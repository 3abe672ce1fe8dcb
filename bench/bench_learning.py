"""Ablations: train several train_pretrain.py configurations for equal tokens or equal training time, compare them.

    python bench/bench_learning.py --ablation bench/ablations/demo-recipe.yaml --out out/bench-learning
    python bench/bench_learning.py --recipe recipes/demo-pretrain.yaml --seconds 120 --seeds 1 2 \\
        --config baseline="" --config lr-1e-3="--learning_rate 1e-3" --config warmup-50="--warmup_steps 50"

Each configuration is a name and train_pretrain.py flags layered over the shared ones (--recipe, passed as
train_pretrain's --config, then --base); the flags pass through untouched, so any flag train_pretrain.py has
works here. The first configuration is the baseline. The budget is the same for every configuration:

  --tokens N    each trains floor(N / tokens per step) steps (tokens per step = batch x accumulation x context)
  --seconds S   each first runs a short calibration (--calibration_steps timed after --calibration_warmup steps)
                to measure its seconds per step and the one-off cost of its first steps (warm-up, compilation),
                then trains as many steps as fit in S: a whole schedule (warmup, cosine to the end) in the same
                training time. The time each run really took is reported beside it.

Runs are real train_pretrain.py processes, one at a time (in parallel they would compete for the machine), with
--evals evaluations each, no checkpoints, samples, probes or layer statistics. Training time is metrics.jsonl's
elapsed_s: wall time without the evaluation pauses. --seeds repeats every configuration with each seed and
reports the mean and the range of the final validation loss, to tell a gain from noise.

--metric decides what is compared (sorted, differenced, reached in time, plotted): val_loss (nats per token) or
val_bpb (bits per byte of the validation text). Configurations with different tokenizers count different tokens,
so their losses per token do not compare; the default is val_bpb when the tokenizers differ, val_loss otherwise.

Writes to --out: results.json (everything: flags, commands, steps, tokens, times, the evaluation curves, the
final losses per seed and their mean), results.md (a table sorted by final validation loss, with the change
against the baseline and the training time a configuration needs to reach the baseline's final loss, as a share
of the baseline's time) and loss_vs_time.png (validation loss against training seconds and against tokens).
Runs and their logs are kept in --out/runs and --out/logs.

An ablation file (YAML or JSON) holds the same settings; flags given on the command line win, --config adds:

    recipe: recipes/demo-pretrain.yaml
    base: --max_seq_len 256          # a string of flags, a list, or a mapping {flag: value}
    tokens: 819200                   # or seconds: 300
    metric: val_loss                 # or val_bpb (the default when the configurations' tokenizers differ)
    evals: 12
    seeds: [42]
    configs:
      baseline: {}
      lr-1e-3: {learning_rate: 1.0e-3}
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.portable import portable  # noqa: E402
from common.device import cpu_model  # noqa: E402
from common.errors import ConfigError  # noqa: E402
from common.files import DEFAULT_TOKENIZER_DIR  # noqa: E402
from scripts.plot_metrics import read_metrics  # noqa: E402

TRAIN_SCRIPT = ROOT / "train_pretrain.py"
# What the harness sets for every run: a configuration (or the base) setting one would be silently overridden.
RESERVED = ("max_steps", "epochs", "out_dir", "run_name", "resume", "eval_interval")
# Every run only trains and evaluates: no checkpoints to write, no samples, probes or per-layer statistics.
QUIET = ["--overwrite", "--no-checkpoints", "--sample_prompts", "none", "--probes", "none", "--no-layer_stats"]
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
TAIL_LINES = 20
METRICS = {"val_loss": "validation loss (nats/token)", "val_bpb": "validation bits per byte"}


class UsageError(Exception):
    """Bad input (exit 2): an unreadable ablation file, a bad configuration, flags train_pretrain.py rejects."""


class RunFailed(Exception):
    """train_pretrain.py exited non-zero; `code` is its exit status (2: bad input, 1: training had to stop)."""

    def __init__(self, label: str, code: int, tail: list[str], log: Path) -> None:
        self.code = code
        super().__init__(f"{label}: train_pretrain.py exited with {code}; the end of its output (all of it in "
                         f"{log}):\n" + "".join(f"    {line}" for line in tail).rstrip())


@dataclass
class Config:
    """A configuration under test: its name and its train_pretrain.py flags (over the shared ones)."""

    name: str
    flags: list[str]


@dataclass
class Plan:
    """How a configuration spends the budget: its tokens per step and own --seed (from its flags), the steps it
    trains, how often it evaluates and (equal-time budgets) what its calibration measured: seconds per step, and
    the one-off seconds of its first steps beyond that (warm-up, compilation), which a run spends too."""

    config: Config
    tokens_per_step: int
    seed: int
    steps: int = 0
    eval_interval: int = 1
    seconds_per_step: float | None = None
    startup_s: float = 0.0


@dataclass
class Run:
    """One training run of a configuration with one seed, and its evaluations."""

    seed: int
    command: list[str]
    run_dir: Path
    process_s: float = 0.0
    curve: list[dict[str, float]] = field(default_factory=list)
    error: str | None = None


# ------------------------------------------------------------------------------------------------ configuration
def flag_list(value: Any, where: str) -> list[str]:
    """train_pretrain.py flags from an ablation file's value: a command-line string, a list of words, or a
    mapping {flag: value} (true: --flag, false: --no-flag, a list: several values)."""
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(value)
    if isinstance(value, list):
        return [str(v) for v in value]
    if isinstance(value, dict):
        out: list[str] = []
        for key, v in value.items():
            if isinstance(v, bool):
                out.append(f"--{'' if v else 'no-'}{key}")
            elif isinstance(v, list):
                out += [f"--{key}", *map(str, v)]
            elif v is not None:
                out += [f"--{key}", str(v)]
        return out
    raise UsageError(f"{where}: expected flags as a string, a list or a mapping, not {type(value).__name__}")


def parse_config_arg(text: str) -> Config:
    """--config NAME="FLAGS" -> Config."""
    name, sep, flags = text.partition("=")
    if not sep:
        raise UsageError(f'--config {text!r}: expected NAME="FLAGS" (e.g. lr-1e-3="--learning_rate 1e-3")')
    return Config(name.strip(), shlex.split(flags))


ABLATION_KEYS = ("recipe", "base", "tokens", "seconds", "evals", "seeds", "metric", "configs")


def load_ablation(path: Path) -> dict[str, Any]:
    """An ablation file's settings (YAML, or JSON, which YAML reads too): base as flags, configs as Configs."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise UsageError(f"{path}: no such ablation file") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise UsageError(f"{path}: unreadable ablation file ({e})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a mapping with keys {', '.join(ABLATION_KEYS)}")
    unknown = sorted(set(data) - set(ABLATION_KEYS))
    if unknown:
        raise UsageError(f"{path}: unknown keys {', '.join(unknown)} (known: {', '.join(ABLATION_KEYS)})")
    configs = data.get("configs") or {}
    if not isinstance(configs, dict):
        raise UsageError(f"{path}: configs must map each configuration's name to its flags")
    data["configs"] = [Config(str(k), flag_list(v, f"{path}: configs.{k}")) for k, v in configs.items()]
    data["base"] = flag_list(data.get("base"), f"{path}: base")
    return data


def check_configs(configs: list[Config], shared: list[str], seeds_given: bool) -> None:
    """UsageError for a set of configurations that cannot run: none, duplicate or unusable names, or flags the
    harness sets itself."""
    if not configs:
        raise UsageError('no configurations: give --config NAME="FLAGS" or an --ablation file with configs')
    names = [c.name for c in configs]
    if len(set(names)) < len(names):
        raise UsageError(f"configuration names must differ: {', '.join(names)}")
    bad = [n for n in names if not NAME.fullmatch(n)]
    if bad:
        raise UsageError(f"configuration name {bad[0]!r}: use letters, digits, '.', '_' and '-' (it names a run "
                         "directory)")
    reserved = RESERVED + (("seed",) if seeds_given else ())
    for where, flags in [("the shared flags", shared), *((f"configuration {c.name!r}", c.flags) for c in configs)]:
        for flag in flags:
            if not flag.startswith("--"):
                continue
            given = flag.split("=")[0].removeprefix("--").removeprefix("no-")
            if any(r.startswith(given) for r in reserved):  # argparse takes unique prefixes: --max_step
                raise UsageError(f"{where} set {flag}: the harness sets --{', --'.join(reserved)} for every run "
                                 "(the budget decides the steps)")


def parse_flags(argv: list[str], label: str) -> Any:
    """train_pretrain.py's configuration of argv, parsed by its own parser (so every flag it has is accepted, and
    a bad one is found before anything trains); UsageError naming the configuration otherwise."""
    from trainer_utils.stages import parse_train_config

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parse_train_config("pretrain", argv, None)
    except SystemExit:  # argparse's usage error, written to stderr
        lines = stderr.getvalue().strip().splitlines() or ["invalid flags"]
        raise UsageError(f"{label}: train_pretrain.py rejects its flags: {lines[-1].split('error: ')[-1]}") from None
    except ConfigError as e:
        raise UsageError(f"{label}: {e}") from None


def tokens_per_step(config: Any) -> int:
    """Tokens one optimizer step trains on (one process): batch x accumulation x context, the context being
    --max_seq_len or the model's (the preset's, or the --init_from checkpoint's)."""
    m, o = config.model, config.optim
    seq = m.max_seq_len
    if seq is None:
        from model import ModelConfig
        from model.config import config_from_flags
        from model.loading import resolve_model_dir

        model = ModelConfig.load(resolve_model_dir(m.init_from) / "config.json") if m.init_from else \
            config_from_flags(m)
        seq = model.max_seq_len
    return o.batch_size * o.accumulation_steps * seq


# ------------------------------------------------------------------------------------------------------ budget
def steps_for_tokens(tokens: int, per_step: int) -> int:
    """Whole steps that train at most `tokens` (at least one)."""
    return max(1, tokens // per_step)


def steps_for_seconds(seconds: float, seconds_per_step: float, startup_s: float = 0.0) -> int:
    """Whole steps that fit in `seconds` of training after `startup_s` of one-off costs (at least one)."""
    return max(1, math.floor((seconds - startup_s) / seconds_per_step))


def eval_interval(steps: int, evals: int) -> int:
    """The interval that gives `evals` evaluations over `steps`, or a few fewer (the last step always evaluates)."""
    return max(1, math.ceil(steps / evals))


def time_to_reach(curve: list[dict[str, float]], target: float, metric: str = "val_loss") -> float | None:
    """Training seconds at which the curve's `metric` first reaches `target`, linear between evaluations
    (None: never). Reached at the first evaluation, it is that evaluation's time: an upper bound."""
    before = None
    for point in curve:
        if point[metric] <= target:
            if before is None:
                return point["elapsed_s"]
            share = (before[metric] - target) / (before[metric] - point[metric])
            return before["elapsed_s"] + share * (point["elapsed_s"] - before["elapsed_s"])
        before = point
    return None


# ------------------------------------------------------------------------------------------------------- runs
def command(shared: list[str], config: Config, out: Path, run_name: str, extra: list[str]) -> list[str]:
    """The train_pretrain.py command of one run: the shared flags, the configuration's, then the harness's."""
    return [sys.executable, str(TRAIN_SCRIPT), *shared, *config.flags, "--out_dir", str(out / "runs"),
            "--run_name", run_name, *QUIET, *extra]


def calibration_flags(warmup: int, steps: int) -> list[str]:
    """A calibration run: `steps` timed steps after `warmup` untimed ones (logged at both ends), the closing
    evaluation on one batch."""
    return ["--max_steps", str(warmup + steps), "--log_interval", str(warmup), "--eval_batches", "1"]


def train(cmd: list[str], run_dir: Path, log: Path, label: str) -> float:
    """Run one training process (its output into `log`, its evaluation lines echoed); returns its wall seconds,
    or raises RunFailed."""
    # --no-checkpoints leaves no `latest`, which is what --overwrite looks for: the old metrics.jsonl would grow
    shutil.rmtree(run_dir, ignore_errors=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        for line in proc.stdout:
            f.write(line)
            tail.append(line)
            if ": val_loss " in line:
                print(f"    {line.rstrip()}", flush=True)
        code = proc.wait()
    if code != 0:
        raise RunFailed(label, code, list(tail), log)
    return time.perf_counter() - t0


def resolved(run_dir: Path) -> dict[str, Any]:
    """What a run derived (train_config.json's resolved section: device, dtype, steps, tokens per step)."""
    return json.loads((run_dir / "train_config.json").read_text())["resolved"]


def read_curve(run_dir: Path, per_step: int) -> list[dict[str, float]]:
    """A run's evaluations: step, tokens, training seconds, validation loss and (when logged) bits per byte."""
    series, _ = read_metrics(run_dir / "metrics.jsonl", ("val_loss", "val_bpb", "elapsed_s"))
    curve = []
    for step, loss in series["val_loss"].items():
        point = {"step": int(step), "tokens": int(step) * per_step, "elapsed_s": series["elapsed_s"][step],
                 "val_loss": loss}
        if step in series["val_bpb"]:
            point["val_bpb"] = series["val_bpb"][step]
        curve.append(point)
    return curve


def calibrate(plan: Plan, shared: list[str], out: Path, warmup: int, steps: int) -> None:
    """Measure a configuration's seconds per step in a short run, timed after its first `warmup` steps
    (allocator, caches and compilation warm up there)."""
    name = f"{plan.config.name}-calibration"
    train(command(shared, plan.config, out, name, calibration_flags(warmup, steps)), out / "runs" / name,
          out / "logs" / f"{name}.log", f"configuration {plan.config.name!r} (calibration)")
    elapsed = read_metrics(out / "runs" / name / "metrics.jsonl", ("elapsed_s",))[0]["elapsed_s"]
    plan.seconds_per_step = (elapsed[warmup + steps] - elapsed[warmup]) / steps
    plan.startup_s = max(0.0, elapsed[warmup] - warmup * plan.seconds_per_step)


def run_once(plan: Plan, seed: int | None, name: str, shared: list[str], out: Path) -> Run:
    """Train a configuration over its budget with one seed (None: its own), then read its evaluations."""
    extra = ["--max_steps", str(plan.steps), "--eval_interval", str(plan.eval_interval)]
    run = Run(plan.seed if seed is None else seed, command(shared, plan.config, out, name,
                                                           extra + (["--seed", str(seed)] if seed is not None else [])),
              out / "runs" / name)
    run.process_s = train(run.command, run.run_dir, out / "logs" / f"{name}.log",
                          f"configuration {plan.config.name!r} (seed {run.seed})")
    got = resolved(run.run_dir)
    if (got["tokens_per_step"], got["total_steps"]) != (plan.tokens_per_step, plan.steps):
        raise UsageError(f"configuration {plan.config.name!r}: planned {plan.steps} steps of "
                         f"{plan.tokens_per_step} tokens, the run made {got['total_steps']} of "
                         f"{got['tokens_per_step']} (a launcher with several processes?)")
    run.curve = read_curve(run.run_dir, plan.tokens_per_step)
    return run


# ---------------------------------------------------------------------------------------------------- results
def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def mean_curve(curves: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    """Curves of the same evaluation steps (one per seed) averaged point by point: their times and losses."""
    return [{**{k: curves[0][i][k] for k in ("step", "tokens")},
             **{k: round(mean([c[i][k] for c in curves]), 5) for k in ("elapsed_s", "val_loss", "val_bpb")
                if all(k in c[i] for c in curves)}}
            for i in range(min(map(len, curves)))]


def summarize(plan: Plan, runs: list[Run]) -> dict[str, Any]:
    """A configuration's results: each run's, and their mean over the seeds."""
    row: dict[str, Any] = {"name": plan.config.name, "flags": [portable(f) for f in plan.config.flags],
                           "steps": plan.steps,
                           "tokens_per_step": plan.tokens_per_step, "tokens": plan.steps * plan.tokens_per_step,
                           "eval_interval": plan.eval_interval}
    if plan.seconds_per_step is not None:
        row.update(calibrated_seconds_per_step=round(plan.seconds_per_step, 5),
                   calibrated_startup_s=round(plan.startup_s, 3))
    row["runs"] = []
    for r in runs:
        final = r.curve[-1] if r.curve else {}
        row["runs"].append({"seed": r.seed, "command": shlex.join(map(portable, r.command)),
                            "run_dir": portable(r.run_dir),
                            "process_s": round(r.process_s, 2), "wall_s": final.get("elapsed_s"),
                            "final_val_loss": final.get("val_loss"), "final_val_bpb": final.get("val_bpb"),
                            "curve": r.curve, **({"error": r.error} if r.error else {})})
    done = [r for r in runs if r.curve]
    if not done:
        return row
    curve = mean_curve([r.curve for r in done])
    wall = curve[-1]["elapsed_s"]
    row.update(wall_s=round(wall, 3), seconds_per_step=round(wall / plan.steps, 5),
               tokens_per_s=round(row["tokens"] / wall), final_val_bpb=None, curve=curve)
    for metric in METRICS:  # the mean over the seeds and their range
        finals = [r.curve[-1][metric] for r in done if metric in r.curve[-1]]
        if len(finals) == len(done):
            row.update({f"final_{metric}": round(mean(finals), 5), f"final_{metric}_min": min(finals),
                        f"final_{metric}_max": max(finals)})
    return row


def compare(rows: list[dict[str, Any]], metric: str) -> None:
    """Add to each row its final `metric`'s change against the baseline (the first configuration) and the training
    time its mean curve takes to reach the baseline's final value, as a share of the baseline's training time."""
    baseline = rows[0]
    if baseline.get(f"final_{metric}") is None:
        return
    target = baseline[f"final_{metric}"]
    for row in rows:
        if row.get(f"final_{metric}") is None:
            continue
        reached = time_to_reach(row["curve"], target, metric)
        row.update(delta_vs_baseline=round(row[f"final_{metric}"] - target, 5),
                   time_to_baseline_s=None if reached is None else round(reached, 3),
                   time_to_baseline_frac=None if reached is None else round(reached / baseline["wall_s"], 4),
                   # reached at the first evaluation: the curve before it is unknown, so this is an upper bound
                   time_to_baseline_upper_bound=reached is not None and row["curve"][0][metric] <= target)


def describe(budget: dict[str, Any]) -> str:
    return (f"equal tokens ({budget['tokens']:,} per configuration)" if budget["mode"] == "tokens"
            else f"equal training time ({budget['seconds']:g} s per configuration)")


def table(report: dict[str, Any]) -> str:
    """results.md: the setting, then one row per configuration, the best final value of the metric first."""
    several, metric = len(report["seeds"]) > 1, report["metric"]
    short = metric.removeprefix("val_")  # loss, bpb

    def final(r: dict[str, Any], key: str) -> str:
        if r.get(f"final_{key}") is None:
            return "–"
        spread = f" ({r[f'final_{key}_min']:.4f}–{r[f'final_{key}_max']:.4f})" if several and key == metric else ""
        return f"{r[f'final_{key}']:.4f}{spread}"

    lines = [f"# Ablation: {describe(report['budget'])}, compared by {METRICS[metric]}", "",
             f"Shared flags: `{shlex.join(report['shared_flags']) or '(none)'}`; seeds "
             f"{', '.join(map(str, report['seeds']))}; {report['device']} on {report['host']}, torch "
             f"{report['torch']}.", "",
             f"| config | steps | tokens | wall s | tokens/s | final val loss | val bpb | Δ {short} vs baseline "
             f"| time to baseline's {short} |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in sorted(report["configs"], key=lambda r: math.inf if r.get(f"final_{metric}") is None
                    else r[f"final_{metric}"]):
        name = f"**{r['name']}**" if r["name"] == report["baseline"] else r["name"]
        if "final_val_loss" not in r:
            lines.append(f"| {name} | {r['steps']:,} | {r['tokens']:,} | failed | | | | | |")
            continue
        delta = f"{r['delta_vs_baseline']:+.4f}" if "delta_vs_baseline" in r else "–"
        frac = r.get("time_to_baseline_frac")
        reach = "–" if "delta_vs_baseline" not in r else "not reached" if frac is None else \
            f"{'≤ ' if r['time_to_baseline_upper_bound'] else ''}{frac:.2f}×"
        lines.append(f"| {name} | {r['steps']:,} | {r['tokens']:,} | {r['wall_s']:.1f} | {r['tokens_per_s']:,} "
                     f"| {final(r, 'val_loss')} | {final(r, 'val_bpb')} | {delta} | {reach} |")
    lines += ["", "Bold: the baseline (the first configuration). Wall s: training time (metrics.jsonl's elapsed_s, "
              "without the evaluation pauses)"
              + (f", final val loss and bpb: means over the seeds (the {short}'s range in brackets)" if several
                 else "")
              + f". Time to baseline's {short}: when the configuration's validation curve (linear between "
              f"evaluations) first reaches the baseline's final {METRICS[metric]}, as a share of the baseline's "
              "training time (≤: already at the first evaluation)."]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    """loss_vs_time.png: each configuration's (mean) validation curve against training seconds and tokens."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, (by_time, by_tokens) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    metric = report["metric"]
    for r in report["configs"]:
        if "curve" in r and all(metric in p for p in r["curve"]):
            loss = [p[metric] for p in r["curve"]]
            by_time.plot([p["elapsed_s"] for p in r["curve"]], loss, "o-", markersize=3, label=r["name"])
            by_tokens.plot([p["tokens"] for p in r["curve"]], loss, "o-", markersize=3, label=r["name"])
    target = report["configs"][0].get(f"final_{metric}")
    for ax, xlabel in ((by_time, "training time (s, evaluations excluded)"), (by_tokens, "tokens")):
        if target is not None:
            ax.axhline(target, color="gray", linestyle="--", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    by_time.set_ylabel(METRICS[metric])
    by_time.legend()
    fig.suptitle(f"{describe(report['budget'])}; dashed: the baseline's final {METRICS[metric]}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ablation", type=Path, help="YAML/JSON file with the configurations and shared settings")
    p.add_argument("--recipe", help="shared train_pretrain.py --config file (e.g. recipes/demo-pretrain.yaml)")
    p.add_argument("--base", help='shared train_pretrain.py flags, e.g. "--preset tiny --batch_size 8"')
    p.add_argument("--config", action="append", default=[], metavar='NAME="FLAGS"',
                   help="a configuration: a name and its flags over the shared ones (repeat it; the first "
                        "configuration is the baseline)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--tokens", type=int, help="equal tokens: every configuration trains this many")
    budget.add_argument("--seconds", type=float, help="equal training time: every configuration trains this long")
    p.add_argument("--evals", type=int, help="evaluations per run, the points of the curves (default 12)")
    p.add_argument("--seeds", type=int, nargs="+", help="run every configuration with each of these --seed values "
                                                        "(default: once, with its own seed)")
    p.add_argument("--metric", choices=sorted(METRICS), help="what to compare: val_loss or val_bpb (default: "
                   "val_bpb when the configurations' tokenizers differ, else val_loss)")
    p.add_argument("--calibration_steps", type=int, default=8, help="timed steps of an equal-time calibration run")
    p.add_argument("--calibration_warmup", type=int, default=2, help="untimed steps before them")
    p.add_argument("--out", type=Path, default=Path("out/bench-learning"), help="results directory")
    p.add_argument("--dry_run", action="store_true", help="check the configurations and print the commands")
    return p.parse_args(argv)


def setup(args: argparse.Namespace) -> tuple[list[str], list[Plan], dict[str, Any], int, list[int | None], str]:
    """The shared flags, a plan per configuration (flags checked by train_pretrain's parser), the budget, the
    evaluations per run, the seeds ([None]: each configuration's own) and the metric compared, from the ablation
    file and the command line (which wins); UsageError when they do not make an ablation."""
    file = load_ablation(args.ablation) if args.ablation else {"configs": [], "base": []}
    recipe = args.recipe or file.get("recipe")
    if recipe is not None and not Path(recipe).is_file():
        raise UsageError(f"recipe {recipe}: no such file")
    shared = (["--config", str(recipe)] if recipe else []) + file["base"] + shlex.split(args.base or "")
    configs = file["configs"] + [parse_config_arg(c) for c in args.config]
    given = args.tokens is not None or args.seconds is not None
    tokens, seconds = (args.tokens, args.seconds) if given else (file.get("tokens"), file.get("seconds"))
    if (tokens is None) == (seconds is None):
        raise UsageError("give one budget: --tokens N (equal tokens) or --seconds S (equal training time)")
    if (tokens if tokens is not None else seconds) <= 0:
        raise UsageError("the budget must be positive")
    budget = {"mode": "tokens", "tokens": int(tokens)} if tokens is not None else \
        {"mode": "seconds", "seconds": float(seconds)}
    evals, seeds = args.evals or file.get("evals") or 12, args.seeds or file.get("seeds")
    if min(evals, args.calibration_steps, args.calibration_warmup) < 1:
        raise UsageError("--evals, --calibration_steps and --calibration_warmup must be at least 1")
    check_configs(configs, shared, seeds is not None)
    plans, tokenizers = [], set()
    for c in configs:
        parsed = parse_flags([*shared, *c.flags], f"configuration {c.name!r}")
        plans.append(Plan(c, tokens_per_step(parsed), parsed.optim.seed))
        tokenizers.add(Path(parsed.data.tokenizer or DEFAULT_TOKENIZER_DIR).resolve())
    metric = args.metric or file.get("metric") or ("val_bpb" if len(tokenizers) > 1 else "val_loss")
    if metric not in METRICS:
        raise UsageError(f"metric {metric!r}: use {' or '.join(METRICS)}")
    if metric == "val_loss" and len(tokenizers) > 1:
        raise UsageError("the configurations use different tokenizers, so their losses per token count different "
                         "tokens: compare them with --metric val_bpb")
    return shared, plans, budget, int(evals), [int(s) for s in seeds] if seeds else [None], metric


def run_name(plan: Plan, seed: int | None, seeds: list[int | None]) -> str:
    return plan.config.name + (f"-seed{seed}" if len(seeds) > 1 else "")


def dry_run(plans: list[Plan], shared: list[str], out: Path, budget: dict[str, Any], evals: int,
            seeds: list[int | None], args: argparse.Namespace) -> int:
    """Print the commands an ablation would run (an equal-time budget's steps come from the calibration)."""
    if budget["mode"] == "seconds":
        for plan in plans:
            print(shlex.join(command(shared, plan.config, out, f"{plan.config.name}-calibration",
                                     calibration_flags(args.calibration_warmup, args.calibration_steps))))
    for seed in seeds:
        for plan in plans:
            if budget["mode"] == "tokens":
                steps = steps_for_tokens(budget["tokens"], plan.tokens_per_step)
                extra = ["--max_steps", str(steps), "--eval_interval", str(eval_interval(steps, evals))]
            else:
                extra = ["--max_steps", "<from the calibration>", "--eval_interval", f"<steps / {evals}>"]
            extra += ["--seed", str(seed)] if seed is not None else []
            print(shlex.join(command(shared, plan.config, out, run_name(plan, seed, seeds), extra)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out
    try:
        shared, plans, budget, evals, seeds, metric = setup(args)
        if args.dry_run:
            return dry_run(plans, shared, out, budget, evals, seeds, args)
        print(f"ablation: {len(plans)} configurations x {len(seeds)} seed(s), {describe(budget)}, compared by "
              f"{metric}", flush=True)
        if budget["mode"] == "seconds":
            for plan in plans:
                calibrate(plan, shared, out, args.calibration_warmup, args.calibration_steps)
                print(f"calibrated {plan.config.name}: {plan.seconds_per_step:.4f} s/step after "
                      f"{plan.startup_s:.2f} s of warm-up", flush=True)
        for plan in plans:
            plan.steps = (steps_for_tokens(budget["tokens"], plan.tokens_per_step) if budget["mode"] == "tokens"
                          else steps_for_seconds(budget["seconds"], plan.seconds_per_step, plan.startup_s))
            plan.eval_interval = eval_interval(plan.steps, evals)
        tokens = {p.config.name: p.steps * p.tokens_per_step for p in plans}
        if budget["mode"] == "tokens" and len(set(tokens.values())) > 1:
            print(f"note: the budget is not a multiple of every configuration's tokens per step; they train {tokens}",
                  flush=True)

        runs: dict[str, list[Run]] = {p.config.name: [] for p in plans}
        failed = 0
        for seed in seeds:  # seed-major: an interrupted ablation still has every configuration of the first seed
            for plan in plans:
                print(f"[{sum(map(len, runs.values())) + 1}/{len(plans) * len(seeds)}] {plan.config.name}"
                      f"{'' if seed is None else f', seed {seed}'}: {plan.steps:,} steps, "
                      f"{plan.steps * plan.tokens_per_step:,} tokens", flush=True)
                name = run_name(plan, seed, seeds)
                try:
                    runs[plan.config.name].append(run_once(plan, seed, name, shared, out))
                except RunFailed as e:
                    if e.code == 2:  # bad input: the other runs would fail alike
                        raise
                    # training had to stop (diverged, say): a result too; the ablation goes on
                    print(f"error: {e}", file=sys.stderr)
                    failed += 1
                    runs[plan.config.name].append(Run(plan.seed if seed is None else seed, [], out / "runs" / name,
                                                      error=str(e)))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if e.code == 2 else 1

    rows = [summarize(p, runs[p.config.name]) for p in plans]
    compare(rows, metric)
    first = next((r.run_dir for rs in runs.values() for r in rs if r.curve), None)
    where = resolved(first) if first else {}
    report = {"budget": budget, "evals": evals, "seeds": sorted({r.seed for rs in runs.values() for r in rs}),
              "shared_flags": [portable(f) for f in shared], "baseline": plans[0].config.name, "metric": metric,
              "device": f"{where.get('device', '?')} ({where.get('dtype', '?')})", "host": cpu_model(),
              "torch": torch.__version__, "configs": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    (out / "results.md").write_text(table(report), encoding="utf-8")
    written = [out / "results.json", out / "results.md"]
    try:
        plot(report, out / "loss_vs_time.png")
        written.append(out / "loss_vs_time.png")
    except ImportError:
        print("note: matplotlib is not installed: no loss_vs_time.png (pip install matplotlib)", file=sys.stderr)
    print("\n" + table(report))
    print(f"wrote {', '.join(map(str, written))}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
