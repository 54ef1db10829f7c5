"""kvlab: plan, run, measure and see the KV cache.

    from kvlab import LLM, SamplingParams

Imported lazily, so commands that need no torch (``kvlab plan``) stay fast.
"""

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from kvlab.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvlab.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvlab' has no attribute {name!r}")
