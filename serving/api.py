"""The OpenAI-compatible HTTP API (FastAPI) over the batching engine: /v1/models, /v1/chat/completions,
/v1/completions and /health, and a chat page at / (serving/static/: plain HTML, CSS and JavaScript that call the
API from the browser; the page loads without the API key, its requests send it), with /tools and /tools/run: the
bundled tools the page offers the model and runs when it calls them.

Here: the app around what is served (serving/service.py): the page, the key, the errors. The routes are
serving/routes.py; a request's checks and prompts, serving/checks.py; the engine's answer as JSON or a stream,
serving/responses.py.

Every failure a client can cause is answered in OpenAI's error shape with its status (400 bad request, 401 bad
key, 404 unknown model or route, 413 body too large, 503 + Retry-After when the queue is full), never with a
traceback. A client that goes away (mid-stream or while waiting) has its request cancelled, which frees its rows
in the engine before the next decode step.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from .routes import api_routes
from .schema import APIError
from .service import Service

logger = logging.getLogger("pocketlm.serving")
STATIC_DIR = Path(__file__).with_name("static")  # the chat page
# The page may load and call nothing but this server (no CDN, no third-party script can run in it); no-cache:
# a new version of the page is picked up on reload.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; "
                                           "form-action 'none'; frame-ancestors 'none'",
                "Cache-Control": "no-cache"}


def create_app(service: Service, api_key: str | None = None, max_body_bytes: int = 1 << 20) -> FastAPI:
    """The FastAPI app: the chat page, the API's routes (serving/routes.py) behind `api_key` when one is given,
    errors in OpenAI's shape; its lifespan starts and stops the engine's decode thread."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.engine.start()
        yield
        await asyncio.to_thread(service.engine.stop)

    app = FastAPI(title="PocketLM OpenAI-compatible API", lifespan=lifespan)
    app.state.service = service
    add_error_handlers(app)

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers=PAGE_HEADERS)

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.include_router(api_routes(service, key_check(api_key), max_body_bytes))
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every failure as OpenAI's error body with its status: ours (APIError), the framework's (404 for an unknown
    route, 405...), and anything unexpected (500, logged with its traceback on the server only)."""
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


def key_check(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """The dependency that checks a request's `Authorization: Bearer KEY` (nothing without a key), in constant
    time."""
    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if not key:
            raise APIError(401, "You didn't provide an API key: send `Authorization: Bearer KEY` (the server's "
                                "--api_key).", code="invalid_api_key")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
    return authorize
