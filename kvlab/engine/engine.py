"""LLMEngine: requests in, token deltas out. One ``step()`` = schedule, run the model, sample,
then hand each token to the request's ``OutputProcessor`` (``kvlab.engine.output``, the plain
loop's too), so greedy output is the same token for token and ends the same way."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kvlab import dispatch
from kvlab.data import PERSUASION
from kvlab.dispatch import AttentionShape
from kvlab.engine.executor import CacheConfig, Executor, make_executor
from kvlab.engine.kv_cache import CALIBRATION_TOKENS, PagedKVCache
from kvlab.engine.kv_manager import KVCacheManager
from kvlab.engine.output import OutputProcessor
from kvlab.engine.runner import ModelRunner
from kvlab.engine.scheduler import Scheduler, SchedulerOutput
from kvlab.engine.sequence import Sequence, SeqStatus
from kvlab.engine.tiers import DiskTier, RamTier, TierChain, TierStats, file_digest, fingerprint
from kvlab.eviction import EvictionPolicy, make_policy
from kvlab.hardware import default_disk_budget, system_memory
from kvlab.layout import KVCapacity, LayerGroup, kv_cache_capacity, layer_groups, memory_budget
from kvlab.models.llama import CausalLM
from kvlab.models.parallel import weight_bytes
from kvlab.models.tokenizer import TextTokenizer
from kvlab.options import EngineOptions
from kvlab.sampling import Sampler, SamplingParams, TokenLogprob, sample_batch, token_logprobs
from kvlab.units import fmt_bytes

log = logging.getLogger("kvlab.engine")

CPU_KV_MEMORY = 2**30  # default cache on CPU (vLLM's CPU backend also takes a fixed KV space)
MODEL_KV_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass
class RequestOutput:
    """A request's state after a step: what is new (`new_*`) and everything so far."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far (a final EOS included, as kvlab.generate reports)
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # stop | length | abort | error
    ttft_s: float | None  # from add_request to the first token
    num_cached_tokens: int  # prompt tokens served from the prefix cache (pool and tiers)
    num_preemptions: int
    tier_tokens: dict[str, int] = field(default_factory=dict)  # of those, each tier's ("ram", "disk")
    error: str | None = None  # why, when finish_reason is "error"
    # with params.logprobs: one per generated token so far (a list that grows with the request)
    logprobs: list[TokenLogprob] | None = None
    # with params.prompt_logprobs: one per prompt token, None for the first (nothing predicts it)
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class EngineMetrics:
    """Counters and gauges (the future server exports these)."""

    kv_cache_blocks: int  # blocks per layer group (the planner's figure)
    kv_cache_tokens: int
    max_concurrency: float
    kv_blocks_used: int  # summed over layer groups
    kv_blocks_cached: int  # free, but holding a cached prefix block (summed over groups)
    kv_blocks_total: int
    kv_usage: float  # used / total
    prefix_cache_queries: int  # prompt tokens looked up (first admissions)
    prefix_cache_hits: int  # of which served from the cache (pool and tiers)
    tier_hits: int  # of which loaded from a prefix tier behind the pool
    preemptions: int
    swapped_out_blocks: int
    swapped_in_blocks: int
    swap_fallbacks: int  # swap-outs the host pool could not take (disk full): recomputed instead
    evicted_blocks: int  # given back by the --kv-policy (per layer group's table)
    evicted_tokens: int
    kv_saturated_values: int  # fp8 cache: values beyond the format's range, clamped
    running: int
    waiting: int
    swapped: int
    tiers: list[TierStats] = field(default_factory=list)  # the prefix tiers behind the pool


@dataclass
class _Request:
    seq: Sequence
    params: SamplingParams
    sampler: Sampler
    output: OutputProcessor
    arrival: float
    ttft_s: float | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None


def kv_memory_for(options: EngineOptions, model: CausalLM, executor: Executor | None = None) -> int:
    """Bytes for the cache (of each rank, under tensor parallelism): --kv-memory, else the part of
    mem_util x device memory left after the weights (the executor's rank's), one step's
    activations and logits and the runtime (`memory_budget`, the planner's model), else (CPU) a
    fixed 1 GiB."""
    if options.kv_memory is not None:
        return options.kv_memory
    device = executor.device if executor is not None else model.device
    if options.mem_util is None and device.type == "cpu":
        return CPU_KV_MEMORY
    util = options.mem_util if options.mem_util is not None else 0.9
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = system_memory()
    weights = executor.weight_bytes if executor is not None else weight_bytes(model)
    # the planner's memory model, with this engine's step size and its fp32 logits
    kv = memory_budget(model.spec, total, util, weights, batched_tokens=options.max_num_batched_tokens,
                       sequences=options.max_num_seqs, on_gpu=device.type == "cuda",
                       elem_bytes=model.dtype.itemsize, logit_bytes=4).kv
    if kv <= 0:
        raise ValueError(f"mem_util {util} of {fmt_bytes(total)} leaves nothing for the KV cache "
                         f"after {fmt_bytes(weights)} of weights")
    return kv


