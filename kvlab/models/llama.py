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

import copy
import functools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvlab import dispatch, kernels
from kvlab.dispatch import Backends
from kvlab.kernels.onednn import PackedWeights
from kvlab.models import methods
from kvlab.models.attention import AttentionBackend
from kvlab.models.invariant import check_attention, check_linears
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


class Linear(nn.Linear):
    """nn.Linear whose inference runs by ``method`` (``kvlab.models.methods``), which
    ``CausalLM.use`` chooses: oneDNN's packed copy (bf16 where oneDNN has bf16 kernels), kvlab's
    native kernel up to a row count, or PyTorch's ``F.linear`` (its rows padded in deterministic
    mode). A layer no model has set up runs plain ``F.linear``."""

    method: methods.LinearMethod = methods.Gemm()

    def choose(self, setting: methods.Setting, packed: PackedWeights | None = None) -> None:
        gemm = setting.gemm(self.weight.dtype)
        if packed is not None:
            self.method = methods.Packed(packed)
        elif (rows := setting.rows(self.weight.dtype)) and _native_fits(self.weight, self.bias):
            self.method = methods.Native(rows, gemm)
        else:
            self.method = gemm

    def forward(self, x: Tensor) -> Tensor:
        return self.method(x, self.weight, self.bias)


def _native_fits(weight: Tensor, bias: Tensor | None) -> bool:
    """Does kvlab's linear kernel take this weight and bias (contiguous, one dtype)?"""
    return weight.is_contiguous() and (bias is None or (bias.dtype == weight.dtype and bias.is_contiguous()
                                                        and bias.shape == weight.shape[:1]))


class LMHead(Linear):
    """The LM head: fp32 logits whatever the model's dtype, as llama.cpp keeps them and vLLM
    samples them. A bf16 head sums in fp32 and never rounds the logits to bf16, whose values
    near 15-20 are 0.125 apart: rounded, a near-tie becomes an exact tie that goes to the lower
    token id (the first token of the README's chat question in bf16 did). The weight stays in
    the model's dtype (tied: it is the embedding). Never packed: oneDNN's packed bf16 matmul
    returns bf16."""

    def choose(self, setting: methods.Setting, packed: PackedWeights | None = None) -> None:
        dtype = self.weight.dtype
        if dtype == torch.float32:
            super().choose(setting)
        elif setting.rowwise and dtype == torch.bfloat16 and _native_fits(self.weight, self.bias):
            # every row count: the kernel's rows never depend on the batch
            self.method = methods.Native(sys.maxsize, setting.gemm(dtype), fp32_out=True)
        else:
            self.method = methods.SlicedFp32(setting.gemm(torch.float32))


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, as in HF (bit-for-bit).
    ``offset`` (Gemma): the scale is (1 + weight), applied in float32 before the cast, as in
    HF's Gemma3RMSNorm; the native kernel computes only the plain form (``choose``)."""

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset

    native = False  # by kvlab's kernel (``choose``)

    def choose(self, setting: methods.Setting) -> None:
        self.native = native = setting.rowwise and not self.offset
        self._norm = self._native if native else self._torch  # type: ignore[method-assign]
        self._norm_add = self._native_add if native else self._torch_add  # type: ignore[method-assign]

    def forward(self, x: Tensor) -> Tensor:
        return self._norm(x)

    def add(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(this norm of h, h) with h = x + residual: one pass where the native kernel runs."""
        return self._norm_add(x, residual)

    def _native(self, x: Tensor) -> Tensor:
        return kernels.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps)[0].view(x.shape)

    def _native_add(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        return kernels.rms_norm(x, self.weight, self.eps, residual)

    def _torch(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x32 * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)

    def _torch_add(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        h = x + residual
        return self._torch(h), h

    _norm, _norm_add = _torch, _torch_add  # until a model chooses


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, D]; cos/sin [T, D] (already in x's dtype)."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


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

    def choose(self, setting: methods.Setting, pack: bool) -> None:
        """q/k/v as one packed matmul (``pack``) or three layers; RoPE by the native kernel
        (in place, one call for seven ops) or PyTorch's ops."""
        qkv = (self.q_proj, self.k_proj, self.v_proj)
        self._qkv = _packed(qkv) if pack else None
        for m in qkv:
            m.choose(setting)
        self.o_proj.choose(setting, _packed((self.o_proj,)) if pack else None)
        if self.qk_norm:
            self.q_norm.choose(setting)
            self.k_norm.choose(setting)
        self._rope = kernels.rope_ if setting.rowwise else apply_rope

    _qkv: PackedWeights | None = None  # q/k/v stacked: one matmul
    _rope = staticmethod(apply_rope)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionBackend,
                rows: Tensor | None = None) -> Tensor:
        """Every row's K/V goes to the cache; the output is for ``rows`` only (all if None)."""
        t, h, kvh, d = x.shape[0], self.num_heads, self.kv_heads, self.head_dim
        if self._qkv is not None:
            qkv = self._qkv(x)
            qk, v = qkv[:, :(h + kvh) * d].view(t, h + kvh, d), qkv[:, (h + kvh) * d:]
        else:
            qk, v = None, self.v_proj(x)
        v = v.view(t, kvh, d)
        if qk is not None and not self.qk_norm:
            # RoPE is elementwise: one pass over q and k side by side gives the same values
            q, k = self._rope(qk, cos, sin).split((h, kvh), 1)
        else:
            q, k = (qk.split((h, kvh), 1) if qk is not None
                    else (self.q_proj(x).view(t, h, d), self.k_proj(x).view(t, kvh, d)))
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        out = attn.attend(self.layer_idx, q, k, v).reshape(t, self.num_heads * self.head_dim)
        return self.o_proj(out if rows is None else out[rows])


