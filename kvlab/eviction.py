"""Token eviction: which cached tokens a sequence keeps when its cache may not grow without end.

One small interface serves the paged engine and the plain generation loop. A policy looks at a
sequence of ``n`` cached positions cut into units of ``unit`` tokens (a KV block in the engine,
one token in the loop) and says which units stay:

- ``full``: everything (no eviction);
- ``window``: the most recent tokens only (the lesson's failure case: the first tokens, where
  attention piles up, are lost);
- ``streaming``: ``sinks`` first tokens + the most recent (StreamingLLM, arXiv 2309.17453);
- ``h2o``: half the budget for the recent tokens, half for the "heavy hitters", the tokens with
  the most attention accumulated over every query so far (arXiv 2306.14048);
- ``snapkv``: once the prompt is in, its last ``obs_window`` positions vote (attention summed
  over 7 neighbouring positions) for the earlier tokens worth keeping, + the recent window
  (arXiv 2404.14469). Tokens generated later have no votes: they leave in age order.

One kept set per sequence, shared by all layers and heads: a KV block holds every layer's and
head's K/V of its tokens, so per-head selection (as the papers do) would only mask tokens and
free no memory. Attention scores are summed over layers and heads, in fixed point (``fixed_point``):
integer sums do not depend on their order, so the same tokens are evicted however the queries
were batched or chunked. Keys keep the RoPE positions
they were written with (evicting never renumbers the rest), as in any paged cache.

A policy evicts only once the kept tokens exceed the budget, and never a unit still being
written (the last one) or a sink. Evicted tokens never come back.

torch is imported only by the functions that handle tensors: the CLI's flag parsing reads the
policy names and budgets (kvlab.options) and must not load it (`kvlab plan` stays instant).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

POLICIES = ("full", "window", "streaming", "h2o", "snapkv")
SCORED = ("h2o", "snapkv")  # policies that need attention scores from the runtime
SNAPKV_POOL = 7  # SnapKV's pooling kernel over positions
SCORE_ONE = 2**32  # an attention weight of 1.0 in fixed point (int64 holds 2**31 such weights)


def fixed_point(weights: Tensor) -> Tensor:
    """Attention weights (floats in [0, 1]) as int64 fixed point, the unit of every score."""
    return (weights.double() * SCORE_ONE).round_().long()


def parse_budget(text: str | int | float | None) -> int | float | None:
    """``--kv-budget``: whole tokens per sequence ("256") or a ratio of the context ("0.25")."""
    if text is None or isinstance(text, (int, float)):
        return text
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--kv-budget takes tokens (256) or a ratio of the context (0.25), "
                         f"not {text!r}") from None


@dataclass(frozen=True)
class EvictionPolicy:
    """A policy and its budget: ``budget`` tokens (int) or a ratio of the tokens seen (float)."""

    name: str = "full"
    budget: int | float | None = None
    sinks: int = 4
    obs_window: int = 32

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown --kv-policy {self.name!r}; choose {', '.join(POLICIES)}")
        if self.name == "full":
            return
        if self.budget is None:
            raise ValueError(f"--kv-policy {self.name} needs --kv-budget (tokens, e.g. 256, or a "
                             f"ratio of the context, e.g. 0.25)")
        if isinstance(self.budget, float) and not 0 < self.budget <= 1:
            raise ValueError(f"--kv-budget ratio must be in (0, 1], got {self.budget}: use a whole "
                             f"number for tokens")
        if isinstance(self.budget, int) and self.budget < 1:
            raise ValueError(f"--kv-budget must be at least 1 token, got {self.budget}")

    @property
    def active(self) -> bool:
        return self.name != "full"

    @property
    def needs_scores(self) -> bool:
        return self.name in SCORED

    def check_unit(self, unit: int) -> None:
        """A token budget must hold the sinks (streaming) and one unit more: else nothing could
        be both pinned and recent."""
        if not self.active or not isinstance(self.budget, int):
            return
        least = (math.ceil(self.sinks / unit) + 1) * unit if self.name == "streaming" else 2 * unit
        if self.budget < least:
            raise ValueError(f"--kv-budget {self.budget} is too small for --kv-policy {self.name} with "
                             f"{unit}-token blocks: use at least {least} (sinks + one block, or two blocks)")

    def budget_tokens(self, seen: int) -> int:
        if isinstance(self.budget, float):
            return max(1, math.floor(self.budget * seen))
        return int(self.budget or seen)

    def max_tokens_held(self, prompt: int, final: int, chunk: int, unit: int) -> int:
        """Positions a sequence of ``final`` positions may hold at once under this policy, with
        prefill chunks of at most ``chunk`` tokens: its budget, the chunk being computed and the
        block being written. snapkv holds the whole prompt before it compresses."""
        if not self.active:
            return final
        held = (self.budget_tokens(final) // unit + 1) * unit + chunk
        if self.name == "snapkv":
            held = max(held, prompt)
        return min(final, held)

    def allowed_units(self, n: int, unit: int) -> int:
        return max(2, self.budget_tokens(n) // unit)

    def split(self, n: int, unit: int) -> tuple[int, int]:
        """(sink units, recent units) of the budget at ``n`` positions; the rest goes by score."""
        allowed = self.allowed_units(n, unit)
        sink_units = math.ceil(self.sinks / unit) if self.name == "streaming" else 0
        if self.name in ("window", "streaming"):
            recent = allowed - sink_units
        elif self.name == "snapkv":
            recent = max(1, math.ceil(self.obs_window / unit))
        else:  # h2o: half recent, half heavy hitters
            recent = max(1, allowed // 2)
        return sink_units, min(recent, allowed - sink_units)  # a window wider than the budget is the budget

    def voters(self, num_prompt_tokens: int) -> range | None:
        """Positions whose queries' attention counts toward the scores (None: no scores)."""
        if self.name == "h2o":
            return range(0, 2**62)
        if self.name == "snapkv":
            return range(max(0, num_prompt_tokens - self.obs_window), num_prompt_tokens)
        return None

    def keep(self, kept: Tensor, n: int, unit: int, scores: Tensor | None) -> Tensor:
        """The units (of ``unit`` tokens over ``n`` cached positions) to keep from ``kept`` (bool
        [units], False = already evicted). ``scores`` [n]: per-position attention mass."""
        units = kept.numel()
        allowed = self.allowed_units(n, unit)
        if not self.active or int(kept.sum()) <= allowed:
            return kept
        import torch

        last = units - 1  # being written: never evicted
        sink_units, recent = self.split(n, unit)
        out = torch.zeros_like(kept)
        out[:sink_units] = kept[:sink_units]
        # the most recent kept units, newest first
        order = torch.nonzero(kept, as_tuple=False).flatten().flip(0)
        order = order[order >= sink_units]
        out[order[:recent]] = True
        out[last] = True
        room = allowed - int(out.sum())
        if room > 0 and self.needs_scores and scores is not None:
            votes = _pooled(scores[:n]) if self.name == "snapkv" else scores[:n]
            per_unit = torch.zeros(units, dtype=torch.long, device=scores.device)
            per_unit.index_add_(0, torch.arange(n, device=scores.device) // unit, votes)
            candidates = torch.nonzero(kept & ~out, as_tuple=False).flatten()
            best = candidates[per_unit[candidates].argsort(descending=True, stable=True)[:room]]
            out[best] = True
        return out


def _pooled(scores: Tensor) -> Tensor:
    """SnapKV's pooling: each position's score summed with its neighbours' (``SNAPKV_POOL``
    positions centred on it), so a token next to a voted one stays with it."""
    import torch

    half = SNAPKV_POOL // 2
    sums = torch.cat([scores.new_zeros(1), scores.cumsum(0)])
    idx = torch.arange(scores.numel(), device=scores.device)
    hi = (idx + half + 1).clamp(max=scores.numel())
    return sums[hi] - sums[(idx - half).clamp(min=0)]
