"""OpenVINO GenAI's cache eviction on kvlab's retrieval prompts: issue 38's second eviction peer,
the one that frees blocks for real on a CPU.

OpenVINO GenAI is never a kvlab dependency; it lives in its own virtual environment (`bash
benchmarks/peers.sh openvino`). This script imports neither kvlab nor torch: the caller
(benchmarks/evict_peers.py) writes the prompts as token ids, kvlab's own, and scores the ids this
script returns with kvlab's tokenizer and `kvlab.ruler.Sample.score`:

    /work/peers/openvino/bin/python benchmarks/openvino_evict_peer.py MODEL.gguf requests.json \\
        --modes none,sum,norm_sum,kvcrush --budgets 256,512 --threads 2

The GGUF is read by OpenVINO's own reader; the CPU plugin runs fp32 (INFERENCE_PRECISION_HINT f32,
KV_CACHE_PRECISION f32, DYNAMIC_QUANTIZATION_GROUP_SIZE 0: no int8 activations), so the only
difference from kvlab's fp32 rows is the eviction. All prompts of a row go to one
`ContinuousBatchingPipeline.generate`, greedy, each stopping at its own length or EOS.

A mode is a `CacheEvictionConfig` at a budget: `max_cache_size` = the budget, OpenVINO's start
area of 32 tokens and recent area of 128 (the values its documentation uses; both whole blocks),
the evictable area between them scored by the attention the prompt's last `snapkv_window_size`
(8, its default) queries paid, then by every generated token's. OpenVINO evicts nothing during the
prefill: a sequence holds its whole prompt until its first generated token.

- `none`: no eviction (the harness check against kvlab's full cache);
- `sum`, `norm_sum`: `AggregationMode.SUM` / `NORM_SUM` (the sum divided by each token's lifetime);
- `kvcrush`: `sum` with KVCrush (arXiv 2503.00022) choosing half the evictable area's blocks as
  representatives of the rest (`KVCrushConfig(budget)`, in blocks; its anchor point RANDOM, seed 0).

Prints one JSON object: per mode and budget, the generated ids of every prompt and the seconds.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import openvino as ov
import openvino_genai as ov_genai

START, RECENT = 32, 128  # OpenVINO's documented start and recent areas, in tokens
BLOCK = 32  # the CPU plugin's KV block: start, recent and max_cache_size are multiples of it
FP32 = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}
MODES = ("none", "sum", "norm_sum", "kvcrush")


def eviction(mode: str, budget: int) -> ov_genai.CacheEvictionConfig:
    """The mode's config at `budget` tokens (a multiple of BLOCK above START + RECENT)."""
    if budget % BLOCK or budget <= START + RECENT:
        raise SystemExit(f"budget {budget}: OpenVINO needs a multiple of {BLOCK} above {START + RECENT}")
    aggregation = ov_genai.AggregationMode.NORM_SUM if mode == "norm_sum" else ov_genai.AggregationMode.SUM
    crush = None
    if mode == "kvcrush":
        crush = ov_genai.KVCrushConfig(max(1, (budget - START - RECENT) // BLOCK // 2),
                                       ov_genai.KVCrushAnchorPointMode.RANDOM, 0)
    return ov_genai.CacheEvictionConfig(START, RECENT, budget, aggregation, kvcrush_config=crush)


def greedy(n: int) -> ov_genai.GenerationConfig:
    c = ov_genai.GenerationConfig()
    c.max_new_tokens, c.do_sample = n, False
    return c


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("gguf")
    p.add_argument("requests", help="JSON list of {ids, max_tokens}")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--budgets", default="256,512", help="max_cache_size, tokens per sequence")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    requests = json.loads(open(args.requests).read())
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown mode {', '.join(unknown)}: choose from {', '.join(MODES)}")
    prompts = [ov.Tensor(np.array([r["ids"]], dtype=np.int64)) for r in requests]
    configs = [greedy(r["max_tokens"]) for r in requests]
    rows = []
    for mode in modes:
        for budget in [None] if mode == "none" else [int(b) for b in args.budgets.split(",")]:
            scheduler = ov_genai.SchedulerConfig()
            if budget is not None:
                scheduler.use_cache_eviction = True
                scheduler.cache_eviction_config = eviction(mode, budget)
            pipe = ov_genai.ContinuousBatchingPipeline(args.gguf, scheduler, "CPU",
                                                       {"INFERENCE_NUM_THREADS": args.threads, **FP32})
            t0 = time.perf_counter()
            outs = pipe.generate(prompts, configs)
            rows.append({"press": mode, "budget": budget, "seconds": time.perf_counter() - t0,
                         "outputs": [[int(t) for t in o.m_generation_ids[0]] for o in outs]})
            del pipe
    print(json.dumps({"openvino_genai": ov_genai.__version__, "threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
