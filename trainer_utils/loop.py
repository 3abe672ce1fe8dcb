"""The one training loop shared by pretraining and SFT, and the session that sets it up.

Session: checks what needs the device, then the run directory, tokenizer, model config (new, from --init_from,
or resumed), tokenize-once data, and the backend, in that order (data preparation is file-locked and happens
before any process group exists).
Trainer.fit(): for each optimizer step, take this rank's micro-batches from the global cursor, normalise the
loss by the valid target tokens of the whole step (all micro-batches, all ranks), backward with no_sync on
all but the last micro-batch, clip and step (skipping non-finite steps), then log, evaluate and checkpoint
when due. When steps keep failing in a reduced precision, run() builds a new Trainer that resumes the last
checkpoint in a wider one (--on_nonfinite fallback).
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import io
import json
import math
import re
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from common.config import RESOLVED_KEY, to_dict
from common.device import DTYPES, choose_dtype, dtype_name, precision_policy
from common.errors import CheckpointError, ConfigError, PocketLMError, TokenizerError, TrainingError
from common.files import BEST_NAME, TRAIN_CONFIG_NAME, file_sha256, shipped_path, write_atomic
from dataset.config import DataConfig, training_data
from dataset.jsonl import read_records
from dataset.tokenizer import DEFAULT_TOKENIZER_DIR, Tokenizer
from model import ModelConfig, PocketLM
from model.config import architecture, model_name, reshape_preset
from model.generate import generate
from model.inference import read_train_info, token_byte_lengths
from model.loading import (
    ADAPTER_WEIGHTS_NAME,
    LORA_CONFIG_NAME,
    WEIGHTS_NAME,
    is_lora_dir,
    load_model,
    load_state_into,
    read_state_dict,
    resolve_model_dir,
)
from model.lora import (
    LoraSpec,
    apply_lora,
    base_reference,
    load_lora_model,
    load_lora_state_dict,
    read_lora_config,
    save_lora,
)
from model.memory import MemoryEstimate, estimate_memory, measure_step_peak
from model.probes import read_probe_file, read_prompt_file, run_probes
from model.stats import layer_stats

from .backend import Backend
from .checkpoint import (
    checkpoint_dir,
    latest_checkpoint,
    load_training_state,
    mark_best,
    new_staging_dir,
    save_checkpoint,
    staging_dir,
)
from .config import ADAPTED, DEFAULT_PRESET, ModelOptions, TrainConfig, parse_train_config
from .data import StepFeeder, eval_batches
from .distributed import detect_env, device_for, make_backend
from .metrics import MetricsLogger, TrainClock, flops_per_token, peak_flops
from .objectives import DPO, Batch, Distillation, LanguageModeling, Objective, sequence_log_probs, target_bytes
from .optim import WarmupCosine, build_optimizer
from .routing import RouterBalance
from .runtime import (
    Precision,
    StopSignal,
    fallback_dtype,
    rng_state,
    seed_everything,
    set_rng_state,
    wider_dtype,
)

OOM_HELP = ("out of GPU memory. Reduce memory with a smaller --batch_size and more --accumulation_steps "
            "(same effective batch), --grad_checkpointing, or a shorter --max_seq_len. The last checkpoint "
            "is intact.")


def new_model_config(options: ModelOptions, vocab_size: int | None = None) -> ModelConfig:
    """The config of a new model: the preset, reshaped by --hidden_size / --num_hidden_layers / --max_seq_len and
    the mixture-of-experts, architecture (--rope_theta, --qk_norm) and init (--zero_init_residual) flags, with the
    tokenizer's vocabulary (None: the preset's)."""
    extra: dict[str, Any] = {} if vocab_size is None else {"vocab_size": vocab_size}  # the tokenizer actually used
    for name in (*ModelOptions.MOE_FLAGS, *ModelOptions.ARCHITECTURE_FLAGS, *ModelOptions.INIT_FLAGS,
                 *ModelOptions.TRAINING_FLAGS):
        if getattr(options, name) is not None:
            extra[name] = getattr(options, name)
    if options.num_experts_per_tok == 1 and options.norm_topk_prob is None:
        extra["norm_topk_prob"] = False  # top-1 is Switch-style: the default that works
    return reshape_preset(options.preset or DEFAULT_PRESET, options.hidden_size, options.num_hidden_layers,
                          options.max_seq_len, **extra)


def check_resumed_model(options: ModelOptions, saved: ModelConfig, run_dir: Path) -> None:
    """ConfigError when model flags given with --resume describe another model than the run being resumed
    (they cannot take effect). Flags that agree with it are fine: Slurm requeues repeat the whole command."""
    given = [k for k in (*ModelOptions.SHAPE_FLAGS, *ModelOptions.TRAINING_FLAGS) if getattr(options, k) is not None]
    if not given:
        return
    differ = {}
    if any(getattr(options, k) is not None for k in ModelOptions.SHAPE_FLAGS):
        described = new_model_config(options, saved.vocab_size)
        differ = {k: (v, getattr(saved, k)) for k, v in architecture(described).items() if getattr(saved, k) != v}
    for name in ModelOptions.TRAINING_FLAGS:
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

    def __init__(self, config: TrainConfig, stage: str) -> None:
        self.config, self.stage = config, stage
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
        name = run.run_name or f"{stage}-{model_name(init_config or new_model_config(m))}"
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
        self.samples = read_prompt_file(shipped_path(ev.sample_prompts)) if ev.sample_prompts.lower() != "none" else []
        self.probes = read_probe_file(shipped_path(ev.probes)) if ev.probes and ev.probes.lower() != "none" else []
        if stage == "sft" and self.init_dir is None and self.resume_from is None:
            print("note: no --init_from; fine-tuning a randomly initialised model", file=sys.stderr)
        self.tokenizer = Tokenizer(config.data.tokenizer or self._default_tokenizer())
        self.model_config = self._model_config(init_config)
        self.tokenizer.check_fits(self.model_config.vocab_size)
        self.token_bytes = self._token_bytes()  # None: no val_bpb
        self.max_seq_len = m.max_seq_len or self.model_config.max_seq_len
        if self.max_seq_len > self.model_config.max_position_embeddings:
            raise ConfigError(f"--max_seq_len {self.max_seq_len} exceeds the model's max_position_embeddings "
                              f"({self.model_config.max_position_embeddings})")
        self.teacher_dir = self._check_teacher() if stage == "distill" else None
        self.lora, self.base_ref = self._lora()
        # Every rank checks (before any collective exists, so all stop together); only rank 0 deletes.
        if not run.resume and (self.run_dir / "latest").exists():
            if not run.overwrite:
                raise ConfigError(f"{self.run_dir} already holds a run; pass --resume to continue it, "
                                  "--overwrite to replace it, or --run_name to start another")
            if self.env.rank == 0:
                shutil.rmtree(self.run_dir)
        self.kind = data_kind(stage, config.data)
        self.chat = self.kind != "pretrain"  # samples, probes and the saved checkpoints use the chat template
        self.data = training_data(config.data, self.tokenizer, self.kind, self.max_seq_len, config.optim.batch_size,
                                  config.optim.seed, log=lambda msg: print(msg, file=sys.stderr))
        self.train_data, self.val_sets = self.data.train, self.data.val
        if config.eval.early_stopping and not self.val_sets:
            raise ConfigError(f"{' '.join(config.data.data_path)}: no validation documents at --val_fraction "
                              f"{config.data.val_fraction}; early stopping needs some (raise --val_fraction)")
        self.backend: Backend = make_backend(config, self.env, self.device, self.precision)

    def _check_teacher(self) -> Path:
        """The --teacher model dir, checked to speak the student's tokenizer and cover its context."""
        teacher = resolve_model_dir(self.config.objective.teacher)
        if not (teacher / "tokenizer.json").is_file():
            raise TokenizerError(f"--teacher {teacher}: no tokenizer.json, so it cannot be checked to share the "
                                 f"student's tokenizer ({self.tokenizer.path})")
        if Tokenizer(teacher).sha256 != self.tokenizer.sha256:
            raise TokenizerError(f"--teacher {teacher} uses another tokenizer than the student "
                                 f"({self.tokenizer.path}); distillation compares distributions token by token, "
                                 "so they must share one")
        cfg = ModelConfig.load(teacher / "config.json")
        if cfg.max_position_embeddings < self.max_seq_len:
            raise ConfigError(f"--teacher {teacher} covers {cfg.max_position_embeddings} positions, fewer than "
                              f"--max_seq_len {self.max_seq_len}")
        return teacher

    def objective(self, device: torch.device) -> Objective:
        """What this stage minimises, with its frozen helpers on the device."""
        o = self.config.objective
        if self.stage == "distill":
            teacher, _ = load_model(self.teacher_dir, device=device)
            return Distillation(teacher, o.alpha, o.temperature)
        if self.stage == "dpo":
            return DPO(o.beta, o.label_smoothing)
        return LanguageModeling()

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

    def _token_bytes(self) -> torch.Tensor | None:
        """UTF-8 bytes per token id, for the validation bits per byte of per-token losses; None for DPO (a loss
        per pair) and for a tokenizer that is not byte-level, whose tokens have no fixed byte length."""
        if self.stage == "dpo":
            return None
        try:
            return token_byte_lengths(self.tokenizer.path, self.model_config.vocab_size)
        except CheckpointError as e:
            if self.env.rank == 0:
                print(f"note: no val_bpb in the log: {e}", file=sys.stderr)
            return None

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
            for name in ModelOptions.TRAINING_FLAGS:  # training choices, not the shape: they apply to loaded weights
                if getattr(m, name) is not None:
                    setattr(init_config, name, getattr(m, name))
            init_config.validate()
            return init_config
        return new_model_config(m, self.tokenizer.vocab_size)

    def _lora(self) -> tuple[LoraSpec | None, dict[str, str] | None]:
        """The adapters to train (None: every weight) and the base they adapt: the --init_from model, or on
        resume the one the run's checkpoint names (checked by its hash when loaded)."""
        o = self.config.lora
        if self.stage not in ADAPTED or o.lora_rank == 0:
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


