"""Memory that stays flat: engine steps of ever new row counts (every prompt length once) must not
leave per-shape state behind (issue 18 saw bf16 RSS climb with traffic on a CPU whose oneDNN
caches a kernel per matmul shape). The 20-minute soak is benchmarks/soak.py's; this is its
quick form."""

from __future__ import annotations

import gc

from kvlab.engine.llm import LLM
from kvlab.models.loader import build_model, init_random_
from kvlab.sampling import SamplingParams
from kvlab.spec import spec_from_config
from tests.test_engine_parity import tiny_config


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def test_steps_of_new_row_counts_leave_rss_flat():
    cfg = tiny_config(hidden_size=256, intermediate_size=512, vocab_size=512, max_position_embeddings=1024)
    model = build_model(spec_from_config(cfg, "tiny"), "bf16", random_weights=True)
    init_random_(model, seed=0)
    llm = LLM(model, max_num_batched_tokens=1024, max_model_len=1024, prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def prompts_of(lengths: range) -> None:
        for n in lengths:  # one prompt per step: a step of n rows, then one of 1 row
            llm.generate([[(7 * i) % 512 for i in range(n)]], params)

    prompts_of(range(1, 64))  # warm-up: allocator pools, the first shapes
    gc.collect()
    before = rss_bytes()
    prompts_of(range(64, 304, 2))  # 120 row counts never seen before
    gc.collect()
    grown = rss_bytes() - before
    assert grown < 16 * 2**20, f"RSS grew {grown / 2**20:.1f} MiB over 120 new row counts"
