"""The training configuration: typed groups (data, model, optimization, precision/devices, output/logging,
evaluation) that every training script shares, with MiniMind's flag names. Stages (trainer_utils/stages) differ
in their defaults, in the shared settings they have (a setting's `feature`: adapters for LoRA, conversations for
chat data), and in their own settings, the `objective` group, which each stage declares itself
(train_config_class: DPO's --beta, distillation's --teacher, GRPO's --num_generations, ...).

    python train_pretrain.py --config recipes/minimind-26m-pretrain.yaml --max_steps 100

Checks that need no data, model or device run in TrainConfig.check(), before anything slow; the loop's
Session adds the ones that need the device or the checkpoint being loaded.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from common.config import option
from common.errors import ConfigError
from common.files import require_package
from dataset.config import DataConfig
from model.config import get_preset, model_flags, switches
from model.inference import DeviceConfig

from .budget import parse_duration
from .runtime import compile_toolchain_problem

AUTO_PRESET = "auto"  # --preset auto: the plan sizes the model for --time_budget (trainer_utils/planner.py)
# the flags that describe a new model: refused with --init_from, whose weights bring their own
NEW_MODEL_FLAGS = ("preset", *switches("shape", "architecture", "init"))


# Which model to train: --preset and every model switch (declared once, as ModelConfig fields: model/config.py),
# then what only training has: the weights to start from and how the step runs.
ModelOptions = dataclasses.make_dataclass("ModelOptions", [
    *model_flags(),
    ("init_from", str | None, option(None, "start from the weights of this run / checkpoint / model dir",
                                     metavar="DIR")),
    ("grad_checkpointing", bool, option(False, "recompute blocks in backward: less memory, ~30% more compute")),
    ("compile", bool, option(False, "torch.compile the model")),
], namespace={"title": "model", "__doc__": "Which model to train: a preset (optionally reshaped and switched), or "
                                           "the weights of an earlier run."})


@dataclass
class OptimConfig:
    """How long and how fast to learn."""

    title: ClassVar[str] = "optimization"
    epochs: int = option(1, "passes over the training data", at_least=1)
    max_steps: int | None = option(None, "optimizer steps (overrides --epochs)", at_least=1)
    time_budget: str | None = option(None, "train for this long (90s, 10m, 2h; setting up included): the steps "
                                           "are planned from measured step, evaluation and checkpoint times, the "
                                           "schedule laid over them; --max_steps / --epochs stay upper bounds",
                                     metavar="DURATION")
    batch_size: int = option(32, "sequences per micro-batch per device", at_least=1)
    accumulation_steps: int = option(1, "micro-batches per optimizer step", at_least=1)
    learning_rate: float = option(5e-4, "peak learning rate", above=0)
    min_lr: float | None = option(None, "end of the cosine (default: learning_rate / 10)", at_least=0)
    warmup_steps: int | None = option(None, "linear warmup steps (default: --warmup_ratio of all steps)",
                                      at_least=0)
    warmup_ratio: float = option(0.01, "warmup share of all steps when --warmup_steps is not given", at_least=0,
                                 below=1)
    weight_decay: float = option(0.1, "weight decay on matrices (never on norms, biases, embeddings)",
                                 at_least=0)
    optimizer: Literal["auto", "adamw", "muon", "sgd"] = option(
        "adamw", "optimizer. muon: Muon on the blocks' weight matrices, AdamW on embeddings, norms, biases and "
                 "head; auto: muon, except adamw under --deepspeed (docs/training.md, \"Recipe: Muon and QK-norm\")")
    beta1: float = option(0.9, "AdamW beta1", at_least=0, below=1)
    beta2: float = option(0.95, "AdamW beta2", at_least=0, below=1)
    adam_eps: float = option(1e-8, "AdamW epsilon", above=0)
    momentum: float = option(0.9, "SGD momentum (Nesterov)", at_least=0, below=1)
    muon_lr: float | None = option(None, "Muon's peak learning rate (default: --learning_rate; its updates are "
                                         "scaled to AdamW's RMS, so the two are on one scale)", above=0)
    muon_base_width: int | None = option(None, "the model width (hidden size) --muon_lr is for: a model of "
                                               "another width trains Muon's matrices at --muon_lr x muon_base_width "
                                               "/ hidden_size, as their best rate falls with the width (muP's rule "
                                               "for hidden matrices; docs/training.md). Default: --muon_lr at any "
                                               "width", at_least=1)
    muon_momentum: float = option(0.95, "Muon momentum (Nesterov)", at_least=0, below=1)
    muon_ns_steps: int | None = option(None, "Newton-Schulz iterations per Muon update (default: 5 where the "
                                             "iteration runs in bf16 or fp16, 3 in fp32, docs/precision.md)",
                                       at_least=1)
    grad_clip: float = option(1.0, "clip the gradient norm to this; 0 disables clipping", at_least=0)
    max_bad_steps: int = option(10, "stop after this many consecutive steps skipped for non-finite gradients",
                                at_least=1)
    seed: int = option(42, "seed of the initialisation and the data order")

    @property
    def budget_s(self) -> float | None:
        """--time_budget in seconds, None without one (ConfigError for a duration that is not one)."""
        return None if self.time_budget is None else parse_duration(self.time_budget)

    def warmup(self, steps: int) -> int:
        """The warm-up of a run of `steps` steps: --warmup_steps, or --warmup_ratio of them."""
        return self.warmup_steps if self.warmup_steps is not None else int(self.warmup_ratio * steps)

    @property
    def final_lr(self) -> float:
        """Where the cosine ends: --min_lr, or a tenth of --learning_rate."""
        return self.min_lr if self.min_lr is not None else self.learning_rate / 10


@dataclass
class PrecisionConfig(DeviceConfig):
    """Number formats and where the run executes: evaluation's --dtype / --device, plus training's own."""

    tf32: bool = option(True, "TF32 tensor cores for fp32 matmuls on Ampere+ GPUs (--no-tf32: strict fp32)")
    on_nonfinite: Literal["fallback", "stop"] = option(
        "fallback", "when --max_bad_steps consecutive steps are non-finite or the fp16 loss scale falls below 1: "
                    "'fallback' reloads the last checkpoint and continues in bf16 (fp32 where bf16 is not native, "
                    "or after bf16), 'stop' exits 1")
    deepspeed: str | None = option(None, "DeepSpeed config JSON (e.g. launch/ds_zero2.json)",
                                    metavar="F.json")
    # The deepspeed launcher appends --local_rank=N; the same value is in $LOCAL_RANK, which is what is read.
    local_rank: int | None = option(None, "", hidden=True, persist=False, aliases=("--local-rank",))
    dist_timeout: int = option(600, "seconds a collective may wait for other ranks before failing", at_least=1)

    def deepspeed_config(self) -> dict[str, Any]:
        """The --deepspeed file's settings, or ConfigError naming the file."""
        try:
            config = json.loads(Path(self.deepspeed).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"--deepspeed {self.deepspeed}: {getattr(e, 'strerror', None) or e}") from None
        if not isinstance(config, dict):
            raise ConfigError(f"--deepspeed {self.deepspeed}: expected a JSON object")
        return config


