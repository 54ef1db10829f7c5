"""One decoder for the standard-attention families: Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, Gemma 3.

They differ only in small switches, all read from the spec / raw config:
- Qwen2: bias on q/k/v projections;  Llama: ``attention_bias`` (q/k/v/o), ``mlp_bias``;
- Qwen3: RMSNorm over each head of q and k before RoPE;
- Mistral (and any config with sliding layers): a sliding window, applied by the backend;
- RoPE: default, "linear" or Llama 3's "llama3" frequency scaling;
- Gemma 3 (``gemma3_text``): embeddings scaled by sqrt(hidden), (1 + w) RMSNorms, four of them
  per layer (before and after attention and MLP), q/k norms, GeGLU (tanh GELU), queries scaled
  by ``query_pre_attn_scalar``, and its own RoPE base on the sliding layers.

Module names mirror Hugging Face's (``model.layers.0.self_attn.q_proj``...) so a checkpoint's
state dict loads as is. The forward pass works on flat tokens and leaves every cache decision
to the attention backend (see ``attention.py``), so the paged engine reuses this file untouched.
"""

from __future__ import annotations

import functools
import math
import sys
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvlab import dispatch, kernels
from kvlab.models.attention import AttentionBackend
from kvlab.models.invariant import check_linears, pad_rows
from kvlab.models.weights import QuantEmbedding, QuantLinear
from kvlab.spec import LayerSpec, ModelSpec

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
SUPPORTED_ROPE = ("default", "linear", "llama3")
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}
GEMMA = "gemma3_text"


class UnsupportedModelError(ValueError):
    """The runtime cannot run this architecture (the message names it and what is supported)."""


