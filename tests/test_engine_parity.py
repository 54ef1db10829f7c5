"""Greedy output of the paged engine is token-identical to the plain contiguous-cache loop
(kvlab.generate) in every lossless configuration: prefix hits, chunked prefill, preemption by
recompute and by swap (RAM, disk), sliding windows, hybrid layer groups, mixed batches."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from kvlab.engine.llm import LLM
from kvlab.layout import cdiv, layer_groups
from kvlab.generate import generate
from kvlab.models import build_model
from kvlab.models.llama import CausalLM
from kvlab.models.loader import init_random_
from kvlab.sampling import SamplingParams
from kvlab.spec import spec_from_config

GREEDY = SamplingParams(temperature=0, max_tokens=20)


def tiny_config(**over) -> dict:
    """2 layers, GQA (4 query heads, 2 KV heads, head_dim 32), 128-token vocabulary."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 256,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
    cfg.update(over)
    return cfg


def tiny_model(**over) -> CausalLM:
    """fp32 random weights, wide enough (std 0.2) that greedy picks are not near-ties."""
    model = build_model(spec_from_config(tiny_config(**over), "tiny"), "fp32", random_weights=True)
    init_random_(model, seed=0, std=0.2)
    return model


def prompts(lengths: tuple[int, ...], seed: int = 0, vocab: int = 128) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def kv_bytes(model: CausalLM, blocks: int, block_size: int) -> int:
    """kv_memory that buys exactly `blocks` blocks (fp32 cache)."""
    return blocks * block_size * model.spec.kv_bytes_per_token("fp32")


