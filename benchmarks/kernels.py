"""kvlab's native kernels against PyTorch's ops on the bundled model's shapes, one table each:

- linear: weight GB/s and GFLOP/s of ``F.linear`` (MKL's sgemm) and ``kvlab.kernels.linear`` over
  1-512 rows, each weight a distinct tensor (as in a forward pass, so the weights come from memory);
- decode attention: a decode step's attention over a batch of sequences, PyTorch's path (gather the
  slots with ``index_select``, then SDPA) against ``kvlab.kernels.paged_attention`` reading the
  paged cache in place.

    .venv/bin/python benchmarks/kernels.py --threads 2

docs/benchmarks.md ("#11 native kernels") quotes it. Timings are best-of-3 means; the machine's
noise is several percent, so compare columns of one run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvlab import dispatch, kernels
from kvlab.models.attention import _sdpa

SHAPES = [(1536, 576), (576, 1536), (576, 576), (49152, 576)]  # gate/up, down, q/o, the LM head
ROWS = [1, 2, 4, 16, 64, 128, 512]


def best_mean(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call: the best of 3 rounds of ``calls`` calls, after one to warm up."""
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def linear_table() -> None:
    print("linear: weight GB/s (GFLOP/s), MKL's sgemm vs kvlab's kernel")
    print(f"{'weight':>12} {'rows':>5} {'MKL':>16} {'kvlab':>16} {'speed-up':>9}")
    for n, k in SHAPES:
        weights = [torch.randn(n, k) for _ in range(max(2, 300_000_000 // (n * k * 4)))]
        for m in ROWS:
            x = torch.randn(m, k)
            # every weight once per call, so each one comes from memory, not the cache
            t_mkl = best_mean(lambda: [F.linear(x, w) for w in weights], 1) / len(weights)
            t_own = best_mean(lambda: [kernels.linear(x, w, None) for w in weights], 1) / len(weights)
            gb, gf = n * k * 4 / 1e9, 2 * m * n * k / 1e9
            print(f"{n:>6}x{k:<5} {m:>5} {gb / t_mkl:6.1f} ({gf / t_mkl:6.1f}) {gb / t_own:6.1f} ({gf / t_own:6.1f})"
                  f" {t_mkl / t_own:8.2f}x")


def attention_table() -> None:
    print("\ndecode attention (9 query / 3 KV heads, head_dim 64, fp32 cache): microseconds a layer")
    print(f"{'batch':>5} {'keys':>6} {'gather + SDPA':>14} {'kvlab':>8} {'speed-up':>9}")
    kv, heads, d, block = 3, 9, 64, 16
    for batch, length in ((1, 256), (1, 2048), (16, 256), (16, 768)):
        blocks = batch * length // block + 1
        k_cache, v_cache = torch.randn(kv, blocks, block, d), torch.randn(kv, blocks, block, d)
        slots = torch.randperm(blocks * block)[:batch * length].view(batch, length)
        lengths = torch.full((batch,), length)
        q = torch.randn(batch, heads, d)

        def gathered() -> torch.Tensor:
            keys = k_cache.view(kv, -1, d).index_select(1, slots.flatten()).view(kv, batch, length, d)
            vals = v_cache.view(kv, -1, d).index_select(1, slots.flatten()).view(kv, batch, length, d)
            return _sdpa(q[:, :, None], keys.transpose(0, 1), vals.transpose(0, 1), None)

        t_torch = best_mean(gathered, 50)
        t_own = best_mean(lambda: kernels.paged_attention(q, k_cache, v_cache, slots, lengths), 50)
        print(f"{batch:>5} {length:>6} {t_torch * 1e6:14.0f} {t_own * 1e6:8.0f} {t_torch / t_own:8.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    here = dispatch.backends()  # also turns the AVX-512 loops on where they run
    if not here.native:
        raise SystemExit(f"kvlab's kernels do not run here: {here.native.why}")
    print(f"{args.threads} threads; {here.line()}")
    with torch.inference_mode():
        linear_table()
        attention_table()


if __name__ == "__main__":
    main()
