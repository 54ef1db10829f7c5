"""How a model's weight matrices are held while it runs: dense in the model's dtype, or as a GGUF
file stores them, in blocks of 32 weights with an fp16 scale, or k-quants' super-blocks of 256
(``BlockFormat``).

Decode reads every weight once per step, so its speed is the bytes held: SmolLM2-135M's Q4_1
layers are 5 bits a weight in the file and 32 as fp32. A ``QuantLinear`` keeps the file's blocks
and multiplies by them in place (``kvlab.kernels.linear_q``: dequantised in registers, bitwise
the fp32 kernel on the dequantised weight); where that kernel cannot run, the reference path
dequantises the whole weight and calls ``F.linear``, as the dense layer would on those values.
Either way a row's values are those of the dense fp32 model of the same file: the format changes
the bytes read, never the tokens (``tests/test_weights.py`` holds it to the bit).

The formats run as stored are those with a native kernel: Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K.
Other GGUF types (Q5_1, Q5_K...) are dequantised to dense fp32 at load (``kvlab.models.loader``).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kvlab import kernels
from kvlab.dtypes import GGUF_AS_STORED
from kvlab.models.methods import (Dequantize, Dequantized, Gemm, Int8Reference, LinearMethod, NativeStored,
                                  Setting)

QK = 32  # weights per block
QK_K = 256  # weights per k-quant super-block


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF block format: its name, its number in the native kernel (``blocks.h``,
    ``kblocks.h``), the bytes of one block and the weights in it (32, or a k-quant's 256)."""

    name: str
    code: int
    block_bytes: int
    block: int = QK

    @property
    def bits(self) -> float:
        """Bits per weight, scales included (Q4_1: 5.0)."""
        return self.block_bytes * 8 / self.block

    def row_bytes(self, k: int) -> int:
        return k // self.block * self.block_bytes

    def check_rows(self, blocks: Tensor, k: int) -> None:
        """ValueError unless ``blocks`` holds rows of k weights in whole blocks (a GGUF writer
        never stores a row in part of a block: llama.cpp falls back to another type)."""
        if k % self.block or blocks.shape[-1] != self.row_bytes(k):
            raise ValueError(f"{self.name} weight of {k} inputs: rows must be whole blocks of {self.block}")

    def dequantizer(self, k: int, native: bool) -> Dequantize:
        """The fp32 rows [N, k] of blocks [N, row_bytes(k)], by the native kernel (``native``:
        it runs here, the blocks on the CPU) or ``reference``: the same values either way."""
        if native:
            return functools.partial(_native_dequantize, code=self.code, k=k)
        return self.reference

    def reference(self, blocks: Tensor) -> Tensor:
        """Dequantisation in PyTorch's ops, as gguf.quants computes it (its values exactly: each
        d * q is exact in fp32, Q4_1's + m rounds once)."""
        n = blocks.shape[0]
        b = blocks.reshape(n, -1, self.block_bytes)
        if self.name in _K_QUANTS:
            return _K_QUANTS[self.name](b).reshape(n, -1)
        d = b[..., 0:2].contiguous().view(torch.float16).float()
        if self.name == "Q8_0":
            return (d * b[..., 2:].contiguous().view(torch.int8).float()).reshape(n, -1)
        start = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6}[self.name]
        qs = b[..., start:start + 16]
        q = torch.cat([qs & 15, qs >> 4], -1).to(torch.int32)  # weight i < 16: low nibble of byte i
        if self.name == "Q4_1":
            m = b[..., 2:4].contiguous().view(torch.float16).float()
            return (d * q.float() + m).reshape(n, -1)
        if self.name == "Q5_0":
            qh = b[..., 2:6].contiguous().view(torch.int32)  # bit i: weight i's fifth bit
            q = q | (((qh >> torch.arange(QK, dtype=torch.int32)) & 1) << 4)
            return (d * (q - 16).float()).reshape(n, -1)
        return (d * (q - 8).float()).reshape(n, -1)