def rope_parameters(cfg: dict[str, Any], layer_type: str = "full_attention") -> dict[str, Any]:
    """RoPE settings of one layer type from either transformers 5 (``rope_parameters``, per
    layer type for Gemma 3) or older configs (``rope_theta`` + ``rope_scaling``; Gemma 3's
    sliding layers: ``rope_local_base_freq``, never scaled), normalised to a dict with rope_type
    and rope_theta."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "full_attention" in params or "sliding_attention" in params:
        params = dict(params.get(layer_type) or {})
    elif layer_type == "sliding_attention" and cfg.get("model_type") == GEMMA:
        return {"rope_type": "default", "rope_theta": float(cfg.get("rope_local_base_freq", 10000.0))}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return {**params, "rope_type": rope_type, "rope_theta": float(theta)}


def check_supported(spec: ModelSpec) -> None:
    """Raise UnsupportedModelError (one line) unless this runtime can run ``spec``."""
    supported = ("supported: llama, mistral, qwen2, qwen3, gemma3_text (Llama 2/3.x, SmolLM2, "
                 "TinyLlama, Mistral, Qwen2/2.5, Qwen3 dense, Gemma 3 text)")
    kinds = {layer.kind for layer in spec.layers}
    mtype = spec.model_type
    if mtype not in SUPPORTED_TYPES:
        why = ("MLA attention" if spec.is_mla else
               "SSM / hybrid layers" if kinds & {"ssm", "none"} else
               "mixture of experts" if any(m.name.startswith("moe") for m in spec.matrices) else
               "a different block layout")
        raise UnsupportedModelError(f"{spec.name}: architecture {mtype} ({spec.architecture}, {why}) "
                                    f"is not supported by kvlab's runtime; {supported}")
    if not kinds <= {"full", "sliding"}:
        raise UnsupportedModelError(f"{spec.name}: layer kinds {sorted(kinds)} are not supported; "
                                    f"{supported}")
    cfg = spec.config
    act = activation_name(cfg)
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(f"{spec.name}: hidden_act {act!r} is not supported; "
                                    f"supported: {', '.join(ACTIVATIONS)}")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise UnsupportedModelError(f"{spec.name}: {key} is not supported")
    for layer_type in ("full_attention", "sliding_attention"):
        rope = rope_parameters(cfg, layer_type)["rope_type"]
        if rope not in SUPPORTED_ROPE:
            raise UnsupportedModelError(f"{spec.name}: rope_type {rope!r} is not supported; "
                                        f"supported: {', '.join(SUPPORTED_ROPE)}")


def activation_name(cfg: dict[str, Any]) -> str:
    """The MLP's activation: Gemma's configs name it ``hidden_activation``."""
    return cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")


def inv_frequencies(cfg: dict[str, Any], head_dim: int, layer_type: str = "full_attention") -> Tensor:
    """RoPE inverse frequencies (float32, on the CPU) of one layer type, as Hugging Face computes
    them for each rope_type. On the CPU even while a model is built on the meta device: meta ops
    here would import torch._dynamo (1 s per start)."""
    p = rope_parameters(cfg, layer_type)
    positions = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu")
    inv = 1.0 / (p["rope_theta"] ** (positions.float() / head_dim))
    if p["rope_type"] == "linear":
        return inv / p["factor"]
    if p["rope_type"] == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old_len = p["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / hi) * ~(wavelen > old_len / lo)
        return torch.where(medium, blended, scaled)
    return inv


def _can_prepack(weight: Tensor) -> bool:
    """oneDNN prepacking pays for bf16 weights on a CPU with oneDNN's bf16 kernels (AVX-512 or
    AVX-NE-CONVERT; on an AVX2-only CPU oneDNN refuses to pack; ``KVLAB_ONEDNN_BF16=off`` takes
    that branch anywhere)."""
    if weight is None or weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return False
    return dispatch.onednn_bf16().on


def onednn_rows(m: int) -> int:
    """The row count a oneDNN matmul of ``m`` rows runs at: ``m`` up to 8, else ``m`` rounded up
    to the next of four steps per octave (8, 10, 12, 14, 16, 20, 24, 28, 32, 40...). oneDNN builds
    and caches a kernel per input shape (~0.5 MB each, measured: 1,200 distinct prefill lengths
    grew RSS by 640 MB), so the rows it sees are bucketed: at most 8 + 4 per doubling shapes,
    for at most 25% padding rows."""
    if m <= 8:
        return m
    step = 1 << (m.bit_length() - 3)  # a quarter of the octave m lies in
    return -(-m // step) * step


def _onednn_pack(weight: Tensor) -> Tensor:
    """oneDNN's blocked copy of a bf16 weight [N, K]."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)


def _onednn_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """x @ packed^T (+ bias): the one call through which kvlab hands shapes to oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedWeights:
    """A oneDNN-packed copy of one or more linear layers' weights, stacked along the output
    dimension (several layers that read the same input then run as one matmul: q/k/v,
    gate/up).

    On CPU a bf16 ``F.linear`` re-packs its weight into oneDNN's blocked layout on every call,
    which makes small-batch (decode) matmuls compute-bound at a third of the memory bandwidth;
    the packed copy is read as is. Each output column is computed exactly as ``F.linear``
    computes it (same oneDNN kernel, same reduction), so results are bit-identical. The copy
    is only used while every source weight and bias is the very tensor it was made from,
    unmodified (``valid``); callers fall back to the plain layers otherwise. Padded rows are
    zeros, and a row's sums do not read the other rows.
    """

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.linears = linears
        self.sources = self._sources()
        with torch.no_grad():
            weights = [m.weight.detach() for m in linears]
            w = weights[0] if len(weights) == 1 else torch.cat(weights)
            self.packed = _onednn_pack(w)
            biases = [m.bias for m in linears]
            self.bias = None
            if any(b is not None for b in biases):
                self.bias = torch.cat([b.detach() if b is not None else w.new_zeros(m.out_features)
                                       for b, m in zip(biases, linears)])
        self.sizes = [m.out_features for m in linears]
        self.dtype = w.dtype
        self.nbytes = w.numel() * w.element_size()

    def _sources(self) -> list[tuple[weakref.ref | None, int, int]]:
        # weak references: a replaced weight is not kept alive by its stale copy
        return [(weakref.ref(t), t._version, t.data_ptr()) if t is not None else (None, 0, 0)
                for m in self.linears for t in (m.weight, m.bias)]

    def valid(self) -> bool:
        """Every source weight and bias is still the tensor the copy was made from, unmodified."""
        i = 0
        for m in self.linears:
            for t in (m.weight, m.bias):
                ref, version, ptr = self.sources[i]
                if t is None:
                    if ref is not None:
                        return False
                elif ref is None or ref() is not t or t._version != version or t.data_ptr() != ptr:
                    return False
                i += 1
        return True

    def __call__(self, x: Tensor) -> Tensor:
        """x @ W^T (+ b), x's rows zero-padded to ``onednn_rows`` (a bounded set of shapes)."""
        m = x.shape[0]
        return _onednn_linear(pad_rows(x, onednn_rows(m)), self.packed, self.bias)[:m]


