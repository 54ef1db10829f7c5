"""Block tables of every sequence across the layer groups: allocation, prefix hits (in the pool
and in the tiers behind it), sliding windows giving blocks back, and the host pool that
swapped-out blocks move to.

The scheduler asks it questions (does this chunk fit? how much of this prompt is cached?) and
gets answers as block ids; the runner turns the block ids into tensors. The only bytes that pass
through here are the prefix tiers' (``kvlab.engine.tiers``): a block leaving the pool is read
out through ``read_blocks`` at once, while it still holds its K/V, and blocks loaded from a tier
wait in ``take_loads()`` for the engine to write them before the step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from kvlab.engine.block_pool import BlockPool
from kvlab.engine.sequence import NULL_BLOCK, Sequence
from kvlab.engine.tiers import Key, TierChain, tier_key
from kvlab.layout import LayerGroup, cdiv

# (source block, destination block) copies per layer group, to run before the step's forward pass
BlockCopies = list[list[tuple[int, int]]]
# (block, its bytes) per layer group: blocks a prefix tier fills, before the step's forward pass
BlockLoads = list[list[tuple[int, Tensor]]]
# a prefix hit's table entry for a block that a tier holds (a fresh pool block once allocated)
TIER_BLOCK = -2


@dataclass(frozen=True)
class PrefixHit:
    """Leading tokens whose K/V are already cached, and the block-table prefix (per group) holding
    them. Sliding groups hold only the blocks the window still needs (NULL_BLOCK before); a block
    a prefix tier holds is TIER_BLOCK."""

    tokens: int
    tables: list[list[int]]

    @property
    def from_tiers(self) -> bool:
        return any(TIER_BLOCK in t for t in self.tables)


class KVCacheManager:
    """One BlockPool per layer group (all the same size) plus a host pool for swapping."""

    def __init__(self, groups: list[LayerGroup], num_blocks: int, block_size: int,
                 prefix_caching: bool = True, num_host_blocks: int = 0, tiers: TierChain | None = None,
                 read_blocks: Callable[[int, list[int]], Tensor] | None = None) -> None:
        """``tiers``: the prefix tiers behind the pools, with ``read_blocks(group, blocks)`` giving
        those blocks' bytes ([n, block bytes] uint8) for them to keep."""
        self.groups = groups
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.tiers = tiers if prefix_caching else None
        self.read_blocks = read_blocks
        self.pools = [BlockPool(num_blocks, self._evicted(gi) if self.tiers is not None else None)
                      for gi in range(len(groups))]
        self._staged: dict[Key, tuple[str, Tensor]] = {}  # tier blocks read for the queue's head
        self._loads: BlockLoads = [[] for _ in groups]
        self.num_host_blocks = num_host_blocks
        self.host_free = [deque(range(num_host_blocks)) for _ in groups]
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0

    # --- sizes ----------------------------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks one sequence of `num_tokens` computed positions needs at once (worst group)."""
        return max(g.blocks_per_seq(num_tokens, self.block_size) for g in self.groups)

    def _first_needed_block(self, group: LayerGroup, position: int) -> int:
        """First block a query at `position` (or later) can still read in this group."""
        if group.window is None:
            return 0
        return max(0, position - group.window + 1) // self.block_size

    def max_chunk(self, start: int, num_tokens: int, seq: Sequence | None = None) -> int:
        """Cap a chunk starting at `start` so that each group's span fits in its pool: a sliding
        group holds the window before the chunk plus the chunk, a sequence under eviction what it
        kept plus the chunk, never more than the pool."""
        for gi, g in enumerate(self.groups):
            given_back = self._first_needed_block(g, start)
            tables = (seq.block_tables or seq.host_tables) if seq is not None else []
            if tables:
                given_back = max(given_back, tables[gi].count(NULL_BLOCK))
            num_tokens = min(num_tokens, (self.num_blocks + given_back) * self.block_size - start)
        return num_tokens

    # --- prefix cache ---------------------------------------------------------------------------
    def find_prefix(self, seq: Sequence, most: int | None = None) -> PrefixHit:
        """Longest run of leading full blocks cached in every group, covering at most ``most``
        tokens (None: any). At least the last token is always left to compute: its logits are
        needed to sample."""
        bs = self.block_size
        none = PrefixHit(0, [[] for _ in self.groups])
        if not self.prefix_caching:
            return none
        n = (seq.num_tokens - 1) // bs
        if most is not None:
            n = min(n, most // bs)
        hashes = seq.block_hashes(n, bs)
        for gi, g in enumerate(self.groups):
            if g.window is None:
                k = 0
                while k < n and self._where(gi, hashes[k]) is not None:
                    k += 1
                n = k
        # sliding groups: only the blocks inside the window at the hit's end must be cached
        while n > 0 and not all(
            all(self._where(gi, h) is not None for h in hashes[self._first_needed_block(g, n * bs):n])
            for gi, g in enumerate(self.groups) if g.window is not None
        ):
            n -= 1
        if n == 0:
            return none
        tables = []
        for gi, g in enumerate(self.groups):
            first = self._first_needed_block(g, n * bs)
            tables.append([NULL_BLOCK] * first + [self._where(gi, h) for h in hashes[first:n]])  # type: ignore[misc]
        return PrefixHit(n * bs, tables)

    def _where(self, group: int, block_hash: bytes) -> int | None:
        """The pool block holding this block hash, TIER_BLOCK if only a tier holds it, else None."""
        block = self.pools[group].lookup(block_hash)
        if block is not None:
            return block
        key = tier_key(group, block_hash)
        if self.tiers is not None and (key in self._staged or self.tiers.where(key) is not None):
            return TIER_BLOCK
        return None

    def fetch(self, seq: Sequence, hit: PrefixHit) -> PrefixHit:
        """Read the hit's tier blocks (kept for this sequence until it is admitted, so a queue
        head waiting for room reads them once). A block a tier fails to give (a corrupt file,
        one deleted meanwhile) is missing from then on: the hit is looked up again, shorter."""
        assert self.tiers is not None
        hashes = seq.block_hashes(hit.tokens // self.block_size, self.block_size)
        wanted = [tier_key(gi, hashes[i]) for gi, table in enumerate(hit.tables)
                  for i, block in enumerate(table) if block == TIER_BLOCK]
        wanted = [key for key in wanted if key not in self._staged]
        got = self.tiers.fetch(wanted)
        self._staged.update((key, g) for key, g in zip(wanted, got) if g is not None)
        if None in got:
            return self.fetch(seq, self.find_prefix(seq, hit.tokens))  # never longer than asked
        return hit

    def cache_computed(self, seq: Sequence) -> None:
        """Offer the sequence's newly computed full blocks to the prefix cache (never once the
        sequence has evicted tokens: what it computes since saw a shortened past)."""
        if not self.prefix_caching or seq.lossy:
            return
        n = seq.num_computed_tokens // self.block_size
        if n <= seq.num_hashed_blocks:
            return
        hashes = seq.block_hashes(n, self.block_size)
        for gi, (pool, table) in enumerate(zip(self.pools, seq.block_tables)):
            new = [(table[i], hashes[i]) for i in range(seq.num_hashed_blocks, n)
                   if table[i] != NULL_BLOCK and pool.cache(table[i], hashes[i])]
            if self.tiers is not None:
                self._to_tier(gi, new, self.tiers.wants_computed, self.tiers.computed)
        seq.num_hashed_blocks = n

    def _evicted(self, group: int) -> Callable[[list[tuple[int, bytes]]], None]:
        """The pool's on_evict: what leaves the pool goes to the tiers, read out at once."""
        def leave(blocks: list[tuple[int, bytes]]) -> None:
            assert self.tiers is not None
            self._to_tier(group, blocks, self.tiers.wants_leaving, self.tiers.leaving_pool)
        return leave

    def _to_tier(self, group: int, blocks: list[tuple[int, bytes]], wants: Callable[[Key], bool],
                 take: Callable[[Key, Tensor], None]) -> None:
        """Read out the blocks a tier wants (only those: the copy is on the step's path) and
        hand each to ``take``."""
        wanted = [(block, tier_key(group, h)) for block, h in blocks if wants(tier_key(group, h))]
        if not wanted:
            return
        assert self.read_blocks is not None
        data = self.read_blocks(group, [b for b, _ in wanted])
        for (_, key), row in zip(wanted, data):
            take(key, row.clone())  # its own bytes, not a view of the batch

    # --- allocation -----------------------------------------------------------------------------
    def free_outside_window(self, seq: Sequence) -> None:
        """Give back sliding-group blocks no future query of `seq` can attend to."""
        for g, pool, table in zip(self.groups, self.pools, seq.block_tables):
            first = min(self._first_needed_block(g, seq.num_computed_tokens), len(table))
            gone = [b for b in table[:first] if b != NULL_BLOCK]
            if gone:
                pool.release(reversed(gone))
                table[:first] = [NULL_BLOCK] * first

    def evict(self, seq: Sequence, keep: list[bool]) -> int:
        """Give back the blocks of ``seq`` whose ``keep`` flag is False (one flag per block of its
        tables) in the full-attention groups; sliding groups keep their window. Blocks already
        offered to the prefix cache stay findable there until reused: they were computed from the
        full text. Returns the blocks given back."""
        freed = 0
        for g, pool, table in zip(self.groups, self.pools, seq.block_tables):
            if g.window is not None:
                continue
            gone = [i for i, k in enumerate(keep) if not k and table[i] != NULL_BLOCK]
            pool.release(table[i] for i in reversed(gone))
            for i in gone:
                table[i] = NULL_BLOCK
            freed += len(gone)
        if freed:
            seq.lossy = True
        return freed

    def _needs(self, seq: Sequence, num_new: int, hit: PrefixHit | None) -> list[int]:
        """Blocks each pool must hand out to compute `num_new` more tokens of `seq`."""
        start = hit.tokens if hit is not None else seq.num_computed_tokens
        end_blocks = cdiv(start + num_new, self.block_size)
        needs = []
        for gi, pool in enumerate(self.pools):
            if hit is not None:
                table = hit.tables[gi]
                revived = sum(1 for b in table if b == TIER_BLOCK or b >= 0 and pool.ref_cnt[b] == 0)
            elif seq.host_tables:
                table = seq.host_tables[gi]
                revived = sum(1 for b in table if b != NULL_BLOCK)  # swapped blocks come back
            else:
                table, revived = (seq.block_tables[gi] if seq.block_tables else []), 0
            needs.append(max(0, end_blocks - len(table)) + revived)
        return needs

    def allocate(self, seq: Sequence, num_new: int, hit: PrefixHit | None = None) -> BlockCopies | None:
        """Extend `seq`'s tables to cover `num_new` more tokens, or return None (nothing changed)
        when some pool lacks the blocks: one call both asks and takes, so the needs are counted
        once and no caller can take without asking.

        With a prefix hit, the cached blocks are shared and `seq` starts after them. A swapped
        sequence gets device blocks for its host copies; the returned (host, device) copies must
        run before the step."""
        if any(n > pool.num_available for n, pool in zip(self._needs(seq, num_new, hit), self.pools)):
            return None
        copies: BlockCopies = [[] for _ in self.groups]
        if hit is not None:
            seq.block_tables = [list(t) for t in hit.tables]
            for pool, table in zip(self.pools, seq.block_tables):
                pool.touch(b for b in table if b >= 0)
            if hit.from_tiers:
                self._load(seq, hit)
            seq.num_computed_tokens = hit.tokens
            seq.num_hashed_blocks = hit.tokens // self.block_size
        elif seq.host_tables:
            seq.block_tables = []
            for gi, (pool, host_table) in enumerate(zip(self.pools, seq.host_tables)):
                table = []
                for host in host_table:
                    if host == NULL_BLOCK:
                        table.append(NULL_BLOCK)
                        continue
                    device = pool.allocate(1)[0]
                    copies[gi].append((host, device))
                    self.host_free[gi].append(host)
                    table.append(device)
                seq.block_tables.append(table)
            seq.host_tables = []
            seq.num_hashed_blocks = 0  # the copies can be offered to the prefix cache again
            self.swapped_in_blocks += sum(map(len, copies))
        elif not seq.block_tables:
            seq.block_tables = [[] for _ in self.groups]
        end_blocks = cdiv(seq.num_computed_tokens + num_new, self.block_size)
        for pool, table in zip(self.pools, seq.block_tables):
            if end_blocks > len(table):
                table.extend(pool.allocate(end_blocks - len(table)))
        return copies

    def _load(self, seq: Sequence, hit: PrefixHit) -> None:
        """Give the hit's tier blocks fresh pool blocks, findable at once, their bytes to be
        written before the step (``take_loads``); count the prompt tokens each tier gave."""
        hashes = seq.block_hashes(hit.tokens // self.block_size, self.block_size)
        counted = self.full_group
        for gi, (pool, table) in enumerate(zip(self.pools, seq.block_tables)):
            for i, block in enumerate(table):
                if block != TIER_BLOCK:
                    continue
                tier, data = self._staged[tier_key(gi, hashes[i])]
                table[i] = pool.allocate(1)[0]
                pool.cache(table[i], hashes[i])
                self._loads[gi].append((table[i], data))
                if gi == counted and seq.admitted < 0:  # as num_cached_tokens: the first admission
                    seq.tier_tokens[tier] = seq.tier_tokens.get(tier, 0) + self.block_size
        self._staged.clear()

    def take_loads(self) -> BlockLoads:
        """The blocks tiers filled since the last call, per group: write them before the step."""
        loads, self._loads = self._loads, [[] for _ in self.groups]
        return loads

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq` (tail first) and its host copies, if swapped."""
        for pool, table in zip(self.pools, seq.block_tables):
            pool.release(b for b in reversed(table) if b != NULL_BLOCK)
        for free, table in zip(self.host_free, seq.host_tables):
            free.extend(b for b in table if b != NULL_BLOCK)
        seq.block_tables, seq.host_tables = [], []
        seq.num_hashed_blocks = 0
        seq.lossy = False

    def swap_out(self, seq: Sequence) -> BlockCopies | None:
        """Move `seq`'s blocks to the host pool: returns (device, host) copies to run before the
        step, or None (nothing changed) when the host pool lacks room."""
        self.free_outside_window(seq)
        held = [[b for b in table if b != NULL_BLOCK] for table in seq.block_tables]
        if any(len(h) > len(free) for h, free in zip(held, self.host_free)):
            return None
        copies: BlockCopies = [[] for _ in self.groups]
        host_tables = []
        for gi, table in enumerate(seq.block_tables):
            host_table = []
            for device in table:
                if device == NULL_BLOCK:
                    host_table.append(NULL_BLOCK)
                    continue
                host = self.host_free[gi].popleft()
                copies[gi].append((device, host))
                host_table.append(host)
            host_tables.append(host_table)
        for pool, table in zip(self.pools, seq.block_tables):
            pool.release(b for b in reversed(table) if b != NULL_BLOCK)
        seq.block_tables, seq.host_tables = [], host_tables
        seq.num_hashed_blocks = 0
        self.swapped_out_blocks += sum(map(len, copies))
        return copies

    def held_blocks(self, seq: Sequence) -> list[bool]:
        """Which blocks of the sequence's tables it still holds (a full-attention group's view:
        the one eviction acts on)."""
        if not seq.block_tables:
            return []
        return [b != NULL_BLOCK for b in seq.block_tables[self.full_group]]

    @property
    def full_group(self) -> int:
        """The first full-attention group (0 if every group slides)."""
        return next((gi for gi, g in enumerate(self.groups) if g.window is None), 0)

    # --- figures --------------------------------------------------------------------------------
    @property
    def num_used_blocks(self) -> int:
        return sum(pool.num_used for pool in self.pools)

    @property
    def usage(self) -> float:
        """Fraction of all groups' blocks referenced by a sequence (cached free blocks count free)."""
        total = self.num_blocks * len(self.pools)
        return self.num_used_blocks / total if total else 0.0
