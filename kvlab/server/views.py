"""What the page's planner, crossover, step-through, eviction and live cache views show, computed
by kvlab's own code.

The page only draws: every number comes from ``kvlab.plan.make_plan``, from running
``kvlab.generate.Generation`` on the served model or from the serving engine's own block pools
and sequences, shaped here into what one view needs, so the browser holds no formula of its own
and the page cannot drift from `kvlab plan` / `kvlab generate` / the engine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, replace

import torch

from kvlab.catalog import BUNDLED, OPTIONAL, find, load_spec
from kvlab.engine.engine import MODEL_KV_DTYPE, LLMEngine
from kvlab.eviction import POLICIES, make_policy
from kvlab.generate import Generation
from kvlab.models import CausalLM
from kvlab.models.attention import EvictingKVCache
from kvlab.models.tokenizer import TextTokenizer
from kvlab.plan import Plan, PlanRequest, make_plan
from kvlab.plan.eviction import measured_rows
from kvlab.sampling import SamplingParams, TokenLogprob
from kvlab.server.errors import APIError
from kvlab.spec import ModelSpec, spec_from_config

MAX_SWEEP_BATCH = 1 << 16
MAX_SWEEP_CONTEXT = 1 << 24
RUNNERS_UP = 3  # alternatives the step-through shows beside each chosen token


def resolve_spec(model: str | None, config: dict | None) -> ModelSpec:
    """A catalogue or bundled model by name (read as the CLI reads it: a bundled GGUF file's
    metadata, a catalogue config.json), or a pasted config.json. Never a path: the page is a web
    client, and a path would let it probe the server's files."""
    if config is not None:
        return spec_from_config(config, str(config.get("_name_or_path") or "pasted config.json"))
    if not model:
        raise APIError("give a catalogue model or paste a config.json", param="model")
    if model.strip().lower() not in BUNDLED.keys() | OPTIONAL.keys() and find(model) is None:
        raise APIError(f"unknown catalogue model {model!r}", 404, "not_found_error", "model",
                       "model_not_found")
    return load_spec(model.strip())


CpuCompute = tuple[str, float]  # (activations mode, kvlab's kernel FLOP/s in it): a CPU plan's rate


def _plan(spec: ModelSpec, context: int, users: int, kv_dtype: str, weights_dtype: str, gpu: str,
          gpus: int = 1, tp: int | None = None, cpu_compute: CpuCompute | None = None) -> Plan:
    """make_plan (a CPU plan at ``cpu_compute``'s rate, as `kvlab plan --gpu cpu` plans), its
    ValueErrors as 400s."""
    mode, rate = cpu_compute if cpu_compute and gpu.lower() == "cpu" else ("fp32", None)
    try:
        return make_plan(spec, PlanRequest(context=context, users=users, kv_dtype=kv_dtype,
                                           weights_dtype=weights_dtype, gpu=gpu, gpus=gpus, tp=tp,
                                           activations=mode, kernel_flops=rate))
    except ValueError as e:
        raise APIError(str(e)) from None


def plan_view(spec: ModelSpec, context: int, users: int, kv_dtype: str, weights_dtype: str,
              gpu: str, gpus: int = 1, tp: int | None = None, cpu_compute: CpuCompute | None = None) -> dict:
    """The plan on `gpus` GPUs (TP `tp`, default all of them), plus one GPU's memory bar: its
    share of the weights (the planner's, not computed again here), the cache of the sequences it
    holds, logits, activations and runtime."""
    p = _plan(spec, context, users, kv_dtype, weights_dtype, gpu, gpus, tp, cpu_compute)
    overhead = p.logits_bytes_last_only + p.activation_allowance_bytes + p.runtime_overhead_bytes
    weights = p.weights_bytes_per_gpu
    on_one = "" if p.gpus == 1 else " on this GPU"
    segments: list[dict] = [
        {"key": "weights", "label": "weights" + ("" if p.tp == 1 else f" (1/{p.tp}, TP {p.tp})"), "bytes": weights},
        {"key": "kv", "label": f"KV cache{on_one} ({users} x {context:,} tokens in all)",
         "bytes": p.kv_bytes_batch_per_gpu},
        {"key": "overhead", "label": "logits, activations & runtime", "bytes": overhead},
    ]
    need = sum(s["bytes"] for s in segments)
    return {
        "plan": p.to_json(),
        "memory": {"segments": segments, "total_bytes": need, "gpu_bytes": p.gpu_memory_bytes,
                   "usable_bytes": p.usable_bytes_per_gpu, "fits": p.max_sequences >= users},
        "gpus": p.gpus, "tp": p.tp,
        "gpus_cache_only": p.gpus_needed_cache_only,
        "gpus_everything": p.gpus_needed,  # None: more than the planner searches (4096)
        "max_users": p.max_sequences,
    }


def _step(p: Plan) -> dict:
    """A decode step's reads (weights, cache), its compute, and the step: the longer of them."""
    return {"weights_s": p.decode_weights_seconds, "kv_s": p.decode_kv_seconds,
            "compute_s": p.decode_compute_seconds, "step_s": p.decode_step_seconds}


