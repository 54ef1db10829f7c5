"""Lossy KV formats (fp8 e4m3 / e5m2 with per-layer scales, int8 with group scales; bf16 for
scale): agreement with the lossless fp32 cache and the largest logit error, reported and bounded.

Teacher forcing (prefill the prompt, then decode the lossless continuation token by token) makes
every position comparable; free-running greedy agreement is reported as well (it drops after the
first differing token, so it is bounded loosely)."""

from __future__ import annotations

import pytest
import torch

from kvlab.engine.attention import PagedAttention, SeqSpan
from kvlab.engine.engine import calibration_ids
from kvlab.engine.kv_cache import PagedKVCache
from kvlab.engine.llm import LLM
from kvlab.layout import cdiv, layer_groups
from kvlab.models.llama import CausalLM
from kvlab.sampling import SamplingParams
from tests.test_engine_parity import kv_bytes, prompts, reference, tiny_model  # noqa: F401 (fixtures)

PARAMS = SamplingParams(temperature=0, max_tokens=24)


@torch.inference_mode()
def forced_logits(model: CausalLM, ids: list[int], kv_dtype: str, prompt_len: int,
                  block_size: int = 4) -> torch.Tensor:
    """Logits at positions prompt_len - 1 ... len(ids) - 1 through the paged backend."""
    spec = model.spec
    groups = layer_groups(spec)
    blocks = cdiv(len(ids), block_size)
    cache = PagedKVCache(spec, groups, blocks, block_size, kv_dtype)
    cache.calibrate(model, calibration_ids(None, spec.vocab_size))
    attn = PagedAttention(cache)
    tables = [list(range(blocks))] * len(groups)
    attn.prepare([SeqSpan(tables, 0, prompt_len)], "cpu")
    out = [model(torch.tensor(ids[:prompt_len]), torch.arange(prompt_len), attn,
                 torch.tensor([prompt_len - 1]))]
    for p in range(prompt_len, len(ids)):
        attn.prepare([SeqSpan(tables, p, 1)], "cpu")
        out.append(model(torch.tensor(ids[p:p + 1]), torch.tensor([p]), attn, torch.tensor([0])))
    return torch.cat(out)


@pytest.fixture(scope="module")
def setup():
    model = tiny_model()
    batch = prompts((9, 17, 33, 40, 23, 26), seed=7)
    return model, batch, reference(model, batch, PARAMS)


# kv dtype: (min teacher-forced argmax agreement, max logit error in units of the logits' std)
BOUNDS = {"bf16": (0.95, 0.2), "int8": (0.9, 0.5), "fp8_e4m3": (0.6, 2.5), "fp8_e5m2": (0.5, 3.0)}


@pytest.mark.parametrize("kv_dtype", list(BOUNDS))
def test_lossy_kv_agreement(setup, kv_dtype):
    model, batch, ref = setup
    errors, spreads, agree, total = [], [], 0, 0
    for prompt, out in zip(batch, ref):
        ids = prompt + out[:-1]
        exact = forced_logits(model, ids, "fp32", len(prompt))
        lossy = forced_logits(model, ids, kv_dtype, len(prompt))
        errors.append((exact - lossy).abs().max().item())
        spreads.append(exact.std().item())
        agree += (exact.argmax(-1) == lossy.argmax(-1)).sum().item()
        total += len(exact)
    llm = LLM(model, kv_memory=kv_bytes(model, 200, 4), block_size=4, kv_dtype=kv_dtype)
    outs = llm.generate(batch, PARAMS)
    same = sum(a == b for o, r in zip(outs, ref) for a, b in zip(o.token_ids, r))
    free = same / sum(len(r) for r in ref)
    forced = agree / total
    err, spread = max(errors), sum(spreads) / len(spreads)
    print(f"\n{kv_dtype}: teacher-forced argmax agreement {forced:.1%}, free-running identical "
          f"tokens {free:.1%}, max logit error {err:.3f} (logit std {spread:.2f})")
    min_agree, max_err = BOUNDS[kv_dtype]
    assert forced >= min_agree
    assert 0 < err <= max_err * spread
    assert free >= (0.5 if kv_dtype in ("bf16", "int8") else 0.05)
    assert llm.engine.cache.blocks[0][0].dtype == {
        "bf16": torch.bfloat16, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn,
        "fp8_e5m2": torch.float8_e5m2}[kv_dtype]


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_scales_do_not_depend_on_request_history(setup, kv_dtype):
    """Scales come from a fixed calibration text at start-up: a prompt gives the same greedy
    tokens alone, after another request, and squeezed into a cache that preempts."""
    model, batch, _ = setup

    def run(prompts_, blocks=64, preemption="recompute"):
        llm = LLM(model, kv_memory=kv_bytes(model, blocks, 4) // 4, block_size=4, kv_dtype=kv_dtype,
                  preemption=preemption, max_num_batched_tokens=16)
        return llm, [o.token_ids for o in llm.generate(prompts_, PARAMS)]

    llm, (alone,) = run([batch[2]])
    _, (_, after) = run([[v * 3 % 128 for v in batch[0]] * 3, batch[2]])
    tight, squeezed = run(batch, blocks=24, preemption="swap-ram")
    assert after == alone and squeezed[2] == alone
    assert tight.metrics().preemptions > 0
    # the scales are the calibration's, whatever ran: the same in every engine
    assert torch.equal(llm.engine.cache.scales[0], tight.engine.cache.scales[0])
    # values beyond the calibrated range are clamped and counted
    cache = llm.engine.cache
    before = llm.metrics().kv_saturated_values
    k = torch.full((3, model.spec.layers[0].kv_heads, model.spec.layers[0].head_dim), 1e6)
    cache.write(0, k, torch.zeros_like(k), torch.tensor([0, 1, 2]))
    assert llm.metrics().kv_saturated_values - before == k.numel()
