"""Block tables of every sequence across the layer groups: allocation, prefix hits, sliding
windows giving blocks back, and the host pool that swapped-out blocks move to.

The scheduler asks it questions (does this chunk fit? how much of this prompt is cached?) and
gets answers as block ids; the runner turns the block ids into tensors. Still no tensors here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvlab.engine.block_pool import BlockPool
from kvlab.engine.sequence import NULL_BLOCK, Sequence
from kvlab.layout import LayerGroup, cdiv

# (source block, destination block) copies per layer group, to run before the step's forward pass
BlockCopies = list[list[tuple[int, int]]]


@dataclass(frozen=True)
class PrefixHit:
    """Leading tokens whose K/V are already cached, and the block-table prefix (per group) holding
    them. Sliding groups hold only the blocks the window still needs (NULL_BLOCK before)."""

    tokens: int
    tables: list[list[int]]


class KVCacheManager:
    """One BlockPool per layer group (all the same size) plus a host pool for swapping."""

    def __init__(self, groups: list[LayerGroup], num_blocks: int, block_size: int,
                 prefix_caching: bool = True, num_host_blocks: int = 0) -> None:
        self.groups = groups
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.pools = [BlockPool(num_blocks) for _ in groups]
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
    def find_prefix(self, seq: Sequence) -> PrefixHit:
        """Longest run of leading full blocks cached in every group. At least the last token is
        always left to compute: its logits are needed to sample."""
        bs = self.block_size
        none = PrefixHit(0, [[] for _ in self.groups])
        if not self.prefix_caching:
            return none
        n = (seq.num_tokens - 1) // bs
        hashes = seq.block_hashes(n, bs)
        for g, pool in zip(self.groups, self.pools):
            if g.window is None:
                k = 0
                while k < n and pool.lookup(hashes[k]) is not None:
                    k += 1
                n = k
        # sliding groups: only the blocks inside the window at the hit's end must be cached
        while n > 0 and not all(
            all(pool.lookup(h) is not None for h in hashes[self._first_needed_block(g, n * bs):n])
            for g, pool in zip(self.groups, self.pools) if g.window is not None
        ):
            n -= 1
        if n == 0:
            return none
        tables = []
        for g, pool in zip(self.groups, self.pools):
            first = self._first_needed_block(g, n * bs)
            cached = [pool.lookup(h) for h in hashes[first:n]]
            tables.append([NULL_BLOCK] * first + cached)  # type: ignore[operator]
        return PrefixHit(n * bs, tables)

    def cache_computed(self, seq: Sequence) -> None:
        """Offer the sequence's newly computed full blocks to the prefix cache (never once the
        sequence has evicted tokens: what it computes since saw a shortened past)."""
        if not self.prefix_caching or seq.lossy:
            return
        n = seq.num_computed_tokens // self.block_size
        if n <= seq.num_hashed_blocks:
            return
        hashes = seq.block_hashes(n, self.block_size)
        for pool, table in zip(self.pools, seq.block_tables):
            for i in range(seq.num_hashed_blocks, n):
                if table[i] != NULL_BLOCK:
                    pool.cache(table[i], hashes[i])
        seq.num_hashed_blocks = n

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
        tables; every group is full attention). Blocks already offered to the prefix cache stay
        findable there until reused: they were computed from the full text. Returns the blocks
        given back."""
        freed = 0
        for pool, table in zip(self.pools, seq.block_tables):
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
                revived = sum(1 for b in table if b != NULL_BLOCK and pool.ref_cnt[b] == 0)
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
                pool.touch(b for b in table if b != NULL_BLOCK)
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
        """Which blocks of the sequence's tables it still holds (first group's view)."""
        return [b != NULL_BLOCK for b in seq.block_tables[0]] if seq.block_tables else []

    # --- figures --------------------------------------------------------------------------------
    @property
    def num_used_blocks(self) -> int:
        return sum(pool.num_used for pool in self.pools)

    @property
    def usage(self) -> float:
        """Fraction of all groups' blocks referenced by a sequence (cached free blocks count free)."""
        total = self.num_blocks * len(self.pools)
        return self.num_used_blocks / total if total else 0.0
