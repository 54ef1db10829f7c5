"""Where a batch-1 decode step of the paged engine spends its time, by torch op: the
PyTorch profiler's self CPU time of every op over the decode steps of one request, summed
into groups (matrix multiplies, attention, the cache's reads and writes, the rest).

    .venv/bin/python benchmarks/decode_ops.py --input-len 128 --output-len 64 --threads 2

The prefill step is left out (it runs before the profiler starts). Self time is the op's own,
not its children's; the Python between ops is what the steps' wall time has beyond the ops'
sum ("outside torch ops"). docs/benchmarks.md quotes it beside the side-by-side table.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from kvlab.bench import Workload
from kvlab.engine.engine import LLMEngine
from kvlab.options import EngineOptions
from kvlab.models import load
from kvlab.sampling import SamplingParams

# op name -> group; anything else is "other ops" (norms, RoPE, SiLU, adds, copies, sampling...,
# kvlab's row-wise kernels among them)
GROUPS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
               "mkldnn::_linear_pointwise", "kvlab::linear", "kvlab::linear_q"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention",
                  "aten::_softmax", "aten::softmax", "kvlab::paged_attention"),
    "cache reads and writes": ("aten::index_select", "aten::index_put_", "aten::index_copy_", "aten::index",
                               "kvlab::store_kv"),
    # kvlab.kernels.decoder_layers: the layers's matmuls, attention and small ops in one native call
    "whole native layers": ("kvlab::decoder_layers",),
}


def group_of(name: str) -> str:
    return next((g for g, ops in GROUPS.items() if name in ops), "other ops")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None, help="default: smollm2-135m")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--deterministic", action="store_true", help="the batch-invariant kernels")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load(args.model, args.dtype)
    engine = LLMEngine(loaded.model, None, EngineOptions(deterministic=args.deterministic))
    (prompt, _), = Workload(1, (args.input_len,) * 2, (1, 1)).requests(loaded.model.spec.vocab_size)
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True))
    with torch.inference_mode():
        engine.step()  # the prefill, outside the profile
        steps = 0
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
                steps += 1
            wall = time.perf_counter() - start
    spent: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        spent[group_of(e.key)] += e.self_cpu_time_total / 1e6
    spent["outside torch ops"] = max(0.0, wall - sum(spent.values()))
    print(f"{loaded.model.name}, {loaded.dtype}, {args.threads} threads, "
          f"{'deterministic, ' if args.deterministic else ''}{steps} decode steps after a "
          f"{args.input_len}-token prompt: {wall / steps * 1000:.1f} ms a step (profiled)")
    for name, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:24s} {seconds / steps * 1000:7.2f} ms  {seconds / wall:6.1%}")
    print("top ops by self CPU time:")
    for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]:
        print(f"  {e.key:48s} {e.self_cpu_time_total / 1e3 / steps:7.2f} ms a step, {e.count // steps} calls")


if __name__ == "__main__":
    main()
