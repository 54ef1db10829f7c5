"""The OpenAI request and response shapes the server speaks (the subset kvlab implements).

Requests are validated here, at the edge, so bounds a client can get wrong (negative or absurd
numbers, too many stop strings, a malformed prompt) fail as one 400 naming the field, before any
tokenizer or engine work. Unknown fields are ignored, as OpenAI-compatible servers do, so clients
that send extras (``user``, ``logit_bias: null``) keep working; fields kvlab cannot honour
(penalties, suffix) are refused rather than silently dropped.

Log-probabilities follow vLLM: the fp32 log-softmax of the model's raw logits (before temperature
and top-k/top-p/min-p), so they describe the model, not the sampling; -inf is sent as -9999.0.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from kvlab.sampling import MAX_LOGPROBS, SamplingParams
from kvlab.server.errors import APIError

MAX_N = 16  # choices per request: each is a sequence in the engine
MAX_TOKENS_LIMIT = 1_000_000  # anything above is a typo; the model's context refuses less
MAX_PROMPTS = 64  # prompts in one /v1/completions batch

TokenId = Annotated[int, Field(ge=0)]
Stop = str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=4)] | None


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat; ``None`` means the OpenAI default."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM extension
    min_p: float | None = Field(None, ge=0, le=1)  # vLLM extension
    n: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    ignore_eos: bool | None = False  # vLLM extension: generate exactly max_tokens
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)

    def check_supported(self) -> None:
        """Refuse what kvlab would otherwise ignore, so a client never gets a silent no-op."""
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise APIError(f"{name} is not supported by kvlab", param=name, code="unsupported")

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(alternatives per generated token, per prompt token); None = not asked for."""
        return None, None

    def sampling(self, max_tokens: int, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not s for s in stop):
            raise APIError("stop strings must not be empty", param="stop")
        logprobs, prompt_logprobs = self.logprob_counts()
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, seed=self.seed, max_tokens=max_tokens, stop=stop,
            stop_token_ids=stop_token_ids, ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: (Annotated[str, Field(min_length=1)]
             | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_PROMPTS)])
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # top alternatives per token
    echo: bool | None = False  # the prompt before the completion (with logprobs: scored too)
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise APIError("suffix is not supported by kvlab", param="suffix", code="unsupported")

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids), OpenAI's four forms."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # validated when absent too: only an assistant message may come without content (OpenAI's
    # rule; its null content goes with tool calls), else a null user message would be an empty
    # prompt that generates to the context limit
    content: str | list[TextPart] | None = Field(None, validate_default=True)
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, content, info: ValidationInfo):
        role = info.data.get("role")  # absent when the role itself was invalid
        if content is None and role not in (None, "assistant"):
            raise PydanticCustomError("content_missing", "a {role} message needs content (a string or a "
                                      "list of text parts), not null", {"role": role})
        return content

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)]
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    add_generation_prompt: bool = True  # vLLM extension
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, None


# --- responses ---------------------------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()

    def add(self, prompt: int, completion: int, cached: int) -> None:
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        self.total_tokens += prompt + completion
        self.prompt_tokens_details.cached_tokens += cached


FinishReason = str | None  # stop | length | abort (the engine's), None until the last chunk


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token (prompt tokens first
    with echo; the first prompt token has no logprob). text_offset: where each token's text
    starts in the choice's text."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None  # UTF-8 of the token's text


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None


class ChatResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None


class ChatChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvlab"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
