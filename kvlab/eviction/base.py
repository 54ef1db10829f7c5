"""The base of every eviction policy: the few hooks the engine and the plain loop ask it.

The scheduler, the model runner, the paged attention and the plain loop's ``EvictingKVCache``
know a policy only through these hooks, never by its name:

- what it scores: ``needs_scores`` (the runtime keeps attention scores for it), ``per_head``
  (one column per layer and query head, not their sum) and ``voters`` (the query positions
  whose attention counts);
- when it may evict: ``ready`` (from ``active`` and ``waits_for_prompt``);
- which units it keeps: ``keep``;
- its budget: ``budget_tokens``, ``check_unit`` and ``max_tokens_held``.

The default ``keep`` is one template for every built-in policy that evicts: the units ``split``
pins (sinks first, then the most recent) and, if the policy ``votes``, the rest of the budget by
score. A new policy overrides only what differs.

torch is imported only inside the methods that handle tensors (see ``kvlab.eviction``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from torch import Tensor

SCORE_ONE = 2**32  # an attention weight of 1.0 in fixed point (int64 holds 2**31 such weights)


def fixed_point(weights: Tensor) -> Tensor:
    """Attention weights (floats in [0, 1]) as int64 fixed point, the unit of every score."""
    return (weights.double() * SCORE_ONE).round_().long()


def add_scores(scores: Tensor, positions: Tensor, mass: Tensor, layer_idx: int) -> None:
    """Add one layer's attention mass at ``positions`` to a sequence's scores: ``mass`` [L] to
    scores [n] (summed over layers and heads), or ``mass`` [L, H] to layer ``layer_idx``'s H
    columns of scores [n, layers * H] (``per_head``)."""
    if mass.dim() == 1:
        scores.index_add_(0, positions, mass)
    else:
        heads = mass.shape[1]
        scores.narrow(1, layer_idx * heads, heads).index_add_(0, positions, mass)


@dataclass(frozen=True)
class EvictionPolicy:
    """A policy and its budget: ``budget`` tokens (int) or a ratio of the tokens seen (float).

    A sequence of ``n`` cached positions is cut into units of ``unit`` tokens (a KV block in the
    engine, one token in the loop); the policy says which units stay. By default it keeps the
    most recent units within its budget (``window`` adds nothing to this class but its name).
    """

    name: ClassVar[str] = ""  # its --kv-policy spelling: for the registry and reports only
    active: ClassVar[bool] = True  # False: it never evicts (``full``)
    needs_scores: ClassVar[bool] = False  # the runtime accumulates attention scores for it
    per_head: ClassVar[bool] = False  # ... per layer and query head: scores [n, layers * heads]
    waits_for_prompt: ClassVar[bool] = False  # it evicts only once the whole prompt is computed

    budget: int | float | None = None

    def __post_init__(self) -> None:
        if not self.active:
            return
        if self.budget is None:
            raise ValueError(f"--kv-policy {self.name} needs --kv-budget (tokens, e.g. 256, or a "
                             f"ratio of the context, e.g. 0.25)")
        if isinstance(self.budget, float) and not 0 < self.budget <= 1:
            raise ValueError(f"--kv-budget ratio must be in (0, 1], got {self.budget}: use a whole "
                             f"number for tokens")
        if isinstance(self.budget, int) and self.budget < 1:
            raise ValueError(f"--kv-budget must be at least 1 token, got {self.budget}")

    # --- what it scores --------------------------------------------------------------------------
    def score_columns(self, num_layers: int, num_heads: int) -> int:
        """Columns of a sequence's scores: 1 (the sum over layers and heads; the tensor is then
        1-D) or one per layer and query head."""
        return num_layers * num_heads if self.per_head else 1

    def new_scores(self, size: int, columns: int, device) -> Tensor:
        """Zero scores for ``size`` positions: [size], or [size, columns] per head."""
        import torch

        shape = (size,) if columns == 1 else (size, columns)
        return torch.zeros(shape, dtype=torch.long, device=device)

    def voters(self, num_prompt_tokens: int) -> range | None:
        """Positions whose queries' attention counts toward the scores (None: no scores)."""
        return None

    def prefix_limit(self, num_prompt_tokens: int) -> int | None:
        """Prompt tokens a prefix-cache hit may cover (None: all): a hit skips its tokens'
        queries, and the queries that vote must run for the scores to be those of a cold run."""
        voting = self.voters(num_prompt_tokens)
        return None if voting is None else voting.start

    # --- when it may evict -----------------------------------------------------------------------
    def ready(self, computed: int, num_prompt_tokens: int) -> bool:
        """Whether it may evict from a sequence with ``computed`` positions in its cache, of a
        prompt of ``num_prompt_tokens``."""
        return self.active and (computed >= num_prompt_tokens or not self.waits_for_prompt)

    # --- its budget ------------------------------------------------------------------------------
    def budget_tokens(self, seen: int) -> int:
        if isinstance(self.budget, float):
            return max(1, math.floor(self.budget * seen))
        return int(self.budget or seen)

    def allowed_units(self, n: int, unit: int) -> int:
        return max(2, self.budget_tokens(n) // unit)

    def least_budget(self, unit: int) -> int:
        """The smallest token budget it takes with ``unit``-token units: one unit pinned and one
        recent (a policy with sinks: the sinks' units and one more)."""
        return 2 * unit

    def check_unit(self, unit: int) -> None:
        """A token budget must hold what the policy pins and one unit more: else nothing could
        be both pinned and recent."""
        if not self.active or not isinstance(self.budget, int):
            return
        least = self.least_budget(unit)
        if self.budget < least:
            raise ValueError(f"--kv-budget {self.budget} is too small for --kv-policy {self.name} with "
                             f"{unit}-token blocks: use at least {least} (sinks + one block, or two blocks)")

    def max_tokens_held(self, prompt: int, final: int, chunk: int, unit: int) -> int:
        """Positions a sequence of ``final`` positions may hold at once under this policy, with
        prefill chunks of at most ``chunk`` tokens: its budget, the chunk being computed and the
        block being written. A policy that waits for the prompt holds all of it first."""
        if not self.active:
            return final
        held = (self.budget_tokens(final) // unit + 1) * unit + chunk
        if self.waits_for_prompt:
            held = max(held, prompt)
        return min(final, held)

    # --- which units it keeps --------------------------------------------------------------------
    def split(self, n: int, unit: int) -> tuple[int, int]:
        """(sink units, recent units) of the budget at ``n`` positions; the rest goes by score."""
        return 0, self.allowed_units(n, unit)

    def votes(self, scores: Tensor) -> Tensor | None:
        """Per-position votes [n] from the attention scores ([n], or [n, layers * heads] if
        ``per_head``); None: no unit is kept by score."""
        return None

    def keep(self, kept: Tensor, n: int, unit: int, scores: Tensor | None) -> Tensor:
        """The units (of ``unit`` tokens over ``n`` cached positions) to keep from ``kept`` (bool
        [units], False = already evicted). ``scores`` [n]: per-position attention mass. Never
        evicts the last unit (being written) nor brings an evicted one back."""
        units = kept.numel()
        allowed = self.allowed_units(n, unit)
        if int(kept.sum()) <= allowed:
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
        votes = self.votes(scores[:n]) if room > 0 and scores is not None else None
        if votes is not None:
            per_unit = torch.zeros(units, dtype=torch.long, device=votes.device)
            per_unit.index_add_(0, torch.arange(n, device=votes.device) // unit, votes)
            candidates = torch.nonzero(kept & ~out, as_tuple=False).flatten()
            best = candidates[per_unit[candidates].argsort(descending=True, stable=True)[:room]]
            out[best] = True
        return out
