"""The OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Each choice (prompt x n) is one engine request. Non-streaming responses gather the choices;
streaming ones interleave them as server-sent events in the order tokens arrive. Leaving a
response early (the client went away, or a sibling choice failed) closes every choice's stream,
which aborts its engine request and frees its blocks.

Log-probabilities come from the engine (``kvlab.sampling.token_logprobs``: raw logits, fp32, as
vLLM); here they are only dressed in OpenAI's two shapes, completions' parallel lists and chat's
``content`` entries, streaming included.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Sequence
from contextlib import AsyncExitStack
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from kvlab.models.tokenizer import TextTokenizer
from kvlab.sampling import SamplingParams, TokenLogprob
from kvlab.server.auth import require_api_key
from kvlab.server.bridge import EngineBridge, RequestStream, StepOutput
from kvlab.server.errors import APIError
from kvlab.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunk,
    ChatChunkChoice,
    ChatLogprobs,
    ChatRequest,
    ChatResponse,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Delta,
    ModelCard,
    ModelList,
    SamplingFields,
    TopLogprob,
    Usage,
    new_id,
)

T = TypeVar("T")
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


def bridge_of(request: Request) -> EngineBridge:
    return request.app.state.bridge


def require_json(request: Request) -> None:
    """A POST body must be JSON. Without this check a text/plain body reaches validation as
    bytes and the client reads "Input should be a valid dictionary", which never names the cause."""
    ctype = request.headers.get("content-type")
    if request.method != "POST" or ctype is None:  # no header: FastAPI reads the body as JSON
        return
    media = ctype.split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise APIError(f"the request body must be JSON sent with Content-Type: application/json, "
                       f"not {media or 'an empty content type'}", 415, code="unsupported_media_type")


router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key), Depends(require_json)])
LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM sends this floor instead


class SSEResponse(StreamingResponse):
    """A text/event-stream response that always closes its generator, however the stream ends.

    Starlette cancels the body on disconnect under ASGI < 2.4 but under 2.4 only stops iterating,
    leaving the generator to the garbage collector; closing it here makes the abort (and the
    freed blocks) immediate either way."""

    def __init__(self, content: AsyncGenerator[str, None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()


def _event(payload: BaseModel | str) -> str:
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


def _check_model(bridge: EngineBridge, name: str) -> None:
    if name != bridge.model_id:
        raise APIError(f"the model {name!r} does not exist; this server serves {bridge.model_id!r}",
                       404, "not_found_error", "model", "model_not_found")


def _choice_params(req: SamplingFields, max_tokens: int, n: int) -> list[SamplingParams]:
    """One SamplingParams per choice; with a seed, choice i uses seed + i so choices differ yet
    each is reproducible."""
    try:
        base = req.sampling(max_tokens)
    except ValueError as e:
        raise APIError(str(e)) from None
    if base.seed is None:
        return [base] * n
    return [replace(base, seed=base.seed + i) for i in range(n)]


async def _merge(streams: Sequence[AsyncIterator[StepOutput]]) -> AsyncIterator[tuple[int, StepOutput]]:
    """Interleave several streams as their items arrive, tagged by stream index."""
    queue: asyncio.Queue[tuple[int, StepOutput | None | BaseException]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[StepOutput]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
            await queue.put((i, None))
        except Exception as e:  # re-raised in the consumer
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _start(bridge: EngineBridge, stack: AsyncExitStack, prompts: list[list[int]],
                 params: list[SamplingParams], param: str) -> list[RequestStream]:
    """Submit every (prompt, choice) pair; the stack closes (aborts) them all on the way out."""
    limit = bridge.max_model_len
    for ids in prompts:
        if len(ids) + params[0].max_tokens > limit:
            raise APIError(f"this model's maximum context length is {limit} tokens; the prompt has "
                           f"{len(ids)} and max_tokens asks for {params[0].max_tokens} more",
                           param=param, code="context_length_exceeded")
    streams: list[RequestStream] = []
    for ids in prompts:
        for p in params:
            try:
                stream = await bridge.generate(ids, p)
            except ValueError as e:
                raise APIError(str(e), param=param, code="context_length_exceeded") from None
            streams.append(stream)
            stack.push_async_callback(stream.aclose)
    return streams


class _Logprobs:
    """The engine's TokenLogprobs in OpenAI's shapes; a token's text is its decoded id."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def completion(self, tokens: Sequence[tuple[int, TokenLogprob | None]],
                   offset: int = 0) -> tuple[CompletionLogprobs, int]:
        """The legacy lists for (token id, logprob) pairs whose text starts at ``offset`` of the
        choice's text; returns them and the offset after the last token. As vLLM, each
        top_logprobs entry lists the chosen token too, even when it is not among the top N."""
        out = CompletionLogprobs()
        for token_id, lp in tokens:
            text = self._text(token_id)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            if lp is None:  # the first prompt token: nothing before it to predict it
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(max(lp.logprob, LOGPROB_FLOOR))
            top = {self._text(t): max(v, LOGPROB_FLOOR) for t, v in lp.top}
            top.setdefault(text, max(lp.logprob, LOGPROB_FLOOR))
            out.top_logprobs.append(top)
        return out, offset

    def _entry(self, token_id: int, logprob: float) -> TopLogprob:
        text = self._text(token_id)
        return TopLogprob(token=text, logprob=max(logprob, LOGPROB_FLOOR), bytes=list(text.encode()))

    def chat(self, tokens: Sequence[TokenLogprob]) -> ChatLogprobs:
        return ChatLogprobs(content=[
            ChatTokenLogprob(**dict(self._entry(lp.token_id, lp.logprob)),
                             top_logprobs=[self._entry(t, v) for t, v in lp.top])
            for lp in tokens])


