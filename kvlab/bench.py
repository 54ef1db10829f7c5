"""`kvlab bench`: a seeded offline workload through the paged engine, optionally beside
Hugging Face transformers run the way users run it (static, left-padded batches).

Figures: output tokens/s, TTFT and inter-token latency p50/p99, peak KV usage, KV waste
(allocated-but-empty slots / slots holding tokens, at the peak), prefix hit rate; the
compute bound (the workload's FLOPs at this machine's measured matmul peak), the fraction of
peak reached in prefill steps (FLOP/s) and in decode steps (bytes/s of bandwidth, and FLOP/s),
and for a single request its decode speed as a fraction of the memory-bandwidth bound of
`kvlab plan`.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from kvlab.dtypes import weight_dtype
from kvlab.engine.engine import MODEL_KV_DTYPE, LLMEngine
from kvlab.options import EngineOptions
from kvlab.engine.sequence import Sequence
from kvlab.hardware import cpu_device, kernel_flops
from kvlab.dispatch import backends
from kvlab.models.llama import CausalLM, Linear, LMHead
from kvlab.models.methods import Setting
from kvlab.models.weights import FORMATS, QuantLinear, held_bytes, held_formats
from kvlab.plan import forward_flops, generation_flops
from kvlab.plan.memory import weights_split
from kvlab.plan.speed import weights_read
from kvlab.sampling import SamplingParams
from kvlab.spec import ModelSpec


@dataclass(frozen=True)
class Workload:
    num_requests: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    shared_prefix: int = 0
    seed: int = 0

    def requests(self, vocab_size: int) -> list[tuple[list[int], int]]:
        """(prompt ids, output length) per request; the shared prefix opens every prompt."""
        if self.shared_prefix >= self.input_len[0] and self.shared_prefix:
            raise ValueError(f"--shared-prefix {self.shared_prefix} must be shorter than the "
                             f"shortest input ({self.input_len[0]})")
        rng = random.Random(self.seed)
        prefix = [rng.randrange(vocab_size) for _ in range(self.shared_prefix)]
        out = []
        for _ in range(self.num_requests):
            n_in = rng.randint(*self.input_len)
            own = [rng.randrange(vocab_size) for _ in range(n_in - len(prefix))]
            out.append((prefix + own, rng.randint(*self.output_len)))
        return out


def parse_range(text: str) -> tuple[int, int]:
    """'64:512' -> (64, 512); '128' -> (128, 128)."""
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
    except ValueError:
        lo = hi = None
    if lo is None or hi is None or lo < 1 or hi < lo:
        raise ValueError(f"not a length range: {text!r} (examples: 128, 64:512)")
    return lo, hi


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


@dataclass
class BenchResult:
    model: str
    dtype: str  # the model's (fp32, bf16, fp16): 16-bit greedy outputs may differ from a peer's
    deterministic: bool  # batch-invariant kernels (--deterministic): answers independent of load
    num_requests: int
    output_tokens: int
    seconds: float
    output_tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    itl_p50_s: float
    itl_p99_s: float
    peak_kv_usage: float
    kv_waste_at_peak: float
    prefix_queries: int
    prefix_hits: int
    prefix_hit_rate: float
    preemptions: int
    kv_cache_blocks: int
    # sequences holding KV at once: the most, and the most past their prompt (generating): what a
    # policy's kept budget buys under a fixed --kv-memory
    max_running: int
    max_decoding: int
    ttft_first_s: float  # the first request's TTFT (cold, for shared-prefix runs)
    ttft_mean_after_first_s: float
    work_flops: float = 0.0  # the workload's FLOPs (`kvlab.plan.generation_flops`, all requests)
    decode_tokens_per_s: float | None = None  # single request: tokens after the first / time
    bound_tokens_per_s: float | None = None  # memory-bandwidth bound of `kvlab plan --gpu cpu`
    matmul_peak_flops: float | None = None  # measured: the model's largest linear layer as it runs
    compute_bound_tokens_per_s: float | None = None  # output tokens / (work at the matmul peak)
    # the engine's steps by phase: prefill steps compute a prompt token or more, decode steps one
    # new token per sequence; their FLOPs from `kvlab.plan.forward_flops`, decode's bytes are the
    # weights as held (held_weight_bytes) and each sequence's cache read
    prefill_seconds: float = 0.0
    prefill_flops: float = 0.0
    decode_seconds: float = 0.0
    decode_flops: float = 0.0
    decode_bytes: float = 0.0
    held_weight_bytes: int = 0  # the weights the model holds, stored blocks as stored: each decode step's read
    held_formats: dict[str, int] = field(default_factory=dict)  # its matrices per format (weights.held_formats)
    weights: str = ""  # which matrices run as stored, and why (kvlab.models.loader.WeightsChoice)
    activations: str = "fp32"  # the matmuls' inputs (--activations): fp32 exact, int8 lossy
    memory_bandwidth: float | None = None  # bytes/s: `kvlab plan --gpu cpu`'s measured figure
    prefill_peak_fraction: float | None = None  # achieved FLOP/s / matmul peak
    decode_peak_fraction: float | None = None  # achieved FLOP/s / matmul peak
    decode_bandwidth_fraction: float | None = None  # achieved bytes/s / memory bandwidth
    hf_output_tokens_per_s: float | None = None
    hf_batch_size: int | None = None
    hf_identical_requests: int | None = None  # greedy outputs equal to the engine's
    dtype_why: str = ""  # how the loader chose `dtype` (kvlab.models.loader.choose_dtype)
    linear_kernel: str = ""  # what runs the linear layers (kvlab.dispatch.Backends.linear_kernel)
    cpu_paths: str = ""  # every CPU-dependent path, on or off, and why (kvlab.dispatch.Backends.line)
    deterministic_why: str = ""  # the flag, or auto's reason (kvlab.engine.engine.deterministic_is_free)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def _waste(engine: LLMEngine) -> tuple[int, int]:
    """(empty slots in allocated blocks, slots holding tokens) over the running sequences."""
    bs = engine.options.block_size
    held = empty = 0
    for seq in engine.scheduler.running:
        for table in seq.block_tables:
            live = [b for b in table if b >= 0]
            slots = len(live) * bs
            # tokens with K/V in this table's live blocks (a sliding table lost its early blocks)
            first = (len(table) - len(live)) * bs
            tokens = max(0, min(seq.num_computed_tokens, len(table) * bs) - first)
            held += tokens
            empty += slots - tokens
    return empty, held


@dataclass
class Phases:
    """Seconds, FLOPs and (decode) bytes of the engine's steps, split by phase. Each step is
    read from the sequences around it: the tokens each computed (from the first not in its
    cache, or its prefix-cache hit on admission) to its computed count after the step. A step
    in which every sequence computed just its one new token is a decode step; any other (a
    prompt chunk, alone or beside decodes) a prefill step. Attention and cache reads are
    counted over every earlier token: under a --kv-policy that keeps fewer, the decode figures
    are upper estimates."""

    spec: ModelSpec
    weights: tuple[int, int]  # the weights as held (decode_weights): outside routed experts, of routed experts
    kv_dtype: str
    prefill_seconds: float = 0.0
    prefill_flops: float = 0.0
    decode_seconds: float = 0.0
    decode_flops: float = 0.0
    decode_bytes: float = 0.0

    @staticmethod
    def before(engine: LLMEngine) -> list[tuple[Sequence, int, int]]:
        """(sequence, computed tokens, tokens) of every sequence the next step may run."""
        s = engine.scheduler
        return [(q, q.num_computed_tokens, q.num_tokens) for q in [*s.running, *s.waiting]]

    def add(self, before: list[tuple[Sequence, int, int]], seconds: float) -> None:
        """Count one step that took `seconds`, from `before` (taken just ahead of it)."""
        spans = []  # (first position computed, end, tokens before the step)
        for seq, done, total in before:
            start = done or seq.num_cached_tokens  # first admission: its prefix-cache hit
            if seq.num_computed_tokens > start:
                spans.append((start, seq.num_computed_tokens, total))
        flops = sum(forward_flops(self.spec, a, b - a, int(b == t)) for a, b, t in spans)
        if spans and all(a == t - 1 and b == t for a, b, t in spans):
            self.decode_seconds += seconds
            self.decode_flops += flops
            self.decode_bytes += weights_read(self.spec, self.weights, len(spans)) + sum(
                self.spec.kv_bytes_per_sequence(b, self.kv_dtype) for _, b, _ in spans)
        else:
            self.prefill_seconds += seconds
            self.prefill_flops += flops


def decode_weights(model: CausalLM) -> tuple[int, int]:
    """(bytes outside routed experts, bytes of routed experts) of the weights a decode step reads:
    those the model holds (``held_bytes``: a GGUF file's Q4_1 blocks as stored, not their dense
    fp32), the routed experts' share as ``weights_split`` counts them in the model's dtype."""
    _, experts = weights_split(model.spec, weight_dtype(MODEL_KV_DTYPE[model.dtype]))
    return held_bytes(model) - experts, experts


def run_engine(model: CausalLM, options: EngineOptions, work: Workload,
               progress: Callable[[int, int], None] = lambda done, total: None,
               staggered: bool | None = None, device: str | None = None) -> tuple[BenchResult, list[list[int]]]:
    """Add every request at once (offline throughput), step until all finish.

    With a shared prefix (or ``staggered``), requests arrive one after another instead: each
    as soon as the previous one has its first token, so the prefix is cached when it arrives.
    The first request's TTFT is then the cold one and the others' show what the prefix cache
    saves (added all at once, the first steps would compute the prefix for several requests
    and everyone would queue behind them). TTFT counts from each request's arrival.
    Returns the figures and each request's generated ids, in request order. ``device``: where
    tensor-parallel workers run (``options.tp`` > 1; default the model's device)."""
    engine = LLMEngine(model, None, options, device)
    reqs = work.requests(model.spec.vocab_size)
    staggered = work.shared_prefix > 0 if staggered is None else staggered
    t0 = time.perf_counter()
    ids: dict[str, int] = {}

    def submit(i: int) -> str:
        prompt, n_out = reqs[i]
        params = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
        rid = engine.add_request(prompt, params)
        ids[rid] = i
        return rid

    if staggered:
        latest = submit(0)
    else:
        for i in range(len(reqs)):
            submit(i)
    outputs: list[list[int]] = [[] for _ in reqs]
    last_token_at: dict[str, float] = {}
    ttft: dict[str, float] = {}
    itl: list[float] = []
    tokens = 0
    done = 0
    peak_usage, waste_at_peak = 0.0, 0.0
    max_running = max_decoding = 0
    phases = Phases(model.spec, decode_weights(model), engine.capacity.kv_dtype)
    with torch.inference_mode():
        while engine.has_unfinished():
            before = phases.before(engine)
            start = time.perf_counter()
            outs = engine.step()
            now = time.perf_counter()
            phases.add(before, now - start)
            running = engine.scheduler.running
            max_running = max(max_running, len(running))
            max_decoding = max(max_decoding, sum(q.num_computed_tokens >= q.num_prompt_tokens for q in running))
            m = engine.metrics()
            if m.kv_usage >= peak_usage:
                empty, held = _waste(engine)
                peak_usage, waste_at_peak = m.kv_usage, empty / held if held else 0.0
            for out in outs:
                tokens += len(out.new_token_ids)
                rid = out.request_id
                if rid in last_token_at:
                    itl.append(now - last_token_at[rid])
                else:
                    ttft[rid] = out.ttft_s or now - t0
                last_token_at[rid] = now
                if out.finished:
                    outputs[ids[rid]] = list(out.token_ids)
                    done += 1
                    progress(done, len(reqs))
            if staggered and latest in ttft and len(ids) < len(reqs):
                latest = submit(len(ids))
    seconds = time.perf_counter() - t0
    engine.close()  # tensor-parallel workers, if any: the figures below are the driver's
    m = engine.metrics()
    order = sorted(ttft, key=lambda r: ids[r])
    ttfts = [ttft[r] for r in order]
    after = ttfts[1:]
    single = len(reqs) == 1 and tokens > 1
    result = BenchResult(
        model=model.name, dtype=MODEL_KV_DTYPE[model.dtype], deterministic=bool(engine.options.deterministic),
        deterministic_why=engine.deterministic_why,
        num_requests=len(reqs), output_tokens=tokens,
        seconds=seconds,
        output_tokens_per_s=tokens / seconds, ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99), ttft_mean_s=statistics.fmean(ttfts),
        itl_p50_s=percentile(itl, 50), itl_p99_s=percentile(itl, 99),
        peak_kv_usage=peak_usage, kv_waste_at_peak=waste_at_peak,
        prefix_queries=m.prefix_cache_queries, prefix_hits=m.prefix_cache_hits,
        prefix_hit_rate=m.prefix_cache_hits / m.prefix_cache_queries if m.prefix_cache_queries else 0.0,
        preemptions=m.preemptions, kv_cache_blocks=m.kv_cache_blocks,
        max_running=max_running, max_decoding=max_decoding,
        work_flops=sum(generation_flops(model.spec, len(p), n) for p, n in reqs),
        ttft_first_s=ttfts[0], ttft_mean_after_first_s=statistics.fmean(after) if after else ttfts[0],
        decode_tokens_per_s=(tokens - 1) / (seconds - ttfts[0]) if single else None,
        prefill_seconds=phases.prefill_seconds, prefill_flops=phases.prefill_flops,
        decode_seconds=phases.decode_seconds, decode_flops=phases.decode_flops,
        decode_bytes=phases.decode_bytes, held_weight_bytes=sum(phases.weights), held_formats=held_formats(model),
        activations=model.activations,
        notes=["requests arrived one after another, each once the previous one had its first "
               "token"] if staggered and len(reqs) > 1 else [],
    )
    return result, outputs


