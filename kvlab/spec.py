"""config.json -> ModelSpec: the one description of a model's layers that everything else reads.

The planner sizes caches from it, the runtime builds layers from it, the engine allocates blocks
from it and `measure` compares the tensors it finds against it. Each layer records what its cache
holds per token (vectors of K, V or an MLA latent) and what fixed state it keeps per sequence
(SSM / linear-attention layers); parameter counts are derived from the same fields.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from kvlab.dtypes import GGUF_AS_STORED, StorageDtype, kv_dtype

LayerKind = Literal["full", "sliding", "chunked", "mla", "ssm", "none"]


class ConfigError(ValueError):
    """A config that kvlab cannot read or that contradicts itself."""


def rank_kv_heads(kv_heads: int, tp: int) -> int:
    """KV heads each of `tp` tensor-parallel ranks holds: an even split, and past kv_heads ranks
    one whole head each (replicated: a rank needs the head its query heads read, as in vLLM)."""
    return max(1, kv_heads // tp)


@dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer caches.

    kv_vectors: (count, length) pairs of vectors cached per token, e.g. K and V of each KV head
    ((kv_heads, head_dim), (kv_heads, v_head_dim)) or one MLA latent ((1, rank + rope_dim)).
    state_elems: elements of fixed per-sequence state (conv + recurrent state of SSM layers).
    """

    kind: LayerKind
    mixer: str  # attention | mla | mamba | mamba2 | gated_deltanet | mlp
    num_heads: int = 0  # query heads; for SSM layers the units tensor parallelism splits
    kv_heads: int = 0
    head_dim: int = 0
    v_head_dim: int = 0
    window: int | None = None  # sliding window / chunk size in tokens
    kv_vectors: tuple[tuple[int, int], ...] = ()
    state_elems: int = 0

    @property
    def has_kv(self) -> bool:
        return bool(self.kv_vectors)

    def kv_bytes_per_token(self, dtype: StorageDtype) -> int:
        return sum(n * dtype.vector_bytes(length) for n, length in self.kv_vectors)

    def cached_tokens(self, context: int, kept: int | None = None) -> int:
        """Tokens this layer must hold for a sequence of `context` tokens; ``kept``: the tokens an
        eviction policy leaves the full-attention layers (sliding and chunked ones keep their window)."""
        if self.kind == "sliding" and self.window:
            return min(context, self.window)
        if self.kind == "chunked" and self.window:
            return min(context, self.window)
        if not self.has_kv:
            return 0
        return context if kept is None else min(context, kept)

    def tp_shard(self, tp: int) -> LayerSpec:
        """The part of this layer one of `tp` tensor-parallel ranks holds: its query heads, its
        KV heads (``rank_kv_heads``), an MLA latent whole (every head reads all of it), SSM
        state split with the SSM heads."""
        if self.kind == "mla":
            return self
        if not self.has_kv:
            return replace(self, num_heads=self.num_heads // tp, state_elems=self.state_elems // tp)
        kv = rank_kv_heads(self.kv_heads, tp)
        return replace(self, num_heads=self.num_heads // tp, kv_heads=kv,
                       kv_vectors=tuple((kv, length) for _, length in self.kv_vectors))


@dataclass(frozen=True)
class Matrix:
    """A group of identical weight matrices: `count` in the model, `active` used per token."""

    name: str
    rows: int
    cols: int
    count: int
    active: int
    quantizable: bool = True  # embeddings stay 16-bit in every serving stack

    @property
    def params(self) -> int:
        return self.rows * self.cols * self.count


@dataclass(frozen=True)
class StoredWeights:
    """What a checkpoint file holds on disk (a GGUF's quantised tensors): bytes and formats; and
    what kvlab's engine holds running the file on the CPU (``--weights auto``, fp32): its
    matrices in ``GGUF_AS_STORED`` types as in the file, every other tensor dense in fp32."""

    bytes: int
    formats: dict[str, int] = field(compare=False)  # storage type (Q4_1, Q8_0, F32...) -> tensors
    held_bytes: int  # the engine's: kvlab.models.weights.held_bytes of the file loaded on the CPU

    @property
    def as_stored(self) -> tuple[str, ...]:
        """The file's types that kvlab's engine runs as stored, by name (``("Q4_1", "Q8_0")``)."""
        return tuple(sorted(set(self.formats) & set(GGUF_AS_STORED)))

    def describe(self) -> str:
        return ", ".join(f"{n} {k}" for k, n in sorted(self.formats.items(), key=lambda kv: -kv[1]))


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_type: str
    architecture: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    layers: tuple[LayerSpec, ...]
    matrices: tuple[Matrix, ...]
    other_params: int  # norms, biases, SSM vectors: kept in 16-bit
    config: dict[str, Any] = field(repr=False, compare=False)
    torch_dtype: str = "bfloat16"
    notes: tuple[str, ...] = ()
    stored_weights: StoredWeights | None = None  # set for checkpoint files that say (GGUF)
    weights_format: str | None = None  # the linear layers' format (kvlab.dtypes.WEIGHT_DTYPES key)
    # that the checkpoint's quantization_config names; None: unquantised

    # --- cache -------------------------------------------------------------------------
    def kv_bytes_per_token(self, dtype: str | StorageDtype = "bf16") -> int:
        d = kv_dtype(dtype) if isinstance(dtype, str) else dtype
        return sum(layer.kv_bytes_per_token(d) for layer in self.layers)

    def kv_bytes_per_sequence(self, context: int, dtype: str | StorageDtype = "bf16",
                              state_bytes_per_elem: int = 2) -> int:
        """Cache of one sequence of `context` tokens: windows capped, SSM state fixed."""
        d = kv_dtype(dtype) if isinstance(dtype, str) else dtype
        return sum(
            layer.kv_bytes_per_token(d) * layer.cached_tokens(context)
            + layer.state_elems * state_bytes_per_elem
            for layer in self.layers
        )

    def tp_shard(self, tp: int) -> ModelSpec:
        """The layers one of `tp` tensor-parallel ranks holds (``LayerSpec.tp_shard``): its
        cache per token is what that rank allocates. Parameters stay the whole model's."""
        return self if tp == 1 else replace(self, layers=tuple(layer.tp_shard(tp) for layer in self.layers))

    def layer_kinds(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for layer in self.layers:
            key = f"sliding({layer.window})" if layer.kind == "sliding" else layer.kind
            counts[key] = counts.get(key, 0) + 1
        return counts

    def kv_fixed_bytes(self, dtype: str | StorageDtype = "bf16") -> int:
        """Per-tensor scales, whatever the length: one per cached tensor of each layer (K and V;
        MLA's single latent), for formats that keep them (fp8)."""
        d = kv_dtype(dtype) if isinstance(dtype, str) else dtype
        return d.fixed_bytes_per_tensor * sum(len(layer.kv_vectors) for layer in self.layers)

    @property
    def attention_layers(self) -> list[LayerSpec]:
        return [layer for layer in self.layers if layer.has_kv]

    # --- parameters --------------------------------------------------------------------
    @property
    def num_params(self) -> int:
        return sum(m.params for m in self.matrices) + self.other_params

    @property
    def active_params(self) -> int:
        """Parameters one token's forward pass touches (MoE: only routed experts)."""
        return sum(m.rows * m.cols * m.active for m in self.matrices) + self.other_params

    @property
    def num_kv_heads(self) -> int:
        """KV heads of the attention layers (the largest, for tensor-parallel limits)."""
        return max((layer.kv_heads for layer in self.layers if layer.kind != "mla"), default=0)

    @property
    def is_mla(self) -> bool:
        return any(layer.kind == "mla" for layer in self.layers)


# ---------------------------------------------------------------------------------------
# Reading configs
# ---------------------------------------------------------------------------------------

# Defaults that Hugging Face's config classes apply when a field is absent.
_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {
        "vocab_size": 262208, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
        "max_position_embeddings": 131072, "sliding_window_pattern": 6,
        "tie_word_embeddings": True, "head_dim": 256, "sliding_window": 4096,
    },
    "gemma2": {"tie_word_embeddings": True, "head_dim": 256},
    "gemma": {"tie_word_embeddings": True, "head_dim": 256},
}

KNOWN_TYPES = {
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next",
    "deepseek_v2", "deepseek_v3", "kimi_k2", "gemma", "gemma2", "gemma3", "gemma3_text", "gpt_oss",
    "phi3", "jamba", "nemotron_h", "falcon_mamba", "mamba", "olmo2", "olmo",
}


def _weights_format(cfg: dict) -> tuple[str | None, str | None]:
    """(the WEIGHT_DTYPES key of the format the checkpoint's quantization_config names, or None;
    a note when it names one kvlab does not read). Looked for beside text_config too (Gemma 3)."""
    q = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")
    if not isinstance(q, dict):
        return None, None
    method, bits = str(q.get("quant_method", "")).lower(), q.get("bits")
    if method in ("fp8", "mxfp4"):
        return method, None
    if method in ("gptq", "awq") and bits in (4, 8):
        return f"int{bits}", None
    if method == "bitsandbytes" and (q.get("load_in_4bit") or q.get("load_in_8bit")):
        return ("int4" if q.get("load_in_4bit") else "int8"), None
    return None, (f"quantization_config names {method or 'no quant_method'}"
                  f"{f' ({bits} bits)' if bits else ''}, which kvlab does not read: weights "
                  f"planned in bf16 (--weights-dtype to choose)")


def _positive_int(cfg: dict, key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise ConfigError(f"config.json lacks {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def _text_config(cfg: dict) -> tuple[dict, list[str]]:
    """Multimodal wrappers (Gemma 3) keep the decoder in text_config; fill HF's defaults."""
    notes: list[str] = []
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        text = dict(cfg["text_config"])
        text.setdefault("architectures", cfg.get("architectures"))
        text.setdefault("torch_dtype", cfg.get("torch_dtype"))
        cfg = text
    mtype = cfg.get("model_type", "")
    if mtype == "gemma3":
        mtype = "gemma3_text"
    defaults = _TYPE_DEFAULTS.get(mtype, {})
    filled = [k for k in defaults if k not in cfg]
    if filled:
        notes.append(f"{mtype} defaults used for: {', '.join(filled)}")
    return {**defaults, **cfg, "model_type": mtype}, notes


def _layer_types(cfg: dict, n: int, mtype: str) -> list[str]:
    """Per-layer attention type names in HF's vocabulary (full_attention, sliding_attention...)."""
    if cfg.get("layer_types"):
        types = list(cfg["layer_types"])
        if len(types) != n:
            raise ConfigError(f"config.json: layer_types has {len(types)} entries for {n} layers")
        return types
    if mtype == "gemma2":
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if mtype == "gemma3_text":
        pattern = cfg.get("sliding_window_pattern", 6)
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    if mtype == "qwen3_next":
        every = cfg.get("full_attention_interval", 4)
        return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    if mtype == "jamba":
        period, offset = cfg.get("attn_layer_period", 8), cfg.get("attn_layer_offset", 4)
        return ["full_attention" if i % period == offset else "mamba" for i in range(n)]
    if mtype == "nemotron_h":
        pattern = cfg.get("hybrid_override_pattern", "")
        if len(pattern) != n:
            raise ConfigError(f"config.json: hybrid_override_pattern has {len(pattern)} layers, "
                              f"num_hidden_layers is {n}")
        names = {"M": "mamba2", "*": "full_attention", "-": "mlp", "E": "moe"}
        bad = set(pattern) - set(names)
        if bad:
            raise ConfigError(f"config.json: unknown layer symbols {sorted(bad)} in hybrid_override_pattern")
        return [names[c] for c in pattern]
    if mtype in ("falcon_mamba", "mamba"):
        return ["mamba"] * n
    if cfg.get("attention_chunk_size") and cfg.get("no_rope_layers"):
        return ["chunked_attention" if r else "full_attention" for r in cfg["no_rope_layers"]]
    window = cfg.get("sliding_window")
    uses_window = cfg.get("use_sliding_window", mtype not in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"))
    if window and uses_window and window < cfg.get("max_position_embeddings", math.inf):
        return ["sliding_attention"] * n
    return ["full_attention"] * n


def _mamba_layer(cfg: dict, hidden: int, mtype: str) -> tuple[LayerSpec, list[Matrix], int]:
    """Mamba-1 (Jamba, falcon-mamba): conv state (d_conv-1) x d_inner + SSM state d_inner x d_state."""
    if mtype == "jamba":
        d_inner = cfg.get("mamba_expand", 2) * hidden
        d_state, d_conv = cfg.get("mamba_d_state", 16), cfg.get("mamba_d_conv", 4)
        dt_rank = cfg.get("mamba_dt_rank", math.ceil(hidden / 16))
        conv_bias, proj_bias = cfg.get("mamba_conv_bias", True), cfg.get("mamba_proj_bias", False)
        extra = dt_rank + 2 * d_state  # dt/B/C layer norms
    else:
        d_inner = cfg.get("intermediate_size") or cfg.get("expand", 2) * hidden
        d_state, d_conv = cfg.get("state_size", 16), cfg.get("conv_kernel", 4)
        dt_rank = cfg.get("time_step_rank", math.ceil(hidden / 16))
        conv_bias, proj_bias = cfg.get("use_conv_bias", True), cfg.get("use_bias", False)
        extra = 0
    mats = [
        Matrix("mamba.in_proj", 2 * d_inner, hidden, 1, 1),
        Matrix("mamba.x_proj", dt_rank + 2 * d_state, d_inner, 1, 1),
        Matrix("mamba.dt_proj", d_inner, dt_rank, 1, 1),
        Matrix("mamba.out_proj", hidden, d_inner, 1, 1),
    ]
    other = (d_inner * d_conv + (d_inner if conv_bias else 0) + d_inner  # conv, dt_proj bias
             + d_inner * d_state + d_inner + extra  # A_log, D
             + (2 * d_inner + hidden if proj_bias else 0))
    state = (d_conv - 1) * d_inner + d_inner * d_state
    return LayerSpec("ssm", "mamba", num_heads=d_inner, state_elems=state), mats, other


def _mamba2_layer(cfg: dict, hidden: int) -> tuple[LayerSpec, list[Matrix], int]:
    """Mamba-2 (Nemotron-H): heads x head_dim x d_state recurrent state + conv state."""
    heads, head_dim = cfg["mamba_num_heads"], cfg["mamba_head_dim"]
    d_state, groups, d_conv = cfg["ssm_state_size"], cfg.get("n_groups", 1), cfg.get("conv_kernel", 4)
    d_inner = heads * head_dim
    conv_dim = d_inner + 2 * groups * d_state
    mats = [
        Matrix("mamba2.in_proj", 2 * d_inner + 2 * groups * d_state + heads, hidden, 1, 1),
        Matrix("mamba2.out_proj", hidden, d_inner, 1, 1),
    ]
    other = conv_dim * d_conv + (conv_dim if cfg.get("use_conv_bias", True) else 0) + 3 * heads + d_inner
    state = (d_conv - 1) * conv_dim + heads * head_dim * d_state
    return LayerSpec("ssm", "mamba2", num_heads=heads, state_elems=state), mats, other


def _deltanet_layer(cfg: dict, hidden: int) -> tuple[LayerSpec, list[Matrix], int]:
    """Gated DeltaNet (Qwen3-Next): v_heads x k_dim x v_dim recurrent state + conv state."""
    kh, kd = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    vh, vd = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    d_conv = cfg.get("linear_conv_kernel_dim", 4)
    key_dim, value_dim = kh * kd, vh * vd
    conv_dim = 2 * key_dim + value_dim
    mats = [
        Matrix("deltanet.in_proj_qkvz", 2 * key_dim + 2 * value_dim, hidden, 1, 1),
        Matrix("deltanet.in_proj_ba", 2 * vh, hidden, 1, 1),
        Matrix("deltanet.out_proj", hidden, value_dim, 1, 1),
    ]
    other = conv_dim * d_conv + 2 * vh + vd
    state = (d_conv - 1) * conv_dim + vh * kd * vd
    return LayerSpec("ssm", "gated_deltanet", num_heads=kh, state_elems=state), mats, other


def _attention_layer(cfg: dict, hidden: int, mtype: str, ltype: str
                     ) -> tuple[LayerSpec, list[Matrix], int]:
    heads = _positive_int(cfg, "num_attention_heads")
    if mtype == "nemotron_h":
        head_dim = cfg.get("attention_head_dim") or hidden // heads
    else:
        head_dim = cfg.get("head_dim") or hidden // heads
    if not cfg.get("head_dim") and mtype != "nemotron_h" and hidden % heads:
        raise ConfigError(f"config.json: hidden_size {hidden} is not divisible by "
                          f"num_attention_heads {heads} and no head_dim is given")
    kv_heads = cfg.get("num_key_value_heads") or heads
    if kv_heads > heads or heads % kv_heads:
        raise ConfigError(f"config.json: num_attention_heads {heads} is not a multiple of "
                          f"num_key_value_heads {kv_heads}")
    kind: LayerKind = {"sliding_attention": "sliding", "chunked_attention": "chunked"}.get(ltype, "full")
    window = None
    if kind == "sliding":
        window = cfg.get("sliding_window")
        if not window or window <= 0:
            raise ConfigError("config.json: sliding layers need a positive sliding_window")
    elif kind == "chunked":
        window = cfg["attention_chunk_size"]
    qkv_bias = cfg.get("attention_bias", mtype in ("qwen2", "qwen2_moe"))
    q_rows = heads * head_dim * (2 if mtype == "qwen3_next" else 1)  # Qwen3-Next gates its output
    mats = [
        Matrix("attn.q_proj", q_rows, hidden, 1, 1),
        Matrix("attn.kv_proj", kv_heads * head_dim, hidden, 2, 2),
        Matrix("attn.o_proj", hidden, heads * head_dim, 1, 1),
    ]
    other = 0
    if qkv_bias:
        other += q_rows + 2 * kv_heads * head_dim
    if cfg.get("attention_bias") and mtype in ("gpt_oss", "olmo", "llama", "mistral", "phi3"):
        other += hidden  # o_proj bias
    if mtype == "gpt_oss":
        other += heads  # attention sinks
    if mtype in ("qwen3", "qwen3_moe", "qwen3_next", "gemma3_text"):
        other += 2 * head_dim  # per-head q/k RMSNorm
    if mtype == "olmo2":
        other += heads * head_dim + kv_heads * head_dim  # q/k RMSNorm over all heads
    layer = LayerSpec(kind, "attention", heads, kv_heads, head_dim, head_dim, window,
                      ((kv_heads, head_dim), (kv_heads, head_dim)))
    return layer, mats, other


def _mla_layer(cfg: dict, hidden: int) -> tuple[LayerSpec, list[Matrix], int]:
    """MLA caches one latent per token: kv_lora_rank + qk_rope_head_dim, shared by all heads."""
    heads = _positive_int(cfg, "num_attention_heads")
    rank, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    nope, v_dim = cfg["qk_nope_head_dim"], cfg.get("v_head_dim", cfg["qk_nope_head_dim"])
    q_rank = cfg.get("q_lora_rank")
    mats = []
    other = rank  # kv_a_layernorm
    if q_rank:
        mats += [Matrix("mla.q_a_proj", q_rank, hidden, 1, 1),
                 Matrix("mla.q_b_proj", heads * (nope + rope), q_rank, 1, 1)]
        other += q_rank
    else:
        mats.append(Matrix("mla.q_proj", heads * (nope + rope), hidden, 1, 1))
    mats += [
        Matrix("mla.kv_a_proj", rank + rope, hidden, 1, 1),
        Matrix("mla.kv_b_proj", heads * (nope + v_dim), rank, 1, 1),
        Matrix("mla.o_proj", hidden, heads * v_dim, 1, 1),
    ]
    layer = LayerSpec("mla", "mla", heads, 1, nope + rope, v_dim, None, ((1, rank + rope),))
    return layer, mats, other


def _ffn(cfg: dict, hidden: int, mtype: str, i: int, ltype: str) -> tuple[list[Matrix], int]:
    """Dense MLP or MoE block of layer i."""
    if ltype == "mamba2" or ltype == "full_attention" and mtype == "nemotron_h":
        return [], 0  # Nemotron-H: mixers and MLPs are separate layers
    if mtype in ("mamba", "falcon_mamba"):
        return [], 0
    inter = cfg.get("intermediate_size")
    gated = not (mtype == "nemotron_h")  # relu2 MLP: up and down only
    experts, topk, moe_inter = 0, 0, inter
    shared_inter = 0
    router_bias = 0
    if mtype == "mixtral":
        experts, topk = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    elif mtype == "gpt_oss":
        experts, topk = cfg["num_local_experts"], cfg.get("num_experts_per_tok", cfg.get("experts_per_token"))
        router_bias = experts
    elif mtype in ("qwen3_moe", "qwen2_moe", "qwen3_next"):
        step = cfg.get("decoder_sparse_step", 1)
        if i not in cfg.get("mlp_only_layers", []) and cfg.get("num_experts", 0) and (i + 1) % step == 0:
            experts, topk, moe_inter = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
            shared_inter = cfg.get("shared_expert_intermediate_size", 0)
    elif mtype in ("deepseek_v2", "deepseek_v3", "kimi_k2"):
        if cfg.get("n_routed_experts") and i >= cfg.get("first_k_dense_replace", 0) \
                and i % cfg.get("moe_layer_freq", 1) == 0:
            experts, topk, moe_inter = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
            shared_inter = cfg.get("n_shared_experts", 0) * moe_inter
            if cfg.get("topk_method") == "noaux_tc":
                router_bias = experts  # e_score_correction_bias
    elif mtype == "jamba":
        if cfg.get("num_experts", 1) > 1 and i % cfg.get("expert_layer_period", 2) == cfg.get("expert_layer_offset", 1):
            experts, topk = cfg["num_experts"], cfg["num_experts_per_tok"]
    if not inter and not experts:
        raise ConfigError("config.json lacks 'intermediate_size'")
    if experts:
        mats = [Matrix("moe.router", experts, hidden, 1, 1)]
        if mtype == "gpt_oss":  # fused gate_up with biases
            mats += [Matrix("moe.experts.gate_up", 2 * moe_inter, hidden, experts, topk),
                     Matrix("moe.experts.down", hidden, moe_inter, experts, topk)]
            other = router_bias + experts * (2 * moe_inter + hidden)
        else:
            mats += [Matrix("moe.experts.gate_up", moe_inter, hidden, 2 * experts, 2 * topk),
                     Matrix("moe.experts.down", hidden, moe_inter, experts, topk)]
            other = router_bias
        if shared_inter:
            mats += [Matrix("moe.shared.gate_up", shared_inter, hidden, 2, 2),
                     Matrix("moe.shared.down", hidden, shared_inter, 1, 1)]
            if mtype in ("qwen2_moe", "qwen3_next"):
                mats.append(Matrix("moe.shared.gate", 1, hidden, 1, 1))
        return mats, other
    n_in = 2 if gated else 1
    mats = [Matrix("mlp.gate_up", inter, hidden, n_in, n_in), Matrix("mlp.down", hidden, inter, 1, 1)]
    other = (n_in * inter + hidden) if cfg.get("mlp_bias") else 0
    return mats, other


def _norms_per_layer(mtype: str, hidden: int, ltype: str) -> int:
    if mtype in ("gemma2", "gemma3_text"):
        return 4 * hidden  # pre/post norms around attention and MLP
    if mtype in ("falcon_mamba", "mamba", "nemotron_h"):
        return hidden  # one norm per block
    return 2 * hidden


def spec_from_config(cfg: dict, name: str = "") -> ModelSpec:
    """Read a Hugging Face config.json dict into a ModelSpec (raises ConfigError)."""
    if not isinstance(cfg, dict):
        raise ConfigError("config.json must hold a JSON object")
    weights_format, unread = _weights_format(cfg)
    cfg, notes = _text_config(cfg)
    notes += [unread] if unread else []
    mtype = cfg.get("model_type") or ""
    arch = (cfg.get("architectures") or ["?"])[0]
    if mtype not in KNOWN_TYPES:
        msg = (f"unknown architecture {mtype or arch!r}: assuming a dense decoder with standard "
               f"attention from num_hidden_layers, num_attention_heads, num_key_value_heads, "
               f"head_dim (or hidden_size/heads), intermediate_size (gated MLP) and sliding_window")
        warnings.warn(msg, stacklevel=2)
        notes.append(msg)
    hidden = _positive_int(cfg, "hidden_size", cfg.get("d_model"))
    n = _positive_int(cfg, "num_hidden_layers", cfg.get("n_layer"))
    vocab = _positive_int(cfg, "vocab_size")
    max_pos = cfg.get("max_position_embeddings") or 0
    tie = bool(cfg.get("tie_word_embeddings", mtype in ("gemma", "gemma2", "gemma3_text")))
    if "mamba" in mtype:
        tie = bool(cfg.get("tie_word_embeddings", True))
    is_mla = "kv_lora_rank" in cfg and cfg.get("kv_lora_rank")

    layers: list[LayerSpec] = []
    matrices: list[Matrix] = []
    other = hidden  # final norm
    for i, ltype in enumerate(_layer_types(cfg, n, mtype)):
        if ltype == "mamba":
            layer, mats, extra = _mamba_layer(cfg, hidden, mtype)
        elif ltype == "mamba2":
            layer, mats, extra = _mamba2_layer(cfg, hidden)
        elif ltype == "linear_attention":
            layer, mats, extra = _deltanet_layer(cfg, hidden)
        elif ltype in ("mlp", "moe"):
            layer, mats, extra = LayerSpec("none", "mlp"), [], 0
        elif is_mla:
            layer, mats, extra = _mla_layer(cfg, hidden)
        elif ltype in ("full_attention", "sliding_attention", "chunked_attention"):
            layer, mats, extra = _attention_layer(cfg, hidden, mtype, ltype)
        else:
            raise ConfigError(f"config.json: unknown layer type {ltype!r} at layer {i}")
        ffn_mats, ffn_other = _ffn(cfg, hidden, mtype, i, ltype)
        layers.append(layer)
        matrices += mats + ffn_mats
        other += extra + ffn_other + _norms_per_layer(mtype, hidden, ltype)
    matrices.append(Matrix("embed_tokens", vocab, hidden, 1, 0, quantizable=False))
    if not tie:
        matrices.append(Matrix("lm_head", vocab, hidden, 1, 1, quantizable=False))
    return ModelSpec(
        name=name or cfg.get("_name_or_path") or arch,
        model_type=mtype,
        architecture=arch,
        hidden_size=hidden,
        vocab_size=vocab,
        num_layers=n,
        max_position_embeddings=max_pos,
        tie_word_embeddings=tie,
        layers=tuple(layers),
        matrices=tuple(_merge(matrices)),
        other_params=other,
        config=cfg,
        torch_dtype=str(cfg.get("torch_dtype") or "bfloat16"),
        notes=tuple(notes),
        weights_format=weights_format,
    )


def _merge(mats: list[Matrix]) -> list[Matrix]:
    """Fold identical matrices of different layers into one entry with a count."""
    merged: dict[tuple, Matrix] = {}
    for m in mats:
        key = (m.name, m.rows, m.cols, m.quantizable)
        if key in merged:
            old = merged[key]
            merged[key] = Matrix(m.name, m.rows, m.cols, old.count + m.count, old.active + m.active,
                                 m.quantizable)
        else:
            merged[key] = m
    return list(merged.values())


def read_config(path: str | Path) -> dict:
    """Read config.json from a file or a checkpoint folder (raises ConfigError)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"no config.json at {path}")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold a JSON object")
    return data
