"""kvlab: plan, run, measure and see the KV cache.

    from kvlab import LLM, SamplingParams

Imported lazily, so commands that need no torch (``kvlab plan``) stay fast.
"""

import os

__all__ = ["LLM", "SamplingParams"]

# PyTorch's OpenMP threads (its own ops: the sampler's argmax over the vocabulary...) spin after
# each parallel region by default, on the very cores kvlab's kernel threads then need: a
# 16-sequence decode step measured 5-12% faster with them asleep (docs/benchmarks.md). Only
# before torch is first imported, and never over the user's own setting.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def __getattr__(name: str):
    if name == "LLM":
        from kvlab.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvlab.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvlab' has no attribute {name!r}")