def run_hf(model: CausalLM, work: Workload, batch_size: int,
           progress: Callable[[int, int], None] = lambda done, total: None) -> tuple[float, list[list[int]]]:
    """The same requests through transformers with the same weights: static batches of
    `batch_size`, left-padded, each batch generating until its longest request is done.
    Returns (useful output tokens/s, greedy outputs)."""
    import transformers

    try:  # transformers >= 5
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights

    cfg = {k: v for k, v in model.config.items() if k != "auto_map"}
    hf_cfg = transformers.AutoConfig.for_model(**cfg)
    with no_init_weights():  # every weight is kvlab's: random init would cost ~20 s for 0.5B on 2 cores
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=model.dtype)
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"transformers' model does not take kvlab's weights: {missing + unexpected}")
    hf.tie_weights()
    hf.eval()
    reqs = work.requests(model.spec.vocab_size)
    outputs: list[list[int]] = []
    useful = 0
    t0 = time.perf_counter()
    for start in range(0, len(reqs), batch_size):
        batch = reqs[start:start + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (p, _) in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        n_new = max(n for _, n in batch)
        with torch.inference_mode():
            gen = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new,
                              min_new_tokens=n_new, do_sample=False, pad_token_id=0,
                              eos_token_id=None)
        for i, (_, n) in enumerate(batch):
            outputs.append(gen[i, width:width + n].tolist())
            useful += n
        progress(min(start + batch_size, len(reqs)), len(reqs))
    return useful / (time.perf_counter() - t0), outputs


