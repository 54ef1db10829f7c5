"""/v1/models advertises what one request can really reach (issue 15, item 10)."""

from __future__ import annotations

import httpx

from tests.test_server_fixtures import MODEL_ID, LiveServer, tiny_bridge


def test_models_advertises_what_a_small_cache_can_hold(tmp_path):
    """`serve --kv-memory 64KiB`: 16 blocks of 8 tokens, so no request reaches the model's 256."""
    live = LiveServer(tiny_bridge(tmp_path, kv_memory=16 * 8 * 512))
    try:
        with httpx.Client(base_url=live.url, timeout=30) as http:
            longest = http.get("/v1/models").json()["data"][0]["max_model_len"]
            assert longest == 16 * 8 + 1 < live.bridge.max_model_len  # the last token needs no K/V
            ok = http.post("/v1/completions", json={"model": MODEL_ID, "prompt": [5] * (longest - 4),
                                                    "max_tokens": 4, "ignore_eos": True})
            assert ok.status_code == 200 and ok.json()["usage"]["total_tokens"] == longest
            over = http.post("/v1/completions", json={"model": MODEL_ID, "prompt": [5] * (longest - 4),
                                                      "max_tokens": 5})
            assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"
    finally:
        live.stop()
