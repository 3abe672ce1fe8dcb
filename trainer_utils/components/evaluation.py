"""Validation: every --eval_interval steps, the loss (per token, or per pair for DPO) and the objective's metrics
on each --data_path file's validation split, over the same --eval_batches batches every time.

With several files each one's loss (perplexity, bits per byte) is logged as val_loss/<file stem> (val_ppl/...,
val_bpb/...), and val_loss itself weights them as the files are mixed in training (an --eval_data_path file,
scored whole and never trained on, weighs nothing in it): continued pretraining on new text mixed with general
text shows both sides, learning and forgetting. A run that starts from trained weights
(--init_from) is evaluated once before its first step too (a per-token loss: not DPO's, which starts at ln 2 by
construction), so its step-0 numbers are the start model's. For a per-token loss with a byte-level tokenizer,
"bpb" is the loss in bits per UTF-8 byte of the targets. The mixed val_loss is reported to the loop (None when no
file has a validation split) for early stopping and the checkpoint's train_info.json.
"""
from __future__ import annotations

import math

import torch

from ..context import Report, RunContext, every
from ..data import eval_batches
from ..objectives import target_bytes
from .base import Component


def perplexity(loss: float) -> float:
    """exp(loss) as logged, capped so that a diverged run stays finite."""
    return round(math.exp(min(loss, 50)), 3)


class Evaluation(Component):
    pauses_clock = True

    def __init__(self, ctx: RunContext) -> None:
        self.interval = ctx.config.eval.eval_interval
        self.token_bytes = ctx.token_bytes() if ctx.objective.unit == "tokens" else None

    def due(self, step: int, last: int) -> bool:
        return every(self.interval, step, last)

    def start(self, ctx: RunContext) -> Report | None:
        # the baseline of what training changes; not for a per-pair loss (DPO), whose start is ln 2 by construction
        if ctx.init_dir is not None and ctx.state.step == 0 and ctx.objective.unit == "tokens":
            with ctx.clock.pause():
                return self.run(ctx)
        return None

    @torch.no_grad()
    def evaluate(self, ctx: RunContext) -> dict[str, dict[str, float]]:
        """{file name: {"loss", metrics..., "bpb"}} of each validation split (empty: none)."""
        objective, device, config = ctx.objective, ctx.device, ctx.config
        val_sets, names = ctx.val_sets, objective.eval_metrics
        token_bytes = self.token_bytes.to(device) if self.token_bytes is not None else None
        ctx.model.eval()
        # per file: units, summed loss, the summed metrics, the targets' bytes (summed over ranks together)
        total = torch.zeros(len(val_sets), 3 + len(names), device=device, dtype=torch.float64)
        for k, v in enumerate(val_sets):
            for batch in eval_batches(v.data, config.optim.batch_size, config.eval.eval_batches,
                                      ctx.backend.rank, ctx.backend.world_size):
                batch = tuple(t.to(device) for t in batch)
                out = objective.evaluate(ctx.model, batch, ctx.precision.autocast)
                total[k, 0] += objective.count(batch)
                total[k, 1] += out.loss
                for j, name in enumerate(names):
                    total[k, 2 + j] += out.metrics[name]
                if token_bytes is not None:
                    total[k, -1] += target_bytes(batch[1], token_bytes)
        total = ctx.backend.all_reduce_sum(total).tolist() if val_sets else []
        ctx.model.train()
        results = {}
        for v, (count, loss, *metrics, n_bytes) in zip(val_sets, total):
            if count > 0:
                results[v.name] = {"loss": loss / count, **{k: x / count for k, x in zip(names, metrics)}}
                if n_bytes > 0:
                    results[v.name]["bpb"] = loss / math.log(2) / n_bytes
        return results

    def run(self, ctx: RunContext) -> Report:
        results = self.evaluate(ctx)
        if not results:
            return Report({"val_loss": None})
        step = ctx.state.step
        weights = {v.name: v.weight for v in ctx.val_sets if v.name in results}
        if not any(weights.values()):  # only --eval_data_path files were scored: their plain mean
            weights = dict.fromkeys(weights, 1.0)
        mixed = {key: sum(weights[k] * r[key] for k, r in results.items()) / sum(weights.values())
                 for key in next(iter(results.values())) if all(key in r for r in results.values())}
        val_loss = mixed["loss"]
        record = {"step": step, "val_loss": round(val_loss, 5),
                  **{f"val_{k}": round(v, 5) for k, v in mixed.items() if k != "loss"}}
        if ctx.objective.unit == "tokens":  # a perplexity is per token; DPO's loss is per pair
            record["val_ppl"] = perplexity(val_loss)
        several = len(results) > 1
        if several:
            for key in ("loss", "bpb"):
                record.update({f"val_{key}/{k}": round(r[key], 5) for k, r in results.items() if key in r})
            if "val_ppl" in record:
                record.update({f"val_ppl/{k}": perplexity(r["loss"]) for k, r in results.items()})
        record["elapsed_s"] = round(ctx.clock.elapsed(), 3)  # training seconds up to this evaluation
        ctx.logger.log(record)
        notes = [f"ppl {record['val_ppl']:.2f}"] if "val_ppl" in record else []
        each_ppl = lambda k: f" (ppl {record[f'val_ppl/{k}']:.2f})" if f"val_ppl/{k}" in record else ""  # noqa: E731
        notes += [f"{k} {r['loss']:.4f}{each_ppl(k)}" for k, r in results.items()] if several else []
        each_bpb = [f"{k} {r['bpb']:.4f}" for k, r in results.items() if "bpb" in r] if several else []
        extra = "".join(f", {k} {v:.4f}" + (f" ({', '.join(each_bpb)})" if k == "bpb" and each_bpb else "")
                        for k, v in mixed.items() if k != "loss")
        ctx.logger.message(f"step {step}: val_loss {val_loss:.4f}" + (f" ({', '.join(notes)})" if notes else "")
                           + extra)
        return Report({"val_loss": val_loss})
