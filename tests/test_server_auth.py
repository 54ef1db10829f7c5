"""Who may use the server: with --api-key every route that runs the model or shows the cache
needs the key (found by walking the app's own routes, so a new route cannot slip by), the page
and health/metrics stay open, keys are compared in constant time, a non-loopback --host needs a
key or an explicit flag, and chat templates stay inside Jinja2's sandbox."""

from __future__ import annotations

import hmac

import httpx
import pytest

import kvlab.server.auth as auth
from kvlab.cli import main
from kvlab.options import ModelOptions
from kvlab.server.run import build_bridge, is_loopback
from tests.test_server_fixtures import MODEL_ID, LiveServer, make_tiny_model, tiny_bridge

KEY = "sk-kvlab_Test.42~"
BODIES = {  # a valid body per POST route, so a 200 with the key proves the route really ran
    "/v1/completions": {"model": MODEL_ID, "prompt": "the cache", "max_tokens": 3},
    "/v1/chat/completions": {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    "/api/plan": {"model": "llama-3.1-8b", "context": 1024},
    "/api/crossover": {"model": "llama-3.1-8b", "context": 1024},
    "/api/steps": {"prompt": "the cache", "max_tokens": 2},
    "/api/evict": {"prompt": "the cache holds keys and values", "budget": 8},
}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    live = LiveServer(tiny_bridge(tmp_path_factory.mktemp("keyed")), api_key=KEY)
    yield live
    live.stop()


def _guarded_routes(url: str) -> list[tuple[str, str]]:
    """Every /v1 and /api operation the server describes in its OpenAPI schema."""
    paths = httpx.get(f"{url}/openapi.json").json()["paths"]
    return sorted((method.upper(), path) for path, ops in paths.items() for method in ops
                  if path.startswith(("/v1", "/api")))


def test_every_model_or_cache_route_needs_the_key(keyed):
    routes = _guarded_routes(keyed.url)
    assert {("POST", "/api/steps"), ("GET", "/api/cache"), ("POST", "/v1/completions")} <= set(routes)
    bearer = "Bearer " + KEY
    with httpx.Client(base_url=keyed.url, timeout=60) as http:
        for method, path in routes:
            body = BODIES.get(path, {}) if method == "POST" else None
            for header in (None, "Bearer wrong", bearer + "x", bearer[:-1], KEY):
                headers = {"Authorization": header.encode()} if header else {}
                r = http.request(method, path, json=body, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, header)
            r = http.request(method, path, json=body, headers={"Authorization": bearer.encode()})
            # with the key: served (a route added later without a body above at least gets past the key)
            assert r.status_code == 200 if method == "GET" or path in BODIES else r.status_code != 401, (path, r.text)


def test_the_page_health_and_metrics_stay_open(keyed):
    with httpx.Client(base_url=keyed.url, timeout=30) as http:
        for path in ("/", "/static/app.js", "/health", "/metrics"):
            assert http.get(path).status_code == 200, path


def test_keys_are_compared_in_constant_time(keyed, monkeypatch):
    calls, real = [], hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)
    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    httpx.get(f"{keyed.url}/api/cache", headers={"Authorization": "Bearer guess"})
    assert calls == [(b"Bearer guess", b"Bearer " + KEY.encode())]


def test_a_non_loopback_host_needs_a_key_and_keys_are_ascii(capsys):
    assert main(["serve", "--host", "0.0.0.0"]) == 2  # refused before any model loads
    assert "refusing to serve on 0.0.0.0 without --api-key" in capsys.readouterr().err
    assert main(["serve", "--api-key", "ключ"]) == 2  # no header (nor browser) could send it
    assert "--api-key must be printable ASCII" in capsys.readouterr().err
    assert [is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "localhost")] == [True] * 4
    assert [is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.5", "example.org")] == [False] * 4


def test_chat_templates_render_in_the_sandbox(tmp_path):
    """A template from a downloaded checkpoint that reaches for Python internals fails as one
    clean 400; the server keeps serving."""
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}{% for m in messages %}{{ m.content }}{% endfor %}"
    live = LiveServer(build_bridge(ModelOptions(str(make_tiny_model(tmp_path, chat_template=escape)), dtype="fp32",
                                                random_weights=True), served_model_name=MODEL_ID))
    try:
        with httpx.Client(base_url=live.url, timeout=30) as http:
            r = http.post("/v1/chat/completions", json=BODIES["/v1/chat/completions"])
            assert r.status_code == 400 and "unsafe" in r.json()["error"]["message"].lower(), r.text
            assert http.post("/v1/completions", json=BODIES["/v1/completions"]).status_code == 200
    finally:
        live.stop()