def reference(model: CausalLM, batch: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [generate(model, p, params).token_ids for p in batch]


@pytest.fixture(scope="module")
def llama() -> CausalLM:
    return tiny_model()


@pytest.fixture(scope="module")
def workload(llama):
    batch = prompts((5, 17, 33, 40, 3, 26))
    return batch, reference(llama, batch)


@pytest.mark.parametrize("options", [
    pytest.param({}, id="default"),
    pytest.param({"max_num_batched_tokens": 7, "block_size": 4}, id="chunked-prefill"),
    pytest.param({"max_num_seqs": 2, "block_size": 8}, id="max-num-seqs"),
    pytest.param({"blocks": 20, "block_size": 4}, id="preempt-recompute"),
    pytest.param({"blocks": 20, "block_size": 4, "prefix_caching": False}, id="recompute-no-prefix"),
    pytest.param({"blocks": 20, "block_size": 4, "preemption": "swap-ram"}, id="swap-ram"),
    pytest.param({"blocks": 20, "block_size": 4, "preemption": "swap-disk",
                  "max_num_batched_tokens": 9}, id="swap-disk-chunked"),
])
def test_greedy_parity(llama, workload, options):
    batch, ref = workload
    options = dict(options)
    blocks = options.pop("blocks", 512)
    llm = LLM(llama, kv_memory=kv_bytes(llama, blocks, options.get("block_size", 16)), **options)
    outs = llm.generate(batch, GREEDY)
    assert [o.token_ids for o in outs] == ref
    m = llm.metrics()
    if blocks == 20:
        assert m.preemptions > 0
        if options.get("preemption", "recompute") != "recompute":
            assert m.swapped_out_blocks > 0 and m.swapped_in_blocks == m.swapped_out_blocks
    assert m.kv_blocks_used == 0 and m.running == m.waiting == m.swapped == 0


def test_prefix_cache_hits(llama):
    """Shared prefixes are found again; a fully cached prompt still recomputes its last block."""
    shared = prompts((24,), seed=1)[0]
    a = shared + prompts((5,), seed=2)[0]
    b = shared + prompts((9,), seed=3)[0]
    llm = LLM(llama, kv_memory=kv_bytes(llama, 64, 4), block_size=4)
    first = llm.generate(a, GREEDY)[0]
    assert first.num_cached_tokens == 0
    second, again = llm.generate([b, a], GREEDY)
    assert second.num_cached_tokens == 24  # the six shared blocks
    assert again.num_cached_tokens == (len(a) - 1) // 4 * 4  # never the last token
    exact = llm.generate(shared, GREEDY)[0]
    assert exact.num_cached_tokens == 20  # 24 tokens cached, the last block recomputed
    assert [first.token_ids, second.token_ids, again.token_ids, exact.token_ids] == \
        reference(llama, [a, b, a, shared])
    m = llm.metrics()
    assert m.prefix_cache_hits == 24 + (len(a) - 1) // 4 * 4 + 20
    assert m.prefix_cache_queries == len(a) * 2 + len(b) + len(shared)
    salted = llm.generate(a, GREEDY, cache_salt="tenant-2")[0]
    assert salted.num_cached_tokens == 0 and salted.token_ids == first.token_ids


def test_sliding_window_stops_growing():
    """Mistral-style: every layer slides (window 8). Parity, and each sequence never holds more
    blocks than its window spans, however long it gets."""
    model = tiny_model(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=8)
    assert {layer.kind for layer in model.spec.layers} == {"sliding"}
    batch = prompts((30, 5, 19), seed=4)
    params = SamplingParams(temperature=0, max_tokens=60)
    llm = LLM(model, kv_memory=kv_bytes(model, 12, 4), block_size=4, max_num_batched_tokens=6)
    assert llm.capacity.max_concurrency == 12 / (cdiv(8 - 1, 4) + 1)
    engine, held = llm.engine, []
    ids = [engine.add_request(p, params) for p in batch]
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.token_ids
        held += [sum(b >= 0 for b in s.block_tables[0]) for s in engine.scheduler.running]
    assert [final[i] for i in ids] == reference(model, batch, params)
    # the window (8) plus one step's chunk (6) spans at most cdiv(8 - 1 + 6 - 1, 4) + 1 blocks
    assert max(held) <= cdiv(8 - 1 + 6 - 1, 4) + 1 < cdiv(30 + 60, 4)


def test_hybrid_layer_groups():
    """Full and sliding layers in one model: two block pools, two tables per sequence."""
    model = tiny_model(num_hidden_layers=3, sliding_window=6,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    batch = prompts((21, 9, 14), seed=5)
    llm = LLM(model, kv_memory=kv_bytes(model, 18, 4), block_size=4, max_num_batched_tokens=10)
    assert len(llm.engine.kv.groups) == 2
    assert [o.token_ids for o in llm.generate(batch, GREEDY)] == reference(model, batch)
    assert llm.metrics().preemptions > 0


def test_seeded_sampling_independent_of_batching(llama):
    """A seeded request samples the same tokens alone or in a batch, preempted or not."""
    batch = prompts((12, 20, 7), seed=6)
    params = SamplingParams(temperature=0.8, top_k=20, seed=123, max_tokens=16)
    alone = [LLM(llama, kv_memory=kv_bytes(llama, 64, 4), block_size=4).generate(p, params)[0].token_ids
             for p in batch]
    crowded = LLM(llama, kv_memory=kv_bytes(llama, 14, 4), block_size=4).generate(batch, params)
    assert [o.token_ids for o in crowded] == alone
    assert alone == reference(llama, batch, params)


POOL = prompts((3, 9, 14, 22, 31, 6, 17, 40), seed=10)
POOL_PARAMS = SamplingParams(temperature=0, max_tokens=12)
VARIANTS = {  # full layers / all sliding (Mistral-style) / full + sliding groups
    "llama": {},
    "sliding": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 7},
    "hybrid": {"sliding_window": 5, "layer_types": ["full_attention", "sliding_attention"]},
}


@pytest.fixture(scope="module")
def pool_models():
    models = {name: tiny_model(**over) for name, over in VARIANTS.items()}
    return {name: (m, reference(m, POOL, POOL_PARAMS)) for name, m in models.items()}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(variant=st.sampled_from(sorted(VARIANTS)),
       picks=st.lists(st.integers(0, len(POOL) - 1), min_size=1, max_size=8),
       block_size=st.sampled_from([1, 2, 4, 8, 16]), spare=st.integers(0, 40),
       budget=st.integers(1, 64), max_seqs=st.integers(1, 8),
       preemption=st.sampled_from(["recompute", "swap-ram", "swap-disk"]), prefix=st.booleans())
def test_random_workloads_match_the_plain_loop(pool_models, variant, picks, block_size, spare,
                                               budget, max_seqs, preemption, prefix):
    """Any mix of prompts (repeats included) under any options gives the plain loop's tokens."""
    model, ref = pool_models[variant]
    need = max(blocks_needed(model, len(POOL[i]) + 12 - 1, block_size) for i in picks)
    llm = LLM(model, kv_memory=kv_bytes(model, need + spare, block_size), block_size=block_size,
              max_num_batched_tokens=budget, max_num_seqs=max_seqs, preemption=preemption,
              prefix_caching=prefix)
    outs = llm.generate([POOL[i] for i in picks], POOL_PARAMS)
    assert [o.token_ids for o in outs] == [ref[i] for i in picks]
    assert llm.metrics().kv_blocks_used == 0


def blocks_needed(model: CausalLM, positions: int, block_size: int) -> int:
    """Blocks the largest request needs at once (the admission check's figure)."""
    return max(g.blocks_per_seq(positions, block_size) for g in layer_groups(model.spec))
