"""Batch invariance: the kernels of kvlab's deterministic mode (``--deterministic``).

A request's tokens must not depend on what runs beside it. Two things make them depend on it
in a plain engine, and this module removes both:

- **Matmul row counts.** A CPU GEMM computes rows in blocks and finishes the rows left over by
  other kernels: on the AVX2 EPYC kvlab is measured on, an fp32 row comes out one way alone (a
  GEMV), another among the last 2-3 rows of a batch, and a third in a full block of 4 (then
  identical for any batch and any position). So every linear layer and every attention matmul
  gets a multiple of ``row_block`` rows, zero rows padding the rest. ``check_linears`` finds that
  multiple on the model's own weight shapes at start-up, and refuses (one line) a backend where
  none gives stable rows.
- **Reduction orders that follow the batch.** SDPA splits the key axis by lengths that change
  with padding and chunking. ``split_attention`` instead cuts the keys into splits of a fixed
  ``SPLIT`` positions aligned to absolute position 0 (Thinking Machines' fixed split size, "Defeating
  Nondeterminism in LLM Inference"): each split's partial sums go through a matmul over exactly
  ``SPLIT`` keys, masked keys add exact zeros, and the splits are summed in position order by a
  sequential ``cumsum`` (float64 accumulator), so splits that a query cannot see, or that a longer
  batch appends, change nothing.

What may still change results: the thread count, the CPU model (its GEMM kernels) and the
PyTorch build. These are fixed for one run.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from kvlab.eviction import fixed_point

SPLIT = 64  # keys per split: a multiple of every block size used, and of SIMD widths
ROW_CANDIDATES = (1, 2, 4, 8, 16)  # the smallest stable row block is searched among these
_PROBE_BLOCKS = (1, 2, 3, 5, 9, 33)  # batches of this many row blocks are compared


class BatchInvariantError(ValueError):
    """The backend cannot give batch-invariant results (the message says what to do)."""


def stable_row_block(linear: nn.Module, in_features: int, dtype: torch.dtype,
                     device: torch.device) -> int | None:
    """The smallest candidate r such that one input row gives the same output row at every
    position of every batch of a multiple of r rows (as far as the probe's batches show), or None."""
    gen = torch.Generator().manual_seed(0)
    filler = torch.randn(max(ROW_CANDIDATES) * max(_PROBE_BLOCKS), in_features, generator=gen)
    filler = filler.to(device=device, dtype=dtype)
    row = filler[-1:]
    with torch.inference_mode():
        for r in ROW_CANDIDATES:
            outputs = []
            for blocks in _PROBE_BLOCKS:
                m = r * blocks
                at = torch.arange(0, m, max(1, m // 7)).tolist() + [m - 1]  # spread over the batch
                x = filler[:m].clone()
                x[at] = row
                outputs.append(linear(x)[at])
            first = outputs[0][0]
            if all(torch.equal(o, first.expand_as(o)) for o in outputs):
                return r
    return None


def check_linears(linears: list[nn.Module], dtype: torch.dtype, device: torch.device) -> int:
    """The row block to pad every linear layer's input to (the largest any shape needs); one
    probe per distinct layer class and weight shape. Raises BatchInvariantError where none is stable."""
    if device.type != "cpu":
        raise BatchInvariantError(
            f"--deterministic runs on CPU only: kvlab has no batch-invariant kernels for "
            f"{device.type} (on GPUs vLLM offers VLLM_BATCH_INVARIANT=1); drop --deterministic "
            f"or run on the CPU")
    seen: dict[tuple[type, tuple[int, ...]], int] = {}
    for m in linears:
        shape = (m.out_features, m.in_features)
        if (type(m), shape) in seen:  # same class, same shape: the same GEMM (the LM head's is fp32)
            continue
        block = stable_row_block(m, shape[1], dtype, device)
        if block is None:
            raise BatchInvariantError(
                f"--deterministic: this CPU's {dtype} matmul gives row results that depend on "
                f"the batch for weight shape {list(shape)}; try --dtype fp32, or drop --deterministic")
        seen[type(m), shape] = block
    return max(seen.values(), default=1)


def split_attention(q: Tensor, keys: Tensor, vals: Tensor, allowed: Tensor, row_block: int,
                    voters: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Attention whose every output row is bitwise independent of the other rows, of the batch
    and of how many split-aligned keys follow.

    q [B, n, H, D]; keys/vals [B, KV, L, D] with L a multiple of ``SPLIT`` and key j of the
    tensors at an absolute position congruent to j modulo ``SPLIT``; allowed [B, n, L] bool
    (True = the query may see the key; every query sees at least one). ``voters`` [B, n] bool:
    also return each key's attention mass over the heads and voting queries, as fixed-point int64
    ``[B, L]`` (see ``kvlab.eviction.fixed_point``), whose sums do not depend on order either.
    Returns the output [B, n, H, D] in q's dtype and the mass (or None).
    """
    b, n, h, d = q.shape
    kv, length = keys.shape[1], keys.shape[2]
    group = h // kv
    rows = n  # queries, padded so that each matmul's G * rows is a whole number of row blocks
    while group * rows % row_block:
        rows += 1
    if rows > n:
        q = torch.cat([q, q.new_zeros(b, rows - n, h, d)], 1)
        allowed = torch.cat([allowed, allowed[:, :1].expand(b, rows - n, length)], 1)
    # heads of a KV group side by side in the rows: [B, KV, G * rows, D]
    qf = (q.float() * (1.0 / math.sqrt(d))).permute(0, 2, 1, 3).reshape(b, kv, group * rows, d)
    s = torch.matmul(qf, keys.float().transpose(-1, -2)).view(b, kv, group, rows, length)
    s = s.masked_fill(~allowed[:, None, None], float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))  # masked keys: exactly 0
    splits = length // SPLIT
    # a ones column gives each split's softmax denominator from the same matmul as its values
    vext = torch.cat([vals.float(), vals.new_ones(b, kv, length, 1, dtype=torch.float32)], -1)
    part = torch.matmul(p.view(b, kv, group * rows, splits, SPLIT).transpose(2, 3),
                        vext.view(b, kv, splits, SPLIT, d + 1))  # [B, KV, splits, G*rows, D+1]
    total = part.cumsum(2)[:, :, -1]  # sequential over splits, in position order
    out = (total[..., :d] / total[..., d:]).view(b, kv, group, rows, d)
    out = out.permute(0, 3, 1, 2, 4).reshape(b, rows, h, d)[:, :n].to(q.dtype)
    if voters is None:
        return out, None
    weights = p / total[..., d:].view(b, kv, group, rows, 1)
    counted = fixed_point(weights[:, :, :, :n]) * voters[:, None, None, :, None]
    return out, counted.sum(dim=(1, 2, 3))