def _powers(top: int, start: int = 1) -> list[int]:
    out, x = [], start
    while x < top:
        out.append(x)
        x *= 2
    return out + [top]


def crossover_view(spec: ModelSpec, context: int, batch: int, kv_dtype: str, weights_dtype: str,
                   gpu: str, cpu_compute: CpuCompute | None = None) -> dict:
    """Decode step time (the longer of weight + cache reads and compute) over batch at this
    context and over context at this batch, with where the cache reads overtake the weight reads
    on each axis and the batch from which the step is compute-bound."""
    def plan(c: int, b: int) -> Plan:
        return _plan(spec, c, b, kv_dtype, weights_dtype, gpu, cpu_compute=cpu_compute)

    here = plan(context, batch)
    cross_b = here.crossover_batch
    top_b = min(MAX_SWEEP_BATCH, max(4 * batch, 2 * (cross_b or 1), 64))
    batches = sorted(set(_powers(top_b)) | {batch} | ({cross_b} if cross_b and cross_b <= top_b else set()))
    by_batch = [{"batch": b, **_step(plan(context, b))} for b in batches]

    def kv_wins(c: int) -> bool:
        p = plan(c, batch)
        return p.decode_kv_seconds >= p.decode_weights_seconds

    top_c = min(MAX_SWEEP_CONTEXT, max(4 * context, spec.max_position_embeddings or 0, 4096))
    cross_c = None
    if kv_wins(top_c):  # cache reads grow with context (until a window saturates): bisect
        lo, hi = 0, top_c
        while lo + 1 < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if kv_wins(mid) else (mid, hi)
        cross_c = hi
    contexts = sorted(set(_powers(top_c, 256)) | {context} | ({cross_c} if cross_c else set()))
    by_context = [{"context": c, **_step(plan(c, batch))} for c in contexts]
    return {"model": spec.name, "gpu": here.gpu, "context": context, "batch": batch, "point": _step(here),
            "tokens_per_s": here.decode_tokens_per_s, "crossover_batch": cross_b,
            "compute_bound_batch": here.compute_bound_batch,
            "crossover_context": cross_c, "by_batch": by_batch, "by_context": by_context,
            "max_batch_in_memory": here.max_sequences, "source": here.sources["decode_step"]}


def _token(tokenizer: TextTokenizer, token_id: int) -> dict:
    return {"id": token_id, "text": tokenizer.decode([token_id])}


def _choice(tokenizer: TextTokenizer, lp: TokenLogprob) -> dict:
    """The chosen token's probability and the most likely tokens at its step (raw logits)."""
    return {"p": math.exp(lp.logprob), "rank": lp.rank,
            "top": [{**_token(tokenizer, t), "p": math.exp(v)} for t, v in lp.top]}


def _run(model: CausalLM, prompt: Sequence[int], params: SamplingParams,
         use_cache: bool) -> tuple[list[int], list[dict], list[TokenLogprob | None]]:
    """Generate and record, per step, which positions went through the model and which K/V came
    from the cache. With a cache the figures are read off the real ContiguousKVCache (its length
    before and after the step); without one every step feeds the whole sequence so far."""
    gen = Generation(model, prompt, params, use_cache=use_cache)
    tokens: list[int] = []
    steps: list[dict] = []
    logprobs: list[TokenLogprob | None] = []
    done = 0  # positions whose K/V the cache held before this step
    processed = 0
    t = time.perf_counter()
    for delta in gen:
        now = time.perf_counter()
        assert delta.token_id is not None
        if use_cache:
            assert gen.cache is not None
            start, end = done, gen.cache.length
            done = end
        else:
            start, end = 0, len(prompt) + len(tokens)
        processed += end - start
        steps.append({"computed": [start, end], "read_from_cache": start, "processed_total": processed,
                      "seconds": now - t})
        logprobs.append(delta.logprob)
        tokens.append(delta.token_id)
        t = time.perf_counter()
    return tokens, steps, logprobs


