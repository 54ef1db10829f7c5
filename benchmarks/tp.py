"""Tensor parallelism on this machine (issue 14): each rank's memory beside the plan, and where a
step's time goes (the all-reduces against the rest). The figures in docs/benchmarks.md.

    .venv/bin/python benchmarks/tp.py memory                 # per-rank weights and KV cache
    .venv/bin/python benchmarks/tp.py allreduce --tp 2       # gloo all-reduce of one layer's output

Memory is counted from the tensors each rank holds (weights: its parameters and stored GGUF
blocks; cache: its block tensors), beside ``kvlab plan --tp N``'s kv_bytes_per_gpu for a context of as many tokens as the
pool. Speed comes from ``kvlab bench --tp N`` (see the docs for the command lines).
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONTEXT = 4096  # tokens each rank's pool holds


def memory() -> None:
    from kvlab.engine.llm import LLM
    from kvlab.models import load
    from kvlab.models.parallel import weight_bytes
    from kvlab.plan import PlanRequest, make_plan

    torch.set_num_threads(1)
    print(f"{'model':<14}{'tp':>3}  {'weights per rank (MiB)':<24}{'KV cache per rank (B)':<36}plan kv_bytes_per_gpu")
    for name, random, sizes in (("smollm2-135m", False, (1, 2, 3)), ("qwen2.5-0.5b", True, (1, 2))):
        model = load(name, "bf16", random_weights=random).model
        for tp in sizes:
            try:
                plan = make_plan(model.spec, PlanRequest(context=CONTEXT, kv_dtype="bf16", tp=tp))
            except ValueError as e:
                print(f"{name:<14}{tp:>3}  refused: {e}")
                continue
            llm = LLM(model, kv_memory=plan.kv_bytes_per_gpu, max_model_len=CONTEXT, tp=tp)
            ex = llm.engine.executor
            weights = getattr(ex, "rank_weight_bytes", [weight_bytes(model)])
            cache = getattr(ex, "rank_cache_bytes", [llm.engine.cache.nbytes if llm.engine.cache else 0])
            llm.close()
            print(f"{name:<14}{tp:>3}  {' / '.join(f'{w / 2**20:.1f}' for w in weights):<24}"
                  f"{' / '.join(f'{c:,}' for c in cache):<36}{plan.kv_bytes_per_gpu:,}")


def _allreduce_rank(rank: int, tp: int, port: int, rows: list[int], hidden: int, dtype: str,
                    repeats: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp,
                            timeout=timedelta(seconds=60))
    for n in rows:
        x = torch.randn(n, hidden, dtype=getattr(torch, dtype))
        for _ in range(10):
            dist.all_reduce(x)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(x)
        if rank == 0:
            out[n] = (time.perf_counter() - start) / repeats
    dist.destroy_process_group()


def allreduce(tp: int, hidden: int, dtype: str, repeats: int) -> None:
    """Time one all-reduce of [rows, hidden] (one row-parallel layer's output) over gloo."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rows = [1, 8, 64, 512]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_allreduce_rank, args=(tp, port, rows, hidden, dtype, repeats, out), nprocs=tp,
                           start_method="fork")
        for n in rows:
            print(f"all-reduce [{n:>3} x {hidden}] {dtype} over {tp} gloo ranks: {out[n] * 1e6:8.1f} us")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["memory", "allreduce"])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=896, help="qwen2.5-0.5b: 896; smollm2-135m: 576")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=200)
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    memory() if a.what == "memory" else allreduce(a.tp, a.hidden, a.dtype, a.repeats)
