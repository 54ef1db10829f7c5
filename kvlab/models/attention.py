"""Attention backends: the one place where K/V are written to a cache and read back.

The model never touches a cache. Each attention layer projects q/k/v, applies RoPE and calls

    out = attn.attend(layer_idx, q, k, v)      # q [T, H, D], k/v [T, KV, D] -> out [T, H, D]

on whatever backend the caller passed to ``model(input_ids, positions, attn, logits_indices)``.
A backend that can also hand a step's layout to kvlab's native decoder layer (the paged engine's)
implements ``NativeAttention``: the layer then runs whole in one native call, cache write
included.
Tokens are *flat* (T tokens of one or more sequences, no padding), which is the layout a paged
engine needs (slot mapping + block tables), so a new backend plugs in here and the model code stays
untouched. The caller prepares the backend's per-step state (which tokens go where) *before* the
forward pass; the backend reads per-layer shapes and windows from the same ``ModelSpec`` the
planner uses.

Three backends live here:
- ``NoCache``: plain causal attention over exactly the tokens given (recompute everything).
- ``ContiguousKVCache``: gpt-fast style, one K and one V tensor per layer allocated once.
- ``EvictingKVCache``: one sequence under a token eviction policy (``kvlab.eviction``).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab.eviction import EvictionPolicy, add_scores, fixed_point
from kvlab.kernels import CacheLayout, StepRows
from kvlab.spec import LayerSpec, ModelSpec


class AttentionBackend(Protocol):
    """What every attention layer calls. RoPE is already applied to q and k."""

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, kv_heads, head_dim] -> [T, num_heads, head_dim]."""
        ...


class NativeAttention(AttentionBackend, Protocol):
    """A backend that can give this step's layout to ``kvlab.kernels.decoder_layers``."""

    def native_layout(self, layers: tuple[tuple[int, int], ...], dtype: torch.dtype
                      ) -> tuple[CacheLayout, list[StepRows]] | None:
        """For these layers ((layer index, query heads) each): where each keeps its K/V and
        where every row of this step writes and reads in each cache group, when the native
        attention can serve them all (queries of ``dtype``); None otherwise."""
        ...


def _window(layer: LayerSpec) -> int | None:
    return layer.window if layer.kind == "sliding" and layer.window else None


