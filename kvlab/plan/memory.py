"""Memory: the cache per token, sequence and layer kind; weights; logits. The budget these are
taken from is `kvlab.layout.memory_budget`, the one model the engine sizes its pool by."""

from __future__ import annotations

from kvlab.dtypes import StorageDtype, matrix_bytes
from kvlab.spec import LayerSpec, ModelSpec

PREFILL_CHUNK = 8192  # tokens of one prefill step that the activation allowance is sized for


def weights_split(spec: ModelSpec, dtype: StorageDtype) -> tuple[int, int]:
    """(bytes outside routed experts, bytes of routed experts) with weights in `dtype`;
    embeddings and vectors stay 16-bit (32-bit if dtype is fp32), and so does every matrix
    outside the experts for a format that covers only them (MXFP4)."""
    small = 4 if dtype.bits == 32 else 2
    dense, experts = spec.other_params * small, 0
    for m in spec.matrices:
        expert = m.name.startswith("moe.experts")
        stored = m.quantizable and (expert or not dtype.experts_only)
        size = matrix_bytes(dtype, m.rows, m.cols) if stored else m.rows * m.cols * small
        if expert:
            experts += size * m.count
        else:
            dense += size * m.count
    return dense, experts


def kv_layout(spec: ModelSpec, dtype: StorageDtype) -> str:
    """The cache format's layout with the per-tensor scales this model keeps (fp8: K and V of
    each layer, or MLA's one latent)."""
    if not dtype.fixed_bytes_per_tensor:
        return dtype.layout
    tensors = "its latent" if spec.is_mla else "K and for V"
    per_layer = spec.kv_fixed_bytes(dtype) // max(1, len(spec.attention_layers))
    return f"{dtype.layout} for {tensors} ({per_layer} B per layer)"


def kv_without_gqa(spec: ModelSpec, dtype: StorageDtype) -> int | None:
    """Bytes per token if every query head kept its own K and V (None: the model has no GQA)."""
    layers = [layer for layer in spec.layers if layer.has_kv]
    if not any(layer.kind != "mla" and layer.kv_heads < layer.num_heads for layer in layers):
        return None
    return sum(layer.num_heads * (dtype.vector_bytes(layer.head_dim) + dtype.vector_bytes(layer.v_head_dim))
               for layer in layers)


def _kind_label(layer: LayerSpec) -> str:
    if layer.kind == "sliding":
        return f"sliding (W={layer.window})"
    if layer.kind == "chunked":
        return f"chunked ({layer.window})"
    if layer.kind in ("ssm", "none"):
        return f"{layer.kind} ({layer.mixer})"
    return layer.kind


def layer_breakdown(spec: ModelSpec, context: int, dtype: StorageDtype, state_bytes: int) -> list[dict]:
    """Layers, bytes per token and bytes per sequence of `context` tokens, by layer kind."""
    rows: dict[str, dict] = {}
    for layer in spec.layers:
        key = _kind_label(layer)
        row = rows.setdefault(key, {"kind": key, "layers": 0, "bytes_per_token": 0, "bytes_per_sequence": 0})
        row["layers"] += 1
        row["bytes_per_token"] += layer.kv_bytes_per_token(dtype)
        row["bytes_per_sequence"] += (layer.kv_bytes_per_token(dtype) * layer.cached_tokens(context)
                                      + layer.state_elems * state_bytes)
    return list(rows.values())
