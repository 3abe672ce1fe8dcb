"""Rollouts for reinforcement learning: sample a group of completions per prompt from the current policy, in one
batched, KV-cached generation (model/generate.py), and lay them out for the policy loss.

Each prompt is repeated `group` times (its group: consecutive rows, as trainer_utils/rewards.py's advantages
expect). A completion ends at a stop token, which it keeps (the policy learns to stop), or at the budget
(`truncated`). The training rows are prompt + completion, right-padded: inputs all but the last token, targets
the completion's tokens only (IGNORE_INDEX over the prompt and the padding), and the sampling policy's
log-probability of each target (for the importance ratio), as the sampler computed it while drawing: no second
forward, and the ratio then measures what differs between the sampler's arithmetic and the trained forward's
(a KV-cached decode against a full forward, in the training precision). The rows are padded to a multiple of
SHAPE_STEP tokens (objectives.py says why).

Rows may be given keys: row r's random numbers are then seeded by its key alone, so its completion depends on
(key, weights, prompt), never on the batch it was decoded in or on a global generator's state. The GRPO stage
keys each row by (seed, step, prompt index, member of the group): a resumed run samples what the uninterrupted
one did, and ranks of a DDP run sample what one process does.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from common.tokens import IGNORE_INDEX
from model.generate import generate

from .objectives import SHAPE_STEP, Autocast


def keyed_uniforms(keys: Sequence[Sequence[int]], count: int, device: torch.device | str) -> torch.Tensor:
    """(len(keys), count) numbers in [0, 1), each row seeded by its key (numpy's SeedSequence hashes it)."""
    rows = [np.random.default_rng(list(key)).random(count) for key in keys]
    return torch.from_numpy(np.stack(rows) if rows else np.zeros((0, count))).to(device)


@dataclass
class Rollouts:
    """A step's sampled completions (rows = prompts x group) and their training rows."""

    inputs: torch.Tensor  # (N, L) prompt + completion but the last token, right-padded
    targets: torch.Tensor  # (N, L) the completion's tokens where they are predicted, else IGNORE_INDEX
    old_log_probs: torch.Tensor  # (N, L) the sampler's log-probability of each target (0 elsewhere)
    completions: list[list[int]]  # each row's completion ids, its stop token included
    truncated: list[bool]  # the budget ended it, not a stop token
    prompt_rows: list[int]  # the prompt each row continues (its index in the prompts given)


@torch.no_grad()
def sample_rollouts(model: torch.nn.Module, prompts: Sequence[Sequence[int]], group: int, max_new_tokens: int,
                    stop_ids: Sequence[int], pad_id: int, temperature: float = 1.0, top_p: float = 1.0,
                    top_k: int = 0, autocast: Autocast = contextlib.nullcontext,
                    generator: torch.Generator | None = None, row_keys: Sequence[Sequence[int]] | None = None
                    ) -> Rollouts:
    """`group` completions of each prompt (token ids), sampled together; see the module docstring. row_keys: one
    key per row (prompt-major), instead of the generator."""
    device = next(model.parameters()).device
    rows = [i for i in range(len(prompts)) for _ in range(group)]
    stops = torch.tensor(list(stop_ids), device=device)

    def ends(tokens: torch.Tensor, active: torch.Tensor) -> torch.Tensor:  # a stop token ends its row, kept
        return torch.isin(tokens, stops) & active

    if row_keys is not None and len(row_keys) != len(rows):
        raise ValueError(f"{len(row_keys)} row keys for {len(rows)} rows")
    uniforms = keyed_uniforms(row_keys, max_new_tokens, device) if row_keys is not None else None
    sampled_log_probs: list[list[float]] = []
    with autocast():
        completions = generate(model, [prompts[i] for i in rows], max_new_tokens, temperature=temperature,
                               top_k=top_k, top_p=top_p, pad_token_id=pad_id, stop=ends, generator=generator,
                               uniforms=uniforms, log_probs=sampled_log_probs)
    truncated = [not c or c[-1] not in stop_ids for c in completions]
    width = max(len(prompts[i]) + len(c) for i, c in zip(rows, completions)) - 1
    width = -(-width // SHAPE_STEP) * SHAPE_STEP
    inputs = torch.full((len(rows), width), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    old = torch.zeros((len(rows), width), dtype=torch.float32)
    for r, (i, c) in enumerate(zip(rows, completions)):
        sequence = torch.tensor([*prompts[i], *c], dtype=torch.long)
        n, p = len(sequence) - 1, len(prompts[i])
        inputs[r, :n] = sequence[:-1]
        targets[r, p - 1:n] = sequence[p:]
        old[r, p - 1:n] = torch.tensor(sampled_log_probs[r], dtype=torch.float32)
    return Rollouts(inputs.to(device), targets.to(device), old.to(device), completions, truncated, rows)
