"""oneDNN's packed bf16 matmul, through PyTorch's mkldnn ops: the third kernel family next to
kvlab's own C kernels and PyTorch's plain ops.

On CPU a bf16 ``F.linear`` re-packs its weight into oneDNN's blocked layout on every call, which
makes small-batch (decode) matmuls compute-bound at a third of the memory bandwidth; a packed copy
is read as is. Each output column is computed exactly as ``F.linear`` computes it (same oneDNN
kernel, same reduction), so results are bit-identical. Whether oneDNN packs bf16 on this CPU is
``kvlab.dispatch.onednn_bf16``'s probe; this module only runs it.
"""

from __future__ import annotations

import torch
from torch import Tensor


def pad_rows(x: Tensor, rows: int) -> Tensor:
    """``x`` [n, ...] with zero rows appended up to a multiple of ``rows`` rows."""
    extra = -x.shape[0] % rows
    if not extra:
        return x
    return torch.cat([x, x.new_zeros(extra, *x.shape[1:])])


def onednn_rows(m: int) -> int:
    """The row count a oneDNN matmul of ``m`` rows runs at: ``m`` up to 8, else ``m`` rounded up
    to the next of four steps per octave (8, 10, 12, 14, 16, 20, 24, 28, 32, 40...). oneDNN builds
    and caches a kernel per input shape (~0.5 MB each, measured: 1,200 distinct prefill lengths
    grew RSS by 640 MB), so the rows it sees are bucketed: at most 8 + 4 per doubling shapes,
    for at most 25% padding rows."""
    if m <= 8:
        return m
    step = 1 << (m.bit_length() - 3)  # a quarter of the octave m lies in
    return -(-m // step) * step


def pack(weight: Tensor) -> Tensor:
    """oneDNN's blocked copy of a bf16 weight [N, K]."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)


def linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """x @ packed^T (+ bias): the one call through which kvlab hands shapes to oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedWeights:
    """A packed copy of one or more linear layers' weights (bf16 [out, in] each, one input
    width), stacked along the output dimension: layers that read the same input (q/k/v,
    gate/up) then run as one matmul. Padded rows are zeros, and a row's sums do not read the
    other rows. The copy is made once; whoever changes a source weight makes a new one."""

    def __init__(self, weights: list[Tensor], biases: list[Tensor | None]) -> None:
        with torch.no_grad():
            w = weights[0] if len(weights) == 1 else torch.cat([t.detach() for t in weights])
            self.packed = pack(w.detach())
            self.bias = None
            if any(b is not None for b in biases):
                self.bias = torch.cat([b.detach() if b is not None else w.new_zeros(t.shape[0])
                                       for b, t in zip(biases, weights)])
        self.sizes = [t.shape[0] for t in weights]
        self.nbytes = w.numel() * w.element_size()

    def __call__(self, x: Tensor) -> Tensor:
        """x @ W^T (+ b), x's rows zero-padded to ``onednn_rows`` (a bounded set of shapes)."""
        m = x.shape[0]
        return linear(pad_rows(x, onednn_rows(m)), self.packed, self.bias)[:m]