def pack(linears: list[nn.Linear]) -> PackedWeights | None:
    """Packed weights for these layers side by side, or None where packing does not apply (not
    bf16 on a CPU with oneDNN)."""
    if not all(_can_prepack(m.weight) for m in linears):
        return None
    return PackedWeights(linears)


def _use(packed: PackedWeights | None, x: Tensor) -> bool:
    """Run from `packed` now? Inference only (no autograd), matching dtype, fresh copy."""
    return (packed is not None and x.dtype == packed.dtype and not torch.is_grad_enabled()
            and packed.valid())


class Linear(nn.Linear):
    """nn.Linear that runs inference, in order of preference: from packed weights once
    ``prepack()``-ed (bf16 where oneDNN has bf16 kernels, see ``PackedWeights``), by kvlab's
    native kernel (fp32 or bf16, up to ``native_rows`` rows: by default
    ``kvlab.kernels.max_rows``), or by plain ``F.linear``. With ``row_block`` > 1 (deterministic
    mode without the native kernel), the rows are padded with zero rows to a multiple of it, so
    that every row goes through the same GEMM kernel whatever the batch
    (``kvlab.models.invariant``)."""

    _packed: PackedWeights | None = None
    row_block: int = 1
    native_rows: int | None = None

    def prepack(self) -> int:
        """Pack the weight if that applies here; returns the bytes the packed copy takes."""
        if self._packed is None or not self._packed.valid():
            self._packed = pack([self])
            _restructured()
        return self._packed.nbytes if self._packed is not None else 0

    def unpack(self) -> None:
        self._packed = None
        _restructured()

    def row_limit(self, dtype: torch.dtype) -> int:
        """The most rows of ``dtype`` the native kernel takes here: ``native_rows``, by default
        ``kernels.max_rows``."""
        return kernels.max_rows(dtype) if self.native_rows is None else self.native_rows

    def forward(self, x: Tensor) -> Tensor:
        if _use(self._packed, x):
            return self._packed(x)  # type: ignore[misc]
        if x.shape[0] <= self.row_limit(x.dtype) and kernels.usable(x, self.weight, self.bias):
            return kernels.linear(x, self.weight, self.bias)
        return self._gemm(x, self.weight, self.bias)

    def _gemm(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """PyTorch's F.linear, the rows zero-padded to a multiple of ``row_block`` (deterministic
        mode) and, in bf16 on a CPU, to ``onednn_rows``: PyTorch hands bf16 matmuls to oneDNN
        wherever oneDNN has bf16 kernels, whatever kvlab packs, and oneDNN caches a kernel per
        shape."""
        m = x.shape[0]
        rows = onednn_rows(m) if x.dtype == torch.bfloat16 and x.device.type == "cpu" else m
        rows = -(-rows // self.row_block) * self.row_block
        if rows == m:
            return F.linear(x, weight, bias)
        return F.linear(pad_rows(x, rows), weight, bias)[:m]


class LMHead(Linear):
    """The LM head: fp32 logits whatever the model's dtype, as llama.cpp keeps them and vLLM
    samples them. A bf16 head sums in fp32 and never rounds the logits to bf16, whose values
    near 15-20 are 0.125 apart: rounded, a near-tie becomes an exact tie that goes to the lower
    token id (the first token of the README's chat question in bf16 did). The weight stays in
    the model's dtype (tied: it is the embedding)."""

    VOCAB_SLICE = 8192  # weight rows widened at a time where the native kernel does not run

    def prepack(self) -> int:
        return 0  # oneDNN's packed bf16 matmul returns bf16

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            return super().forward(x)
        if kernels.usable(x, self.weight, self.bias):
            return kernels.linear(x, self.weight, self.bias, fp32_out=True)  # any rows: batch-invariant
        x32, step = x.float(), self.VOCAB_SLICE
        return torch.cat([self._gemm(x32, self.weight[i:i + step].float(),
                                     None if self.bias is None else self.bias[i:i + step].float())
                          for i in range(0, self.out_features, step)], dim=-1)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, as in HF (bit-for-bit).
    ``offset`` (Gemma): the scale is (1 + weight), applied in float32 before the cast, as in
    HF's Gemma3RMSNorm; the native kernel computes only the plain form."""

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: Tensor) -> Tensor:
        if not self.offset and kernels.rowwise_usable(x, self.weight):
            return kernels.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps)[0].view(x.shape)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x32 * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)

    def add(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(this norm of h, h) with h = x + residual: one pass where the native kernel runs."""
        if not self.offset and x.dim() == 2 and kernels.rowwise_usable(x, residual, self.weight):
            return kernels.rms_norm(x, self.weight, self.eps, residual)
        h = x + residual
        return self(h), h


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, D]; cos/sin [T, D] (already in x's dtype)."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def rope_in_place(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """apply_rope, written over x (a projection nothing else holds) where the native kernel
    runs: one call instead of seven ops."""
    if kernels.rowwise_usable(x, cos, sin) and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return kernels.rope_(x, cos, sin)
    return apply_rope(x, cos, sin)


class Attention(nn.Module):
    def __init__(self, layer_idx: int, layer: LayerSpec, cfg: dict[str, Any], hidden: int,
                 mtype: str) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.kv_heads, self.head_dim = layer.num_heads, layer.kv_heads, layer.head_dim
        bias = cfg.get("attention_bias", False)
        qkv_bias = True if mtype == "qwen2" else bias  # Qwen2 hard-codes q/k/v bias
        o_bias = bias if mtype in ("llama", "qwen3") else False
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = Linear(hidden, self.kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = Linear(hidden, self.kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=o_bias)
        self.qk_norm = mtype in ("qwen3", GEMMA)
        if self.qk_norm:
            eps = cfg.get("rms_norm_eps", 1e-6)
            self.q_norm = RMSNorm(self.head_dim, eps, offset=mtype == GEMMA)
            self.k_norm = RMSNorm(self.head_dim, eps, offset=mtype == GEMMA)
        # Gemma scales scores by query_pre_attn_scalar**-0.5, the backends by head_dim**-0.5:
        # the queries carry the difference (1.0, i.e. nothing, where the two agree)
        scalar = cfg.get("query_pre_attn_scalar", self.head_dim) if mtype == GEMMA else self.head_dim
        self.q_scale = math.sqrt(self.head_dim / scalar)

    _qkv: PackedWeights | None = None  # q/k/v stacked: one matmul (see CausalLM.prepack)

    def prepack(self) -> int:
        if self._qkv is None or not self._qkv.valid():
            self._qkv = pack([self.q_proj, self.k_proj, self.v_proj])
            _restructured()
        return (self._qkv.nbytes if self._qkv is not None else 0) + self.o_proj.prepack()

    def unpack(self) -> None:
        self._qkv = None
        _restructured()
        self.o_proj.unpack()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionBackend,
                rows: Tensor | None = None) -> Tensor:
        """Every row's K/V goes to the cache; the output is for ``rows`` only (all if None)."""
        t, h, kvh, d = x.shape[0], self.num_heads, self.kv_heads, self.head_dim
        qk: Tensor | None = None  # q and k side by side [t, h + kvh, d]: one RoPE pass for both
        if _use(self._qkv, x):
            qkv = self._qkv(x)  # type: ignore[misc]
            qk, v = qkv[:, :(h + kvh) * d].view(t, h + kvh, d), qkv[:, (h + kvh) * d:]
            q, k = qk.split((h, kvh), 1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        v = v.view(t, kvh, d)
        if qk is not None and not self.qk_norm:
            # RoPE is elementwise: one pass over q and k side by side gives the same values
            q, k = rope_in_place(qk, cos, sin).split((h, kvh), 1)
        else:
            q, k = q.view(t, h, d), k.view(t, kvh, d)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rope_in_place(q, cos, sin), rope_in_place(k, cos, sin)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        out = attn.attend(self.layer_idx, q, k, v).reshape(t, self.num_heads * self.head_dim)
        return self.o_proj(out if rows is None else out[rows])


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (silu), or Gemma's GeGLU (``gelu_pytorch_tanh``)."""

    def __init__(self, hidden: int, inter: int, bias: bool, act: str = "silu") -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=bias)
        self.up_proj = Linear(hidden, inter, bias=bias)
        self.down_proj = Linear(inter, hidden, bias=bias)
        self.act = act

    _gate_up: PackedWeights | None = None  # gate/up stacked: one matmul (see CausalLM.prepack)

    def prepack(self) -> int:
        if self._gate_up is None or not self._gate_up.valid():
            self._gate_up = pack([self.gate_proj, self.up_proj])
            _restructured()
        return (self._gate_up.nbytes if self._gate_up is not None else 0) + self.down_proj.prepack()

    def unpack(self) -> None:
        self._gate_up = None
        _restructured()
        self.down_proj.unpack()

    def forward(self, x: Tensor) -> Tensor:
        act = ACTIVATIONS[self.act]
        if _use(self._gate_up, x):
            gate, up = self._gate_up(x).split(self._gate_up.sizes, -1)  # type: ignore[misc, union-attr]
            return self.down_proj(act(gate).mul_(up))
        if torch.is_grad_enabled() or act is not F.silu:
            return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))
        # in place on the fresh projection outputs: the same values, no extra [T, inter] buffers
        gate, up = self.gate_proj(x), self.up_proj(x)
        if kernels.rowwise_usable(gate, up) and gate.is_contiguous() and up.is_contiguous():
            return self.down_proj(kernels.silu_mul_(gate, up))  # what the native layer computes
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


