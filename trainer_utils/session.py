"""The session: what a training run needs before its first step, built in an order that is safe under
multi-process launchers.

It checks what needs the device first, then the run directory, tokenizer, model config (new, from --init_from,
or resumed), the stage's own checks, the tokenize-once data (file-locked, before any process group exists) and
the backend. It outlives the Trainers of one run: after a precision fallback the next Trainer resumes from it.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from common.device import DTYPES, choose_dtype, dtype_name
from common.errors import CheckpointError, ConfigError, TokenizerError
from common.files import LATEST_NAME, METRICS_NAME, shipped_path
from dataset.config import training_data
from dataset.kinds import TEXT
from dataset.tasks import load_tasks
from dataset.tokenizer import DEFAULT_TOKENIZER_DIR, Tokenizer
from evaluation.probes import read_probe_file, read_prompt_file
from model import ModelConfig, PocketLM
from model.checkpoint import load_model
from model.config import architecture, config_from_flags, model_name, switches
from model.inference import read_train_info, token_byte_lengths
from model.loading import WEIGHTS_NAME, is_lora_dir, load_state_into, read_state_dict, resolve_model_dir
from model.lora import LoraSpec, apply_lora, base_reference, load_lora_model, read_lora_config

from .backend import Backend
from .budget import BudgetClock, BudgetPlan
from .checkpoint import latest_checkpoint
from .config import NEW_MODEL_FLAGS, ModelOptions, TrainConfig
from .context import LoopControl, RunContext, SetupContext, TrainState
from .distributed import detect_env, device_for, make_backend
from .metrics import TrainClock
from .objectives import Objective
from .routing import RouterBalance
from .runtime import Precision, seed_everything, wider_dtype
from .stages import Stage, get_stage


def is_on(setting: str | None) -> bool:
    """Whether an optional file or list setting names something: not unset, and not 'none' (which turns off a
    recipe's value from the command line)."""
    return bool(setting) and setting.lower() != "none"


def check_resumed_model(options: ModelOptions, saved: ModelConfig, run_dir: Path) -> None:
    """ConfigError when model flags given with --resume describe another model than the run being resumed
    (they cannot take effect). Flags that agree with it are fine: Slurm requeues repeat the whole command."""
    given = [k for k in (*NEW_MODEL_FLAGS, *switches("training")) if getattr(options, k) is not None]
    if not given:
        return
    differ = {}
    if any(getattr(options, k) is not None for k in NEW_MODEL_FLAGS):
        described = config_from_flags(options, saved.vocab_size)
        differ = {k: (v, getattr(saved, k)) for k, v in architecture(described).items() if getattr(saved, k) != v}
    for name in switches("training"):
        value = getattr(options, name)
        if value is not None and value != getattr(saved, name):
            differ[name] = (value, getattr(saved, name))
    if differ:
        what = ", ".join(f"{k} {new} (the run has {old})" for k, (new, old) in differ.items())
        raise ConfigError(f"{', '.join('--' + k for k in given)} cannot take effect with --resume: they describe "
                          f"{what}; the model of {run_dir} is fixed. Drop them, or start a new run")


class Session:
    """Everything a training run needs before the first step, built in an order that is safe under
    multi-process launchers: data preparation (file-locked) before the process group exists."""

    def __init__(self, config: TrainConfig, stage: Stage | str) -> None:
        self.config, self.stage = config, get_stage(stage)
        m, run = config.model, config.run
        # Flags that need the device are checked before anything slow.
        self.env = detect_env()
        self.device = device_for(self.env, config.precision.device)
        # the precision policy's answer for this device (common/device.py), said in the run header
        choice = choose_dtype(config.precision.dtype, self.device, "train")
        self.precision, self.precision_reason = Precision(self.device, choice.dtype), choice.reason
        if choice.warning and self.env.rank == 0:
            print(f"warning: {choice.warning}", file=sys.stderr)
        seed_everything(config.optim.seed)

        self.init_dir = resolve_model_dir(m.init_from) if m.init_from else None
        init_config = ModelConfig.load(self.init_dir / "config.json") if self.init_dir else None
        # the default name describes the model actually trained (the init checkpoint's, or the new one's)
        name = run.run_name or f"{self.stage.name}-{model_name(init_config or config_from_flags(m))}"
        self.run_dir = Path(run.out_dir) / name
        self.resume_from = latest_checkpoint(self.run_dir) if run.resume else None
        if run.resume and self.resume_from is None:
            print(f"--resume: no checkpoint in {self.run_dir} yet; starting a new run", file=sys.stderr)
        # precision fallbacks of this run so far (--on_nonfinite fallback), carried by its checkpoints
        self.fallbacks: list[dict[str, Any]] = []
        if self.resume_from is not None:
            self._resume_precision()

        # prompt files are read now: a missing or malformed one must not wait for the first evaluation
        ev = config.eval
        self.samples = read_prompt_file(shipped_path(ev.sample_prompts)) if is_on(ev.sample_prompts) else []
        self.probes = read_probe_file(shipped_path(ev.probes)) if is_on(ev.probes) else []
        self.eval_tasks = load_tasks(ev.eval_tasks, ev.eval_task_items) if is_on(ev.eval_tasks) else []
        self.tokenizer = Tokenizer(config.data.tokenizer or self._default_tokenizer())
        self._check_init_tokenizer()
        self.model_config = self._model_config(init_config)
        self.tokenizer.check_fits(self.model_config.vocab_size)
        self.max_seq_len = m.max_seq_len or self.model_config.max_seq_len
        if self.max_seq_len > self.model_config.max_position_embeddings:
            raise ConfigError(f"--max_seq_len {self.max_seq_len} exceeds the model's max_position_embeddings "
                              f"({self.model_config.max_position_embeddings})")
        self.stage.check_session(self.setup_context())
        self.lora, self.base_ref = self._lora()
        # Every rank checks (before any collective exists, so all stop together); only rank 0 deletes. A run is
        # there when it saved a checkpoint or logged a record: a --no-checkpoints run, or one stopped before its
        # first save, leaves only its metrics, which a new run would otherwise append to.
        if not run.resume and any((self.run_dir / name).exists() for name in (LATEST_NAME, METRICS_NAME)):
            if not run.overwrite:
                raise ConfigError(f"{self.run_dir} already holds a run; pass --resume to continue it, "
                                  "--overwrite to replace it, or --run_name to start another")
            if self.env.rank == 0:
                shutil.rmtree(self.run_dir)
        self.kind = self.stage.data_kind(config.data)
        self.chat = self.kind != TEXT  # samples, probes and the saved checkpoints use the chat template
        record_tokens = self.stage.record_tokens(self.setup_context())
        self.data = training_data(config.data, self.tokenizer, self.kind, record_tokens, config.optim.batch_size,
                                  config.optim.seed, log=lambda msg: print(msg, file=sys.stderr))
        self.train_data, self.val_sets = self.data.train, self.data.val
        if config.eval.early_stopping and not self.val_sets:
            raise ConfigError(f"{' '.join(config.data.data_path)}: no validation documents at --val_fraction "
                              f"{config.data.val_fraction}; early stopping needs some (raise --val_fraction)")
        self.backend: Backend = make_backend(config, self.env, self.device, self.precision)

    def describe(self, model_config: ModelConfig, derived: dict[str, Any]) -> dict[str, Any]:
        """The run header and train_config.json's "resolved": what this session settled on, the model, and what
        the Trainer `derived` (its steps, batch and schedule), in that order."""
        world = self.backend.world_size
        header = {"stage": self.stage.name, "run_dir": str(self.run_dir), "device": str(self.device),
                  "dtype": dtype_name(self.precision.dtype), "precision": self.precision_reason,
                  "world_size": world, "backend": self.backend.name, **derived,
                  "max_seq_len": self.max_seq_len, "train_samples": len(self.train_data),
                  "val_samples": sum(len(v.data) for v in self.val_sets),
                  "tokenizer": str(self.tokenizer.path), "tokenizer_sha256": self.tokenizer.sha256,
                  "model": model_config.to_dict(), "parameters": model_config.num_parameters()}
        if len(self.data.sources) > 1:
            header["data_mixture"] = self.data.sources
        if self.fallbacks:
            header["precision_fallback"] = self.fallbacks
        return header

    def setup_context(self) -> SetupContext:
        """What the stage's setup hooks see of this session (trainer_utils/context.py)."""
        return SetupContext(self.config.objective, self.tokenizer, self.max_seq_len, self.init_dir, self.resume_from,
                            self.device)

    def run_context(self, control: LoopControl, model: PocketLM, optimizer: torch.optim.Optimizer,
                    objective: Objective, router: RouterBalance | None, plan: BudgetPlan | None,
                    budget_clock: BudgetClock | None, first_steps: int = 0) -> RunContext:
        """What the stage's hooks and the components see of a Trainer's run (trainer_utils/context.py): this
        session's settled facts, and what the Trainer built."""
        return RunContext(
            config=self.config, options=self.config.objective, control=control, device=self.device,
            precision=self.precision, backend=self.backend, model=model, optimizer=optimizer, objective=objective,
            router=router, tokenizer=self.tokenizer, max_seq_len=self.max_seq_len, kind=self.kind, chat=self.chat,
            train_data=self.train_data, val_sets=self.val_sets, token_bytes=self.token_bytes, init_dir=self.init_dir,
            run_dir=self.run_dir, adapters=self.lora is not None, eval_tasks=self.eval_tasks, samples=self.samples,
            probes=self.probes, metric_unit=self.stage.metric_unit, memory_rows=self.stage.memory_rows,
            estimates_memory=self.stage.estimates_memory, plan=plan, budget_clock=budget_clock,
            first_steps=first_steps, state=TrainState(),
            clock=TrainClock(self.device))

    def train_info(self, tokens_seen: int, val_loss: float | None) -> dict[str, Any]:
        """A checkpoint's train_info.json: how it is prompted, which stage trained it and how far, its precision."""
        info = {"prompt_format": "chat" if self.chat else "text", "method": self.stage.name,
                "tokens_seen": tokens_seen, "val_loss": val_loss, "dtype": dtype_name(self.precision.dtype)}
        if self.fallbacks:
            info["precision_fallback"] = self.fallbacks
        return info

    def objective(self) -> Objective:
        """What this stage minimises, with its frozen helpers on the device."""
        return self.stage.objective(self.setup_context())

    def _resume_precision(self) -> None:
        """A resumed run keeps the precision it fell back to: a requeued job repeating the original command
        (say --dtype float16) must not walk back into the trouble. A wider --dtype still wins."""
        info = read_train_info(self.resume_from)
        self.fallbacks = list(info.get("precision_fallback", []))
        if not self.fallbacks:
            return
        dtype = wider_dtype(self.precision.dtype, DTYPES[self.fallbacks[-1]["to"]])
        if dtype != self.precision.dtype:
            last = self.fallbacks[-1]
            self.precision_reason = (f"{dtype_name(dtype)}: this run fell back to it from {last['from']} at step "
                                     f"{last['step']}")
            print(f"note: resuming in {self.precision_reason}", file=sys.stderr)
            self.precision = Precision(self.device, dtype)

    def fall_back(self, event: dict[str, Any]) -> None:
        """Continue in event["to"] from the run's last checkpoint (or its initial weights, when it has none):
        the next Trainer resumes from there with the new precision."""
        self.fallbacks.append(event)
        self.precision = Precision(self.device, DTYPES[event["to"]])
        self.precision_reason = f"{event['to']}: fell back from {event['from']} at step {event['step']}"
        self.backend.set_precision(self.precision)
        self.resume_from = latest_checkpoint(self.run_dir)

    def token_bytes(self) -> torch.Tensor | None:
        """UTF-8 bytes per token id, for the validation bits per byte of per-token losses; None (said on rank 0)
        for a tokenizer that is not byte-level, whose tokens have no fixed byte length."""
        try:
            return token_byte_lengths(self.tokenizer.path, self.model_config.vocab_size)
        except CheckpointError as e:
            if self.env.rank == 0:
                print(f"note: no val_bpb in the log: {e}", file=sys.stderr)
            return None

    def _check_init_tokenizer(self) -> None:
        """--init_from weights learned one tokenizer's ids: another --tokenizer would train them on mismatched ids
        (resume checks its tokenizer by hash too, when the checkpoint is loaded)."""
        init = self.init_dir
        if init is None or self.resume_from is not None or not (init / "tokenizer.json").is_file():
            return
        if Tokenizer(init).sha256 != self.tokenizer.sha256:
            raise TokenizerError(f"--tokenizer {self.tokenizer.path} is not the tokenizer --init_from {init} was "
                                 "trained with: its weights would read other ids. Drop --tokenizer (the "
                                 "checkpoint's is used), or start a new model with this tokenizer")

    def _default_tokenizer(self) -> Path:
        if self.resume_from is not None:
            return self.resume_from
        if self.init_dir is not None and (self.init_dir / "tokenizer.json").exists():
            return self.init_dir
        return DEFAULT_TOKENIZER_DIR

    def _model_config(self, init_config: ModelConfig | None) -> ModelConfig:
        m = self.config.model
        if self.resume_from is not None:
            saved = ModelConfig.load(self.resume_from / "config.json")
            check_resumed_model(m, saved, self.run_dir)
            return saved
        if init_config is not None:
            for name in switches("training"):  # training choices, not the shape: they apply to loaded weights
                if getattr(m, name) is not None:
                    setattr(init_config, name, getattr(m, name))
            init_config.validate()
            return init_config
        return config_from_flags(m, self.tokenizer.vocab_size)

    def _lora(self) -> tuple[LoraSpec | None, dict[str, str] | None]:
        """The adapters to train (None: every weight) and the base they adapt: the --init_from model, or on
        resume the one the run's checkpoint names (checked by its hash when loaded)."""
        o = self.config.lora
        if not self.stage.adapts or o.lora_rank == 0:
            return None, None
        spec = LoraSpec(o.lora_rank, o.lora_alpha, tuple(o.lora_targets), o.lora_dropout)
        spec.validate()
        if self.resume_from is None:
            return spec, base_reference(self.init_dir)
        saved, base = read_lora_config(self.resume_from)
        if saved != spec:
            raise ConfigError(f"the LoRA flags describe other adapters ({spec}) than the run being resumed has "
                              f"({saved}); drop them, or start a new run")
        return saved, base

    def build_model(self) -> PocketLM:
        """The model to train: new, or the --init_from weights (a LoRA run's merged in), with adapters when
        training LoRA; on resume, the weights come from the checkpoint afterwards (the base here, for LoRA)."""
        if self.lora is not None and self.resume_from is not None:
            return load_lora_model(self.resume_from, merge=False)
        model = PocketLM(self.model_config)
        if self.init_dir is not None and self.resume_from is None:
            init = self.init_dir
            state = load_model(init)[0].state_dict() if is_lora_dir(init) else read_state_dict(init / WEIGHTS_NAME)
            load_state_into(model, state, str(init))
        if self.lora is not None:
            apply_lora(model, self.lora)
        return model