def calibration_ids(tokenizer: TextTokenizer | None, vocab_size: int) -> list[int]:
    """The fixed text an fp8 cache's scales are set from: the opening of *Persuasion* through
    the model's tokenizer, or (no tokenizer) seeded random ids."""
    if tokenizer is not None:
        ids = tokenizer.encode(PERSUASION.read_text()[:4000])[:CALIBRATION_TOKENS]
        if ids and max(ids) < vocab_size:
            return ids
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (CALIBRATION_TOKENS,), generator=gen).tolist()


def deterministic_is_free(model: CausalLM, options: EngineOptions, kv_dtype: str,
                          groups: list[LayerGroup], eviction: EvictionPolicy) -> tuple[bool, str]:
    """``--deterministic``'s default for this model and these options: kvlab.dispatch's one rule
    (``deterministic_default``), given the layers' attention shapes. Returns (on, why)."""
    layers = [model.spec.layers[i] for g in groups for i in g.layers]
    return dispatch.deterministic_default(
        model.device.type, options.tp, eviction.name if eviction.active else None, model.dtype, kv_dtype,
        [AttentionShape(layer.num_heads, layer.kv_heads, layer.head_dim, layer.v_head_dim or layer.head_dim)
         for layer in layers])


class LLMEngine:
    """``device``: where tensor-parallel workers run (default: the model's device)."""

    def __init__(self, model: CausalLM, tokenizer: TextTokenizer | None = None,
                 options: EngineOptions = EngineOptions(), device: str | None = None) -> None:
        spec = model.spec
        limit = spec.max_position_embeddings
        max_model_len = options.max_model_len or limit
        if limit and max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                             f"max_position_embeddings {limit}")
        self.model, self.tokenizer, self.options = model, tokenizer, options
        self.max_model_len = max_model_len
        kv_dtype = MODEL_KV_DTYPE[model.dtype] if options.kv_dtype == "auto" else options.kv_dtype
        groups = layer_groups(spec)
        swap = options.preemption != "recompute"
        self.eviction = make_policy(options.kv_policy, options.kv_budget)
        # hybrid models (Gemma 3) evict on their full-attention layers: the sliding ones give
        # blocks back by their window already
        if self.eviction.active and all(g.window is not None for g in groups):
            raise ValueError(f"--kv-policy {self.eviction.name}: every layer of {spec.name} has a sliding "
                             f"window, which evicts by itself; use --kv-policy full")
        if self.eviction.needs_scores and options.tp > 1:
            raise ValueError(f"--kv-policy {self.eviction.name} reads attention scores, which tensor-"
                             f"parallel ranks hold in pieces: use --tp 1 or --kv-policy window/streaming")
        self.eviction.check_unit(options.block_size)
        if options.deterministic is None:
            on, why = deterministic_is_free(model, options, kv_dtype, groups, self.eviction)
            options = replace(options, deterministic=on)
            self.options, self.deterministic_why = options, f"auto: {why}"
        else:
            self.deterministic_why = "--deterministic" if options.deterministic else "--no-deterministic"
        if options.deterministic:
            self._check_deterministic(options)
        model.use(deterministic=bool(options.deterministic))
        self.executor: Executor = make_executor(model, options.tp, device, options.tp_timeout)
        try:
            self.capacity: KVCapacity = kv_cache_capacity(
                spec, kv_memory_for(options, model, self.executor), options.block_size, kv_dtype,
                max_model_len, options.tp)
            blocks = self.capacity.blocks
            if blocks == 0:
                raise ValueError(f"the KV memory buys no block: one block of {options.block_size} tokens "
                                 f"takes {fmt_bytes(options.block_size * self.capacity.bytes_per_token)}")
            # fp8 scales are fixed once, from the same text for every run
            nbytes = self.executor.init_cache(CacheConfig(
                groups, blocks, options.block_size, kv_dtype,
                None if not swap else "ram" if options.preemption == "swap-ram" else "disk",
                calibration_ids(tokenizer, spec.vocab_size) if kv_dtype.startswith("fp8") else []))
            if nbytes != self.capacity.bytes:
                raise RuntimeError(f"KV cache allocated {nbytes} B, sizing said {self.capacity.bytes} B")
        except BaseException:
            self.executor.close()  # no worker process outlives a failed start
            raise
        # the cache tensors, when they live in this process (tp=1)
        self.cache: PagedKVCache | None = self.executor.cache
        self.tiers = self._prefix_tiers(options, kv_dtype, groups)
        self.kv = KVCacheManager(groups, blocks, options.block_size, options.prefix_caching,
                                 num_host_blocks=blocks if swap else 0, tiers=self.tiers,
                                 read_blocks=self.executor.block_bytes)
        self.scheduler = Scheduler(self.kv, options.max_num_seqs, options.max_num_batched_tokens,
                                   max_model_len, swap, self.eviction,
                                   options.max_num_batched_tokens if options.deterministic else None)
        self.runner = ModelRunner(self.executor, spec.vocab_size, self.eviction, self.eviction.score_columns(
            len(spec.layers), max(layer.num_heads for layer in spec.layers)))
        self.requests: dict[str, _Request] = {}
        self._next_id = 0
        self.swap_fallbacks = 0
        c = self.capacity
        log.info("KV cache: %d blocks x %d tokens = %d tokens, %s (%s, %d layer group%s); "
                 "max concurrency at %d tokens: %.2fx", blocks, c.block_size, c.tokens,
                 fmt_bytes(c.bytes), c.kv_dtype, len(groups), "s" if len(groups) > 1 else "",
                 max_model_len, c.max_concurrency)
        if options.tp > 1:
            log.info("tensor parallel: %d ranks, each with this cache (its share of the KV heads)",
                     options.tp)
        log.info("deterministic mode: %s (%s)", "on" if options.deterministic else "off",
                 self.deterministic_why)

    def _prefix_tiers(self, options: EngineOptions, kv_dtype: str,
                      groups: list[LayerGroup]) -> TierChain | None:
        """The RAM and disk tiers behind the pool, as --kv-offload-* say (None: neither)."""
        if not options.offloads:
            return None
        ram = RamTier(options.kv_offload_ram) if options.kv_offload_ram else None
        disk = None
        if options.kv_offload_dir is not None:
            root = Path(options.kv_offload_dir)
            budget = options.kv_offload_disk or default_disk_budget(root)
            disk = DiskTier(root, budget, self._block_fingerprint(kv_dtype, groups, root))
        log.info("prefix tiers: %s", ", ".join(
            f"{t.stats.name} {fmt_bytes(t.stats.budget)}" + (f" in {t.root} ({fmt_bytes(t.stats.used)} "
                                                               f"there)" if isinstance(t, DiskTier) else "")
            for t in (ram, disk) if t is not None))
        return TierChain(ram, disk)

    def _block_fingerprint(self, kv_dtype: str, groups: list[LayerGroup], root: Path) -> bytes:
        """What shapes a block's bytes, hashed: the weights (their files' contents, hashed once
        and remembered in ``root``), the config, dtypes, block size, layer groups, the TP size
        (a tier block holds every rank's shard side by side), the fp8 scales and the kernels that
        compute K/V (their CPU paths, threads, deterministic mode)."""
        model = self.model
        source = model.source
        if source is None:
            raise ValueError("the --kv-offload-* tiers name blocks by the model's weights: load the "
                             "model with kvlab.models.load (or build_model) so its source is known")
        weights = file_digest(source.files, root / "digests.json") if source.files else source.random
        return fingerprint({
            "weights": weights, "stored": list(source.stored), "config": model.spec.config,
            "dtype": str(model.dtype), "kv_dtype": kv_dtype, "block_size": self.options.block_size,
            "groups": [[list(g.layers), g.window] for g in groups], "tp": self.options.tp,
            "fp8_scales": self.executor.kv_scales(),
            "cpu_paths": dispatch.backends().line(), "threads": torch.get_num_threads(),
            "deterministic": bool(self.options.deterministic)})

    def _check_deterministic(self, options: EngineOptions) -> None:
        """Deterministic mode's one-line errors for what cannot honour it (the kernels' own
        check runs in ``CausalLM.use``)."""
        if options.tp > 1:
            raise ValueError("--deterministic runs at --tp 1 (its kernels are not checked across "
                             "ranks); drop one of the two")
        if self.eviction.active and options.preemption == "recompute":
            raise ValueError(f"--deterministic with --kv-policy {self.eviction.name}: a recomputed "
                             f"sequence would evict again from scratch; use --preemption swap-ram")

    def close(self) -> None:
        """Write what the disk tier has queued; stop the tensor-parallel workers. The engine
        cannot step after."""
        if self.tiers is not None:
            self.tiers.close()
        self.executor.close()

    # --- requests -------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams = SamplingParams(),
                    request_id: str | None = None, cache_salt: str | None = None) -> str:
        """Queue a request; ValueError now (not later) if it can never run. All or nothing: every
        check runs before the scheduler takes the request, so a refused one leaves no trace."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(i) for i in prompt]
        vocab = self.model.spec.vocab_size
        if any(not 0 <= i < vocab for i in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if params.prompt_logprobs is not None:
            # every prompt position must go through the model to be scored: a salt of its own
            # keeps the prefix cache from serving any of them (vLLM skips the cache likewise)
            cache_salt = f"{cache_salt or ''}\0prompt-logprobs:{request_id}"
        seq = Sequence(request_id, ids, params.max_tokens, cache_salt)
        # a request also ends when it fills max_model_len (the scheduler admits up to that)
        output = OutputProcessor(params, ids, self.model.eos_token_ids, self.tokenizer,
                                 min(params.max_tokens, self.max_model_len - len(ids)))
        req = _Request(seq, params, Sampler(params, self.model.device), output, time.perf_counter())
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(ids)
        self.scheduler.add(seq)  # its admission check is the last one; nothing can fail after it
        self.requests[request_id] = req
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput:
        """Stop a request now; its blocks are freed (or cached) before this returns."""
        req = self.requests.pop(request_id)
        self.scheduler.finish(request_id)
        return self._output(req, [], "", "abort")

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # --- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One forward pass over the scheduled tokens; an output per request that got a token.

        A failure in one request's own work (sampling, detokenising, stop rules) ends that
        request with finish_reason "error" and leaves the batch alone; a failure of the step
        itself (the forward pass) raises."""
        out = self.scheduler.schedule()
        if not out.chunks and self.scheduler.has_unfinished():
            raise RuntimeError("the scheduler made no progress with requests pending")
        self._copy_blocks(out)
        scoring = [rid for rid, r in self.requests.items() if r.prompt_logprobs is not None]
        logits, prompt_rows = self.runner.execute(out, scoring)
        self._score_prompts(prompt_rows)
        seqs = [c.seq for c in out.chunks if c.samples]
        row = {s.request_id: i for i, s in enumerate(seqs)}
        tokens = self._sample(seqs, logits)
        outputs = [self._fail(self.requests[s.request_id], t) for s, t in zip(seqs, tokens)
                   if isinstance(t, Exception)]
        sampled = {s.request_id: t for s, t in zip(seqs, tokens) if isinstance(t, int)}
        out.chunks = [c for c in out.chunks if not c.samples or c.seq.request_id in sampled]
        self.scheduler.update(out, sampled)
        now = time.perf_counter()
        for rid, token in sampled.items():
            req = self.requests[rid]
            try:
                if req.params.logprobs is not None:
                    req.logprobs += token_logprobs(logits[row[rid]:row[rid] + 1], [token], req.params.logprobs)
                outputs.append(self._advance(req, token, now))
            except Exception as e:
                outputs.append(self._fail(req, e))
        return outputs

    def _copy_blocks(self, out: SchedulerOutput) -> None:
        """Run the step's swap copies. Swap-outs the host pool cannot take (the swap file's disk
        is full or turned read-only) become recomputes: those sequences keep their tokens and
        compute their K/V again, so nothing is lost but time."""
        try:
            self.executor.swap_out(out.swap_out)
        except OSError as e:
            victims = [s for s in out.preempted if s.status is SeqStatus.SWAPPED]
            for seq in victims:
                self.scheduler.recompute(seq)
            self.swap_fallbacks += len(victims)
            self.kv.swapped_out_blocks -= sum(map(len, out.swap_out))  # they never reached the host pool
            log.warning("swap-out failed (%s): %d preempted request(s) will recompute", e, len(victims))
        self.executor.swap_in(out.swap_in)
        for group, loads in enumerate(out.loads):  # prefix-tier hits, into their fresh blocks
            if loads:
                assert self.tiers is not None
                self.executor.put_block_bytes(group, [b for b, _ in loads], torch.stack([d for _, d in loads]))
                self.tiers.loaded(d for _, d in loads)

    def _score_prompts(self, rows: dict[str, tuple[int, torch.Tensor]]) -> None:
        """Prompt logprobs from the rows the runner computed for them (a chunked prefill brings
        them over several steps; a recompute after preemption brings the same ones again)."""
        for rid, (first, logits) in rows.items():
            req = self.requests[rid]
            assert req.prompt_logprobs is not None
            targets = req.seq.token_ids[first:first + len(logits)]
            scored = token_logprobs(logits, targets, req.params.prompt_logprobs or 0)
            req.prompt_logprobs[first:first + len(scored)] = scored

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int | Exception]:
        """One token per sequence, or the exception its own draw raised."""
        return sample_batch(logits, [self.requests[s.request_id].sampler for s in seqs])

    def _fail(self, req: _Request, error: Exception) -> RequestOutput:
        """End a request whose own work raised; its blocks are freed like an abort's."""
        rid = req.seq.request_id
        log.error("request %s failed: %s: %s", rid, type(error).__name__, error)
        self.requests.pop(rid, None)
        if rid in self.scheduler.requests:
            self.scheduler.finish(rid)
        out = self._output(req, [], "", "error")
        out.error = f"{type(error).__name__}: {error}"
        return out

    def _advance(self, req: _Request, token: int, now: float) -> RequestOutput:
        """Hand the token to the request's output processor; a finished request lets go."""
        if req.ttft_s is None:
            req.ttft_s = now - req.arrival
        delta = req.output.add(token)
        if req.output.finished:
            del self.requests[req.seq.request_id]
            self.scheduler.finish(req.seq.request_id)
        return self._output(req, [token], delta, req.output.finish_reason)

    def _output(self, req: _Request, new: list[int], delta: str, finish: str | None) -> RequestOutput:
        seq = req.seq
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens],
            token_ids=seq.output_ids, text=req.output.text, new_token_ids=new, new_text=delta,
            finished=finish is not None, finish_reason=finish, ttft_s=req.ttft_s,
            num_cached_tokens=seq.num_cached_tokens, num_preemptions=seq.num_preemptions,
            tier_tokens=dict(seq.tier_tokens),
            logprobs=req.logprobs if req.params.logprobs is not None else None,
            prompt_logprobs=req.prompt_logprobs)

    # --- figures --------------------------------------------------------------------------------
    def longest_request(self) -> int:
        """The most tokens (prompt + output) one request can reach alone in the cache:
        max_model_len, or less when the cache is smaller. Asked of the admission check itself,
        so it holds whatever the block size, windows or eviction policy."""
        def admitted(total: int) -> bool:
            try:  # a prompt of total - 1 tokens and one new token: total positions in all
                self.scheduler.check(Sequence("\0longest-request-probe", [0] * (total - 1), 1))
                return True
            except ValueError:
                return False

        lo, hi = 1, self.max_model_len  # lo: known to fit (one token always does if a block exists)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if admitted(mid) else (lo, mid - 1)
        return lo

    def metrics(self) -> EngineMetrics:
        c, kv, s = self.capacity, self.kv, self.scheduler
        return EngineMetrics(
            kv_cache_blocks=c.blocks, kv_cache_tokens=c.tokens, max_concurrency=c.max_concurrency,
            kv_blocks_used=kv.num_used_blocks, kv_blocks_total=kv.num_blocks * len(kv.pools),
            kv_blocks_cached=sum(pool.num_cached for pool in kv.pools),
            kv_usage=kv.usage, prefix_cache_queries=s.prefix_queries,
            prefix_cache_hits=s.prefix_hits, tier_hits=s.tier_hits, preemptions=s.num_preemptions,
            swapped_out_blocks=kv.swapped_out_blocks, swapped_in_blocks=kv.swapped_in_blocks,
            swap_fallbacks=self.swap_fallbacks, evicted_blocks=s.num_evicted_blocks,
            evicted_tokens=s.num_evicted_tokens, kv_saturated_values=self.executor.saturated,
            running=len(s.running), waiting=s.num_waiting,
            swapped=s.num_swapped, tiers=[replace(t.stats) for t in self.tiers.tiers] if self.tiers else [])
