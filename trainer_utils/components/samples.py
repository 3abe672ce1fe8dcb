"""Samples and probes: at every evaluation, rank 0 continues the --sample_prompts (same sampling settings and seed
every time, so the change between evaluations is the model's) and scores the --probes, into samples.jsonl and
probes.jsonl.

A forward on rank 0 alone: with weights sharded across ranks it would need every rank (not possible yet).
"""
from __future__ import annotations

import torch

from evaluation.probes import run_probes
from model.generate import generate

from ..context import RunContext, every
from .base import Component


class SamplesAndProbes(Component):
    pauses_clock = True

    def __init__(self, ctx: RunContext) -> None:
        self.interval = ctx.config.eval.eval_interval
        self.on = ctx.backend.is_main and bool(ctx.samples or ctx.probes)

    def due(self, step: int, last: int) -> bool:
        return self.on and every(self.interval, step, last)

    @torch.no_grad()
    def run(self, ctx: RunContext) -> None:
        model, logger, step = ctx.model, ctx.logger, ctx.state.step
        tok, chat = ctx.tokenizer, ctx.chat
        eos = tok.stop_ids(chat)
        prompt_ids = lambda text: tok.prompt_ids(text, chat)  # noqa: E731
        model.eval()
        if ctx.samples:
            new = generate(model, [prompt_ids(p.prompt) for p in ctx.samples],
                           max_new_tokens=ctx.config.eval.sample_tokens, temperature=0.8, top_p=0.95,
                           repetition_penalty=1.1, eos_token_ids=eos, pad_token_id=tok.pad_id,
                           generator=torch.Generator(ctx.device).manual_seed(ctx.config.optim.seed))
            rows = [{"prompt": p.prompt, "text": tok.decode(ids)} for p, ids in zip(ctx.samples, new)]
            logger.log_rows("samples", step, rows)
            for row in rows:
                logger.message(f"step {step} sample: {row['prompt']} | {row['text'][:100]!r}")
        if ctx.probes:
            results = run_probes(model, ctx.probes, prompt_ids, tok.encode, tok.decode, chat, eos, tok.pad_id)
            logger.log_rows("probes", step, [vars(r) for r in results])
            correct = sum(r.correct for r in results)
            mean_logprob = sum(r.logprob for r in results) / len(results)
            logger.log({"step": step, "probes_correct": correct / len(results),
                        "probes_logprob": round(mean_logprob, 4)})
            logger.message(f"step {step} probes: {correct}/{len(results)} correct, mean answer logprob "
                           f"{mean_logprob:.3f}, first-token ranks {[r.rank for r in results]}")
        model.train()