@dataclass
class RunConfig:
    """Where the run is written and what it reports."""

    title: ClassVar[str] = "output and logging"
    out_dir: str = option("out", "directory that holds the runs", metavar="DIR")
    run_name: str | None = option(None, "default: <stage>-<preset of the model>", metavar="NAME")
    resume: bool = option(False, "continue out_dir/run_name from its latest checkpoint (a fresh start if it "
                                 "has none)", persist=False)
    overwrite: bool = option(False, "delete an existing run of the same name first", persist=False)
    save_interval: int = option(500, "steps between checkpoints", at_least=1)
    checkpoints: bool = option(True, "write checkpoints (--no-checkpoints: none at all, for benchmarks; the run "
                                     "then cannot be resumed or loaded)")
    keep_last: int = option(3, "checkpoints kept", at_least=1)
    log_interval: int = option(10, "steps between log records", at_least=1)
    use_wandb: bool = option(False, "log to wandb (offline unless WANDB_API_KEY is set)")
    wandb_project: str = option("pocketlm", "wandb project", metavar="NAME")
    use_tensorboard: bool = option(False, "log to TensorBoard (out/<run>/tensorboard)")

    @property
    def checkpoint_every(self) -> int | None:
        """Steps between checkpoints; None with --no-checkpoints."""
        return self.save_interval if self.checkpoints else None


