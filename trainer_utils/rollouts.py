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
import json
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from common.tokens import IGNORE_INDEX
from common.tool_calls import parse_reply
from common.tools import Tool, run_tool
from model.generate import generate
from model.tool_use import assistant_message

from .objectives import SHAPE_STEP, Autocast
from .rewards import ToolUse


class ToolCodec(Protocol):
    """What a rollout with tools needs of the tokenizer (dataset/tokenizer.py Tokenizer)."""

    pad_id: int
    im_end_id: int  # the end of a turn: a reply that calls ends with it before the results come back

    def stop_ids(self, chat: bool) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...

    def tool_results(self, messages: list[dict[str, Any]]) -> list[int]:
        """The ids the chat template writes after a reply's end-of-turn for these tool messages, up to and
        including the next assistant header."""


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
    inputs, targets, old = training_rows([Row([*prompts[i], *c], [False] * len(prompts[i]) + [True] * len(c),
                                              [0.0] * len(prompts[i]) + lp)
                                          for i, c, lp in zip(rows, completions, sampled_log_probs)], pad_id, device)
    return Rollouts(inputs, targets, old, completions, truncated, rows)


@dataclass
class Row:
    """One rollout as a token sequence: which tokens the policy sampled (the targets) and their log-probabilities
    under the sampler (0 elsewhere: the prompt, a tool's result and the template's markers around it)."""

    ids: list[int]
    policy: list[bool]
    log_probs: list[float]


def training_rows(rows: Sequence[Row], pad_id: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets, the sampler's log-probabilities) of rows, right-padded to a multiple of SHAPE_STEP: inputs
    all but a row's last token; targets its next tokens where the policy sampled them, IGNORE_INDEX elsewhere."""
    width = max(len(row.ids) for row in rows) - 1
    width = -(-width // SHAPE_STEP) * SHAPE_STEP
    inputs = torch.full((len(rows), width), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    old = torch.zeros((len(rows), width), dtype=torch.float32)
    for r, row in enumerate(rows):
        sequence, n = torch.tensor(row.ids, dtype=torch.long), len(row.ids) - 1
        inputs[r, :n] = sequence[:-1]
        targets[r, :n] = torch.where(torch.tensor(row.policy[1:]), sequence[1:], IGNORE_INDEX)
        old[r, :n] = torch.tensor(row.log_probs[1:], dtype=torch.float32)
    return inputs.to(device), targets.to(device), old.to(device)


@dataclass
class ToolRollouts:
    """A step's rollouts with tools (rows = prompts x group): the training rows, and what each rollout did."""

    rows: Rollouts  # completions: each row's ids after its prompt (replies, results and markers); truncated: cut
    uses: list[ToolUse]
    finals: list[str]  # each rollout's final answer ("" when it ended without one)
    policy_tokens: list[int]  # the tokens each rollout's replies sampled


@torch.no_grad()
def sample_tool_rollouts(model: torch.nn.Module, prompts: Sequence[Sequence[int]], group: int, max_new_tokens: int,
                         max_rounds: int, max_len: int, codec: ToolCodec, tools: Sequence[dict[str, Tool]],
                         temperature: float = 1.0, autocast: Autocast = contextlib.nullcontext,
                         row_keys: Sequence[Sequence[int]] | None = None) -> ToolRollouts:
    """`group` rollouts of each prompt that may call tools: each round, every rollout still going generates its
    next reply (one batched, KV-cached generation for all of them, up to max_new_tokens each); a reply that ends its
    turn with well-formed calls has them run by `tools[prompt]` (the tools its prompt offers: common/tools.py, the
    model's text never evaluated), their results appended as the template writes them, and goes on; any other
    reply ends its rollout. At most `max_rounds` rounds of calls run (a reply still calling after them is
    `capped`), and a rollout stops when its next reply might not fit in `max_len` tokens (`overflow`).

    The tokens are appended as sampled, never re-encoded, so the training row is exactly what the policy saw.
    Only the replies' tokens are targets (their end-of-turn included); the prompt, the results and the template's
    markers around them are not. Row r, round k draws its tokens with key (*row_keys[r], k): a rollout is the same
    whatever batch or round-mate it is decoded with, so a resume or a DDP run samples what one process does."""
    device = next(model.parameters()).device
    owner = [i for i in range(len(prompts)) for _ in range(group)]
    if row_keys is not None and len(row_keys) != len(owner):
        raise ValueError(f"{len(row_keys)} row keys for {len(owner)} rows")
    rows = [Row(list(prompts[i]), [False] * len(prompts[i]), [0.0] * len(prompts[i])) for i in owner]
    uses, finals = [ToolUse() for _ in owner], [""] * len(owner)
    stop_ids = codec.stop_ids(True)
    stops = torch.tensor(stop_ids, device=device)
    active = list(range(len(owner)))
    for round_ in range(max_rounds + 1):
        for r in active:
            uses[r].overflow = len(rows[r].ids) + max_new_tokens > max_len
        active = [r for r in active if not uses[r].overflow]
        if not active:
            break
        uniforms = (keyed_uniforms([(*row_keys[r], round_) for r in active], max_new_tokens, device)
                    if row_keys is not None else None)
        log_probs: list[list[float]] = []
        with autocast():
            replies = generate(model, [rows[r].ids for r in active], max_new_tokens, temperature=temperature,
                               pad_token_id=codec.pad_id, stop=lambda t, a: torch.isin(t, stops) & a,
                               uniforms=uniforms, log_probs=log_probs)
        going = []
        for r, new, lp in zip(active, replies, log_probs):
            row, use = rows[r], uses[r]
            row.ids += new
            row.policy += [True] * len(new)
            row.log_probs += lp
            reply = parse_reply(codec.decode(new, skip_special_tokens=True))
            use.turns.append(assistant_message(reply))
            use.malformed += len(reply.malformed)
            use.cut = not new or new[-1] not in stop_ids
            if use.cut or not reply.calls:
                finals[r] = "" if use.cut else reply.content
                continue
            if round_ == max_rounds or new[-1] != codec.im_end_id:
                use.capped = True  # calls left unrun: no answer (an end of text instead of a turn's end, too)
                continue
            results = [run_tool(call, tools[owner[r]]) for call in reply.calls]
            use.calls += len(results)
            use.errors += sum("error" in json.loads(result) for result in results)
            messages = [{"role": "tool", "content": result} for result in results]
            use.turns += messages
            observed = codec.tool_results(messages)
            row.ids += observed
            row.policy += [False] * len(observed)
            row.log_probs += [0.0] * len(observed)
            going.append(r)
        active = going
    inputs, targets, old = training_rows(rows, codec.pad_id, device)
    completions = [row.ids[len(prompts[i]):] for row, i in zip(rows, owner)]
    policy_tokens = [sum(row.policy) for row in rows]
    return ToolRollouts(Rollouts(inputs, targets, old, completions, [u.cut for u in uses], owner), uses, finals,
                        policy_tokens)
