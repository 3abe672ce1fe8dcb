"""The in-loop extras, one module each (components/base.py says what a component is). They run in this order
after each step: a time budget planned on the run's first steps (first: it times the step it wraps alone, and a
plan that ends the run here makes this step's evaluation and checkpoint the last), the budget's guard (a re-plan
likewise), the log, the precision fallback's check (it reads the counters the log synced), then at
evaluations the validation loss, whether it is on track (it reads the losses just measured), the downstream
tasks, layer statistics, samples and probes, and early stopping (which reads the validation loss); the memory
check wraps the one step it measures."""
from __future__ import annotations

from ..context import StepOutcome, Stop, every
from .base import Component
from .budget import TimeBudgetGuard
from .downstream import DownstreamEval
from .early_stop import EarlyStopping
from .evaluation import Evaluation
from .fallback import NonfiniteGuard
from .first_steps import FirstStepsPlan
from .layer_stats import LayerStats
from .log import TrainLog
from .memory import MemoryCheck
from .on_track import OnTrack
from .samples import SamplesAndProbes

COMPONENTS: tuple[type[Component], ...] = (FirstStepsPlan, TimeBudgetGuard, TrainLog, NonfiniteGuard, Evaluation,
                                           OnTrack, DownstreamEval, LayerStats, SamplesAndProbes, EarlyStopping,
                                           MemoryCheck)

__all__ = ["COMPONENTS", "Component", "StepOutcome", "Stop", "every"]