@dataclass
class EvalOptions:
    """When the model is scored on held-out data, and when that score ends the run."""

    title: ClassVar[str] = "evaluation"
    eval_interval: int = option(500, "steps between validation passes", at_least=1)
    eval_batches: int = option(20, "validation batches per pass", at_least=1)
    early_stop_patience: int | None = option(
        None, "stop when the validation loss has not improved for this many evaluations (off by default)",
        at_least=1)
    overfit_gap: float | None = option(
        None, "stop when the validation loss exceeds the training loss by more than this (off by default; "
              "0.5 is a common choice)", above=0)
    sample_prompts: str = option("dataset/prompts/samples.txt", "prompts continued at every evaluation, with "
                                 "fixed sampling settings and seed, into samples.jsonl ('none': off)",
                                 metavar="FILE")
    probes: str | None = option(None, "prompt<TAB>expected file scored at every evaluation into probes.jsonl "
                                      "(e.g. dataset/prompts/probes.tsv; 'none': off, e.g. over a recipe's)",
                                metavar="FILE")
    sample_tokens: int = option(32, "tokens generated per sample prompt", at_least=1)
    layer_stats: bool = option(True, "per-layer attention entropy and activation RMS of a fixed validation "
                                     "batch at every evaluation, into metrics.jsonl (and histograms)")
    eval_tasks: str | None = option(None, "benchmarks scored at every evaluation, comma-separated: names as "
                                          "eval_model.py --tasks takes them (arc_easy, hellaswag, ..., core) or task "
                                          "files; logged as task/<name>/acc, acc_norm, centred (or bpb); "
                                          "'none': off, e.g. over a recipe's",
                                    metavar="NAMES")
    eval_task_items: int = option(200, "--eval_tasks: items scored per task (its first N)", at_least=1)

    @property
    def early_stopping(self) -> bool:
        return self.early_stop_patience is not None or self.overfit_gap is not None


@dataclass
class LoraOptions:
    """Low-rank adapters: rank-r updates of chosen projections are trained, the model itself stays frozen."""

    title: ClassVar[str] = "LoRA"
    lora_rank: int = option(0, "adapter rank; 0 trains every weight instead (train_lora.py: 16)", at_least=0,
                            feature="adapters")
    lora_alpha: float = option(32.0, "adapter scale: updates are multiplied by lora_alpha / lora_rank", above=0,
                               feature="adapters")
    lora_targets: list[str] = option(["q_proj", "k_proj", "v_proj", "o_proj"], "projections that get adapters "
                                     "(also gate_proj, up_proj, down_proj)", several=True, metavar="NAME",
                                     feature="adapters")
    lora_dropout: float = option(0.0, "dropout on the adapters' input", at_least=0, below=1, feature="adapters")


@dataclass
class NoOptions:
    """The `objective` group of a stage that has no settings of its own (pretraining, SFT, LoRA). A stage that has
    some declares them as a dataclass of its own (Stage.options): see train_config_class."""

    title: ClassVar[str] = "objective"


