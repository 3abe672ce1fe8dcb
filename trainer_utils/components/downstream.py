"""Downstream evaluation (--eval_tasks): at every evaluation, the benchmark tasks scored as eval_model.py --tasks
scores them (evaluation/scoring.py: ranked choices by log-likelihood, bits per byte, answers generated greedily, or
tool use), on the first --eval_task_items items of each, into metrics.jsonl (task/<name>/acc, acc_norm, centred,
bpb, stated, a tool task's call_valid, call_tool, call_acc and bare_acc, and tasks_centred, the chance-centred
average of the ranked-choice tasks), TensorBoard and wandb. Every rank scores its share of the items and the sums
are added up, so several ranks log what one process would (and no rank runs a forward alone).
"""
from __future__ import annotations

from typing import Any

import torch

from evaluation.scoring import TaskTotals, centred_average, task_totals

from ..context import RunContext, every
from .base import Component


class DownstreamEval(Component):
    pauses_clock = True

    def __init__(self, ctx: RunContext) -> None:
        self.tasks = ctx.eval_tasks
        self.interval = ctx.config.eval.eval_interval
        self.batch_size = ctx.config.optim.batch_size

    def describe(self) -> dict[str, Any]:
        if not self.tasks:
            return {}
        pairs = sum(len(item.pairs) for task in self.tasks if task.kind in ("choice", "bpb") for item in task.items)
        # a tool item: a reply per round of calls and one without tools
        tokens = sum(item.max_new_tokens * (getattr(item, "max_rounds", 0) + 1 + (task.kind == "tools"))
                     for task in self.tasks if task.kind in ("generate", "tools") for item in task.items)
        cost = [f"{pairs} continuations scored"] if pairs else []
        cost += [f"up to {tokens} tokens generated"] if tokens else []
        return {"eval_tasks": {task.name: len(task.items) for task in self.tasks},
                "eval_task_cost": f"{' and '.join(cost)} per evaluation, over all ranks"}

    def due(self, step: int, last: int) -> bool:
        return bool(self.tasks) and every(self.interval, step, last)

    @torch.no_grad()
    def run(self, ctx: RunContext) -> None:
        rank, world, tok = ctx.backend.rank, ctx.backend.world_size, ctx.tokenizer
        totals = [task_totals(ctx.model, task.kind, task.items[rank::world], tok, self.batch_size,
                              ctx.precision.autocast) for task in self.tasks]
        sums = torch.tensor([v for t in totals for v in t.as_list()], dtype=torch.float64, device=ctx.device)
        sums = ctx.backend.all_reduce_sum(sums).view(len(self.tasks), -1).tolist()
        scores = [TaskTotals.from_list(task.kind, row).score(task.name) for task, row in zip(self.tasks, sums)]
        step = ctx.state.step
        record: dict[str, Any] = {"step": step}
        for s in scores:
            values = {"acc": s.acc, "acc_norm": s.acc_norm, "centred": s.centred, "bpb": s.bpb, "stated": s.stated,
                      "call_valid": s.call_valid, "call_tool": s.call_tool, "call_acc": s.call_acc,
                      "bare_acc": s.bare_acc}
            record.update({f"task/{s.name}/{k}": round(v, 5) for k, v in values.items() if v is not None})
        average = centred_average(scores)
        if average is not None:
            record["tasks_centred"] = round(average, 5)
        ctx.logger.log(record)
        shown = ", ".join(f"{s.name} {s.acc:.3f}" if s.acc is not None else f"{s.name} {s.bpb:.3f} bpb"
                          for s in scores)
        ctx.logger.message(f"step {step} tasks: {shown}" + (f"; centred average {average:.4f}"
                                                               if average is not None else ""))
