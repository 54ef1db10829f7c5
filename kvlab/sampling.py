"""Sampling parameters and the sampler: turn the last position's logits into the next token.

Order (as Hugging Face's logits processors): temperature, top-k, top-p, min-p, then a draw from
the remaining distribution with the request's own ``torch.Generator`` (so a seed reproduces a
completion regardless of what else runs). Temperature 0 is greedy (argmax) and skips the rest.
Defaults follow vLLM's SamplingParams (temperature 1, no top-k/top-p/min-p filtering).

The engine samples a whole step at once (``sample_batch``): the filters take one parameter per
row, so every request's rows are filtered together, and only the draw runs row by row, each with
its request's generator. Every filter works on each row alone, so a row's probabilities, and a
seeded request's tokens, are the same in a batch as alone (``Sampler``).

Log-probabilities (``logprobs``, ``prompt_logprobs``) are vLLM's default "raw" ones: the
log-softmax in fp32 of the model's logits as they are, before temperature and the filters, so a
token's figure does not depend on how it was sampled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import Tensor


MAX_LOGPROBS = 20  # alternatives per token at most, as vLLM's default max_logprobs and OpenAI's


GREEDY_BELOW = 1e-5  # temperatures below this sample greedily

# logits a batched filter works on at once: 2**18 fp32 values (1 MiB) per tensor, which stay in
# cache. A small vocabulary gains most from batching (256: 64 rows 2x faster); at 49k (5 rows a
# chunk) the per-row sort and draw dominate and batching measured neither faster nor slower
CHUNK_ELEMENTS = 1 << 18


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
    def filters(self) -> tuple[bool, bool, bool]:
        """Whether the request turns top-k, top-p and min-p on (a batch groups rows by this)."""
        return self.top_k > 0, self.top_p < 1.0, self.min_p > 0.0

    @property
    def greedy(self) -> bool:
        """Temperature 0, or so close to it (as vLLM, below 1e-5) that the distribution is one-hot
        anyway and dividing the logits by it would overflow float32 into NaN probabilities."""
        return self.temperature < GREEDY_BELOW


Param = TypeVar("Param", int, float)


def _rows_of(value: Param | Sequence[Param], logits: Tensor) -> list[Param]:
    """A filter's parameter per row: one value for every row, or one per row."""
    return list(value) if isinstance(value, Sequence) else [value] * logits.shape[0]


def _operand(values: Sequence[float], like: Tensor) -> float | Tensor:
    """The rows' values as a filter's operand: a plain number when they share one (one op for
    all, as for a single request), else a [rows, 1] column in ``like``'s dtype (a Python number
    is cast to it too, so a row comes out the same either way)."""
    if len(set(values)) == 1:
        return values[0]
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]


def _on_rows(logits: Tensor, on: list[bool], apply: Callable[[Tensor, list[int]], Tensor]) -> Tensor:
    """``apply(rows, their indices)`` to the rows of ``logits`` where ``on`` holds; the others are
    left as they are and cost nothing. Each filter works on each row alone, so a row comes out the
    same whichever rows it is filtered with."""
    if all(on):
        return apply(logits, list(range(len(on))))
    index = [i for i, o in enumerate(on) if o]
    if not index:
        return logits
    out = logits.clone()
    out[index] = apply(logits[index], index)
    return out


def apply_top_k(logits: Tensor, k: int | Sequence[int]) -> Tensor:
    """Keep the k largest logits of each row (ties at the k-th value are kept), -inf elsewhere.
    ``k``: one for all rows or one per row; 0, -1 or >= the vocabulary leave a row alone."""
    ks = _rows_of(k, logits)

    def top_k(x: Tensor, index: list[int]) -> Tensor:
        depth = [ks[i] for i in index]  # each row's k-th largest value, from one topk as deep as the deepest
        values = torch.topk(x, max(depth), dim=-1).values
        kth = values[..., -1:] if len(set(depth)) == 1 else values.gather(
            -1, torch.tensor(depth, device=x.device)[:, None] - 1)
        return x.masked_fill(x < kth, float("-inf"))
    return _on_rows(logits, [0 < k < logits.shape[-1] for k in ks], top_k)