@dataclass
class TrainConfig:
    """Everything a training run is told; what it derives from it (device, steps, model) is written beside it."""

    data: DataConfig
    model: ModelOptions
    optim: OptimConfig
    precision: PrecisionConfig
    run: RunConfig
    eval: EvalOptions
    lora: LoraOptions
    objective: NoOptions  # the stage's own settings (Stage.options): train_config_class

    def check(self) -> None:
        """Cross-setting checks that need nothing slow (no data, model or device), so they fail at once."""
        if hasattr(self.objective, "check"):  # the stage's own options check themselves
            self.objective.check()
        if self.optim.optimizer == "auto":  # pretraining's default: Muon where it can run
            self.optim.optimizer = "adamw" if self.precision.deepspeed is not None else "muon"
        _ = self.optim.budget_s  # a bad duration is refused before anything slow
        if self.run.resume and self.run.overwrite:
            raise ConfigError("--resume and --overwrite contradict each other")
        if self.eval.early_stopping and not self.run.checkpoints:
            raise ConfigError("--early_stop_patience and --overfit_gap keep the best checkpoint; they need "
                              "checkpoints (drop --no-checkpoints)")
        if self.eval.early_stopping and self.data.val_fraction == 0:
            raise ConfigError("--early_stop_patience and --overfit_gap watch the validation loss; they need "
                              "--val_fraction > 0")
        if self.model.preset == AUTO_PRESET:
            if self.optim.time_budget is None:
                raise ConfigError("--preset auto sizes the model for a time budget: add --time_budget (90s, 10m, 2h)")
            reshaped = [f"--{k}" for k in switches("shape") if getattr(self.model, k) is not None]
            if reshaped:
                raise ConfigError(f"--preset auto picks the model's whole shape; drop {', '.join(reshaped)}")
        elif self.model.preset is not None:
            get_preset(self.model.preset)  # an unknown name is refused here, before the device is looked at
        if self.model.init_from is not None:
            given = [f"--{k}" for k in NEW_MODEL_FLAGS if getattr(self.model, k) is not None]
            if given:
                raise ConfigError(f"{', '.join(given)} cannot take effect with --init_from: the model (its shape "
                                  f"and weights) comes from {self.model.init_from}; "
                                  f"drop {'it' if len(given) == 1 else 'them'}")
        for flag, what in (("muon_lr", "Muon's learning rate"), ("muon_base_width", "the width Muon's rate is for"),
                           ("muon_ns_steps", "Muon's Newton-Schulz iterations")):
            if self.optim.optimizer == "muon" or getattr(self.optim, flag) is None:
                continue
            if flag in getattr(self, "typed", ()):
                raise ConfigError(f"--{flag} sets {what}; the optimizer is {self.optim.optimizer} (add "
                                  f"--optimizer muon, or drop --{flag})")
            setattr(self.optim, flag, None)  # a recipe's, for Muon: moot here, and recorded as unused
        if self.model.compile and (problem := compile_toolchain_problem()):
            raise ConfigError(problem)
        if self.precision.deepspeed is not None:
            require_package("deepspeed", "--deepspeed")
            if self.precision.dtype == "float16":
                raise ConfigError("use --dtype bfloat16 or float32 with --deepspeed (DeepSpeed does its own fp16 "
                                  "loss scaling, which the loop does not drive)")
            self.precision.deepspeed_config()  # readable and valid now, not after tokenizing
            if self.optim.optimizer == "muon":
                raise ConfigError("--optimizer muon does not run under --deepspeed: ZeRO shards the optimizer state "
                                  "as flat slices, and Muon orthogonalises whole matrices; train it with DDP "
                                  "(torchrun) or use --optimizer adamw")
        if self.run.use_wandb:
            require_package("wandb", "--use_wandb")
        if self.run.use_tensorboard:
            require_package("tensorboard", "--use_tensorboard")


@functools.cache
def train_config_class(options: type) -> type[TrainConfig]:
    """TrainConfig with a stage's own options as its `objective` group. The group keeps its name whatever the
    stage, so the flags, a recipe's `objective:` section and train_config.json read as they always have, and each
    script parses (and --help shows) only its own stage's settings."""
    if options is NoOptions:
        return TrainConfig
    return dataclasses.make_dataclass(f"TrainConfig[{options.__name__}]", [("objective", options)],
                                      bases=(TrainConfig,))
