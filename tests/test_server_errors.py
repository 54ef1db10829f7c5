"""Bad requests get OpenAI-style 4xx errors and the server keeps serving; a client that leaves
mid-stream aborts its request and frees its blocks; /metrics and /health report the engine."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from tests.test_server_fixtures import MODEL_ID, LiveServer, server, tiny_bridge  # noqa: F401

OK = {"model": MODEL_ID, "prompt": "the cache holds", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def http(server):  # noqa: F811
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def _error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


@pytest.mark.parametrize("change, param", [
    ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**12}, "max_tokens"), ({"temperature": -0.5}, "temperature"),
    ({"temperature": 1e9}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 0}, "n"), ({"n": 10**6}, "n"),
    ({"seed": -3}, "seed"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"top_k": -7}, "top_k"),
    ({"prompt": ""}, None), ({"prompt": [1, -2]}, None), ({"prompt": []}, None),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"logprobs": 21}, "logprobs"), ({"suffix": "x"}, "suffix"),
])
def test_invalid_completion_fields(http, change, param):
    err = _error(http.post("/v1/completions", json={**OK, **change}), 400, param)
    assert err["type"] == "invalid_request_error"


def test_malformed_bodies(http):
    _error(http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
           400, code="invalid_json")
    _error(http.post("/v1/completions", json=[1, 2]), 400)
    _error(http.post("/v1/completions", json={"prompt": "x"}), 400, "model", "missing_parameter")
    _error(http.post("/v1/chat/completions", json={"model": MODEL_ID, "messages": []}), 400, "messages")
    wizard = [{"role": "wizard", "content": "x"}]
    _error(http.post("/v1/chat/completions", json={"model": MODEL_ID, "messages": wizard}), 400, "messages.0.role")
    _error(http.post("/v1/completions", json={**OK, "model": "gpt-4"}), 404, "model", "model_not_found")
    _error(http.get("/v1/completions"), 405)
    _error(http.get("/v1/nothing-here"), 404)
    _error(http.post("/v1/completions", json={**OK, "prompt": [OK["prompt"], 5]}), 400)
    _error(http.post("/v1/completions", json={**OK, "prompt": [999]}), 400, "prompt")  # vocab is 320


@pytest.mark.parametrize("message", [{"role": "user", "content": None}, {"role": "user"},
                                     {"role": "system", "content": None}])
def test_chat_message_without_content(http, message):
    """OpenAI refuses a null user or system message (400); accepted, it would be an empty turn
    that generates to the context limit when no max_tokens is given."""
    body = {"model": MODEL_ID, "messages": [message]}
    err = _error(http.post("/v1/chat/completions", json=body), 400, "messages.0.content")
    assert f"a {message['role']} message needs content" in err["message"]


def test_assistant_message_may_have_null_content(http):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                {"role": "user", "content": "the cache holds"}]
    r = http.post("/v1/chat/completions", json={"model": MODEL_ID, "messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_too_long_for_the_model(http, server):  # noqa: F811
    limit = server.bridge.max_model_len
    _error(http.post("/v1/completions", json={**OK, "prompt": [5] * (limit + 1)}), 400, "prompt",
           "context_length_exceeded")
    _error(http.post("/v1/completions", json={**OK, "prompt": [5] * 10, "max_tokens": limit}), 400, "prompt",
           "context_length_exceeded")
    long_chat = [{"role": "user", "content": "cache " * limit}]
    _error(http.post("/v1/chat/completions", json={"model": MODEL_ID, "messages": long_chat}), 400, "messages",
           "context_length_exceeded")


def test_too_long_for_the_cache(tmp_path):
    """A prompt inside the model's context but beyond the whole KV cache is refused up front."""
    live = LiveServer(tiny_bridge(tmp_path, kv_memory=16 * 8 * 512))  # 16 blocks x 8 tokens
    try:
        assert live.bridge.engine.capacity.tokens == 128 < live.bridge.max_model_len
        r = httpx.post(f"{live.url}/v1/completions", json={**OK, "prompt": [5] * 150, "max_tokens": 1})
        err = _error(r, 400, "prompt", "context_length_exceeded")
        assert "KV blocks" in err["message"]
        assert httpx.post(f"{live.url}/v1/completions", json=OK).status_code == 200
    finally:
        live.stop()