class _Tally:
    """Text, logprobs, finish reason and usage of each choice as outputs arrive."""

    def __init__(self, n_choices: int, n: int) -> None:
        self.n = n
        self.text = [""] * n_choices
        self.logprobs: list[list[TokenLogprob]] = [[] for _ in range(n_choices)]
        self.prompt_logprobs: list[list[TokenLogprob | None] | None] = [None] * n_choices
        self.finish: list[str | None] = [None] * n_choices
        self.usage = Usage()

    def add(self, i: int, out: StepOutput) -> None:
        self.text[i] += out.text
        self.logprobs[i] += out.logprobs or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[i] = out.prompt_logprobs
        if out.finished:
            self.finish[i] = out.finish_reason
            first_choice = i % self.n == 0  # a prompt is counted once, however many choices
            self.usage.add(out.prompt_tokens if first_choice else 0, out.num_output_tokens,
                           out.cached_tokens if first_choice else 0)


async def _collect(bridge: EngineBridge, prompts: list[list[int]], params: list[SamplingParams], n: int,
                   param: str) -> _Tally:
    """Run every choice to the end (a non-streaming response)."""
    async with AsyncExitStack() as stack:
        streams = await _start(bridge, stack, prompts, params, param)
        tally = _Tally(len(streams), n)
        async for i, out in _merge(streams):
            tally.add(i, out)
        return tally