# Bumped whenever any module gains or replaces a parameter or a submodule (torch's global
# registration hooks) or packs or drops a packed copy, so that gathered native weights are known
# stale.
_structure = [0]


def _restructured(*_: object) -> None:
    _structure[0] += 1


nn.modules.module.register_module_parameter_registration_hook(_restructured)
nn.modules.module.register_module_module_registration_hook(_restructured)


class DecoderLayer(nn.Module):
    def __init__(self, layer_idx: int, spec: ModelSpec) -> None:
        super().__init__()
        cfg, hidden = spec.config, spec.hidden_size
        eps = cfg.get("rms_norm_eps", 1e-6)
        gemma = spec.model_type == GEMMA
        self.self_attn = Attention(layer_idx, spec.layers[layer_idx], cfg, hidden, spec.model_type)
        self.mlp = MLP(hidden, cfg["intermediate_size"], bool(cfg.get("mlp_bias", False)),
                       activation_name(cfg))
        self.input_layernorm = RMSNorm(hidden, eps, gemma)
        self.post_attention_layernorm = RMSNorm(hidden, eps, gemma)
        # Gemma's "sandwich": post_attention_layernorm normalises the attention output before
        # the residual add, and the MLP has its own norms before and after
        self.sandwich = gemma
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, True)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, True)

    _native: tuple[int, tuple[Linear, ...], kernels.LayerWeights | None] | None = None

    def linears(self) -> tuple[Linear, ...]:
        """q, k, v, o, gate, up, down: the order ``kernels.LayerWeights`` takes them in."""
        attn, mlp = self.self_attn, self.mlp
        return (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)

    def native_weights(self, x: Tensor) -> kernels.LayerWeights | None:
        """The weights ``kvlab.kernels.decoder_layers`` takes, when it can run this layer on x
        exactly as these modules would: the native kernels serve every op at this many rows (no
        packed copies, no tensor-parallel linears, no q/k norms, no autograd). Gathered once and
        again only when some module's parameters or submodules were replaced (``_structure``) or
        a weight moved: collecting 16 parameters through ``nn.Module`` costs more per step than
        the checks."""
        attn, mlp = self.self_attn, self.mlp
        if self.sandwich:  # the native layer is Llama-form only
            return None
        if self._native is None or self._native[0] != _structure[0] or (self._native[2] is not None
                                                                          and self._native[2].moved()):
            linears = self.linears()
            weights = None
            if not attn.qk_norm and all(type(m) in (Linear, QuantLinear) for m in linears):
                weights = [self.input_layernorm.weight]
                for m in linears:
                    weights += [m.weight if m.weight is not None else m.blocks, m.bias]
                    if m is attn.o_proj:
                        weights.append(self.post_attention_layernorm.weight)
                formats = [m.format.code if isinstance(m, QuantLinear) else 0 for m in linears]
            self._native = (_structure[0], linears,
                            None if weights is None else kernels.LayerWeights(weights, formats))
        _, linears, packed = self._native
        if packed is None or attn._qkv is not None or mlp._gate_up is not None or torch.is_grad_enabled():
            return None
        if any(m._packed is not None for m in linears):
            return None
        if any(x.shape[0] > m.row_limit(x.dtype) for m in linears):
            return None
        if not packed.fit(x.dtype):
            return None
        first = linears[0]
        native = (first.native(x) if isinstance(first, QuantLinear)
                  else kernels.usable(x, first.weight, first.bias)) and kernels.rowwise_usable(x)
        return packed if native else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionBackend,
                rows: Tensor | None = None) -> Tensor:
        """Output rows ``rows`` only (all if None); the cache still gets every row's K/V. (A stack
        of layers that can run natively runs in ``CausalLM.forward``, not here.)"""
        a = self.self_attn(self.input_layernorm(x), cos, sin, attn, rows)
        if self.sandwich:
            x = (x if rows is None else x[rows]) + self.post_attention_layernorm(a)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        h, x = self.post_attention_layernorm.add(a, x if rows is None else x[rows])
        return x + self.mlp(h)


