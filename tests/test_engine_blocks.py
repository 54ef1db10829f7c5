"""Block pool, prefix hashes, block tables and scheduler decisions, one behaviour at a time."""

from __future__ import annotations

import pytest

from kvlab.engine.block_pool import BlockPool, hash_block
from kvlab.engine.kv_manager import KVCacheManager
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.sequence import NULL_BLOCK, SeqStatus, Sequence
from kvlab.layout import LayerGroup

FULL = [LayerGroup("full", None, (0,))]


def test_hash_chain_and_salt():
    a = hash_block(None, [1, 2])
    assert hash_block(None, [1, 2]) == a
    assert hash_block(None, [1, 2], "tenant") != a
    assert hash_block(a, [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])  # parent matters
    seq = Sequence("r", [1, 2, 3, 4, 5], 1, cache_salt="tenant")
    assert seq.block_hashes(2, 2) == [hash_block(None, [1, 2], "tenant"),
                                      hash_block(hash_block(None, [1, 2], "tenant"), [3, 4])]
    with pytest.raises(ValueError):
        seq.block_hashes(3, 2)  # the third block is not full


def test_lru_keeps_cached_blocks_until_free_ones_run_out():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache(b, bytes([i]))
    pool.release(reversed(blocks))  # tail first: block 2 is the oldest cached
    assert (pool.num_free, pool.num_cached, pool.num_used) == (1, 3, 0)
    assert pool.allocate(1) == [3]  # the never-cached block goes first
    assert pool.allocate(1) == [blocks[2]] and pool.lookup(bytes([2])) is None  # then LRU
    pool.touch([pool.lookup(bytes([0]))])  # a hit revives a cached block
    assert pool.ref_cnt[blocks[0]] == 1 and pool.num_cached == 1
    with pytest.raises(RuntimeError):
        pool.allocate(2)


def run(sched: Scheduler, tokens: int = 7) -> None:
    """One step with a fixed sampled token."""
    out = sched.schedule()
    sched.update(out, {c.seq.request_id: tokens for c in out.chunks if c.samples})


def test_shared_prefix_is_reference_counted():
    kv = KVCacheManager(FULL, 16, 2)
    sched = Scheduler(kv, 4, 64, 64)
    a = Sequence("a", [1, 2, 3, 4, 5, 6, 7], 4)
    sched.add(a)
    run(sched)
    b = Sequence("b", [1, 2, 3, 4, 5, 9, 9], 4)
    sched.add(b)
    run(sched)
    assert b.num_cached_tokens == 4 and b.block_tables[0][:2] == a.block_tables[0][:2]
    assert [kv.pools[0].ref_cnt[x] for x in a.block_tables[0][:2]] == [2, 2]
    sched.finish("a")
    assert [kv.pools[0].ref_cnt[x] for x in b.block_tables[0][:2]] == [1, 1]
    sched.finish("b")
    # a computed 8 tokens (4 full blocks), b 7 (its third block is its own)
    assert kv.pools[0].num_used == 0 and kv.pools[0].num_cached == 5


def test_fully_cached_prompt_recomputes_its_last_block():
    kv = KVCacheManager(FULL, 16, 2)
    sched = Scheduler(kv, 4, 64, 64)
    sched.add(Sequence("a", [1, 2, 3, 4, 5, 6], 1))
    run(sched)
    sched.finish("a")
    again = Sequence("b", [1, 2, 3, 4, 5, 6], 1)
    sched.add(again)
    out = sched.schedule()
    assert again.num_cached_tokens == 4  # 6 tokens cached, 2 recomputed for the logits
    assert (out.chunks[0].start, out.chunks[0].num_tokens) == (4, 2)
    assert sched.prefix_queries == 12 and sched.prefix_hits == 4


def test_sliding_window_gives_blocks_back():
    kv = KVCacheManager([LayerGroup("sliding", 4, (0,))], 8, 2)
    sched = Scheduler(kv, 1, 64, 64)
    seq = Sequence("a", list(range(10)), 20)
    sched.add(seq)
    run(sched)  # prefill positions 0..9
    run(sched)  # next decode reads positions 7..10: blocks 0-2 are out of the window
    assert seq.block_tables[0][:3] == [NULL_BLOCK] * 3
    assert kv.pools[0].num_used == len([b for b in seq.block_tables[0] if b != NULL_BLOCK]) <= 3
    for _ in range(15):
        run(sched)
    assert kv.pools[0].num_used <= 3  # cdiv(4 - 1, 2) + 1: the cache stopped growing


def test_preempts_latest_admitted_and_resumes_it():
    kv = KVCacheManager(FULL, 6, 2)
    sched = Scheduler(kv, 4, 64, 64)
    seqs = [Sequence(f"r{i}", [i + 1] * 4, 4) for i in range(3)]
    for s in seqs:
        sched.add(s)
    run(sched)  # all three admitted: 2 blocks each, pool full
    out = sched.schedule()  # r0 needs a third block: r2 (latest) is preempted
    assert out.preempted == [seqs[2]] and seqs[2].status is SeqStatus.WAITING
    assert [c.seq.request_id for c in out.chunks] == ["r0", "r1"]
    assert sched.waiting[0] is seqs[2] and seqs[2].num_computed_tokens == 0


def test_swap_preemption_moves_blocks_to_host():
    kv = KVCacheManager(FULL, 6, 2, num_host_blocks=6)
    sched = Scheduler(kv, 4, 64, 64, swap=True)
    seqs = [Sequence(f"r{i}", [i + 1] * 4, 4) for i in range(3)]
    for s in seqs:
        sched.add(s)
    run(sched)
    victim_blocks = list(seqs[2].block_tables[0])
    out = sched.schedule()
    assert seqs[2].status is SeqStatus.SWAPPED and seqs[2].num_computed_tokens == 4
    assert [d for d, _ in out.swap_out[0]] == victim_blocks and kv.swapped_out_blocks == 2
    assert [h for _, h in out.swap_out[0]] == seqs[2].host_tables[0]
    sched.update(out, {c.seq.request_id: 7 for c in out.chunks if c.samples})
    sched.finish("r0")
    out = sched.schedule()
    assert len(out.swap_in[0]) == 2 and seqs[2].status is SeqStatus.RUNNING


def test_requests_that_can_never_fit_are_refused():
    kv = KVCacheManager(FULL, 4, 2)
    sched = Scheduler(kv, 4, 64, max_model_len=10)
    with pytest.raises(ValueError, match="max_model_len 10"):
        sched.add(Sequence("long", [1] * 11, 1))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add(Sequence("big", [1] * 6, 4))  # 9 positions = 5 blocks > 4
    with pytest.raises(ValueError, match="empty"):
        sched.add(Sequence("empty", [], 4))
    sched.add(Sequence("ok", [1] * 6, 3))  # 8 positions = 4 blocks
    with pytest.raises(ValueError, match="already in use"):
        sched.add(Sequence("ok", [1], 1))
    run(sched)
    assert sched.running[0].request_id == "ok"