class Trainer:
    """Runs optimizer steps until max_steps, a stop signal, early stopping, or non-finite trouble (which ends
    it with `fallback` set when the run should continue in a wider precision)."""

    def __init__(self, session: Session) -> None:
        s, c = session, session.config
        self.s, self.config, self.backend = s, c, s.backend
        self.device, self.precision = s.backend.device, s.backend.precision
        o = c.optim
        seed_everything(o.seed)
        self.model = s.build_model().to(self.device)
        self.model.set_gradient_checkpointing(c.model.grad_checkpointing)
        self.optimizer = build_optimizer(self.model, o.optimizer, o.learning_rate, o.weight_decay,
                                         (o.beta1, o.beta2), o.momentum, self.device, o.adam_eps, o.muon_lr,
                                         o.muon_momentum)
        world = self.backend.world_size
        self.samples_per_step = o.batch_size * o.accumulation_steps * world
        steps_per_epoch = max(1, len(s.train_data) // self.samples_per_step)
        self.total_steps = o.max_steps or o.epochs * steps_per_epoch
        warmup = o.warmup_steps if o.warmup_steps is not None else int(o.warmup_ratio * self.total_steps)
        min_lr = o.min_lr if o.min_lr is not None else o.learning_rate / 10
        self.scheduler = WarmupCosine(self.optimizer, o.learning_rate, min_lr, warmup, self.total_steps)
        # the parameter through which an empty step's gradients are made NaN (see train_step)
        self.objective: Objective = s.objective(self.device)
        if isinstance(self.objective, DPO):
            self._prepare_reference()
        self.empty_step_anchor = min((p for p in self.model.parameters() if p.requires_grad), key=torch.numel)
        # a mixture of experts: its routers' balancing losses and load statistics (trainer_utils/routing.py)
        self.router = RouterBalance(self.model.config, self.backend, self.device) if self.model.config.moe else None
        self.wrapped = self.backend.wrap(self.model, self.optimizer)  # DDP, a DeepSpeed engine, or the model
        # compiled after wrapping, as PyTorch recommends: dynamo then splits the graph at DDP's bucket boundaries,
        # so gradient all-reduces overlap the backward (a compiled module inside DDP reduces only at the end)
        self.forward_model = torch.compile(self.wrapped) if c.model.compile else self.wrapped

        # Progress. The running totals live on the device and are read once per log interval (no host sync
        # per step); the plain numbers are what checkpoints and the log read.
        self.step, self.cursor, self.tokens_seen, self.skipped, self.bad_in_a_row = 0, 0, 0, 0, 0
        self.resumed_train_s = 0.0  # training seconds before the checkpoint resumed from (elapsed_s goes on)
        self.val_loss: float | None = None
        self.last_train_loss: float | None = None  # of the last logged window, for --overfit_gap
        self.best = {"val_loss": None, "step": None, "evals_since": 0}  # early stopping's memory (checkpointed)
        self.last_saved = -1
        self.fallback: dict[str, Any] | None = None  # set when fit() ends for a precision fallback
        zero = lambda: torch.zeros((), device=self.device, dtype=torch.float64)  # noqa: E731
        self.counters = {"tokens_seen": zero(), "skipped": zero(), "bad_in_a_row": zero(), "grad_norm": zero()}
        self.window = {"loss": zero(), "valid": zero(), "tokens": 0, "wait": 0.0, "t0": time.perf_counter(),
                       "steps": 0, "metrics": {}}
        self.step_metrics: dict[str, torch.Tensor] = {}
        if s.resume_from is not None:  # after wrap: a DeepSpeed engine restores into itself
            self._restore(s.resume_from)
        self.logger: MetricsLogger | None = None
        self.stats_batch = self._stats_batch() if c.eval.layer_stats and self.backend.is_main else None

        cfg = self.model.config
        self.flops_per_token = flops_per_token(cfg, s.max_seq_len)
        self.peak = peak_flops(self.device)
        self.resolved = {"stage": s.stage, "run_dir": str(s.run_dir), "device": str(self.device),
                         "dtype": dtype_name(self.precision.dtype), "precision": s.precision_reason,
                         "world_size": world,
                         "backend": self.backend.name, "total_steps": self.total_steps,
                         "steps_per_epoch": steps_per_epoch, "samples_per_step": self.samples_per_step,
                         "tokens_per_step": self.samples_per_step * s.max_seq_len, "max_seq_len": s.max_seq_len,
                         "warmup_steps": warmup, "min_lr": min_lr, "train_samples": len(s.train_data),
                         "val_samples": sum(len(v.data) for v in s.val_sets),
                         "tokenizer": str(s.tokenizer.path), "tokenizer_sha256": s.tokenizer.sha256,
                         "model": cfg.to_dict(), "parameters": cfg.num_parameters()}
        if o.optimizer == "muon":
            self.resolved["newton_schulz_dtype"] = dtype_name(precision_policy(self.device).optimizer)
        if len(s.data.sources) > 1:
            self.resolved["data_mixture"] = s.data.sources
        if s.fallbacks:
            self.resolved["precision_fallback"] = s.fallbacks
        self.memory = self._memory_estimate()
        if self.memory is not None:
            self.resolved["memory_estimate"] = {"peak_bytes": self.memory.peak, "at": self.memory.peak_moment,
                                                **{k: getattr(self.memory, k) for k in MEMORY_KINDS}}

    # ------------------------------------------------------------------------- state
    def _restore(self, ckpt: Path) -> None:
        state = load_training_state(ckpt)
        saved = state.get("config", {}).get("optim", {}).get("optimizer")
        if saved not in (None, self.config.optim.optimizer):  # e.g. a run begun before pretraining's default was Muon
            raise ConfigError(f"{ckpt}: trained with --optimizer {saved}, whose state cannot turn into "
                              f"{self.config.optim.optimizer}'s mid-run; resume it with --optimizer {saved}")
        if self.s.lora is not None:  # the base is already in place (build_model), checked against its hash
            load_lora_state_dict(self.model, read_state_dict(ckpt / ADAPTER_WEIGHTS_NAME), str(ckpt))
        else:
            load_state_into(self.model, read_state_dict(ckpt / WEIGHTS_NAME), str(ckpt))
        if state.get("tokenizer_sha256") not in (None, self.s.tokenizer.sha256):
            raise TokenizerError(f"{ckpt}: trained with another tokenizer (sha256 {state['tokenizer_sha256'][:12]}"
                                 f"), not {self.s.tokenizer.path}")
        self.backend.restore_state(ckpt, state)
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.cursor, self.tokens_seen = state["step"], state["cursor"], state["tokens_seen"]
        self.counters["tokens_seen"] += self.tokens_seen
        self.skipped = state.get("skipped", 0)  # the count in metrics.jsonl goes on across resumes
        self.resumed_train_s = state.get("train_time_s", 0.0)  # and so does elapsed_s
        self.counters["skipped"] += self.skipped
        self.best.update(state.get("early_stop", {}))
        set_rng_state(state["rng"])
        if state.get("world_size") != self.backend.world_size and self.backend.is_main:
            print(f"resuming a {state.get('world_size')}-rank run on {self.backend.world_size} ranks: the "
                  f"sample cursor ({self.cursor}) carries over; the effective batch is now "
                  f"{self.samples_per_step}", file=sys.stderr)

    def save(self) -> None:
        """Checkpoint (collective): every rank writes what it owns into the staging directory, then rank 0
        completes it and publishes it. Nothing with --no-checkpoints."""
        if not self.config.run.checkpoints:
            return
        backend = self.backend
        self._sync_counters()
        if backend.is_main:
            new_staging_dir(self.s.run_dir, self.step)
        backend.barrier()
        backend_state = backend.save_state(staging_dir(self.s.run_dir, self.step))
        weights = backend.master_weights(self.model) if self.s.lora is None else None
        backend.barrier()
        if backend.is_main:
            state = {**backend_state, "scheduler": self.scheduler.state_dict(), "step": self.step,
                     "cursor": self.cursor, "tokens_seen": self.tokens_seen, "skipped": self.skipped,
                     "train_time_s": self.clock.elapsed(), "rng": rng_state(),
                     "world_size": backend.world_size, "tokenizer_sha256": self.s.tokenizer.sha256,
                     "early_stop": dict(self.best), "config": to_dict(self.config, self.s.stage)}
            # "stage" is how the checkpoint is prompted (raw text or chat), "method" how it was trained
            info = {"stage": "sft" if self.s.chat else "pretrain", "method": self.s.stage,
                    "tokens_seen": self.tokens_seen, "val_loss": self.val_loss,
                    "dtype": dtype_name(self.precision.dtype)}
            if self.s.fallbacks:
                info["precision_fallback"] = self.s.fallbacks
            write = None if self.s.lora is None else \
                lambda d: save_lora(self.model, d, self.s.lora, self.s.base_ref, self.s.tokenizer.path)
            save_checkpoint(self.s.run_dir, self.step, self.model, state, info, self.s.tokenizer.path,
                            self.config.run.keep_last, write, weights)
        backend.barrier()
        self.last_saved = self.step

    def write_run_config(self) -> None:
        """train_config.json: the run's settings (a valid --config that reproduces it) and what it derived."""
        config = {**to_dict(self.config, self.s.stage), RESOLVED_KEY: self.resolved}
        write_atomic(self.s.run_dir / TRAIN_CONFIG_NAME, json.dumps(config, indent=2, default=str) + "\n")

    # -------------------------------------------------------------------------- eval
    @torch.no_grad()
    def evaluate(self) -> dict[str, dict[str, float]]:
        """Validation loss (per token, or per pair for DPO) and the objective's evaluation metrics of each
        --data_path file that has a validation split, over the same --eval_batches batches every time; for a
        per-token loss with a byte-level tokenizer also "bpb", the loss in bits per UTF-8 byte of the targets."""
        val_sets, names = self.s.val_sets, self.objective.eval_metrics
        token_bytes = self.s.token_bytes if self.objective.unit == "tokens" else None
        token_bytes = token_bytes.to(self.device) if token_bytes is not None else None
        self.model.eval()
        # per file: units, summed loss, the summed metrics, the targets' bytes (summed over ranks together)
        total = torch.zeros(len(val_sets), 3 + len(names), device=self.device, dtype=torch.float64)
        for k, v in enumerate(val_sets):
            for batch in eval_batches(v.data, self.config.optim.batch_size, self.config.eval.eval_batches,
                                      self.backend.rank, self.backend.world_size):
                batch = tuple(t.to(self.device) for t in batch)
                out = self.objective.evaluate(self.model, batch, self.precision.autocast)
                total[k, 0] += self.objective.count(batch)
                total[k, 1] += out.loss
                for j, name in enumerate(names):
                    total[k, 2 + j] += out.metrics[name]
                if token_bytes is not None:
                    total[k, -1] += target_bytes(batch[1], token_bytes)
        total = self.backend.all_reduce_sum(total).tolist() if val_sets else []
        self.model.train()
        results = {}
        for v, (count, loss, *metrics, n_bytes) in zip(val_sets, total):
            if count > 0:
                results[v.name] = {"loss": loss / count, **{k: x / count for k, x in zip(names, metrics)}}
                if n_bytes > 0:
                    results[v.name]["bpb"] = loss / math.log(2) / n_bytes
        return results

    # ------------------------------------------------------------------------- train
    def train_step(self, micro: list[Batch], n_valid: torch.Tensor) -> torch.Tensor:
        """Forward/backward every micro-batch, then one optimizer step; returns the summed loss (the objective's
        metrics, summed too, are left in self.step_metrics). A mixture of experts adds its routers' losses,
        normalised over the step's input tokens (self.router.start_step), and logged apart from the loss.

        Gradients are of sum(unit losses) / n_valid. A step with no target anywhere (n_valid == 0) has
        nothing to learn from, yet an optimizer step would still apply weight decay and momentum. Its gradients
        are made NaN instead (through the smallest trainable parameter: free when the step is not empty), so
        every backend skips it like any other non-finite step, with no host sync to decide.
        """
        world = self.backend.world_size
        loss_sum = torch.zeros((), device=self.device)
        self.step_metrics = {}
        scale = world / n_valid.clamp(min=1)  # backends average gradients over ranks; * world: sum / n_valid
        poison = torch.where(n_valid > 0, 0.0, float("nan"))
        for i, batch in enumerate(micro):
            last = i == len(micro) - 1
            with contextlib.nullcontext() if last else self.backend.no_sync(self.wrapped):
                out = self.objective(self.forward_model, batch, self.precision.autocast)
                loss = out.loss * scale + (poison * self.empty_step_anchor.sum() if last else 0.0)
                if out.router is not None:
                    loss = loss + self.router.loss(out.router)
                self.backend.backward(loss)
            loss_sum += out.loss.detach()
            for k, v in out.metrics.items():
                self.step_metrics[k] = self.step_metrics.get(k, 0.0) + v.detach().double()
        return loss_sum

    def fit(self) -> int:
        """Train to the end (or a stop signal); returns the process exit code."""
        s, backend = self.s, self.backend
        run = self.config.run
        self.logger = MetricsLogger(s.run_dir, backend.is_main, self.total_steps, self.step, self.resolved,
                                    run.use_wandb, run.wandb_project, run.use_tensorboard)
        if backend.is_main:
            self.write_run_config()
            self.logger.message(json.dumps({k: v for k, v in self.resolved.items() if k != "model"}))
            if self.memory is not None:
                self.logger.message(self.memory.summary())
        feeder = StepFeeder(s.train_data, self.config.optim.batch_size, self.config.optim.accumulation_steps,
                            backend.rank, backend.world_size, self.cursor, self.device)
        exit_code = 0
        self.model.train()
        # elapsed_s in the log: training time, without the pauses to evaluate and checkpoint
        self.clock = TrainClock(self.device, self.resumed_train_s)
        # memory is measured on a step that has the optimizer state: the second, or the first after a resume
        measure_at = self.step if self.step > 0 else 1
        try:
            with StopSignal() as stop:
                while self.step < self.total_steps and not self._stop_requested(stop):
                    if self.step == measure_at and self.memory is not None:
                        self._measure_memory(lambda: self._optimizer_step(feeder))
                    else:
                        self._optimizer_step(feeder)
                    if self._due(run.log_interval):
                        self._log()
                        trouble = self._nonfinite_trouble()
                        if trouble:
                            self.fallback = self._plan_fallback(trouble)
                            exit_code = 0 if self.fallback else 1
                            break
                    early_stop = None
                    if self._due(self.config.eval.eval_interval):
                        with self.clock.pause():
                            self._eval_and_log()
                            self._layer_stats()
                            self._samples_and_probes()
                            early_stop = self._early_stop_reason()
                    if (self._due(run.save_interval) or early_stop) and self.last_saved != self.step:
                        with self.clock.pause():
                            self.save()
                    if early_stop:
                        self._report_early_stop(early_stop)
                        break
                if stop.received and exit_code == 0:
                    if self.last_saved != self.step:
                        self.save()
                    self.logger.message(f"{stop.received} received: checkpointed step {self.step} to {s.run_dir}; "
                                        "continue with --resume" if run.checkpoints else
                                        f"{stop.received} received: stopped at step {self.step} "
                                        "(--no-checkpoints: nothing to resume from)")
        except RuntimeError as e:
            if backend.world_size == 1 or not is_peer_failure(e):
                raise
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            print(f"error: rank {backend.rank} lost contact with the other ranks ({first}); a rank died or hung. "
                  f"Resume with --resume from the last checkpoint.", file=sys.stderr)
            exit_code = 1
        finally:
            feeder.close()
            self.logger.close()
        return exit_code

    def _due(self, interval: int) -> bool:
        """Whether the step just taken is a multiple of `interval`, or the last one."""
        return self.step % interval == 0 or self.step == self.total_steps

    def _stop_requested(self, stop: StopSignal) -> bool:
        """Whether to stop before the next step. Ranks agree (all stop after the same step): they compare notes
        once per log interval."""
        if self.backend.world_size == 1:
            return stop.received is not None
        if self.step % self.config.run.log_interval:
            return False
        flag = torch.tensor(float(stop.received is not None), device=self.device)
        if self.backend.all_reduce_sum(flag).item() > 0:
            stop.received = stop.received or "stop signal on another rank"
            return True
        return False

    def _optimizer_step(self, feeder: StepFeeder) -> None:
        """One optimizer step on the next micro-batches, with the device-side counters updated."""
        t_wait = time.perf_counter()
        micro, n_input = feeder.next_step()
        self.window["wait"] += time.perf_counter() - t_wait
        n_local = sum(self.objective.count(batch) for batch in micro).double()
        # the valid targets of the whole step, over all ranks, normalise the loss (and its input tokens, the
        # routers' losses)
        totals = torch.stack([n_local, torch.tensor(float(sum(b[0].numel() for b in micro)), device=self.device,
                                                    dtype=torch.float64)])
        n_valid, n_routed = self.backend.all_reduce_sum(totals) if self.backend.world_size > 1 else totals
        if self.router is not None:
            self.router.start_step(n_routed)
        try:
            loss_sum = self.train_step(micro, n_valid.float())
            grad_norm, applied = self.backend.step()
        except torch.cuda.OutOfMemoryError:
            raise TrainingError(OOM_HELP) from None
        if self.router is not None:
            self.router.end_step(self.model, applied)
        self.step += 1
        self.cursor = feeder.cursor
        self.scheduler.step()
        self.logger.advance()
        ok = applied.double()
        w, c = self.window, self.counters
        # torch.where, not a product: a skipped step's loss may be NaN, and NaN * 0 is NaN
        w["loss"] += torch.where(applied, loss_sum.double(), 0.0)
        for k, v in self.step_metrics.items():
            w["metrics"][k] = w["metrics"].get(k, 0.0) + torch.where(applied, v, 0.0)
        w["valid"] += n_local * ok
        w["tokens"] += n_input
        w["steps"] += 1
        c["tokens_seen"] += n_valid * ok
        c["skipped"] += 1 - ok
        c["bad_in_a_row"] = (c["bad_in_a_row"] + 1) * (1 - ok)
        c["grad_norm"] = grad_norm.double()

    def _prepare_reference(self) -> None:
        """DPO: the reference model's log-probabilities of every pair, computed once (by rank 0, with the
        --init_from model under this run's precision) and cached beside each file's token cache, keyed by the
        reference's weights and the precision; every rank then reads them. A resume finds them there."""
        train = self.s.train_data
        datasets = [*getattr(train, "parts", [train]), *(v.data for v in self.s.val_sets)]
        key = f"{weights_sha256(self.s.init_dir)[:16]}-{dtype_name(self.precision.dtype)}"
        paths = [ds.cache_path / f"reference-{ds.split}-{key}.npy" for ds in datasets]
        missing = [(ds, path) for ds, path in zip(datasets, paths) if not path.is_file()]
        if missing and self.backend.is_main:
            t0 = time.perf_counter()
            reference, _ = load_model(self.s.init_dir, device=self.device)  # a LoRA run's adapters merged in
            for ds, path in missing:
                values = np.zeros((ds.num_examples, 2), dtype=np.float32)
                # training-sized batches: larger ones measured slower on CPU (25 s against 21.5 s for the demo)
                for indices, x, y in ds.all_pairs_batches(self.config.optim.batch_size):
                    logp = sequence_log_probs(reference, x.to(self.device), y.to(self.device),
                                              self.precision.autocast).cpu().numpy()
                    values[indices, 0], values[indices, 1] = logp[:len(indices)], logp[len(indices):]
                with io.BytesIO() as buffer:
                    np.save(buffer, values)
                    write_atomic(path, buffer.getvalue())
            del reference
            pairs = sum(ds.num_examples for ds, _ in missing)
            print(f"reference log-probs of {pairs:,} pairs computed once in {time.perf_counter() - t0:.1f}s "
                  f"({self.s.init_dir}, {dtype_name(self.precision.dtype)}), cached as {paths[0].name}",
                  file=sys.stderr)
        self.backend.barrier()
        for ds, path in zip(datasets, paths):
            ds.set_reference(np.load(path))

    def _memory_estimate(self) -> MemoryEstimate | None:
        """python -m model --estimate for this run (printed at the start), or None where it does not apply."""
        c = self.config
        if self.backend.name == "deepspeed" or c.optim.optimizer == "sgd" or c.model.compile or \
                self.model.config.dropout > 0 or self.s.lora is not None or self.s.stage == "distill":
            # the formula is one eager model (no teacher) with AdamW (or Muon + AdamW) on every weight, unsharded,
            # without dropout
            return None
        o, cfg = self.config.optim, self.model.config
        rows = o.batch_size * (2 if self.s.stage == "dpo" else 1)  # a DPO batch holds both answers of each pair
        return estimate_memory(cfg, rows, self.s.max_seq_len, self.precision.dtype,
                               self.config.model.grad_checkpointing, o.accumulation_steps, name=model_name(cfg),
                               optimizer=o.optimizer)

    def _measure_memory(self, step: Callable[[], None]) -> None:
        """Run one optimizer step with its memory peak measured (rank 0; CPU: profiled, a few % slower once) and
        log it beside the estimate printed at the start."""
        if not self.backend.is_main:
            return step()
        measured = measure_step_peak(step, self.device, self.model, self.optimizer)
        if measured is None:  # a device without a peak statistic (MPS): the estimate printed at the start stands
            return
        self.logger.log({"step": self.step, "memory_estimated_gb": round(self.memory.peak / 2**30, 4),
                         "memory_measured_gb": round(measured / 2**30, 4)})
        note = ("; the estimate is for batches of --max_seq_len tokens, chat batches are as long as their longest "
                "example" if self.s.kind != "pretrain" else "")
        self.logger.message(self.memory.summary(measured) + note)

    def _stats_batch(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The fixed batch of --layer_stats: the first 2 validation sequences, at most 1024 tokens (its attention
        weights are materialised: B x heads x T x T per layer), and which positions are not padding."""
        if not self.s.val_sets:
            return None
        x = next(eval_batches(self.s.val_sets[0].data, 2, 1, 0, 1))[0]
        x = x[:, :1024].to(self.device)
        if self.s.kind == "pretrain":
            return x, None  # pretraining windows are never padded
        # SFT batches are right-padded: the trailing run of pad ids in each row
        real = (x != self.s.tokenizer.pad_id).flip(1).cumsum(1).flip(1) > 0
        return x, real.long()

    @torch.no_grad()
    def _layer_stats(self) -> None:
        """Rank 0 records per-layer attention entropy and activation RMS of the fixed batch (model/stats.py):
        attention collapsing onto one token, or activations growing towards overflow, show here first."""
        if not self.backend.is_main or not self.config.eval.layer_stats or self.stats_batch is None:
            return
        x, real = self.stats_batch
        with self.precision.autocast():
            stats = layer_stats(self.model, x, attention_mask=real)
        self.logger.log({"step": self.step, **{k: round(v, 5) for k, v in stats.flat().items()}})
        self.logger.log_histograms(self.step, stats.histograms())

    @torch.no_grad()
    def _samples_and_probes(self) -> None:
        """Rank 0 continues the sample prompts (same sampling settings and seed every time, so the change
        between evaluations is the model's) and scores the probes; to samples.jsonl / probes.jsonl."""
        s = self.s
        if not self.backend.is_main or not (s.samples or s.probes):
            return
        tok, chat = s.tokenizer, s.chat
        eos = tok.stop_ids(chat)
        prompt_ids = lambda text: tok.prompt_ids(text, chat)  # noqa: E731
        self.model.eval()
        if s.samples:
            new = generate(self.model, [prompt_ids(p.prompt) for p in s.samples],
                           max_new_tokens=self.config.eval.sample_tokens, temperature=0.8, top_p=0.95,
                           repetition_penalty=1.1, eos_token_ids=eos, pad_token_id=tok.pad_id,
                           generator=torch.Generator(self.device).manual_seed(self.config.optim.seed))
            rows = [{"prompt": p.prompt, "text": tok.decode(ids)} for p, ids in zip(s.samples, new)]
            self.logger.log_rows("samples", self.step, rows)
            for row in rows:
                self.logger.message(f"step {self.step} sample: {row['prompt']} | {row['text'][:100]!r}")
        if s.probes:
            results = run_probes(self.model, s.probes, prompt_ids, tok.encode, tok.decode, chat, eos, tok.pad_id)
            self.logger.log_rows("probes", self.step, [vars(r) for r in results])
            correct = sum(r.correct for r in results)
            mean_logprob = sum(r.logprob for r in results) / len(results)
            self.logger.log({"step": self.step, "probes_correct": correct / len(results),
                             "probes_logprob": round(mean_logprob, 4)})
            self.logger.message(f"step {self.step} probes: {correct}/{len(results)} correct, mean answer "
                                f"logprob {mean_logprob:.3f}, first-token ranks {[r.rank for r in results]}")
        self.model.train()

    def _early_stop_reason(self) -> str | None:
        """After an evaluation, with early stopping on: keep the best checkpoint (saving it, pointing `best` at
        it) and return why to stop, if it is time."""
        ev, b = self.config.eval, self.best
        if not ev.early_stopping or self.val_loss is None:
            return None
        if b["val_loss"] is None or self.val_loss < b["val_loss"]:
            b.update(val_loss=self.val_loss, step=self.step, evals_since=0)
            if self.last_saved != self.step:
                self.save()
            if self.backend.is_main:
                mark_best(self.s.run_dir, checkpoint_dir(self.s.run_dir, self.step))
        else:
            b["evals_since"] += 1
        if ev.early_stop_patience is not None and b["evals_since"] >= ev.early_stop_patience:
            return (f"the validation loss has not improved for {b['evals_since']} evaluations (--early_stop_patience "
                    f"{ev.early_stop_patience})")
        gap = None if self.last_train_loss is None else self.val_loss - self.last_train_loss
        if ev.overfit_gap is not None and gap is not None and gap > ev.overfit_gap:
            return (f"the validation loss {self.val_loss:.4f} exceeds the training loss {self.last_train_loss:.4f} "
                    f"by {gap:.4f} (--overfit_gap {ev.overfit_gap})")
        return None

    def _report_early_stop(self, reason: str) -> None:
        b = self.best
        self.logger.log({"step": self.step, "event": "early_stop", "reason": reason, "best_step": b["step"],
                         "best_val_loss": b["val_loss"]})
        self.logger.message(f"early stop after step {self.step}: {reason}. Best: step {b['step']} (val_loss "
                            f"{b['val_loss']:.4f}), {self.s.run_dir / BEST_NAME}; last: {self.s.run_dir / 'latest'}")

    def _nonfinite_trouble(self) -> str | None:
        """Why training cannot go on in this precision (checked at log steps), or None.

        Ranks agree without a collective: the gradients they test are already all-reduced."""
        if self.bad_in_a_row >= self.config.optim.max_bad_steps:
            return f"{self.bad_in_a_row} consecutive steps had non-finite gradients"
        scaler = self.precision.scaler
        if scaler.is_enabled() and scaler.get_scale() < 1:
            # below 1 the scaler is shrinking gradients that overflow fp16 even unscaled: its range is too small
            return f"the fp16 loss scale fell to {scaler.get_scale():.3g} (below 1)"
        return None

    def _plan_fallback(self, trouble: str) -> dict[str, Any] | None:
        """The precision fallback to make (logged), or None to stop without saving (after saying why)."""
        dtype, option = self.precision.dtype, self.config.precision.on_nonfinite
        to = fallback_dtype(dtype, self.device) if option == "fallback" else None
        if to is None or not self.backend.can_switch_precision:
            if to is None:
                advice = ("Try a lower --learning_rate" + (", --dtype bfloat16 or float32" if dtype != torch.float32
                                                           else ""))
            else:
                advice = (f"DeepSpeed fixes its precision when the engine starts: continue with --resume --dtype "
                          f"{dtype_name(to)}")
            self.logger.message(f"error: {trouble}; stopping without saving. {advice}. The last checkpoint is "
                                "intact.")
            return None
        last = latest_checkpoint(self.s.run_dir)
        event = {"step": self.step, "from": dtype_name(dtype), "to": dtype_name(to), "reason": trouble,
                 "reload": str(last.relative_to(self.s.run_dir)) if last else "initial weights"}
        self.logger.log({"event": "precision_fallback", **event})
        self.logger.message(f"step {self.step}: {trouble}. Falling back from {event['from']} to {event['to']}: "
                            f"continuing from {event['reload']} (--on_nonfinite fallback)")
        return event

    def _sync_counters(self) -> None:
        """Copy the device-side counters to plain numbers (one host sync)."""
        c = self.counters
        tokens, skipped, bad = torch.stack([c["tokens_seen"], c["skipped"], c["bad_in_a_row"]]).tolist()
        self.tokens_seen, self.skipped, self.bad_in_a_row = int(tokens), int(skipped), int(bad)

    def _log(self) -> None:
        w = self.window
        elapsed = time.perf_counter() - w["t0"]
        # token-weighted loss and non-padding inputs over all ranks: the one host sync per log interval
        tokens = torch.tensor(float(w["tokens"]), device=self.device, dtype=torch.float64)
        names = sorted(w["metrics"])
        sums = torch.stack([w["loss"], w["valid"], tokens, *(w["metrics"][k] for k in names)])
        loss_sum, valid, tokens, *metrics = self.backend.all_reduce_sum(sums).tolist()
        self._sync_counters()
        record = {"step": self.step, "loss": round(loss_sum / valid, 6) if valid > 0 else None,
                  **{k: round(v / valid, 6) if valid > 0 else None for k, v in zip(names, metrics)},
                  "lr": self.scheduler.lr, "grad_norm": round(float(self.counters["grad_norm"]), 4),
                  "tokens_per_s": round(tokens / elapsed), "step_time_s": round(elapsed / max(w["steps"], 1), 4),
                  "data_wait_frac": round(w["wait"] / elapsed, 4), "tokens_seen": self.tokens_seen,
                  "skipped_steps": self.skipped, "elapsed_s": round(self.clock.elapsed(), 3)}
        if self.router is not None:
            record.update(self.router.record())
        if self.peak is not None:
            record["mfu"] = round(self.flops_per_token * tokens / elapsed / (self.peak * self.backend.world_size), 4)
        if self.device.type == "cuda":
            record["peak_mem_gb"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3)
        else:
            record["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)
        self.logger.log(record, bar_fields=("loss", "lr", "tokens_per_s"))
        self.last_train_loss = record["loss"]
        w.update(loss=torch.zeros_like(w["loss"]), valid=torch.zeros_like(w["valid"]), tokens=0, wait=0.0,
                 t0=time.perf_counter(), steps=0, metrics={})

    def _eval_and_log(self) -> None:
        """val_loss (and val_bpb, the other metrics): each file's validation loss weighted as the files are mixed
        in training (one file: its loss); with several files each one's loss and bpb too, as val_loss/<file stem>
        and val_bpb/<file stem>."""
        results = self.evaluate()
        if not results:
            self.val_loss = None
            return
        weights = {v.name: v.weight for v in self.s.val_sets if v.name in results}
        mixed = {key: sum(weights[k] * r[key] for k, r in results.items()) / sum(weights.values())
                 for key in next(iter(results.values())) if all(key in r for r in results.values())}
        self.val_loss = mixed["loss"]
        record = {"step": self.step, "val_loss": round(self.val_loss, 5),
                  **{f"val_{k}": round(v, 5) for k, v in mixed.items() if k != "loss"}}
        if self.objective.unit == "tokens":  # a perplexity is per token; DPO's loss is per pair
            record["val_ppl"] = round(math.exp(min(self.val_loss, 50)), 3)  # capped: a diverged run stays finite
        several = len(self.s.data.sources) > 1
        if several:
            for key in ("loss", "bpb"):
                record.update({f"val_{key}/{k}": round(r[key], 5) for k, r in results.items() if key in r})
        record["elapsed_s"] = round(self.clock.elapsed(), 3)  # training seconds up to this evaluation
        self.logger.log(record)
        notes = [f"ppl {record['val_ppl']:.2f}"] if "val_ppl" in record else []
        notes += [f"{k} {r['loss']:.4f}" for k, r in results.items()] if several else []
        each_bpb = [f"{k} {r['bpb']:.4f}" for k, r in results.items() if "bpb" in r] if several else []
        extra = "".join(f", {k} {v:.4f}" + (f" ({', '.join(each_bpb)})" if k == "bpb" and each_bpb else "")
                        for k, v in mixed.items() if k != "loss")
        self.logger.message(f"step {self.step}: val_loss {self.val_loss:.4f}"
                            + (f" ({', '.join(notes)})" if notes else "") + extra)


MEMORY_KINDS = ("parameters", "gradients", "optimizer", "activations", "logits")


def weights_sha256(model_dir: Path) -> str:
    """A digest of the weights a model dir holds: its model.safetensors, or a LoRA run's base and adapters."""
    if not is_lora_dir(model_dir):
        return file_sha256(model_dir / WEIGHTS_NAME)
    # the adapters and lora.json, which holds the base's own sha256
    parts = [file_sha256(model_dir / ADAPTER_WEIGHTS_NAME), file_sha256(model_dir / LORA_CONFIG_NAME)]
    return hashlib.sha256("".join(parts).encode()).hexdigest()


def data_kind(stage: str, data: DataConfig) -> str:
    """The kind of records a stage trains on: distillation takes either, as its first file shows."""
    if stage != "distill":
        return {"pretrain": "pretrain", "sft": "sft", "lora": "sft", "dpo": "dpo"}[stage]
    _, first = next(read_records(data.sources()[0].path, "any", data.skip_bad_lines))
    return "pretrain" if "text" in first else "sft"


def is_peer_failure(e: RuntimeError) -> bool:
    """Whether a collective failed because another rank died or hung (gloo/NCCL report it as RuntimeError)."""
    if isinstance(e, getattr(torch.distributed, "DistError", ())):
        return True
    return re.search(r"(?i)connection (closed|reset|refused)|timed? ?out|by peer|nccl|gloo", str(e)) is not None


def main(stage: str, argv: list[str] | None, description: str | None) -> int:
    """A training script's whole entry point: parse its flags and --config, then train."""
    try:
        config = parse_train_config(stage, argv, description)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run(config, stage)


def run(config: TrainConfig, stage: str) -> int:
    """Build the session and train. Errors that are the user's to fix become one `error: ...` line: exit 2
    for bad flags, data or checkpoints (nothing trained), 1 when training itself had to stop."""
    session = None
    try:
        session = Session(config, stage)
        while True:
            trainer = Trainer(session)
            exit_code, fallback = trainer.fit(), trainer.fallback
            del trainer  # the next Trainer's model and optimizer must not coexist with this one's
            if fallback is None:
                return exit_code
            gc.collect()
            if session.device.type == "cuda":
                torch.cuda.empty_cache()
            session.fall_back(fallback)
    except PocketLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1 if isinstance(e, TrainingError) else 2
    finally:
        if session is not None:
            session.backend.close()
