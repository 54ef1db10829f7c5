"""What a request's sampled tokens become: streamed text and, at the end, a finish reason.

The plain loop (``kvlab.generate``) and the paged engine both feed each sampled token to one
``OutputProcessor``, so the stop rules exist once and the two paths end a request on the same
token with the same text:

    out = OutputProcessor(params, prompt_ids, model.eos_token_ids, tokenizer)
    delta = out.add(token)       # text this token adds ("" while something is held back)
    out.finish_reason            # None, "stop" or "length"

No model, no tensors: only token ids, the tokenizer and the request's SamplingParams.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

from kvlab.models.tokenizer import TextTokenizer
from kvlab.sampling import SamplingParams, StopStringMatcher

FinishReason = Literal["stop", "length"]


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, as vLLM does.

    Decoding one token at a time is wrong twice over: a multi-byte character split across tokens
    decodes to U+FFFD halves, and SentencePiece-style tokenizers drop a token's leading space
    unless it is decoded after its neighbour. So we decode a short window (a few prompt tokens
    for context, then everything not yet shown) and emit only the new suffix, holding back while
    the text ends in an incomplete character.
    """

    CONTEXT = 5  # prompt tokens decoded before the first new token, for correct spacing

    def __init__(self, tokenizer: TextTokenizer, prompt_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-self.CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):] if len(text) > len(prefix) else ""


class OutputProcessor:
    """One request's detokenising and stop checks, fed one sampled token at a time.

    The rules, in order: a stop token id (``params.stop_token_ids``, plus the model's EOS ids
    unless ``ignore_eos``) ends the request with "stop" and adds no text (the id itself still
    counts as generated, as vLLM reports it); otherwise the token's text goes through the
    stop-string matcher, and a stop string ends it with "stop" (the string and anything after it
    dropped); otherwise the ``max_new_tokens``-th token ends it with "length". When it ends, text
    still held back (an incomplete character, the start of a possible stop string) is released.

    Without a tokenizer there is no text: only stop ids and length apply (stop strings are
    refused up front, a user error, so the refusal is a ValueError).
    """

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], eos_token_ids: Iterable[int],
                 tokenizer: TextTokenizer | None = None, max_new_tokens: int | None = None) -> None:
        if params.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(eos_token_ids)
        self.stop_ids = frozenset(stop_ids)
        # the engine passes what its context leaves after the prompt when that is less
        self.max_new_tokens = params.max_tokens if max_new_tokens is None else max_new_tokens
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids) if tokenizer is not None else None
        self.matcher = StopStringMatcher(params.stop)
        self.num_tokens = 0
        self.text = ""  # everything shown so far
        self.finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, token: int) -> str:
        """Take the next sampled token; returns the text it adds to what was shown."""
        if self.finished:
            raise RuntimeError("token added after the request finished")
        self.num_tokens += 1
        delta = ""
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif self.detokenizer is not None:
            delta = self.matcher.feed(self.detokenizer.add(token))
            if self.matcher.stopped:
                self.finish_reason = "stop"
        if self.finish_reason is None and self.num_tokens >= self.max_new_tokens:
            self.finish_reason = "length"
        if self.finished and self.detokenizer is not None and not self.matcher.stopped:
            delta += self.matcher.feed(self.detokenizer.flush()) + self.matcher.flush()
        self.text += delta
        return delta
