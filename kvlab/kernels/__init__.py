"""kvlab's native CPU kernels: C compiled on first use (``make setup`` builds it ahead), loaded
with ctypes, and PyTorch's own ops wherever they cannot run.

- ``linear`` (``linear.c``): linear layers for the few rows of a decode step in fp32, which MKL's
  sgemm reads at a fraction of the memory bandwidth on AVX2 CPUs, and for any rows in bf16,
  which PyTorch multiplies at ~1 GFLOP/s on CPUs without oneDNN's bf16 kernels. Its results do
  not depend on the batch, so deterministic mode needs no padded rows with it.
- ``linear_q``, ``dequantize`` (``linear.c``, ``blocks.h``, ``kblocks.h``): the same for weights
  kept in GGUF's Q8_0, Q4_0, Q4_1 and Q5_0 blocks or Q4_K and Q6_K super-blocks, dequantised in
  registers to the file's exact values, so bitwise ``linear`` on the dequantised weight, reading
  4-7x fewer bytes. On CPUs with AVX-512
  two weight rows share each register (``KVLAB_AVX512=off``: the AVX2 loop; the same bits).
- ``paged_attention`` (``attention.c``): query rows against their keys and values read in place
  in the paged cache (fp32 or bf16), instead of a gathered copy and SDPA. A row's result does not
  depend on the other rows either.
- ``rms_norm``, ``rope_``, ``store_kv``, ``silu_mul_`` (``rowwise.c``): the small ops between a
  layer's matmuls, one call each instead of 2-10 PyTorch ops, whose dispatch dominated them at
  batch 1.
- ``decoder_layers`` (``layer.c``): a stack of Llama-form decoder layers by the kernels above in
  one call, bitwise the same as the layers' modules running them one by one.

Every function called from here and every struct filled here is declared once, in ``kvlab.h``;
``binding.py`` reads it for their ctypes types.

Their loops run on kvlab's own thread pool (``pool.c``, ``torch.get_num_threads()`` threads),
whose caller never waits for a thread that is not running: a decode step keeps its pace beside
other busy processes, where OpenMP's barriers stalled it (``benchmarks/stored_weights.py``).

It needs an x86 CPU with AVX2 and FMA and a C compiler (``$CC``, ``cc`` or ``gcc``). The library
is cached under ``~/.cache/kvlab`` by a hash of the source and flags. This package only builds and
runs the kernels: whether kvlab uses them is ``kvlab.dispatch``'s decision, which reads the
``KVLAB_*`` switches (``KVLAB_KERNELS=off``: never, to compare or to rule them out).
``python -m kvlab.kernels`` builds it and says which paths run.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import itertools
import math
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from torch.profiler import record_function

from kvlab.hardware import CACHE_DIR
from kvlab.kernels import binding

SOURCES = [Path(__file__).with_name(name) for name in ("linear.c", "attention.c", "rowwise.c", "layer.c", "pool.c")]
HEADER = Path(__file__).with_name("kvlab.h")  # every exported function and shared struct (binding.py)
_CONSTANTS = binding.read(HEADER).constants
ACT8 = _CONSTANTS["KVLAB_ACT8"]  # a block format's code | ACT8: int8 activations
VNNI = {"avx512": _CONSTANTS["KVLAB_VNNI_512"], "avx": _CONSTANTS["KVLAB_VNNI_AVX"]}  # set_vnni's encodings
HEADERS = sorted(Path(__file__).parent.glob("*.h"))  # all of them in the build's hash
# -ffp-contract=off: a product is never fused into an add behind the source's back (the row-wise
# ops round each step as PyTorch's eager ops do)
# -fvisibility=hidden: the library exports kvlab.h's KVLAB_API functions only
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fvisibility=hidden", "-pthread", "-shared",
         "-fPIC")
# Rows up to which the kernel beats MKL's sgemm on kvlab's weight shapes (more rows: the
# blocked GEMM's reuse of each weight wins); docs/benchmarks.md has the sweep.
MAX_ROWS = 64


@dataclass(frozen=True)
class Status:
    available: bool
    detail: str  # the library's path, or why PyTorch's matmul runs instead
    avx512: bool = False  # this CPU can run the block formats' AVX-512 loops (``set_avx512``)
    vnni: tuple[str, ...] = ()  # the VNNI encodings this CPU runs (``set_vnni``)


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, Status]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, Status(False, f"no kernel for {platform.machine()} (x86 AVX2 only)")
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None, Status(False, "this CPU lacks AVX2/FMA")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, Status(False, "no C compiler (set CC, or install gcc)")
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in SOURCES + HEADERS) + " ".join(FLAGS).encode())
    path = CACHE_DIR / f"kernels-{digest.hexdigest()[:12]}.so"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            # build beside the target, then rename: processes building at once never see half a file
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
            os.close(fd)
            try:
                subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", tmp], check=True,
                               capture_output=True, text=True)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        lib = ctypes.CDLL(str(path))
    except subprocess.CalledProcessError as e:
        first = (e.stderr or "").strip().splitlines()[:1]
        return None, Status(False, f"{cc} failed: {first[0] if first else e}")
    except OSError as e:
        return None, Status(False, f"cannot build or load {path}: {e}")
    binding.bind(lib, binding.read(HEADER))
    wide = bool(lib.kvlab_set_avx512(1))  # this CPU has the loops; they stay off until asked for
    lib.kvlab_set_avx512(0)
    vnni = tuple(name for name, code in VNNI.items() if lib.kvlab_set_vnni(code))
    lib.kvlab_set_vnni(0)
    return lib, Status(True, str(path), wide, vnni)


def _profiled(name: str) -> contextlib.AbstractContextManager:
    """The call as a named op in a running torch profile (``benchmarks/decode_ops.py``); a
    ctypes call is otherwise invisible there. Free when no profile runs."""
    return record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def status() -> Status:
    """Whether the native kernels run here (building them if needed), and why not."""
    return _load()[1]


def set_avx512(on: bool) -> bool:
    """Run the block formats' AVX-512 loops (``on``, where the CPU has AVX-512 F and DQ) or the
    AVX2 ones; their results are bitwise the same, only the speed differs. Returns whether the
    AVX-512 loops now run. Off until ``kvlab.dispatch`` turns them on."""
    lib = _load()[0]
    assert lib is not None
    return bool(lib.kvlab_set_avx512(int(on)))


def set_vnni(encoding: str | None) -> bool:
    """Run the int8 activations' dot products with VNNI's vpdpbusd in ``encoding`` ("avx512":
    AVX512-VNNI with BW and VL; "avx": AVX-VNNI), where the CPU has it, or with AVX2's (None); the
    integers, so the results, are the same. Returns whether it runs. AVX2's until
    ``kvlab.dispatch`` chooses."""
    lib = _load()[0]
    assert lib is not None
    return bool(lib.kvlab_set_vnni(VNNI[encoding] if encoding else 0))


def quantize_act8(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(q [M, K] int8, d [M, K / 32] fp32, s [M, K / 32] int32) of fp32 x [M, K] as the int8
    activations quantise it: per 32 values d = max|x| / 127, q = round(x / d), s = sum q."""
    lib = _load()[0]
    assert lib is not None and x.dtype == torch.float32 and x.shape[1] % 32 == 0
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // 32, dtype=torch.float32)
    s = torch.empty(m, k // 32, dtype=torch.int32)
    lib.kvlab_quantize_act8(x.data_ptr(), q.data_ptr(), d.data_ptr(), s.data_ptr(), m, k, torch.get_num_threads())
    return q, d, s


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, fp32_out: bool = False) -> Tensor:
    """F.linear(x, weight, bias) by the native kernel (check ``usable`` first): x [M, K],
    weight [N, K] -> [M, N] in x's dtype (bf16: summed in fp32, rounded once; with
    ``fp32_out`` the same sums in fp32, not rounded), on torch's thread count."""
    lib = _load()[0]
    assert lib is not None
    m, k = x.shape
    n = weight.shape[0]
    bf16 = x.dtype == torch.bfloat16
    y = torch.empty(m, n, dtype=torch.float32 if fp32_out else x.dtype)
    fn = (lib.kvlab_linear_f32 if not bf16 else lib.kvlab_linear_bf16_f32 if fp32_out
          else lib.kvlab_linear_bf16)
    with _profiled("kvlab::linear"):
        fn(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
           m, n, k, torch.get_num_threads())
    return y


