"""Paged attention in plain PyTorch: the backend the model calls as ``attn.attend(layer, q, k, v)``.

Per step the runner prepares, for each layer group, where each new token's K/V go (slot mapping)
and which slots each sequence reads (its block table expanded over the positions it can see: its
whole context, or its window). Each layer then writes the new K/V through the slot mapping and
reads, per sequence, only the slots it can see:
- prefill chunks (several new tokens of one sequence): one SDPA each, causal over the cached
  prefix plus the chunk (a window mask on sliding layers);
- decodes (one new token each): bucketed by context length (lengths within 3/4 of the bucket's
  longest share one padded SDPA), so the work follows the tokens actually cached, not the longest
  sequence of the batch. Where ``kvlab.kernels.paged_attention`` runs (fp32 or bf16 queries, an
  fp32 or bf16 cache, AVX2), each bucket is one call that reads the slots in place, with no gathered copy.
- sequences whose eviction policy needs attention scores (h2o, snapkv): one explicit softmax
  pass each (``attend_scored``), which adds each key's attention mass to the sequence's scores.
Blocks a sequence gave back (a window's past, evicted tokens) are skipped; the keys it still holds
keep their positions, so masks are built from positions, not from slot order.
A GPU kernel (FlashAttention's varlen / paged KV) would replace ``attend`` and reuse the metadata.

``InvariantAttention`` is the deterministic mode's backend: the same cache, but every query
computed so that a token's output does not depend on the batch, the chunking, or the decode
padding: by ``kvlab.kernels.paged_attention`` where it runs (each query row on its own, prompt
tokens and decodes alike: ``RowLayout``), otherwise with each sequence's keys laid out by
absolute position in fixed splits (``split_layout``) through
``kvlab.models.invariant.split_attention``. Sequences whose policy needs attention scores always
take the split path, which returns them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab import kernels
from kvlab.engine.kv_cache import PagedKVCache
from kvlab.engine.sequence import NULL_BLOCK
from kvlab.layout import LayerGroup, cdiv
from kvlab.models.attention import _mask, _sdpa, attend_scored
from kvlab.models.invariant import SPLIT, split_attention

BUCKET_RATIO = 0.75  # a decode joins a bucket if its context is >= 3/4 of the bucket's longest


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's part of the step: compute positions [start, start + num_tokens).

    For an eviction policy that needs attention scores, ``scores`` is the sequence's per-position
    attention mass, to which this step adds the weights of the queries at positions in
    ``voters``."""

    block_tables: list[list[int]]  # per group
    start: int
    num_tokens: int
    scores: Tensor | None = None
    voters: range = range(0)


@dataclass(frozen=True)
class PrefillSpan:
    rows: slice  # query rows in the flat batch
    key_slots: Tensor  # [L] slots of the positions the chunk's queries can see
    mask: Tensor | None  # [n, L] True = attend; None with causal (or nothing to mask)
    causal: bool


@dataclass(frozen=True)
class DecodeBucket:
    rows: Tensor  # [b] query rows, ascending
    key_slots: Tensor  # [b, L], padded with each row's last slot
    mask: Tensor | None  # [b, 1, 1, L] True = real key; None when no row is padded
    lengths: Tensor  # [b] each row's real keys (the first of its key_slots)
    all_rows: bool = False  # rows are 0..T-1: the step's only work, no gather/scatter of rows


@dataclass(frozen=True)
class ScoredSpan:
    """A sequence whose attention weights an eviction policy needs (computed without SDPA)."""

    rows: slice
    key_slots: Tensor  # [L]
    key_positions: Tensor  # [L]
    mask: Tensor | None  # [n, L]
    voters: Tensor  # [n] bool: queries whose weights count
    scores: Tensor  # the sequence's per-position attention mass, added to in place


@dataclass(frozen=True)
class GroupStep:
    """One layer group's view of the step."""

    slot_mapping: Tensor  # [T] where each new token's K/V go
    prefills: list[PrefillSpan]
    decodes: list[DecodeBucket]
    scored: list[ScoredSpan]