class DecoderModel(nn.Module):
    """Embeddings, layers and final norm (HF's ``model.`` prefix)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        # weights come from the checkpoint or init_random_: an uninitialised table, because
        # nn.Embedding's own init on the meta device imports torch._dynamo (1.1 s per start)
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size,
                                         _weight=torch.empty(spec.vocab_size, spec.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(i, spec) for i in range(spec.num_layers))
        gemma = spec.model_type == GEMMA
        self.norm = RMSNorm(spec.hidden_size, spec.config.get("rms_norm_eps", 1e-6), gemma)
        # Gemma multiplies the embeddings by sqrt(hidden), rounded to the weights' dtype (as HF)
        self.embed_scale = math.sqrt(spec.hidden_size) if gemma else None

    def embed(self, input_ids: Tensor) -> Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is None:
            return x
        return x * torch.tensor(self.embed_scale).to(x.dtype)


class CausalLM(nn.Module):
    """A decoder-only LM over flat tokens.

    ``forward(input_ids [T], positions [T], attn, logits_indices [N] | None) -> logits [N, vocab]``,
    fp32 in every model dtype (``LMHead``).
    Only the rows at ``logits_indices`` go through the last layer's o_proj and MLP, the final
    norm and the LM head: during generation that is one row per sequence, never [T, vocab] for
    a whole prompt (which for a 151,936-word vocabulary costs ~10x the KV cache). ``None``
    returns every position (the "naive" forward pass that ``measure`` compares against).
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        check_supported(spec)
        heads = {(layer.head_dim) for layer in spec.layers}
        if len(heads) != 1:
            raise UnsupportedModelError(f"{spec.name}: layers with different head_dim {sorted(heads)}")
        self.spec = spec
        self.config = spec.config
        self.model = DecoderModel(spec)
        self.lm_head = LMHead(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.head_dim = heads.pop()
        # Gemma 3's sliding layers rotate with their own base (inv_freq_local); all others share one
        self.local_rope = frozenset(i for i, layer in enumerate(spec.layers) if layer.kind == "sliding"
                                    ) if spec.model_type == GEMMA else frozenset()
        self.register_buffer("inv_freq", None, persistent=False)
        self.register_buffer("inv_freq_local", None, persistent=False)
        self.set_rope()
        self.eos_token_ids: tuple[int, ...] = ()  # filled by the loader (generation_config.json)
        self.invariant_rows: int | None = None  # deterministic mode's row block (set_batch_invariant)
        self.name = spec.name

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def prepack(self, max_bytes: int | None = None) -> int:
        """Give every linear layer a packed copy of its weight for faster inference (bf16 on
        CPU; a no-op elsewhere). Skipped when the copies would take more than ``max_bytes``.
        Returns the bytes the copies take. Never in deterministic mode (the probe that makes it
        safe ran on the plain layers)."""
        if not _can_prepack(self.lm_head.weight) or self.invariant_rows is not None:
            return 0
        linears = [m for m in self.modules() if isinstance(m, Linear) and not isinstance(m, LMHead)]
        need = sum(m.weight.numel() * m.weight.element_size() for m in linears)
        if max_bytes is not None and need > max_bytes and not self.is_packed():
            return 0
        done = 0
        for layer in self.model.layers:
            done += layer.self_attn.prepack() + layer.mlp.prepack()
        return done

    def is_packed(self) -> bool:
        """Every decoder layer's linear layers run from valid packed copies (the LM head never
        does: its logits stay fp32)."""
        packs = [p for layer in self.model.layers for p in (
            layer.self_attn._qkv, layer.self_attn.o_proj._packed, layer.mlp._gate_up,
            layer.mlp.down_proj._packed)]
        return all(p is not None and p.valid() for p in packs)

    def unpack(self) -> None:
        """Drop the packed copies (their memory); inference runs plain ``F.linear`` again."""
        self.lm_head.unpack()
        for layer in self.model.layers:
            layer.self_attn.unpack()
            layer.mlp.unpack()

    def set_batch_invariant(self, on: bool) -> None:
        """Deterministic mode on: packed copies are dropped and the probe (``check_linears``;
        BatchInvariantError, one line, where it finds nothing stable) finds the row block that
        makes PyTorch's GEMM rows stable; ``invariant_rows`` tells the attention backend that
        block. Linear layers then run every row count on the native kernel, which needs no
        padding (probed again to prove it), or, where it cannot run, pad their rows to the
        block. Off: the default kernels again."""
        linears = [m for m in self.modules() if isinstance(m, (Linear, QuantLinear))]
        for m in linears:  # probe the plain kernels (a second call must not probe padded ones)
            m.row_block, m.native_rows = 1, 0
        self.invariant_rows = None
        if not on:
            for m in linears:
                m.native_rows = None
            _restructured()
            return
        self.unpack()
        rows = check_linears(linears, self.dtype, self.device)
        self.invariant_rows = rows
        for m in linears:
            m.native_rows = sys.maxsize
        native_rows = check_linears(linears, self.dtype, self.device)
        for m in linears:
            m.row_block = native_rows
        _restructured()  # the row limits changed: a gathered native stack holds the old ones

    def tie_weights(self) -> None:
        if not self.spec.tie_word_embeddings:
            return
        embed = self.model.embed_tokens
        if isinstance(embed, QuantEmbedding):
            self.lm_head = embed.as_linear()  # type: ignore[assignment]
        else:
            self.lm_head.weight = embed.weight

    def set_rope(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the RoPE inverse frequencies in float32, on ``device`` (None: the current
        default device; a model built on the meta device gets real ones here)."""
        self.inv_freq = inv_frequencies(self.config, self.head_dim).to(device)
        if self.local_rope:
            self.inv_freq_local = inv_frequencies(self.config, self.head_dim, "sliding_attention").to(device)

    def rope(self, positions: Tensor, dtype: torch.dtype, local: bool = False) -> tuple[Tensor, Tensor]:
        """cos/sin [T, head_dim] for these positions: computed in float32, then cast (as HF).
        ``local``: with the sliding layers' own base (Gemma 3)."""
        inv = self.inv_freq_local if local else self.inv_freq
        freqs = positions[:, None].float() * inv.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend,
                logits_indices: Tensor | None = None) -> Tensor:
        x = self.model.embed(input_ids)
        ropes = [self.rope(positions, x.dtype)]
        if self.local_rope:
            ropes.append(self.rope(positions, x.dtype, local=True))
        layers = self.model.layers
        # the last layer computes only the rows that want logits, which the native stack cannot
        native = self.native_stack(x, attn, len(layers) - (logits_indices is not None))
        done = 0
        if native is not None:
            x = kernels.decoder_layers(x, *native, *ropes[0])
            done = len(native[0])
        for i in range(done, len(layers)):
            # The last layer's o_proj and MLP run only where logits are wanted: the other rows
            # only had to leave their K/V in the cache.
            x = layers[i](x, *ropes[i in self.local_rope], attn, logits_indices if i == len(layers) - 1 else None)
        return self.lm_head(self.model.norm(x))

    # (key, the stack or None where some layer cannot run natively, the least row_limit of the
    # layers' linears, (attention layer index, heads) each): see native_stack
    _stack: tuple[tuple, kernels.LayerStack | None, int, tuple[tuple[int, int], ...]] | None = None

    def native_stack(self, x: Tensor, attn: AttentionBackend, count: int
                     ) -> tuple[kernels.LayerStack, kernels.CacheLayout, list[kernels.StepRows]] | None:
        """The first ``count`` layers as one ``kvlab.kernels.decoder_layers`` call on x, with
        their caches and this step's rows, when every one of them can run natively
        (``DecoderLayer.native_weights``) and the backend lays them out (``NativeAttention``).
        The stack is gathered once per structure (``_structure``: deterministic mode's row
        limits bump it too), dtype and device; each step checks only what a step can change: the
        rows, autograd, a weight moved. (Why it matters:
        Python run between steps finds its objects evicted by the weights just streamed, so each
        check costs several times its cost in a loop.)"""
        layout = getattr(attn, "native_layout", None)  # NativeAttention (isinstance on a Protocol is slow)
        if layout is None or not count or self.local_rope or torch.is_grad_enabled():
            return None
        key = (_structure[0], x.dtype, x.device, count)
        cached = self._stack
        if cached is not None and cached[0] == key and not (cached[1] is not None and cached[1].moved()):
            if x.shape[0] > cached[2]:
                return None
        else:
            layers = list(self.model.layers)[:count]  # (a ModuleList slice registers its modules anew)
            limit = min(m.row_limit(x.dtype) for layer in layers for m in layer.linears())
            if x.shape[0] > limit:
                return None  # before gathering: native_weights would refuse these rows, not the layers
            weights = [layer.native_weights(x) for layer in layers]
            stack = None
            if all(w is not None for w in weights):
                stack = kernels.LayerStack([(w, layer.self_attn.num_heads, layer.self_attn.kv_heads,
                                             layer.input_layernorm.eps) for w, layer in zip(weights, layers)])
            cached = self._stack = (key, stack, limit, tuple((layer.self_attn.layer_idx, layer.self_attn.num_heads)
                                                             for layer in layers))
        stack = cached[1]
        where = None if stack is None else layout(cached[3], x.dtype)
        return None if where is None or stack is None else (stack, *where)
