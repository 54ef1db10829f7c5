"""The built-in policies, one class each (see ``kvlab.eviction`` for what each keeps and why)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvlab.eviction.base import EvictionPolicy

if TYPE_CHECKING:
    from torch import Tensor

SNAPKV_POOL = 7  # SnapKV's pooling kernel over positions


@dataclass(frozen=True)
class Full(EvictionPolicy):
    """No eviction: every token stays (its budget, if given, is ignored)."""

    name = "full"
    active = False

    def keep(self, kept: Tensor, n: int, unit: int, scores: Tensor | None) -> Tensor:
        return kept


@dataclass(frozen=True)
class Window(EvictionPolicy):
    """The most recent tokens only: the base class's default (the lesson's failure case: the
    first tokens, where attention piles up, are lost)."""

    name = "window"


@dataclass(frozen=True)
class Streaming(EvictionPolicy):
    """``sinks`` first tokens + the most recent (StreamingLLM, arXiv 2309.17453)."""

    name = "streaming"
    sinks: int = 4

    def sink_units(self, unit: int) -> int:
        return math.ceil(self.sinks / unit)

    def least_budget(self, unit: int) -> int:
        return (self.sink_units(unit) + 1) * unit

    def split(self, n: int, unit: int) -> tuple[int, int]:
        sink_units = self.sink_units(unit)
        return sink_units, self.allowed_units(n, unit) - sink_units


@dataclass(frozen=True)
class H2O(EvictionPolicy):
    """Half the budget for the recent tokens, half for the heavy hitters: the tokens with the
    most attention accumulated over every query so far (arXiv 2306.14048)."""

    name = "h2o"
    needs_scores = True

    def voters(self, num_prompt_tokens: int) -> range | None:
        return range(0, 2**62)  # every query, prompt and generated

    def split(self, n: int, unit: int) -> tuple[int, int]:
        return 0, max(1, self.allowed_units(n, unit) // 2)

    def votes(self, scores: Tensor) -> Tensor | None:
        return scores


@dataclass(frozen=True)
class SnapKV(EvictionPolicy):
    """Once the prompt is in, its last ``obs_window`` positions vote (attention summed over
    ``SNAPKV_POOL`` neighbouring positions) for the earlier tokens worth keeping, + the recent
    window (arXiv 2404.14469). Tokens generated later have no votes: they leave in age order."""

    name = "snapkv"
    needs_scores = True
    waits_for_prompt = True
    obs_window: int = 32

    def voters(self, num_prompt_tokens: int) -> range | None:
        return range(max(0, num_prompt_tokens - self.obs_window), num_prompt_tokens)

    def split(self, n: int, unit: int) -> tuple[int, int]:
        recent = max(1, math.ceil(self.obs_window / unit))
        return 0, min(recent, self.allowed_units(n, unit))  # a window wider than the budget is the budget

    def votes(self, scores: Tensor) -> Tensor | None:
        return _pooled(scores)


@dataclass(frozen=True)
class AdaKV(SnapKV):
    """SnapKV's votes cast by each layer's query heads apart, a token's score its best head's:
    the adaptive per-head budgets of Ada-KV (arXiv 2407.11550) in a cache whose blocks every head
    shares. Ada-KV gives each head the share of a layer's budget that its attention asks for, so
    a few heads that look hard at a few tokens keep them; summed over 30 layers' heads, as
    SnapKV does, the vote of the heads that retrieve a fact is lost among the rest. Every head's
    votes add up to the same mass (its voting queries' softmax rows), so their maxima compare."""

    name = "adakv"
    per_head = True

    def votes(self, scores: Tensor) -> Tensor | None:
        return _pooled(scores).amax(dim=1)


def _pooled(scores: Tensor) -> Tensor:
    """SnapKV's pooling: each position's score ([n] or [n, heads]) summed with its neighbours'
    (``SNAPKV_POOL`` positions centred on it), so a token next to a voted one stays with it."""
    import torch

    half = SNAPKV_POOL // 2
    sums = torch.cat([scores.new_zeros(1, *scores.shape[1:]), scores.cumsum(0)])
    idx = torch.arange(scores.shape[0], device=scores.device)
    hi = (idx + half + 1).clamp(max=scores.shape[0])
    return sums[hi] - sums[(idx - half).clamp(min=0)]