def token_slots(table: list[int], start: int, end: int, block_size: int) -> tuple[Tensor, Tensor | None]:
    """Slots of positions [start, end) through a block table, skipping blocks given back (a
    sliding window's past, or evicted tokens). Returns the slots and, if any block was skipped,
    the positions they hold (None: positions start..end-1 as they are)."""
    first = start // block_size
    part = table[first:cdiv(end, block_size)]
    blocks = torch.tensor(part, dtype=torch.long)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
    lo, hi = start - first * block_size, end - first * block_size
    if NULL_BLOCK not in part:
        return slots[lo:hi], None
    positions = torch.arange(first * block_size, first * block_size + len(part) * block_size)
    keep = (blocks != NULL_BLOCK).repeat_interleave(block_size)
    keep[:lo] = False
    keep[hi:] = False
    return slots[keep], positions[keep]


def build_group_step(spans: list[SeqSpan], group_idx: int, group: LayerGroup, block_size: int,
                     device: torch.device | str) -> GroupStep:
    """Slot mapping, prefill spans and decode buckets of one group for this step."""
    window = group.window
    mapping, prefills, decodes, scored = [], [], [], []
    row = 0
    for span in spans:
        start, n = span.start, span.num_tokens
        end = start + n
        k_start = 0 if window is None else max(0, start - window + 1)
        slots, kept_pos = token_slots(span.block_tables[group_idx], k_start, end, block_size)
        mapping.append(slots[-n:])
        k_pos = kept_pos if kept_pos is not None else torch.arange(k_start, end)
        q_pos = torch.arange(start, end)
        if span.scores is not None:
            voters = (q_pos >= span.voters.start) & (q_pos < span.voters.stop)
            mask = _mask(q_pos, k_pos, window) if n > 1 else None
            scored.append(ScoredSpan(slice(row, row + n), slots.to(device), k_pos.to(device),
                                     None if mask is None else mask.to(device), voters.to(device),
                                     span.scores))
        elif n == 1:
            decodes.append((row, slots))
        else:
            causal = start == 0 and kept_pos is None and (window is None or window >= n)
            mask = None
            if not causal:
                mask = _mask(q_pos, k_pos, window).to(device)
            prefills.append(PrefillSpan(slice(row, row + n), slots.to(device), mask, causal))
        row += n
    buckets = _buckets(decodes, device, all_rows=not prefills and not scored)
    return GroupStep(torch.cat(mapping).to(device), prefills, buckets, scored)


