"""Tensor parallelism: which TP sizes an engine accepts and how much of a cache each GPU holds."""

from __future__ import annotations

import math

from kvlab.dtypes import StorageDtype
from kvlab.spec import LayerSpec, ModelSpec, rank_kv_heads

VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of this before splitting it over TP


def valid_tp_sizes(spec: ModelSpec, limit: int = 64) -> list[int]:
    """TP sizes vLLM accepts: they divide the query heads, the FFN width (each expert's for MoE)
    and the vocabulary padded to a multiple of 64 (vLLM's VocabParallelEmbedding pads it so, then
    splits it evenly), and KV heads divide evenly or are replicated (tp a multiple of kv_heads)."""
    heads = [layer.num_heads for layer in spec.layers if layer.num_heads]
    kv = [layer.kv_heads for layer in spec.layers if layer.kv_heads and layer.kind != "mla"]
    # the FFN widths a rank splits: the input width of every down projection (dense, expert, shared)
    ffn = {m.cols for m in spec.matrices if m.name.endswith("down")}
    vocab = -(-spec.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    out = []
    for tp in range(1, limit + 1):
        if any(h % tp for h in heads) or any(f % tp for f in ffn) or vocab % tp:
            continue
        if any(k % tp and tp % k for k in kv):
            continue
        out.append(tp)
    return out


def check_tp(spec: ModelSpec, tp: int) -> None:
    """ValueError (one line) unless `tp` is one of the model's valid TP sizes."""
    tps = valid_tp_sizes(spec)
    if tp not in tps:
        raise ValueError(f"--tp {tp} is not valid for {spec.name}: valid sizes are {', '.join(map(str, tps))}")


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


def seq_bytes_per_gpu(spec: ModelSpec, context: int, dtype: StorageDtype, tp: int, state_bytes: int) -> int:
    """One sequence's cache on each GPU at this TP size (windows capped, SSM state fixed)."""
    total = 0.0
    for layer in spec.layers:
        full = layer.kv_bytes_per_token(dtype) * layer.cached_tokens(context) + layer.state_elems * state_bytes
        total += full * layer_kv_share(layer, tp)
    return math.ceil(total)