def _mask(q_pos: Tensor, k_pos: Tensor, window: int | None) -> Tensor:
    """Boolean [n_q, n_k] mask, True = may attend: causal, and within the window if any.

    A window W lets a query see W tokens including itself (HF: k > q - W).
    """
    diff = q_pos[:, None] - k_pos[None, :]
    ok = diff >= 0
    if window is not None:
        ok &= diff < window
    return ok


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool = False) -> Tensor:
    """SDPA with grouped KV heads. q [B, H, n, D], k/v [B, KV, L, D] -> [B, H, n, D].

    For one query token, the heads of a group are folded into the query axis (q [B, KV, G, D]),
    which reads each K/V head once: several times faster on CPU in bf16 than ``enable_gqa``
    (10x with a padding mask). A mask must then be the same for every head ([B, 1, 1, L]), as a
    padding mask is.
    """
    b, h, n, d = q.shape
    kv = k.shape[1]
    if n == 1 and not is_causal and (mask is None or (mask.dim() == 4 and mask.shape[1] == 1)):
        out = F.scaled_dot_product_attention(q.reshape(b, kv, h // kv, d), k, v, attn_mask=mask)
        return out.reshape(b, h, 1, d)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                          enable_gqa=kv != h)


SCORE_CHUNK = 256  # query rows per pass when attention weights are needed (bounds the memory)


def attend_scored(q: Tensor, keys: Tensor, vals: Tensor, mask: Tensor | None,
                  voters: Tensor | None, per_head: bool = False) -> tuple[Tensor, Tensor]:
    """Attention that also says where it went, for eviction policies.

    q [n, H, D]; keys/vals [KV, L, D]; mask [n, L] (True = may attend) or None (every query sees
    every key); voters [n] bool: the queries whose weights count (None: all). Returns the output
    [n, H, D] and the attention mass per key [L] (int64 fixed point, ``fixed_point``, summed
    over heads and voting queries), or per key and head [L, H] with ``per_head``.
    Queries go in chunks of ``SCORE_CHUNK`` rows, so the weights held at once are [H, chunk, L],
    never [H, n, L] for a long prompt.
    """
    n, h, d = q.shape
    kv, length = keys.shape[0], keys.shape[1]
    group = h // kv
    out = torch.empty_like(q)
    mass = torch.zeros(kv, group, length, dtype=torch.long, device=q.device)
    kf, vf = keys.float(), vals.float()
    for a in range(0, n, SCORE_CHUNK):
        b = min(n, a + SCORE_CHUNK)
        qc = q[a:b].float().transpose(0, 1).reshape(kv, group * (b - a), d)  # heads of a group together
        logits = torch.bmm(qc, kf.transpose(1, 2)) / math.sqrt(d)  # [KV, G*(b-a), L]
        logits = logits.view(kv, group, b - a, length)
        if mask is not None:
            logits = logits.masked_fill(~mask[a:b][None, None], float("-inf"))
        w = torch.softmax(logits, dim=-1)
        o = torch.bmm(w.view(kv, group * (b - a), length), vf).view(kv, group, b - a, d)
        out[a:b] = o.reshape(h, b - a, d).transpose(0, 1).to(q.dtype)
        counted = fixed_point(w)
        if voters is not None:
            counted *= voters[a:b][None, None, :, None]
        mass += counted.sum(dim=2)
    return out, (mass.view(h, length).t() if per_head else mass.sum(dim=(0, 1)))


def _to_heads(x: Tensor, batch: int) -> Tensor:
    """[B*n, heads, D] (flat, row-major by sequence) -> [B, heads, n, D]."""
    t, heads, d = x.shape
    return x.view(batch, t // batch, heads, d).transpose(1, 2)


def _from_heads(x: Tensor) -> Tensor:
    """[B, heads, n, D] -> [B*n, heads, D]."""
    b, heads, n, d = x.shape
    return x.transpose(1, 2).reshape(b * n, heads, d)


def _positions(start: int, num_tokens: int, batch: int, device: torch.device | str) -> Tensor:
    return torch.arange(start, start + num_tokens, device=device).repeat(batch)


class NoCache:
    """Causal attention over exactly the tokens of this forward pass; nothing is kept.

    The flat tokens are ``batch_size`` sequences of equal length, each starting at position 0:
    this is the "recompute the whole sequence every step" baseline.
    """

    def __init__(self, spec: ModelSpec, batch_size: int = 1) -> None:
        self.spec = spec
        self.batch_size = batch_size
        self.kv_bytes = 0  # holds nothing between steps

    def prepare(self, num_tokens: int, device: torch.device | str = "cpu") -> Tensor:
        """Positions of the next forward pass: ``num_tokens`` per sequence, from 0."""
        return _positions(0, num_tokens, self.batch_size, device)

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        qb, kb, vb = (_to_heads(x, self.batch_size) for x in (q, k, v))
        n = qb.shape[2]
        window = _window(self.spec.layers[layer_idx])
        if window is None or window >= n:
            out = _sdpa(qb, kb, vb, None, is_causal=n > 1)
        else:
            pos = torch.arange(n, device=q.device)
            out = _sdpa(qb, kb, vb, _mask(pos, pos, window))
        return _from_heads(out)


class ContiguousKVCache:
    """gpt-fast style cache: per layer one K and one V tensor [batch, kv_heads, slots, head_dim].

    Allocated once for ``capacity`` tokens (prompt + max new tokens), never reallocated. Full
    layers have ``capacity`` slots and token p lives in slot p. Sliding-window layers hold only
    ``layer.cached_tokens(capacity)`` = min(capacity, window) slots as a ring (token p in slot
    p % window), so the bytes held are exactly what ``ModelSpec.kv_bytes_per_sequence`` predicts.

    Use: ``positions = cache.prepare(n)`` reserves the next n tokens of every sequence, then
    ``model(ids, positions, cache, ...)`` writes their K/V and reads everything before them.
    All sequences of a batch advance together (same length, no padding).
    """

    def __init__(self, spec: ModelSpec, capacity: int, batch_size: int = 1,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu") -> None:
        if capacity <= 0 or batch_size <= 0:
            raise ValueError("capacity and batch_size must be positive")
        self.spec = spec
        self.capacity = capacity
        self.batch_size = batch_size
        self.length = 0  # tokens of each sequence written (after the pending step: see prepare)
        self._start = 0
        self._n = 0
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        for layer in spec.layers:
            slots = layer.cached_tokens(capacity)
            shape = (batch_size, layer.kv_heads, slots, layer.head_dim)
            self.k.append(torch.zeros(shape, dtype=dtype, device=device))
            self.v.append(torch.zeros((*shape[:3], layer.v_head_dim or layer.head_dim),
                                      dtype=dtype, device=device))

    @property
    def kv_bytes(self) -> int:
        """Bytes of the cache tensors (allocated capacity, not usage)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def reset(self) -> None:
        self.length = self._start = self._n = 0

    def prepare(self, num_tokens: int, device: torch.device | str | None = None) -> Tensor:
        """Reserve the next ``num_tokens`` positions of every sequence; return their positions."""
        if self.length + num_tokens > self.capacity:
            raise ValueError(f"KV cache full: {self.length} + {num_tokens} tokens > capacity "
                             f"{self.capacity}")
        self._start, self._n = self.length, num_tokens
        self.length += num_tokens
        return _positions(self._start, num_tokens, self.batch_size, device or self.k[0].device)

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        qb, kb, vb = (_to_heads(x, self.batch_size) for x in (q, k, v))
        kc, vc = self.k[layer_idx], self.v[layer_idx]
        start, n = self._start, self._n
        end = start + n
        if qb.shape[2] != n:
            raise ValueError(f"layer {layer_idx}: got {qb.shape[2]} tokens per sequence, "
                             f"prepare() reserved {n}")
        slots = kc.shape[2]
        window = _window(self.spec.layers[layer_idx])
        dev = q.device
        if slots == self.capacity or n == 1 or end <= slots:
            # Write first, then read the held slots. The window never binds here: a full-size
            # layer's window is >= capacity, a ring holds only tokens inside the window, and one
            # new token overwrites only a token that has just left it.
            at = start if end <= slots else start % slots
            kc[:, :, at:at + n] = kb
            vc[:, :, at:at + n] = vb
            keys, vals = kc[:, :, :min(end, slots)], vc[:, :, :min(end, slots)]
            if n == 1:
                out = _sdpa(qb, keys, vals, None)
            elif start == 0:
                out = _sdpa(qb, keys, vals, None, is_causal=True)
            else:
                q_pos = torch.arange(start, end, device=dev)
                out = _sdpa(qb, keys, vals, _mask(q_pos, torch.arange(end, device=dev), None))
            return _from_heads(out)
        # A ring smaller than this step's reach (a long prompt on a sliding layer): the first
        # queries need tokens the step would overwrite, so attend over [held window, new tokens]
        # and then keep the last `slots` new tokens.
        assert window is not None
        old_pos = torch.arange(max(0, start - (slots - 1)), start, device=dev)
        keys = torch.cat([kc[:, :, old_pos % slots], kb], dim=2)
        vals = torch.cat([vc[:, :, old_pos % slots], vb], dim=2)
        q_pos = torch.arange(start, end, device=dev)
        out = _sdpa(qb, keys, vals, _mask(q_pos, torch.cat([old_pos, q_pos]), window))
        keep = min(n, slots)
        idx = torch.arange(end - keep, end, device=dev) % slots
        kc.index_copy_(2, idx, kb[:, :, n - keep:])
        vc.index_copy_(2, idx, vb[:, :, n - keep:])
        return _from_heads(out)


class EvictingKVCache:
    """One sequence's cache under a token eviction policy, one token per unit: the reference the
    paged engine's block-granular eviction is measured against.

    Per layer K and V hold only the kept tokens, compacted after each ``evict()``; each keeps the
    position (and so the RoPE rotation) it was written with, as in the paged engine. With
    ``renumber`` (the model's RoPE inverse frequencies), positions are instead the tokens' places
    in the cache, as StreamingLLM assigns them: new tokens get the next place, and each kept key
    is rotated back by the places it moved down when others were evicted. Capacity: the budget
    plus the largest step, never the whole text.
    """

    def __init__(self, spec: ModelSpec, policy: EvictionPolicy, capacity: int, num_prompt_tokens: int,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 renumber: Tensor | None = None) -> None:
        if any(_window(layer) for layer in spec.layers):
            raise ValueError(f"{spec.name} has sliding-window layers; token eviction needs full attention")
        self.spec, self.policy, self.capacity = spec, policy, capacity
        self.renumber = renumber
        self.num_prompt_tokens = num_prompt_tokens
        self.k = [torch.zeros(layer.kv_heads, capacity, layer.head_dim, dtype=dtype, device=device)
                  for layer in spec.layers]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.positions = torch.zeros(capacity, dtype=torch.long, device=device)
        self.held = 0  # kept tokens in the tensors
        self.seen = 0  # positions written so far (kept or evicted)
        self.scores = torch.zeros(0, dtype=torch.long, device=device)
        self._n = 0

    @property
    def kv_bytes(self) -> int:
        """Bytes of the tokens held now (what a compacting cache needs)."""
        per_token = sum(t.shape[0] * t.shape[2] * t.element_size() for t in self.k + self.v)
        return self.held * per_token

    def prepare(self, num_tokens: int, device: torch.device | str | None = None) -> Tensor:
        if self.held + num_tokens > self.capacity:
            raise ValueError(f"eviction cache full: {self.held} kept + {num_tokens} new > {self.capacity}")
        start = self.seen
        self.positions[self.held:self.held + num_tokens] = torch.arange(start, start + num_tokens)
        self._n = num_tokens
        given = self.held if self.renumber is not None else start  # the model's RoPE positions
        if self.policy.needs_scores and self.scores.shape[0] < start + num_tokens:
            columns = self.policy.score_columns(len(self.spec.layers), max(l.num_heads for l in self.spec.layers))
            grown = self.policy.new_scores(2 * (start + num_tokens), columns, self.scores.device)
            if self.scores.shape[0]:
                grown[:self.scores.shape[0]] = self.scores
            self.scores = grown
        return torch.arange(given, given + num_tokens, device=device or self.positions.device)

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n, end = self._n, self.held + self._n
        self.k[layer_idx][:, self.held:end] = k.transpose(0, 1)
        self.v[layer_idx][:, self.held:end] = v.transpose(0, 1)
        keys, vals = self.k[layer_idx][:, :end], self.v[layer_idx][:, :end]
        k_pos = self.positions[:end]
        q_pos = k_pos[self.held:]
        mask = _mask(q_pos, k_pos, None) if n > 1 else None
        voters = self._voters(q_pos)
        if voters is not None:
            out, mass = attend_scored(q, keys, vals, mask, voters, self.policy.per_head)
            add_scores(self.scores, k_pos, mass, layer_idx)
            return out
        o = _sdpa(q.transpose(0, 1)[None], keys[None], vals[None],
                  None if mask is None else mask[None, None])
        return o[0].transpose(0, 1)

    def _rotate(self, n: int, shift: Tensor) -> None:
        """Rotate the first ``n`` keys of every layer by ``shift`` positions each (RoPE rotations
        add up, so this is the key as if written at its position + shift); in float32."""
        assert self.renumber is not None
        freqs = shift[:, None].float() * self.renumber.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None], emb.sin()[None]
        for k in self.k:
            x = k[:, :n].float()
            half = x.shape[-1] // 2
            rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
            k[:, :n] = (x * cos + rotated * sin).to(k.dtype)

    def _voters(self, q_pos: Tensor) -> Tensor | None:
        voters = self.policy.voters(self.num_prompt_tokens)
        if voters is None:
            return None
        mask = (q_pos >= voters.start) & (q_pos < voters.stop)
        return mask if bool(mask.any()) else None

    def evict(self) -> int:
        """After a step: apply the policy to the tokens written so far. Returns tokens evicted."""
        self.held += self._n
        self.seen += self._n
        self._n = 0
        if not self.policy.ready(self.seen, self.num_prompt_tokens):
            return 0
        kept = torch.zeros(self.seen, dtype=torch.bool, device=self.positions.device)
        kept[self.positions[:self.held]] = True
        keep = self.policy.keep(kept, self.seen, 1, self.scores if self.policy.needs_scores else None)
        stay = torch.nonzero(keep[self.positions[:self.held]], as_tuple=False).flatten()
        gone = self.held - stay.numel()
        if gone:
            for t in self.k + self.v:
                t[:, :stay.numel()] = t[:, stay]
            if self.renumber is not None:  # each kept key moves down to its new place
                self._rotate(stay.numel(), torch.arange(stay.numel(), device=stay.device) - stay)
            self.positions[:stay.numel()] = self.positions[stay].clone()
            self.held = stay.numel()
        return gone
