"""Every choice kvlab makes because of the CPU it runs on, each behind one switch read here.

Three fast paths exist only on some x86 CPUs:

- ``KVLAB_KERNELS``: kvlab's native C kernels (``kvlab.kernels``), which need AVX2, FMA and a C
  compiler;
- ``KVLAB_ONEDNN_BF16``: oneDNN's packed bf16 matmul, which PyTorch runs only on CPUs with
  AVX-512 or AVX-NE-CONVERT bf16 support (a probe decides);
- ``KVLAB_AVX512``: the native kernels' AVX-512 loops for weights in GGUF block formats, which
  give the AVX2 loops' results bit for bit (two weight rows per register, each the same chain).

A switch set to ``off`` (also ``0``, ``no``, ``false``) makes every kvlab decision take the
branch a CPU without the feature takes, so every branch can be run, and tested, on a machine
that has the feature (``scripts/test_dispatch.sh`` runs the CPU-sensitive tests once per
setting). Nothing else in kvlab reads these variables or probes the CPU for these features.
PyTorch's own choices stay PyTorch's: with ``KVLAB_ONEDNN_BF16=off`` its plain bf16 matmul
still runs on oneDNN where oneDNN can; ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` takes
an AVX2 CPU's branches there too (the script's last setting on an AVX-512 CPU).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

SWITCHES = {
    "KVLAB_KERNELS": "kvlab's native C kernels (AVX2 + FMA, built with the system's C compiler)",
    "KVLAB_ONEDNN_BF16": "oneDNN's packed bf16 matmul (CPUs with AVX-512 or AVX-NE-CONVERT bf16)",
    "KVLAB_AVX512": "the native kernels' AVX-512 loops for GGUF block formats (bitwise the AVX2 ones)",
}
_OFF = ("off", "0", "no", "false")


@dataclass(frozen=True)
class Feature:
    """A CPU-dependent path: whether it runs here, and why (or why not) in a few words."""

    switch: str  # the environment variable that turns it off
    on: bool
    why: str

    def __bool__(self) -> bool:
        return self.on


def switched_off(switch: str) -> bool:
    """Has the user turned this path off (``SWITCH=off``)?"""
    assert switch in SWITCHES, switch
    return os.environ.get(switch, "on").strip().lower() in _OFF


@functools.cache
def onednn_bf16() -> Feature:
    """Does oneDNN pack and multiply bf16 weights here? One probe per process (it needs torch,
    imported only now so the planner never pays for it)."""
    if switched_off("KVLAB_ONEDNN_BF16"):
        return Feature("KVLAB_ONEDNN_BF16", False, "KVLAB_ONEDNN_BF16=off")
    import torch

    if not torch.backends.mkldnn.is_available():
        return Feature("KVLAB_ONEDNN_BF16", False, "this PyTorch build has no oneDNN")
    try:
        probe = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 16, dtype=torch.bfloat16), probe, None,
                                           "none", [], "")
    except (AttributeError, RuntimeError):  # older builds lack the ops; CPUs without bf16 kernels
        return Feature("KVLAB_ONEDNN_BF16", False, "this CPU has no oneDNN bf16 kernels "
                                                   "(AVX-512 or AVX-NE-CONVERT)")
    return Feature("KVLAB_ONEDNN_BF16", True, "this CPU has oneDNN's bf16 kernels")


def native_kernels() -> Feature:
    """Do kvlab's native kernels run here (building them on first use)?"""
    from kvlab import kernels

    status = kernels.status()
    why = "KVLAB_KERNELS=off" if switched_off("KVLAB_KERNELS") else status.detail
    return Feature("KVLAB_KERNELS", status.available, why)


def avx512_kernels() -> Feature:
    """Do the native kernels take their AVX-512 loops here (the CPU says, through the library)?"""
    from kvlab import kernels

    if switched_off("KVLAB_AVX512"):
        return Feature("KVLAB_AVX512", False, "KVLAB_AVX512=off")
    if not kernels.status().available:
        return Feature("KVLAB_AVX512", False, "the native kernels do not run here")
    if not kernels.avx512():
        return Feature("KVLAB_AVX512", False, "this CPU lacks AVX-512 F and DQ")
    return Feature("KVLAB_AVX512", True, "this CPU has AVX-512 F and DQ")


def report() -> list[Feature]:
    """Every CPU-dependent path and its state here, for start-up lines and ``python -m
    kvlab.kernels``."""
    return [native_kernels(), avx512_kernels(), onednn_bf16()]