def _packed(linears: tuple[Linear, ...]) -> PackedWeights:
    return PackedWeights([m.weight for m in linears], [m.bias for m in linears])


def act_mul(act: Callable[[Tensor], Tensor], gate: Tensor, up: Tensor) -> Tensor:
    """act(gate) * up, the product written over the activation (a fresh tensor)."""
    return act(gate).mul_(up)


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (silu), or Gemma's GeGLU (``gelu_pytorch_tanh``)."""

    def __init__(self, hidden: int, inter: int, bias: bool, act: str = "silu") -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=bias)
        self.up_proj = Linear(hidden, inter, bias=bias)
        self.down_proj = Linear(inter, hidden, bias=bias)
        self.act = act

    def choose(self, setting: methods.Setting, pack: bool) -> None:
        """gate/up as one packed matmul (``pack``) or two layers; SwiGLU's product by the native
        kernel where it runs (in place on the fresh projections: no extra [T, inter] buffers)."""
        self._gate_up = _packed((self.gate_proj, self.up_proj)) if pack else None
        for m in (self.gate_proj, self.up_proj):
            m.choose(setting)
        self.down_proj.choose(setting, _packed((self.down_proj,)) if pack else None)
        act = ACTIVATIONS[self.act]
        native = setting.rowwise and act is F.silu and not pack
        self._act_mul = kernels.silu_mul_ if native else functools.partial(act_mul, act)

    _gate_up: PackedWeights | None = None  # gate/up stacked: one matmul
    _act_mul = staticmethod(functools.partial(act_mul, F.silu))

    def forward(self, x: Tensor) -> Tensor:
        if self._gate_up is not None:
            gate, up = self._gate_up(x).split(self._gate_up.sizes, -1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self._act_mul(gate, up))


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

    def linears(self) -> tuple[Linear | QuantLinear, ...]:
        """q, k, v, o, gate, up, down: the order ``kernels.LayerWeights`` takes them in."""
        attn, mlp = self.self_attn, self.mlp
        return (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)

    def choose(self, setting: methods.Setting, pack: bool) -> None:
        self.self_attn.choose(setting, pack)
        self.mlp.choose(setting, pack)
        for norm in self.children():
            if isinstance(norm, RMSNorm):
                norm.choose(setting)

    def native_weights(self, dtype: torch.dtype) -> tuple[kernels.LayerWeights, int] | None:
        """The weights ``kvlab.kernels.decoder_layers`` takes and the most rows it may run, when
        it can run this layer exactly as these modules would: Llama form (no q/k norms, no
        sandwich), every linear layer and norm on a native kernel (no packed copies, no
        tensor-parallel linears)."""
        attn = self.self_attn
        linears = self.linears()
        if self.sandwich or attn.qk_norm or not all(type(m) in (Linear, QuantLinear) for m in linears):
            return None
        chosen = [m.method for m in linears]
        if not all(isinstance(c, (methods.Native, methods.NativeStored)) for c in chosen):
            return None
        if not (self.input_layernorm.native and self.post_attention_layernorm.native):
            return None
        weights = [self.input_layernorm.weight]
        for m in linears:
            weights += [m.weight if m.weight is not None else m.blocks, m.bias]
            if m is attn.o_proj:
                weights.append(self.post_attention_layernorm.weight)
        formats = [c.code if isinstance(c, methods.NativeStored) else 0 for c in chosen]  # ACT8 flag included
        packed = kernels.LayerWeights(weights, formats)
        if not packed.fit(dtype):
            return None
        return packed, min(c.rows for c in chosen)  # type: ignore[union-attr]

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


