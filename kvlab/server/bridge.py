"""The bridge between the asyncio server and the engine, which is single-threaded by design.

``LLMEngine`` is plain synchronous code: ``add_request``, ``step``, ``abort_request``. One
dedicated thread owns it and runs a loop: apply the commands the event loop queued (add, abort,
snapshot), step while anything is unfinished, hand each step's outputs back to the event loop in
one ``call_soon_threadsafe``. So the engine never sees two threads, the event loop never waits for a
forward pass, and a request added mid-step joins at the next step (continuous batching).

Each request is a ``RequestStream``: an async iterator of ``StepOutput``; closing it early (a
client disconnect) aborts the request, which frees its blocks before the next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from kvlab.bench import kernel_rate
from kvlab.engine.engine import LLMEngine, RequestOutput
from kvlab.engine.executor import WorkerError
from kvlab.models.chat import ChatTemplate, ChatTemplateError
from kvlab.models.tokenizer import ByteTokenizer, TextTokenizer
from kvlab.sampling import SamplingParams, TokenLogprob
from kvlab.server.errors import APIError
from kvlab.server.metrics import EngineGauges, ServerMetrics
from kvlab.server.views import block_map

log = logging.getLogger("kvlab.server")
T = TypeVar("T")
IDLE_POLL_S = 0.05  # how long the idle engine thread sleeps between looks at its command queue


@dataclass(frozen=True)
class StepOutput:
    """One request's update after a step: the text it adds and, at the end, its accounting."""

    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    num_output_tokens: int
    logprobs: list[TokenLogprob] | None = None  # the new tokens' (with params.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first output that has a token

    @classmethod
    def of(cls, out: RequestOutput) -> StepOutput:
        new = len(out.new_token_ids)
        first = new > 0 and len(out.token_ids) == new
        return cls(out.new_text, list(out.new_token_ids), out.finished, out.finish_reason,
                   len(out.prompt_token_ids), out.num_cached_tokens, len(out.token_ids),
                   out.logprobs[len(out.logprobs) - new:] if out.logprobs is not None else None,
                   out.prompt_logprobs if first else None)


class RequestStream:
    """An engine request seen from the event loop. Iterate for outputs; ``aclose`` aborts."""

    def __init__(self, bridge: EngineBridge, request_id: str) -> None:
        self.bridge, self.request_id = bridge, request_id
        self.queue: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()
        self.done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StepOutput:
        if self.done:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.done = True
            raise item
        self.done = item.finished
        return item

    async def aclose(self) -> None:
        if not self.done:
            self.done = True
            self.bridge.abort(self.request_id)


