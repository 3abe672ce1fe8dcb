"""Rollouts for reinforcement learning: sample a group of completions per prompt from the current policy, in one
batched, KV-cached generation (model/generate.py), and lay them out for the policy loss.

Each prompt is repeated `group` times (its group: consecutive rows, as trainer_utils/rewards.py's advantages
expect). A completion ends at a stop token, which it keeps (the policy learns to stop), or at the budget
(`truncated`). The training rows hold a group's prompt once and then its completions (pack_rollouts), each
completion seeing the prompt and itself under an attention mask, at its own positions: what a row of prompt +
completion per rollout computes, without computing the prompt once per rollout. Targets are the completions'
tokens only (IGNORE_INDEX over the prompt and the padding), with the sampling policy's log-probability of each
(for the importance ratio), as the sampler computed it while drawing: no second forward, and the ratio then
measures what differs between the sampler's arithmetic and the trained forward's (a KV-cached decode against a
full forward, in the training precision). The rows are padded to a multiple of SHAPE_STEP tokens (objectives.py
says why).

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
from evaluation.tool_use import assistant_message
from model.generate import generate
from model.model import shared_context_mask

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
    """A step's sampled completions (prompts x group of them, prompt-major) and their training rows, packed: a
    row holds a prompt once and then its completions (module docstring)."""

    inputs: torch.Tensor  # (R, L) packed rows: the prompt but its last token, then each completion's inputs
    positions: torch.Tensor  # (R, L) each input's position in its own conversation
    segment: torch.Tensor  # (R, L) 0 the prompt, j >= 1 the row's j-th completion, -1 padding
    targets: torch.Tensor  # (R, L) the next token where the policy sampled it, else IGNORE_INDEX
    old_log_probs: torch.Tensor  # (R, L) the sampler's log-probability of each target (0 elsewhere)
    members: torch.Tensor  # (R, L) the completion (its index below) each segment's input belongs to, else -1
    completions: list[list[int]]  # each completion's ids after its prompt, its stop token included
    truncated: list[bool]  # the budget ended it, not a stop token
    prompt_rows: list[int]  # the prompt each completion continues (its index in the prompts given)

    @property
    def attention(self) -> torch.Tensor:
        """The rows' (R, 1, L, L) attention mask: a completion sees its prompt and itself, never another."""
        return shared_context_mask(self.segment)

    def per_token(self, values: torch.Tensor) -> torch.Tensor:
        """One value per completion (an advantage), laid out as the rows: (R, L), 0 outside the completions."""
        spread = values.to(self.members.device)[self.members.clamp(min=0)]
        return torch.where(self.members >= 0, spread, torch.zeros((), dtype=spread.dtype, device=spread.device))

    def policy_batch(self, advantages: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The rows as objectives.PolicyGradient takes them, with each completion's advantage."""
        return (self.inputs, self.targets, self.old_log_probs, self.per_token(advantages), self.positions,
                self.attention)

    def one_row_each(self, advantages: torch.Tensor, pad_id: int) -> tuple[torch.Tensor | None, ...]:
        """The same policy batch without packing, one right-padded row per completion, its prompt included: what
        the packed rows are tested and benchmarked against (bench/bench_rollouts.py times the loss on both)."""
        rows = [self.unpacked(i) for i in range(len(self.completions))]
        width = shape_width(max(len(inputs) for inputs, _, _ in rows))
        inputs, targets = torch.full((len(rows), width), pad_id), torch.full((len(rows), width), IGNORE_INDEX)
        old = torch.zeros((len(rows), width))
        for r, row in enumerate(rows):
            for tensor, values in zip((inputs, targets, old), row):
                tensor[r, :len(values)] = torch.tensor(values)
        device = self.inputs.device
        return (inputs.to(device), targets.to(device), old.to(device),
                advantages.to(device)[:, None].expand(len(rows), width), None, None)

    def only(self, prompts: Sequence[int]) -> Rollouts:
        """The training rows of these prompts' groups alone (a packed row holds one prompt's rollouts; a row whose
        rollouts all ended before a token is left out too); the completions' own fields stay whole, so advantages
        are still given per completion."""
        kept = set(prompts)
        # any completion of a row names its prompt (-1: a row with none)
        rows = [r for r, i in enumerate(self.members.amax(dim=1).tolist()) if i >= 0 and self.prompt_rows[i] in kept]
        if not rows:
            raise ValueError("no rows left: keep at least one prompt with a rollout")
        index = torch.tensor(rows, device=self.inputs.device)
        width = shape_width(int((self.segment[index] >= 0).sum(dim=1).max()))
        pick = lambda t: t[index, :width]  # noqa: E731
        return Rollouts(pick(self.inputs), pick(self.positions), pick(self.segment), pick(self.targets),
                        pick(self.old_log_probs), pick(self.members), self.completions, self.truncated,
                        self.prompt_rows)

    def unpacked(self, i: int) -> tuple[list[int], list[int], list[float]]:
        """Completion i as a row of its own would hold it: (inputs, targets, old log-probabilities), its prompt
        and everything it continued with but the last token."""
        r = int((self.members == i).any(dim=1).nonzero()[0])
        prompt, own = self.segment[r] == 0, self.members[r] == i
        pick = lambda t: t[r][prompt].tolist() + t[r][own].tolist()  # noqa: E731
        return pick(self.inputs), pick(self.targets), pick(self.old_log_probs)


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
    return pack_rollouts(prompts, rows, [Row(list(c), [True] * len(c), lp)
                                         for c, lp in zip(completions, sampled_log_probs)],
                         truncated, pad_id, device)


@dataclass
class Row:
    """What one rollout added after its prompt, token by token: which tokens the policy sampled (the targets)
    and their log-probabilities under the sampler (0 elsewhere: a tool's result and the template's markers
    around it)."""

    ids: list[int]
    policy: list[bool]
    log_probs: list[float]


# A packed row's attention is dense over its length (a mask, not the causal kernel): a group whose prompt and
# completions would pass this many tokens is split over rows, each holding the prompt again.
PACK_TOKENS = 2048


def pack_rollouts(prompts: Sequence[Sequence[int]], owner: Sequence[int], rows: Sequence[Row],
                  truncated: list[bool], pad_id: int, device: torch.device) -> Rollouts:
    """The training rows of rollouts (row i continues prompts[owner[i]]; a group's rollouts are consecutive),
    packed: a row holds a prompt's tokens but its last once, then, for each of its rollouts, that last token
    and everything the rollout added but its last token, so every rollout predicts its tokens from its own copy
    of the prompt's last position. Positions go on from the prompt in each rollout; a rollout sees the prompt and
    itself (Rollouts.attention). A group's prompt is computed once in training instead of once per rollout: with
    the tool prompts' 350 tokens of tool schemas and 8 rollouts of ~120 tokens, a third of the tokens. Rows are
    right-padded to a multiple of SHAPE_STEP (objectives.py says why)."""
    packs: list[tuple[int, list[int]]] = []  # (prompt, the rollouts in the row)
    for i, p in enumerate(owner):
        if packs and packs[-1][0] == p and packed_length(prompts, rows, p, [*packs[-1][1], i]) <= PACK_TOKENS:
            packs[-1][1].append(i)
        else:
            packs.append((p, [i]))
    width = shape_width(max(packed_length(prompts, rows, p, members) for p, members in packs))
    shape = (len(packs), width)
    inputs, positions = torch.full(shape, pad_id, dtype=torch.long), torch.zeros(shape, dtype=torch.long)
    segment, members = torch.full(shape, -1, dtype=torch.long), torch.full(shape, -1, dtype=torch.long)
    targets, old = torch.full(shape, IGNORE_INDEX, dtype=torch.long), torch.zeros(shape, dtype=torch.float32)
    for r, (p, rollouts) in enumerate(packs):
        prompt = list(prompts[p])
        n = len(prompt) - 1
        inputs[r, :n], positions[r, :n], segment[r, :n] = torch.tensor(prompt[:-1], dtype=torch.long), \
            torch.arange(n), 0
        at = n
        for j, i in enumerate(rollouts, start=1):
            row, m = rows[i], len(rows[i].ids)
            if not m:
                continue
            span = slice(at, at + m)
            inputs[r, span] = torch.tensor([prompt[-1], *row.ids[:-1]], dtype=torch.long)
            positions[r, span], segment[r, span], members[r, span] = torch.arange(n, n + m), j, i
            targets[r, span] = torch.where(torch.tensor(row.policy), torch.tensor(row.ids), IGNORE_INDEX)
            old[r, span] = torch.tensor(row.log_probs, dtype=torch.float32)
            at += m
    completions = [row.ids for row in rows]
    return Rollouts(inputs.to(device), positions.to(device), segment.to(device), targets.to(device),
                    old.to(device), members.to(device), completions, truncated, list(owner))


def shape_width(length: int) -> int:
    """A row's width for `length` tokens: the next multiple of SHAPE_STEP (objectives.py says why)."""
    return -(-length // SHAPE_STEP) * SHAPE_STEP


def packed_length(prompts: Sequence[Sequence[int]], rows: Sequence[Row], prompt: int, members: list[int]) -> int:
    """Tokens of a packed row: the prompt but its last token, then each rollout's own length."""
    return len(prompts[prompt]) - 1 + sum(len(rows[i].ids) for i in members)


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
    `capped`), and a rollout stops when its tools' results or its next reply might not fit in `max_len` tokens
    (`overflow`): no row is ever longer than max_len.

    The tokens are appended as sampled, never re-encoded, so the training row is exactly what the policy saw.
    Only the replies' tokens are targets (their end-of-turn included); the prompt, the results and the template's
    markers around them are not. Row r, round k draws its tokens with key (*row_keys[r], k): a rollout is the same
    whatever batch or round-mate it is decoded with, so a resume or a DDP run samples what one process does."""
    device = next(model.parameters()).device
    owner = [i for i in range(len(prompts)) for _ in range(group)]
    if row_keys is not None and len(row_keys) != len(owner):
        raise ValueError(f"{len(row_keys)} row keys for {len(owner)} rows")
    rows = [Row([], [], []) for _ in owner]  # what each rollout adds after its prompt
    uses, finals = [ToolUse() for _ in owner], [""] * len(owner)
    stop_ids = codec.stop_ids(True)
    stops = torch.tensor(stop_ids, device=device)
    active = list(range(len(owner)))

    def overflows(r: int, more: int) -> bool:  # whether rollout r's row would pass max_len with `more` tokens
        return len(prompts[owner[r]]) + len(rows[r].ids) + more > max_len

    for round_ in range(max_rounds + 1):
        for r in active:
            uses[r].overflow = overflows(r, max_new_tokens)
        active = [r for r in active if not uses[r].overflow]
        if not active:
            break
        uniforms = (keyed_uniforms([(*row_keys[r], round_) for r in active], max_new_tokens, device)
                    if row_keys is not None else None)
        log_probs: list[list[float]] = []
        with autocast():
            replies = generate(model, [[*prompts[owner[r]], *rows[r].ids] for r in active], max_new_tokens,
                               temperature=temperature, pad_token_id=codec.pad_id,
                               stop=lambda t, a: torch.isin(t, stops) & a, uniforms=uniforms, log_probs=log_probs)
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
            observed = codec.tool_results(messages)
            if overflows(r, len(observed)):
                use.overflow = True  # the results do not fit: the row stays within max_len, unanswered
                continue
            use.turns += messages
            row.ids += observed
            row.policy += [False] * len(observed)
            row.log_probs += [0.0] * len(observed)
            going.append(r)
        active = going
    packed = pack_rollouts(prompts, owner, rows, [u.cut for u in uses], codec.pad_id, device)
    return ToolRollouts(packed, uses, finals, [sum(row.policy) for row in rows])
