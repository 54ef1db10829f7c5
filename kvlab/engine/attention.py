"""Paged attention in plain PyTorch: the backend the model calls as ``attn.attend(layer, q, k, v)``.

Per step, each layer group's layout is built once, at the group's first layer
(``build_group_step``): where each new token's K/V go (slot mapping) and which slots each query
reads (its block table expanded over the positions it can see: its whole context, or its
window). Each layer then writes the new K/V through the slot mapping and reads, per sequence,
only the slots it can see:
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

``InvariantAttention`` is the deterministic mode's backend: the same cache and the same layout
built with a split size (``SPLIT``), so that a token's output does not depend on the batch, the
chunking, or the decode padding: every query by ``kvlab.kernels.paged_attention`` where it runs
(each query row on its own, prompt tokens and decodes alike: ``RowLayout``), otherwise with each
sequence's keys laid out by absolute position in whole splits (``SplitSpan``) through
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
from kvlab.eviction import add_scores
from kvlab.models.attention import _mask, _sdpa, attend_scored
from kvlab.models.invariant import SPLIT, split_attention

BUCKET_RATIO = 0.75  # a decode joins a bucket if its context is >= 3/4 of the bucket's longest
QUERY_CHUNK = 256  # query rows per split_attention call: bounds the [H, rows, L] weights held


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's part of the step: compute positions [start, start + num_tokens).

    For an eviction policy that needs attention scores, ``scores`` is the sequence's per-position
    attention mass ([n], or [n, layers * heads] per head), to which this step adds the weights
    of the queries at positions in ``voters``."""

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
class SplitSpan:
    """The split layout: B spans of n queries each (decodes: B sequences, n = 1; a prefill
    chunk or a scored span: B = 1), keys by absolute position in whole splits."""

    rows: Tensor  # [B, n] query rows in the flat batch
    key_slots: Tensor  # [B, L], L a multiple of the split (slot 0 where a key is not valid)
    key_positions: Tensor  # [B, L]
    allowed: Tensor  # [B, n, L] True = the query sees the key
    voters: Tensor | None = None  # [B, n] for a scored span
    scores: Tensor | None = None  # the sequence's scores (B = 1), added to in place


@dataclass(frozen=True)
class RowLayout:
    """Rows for the native kernel one by one (``kvlab.kernels.paged_attention``): query rows[i]
    reads the keys at ``slots[seqs[i], starts[i]:starts[i] + lengths[i]]``."""

    rows: Tensor  # [R] query rows in the flat batch
    slots: Tensor  # [NS, L] each sequence's kept keys in position order, padded
    seqs: Tensor  # [R]
    starts: Tensor  # [R]
    lengths: Tensor  # [R]


@dataclass(frozen=True)
class GroupStep:
    """One layer group's layout of the step (``build_group_step``): the paged layout fills
    ``prefills``, ``decodes`` and ``scored``, the split layout ``splits`` and (where the native
    kernel runs) ``rowwise``."""

    slot_mapping: Tensor  # [T] where each new token's K/V go
    prefills: list[PrefillSpan]
    decodes: list[DecodeBucket]
    scored: list[ScoredSpan]
    splits: list[SplitSpan]
    rowwise: RowLayout | None  # the split layout's unscored rows, or the paged one's only bucket
    whole: bool  # rowwise holds every row, in order


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


