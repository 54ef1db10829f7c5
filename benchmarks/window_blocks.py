"""Blocks a sequence holds in each layer group of the paged engine as it grows: the sliding
layers' table stops growing at the window, the full layers' keeps growing.

    .venv/bin/python benchmarks/window_blocks.py gemma3-270m [--prompt 2048] [--new-tokens 64]

One request (a seeded random prompt) through ``LLM`` with prefill chunks of ``--chunk`` tokens;
after every step, the tokens cached so far and the blocks held per group. Prints the rows where
either count changed, at most every ``--every`` tokens, then the engine's pool beside
``kvlab plan``'s for the same budget, as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from kvlab.catalog import load_spec
    from kvlab.engine.llm import LLM
    from kvlab.plan import PlanRequest, make_plan
    from kvlab.sampling import SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-memory", type=int, default=64 * 2**20)
    ap.add_argument("--every", type=int, default=256)
    args = ap.parse_args()

    max_len = args.prompt + args.new_tokens
    llm = LLM(args.model, kv_memory=args.kv_memory, block_size=args.block_size, max_model_len=max_len,
              max_num_batched_tokens=args.chunk)
    engine = llm.engine
    groups = [f"{g.kind}({g.window})" if g.window else g.kind for g in engine.kv.groups]
    ids = torch.randint(236, 20000, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request(ids, SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True))
    rows, last = [], None
    while engine.has_unfinished():
        engine.step()
        for s in engine.scheduler.running:
            held = [sum(b >= 0 for b in table) for table in s.block_tables]
            cached = s.num_computed_tokens
            if last is None or (held != last[1] and cached - last[0] >= args.every) or not engine.has_unfinished():
                rows.append({"tokens_cached": cached, **dict(zip(groups, held))})
                last = (cached, held)
    plan = make_plan(load_spec(args.model), PlanRequest(context=max_len, kv_memory=args.kv_memory,
                                                        block_size=args.block_size))
    cap = llm.capacity
    print(json.dumps({"model": args.model, "groups": groups, "rows": rows,
                      "engine": {"blocks": cap.blocks, "tokens": cap.tokens, "bytes": cap.bytes,
                                 "max_concurrency": cap.max_concurrency},
                      "plan": {"blocks": plan.kv_cache_blocks, "tokens": plan.kv_cache_tokens,
                               "max_concurrency": plan.max_concurrency}}, indent=1))


if __name__ == "__main__":
    main()