async def _unless_gone(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Await ``work``, cancelling it if the client hangs up first: a non-streaming client that
    times out must not leave its requests holding blocks until max_tokens."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise APIError("the client disconnected", 499, code="client_disconnected")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _tokenize_prompts(bridge: EngineBridge, req: CompletionRequest) -> list[list[int]]:
    out = []
    for p in req.prompts():
        ids = bridge.tokenizer.encode(p) if isinstance(p, str) else list(p)
        vocab = bridge.vocab_size
        if any(i >= vocab for i in ids):
            raise APIError(f"prompt token ids must be below the vocabulary size {vocab}", param="prompt")
        out.append(ids)
    return out


@router.get("/models")
async def models(request: Request) -> ModelList:
    """max_model_len is what one request can really reach: less than the model's context when
    `--kv-memory` leaves too few blocks for a full-length request (asked of the engine)."""
    b = bridge_of(request)
    longest = await b.call(b.engine.longest_request)
    return ModelList(data=[ModelCard(id=b.model_id, created=b.started, max_model_len=longest)])


@router.post("/completions", response_model=None)
async def completions(req: CompletionRequest, request: Request) -> CompletionResponse | SSEResponse:
    bridge = bridge_of(request)
    _check_model(bridge, req.model)
    req.check_supported()
    prompts = _tokenize_prompts(bridge, req)
    echoes = [p if isinstance(p, str) else bridge.tokenizer.decode(list(p)) for p in req.prompts()]
    n = req.n or 1
    params = _choice_params(req, req.max_tokens or 16, n)
    rid, model = new_id("cmpl"), bridge.model_id
    conv = _Logprobs(bridge.tokenizer)

    def response(choices: list[CompletionChoice], usage: Usage | None) -> CompletionResponse:
        return CompletionResponse(id=rid, model=model, choices=choices, usage=usage)

    def choice(i: int, text: str, echo: bool, prompt_lps: Sequence[TokenLogprob | None] | None,
               lps: Sequence[TokenLogprob], finish: str | None, offset: int = 0) -> tuple[CompletionChoice, int]:
        """Choice i's text (after the prompt if ``echo``) and its logprobs from ``offset`` on."""
        tokens: list[tuple[int, TokenLogprob | None]] = [(lp.token_id, lp) for lp in lps]
        if echo:
            text = echoes[i // n] + text
            prompt = prompts[i // n]  # scored unless the request ended before its first token
            tokens = list(zip(prompt, prompt_lps or [None] * len(prompt), strict=True)) + tokens
        logprobs = None
        if req.logprobs is not None:
            logprobs, offset = conv.completion(tokens, offset)
        return CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=finish), offset

    if req.stream:
        offsets: dict[int, int] = {}  # choice -> where its next token's text starts

        def chunk(i: int, out: StepOutput) -> CompletionResponse:
            echo = bool(req.echo) and i not in offsets  # the prompt goes with the choice's first event
            c, offsets[i] = choice(i, out.text, echo, out.prompt_logprobs, out.logprobs or [],
                                   out.finish_reason, offsets.get(i, 0))
            return response([c], None)
        return await _stream(bridge, prompts, params, n, req.include_usage, "prompt", response, chunk)
    tally = await _unless_gone(request, _collect(bridge, prompts, params, n, "prompt"))
    return response([choice(i, tally.text[i], bool(req.echo), tally.prompt_logprobs[i], tally.logprobs[i],
                            tally.finish[i])[0] for i in range(len(tally.text))], tally.usage)


def _chat_prompt(bridge: EngineBridge, req: ChatRequest) -> list[int]:
    messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                for m in req.messages]
    return bridge.encode_chat(messages, req.add_generation_prompt)


@router.post("/chat/completions", response_model=None)
async def chat(req: ChatRequest, request: Request) -> ChatResponse | SSEResponse:
    bridge = bridge_of(request)
    _check_model(bridge, req.model)
    req.check_supported()
    ids = _chat_prompt(bridge, req)
    n = req.n or 1
    max_tokens = req.max_completion_tokens or req.max_tokens or bridge.room_after(len(ids))
    params = _choice_params(req, max_tokens, n)
    rid, model = new_id("chatcmpl"), bridge.model_id

    conv = _Logprobs(bridge.tokenizer)

    if req.stream:
        def chunk(i: int, out: StepOutput) -> ChatChunk:
            return ChatChunk(id=rid, model=model, choices=[ChatChunkChoice(
                index=i, delta=Delta(content=out.text), finish_reason=out.finish_reason,
                logprobs=conv.chat(out.logprobs) if out.logprobs is not None else None)])

        def final(choices: list, usage: Usage | None) -> ChatChunk:
            return ChatChunk(id=rid, model=model, choices=choices, usage=usage)

        first = [ChatChunk(id=rid, model=model, choices=[
            ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))]) for i in range(n)]
        return await _stream(bridge, [ids], params, n, req.include_usage, "messages", final, chunk, first)
    tally = await _unless_gone(request, _collect(bridge, [ids], params, n, "messages"))
    return ChatResponse(id=rid, model=model, usage=tally.usage, choices=[
        ChatChoice(index=i, message=AssistantMessage(content=t), finish_reason=f,
                   logprobs=conv.chat(tally.logprobs[i]) if req.logprobs else None)
        for i, (t, f) in enumerate(zip(tally.text, tally.finish, strict=True))])


async def _stream(bridge: EngineBridge, prompts: list[list[int]], params: list[SamplingParams], n: int,
                  include_usage: bool, param: str, final: Callable[[list, Usage | None], BaseModel],
                  chunk: Callable[[int, StepOutput], BaseModel], first: Sequence[BaseModel] = ()) -> SSEResponse:
    """Submit before answering, so an impossible request is a 400, not a broken stream; then
    stream one event per output, a usage event if asked, and [DONE]."""
    stack = AsyncExitStack()
    try:
        streams = await _start(bridge, stack, prompts, params, param)
    except BaseException:
        await stack.aclose()
        raise

    async def events() -> AsyncGenerator[str, None]:
        async with stack:
            tally = _Tally(len(streams), n)
            for c in first:
                yield _event(c)
            try:
                async for i, out in _merge(streams):
                    tally.add(i, out)
                    if out.text or out.finished or out.logprobs:  # a token held back still has a logprob
                        yield _event(chunk(i, out))
            except RuntimeError as e:  # the engine failed mid-stream: the status is sent, say so in-band
                yield _event(json.dumps(APIError(str(e), 500, "server_error").body()))
                return
            if include_usage:
                yield _event(final([], tally.usage))
            yield _event("[DONE]")

    return SSEResponse(events())