def test_oversized_bodies(tmp_path):
    live = LiveServer(tiny_bridge(tmp_path), max_body_bytes=10_000)
    try:
        big = {**OK, "prompt": "x" * 20_000}
        _error(httpx.post(f"{live.url}/v1/completions", json=big), 413, code="request_too_large")

        def chunks():  # no Content-Length: the limit applies while reading
            body = json.dumps(big).encode()
            for i in range(0, len(body), 4096):
                yield body[i:i + 4096]
        _error(httpx.post(f"{live.url}/v1/completions", content=chunks(),
                          headers={"content-type": "application/json"}), 413, code="request_too_large")
        assert httpx.post(f"{live.url}/v1/completions", json=OK).status_code == 200
    finally:
        live.stop()


def _cache(http) -> dict:
    return http.get("/api/cache").json()


def _wait_idle(http, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        c = _cache(http)
        if (c["stats"]["running"] == c["stats"]["waiting"] == 0 and not c["requests"]) or time.monotonic() > deadline:
            return c
        time.sleep(0.02)


def test_disconnect_mid_stream_aborts_and_frees_blocks(http, server):  # noqa: F811
    before = _metric(http, 'kvlab_requests_total{finish_reason="abort"}')
    limit = server.bridge.max_model_len
    body = {**OK, "max_tokens": limit - 10, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert any(next(lines).startswith("data:") for _ in range(6))
        assert _cache(http)["stats"]["used_blocks"] > 0  # the request holds blocks while streaming
    c = _wait_idle(http)
    assert c["stats"]["used_blocks"] == 0 and c["requests"] == []
    assert all(set(g["blocks"]) <= {"f", "c"} for g in c["groups"])  # free or cached, none in use
    assert _metric(http, 'kvlab_requests_total{finish_reason="abort"}') == before + 1
    # a non-streaming client that gives up is noticed too: each of its 16 choices that reached the
    # engine is aborted (on a busy machine the last ones may not have been added yet: those never are)
    finished = _metric(http, 'kvlab_requests_total{finish_reason="length"}')
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False, "n": 16}, timeout=0.1)
    c = _wait_idle(http)
    assert c["stats"]["used_blocks"] == 0 and c["requests"] == []
    assert before + 1 <= _metric(http, 'kvlab_requests_total{finish_reason="abort"}') <= before + 17
    assert _metric(http, 'kvlab_requests_total{finish_reason="length"}') == finished  # none ran to the end
    assert http.post("/v1/completions", json=OK).status_code == 200  # still serving


def _metric(http, name: str) -> float:
    text = http.get("/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_metrics_and_health(http):
    http.post("/v1/completions", json={**OK, "max_tokens": 5, "ignore_eos": True})
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("kvlab_kv_cache_usage_perc", "kvlab_prefix_cache_queries_total", "kvlab_prefix_cache_hits_total",
                 "kvlab_num_preemptions_total", "kvlab_swapped_out_blocks_total", "kvlab_num_requests_running",
                 "kvlab_num_requests_waiting", "kvlab_time_to_first_token_seconds_count",
                 "kvlab_inter_token_latency_seconds_count"):
        assert re.search(rf"^{name}(\{{.*\}})? ", r.text, re.M), name
    assert _metric(http, "kvlab_time_to_first_token_seconds_count") >= 1
    # which mode runs: the exact default
    assert re.search(r'^kvlab_model_info\{.*activations="fp32".*\} 1\.0$', r.text, re.M)
    assert _metric(http, "kvlab_inter_token_latency_seconds_count") >= 4
    c = _cache(http)
    assert _metric(http, "kvlab_prefix_cache_queries_total") == c["stats"]["prefix_queries_tokens"] > 0
    assert _metric(http, "kvlab_kv_cache_blocks") == c["num_blocks"] * len(c["groups"])
    assert http.get("/health").json() == {"status": "ok"}


def test_an_engine_failure_fails_its_requests_not_the_server(http, server, monkeypatch):  # noqa: F811
    engine = server.bridge.engine
    real_step = engine.step
    calls = []

    def step_once_broken():
        if not calls:
            calls.append(1)
            raise RuntimeError("simulated device error")
        return real_step()
    monkeypatch.setattr(engine, "step", step_once_broken)
    err = _error(http.post("/v1/completions", json=OK), 500)
    assert err["type"] == "server_error" and "simulated device error" in err["message"]
    c = _wait_idle(http)
    assert c["stats"]["used_blocks"] == 0 and c["requests"] == []
    assert http.post("/v1/completions", json=OK).status_code == 200
