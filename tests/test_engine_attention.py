"""The engine's attention layout (``build_group_step``), as both backends read it: in a mixed step
(prefill chunks, decodes, a scored chunk; a full and a sliding-window group; blocks given back
or evicted) every query's output is plain attention over the keys its sequence still holds
within its window, the new K/V land at their sequences' slots, and a scored chunk's voters add
their attention weights. Deterministic mode's split layout also gives each sequence the bits of
its solo run.

The cache's fp32 blocks are read in place by ``kvlab.kernels.paged_attention`` where it runs;
fp16 blocks are not, so they take PyTorch's paths (SDPA, ``split_attention``)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch

from kvlab.engine.attention import InvariantAttention, PagedAttention, SeqSpan
from kvlab.engine.kv_cache import PagedKVCache
from kvlab.engine.sequence import NULL_BLOCK
from kvlab.layout import cdiv, layer_groups
from kvlab.eviction import SCORE_ONE
from kvlab.spec import spec_from_config
from tests.test_engine_parity import tiny_config

BLOCK, WINDOW, HEADS, KV, D = 4, 6, 4, 2, 32
BLOCKS = 64
ROW_BLOCK = 4  # deterministic mode's matmul row block (any does for attention's outcome)


@dataclass
class Seq:
    start: int  # positions cached before the step
    num_tokens: int  # new this step
    evicted: tuple[int, ...] = ()  # full-group blocks an eviction policy gave back
    voters: range | None = None  # a scored chunk: the positions whose queries vote

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


MIXED = [
    Seq(9, 7),  # a prefill chunk after a cached prefix (the sliding group gave block 0 back)
    Seq(21, 1),  # a long decode: the window holds its last 6 positions only
    Seq(3, 1),  # a short decode (another bucket of the paged layout)
    Seq(0, 9),  # a fresh prompt longer than the window
    Seq(4, 3, voters=range(5, 8)),  # a scored chunk: queries at 5 and 6 vote, 4 does not
    Seq(17, 1, evicted=(1, 2)),  # a decode whose positions 4..11 were evicted
]
DECODES = [Seq(21, 1), Seq(3, 1), Seq(17, 1, evicted=(1, 2)), Seq(12, 1)]


def spec():
    return spec_from_config(tiny_config(num_hidden_layers=2, sliding_window=WINDOW,
                                        layer_types=["sliding_attention", "full_attention"]), "tiny")


class World:
    """A cache holding each sequence's K/V history at its blocks (noise everywhere else), with
    the block tables that say where, and the step's new tokens."""

    def __init__(self, seqs: list[Seq], kv_dtype: str, seed: int = 0) -> None:
        self.spec = spec()
        self.groups = layer_groups(self.spec)
        assert [g.window for g in self.groups] == [WINDOW, None]
        self.seqs = seqs
        self.cache = PagedKVCache(self.spec, self.groups, BLOCKS, BLOCK, kv_dtype)
        g = torch.Generator().manual_seed(seed)
        for tensors in self.cache.blocks.values():
            for t in tensors:
                t.copy_(torch.randn(t.shape, generator=g))
        pool = list(range(BLOCKS))
        random.Random(seed).shuffle(pool)
        self.tables = []  # per sequence, per group
        for s in seqs:
            tables = []
            for group in self.groups:
                table = []
                for b in range(cdiv(s.end, BLOCK)):
                    gone = ((b + 1) * BLOCK <= s.start - WINDOW + 1 if group.window else b in s.evicted)
                    table.append(NULL_BLOCK if gone else pool.pop())
                tables.append(table)
            self.tables.append(tables)
        # per layer, per sequence: K, V [end, KV, D] and the queries [num_tokens, H, D]
        self.k = [[torch.randn(s.end, KV, D, generator=g) for s in seqs] for _ in self.spec.layers]
        self.v = [[torch.randn(s.end, KV, D, generator=g) for s in seqs] for _ in self.spec.layers]
        self.q = [[torch.randn(s.num_tokens, HEADS, D, generator=g) for s in seqs] for _ in self.spec.layers]
        stored = self.cache.storage
        for layer in range(len(self.spec.layers)):
            for i, s in enumerate(seqs):
                cached = [p for p in range(s.start) if self.held(i, layer, p)]
                if cached:
                    self.cache.write(layer, self.k[layer][i][cached].to(stored), self.v[layer][i][cached].to(stored),
                                     self.slots(i, layer, cached))

    def group(self, layer: int) -> int:
        return self.cache.group_of[layer]

    def held(self, i: int, layer: int, p: int) -> bool:
        return self.tables[i][self.group(layer)][p // BLOCK] != NULL_BLOCK

    def slots(self, i: int, layer: int, positions: list[int]) -> torch.Tensor:
        table = self.tables[i][self.group(layer)]
        return torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in positions])

    def spans(self, scores: dict[int, torch.Tensor]) -> list[SeqSpan]:
        return [SeqSpan(self.tables[i], s.start, s.num_tokens) if s.voters is None
                else SeqSpan(self.tables[i], s.start, s.num_tokens, scores[i], s.voters)
                for i, s in enumerate(self.seqs)]

    def run(self, backend: str) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
        """Every layer's output [T, H, D] for the step, and the scored sequences' scores."""
        attn = PagedAttention(self.cache) if backend == "paged" else InvariantAttention(self.cache, ROW_BLOCK)
        scores = {i: torch.zeros(64, dtype=torch.long) for i, s in enumerate(self.seqs) if s.voters is not None}
        attn.prepare(self.spans(scores), "cpu")
        outs = []
        with torch.inference_mode():
            for layer in range(len(self.spec.layers)):
                new = [slice(s.start, s.end) for s in self.seqs]
                outs.append(attn.attend(layer, torch.cat(self.q[layer]),
                                        torch.cat([k[n] for k, n in zip(self.k[layer], new)]),
                                        torch.cat([v[n] for v, n in zip(self.v[layer], new)])))
        return outs, scores

    def reference(self, layer: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax attention in float64 of sequence i's queries over the keys each may see (causal,
        within the window on the sliding layer, held blocks only), K/V as the cache stores them;
        and each key position's weight summed over heads and the voting queries."""
        s, window = self.seqs[i], self.groups[self.group(layer)].window
        as_stored = self.cache.storage
        k = self.k[layer][i].to(as_stored).double()
        v = self.v[layer][i].to(as_stored).double()
        out = torch.empty(s.num_tokens, HEADS, D, dtype=torch.float64)
        mass = torch.zeros(64, dtype=torch.float64)
        for a, p in enumerate(range(s.start, s.end)):
            seen = [j for j in range(p + 1) if self.held(i, layer, j) and (window is None or j > p - window)]
            for h in range(HEADS):
                kh = k[seen, h // (HEADS // KV)]
                w = torch.softmax(kh @ self.q[layer][i][a, h].double() / math.sqrt(D), 0)
                out[a, h] = w @ v[seen, h // (HEADS // KV)]
                if s.voters is not None and p in s.voters:
                    mass[seen] += w
        return out, mass


def rows_of(seqs: list[Seq]) -> list[slice]:
    at = [0]
    for s in seqs:
        at.append(at[-1] + s.num_tokens)
    return [slice(a, b) for a, b in zip(at, at[1:])]


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("backend", ["paged", "invariant"])
@pytest.mark.parametrize("step", ["mixed", "decodes"])
def test_every_query_attends_to_the_keys_its_sequence_holds_in_its_window(step, backend, kv_dtype):
    world = World(MIXED if step == "mixed" else DECODES, kv_dtype)
    outs, scores = world.run(backend)
    tol = dict(atol=2e-5, rtol=1e-5)
    for layer, out in enumerate(outs):
        assert out.shape == (sum(s.num_tokens for s in world.seqs), HEADS, D)
        for i, rows in enumerate(rows_of(world.seqs)):
            ref, mass = world.reference(layer, i)
            torch.testing.assert_close(out[rows].double(), ref, **tol, msg=f"layer {layer}, sequence {i}")
            # the new K/V went to the sequence's slots of its new positions
            s = world.seqs[i]
            keys, vals = world.cache.read(layer, world.slots(i, layer, list(range(s.start, s.end))), torch.float64)
            assert torch.equal(keys.transpose(0, 1), world.k[layer][i][s.start:].to(world.cache.storage).double())
            assert torch.equal(vals.transpose(0, 1), world.v[layer][i][s.start:].to(world.cache.storage).double())
    # eviction scores count the full-attention layers only (the sliding one keeps its window)
    full = [layer for layer in range(len(outs)) if world.groups[world.group(layer)].window is None]
    expected = {i: sum(world.reference(layer, i)[1] for layer in full) for i in scores}
    assert scores.keys() == ({4} if step == "mixed" else set())
    for i, got in scores.items():
        torch.testing.assert_close(got.double() / SCORE_ONE, expected[i], atol=1e-5, rtol=1e-5)
        assert got[world.seqs[i].end:].eq(0).all()


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16"])
def test_the_split_layout_gives_each_sequence_its_solo_bits(kv_dtype):
    """Deterministic mode: each sequence's outputs and scores in the mixed step are bitwise its
    outputs when it runs alone."""
    world = World(MIXED, kv_dtype)
    together, scores = world.run("invariant")
    for i, rows in enumerate(rows_of(MIXED)):
        alone = World(MIXED, kv_dtype)  # the same cache, tables and tokens...
        alone.seqs, alone.tables = [MIXED[i]], [alone.tables[i]]  # ...and only sequence i in the step
        for name in ("k", "v", "q"):
            setattr(alone, name, [per_layer[i:i + 1] for per_layer in getattr(alone, name)])
        outs, solo_scores = alone.run("invariant")
        for layer in range(len(outs)):
            assert torch.equal(together[layer][rows], outs[layer]), (i, layer)
        if i in scores:
            assert torch.equal(scores[i], solo_scores[0])