def layer_peak(layer: torch.nn.Module, dtype: torch.dtype, device: torch.device, rows: int,
               repeats: int = 3) -> float:
    """FLOP/s of one linear layer's forward (its method, as its model chose it) on ``rows``
    random input rows, at the current thread count, best of ``repeats`` after a warm-up."""
    x = torch.randn(rows, layer.in_features, dtype=dtype, device=device)
    best = float("inf")
    with torch.inference_mode():
        layer(x)  # warm-up: kernels, caches, thread pool
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            layer(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
    return 2 * rows * layer.in_features * layer.out_features / best


def matmul_peak(model: CausalLM, rows: int = 2048) -> float:
    """FLOP/s of this machine's best case for the model as it runs: its largest linear layer
    (the last of them, an MLP's down projection, which a model that packs weights packs) on
    ``rows`` rows through the method the model chose, so the figure is the activations mode's
    and the weights' own (kvlab's block kernel in fp32 or int8, oneDNN's packed copy, PyTorch's
    GEMM). A workload's FLOPs at this rate give the compute bound of its throughput."""
    linears = [m for m in model.modules() if isinstance(m, (Linear, QuantLinear)) and not isinstance(m, LMHead)]
    layer = max(reversed(linears), key=lambda m: m.in_features * m.out_features)
    return layer_peak(layer, model.dtype, model.device, rows)


# kernel_peak's matrix: the default model's format, square and large enough that 256 rows run
# at the kernel's steady rate (a prefill chunk's tiles, not the small-batch ones)
PEAK_FORMAT, PEAK_SIZE, PEAK_ROWS = "Q4_1", 2048, 256


def kernel_peak(activations: str) -> float:
    """FLOP/s of kvlab's linear kernel on this CPU in an activations mode (fp32 or int8): a
    random Q4_1 matrix held as stored, run as the engine's deterministic mode runs it (the
    native kernel at every row count where it runs, else the dequantised weight through
    PyTorch: what ``kvlab.dispatch`` decides here). The planner's CPU compute rate
    (``kvlab.hardware.kernel_flops`` caches it)."""
    fmt = FORMATS[PEAK_FORMAT]
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (PEAK_SIZE, fmt.row_bytes(PEAK_SIZE)), dtype=torch.uint8, generator=gen)
    # every block's two fp16 factors (d, m) a normal number: no NaN, no subnormal slow paths
    scales = blocks.view(PEAK_SIZE, -1, fmt.block_bytes)[:, :, :4]
    scales.copy_(torch.tensor([0.01, -0.05], dtype=torch.float16).view(torch.uint8).expand_as(scales))
    layer = QuantLinear(fmt, blocks, PEAK_SIZE)
    layer.choose(Setting(backends(), torch.float32, torch.device("cpu"), native_rows=sys.maxsize,
                         activations=activations))
    return layer_peak(layer, torch.float32, torch.device("cpu"), PEAK_ROWS)


