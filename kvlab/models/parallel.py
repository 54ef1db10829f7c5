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

The model is sharded in place from a whole one (``shard_model``); module names stay Hugging
Face's, so the model code runs unchanged on a shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from kvlab.models.llama import CausalLM, Linear
from kvlab.models.weights import QuantEmbedding, QuantLinear, held_bytes
from kvlab.spec import rank_kv_heads


class RowParallelLinear(Linear):
    """A linear layer that holds some input columns: all-reduce sums the ranks' partial
    products, then the bias (kept whole on every rank) is added once."""

    def __init__(self, weight: Tensor, bias: Tensor | None, group: dist.ProcessGroup | None) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.reduced_bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x)
        dist.all_reduce(y, group=self.group)
        return y if self.reduced_bias is None else y + self.reduced_bias


class NoHead(Linear):
    """The LM head of a rank other than 0: no weight, no logits (the driver samples rank 0's)."""

    def __init__(self, like: Linear) -> None:
        super().__init__(like.in_features, 0, bias=False, device="meta")
        self.weight = nn.Parameter(like.weight.new_empty(0, like.in_features), requires_grad=False)

    def reset_parameters(self) -> None:
        pass  # nothing to initialise

    def prepack(self) -> int:
        return 0

    def forward(self, x: Tensor) -> Tensor:
        return x[:, :0]


def _rows(linear: Linear, start: int, end: int) -> None:
    """Keep output rows [start, end) of a linear layer (column parallelism)."""
    with torch.no_grad():
        linear.weight = nn.Parameter(linear.weight[start:end].clone(), requires_grad=False)
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias[start:end].clone(), requires_grad=False)
    linear.out_features = end - start


def _columns(linear: Linear, start: int, end: int, group: dist.ProcessGroup | None) -> RowParallelLinear:
    """Input columns [start, end) of a linear layer, as a row-parallel layer."""
    bias = None if linear.bias is None else linear.bias.detach().clone()
    return RowParallelLinear(linear.weight.detach()[:, start:end].clone(), bias, group)


def _densify(model: CausalLM) -> None:
    """Stored GGUF blocks become dense fp32 layers of the same values before sharding (the ranks
    do not shard blocks yet: a tensor-parallel run holds fp32 weights)."""
    for name, m in list(model.named_modules()):
        if not isinstance(m, (QuantLinear, QuantEmbedding)):
            continue
        parent_name, _, child = name.rpartition(".")
        if isinstance(m, QuantEmbedding):
            ids = torch.arange(m.num_embeddings)
            dense: nn.Module = nn.Embedding(m.num_embeddings, m.embedding_dim, _weight=m(ids))
        else:
            dense = Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
            dense.weight = nn.Parameter(m.dense(), requires_grad=False)
            if m.bias is not None:
                dense.bias = nn.Parameter(m.bias.detach(), requires_grad=False)
        setattr(model.get_submodule(parent_name), child, dense)
    model.tie_weights()


def first_kv_head(num_heads: int, kv_heads: int, rank: int, tp: int) -> int:
    """The first KV head rank `rank` holds: the one its first query head reads."""
    return rank * (num_heads // tp) // (num_heads // kv_heads)


@torch.no_grad()
def shard_model(model: CausalLM, rank: int, tp: int, group: dist.ProcessGroup | None = None) -> CausalLM:
    """Keep rank `rank`'s part of `model` (in place; returns it). `tp` must be one of the model's
    valid sizes (``kvlab.plan.parallel.check_tp``: it divides the heads and the FFN width)."""
    model.unpack()  # packed copies of whole weights would outlive the shard
    _densify(model)
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
        model.lm_head = NoHead(model.lm_head)  # a tied head's weight stays: it is the embedding
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's (or shard's) weights as held (stored blocks included), a tied weight
    counted once."""
    return held_bytes(model)
