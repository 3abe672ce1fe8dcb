"""The OpenAI-compatible HTTP API (FastAPI) over the batching engine: /v1/models, /v1/chat/completions,
/v1/completions and /health, and a chat page at / (serving/static/: plain HTML, CSS and JavaScript that call the
API from the browser; the page loads without the API key, its requests send it), with /tools and /tools/run: the
bundled tools the page offers the model and runs when it calls them.

Every failure a client can cause is answered in OpenAI's error shape with its status (400 bad request, 401 bad
key, 404 unknown model or route, 413 body too large, 503 + Retry-After when the queue is full), never with a
traceback. A client that goes away (mid-stream or while waiting) has its request cancelled, which frees its rows
in the engine before the next decode step.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import AsyncIterator, Callable

import torch
from fastapi import Depends, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.device import choose_dtype
from common.errors import ConfigError
from common.tool_calls import Event, Reply, ReplyStream, ToolCall, parse_reply
from common.tools import run_tool, tool_schemas
from dataset.tokenizer import DEFAULT_TOKENIZER_DIR, Tokenizer
from model import generate, load_model
from model.inference import fit_chat, keep_recent, read_train_info

from .config import ServeConfig
from .engine import ChoiceEnd, Engine, QueueFull, RequestEnd, RequestError, SamplingParams, TextDelta
from .engine import Request as EngineRequest
from .schema import (
    APIError,
    ChatCompletionRequest,
    CommonRequest,
    CompletionRequest,
    chat_response,
    chunk,
    completion_response,
    new_id,
    parse_request,
    sse,
    tool_call_entry,
    usage,
    usage_chunk,
)

logger = logging.getLogger("pocketlm.serving")
RETRY_AFTER_S = 1  # what a 503 tells the client to wait: a slot frees as soon as any sequence ends
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
STATIC_DIR = Path(__file__).with_name("static")  # the chat page
# The page may load and call nothing but this server (no CDN, no third-party script can run in it); no-cache:
# a new version of the page is picked up on reload.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; "
                                           "form-action 'none'; frame-ancestors 'none'",
                "Cache-Control": "no-cache"}


@dataclass
class Service:
    """What the API serves: the engine (which owns the model), the tokenizer, the prompt format and the model's
    name."""

    engine: Engine
    tokenizer: Tokenizer
    prompt_format: str  # "chat": chat completions; "text": text completions
    name: str
    created: int  # when the checkpoint was written (the model card's `created`)
    model_dir: Path

    @property
    def context(self) -> int:
        return self.engine.max_model_len


def load_service(config: ServeConfig, device: torch.device) -> Service:
    """Load the checkpoint as eval_model.py does (prompt format from train_info.json, the checkpoint's
    tokenizer) and
    wrap it in an engine (not started)."""
    m = config.model
    dtype = choose_dtype(config.device.dtype, device, "inference").dtype
    model, model_dir = load_model(m.checkpoint, device=device, dtype=dtype, rope_scaling=config.context.scaling())
    prompt_format = m.prompt_format or read_train_info(model_dir)["prompt_format"]
    has_tokenizer = (model_dir / "tokenizer.json").is_file()
    if not has_tokenizer:
        logger.warning("%s has no tokenizer.json; using the default tokenizer", model_dir)
    tok = Tokenizer(model_dir if has_tokenizer else DEFAULT_TOKENIZER_DIR)
    tok.check_fits(model.config.vocab_size)
    if m.max_model_len is not None and m.max_model_len > model.config.max_position_embeddings:
        raise ConfigError(f"--max_model_len {m.max_model_len} is beyond the model's max_position_embeddings "
                          f"({model.config.max_position_embeddings})")
    generate(model, [[tok.eot_id]], max_new_tokens=2, temperature=0)  # warm-up: the first request is not slower
    b = config.batching
    engine = Engine(model, tok.decode, tok.pad_id, max_batch_size=b.max_batch_size, max_queue=b.max_queue,
                    max_model_len=m.max_model_len)
    name = m.model_name or Path(m.checkpoint).resolve().name
    created = int((model_dir / "config.json").stat().st_mtime) if (model_dir / "config.json").exists() else 0
    return Service(engine, tok, prompt_format, name, created, model_dir)


def create_app(service: Service, api_key: str | None = None, max_body_bytes: int = 1 << 20) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the engine's decode thread."""
    engine, tok = service.engine, service.tokenizer

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="PocketLM OpenAI-compatible API", lifespan=lifespan)
    app.state.service = service

    # ------------------------------------------------------------------------- errors
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = (f"Unknown request URL: {request.method} {request.url.path}" if e.status_code == 404
                   else str(e.detail))
        return JSONResponse(APIError(e.status_code, message).body(), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(APIError(500, f"internal server error ({type(e).__name__})", type="server_error").body(),
                            status_code=500)

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if not key:
            raise APIError(401, "You didn't provide an API key: send `Authorization: Bearer KEY` (the server's "
                                "--api_key).", code="invalid_api_key")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    # ------------------------------------------------------------------------ routes
    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers=PAGE_HEADERS)

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    def model_card() -> dict:
        return {"id": service.name, "object": "model", "created": service.created, "owned_by": "pocketlm",
                "prompt_format": service.prompt_format, "max_model_len": service.context}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": service.name, "prompt_format": service.prompt_format, **engine.snapshot()}

    # The bundled tools (common/tools.py), for the chat page: an OpenAI server never runs a client's tools, so the
    # page runs these through the server (pure functions of a fixed registry; a bad call comes back as an error
    # result, as the model would read it).
    @app.get("/tools", dependencies=[Depends(authorize)])
    async def list_tools() -> dict:
        return {"tools": tool_schemas()}

    @app.post("/tools/run", dependencies=[Depends(authorize)])
    async def call_tool(request: Request) -> dict:
        body = await read_json(request, max_body_bytes)
        name, arguments = body.get("name"), body.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise APIError(400, 'expected {"name": str, "arguments": object or JSON object string}', param="name")
        return {"content": run_tool(ToolCall(name, arguments))}

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorize)])
    async def get_model(model_id: str) -> dict:
        check_model(model_id, param=None)
        return model_card()

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, await read_json(request, max_body_bytes))
        check_request(req)
        if service.prompt_format != "chat":
            raise APIError(400, f"{service.name} is a pretrain checkpoint: it continues raw text and was not trained "
                                "on the chat format; use /v1/completions", param="messages", code="wrong_endpoint")
        if req.max_tokens and req.max_completion_tokens and req.max_tokens != req.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens differ; give one", param="max_tokens")
        tools, prefill = req.offered_tools, req.call_prefill
        encode = partial(tok.chat_prompt, tools=tools, enable_thinking=req.enable_thinking, prefill=prefill)
        prompt, max_tokens = chat_prompt([m.as_dict() for m in req.messages], encode,
                                         req.max_completion_tokens or req.max_tokens, req.truncate == "oldest_turns")
        reading = Reading(bool(tools), req.enable_thinking is True, prefill)
        return await respond(request, req, [prompt], [max_tokens], reading)

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request) -> Response:
        req: CompletionRequest = parse_request(CompletionRequest, await read_json(request, max_body_bytes))
        check_request(req)
        if service.prompt_format == "chat":
            raise APIError(400, f"{service.name} is an SFT (chat) checkpoint: send conversations to "
                                "/v1/chat/completions", param="prompt", code="wrong_endpoint")
        limit = engine.max_batch_size + engine.max_queue
        if len(req.prompt) > limit:
            raise APIError(400, f"at most {limit} prompts per request (max_batch_size + max_queue), got "
                                f"{len(req.prompt)}", param="prompt")
        max_tokens = req.max_tokens or 16  # OpenAI's default for text completions
        prompts = [text_prompt(p, i, max_tokens, req.truncate == "oldest_tokens") for i, p in enumerate(req.prompt)]
        return await respond(request, req, prompts, [max_tokens] * len(prompts), None)

    # ----------------------------------------------------------------------- helpers
    def check_model(name: str, param: str | None = "model") -> None:
        if name != service.name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{service.name}`.",
                           param=param, code="model_not_found")

    def check_request(req: CommonRequest) -> None:
        check_model(req.model)
        for field, hint in req.unsupported():
            raise APIError(400, f"{field}: not supported by this server; {hint}", param=field,
                           code="unsupported_parameter")
        if (req.n or 1) > engine.max_batch_size:
            raise APIError(400, f"n: at most {engine.max_batch_size} (the server's max_batch_size), got {req.n}",
                           param="n")

    def too_long(prompt_tokens: int, max_tokens: int, param: str, hint: str) -> APIError:
        return APIError(400, f"This model's maximum context length is {service.context} tokens. However, you "
                             f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {param}, "
                             f"{max_tokens} in the completion). Please reduce the length of the {param} or "
                             f"completion{hint}.", param=param, code="context_length_exceeded")

    def chat_prompt(messages: list[dict], encode: Callable[[list[dict]], list[int]], max_tokens: int | None,
                    truncate: bool) -> tuple[list[int], int]:
        """The conversation's ids (rendered with the checkpoint's chat template by `encode`) and the completion
        budget."""
        ctx = service.context
        if max_tokens is not None and max_tokens >= ctx:
            raise APIError(400, f"max_tokens: {max_tokens} leaves no room for a prompt in this model's "
                                f"{ctx}-token context", param="max_tokens")
        if truncate:
            # without max_tokens, a quarter of the context stays for the answer
            budget = ctx - (max_tokens if max_tokens is not None else max(1, ctx // 4))
            _, ids, _ = fit_chat(messages, encode, budget)
            ids, _ = keep_recent(ids, budget)  # the newest turn alone may still be too long
        else:
            ids = encode(messages)
        if max_tokens is None:
            max_tokens = ctx - len(ids)  # OpenAI's default: whatever the context leaves
        if max_tokens < 1 or len(ids) + max_tokens > ctx:
            raise too_long(len(ids), max(max_tokens, 1), "messages", ', or send "truncate": "oldest_turns" to '
                                                                    "drop the oldest turns")
        return ids, max_tokens

    def text_prompt(prompt: str | list[int], i: int, max_tokens: int, truncate: bool) -> list[int]:
        ctx, vocab = service.context, engine.model.config.vocab_size
        if max_tokens >= ctx:
            raise APIError(400, f"max_tokens: {max_tokens} leaves no room for a prompt in this model's "
                                f"{ctx}-token context", param="max_tokens")
        if isinstance(prompt, str):
            ids = tok.encode(prompt) or [tok.eot_id]  # an empty prompt starts a new document
        else:
            if any(not 0 <= t < vocab for t in prompt):
                raise APIError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
            ids = list(prompt)
        if truncate:
            ids, _ = keep_recent(ids, ctx - max_tokens)
        if len(ids) + max_tokens > ctx:
            raise too_long(len(ids), max_tokens, "prompt", ', or send "truncate": "oldest_tokens" to keep its end')
        return ids

    def sampling(req: CommonRequest, max_tokens: int, chat: bool) -> SamplingParams:
        temperature = 1.0 if req.temperature is None else req.temperature
        top_p = 1.0 if req.top_p is None else req.top_p
        if top_p == 0:  # keep only the most likely token: greedy (sample_next needs top_p > 0)
            temperature, top_p = 0.0, 1.0
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=req.top_k or 0,
                              repetition_penalty=req.repetition_penalty or 1.0, seed=req.seed,
                              stop=tuple(req.stop or ()), stop_ids=() if req.ignore_eos else tuple(tok.stop_ids(chat)))

    async def respond(request: Request, req: CommonRequest, prompts: list[list[int]], max_tokens: list[int],
                      reading: Reading | None) -> Response:
        """Submit one engine request per prompt and answer with the whole result or a stream of chunks; a chat
        answer (`reading` given) is read for reasoning and tool calls."""
        n, chat = req.n or 1, reading is not None
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        handles: list[EngineRequest] = []

        def deliver(k: int, event: object) -> None:  # called on the engine's thread
            loop.call_soon_threadsafe(events.put_nowait, (k, event))

        try:
            for k, (ids, m) in enumerate(zip(prompts, max_tokens)):
                handles.append(engine.submit(ids, sampling(req, m, chat), n, partial(deliver, k)))
        except QueueFull as e:
            cancel(handles)
            raise APIError(503, f"The server is busy ({e}); retry after {RETRY_AFTER_S} s.", type="server_error",
                           code="server_busy", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ValueError as e:  # what the checks above let through and the engine refuses
            cancel(handles)
            raise APIError(400, str(e)) from None
        except RuntimeError as e:  # the engine has stopped: the server is shutting down
            cancel(handles)
            raise APIError(503, f"The server is shutting down ({e}).", type="server_error") from None
        id, created = new_id("chatcmpl" if chat else "cmpl"), int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream(events, handles, n, reading, id, created, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        texts = [[] for _ in range(len(prompts) * n)]
        reasons: list[str | None] = [None] * len(texts)
        counts = [0, 0]
        try:
            for k, e in await collect(request, events, len(prompts)):
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
            cancel(handles)
        if reading is None:
            return JSONResponse(completion_response(id, created, service.name, ["".join(t) for t in texts], reasons,
                                                    usage(*counts)))
        replies = [reading.read("".join(t)) for t in texts]
        return JSONResponse(chat_response(id, created, service.name, replies, reasons, usage(*counts)))

    def cancel(handles: list[EngineRequest]) -> None:
        for h in handles:
            if not h.finished:
                engine.cancel(h)

    async def collect(request: Request, events: asyncio.Queue, requests: int) -> list[tuple[int, object]]:
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

    async def stream(events: asyncio.Queue, handles: list[EngineRequest], n: int, reading: Reading | None, id: str,
                     created: int, include_usage: bool) -> AsyncIterator[bytes]:
        """Server-sent events: per choice the role first (chat), then its text (a chat answer's read as it comes:
        content, reasoning_content and tool_calls deltas), then its finish_reason; then the usage chunk
        (stream_options.include_usage) and [DONE]. When the client disconnects, Starlette cancels this generator
        and `finally` cancels the requests."""
        chat = reading is not None
        def piece(index: int, **kw) -> bytes:
            return sse(chunk(chat, id, created, service.name, index, with_usage=include_usage, **kw))
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
                yield sse(usage_chunk(chat, id, created, service.name, usage(*counts)))
            yield sse("[DONE]")
        finally:
            cancel(handles)

    return app


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


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object: 413 beyond `limit` bytes (checked before reading when Content-Length says so),
    400 when it is not JSON or not an object."""
    too_big = APIError(413, f"Request body too large: this server accepts at most {limit} bytes (--max_body_bytes).",
                       code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise too_big
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"We could not parse the JSON body of your request ({e}). The body must be a JSON "
                            "object, sent with Content-Type: application/json.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"The request body must be a JSON object, got {type(data).__name__}.",
                       code="invalid_json")
    return data