def kernel_rate(activations: str) -> float:
    """``kernel_peak`` measured once per CPU, mode and switch setting (``kvlab.hardware.
    kernel_flops`` caches it): the rate a CPU plan computes at in that activations mode."""
    return kernel_flops(activations, lambda: kernel_peak(activations))


def add_compute_bound(result: BenchResult, model: CausalLM) -> None:
    """Fill the measured matmul peak, the throughput the workload's FLOPs allow at it, and the
    fraction of peak each phase reached: prefill and decode FLOP/s of the matmul peak, decode
    bytes/s of this machine's measured bandwidth (a model off the CPU has no measured bandwidth
    here, so its decode stays in FLOP/s)."""
    peak = result.matmul_peak_flops = matmul_peak(model)
    result.compute_bound_tokens_per_s = result.output_tokens * peak / result.work_flops
    if result.prefill_seconds:
        result.prefill_peak_fraction = result.prefill_flops / result.prefill_seconds / peak
    if result.decode_seconds:
        result.decode_peak_fraction = result.decode_flops / result.decode_seconds / peak
        if model.device.type == "cpu":
            result.memory_bandwidth = cpu_device().bandwidth
            result.decode_bandwidth_fraction = (result.decode_bytes / result.decode_seconds
                                                / result.memory_bandwidth)


def bandwidth_bound(model: CausalLM, context: int) -> float:
    """Tokens/s a single sequence could reach at `context` if every step only read the weights
    the model holds and its cache at this machine's measured bandwidth (`kvlab plan --gpu cpu`)."""
    from kvlab.plan import PlanRequest, make_plan

    dtype = MODEL_KV_DTYPE[model.dtype]
    plan = make_plan(model.spec, PlanRequest(context=context, users=1, kv_dtype=dtype, weights_dtype=dtype,
                                             gpu="cpu", held_weights=decode_weights(model)))
    return plan.decode_tokens_per_s
