"""The API key: one rule for every route that runs the model or shows what it is working on.

With ``--api-key``, everything under /v1 (the OpenAI API) and /api (the page's API, which runs
the step-through and shows the live cache) needs ``Authorization: Bearer KEY``; the page itself,
its static files, /health and /metrics (counts, no prompts) stay open, so the page can load and
ask for the key. Keys are compared in constant time, so response timing does not leak how much
of a guess was right.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from kvlab.server.errors import APIError


def require_api_key(request: Request) -> None:
    """A FastAPI dependency: 401 unless the request carries the server's key (if it has one)."""
    key: str | None = request.app.state.api_key
    if not key:
        return
    # header values arrive decoded as latin-1: encoding back gives the bytes that were sent
    sent = request.headers.get("authorization", "").encode("latin-1")
    if not hmac.compare_digest(sent, b"Bearer " + key.encode()):
        raise APIError("invalid or missing API key (Authorization: Bearer KEY)", 401,
                       "invalid_request_error", code="invalid_api_key")
