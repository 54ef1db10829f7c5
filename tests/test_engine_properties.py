"""Random workloads (add / step / abort / finish) through the block pools and the scheduler, with
no model: a fake cache records, for every slot, which token prefix its K/V would come from, so a
wrong block table, a bad prefix hit, a lost swap or a prefix tier that hands back the wrong block
shows up as a wrong read."""

from __future__ import annotations

import pickle
import shutil
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvlab.engine.kv_manager import KVCacheManager
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.sequence import NULL_BLOCK, SeqStatus, Sequence
from kvlab.engine.tiers import DiskTier, RamTier, TierChain, fingerprint
from kvlab.layout import LayerGroup

LAYOUTS = {
    "full": [LayerGroup("full", None, (0, 1))],
    "sliding": [LayerGroup("sliding", 5, (0,))],
    "hybrid": [LayerGroup("sliding", 3, (0,)), LayerGroup("full", None, (1,))],
}
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [7, 7, 7, 7, 7, 7, 7]]
ROW = 2048  # bytes of one fake block as a tier holds it: a length, then its pickled slots


class EngineMachine(RuleBasedStateMachine):
    @initialize(layout=st.sampled_from(sorted(LAYOUTS)), block_size=st.sampled_from([1, 2, 4]),
                num_blocks=st.integers(4, 16), prefix=st.booleans(),
                preemption=st.sampled_from(["recompute", "swap"]), host_blocks=st.integers(0, 24),
                max_seqs=st.integers(1, 5), budget=st.integers(1, 12), max_model_len=st.integers(8, 40),
                tiers=st.sampled_from(["none", "ram", "disk", "both"]), ram_blocks=st.integers(0, 12),
                disk_blocks=st.integers(1, 12))
    def setup(self, layout, block_size, num_blocks, prefix, preemption, host_blocks, max_seqs,
              budget, max_model_len, tiers, ram_blocks, disk_blocks):
        self.groups = LAYOUTS[layout]
        self.folder = Path(tempfile.mkdtemp(prefix="kvlab-tiers-")) if tiers in ("disk", "both") else None
        self.fingerprint = fingerprint({"layout": layout, "block_size": block_size})
        self.chain = TierChain(
            RamTier(ram_blocks * ROW) if tiers in ("ram", "both") else None,
            DiskTier(self.folder, disk_blocks * (ROW + 64), self.fingerprint) if self.folder else None,
        ) if prefix and tiers != "none" else None
        self.kv = KVCacheManager(self.groups, num_blocks, block_size, prefix,
                                 host_blocks if preemption == "swap" else 0, tiers=self.chain,
                                 read_blocks=self._read_blocks)
        self.sched = Scheduler(self.kv, max_seqs, budget, max_model_len, swap=preemption == "swap")
        # fake K/V: per group, per block, per offset: the token prefix the slot was computed from
        self.device = [[[None] * block_size for _ in range(num_blocks)] for _ in self.groups]
        self.host = [[[None] * block_size for _ in range(max(host_blocks, 1))] for _ in self.groups]
        self.next_id = 0

    # --- operations ----------------------------------------------------------------------------
    @rule(base=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 9), max_size=12),
          max_tokens=st.integers(1, 12), salt=st.sampled_from([None, None, "a"]))
    def add(self, base, tail, max_tokens, salt):
        prompt = base[: len(base) // 2 + len(tail) % 4] + tail
        seq = Sequence(f"r{self.next_id}", list(prompt), max_tokens, cache_salt=salt)
        self.next_id += 1
        try:
            self.sched.add(seq)
        except ValueError:
            final = min(len(prompt) + max_tokens, self.sched.max_model_len)
            assert (not prompt or len(prompt) > self.sched.max_model_len
                    or self.kv.blocks_needed(max(len(prompt), final - 1)) > self.kv.num_blocks)

    @rule(data=st.data())
    def step(self, data):
        if self.sched.has_unfinished():
            self._step(lambda: data.draw(st.integers(0, 9)), lambda: data.draw(st.booleans()))

    @rule(data=st.data())
    def abort(self, data):
        if not self.sched.has_unfinished():
            return
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        self.sched.finish(rid)
        assert self.sched.requests.get(rid) is None

    def _step(self, draw_token, draw_stop):
        out = self.sched.schedule()
        assert out.num_tokens <= self.sched.max_num_batched_tokens
        assert len(self.sched.running) <= self.sched.max_num_seqs
        assert not (any(out.swap_in) and any(out.swap_out))
        assert out.chunks or not self.sched.has_unfinished(), "the scheduler stalled"
        assert all(c.num_tokens > 0 for c in out.chunks)
        for name, happened in (("preemption", out.preempted), ("swap out", any(out.swap_out)),
                               ("swap in", any(out.swap_in)), ("prefix hit", self.sched.prefix_hits),
                               ("sliding block freed", any(NULL_BLOCK in t for s in self.sched.running
                                                           for t in s.block_tables))):
            if happened:
                event(name)
        self._copy(out.swap_out, self.device, self.host)
        self._copy(out.swap_in, self.host, self.device)
        for g, loads in enumerate(out.loads):  # what a tier gives back must be the prefix asked for
            for block, data in loads:
                self.device[g][block] = pickle.loads(data[4:4 + int.from_bytes(data[:4].numpy(), "little")].numpy())
            if loads:
                event("tier load")
        for chunk in out.chunks:
            self._compute(chunk.seq, chunk.start, chunk.num_tokens)
        sampled = {c.seq.request_id: draw_token() for c in out.chunks if c.samples}
        self.sched.update(out, sampled)
        for chunk in out.chunks:
            seq = chunk.seq
            if chunk.samples and (len(seq.output_ids) >= seq.max_tokens
                                  or seq.num_tokens >= self.sched.max_model_len or draw_stop()):
                self.sched.finish(seq.request_id)

    def _read_blocks(self, group, blocks):
        rows = torch.zeros(len(blocks), ROW, dtype=torch.uint8)
        for row, block in zip(rows, blocks):
            raw = pickle.dumps(list(self.device[group][block]))
            assert len(raw) + 4 <= ROW
            row[:4] = torch.tensor(list(len(raw).to_bytes(4, "little")), dtype=torch.uint8)
            row[4:4 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        return rows

    @rule()
    def restart_disk_tier(self):
        """A new process on the same directory: it reads back what the old one wrote."""
        if self.chain is None or self.chain.disk is None:
            return
        old = self.chain.disk
        old.close()
        self.chain.disk = DiskTier(self.folder, old.stats.budget, self.fingerprint)
        assert self.chain.disk.stats.blocks == old.stats.blocks

    def _copy(self, copies, src, dst):
        for g, pairs in enumerate(copies):
            for a, b in pairs:
                dst[g][b] = list(src[g][a])

    def _compute(self, seq, start, n):
        """Check every slot the chunk's queries read holds its own prefix, then write the chunk."""
        bs = self.kv.block_size
        for g, group in enumerate(self.groups):
            table = seq.block_tables[g]
            first = 0 if group.window is None else max(0, start - group.window + 1)
            for pos in range(first, start + n):
                block = table[pos // bs]
                assert block != NULL_BLOCK, (seq.request_id, g, pos)
                if pos < start:
                    assert self.device[g][block][pos % bs] == tuple(seq.token_ids[:pos + 1])
            for pos in range(start, start + n):
                self.device[g][table[pos // bs]][pos % bs] = tuple(seq.token_ids[:pos + 1])

    # --- invariants ----------------------------------------------------------------------------
    @invariant()
    def pools_consistent(self):
        live = list(self.sched.requests.values())
        for g, pool in enumerate(self.kv.pools):
            refs = [0] * pool.num_blocks
            for seq in live:
                if seq.status is not SeqStatus.RUNNING:
                    assert not seq.block_tables
                    continue
                held = [b for b in seq.block_tables[g] if b != NULL_BLOCK]
                assert len(held) == len(set(held)), "a block owned twice by one sequence"
                for b in held:
                    refs[b] += 1
            assert refs == pool.ref_cnt
            free, cached = set(pool.free_ids()), set(pool.cached_ids())
            used = {b for b in range(pool.num_blocks) if pool.ref_cnt[b] > 0}
            assert not (free & cached) and not (free & used) and not (cached & used)
            assert len(free) + len(cached) + len(used) == pool.num_blocks
            assert all(pool.hash_of[b] is not None for b in cached)
            assert all(pool.hash_of[b] is None for b in free)
            for b in used:  # a shared block is a cached full prefix block
                assert pool.ref_cnt[b] == 1 or pool.hash_of[b] is not None
        for g, free in enumerate(self.kv.host_free):
            held = [b for s in live for b in (s.host_tables[g] if s.host_tables else []) if b != NULL_BLOCK]
            assert len(held) == len(set(held)) and not set(held) & set(free)
            assert len(held) + len(free) == self.kv.num_host_blocks

    @invariant()
    def tiers_within_budget(self):
        if self.chain is None:
            return
        self.chain.flush()
        for tier in self.chain.tiers:
            assert tier.stats.used <= tier.stats.budget, tier.stats
        if self.chain.disk is not None:
            on_disk = sum(p.stat().st_size for p in self.folder.rglob("*.kvb"))
            assert on_disk == self.chain.disk.stats.used <= self.chain.disk.stats.budget

    @invariant()
    def counters_sane(self):
        assert 0 <= self.sched.prefix_hits <= self.sched.prefix_queries
        assert self.sched.num_waiting + self.sched.num_swapped + len(self.sched.running) == \
            len(self.sched.requests)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(2000):  # every admitted request finishes: no deadlock
            if not self.sched.has_unfinished():
                break
            self._step(lambda: 1, lambda: False)
        assert not self.sched.has_unfinished()
        for pool in self.kv.pools:
            assert pool.num_used == 0 and pool.num_free + pool.num_cached == pool.num_blocks
        assert all(len(free) == self.kv.num_host_blocks for free in self.kv.host_free)
        if self.chain is not None:
            self.chain.close()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