def _buckets(decodes: list[tuple[int, Tensor]], device: torch.device | str,
             all_rows: bool = False) -> list[DecodeBucket]:
    """Group decodes of similar context length; pad each bucket to its longest. `all_rows`:
    the step has nothing but these decodes."""
    out = []
    pending = sorted(decodes, key=lambda d: -len(d[1]))
    while pending:
        longest = len(pending[0][1])
        take = [d for d in pending if len(d[1]) >= BUCKET_RATIO * longest]
        pending = pending[len(take):]
        take.sort(key=lambda d: d[0])  # rows in order: one bucket of a decode-only step is all rows
        lengths = [len(s) for _, s in take]
        slots = torch.stack([torch.cat([s, s[-1:].expand(longest - len(s))]) for _, s in take])
        mask = None
        if min(lengths) < longest:
            mask = (torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
            mask = mask.to(device)
        whole = all_rows and not out and not pending
        out.append(DecodeBucket(torch.tensor([r for r, _ in take], device=device),
                                slots.to(device), mask, torch.tensor(lengths), whole))
    return out


def _indices(*tensors: Tensor) -> tuple[Tensor, ...]:
    return tuple(t.to(torch.long).contiguous() for t in tensors)


class PagedAttention:
    """The attention backend over a PagedKVCache; `prepare` it before each forward pass."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self.steps: list[GroupStep] = []
        # (layers, dtype) -> where those layers' K/V lie for the native stack (None: some layer's
        # cache is not one the native attention reads): a cache's tensors stay put for its life
        self.native_caches: dict[tuple[tuple[tuple[int, int], ...], torch.dtype], kernels.CacheLayout | None] = {}
        self.rows: list[kernels.StepRows | None] | None = None

    def prepare(self, spans: list[SeqSpan], device: torch.device | str) -> None:
        self.steps = [build_group_step(spans, gi, g, self.cache.block_size, device)
                      for gi, g in enumerate(self.cache.groups)]
        self.rows = None  # each group's, at the first native_layout of the step

    def native_layout(self, layers: tuple[tuple[int, int], ...], dtype: torch.dtype
                      ) -> tuple[kernels.CacheLayout, list[kernels.StepRows]] | None:
        """See ``NativeAttention``: each group's rows are laid out once a step."""
        key = (layers, dtype)
        if key not in self.native_caches:
            self.native_caches[key] = self._cache_layout(layers, dtype)
        caches = self.native_caches[key]
        if caches is None:
            return None
        if self.rows is None:
            self.rows = [self._native_rows(gi) for gi in range(len(self.cache.groups))]
        if any(r is None for r in self.rows):
            return None
        return caches, self.rows  # type: ignore[return-value]

    def _cache_layout(self, layers: tuple[tuple[int, int], ...], dtype: torch.dtype) -> kernels.CacheLayout | None:
        caches = []
        for layer_idx, heads in layers:
            plain = self.cache.plain(layer_idx)
            if plain is None or not kernels.attention_fits(dtype, heads, plain[0].shape[-1], *plain):
                return None
            caches.append(plain)
        return kernels.CacheLayout(caches, [self.cache.group_of[i] for i, _ in layers])

    def _native_rows(self, gi: int) -> kernels.StepRows | None:
        """A decode-only step (one bucket, every row): its write slots, key slots, seqs, starts
        and lengths."""
        step = self.steps[gi]
        if len(step.decodes) != 1 or not step.decodes[0].all_rows:
            return None
        b = step.decodes[0]
        return kernels.StepRows(*_indices(step.slot_mapping, b.key_slots, torch.arange(len(b.lengths)),
                                          torch.zeros(len(b.lengths), dtype=torch.long), b.lengths))

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        step = self.steps[self.cache.group_of[layer_idx]]
        self.cache.write(layer_idx, k, v, step.slot_mapping)
        plain = self.cache.plain(layer_idx)
        native = plain is not None and kernels.attention_usable(q, *plain)
        if len(step.decodes) == 1 and step.decodes[0].all_rows:  # a decode-only step, one bucket
            b = step.decodes[0]
            if native:
                return kernels.paged_attention(q, *plain, b.key_slots, b.lengths)
            keys, vals = self.cache.read(layer_idx, b.key_slots, q.dtype)  # [KV, b, L, D]
            return _sdpa(q[:, :, None], keys.transpose(0, 1), vals.transpose(0, 1), b.mask)[:, :, 0]
        out = torch.empty_like(q)
        for p in step.prefills:
            keys, vals = self.cache.read(layer_idx, p.key_slots, q.dtype)  # [KV, L, D]
            o = _sdpa(q[p.rows].transpose(0, 1)[None], keys[None], vals[None], p.mask,
                      is_causal=p.causal)
            out[p.rows] = o[0].transpose(0, 1)
        for b in step.decodes:
            if native:
                out[b.rows] = kernels.paged_attention(q[b.rows], *plain, b.key_slots, b.lengths)
                continue
            keys, vals = self.cache.read(layer_idx, b.key_slots, q.dtype)  # [KV, b, L, D]
            o = _sdpa(q[b.rows][:, :, None], keys.transpose(0, 1), vals.transpose(0, 1), b.mask)
            out[b.rows] = o[:, :, 0]
        for s in step.scored:
            keys, vals = self.cache.read(layer_idx, s.key_slots, q.dtype)  # [KV, L, D]
            out[s.rows], mass = attend_scored(q[s.rows], keys, vals, s.mask, s.voters)
            s.scores.index_add_(0, s.key_positions, mass)
        return out


QUERY_CHUNK = 256  # query rows per split_attention call: bounds the [H, rows, L] weights held


@dataclass(frozen=True)
class SplitSpan:
    """Deterministic mode: B spans of n queries each (decodes: B sequences, n = 1; a prefill
    chunk or a scored span: B = 1), keys by absolute position in whole splits."""

    rows: Tensor  # [B, n] query rows in the flat batch
    key_slots: Tensor  # [B, L], L a multiple of SPLIT (slot 0 where a key is not valid)
    key_positions: Tensor  # [B, L]
    allowed: Tensor  # [B, n, L] True = the query sees the key
    voters: Tensor | None = None  # [B, n] for a scored span
    scores: Tensor | None = None  # the sequence's scores (B = 1), added to in place


def split_layout(table: list[int], lo: int, end: int, block_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Slots, positions and validity of the keys a span may read, from position ``lo`` (rounded
    down to a split) to ``end``, padded to whole splits; splits with no key held at all (given
    back or evicted) are left out, which changes no sum (their keys would add exact zeros)."""
    first = lo // SPLIT * SPLIT
    length = -(-(end - first) // SPLIT) * SPLIT
    positions = torch.arange(first, first + length)
    blocks = torch.tensor(table + [NULL_BLOCK] * (cdiv(first + length, block_size) - len(table)),
                          dtype=torch.long)[positions // block_size]
    valid = (blocks != NULL_BLOCK) & (positions < end) & (positions >= lo)
    slots = torch.where(valid, blocks * block_size + positions % block_size, 0)
    held = valid.view(-1, SPLIT).any(1).repeat_interleave(SPLIT)
    return slots[held], positions[held], valid[held]


@dataclass(frozen=True)
class RowLayout:
    """Deterministic mode's native path: query rows[i] reads the keys at
    ``slots[seqs[i], starts[i]:starts[i] + lengths[i]]`` (``kvlab.kernels.paged_attention``)."""

    rows: Tensor  # [R] query rows in the flat batch
    slots: Tensor  # [NS, L] each sequence's kept keys in position order, padded with slot 0
    seqs: Tensor  # [R]
    starts: Tensor  # [R]
    lengths: Tensor  # [R]


def row_layout(spans: list[tuple[Tensor, Tensor, Tensor, Tensor]]) -> RowLayout:
    """(rows, slots, first visible key, visible keys) per sequence -> one layout."""
    longest = max(len(s[1]) for s in spans)
    return RowLayout(torch.cat([s[0] for s in spans]),
                     torch.stack([F.pad(s[1], (0, longest - len(s[1]))) for s in spans]),
                     torch.cat([torch.full_like(s[0], i) for i, s in enumerate(spans)]),
                     torch.cat([s[2] for s in spans]), torch.cat([s[3] for s in spans]))


def build_split_spans(spans: list[SeqSpan], group_idx: int, group: LayerGroup, block_size: int,
                      device: torch.device | str, native: bool = False
                      ) -> tuple[Tensor, list[SplitSpan], RowLayout | None]:
    """The slot mapping, split spans and (``native``: for the sequences that need no scores) the
    row layout of one group for this step (deterministic mode)."""
    window = group.window
    mapping, out, decodes, rowwise = [], [], [], []
    row = 0
    for span in spans:
        start, n = span.start, span.num_tokens
        end = start + n
        table = span.block_tables[group_idx]
        mapping.append(token_slots(table, start, end, block_size)[0])
        lo = 0 if window is None else max(0, start - window + 1)
        if native and span.scores is None:
            # every query sees a run of the kept keys: from the window's first to its own position
            slots, kept = token_slots(table, lo, end, block_size)
            k_pos = kept if kept is not None else torch.arange(lo, end)
            q_pos = torch.arange(start, end)
            first = (torch.zeros(n, dtype=torch.long) if window is None
                     else torch.searchsorted(k_pos, q_pos - window + 1))
            last = torch.searchsorted(k_pos, q_pos, right=True)
            rowwise.append((torch.arange(row, row + n), slots, first, last - first))
            row += n
            continue
        slots, k_pos, valid = split_layout(table, lo, end, block_size)
        q_pos = torch.arange(start, end)
        allowed = _mask(q_pos, k_pos, window) & valid[None, :]
        rows = torch.arange(row, row + n)
        if span.scores is not None:
            voters = (q_pos >= span.voters.start) & (q_pos < span.voters.stop)
            out.append(SplitSpan(rows[None].to(device), slots[None].to(device), k_pos[None].to(device),
                                 allowed[None].to(device), voters[None].to(device), span.scores))
        elif n == 1:
            decodes.append((rows, slots, k_pos, allowed))
        else:
            out.append(SplitSpan(rows[None].to(device), slots[None].to(device), k_pos[None].to(device),
                                 allowed[None].to(device)))
        row += n
    if decodes:  # one batch: shorter key lists padded with splits nobody sees (exact zeros)
        longest = max(len(d[1]) for d in decodes)

        def pad(t: Tensor, value: int | bool) -> Tensor:
            return torch.cat([t, t.new_full((*t.shape[:-1], longest - t.shape[-1]), value)], -1)

        out.append(SplitSpan(torch.stack([d[0] for d in decodes]).to(device),
                             torch.stack([pad(d[1], 0) for d in decodes]).to(device),
                             torch.stack([pad(d[2], 0) for d in decodes]).to(device),
                             torch.stack([pad(d[3], False) for d in decodes]).to(device)))
    return torch.cat(mapping).to(device), out, row_layout(rowwise) if rowwise else None


class InvariantAttention(PagedAttention):
    """The paged backend of deterministic mode: every query through the native kernel (one row
    at a time) where it reads this cache, otherwise through ``split_attention``, with matmul rows
    in whole ``row_block``s (the block the linear layers' probe found stable)."""

    def __init__(self, cache: PagedKVCache, row_block: int) -> None:
        super().__init__(cache)
        self.row_block = row_block
        self.spans: list[SeqSpan] = []
        self.device: torch.device | str = "cpu"
        self.split_steps: dict[int, tuple[Tensor, list[SplitSpan], RowLayout | None]] = {}

    def prepare(self, spans: list[SeqSpan], device: torch.device | str) -> None:
        # laid out per group at its first layer, when the queries' dtype says which path runs
        self.spans, self.device, self.split_steps = spans, device, {}
        self.rows = None

    def _group_step(self, gi: int, native: bool) -> tuple[Tensor, list[SplitSpan], RowLayout | None]:
        if gi not in self.split_steps:
            self.split_steps[gi] = build_split_spans(self.spans, gi, self.cache.groups[gi],
                                                     self.cache.block_size, self.device, native)
        return self.split_steps[gi]

    def _native_rows(self, gi: int) -> kernels.StepRows | None:
        """A step whose every row runs one by one through the native attention (no scored
        spans)."""
        mapping, spans, rowwise = self._group_step(gi, True)
        if rowwise is None or spans:
            return None
        return kernels.StepRows(*_indices(mapping, rowwise.slots, rowwise.seqs, rowwise.starts, rowwise.lengths))

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        plain = self.cache.plain(layer_idx)
        native = plain is not None and kernels.attention_usable(q, *plain)
        mapping, spans, rowwise = self._group_step(self.cache.group_of[layer_idx], native)
        self.cache.write(layer_idx, k, v, mapping)
        if rowwise is not None and not spans:  # every row, in order: no gather or scatter
            assert plain is not None
            return kernels.paged_attention(q, *plain, rowwise.slots, rowwise.lengths, rowwise.starts,
                                           rowwise.seqs)
        out = torch.empty_like(q)
        if rowwise is not None:
            assert plain is not None
            out[rowwise.rows] = kernels.paged_attention(q[rowwise.rows], *plain, rowwise.slots,
                                                        rowwise.lengths, rowwise.starts, rowwise.seqs)
        for s in spans:
            keys, vals = self.cache.read(layer_idx, s.key_slots, q.dtype)  # [KV, B, L, D]
            keys, vals = keys.transpose(0, 1), vals.transpose(0, 1)
            for a in range(0, s.rows.shape[1], QUERY_CHUNK):
                rows = s.rows[:, a:a + QUERY_CHUNK]
                voters = None if s.voters is None else s.voters[:, a:a + QUERY_CHUNK]
                o, mass = split_attention(q[rows], keys, vals, s.allowed[:, a:a + QUERY_CHUNK],
                                          self.row_block, voters)
                out[rows] = o
                if mass is not None and s.scores is not None:
                    s.scores.index_add_(0, s.key_positions[0], mass[0])
        return out
