"""How a linear layer computes, chosen once per model (``CausalLM.use``), in the spirit of vLLM's
``LinearMethod``: a layer's ``forward`` calls its method and never asks what runs here.

Each method is called as ``method(x, weight, bias)`` (a stored layer passes its blocks as the
weight). Where a method depends on the row count, that is the method's definition (the native
kernel beats MKL's blocked GEMM only for a decode step's few rows), not a question about the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlab import kernels
from kvlab.dispatch import Backends
from kvlab.kernels.onednn import onednn_rows, pad_rows

Dequantize = Callable[[Tensor], Tensor]  # a stored layer's blocks -> its dense fp32 weight
LinearMethod = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]  # (x, weight or blocks, bias) -> y


@dataclass(frozen=True)
class Setting:
    """What ``CausalLM.use`` asks of every layer: what runs here (``kvlab.dispatch``), the
    model's dtype and device, and the mode's row rules."""

    backends: Backends
    dtype: torch.dtype
    device: torch.device
    # rows the native linear kernels take: None, the backends' default for the dtype; 0, none;
    # sys.maxsize, every row count (deterministic mode: their rows never depend on the batch)
    native_rows: int | None = None
    row_block: int = 1  # deterministic mode: PyTorch's GEMM rows padded to a multiple of this
    # deterministic mode on a CPU whose GEMM splits long rows by the batch's size: every GEMM
    # call exactly row_block rows (``kvlab.models.invariant.check_linears``)
    row_calls: bool = False
    activations: str = "fp32"  # "int8": stored 32-weight-block layers quantise their input rows

    @property
    def rowwise(self) -> bool:
        """Do kvlab's row-wise kernels (norms, RoPE, activations) run this model?"""
        return (bool(self.backends.native) and self.device.type == "cpu"
                and self.dtype in (torch.float32, torch.bfloat16))

    def rows(self, dtype: torch.dtype) -> int:
        """Rows up to which a native linear kernel runs on ``dtype`` weights (0: never)."""
        if not self.rowwise or dtype != self.dtype:
            return 0
        return self.backends.native_rows(dtype) if self.native_rows is None else self.native_rows

    def gemm(self, dtype: torch.dtype) -> Gemm:
        """PyTorch's path for a layer of ``dtype`` weights in this setting."""
        return Gemm(self.row_block, bucket=dtype == torch.bfloat16 and self.device.type == "cpu",
                    row_calls=self.row_calls)


class Gemm:
    """PyTorch's ``F.linear``, x's rows zero-padded to a multiple of ``row_block`` (deterministic
    mode, ``kvlab.models.invariant``; with ``row_calls``, one call per block of rows) and, with
    ``bucket`` (bf16 on a CPU), to ``onednn_rows``: PyTorch hands bf16 matmuls to oneDNN
    wherever oneDNN has bf16 kernels, whatever kvlab packs, and oneDNN caches a kernel per shape."""

    def __init__(self, row_block: int = 1, bucket: bool = False, row_calls: bool = False) -> None:
        self.row_block, self.bucket, self.row_calls = row_block, bucket, row_calls

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        m = x.shape[0]
        rows = onednn_rows(m) if self.bucket else m
        rows = -(-rows // self.row_block) * self.row_block
        if rows != m:
            x = pad_rows(x, rows)
        if self.row_calls:
            y = torch.cat([F.linear(x[i:i + self.row_block], weight, bias) for i in range(0, rows, self.row_block)])
        else:
            y = F.linear(x, weight, bias)
        return y if rows == m else y[:m]


class Native:
    """kvlab's linear kernel (fp32 or bf16) up to ``rows`` rows, ``fallback`` above; with
    ``fp32_out`` the bf16 kernel's fp32 sums, never rounded (the LM head's logits)."""

    def __init__(self, rows: int, fallback: Gemm, fp32_out: bool = False) -> None:
        self.rows, self.fallback, self.fp32_out = rows, fallback, fp32_out

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if x.shape[0] <= self.rows and x.is_contiguous():
            return kernels.linear(x, weight, bias, fp32_out=self.fp32_out)
        return self.fallback(x, weight, bias)


class Packed:
    """oneDNN's packed copy of the weight (``kvlab.kernels.onednn.PackedWeights``): bitwise
    ``F.linear``, without re-packing the weight on every call."""

    def __init__(self, packed: kernels.onednn.PackedWeights) -> None:
        self.packed = packed

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return self.packed(x)


class SlicedFp32:
    """fp32 logits from a bf16 head where the native kernel does not run: the weight widened
    ``step`` rows at a time (never a whole fp32 copy of a 150k-word head)."""

    def __init__(self, gemm: Gemm, step: int = 8192) -> None:
        self.gemm, self.step = gemm, step

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        x32, step = x.float(), self.step
        return torch.cat([
            self.gemm(x32, weight[i:i + step].float(), None if bias is None else bias[i:i + step].float())
            for i in range(0, weight.shape[0], step)], dim=-1)


class Dequantized:
    """A stored layer's reference path: the whole weight dequantised (the file's exact values),
    then ``gemm``, as the dense fp32 layer would run on those values."""

    def __init__(self, dequantize: Dequantize, gemm: Gemm) -> None:
        self.dequantize, self.gemm = dequantize, gemm

    def __call__(self, x: Tensor, blocks: Tensor, bias: Tensor | None) -> Tensor:
        weight = self.dequantize(blocks).to(x.dtype)
        return self.gemm(x, weight, None if bias is None else bias.to(x.dtype))


class NativeStored:
    """kvlab's block-format kernel (``kernels.linear_q``: bitwise the fp32 kernel on the
    dequantised weight) up to ``rows`` rows, ``fallback`` above."""

    def __init__(self, code: int, rows: int, fallback: Dequantized) -> None:
        self.code, self.rows, self.fallback = code, rows, fallback

    def __call__(self, x: Tensor, blocks: Tensor, bias: Tensor | None) -> Tensor:
        if x.shape[0] <= self.rows:
            return kernels.linear_q(x.contiguous(), blocks, self.code, bias)
        return self.fallback(x, blocks, bias)


def act8_reference(x: Tensor) -> Tensor:
    """x's rows as ``--activations int8`` quantises them (``kvlab/kernels/act8.h``), as fp32: per
    32 values d = max|x| / 127, q = round(x / d) to nearest (ties to even), then q * d. The same q
    and d as the kernel's, bit for bit (``kernels.quantize_act8``)."""
    b = x.float().reshape(*x.shape[:-1], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(b * inv) * d).reshape(x.shape)


class Int8Reference:
    """``--activations int8`` where the native kernels do not run: the rows quantised as the
    kernel quantises them (``act8_reference``), then the dequantised weight through ``gemm``:
    the same values, summed in another order (so close to the kernel's results, not bitwise)."""

    def __init__(self, dequantize: Dequantize, gemm: Gemm) -> None:
        self.dequantize, self.gemm = dequantize, gemm

    def __call__(self, x: Tensor, blocks: Tensor, bias: Tensor | None) -> Tensor:
        return self.gemm(act8_reference(x), self.dequantize(blocks), bias)
