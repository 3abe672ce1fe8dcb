"""Validation: every --eval_interval steps, the loss (per token, or per pair for DPO) and the objective's metrics
on each --data_path file's validation split, over the same --eval_batches batches every time.

With several files each one's loss (and bits per byte) is logged as val_loss/<file stem>, and val_loss itself
weights them as the files are mixed in training. For a per-token loss with a byte-level tokenizer, "bpb" is the
loss in bits per UTF-8 byte of the targets. The last val_loss is left in trainer.val_loss (None when no file has
a validation split) for early stopping and the checkpoint's train_info.json.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ..data import eval_batches
from ..objectives import target_bytes
from .base import Component, every

if TYPE_CHECKING:
    from ..loop import Trainer


class Evaluation(Component):
    pauses_clock = True

    def __init__(self, trainer: Trainer) -> None:
        self.interval = trainer.config.eval.eval_interval
        self.token_bytes = trainer.session.token_bytes() if trainer.objective.unit == "tokens" else None

    def due(self, step: int, last: int) -> bool:
        return every(self.interval, step, last)

    @torch.no_grad()
    def evaluate(self, trainer: Trainer) -> dict[str, dict[str, float]]:
        """{file name: {"loss", metrics..., "bpb"}} of each validation split (empty: none)."""
        s, objective, device = trainer.session, trainer.objective, trainer.device
        val_sets, names = s.val_sets, objective.eval_metrics
        token_bytes = self.token_bytes.to(device) if self.token_bytes is not None else None
        trainer.model.eval()
        # per file: units, summed loss, the summed metrics, the targets' bytes (summed over ranks together)
        total = torch.zeros(len(val_sets), 3 + len(names), device=device, dtype=torch.float64)
        for k, v in enumerate(val_sets):
            for batch in eval_batches(v.data, s.config.optim.batch_size, s.config.eval.eval_batches,
                                      trainer.backend.rank, trainer.backend.world_size):
                batch = tuple(t.to(device) for t in batch)
                out = objective.evaluate(trainer.model, batch, trainer.precision.autocast)
                total[k, 0] += objective.count(batch)
                total[k, 1] += out.loss
                for j, name in enumerate(names):
                    total[k, 2 + j] += out.metrics[name]
                if token_bytes is not None:
                    total[k, -1] += target_bytes(batch[1], token_bytes)
        total = trainer.backend.all_reduce_sum(total).tolist() if val_sets else []
        trainer.model.train()
        results = {}
        for v, (count, loss, *metrics, n_bytes) in zip(val_sets, total):
            if count > 0:
                results[v.name] = {"loss": loss / count, **{k: x / count for k, x in zip(names, metrics)}}
                if n_bytes > 0:
                    results[v.name]["bpb"] = loss / math.log(2) / n_bytes
        return results

    def run(self, trainer: Trainer) -> None:
        results = self.evaluate(trainer)
        if not results:
            trainer.val_loss = None
            return
        s, step = trainer.session, trainer.state.step
        weights = {v.name: v.weight for v in s.val_sets if v.name in results}
        mixed = {key: sum(weights[k] * r[key] for k, r in results.items()) / sum(weights.values())
                 for key in next(iter(results.values())) if all(key in r for r in results.values())}
        val_loss = trainer.val_loss = mixed["loss"]
        record = {"step": step, "val_loss": round(val_loss, 5),
                  **{f"val_{k}": round(v, 5) for k, v in mixed.items() if k != "loss"}}
        if trainer.objective.unit == "tokens":  # a perplexity is per token; DPO's loss is per pair
            record["val_ppl"] = round(math.exp(min(val_loss, 50)), 3)  # capped: a diverged run stays finite
        several = len(s.data.sources) > 1
        if several:
            for key in ("loss", "bpb"):
                record.update({f"val_{key}/{k}": round(r[key], 5) for k, r in results.items() if key in r})
        record["elapsed_s"] = round(trainer.clock.elapsed(), 3)  # training seconds up to this evaluation
        trainer.logger.log(record)
        notes = [f"ppl {record['val_ppl']:.2f}"] if "val_ppl" in record else []
        notes += [f"{k} {r['loss']:.4f}" for k, r in results.items()] if several else []
        each_bpb = [f"{k} {r['bpb']:.4f}" for k, r in results.items() if "bpb" in r] if several else []
        extra = "".join(f", {k} {v:.4f}" + (f" ({', '.join(each_bpb)})" if k == "bpb" and each_bpb else "")
                        for k, v in mixed.items() if k != "loss")
        trainer.logger.message(f"step {step}: val_loss {val_loss:.4f}" + (f" ({', '.join(notes)})" if notes else "")
                               + extra)
