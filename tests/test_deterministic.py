"""Deterministic mode: a request's tokens and logprobs are bitwise its solo run's, whatever runs
beside it (batch, chunk budget, preemption by recompute or swap, prefix-cache hits)."""

from __future__ import annotations

import contextlib
import os
import json
from unittest import mock

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings

from kvlab import dispatch, kernels
from kvlab.engine.llm import LLM
from kvlab.models.invariant import (SPLIT, BatchInvariantError, check_attention, check_linears, split_attention,
                                   stable_row_block)
from kvlab.models.llama import Linear
from kvlab.models.methods import Gemm
from kvlab.models.loader import build_model, init_random_
from kvlab.sampling import SamplingParams
from kvlab.spec import spec_from_config
from tests.test_engine_parity import tiny_config


def near_tie_model(dtype: str = "fp32"):
    """Small init (std 0.02): logits close together, so any change of reduction order shows in
    the logprobs (the test would catch a kernel that is not batch-invariant)."""
    # head_dim 32: the native kernels take it (the property test below also runs without them)
    model = build_model(spec_from_config(tiny_config(hidden_size=128, intermediate_size=128), "tiny"),
                        dtype, random_weights=True)
    init_random_(model, seed=0, std=0.02)
    return model


@pytest.fixture(scope="module")
def models():
    return {"fp32": near_tie_model("fp32"), "bf16": near_tie_model("bf16")}


@contextlib.contextmanager
def kernels_off():
    """``KVLAB_KERNELS=off`` for a while (kvlab.dispatch decides afresh on entry and on exit)."""
    with mock.patch.dict(os.environ, {"KVLAB_KERNELS": "off"}):
        dispatch.backends.cache_clear()
        try:
            yield
        finally:
            dispatch.backends.cache_clear()


def outcome(out) -> tuple:
    return tuple(out.token_ids), tuple((lp.token_id, lp.logprob) for lp in out.logprobs)


def test_linear_rows_are_stable_once_padded_to_the_probed_block():
    torch.manual_seed(0)
    layer = Linear(96, 80, bias=True)  # PyTorch's GEMM, whose rows need the padding (the native kernel's do not)
    block, calls = check_linears([layer], torch.float32, torch.device("cpu"))
    layer.method = Gemm(row_block=block, row_calls=calls)
    x = torch.randn(50, 96)
    with torch.inference_mode():
        alone = layer(x[:1])[0]
        for m in (2, 3, 5, 7, 13, 50):
            for pos in range(m):
                batch = torch.randn(m, 96)
                batch[pos] = x[0]
                assert torch.equal(layer(batch)[pos], alone), (block, m, pos)
    with pytest.raises(BatchInvariantError, match="CPU only"):
        check_linears([layer], torch.float32, torch.device("meta"))


class _SplitsLongBatches(torch.nn.Module):
    """A GEMM as MKL's fp32 runs 1,536-wide rows at 2 threads on a Xeon with AMX: the reduction
    order follows the batch's size (here: a last-bit offset past 8 rows, another past 40), so no
    padding is stable."""

    in_features, out_features = 48, 24

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.randn(24, 48, generator=torch.Generator().manual_seed(2))

    def forward(self, x):
        y = x @ self.weight.T
        for _ in range((x.shape[0] > 8) + (x.shape[0] > 40)):
            y = torch.nextafter(y, y + 1)
        return y


def test_a_gemm_that_splits_long_batches_runs_one_call_per_block():
    layer = _SplitsLongBatches()
    assert check_linears([layer], torch.float32, torch.device("cpu")) == (1, True)
    gemm = Gemm(row_block=1, row_calls=True)
    x = torch.randn(20, 48)
    assert torch.equal(gemm(x, layer.weight, None), torch.cat([x[i:i + 1] @ layer.weight.T for i in range(20)]))
    assert stable_row_block(layer, 48, torch.float32, torch.device("cpu")) is None  # padding: never stable


