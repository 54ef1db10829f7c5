"""OpenAI-style errors: every failure a client can cause becomes a 4xx with one JSON shape.

Clients written for OpenAI (the official SDK included) parse ``{"error": {"message", "type",
"param", "code"}}`` and map the status to an exception class, so a bad request must never surface
as FastAPI's default ``{"detail": ...}`` or, worse, a 500 that looks like the server broke.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("kvlab.server")


class APIError(Exception):
    """A request the server refuses, with the status and OpenAI error fields to send back."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


_STATUS_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                 405: "invalid_request_error", 413: "invalid_request_error",
                 429: "rate_limit_error"}


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param(loc: tuple) -> str | None:
    """The field path (``messages.0.role``) without pydantic's union-branch tags (``list[int]``)."""
    parts: list[str] = []
    for p in loc:
        if p == "body":
            continue
        if isinstance(p, str) and ("[" in p or "-" in p or p in _TYPE_TAGS):
            break
        parts.append(str(p))
    return ".".join(parts) or None


def _validation_error(exc: RequestValidationError) -> APIError:
    """Pydantic's most telling complaint, phrased for a person, with the field as ``param``.

    A union field (``prompt``, ``stop``) fails once per branch; a bound that was broken ("at most
    4 items") says more than "not a string", so errors about a value beat errors about a type."""
    errors = exc.errors()
    if not errors:
        return APIError("invalid request")
    first = sorted(errors, key=lambda e: str(e.get("type", "")).endswith("_type"))[0]
    if first.get("type") == "json_invalid":
        return APIError(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "),
                        code="invalid_json")
    param = _param(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        return APIError(f"missing required parameter {param!r}", param=param, code="missing_parameter")
    return APIError(f"invalid {param or 'request'}: {msg}", param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception a request can raise to an OpenAI-shaped response."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(str(exc.detail), exc.status_code, _STATUS_TYPES.get(exc.status_code,
                        "invalid_request_error" if exc.status_code < 500 else "server_error")).response()

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(f"internal error: {type(exc).__name__}: {exc}", 500, "server_error").response()
