"""The soak of benchmarks/soak.py, small and in-process: bounded mixed streaming traffic (about
one client in five leaving mid-stream) against a cache that preempts all the time, by swap to
RAM and to disk, and with the prefix tiers on. No 5xx, no hang, every completed output equals its
solo run, no block leaked, no swap file left, no tier past its budget. (RSS over time is the benchmark's to measure: docs/benchmarks.md.)"""

from __future__ import annotations

import asyncio
import glob
import os
import tempfile

import pytest

from benchmarks.soak import idle_cache, leaked_blocks, mismatches, run_traffic, tier_bytes
from kvlab.engine.tiers import HEADER
from kvlab.options import EngineOptions, ModelOptions
from kvlab.server.run import build_bridge
from tests.test_server_fixtures import CORPUS, MODEL_ID, LiveServer, make_tiny_model, tiny_bridge


@pytest.mark.parametrize("mode, tiers", [("swap-ram", False), ("swap-disk", False), ("swap-ram", True)],
                         ids=["swap-ram", "swap-disk", "swap-ram-with-prefix-tiers"])
def test_small_soak(tmp_path, mode, tiers):
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "kvlab-swap-*")))
    # 24 blocks x 8 tokens for 8 clients of up to ~70 tokens each; tiers of 16 and 32 blocks
    block = 8 * 512
    offload = {"kv_offload_ram": 16 * block, "kv_offload_dir": str(tmp_path / "kv"),
               "kv_offload_disk": 32 * (block + HEADER.size)} if tiers else {}
    live = LiveServer(tiny_bridge(tmp_path, kv_memory=24 * block, preemption=mode, **offload))
    try:
        pool = [f"{CORPUS[i % 3][:30 + 7 * i]} ({i})" for i in range(12)]
        traffic = asyncio.run(run_traffic(live.url, MODEL_ID, 60, 8, pool, [8, 24, 40], max_requests=8))
        cache = idle_cache(live.url)
        stats = cache["stats"]
        engine = live.bridge.engine
        assert dict(traffic.statuses) == {200: 64} and traffic.hangs == 0 and not traffic.errors
        assert traffic.left > 0 and len(traffic.completed) == 64 - traffic.left
        assert mismatches(engine.model, engine.tokenizer, traffic.completed) == []
        assert stats["preemptions"] > 0 and stats["swapped_out_blocks"] > 0
        assert leaked_blocks(cache) == 0 and cache["requests"] == []
        if tiers:  # the tiers served prompt tokens, stayed within budget, and changed no output
            assert stats["external_hits_tokens"] > 0
            assert all(0 < t["used"] <= t["budget"] for t in stats["tiers"])
    finally:
        live.stop()
    if tiers:
        assert 0 < tier_bytes(tmp_path / "kv") <= offload["kv_offload_disk"]
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "kvlab-swap-*"))) == before


def test_deterministic_server_answers_as_alone_in_bf16(tmp_path):
    """--deterministic under the same mixed traffic, in bf16 (where batching otherwise changes
    rounding): every completed output is bitwise its solo run in the same mode."""
    options = EngineOptions(block_size=8, kv_memory=24 * 8 * 256, preemption="swap-ram", deterministic=True)
    live = LiveServer(build_bridge(ModelOptions(str(make_tiny_model(tmp_path)), dtype="bf16", random_weights=True),
                                   options, served_model_name=MODEL_ID))
    try:
        pool = [f"{CORPUS[i % 3][:30 + 7 * i]} ({i})" for i in range(12)]
        traffic = asyncio.run(run_traffic(live.url, MODEL_ID, 60, 8, pool, [8, 24, 40], max_requests=6))
        engine = live.bridge.engine
        assert dict(traffic.statuses) == {200: 48} and traffic.hangs == 0 and not traffic.errors
        assert engine.metrics().preemptions > 0
        assert mismatches(engine.model, engine.tokenizer, traffic.completed, deterministic=True) == []
        assert leaked_blocks(idle_cache(live.url)) == 0
    finally:
        live.stop()
