"""Faults the server must survive, injected: a swap file that cannot be written, a request whose
own work raises inside the engine, requests the engine refuses, and SIGTERM while streaming.

Each fault is checked for what a user would see (a clean error or the same greedy text as a solo
run) and for what must not happen (a leaked block, a stuck engine, a swap file left behind)."""

from __future__ import annotations

import asyncio
import errno
import glob
import json
import os
import signal
import tempfile
import time

import httpx
import pytest

from benchmarks.soak import serve_process
from kvlab.engine.engine import LLMEngine, RequestOutput
from kvlab.generate import generate
from kvlab.sampling import SamplingParams
from tests.test_server_fixtures import MODEL_ID, LiveServer, tiny_bridge

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
PROMPTS = ["the cache holds keys", "hello there, how can", "values of every earlier token",
           "héllo wörld 日本語", "so each step computes one", "user: hello\nassistant:"]


def _drain(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step until every request finished (bounded); request id -> its final output."""
    final = {}
    for _ in range(5000):
        if not engine.has_unfinished():
            return final
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    raise AssertionError("the engine did not finish within the step bound")


def _solo(engine: LLMEngine, prompt: str, params: SamplingParams = GREEDY) -> str:
    return generate(engine.model, engine.tokenizer.encode(prompt), params, engine.tokenizer).text


def _assert_idle(engine: LLMEngine) -> None:
    m = engine.metrics()
    assert m.kv_blocks_used == 0 and m.running == m.waiting == m.swapped == 0
    assert engine.requests == {} and engine.scheduler.requests == {}
    assert all(len(free) == engine.kv.num_host_blocks for free in engine.kv.host_free)  # host pool whole


def _swap_files() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "kvlab-swap-*")))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


# 12 blocks x 8 tokens for six 40-token requests of ~50 tokens each: constant preemption
SMALL = {"kv_memory": 12 * 8 * 512, "preemption": "swap-disk"}


@pytest.mark.parametrize("fault", [errno.ENOSPC, errno.EACCES, errno.EROFS],
                         ids=["disk-full", "permission-lost", "read-only"])
def test_swap_disk_write_failure_falls_back_to_recompute(folder, fault):
    before = _swap_files()
    engine = tiny_bridge(folder, **SMALL).engine
    assert _swap_files() == before  # the swap file is unlinked as soon as it exists
    swap = engine.cache.swap_file
    real_write, writes = swap.write, []

    def failing_write(data, offset):  # the first swap-outs succeed, then the disk "fails" mid-run
        writes.append(offset)
        if len(writes) > 16:
            raise OSError(fault, os.strerror(fault))
        real_write(data, offset)
    swap.write = failing_write
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    final = _drain(engine)
    m = engine.metrics()
    assert m.swapped_out_blocks > 0 and m.swap_fallbacks > 0  # both paths ran
    assert m.swapped_in_blocks == m.swapped_out_blocks  # what reached the swap file came back
    for prompt, rid in zip(PROMPTS, ids, strict=True):
        assert final[rid].finish_reason == "length" and final[rid].text == _solo(engine, prompt)  # nothing lost
    _assert_idle(engine)
    assert _swap_files() == before


def test_a_request_whose_own_work_raises_fails_alone(folder):
    engine = tiny_bridge(folder).engine
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS[:3]]
    broken = engine.add_request("the cache holds keys", SamplingParams(temperature=0.8, seed=7, max_tokens=20))
    sampler, calls = engine.requests[broken].sampler, []
    draw = sampler.draw

    def nan_after_three(probs):  # what torch.multinomial says when a row is all NaN
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return draw(probs)
    sampler.draw = nan_after_three  # type: ignore[method-assign]
    final = _drain(engine)
    assert final[broken].finish_reason == "error" and "nan" in final[broken].error
    assert len(final[broken].token_ids) == 3
    for prompt, rid in zip(PROMPTS[:3], ids, strict=True):
        assert final[rid].text == _solo(engine, prompt)  # the batch it shared went on unchanged
    _assert_idle(engine)


def _seed_past_validation() -> SamplingParams:
    """A seed torch cannot take (>= 2**64) smuggled past SamplingParams' own check: what a caller
    mutating a frozen dataclass would hand in; the Sampler raises inside add_request."""
    params = SamplingParams(temperature=0.5, max_tokens=8)
    object.__setattr__(params, "seed", 2**64)
    return params


REFUSED = {
    "token id past the vocabulary": (lambda e: e.add_request([5, 10_000], GREEDY), ValueError),
    "negative token id": (lambda e: e.add_request([5, -1], GREEDY), ValueError),
    "empty prompt": (lambda e: e.add_request([], GREEDY), ValueError),
    "prompt longer than max_model_len": (lambda e: e.add_request([5] * 300, GREEDY), ValueError),
    "more blocks than the cache": (lambda e: e.add_request([5] * 10, SamplingParams(max_tokens=200)), ValueError),
    "request id in use": (lambda e: e.add_request("hello", GREEDY, request_id="taken"), ValueError),
    "seed torch cannot take": (lambda e: e.add_request("hello", _seed_past_validation()), ValueError),
}


def test_sampling_params_refuse_a_seed_torch_cannot_take():
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)
    SamplingParams(seed=2**64 - 1)  # the largest torch.Generator takes


@pytest.mark.parametrize("kind", list(REFUSED))
def test_add_request_is_all_or_nothing(folder, kind):
    engine = tiny_bridge(folder, kv_memory=16 * 8 * 512).engine  # 16 blocks: 200 new tokens do not fit
    taken = engine.add_request("the cache holds keys", GREEDY, request_id="taken")
    add, error = REFUSED[kind]
    with pytest.raises(error):
        add(engine)
    assert set(engine.requests) == set(engine.scheduler.requests) == {"taken"}  # no orphan
    final = _drain(engine)  # the engine keeps serving: the earlier request and a later one
    assert final[taken].text == _solo(engine, "the cache holds keys")
    later = engine.add_request("values of every earlier token", GREEDY)
    assert _drain(engine)[later].text == _solo(engine, "values of every earlier token")
    _assert_idle(engine)


async def _stream(http: httpx.AsyncClient, max_tokens: int, started: asyncio.Event) -> dict:
    body = {"model": "austen", "prompt": "It is a truth universally acknowledged", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    events = []
    async with http.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
    return {"status": r.status_code, "done": events[-1:] == ["[DONE]"], "finish": next(filter(None, finish), None)}


def test_sigterm_while_streaming_refuses_new_requests_ends_running_ones_and_exits_0():
    """Three long streams on one sequence slot (two wait), SIGTERM once tokens flow: a new request
    is refused, every stream still ends with a finish reason and [DONE] (finished, or ended at
    the 1 s shutdown timeout), and the process exits 0."""
    args = ["austen-demo", "--dtype", "fp32", "--threads", "1", "--max-num-seqs", "1", "--shutdown-timeout", "1",
            "--served-model-name", "austen"]

    async def scenario(server) -> tuple[list[dict], object]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            started = asyncio.Event()
            streams = [asyncio.create_task(_stream(http, 900, started)) for _ in range(3)]
            await asyncio.wait_for(started.wait(), 60)
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.05)
            # a new connection: refused once uvicorn closed its socket, closed unanswered when it was
            # accepted just before, else answered 503
            try:
                async with httpx.AsyncClient(base_url=server.url, timeout=10) as fresh:
                    late = (await fresh.post("/v1/completions", json={"model": "austen", "prompt": "x"})).status_code
            except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                late = "refused"
            results = await asyncio.wait_for(asyncio.gather(*streams), 30)
            return results, (late, time.monotonic() - t0)

    with serve_process(args) as server:
        results, (late, ended_s) = asyncio.run(scenario(server))
        status = server.proc.wait(30)
    assert late in ("refused", 503)
    assert all(r["status"] == 200 and r["done"] for r in results), results
    assert {r["finish"] for r in results} <= {"length", "abort"} and "abort" in {r["finish"] for r in results}
    assert ended_s < 10 and status == 0


def test_a_client_leaving_while_its_requests_queue_harms_no_one(folder):
    """A non-streaming client (n=4) gives up while its adds wait behind a busy engine thread: those
    adds never run, and a stream already in flight finishes untouched (a cancelled add once
    raised on the engine thread and failed every request in flight)."""
    live = LiveServer(tiny_bridge(folder))
    body = {"model": MODEL_ID, "prompt": "the cache holds keys", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True}

    async def scenario() -> tuple[list[dict], str]:
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as http:
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                lines = r.aiter_lines()
                first = await anext(lines)  # the stream is running
                live.bridge._commands.put(lambda: time.sleep(1.0))  # the engine thread is busy for 1 s
                with pytest.raises(httpx.ReadTimeout):
                    await http.post("/v1/completions", json={**body, "n": 4}, timeout=0.2)
                events = [json.loads(line[6:]) async for line in lines
                          if line.startswith("data: ") and line != "data: [DONE]"]
                events.insert(0, json.loads(first[6:]))
        return events, "".join(e["choices"][0]["text"] for e in events if "choices" in e)

    try:
        events, text = asyncio.run(scenario())
        assert all("error" not in e for e in events) and events[-1]["choices"][0]["finish_reason"] == "length"
        engine = live.bridge.engine
        assert text == generate(engine.model, engine.tokenizer.encode(body["prompt"]),
                                SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), engine.tokenizer).text
        deadline = time.monotonic() + 10
        while engine.requests and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.requests == {} and engine.metrics().kv_blocks_used == 0
    finally:
        live.stop()