def linear_q(x: Tensor, blocks: Tensor, fmt: int, bias: Tensor | None) -> Tensor:
    """x @ W^T (+ bias) for fp32 x [M, K] (contiguous) and W stored as ``blocks`` [N, K / block
    weights x block bytes] (uint8, contiguous) in block format ``fmt`` (``kvlab.models.weights``): bitwise
    ``linear(x, W, bias)`` on the dequantised W; ``fmt | ACT8`` (a 32-weight format): x's rows
    quantised to int8 first (``quantize_act8``) and multiplied by integer dot products."""
    lib = _load()[0]
    assert lib is not None and x.dtype == torch.float32 and x.is_contiguous() and blocks.is_contiguous()
    m, k = x.shape
    n = blocks.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    with _profiled("kvlab::linear_q"):
        lib.kvlab_linear_q(x.data_ptr(), blocks.data_ptr(), None if bias is None else bias.data_ptr(),
                           y.data_ptr(), m, n, k, fmt, torch.get_num_threads())
    return y


def dequantize(blocks: Tensor, fmt: int, k: int) -> Tensor:
    """The fp32 rows [N, k] of ``blocks`` [N, k / block weights x block bytes] in block format ``fmt``,
    exactly as gguf.quants dequantises them."""
    lib = _load()[0]
    assert lib is not None and blocks.is_contiguous() and blocks.dtype == torch.uint8
    out = torch.empty(blocks.shape[0], k, dtype=torch.float32)
    with _profiled("kvlab::dequantize"):
        lib.kvlab_dequantize(blocks.data_ptr(), out.data_ptr(), blocks.shape[0], k, fmt, torch.get_num_threads())
    return out


