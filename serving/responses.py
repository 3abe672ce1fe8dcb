"""From the engine's events to an HTTP answer: one engine request per prompt, then the whole result as one JSON
body or a stream of server-sent events (a chat answer read for reasoning and tool calls as it comes). A client
that goes away (mid-stream or while waiting) has its requests cancelled, which frees their rows in the engine
before the next decode step; a full queue is a 503 with Retry-After.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common.tool_calls import Event, Reply, ReplyStream, parse_reply

from .engine import ChoiceEnd, QueueFull, RequestEnd, RequestError, SamplingParams, TextDelta
from .engine import Request as EngineRequest
from .schema import (
    APIError,
    CommonRequest,
    chat_response,
    chunk,
    completion_response,
    new_id,
    sse,
    tool_call_entry,
    usage,
    usage_chunk,
)

if TYPE_CHECKING:
    from .service import Service

RETRY_AFTER_S = 1  # what a 503 tells the client to wait: a slot frees as soon as any sequence ends
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there


class ClientGone(Exception):
    """The client of a non-streamed request disconnected."""


@dataclass(frozen=True)
class Reading:
    """How a chat answer is read (common/tool_calls.py): for tool calls when tools were offered, from inside a
    <think> block when the prompt opened one, after the `prefill` the prompt ended with (a forced call's start,
    part of the answer though the model did not generate it). An answer that neither calls nor thinks comes back
    as generated."""

    tools: bool
    thinking: bool
    prefill: str = ""

    def stream(self) -> ReplyStream:
        reader = ReplyStream(tools=self.tools, thinking=self.thinking)
        reader.push(self.prefill)  # a call's opening: nothing to emit until the call closes
        return reader

    def read(self, text: str) -> Reply:
        return parse_reply(self.prefill + text, thinking=self.thinking, tools=self.tools)


class Responder:
    """Runs a checked request's prompts on the served model's engine and answers it."""

    def __init__(self, service: Service) -> None:
        self.service, self.engine = service, service.engine

    async def respond(self, request: Request, req: CommonRequest, prompts: list[list[int]],
                      params: list[SamplingParams], reading: Reading | None) -> Response:
        """Submit one engine request per prompt and answer with the whole result or a stream of chunks; a chat
        answer (`reading` given) is read for reasoning and tool calls."""
        n, chat = req.n or 1, reading is not None
        handles, events = self.submit(prompts, params, n)
        id, created = new_id("chatcmpl" if chat else "cmpl"), int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self.stream(events, handles, n, reading, id, created, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        texts = [[] for _ in range(len(prompts) * n)]
        reasons: list[str | None] = [None] * len(texts)
        counts = [0, 0]
        try:
            for k, e in await self.collect(request, events, len(prompts)):
                if isinstance(e, TextDelta):
                    texts[k * n + e.index].append(e.text)
                elif isinstance(e, ChoiceEnd):
                    reasons[k * n + e.index] = e.finish_reason
                elif isinstance(e, RequestEnd):
                    counts[0] += e.prompt_tokens
                    counts[1] += e.completion_tokens
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"
        finally:
            self.cancel(handles)
        name = self.service.name
        if reading is None:
            return JSONResponse(completion_response(id, created, name, ["".join(t) for t in texts], reasons,
                                                    usage(*counts)))
        replies = [reading.read("".join(t)) for t in texts]
        return JSONResponse(chat_response(id, created, name, replies, reasons, usage(*counts)))

    def submit(self, prompts: list[list[int]], params: list[SamplingParams], n: int
               ) -> tuple[list[EngineRequest], asyncio.Queue]:
        """One engine request per prompt, all delivering (prompt index, event) into one queue of this loop's."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        handles: list[EngineRequest] = []

        def deliver(k: int, event: object) -> None:  # called on the engine's thread
            loop.call_soon_threadsafe(events.put_nowait, (k, event))

        try:
            for k, (ids, p) in enumerate(zip(prompts, params)):
                handles.append(self.engine.submit(ids, p, n, partial(deliver, k)))
        except QueueFull as e:
            self.cancel(handles)
            raise APIError(503, f"The server is busy ({e}); retry after {RETRY_AFTER_S} s.", type="server_error",
                           code="server_busy", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ValueError as e:  # what the request checks let through and the engine refuses
            self.cancel(handles)
            raise APIError(400, str(e)) from None
        except RuntimeError as e:  # the engine has stopped: the server is shutting down
            self.cancel(handles)
            raise APIError(503, f"The server is shutting down ({e}).", type="server_error") from None
        return handles, events

    def cancel(self, handles: list[EngineRequest]) -> None:
        for h in handles:
            if not h.finished:
                self.engine.cancel(h)

    async def collect(self, request: Request, events: asyncio.Queue, requests: int) -> list[tuple[int, object]]:
        """Every event of a non-streamed answer; ClientGone if the client disconnects first."""
        out, left = [], requests
        check_at = time.monotonic() + DISCONNECT_POLL_S
        while left:
            try:
                k, e = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                k, e = -1, None
            if time.monotonic() >= check_at:  # by the clock: a busy request may never time out above
                if await request.is_disconnected():
                    raise ClientGone()
                check_at = time.monotonic() + DISCONNECT_POLL_S
            if e is None:
                continue
            if isinstance(e, RequestError):
                raise APIError(500, e.message, type="server_error")
            out.append((k, e))
            left -= isinstance(e, RequestEnd)
        return out

    async def stream(self, events: asyncio.Queue, handles: list[EngineRequest], n: int, reading: Reading | None,
                     id: str, created: int, include_usage: bool) -> AsyncIterator[bytes]:
        """Server-sent events: per choice the role first (chat), then its text (a chat answer's read as it comes:
        content, reasoning_content and tool_calls deltas), then its finish_reason; then the usage chunk
        (stream_options.include_usage) and [DONE]. When the client disconnects, Starlette cancels this generator
        and `finally` cancels the requests."""
        chat, name = reading is not None, self.service.name

        def piece(index: int, **kw) -> bytes:
            return sse(chunk(chat, id, created, name, index, with_usage=include_usage, **kw))

        readers = [reading.stream() for _ in range(len(handles) * n)] if reading else []
        calls = [0] * len(readers)  # tool calls streamed per choice: their `index`

        def pieces(index: int, read: list[Event]) -> list[bytes]:
            out = []
            for kind, value in read:
                if kind == "call":
                    out.append(piece(index, tool_call=tool_call_entry(value, calls[index])))  # type: ignore[arg-type]
                    calls[index] += 1
                else:
                    out.append(piece(index, **{"text" if kind == "content" else "reasoning": value}))
            return out

        try:
            for i in range(len(readers)):
                yield piece(i, role=True)
            left, counts = len(handles), [0, 0]
            while left:
                # whatever arrived meanwhile goes out in one write: fewer sends when the loop falls behind
                batch, out = [await events.get()], []
                while not events.empty():
                    batch.append(events.get_nowait())
                for k, e in batch:
                    if isinstance(e, TextDelta):
                        i = k * n + e.index
                        out += pieces(i, readers[i].push(e.text)) if chat else [piece(i, text=e.text)]
                    elif isinstance(e, ChoiceEnd):
                        i = k * n + e.index
                        if chat:
                            out += pieces(i, readers[i].finish())
                        reason = "tool_calls" if chat and calls[i] else e.finish_reason
                        out.append(piece(i, finish_reason=reason))
                    elif isinstance(e, RequestEnd):
                        counts[0] += e.prompt_tokens
                        counts[1] += e.completion_tokens
                        left -= 1
                    elif isinstance(e, RequestError):
                        yield b"".join(out) + sse(APIError(500, e.message, type="server_error").body())
                        return
                if out:
                    yield b"".join(out)
            if include_usage:
                yield sse(usage_chunk(chat, id, created, name, usage(*counts)))
            yield sse("[DONE]")
        finally:
            self.cancel(handles)
