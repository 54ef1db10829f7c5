"""Load on a live server over loopback: 64 concurrent streaming clients with mixed lengths, some
leaving early, against a cache too small for all of them at once (queueing, preemption, prefix
hits). Every client that stays gets exactly the greedy text of the plain loop run alone, nothing
answers 5xx, and afterwards no block is leaked. Bounded: 64 requests, a 90 s deadline."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from kvlab.generate import generate
from kvlab.sampling import SamplingParams
from tests.test_server_fixtures import MODEL_ID, LiveServer, tiny_bridge

CLIENTS = 64
DEADLINE_S = 90
SHARED = "the cache holds keys and values of every earlier token, "  # a common prefix: prefix hits


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    # 96 blocks x 8 tokens = 768 token slots for ~6,000 tokens of demand
    server = LiveServer(tiny_bridge(tmp_path_factory.mktemp("load"), kv_memory=96 * 8 * 512))
    yield server
    server.stop()


def _workload(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    jobs = []
    for i in range(CLIENTS):
        words = " ".join(rng.choice(["token", "cache", "block", "step", "key"]) for _ in range(rng.randint(1, 30)))
        prompt = (SHARED if i % 2 else "") + f"request {i}: {words}"
        leaves = i % 5 == 3  # about one in five disconnects after a few chunks
        jobs.append({"prompt": prompt, "max_tokens": rng.randint(100, 150) if leaves else rng.randint(4, 120),
                     "leave_after": rng.randint(1, 4) if leaves else None})
    return jobs


async def _client(http: httpx.AsyncClient, job: dict) -> dict:
    body = {"model": MODEL_ID, "prompt": job["prompt"], "max_tokens": job["max_tokens"], "temperature": 0,
            "ignore_eos": True, "stream": True}
    text, chunks, finish = "", 0, None
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "body": (await r.aread()).decode()}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
            chunks += 1
            if job["leave_after"] is not None and chunks >= job["leave_after"]:
                break  # leaving the block closes the connection mid-stream
    return {"status": 200, "text": text, "finish": finish, "left": job["leave_after"] is not None}


async def _run_all(url: str, jobs: list[dict]) -> list[dict]:
    limits = httpx.Limits(max_connections=CLIENTS + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=DEADLINE_S, limits=limits) as http:
        return await asyncio.wait_for(asyncio.gather(*(_client(http, j) for j in jobs)), DEADLINE_S)


def test_64_concurrent_streams(live):
    jobs = _workload()
    t0 = time.monotonic()
    results = asyncio.run(_run_all(live.url, jobs))
    elapsed = time.monotonic() - t0
    assert [r["status"] for r in results] == [200] * CLIENTS, [r for r in results if r["status"] != 200][:3]

    # every client that stayed got the plain loop's greedy text, run alone
    bridge = live.bridge
    model, tok = bridge.engine.model, bridge.tokenizer
    stayed = [(j, r) for j, r in zip(jobs, results, strict=True) if not r["left"]]
    assert len(stayed) >= CLIENTS * 3 // 4
    for job, res in stayed:
        alone = generate(model, tok.encode(job["prompt"]),
                         SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True), tok)
        assert res["finish"] == "length" and res["text"] == alone.text, job["prompt"]

    # afterwards: nothing running, every block free or cached, and the run really used the cache
    with httpx.Client(base_url=live.url, timeout=30) as http:
        deadline = time.monotonic() + 10
        while True:
            cache = http.get("/api/cache").json()
            if not cache["requests"] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        metrics = http.get("/metrics").text
        assert http.get("/health").status_code == 200
    s = cache["stats"]
    assert cache["requests"] == [] and s["running"] == s["waiting"] == s["swapped"] == 0
    assert s["used_blocks"] == 0
    assert all(set(g["blocks"]) <= {"f", "c"} for g in cache["groups"])  # free or cached, none in use
    assert s["prefix_hits_tokens"] > 0 and s["preemptions"] > 0  # shared prefixes; a cache under pressure
    aborted = sum(1 for r in results if r["left"])
    assert f'kvlab_requests_total{{finish_reason="abort"}} {float(aborted)}' in metrics
    assert elapsed < DEADLINE_S
