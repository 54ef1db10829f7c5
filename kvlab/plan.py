"""The planner: KV-cache memory, weights, capacity, tensor parallelism and speed bounds.

Every number is derived from the ModelSpec (one source of truth) and a Device; each comes with
the formula or datasheet it rests on, so a reader can check it by hand.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from kvlab.dtypes import StorageDtype, kv_dtype, matrix_bytes, weight_dtype
from kvlab.engine.sizing import kv_cache_capacity
from kvlab.hardware import Device, get_device
from kvlab.spec import LayerSpec, ModelSpec

GiB = 2**30
# Runtime memory outside weights/KV/activations: CUDA context, allocator slack, graphs.
RUNTIME_OVERHEAD = {"gpu": 1 * GiB, "cpu": GiB // 2}
PREFILL_CHUNK = 8192  # tokens of one prefill step that the activation allowance is sized for


@dataclass(frozen=True)
class PlanRequest:
    context: int = 8192
    users: int = 1
    kv_dtype: str = "bf16"
    weights_dtype: str = "bf16"
    gpu: str = "h100-sxm"
    gpus: int | None = None
    tp: int | None = None
    mem_util: float = 0.9
    gpu_memory: int | None = None  # override the device's memory (bytes)
    prompt: int = 128  # for the cache / no-cache work table
    new_tokens: tuple[int, ...] = (64, 128, 256, 512)
    kv_memory: int | None = None  # the engine's KV budget (bytes): sizes its block pool
    block_size: int = 16  # tokens per engine KV block
    max_model_len: int | None = None  # for the engine's max concurrency (default: context)

    def validate(self, spec: ModelSpec) -> None:
        checks = [
            (self.context >= 1, f"--context must be at least 1, got {self.context}"),
            (self.context <= 100_000_000, f"--context {self.context} is beyond any model"),
            (self.users >= 1, f"--users must be at least 1, got {self.users}"),
            (0 < self.mem_util <= 1, f"--mem-util must be in (0, 1], got {self.mem_util}"),
            (self.gpus is None or self.gpus >= 1, f"--gpus must be at least 1, got {self.gpus}"),
            (self.tp is None or self.tp >= 1, f"--tp must be at least 1, got {self.tp}"),
            (self.prompt >= 1, f"--prompt must be at least 1, got {self.prompt}"),
            (self.gpu_memory is None or self.gpu_memory > 0, "--gpu-memory must be positive"),
            (self.kv_memory is None or self.kv_memory > 0, "--kv-memory must be positive"),
            (self.block_size >= 1, f"--block-size must be at least 1, got {self.block_size}"),
            (self.max_model_len is None or self.max_model_len >= 1,
             f"--max-model-len must be at least 1, got {self.max_model_len}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)


@dataclass
class Plan:
    model: str
    context: int
    users: int
    kv_dtype: str
    weights_dtype: str
    gpu: str
    tp: int
    gpus: int
    # cache
    kv_bytes_per_token: int
    kv_bytes_per_sequence: int
    kv_bytes_total: int
    kv_bytes_per_gpu: int
    kv_bytes_per_token_without_gqa: int | None
    kv_fixed_bytes: int
    kv_layout: str
    layer_breakdown: list[dict]
    # memory
    weights_bytes: int
    stored_weights_bytes: int | None  # what the checkpoint file holds (GGUF: quantised tensors)
    stored_weights_formats: str | None
    num_params: int
    active_params: int
    logits_bytes_all_positions: int
    logits_bytes_last_only: int
    activation_allowance_bytes: int
    runtime_overhead_bytes: int
    # device and capacity
    gpu_memory_bytes: int
    usable_bytes_per_gpu: int
    kv_budget_bytes_per_gpu: int
    max_sequences: int
    max_context_for_users: int | None
    gpus_needed: int | None
    gpus_needed_cache_only: int
    valid_tp_sizes: list[int]
    kv_replicated: bool
    # speed
    decode_step_seconds: float
    decode_weights_seconds: float
    decode_kv_seconds: float
    decode_tokens_per_s: float
    ttft_seconds: float
    prefill_flops: float
    crossover_batch: int | None
    work_table: list[dict]
    vllm_flags: str
    notes: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)
    # the engine's block pool for --kv-memory (kvlab.engine.sizing: what the engine allocates)
    kv_cache_blocks: int | None = None
    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None

    def to_json(self) -> dict:
        return asdict(self)


# --- tensor parallelism --------------------------------------------------------------------

def valid_tp_sizes(spec: ModelSpec, limit: int = 64) -> list[int]:
    """TP sizes an engine accepts: they divide the query heads, and KV heads divide evenly or
    are replicated (tp a multiple of kv_heads)."""
    heads = [layer.num_heads for layer in spec.layers if layer.num_heads]
    kv = [layer.kv_heads for layer in spec.layers if layer.kv_heads and layer.kind != "mla"]
    out = []
    for tp in range(1, limit + 1):
        if any(h % tp for h in heads):
            continue
        if any(k % tp and tp % k for k in kv):
            continue
        out.append(tp)
    return out


def layer_kv_share(layer: LayerSpec, tp: int) -> float:
    """Fraction of a layer's cache that each GPU holds at this TP size.

    GQA/MHA caches split by KV heads; past kv_heads GPUs each still holds one whole head
    (replication). MLA's latent is shared by all heads, so every GPU holds all of it.
    SSM state splits with the SSM heads."""
    if layer.kind == "mla":
        return 1.0
    if layer.has_kv:
        return max(1, layer.kv_heads // tp) / layer.kv_heads
    return 1.0 / tp


def seq_bytes_per_gpu(spec: ModelSpec, context: int, dtype: StorageDtype, tp: int, state_bytes: int) -> int:
    total = 0.0
    for layer in spec.layers:
        full = layer.kv_bytes_per_token(dtype) * layer.cached_tokens(context) + layer.state_elems * state_bytes
        total += full * layer_kv_share(layer, tp)
    return math.ceil(total)


# --- memory ---------------------------------------------------------------------------------

def weights_split(spec: ModelSpec, dtype: StorageDtype) -> tuple[int, int]:
    """(bytes outside routed experts, bytes of routed experts) with weights in `dtype`;
    embeddings and vectors stay 16-bit (32-bit if dtype is fp32)."""
    small = 4 if dtype.bits == 32 else 2
    dense, experts = spec.other_params * small, 0
    for m in spec.matrices:
        size = matrix_bytes(dtype, m.rows, m.cols) if m.quantizable else m.rows * m.cols * small
        if m.name.startswith("moe.experts"):
            experts += size * m.count
        else:
            dense += size * m.count
    return dense, experts


def experts_touched_fraction(spec: ModelSpec, batch: int) -> float:
    """Expected fraction of experts a batch routes to: 1 - (1 - k/E)^batch (uniform routing)."""
    for m in spec.matrices:
        if m.name == "moe.experts.down" and m.count:
            p = m.active / m.count
            return 1 - (1 - p) ** batch
    return 1.0


def activation_allowance(spec: ModelSpec, context: int) -> int:
    """Peak activations of one prefill chunk: hidden states, q/k/v/o and MLP intermediates."""
    tokens = min(context, PREFILL_CHUNK)
    inter = max((m.rows for m in spec.matrices if m.name in ("mlp.gate_up", "moe.experts.gate_up")), default=0)
    return tokens * (4 * spec.hidden_size + 2 * inter) * 2


# --- speed ----------------------------------------------------------------------------------

def prefill_flops(spec: ModelSpec, tokens: int) -> float:
    """2 x active matrix params x tokens for the matmuls (lm_head for the last token only) plus
    causal attention: QK^T and PV over the tokens each position attends to."""
    lm_head = 2 * spec.vocab_size * spec.hidden_size
    # the matrices every token multiplies by (MoE: routed experts only); the embedding is a lookup
    per_token = sum(m.rows * m.cols * m.active for m in spec.matrices if m.name != "lm_head")
    dense = 2 * per_token * tokens + lm_head
    attn = 0.0
    for layer in spec.layers:
        if not layer.has_kv:
            continue
        w = min(layer.cached_tokens(tokens), tokens)
        pairs = w * (w + 1) / 2 + (tokens - w) * w  # position i attends to min(i + 1, w) tokens
        attn += 2 * layer.num_heads * (layer.head_dim + layer.v_head_dim) * pairs
    return dense + attn


def generation_flops(spec: ModelSpec, prompt: int, new_tokens: int) -> float:
    """FLOPs to generate ``new_tokens`` after a ``prompt``-token prompt with a KV cache: every
    token but the last generated one passes through the model once (causally, as one long
    prefill would), and each of the ``new_tokens`` sampling positions through the LM head."""
    lm_head = 2 * spec.vocab_size * spec.hidden_size
    return prefill_flops(spec, prompt + new_tokens - 1) + (new_tokens - 1) * lm_head


def work_table(prompt: int, new_tokens: tuple[int, ...]) -> list[dict]:
    """Tokens pushed through the model with a cache (P + N - 1) and without (sum of P + i)."""
    rows = []
    for n in new_tokens:
        with_cache = prompt + n - 1
        without = n * prompt + n * (n - 1) // 2
        rows.append({"prompt": prompt, "new_tokens": n, "tokens_with_cache": with_cache,
                     "tokens_without_cache": without, "work_ratio": without / with_cache})
    return rows


# --- the plan -------------------------------------------------------------------------------

def make_plan(spec: ModelSpec, req: PlanRequest = PlanRequest()) -> Plan:
    req.validate(spec)
    kvd, wd = kv_dtype(req.kv_dtype), weight_dtype(req.weights_dtype)
    device: Device = get_device(req.gpu)
    state_bytes = 4 if wd.bits == 32 else 2  # SSM state stays in the activation dtype
    notes = list(spec.notes)
    T, B = req.context, req.users
    if spec.max_position_embeddings and T > spec.max_position_embeddings:
        notes.append(f"context {T:,} exceeds the model's max_position_embeddings "
                     f"{spec.max_position_embeddings:,}")

    tps = valid_tp_sizes(spec)
    gpus = req.gpus or req.tp or 1
    tp = req.tp or max(t for t in tps if gpus % t == 0)
    if tp not in tps:
        raise ValueError(f"--tp {tp} is not valid for {spec.name}: valid sizes are {', '.join(map(str, tps))}")
    if gpus % tp:
        raise ValueError(f"--gpus {gpus} is not a multiple of --tp {tp}")
    replicas = gpus // tp

    per_token = spec.kv_bytes_per_token(kvd)
    per_seq = spec.kv_bytes_per_sequence(T, kvd, state_bytes)
    per_seq_gpu = seq_bytes_per_gpu(spec, T, kvd, tp, state_bytes)
    kv_layers = [layer for layer in spec.layers if layer.has_kv]
    replicated = any(layer_kv_share(layer, tp) * tp > 1 for layer in kv_layers)
    without_gqa = None
    if any(layer.kind != "mla" and layer.kv_heads < layer.num_heads for layer in kv_layers):
        without_gqa = sum(layer.num_heads * kvd.vector_bytes(layer.head_dim)
                          + layer.num_heads * kvd.vector_bytes(layer.v_head_dim) for layer in kv_layers)

    breakdown: dict[str, dict] = {}
    for layer in spec.layers:
        key = f"sliding (W={layer.window})" if layer.kind == "sliding" else \
              f"chunked ({layer.window})" if layer.kind == "chunked" else \
              f"{layer.kind} ({layer.mixer})" if layer.kind in ("ssm", "none") else layer.kind
        row = breakdown.setdefault(key, {"kind": key, "layers": 0, "bytes_per_token": 0,
                                         "bytes_per_sequence": 0})
        row["layers"] += 1
        row["bytes_per_token"] += layer.kv_bytes_per_token(kvd)
        row["bytes_per_sequence"] += (layer.kv_bytes_per_token(kvd) * layer.cached_tokens(T)
                                      + layer.state_elems * state_bytes)

    w_dense, w_experts = weights_split(spec, wd)
    w_bytes = w_dense + w_experts

    def weights_read(batch: int) -> float:
        """Bytes of weights one decode step reads on each GPU: routed experts only."""
        return (w_dense + w_experts * experts_touched_fraction(spec, batch)) / tp
    logits_bytes = 4 if kvd.bits == 32 else 2
    logits_all = T * spec.vocab_size * logits_bytes
    logits_last = B * spec.vocab_size * logits_bytes
    act = activation_allowance(spec, T)
    runtime = RUNTIME_OVERHEAD["cpu" if device.key == "cpu" else "gpu"]

    mem = req.gpu_memory or device.memory_bytes
    usable = int(mem * req.mem_util)
    fixed_per_gpu = math.ceil(w_bytes / tp) + act + runtime + logits_last
    budget = usable - fixed_per_gpu
    kv_fixed = kvd.fixed_bytes_per_tensor * 2 * len(kv_layers)
    max_seqs = max(0, budget // per_seq_gpu) * replicas if per_seq_gpu and budget > 0 else 0

    def fits(n_users: int, context: int, tp_: int, dp: int, per: int | None = None) -> bool:
        per = per if per is not None else seq_bytes_per_gpu(spec, context, kvd, tp_, state_bytes)
        need = math.ceil(w_bytes / tp_) + act + runtime + math.ceil(n_users / dp) * (per + spec.vocab_size * logits_bytes)
        return need <= usable

    max_ctx = None
    if budget > 0:
        lo, hi = 0, max(T, spec.max_position_embeddings or T)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(B, mid, tp, replicas):
                lo = mid
            else:
                hi = mid - 1
        max_ctx = lo or None
    gpus_needed = None
    per_by_tp = {t: seq_bytes_per_gpu(spec, T, kvd, t, state_bytes) for t in tps}
    for n in range(1, 4097):
        if any(n % t == 0 and fits(B, T, t, n // t, per_by_tp[t]) for t in tps):
            gpus_needed = n
            break
    cache_only = math.ceil(per_seq * B / usable)

    # decode: each GPU reads its weight shard and its share of every sequence's cache
    batch = max(1, math.ceil(B / replicas))
    w_read = weights_read(batch)
    kv_read = batch * per_seq_gpu
    t_w, t_kv = w_read / device.bandwidth, kv_read / device.bandwidth
    step = t_w + t_kv
    flops = prefill_flops(spec, T)
    ttft = max(flops / (device.flops * tp), w_bytes / tp / device.bandwidth)

    crossover = None
    if per_seq_gpu:  # cache reads grow linearly in the batch, weight reads saturate: bisect
        hi = 1
        while hi * per_seq_gpu < weights_read(hi) and hi < 2**40:
            hi *= 2
        lo = hi // 2
        while lo + 1 < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if mid * per_seq_gpu < weights_read(mid) else (lo, mid)
        crossover = hi

    capacity = None
    if req.kv_memory is not None:
        try:
            capacity = kv_cache_capacity(spec, req.kv_memory, req.block_size, kvd.name,
                                         req.max_model_len or T)
        except ValueError as e:
            notes.append(f"engine KV cache: {e}")

    vllm_kv = {"bf16": "auto", "fp16": "auto", "fp32": "auto", "fp8_e4m3": "fp8_e4m3",
               "fp8_e5m2": "fp8_e5m2"}.get(kvd.name)
    flags = [f"--max-model-len {T}", f"--max-num-seqs {max(1, min(B, max_seqs // replicas or 1))}",
             f"--tensor-parallel-size {tp}", f"--gpu-memory-utilization {req.mem_util}"]
    if replicas > 1:
        flags.append(f"--data-parallel-size {replicas}")
    if vllm_kv:
        flags.append(f"--kv-cache-dtype {vllm_kv}")
    else:
        notes.append(f"vLLM has no {kvd.name} KV cache; llama.cpp does (--cache-type-k/-v q8_0/q4_0)")
    if max_seqs < B:
        notes.append(f"{B} users of {T:,} tokens do not fit on {gpus} x {device.name}: "
                     f"room for {max_seqs}")

    return Plan(
        model=spec.name, context=T, users=B, kv_dtype=kvd.name, weights_dtype=wd.name,
        gpu=device.key, tp=tp, gpus=gpus,
        kv_bytes_per_token=per_token, kv_bytes_per_sequence=per_seq, kv_bytes_total=per_seq * B,
        kv_bytes_per_gpu=per_seq_gpu, kv_bytes_per_token_without_gqa=without_gqa,
        kv_fixed_bytes=kv_fixed, kv_layout=kvd.layout, layer_breakdown=list(breakdown.values()),
        weights_bytes=w_bytes,
        stored_weights_bytes=spec.stored_weights.bytes if spec.stored_weights else None,
        stored_weights_formats=spec.stored_weights.describe() if spec.stored_weights else None,
        num_params=spec.num_params, active_params=spec.active_params,
        logits_bytes_all_positions=logits_all, logits_bytes_last_only=logits_last,
        activation_allowance_bytes=act, runtime_overhead_bytes=runtime,
        gpu_memory_bytes=mem, usable_bytes_per_gpu=usable, kv_budget_bytes_per_gpu=budget,
        max_sequences=int(max_seqs), max_context_for_users=max_ctx, gpus_needed=gpus_needed,
        gpus_needed_cache_only=cache_only, valid_tp_sizes=tps, kv_replicated=replicated,
        decode_step_seconds=step, decode_weights_seconds=t_w, decode_kv_seconds=t_kv,
        decode_tokens_per_s=batch * replicas / step, ttft_seconds=ttft, prefill_flops=flops,
        crossover_batch=crossover, work_table=work_table(req.prompt, req.new_tokens),
        vllm_flags="vllm serve MODEL " + " ".join(flags), notes=notes,
        sources={
            "kv_bytes_per_token": "sum over layers of K and V vectors per token x dtype bytes "
                                  "(2 x kv_heads x head_dim x bytes for GQA; kv_lora_rank + rope dim for MLA)",
            "kv_bytes_per_sequence": "per layer: bytes/token x min(context, window) + fixed SSM state",
            "weights_bytes": f"parameters from config.json; linear layers in {wd.name} ({wd.layout}), "
                             f"embeddings and norms in {'fp32' if wd.bits == 32 else '16-bit'}",
            "logits": "positions x vocab_size x 2 B: all prompt positions vs the last one only",
            "activation_allowance": f"estimate: one {PREFILL_CHUNK}-token prefill chunk x "
                                    f"(4 x hidden + 2 x intermediate) x 2 B",
            "runtime_overhead": "estimate: CUDA context, allocator slack, graphs (0.5 GiB on cpu)",
            "device": device.source,
            "decode_step": "(weights read + KV of the batch) / memory bandwidth, per GPU at this TP",
            "ttft": "max(prefill FLOPs / peak dense FLOP/s, weights / bandwidth)",
            "crossover": "smallest batch whose cache reads >= weight reads at this context",
            "kv_cache_blocks": "(kv_memory - fp8 scales) // (block_size x kv_bytes_per_token); "
                               "max_concurrency = blocks / blocks one max_model_len sequence holds",
        },
        kv_cache_blocks=capacity.blocks if capacity else None,
        kv_cache_tokens=capacity.tokens if capacity else None,
        max_concurrency=capacity.max_concurrency if capacity else None,
    )
