"""What the engine holds, in numbers: how many KV blocks a memory budget buys and which tensor-parallel
sizes a model splits into. The one formula the engine allocates by and the planner prints, so
`kvlab plan --kv-memory` and the engine's start-up line can never disagree; torch-free, so both
`kvlab.plan` and `kvlab.engine` stand on it and neither imports the other.

Layers are grouped by how far back they attend (full layers, or sliding layers of one window);
each group gets its own block pool and block table per sequence. Every group gets the same number
of blocks, so one "block" means `block_size` tokens of every layer and costs
`block_size x spec.kv_bytes_per_token(dtype)` bytes: the planner's bytes per token are exactly what
the engine allocates. (A hybrid model's sliding pool is thus sized like its full pool; vLLM's
shared-page allocator reclaims that, at the price of many more block tables. All-sliding models,
Mistral-style, do get the window's saving: their sequences stop growing at the window.)

`memory_budget` is the one memory model: what is left for the cache once weights, activations,
logits and the runtime's own memory are taken from a device's memory. The engine sizes its pool by
it when no `--kv-memory` is given, and the planner's capacity figures are the same subtraction.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvlab.dtypes import kv_dtype as lookup_kv_dtype
from kvlab.spec import ModelSpec


GiB = 2**30
# Runtime memory outside weights/KV/activations: CUDA context, allocator slack, graphs (an estimate).
RUNTIME_OVERHEAD = {"gpu": 1 * GiB, "cpu": GiB // 2}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def activation_bytes(spec: ModelSpec, tokens: int, elem_bytes: int = 2) -> int:
    """Peak activations of one forward step over `tokens` tokens: hidden states, q/k/v/o and the
    MLP's gate and up outputs (the widest FFN: dense or one expert)."""
    inter = max((m.rows for m in spec.matrices if m.name in ("mlp.gate_up", "moe.experts.gate_up")),
                default=0)
    return tokens * (4 * spec.hidden_size + 2 * inter) * elem_bytes


@dataclass(frozen=True)
class MemoryBudget:
    """One device's memory, spent: the cache gets what the rest leaves."""

    total: int  # the device's memory (RAM on CPU)
    usable: int  # total x utilisation
    weights: int  # this device's share of the weights
    activations: int  # one step of `batched_tokens` tokens
    logits: int  # last-position logits of every sequence in the step
    runtime: int  # RUNTIME_OVERHEAD: estimate

    @property
    def kv(self) -> int:
        return self.usable - self.weights - self.activations - self.logits - self.runtime


def memory_budget(spec: ModelSpec, total: int, utilisation: float, weights: int, *,
                  batched_tokens: int, sequences: int, on_gpu: bool, elem_bytes: int = 2,
                  logit_bytes: int = 2) -> MemoryBudget:
    """The KV budget of one device: `total x utilisation` less weights, one step's activations
    (`batched_tokens` tokens in `elem_bytes`), `sequences` rows of logits and the runtime."""
    return MemoryBudget(
        total=total, usable=int(total * utilisation), weights=weights,
        activations=activation_bytes(spec, batched_tokens, elem_bytes),
        logits=sequences * spec.vocab_size * logit_bytes,
        runtime=RUNTIME_OVERHEAD["gpu" if on_gpu else "cpu"],
    )


@dataclass(frozen=True)
class LayerGroup:
    """Layers that share one block pool and one block table per sequence: same attention span."""

    kind: str  # the layers' LayerSpec.kind: full (or mla) / sliding (or chunked)
    window: int | None  # tokens a query sees (itself included); None = everything before it
    layers: tuple[int, ...]

    def blocks_per_seq(self, num_tokens: int, block_size: int) -> int:
        """Most blocks a sequence of `num_tokens` cached positions holds at once in this group.

        A window of W tokens straddles at most cdiv(W - 1, block_size) + 1 blocks.
        """
        full = cdiv(num_tokens, block_size)
        if self.window is None:
            return full
        return min(full, cdiv(self.window - 1, block_size) + 1)


def layer_groups(spec: ModelSpec) -> list[LayerGroup]:
    """The block-pool groups of a model, in order of first layer. Raises ValueError for layers with
    per-sequence state (SSM), which a block pool cannot hold."""
    if any(layer.state_elems for layer in spec.layers):
        raise ValueError(f"{spec.name}: SSM / linear-attention state is not paged by kvlab's engine")
    keys: dict[tuple[str, int | None], list[int]] = {}
    for i, layer in enumerate(spec.layers):
        if not layer.has_kv:
            continue
        windowed = layer.kind in ("sliding", "chunked") and layer.window
        keys.setdefault((layer.kind, layer.window if windowed else None), []).append(i)
    if not keys:
        raise ValueError(f"{spec.name}: no layer keeps a KV cache")
    return [LayerGroup(kind, window, tuple(ids)) for (kind, window), ids in keys.items()]


@dataclass(frozen=True)
class KVCapacity:
    """What a KV budget holds. `blocks` is the count in each group's pool."""

    blocks: int
    tokens: int  # blocks x block_size: token slots in every layer
    max_concurrency: float  # sequences of max_model_len tokens that fit at once
    bytes: int  # allocated: blocks x block_size x bytes_per_token + per-layer fp8 scales
    bytes_per_token: int
    block_size: int
    max_model_len: int
    kv_dtype: str


def kv_cache_capacity(spec: ModelSpec, kv_memory: int, block_size: int, kv_dtype: str,
                      max_model_len: int, tp: int = 1) -> KVCapacity:
    """Blocks, tokens and max concurrency that `kv_memory` bytes of `kv_dtype` cache give `spec`.
    At tensor-parallel size `tp`, `kv_memory` and the bytes are one rank's (``ModelSpec.tp_shard``):
    every rank holds the same block ids, each with its share of the KV heads."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be at least 1, got {max_model_len}")
    if kv_memory < 0:
        raise ValueError(f"kv_memory must be >= 0, got {kv_memory}")
    dtype = lookup_kv_dtype(kv_dtype)
    groups = layer_groups(spec)
    per_token = spec.tp_shard(tp).kv_bytes_per_token(dtype)
    fixed = spec.kv_fixed_bytes(dtype)
    blocks = max(0, (kv_memory - fixed) // (block_size * per_token))
    per_seq = max(g.blocks_per_seq(max_model_len, block_size) for g in groups)
    return KVCapacity(
        blocks=blocks, tokens=blocks * block_size, max_concurrency=blocks / per_seq,
        bytes=blocks * block_size * per_token + fixed,
        bytes_per_token=per_token, block_size=block_size, max_model_len=max_model_len,
        kv_dtype=dtype.name,
    )


# A disk-tier file (kvlab.engine.tiers): this header, then the bytes of one layer group's pool block
TIER_FILE_HEADER = struct.Struct("<8sI16s17sQI")  # magic, format, fingerprint, key, payload bytes, CRC-32


def tier_tokens(spec: ModelSpec, budget: int, block_size: int, kv_dtype: str, header: int = 0) -> int:
    """Prefix tokens a tier of ``budget`` bytes holds: whole blocks, one entry per layer group's
    block (exactly the pool block's bytes, int8's scales included), each with ``header`` bytes
    more (a disk file's TIER_FILE_HEADER; RAM entries have none)."""
    per_block = block_size * spec.kv_bytes_per_token(lookup_kv_dtype(kv_dtype)) + len(layer_groups(spec)) * header
    return budget // per_block * block_size


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