def on_splits(slots: Tensor, positions: Tensor, split: int) -> tuple[Tensor, Tensor, Tensor]:
    """Keys (slots at ascending positions) laid out by absolute position in whole splits: the
    slots (0 where a position holds no key), positions and validity of every split that holds a
    key; the others are left out, which changes no sum (their keys would add exact zeros)."""
    held, which = torch.unique_consecutive(positions // split, return_inverse=True)
    at = which * split + positions % split
    grid = torch.zeros(len(held) * split, dtype=slots.dtype)
    grid[at] = slots
    valid = torch.zeros(len(held) * split, dtype=torch.bool)
    valid[at] = True
    return grid, (held[:, None] * split + torch.arange(split)).flatten(), valid


def build_group_step(spans: list[SeqSpan], group_idx: int, group: LayerGroup, block_size: int,
                     device: torch.device | str, split: int | None = None, native: bool = False) -> GroupStep:
    """One group's layout of this step: each span's new slots and the keys its queries may read
    (from its window's first position on, blocks given back skipped). ``split`` None: the paged
    layout (prefill spans, decode buckets, scored spans). A split size: deterministic mode's,
    each span's keys in whole splits (``SplitSpan``; the decodes in one batch), or, with
    ``native``, the spans that need no scores as rows for the native kernel (``RowLayout``)."""
    window = group.window
    mapping, prefills, decodes, scored, splits, rowwise = [], [], [], [], [], []
    row = 0
    for span in spans:
        start, n = span.start, span.num_tokens
        end = start + n
        lo = 0 if window is None else max(0, start - window + 1)
        slots, kept = token_slots(span.block_tables[group_idx], lo, end, block_size)
        mapping.append(slots[-n:])
        k_pos = kept if kept is not None else torch.arange(lo, end)
        q_pos = torch.arange(start, end)
        rows = slice(row, row + n)
        row += n
        voters = None
        if span.scores is not None and window is None:  # eviction scores full layers only
            voters = (q_pos >= span.voters.start) & (q_pos < span.voters.stop)
        if split is None:
            if voters is not None:
                mask = _mask(q_pos, k_pos, window).to(device) if n > 1 else None
                scored.append(ScoredSpan(rows, slots.to(device), k_pos.to(device), mask, voters.to(device),
                                         span.scores))
            elif n == 1:
                decodes.append((rows.start, slots))
            else:
                causal = start == 0 and kept is None and (window is None or window >= n)
                mask = None if causal else _mask(q_pos, k_pos, window).to(device)
                prefills.append(PrefillSpan(rows, slots.to(device), mask, causal))
        elif native and voters is None:
            # every query sees a run of the kept keys: from the window's first to its own position
            first = (torch.zeros(n, dtype=torch.long) if window is None
                     else torch.searchsorted(k_pos, q_pos - window + 1))
            last = torch.searchsorted(k_pos, q_pos, right=True)
            rowwise.append((torch.arange(rows.start, rows.stop), slots, first, last - first))
        else:
            slots, k_pos, valid = on_splits(slots, k_pos, split)
            allowed = _mask(q_pos, k_pos, window) & valid[None, :]
            if n == 1 and voters is None:
                decodes.append((rows.start, slots, k_pos, allowed))
                continue
            laid = (torch.arange(rows.start, rows.stop), slots, k_pos, allowed)
            splits.append(SplitSpan(*(t[None].to(device) for t in laid),
                                    None if voters is None else voters[None].to(device), span.scores))
    buckets = []
    # paged: decodes of similar context share a bucket; split: one batch, shorter key lists
    # padded with splits nobody sees (exact zeros)
    for longest, take in _by_length(decodes, BUCKET_RATIO if split is None else 0.0):
        if split is not None:
            padded = (_padded([d[i] for d in take], longest, zeros=True).to(device) for i in (1, 2, 3))
            splits.append(SplitSpan(torch.tensor([[d[0]] for d in take], device=device), *padded))
            continue
        lengths = [len(s) for _, s in take]
        mask = None
        if min(lengths) < longest:
            mask = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
            mask = mask[:, None, None, :].to(device)
        slots = _padded([s for _, s in take], longest).to(device)
        buckets.append(DecodeBucket(torch.tensor([r for r, _ in take], device=device), slots, mask,
                                    torch.tensor(lengths)))
    layout = None
    if rowwise:
        layout = _row_layout(rowwise)
    elif len(buckets) == 1 and not prefills and not scored:  # a decode-only step: one row per sequence
        b = buckets[0]
        layout = RowLayout(b.rows, b.key_slots, torch.arange(len(b.lengths)),
                           torch.zeros(len(b.lengths), dtype=torch.long), b.lengths)
    return GroupStep(torch.cat(mapping).to(device), prefills, buckets, scored, splits, layout,
                     layout is not None and not splits)


def _by_length(decodes: list[tuple], ratio: float) -> list[tuple[int, list[tuple]]]:
    """Decodes (row, key slots, ...) batched by their keys' count: each batch takes every decode
    left with at least ``ratio`` x the longest's keys (0: all in one); its longest and its decodes
    in row order (one batch of a decode-only step is all rows)."""
    out = []
    pending = sorted(decodes, key=lambda d: -len(d[1]))
    while pending:
        longest = len(pending[0][1])
        take = [d for d in pending if len(d[1]) >= ratio * longest]
        pending = pending[len(take):]
        out.append((longest, sorted(take, key=lambda d: d[0])))
    return out


def _padded(tensors: list[Tensor], longest: int, zeros: bool = False) -> Tensor:
    """Tensors [..., L_i] stacked, each padded along its last axis to ``longest`` with its last
    entries (``zeros``: with zeros / False)."""
    return torch.stack([torch.cat([t, (t.new_zeros(()) if zeros else t[..., -1:]).expand(
        *t.shape[:-1], longest - t.shape[-1])], -1) for t in tensors])


def _row_layout(spans: list[tuple[Tensor, Tensor, Tensor, Tensor]]) -> RowLayout:
    """(rows, slots, first visible key, visible keys) per sequence -> one layout."""
    longest = max(len(s[1]) for s in spans)
    return RowLayout(torch.cat([s[0] for s in spans]),
                     torch.stack([F.pad(s[1], (0, longest - len(s[1]))) for s in spans]),
                     torch.cat([torch.full_like(s[0], i) for i, s in enumerate(spans)]),
                     torch.cat([s[2] for s in spans]), torch.cat([s[3] for s in spans]))


def _indices(*tensors: Tensor) -> tuple[Tensor, ...]:
    return tuple(t.to(torch.long).contiguous() for t in tensors)


class PagedAttention:
    """The attention backend over a PagedKVCache; `prepare` it before each forward pass."""

    split: int | None = None  # the layout's split size (None: the paged layout)
    row_block = 1  # the split layout's matmul rows come in multiples of this

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self.spans: list[SeqSpan] = []
        self.device: torch.device | str = "cpu"
        self.steps: list[GroupStep | None] = []
        # (layers, dtype) -> where those layers' K/V lie for the native stack (None: some layer's
        # cache is not one the native attention reads): a cache's tensors stay put for its life
        self.native_caches: dict[tuple[tuple[tuple[int, int], ...], torch.dtype], kernels.CacheLayout | None] = {}
        self.rows: list[kernels.StepRows | None] | None = None

    def prepare(self, spans: list[SeqSpan], device: torch.device | str) -> None:
        # laid out per group at its first layer, when the queries' dtype says whether the native
        # kernel runs (which the split layout lays rows out for)
        self.spans, self.device = spans, device
        self.steps = [None] * len(self.cache.groups)
        self.rows = None  # each group's, at the first native_layout of the step

    def _step(self, gi: int, native: bool) -> GroupStep:
        step = self.steps[gi]
        if step is None:
            step = self.steps[gi] = build_group_step(self.spans, gi, self.cache.groups[gi],
                                                     self.cache.block_size, self.device, self.split, native)
        return step

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
            if (not self.cache.native or plain is None
                    or not kernels.attention_fits(dtype, heads, plain[0].shape[-1], *plain)):
                return None
            caches.append(plain)
        return kernels.CacheLayout(caches, [self.cache.group_of[i] for i, _ in layers])

    def _native_rows(self, gi: int) -> kernels.StepRows | None:
        """A step whose every row the native attention reads one by one (a decode-only step of
        one bucket; the split layout: no scored spans): its write slots, key slots, seqs, starts
        and lengths."""
        step = self._step(gi, True)
        if not step.whole:
            return None
        r = step.rowwise
        assert r is not None
        return kernels.StepRows(*_indices(step.slot_mapping, r.slots, r.seqs, r.starts, r.lengths))

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        plain = self.cache.plain(layer_idx)
        native = self.cache.native and plain is not None and kernels.attention_usable(q, *plain)
        step = self._step(self.cache.group_of[layer_idx], native)
        self.cache.write(layer_idx, k, v, step.slot_mapping)
        r = step.rowwise
        if step.whole:  # every row, in order: one call, no gather or scatter of rows
            if native:
                assert r is not None and plain is not None
                return kernels.paged_attention(q, *plain, r.slots, r.lengths, r.starts, r.seqs)
            if step.decodes:  # the paged layout's one bucket, without the kernel
                b = step.decodes[0]
                keys, vals = self.cache.read(layer_idx, b.key_slots, q.dtype)  # [KV, b, L, D]
                return _sdpa(q[:, :, None], keys.transpose(0, 1), vals.transpose(0, 1), b.mask)[:, :, 0]
        out = torch.empty_like(q)
        if r is not None:  # the split layout's rows for the native kernel
            assert plain is not None
            out[r.rows] = kernels.paged_attention(q[r.rows], *plain, r.slots, r.lengths, r.starts, r.seqs)
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
            out[s.rows], mass = attend_scored(q[s.rows], keys, vals, s.mask, s.voters, s.scores.dim() == 2)
            add_scores(s.scores, s.key_positions, mass, layer_idx)
        for s in step.splits:
            keys, vals = self.cache.read(layer_idx, s.key_slots, q.dtype)  # [KV, B, L, D]
            keys, vals = keys.transpose(0, 1), vals.transpose(0, 1)
            for a in range(0, s.rows.shape[1], QUERY_CHUNK):
                rows = s.rows[:, a:a + QUERY_CHUNK]
                voters = None if s.voters is None else s.voters[:, a:a + QUERY_CHUNK]
                per_head = s.scores is not None and s.scores.dim() == 2
                o, mass = split_attention(q[rows], keys, vals, s.allowed[:, a:a + QUERY_CHUNK],
                                          self.row_block, voters, per_head)
                out[rows] = o
                if mass is not None and s.scores is not None:
                    add_scores(s.scores, s.key_positions[0], mass[0], layer_idx)
        return out


class InvariantAttention(PagedAttention):
    """The paged backend of deterministic mode: the split layout (``SPLIT``), every query through
    the native kernel (one row at a time) where it reads this cache, otherwise through
    ``split_attention``, with matmul rows in whole ``row_block``s (the block the linear layers'
    probe found stable)."""

    split = SPLIT

    def __init__(self, cache: PagedKVCache, row_block: int) -> None:
        super().__init__(cache)
        self.row_block = row_block
