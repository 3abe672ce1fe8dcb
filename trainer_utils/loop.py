"""The one training loop: a Trainer that takes optimizer steps (trainer_utils/driver.py runs it).

Trainer.fit(): for each optimizer step, take this rank's micro-batches from the global cursor, normalise the
loss by the valid target tokens of the whole step (all micro-batches, all ranks), backward with no_sync on all
but the last micro-batch, clip and step (skipping non-finite steps); then the components (trainer_utils/
components: the log, the precision fallback's check, evaluation, layer statistics, samples and probes, early
stopping, the memory check) each do their work when due, and a checkpoint is written every --save_interval.
What differs between stages lives in trainer_utils/stages; what happens before the first step in session.py.
When steps keep failing in a reduced precision, fit() ends with `fallback` set, and the driver builds a new Trainer
that resumes the last checkpoint in a wider one (--on_nonfinite fallback).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from common.config import RESOLVED_KEY, to_dict
from common.device import dtype_name, precision_policy
from common.errors import ConfigError, TrainingError
from common.files import TRAIN_CONFIG_NAME, write_atomic
from model.loading import ADAPTER_WEIGHTS_NAME, WEIGHTS_NAME, load_state_into, read_state_dict
from model.lora import load_lora_state_dict, save_lora

from .budget import (
    PLAN_KEY,
    BudgetClock,
    BudgetPlan,
)
from .checkpoint import check_resumable, load_training_state, new_staging_dir, save_checkpoint, staging_dir
from .components import COMPONENTS
from .context import Report, StepBatches, StepOutcome, Stop, TrainState, every
from .data import StepFeeder
from .distributed import lost_peer
from .metrics import MetricsLogger, TrainClock
from .objectives import Batch, Objective
from .optim import WarmupCosine, newton_schulz_steps, optimizer_for
from .routing import RouterBalance
from .runtime import StopSignal, rng_state, seed_everything, set_rng_state
from .session import Session
from .step import Step

OOM_HELP = ("out of GPU memory. Reduce memory with a smaller --batch_size and more --accumulation_steps "
            "(same effective batch), --grad_checkpointing, or a shorter --max_seq_len. The last checkpoint "
            "is intact.")


def samples_per_step(session: Session) -> int:
    """Sequences in one optimizer step, over every rank and micro-batch."""
    o = session.config.optim
    return o.batch_size * o.accumulation_steps * session.backend.world_size


def steps_per_epoch(session: Session) -> int:
    """Optimizer steps in one pass over the training data (at least one)."""
    return max(1, len(session.train_data) // samples_per_step(session))


def step_limit(session: Session) -> int:
    """The most steps --max_steps, or else --epochs of the training data, allow."""
    o = session.config.optim
    return o.max_steps or o.epochs * steps_per_epoch(session)


class OnContext:
    """A Trainer attribute that lives on its RunContext, so the loop, the stage and the components share one value
    (the loop replaces `state` on resume and `logger` when fit() starts; components write the losses)."""

    def __init__(self, field: str | None = None) -> None:
        self.field = field

    def __set_name__(self, owner: type, name: str) -> None:
        self.field = self.field or name

    def __get__(self, trainer: Trainer | None, owner: type | None = None) -> Any:
        return self if trainer is None else getattr(trainer.ctx, self.field)

    def __set__(self, trainer: Trainer, value: Any) -> None:
        setattr(trainer.ctx, self.field, value)


class Trainer:
    """Runs optimizer steps until max_steps, a stop signal, or a component's Stop (early stopping; non-finite
    trouble, which ends it with `fallback` set when the run should continue in a wider precision). It owns the
    step, the backend, the model, optimizer and schedule. The stage's hooks and the components see the run through
    its RunContext (trainer_utils/context.py), ask the loop for a checkpoint through it, and return what they
    produce (a Report: measurements, a re-planned time budget, a Stop), which the loop records."""

    state = OnContext()
    logger = OnContext()
    clock = OnContext()
    stage_state = OnContext()  # what the stage's prepare() returned
    plan = OnContext()  # a --time_budget run's (trainer_utils/budget.py; a re-plan replaces it); None: steps as given
    budget_clock = OnContext()  # the clock a plan is held to
    measured = OnContext()  # what the components reported (val_loss, train_loss)
    grad_norm = OnContext()
    bad_in_a_row = OnContext()

    def __init__(self, session: Session, plan: BudgetPlan | None = None, budget_clock: BudgetClock | None = None,
                 first_steps: int = 0) -> None:
        s, c = session, session.config
        self.session, self.config, self.backend = s, c, s.backend
        self.device, self.precision = s.backend.device, s.backend.precision
        o = c.optim
        seed_everything(o.seed)
        self.model = s.build_model().to(self.device)
        self.model.set_gradient_checkpointing(c.model.grad_checkpointing)
        # wrapped first (DDP, a DeepSpeed engine, or the model itself), the optimizer then built over what the
        # backend trains: the order a sharded backend needs
        self.wrapped, self.optimizer = self.backend.wrap(self.model, lambda m: optimizer_for(m, o, self.device))
        self.samples_per_step = samples_per_step(session)
        self.step_limit = step_limit(session)  # a time budget's plan stays within it
        planned = plan.steps if plan is not None else self.step_limit
        self.scheduler = WarmupCosine(self.optimizer, o.learning_rate, o.final_lr, o.warmup(planned), planned)
        for r in plan.replans if plan is not None else ():  # a resumed budget run's, as they were made
            self.scheduler.end_at(r["step"], r["steps"])
        self.objective: Objective = s.objective()
        # a mixture of experts: its routers' balancing losses and load statistics (trainer_utils/routing.py)
        self.router = RouterBalance(self.model.config, self.backend, self.device) if self.model.config.moe else None
        self.ctx = s.run_context(self, self.model, self.optimizer, self.objective, self.router, plan, budget_clock,
                                 first_steps)
        self.stage_state = s.stage.prepare(self.ctx)  # what the stage's hooks keep for this run
        self.step = Step(self.model, self.wrapped, self.objective, self.backend, self.router, c.model.compile)

        self.last_saved = -1
        self.fallback: dict[str, Any] | None = None  # set when fit() ends for a precision fallback
        # Running totals live on the device and are read once per log interval (no host sync per step).
        zero = lambda: torch.zeros((), device=self.device, dtype=torch.float64)  # noqa: E731
        self.counters = {"tokens_seen": zero(), "skipped": zero(), "bad_in_a_row": zero(), "grad_norm": zero()}
        self.components = [component(self.ctx) for component in COMPONENTS]
        if s.resume_from is not None:  # after wrap: a DeepSpeed engine restores into itself
            self._restore(s.resume_from)

        derived = {"total_steps": self.total_steps, "steps_per_epoch": steps_per_epoch(s),
                   "samples_per_step": self.samples_per_step, "tokens_per_step": self.samples_per_step * s.max_seq_len,
                   "warmup_steps": self.scheduler.warmup, "min_lr": self.scheduler.min_lr}
        if o.optimizer == "muon":
            derived["newton_schulz_dtype"] = dtype_name(precision_policy(self.device).optimizer)
            # what the optimizer runs (the policy's count or --muon_ns_steps; a resumed run's own, once restored)
            derived["newton_schulz_steps"] = newton_schulz_steps(self.optimizer)
        self.resolved = s.describe(self.model.config, derived)
        for component in self.components:
            self.resolved.update(component.describe())

    @property
    def total_steps(self) -> int:
        """The step training ends at: the schedule's end (a time budget's re-plan moves it)."""
        return self.scheduler.end

    @property
    def lr(self) -> float:
        """The learning rate of the step just taken."""
        return self.scheduler.lr

    def record(self, report: Report | None) -> Stop | None:
        """Take in what a component produced: its measurements, a time budget's plan or re-plan (the run trains to its
        end); returns its Stop, if any."""
        if report is None:
            return None
        self.measured.update(report.measured)
        if report.plan is not None:
            if self.plan is None:  # made on the run's first steps, all warm-up: the schedule of its length, exactly
                self.scheduler.set_total(report.plan.steps)
                self.resolved.update({"total_steps": report.plan.steps, PLAN_KEY: report.plan.to_dict()})
                if self.backend.is_main:
                    self.write_run_config()
            else:  # a re-plan: the rest of the schedule laid over the steps up to its end
                self.scheduler.end_at(self.state.step, report.plan.end)
            self.plan = report.plan
            if self.logger is not None:
                self.logger.set_total(report.plan.end)
        return report.stop

    # ------------------------------------------------------------------------- state
    def _restore(self, ckpt: Path) -> None:
        state, tokenizer = load_training_state(ckpt), self.session.tokenizer
        check_resumable(ckpt, state, self.config.optim.optimizer, tokenizer.sha256, tokenizer.path)
        if self.session.lora is not None:  # the base is already in place (build_model), checked against its hash
            load_lora_state_dict(self.model, read_state_dict(ckpt / ADAPTER_WEIGHTS_NAME), str(ckpt))
        else:
            load_state_into(self.model, read_state_dict(ckpt / WEIGHTS_NAME), str(ckpt))
        self.backend.restore_state(ckpt, state)
        given, restored = self.config.optim.muon_ns_steps, newton_schulz_steps(self.optimizer)
        if given is not None and restored is not None and given != restored:  # the restored group's count runs
            raise ConfigError(f"--muon_ns_steps {given}: {ckpt} was trained with {restored} Newton-Schulz "
                              "iterations, which a resume keeps; drop --muon_ns_steps (or pass "
                              f"{restored}), or start a new run")
        self.scheduler.load_state_dict(state["scheduler"])
        self.state = TrainState.from_checkpoint(state)
        self.counters["tokens_seen"] += self.state.tokens_seen
        self.counters["skipped"] += self.state.skipped
        for component in self.components:
            if component.name:
                component.load_state_dict(state.get(component.name, {}))
        set_rng_state(state["rng"])
        if state.get("world_size") != self.backend.world_size and self.backend.is_main:
            print(f"resuming a {state.get('world_size')}-rank run on {self.backend.world_size} ranks: the "
                  f"sample cursor ({self.state.cursor}) carries over; the effective batch is now "
                  f"{self.samples_per_step}", file=sys.stderr)

    def sync_counters(self) -> None:
        """Copy the device-side counters to plain numbers (one host sync)."""
        c = self.counters
        tokens, skipped, bad, norm = torch.stack([c["tokens_seen"], c["skipped"], c["bad_in_a_row"],
                                                  c["grad_norm"]]).tolist()
        self.state.tokens_seen, self.state.skipped, self.bad_in_a_row, self.grad_norm = \
            int(tokens), int(skipped), int(bad), norm

    def save(self) -> None:
        """Checkpoint this step (collective): every rank writes what it owns into the staging directory, then
        rank 0 completes it and publishes it. Nothing with --no-checkpoints, or when this step is saved. In a
        rehearsal, into its scratch directory."""
        if not self.config.run.checkpoints or self.last_saved == self.state.step:
            return
        s, backend, step, run_dir = self.session, self.backend, self.state.step, self.ctx.run_dir
        self.sync_counters()
        self.state.train_time_s = self.clock.elapsed()
        if backend.is_main:
            new_staging_dir(run_dir, step)
        backend.barrier()
        backend_state = backend.save_state(staging_dir(run_dir, step))
        weights = backend.master_weights(self.model) if s.lora is None else None
        backend.barrier()
        if backend.is_main:
            state = {**backend_state, **dataclasses.asdict(self.state), "scheduler": self.scheduler.state_dict(),
                     "rng": rng_state(), "world_size": backend.world_size, "tokenizer_sha256": s.tokenizer.sha256,
                     "config": to_dict(self.config, s.stage),
                     **{c.name: c.state_dict() for c in self.components if c.name}}
            info = s.train_info(self.state.tokens_seen, self.measured.get("val_loss"))
            if self.plan is not None:  # a budget run's plan, and the budget spent so far: what --resume continues
                info[PLAN_KEY] = dataclasses.replace(self.plan, used_s=round(self.budget_clock.spent(), 3)).to_dict()
            write = None if s.lora is None else lambda d: save_lora(self.model, d, s.lora, s.base_ref, s.tokenizer.path)
            save_checkpoint(run_dir, step, self.model, state, info, s.tokenizer.path, self.config.run.keep_last,
                            write, weights)
        backend.barrier()
        self.last_saved = step

    @contextlib.contextmanager
    def rehearsal(self, scratch: Path) -> Iterator[None]:
        """What runs inside leaves no trace on the run (components/first_steps.py times a checkpoint and an evaluation
        round on it): it writes into `scratch` (a checkpoint, an early stop's best mark), logs nothing, and the state,
        measurements and components' states are restored after it (the samples draw from a generator of their own)."""
        ctx = self.ctx
        kept = (self.logger, dict(self.measured), dataclasses.replace(self.state), self.last_saved, ctx.run_dir)
        states = {c: copy.deepcopy(c.state_dict()) for c in self.components if c.name}
        self.logger, ctx.run_dir = MetricsLogger(scratch, False, 0, 0, {}), scratch
        try:
            yield
        finally:
            self.logger, self.measured, self.state, self.last_saved, ctx.run_dir = kept
            for component, state in states.items():
                component.load_state_dict(state)

    def write_run_config(self) -> None:
        """train_config.json: the run's settings (a valid --config that reproduces it) and what it derived."""
        config = {**to_dict(self.config, self.session.stage), RESOLVED_KEY: self.resolved}
        write_atomic(self.session.run_dir / TRAIN_CONFIG_NAME, json.dumps(config, indent=2, default=str) + "\n")

    # ------------------------------------------------------------------------- train
    def fit(self) -> int:
        """Train to the end (or a stop); returns the process exit code."""
        s, backend, run = self.session, self.backend, self.config.run
        self.logger = MetricsLogger(s.run_dir, backend.is_main, self.total_steps, self.state.step, self.resolved,
                                    run.use_wandb, run.wandb_project, run.use_tensorboard)
        if backend.is_main:
            self.write_run_config()
            self.logger.message(json.dumps({k: v for k, v in self.resolved.items() if k != "model"}))
        feeder = StepFeeder(s.train_data, self.config.optim.batch_size, self.config.optim.accumulation_steps,
                            backend.rank, backend.world_size, self.state.cursor, self.device)
        exit_code = 0
        self.model.train()
        self.clock = TrainClock(self.device, self.state.train_time_s)
        self.start_components()
        try:
            with StopSignal() as signal:
                while self.state.step < self.total_steps and not self._stop_requested(signal):
                    step = lambda: self.optimizer_step(feeder)  # noqa: E731
                    for component in self.components:
                        step = component.wrap_step(self.ctx, step)
                    step()
                    stop = self._after_step()
                    if stop is not None:
                        exit_code, self.fallback = stop.exit_code, stop.fallback
                        break
                if signal.received and exit_code == 0:
                    self.save()
                    self.logger.message(f"{signal.received} received: checkpointed step {self.state.step} to "
                                        f"{s.run_dir}; continue with --resume" if run.checkpoints else
                                        f"{signal.received} received: stopped at step {self.state.step} "
                                        "(--no-checkpoints: nothing to resume from)")
        except RuntimeError as e:
            if not lost_peer(e, backend):
                raise
            exit_code = 1
        finally:
            feeder.close()
            self.logger.close()
        return exit_code

    def _after_step(self) -> Stop | None:
        """The components that are due, in order, until one says stop; then the checkpoint, when due. The last
        step is read afresh each time: a time budget's re-plan (the first component) may make this one the last."""
        step, stop = self.state.step, None
        for component in self.components:
            if component.due(step, self.total_steps):
                with self.clock.pause() if component.pauses_clock else contextlib.nullcontext():
                    stop = self.record(component.run(self.ctx))
                if stop is not None:
                    break
        if stop.save if stop is not None else every(self.config.run.save_interval, step, self.total_steps):
            with self.clock.pause():
                self.save()
        if stop is not None and stop.announce is not None:
            stop.announce()
        return stop

    def _stop_requested(self, signal: StopSignal) -> bool:
        """Whether to stop before the next step. Ranks agree (all stop after the same step): they compare notes
        once per log interval."""
        if self.backend.world_size == 1:
            return signal.received is not None
        if self.state.step % self.config.run.log_interval:
            return False
        flag = torch.tensor(float(signal.received is not None), device=self.device)
        if self.backend.all_reduce_sum(flag).item() > 0:
            signal.received = signal.received or "stop signal on another rank"
            return True
        return False

    def start_components(self) -> None:
        """What the components do before the first step (an --init_from model's baseline evaluation)."""
        for component in self.components:
            self.record(component.start(self.ctx))

    def evaluation_round(self) -> None:
        """The components that pause the training clock, as the last step runs them: every one of them due."""
        step = self.state.step
        for component in self.components:
            if component.pauses_clock and component.due(step, step):
                self.record(component.run(self.ctx))

    def optimizer_step(self, feeder: StepFeeder) -> None:
        """One optimizer step on the next micro-batches, with the device-side counters updated."""
        t_wait = time.perf_counter()
        micro, n_input = feeder.next_step()
        wait = time.perf_counter() - t_wait
        prepared = self.session.stage.before_loss(self.ctx, StepBatches(micro, n_input))
        micro, n_input = prepared.micro, prepared.input_tokens
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
        self.state.step += 1
        self.state.cursor = feeder.cursor
        self.scheduler.step()
        self.logger.advance()
        ok, c = applied.double(), self.counters
        c["tokens_seen"] += n_valid * ok
        c["skipped"] += 1 - ok
        c["bad_in_a_row"] = (c["bad_in_a_row"] + 1) * (1 - ok)
        c["grad_norm"] = grad_norm.double()
        outcome = StepOutcome(loss_sum, {**self.step.metrics, **prepared.metrics}, applied, n_local, n_input, wait)
        for component in self.components:
            component.after_step(self.ctx, outcome)

    def train_step(self, micro: list[Batch], n_valid: torch.Tensor) -> torch.Tensor:
        """Forward and backward over the step's micro-batches (trainer_utils/step.py); returns the summed loss."""
        return self.step.backward(micro, n_valid)