def attention_usable(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> bool:
    """Can ``paged_attention`` run: q [R, H, D] on CPU, and ``attention_fits``."""
    return q.device.type == "cpu" and q.dim() == 3 and attention_fits(q.dtype, q.shape[1], q.shape[2],
                                                                      k_cache, v_cache)


def attention_fits(dtype: torch.dtype, heads: int, head_dim: int, k_cache: Tensor, v_cache: Tensor) -> bool:
    """Can ``paged_attention`` take queries of this dtype and heads: fp32 or bf16, caches [KV,
    blocks, block_size, D] on CPU in fp32 or bf16, head sizes multiples of 32, at most 64 query
    heads per KV head."""
    if dtype not in (torch.float32, torch.bfloat16) or k_cache.device.type != "cpu":
        return False
    if k_cache.dtype not in (torch.float32, torch.bfloat16) or v_cache.dtype != k_cache.dtype:
        return False
    if k_cache.dim() != 4 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    kv = k_cache.shape[0]
    if k_cache.shape[-1] != head_dim or head_dim % 32 or v_cache.shape[-1] % 32 or heads % kv or heads // kv > 64:
        return False
    return _load()[0] is not None


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, lengths: Tensor,
                    starts: Tensor | None = None, seqs: Tensor | None = None) -> Tensor:
    """Softmax(q K^T / sqrt(D)) V per query row over the cache (check ``attention_usable``
    first). q [R, H, D]; slots [NS, L]: slots of the block tensors' flattened [blocks x
    block_size] axis, a sequence's keys in position order per row; row r reads
    ``slots[seqs[r], starts[r]:starts[r] + lengths[r]]`` (lengths >= 1; by default seqs[r] = r
    and starts 0: one decode per row of slots) -> [R, H, DV] in q's dtype (computed in fp32)."""
    lib = _load()[0]
    assert lib is not None
    r, h, d = q.shape
    kv, dv = k_cache.shape[0], v_cache.shape[-1]
    seqs = torch.arange(r) if seqs is None else seqs
    starts = torch.zeros(r, dtype=torch.int64) if starts is None else starts
    dtype, q, slots = q.dtype, q.float().contiguous(), slots.to(torch.int64).contiguous()
    seqs, starts, lengths = (t.to(torch.int64).contiguous() for t in (seqs, starts, lengths))
    out = torch.empty(r, h, dv, dtype=torch.float32)
    with _profiled("kvlab::paged_attention"):
        failed = lib.kvlab_paged_attention(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16),
            k_cache.shape[1] * k_cache.shape[2], slots.data_ptr(), slots.shape[1], seqs.data_ptr(),
            starts.data_ptr(), lengths.data_ptr(), out.data_ptr(), r, h, kv, d, dv,
            1.0 / math.sqrt(d), torch.get_num_threads())
    if failed:
        raise MemoryError("paged attention: out of memory for the scores")
    return out.to(dtype)


