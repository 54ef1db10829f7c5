"""Every choice kvlab makes because of the CPU it runs on, each behind one switch read here, and
the one rule that sets ``--deterministic``'s default.

The fast paths that exist only on some x86 CPUs:

- ``KVLAB_KERNELS``: kvlab's native C kernels (``kvlab.kernels``), which need AVX2, FMA and a C
  compiler;
- ``KVLAB_ONEDNN_BF16``: oneDNN's packed bf16 matmul, which PyTorch runs only on CPUs with
  AVX-512 or AVX-NE-CONVERT bf16 support (a probe decides);
- ``KVLAB_AVX512``: the native kernels' AVX-512 loops for weights in GGUF block formats, which
  give the AVX2 loops' results bit for bit (two weight rows per register, each the same chain);
- ``KVLAB_VNNI`` and ``KVLAB_AVX_VNNI``: ``--activations int8``'s dot products by vpdpbusd in
  AVX512-VNNI's encoding (taken first) or AVX-VNNI's, instead of AVX2's vpmaddubsw + vpmaddwd:
  the same integer sums, so the same bits.

A switch set to ``off`` (also ``0``, ``no``, ``false``) makes every kvlab decision take the
branch a CPU without the feature takes, so every branch can be run, and tested, on a machine
that has the feature (``scripts/test_dispatch.sh`` runs the CPU-sensitive tests once per
setting). Nothing else in kvlab reads these variables or probes the CPU for these features:
``backends()`` decides once per process, and a model takes its layers' implementations from it
(``CausalLM.use``); ``Backends.line()`` is the one report of what it decided and why.
PyTorch's own choices stay PyTorch's: with ``KVLAB_ONEDNN_BF16=off`` its plain bf16 matmul
still runs on oneDNN where oneDNN can; ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` takes
an AVX2 CPU's branches there too (the script's last setting on an AVX-512 CPU).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads only when a model does: the planner never pays for it
    import torch

SWITCHES = {
    "KVLAB_KERNELS": "kvlab's native C kernels (AVX2 + FMA, built with the system's C compiler)",
    "KVLAB_ONEDNN_BF16": "oneDNN's packed bf16 matmul (CPUs with AVX-512 or AVX-NE-CONVERT bf16)",
    "KVLAB_AVX512": "the native kernels' AVX-512 loops for GGUF block formats (bitwise the AVX2 ones)",
    "KVLAB_VNNI": "the int8 activations' dot products by AVX512-VNNI, BW and VL (bitwise the AVX2 ones)",
    "KVLAB_AVX_VNNI": "the int8 activations' dot products by AVX-VNNI where AVX512-VNNI is not taken",
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
    if switched_off("KVLAB_KERNELS"):
        return Feature("KVLAB_KERNELS", False, "KVLAB_KERNELS=off")
    from kvlab import kernels

    status = kernels.status()
    return Feature("KVLAB_KERNELS", status.available, status.detail)


def avx512_kernels() -> Feature:
    """Do the native kernels take their AVX-512 loops here (the CPU says, through the library)?
    The answer is applied: the library runs the loops it says."""
    if not native_kernels():
        return Feature("KVLAB_AVX512", False, "the native kernels do not run here")
    from kvlab import kernels

    if switched_off("KVLAB_AVX512"):
        kernels.set_avx512(False)
        return Feature("KVLAB_AVX512", False, "KVLAB_AVX512=off")
    if not kernels.set_avx512(True):
        return Feature("KVLAB_AVX512", False, "this CPU lacks AVX-512 F and DQ")
    return Feature("KVLAB_AVX512", True, "this CPU has AVX-512 F and DQ")


def vnni_kernels() -> tuple[Feature, Feature]:
    """Which VNNI encoding the int8 activations' dot products take here (AVX512-VNNI's first,
    then AVX-VNNI's, else AVX2's), applied as ``avx512_kernels``. A feature is on where the CPU
    has it and its switch allows it, so turning either off leaves the other to run."""
    if not native_kernels():
        return (Feature("KVLAB_VNNI", False, "the native kernels do not run here"),
                Feature("KVLAB_AVX_VNNI", False, "the native kernels do not run here"))
    from kvlab import kernels

    has = kernels.status().vnni
    features = []
    for switch, encoding, name in (("KVLAB_VNNI", "avx512", "AVX512-VNNI, BW and VL"),
                                   ("KVLAB_AVX_VNNI", "avx", "AVX-VNNI")):
        if switched_off(switch):
            features.append(Feature(switch, False, f"{switch}=off"))
        elif encoding not in has:
            features.append(Feature(switch, False, f"this CPU lacks {name}"))
        else:
            features.append(Feature(switch, True, f"this CPU has {name}"))
    on = [encoding for f, encoding in zip(features, ("avx512", "avx")) if f.on]
    kernels.set_vnni(on[0] if on else None)
    return features[0], features[1]


@dataclass(frozen=True)
class Backends:
    """What runs here, decided once per process (``backends()``): the models' layers, the
    engine's attention and the reports all read it, none probes again."""

    native: Feature  # kvlab's C kernels (KVLAB_KERNELS)
    avx512: Feature  # their AVX-512 loops for block formats (KVLAB_AVX512)
    onednn_bf16: Feature  # oneDNN's packed bf16 matmul (KVLAB_ONEDNN_BF16)
    vnni: Feature  # the int8 activations' dot products by AVX512-VNNI (KVLAB_VNNI)
    avx_vnni: Feature  # ... by AVX-VNNI where AVX512-VNNI is not taken (KVLAB_AVX_VNNI)

    def features(self) -> list[Feature]:
        return [self.native, self.avx512, self.onednn_bf16, self.vnni, self.avx_vnni]

    def line(self) -> str:
        """The one report: every switch, on or off, and why."""
        return "; ".join(f"{f.switch} {'on' if f else 'off'} ({f.why})" for f in self.features())

    def native_rows(self, dtype: torch.dtype) -> int:
        """Rows up to which the native linear kernel runs by default (0: it does not run):
        fp32 up to ``kernels.MAX_ROWS`` (MKL's blocked GEMM wins above); bf16 always, unless
        oneDNN has bf16 kernels here (its packed weights are then the measured path)."""
        import torch

        from kvlab import kernels

        if not self.native or dtype not in (torch.float32, torch.bfloat16):
            return 0
        if dtype == torch.bfloat16 and not self.onednn_bf16:
            return sys.maxsize
        return kernels.MAX_ROWS

    def linear_kernel(self, dtype: torch.dtype, deterministic: bool, activations: str = "fp32") -> str:
        """One line for reports: which kernel runs a model's linear layers in this dtype."""
        import torch

        if dtype not in (torch.float32, torch.bfloat16):
            return "PyTorch's matmul (the native kernel takes fp32 and bf16)"
        if not self.native:
            return f"PyTorch's matmul: {self.native.why}"
        if activations == "int8":
            isa = "AVX512-VNNI" if self.vnni else "AVX-VNNI" if self.avx_vnni else "AVX2"
            return f"kvlab's int8 kernel ({isa}) for the stored layers at every row count"
        rows = sys.maxsize if deterministic else self.native_rows(dtype)
        if rows == sys.maxsize:
            return "kvlab's AVX2 kernel for every row count"
        if dtype == torch.bfloat16:  # the engine packs bf16 weights where oneDNN has bf16 kernels
            return (f"oneDNN's packed bf16 matmul in the paged engine; elsewhere kvlab's AVX2 kernel "
                    f"for up to {rows} rows, oneDNN above")
        return f"kvlab's AVX2 kernel for up to {rows} rows, MKL's sgemm above"


