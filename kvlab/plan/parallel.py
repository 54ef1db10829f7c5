"""Tensor parallelism: which TP sizes an engine accepts and how much of a cache each GPU holds."""

from __future__ import annotations

import math

from kvlab.dtypes import StorageDtype
from kvlab.layout import VOCAB_PADDING, check_tp, valid_tp_sizes  # noqa: F401  (the planner's TP answers)
from kvlab.spec import LayerSpec, ModelSpec, rank_kv_heads

def layer_kv_share(layer: LayerSpec, tp: int) -> float:
    """Fraction of a layer's cache that each GPU holds at this TP size.

    GQA/MHA caches split by KV heads; past kv_heads GPUs each still holds one whole head
    (replication). MLA's latent is shared by all heads, so every GPU holds all of it.
    SSM state splits with the SSM heads."""
    if layer.kind == "mla":
        return 1.0
    if layer.has_kv:
        return rank_kv_heads(layer.kv_heads, tp) / layer.kv_heads
    return 1.0 / tp


def kv_split(spec: ModelSpec, tp: int, dp_attention: bool = False) -> str:
    """In words, how `tp` tensor-parallel GPUs divide one sequence's cache (``layer_kv_share``)."""
    if tp == 1:
        return "whole on one GPU"
    if dp_attention:
        return "DP attention: whole on the GPU that serves it"
    if spec.is_mla:
        return "MLA latent: whole on every GPU (all heads read it)"
    kv = spec.num_kv_heads
    if not kv:
        return f"state split with the SSM heads, 1/{tp} per GPU"
    if tp > kv:
        return f"replicated: {kv} KV heads, one on each GPU, {tp // kv} copies of each"
    return f"split by KV heads: {rank_kv_heads(kv, tp)} of {kv} per GPU"


def seq_bytes_per_gpu(spec: ModelSpec, context: int, dtype: StorageDtype, tp: int, state_bytes: int,
                      kept: int | None = None) -> int:
    """One sequence's cache on each GPU at this TP size (windows capped, SSM state fixed; ``kept``:
    the tokens an eviction policy leaves the full-attention layers)."""
    total = 0.0
    for layer in spec.layers:
        full = layer.kv_bytes_per_token(dtype) * layer.cached_tokens(context, kept) + layer.state_elems * state_bytes
        total += full * layer_kv_share(layer, tp)
    return math.ceil(total)
