"""Log-probabilities: the sampler's figures, the plain loop's and the engine's agree with a full
forward pass (fp32), for sampled tokens and for the prompt, through chunked prefill,
preemption and a warm prefix cache."""

from __future__ import annotations

import math

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.generate import Generation
from kvlab.models.attention import NoCache
from kvlab.sampling import token_logprobs
from tests.test_engine_parity import kv_bytes, prompts, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def full_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log-softmax at every position of one uncached forward pass: row p predicts token p + 1."""
    backend = NoCache(model.spec)
    with torch.inference_mode():
        logits = model(torch.tensor(ids), backend.prepare(len(ids), "cpu"), backend, None)
    return torch.log_softmax(logits.float(), -1)


def test_token_logprobs_rank_and_top():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0], [0.0, 0.0, 0.0, 9.0]])
    a, b = token_logprobs(logits, [2, 3], 2)
    lp = torch.log_softmax(logits, -1)
    assert a.logprob == pytest.approx(lp[0, 2].item()) and a.rank == 3
    assert [t for t, _ in a.top] == [1, 3] and a.top[0][1] == pytest.approx(lp[0, 1].item())
    assert b.rank == 1 and b.top[0] == (3, pytest.approx(lp[1, 3].item()))
    assert token_logprobs(logits, [0, 0], 0)[0].top == ()
    with pytest.raises(ValueError, match="logprobs must be an integer in"):
        SamplingParams(logprobs=21)


def test_raw_logprobs_ignore_temperature_and_filters(model):
    """vLLM's default: the figures are the model's, not the sampling distribution's."""
    ids = prompts((9,), seed=3)[0]
    hot = SamplingParams(temperature=1.7, top_k=3, seed=5, max_tokens=6, logprobs=2)
    ref = full_logprobs(model, ids)[-1]
    first = next(iter(Generation(model, ids, hot)))
    assert first.logprob.logprob == pytest.approx(ref[first.token_id].item(), abs=1e-5)
    assert sum(math.exp(v) for _, v in first.logprob.top) < 1


def test_plain_loop_and_engine_agree_with_a_full_pass(model):
    batch = prompts((7, 21, 12), seed=11)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    # 4-token blocks, 8-token chunks and a cache for ~2 sequences: chunked prefill and preemption
    llm = LLM(model, kv_memory=kv_bytes(model, 14, 4), block_size=4, max_num_batched_tokens=8,
              preemption="recompute")
    outs = llm.generate(batch, params)
    assert llm.metrics().preemptions > 0
    for ids, out in zip(batch, outs, strict=True):
        full = full_logprobs(model, ids + out.token_ids)
        assert len(out.logprobs) == len(out.token_ids) == 8
        for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            row = full[len(ids) - 1 + i]
            assert lp.token_id == tok and lp.rank == 1  # greedy: the sampled token is the best
            assert lp.logprob == pytest.approx(row[tok].item(), abs=1e-4)
            assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for p in range(1, len(ids)):
            got = out.prompt_logprobs[p]
            assert got.token_id == ids[p] and got.logprob == pytest.approx(full[p - 1, ids[p]].item(), abs=1e-4)
            assert len(got.top) == 2 and got.rank == 1 + int((full[p - 1] > full[p - 1, ids[p]]).sum())
        plain = [d.logprob for d in Generation(model, ids, params)]
        assert [d.token_id for d in plain] == out.token_ids
        assert [d.logprob for d in plain] == pytest.approx([d.logprob for d in out.logprobs], abs=1e-4)


def test_prompt_logprobs_are_scored_even_when_the_prefix_is_cached(model):
    ids = prompts((17,), seed=4)[0]
    llm = LLM(model, kv_memory=kv_bytes(model, 32, 4), block_size=4)
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=2))  # warms the prefix cache
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0 and all(lp is not None for lp in out.prompt_logprobs[1:])
    again = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2))[0]
    assert again.num_cached_tokens > 0 and again.prompt_logprobs is None and again.logprobs is None
