"""The API's routes: /health, the bundled tools (/tools, /tools/run), the model card (/v1/models), and the two
completion endpoints, each a few lines: read the JSON body, check it and make its prompts (serving/checks.py),
answer it through the engine (serving/responses.py).
"""
from __future__ import annotations

import json
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from common.tool_calls import ToolCall
from common.tools import run_tool, tool_schemas

from .checks import RequestChecks
from .responses import Reading, Responder
from .schema import APIError, ChatCompletionRequest, CompletionRequest, parse_request

if TYPE_CHECKING:
    from .service import Service


def api_routes(service: Service, authorize: Callable[..., Any], max_body_bytes: int) -> APIRouter:
    """Every route but the chat page; all but /health need the API key (`authorize`)."""
    engine, tok = service.engine, service.tokenizer
    checks, responder = RequestChecks(service), Responder(service)
    router, keyed = APIRouter(), [Depends(authorize)]

    def model_card() -> dict:
        return {"id": service.name, "object": "model", "created": service.created, "owned_by": "pocketlm",
                "prompt_format": service.prompt_format, "max_model_len": service.context}

    @router.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": service.name, "prompt_format": service.prompt_format, **engine.snapshot()}

    # The bundled tools (common/tools.py), for the chat page: an OpenAI server never runs a client's tools, so the
    # page runs these through the server (pure functions of a fixed registry; a bad call comes back as an error
    # result, as the model would read it).
    @router.get("/tools", dependencies=keyed)
    async def list_tools() -> dict:
        return {"tools": tool_schemas()}

    @router.post("/tools/run", dependencies=keyed)
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

    @router.get("/v1/models", dependencies=keyed)
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @router.get("/v1/models/{model_id:path}", dependencies=keyed)
    async def get_model(model_id: str) -> dict:
        checks.check_model(model_id, param=None)
        return model_card()

    @router.post("/v1/chat/completions", dependencies=keyed)
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, await read_json(request, max_body_bytes))
        checks.check_request(req)
        if service.prompt_format != "chat":
            raise APIError(400, f"{service.name} is a pretrain checkpoint: it continues raw text and was not trained "
                                "on the chat format; use /v1/completions", param="messages", code="wrong_endpoint")
        if req.max_tokens and req.max_completion_tokens and req.max_tokens != req.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens differ; give one", param="max_tokens")
        tools, prefill = req.offered_tools, req.call_prefill
        encode = partial(tok.chat_prompt, tools=tools, enable_thinking=req.enable_thinking, prefill=prefill)
        prompt, max_tokens = checks.chat_prompt([m.as_dict() for m in req.messages], encode,
                                                req.max_completion_tokens or req.max_tokens,
                                                req.truncate == "oldest_turns")
        reading = Reading(bool(tools), req.enable_thinking is True, prefill)
        return await responder.respond(request, req, [prompt], [checks.sampling(req, max_tokens, True)], reading)

    @router.post("/v1/completions", dependencies=keyed)
    async def completions(request: Request) -> Response:
        req: CompletionRequest = parse_request(CompletionRequest, await read_json(request, max_body_bytes))
        checks.check_request(req)
        if service.prompt_format == "chat":
            raise APIError(400, f"{service.name} is an SFT (chat) checkpoint: send conversations to "
                                "/v1/chat/completions", param="prompt", code="wrong_endpoint")
        limit = engine.max_batch_size + engine.max_queue
        if len(req.prompt) > limit:
            raise APIError(400, f"at most {limit} prompts per request (max_batch_size + max_queue), got "
                                f"{len(req.prompt)}", param="prompt")
        max_tokens = req.max_tokens or 16  # OpenAI's default for text completions
        prompts = [checks.text_prompt(p, max_tokens, req.truncate == "oldest_tokens") for p in req.prompt]
        params = [checks.sampling(req, max_tokens, False)] * len(prompts)
        return await responder.respond(request, req, prompts, params, None)

    return router


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