@dataclass(frozen=True)
class WeightsSource:
    """Where a model's weights came from, for what must name them (the prefix tiers' keys): the
    files read, or a random init's config and seed; and the GGUF types held as stored."""

    files: tuple[Path, ...] = ()
    random: str = ""  # JSON of the config and seed of random weights
    stored: tuple[str, ...] = ()


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
        self.source: WeightsSource | None = None  # filled by the loader
        # the matmuls' inputs: "fp32" (exact) or "int8" (kvlab.models.methods: the stored
        # 32-weight-block layers' rows quantised); set by the loader, read by use()
        self.activations = "fp32"
        self.invariant_rows: int | None = None  # deterministic mode's row block (use)
        self._use: tuple[Backends, bool, int] | None = None  # use()'s arguments, for .to()
        self._stacks: dict[int, NativeStack] = {}  # layers run as one native call, by count (use)
        self.name = spec.name

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def use(self, backends: Backends | None = None, *, deterministic: bool = False, pack_bytes: int = 0) -> None:
        """Choose how every layer runs, once (a forward pass never asks again), from what runs
        here (``backends``: by default ``kvlab.dispatch.backends()``), this model's dtype and
        device, and the mode:

        - ``deterministic``: batch-invariant mode. Probes (BatchInvariantError, one line, where
          they find nothing stable) find the row block that makes PyTorch's batched matmul rows
          stable on the attention's shapes (``check_attention``: ``invariant_rows``, for the
          attention backend), then check the linear layers (``check_linears``): they run every
          row count on the native kernel, which needs no padding, or, where it cannot run, pad
          their rows to the block the probe finds for their GEMM.
        - ``pack_bytes``: give the linear layers oneDNN-packed copies of their bf16 weights
          (where oneDNN has bf16 kernels; q/k/v and gate/up stacked as one matmul each) if the
          copies fit in these bytes; never in deterministic mode (the probe ran on the plain layers).

        The model is inference-only: its parameters stop requiring gradients. Building or
        loading a model calls this; ``.to()`` calls it again with the same arguments. Whoever
        replaces or edits weights otherwise calls it again."""
        backends = backends or dispatch.backends()
        self._use = (backends, deterministic, pack_bytes)
        self.requires_grad_(False)
        dtype, device = self.dtype, self.device
        layers: list[DecoderLayer] = list(self.model.layers)
        self.invariant_rows = None
        if deterministic:
            linears = [m for m in self.modules() if isinstance(m, (Linear, QuantLinear))]
            act = self.activations
            self.invariant_rows = check_attention({la.head_dim for la in self.spec.layers if la.head_dim}, device)
            self._choose(methods.Setting(backends, dtype, device, native_rows=sys.maxsize, activations=act), False)
            row_block, row_calls = check_linears(linears, dtype, device)
            setting = methods.Setting(backends, dtype, device, native_rows=sys.maxsize, row_block=row_block,
                                      row_calls=row_calls, activations=act)
            self._choose(setting, False)
        else:
            dense = [m for layer in layers for m in layer.linears()]
            pack = (bool(backends.onednn_bf16) and dtype == torch.bfloat16 and device.type == "cpu"
                    and all(isinstance(m, Linear) for m in dense)
                    and sum(m.weight.numel() * m.weight.element_size() for m in dense) <= pack_bytes)
            self._choose(methods.Setting(backends, dtype, device, activations=self.activations), pack)
        # the decoder layers as one native call each step: all L of them, or the first L - 1
        # (a step that wants logits from some rows only runs the last layer by its modules)
        self._stacks = {}
        if self.local_rope or device.type != "cpu":
            return
        native = [layer.native_weights(dtype) for layer in layers]
        for count in (len(layers), len(layers) - 1):
            if count and all(w is not None for w in native[:count]):
                self._stacks[count] = NativeStack(layers[:count], native[:count])  # type: ignore[arg-type]

    def _choose(self, setting: methods.Setting, pack: bool) -> None:
        for m in self.modules():
            if isinstance(m, DecoderLayer):
                m.choose(setting, pack)
        self.model.norm.choose(setting)
        if isinstance(self.model.embed_tokens, QuantEmbedding):
            self.model.embed_tokens.choose(setting)
        self.lm_head.choose(setting)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """``.to()``, ``.float()``...: then the layers choose again for the new dtype or device."""
        out = super()._apply(fn, recurse)
        self._choose_again()
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> "CausalLM":
        """A copy (a tensor-parallel shard is cut from one) chooses again from its own tensors:
        the native stacks hold raw pointers into this model's, which cannot be copied."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        stacks, self._stacks = self._stacks, {}
        try:
            copied.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items()})
        finally:
            self._stacks = stacks
        copied._choose_again()
        return copied

    def _choose_again(self) -> None:
        if self._use is not None:
            backends, deterministic, pack_bytes = self._use
            self.use(backends, deterministic=deterministic, pack_bytes=pack_bytes)

    def prepack(self, max_bytes: int) -> int:
        """``use`` again with packed copies allowed up to ``max_bytes`` (bf16 on a CPU with oneDNN's
        bf16 kernels; a no-op elsewhere and in deterministic mode). Returns the bytes they take."""
        backends, deterministic, _ = self._use or (dispatch.backends(), False, 0)
        if not deterministic:
            self.use(backends, pack_bytes=max_bytes)
        return self.packed_bytes()

    def packed_bytes(self) -> int:
        """Bytes of the packed weight copies the layers run from (0: none)."""
        total = 0
        for layer in self.model.layers:
            for p in (layer.self_attn._qkv, layer.mlp._gate_up):
                total += p.nbytes if p is not None else 0
            for m in (layer.self_attn.o_proj, layer.mlp.down_proj):
                total += m.method.packed.nbytes if isinstance(m.method, methods.Packed) else 0
        return total

    def is_packed(self) -> bool:
        """Every decoder layer's linear layers run from packed copies (the LM head never does:
        its logits stay fp32)."""
        return all(layer.self_attn._qkv is not None and layer.mlp._gate_up is not None
                   and isinstance(layer.self_attn.o_proj.method, methods.Packed)
                   and isinstance(layer.mlp.down_proj.method, methods.Packed) for layer in self.model.layers)

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
        native = self._native_layers(x, attn, len(layers) - (logits_indices is not None), ropes[0])
        x, done = native if native is not None else (x, 0)
        for i in range(done, len(layers)):
            # The last layer's o_proj and MLP run only where logits are wanted: the other rows
            # only had to leave their K/V in the cache.
            x = layers[i](x, *ropes[i in self.local_rope], attn, logits_indices if i == len(layers) - 1 else None)
        return self.lm_head(self.model.norm(x))

    def _native_layers(self, x: Tensor, attn: AttentionBackend, count: int,
                       rope: tuple[Tensor, Tensor]) -> tuple[Tensor, int] | None:
        """The first ``count`` layers as one ``kvlab.kernels.decoder_layers`` call, when ``use``
        found them all native, the step's rows are within their kernels' limit, and the backend
        lays their caches out for it (``native_layout``: the paged engine's). Returns (their
        output, count), else None: the modules run them."""
        stack = self._stacks.get(count)
        layout = getattr(attn, "native_layout", None)  # NativeAttention (isinstance on a Protocol is slow)
        if stack is None or layout is None or x.shape[0] > stack.rows:
            return None
        if stack.weights.moved():  # a weight replaced behind use()'s back (``.data =``): choose again
            self._choose_again()
            return self._native_layers(x, attn, count, rope)
        where = layout(stack.heads, x.dtype)
        if where is None:
            return None
        return kernels.decoder_layers(x, stack.weights, *where, *rope), count


class NativeStack:
    """Decoder layers that ``kvlab.kernels.decoder_layers`` runs as one call: their weights
    (gathered once, by ``CausalLM.use``), the most rows their kernels take, and each one's
    (attention layer index, heads) for the backend's cache layout."""

    def __init__(self, layers: list[DecoderLayer], native: list[tuple[kernels.LayerWeights, int]]) -> None:
        self.weights = kernels.LayerStack([(w, layer.self_attn.num_heads, layer.self_attn.kv_heads,
                                            layer.input_layernorm.eps) for (w, _), layer in zip(native, layers)])
        self.rows = min(rows for _, rows in native)
        self.heads = tuple((layer.self_attn.layer_idx, layer.self_attn.num_heads) for layer in layers)
