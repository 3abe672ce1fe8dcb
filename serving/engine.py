"""Continuous batching: one decode loop owns the model and decodes every request in flight together.

Cache layout. A SlotCache has one row (slot) per sequence being decoded and one write column (`length`) shared
by all rows, like model.generate's left-padded cache. The busy rows are always rows 0..n-1, so a step runs the
model on exactly the n sequences in flight. A row holds its sequence right-aligned to the write column: columns
[start, length) are its tokens, everything left of `start` is masked. Keys are cached after RoPE, at their own
positions, so a key is correct in whatever column it sits: only the order of columns (causality) and the mask
matter, and the next token of a row is at position `length - start`.

Admission. Between two steps, the waiting requests that fit in the free rows are prefilled together (a
left-padded batch in a scratch cache: exactly model.generate's prefill) and their keys/values copied into free
rows, right-aligned to the write column; a prompt longer than the write column first shifts the busy rows right.
A request with n > 1 choices is prefilled once and copied into n rows.

Retirement. A finished (or cancelled) row is overwritten by the last busy row, so busy rows stay contiguous.

Room. When the write column reaches the end of the cache, the columns no busy row uses (left of the smallest
`start`) are cut off, or, when that would free little, the cache doubles, up to max_model_len. A sequence never
needs more than max_model_len columns (prompt + max_tokens <= max_model_len is checked on submission), so at
max_model_len the cut always frees a column. The cache starts small: memory follows the longest sequences
actually in flight, not max_batch_size x max_model_len. Columns are also cut when more than half of them are
unused by every busy row (a long request retired), so the short ones do not attend over dead padding.

Sampling is per sequence (model.generate.sample_next on its own logits row with its own settings, torch.Generator,
repetition-penalty set and stop ids), so a request with a seed draws the same tokens alone or batched, and a
greedy one gives exactly model.generate's tokens.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence, Union

import torch

from model.config import ModelConfig
from model.generate import left_pad, sample_next
from model.inference import StreamDecoder
from model.model import KVCache, PocketLM

logger = logging.getLogger("pocketlm.serving")
FIRST_CACHE_LEN = 256  # columns of the first allocation; the cache doubles from there as sequences need


# ------------------------------------------------------------------------------ requests
@dataclass(frozen=True)
class SamplingParams:
    """One request's decoding settings, with model.generate's (transformers') semantics; temperature 0 = greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None  # choice i draws from torch.Generator().manual_seed(seed + i); None: unseeded
    stop: tuple[str, ...] = ()  # strings that end a choice (cut from its text)
    stop_ids: tuple[int, ...] = ()  # token ids that end a choice (not part of its text)


@dataclass(frozen=True)
class TextDelta:
    """New text of choice `index` (whole characters; never the start of a possible stop string)."""

    index: int
    text: str


@dataclass(frozen=True)
class ChoiceEnd:
    """Choice `index` ended: "stop" (a stop id or string) or "length" (max_tokens); `tokens` it sampled."""

    index: int
    finish_reason: str
    tokens: int


@dataclass(frozen=True)
class RequestEnd:
    """Every choice of the request ended; token counts for the usage report (the prompt counted once)."""

    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class RequestError:
    """The request failed inside the engine (or the engine stopped); no more events follow."""

    message: str


Event = Union[TextDelta, ChoiceEnd, RequestEnd, RequestError]


class QueueFull(RuntimeError):
    """Every row is busy and max_queue requests already wait: try again later."""


class Request:
    """A prompt to continue n times. The engine reports progress by calling sink(event) from its own thread."""

    def __init__(self, prompt: Sequence[int], params: SamplingParams, n: int, sink: Callable[[Event], None]) -> None:
        self.prompt = list(prompt)
        self.params = params
        self.n = n
        self.sink = sink
        self.cancelled = False
        self.finished = False
        self.open = n  # choices still decoding
        self.completion_tokens = 0


class TextStream:
    """Turns one choice's tokens into text deltas: whole UTF-8 characters (model.inference.StreamDecoder), cut
    at the first stop string, never releasing text that could be the beginning of one."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str]) -> None:
        self._decoder = StreamDecoder(decode)
        self._stop = [s for s in stop if s]
        self._longest = max((len(s) for s in self._stop), default=0)
        self.text = ""  # everything decoded so far (up to a stop string)
        self._sent = 0  # how much of it was released

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a token; return (text to release, whether a stop string ended the choice)."""
        return self._feed(self._decoder.push(token_id), final=False)

    def finish(self) -> tuple[str, bool]:
        """The choice ended: release what was held back (a stop string in it still cuts it)."""
        return self._feed(self._decoder.flush(), final=True)

    def _feed(self, piece: str, final: bool) -> tuple[str, bool]:
        if piece and self._stop:
            # a match must end inside the new piece: earlier ones were found when their text arrived
            search_from = max(self._sent, len(self.text) - self._longest + 1)
            self.text += piece
            hits = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                return self._release(len(self.text)), True
        else:
            self.text += piece
        return self._release(len(self.text) if final else len(self.text) - self._held_back()), False

    def _held_back(self) -> int:
        """Length of the longest unreleased tail of the text that some stop string starts with."""
        for k in range(min(self._longest - 1, len(self.text) - self._sent), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0

    def _release(self, end: int) -> str:
        out, self._sent = self.text[self._sent:end], max(self._sent, end)
        return out


@dataclass
class _Choice:
    """One sequence in flight: a row of the cache."""

    request: Request
    index: int
    generator: torch.Generator | None
    seen: torch.Tensor  # (1, vocab) bool: tokens of the prompt and output, for the repetition penalty
    text: TextStream
    start: int = 0  # first cache column of the row
    last: int = 0  # the latest sampled token: the next step's input
    tokens: int = 0  # tokens sampled so far


# --------------------------------------------------------------------------------- cache
class SlotCache(KVCache):
    """A KVCache with one row per slot and a per-slot padding mask, whose forward passes touch only the busy rows
    0..n-1 (n = the batch the model is run on), and which can grow, shift and copy rows between steps."""

    def __init__(self, cfg: ModelConfig, slots: int, capacity: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        super().__init__(cfg, slots, capacity, device=device, dtype=dtype)
        self.mask = torch.zeros((slots, capacity), dtype=torch.long, device=device)  # 1 = a real token

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, start, end = k.shape[0], self.length, self.length + k.shape[2]
        self.k[layer, :n, :, start:end] = k
        self.v[layer, :n, :, start:end] = v
        return self.k[layer, :n, :, :end], self.v[layer, :n, :, :end]

    def resize(self, capacity: int) -> None:
        """Reallocate with `capacity` columns, keeping the first `length`."""
        keep = self.length
        k, v, mask = self.k, self.v, self.mask
        self.k = k.new_zeros((*k.shape[:3], capacity, k.shape[4]))
        self.v = v.new_zeros((*v.shape[:3], capacity, v.shape[4]))
        self.mask = mask.new_zeros((mask.shape[0], capacity))
        self.k[:, :, :, :keep] = k[:, :, :, :keep]
        self.v[:, :, :, :keep] = v[:, :, :, :keep]
        self.mask[:, :keep] = mask[:, :keep]
        self.max_len = capacity

    def shift(self, rows: int, offset: int) -> None:
        """Move the first `rows` rows' columns [0, length) by `offset` (> 0: right, adding masked columns on the
        left; < 0: left, dropping the first -offset columns) and move the write column with them."""
        old = self.length
        new = old + offset
        src, dst = (slice(0, old), slice(offset, new)) if offset > 0 else (slice(-offset, old), slice(0, new))
        for t in (self.k, self.v):
            t[:, :rows, :, dst] = t[:, :rows, :, src].clone()  # clone: the ranges overlap
        self.mask[:rows, dst] = self.mask[:rows, src].clone()
        if offset > 0:
            self.mask[:rows, :offset] = 0
        self.length = new

    def copy_row(self, src: int, dst: int) -> None:
        end = self.length
        self.k[:, dst, :, :end] = self.k[:, src, :, :end]
        self.v[:, dst, :, :end] = self.v[:, src, :, :end]
        self.mask[dst] = self.mask[src]

    def place(self, row: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Write a prefilled sequence's (layers, kv_heads, P, head_dim) keys/values into `row`, ending at the
        write column; return its first column."""
        start = self.length - k.shape[2]
        self.k[:, row, :, start:self.length] = k
        self.v[:, row, :, start:self.length] = v
        self.mask[row] = 0
        self.mask[row, start:self.length] = 1
        return start


# -------------------------------------------------------------------------------- engine
@dataclass
class EngineStats:
    """Counters since start (running and queued are read live)."""

    steps: int = 0  # decode steps
    batched_steps: int = 0  # decode steps that ran more than one sequence
    max_batch: int = 0  # most sequences decoded in one step
    prefills: int = 0
    tokens: int = 0  # tokens sampled
    requests_done: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    compactions: int = 0
    cache_len: int = 0  # columns allocated now


class Engine:
    """Decodes every submitted request in one batched loop (see the module docstring); thread-safe submit/cancel.

    Run it with start() (a background thread that owns the model), or call step() yourself (tests).
    """

    def __init__(self, model: PocketLM, decode: Callable[[list[int]], str], pad_id: int, max_batch_size: int = 8,
                 max_queue: int = 64, max_model_len: int | None = None, first_cache_len: int = FIRST_CACHE_LEN
                 ) -> None:
        cfg = model.config
        if max_batch_size < 1 or max_queue < 0:
            raise ValueError(f"need max_batch_size >= 1 and max_queue >= 0, got {max_batch_size}, {max_queue}")
        self.model = model.eval()
        self.decode = decode
        self.pad_id = pad_id
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.first_cache_len = first_cache_len
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.stats = EngineStats()
        self._cond = threading.Condition()
        self._pending: deque[Request] = deque()
        self._rows: list[_Choice] = []  # row i of the cache is _rows[i]
        self._cache: SlotCache | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ----------------------------------------------------------------- public, any thread
    def submit(self, prompt: Sequence[int], params: SamplingParams, n: int = 1,
               sink: Callable[[Event], None] = lambda event: None) -> Request:
        """Queue a request; raise QueueFull when it cannot start now and max_queue requests already wait,
        ValueError when it can never run (empty prompt, unknown ids, too long, n beyond max_batch_size)."""
        vocab = self.model.config.vocab_size
        if not prompt or any(not 0 <= int(t) < vocab for t in prompt):
            raise ValueError(f"a prompt needs at least one token, all in [0, {vocab})")
        if not 1 <= n <= self.max_batch_size:
            raise ValueError(f"n must be between 1 and max_batch_size ({self.max_batch_size}), got {n}")
        if (params.temperature < 0 or not 0 < params.top_p <= 1 or params.repetition_penalty <= 0
                or params.top_k < 0):
            raise ValueError(f"need temperature >= 0, 0 < top_p <= 1, repetition_penalty > 0 and top_k >= 0; got "
                             f"{params.temperature}, {params.top_p}, {params.repetition_penalty}, {params.top_k}")
        if params.max_tokens < 1 or len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) must fit in "
                             f"max_model_len ({self.max_model_len}), with max_tokens >= 1")
        request = Request(prompt, params, n, sink)
        with self._cond:
            if self._stopping:
                raise RuntimeError("the engine is stopped")
            # _rows is the engine thread's; its length read here may be a step old, which only shifts the
            # moment a request counts as queued
            free = self.max_batch_size - len(self._rows) - sum(r.n for r in self._pending)
            if n > free and len(self._pending) >= self.max_queue:
                raise QueueFull(f"{len(self._pending)} requests are waiting (max_queue {self.max_queue})")
            self._pending.append(request)
            self._cond.notify()
        return request

    def cancel(self, request: Request) -> None:
        """Stop a request (its client went away): its rows are freed before the next step; no more events."""
        with self._cond:
            request.cancelled = True
            self._cond.notify()

    def snapshot(self) -> dict:
        """Counters and the current load, for /health: `running` counts sequences being decoded (a request
        with n choices is n), `queued` the requests waiting for rows."""
        s = self.stats
        return {"running": len(self._rows), "queued": len(self._pending), "max_batch_size": self.max_batch_size,
                "max_queue": self.max_queue, "max_model_len": self.max_model_len, "steps": s.steps,
                "batched_steps": s.batched_steps, "max_batch": s.max_batch, "prefills": s.prefills,
                "tokens": s.tokens, "requests_done": s.requests_done, "requests_cancelled": s.requests_cancelled,
                "requests_failed": s.requests_failed, "compactions": s.compactions, "cache_len": s.cache_len}

    def start(self) -> None:
        """Run the decode loop in a background thread."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="pocketlm-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop; requests still in flight get a RequestError."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # ------------------------------------------------------------------- engine thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._pending and not self._rows:
                    self._cond.wait()
                if self._stopping:
                    break
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, never the server
                logger.exception("decode step failed")
                self._fail_all(f"generation failed: {type(e).__name__}: {e}")
        self._fail_all("the server is shutting down")

    def _fail_all(self, message: str) -> None:
        with self._cond:
            requests = list(self._pending) + list({id(c.request): c.request for c in self._rows}.values())
            self._pending.clear()
        self._rows.clear()
        self._cache = None  # its state is unknown after a failure; the next admission starts afresh
        for r in requests:
            if not r.finished and not r.cancelled:
                r.finished = True
                self.stats.requests_failed += 1
                self._emit(r, RequestError(message))

    @torch.inference_mode()
    def step(self) -> bool:
        """Drop cancelled work, admit waiting requests into free rows (prefill), then decode one token for every
        row. Returns whether there was anything to do."""
        self._remove([i for i, c in enumerate(self._rows) if c.request.cancelled])
        with self._cond:
            cancelled = [r for r in self._pending if r.cancelled]
            self._pending = deque(r for r in self._pending if not r.cancelled)
            admitted, free = [], self.max_batch_size - len(self._rows)
            # first come, first served: a request needing more rows than are free waits, and so do those after it
            while self._pending and self._pending[0].n <= free:
                admitted.append(self._pending.popleft())
                free -= admitted[-1].n
        for r in cancelled:
            self._count_cancelled(r)
        if admitted:
            self._prefill(admitted)
        if self._rows:
            self._decode()
        return bool(admitted or self._rows or cancelled)

    def _prefill(self, requests: list[Request]) -> None:
        """Prefill new requests as one left-padded batch (model.generate's prefill), copy each into its rows and
        sample every choice's first token."""
        cfg = self.model.config
        ids, pad_mask = left_pad([r.prompt for r in requests], self.pad_id, self.device)
        B, W = ids.shape
        scratch = KVCache(cfg, B, W, device=self.device, dtype=self.dtype)
        positions = (pad_mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(ids, position_ids=positions, attention_mask=pad_mask, kv_cache=scratch,
                            last_only=True)[:, -1]
        self.stats.prefills += 1
        cache = self._room_for_prompt(W)
        ended = []
        for b, r in enumerate(requests):
            P = len(r.prompt)
            seen = torch.zeros((1, cfg.vocab_size), dtype=torch.bool, device=self.device)
            seen[0, torch.as_tensor(r.prompt, device=self.device)] = True
            for i in range(r.n):
                choice = _Choice(r, i, self._generator(r.params.seed, i), seen.clone(),
                                 TextStream(self.decode, r.params.stop))
                choice.start = cache.place(len(self._rows), scratch.k[:, b, :, W - P:], scratch.v[:, b, :, W - P:])
                self._rows.append(choice)
                if self._sample_or_fail(choice, logits[b:b + 1]):
                    ended.append(len(self._rows) - 1)
        self._remove(ended)

    def _decode(self) -> None:
        """One token for every busy row."""
        cache = self._room_for_next_token()
        n, L = len(self._rows), cache.length
        tokens = torch.tensor([[c.last] for c in self._rows], device=self.device)
        positions = torch.tensor([[L - c.start] for c in self._rows], device=self.device)
        cache.mask[:n, L] = 1
        logits = self.model(tokens, position_ids=positions, attention_mask=cache.mask[:n, :L + 1], kv_cache=cache,
                            last_only=True)[:, -1]
        s = self.stats
        s.steps, s.max_batch, s.batched_steps = s.steps + 1, max(s.max_batch, n), s.batched_steps + (n > 1)
        self._remove([i for i, c in enumerate(self._rows) if self._sample_or_fail(c, logits[i:i + 1])])

    # ---------------------------------------------------------------------- sampling
    def _generator(self, seed: int | None, index: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        if seed is None:
            g.seed()  # a fresh non-deterministic seed
        else:
            g.manual_seed((seed + index) % 2 ** 64)  # any int: torch takes the 64-bit range only
        return g

    def _sample_or_fail(self, c: _Choice, logits: torch.Tensor) -> bool:
        """_sample, but a failure of one request's sampling (e.g. settings extreme enough to give NaN
        probabilities) fails that request alone; True when the row is done."""
        if c.request.finished:  # failed through another of its choices in this step
            return True
        try:
            return self._sample(c, logits)
        except Exception as e:  # noqa: BLE001 - reported to the request's client
            logger.warning("sampling failed for a request: %s", e)
            r = c.request
            r.finished = True
            self.stats.requests_failed += 1
            self._emit(r, RequestError(f"sampling failed: {e}"))
            r.cancelled = True  # its other rows go at the next step
            return True

    def _sample(self, c: _Choice, logits: torch.Tensor) -> bool:
        """Draw the choice's next token from its (1, vocab) logits and report it; True when the choice ended."""
        p = c.request.params
        token = int(sample_next(logits, c.seen, p.temperature, p.top_k, p.top_p, p.repetition_penalty,
                                c.generator)[0])
        c.tokens += 1
        self.stats.tokens += 1
        if token in p.stop_ids:
            return self._end(c, "stop")
        c.seen[0, token] = True
        delta, stopped = c.text.push(token)
        if delta:
            self._emit(c.request, TextDelta(c.index, delta))
        if stopped:
            return self._end(c, "stop", flush=False)
        if c.tokens >= p.max_tokens:
            return self._end(c, "length")
        c.last = token
        return False

    def _end(self, c: _Choice, reason: str, flush: bool = True) -> bool:
        r = c.request
        if flush:
            delta, stopped = c.text.finish()
            reason = "stop" if stopped else reason
            if delta:
                self._emit(r, TextDelta(c.index, delta))
        self._emit(r, ChoiceEnd(c.index, reason, c.tokens))
        r.open -= 1
        r.completion_tokens += c.tokens
        if r.open == 0 and not r.cancelled:
            r.finished = True
            self.stats.requests_done += 1
            self._emit(r, RequestEnd(len(r.prompt), r.completion_tokens))
        return True

    def _emit(self, r: Request, event: Event) -> None:
        if r.cancelled:
            return
        try:
            r.sink(event)
        except Exception:  # noqa: BLE001 - e.g. the server's event loop is gone: nobody listens any more
            logger.exception("a request's event sink failed; cancelling it")
            r.cancelled = True

    # ------------------------------------------------------------------------- rows
    def _remove(self, rows: list[int]) -> None:
        """Free these rows, moving the last busy rows into the holes so that busy rows stay 0..n-1."""
        for i in sorted(rows, reverse=True):  # from the end: a hole is always filled by a row that stays
            c, last = self._rows[i], len(self._rows) - 1
            if c.request.cancelled and not c.request.finished:
                self._count_cancelled(c.request)
            if i != last:
                self._cache.copy_row(last, i)
                self._rows[i] = self._rows[last]
            self._rows.pop()

    def _count_cancelled(self, r: Request) -> None:
        if not r.finished:
            r.finished = True
            self.stats.requests_cancelled += 1

    def _room_for_prompt(self, width: int) -> SlotCache:
        """The cache, with its write column at least `width` (busy rows shifted right if needed)."""
        cache = self._cache
        if cache is None:
            cache = self._cache = SlotCache(self.model.config, self.max_batch_size,
                                            min(max(self.first_cache_len, width + 1), self.max_model_len),
                                            self.device, self.dtype)
        busy = len(self._rows)
        if busy == 0:
            cache.length = 0
        if width > cache.max_len:
            cache.resize(self._grown(cache.max_len, width))
        if width > cache.length:
            cache.shift(busy, width - cache.length)
        self.stats.cache_len = cache.max_len
        return cache

    def _room_for_next_token(self) -> SlotCache:
        """The cache with a free write column, and without a dead prefix longer than what the rows use."""
        cache = self._cache
        L = cache.length
        unused = min(c.start for c in self._rows)  # columns no busy row reads
        if L == cache.max_len:
            if (unused > 0 and unused >= L // 4) or cache.max_len >= self.max_model_len:
                self._compact(cache, unused)
            else:
                cache.resize(self._grown(cache.max_len, L + 1))
        elif unused >= 32 and unused > L // 2:
            self._compact(cache, unused)
        self.stats.cache_len = cache.max_len
        return cache

    def _compact(self, cache: SlotCache, unused: int) -> None:
        # unused >= 1 at max_model_len: a row holding every column would have reached its max_tokens
        assert unused > 0, "no free column in a cache at max_model_len"
        cache.shift(len(self._rows), -unused)
        for c in self._rows:
            c.start -= unused
        self.stats.compactions += 1

    def _grown(self, capacity: int, need: int) -> int:
        while capacity < need:
            capacity *= 2
        return min(capacity, self.max_model_len)
