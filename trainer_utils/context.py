"""What a stage or a component sees of a training run: a narrow view, not the Trainer.

The loop (trainer_utils/loop.py) builds one RunContext per Trainer and hands it to the stage's hooks (`prepare`,
`before_loss`) and to every component; the Session builds a SetupContext for the stage's setup hooks
(`check_session`, `record_tokens`, `objective`), which run before any model exists. What they may read is listed
here, field by field; what they may do to the run goes through `control` (save a checkpoint, sync the
device-side counters); what they produce (the numbers they measured, a re-planned time budget, a stop)
they return in a Report, which the loop records: the measurements in the context's `measured`, where the other
components and the checkpoint read them.

This module is a leaf: it imports nothing of trainer_utils at run time (its type hints name the classes behind
the fields), so stages and components depend on it and not on the loop or the session. The small records every
hook passes around live here too: the training state a checkpoint holds (TrainState), a step's micro-batches
(StepBatches) and results (StepOutcome), what a component hands back (Report) and why training stops (Stop).
"""
from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

if TYPE_CHECKING:
    from dataset.config import ValSet
    from dataset.kinds import DataKind
    from dataset.tasks import Task
    from dataset.tokenizer import Tokenizer
    from evaluation.probes import Probe
    from model import PocketLM

    from .backend import Backend
    from .budget import BudgetClock, BudgetPlan
    from .config import TrainConfig
    from .metrics import MetricsLogger, TrainClock
    from .objectives import Batch, Objective
    from .routing import RouterBalance
    from .runtime import Precision


@dataclass
class TrainState:
    """Where training is: saved in every checkpoint as a whole, restored on resume."""

    step: int = 0
    cursor: int = 0  # samples taken from the global training order
    tokens_seen: int = 0  # valid targets trained on
    skipped: int = 0  # steps not applied (non-finite gradients); the count goes on across resumes
    train_time_s: float = 0.0  # training seconds, without pauses to evaluate and checkpoint; elapsed_s goes on

    @classmethod
    def from_checkpoint(cls, state: dict[str, Any]) -> TrainState:
        return cls(**{f.name: state[f.name] for f in dataclasses.fields(cls) if f.name in state})


@dataclass
class StepBatches:
    """One optimizer step's micro-batches on this rank, their non-padding input tokens (counted on the host, for
    the log's throughput), and metrics the stage adds to the objective's (sums; Stage.metric_unit says per what)."""

    micro: list[Batch]
    input_tokens: int
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class StepOutcome:
    """One optimizer step's results, as device tensors (reading them would sync): the summed loss and metrics
    of this rank's micro-batches, whether the update was applied, and what it counted."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    applied: torch.Tensor
    n_valid_local: torch.Tensor  # this rank's valid targets (the loss's units)
    n_input: int  # this rank's input tokens
    wait_s: float  # host seconds spent waiting for the batches


@dataclass
class Stop:
    """Why training ends after this step. save: checkpoint it first; announce: said after that checkpoint;
    fallback: continue in a wider precision (run() builds the next Trainer)."""

    reason: str
    save: bool
    exit_code: int = 0
    fallback: dict[str, Any] | None = None
    announce: Callable[[], None] | None = None


@dataclass(frozen=True)
class Report:
    """What a component's start() or run() hands back to the loop, which records it before the next component
    runs: the numbers it measured, for the components after it and the checkpoint (RunContext.measured: the last
    `val_loss`, `train_loss`); a time budget's plan or re-plan (the run trains to its end from now on); and a Stop when
    training ends after this step."""

    measured: dict[str, float | None] = field(default_factory=dict)
    plan: BudgetPlan | None = None
    stop: Stop | None = None


def every(interval: int, step: int, last: int) -> bool:
    """Whether the step just taken is a multiple of `interval`, or the last one."""
    return step % interval == 0 or step == last


class LoopControl(Protocol):
    """What a component may ask of the loop itself (the Trainer implements it)."""

    @property
    def total_steps(self) -> int:
        """The step training ends at (a time budget's re-plan moves it)."""

    @property
    def lr(self) -> float:
        """The learning rate of the step just taken."""

    def save(self) -> None:
        """Checkpoint this step (collective; a no-op when it is saved already or checkpoints are off)."""

    def evaluation_round(self) -> None:
        """Every component due at an evaluation, as the last step runs them."""

    def rehearsal(self, scratch: Path) -> AbstractContextManager[None]:
        """A context in which what runs leaves no trace on the run: it writes into `scratch`, logs nothing, and the
        run's state and the components' are restored after it."""

    def sync_counters(self) -> None:
        """Copy the device-side counters into `state`, `grad_norm` and `bad_in_a_row` (one host sync)."""


@dataclass
class SetupContext:
    """What a stage's setup hooks read (Stage.check_session, record_tokens, objective): the Session's settled
    facts before the data is prepared and before any model is built."""

    options: Any  # the stage's own settings (its Options dataclass: config.objective)
    tokenizer: Tokenizer
    max_seq_len: int
    init_dir: Path | None  # --init_from, resolved
    resume_from: Path | None  # the checkpoint a --resume continues
    device: torch.device


@dataclass(eq=False)
class RunContext:
    """One Trainer's run as its stage and components see it. The first fields are fixed for the Trainer's life;
    `state`, `logger`, `clock`, `plan` and `measured` are replaced or updated by the loop as it goes (read them
    each time)."""

    config: TrainConfig
    options: Any  # the stage's own settings (config.objective)
    control: LoopControl
    # where and how it computes
    device: torch.device
    precision: Precision
    backend: Backend
    model: PocketLM  # unwrapped: what to evaluate and sample from (DDP's wrapper is the loop's business)
    optimizer: torch.optim.Optimizer
    objective: Objective
    router: RouterBalance | None  # a mixture of experts' balancing and load statistics
    # the data and what reads it
    tokenizer: Tokenizer
    max_seq_len: int
    kind: DataKind
    chat: bool  # prompts use the chat template
    train_data: Any  # the training dataset (its records, for a stage's rewards)
    val_sets: list[ValSet]
    token_bytes: Callable[[], torch.Tensor | None]  # UTF-8 bytes per token id (None: not a byte-level tokenizer)
    # what the run starts from, and where it is written
    init_dir: Path | None
    run_dir: Path  # the run's directory (logs, train_config.json)
    adapters: bool  # LoRA adapters are trained instead of every weight
    # what evaluations score beside the loss
    eval_tasks: list[Task]
    samples: list[Probe]  # prompts to continue at each evaluation
    probes: list[Probe]
    # the stage's answers, for the log and the memory estimate
    metric_unit: Callable[[str], str | None]
    memory_rows: int
    estimates_memory: bool
    # a --time_budget run's plan (a re-plan replaces it) and the clock it is held to (None: steps as given)
    plan: BudgetPlan | None
    budget_clock: BudgetClock | None
    first_steps: int  # a budget run planned on its own first steps: the most it may measure (0: it is not)
    # live: replaced or updated by the loop
    state: TrainState
    clock: TrainClock
    logger: MetricsLogger | None = None  # from fit() (or while the driver measures a run's costs) on
    stage_state: Any = None  # what the stage's prepare() returned
    grad_norm: float = 0.0  # of the last synced step (sync_counters)
    bad_in_a_row: int = 0  # consecutive non-finite steps, as last synced
    # what the components measured (their Reports), as the loop recorded it: "val_loss" of the last evaluation
    # (None: no validation split), "train_loss" of the last logged window; absent until measured
    measured: dict[str, float | None] = field(default_factory=dict)
