"""The same seeded workload as `kvlab bench`, through vLLM's CPU build: the performance peer.

vLLM is never a kvlab dependency; it lives in its own virtual environment (see
docs/benchmarks.md). This script imports only kvlab's torch-light pieces (the catalogue and
the workload generator), so it runs from that environment with the repository on PYTHONPATH:

    VLLM_CPU_OMP_THREADS_BIND=0-1 PYTHONPATH=. /path/to/vllm-venv/bin/python \\
        benchmarks/vllm_peer.py qwen2.5-0.5b --num-requests 64 --input-len 64:512 --output-len 32:256

A catalogue name runs with random weights (vLLM's load_format="dummy"), the workload `kvlab
bench --random-weights` runs; a checkpoint folder (config.json + safetensors, e.g. the bundled
GGUF converted by benchmarks/side_by_side.py) runs its real weights. Greedy, EOS ignored, every
request submitted at once, in --dtype (default bf16). Prints one JSON object with
``output_tokens_per_s`` (output tokens over the wall time of ``LLM.generate``); for a single
request also ``ttft_s`` (a one-token run of another prompt of the same length, timed before the
real one, so the prefix cache cannot serve it) and ``decode_tokens_per_s``, as `kvlab bench`
reports them.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from kvlab.bench import Workload, parse_range
from kvlab.catalog import load_config

VLLM_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}  # kvlab's names: vLLM's


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a kvlab catalogue name (random weights), e.g. qwen2.5-0.5b, or a "
                   "checkpoint folder with safetensors (its weights)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=parse_range, default=(64, 512))
    p.add_argument("--output-len", type=parse_range, default=(32, 256))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(VLLM_DTYPES), default="bf16", help="model dtype (default bf16)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: the longest request; runs with one value share vLLM's compile cache")
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: kvlab's default CPU cache

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    config, _ = load_config(args.model)
    work = Workload(args.num_requests, args.input_len, args.output_len, seed=args.seed)
    reqs = work.requests(config["vocab_size"])

    def run(llm: LLM, requests: list[tuple[list[int], int]]) -> tuple[float, list]:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in requests]
        params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True,
                                 detokenize=False) for _, n in requests]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0, outs

    real = os.path.isdir(args.model) and any(f.endswith(".safetensors") for f in os.listdir(args.model))
    with tempfile.TemporaryDirectory() as folder:  # vLLM wants a model folder: config only
        if not real:
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump(config, f)
        llm = LLM(model=args.model if real else folder, load_format="auto" if real else "dummy",
                  dtype=VLLM_DTYPES[args.dtype], skip_tokenizer_init=True,
                  max_model_len=args.max_model_len or args.input_len[1] + args.output_len[1],
                  seed=args.seed)
        single = {}
        if len(reqs) == 1:
            other = Workload(1, (len(reqs[0][0]),) * 2, (1, 1), seed=args.seed + 1).requests(config["vocab_size"])
            single["ttft_s"], _ = run(llm, other)
        seconds, outs = run(llm, reqs)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if single:
        single["decode_tokens_per_s"] = (tokens - 1) / (seconds - single["ttft_s"])
    print(json.dumps({"engine": "vllm-cpu", "model": args.model, "dtype": args.dtype,
                      "weights": "real" if real else "random", "num_requests": len(reqs),
                      "output_tokens": tokens, "seconds": seconds,
                      "output_tokens_per_s": tokens / seconds, **single}))

if __name__ == "__main__":
    main()
