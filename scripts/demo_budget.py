"""The training flags of each `make demo` stage: a share of the time the demo has left, so the whole demo, installing
included, ends within its budget (10 minutes by default) on whatever machine runs it.

    python scripts/demo_budget.py pretrain --start 1733390000 --total 10m     # "--time_budget 312s ... --preset auto"
    python scripts/demo_budget.py sft --start 1733390000 --total 10m --steps 150  # "--max_steps 150"

`make demo` notes the time it starts (before installing) and asks before each training stage. Pretraining gets
PRETRAIN_SHARE of what is left after the evaluation that follows the training (AFTER_S); SFT gets the rest, so
whatever pretraining did not use goes to it. Each trainer then plans its steps from its own measured step time
(--time_budget: trainer_utils/budget.py), on a CPU with or without native bf16 and on a GPU alike; pretraining's
model is the one the plan picks for its share (--preset auto: trainer_utils/planner.py). --steps trains that many
steps of the recipe's model instead (`make demo DEMO_PRETRAIN_STEPS=450`), whatever the time.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.errors import ConfigError  # noqa: E402
from trainer_utils.budget import format_duration, parse_duration  # noqa: E402

PRETRAIN_SHARE = 0.8  # of the training time: pretraining is what the demo's perplexity and samples show
# What follows the training: perplexity over 300 records, four sampled answers and two plots, each a new process
# (27 s on a 2-core AMD EPYC with AVX2 only, float32), with room for a CPU twice as slow (another AVX2 EPYC ran
# the demo's training steps at half that speed).
AFTER_S = 60.0
MIN_STAGE_S = 30.0  # a stage gets at least this (the demo then runs late rather than train nothing)
MAX_STEPS = {"pretrain": 1056, "sft": 400}  # upper bounds: 4 epochs of the demo corpus, 2 of the conversations


def stage_flags(stage: str, start: float, total_s: float, now: float, steps: int | None) -> tuple[str, str | None]:
    """The trainer flags for `stage`, and a note for the user when the demo is already late."""
    if steps is not None:
        return f"--max_steps {steps}", None
    left = total_s - (now - start) - AFTER_S
    budget = PRETRAIN_SHARE * left if stage == "pretrain" else left
    note = None
    if budget < MIN_STAGE_S:
        note = (f"note: the demo has {format_duration(max(0.0, left + AFTER_S))} of its "
                f"{format_duration(total_s)} left; {stage} trains for {format_duration(MIN_STAGE_S)} anyway")
        budget = MIN_STAGE_S
    flags = f"--time_budget {round(budget)}s --max_steps {MAX_STEPS[stage]}"
    return flags + (" --preset auto" if stage == "pretrain" else ""), note


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=sorted(MAX_STEPS))
    parser.add_argument("--start", type=float, required=True, help="when the demo started (seconds since the epoch)")
    parser.add_argument("--total", default="10m", help="the whole demo's budget (default 10m)")
    parser.add_argument("--steps", default="", help="train this many steps instead (empty: the budget decides)")
    args = parser.parse_args(argv)
    try:
        total = parse_duration(args.total, "DEMO_BUDGET")
        if args.steps and not (args.steps.isdigit() and int(args.steps) > 0):
            raise ConfigError(f"--steps {args.steps!r}: expected a positive number of steps")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    flags, note = stage_flags(args.stage, args.start, total, time.time(), int(args.steps) if args.steps else None)
    if note:
        print(note, file=sys.stderr)
    print(flags)
    return 0


if __name__ == "__main__":
    sys.exit(main())
