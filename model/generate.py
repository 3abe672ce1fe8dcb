"""Autoregressive generation: logits filters with Hugging Face semantics and a KV-cached decode loop."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

import torch

from common.config import option

from .model import KVCache, PocketLM


@dataclass
class SamplingConfig:
    """How tokens are drawn: the settings of `generate` that a user chooses (transformers semantics)."""

    title: ClassVar[str] = "sampling"
    temperature: float = option(0.7, "softmax temperature; 0 = greedy", at_least=0)
    top_k: int = option(0, "keep the k most likely tokens; 0 = off", at_least=0)
    top_p: float = option(0.9, "keep the smallest set of tokens with this much probability", above=0, at_most=1)
    repetition_penalty: float = option(1.1, "penalise tokens already in the text (1 = off)", above=0)
    max_new_tokens: int = option(256, "tokens to generate at most", at_least=1)
    seed: int | None = option(None, "seed of the sampling (default: unseeded)")

NEG_INF = float("-inf")


# ------------------------------------------------------------------------ logits filters
# Each takes float logits of shape (B, V) and returns new logits; the order in sample_next is the one
# transformers uses: repetition penalty, then temperature, top-k, top-p.
def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty on tokens already in the sequence (`seen`, a (B, V) bool mask).

    Positive logits are divided by the penalty and negative ones multiplied, so both become less likely.
    """
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits per row (ties with the k-th are kept too); k <= 0 disables."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, NEG_INF)


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose probability reaches p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative <= 1.0 - p  # the low tail whose mass stays within 1 - p
    drop_sorted[..., -1] = False  # always keep the most likely token
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, NEG_INF)


def sample_next(logits: torch.Tensor, seen: torch.Tensor | None = None, temperature: float = 1.0,
                top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0,
                generator: torch.Generator | None = None, uniform: torch.Tensor | None = None) -> torch.Tensor:
    """Pick one token per row from (B, V) logits. temperature == 0 means greedy (argmax). `uniform`: (B, 1)
    numbers in [0, 1) to draw with instead of the generator's (see draw)."""
    if temperature < 0 or not 0.0 < top_p <= 1.0 or repetition_penalty <= 0:
        raise ValueError(f"need temperature >= 0, 0 < top_p <= 1, repetition_penalty > 0; got "
                         f"{temperature}, {top_p}, {repetition_penalty}")
    logits = logits.float()
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, repetition_penalty)
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = apply_top_p(apply_top_k(logits / temperature, top_k), top_p)
    return draw(logits.softmax(dim=-1), generator, uniform)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None,
         uniform: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of (B, V) probabilities, by inverse transform: one uniform number per row against the
    row's cumulative sum. torch.multinomial draws an exponential number per vocabulary entry (B x V of them), a
    quarter of a batched rollout's time on a CPU. A token of probability 0 is never drawn: its cumulative sum
    equals its predecessor's, so no draw lands in it. Probabilities that are not finite (a NaN from a broken
    temperature, say) raise RuntimeError on the CPU, where checking costs no device sync, as multinomial did;
    on an accelerator such a row draws an arbitrary token rather than halting the device. `uniform` (B, 1), when
    given, are the numbers drawn with: a row's token then depends on that row alone, not on its batch."""
    cdf = probs.cumsum(dim=-1)
    if probs.device.type == "cpu" and not bool(torch.isfinite(cdf[:, -1]).all()):
        raise RuntimeError("probability tensor contains inf or nan")
    u = uniform.to(cdf.dtype) if uniform is not None else torch.rand((probs.shape[0], 1), generator=generator,
                                                                      device=probs.device, dtype=cdf.dtype)
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]
    # rounding may put u * total at the total itself, past the last token: take the likeliest instead
    return torch.where(picked < probs.shape[-1], picked, probs.argmax(dim=-1))


