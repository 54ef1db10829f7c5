"""Storage formats for KV caches and weights, and the bytes each one really takes.

A cache or weight format is more than its element width: quantised formats carry scales. Every
figure kvlab prints goes through `vector_bytes`, so the scales are never forgotten.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StorageDtype:
    """An element format, with the scales its layout adds."""

    name: str
    bits: int
    group_size: int | None = None  # elements sharing one scale; None: no per-group scale
    scale_bytes: int = 0  # bytes of each group scale
    fixed_bytes_per_tensor: int = 0  # per-tensor scales, independent of length
    layout: str = ""
    experts_only: bool = False  # weights: the format covers routed experts only, the rest 16-bit

    def vector_bytes(self, length: int) -> int:
        """Bytes to store one vector of `length` elements, group scales included."""
        data = length * self.bits
        if data % 8:
            raise ValueError(f"{self.name}: a vector of {length} elements is not a whole number of bytes")
        groups = math.ceil(length / self.group_size) if self.group_size else 0
        return data // 8 + groups * self.scale_bytes

    def bytes_per_element(self, length: int) -> float:
        return self.vector_bytes(length) / length


# KV-cache formats. int8 / int4 follow llama.cpp's q8_0 / q4_0 blocks (32 values, one fp16 scale);
# fp8 follows vLLM: one fp32 scale per cached tensor in each layer (K and V; MLA's one latent).
# The planner states the scales of the model at hand (kvlab.plan.memory.kv_layout).
KV_DTYPES: dict[str, StorageDtype] = {
    d.name: d
    for d in (
        StorageDtype("fp32", 32, layout="4 B per element, no scales"),
        StorageDtype("bf16", 16, layout="2 B per element, no scales"),
        StorageDtype("fp16", 16, layout="2 B per element, no scales"),
        StorageDtype(
            "fp8_e4m3", 8, fixed_bytes_per_tensor=4, layout="1 B per element + one fp32 scale per layer",
        ),
        StorageDtype(
            "fp8_e5m2", 8, fixed_bytes_per_tensor=4, layout="1 B per element + one fp32 scale per layer",
        ),
        StorageDtype(
            "int8", 8, group_size=32, scale_bytes=2,
            layout="1 B per element + one fp16 scale per 32 elements of each vector (q8_0: 8.5 bits)",
        ),
        StorageDtype(
            "int4", 4, group_size=32, scale_bytes=2,
            layout="0.5 B per element + one fp16 scale per 32 elements of each vector (q4_0: 4.5 bits)",
        ),
    )
}

# Weight formats for the linear layers. Embeddings and norms stay 16-bit in every serving stack.
WEIGHT_DTYPES: dict[str, StorageDtype] = {
    d.name: d
    for d in (
        StorageDtype("fp32", 32, layout="4 B per parameter"),
        StorageDtype("bf16", 16, layout="2 B per parameter"),
        StorageDtype("fp16", 16, layout="2 B per parameter"),
        StorageDtype("fp8", 8, group_size=128 * 128, scale_bytes=4,
                     layout="1 B per parameter + one fp32 scale per 128x128 block (DeepSeek-V3 style)"),
        StorageDtype("int8", 8, group_size=None, layout="1 B per parameter + one fp16 scale per output row"),
        StorageDtype("int4", 4, group_size=128, scale_bytes=4,
                     layout="0.5 B per parameter + fp16 scale and zero point per 128 parameters (GPTQ/AWQ)"),
        StorageDtype("mxfp4", 4, group_size=32, scale_bytes=1, experts_only=True,
                     layout="routed experts in 0.5 B per parameter + one 8-bit scale per 32 (OCP MX, "
                     "as gpt-oss ships them); attention and router 16-bit"),
    )
}

ALIASES = {
    "float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
    "auto": "bf16", "fp8": "fp8_e4m3", "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2",
    "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2",
}


def kv_dtype(name: str) -> StorageDtype:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in KV_DTYPES:
        raise ValueError(f"unknown KV dtype {name!r}; choose one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[key]


def weight_dtype(name: str) -> StorageDtype:
    key = name.lower()
    key = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "auto": "bf16"}.get(key, key)
    if key.startswith("fp8"):
        key = "fp8"
    if key not in WEIGHT_DTYPES:
        raise ValueError(f"unknown weights dtype {name!r}; choose one of {', '.join(WEIGHT_DTYPES)}")
    return WEIGHT_DTYPES[key]


def matrix_bytes(dtype: StorageDtype, rows: int, cols: int) -> int:
    """Bytes of a rows x cols weight matrix (rows = output features) in `dtype`."""
    if dtype.name == "int8":  # per-output-row fp16 scale
        return rows * cols + rows * 2
    if dtype.name == "fp8":
        blocks = math.ceil(rows / 128) * math.ceil(cols / 128)
        return rows * cols + blocks * dtype.scale_bytes
    n = rows * cols
    groups = math.ceil(n / dtype.group_size) if dtype.group_size else 0
    return n * dtype.bits // 8 + groups * dtype.scale_bytes


# --dtype of the commands that run a model by default in "auto" (kvlab.models.loader.choose_dtype);
# here, free of torch, so that flag parsing stays fast
MODEL_DTYPE_HELP = ("auto (default: the checkpoint's values exactly and the same tokens on every CPU: fp32 on "
                    "a CPU, which holds fp16, bf16 and GGUF-quantised values exactly; on a GPU fp16 for fp16 "
                    "weights, else bf16), fp32, bf16 (faster on CPUs with oneDNN's bf16 kernels) or fp16")

# The GGUF types kvlab's engine runs as stored, multiplied by its native kernels
# (kvlab.models.weights.FORMATS); here, free of torch, for the planner and the flags' help
GGUF_AS_STORED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K")

# --weights of the same commands (kvlab.models.loader.choose_weights)
WEIGHTS_HELP = (f"auto (default: a GGUF file's {'/'.join(GGUF_AS_STORED)} matrices as stored where kvlab's "
                "kernels run, with fp32 activations: the same tokens as dense fp32 at a quarter to a sixth of the "
                "bytes; other types dense), as-stored (also where the kernels do not run: slow), or dense "
                "(every matrix in --dtype)")