def apply_top_p(logits: Tensor, p: float | Sequence[float]) -> Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (nucleus).
    ``p``: one for all rows or one per row; 1 leaves a row alone."""
    ps = _rows_of(p, logits)

    def top_p(x: Tensor, index: list[int]) -> Tensor:
        sorted_logits, order = torch.sort(x, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        drop_sorted = before >= _operand([ps[i] for i in index], before)
        drop_sorted[..., 0] = False  # the top token always survives (even a p that rounds to 0 in float32)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        return x.masked_fill(drop, float("-inf"))
    return _on_rows(logits, [p < 1.0 for p in ps], top_p)


def apply_min_p(logits: Tensor, p: float | Sequence[float]) -> Tensor:
    """Drop tokens whose probability is below p times the most likely token's.
    ``p``: one for all rows or one per row; 0 leaves a row alone."""
    ps = _rows_of(p, logits)

    def min_p(x: Tensor, index: list[int]) -> Tensor:
        probs = x.softmax(dim=-1)
        threshold = _operand([ps[i] for i in index], probs) * probs.max(dim=-1, keepdim=True).values
        return x.masked_fill(probs < threshold, float("-inf"))
    return _on_rows(logits, [p > 0.0 for p in ps], min_p)


def filter_logits(logits: Tensor, temperature: float | Sequence[float], top_k: int | Sequence[int],
                  top_p: float | Sequence[float], min_p: float | Sequence[float]) -> Tensor:
    """float32 logits after temperature, top-k, top-p and min-p: each one value for all rows or
    one per row (temperature > 0: greedy rows never come here)."""
    x = logits.float()
    x = x / _operand(_rows_of(temperature, x), x)
    x = apply_top_k(x, top_k)
    x = apply_top_p(x, top_p)
    return apply_min_p(x, min_p)


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
        return filter_logits(logits, p.temperature, p.top_k, p.top_p, p.min_p)

    def draw(self, probs: Tensor) -> Tensor:
        """probabilities [B, vocab] -> token ids [B], from this sampler's generator."""
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)

    def __call__(self, logits: Tensor) -> Tensor:
        """logits [B, vocab] -> token ids [B]."""
        if self.params.greedy:
            return logits.argmax(dim=-1)
        return self.draw(self.filtered_logits(logits).softmax(dim=-1))


def sample_batch(logits: Tensor, samplers: Sequence[Sampler]) -> list[int | Exception]:
    """Row i of ``logits`` sampled by ``samplers[i]``: one token per row, or the exception that
    row's sampling raised (NaN logits, say), so that one request's failure is its own.

    Greedy rows take the first maximum. The others are filtered together, a chunk of rows per
    tensor op instead of a dozen ops per request, and drawn row by row, each from its own
    generator: a seeded request draws what it would alone."""
    rows = [i for i, s in enumerate(samplers) if not s.params.greedy]
    # every row's first maximum (the sampled rows' are overwritten below): max(-1).indices keeps
    # argmax's first-maximum rule and is 3-4x faster than argmax on bf16 CPU rows
    tokens: list[int | Exception] = (logits.max(-1).indices.tolist() if len(rows) < len(samplers)
                                     else [0] * len(samplers))
    # chunks of rows that turn on the same filters, so that each filter runs on all of a chunk's
    # rows or on none (no rows to pick out and put back)
    groups: dict[tuple[bool, bool, bool], list[int]] = {}
    for i in rows:
        groups.setdefault(samplers[i].params.filters, []).append(i)
    size = max(1, CHUNK_ELEMENTS // logits.shape[-1])
    chunks = [group[a:a + size] for group in groups.values() for a in range(0, len(group), size)]
    for chunk in chunks:
        params = [samplers[i].params for i in chunk]
        try:
            probs = filter_logits(logits[chunk], [p.temperature for p in params], [p.top_k for p in params],
                                  [p.top_p for p in params], [p.min_p for p in params]).softmax(dim=-1)
        except Exception as e:  # which row made the filters fail is unknown: the chunk's all do
            for i in chunk:
                tokens[i] = e
            continue
        for j, i in enumerate(chunk):
            try:
                tokens[i] = int(samplers[i].draw(probs[j:j + 1])[0])
            except Exception as e:
                tokens[i] = e
    return tokens


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
