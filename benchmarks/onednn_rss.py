"""RSS over oneDNN bf16 matmuls of ever new row counts, the rows as they come or bucketed as kvlab
pads them (``kvlab.models.llama.onednn_rows``): oneDNN compiles and caches a kernel per shape.

    .venv/bin/python benchmarks/onednn_rss.py            # both, one 1536 x 576 packed weight

Needs a CPU where oneDNN has bf16 kernels (AVX-512 or AVX-NE-CONVERT); says so elsewhere.
"""

from __future__ import annotations

import random
import subprocess
import sys

import psutil
import torch

from kvlab import dispatch
from kvlab.models.llama import _onednn_linear, _onednn_pack, onednn_rows


def growth(bucketed: bool, calls: int = 1500) -> tuple[float, float]:
    """RSS (MiB) before and after ``calls`` matmuls of random row counts 65-2,048."""
    rss = psutil.Process().memory_info
    packed = _onednn_pack(torch.randn(1536, 576).bfloat16())
    rng = random.Random(0)
    before = rss().rss / 2**20
    with torch.inference_mode():
        for _ in range(calls):
            m = rng.randint(65, 2048)
            _onednn_linear(torch.randn(onednn_rows(m) if bucketed else m, 576).bfloat16(), packed, None)
    return before, rss().rss / 2**20


def main() -> None:
    if not dispatch.onednn_bf16():
        print(f"oneDNN bf16 does not run here: {dispatch.onednn_bf16().why}")
        return
    if len(sys.argv) > 1:  # one mode, in a process of its own (cached kernels would carry over)
        torch.set_num_threads(2)
        before, after = growth(sys.argv[1] == "bucketed")
        print(f"{sys.argv[1]:>12}: RSS {before:,.0f} -> {after:,.0f} MiB")
        return
    for mode in ("as-they-come", "bucketed"):
        subprocess.run([sys.executable, __file__, mode], check=True)


if __name__ == "__main__":
    main()
