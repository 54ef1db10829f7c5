"""Tensor parallelism for the Llama-family model (``llama.py``), Megatron-style.

One of N ranks keeps, of every decoder layer:
- q_proj: the rows of its N-th of the query heads; k_proj / v_proj: the rows of the KV heads those
  query heads read (``kvlab.spec.rank_kv_heads``: an even split, or past kv_heads ranks one whole
  head each, the same head on every rank of its group, as vLLM replicates them);
- gate_proj / up_proj: its N-th of the FFN columns (column-parallel: no communication);
- o_proj / down_proj: the matching columns of the input (row-parallel): each rank's product is a
  partial sum, one all-reduce per layer each adds them up, then the bias is added once.
The embedding is replicated (every rank embeds the step's tokens itself: no all-gather), and the
LM head lives on rank 0 alone, which returns the logits the driver samples from; the other ranks
skip it. Attention itself is untouched: a rank attends over its own heads and its own cache.

Stored GGUF blocks (``QuantLinear``, ``QuantEmbedding``) stay stored on every rank: a
column-parallel layer keeps its rows' blocks (a row is whole blocks), a row-parallel one the
blocks of its columns, where its split falls on a block edge (a multiple of 32 inputs); where it
does not (a k-quant's blocks are 256 wide), that layer alone is dequantised to dense fp32 on that rank. The replicated embedding and
rank 0's LM head (tied: the embedding's blocks) stay as stored too, so a rank holds about its N-th
of the packed layers plus the embedding (``held_bytes``).

The model is sharded in place from a whole one (``shard_model``); module names stay Hugging
Face's, so the model code runs unchanged on a shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from kvlab.models.llama import CausalLM, Linear
from kvlab.models.weights import BlockFormat, QuantLinear, held_bytes
from kvlab.spec import rank_kv_heads


class RowParallel:
    """What a layer holding some input columns adds to its own product (mixed in before
    ``Linear`` or ``QuantLinear``): all-reduce sums the ranks' partial products, then the bias,
    kept whole on every rank out of the layer's own product, is added once."""

    reduced_bias: nn.Parameter | None
    group: dist.ProcessGroup | None

    def _reduce_with(self, bias: Tensor | None, group: dist.ProcessGroup | None) -> None:
        self.reduced_bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x)  # type: ignore[misc]
        dist.all_reduce(y, group=self.group)
        return y if self.reduced_bias is None else y + self.reduced_bias


class RowParallelLinear(RowParallel, Linear):
    """A dense row-parallel layer: ``weight`` [out, its inputs]."""

    def __init__(self, weight: Tensor, bias: Tensor | None, group: dist.ProcessGroup | None) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self._reduce_with(bias, group)


class RowParallelQuantLinear(RowParallel, QuantLinear):
    """A row-parallel layer kept in blocks: ``blocks`` [out, its inputs / 32 x block bytes]."""

    def __init__(self, fmt: BlockFormat, blocks: Tensor, in_features: int, bias: Tensor | None,
                 group: dist.ProcessGroup | None) -> None:
        super().__init__(fmt, blocks, in_features)
        self._reduce_with(bias, group)


class NoHead(Linear):
    """The LM head of a rank other than 0: no weight, no logits (the driver samples rank 0's)."""

    def __init__(self, in_features: int, dtype: torch.dtype) -> None:
        super().__init__(in_features, 0, bias=False, device="meta")
        self.weight = nn.Parameter(torch.empty(0, in_features, dtype=dtype), requires_grad=False)

    def reset_parameters(self) -> None:
        pass  # nothing to initialise

    def forward(self, x: Tensor) -> Tensor:
        return x[:, :0]


def _rows(linear: Linear | QuantLinear, start: int, end: int) -> None:
    """Keep output rows [start, end) of a linear layer (column parallelism); a stored one keeps
    those rows' blocks (each row is whole blocks)."""
    with torch.no_grad():
        if isinstance(linear, QuantLinear):
            linear.blocks = linear.blocks[start:end].clone()
        else:
            linear.weight = nn.Parameter(linear.weight[start:end].clone(), requires_grad=False)
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias[start:end].clone(), requires_grad=False)
    linear.out_features = end - start


def _columns(linear: Linear | QuantLinear, start: int, end: int,
             group: dist.ProcessGroup | None) -> RowParallelLinear | RowParallelQuantLinear:
    """Input columns [start, end) of a linear layer, as a row-parallel layer. A stored layer keeps
    the blocks of those columns if start and end are block edges (multiples of 32, a k-quant's 256); else a block
    would straddle two ranks, so this layer is dequantised and its slice held as dense fp32."""
    bias = None if linear.bias is None else linear.bias.detach().clone()
    if isinstance(linear, QuantLinear):
        fmt = linear.format
        if start % fmt.block == 0 and end % fmt.block == 0:
            blocks = linear.blocks[:, fmt.row_bytes(start):fmt.row_bytes(end)].clone()
            return RowParallelQuantLinear(fmt, blocks, end - start, bias, group)
        return RowParallelLinear(linear.dense()[:, start:end].clone(), bias, group)
    return RowParallelLinear(linear.weight.detach()[:, start:end].clone(), bias, group)


def first_kv_head(num_heads: int, kv_heads: int, rank: int, tp: int) -> int:
    """The first KV head rank `rank` holds: the one its first query head reads."""
    return rank * (num_heads // tp) // (num_heads // kv_heads)


@torch.no_grad()
def shard_model(model: CausalLM, rank: int, tp: int, group: dist.ProcessGroup | None = None) -> CausalLM:
    """Keep rank `rank`'s part of `model` (in place; returns it). `tp` must be one of the model's
    valid sizes (``kvlab.plan.parallel.check_tp``: it divides the heads and the FFN width)."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        h, kvh, d = attn.num_heads, attn.kv_heads, attn.head_dim
        q, kv = h // tp, rank_kv_heads(kvh, tp)
        first = first_kv_head(h, kvh, rank, tp)
        _rows(attn.q_proj, rank * q * d, (rank + 1) * q * d)
        _rows(attn.k_proj, first * d, (first + kv) * d)
        _rows(attn.v_proj, first * d, (first + kv) * d)
        attn.o_proj = _columns(attn.o_proj, rank * q * d, (rank + 1) * q * d, group)
        attn.num_heads, attn.kv_heads = q, kv
        inter = mlp.gate_proj.out_features // tp
        _rows(mlp.gate_proj, rank * inter, (rank + 1) * inter)
        _rows(mlp.up_proj, rank * inter, (rank + 1) * inter)
        mlp.down_proj = _columns(mlp.down_proj, rank * inter, (rank + 1) * inter, group)
    if rank != 0:
        # a tied head's weight stays: it is the embedding (its blocks, if stored)
        model.lm_head = NoHead(model.lm_head.in_features, model.dtype)
    model.use()  # the new layers choose how they run; packed copies of whole weights are dropped
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's (or shard's) weights as held: a rank's stored blocks as stored, a tied
    weight counted once."""
    return held_bytes(model)
