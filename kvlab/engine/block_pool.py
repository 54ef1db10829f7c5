"""One layer group's blocks: reference counts, the prefix-hash index and the LRU of cached blocks.

A block is `block_size` token slots in every layer of its group. A block whose reference count
drops to 0 is *free*; if it holds a full, hashed block of some token prefix it stays findable by
that hash (*cached*) until a new allocation finds no plain free block and evicts the least
recently released one. Pure bookkeeping: no tensors, no model.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence

import numpy as np


def hash_block(parent: bytes | None, tokens: Sequence[int], salt: str | None = None) -> bytes:
    """Chained hash of one full block: the parent block's hash, the block's tokens and, for the
    first block only, a salt (a namespace that keeps tenants' caches apart).

    The chain makes a hash name the whole prefix up to the block's end, as K/V depend on every
    token before them. blake2b (128 bits), not Python's hash(): a collision would silently reuse
    the wrong K/V.
    """
    h = hashlib.blake2b(digest_size=16)
    if parent is None:
        h.update(b"salt:" + (salt or "").encode())
    else:
        h.update(parent)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


class BlockPool:
    """Allocates block ids of one pool and tracks who references them."""

    def __init__(self, num_blocks: int,
                 on_evict: Callable[[list[tuple[int, bytes]]], None] | None = None) -> None:
        """``on_evict`` hears of every cached block that an allocation takes, as (block, hash)
        pairs, while the block still holds its K/V (the prefix tiers copy it out then)."""
        self.num_blocks = num_blocks
        self.on_evict = on_evict
        self.ref_cnt = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(num_blocks))  # ref 0, no hash
        self._cached: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed; oldest first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Free blocks that still hold a findable prefix block."""
        return len(self._cached)

    @property
    def num_available(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    def free_ids(self) -> list[int]:
        return list(self._free)

    def cached_ids(self) -> list[int]:
        return list(self._cached)

    def lookup(self, block_hash: bytes) -> int | None:
        return self._by_hash.get(block_hash)

    def allocate(self, n: int) -> list[int]:
        """n blocks with reference count 1: plain free blocks first, then evict cached ones (LRU)."""
        if n > self.num_available:
            raise RuntimeError(f"allocate({n}) with {self.num_available} blocks available")
        out, evicted = [], []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._cached.popitem(last=False)
                block_hash = self.hash_of[block]
                assert block_hash is not None
                del self._by_hash[block_hash]
                self.hash_of[block] = None
                evicted.append((block, block_hash))
            self.ref_cnt[block] = 1
            out.append(block)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        """Take one more reference to each block (a prefix hit); revives cached free blocks."""
        for block in blocks:
            if self.ref_cnt[block] == 0:
                del self._cached[block]
            self.ref_cnt[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block. Callers pass a sequence's blocks tail first, so that
        among blocks released together the tail (the least shareable) is evicted first."""
        for block in blocks:
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] < 0:
                raise RuntimeError(f"block {block} released more often than referenced")
            if self.ref_cnt[block] == 0:
                if self.hash_of[block] is None:
                    self._free.append(block)
                else:
                    self._cached[block] = None

    def cache(self, block: int, block_hash: bytes) -> bool:
        """Make a full, computed block findable; True if it now is. A prefix already cached
        elsewhere keeps its block (this one then stays private and becomes plainly free when
        released)."""
        if self.hash_of[block] is None and block_hash not in self._by_hash:
            self.hash_of[block] = block_hash
            self._by_hash[block_hash] = block
            return True
        return False
