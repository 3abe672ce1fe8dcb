"""The one training loop shared by pretraining and SFT, and the session that sets it up.

Session: run directory, tokenizer, tokenize-once data, backend, model (new, from --init_from, or resumed).
Trainer.fit(): for each optimizer step, take this rank's micro-batches from the global cursor, normalise the
loss by the valid target tokens of the whole step (all micro-batches, all ranks), backward with no_sync on
all but the last micro-batch, clip and step (skipping non-finite steps), log, evaluate and checkpoint.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dataset.cache import prepare
from dataset.datasets import PretrainDataset, SFTDataset
from dataset.jsonl import DataError
from dataset.tokenizer import DEFAULT_TOKENIZER_DIR, IGNORE_INDEX, Tokenizer, TokenizerError
from model import ConfigError, ModelConfig, PocketLM, get_preset
from model.loading import CheckpointError, load_state_into, read_state_dict, resolve_model_dir

from .backend import Backend
from .checkpoint import latest_checkpoint, load_training_state, save_checkpoint, staging_dir
from .distributed import detect_env, make_backend
from .data import StepFeeder, eval_batches
from .metrics import MetricsLogger, flops_per_token, peak_flops
from .optim import WarmupCosine, build_optimizer
from .runtime import StopSignal, rng_state, seed_everything, set_rng_state

OOM_HELP = ("out of GPU memory. Reduce memory with a smaller --batch_size and more --accumulation_steps "
            "(same effective batch), --grad_checkpointing, or a shorter --max_seq_len. The last checkpoint "
            "is intact.")


class Session:
    """Everything a training run needs before the first step, built in an order that is safe under
    multi-process launchers: data preparation (file-locked) before the process group exists."""

    def __init__(self, args: argparse.Namespace, stage: str) -> None:
        self.args, self.stage = args, stage
        seed_everything(args.seed)
        self.run_dir = Path(args.out_dir) / (args.run_name or f"{stage}-{args.preset}")
        self.resume_from = latest_checkpoint(self.run_dir) if args.resume else None
        if args.resume and self.resume_from is None:
            print(f"--resume: no checkpoint in {self.run_dir} yet; starting a new run", file=sys.stderr)
        init_dir = resolve_model_dir(args.init_from) if getattr(args, "init_from", None) else None
        if self.resume_from is not None:
            default_tok = self.resume_from
        else:
            default_tok = init_dir if init_dir is not None and (init_dir / "tokenizer.json").exists() \
                else DEFAULT_TOKENIZER_DIR
        self.tokenizer = Tokenizer(args.tokenizer or default_tok)
        self.model_config = self._model_config(init_dir)
        self.tokenizer.check_fits(self.model_config.vocab_size)
        self.max_seq_len = args.max_seq_len or self.model_config.max_seq_len
        if self.max_seq_len > self.model_config.max_position_embeddings:
            raise ConfigError(f"--max_seq_len {self.max_seq_len} exceeds the model's max_position_embeddings "
                              f"({self.model_config.max_position_embeddings})")
        # Every rank checks (before any collective exists, so all stop together); only rank 0 deletes.
        if not args.resume and (self.run_dir / "latest").exists():
            if not args.overwrite:
                raise SystemExit(f"error: {self.run_dir} already holds a run; pass --resume to continue it, "
                                 "--overwrite to replace it, or --run_name to start another")
            if detect_env().rank == 0:
                shutil.rmtree(self.run_dir)
        self.train_data, self.val_data = self._datasets()
        self.backend: Backend = make_backend(args)
        self.init_dir = init_dir

    def _model_config(self, init_dir: Path | None) -> ModelConfig:
        a = self.args
        if self.resume_from is not None:
            return ModelConfig.load(self.resume_from / "config.json")
        if init_dir is not None:
            return ModelConfig.load(init_dir / "config.json")
        preset = get_preset(a.preset)
        overrides = {k: getattr(a, k) for k in ("hidden_size", "num_hidden_layers", "dropout")
                     if getattr(a, k) is not None}
        if a.max_seq_len is not None:
            overrides["max_seq_len"] = a.max_seq_len
            overrides["max_position_embeddings"] = max(preset.max_position_embeddings, a.max_seq_len)
        if a.hidden_size is not None:
            # keep the preset's head size when only the width changes
            heads = max(1, a.hidden_size // preset.head_dim)
            kv = preset.num_key_value_heads
            overrides.update(num_attention_heads=heads, num_key_value_heads=kv if heads % kv == 0 else heads)
        # the embedding table matches the tokenizer actually used
        return get_preset(a.preset, vocab_size=self.tokenizer.vocab_size, **overrides)

    def _datasets(self) -> tuple[Any, Any]:
        a = self.args
        kind = "sft" if self.stage == "sft" else "pretrain"
        extra = {"max_seq_len": self.max_seq_len, "overlong": a.overlong} if kind == "sft" else {}
        cache = prepare(a.data_path, self.tokenizer, kind, a.val_fraction, a.seed, a.num_workers,
                        a.skip_bad_lines, a.cache_dir, log=lambda m: print(m, file=sys.stderr), **extra)
        if kind == "sft":
            make = lambda split: SFTDataset(cache, split, a.batch_size, a.seed, self.tokenizer.pad_id)  # noqa: E731
        else:
            make = lambda split: PretrainDataset(cache, split, self.max_seq_len, a.seed)  # noqa: E731
        val = make("val") if cache.meta["splits"]["val"]["documents"] else None
        if val is not None and len(val) == 0:
            val = None
        return make("train"), val

    def build_model(self) -> PocketLM:
        model = PocketLM(self.model_config)
        if self.init_dir is not None and self.resume_from is None:
            load_state_into(model, read_state_dict(self.init_dir / "model.safetensors"), str(self.init_dir))
        return model


class Trainer:
    """Runs optimizer steps until max_steps, a stop signal, or too many consecutive non-finite steps."""

    def __init__(self, session: Session) -> None:
        s, a = session, session.args
        self.s, self.a, self.backend = s, a, s.backend
        self.device, self.precision = s.backend.device, s.backend.precision
        seed_everything(a.seed)
        self.model = s.build_model().to(self.device)
        self.model.set_gradient_checkpointing(a.grad_checkpointing)
        self.optimizer = build_optimizer(self.model, a.optimizer, a.learning_rate, a.weight_decay,
                                         (a.beta1, a.beta2), a.momentum, self.device)
        world = self.backend.world_size
        self.samples_per_step = a.batch_size * a.accumulation_steps * world
        steps_per_epoch = max(1, len(s.train_data) // self.samples_per_step)
        self.total_steps = a.max_steps or a.epochs * steps_per_epoch
        warmup = a.warmup_steps if a.warmup_steps is not None else int(a.warmup_ratio * self.total_steps)
        min_lr = a.min_lr if a.min_lr is not None else a.learning_rate / 10
        self.scheduler = WarmupCosine(self.optimizer, a.learning_rate, min_lr, warmup, self.total_steps)
        self.step, self.cursor, self.tokens_seen, self.bad_in_a_row, self.skipped = 0, 0, 0, 0, 0
        forward_model = torch.compile(self.model) if a.compile else self.model
        self.forward_model = self.backend.wrap(forward_model, self.optimizer)
        if s.resume_from is not None:  # after wrap: a DeepSpeed engine restores into itself
            self._restore(s.resume_from)
        cfg = self.model.config
        self.flops_per_token = flops_per_token(cfg, s.max_seq_len)
        self.peak = peak_flops(self.device)
        self.resolved = {"stage": s.stage, "run_dir": str(s.run_dir), "device": str(self.device),
                         "dtype": str(self.precision.dtype).removeprefix("torch."), "world_size": world,
                         "backend": type(self.backend).__name__, "total_steps": self.total_steps,
                         "steps_per_epoch": steps_per_epoch, "samples_per_step": self.samples_per_step,
                         "tokens_per_step": self.samples_per_step * s.max_seq_len, "max_seq_len": s.max_seq_len,
                         "warmup_steps": warmup, "min_lr": min_lr, "train_samples": len(s.train_data),
                         "val_samples": len(s.val_data) if s.val_data is not None else 0,
                         "tokenizer": str(s.tokenizer.path), "tokenizer_sha256": s.tokenizer.sha256,
                         "model": cfg.to_dict(), "parameters": cfg.num_parameters(), "args": vars(a)}

    # ------------------------------------------------------------------------- state
    def _restore(self, ckpt: Path) -> None:
        state = load_training_state(ckpt)
        load_state_into(self.model, read_state_dict(ckpt / "model.safetensors"), str(ckpt))
        if state.get("tokenizer_sha256") not in (None, self.s.tokenizer.sha256):
            raise TokenizerError(f"{ckpt}: trained with another tokenizer (sha256 {state['tokenizer_sha256'][:12]}"
                                 f"), not {self.s.tokenizer.path}")
        if not self.backend.owns_optimizer_state:
            if "optimizer" not in state:
                raise CheckpointError(f"{ckpt}: written by DeepSpeed (optimizer shards in deepspeed/); resume it "
                                      "with --deepspeed, or start a new run from its weights with --init_from")
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.backend.load_state_dict_extra(state.get("backend", {}))
        self.backend.load_extra(ckpt)
        self.step, self.cursor, self.tokens_seen = state["step"], state["cursor"], state["tokens_seen"]
        set_rng_state(state["rng"])
        if state.get("world_size") != self.backend.world_size and self.backend.is_main:
            print(f"resuming a {state.get('world_size')}-rank run on {self.backend.world_size} ranks: the "
                  f"sample cursor ({self.cursor}) carries over; the effective batch is now "
                  f"{self.samples_per_step}", file=sys.stderr)

    def save(self, val_loss: float | None = None) -> None:
        """Checkpoint (collective): backend shards first on every rank, then rank 0 completes and publishes."""
        backend, staged = self.backend, self.backend.owns_optimizer_state
        if hasattr(self, "counters"):
            self._sync_counters()
        if staged:
            staging = staging_dir(self.s.run_dir, self.step)
            if backend.is_main:
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir(parents=True)
            backend.barrier()
            backend.save_extra(staging)
            backend.barrier()
        if backend.is_main:
            state = {"scheduler": self.scheduler.state_dict(), "step": self.step, "cursor": self.cursor,
                     "tokens_seen": self.tokens_seen, "rng": rng_state(), "backend": backend.state_dict_extra(),
                     "world_size": backend.world_size, "tokenizer_sha256": self.s.tokenizer.sha256,
                     "args": vars(self.a)}
            if not staged:
                state["optimizer"] = self.optimizer.state_dict()
            info = {"stage": self.s.stage, "tokens_seen": self.tokens_seen, "val_loss": val_loss}
            save_checkpoint(self.s.run_dir, self.step, self.model, state, info, self.s.tokenizer.path,
                            self.a.keep_last, staged=staged)
        backend.barrier()

    # -------------------------------------------------------------------------- eval
    @torch.no_grad()
    def evaluate(self) -> float | None:
        if self.s.val_data is None:
            return None
        self.model.eval()
        total = torch.zeros(2, device=self.device, dtype=torch.float64)
        for x, y in eval_batches(self.s.val_data, self.a.batch_size, self.a.eval_batches, self.backend.rank,
                                 self.backend.world_size):
            x, y = x.to(self.device), y.to(self.device)
            with self.precision.autocast():
                logits = self.model(x)
            total[0] += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX,
                                        reduction="sum")
            total[1] += (y != IGNORE_INDEX).sum()
        total = self.backend.all_reduce_sum(total)
        self.model.train()
        return float(total[0] / total[1]) if total[1] > 0 else None

    # ------------------------------------------------------------------------- train
    def train_step(self, micro: list[tuple[torch.Tensor, torch.Tensor]], n_valid: torch.Tensor) -> torch.Tensor:
        """Forward/backward every micro-batch, then one optimizer step; returns the summed token loss."""
        world = self.backend.world_size
        loss_sum = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            with contextlib.nullcontext() if last else self.backend.no_sync(self.forward_model):
                with self.precision.autocast():
                    logits = self.forward_model(x)
                # reduction="sum": a micro-batch without targets adds exactly 0 (a mean would be 0/0 = NaN)
                token_loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX,
                                             reduction="sum")
                # Backends average gradients over ranks; scaling by world makes the result sum / n_valid.
                self.backend.backward(token_loss * (world / n_valid))
            loss_sum += token_loss.detach()
        return loss_sum

    def fit(self) -> int:
        a, s, backend = self.a, self.s, self.backend
        logger = MetricsLogger(s.run_dir, backend.is_main, self.total_steps, self.step, self.resolved,
                               a.use_wandb, a.wandb_project, a.use_tensorboard)
        if backend.is_main:
            s.run_dir.mkdir(parents=True, exist_ok=True)
            (s.run_dir / "train_config.json").write_text(json.dumps(self.resolved, indent=2, default=str) + "\n")
            logger.message(json.dumps({k: v for k, v in self.resolved.items() if k not in ("args", "model")}))
        feeder = StepFeeder(s.train_data, a.batch_size, a.accumulation_steps, backend.rank, backend.world_size,
                            self.cursor, self.device)
        # Running totals live on the device and are read once per log interval: no host sync per step.
        zero = lambda: torch.zeros((), device=self.device, dtype=torch.float64)  # noqa: E731
        window = {"loss": zero(), "valid": zero(), "tokens": 0, "wait": 0.0, "t0": time.perf_counter(), "steps": 0}
        self.counters = {"tokens_seen": zero() + self.tokens_seen, "skipped": zero() + self.skipped,
                         "bad_in_a_row": zero(), "grad_norm": zero()}
        exit_code, val_loss, last_saved = 0, None, -1
        self.model.train()
        try:
            with StopSignal() as stop:
                while self.step < self.total_steps:
                    if backend.world_size > 1 and self.step % a.log_interval == 0:
                        # ranks agree on stopping (all after the same step), checked once per log interval
                        flag = torch.tensor(float(stop.received is not None), device=self.device)
                        if backend.all_reduce_sum(flag).item() > 0:
                            stop.received = stop.received or "stop signal on another rank"
                            break
                    t_wait = time.perf_counter()
                    micro, local, n_input = feeder.next_step()
                    window["wait"] += time.perf_counter() - t_wait
                    if backend.world_size == 1 and local == 0:  # no target in the whole step: nothing to learn
                        n_local = n_valid = loss_sum = grad_norm = zero()
                        applied = torch.zeros((), dtype=torch.bool, device=self.device)
                    else:
                        n_local = sum((y != IGNORE_INDEX).sum() for _, y in micro).double()
                        # the valid targets of the whole step, over all ranks, normalise the loss
                        n_valid = backend.all_reduce_sum(n_local.clone()) if backend.world_size > 1 else n_local
                        try:
                            loss_sum = self.train_step(micro, n_valid.float().clamp(min=1))
                            grad_norm, applied = backend.step(self.forward_model, self.optimizer, a.grad_clip,
                                                              skip=n_valid == 0)
                        except torch.cuda.OutOfMemoryError:
                            raise SystemExit(f"error: {OOM_HELP}") from None
                    self.step += 1
                    self.cursor = feeder.cursor
                    self.scheduler.step()
                    logger.advance()
                    ok = applied.double()
                    window["loss"] += loss_sum * ok
                    window["valid"] += n_local * ok
                    c = self.counters
                    c["tokens_seen"] += n_valid * ok
                    c["skipped"] += 1 - ok
                    c["bad_in_a_row"] = (c["bad_in_a_row"] + 1) * (1 - ok)
                    c["grad_norm"] = grad_norm.double()
                    window["tokens"] += n_input
                    window["steps"] += 1
                    if self.step % a.log_interval == 0 or self.step == self.total_steps:
                        self._log(logger, window)
                        if self.bad_in_a_row >= a.max_bad_steps:
                            logger.message(f"error: {self.bad_in_a_row} consecutive steps had non-finite "
                                           "gradients; stopping without saving. Try a lower --learning_rate, "
                                           "--dtype bfloat16 or float32. The last checkpoint is intact.")
                            exit_code = 1
                            break
                    if self.step % a.eval_interval == 0 or self.step == self.total_steps:
                        val_loss = self._eval_and_log(logger)
                    if self.step % a.save_interval == 0 or self.step == self.total_steps:
                        self.save(val_loss)
                        last_saved = self.step
                    if stop.received and backend.world_size == 1:
                        break
                if stop.received and exit_code == 0:
                    if last_saved != self.step:
                        self.save(val_loss)
                    logger.message(f"{stop.received} received: checkpointed step {self.step} to {s.run_dir}; "
                                   "continue with --resume")
        except RuntimeError as e:
            if backend.world_size == 1 or not is_peer_failure(e):
                raise
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            print(f"error: rank {backend.rank} lost contact with the other ranks ({first}); a rank died or hung. "
                  f"Resume with --resume from the last checkpoint.", file=sys.stderr)
            exit_code = 1
        finally:
            feeder.close()
            logger.close()
        return exit_code

    def _sync_counters(self) -> None:
        """Copy the device-side counters to plain numbers (one host sync)."""
        c = self.counters
        tokens, skipped, bad = torch.stack([c["tokens_seen"], c["skipped"], c["bad_in_a_row"]]).tolist()
        self.tokens_seen, self.skipped, self.bad_in_a_row = int(tokens), int(skipped), int(bad)

    def _log(self, logger: MetricsLogger, w: dict[str, Any]) -> None:
        elapsed = time.perf_counter() - w["t0"]
        # token-weighted loss and non-padding inputs over all ranks: the one host sync per log interval
        tokens = torch.tensor(float(w["tokens"]), device=self.device, dtype=torch.float64)
        loss_sum, valid, tokens = self.backend.all_reduce_sum(torch.stack([w["loss"], w["valid"], tokens])).tolist()
        self._sync_counters()
        record = {"step": self.step, "loss": round(loss_sum / max(valid, 1), 6), "lr": self.scheduler.lr,
                  "grad_norm": round(float(self.counters["grad_norm"]), 4), "tokens_per_s": round(tokens / elapsed),
                  "step_time_s": round(elapsed / max(w["steps"], 1), 4),
                  "data_wait_frac": round(w["wait"] / elapsed, 4), "tokens_seen": self.tokens_seen,
                  "skipped_steps": self.skipped}
        if self.peak is not None:
            record["mfu"] = round(self.flops_per_token * tokens / elapsed / (self.peak * self.backend.world_size), 4)
        if self.device.type == "cuda":
            record["peak_mem_gb"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3)
        else:
            record["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)
        logger.log(record, bar_fields=("loss", "lr", "tokens_per_s"))
        w.update(loss=torch.zeros_like(w["loss"]), valid=torch.zeros_like(w["valid"]), tokens=0, wait=0.0,
                 t0=time.perf_counter(), steps=0)

    def _eval_and_log(self, logger: MetricsLogger) -> float | None:
        val_loss = self.evaluate()
        if val_loss is not None:
            ppl = math.exp(min(val_loss, 50))  # capped: a diverged run must not overflow the log
            logger.log({"step": self.step, "val_loss": round(val_loss, 5), "val_ppl": round(ppl, 3)})
            logger.message(f"step {self.step}: val_loss {val_loss:.4f} (ppl {ppl:.2f})")
        return val_loss


def is_peer_failure(e: RuntimeError) -> bool:
    """Whether a collective failed because another rank died or hung (gloo/NCCL report it as RuntimeError)."""
    if isinstance(e, getattr(torch.distributed, "DistError", ())):
        return True
    return re.search(r"(?i)connection (closed|reset|refused)|timed? ?out|by peer|nccl|gloo", str(e)) is not None


def run(args: argparse.Namespace, stage: str) -> int:
    """Build the session and train; turn known user errors into one-line messages (exit code 2)."""
    try:
        trainer = Trainer(Session(args, stage))
    except (DataError, TokenizerError, ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return trainer.fit()
    finally:
        trainer.backend.close()