class EngineBridge:
    """Owns the engine thread; everything else talks to the engine through it."""

    def __init__(self, engine: LLMEngine, model_id: str, chat_template: ChatTemplate) -> None:
        self.engine = engine
        self.model_id = model_id
        self.chat_template = chat_template
        self.tokenizer: TextTokenizer = engine.tokenizer or ByteTokenizer(engine.model.spec.vocab_size)
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model.spec.vocab_size
        self.started = int(time.time())
        # the page's CPU plans compute at kvlab's kernel rate in the served activations mode:
        # measured here once (cached per CPU), before the engine thread runs beside it
        self.cpu_compute = (engine.model.activations, kernel_rate(engine.model.activations))
        self.metrics = ServerMetrics(lambda: self.gauges, {
            "dtype": str(engine.model.dtype).removeprefix("torch."), "activations": engine.model.activations,
            "deterministic": str(bool(engine.options.deterministic)).lower()})
        self.gauges = self._read_gauges()
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._arrival: dict[str, float] = {}
        self._last_token: dict[str, float] = {}
        self._next_id = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._shutdown_deadline: float | None = None  # set once the server is told to stop
        self.fatal: str | None = None  # why the engine stopped for good (its worker processes are gone)
        self.on_fatal: Callable[[], None] = lambda: None  # `kvlab serve` stops the server then

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread, bound to the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kvlab-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the engine thread; what the disk tier has queued is written before this returns."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.engine.tiers is not None:
            self.engine.tiers.flush()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shut_down(self, timeout_s: float) -> None:
        """Refuse new requests from now on; running ones get ``timeout_s`` to finish, then end
        with finish_reason "abort" (their streams close normally). Only sets a field, so a signal
        handler may call it."""
        if self._shutdown_deadline is None:
            self._shutdown_deadline = time.monotonic() + timeout_s

    @property
    def shutting_down(self) -> bool:
        return self._shutdown_deadline is not None

    def refuse_if_shutting_down(self) -> None:
        if self.shutting_down:
            raise APIError("the server is shutting down", 503, "server_error", code="shutting_down")

    # --- the event loop's side ------------------------------------------------------------------
    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread between two steps and await its result. If the
        awaiting coroutine is cancelled first (its client left), ``fn`` never runs."""
        if not self.alive:
            raise RuntimeError("the engine thread is not running")
        fut: Future[T] = Future()

        def run() -> None:
            # a cancelled future cannot take a result: setting one would raise on the engine thread
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the awaiting coroutine
                fut.set_exception(e)
        self._commands.put(run)
        return await asyncio.wrap_future(fut)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queue a request; ValueError (from the engine's admission check) if it can never run."""
        self.refuse_if_shutting_down()
        rid = f"req-{self._next_id}"
        self._next_id += 1
        stream = RequestStream(self, rid)

        def add() -> None:
            self.engine.add_request(prompt_ids, params, request_id=rid)
            self._streams[rid] = stream
            self._arrival[rid] = time.perf_counter()
        try:
            await self.call(add)
        except asyncio.CancelledError:  # the client left while the add was queued or running
            self.abort(rid)  # queued after the add: a no-op if it never ran, else it undoes it
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort from any thread; no-op if the request has already finished."""
        def run() -> None:
            if request_id in self.engine.requests:
                self.engine.abort_request(request_id)
                self.metrics.requests.labels("abort").inc()
            self._forget(request_id)
        self._commands.put(run)

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        try:
            return self.chat_template.encode(self.tokenizer, messages, add_generation_prompt)
        except ChatTemplateError as e:
            raise APIError(str(e), param="messages") from None

    def room_after(self, prompt_tokens: int) -> int:
        """Default max_tokens for chat: what the context and the whole cache leave (at least 1)."""
        cache_tokens = self.engine.capacity.tokens
        return max(1, min(self.max_model_len, cache_tokens) - prompt_tokens)

    # --- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            try:
                self._drain(block=not engine.has_unfinished())
                if self._shutdown_deadline is not None and time.monotonic() >= self._shutdown_deadline:
                    self._deliver([engine.abort_request(rid) for rid in list(engine.requests)])
                if not engine.has_unfinished():
                    continue
                self._deliver(engine.step())
                self.gauges = self._read_gauges()
            except WorkerError as e:  # tensor-parallel workers died or hung: nothing can run again
                log.error("engine stopped: %s", e)
                self.fatal = str(e)
                self._fail_all(e)
                self.on_fatal()
                return
            except Exception as e:  # a bug or OOM: fail what is in flight, keep serving
                log.exception("engine step failed")
                self._fail_all(e)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            cmd()
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
        self.gauges = self._read_gauges()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        batch: list[tuple[RequestStream, StepOutput | BaseException]] = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            self._observe(out, now)
            batch.append((stream, RuntimeError(f"engine error: {out.error}") if out.finish_reason == "error"
                           else StepOutput.of(out)))
            if out.finished:
                self._forget(out.request_id)
        if batch and self._loop is not None:
            self._loop.call_soon_threadsafe(_put_all, batch)

    def _observe(self, out: RequestOutput, now: float) -> None:
        rid, m = out.request_id, self.metrics
        last = self._last_token.get(rid)
        if out.new_token_ids:  # an abort brings no token: no latency to observe
            if last is None:
                m.ttft.observe(now - self._arrival.get(rid, now))
            else:
                m.itl.observe(now - last)
            self._last_token[rid] = now
        if out.finished:
            m.e2e.observe(now - self._arrival.get(rid, now))
            m.requests.labels(out.finish_reason or "stop").inc()
            m.prompt_tokens.inc(len(out.prompt_token_ids))
        m.generation_tokens.inc(len(out.new_token_ids))

    def _forget(self, rid: str) -> None:
        self._streams.pop(rid, None)
        self._arrival.pop(rid, None)
        self._last_token.pop(rid, None)

    def _fail_all(self, error: Exception) -> None:
        failed: list[tuple[RequestStream, StepOutput | BaseException]] = [
            (s, RuntimeError(f"engine error: {error}")) for s in self._streams.values()]
        for rid in list(self.engine.requests):
            try:
                self.engine.abort_request(rid)
            except Exception:  # keep freeing the others
                log.exception("abort of %s after an engine error failed", rid)
        for rid in list(self._streams):
            self._forget(rid)
        if failed and self._loop is not None:
            self._loop.call_soon_threadsafe(_put_all, failed)

    def _read_gauges(self) -> EngineGauges:
        m = self.engine.metrics()
        return EngineGauges(
            num_blocks=m.kv_blocks_total, used_blocks=m.kv_blocks_used, cached_blocks=m.kv_blocks_cached,
            block_size=self.engine.capacity.block_size, prefix_queries_tokens=m.prefix_cache_queries,
            prefix_hits_tokens=m.prefix_cache_hits, preemptions=m.preemptions,
            swapped_out_blocks=m.swapped_out_blocks, swapped_in_blocks=m.swapped_in_blocks,
            swap_fallbacks=m.swap_fallbacks, evicted_blocks=m.evicted_blocks,
            evicted_tokens=m.evicted_tokens, running=m.running, waiting=m.waiting, swapped=m.swapped,
            external_queries_tokens=m.prefix_cache_queries - m.prefix_cache_hits + m.tier_hits,
            external_hits_tokens=m.tier_hits, tiers=tuple(m.tiers))

    def block_map(self) -> dict[str, Any]:
        """The engine's block map (``views.block_map``) with the gauges; call through ``call``
        (engine thread only)."""
        g = self._read_gauges()
        stats = {**asdict(g), "usage": g.usage, "hit_rate": g.hit_rate,
                 "free_blocks": g.num_blocks - g.used_blocks - g.cached_blocks}
        return {**block_map(self.engine), "stats": stats}


def _put_all(batch: list[tuple[RequestStream, StepOutput | BaseException]]) -> None:
    for stream, item in batch:
        stream.queue.put_nowait(item)