def rowwise_usable(*tensors: Tensor) -> bool:
    """Can the row-wise kernels take these tensors: all fp32 or all bf16 on CPU, none needing a
    gradient."""
    dtype = tensors[0].dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    for t in tensors:
        if t.dtype != dtype or t.device.type != "cpu" or (t.requires_grad and torch.is_grad_enabled()):
            return False
    return _load()[0] is not None


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(RMSNorm(h) * weight, h) with h = x + residual (h = x without one), as PyTorch's ops
    compute them (check ``rowwise_usable`` first). x, residual [M, D]; weight [D]."""
    lib = _load()[0]
    assert lib is not None
    x, weight = x.contiguous(), weight.contiguous()
    m, d = x.shape
    y = torch.empty_like(x)
    h = x if residual is None else torch.empty_like(x)
    residual = None if residual is None else residual.contiguous()
    a = None if residual is None else residual.data_ptr()
    with _profiled("kvlab::rms_norm"):
        lib.kvlab_rms_norm(x.data_ptr(), a, None if residual is None else h.data_ptr(), weight.data_ptr(),
                           y.data_ptr(), m, d, eps, int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return y, h


def rope_(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE in place on x [T, H, D] (heads contiguous, any token stride; check
    ``rowwise_usable`` first) with cos, sin [T, D]; returns x."""
    lib = _load()[0]
    assert lib is not None
    t, h, d = x.shape
    assert x.stride(2) == 1 and x.stride(1) == d, "rope_: each token's heads must be contiguous"
    cos, sin = cos.contiguous(), sin.contiguous()
    with _profiled("kvlab::rope"):
        lib.kvlab_rope(x.data_ptr(), t, h, d, x.stride(0), cos.data_ptr(), sin.data_ptr(),
                       int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return x


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor) -> None:
    """Write k [T, KV, D] and v [T, KV, DV] (fp32 or bf16) at ``slots`` [T]
    of the caches [KV, S, D] / [KV, S, DV] (fp32 or bf16, contiguous), cast to the cache's
    dtype."""
    lib = _load()[0]
    assert lib is not None and k_cache.is_contiguous() and v_cache.is_contiguous()
    k, v = (t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous() for t in (k, v))
    slots = slots.to(torch.int64).contiguous()
    with _profiled("kvlab::store_kv"):
        lib.kvlab_store_kv(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k_cache.data_ptr(),
                           v_cache.data_ptr(), slots.data_ptr(), k.shape[0], k.shape[1], k.shape[2],
                           v.shape[2], k_cache.shape[1], int(k.dtype == torch.bfloat16),
                           int(k_cache.dtype == torch.bfloat16))


def silu_mul_(gate: Tensor, up: Tensor) -> Tensor:
    """gate = silu(gate) * up in place (check ``rowwise_usable``; both contiguous, same shape);
    returns gate."""
    lib = _load()[0]
    assert lib is not None and gate.is_contiguous() and up.is_contiguous() and gate.shape == up.shape
    with _profiled("kvlab::silu_mul"):
        lib.kvlab_silu_mul(gate.data_ptr(), up.data_ptr(), gate.numel(), int(gate.dtype == torch.bfloat16),
                           torch.get_num_threads())
    return gate


@dataclass(frozen=True)
class StepRows:
    """A step's rows as the native attention reads a cache: row r's new K/V go to
    ``write_slots[r]``, and it attends to ``slots[seqs[r], starts[r]:starts[r] + lengths[r]]``
    (all int64, contiguous). The layers of one cache group share them."""

    write_slots: Tensor
    slots: Tensor
    seqs: Tensor
    starts: Tensor
    lengths: Tensor

    def args(self) -> tuple[int, ...]:
        """This group's row of ``kvlab_decoder_layers``'s rows array."""
        return (self.write_slots.data_ptr(), self.slots.data_ptr(), self.slots.shape[1], self.seqs.data_ptr(),
                self.starts.data_ptr(), self.lengths.data_ptr())


