"""Attention backends: the one place where K/V are written to a cache and read back.

The model never touches a cache. Each attention layer projects q/k/v, applies RoPE and calls

    out = attn.attend(layer_idx, q, k, v)      # q [T, H, D], k/v [T, KV, D] -> out [T, H, D]

on whatever backend the caller passed to ``model(input_ids, positions, attn, logits_indices)``.
Tokens are *flat* (T tokens of one or more sequences, no padding), which is the layout a paged
engine needs (slot mapping + block tables), so a new backend plugs in here and the model code stays
untouched. The caller prepares the backend's per-step state (which tokens go where) *before* the
forward pass; the backend reads per-layer shapes and windows from the same ``ModelSpec`` the
planner uses.

Two backends live here:
- ``NoCache``: plain causal attention over exactly the tokens given (recompute everything).
- ``ContiguousKVCache``: gpt-fast style, one K and one V tensor per layer allocated once.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab.spec import LayerSpec, ModelSpec


class AttentionBackend(Protocol):
    """What every attention layer calls. RoPE is already applied to q and k."""

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, kv_heads, head_dim] -> [T, num_heads, head_dim]."""
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
