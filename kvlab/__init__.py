"""kvlab: plan, run, measure and see the KV cache.

    from kvlab import LLM, SamplingParams

Imported lazily, so commands that need no torch (``kvlab plan``) stay fast.
"""

import ctypes
import importlib.util
import os
import sys
from pathlib import Path

__all__ = ["LLM", "SamplingParams"]


def _sleeping_openmp() -> None:
    """PyTorch's OpenMP threads (its own ops: the sampler's argmax over the vocabulary...) spin
    after each parallel region by default, on the very cores kvlab's kernel threads then need: a
    16-sequence decode step measured 5-12% faster with them asleep (docs/benchmarks.md). libgomp
    reads OMP_WAIT_POLICY once, when it loads: so torch's own libgomp is loaded here, with PASSIVE
    set for that moment only. The environment is left as it was: child processes (llama.cpp, an
    OpenMP program that needs its threads spinning) are not touched. A user's own
    OMP_WAIT_POLICY, or torch already imported, leaves everything alone."""
    if "OMP_WAIT_POLICY" in os.environ or "torch" in sys.modules:
        return
    spec = importlib.util.find_spec("torch")
    lib = Path(spec.origin).parent / "lib" / "libgomp.so.1" if spec and spec.origin else None
    if lib is None or not lib.exists():
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        ctypes.CDLL(str(lib))
    except OSError:
        pass  # torch then loads it itself, spinning as before
    finally:
        del os.environ["OMP_WAIT_POLICY"]


_sleeping_openmp()


def __getattr__(name: str):
    if name == "LLM":
        from kvlab.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvlab.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvlab' has no attribute {name!r}")
