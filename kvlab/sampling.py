"""Sampling parameters and the sampler: turn the last position's logits into the next token.

Order (as Hugging Face's logits processors): temperature, top-k, top-p, min-p, then a draw from
the remaining distribution with the request's own ``torch.Generator`` (so a seed reproduces a
completion regardless of what else runs). Temperature 0 is greedy (argmax) and skips the rest.
Defaults follow vLLM's SamplingParams (temperature 1, no top-k/top-p/min-p filtering).

Log-probabilities (``logprobs``, ``prompt_logprobs``) are vLLM's default "raw" ones: the
log-softmax in fp32 of the model's logits as they are, before temperature and the filters, so a
token's figure does not depend on how it was sampled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


MAX_LOGPROBS = 20  # alternatives per token at most, as vLLM's default max_logprobs and OpenAI's


GREEDY_BELOW = 1e-5  # temperatures below this sample greedily


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Invalid values raise ValueError on construction."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()  # stop strings (not included in the output)
    stop_token_ids: tuple[int, ...] = ()  # extra stop ids, besides the model's EOS ids
    ignore_eos: bool = False
    logprobs: int | None = None  # per generated token: its log-probability and the N most likely
    prompt_logprobs: int | None = None  # the same for each prompt token after the first

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 1 (0 or -1 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**64):  # torch.Generator's range
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {n!r}")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or so close to it (as vLLM, below 1e-5) that the distribution is one-hot
        anyway and dividing the logits by it would overflow float32 into NaN probabilities."""
        return self.temperature < GREEDY_BELOW


def apply_top_k(logits: Tensor, k: int) -> Tensor:
    """Keep the k largest logits of each row (ties at the k-th value are kept), -inf elsewhere."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: Tensor, p: float) -> Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (nucleus)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    drop_sorted = before >= p
    drop_sorted[..., 0] = False  # the top token always survives (even a p that rounds to 0 in float32)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: Tensor, p: float) -> Tensor:
    """Drop tokens whose probability is below p times the most likely token's."""
    if p <= 0.0:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


class Sampler:
    """Samples one token per row of logits, with its own generator when seeded."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu") -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(params.seed)

    def filtered_logits(self, logits: Tensor) -> Tensor:
        """float32 logits after temperature, top-k, top-p and min-p (for tests and inspection)."""
        p = self.params
        x = logits.float() / p.temperature
        x = apply_top_k(x, p.top_k)
        x = apply_top_p(x, p.top_p)
        return apply_min_p(x, p.min_p)

    def __call__(self, logits: Tensor) -> Tensor:
        """logits [B, vocab] -> token ids [B]."""
        if self.params.greedy:
            return logits.argmax(dim=-1)
        probs = self.filtered_logits(logits).softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability at its position, its rank there, and the most likely tokens."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first


def token_logprobs(logits: Tensor, token_ids: Sequence[int], top: int) -> list[TokenLogprob]:
    """Row i of ``logits`` scored at ``token_ids[i]``, with the ``top`` most likely tokens.

    fp32 log-softmax of the logits as given (no temperature or filters: vLLM's raw logprobs);
    ties in the top list keep torch.topk's order."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=lp.device)
    chosen = lp.gather(-1, ids[:, None])
    ranks = (lp > chosen).sum(-1) + 1
    best_v, best_i = lp.topk(top, dim=-1)
    return [TokenLogprob(t, c, r, tuple(zip(bi, bv)))
            for t, c, r, bi, bv in zip(ids.tolist(), chosen[:, 0].tolist(), ranks.tolist(),
                                       best_i.tolist(), best_v.tolist(), strict=True)]


@dataclass
class StopStringMatcher:
    """Streams text while watching for stop strings that may span several tokens.

    ``feed(text)`` takes the next piece of decoded text and returns what can safely be shown:
    text that might be the start of a stop string is held back until it is decided. Once a stop
    string appears, ``stopped`` is set and everything from the stop string on is dropped.
    ``flush()`` releases the held text at the end of generation.
    """

    stops: tuple[str, ...]
    stopped: bool = False
    _pending: str = field(default="", repr=False)

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        buf = self._pending + text
        # The stop string that completes first wins (ties: the longer one), so the result does
        # not depend on how the text was cut into tokens.
        hits = [(i + len(s), i) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            return buf[: min(hits)[1]]
        hold = 0
        for s in self.stops:  # longest suffix of buf that is a proper prefix of a stop string
            for n in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:n]):
                    hold = n
                    break
        self._pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return "" if self.stopped else out
