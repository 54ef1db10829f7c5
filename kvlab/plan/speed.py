"""Speed bounds: every step is limited by the larger of its bytes over the memory bandwidth and
its FLOPs over the peak FLOP/s; the batch where cache reads overtake weight reads, and the one
where decode turns compute-bound; the cache / no-cache work table in tokens and in FLOPs.

`forward_flops` is the one FLOP count: prefill, decode steps, generation, the work table and
`kvlab bench` all ask it."""

from __future__ import annotations

from collections.abc import Callable

from kvlab.spec import LayerSpec, ModelSpec


def experts_touched_fraction(spec: ModelSpec, batch: int) -> float:
    """Expected fraction of experts a batch routes to: 1 - (1 - k/E)^batch (uniform routing)."""
    for m in spec.matrices:
        if m.name == "moe.experts.down" and m.count:
            p = m.active / m.count
            return 1 - (1 - p) ** batch
    return 1.0


def weights_read(spec: ModelSpec, weights: tuple[int, int], batch: int) -> float:
    """Bytes of weights one decode step of `batch` sequences reads: everything outside the routed
    experts, and the share of `weights` = (those bytes, the experts' bytes) its tokens route to."""
    dense, experts = weights
    return dense + experts * experts_touched_fraction(spec, batch)


_FAR = 2**62  # a length beyond any window: what a layer caches of it is its window


def _window(layer: LayerSpec) -> int | None:
    """Keys a query of this layer can see at most (None: every earlier one)."""
    w = layer.cached_tokens(_FAR)
    return w if w < _FAR else None


def _pairs(window: int | None, end: int) -> int:
    """(query, key) pairs of positions 0 .. end - 1, position i attending to min(i + 1, window)."""
    w = end if window is None else min(window, end)
    return w * (w + 1) // 2 + (end - w) * w


def _pairs_of_prefixes(window: int | None, n: int) -> int:
    """Sum of _pairs(window, m) for m in 0 .. n - 1 in closed form: the attention of n whole
    prefills of 0 .. n - 1 tokens (cubic in n below the window, quadratic beyond it)."""
    a = n if window is None else min(n, window + 1)  # prefixes no longer than the window
    c = n - a  # the longer ones: each adds `window` pairs per extra position
    tri = (a - 1) * a * (a + 1) // 6 if a else 0
    w = window or 0
    return tri + c * w * (w + 1) // 2 + w * c * (c + 1) // 2


def _flops(spec: ModelSpec, tokens: int, lm_head_tokens: int,
           pairs: Callable[[int | None], int]) -> float:
    """The one FLOP count. Per token: 2 x the matrix parameters it multiplies by (MoE: its routed
    experts only; the embedding is a lookup; the LM head counted apart, as only sampled positions
    need it), and per attention layer QK^T plus PV, 2 x heads x (head_dim + v_head_dim) per
    (query, key) pair; `pairs(window)` counts a layer's pairs. SSM layers: their matmuls only."""
    per_token = sum(m.rows * m.cols * m.active for m in spec.matrices if m.name != "lm_head")
    flops = 2 * per_token * tokens + 2 * spec.vocab_size * spec.hidden_size * lm_head_tokens
    for layer in spec.attention_layers:
        flops += 2 * layer.num_heads * (layer.head_dim + layer.v_head_dim) * pairs(_window(layer))
    return float(flops)


def forward_flops(spec: ModelSpec, start: int, tokens: int, lm_head_tokens: int = 1) -> float:
    """FLOPs of positions start .. start + tokens - 1 passing through the model once, with the
    keys of every earlier position cached; `lm_head_tokens` of them go through the LM head."""
    return _flops(spec, tokens, lm_head_tokens, lambda w: _pairs(w, start + tokens) - _pairs(w, start))


def prefill_flops(spec: ModelSpec, tokens: int) -> float:
    """A `tokens`-token prompt in one causal pass, the LM head for the last position only."""
    return forward_flops(spec, 0, tokens)


def decode_flops(spec: ModelSpec, context: int) -> float:
    """One decode token whose query attends to `context` cached keys (itself included)."""
    return forward_flops(spec, context - 1, 1)


def generation_flops(spec: ModelSpec, prompt: int, new_tokens: int) -> float:
    """FLOPs to generate ``new_tokens`` after a ``prompt``-token prompt with a KV cache: every
    token but the last generated one passes through the model once, and each of the
    ``new_tokens`` sampling positions through the LM head."""
    return forward_flops(spec, 0, prompt + new_tokens - 1, lm_head_tokens=new_tokens)


def no_cache_flops(spec: ModelSpec, prompt: int, new_tokens: int) -> float:
    """FLOPs to generate ``new_tokens`` recomputing everything each step: step i is a whole
    prefill of P + i tokens (the sum of prefill_flops(P + i)), so the matmuls grow with N^2 and
    attention with N^3."""
    end = prompt + new_tokens
    tokens = new_tokens * prompt + new_tokens * (new_tokens - 1) // 2
    return _flops(spec, tokens, new_tokens,
                  lambda w: _pairs_of_prefixes(w, end) - _pairs_of_prefixes(w, prompt))


def work_table(spec: ModelSpec, prompt: int, new_tokens: tuple[int, ...]) -> list[dict]:
    """Work to generate each N of ``new_tokens`` after ``prompt`` tokens, with a cache and
    without: tokens pushed through the model (P + N - 1 vs sum of P + i) and their FLOPs."""
    rows = []
    for n in new_tokens:
        with_cache = prompt + n - 1
        without = n * prompt + n * (n - 1) // 2
        flops_with, flops_without = generation_flops(spec, prompt, n), no_cache_flops(spec, prompt, n)
        rows.append({"prompt": prompt, "new_tokens": n, "tokens_with_cache": with_cache,
                     "tokens_without_cache": without, "work_ratio": without / with_cache,
                     "flops_with_cache": flops_with, "flops_without_cache": flops_without,
                     "flops_ratio": flops_without / flops_with})
    return rows


def first_reached(reached: Callable[[int], bool], limit: int = 2**40) -> int | None:
    """Smallest n >= 1 from which `reached(n)` holds (None: not by `limit`). Every use compares a
    part linear in n with one that saturates (cache reads vs MoE weight reads; compute vs memory
    time, in batches) or grows faster (a prefix's prefill vs its tier load, in blocks), so once
    reached it stays reached: double, then bisect."""
    hi = 1
    while not reached(hi) and hi < limit:
        hi = min(2 * hi, limit)
    if not reached(hi):
        return None
    lo = hi // 2
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if reached(mid) else (mid, hi)
    return hi


def crossover_batch(per_seq: int, weights_read: Callable[[int], float]) -> int | None:
    """Smallest batch whose cache reads (batch x per_seq) reach the weight reads."""
    if not per_seq:
        return None
    return first_reached(lambda b: b * per_seq >= weights_read(b))
