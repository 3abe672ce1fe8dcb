"""Samples and probes: at every evaluation, rank 0 continues the --sample_prompts (same sampling settings and seed
every time, so the change between evaluations is the model's) and scores the --probes, into samples.jsonl and
probes.jsonl.

A forward on rank 0 alone: with weights sharded across ranks it would need every rank (not possible yet).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from model.generate import generate
from model.probes import run_probes

from .base import Component, every

if TYPE_CHECKING:
    from ..loop import Trainer


class SamplesAndProbes(Component):
    pauses_clock = True

    def __init__(self, trainer: Trainer) -> None:
        s = trainer.session
        self.interval = trainer.config.eval.eval_interval
        self.on = trainer.backend.is_main and bool(s.samples or s.probes)

    def due(self, step: int, last: int) -> bool:
        return self.on and every(self.interval, step, last)

    @torch.no_grad()
    def run(self, trainer: Trainer) -> None:
        s, model, logger, step = trainer.session, trainer.model, trainer.logger, trainer.state.step
        tok, chat = s.tokenizer, s.chat
        eos = tok.stop_ids(chat)
        prompt_ids = lambda text: tok.prompt_ids(text, chat)  # noqa: E731
        model.eval()
        if s.samples:
            new = generate(model, [prompt_ids(p.prompt) for p in s.samples],
                           max_new_tokens=s.config.eval.sample_tokens, temperature=0.8, top_p=0.95,
                           repetition_penalty=1.1, eos_token_ids=eos, pad_token_id=tok.pad_id,
                           generator=torch.Generator(trainer.device).manual_seed(s.config.optim.seed))
            rows = [{"prompt": p.prompt, "text": tok.decode(ids)} for p, ids in zip(s.samples, new)]
            logger.log_rows("samples", step, rows)
            for row in rows:
                logger.message(f"step {step} sample: {row['prompt']} | {row['text'][:100]!r}")
        if s.probes:
            results = run_probes(model, s.probes, prompt_ids, tok.encode, tok.decode, chat, eos, tok.pad_id)
            logger.log_rows("probes", step, [vars(r) for r in results])
            correct = sum(r.correct for r in results)
            mean_logprob = sum(r.logprob for r in results) / len(results)
            logger.log({"step": step, "probes_correct": correct / len(results),
                        "probes_logprob": round(mean_logprob, 4)})
            logger.message(f"step {step} probes: {correct}/{len(results)} correct, mean answer logprob "
                           f"{mean_logprob:.3f}, first-token ranks {[r.rank for r in results]}")
        model.train()
