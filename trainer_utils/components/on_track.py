"""Is this run's loss normal? For pretraining a new model on what the loss model was fitted on (trainer_utils/
loss_model.py: the bundled corpus, the shipped tokenizer, a context of 256), every evaluation is set beside what the
loss model expects at that point of the run (the model's size, the tokens trained so far and the run's planned end);
one line, once, flags a run that falls behind beyond the spread of the runs the model was fitted on, whose
validation loss rises (diverging), or whose training loss jumps (a spike), with what to check; and the last
evaluation is reported against the expected final loss. Where no loss model applies (fine-tuning, RL,
--init_from, other text, another tokenizer or context) it says nothing and guesses nothing.

Its memory (what it has flagged, the best validation loss, the lowest training loss) is checkpointed, so a resumed
run does not flag again what it flagged before.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from common.files import DEFAULT_TOKENIZER_DIR, PROJECT_ROOT

from ..context import RunContext, every
from ..loss_model import FIT_CONTEXT, FIT_DATA, PROGRESS, SHIPPED, recipe_flags
from .base import Component

DIVERGING = 1.05  # a validation loss this much above the best one so far: the run is going the wrong way
SPIKE = 1.3  # a training-loss window this much above the lowest one so far, after the warm-up: a spike


def same_file(a: str | Path, b: str | Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def not_applicable(ctx: RunContext) -> str | None:
    """Why the loss model does not apply to this run (None: it does)."""
    c = ctx.config
    if ctx.chat or ctx.objective.unit != "tokens":
        return "not pretraining"
    if ctx.init_dir is not None or ctx.adapters:
        return "the model starts from trained weights"
    paths = c.data.data_path or []
    if len(paths) != 1 or not same_file(paths[0], PROJECT_ROOT / FIT_DATA):
        return f"the loss model was fitted on {FIT_DATA} alone"
    if c.data.tokenizer is not None and not same_file(c.data.tokenizer, DEFAULT_TOKENIZER_DIR):
        return "the loss model was fitted with the shipped tokenizer"
    if ctx.max_seq_len != FIT_CONTEXT:
        return f"the loss model was fitted at a context of {FIT_CONTEXT}"
    return None


class OnTrack(Component):
    name = "on_track"

    def __init__(self, ctx: RunContext) -> None:
        self.why_not = not_applicable(ctx)
        self.eval_interval, self.log_interval = ctx.config.eval.eval_interval, ctx.config.run.log_interval
        self.warmup = ctx.config.optim.warmup(ctx.control.total_steps)
        self.n = ctx.model.config.num_parameters(non_embedding=True)
        self.memory: dict[str, Any] = {"flagged": [], "best_val": None, "lowest_train": None}

    def describe(self) -> dict[str, Any]:
        return {"loss_model": "applies" if self.why_not is None else f"not used: {self.why_not}"}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.memory)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.memory.update(state)

    def due(self, step: int, last: int) -> bool:
        return self.why_not is None and any(every(i, step, last) for i in (self.eval_interval, self.log_interval))

    def run(self, ctx: RunContext) -> None:
        step, last = ctx.state.step, ctx.control.total_steps
        if every(self.log_interval, step, last):
            self.watch_training(ctx, ctx.measured.get("train_loss"))
        if every(self.eval_interval, step, last) and ctx.measured.get("val_loss") is not None:
            self.compare(ctx, ctx.measured["val_loss"], step, last)
        return None

    def flag(self, ctx: RunContext, kind: str, text: str) -> None:
        """One line, the first time a kind of trouble shows."""
        if kind not in self.memory["flagged"]:
            self.memory["flagged"].append(kind)
            ctx.logger.log({"step": ctx.state.step, "event": "off_track", "kind": kind})
            ctx.logger.message(f"off track: {text}")

    def watch_training(self, ctx: RunContext, train_loss: float | None) -> None:
        """A training-loss window far above the lowest so far, once the warm-up is over, is a spike."""
        if train_loss is None:
            return
        lowest, step = self.memory["lowest_train"], ctx.state.step
        if not math.isfinite(train_loss) or (lowest is not None and step > self.warmup
                                             and train_loss > SPIKE * lowest):
            self.flag(ctx, "spike", f"the training loss jumped to {train_loss:.4f} at step {step} (its lowest was "
                      f"{lowest:.4f}): check the data around this step (a repeated or garbled document), the learning "
                      "rate and --grad_clip")
        if math.isfinite(train_loss) and (lowest is None or train_loss < lowest):
            self.memory["lowest_train"] = train_loss

    def compare(self, ctx: RunContext, val_loss: float, step: int, last: int) -> None:
        """The evaluation beside the loss model's expectation; behind or diverging flagged; the end reported."""
        best = self.memory["best_val"]
        if best is not None and (not math.isfinite(val_loss) or val_loss > DIVERGING * best):
            self.flag(ctx, "diverging", f"the validation loss rose to {val_loss:.4f} at step {step} from its best, "
                      f"{best:.4f}: lower --learning_rate, or check --grad_clip and --dtype (fp16 can overflow)")
        if not math.isfinite(val_loss):
            return
        if best is None or val_loss < best:
            self.memory["best_val"] = val_loss
        ctx.control.sync_counters()  # the tokens as of this step: the log syncs them only at its own interval
        tokens_end = ctx.state.tokens_seen / step * last
        expected = PROGRESS.expected(SHIPPED, self.n, ctx.state.tokens_seen, tokens_end)
        if expected is None:  # too early in the run to expect anything
            return
        loss, tolerance = expected
        ctx.logger.log({"step": step, "expected_val_loss": round(loss, 5), "expected_tolerance": round(tolerance, 4)})
        off = val_loss / loss - 1
        if step == last:
            ctx.logger.message(f"step {step}: val_loss {val_loss:.4f} at the end, the loss model expected {loss:.4f} "
                               f"({off:+.1%})")
            return
        ctx.logger.message(f"step {step}: expected val_loss {loss:.4f} (±{tolerance:.0%}): "
                           + ("behind" if off > tolerance else "on track"))
        if off > tolerance:
            self.flag(ctx, "behind", f"the validation loss is {val_loss:.4f} at step {step}, {off:.0%} above the "
                      f"{loss:.4f} the loss model expects here (its runs spread ±{tolerance:.0%}): check the learning "
                      f"rate (its runs: {' '.join(recipe_flags())}), the data and --dtype")
