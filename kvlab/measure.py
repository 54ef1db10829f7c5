"""Verify the planner against real tensors and real allocations (the Vietnamese lesson's method).

Four measurements, each beside the planner's prediction:
1. count the cache tensors the runtime holds after a prefill;
2. the slope of allocated cache bytes over several contexts;
3. the extra memory a prefill allocates beyond the cache, with all-position logits vs the last
   one only, and the logits' share of it;
4. generation with vs without the cache: time ratio next to the work ratio.

Memory comes from the allocator's own counters: CUDA's statistics on a GPU, and on the CPU the
allocation events (with c10's running total) that the PyTorch profiler records.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvlab.generate import Generation, generate
from kvlab.models.attention import ContiguousKVCache
from kvlab.models.llama import CausalLM
from kvlab.plan import work_table
from kvlab.progress import Report, no_report
from kvlab.sampling import SamplingParams
from kvlab.dtypes import kv_dtype
from kvlab.spec import ModelSpec

_KV_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

# A model pass's cost in prompt tokens' worth of time, beyond one unit per token it computes:
# reading the weights once (on the bundled model a decode step takes about as long as a 16-token
# prefill chunk's share). Progress is counted in these units so that its estimate holds for
# prefills and decode steps alike.
PASS_UNITS = 16


def _pass_units(tokens: int) -> int:
    return tokens + PASS_UNITS


def _generation_units(prompt: int, new_tokens: int, use_cache: bool) -> int:
    """Progress units of a greedy generation: the prompt's pass, then one pass per new token
    after the first (one token each with the cache, the whole sequence without)."""
    rest = range(1, new_tokens)
    return _pass_units(prompt) + sum(_pass_units(1 if use_cache else prompt + i) for i in rest)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence the profiler's native start/stop log lines (written to fd 2 by C++)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def allocated_during(fn: Callable[[], Any], device: torch.device) -> tuple[int, int, Any]:
    """Run fn; return (peak bytes allocated above the start, bytes still allocated at the end
    above the start, fn's result), from the allocator's counters."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start, torch.cuda.memory_allocated(device) - start, result
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events: list[tuple[int, int, int]] = []

    def walk(nodes) -> None:
        for node in nodes:
            if node.tag.name == "Allocation":
                f = node.extra_fields
                if f.device.type == "cpu":
                    events.append((node.start_time_ns, f.alloc_size, f.total_allocated))
            walk(node.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    if not events:
        return 0, 0, result
    events.sort()
    base = events[0][2] - events[0][1]  # total before the first event
    peak = max(total for _, _, total in events) - base
    return peak, events[-1][2] - base, result


def _prompt(spec: ModelSpec, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.vocab_size, (n,), generator=g)


def _prefill(model: CausalLM, cache: ContiguousKVCache, ids: torch.Tensor, all_logits: bool) -> torch.Tensor:
    positions = cache.prepare(len(ids))
    last = None if all_logits else torch.tensor([len(ids) - 1], device=model.device)
    return model(ids.to(model.device), positions, cache, last)


@dataclass
class CacheCount:
    context: int
    tensors: int
    shapes: list[list[int]]  # distinct shapes
    dtype: str
    total_bytes: int
    counted_bytes_per_token: float
    formula_bytes: int
    formula_bytes_per_token: int
    # per layer type ("full", "sliding(512)"...): [tensors, counted bytes, formula bytes]
    by_kind: dict[str, list[int]]


def _kind(layer) -> str:
    return f"sliding({layer.window})" if layer.kind == "sliding" else layer.kind


@torch.inference_mode()
def count_cache(model: CausalLM, context: int) -> CacheCount:
    """1. The tensors the runtime keeps after prefilling `context` tokens, vs the formula."""
    spec = model.spec
    cache = ContiguousKVCache(spec, context, dtype=model.dtype, device=model.device)
    _prefill(model, cache, _prompt(spec, context), all_logits=False)
    tensors = cache.k + cache.v
    total = sum(t.numel() * t.element_size() for t in tensors)
    shapes = sorted({tuple(t.shape) for t in tensors})
    dtype = _KV_DTYPE_NAMES[model.dtype]
    by_kind: dict[str, list[int]] = {}
    for layer, k, v in zip(spec.layers, cache.k, cache.v):
        row = by_kind.setdefault(_kind(layer), [0, 0, 0])
        row[0] += 2
        row[1] += k.numel() * k.element_size() + v.numel() * v.element_size()
        row[2] += layer.kv_bytes_per_token(kv_dtype(dtype)) * layer.cached_tokens(context)
    return CacheCount(context, len(tensors), [list(s) for s in shapes], dtype, total, total / context,
                      spec.kv_bytes_per_sequence(context, dtype), spec.kv_bytes_per_token(dtype), by_kind)


@dataclass
class Slope:
    contexts: list[int]
    allocated_bytes: list[int]  # cache bytes still allocated after each prefill
    formula_bytes: list[int]
    slope_bytes_per_token: float
    formula_bytes_per_token: int
    deviation_percent: float
    # bytes per token between each context and the next, measured and by formula: where sliding
    # layers stop growing at their window, the growth bends there
    marginal_bytes_per_token: list[float]
    formula_marginal_bytes_per_token: list[float]


@torch.inference_mode()
def cache_slope(model: CausalLM, contexts: Sequence[int]) -> Slope:
    """2. Allocated cache bytes over several contexts; least-squares slope vs the formula."""
    spec = model.spec
    dtype = _KV_DTYPE_NAMES[model.dtype]
    measured = []
    for n in contexts:
        ids = _prompt(spec, n)

        def run(n: int = n, ids: torch.Tensor = ids) -> ContiguousKVCache:
            cache = ContiguousKVCache(spec, n, dtype=model.dtype, device=model.device)
            _prefill(model, cache, ids, all_logits=False)
            return cache

        _, kept, cache = allocated_during(run, model.device)
        measured.append(kept)
        del cache
    xs, ys = torch.tensor(contexts, dtype=torch.float64), torch.tensor(measured, dtype=torch.float64)
    slope = float(((xs - xs.mean()) * (ys - ys.mean())).sum() / ((xs - xs.mean()) ** 2).sum())
    formula = spec.kv_bytes_per_token(dtype)
    predicted = [spec.kv_bytes_per_sequence(n, dtype) for n in contexts]

    def marginal(ys: Sequence[int]) -> list[float]:
        return [(b - a) / (n1 - n0) for a, b, n0, n1 in zip(ys, ys[1:], contexts, contexts[1:])]

    return Slope(list(contexts), measured, predicted, slope, formula,
                 100 * (slope - formula) / formula if formula else 0.0, marginal(measured), marginal(predicted))


@dataclass
class PrefillMemory:
    context: int
    kv_bytes: int
    extra_all_positions: int  # peak bytes the forward pass allocates beyond the cache
    extra_last_only: int
    logits_bytes_all_positions: int
    logits_share_percent: float  # logits / extra, all-position pass
    logits_to_kv_ratio: float


@torch.inference_mode()
def prefill_memory(model: CausalLM, context: int) -> PrefillMemory:
    """3. Peak extra allocation of a prefill, naive (all logits) vs last position only."""
    spec = model.spec
    ids = _prompt(spec, context)
    extra = {}
    logits_bytes = 0
    for all_logits in (True, False):
        cache = ContiguousKVCache(spec, context, dtype=model.dtype, device=model.device)
        peak, _, logits = allocated_during(lambda c=cache, a=all_logits: _prefill(model, c, ids, a), model.device)
        extra[all_logits] = peak  # the cache was allocated before the probe: not counted
        kv = cache.kv_bytes
        # fp32 in every model dtype (kvlab's LM head); the lesson's transformers in bf16: half
        logits_bytes = max(logits_bytes, logits.numel() * logits.element_size())
        del logits, cache
    return PrefillMemory(context, kv, extra[True], extra[False], logits_bytes,
                         100 * logits_bytes / extra[True] if extra[True] else 0.0,
                         logits_bytes / kv if kv else 0.0)


@dataclass
class CacheVsNoCache:
    prompt: int
    new_tokens: int
    seconds_with_cache: float
    seconds_without_cache: float
    time_ratio: float
    tokens_with_cache: int
    tokens_without_cache: int
    work_ratio: float
    identical_tokens: int  # greedy tokens equal before the two runs first differ (bf16 ties)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


WARM_UP_TOKENS = 4


@torch.inference_mode()
def cache_vs_no_cache(model: CausalLM, prompt: int, new_tokens: Sequence[int],
                      progress: Callable[[int], None] = lambda units: None) -> list[CacheVsNoCache]:
    """4. Greedy generation of N tokens with and without the cache; ``progress(units)`` after
    each model pass (see ``_generation_units``)."""
    ids = _prompt(model.spec, prompt).tolist()
    # warm-up: one-time costs
    generate(model, ids, SamplingParams(max_tokens=WARM_UP_TOKENS, ignore_eos=True))
    progress(_generation_units(prompt, WARM_UP_TOKENS, True))
    rows = []
    for n, work in zip(new_tokens, work_table(model.spec, prompt, tuple(new_tokens))):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        timed = {}
        for use_cache in (True, False):
            gen = Generation(model, ids, params, use_cache=use_cache)
            for step, _ in enumerate(gen):  # its total_s leaves out the time spent here
                progress(_pass_units(prompt if step == 0 else 1 if use_cache else prompt + step))
            assert gen.result is not None
            timed[use_cache] = (gen.result, gen.result.total_s)
        (with_c, t_c), (without, t_n) = timed[True], timed[False]
        rows.append(CacheVsNoCache(prompt, n, t_c, t_n, t_n / t_c, work["tokens_with_cache"],
                                   work["tokens_without_cache"], work["work_ratio"],
                                   _common_prefix(with_c.token_ids, without.token_ids)))
    return rows


@dataclass
class Measurement:
    model: str
    dtype: str
    count: CacheCount
    slope: Slope
    prefill: PrefillMemory
    cache_vs_no_cache: list[CacheVsNoCache]

    def to_json(self) -> dict:
        out = asdict(self)
        out.update(formula_bytes_per_token=self.count.formula_bytes_per_token,
                   counted_bytes_per_token=self.count.counted_bytes_per_token,
                   slope_bytes_per_token=self.slope.slope_bytes_per_token)
        return out


def measure(model: CausalLM, contexts: Sequence[int], new_tokens: Sequence[int], prompt: int = 128,
            progress: Report = no_report) -> Measurement:
    """All four measurements, reporting progress in model-pass units (``PASS_UNITS``). Contexts
    beyond the model's maximum are an error."""
    limit = model.spec.max_position_embeddings
    if limit and max(contexts) > limit:
        raise ValueError(f"context {max(contexts)} exceeds the model's maximum of {limit}")
    if limit and prompt + max(new_tokens) > limit:
        raise ValueError(f"prompt {prompt} + {max(new_tokens)} new tokens exceeds the model's maximum of {limit}")
    longest = max(contexts)
    total = (3 * _pass_units(longest) + sum(map(_pass_units, contexts))
             + _generation_units(prompt, WARM_UP_TOKENS, True)
             + sum(_generation_units(prompt, n, c) for n in new_tokens for c in (True, False)))
    done = 0

    def stage(what: str, units: int = 0) -> None:
        nonlocal done
        done += units
        progress(done, total, what)
    stage(f"counting cache tensors after a {longest}-token prefill")
    count = count_cache(model, longest)
    stage(f"cache bytes over contexts {', '.join(map(str, contexts))}", _pass_units(longest))
    slope = cache_slope(model, contexts)
    stage(f"prefill memory at {longest} tokens, all logits vs last only", sum(map(_pass_units, contexts)))
    prefill = prefill_memory(model, longest)
    what = f"generation with vs without the cache, N = {', '.join(map(str, new_tokens))}"
    stage(what, 2 * _pass_units(longest))
    rows = cache_vs_no_cache(model, prompt, new_tokens, lambda units: stage(what, units))
    return Measurement(model.name, _KV_DTYPE_NAMES[model.dtype], count, slope, prefill, rows)
