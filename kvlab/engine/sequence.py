"""A request's state inside the engine: its tokens, how many have K/V computed, its block tables."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from torch import Tensor

from kvlab.engine.block_pool import hash_block

NULL_BLOCK = -1  # a block-table entry a sliding window has given back


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted by recompute (holds no blocks)
    RUNNING = "running"  # holds device blocks
    SWAPPED = "swapped"  # preempted by swap: its blocks live in the host pool
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request. `token_ids` is prompt + generated; K/V exist for the first
    `num_computed_tokens` of them. The last token never has K/V until the next step computes it."""

    request_id: str
    token_ids: list[int]
    max_tokens: int  # new tokens at most: admission sizes the cache for prompt + this
    cache_salt: str | None = None
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    tier_tokens: dict[str, int] = field(default_factory=dict)  # of which each prefix tier gave
    block_tables: list[list[int]] = field(default_factory=list)  # one per layer group
    host_tables: list[list[int]] = field(default_factory=list)  # while swapped: host block ids
    num_hashed_blocks: int = 0  # leading blocks already offered to the prefix cache
    admitted: int = -1  # admission order; the scheduler preempts the latest first
    num_preemptions: int = 0
    # eviction: per-position attention mass (policies that score), tokens given back, and
    # whether any were: K/V computed after that saw a shortened past, so they are never offered
    # to the prefix cache (their hash names the full text)
    scores: Tensor | None = field(default=None, repr=False)
    num_evicted_tokens: int = 0
    lossy: bool = False
    num_prompt_tokens: int = field(init=False)
    _hashes: list[bytes] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def append(self, token: int) -> None:
        self.token_ids.append(token)

    def block_hashes(self, n: int, block_size: int) -> list[bytes]:
        """Chained hashes of the first n full blocks (computed once, extended as tokens arrive)."""
        if n * block_size > self.num_tokens:
            raise ValueError(f"block {n - 1} of {self.request_id} is not full")
        while len(self._hashes) < n:
            i = len(self._hashes)
            parent = self._hashes[-1] if self._hashes else None
            self._hashes.append(hash_block(parent, self.token_ids[i * block_size:(i + 1) * block_size],
                                           self.cache_salt))
        return self._hashes[:n]