@functools.cache
def backends() -> Backends:
    """This process's decision (the switches are read once: tests that flip one clear this
    cache, as a fresh process would read it)."""
    return Backends(native_kernels(), avx512_kernels(), onednn_bf16(), *vnni_kernels())


def report() -> list[Feature]:
    """Every CPU-dependent path and its state here, for start-up lines and ``python -m
    kvlab.kernels``."""
    return backends().features()


@dataclass(frozen=True)
class AttentionShape:
    """What the native attention kernel must take of one layer: its query heads, KV heads and
    head sizes."""

    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int


def deterministic_default(device: str, tp: int, evicting: str | None, dtype: torch.dtype, kv_dtype: str,
                          layers: Sequence[AttentionShape]) -> tuple[bool, str]:
    """``--deterministic``'s default, by one rule on every CPU: on where the batch-invariant path
    costs nothing measurable, that is an fp32 model on one CPU process where kvlab's native
    kernels run every linear layer and every attention (an fp32 or bf16 cache, head sizes they
    take: docs/benchmarks.md measures the two modes level there). bf16 runs are deterministic
    only on request: the invariant path's bf16 matmuls are the native kernel's at every row
    count, which on CPUs with oneDNN's bf16 kernels is several times slower at prefill sizes, so
    "free" would depend on the CPU. Elsewhere its padded rows and split attention cost a third
    to a half of the speed, and an eviction policy (``evicting``: its name) would chunk prompts
    on a grid. Returns (on, why)."""
    import torch

    from kvlab import kernels

    if device != "cpu" or tp > 1:
        return False, "its kernels run on one CPU process"
    if evicting is not None:
        return False, f"--kv-policy {evicting} would cut prompts on a fixed grid"
    if dtype != torch.float32:
        name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
        return False, f"free only in fp32; {name} runs are deterministic on request (--deterministic)"
    if kv_dtype not in ("fp32", "bf16"):
        return False, "kvlab's native kernels take an fp32 or bf16 cache"
    native = backends().native
    if not native:
        return False, f"kvlab's native kernels do not run here: {native.why}"
    storage = torch.float32 if kv_dtype == "fp32" else torch.bfloat16
    for layer in layers:
        k = torch.empty(layer.kv_heads, 1, 1, layer.head_dim, dtype=storage)
        v = torch.empty(layer.kv_heads, 1, 1, layer.v_head_dim, dtype=storage)
        if not kernels.attention_fits(dtype, layer.heads, layer.head_dim, k, v):
            return False, "the native attention kernel does not take this model's head sizes"
    return True, "fp32 on kvlab's native kernels, where it is free"
