"""The same seeded workload as `kvlab bench`, through vLLM's CPU build: the performance peer.

vLLM is never a kvlab dependency; it lives in its own virtual environment (see
docs/benchmarks.md). This script imports only kvlab's torch-light pieces (the catalogue and
the workload generator), so it runs from that environment with the repository on PYTHONPATH:

    VLLM_CPU_OMP_THREADS_BIND=0-1 PYTHONPATH=. /path/to/vllm-venv/bin/python \\
        benchmarks/vllm_peer.py qwen2.5-0.5b --num-requests 64 --input-len 64:512 --output-len 32:256

Random weights (vLLM's load_format="dummy"), bf16, greedy, EOS ignored, every request
submitted at once: the workload `kvlab bench --random-weights` runs. Prints one JSON object
with ``output_tokens_per_s`` (output tokens over the wall time of ``LLM.generate``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from kvlab.bench import Workload, parse_range
from kvlab.catalog import load_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a kvlab catalogue name, e.g. qwen2.5-0.5b")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=parse_range, default=(64, 512))
    p.add_argument("--output-len", type=parse_range, default=(32, 256))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: kvlab's default CPU cache

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    config, _ = load_config(args.model)
    work = Workload(args.num_requests, args.input_len, args.output_len, seed=args.seed)
    reqs = work.requests(config["vocab_size"])
    with tempfile.TemporaryDirectory() as folder:  # vLLM wants a model folder: config only
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
        llm = LLM(model=folder, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                  max_model_len=args.input_len[1] + args.output_len[1],
                  seed=args.seed)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in reqs]
        params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True,
                                 detokenize=False) for _, n in reqs]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"engine": "vllm-cpu", "model": args.model, "num_requests": len(reqs),
                      "output_tokens": tokens, "seconds": seconds,
                      "output_tokens_per_s": tokens / seconds}))


if __name__ == "__main__":
    main()