class CacheLayout:
    """Each layer of a stack: its K and V caches [KV, blocks, block_size, D] (fp32 or bf16,
    contiguous) and the group of the step's rows it reads (``StepRows``), packed once for
    ``decoder_layers``: a cache's tensors stay where they are for its life."""

    def __init__(self, caches: list[tuple[Tensor, Tensor]], groups: list[int]) -> None:
        self.caches = caches
        self.array = (ctypes.c_int64 * (6 * len(caches)))(*itertools.chain.from_iterable(
            (k.data_ptr(), v.data_ptr(), k.shape[-1], k.shape[1] * k.shape[2], int(k.dtype == torch.bfloat16), g)
            for (k, v), g in zip(caches, groups)))

    def __len__(self) -> int:
        return len(self.caches)


class LayerWeights:
    """A decoder layer's weights for ``decoder_layers``: the input norm's, q, q bias, k, k bias, v,
    v bias, o, o bias, the post-attention norm's, gate, gate bias, up, up bias, down, down bias
    (None: no bias), with their addresses packed once for the call; ``formats``: the seven
    matrices' (q, k, v, o, gate, up, down), 0 for dense, else the block format of a uint8 weight
    (fp32 activations only)."""

    def __init__(self, weights: list[Tensor | None], formats: list[int]) -> None:
        assert len(weights) == 16 and weights[10] is not None and len(formats) == 7
        self.weights = weights
        self.formats = formats
        self.addresses = [None if w is None else w.data_ptr() for w in weights]
        self.pointers = (ctypes.c_void_p * 16)(*self.addresses)
        self.format_array = (ctypes.c_int * 7)(*formats)
        self.inter = weights[10].shape[0]
        self._held = [w for w in weights if w is not None]
        self._held_at = [w.data_ptr() for w in self._held]

    def moved(self) -> bool:
        """Is some tensor no longer where it was packed (a cast, ``.to()`` or ``.data =``)? One
        list compare: the native stack asks it of every layer each step."""
        return [w.data_ptr() for w in self._held] != self._held_at

    def fit(self, dtype: torch.dtype) -> bool:
        """Every tensor (but the block-format weights) of this dtype, the blocks with fp32 rows
        only; all contiguous and still where they were packed."""
        if any(self.formats) and dtype != torch.float32:
            return False
        return not self.moved() and all(w is None or ((w.dtype == dtype or w.dtype == torch.uint8)
                                                      and w.is_contiguous()) for w in self.weights)


class LayerStack:
    """Decoder layers for ``decoder_layers``: each one's (weights, heads, KV heads, norm eps),
    packed once into the array the native call reads."""

    def __init__(self, layers: list[tuple[LayerWeights, int, int, float]]) -> None:
        self.layers = layers
        layer = binding.read(HEADER).structs["kvlab_layer"]
        self.array = (layer * len(layers))(*[
            layer(ctypes.addressof(w.pointers), ctypes.addressof(w.format_array), h, kv, w.inter, eps)
            for w, h, kv, eps in layers])
        # every layer's held tensors in one list: one compare a step, not one per layer
        self._held = [t for w, *_ in layers for t in w._held]
        self._held_at = [a for w, *_ in layers for a in w._held_at]

    def __len__(self) -> int:
        return len(self.layers)

    def moved(self) -> bool:
        """Has some layer's weight moved since it was packed (as ``LayerWeights.moved``)?"""
        return [t.data_ptr() for t in self._held] != self._held_at


def decoder_layers(x: Tensor, stack: LayerStack, caches: CacheLayout, rows: list[StepRows], cos: Tensor,
                   sin: Tensor) -> Tensor:
    """Llama-form decoder layers, one after another, on x [M, hidden] (contiguous; every layer's
    ``weights.fit(x.dtype)``, fp32 or bf16) in one native call; cos, sin [M, head_dim]; caches:
    each layer's; rows: each cache group's rows this step. Writes the rows' K/V to each layer's
    cache; returns the last layer's output, bitwise what the layers' modules give on the same
    kernels."""
    lib = _load()[0]
    assert lib is not None and len(caches) == len(stack)
    m, hidden = x.shape
    groups = (ctypes.c_int64 * (6 * len(rows)))(*itertools.chain.from_iterable(map(StepRows.args, rows)))
    out = torch.empty_like(x)
    with _profiled("kvlab::decoder_layers"):
        failed = lib.kvlab_decoder_layers(stack.array, caches.array, groups, len(stack), m, hidden, x.data_ptr(),
                                          out.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                          int(x.dtype == torch.bfloat16), torch.get_num_threads())
    if failed:
        raise MemoryError("decoder layer: out of memory for its buffers or the attention's scores")
    return out
