"""The training log: every --log_interval steps, one record of the window since the last one.

Losses and metrics are weighted by the objective's units (tokens, pairs) over all ranks; a stage's own metrics
(GRPO's per completion) by what its metric_unit names (one all-reduce, the one host sync per interval), beside
the learning rate, gradient norm, throughput, data-wait share, progress counters, the routers' load (MoE), MFU
where the device's peak is known, and the memory peak. The running sums stay on the device between records.
"""
from __future__ import annotations

import resource
import time

import torch

from ..context import Report, RunContext, StepOutcome, every
from ..metrics import flops_per_token, peak_flops
from .base import Component


class TrainLog(Component):
    def __init__(self, ctx: RunContext) -> None:
        self.interval = ctx.config.run.log_interval
        self.flops_per_token = flops_per_token(ctx.model.config, ctx.max_seq_len)
        self.peak = peak_flops(ctx.device)
        self.device = ctx.device
        self._new_window()

    def _new_window(self) -> None:
        zero = lambda: torch.zeros((), device=self.device, dtype=torch.float64)  # noqa: E731
        self.loss, self.valid, self.metrics = zero(), zero(), {}
        self.tokens, self.wait, self.steps, self.t0 = 0, 0.0, 0, time.perf_counter()

    def start(self, ctx: RunContext) -> None:
        self.t0 = time.perf_counter()

    def after_step(self, ctx: RunContext, outcome: StepOutcome) -> None:
        applied = outcome.applied
        # torch.where, not a product: a skipped step's loss may be NaN, and NaN * 0 is NaN
        self.loss += torch.where(applied, outcome.loss.double(), 0.0)
        for k, v in outcome.metrics.items():
            self.metrics[k] = self.metrics.get(k, 0.0) + torch.where(applied, v, 0.0)
        self.valid += outcome.n_valid_local * applied.double()
        self.tokens += outcome.n_input
        self.wait += outcome.wait_s
        self.steps += 1

    def due(self, step: int, last: int) -> bool:
        return every(self.interval, step, last)

    def run(self, ctx: RunContext) -> Report:
        elapsed = time.perf_counter() - self.t0
        tokens = torch.tensor(float(self.tokens), device=self.device, dtype=torch.float64)
        names = sorted(self.metrics)
        sums = torch.stack([self.loss, self.valid, tokens, *(self.metrics[k] for k in names)])
        loss_sum, valid, tokens, *metrics = ctx.backend.all_reduce_sum(sums).tolist()
        ctx.control.sync_counters()
        state = ctx.state
        values = dict(zip(names, metrics))
        unit = {k: ctx.metric_unit(k) for k in names}
        counts = {u for u in unit.values() if u is not None}
        per = {k: values.get(unit[k], 0.0) if unit[k] is not None else valid for k in names if k not in counts}
        record = {"step": state.step, "loss": round(loss_sum / valid, 6) if valid > 0 else None,
                  **{k: round(values[k] / n, 6) if n > 0 else None for k, n in per.items()},
                  "lr": ctx.control.lr, "grad_norm": round(ctx.grad_norm, 4),
                  "tokens_per_s": round(tokens / elapsed), "step_time_s": round(elapsed / max(self.steps, 1), 4),
                  "data_wait_frac": round(self.wait / elapsed, 4), "tokens_seen": state.tokens_seen,
                  "skipped_steps": state.skipped, "elapsed_s": round(ctx.clock.elapsed(), 3)}
        if ctx.router is not None:
            record.update(ctx.router.record())
        if self.peak is not None:
            record["mfu"] = round(self.flops_per_token * tokens / elapsed / (self.peak * ctx.backend.world_size),
                                  4)
        if self.device.type == "cuda":
            record["peak_mem_gb"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3)
        else:
            record["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)
        ctx.logger.log(record, bar_fields=("loss", "lr", "tokens_per_s"))
        self._new_window()
        return Report({"train_loss": record["loss"]})