# ------------------------------------------------------------------------------- decode
def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int,
             device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-align prompts of different lengths: (ids, attention_mask), both (B, longest)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def done_check_interval(device: torch.device) -> int:
    """Decoded tokens between host reads of "every row is done". A read waits for the GPU, so on CUDA the loop
    reads every 16 tokens (finished rows emit masked padding meanwhile) and keeps queueing work; on the CPU a
    read costs nothing."""
    return 1 if device.type == "cpu" else 16


def tokens_seen(ids: torch.Tensor, pad_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, vocab_size) bool: the tokens each left-padded prompt holds (the repetition penalty's), pads left out."""
    seen = torch.zeros((ids.shape[0], vocab_size + 1), dtype=torch.bool, device=ids.device)  # the last: pads
    seen.scatter_(1, ids.masked_fill(pad_mask == 0, vocab_size), True)
    return seen[:, :-1]


@torch.no_grad()  # never a graph: the KV cache, written in place, would hold one alive after the call
def generate(model: PocketLM, prompts: Sequence[Sequence[int]], max_new_tokens: int = 128,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0,
             eos_token_ids: Sequence[int] = (), pad_token_id: int = 0,
             on_token: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
             generator: torch.Generator | None = None, use_cache: bool = True,
             stop: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
             uniforms: torch.Tensor | None = None, log_probs: list[list[float]] | None = None) -> list[list[int]]:
    """Continue each prompt (a list of token ids) by up to max_new_tokens; return the new ids per prompt.

    Prompts are left-padded into one batch with per-row positions, so each row decodes exactly as it would
    alone. A row stops at its first EOS id (not included in the result). on_token(tokens, active) is called
    after every step with the (B,) sampled ids and a (B,) bool mask of rows that produced a real token;
    stop(tokens, active), when given, after it returns a (B,) bool mask of rows to finish there (their token
    kept), e.g. StopStrings.
    uniforms (B, max_new_tokens), when given, are the numbers row b draws its n-th token with (instead of the
    generator's): each row's sample is then a function of its own numbers, whatever batch it is decoded in.
    log_probs, when given a list, receives each row's log-probability of every token it produced under
    softmax(logits / temperature), the policy reinforcement learning trains (no penalty, top-k or top-p).
    use_cache=False recomputes the whole sequence each step (slow; a reference for tests and benchmarks).
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    cfg = model.config
    device = next(model.parameters()).device
    ids, pad_mask = left_pad(prompts, pad_token_id, device)
    (B, P), total = ids.shape, ids.shape[1] + max_new_tokens
    if total > cfg.max_position_embeddings:
        raise ValueError(f"prompt ({P} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_position_embeddings ({cfg.max_position_embeddings})")
    was_training = model.training
    model.eval()

    # Preallocated per-step state: padding mask over all slots, positions, repetition "seen" set.
    attention_mask = torch.ones((B, total), dtype=torch.long, device=device)
    attention_mask[:, :P] = pad_mask
    positions = (pad_mask.cumsum(-1) - 1).clamp(min=0)
    seen = tokens_seen(ids, pad_mask, cfg.vocab_size)
    eos = torch.as_tensor(list(eos_token_ids), dtype=torch.long, device=device)
    out = torch.full((B, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    done, step_log_probs = torch.zeros(B, dtype=torch.bool, device=device), []
    lengths = torch.zeros(B, dtype=torch.long, device=device)  # real tokens produced per row

    cache = KVCache(cfg, B, total, device=device, dtype=KVCache.dtype_for(model, device)) if use_cache else None
    logits = (prefill(model, ids, positions, pad_mask, cache) if use_cache else
              model(ids, position_ids=positions, attention_mask=pad_mask, last_only=True)[:, -1])
    all_ids, all_pos = ids, positions
    check_every = done_check_interval(device)
    for n in range(1, max_new_tokens + 1):
        uniform = uniforms[:, n - 1:n] if uniforms is not None else None
        token = sample_next(logits, seen, temperature, top_k, top_p, repetition_penalty, generator, uniform)
        if log_probs is not None:
            scaled = logits.float() / temperature if temperature > 0 else logits.float()
            step_log_probs.append(torch.log_softmax(scaled, dim=-1).gather(1, token[:, None])[:, 0])
        is_eos = torch.isin(token, eos) if eos.numel() else torch.zeros_like(done)
        active = ~done & ~is_eos
        token = token.masked_fill(~active, pad_token_id)
        out[:, n - 1] = token
        lengths += active
        if on_token is not None:
            on_token(token, active)
        done |= is_eos
        if stop is not None:
            done |= stop(token, active)
        if n == max_new_tokens or (n % check_every == 0 and bool(done.all())):
            break
        # seen[row, token] |= active, as a scatter: boolean-mask indexing would sync to count the rows
        column = token[:, None]
        seen.scatter_(1, column, seen.gather(1, column) | active[:, None])
        next_pos = positions[:, -1:] + n
        if not use_cache:  # the whole sequence again
            all_ids, all_pos = torch.cat([all_ids, token[:, None]], dim=1), torch.cat([all_pos, next_pos], dim=1)
        logits = model(token[:, None] if use_cache else all_ids, position_ids=next_pos if use_cache else all_pos,
                       attention_mask=attention_mask[:, :P + n], kv_cache=cache, last_only=True)[:, -1]
    model.train(was_training)

    lengths = lengths.tolist()
    if log_probs is not None:
        per_step = torch.stack(step_log_probs, dim=1).tolist() if step_log_probs else [[] for _ in lengths]
        log_probs.extend(row[:length] for row, length in zip(per_step, lengths))
    return [row[:length] for row, length in zip(out.tolist(), lengths)]


def prefill(model: PocketLM, ids: torch.Tensor, positions: torch.Tensor, pad_mask: torch.Tensor,
            cache: KVCache) -> torch.Tensor:
    """Run the left-padded prompts into the cache; return each row's last logits. Rows holding the same prompt
    (reinforcement learning samples a group of completions of each) are computed once and their keys and values
    copied to the others: the prefill of 8 copies of a 350-token prompt is most of a tool rollout's first round."""
    rows = torch.cat([ids, pad_mask], dim=1)
    unique, inverse = torch.unique(rows, dim=0, return_inverse=True)
    if unique.shape[0] == rows.shape[0]:
        return model(ids, position_ids=positions, attention_mask=pad_mask, kv_cache=cache, last_only=True)[:, -1]
    first = torch.full((unique.shape[0],), rows.shape[0], dtype=torch.long, device=ids.device)
    first.scatter_reduce_(0, inverse, torch.arange(rows.shape[0], device=ids.device), "amin")
    once = KVCache(model.config, unique.shape[0], ids.shape[1], device=ids.device, dtype=cache.k.dtype)
    logits = model(ids[first], position_ids=positions[first], attention_mask=pad_mask[first], kv_cache=once,
                   last_only=True)[:, -1]
    cache.take_rows(once, inverse)
    return logits[inverse]


class StopStrings:
    """generate()'s `stop` for stop strings (lm-evaluation-harness's `until`): after each step it decodes each
    row's new tokens so far and finishes the rows whose text holds one of their stop strings. A string may span
    tokens, so the whole text is decoded again each step (short outputs: microseconds)."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[Sequence[str]]) -> None:
        self.decode, self.stops = decode, [tuple(s) for s in stops]
        self.ids: list[list[int]] = [[] for _ in stops]

    def __call__(self, tokens: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        hit = [False] * len(self.ids)
        for row, (token, real) in enumerate(zip(tokens.tolist(), active.tolist())):
            if real and self.stops[row]:
                self.ids[row].append(token)
                text = self.decode(self.ids[row])
                hit[row] = any(s in text for s in self.stops[row])
        return torch.tensor(hit, device=tokens.device)


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """The text before the first of `stops` in it (all of it when none occurs)."""
    return text[:min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))]
