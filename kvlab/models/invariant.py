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
from collections.abc import Callable

import torch
from torch import Tensor, nn

from kvlab.eviction import fixed_point

SPLIT = 64  # keys per split: a multiple of every block size used, and of SIMD widths
ROW_CANDIDATES = (1, 2, 4, 8, 16)  # the smallest stable row block is searched among these
_PROBE_BLOCKS = (1, 2, 3, 5, 9, 33)  # batches of this many row blocks are compared


class BatchInvariantError(ValueError):
    """The backend cannot give batch-invariant results (the message says what to do)."""


def stable_row_block(linear: Callable[[Tensor], Tensor], in_features: int, dtype: torch.dtype,
                     device: torch.device, row_calls: bool = False,
                     candidates: tuple[int, ...] = ROW_CANDIDATES) -> int | None:
    """The smallest of ``candidates`` r such that one input row gives the same output row at every
    position of every batch of a multiple of r rows (as far as the probe's batches show), or None;
    ``row_calls``: each batch passed as calls of r rows each."""
    gen = torch.Generator().manual_seed(0)
    filler = torch.randn(max(candidates) * max(_PROBE_BLOCKS), in_features, generator=gen)
    filler = filler.to(device=device, dtype=dtype)
    row = filler[-1:]
    with torch.inference_mode():
        for r in candidates:
            outputs = []
            for blocks in _PROBE_BLOCKS:
                m = r * blocks
                at = torch.arange(0, m, max(1, m // 7)).tolist() + [m - 1]  # spread over the batch
                x = filler[:m].clone()
                x[at] = row
                y = torch.cat([linear(x[i:i + r]) for i in range(0, m, r)]) if row_calls else linear(x)
                outputs.append(y[at])
            first = outputs[0][0]
            if all(torch.equal(o, first.expand_as(o)) for o in outputs):
                return r
    return None


def _cpu_only(device: torch.device) -> None:
    if device.type != "cpu":
        raise BatchInvariantError(
            f"--deterministic runs on CPU only: kvlab has no batch-invariant kernels for "
            f"{device.type} (on GPUs vLLM offers VLLM_BATCH_INVARIANT=1); drop --deterministic "
            f"or run on the CPU")


def check_linears(linears: list[nn.Module], dtype: torch.dtype, device: torch.device) -> tuple[int, bool]:
    """(row block, row calls) for every linear layer: the block to pad its input rows to (the
    largest any shape needs; one probe per distinct layer class and weight shape), and whether
    each GEMM must take exactly one block per call, where padding alone is not stable for some
    shape (a GEMM that splits long rows across threads by the batch's size: MKL's fp32 at 2
    threads on a Xeon with AMX, for 1,536-wide rows). Raises BatchInvariantError where neither is."""
    _cpu_only(device)
    seen: dict[tuple[type, tuple[int, ...]], tuple[nn.Module, int, bool]] = {}
    for m in linears:
        shape = (m.out_features, m.in_features)
        if (type(m), shape) in seen:  # same class, same shape: the same GEMM (the LM head's is fp32)
            continue
        block, calls = stable_row_block(m, shape[1], dtype, device), False
        if block is None:
            block, calls = stable_row_block(m, shape[1], dtype, device, row_calls=True), True
        if block is None:
            hint = "try --threads 1" if dtype == torch.float32 else "try --dtype fp32"
            raise BatchInvariantError(
                f"--deterministic: this CPU's {dtype} matmul gives row results that depend on "
                f"the batch for weight shape {list(shape)}; {hint}, or drop --deterministic")
        seen[type(m), shape] = (m, block, calls)
    block = max((b for _, b, _ in seen.values()), default=1)
    calls = any(c for _, _, c in seen.values())
    # a padded-stable shape is stable in calls of any multiple of its block; a calls-stable one
    # must be probed again at the common block
    for m, b, c in seen.values():
        if c and b != block and stable_row_block(m, m.in_features, dtype, device, True, (block,)) is None:
            raise BatchInvariantError(
                f"--deterministic: this CPU's {dtype} matmul has no row block stable for every "
                f"weight shape; try --threads 1, or drop --deterministic")
    return block, calls


class _HeadMatmul:
    """x [m, k] @ w [k, n] as ``split_attention`` multiplies: one batched 4-D torch.matmul."""

    def __init__(self, k: int, n: int, device: torch.device) -> None:
        self.w = torch.randn(1, 1, k, n, generator=torch.Generator().manual_seed(1)).to(device)

    def __call__(self, x: Tensor) -> Tensor:
        return torch.matmul(x.float()[None, None], self.w)[0, 0]


def check_attention(head_dims: set[int], device: torch.device) -> int:
    """The row block for ``split_attention``'s matmuls (fp32: scores over a head's size, values
    over a split) at every head size: probed on their own shapes, not the linear layers' (whose
    long rows a CPU GEMM may split across threads where these short ones are never split).
    BatchInvariantError where none is stable."""
    _cpu_only(device)
    block = 1
    for d in sorted(head_dims):
        for k, n in ((d, 2 * SPLIT), (SPLIT, d + 1)):
            r = stable_row_block(_HeadMatmul(k, n, device), k, torch.float32, device)
            if r is None:
                raise BatchInvariantError(
                    f"--deterministic: this CPU's fp32 batched matmul gives attention rows that depend "
                    f"on the batch (head size {d}); drop --deterministic")
            block = max(block, r)
    return block


def split_attention(q: Tensor, keys: Tensor, vals: Tensor, allowed: Tensor, row_block: int,
                    voters: Tensor | None = None, per_head: bool = False) -> tuple[Tensor, Tensor | None]:
    """Attention whose every output row is bitwise independent of the other rows, of the batch
    and of how many split-aligned keys follow.

    q [B, n, H, D]; keys/vals [B, KV, L, D] with L a multiple of ``SPLIT`` and key j of the
    tensors at an absolute position congruent to j modulo ``SPLIT``; allowed [B, n, L] bool
    (True = the query may see the key; every query sees at least one). ``voters`` [B, n] bool:
    also return each key's attention mass over the heads and voting queries, as fixed-point int64
    ``[B, L]`` (see ``kvlab.eviction.fixed_point``), whose sums do not depend on order either;
    with ``per_head``, per key and query head ``[B, L, H]``.
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
    counted = (fixed_point(weights[:, :, :, :n]) * voters[:, None, None, :, None]).sum(dim=3)  # [B, KV, G, L]
    if per_head:
        return out, counted.view(b, h, length).transpose(1, 2)
    return out, counted.sum(dim=(1, 2))