def test_attention_probe_refuses_a_device_it_cannot_hold_stable():
    assert check_attention({64, 32}, torch.device("cpu")) in (1, 2, 4, 8, 16)
    with pytest.raises(BatchInvariantError, match="CPU only"):
        check_attention({64}, torch.device("meta"))


def test_split_attention_is_attention_and_ignores_what_else_is_in_the_batch():
    torch.manual_seed(0)
    heads, kv, d = 4, 2, 32
    lengths = [70, 130, 5]
    longest = max(-(-n // SPLIT) * SPLIT for n in lengths) + SPLIT  # one split nobody sees
    keys, vals = torch.randn(3, kv, longest, d), torch.randn(3, kv, longest, d)
    q = torch.randn(3, 1, heads, d)
    allowed = torch.zeros(3, 1, longest, dtype=torch.bool)
    for i, n in enumerate(lengths):
        allowed[i, 0, :n] = True
    together, _ = split_attention(q, keys, vals, allowed, 4)
    for i, n in enumerate(lengths):
        own = -(-n // SPLIT) * SPLIT
        alone, _ = split_attention(q[i:i + 1], keys[i:i + 1, :, :own], vals[i:i + 1, :, :own],
                                   allowed[i:i + 1, :, :own], 4)
        assert torch.equal(alone[0], together[i])
        ref = F.scaled_dot_product_attention(q[i, 0][None, :, None], keys[i, :, :n][None],
                                             vals[i, :, :n][None], enable_gqa=True)
        torch.testing.assert_close(alone[0, 0], ref[0, :, 0], rtol=1e-5, atol=1e-6)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_requests_match_their_solo_runs_bitwise(models, data):
    dtype = data.draw(st.sampled_from(["fp32", "bf16"]), "dtype")
    model = models[dtype]
    shared = data.draw(st.lists(st.integers(0, 127), min_size=16, max_size=40), "shared prefix")
    requests = []
    for i in range(data.draw(st.integers(2, 5), "requests")):
        tail = data.draw(st.lists(st.integers(0, 127), min_size=1, max_size=60), f"prompt {i}")
        prompt = (shared if data.draw(st.booleans(), f"prefix {i}") else []) + tail
        seed = data.draw(st.one_of(st.none(), st.integers(0, 9)), f"seed {i}")
        params = SamplingParams(temperature=0 if seed is None else 0.8, seed=seed, ignore_eos=True,
                                max_tokens=data.draw(st.integers(1, 12), f"max tokens {i}"), logprobs=0)
        requests.append((prompt, params))
    budget = data.draw(st.sampled_from([7, 16, 33, 512]), "tokens per step")
    blocks = data.draw(st.integers(8, 14), "blocks")  # small: preemption, evicted prefixes
    preemption = data.draw(st.sampled_from(["recompute", "swap-ram"]), "preemption")
    per_block = 16 * model.spec.kv_bytes_per_token("fp32" if dtype == "fp32" else "bf16")
    # the native kernels, or PyTorch's with padded rows and split attention (where they cannot run)
    native = data.draw(st.booleans(), "native kernels")
    with contextlib.ExitStack() as stack:
        if not native:
            stack.enter_context(kernels_off())
        llm = LLM(model, deterministic=True, max_num_batched_tokens=budget, preemption=preemption,
                  kv_memory=blocks * per_block, max_model_len=128)
        together = llm.generate([p for p, _ in requests], [s for _, s in requests])
        solo = LLM(model, deterministic=True, kv_memory=16 * per_block, max_model_len=128,
                   prefix_caching=False)
        for (prompt, params), out in zip(requests, together):
            assert outcome(out) == outcome(solo.generate([prompt], params)[0])


def test_prefix_hits_and_preemption_happen_in_such_runs(models):
    """The property above covers what it claims: its runs do hit the prefix cache and preempt."""
    model = models["fp32"]
    shared = list(range(40))
    prompts = [shared + [i] * 30 for i in range(4)]
    per_block = 16 * model.spec.kv_bytes_per_token("fp32")
    llm = LLM(model, deterministic=True, max_num_batched_tokens=33, kv_memory=10 * per_block,
              max_model_len=128)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0))
    m = llm.metrics()
    assert m.preemptions > 0 and m.prefix_cache_hits > 0
    solo = LLM(model, deterministic=True, max_model_len=128)
    for p, out in zip(prompts, outs):
        assert outcome(out) == outcome(solo.generate([p], SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True, logprobs=0))[0])