def _native_dequantize(blocks: Tensor, code: int, k: int) -> Tensor:
    return kernels.dequantize(blocks.contiguous(), code, k)


def _half(b: Tensor) -> Tensor:
    """fp16 values at the last axis's byte pairs (b [..., 2]), as fp32 (exact)."""
    return b.contiguous().view(torch.float16).float()


def _q4_k(b: Tensor) -> Tensor:
    """Q4_K super-blocks b [n, blocks, 144] -> [n, blocks, 256], as gguf.quants.Q4_K: the 6-bit
    scale and min of each sub-block of 32 times d and dmin (exact), w = dd * q - dm (the product
    exact, one rounding)."""
    d, dmin = _half(b[..., 0:2]), _half(b[..., 2:4])
    s = b[..., 4:16].to(torch.int32)
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]  # sub-blocks 4-7 take 2 bits from lo/mid
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 2) & 48)], -1)
    m = torch.cat([mid & 63, (hi >> 4) | ((mid >> 2) & 48)], -1)
    qs = b[..., 16:].reshape(*b.shape[:2], 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
    q = (qs & 15).reshape(*b.shape[:2], 8, 32).float()  # sub-block 2c + h: nibble h of bytes 32c..
    return ((d * sc.float()).unsqueeze(-1) * q - (dmin * m.float()).unsqueeze(-1)).reshape(*b.shape[:2], QK_K)


def _q6_k(b: Tensor) -> Tensor:
    """Q6_K super-blocks b [n, blocks, 210] -> [n, blocks, 256], as gguf.quants.Q6_K: 4 low bits
    from ql, 2 high from qh, w = (d * scale) * (q - 32), every product exact."""
    lead = b.shape[:2]
    ql = b[..., 0:128].reshape(*lead, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    q = ((ql & 15).reshape(*lead, 8, 32) | ((qh & 3).reshape(*lead, 8, 32) << 4)).to(torch.int32) - 32
    scale = _half(b[..., 208:210]) * b[..., 192:208].contiguous().view(torch.int8).float()
    return (scale.unsqueeze(-1) * q.reshape(*lead, 16, 16).float()).reshape(*lead, QK_K)


_K_QUANTS = {"Q4_K": _q4_k, "Q6_K": _q6_k}

FORMATS = {f.name: f for f in (BlockFormat("Q8_0", 1, 34), BlockFormat("Q4_0", 2, 18),
                               BlockFormat("Q4_1", 3, 20), BlockFormat("Q5_0", 4, 22),
                               BlockFormat("Q4_K", 5, 144, QK_K), BlockFormat("Q6_K", 6, 210, QK_K))}
# the 32-weight formats --activations int8 multiplies by integer dot products (kvlab/kernels/act8.h)
ACT8_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0")
# the planner counts a GGUF file's bytes by kvlab.dtypes' torch-free list: it must be this one
assert tuple(FORMATS) == GGUF_AS_STORED, f"kvlab.dtypes.GGUF_AS_STORED is not {tuple(FORMATS)}"


def check_format(name: str) -> BlockFormat:
    """The format called ``name``; ValueError (one line, naming the ones kvlab runs) otherwise."""
    if name not in FORMATS:
        raise ValueError(f"GGUF type {name} cannot run as stored; kvlab runs {', '.join(FORMATS)} as "
                         f"stored and dequantises the others to the model's dtype")
    return FORMATS[name]


class QuantLinear(nn.Module):
    """A linear layer whose weight stays in a block format: ``blocks`` [out, in / block weights
    x block bytes] (uint8). fp32 rows up to the native kernel's row limit (as ``Linear``;
    deterministic mode: all) go through ``kernels.linear_q``; more rows, or where the kernel
    cannot run, dequantise and ``F.linear`` (rows padded in deterministic mode): the same choices,
    on the same values, as a dense fp32 ``Linear`` makes (``choose``)."""

    weight = None  # no dense weight: nothing packs or gathers it

    def __init__(self, fmt: BlockFormat, blocks: Tensor, in_features: int, bias: Tensor | None = None) -> None:
        super().__init__()
        fmt.check_rows(blocks, in_features)
        self.format, self.in_features, self.out_features = fmt, in_features, blocks.shape[0]
        self.register_buffer("blocks", blocks)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.dequantize: Dequantize = fmt.reference  # until a model chooses
        self.method: LinearMethod = Dequantized(self.dequantize, Gemm())

    def extra_repr(self) -> str:
        return f"{self.format.name}, in_features={self.in_features}, out_features={self.out_features}"

    def choose(self, setting: Setting, packed: None = None) -> None:
        """The native block kernel up to the rows a dense fp32 layer gives its kernel (rows past
        them take the dense layer's F.linear on the same values: the native kernel would outrun
        it there, at other bits), else the dequantised weight through PyTorch."""
        native = setting.rowwise and self.blocks.device.type == "cpu"
        self.dequantize = self.format.dequantizer(self.in_features, native)
        fallback = Dequantized(self.dequantize, setting.gemm(torch.float32))
        rows = setting.rows(torch.float32) if self.bias is None or self.bias.dtype == torch.float32 else 0
        if setting.activations == "int8" and self.format.name in ACT8_FORMATS:
            # int8 rows: the integer kernel at every row count (its results never depend on M)
            self.method = (NativeStored(self.format.code | kernels.ACT8, sys.maxsize, fallback) if rows and native
                           else Int8Reference(self.dequantize, setting.gemm(torch.float32)))
            return
        self.method = NativeStored(self.format.code, rows, fallback) if rows and native else fallback

    def dense(self) -> Tensor:
        """The dequantised weight [out, in], fp32."""
        return self.dequantize(self.blocks)

    def forward(self, x: Tensor) -> Tensor:
        return self.method(x, self.blocks, self.bias)


class QuantEmbedding(nn.Module):
    """An embedding table kept in a block format: a lookup dequantises the rows it reads (fp32)."""

    def __init__(self, fmt: BlockFormat, blocks: Tensor, dim: int) -> None:
        super().__init__()
        fmt.check_rows(blocks, dim)
        self.format, self.embedding_dim, self.num_embeddings = fmt, dim, blocks.shape[0]
        self.register_buffer("blocks", blocks)
        self.dequantize: Dequantize = fmt.reference  # until a model chooses

    def choose(self, setting: Setting) -> None:
        self.dequantize = self.format.dequantizer(self.embedding_dim, setting.rowwise and self.blocks.device.type == "cpu")

    def extra_repr(self) -> str:
        return f"{self.format.name}, {self.num_embeddings}, {self.embedding_dim}"

    def forward(self, ids: Tensor) -> Tensor:
        rows = self.blocks[ids.reshape(-1)]
        return self.dequantize(rows).view(*ids.shape, self.embedding_dim)

    def as_linear(self) -> QuantLinear:
        """A tied LM head reading these very blocks."""
        return QuantLinear(self.format, self.blocks, self.embedding_dim)


def held_bytes(model: nn.Module) -> int:
    """Bytes of a model's weights as held: parameters and block buffers, a shared tensor once."""
    seen: dict[int, int] = {}
    for t in list(model.parameters()) + [m.blocks for m in model.modules()
                                         if isinstance(m, (QuantLinear, QuantEmbedding))]:
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def held_formats(model: nn.Module) -> dict[str, int]:
    """Matrices per format: ``{"Q4_1": 210, "Q8_0": 1}``, dense ones by torch dtype
    (``"float32"``); a tied head counted once."""
    counts: dict[str, int] = {}
    seen: set[int] = set()
    for m in model.modules():
        if isinstance(m, (QuantLinear, QuantEmbedding)):
            key, ptr = m.format.name, m.blocks.data_ptr()
        elif isinstance(m, (nn.Linear, nn.Embedding)) and m.weight is not None and m.weight.numel():
            key, ptr = str(m.weight.dtype).removeprefix("torch."), m.weight.data_ptr()
        else:
            continue
        if ptr not in seen:
            seen.add(ptr)
            counts[key] = counts.get(key, 0) + 1
    return counts