def step_through(model: CausalLM, tokenizer: TextTokenizer, prompt: str, max_tokens: int,
                 model_id: str) -> dict:
    """Greedy generation on the served model twice, with and without the KV cache, step by step,
    with each chosen token's probability and runners-up. A one-token run first pays the one-time
    costs (buffers, kernel choice) so that step 1, the same prefill in both runs, times alike."""
    ids = tokenizer.encode(prompt)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=RUNNERS_UP)
    try:
        _run(model, ids, replace(params, max_tokens=1), use_cache=True)
        cached, with_cache, choices = _run(model, ids, params, use_cache=True)
        recomputed, without, _ = _run(model, ids, params, use_cache=False)
    except ValueError as e:  # check_length: prompt + max_tokens beyond the model's context
        raise APIError(str(e), param="prompt", code="context_length_exceeded") from None
    steps = [{"step": i, "token": _token(tokenizer, tok), "choice": _choice(tokenizer, lp), "cache": a,
              "no_cache": b}
             for i, (tok, lp, a, b) in enumerate(zip(cached, choices, with_cache, without, strict=False))]
    return {
        "model": model_id, "prompt": [_token(tokenizer, i) for i in ids], "steps": steps,
        "same_tokens": cached == recomputed,
        "no_cache_tokens": [_token(tokenizer, i) for i in recomputed],
        "totals": {"cache": with_cache[-1]["processed_total"], "no_cache": without[-1]["processed_total"]},
        "formula": {"cache": "P + N - 1", "no_cache": "N x P + N (N - 1) / 2",
                    "expected_cache": len(ids) + len(cached) - 1,
                    "expected_no_cache": len(cached) * len(ids) + len(cached) * (len(cached) - 1) // 2},
        "ratio": without[-1]["processed_total"] / max(1, with_cache[-1]["processed_total"]),
    }



MAX_EVICT_PROMPT = 512  # tokens the eviction view runs five times (once per policy)


@torch.inference_mode()
def eviction_view(model: CausalLM, tokenizer: TextTokenizer, prompt: str, budget: int, sinks: int = 4,
                  chunk: int = 16) -> dict:
    """The prompt through each eviction policy, token by token (``EvictingKVCache``, chunks of
    ``chunk`` tokens as the engine's steps): which tokens each keeps and why (sink, heavy hitter,
    recent window), the attention mass h2o, snapkv and adakv chose by, and the bytes kept."""
    ids = tokenizer.encode(prompt)
    if len(ids) > MAX_EVICT_PROMPT:
        raise APIError(f"the prompt is {len(ids)} tokens; the eviction view takes {MAX_EVICT_PROMPT} at most",
                       param="prompt")
    try:
        policies = [make_policy(name, budget, sinks=sinks) for name in POLICIES]
        for p in policies:
            p.check_unit(1)
    except ValueError as e:
        raise APIError(str(e), param="budget") from None
    per_token = model.spec.kv_bytes_per_token(MODEL_KV_DTYPE.get(model.dtype, "bf16"))
    out = []
    for policy in policies:
        cache = EvictingKVCache(model.spec, policy, policy.max_tokens_held(len(ids), len(ids), chunk, 1),
                                len(ids), model.dtype, model.device)
        for a in range(0, len(ids), chunk):
            piece = torch.tensor(ids[a:a + chunk], device=model.device)
            model(piece, cache.prepare(len(piece)), cache, torch.tensor([len(piece) - 1], device=model.device))
            cache.evict()
        kept = set(cache.positions[:cache.held].tolist())
        n = len(ids)
        sink_units, recent = policy.split(n, 1)
        recent_from = n - recent
        roles = []
        for i in range(n):
            if i not in kept:
                roles.append("evicted")
            elif not policy.active:
                roles.append("kept")
            elif i < sink_units:
                roles.append("sink")
            elif i >= recent_from:
                roles.append("recent")
            else:
                roles.append("heavy")
        mass = None
        if policy.needs_scores:
            scores = cache.scores[:n]
            scores = (scores.amax(dim=1) if scores.dim() == 2 else scores).double()  # adakv: its best head
            mass = (scores / scores.max().clamp(min=1)).tolist()
        out.append({"policy": policy.name, "kept": len(kept), "roles": roles, "mass": mass,
                    "kv_bytes_kept": len(kept) * per_token, "kv_bytes_full": n * per_token})
    # the frontier as kvlab evict measured it on real models of this family (kvlab plan quotes it too)
    measured = [{**asdict(r), "ratio": r.ratio} for r in measured_rows() if r.model_type == model.spec.model_type]
    return {"tokens": [_token(tokenizer, i) for i in ids], "budget": budget, "sinks": sinks,
            "chunk": chunk, "policies": out, "measured": measured}


def block_map(engine: LLMEngine) -> dict:
    """A snapshot of the engine's block pools for drawing: per layer group one letter per block
    (f free, u held by one request, s shared by several (a common prefix stored once), c free but
    cached), and each request's blocks. One string per group keeps a pool of tens of thousands of
    blocks to a few KB. Read it on the engine's thread, between two steps."""
    kv = engine.kv
    groups = []
    for group, pool in zip(kv.groups, kv.pools, strict=True):
        states = ["s" if r > 1 else "u" if r else "f" for r in pool.ref_cnt]
        for b in pool.cached_ids():
            states[b] = "c"
        name = "full attention" if group.window is None else f"sliding window {group.window}"
        groups.append({"name": name, "layers": len(group.layers), "window": group.window,
                       "blocks": "".join(states)})
    requests = [{"id": rid, "status": seq.status.value, "num_tokens": seq.num_tokens,
                 "num_prompt_tokens": seq.num_prompt_tokens,
                 "num_cached_tokens": seq.num_cached_tokens,
                 "blocks": [[b for b in t if b >= 0] for t in seq.block_tables]}
                for rid, seq in engine.scheduler.requests.items()]
    return {"block_size": kv.block_size, "num_blocks": kv.num_blocks, "groups": groups,
            "requests": requests}
