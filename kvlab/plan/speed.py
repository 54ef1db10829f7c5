"""Speed bounds: decode steps limited by memory bandwidth, prefill by FLOPs, and the batch where
cache reads overtake weight reads."""

from __future__ import annotations

from collections.abc import Callable

from kvlab.spec import ModelSpec


def experts_touched_fraction(spec: ModelSpec, batch: int) -> float:
    """Expected fraction of experts a batch routes to: 1 - (1 - k/E)^batch (uniform routing)."""
    for m in spec.matrices:
        if m.name == "moe.experts.down" and m.count:
            p = m.active / m.count
            return 1 - (1 - p) ** batch
    return 1.0


def prefill_flops(spec: ModelSpec, tokens: int) -> float:
    """2 x active matrix params x tokens for the matmuls (lm_head for the last token only) plus
    causal attention: QK^T and PV over the tokens each position attends to."""
    lm_head = 2 * spec.vocab_size * spec.hidden_size
    # the matrices every token multiplies by (MoE: routed experts only); the embedding is a lookup
    per_token = sum(m.rows * m.cols * m.active for m in spec.matrices if m.name != "lm_head")
    dense = 2 * per_token * tokens + lm_head
    attn = 0.0
    for layer in spec.layers:
        if not layer.has_kv:
            continue
        w = min(layer.cached_tokens(tokens), tokens)
        pairs = w * (w + 1) / 2 + (tokens - w) * w  # position i attends to min(i + 1, w) tokens
        attn += 2 * layer.num_heads * (layer.head_dim + layer.v_head_dim) * pairs
    return dense + attn


def generation_flops(spec: ModelSpec, prompt: int, new_tokens: int) -> float:
    """FLOPs to generate ``new_tokens`` after a ``prompt``-token prompt with a KV cache: every
    token but the last generated one passes through the model once (causally, as one long
    prefill would), and each of the ``new_tokens`` sampling positions through the LM head."""
    lm_head = 2 * spec.vocab_size * spec.hidden_size
    return prefill_flops(spec, prompt + new_tokens - 1) + (new_tokens - 1) * lm_head


def work_table(prompt: int, new_tokens: tuple[int, ...]) -> list[dict]:
    """Tokens pushed through the model with a cache (P + N - 1) and without (sum of P + i)."""
    rows = []
    for n in new_tokens:
        with_cache = prompt + n - 1
        without = n * prompt + n * (n - 1) // 2
        rows.append({"prompt": prompt, "new_tokens": n, "tokens_with_cache": with_cache,
                     "tokens_without_cache": without, "work_ratio": without / with_cache})
    return rows


def crossover_batch(per_seq: int, weights_read: Callable[[int], float]) -> int | None:
    """Smallest batch whose cache reads (batch x per_seq) reach the weight reads. Cache reads grow
    linearly in the batch while MoE weight reads saturate, so bisect rather than divide."""
    if not per_seq:
        return None
    hi = 1
    while hi * per_seq < weights_read(hi) and hi < 2**40:
        hi *= 2
    lo = hi // 2
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if mid * per_seq < weights_read(mid) else (lo, mid)
    return hi
