"""Prometheus metrics: the engine's cache state read at scrape time, latencies observed per token.

Gauges and counters that the engine already keeps (KV usage, prefix-cache queries and hits,
preemptions, swaps, queue lengths) are not copied into prometheus objects on every step; a custom
collector reads one ``EngineGauges`` snapshot when /metrics is scraped, so the numbers are exactly
the engine's. Latencies exist only at the server (when a token reached the client's stream), so
those are histograms the bridge observes. Each app gets its own registry: several servers in one
process (tests) never clash.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvlab.engine.tiers import TierStats

PREFIX = "kvlab"
# Buckets in seconds: CPU runs of tiny models are milliseconds, a real model's prefill seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True)
class EngineGauges:
    """What the engine reports about its cache and queues at one instant."""

    num_blocks: int
    used_blocks: int
    cached_blocks: int  # free but still holding a findable prefix
    block_size: int
    prefix_queries_tokens: int  # cumulative: prompt tokens looked up in the prefix cache
    prefix_hits_tokens: int  # cumulative: of those, found
    preemptions: int  # cumulative
    swapped_out_blocks: int  # cumulative
    swapped_in_blocks: int  # cumulative
    swap_fallbacks: int  # cumulative: swap-outs the swap file could not take, recomputed instead
    evicted_blocks: int  # cumulative: given back by the --kv-policy
    evicted_tokens: int  # cumulative
    running: int
    waiting: int
    swapped: int
    external_queries_tokens: int = 0  # cumulative: prompt tokens the pool missed, asked of the tiers
    external_hits_tokens: int = 0  # cumulative: of those, loaded from a tier
    tiers: tuple[TierStats, ...] = ()  # the prefix tiers behind the pool (RAM, disk)

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def hit_rate(self) -> float:
        q = self.prefix_queries_tokens
        return self.prefix_hits_tokens / q if q else 0.0


class _EngineCollector(Collector):
    def __init__(self, read: Callable[[], EngineGauges]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        g = self.read()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)

        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks held by requests (0-1).", g.usage)
        yield gauge("kv_cache_blocks", "KV blocks in the pool.", g.num_blocks)
        yield gauge("kv_cache_used_blocks", "KV blocks referenced by requests.", g.used_blocks)
        yield gauge("kv_cache_cached_blocks", "Free KV blocks still holding a cached prefix.", g.cached_blocks)
        yield gauge("num_requests_running", "Requests holding KV blocks.", g.running)
        yield gauge("num_requests_waiting", "Requests waiting for admission (or recompute).", g.waiting)
        yield gauge("num_requests_swapped", "Requests whose KV blocks are swapped out.", g.swapped)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      g.prefix_queries_tokens)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", g.prefix_hits_tokens)
        yield counter("num_preemptions", "Requests preempted for lack of KV blocks.", g.preemptions)
        yield counter("swapped_out_blocks", "KV blocks copied out to the host pool.", g.swapped_out_blocks)
        yield counter("swapped_in_blocks", "KV blocks copied back from the host pool.", g.swapped_in_blocks)
        yield counter("swap_fallbacks", "Preempted requests recomputed because the swap file could not "
                      "be written (disk full, read-only).", g.swap_fallbacks)
        yield counter("evicted_blocks", "KV blocks given back by the token eviction policy (--kv-policy).",
                      g.evicted_blocks)
        yield counter("evicted_tokens", "Cached tokens evicted by the token eviction policy.", g.evicted_tokens)
        if not g.tiers:
            return
        # vLLM's names for a prefix cache beyond the pool (a KV connector's), in tokens
        yield counter("external_prefix_cache_queries", "Prompt tokens the pool missed, looked up in the "
                      "--kv-offload-* tiers.", g.external_queries_tokens)
        yield counter("external_prefix_cache_hits", "Prompt tokens loaded from a --kv-offload-* tier.",
                      g.external_hits_tokens)
        per_tier = [
            ("kv_offload_hits_blocks", "Blocks a prefix tier gave to a look-up.", "hits", CounterMetricFamily),
            ("kv_offload_misses_blocks", "Blocks asked of a prefix tier and not found (or unreadable).",
             "misses", CounterMetricFamily),
            ("kv_offload_store_blocks", "Blocks a prefix tier took in.", "stored", CounterMetricFamily),
            ("kv_offload_load_bytes", "Bytes read out of a prefix tier.", "bytes_read", CounterMetricFamily),
            ("kv_offload_store_bytes", "Bytes written into a prefix tier.", "bytes_written", CounterMetricFamily),
            ("kv_offload_load_seconds", "Seconds spent reading blocks out of a prefix tier.", "load_seconds",
             CounterMetricFamily),
            ("kv_offload_bad_files", "Disk-tier files dropped as corrupt, truncated or foreign.", "bad",
             CounterMetricFamily),
            ("kv_offload_used_bytes", "Bytes a prefix tier holds.", "used", GaugeMetricFamily),
            ("kv_offload_budget_bytes", "Bytes a prefix tier may hold.", "budget", GaugeMetricFamily),
            ("kv_offload_blocks", "Blocks a prefix tier holds.", "blocks", GaugeMetricFamily),
        ]
        for name, doc, attr, family in per_tier:
            metric = family(f"{PREFIX}_{name}", doc, labels=["tier"])
            for tier in g.tiers:
                metric.add_metric([tier.name], getattr(tier, attr))
            yield metric


class ServerMetrics:
    """The registry of one server and the latency histograms its bridge feeds."""

    def __init__(self, read_engine: Callable[[], EngineGauges], model: dict[str, str]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(read_engine))
        # what runs: kvlab_model_info{dtype=..., activations=..., deterministic=...} 1
        Info(f"{PREFIX}_model", "The served model's dtype, matmul inputs (--activations) and mode.",
             registry=self.registry).info(model)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Request arrival to its first token.",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Time between two tokens of a request.",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Request arrival to its last token.",
                             buckets=TTFT_BUCKETS, registry=self.registry)
        self.requests = Counter(f"{PREFIX}_requests", "Finished requests by reason.", ["finish_reason"],
                                registry=self.registry)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=self.registry)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated.",
                                         registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
