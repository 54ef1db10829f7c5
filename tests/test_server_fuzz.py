"""The fuzzer of benchmarks/fuzz.py, small: requests generated from the server's own OpenAPI
schema (valid and schema-breaking) for every operation, and hostile bodies (invalid UTF-8, lone
surrogates, control characters, huge stop lists, deep nesting, unknown chat roles). No answer
is a 5xx, none misses its deadline, and afterwards the server is healthy with every block free.
The benchmark runs the same with 1,000+ requests (docs/benchmarks.md)."""

from __future__ import annotations

import httpx

from benchmarks.fuzz import FuzzReport, check_after, fuzz_hostile, fuzz_schema
from tests.test_server_fixtures import MODEL_ID, server  # noqa: F401


def test_fuzzed_requests_never_break_the_server(server):  # noqa: F811
    report = FuzzReport()
    fuzz_schema(server.url, MODEL_ID, 3, report)
    fuzz_hostile(server.url, MODEL_ID, 40, report)
    assert report.server_errors == 0 and report.hangs == 0, report.failures
    assert report.requests >= 70
    seen = {name for name, _ in report.statuses}
    assert {"POST /v1/completions (positive)", "POST /v1/chat/completions (negative)", "POST /api/steps (positive)",
            "GET /metrics (positive)"} <= seen  # every kind of operation was reached
    assert any(status == 200 for name, status in report.statuses if "/v1/" in name)  # some reached the engine
    assert check_after(server.url) == {"health": 200, "requests_left": 0, "used_blocks": 0, "leaked_blocks": 0}


def test_a_lone_surrogate_is_one_clear_400(server):  # noqa: F811
    for path, body in [("/v1/completions", f'{{"model": "{MODEL_ID}", "prompt": "a\\ud800b"}}'),
                       ("/v1/chat/completions", f'{{"model": "{MODEL_ID}", "messages": '
                                                f'[{{"role": "user", "content": "\\udfff"}}]}}'),
                       ("/v1/completions", '{"model": "\\ud800", "prompt": "x"}')]:
        r = httpx.post(f"{server.url}{path}", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_unicode", r.text
    # a surrogate pair is one real character: served
    ok = httpx.post(f"{server.url}/v1/completions", content=f'{{"model": "{MODEL_ID}", "prompt": "\\ud83d\\ude00", '
                    '"max_tokens": 2}', headers={"Content-Type": "application/json"})
    assert ok.status_code == 200


def test_sampling_limits_the_fuzzer_found_are_served(server):  # noqa: F811
    """A temperature or top_p so small that float32 rounds it away once made NaN probabilities
    (a 500); both are greedy in effect, and now sample the greedy token."""
    body = {"model": MODEL_ID, "prompt": "the cache holds", "max_tokens": 6, "ignore_eos": True, "seed": 3}
    greedy = httpx.post(f"{server.url}/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
    for extra in ({"temperature": 1e-300}, {"top_p": 1e-300}, {"temperature": 5e-324, "top_p": 5e-324}):
        r = httpx.post(f"{server.url}/v1/completions", json={**body, **extra})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy, (extra, r.text)
