"""`python -m model` prints the preset table (shapes and parameter counts) shown in docs/model.md. With --estimate it
prints the memory one training step needs instead (model/memory.py explains the formula); with --plan, which preset
to pretrain in a time budget, from training steps timed on this device (trainer_utils/planner.py):

    python -m model --estimate --preset minimind-26m --batch_size 8 --max_seq_len 512 --dtype bfloat16
    python -m model --plan --time_budget 2h --data_path pretrain_hq.jsonl

The model flags are the trainers', with the same meaning, so the estimate describes the model they would build.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import ClassVar, Literal

from common.config import option, parse_config
from common.errors import ConfigError, PocketLMError

from .config import ModelConfig, config_from_flags, model_flags, model_name, preset_table
from .memory import estimate_memory

# The model flags are the trainers' (model/config.py model_flags: --preset and every switch), so the estimate
# describes the model they would build; then the step whose memory is estimated.
StepOptions = dataclasses.make_dataclass("StepOptions", [
    ("estimate", bool, option(False, "print the memory one training step needs instead of the preset table")),
    *model_flags(),
    ("vocab_size", int | None, option(None, "vocabulary (default: the preset's; the trainers take the tokenizer's, "
                                            "6400 for the shipped one)", at_least=1)),
    ("batch_size", int, option(32, "sequences per micro-batch", at_least=1)),
    ("accumulation_steps", int, option(1, "micro-batches per optimizer step", at_least=1)),
    ("dtype", Literal["float32", "bfloat16", "float16"], option(
        "bfloat16", "autocast dtype (the trainers' --dtype auto: bfloat16 on Ampere+ GPUs and CPUs with native "
                    "bf16, float16 on older GPUs, else float32)")),
    ("grad_checkpointing", bool, option(False, "recompute blocks in backward: keep only each block's input")),
    ("optimizer", Literal["adamw", "muon"], option("adamw", "whose state is counted: AdamW on every weight, or Muon "
                                                             "on the hidden matrices and AdamW on the rest")),
], namespace={"title": "memory estimate", "__doc__": "The model and the training step whose memory --estimate "
                                                     "prints."})


@dataclass
class PlanOptions:
    """--plan: time each preset's training steps here and recommend what a time budget should train."""

    title: ClassVar[str] = "planning a run"
    plan: bool = option(False, "time a few training steps of each preset on this device and recommend the one to "
                               "pretrain in --time_budget (trainer_utils/planner.py)")
    time_budget: str | None = option(None, "the training time to plan for: 90s, 10m, 2h", metavar="DURATION")
    device: str = option("auto", "where to time the steps: auto, cpu, cuda, cuda:N, mps")
    data_path: str | None = option(None, "the pretraining JSONL to train on: its tokens (estimated) bound the epochs",
                                   metavar="F.jsonl")
    presets: list[str] = option([], "presets to plan (default: the depth family, depth-1 to depth-48)", several=True,
                                metavar="NAME")


@dataclass
class ModelCommand:
    """`python -m model`'s settings."""

    step: StepOptions
    plan: PlanOptions


def model_config(o: StepOptions) -> ModelConfig:
    """The config the trainers build from the same flags."""
    return config_from_flags(o, o.vocab_size)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        command = parse_config(ModelCommand, argv, __doc__)
        o, p = command.step, command.plan
        if p.plan:
            from trainer_utils.planner import main as plan_main  # it trains: the trainer's modules

            return plan_main(p.time_budget, p.device, p.data_path, p.presets or None)
        if not o.estimate:
            if argv:
                raise ConfigError("the flags describe a training step for --estimate, or a budget for --plan; add "
                                  "one of them (without flags, python -m model prints the preset table)")
            print(preset_table())
            return 0
        cfg = model_config(o)
        estimate = estimate_memory(cfg, o.batch_size, cfg.max_seq_len, o.dtype, o.grad_checkpointing,
                                   o.accumulation_steps, name=model_name(cfg), optimizer=o.optimizer)
    except PocketLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(estimate.lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