@pytest.mark.parametrize("policy", ["streaming", "h2o", "snapkv"])
def test_eviction_keeps_the_same_tokens_whatever_the_batch(models, policy):
    model = models["fp32"]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (130, 70, 160)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    opts = dict(deterministic=True, kv_policy=policy, kv_budget=64, preemption="swap-ram",
                max_model_len=256, max_num_batched_tokens=48)
    batched = LLM(model, **opts)
    together = batched.generate(prompts, params)
    assert batched.metrics().evicted_tokens > 0
    for p, out in zip(prompts, together):
        alone = LLM(model, **opts).generate([p], params)[0]
        assert outcome(out) == outcome(alone)


def test_what_deterministic_mode_cannot_honour_is_a_one_line_error(models):
    model = models["fp32"]
    with pytest.raises(ValueError, match="--preemption swap-ram"):
        LLM(model, deterministic=True, kv_policy="streaming", kv_budget=64)
    with pytest.raises(ValueError, match="--tp 1"):
        LLM(model, deterministic=True, tp=2)
    LLM(model, deterministic=True)
    assert model.invariant_rows is not None
    LLM(model, deterministic=False)  # the same model back in the fast mode
    assert model.invariant_rows is None and all(
        getattr(m.method, "fallback", m.method).row_block == 1 for m in model.modules() if isinstance(m, Linear))


def test_generate_deterministic_is_the_servers_answer_under_load(capsys):
    """The bundled model end to end: `kvlab generate --deterministic` gives, token for token, what
    the deterministic engine gives the same prompt batched with others."""
    from kvlab.cli import main
    from kvlab.models import load

    prompt = "The Elliots of Kellynch Hall were"
    assert main(["generate", "--deterministic", "--dtype", "fp32", "--max-tokens", "4",
                 "--threads", "2", "--json", prompt]) == 0
    cli = json.loads(capsys.readouterr().out)
    loaded = load(None, "fp32")
    llm = LLM(loaded.model, tokenizer=loaded.tokenizer, deterministic=True, max_num_batched_tokens=16)
    outs = llm.generate([prompt, "Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man",
                         "Anne"], SamplingParams(temperature=0, max_tokens=4))
    assert cli["token_ids"] == outs[0].token_ids


def test_by_default_deterministic_mode_is_on_where_the_native_kernels_make_it_free(models, switch_off):
    from kvlab import dispatch
    from kvlab.options import EngineOptions, add_engine_args

    def mode(model, **opts):
        engine = LLM(model, **opts).engine
        return engine.options.deterministic, engine.deterministic_why

    on, why = mode(models["fp32"])
    assert on == bool(dispatch.backends().native) and why.startswith("auto: ")
    # one rule on every CPU: bf16 is deterministic on request only, whatever oneDNN offers here
    assert mode(models["bf16"]) == (
        False, "auto: free only in fp32; bf16 runs are deterministic on request (--deterministic)")
    assert mode(models["fp32"], kv_dtype="fp16") == (False, "auto: kvlab's native kernels take an fp32 or bf16 cache")
    assert mode(models["fp32"], kv_dtype="fp8_e4m3")[0] is False
    assert mode(models["fp32"], kv_policy="streaming", kv_budget=64)[0] is False
    assert mode(models["fp32"], deterministic=False) == (False, "--no-deterministic")
    assert mode(models["bf16"], deterministic=True) == (True, "--deterministic")
    switch_off("KVLAB_KERNELS")
    assert mode(models["fp32"]) == (False, "auto: kvlab's native kernels do not run here: KVLAB_KERNELS=off")
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for argv, want in (([], None), (["--deterministic"], True), (["--no-deterministic"], False)):
        assert EngineOptions.from_args(parser.parse_args(argv)).deterministic is want
