"""kvlab's native kernels against PyTorch's ops on the bundled model's shapes, one table each:

- linear: weight GB/s and GFLOP/s of ``F.linear`` (MKL's sgemm) and ``kvlab.kernels.linear`` over
  1-512 rows, each weight a distinct tensor (as in a forward pass, so the weights come from memory);
- stored: ``kvlab.kernels.linear_q`` on a GGUF block format's random blocks (the bundled model's
  Q4_1 and Q8_0, its shapes), fp32 activations (exact) against int8 (``fmt | ACT8``), GFLOP/s over
  1-512 rows, the weights resident (one matrix, called again and again);
- decode attention: a decode step's attention over a batch of sequences (SmolLM2's 9 query / 3 KV
  heads of 64, Qwen2.5-1.5B's 12 / 2 of 128), PyTorch's path (gather the slots with
  ``index_select``, then SDPA) against ``kvlab.kernels.paged_attention`` reading the paged cache
  in place, and kvlab's as GB/s of K/V read (each cached byte once) against this machine's
  measured read bandwidth (``kvlab plan --gpu cpu``'s);
- attention-dram: the same kernel over 30 layers' distinct caches, each sequence's blocks
  interleaved as decode allocates them, so the K/V come from DRAM as in a real decode step.

    .venv/bin/python benchmarks/kernels.py --threads 2 [--tables linear,stored,attention,attention-dram]

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


def stored_table() -> None:
    from kvlab.models.weights import FORMATS

    print("\nstored blocks: GFLOP/s of linear_q, fp32 activations (exact) vs int8 activations")
    print(f"{'format':>6} {'weight':>12} {'rows':>5} {'fp32':>8} {'int8':>8} {'int8/fp32':>10}")
    g = torch.Generator().manual_seed(0)
    for name in ("Q4_1", "Q8_0"):
        fmt = FORMATS[name]
        for n, k in SHAPES:
            blocks = torch.randint(0, 256, (n, fmt.row_bytes(k)), dtype=torch.uint8, generator=g)
            scales = blocks.view(n, -1, fmt.block_bytes)[:, :, :2]  # d: a normal fp16 (Q4_1's m too, below)
            scales.copy_(torch.tensor([0.01], dtype=torch.float16).view(torch.uint8).expand_as(scales))
            for m in ROWS:
                x = torch.randn(m, k)
                calls = max(3, int(2e9 / (2 * m * n * k)))
                t32, t8 = (best_mean(lambda c=c: kernels.linear_q(x, blocks, c, None), calls)
                           for c in (fmt.code, fmt.code | kernels.ACT8))
                gf = 2 * m * n * k / 1e9
                print(f"{name:>6} {n:>6}x{k:<5} {m:>5} {gf / t32:8.1f} {gf / t8:8.1f} {t32 / t8:9.2f}x")


def attention_table() -> None:
    from kvlab.hardware import cpu_device

    bandwidth = cpu_device().bandwidth
    print(f"\ndecode attention, fp32 cache, blocks of 16 scattered over the pool: microseconds a layer; "
          f"kvlab's K/V read in GB/s (each byte once) of the measured {bandwidth / 1e9:.1f} GB/s; one "
          f"layer's cache called again and again, so a small one stays in L2/L3 (over 100%)")
    print(f"{'heads':>7} {'batch':>5} {'keys':>6} {'gather + SDPA':>14} {'kvlab':>8} {'speed-up':>9} {'kvlab GB/s':>11}")
    block = 16
    shapes = [((9, 3, 64), ((1, 256), (1, 2048), (1, 8192), (2, 16384), (16, 256), (16, 400), (16, 768), (64, 512))),
              ((12, 2, 128), ((1, 2048), (1, 8192), (16, 400), (16, 2048)))]  # SmolLM2, Qwen2.5-1.5B
    for (heads, kv, d), runs in shapes:
        for batch, length in runs:
            blocks = batch * length // block + 1
            k_cache, v_cache = torch.randn(kv, blocks, block, d), torch.randn(kv, blocks, block, d)
            # each sequence's keys in whole blocks scattered over the pool, as the engine's block tables lay them
            order = torch.randperm(blocks)[:batch * length // block].view(batch, -1)
            slots = (order[:, :, None] * block + torch.arange(block)).view(batch, length)
            lengths = torch.full((batch,), length)
            q = torch.randn(batch, heads, d)

            def gathered() -> torch.Tensor:
                keys = k_cache.view(kv, -1, d).index_select(1, slots.flatten()).view(kv, batch, length, d)
                vals = v_cache.view(kv, -1, d).index_select(1, slots.flatten()).view(kv, batch, length, d)
                return _sdpa(q[:, :, None], keys.transpose(0, 1), vals.transpose(0, 1), None)

            t_torch = best_mean(gathered, 20)
            t_own = best_mean(lambda: kernels.paged_attention(q, k_cache, v_cache, slots, lengths), 30)
            read = batch * length * kv * 2 * d * 4  # each cached K and V byte once
            print(f"{heads:>3}/{kv:<3} {batch:>5} {length:>6} {t_torch * 1e6:14.0f} {t_own * 1e6:8.0f} "
                  f"{t_torch / t_own:8.2f}x {read / t_own / 1e9:6.1f} ({read / t_own / bandwidth:.0%})")


def attention_dram_table() -> None:
    """A decode step's attention as the engine meets it: every layer's cache distinct (30 layers,
    SmolLM2's shapes), so each layer's K/V come from DRAM, and the sequences' blocks interleaved
    (each takes a block every 16 tokens; batch 1: one sequence's blocks in order)."""
    from kvlab.hardware import cpu_device

    bandwidth = cpu_device().bandwidth
    print(f"\ndecode attention over 30 layers' caches (9 / 3 heads of 64, fp32, blocks of 16 interleaved "
          f"as decode allocates them): microseconds a layer, GB/s of the measured {bandwidth / 1e9:.1f}")
    print(f"{'batch':>5} {'keys':>6} {'kvlab':>8} {'kvlab GB/s':>11}")
    kv, heads, d, block, layers = 3, 9, 64, 16, 30
    for batch, length in ((1, 8192), (2, 4096), (16, 1056)):
        blocks = batch * length // block
        order = torch.arange(blocks).view(-1, batch).t()  # block j of every sequence, then j + 1
        slots = (order[:, :, None] * block + torch.arange(block)).reshape(batch, length)
        caches = [(torch.randn(kv, blocks, block, d), torch.randn(kv, blocks, block, d)) for _ in range(layers)]
        lengths = torch.full((batch,), length)
        q = torch.randn(batch, heads, d)
        t = best_mean(lambda: [kernels.paged_attention(q, k, v, slots, lengths) for k, v in caches], 3) / layers
        read = batch * length * kv * 2 * d * 4
        print(f"{batch:>5} {length:>6} {t * 1e6:8.0f} {read / t / 1e9:6.1f} ({read / t / bandwidth:.0%})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tables", default="linear,attention",
                   help="which tables: linear, stored, attention, attention-dram (default linear,attention)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    here = dispatch.backends()  # also turns the AVX-512 loops on where they run
    if not here.native:
        raise SystemExit(f"kvlab's kernels do not run here: {here.native.why}")
    print(f"{args.threads} threads; {here.line()}")
    tables = {"linear": linear_table, "stored": stored_table, "attention": attention_table,
              "attention-dram": attention_dram_table}
    with torch.inference_mode():
        for name in args.tables.split(","):
            tables[name]()


if __name__ == "__main__":
    main()
