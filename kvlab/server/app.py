"""The app factory: routes, error handling, body-size limit, the page and its static files.

``create_app`` takes a ready ``EngineBridge`` (the model is loaded and the cache allocated before
uvicorn binds), so tests build apps around tiny models and `kvlab serve` around the real one.
The engine thread starts and stops with the app's lifespan.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvlab.server import openai_api, page_api
from kvlab.server.bridge import EngineBridge
from kvlab.server.errors import APIError, install_error_handlers

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
MAX_BODY_BYTES = 4 * 2**20  # a 128k-token prompt is ~0.5 MB of text; more is a mistake or abuse


def _too_large(limit: int) -> JSONResponse:
    return APIError(f"request body larger than {limit:,} bytes", 413, code="request_too_large").response()


class BodyLimit:
    """Refuse bodies over ``limit`` bytes: at once from Content-Length, or while reading a chunked
    body, so an oversized upload is never buffered whole.

    Past the limit the app is told the client left (it stops reading and its own error response
    is dropped), then the 413 goes out from here."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await _too_large(self.limit)(scope, receive, send)
            return
        seen, over, started = 0, False, False

        async def limited() -> Message:
            nonlocal seen, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if over:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, limited, guarded_send)
        if over and not started:
            await _too_large(self.limit)(scope, receive, send)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _lone_surrogate(body: bytes) -> bool:
    """Whether a JSON body decodes to a string holding an unpaired UTF-16 surrogate (the escape
    "\\ud800" alone). A pair decodes to one real character and is fine."""
    if not _SURROGATE_ESCAPE.search(body):
        return False  # the common case: no escape of the surrogate range at all
    try:
        stack = [json.loads(body)]
    except (ValueError, RecursionError):
        return False  # not JSON: the route's own parser says so
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


class RejectLoneSurrogates:
    """Refuse a JSON body whose strings hold unpaired surrogates with one 400.

    JSON allows such escapes and Python decodes them, but the result is not text: the tokenizer,
    the error message that quotes the value and the JSON response all fail on it (a 500, or a
    reset connection). The body (already capped by ``BodyLimit``) is read whole, checked and
    handed on unchanged."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        chunks, message = [], {"type": "http.request", "more_body": True}
        while message["type"] == "http.request" and message.get("more_body", False):
            message = await receive()
            chunks.append(message.get("body", b""))
        if message["type"] != "http.request":  # the client left (or BodyLimit cut it off)
            await self.app(scope, _replay([message], receive), send)
            return
        body = b"".join(chunks)
        if _lone_surrogate(body):
            await APIError("the request body holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff): "
                           "not text", code="invalid_unicode").response()(scope, receive, send)
            return
        await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that hands out ``messages`` first, then defers to the real one."""
    async def replayed() -> Message:
        return messages.pop(0) if messages else await receive()
    return replayed


def create_app(bridge: EngineBridge, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        bridge.start()
        try:
            yield
        finally:
            bridge.stop()

    app = FastAPI(title="kvlab", summary="OpenAI-compatible server on kvlab's paged KV-cache engine",
                  lifespan=lifespan)
    app.state.bridge = bridge
    app.state.api_key = api_key
    install_error_handlers(app)
    app.include_router(openai_api.router)
    app.include_router(page_api.router)
    app.add_middleware(RejectLoneSurrogates)
    app.add_middleware(BodyLimit, limit=max_body_bytes)  # added last, so it runs first

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = bridge.alive
        return JSONResponse({"status": "ok" if ok else "engine stopped"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(bridge.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html")

    app.mount("/static", StaticFiles(directory=WEB_DIR), name="static")
    return app
