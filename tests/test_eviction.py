"""Token eviction: the policies' choices, blocks really given back in the paged engine, the
token-granular loop as the reference, and how eviction meets prefix caching and preemption."""

from __future__ import annotations

import json

import pytest
import torch

from kvlab.cli import main
from kvlab.engine.llm import LLM
from kvlab.evaluate import perplexity_engine, perplexity_loop
from kvlab.eviction import SCORE_ONE, EvictionPolicy, fixed_point, make_policy, register, unregister
from kvlab.ruler import TASKS as RULER_TASKS
from kvlab.sampling import SamplingParams
from tests.test_engine_parity import kv_bytes, prompts, reference, tiny_model

LONG = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llama():
    return tiny_model()


def _kept(n_units: int) -> torch.Tensor:
    return torch.ones(n_units, dtype=torch.bool)


def test_window_and_streaming_choices():
    window = make_policy("window", 64).keep(_kept(10), 160, 16, None)
    assert window.tolist() == [False] * 6 + [True] * 4  # the 4 newest blocks
    streaming = make_policy("streaming", 64, sinks=4).keep(_kept(10), 160, 16, None)
    assert streaming.tolist() == [True] + [False] * 6 + [True] * 3  # sink block + 3 newest
    # under the budget nothing leaves; what left never comes back
    assert make_policy("window", 64).keep(_kept(4), 64, 16, None).all()
    once = torch.tensor([True, False, True, True, True, True])
    assert not make_policy("streaming", 64, sinks=4).keep(once, 96, 16, None)[1]


def test_h2o_keeps_heavy_hitters_and_snapkv_votes():
    scores = torch.zeros(160, dtype=torch.long)
    scores[40:48] = 5 * SCORE_ONE  # block 2 and block 5 drew the most attention
    scores[80:84] = 3 * SCORE_ONE
    keep = make_policy("h2o", 64).keep(_kept(10), 160, 16, scores)
    assert keep.tolist() == [False, False, True, False, False, True, False, False, True, True]
    snap = make_policy("snapkv", 64, obs_window=16).keep(_kept(10), 160, 16, scores)
    assert int(snap.sum()) == 4 and snap[2] and snap[5] and snap[9]


def test_snapkv_votes_are_pooled_over_neighbours_and_sum_in_any_order():
    scores = torch.zeros(40, dtype=torch.long)
    scores[10] = 9 * SCORE_ONE  # one voted token: its neighbours (within 3) come along
    scores[30] = 5 * SCORE_ONE
    keep = make_policy("snapkv", 17, sinks=0, obs_window=4).keep(torch.ones(40, dtype=torch.bool), 40, 1, scores)
    # 4 recent + 13 by pooled votes: all 7 around position 10, then 6 of the 7 around 30 (ties
    # go to the older position)
    assert torch.nonzero(keep).flatten().tolist() == [*range(7, 14), *range(27, 33), *range(36, 40)]
    # fixed point: one sum, whatever the grouping (float32 sums of the same weights differ)
    w = torch.rand(4096, dtype=torch.float32)
    parts = sum(fixed_point(c).sum() for c in w.split(7))
    assert int(parts) == int(fixed_point(w).sum())


def test_adakv_keeps_what_its_best_head_votes_for_as_a_plain_reference_does():
    """Random per-head votes: the kept blocks are those a plain loop picks (pool each head's votes
    over 7 neighbours, take the best head's, keep the recent window and the top blocks)."""
    gen = torch.Generator().manual_seed(3)
    n, heads, unit, budget, window = 160, 6, 8, 64, 16
    scores = torch.randint(0, SCORE_ONE, (n, heads), generator=gen) * torch.randint(0, 2, (n, heads), generator=gen)
    keep = make_policy("adakv", budget, obs_window=window).keep(_kept(n // unit), n, unit, scores)
    best = [max(sum(int(scores[j, h]) for j in range(max(0, i - 3), min(n, i + 4))) for h in range(heads))
            for i in range(n)]
    recent = {n // unit - 1, n // unit - 2}  # the 16-token window: the last two blocks
    per_unit = {u: sum(best[u * unit:(u + 1) * unit]) for u in range(n // unit) if u not in recent}
    top = sorted(per_unit, key=lambda u: (-per_unit[u], u))[:budget // unit - len(recent)]
    assert torch.nonzero(keep).flatten().tolist() == sorted(recent | set(top))


def test_adakv_keeps_a_block_that_one_head_looks_hard_at():
    """Eight heads spreading their votes over blocks 1-3 outweigh, summed, one head's sharp vote
    for a token of block 6 (each head's votes add up to about the same): snapkv keeps two of
    blocks 1-3, adakv block 6 and one of them."""
    scores = torch.zeros(160, 9, dtype=torch.long)
    scores[16:64, :8] = SCORE_ONE
    scores[100, 8] = 40 * SCORE_ONE
    ada = make_policy("adakv", 48, obs_window=16).keep(_kept(10), 160, 16, scores)
    snap = make_policy("snapkv", 48, obs_window=16).keep(_kept(10), 160, 16, scores.sum(1))
    assert ada.tolist() == [False, False, True, False, False, False, True, False, False, True]
    assert snap.tolist() == [False, True, True] + [False] * 6 + [True]


@pytest.mark.parametrize("deterministic", [False, True])
def test_per_head_scores_add_up_to_the_summed_scores(llama, deterministic):
    """adakv's per-head columns hold the same fixed-point mass as snapkv's one sum, in the paged
    and in the deterministic (split) attention and in the plain loop: the columns add up exactly,
    and each layer's own columns hold its share (layer 0's columns differ from layer 1's)."""
    from kvlab.models.attention import EvictingKVCache

    prompt = prompts((70,), seed=4)[0]
    runs = {}
    for name in ("snapkv", "adakv"):
        llm = LLM(llama, kv_policy=name, kv_budget=64, block_size=8, deterministic=deterministic,
                  preemption="swap-ram")
        got = []
        update = llm.engine.scheduler.update

        def watched(out, *a, **k):  # the scores once the prompt is in, before the first eviction
            if not got and all(c.start + c.num_tokens >= c.seq.num_prompt_tokens for c in out.chunks):
                got.append(out.chunks[0].seq.scores.clone())
            return update(out, *a, **k)
        llm.engine.scheduler.update = watched
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        runs[name] = got[0][:70]
        cache = EvictingKVCache(llama.spec, make_policy(name, 64), 80, 70, llama.dtype, llama.device)
        llama(torch.tensor(prompt), cache.prepare(70), cache, None)
        runs[name + " loop"] = cache.scores[:70].clone()
    heads = llama.spec.layers[0].num_heads
    for where in ("", " loop"):
        ada, snap = runs["adakv" + where], runs["snapkv" + where]
        assert ada.shape == (70, len(llama.spec.layers) * heads) and snap.shape == (70,)
        assert torch.equal(ada.sum(1), snap) and snap.sum() > 0
        assert not torch.equal(ada[:, :heads], ada[:, heads:2 * heads])


def test_bad_budgets_are_one_line_errors(capsys):
    for argv, words in [
        (["bench", "austen-demo", "--kv-policy", "streaming", "--kv-budget", "8", "--num-requests", "1"],
         "use at least 32"),
        (["bench", "austen-demo", "--kv-policy", "window", "--kv-budget", "1.5", "--num-requests", "1"],
         "ratio must be in (0, 1]"),
        (["bench", "austen-demo", "--kv-policy", "h2o", "--num-requests", "1"], "needs --kv-budget"),
        (["bench", "austen-demo", "--kv-policy", "lru", "--num-requests", "1"], "invalid choice"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err


@pytest.mark.parametrize("policy", ["window", "streaming", "h2o", "snapkv", "adakv"])
def test_engine_gives_blocks_back_and_stays_bounded(llama, policy):
    """A long generation under a 48-token budget never holds more than budget + one step's
    blocks, and every block is free at the end."""
    bs, budget = 8, 48
    llm = LLM(llama, kv_memory=kv_bytes(llama, 64, bs), block_size=bs, kv_policy=policy,
              kv_budget=budget, max_num_batched_tokens=16)
    batch = prompts((40, 70))
    for p in batch:
        llm.engine.add_request(p, LONG)
    most = 0
    while llm.engine.has_unfinished():
        llm.engine.step()
        for seq in llm.engine.scheduler.running:
            held = sum(b >= 0 for b in seq.block_tables[0])
            most = max(most, held)
    bound = budget // bs + 1 + 16 // bs
    if policy in ("snapkv", "adakv"):  # holds the whole prompt before it compresses
        bound = max(bound, -(-70 // bs))
    assert most <= bound
    m = llm.metrics()
    assert m.evicted_blocks > 0 and m.evicted_tokens == m.evicted_blocks * bs
    assert m.kv_blocks_used == 0 and llm.engine.kv.pools[0].num_available == 64


@pytest.mark.parametrize("policy", [make_policy("window", 40), make_policy("streaming", 40),
                                    make_policy("h2o", 40), make_policy("full")],
                         ids=lambda p: p.name)
def test_one_token_blocks_equal_the_token_granular_loop(llama, policy):
    """With 1-token blocks the engine evicts exactly what the plain loop's compacting cache
    evicts, so their perplexities agree: the reference the block-granular price is read against."""
    ids = prompts((160,), seed=3)[0]
    row = perplexity_engine(llama, None, ids, policy, "fp32", block_size=1, chunk=16)
    loop = perplexity_loop(llama, ids, policy, chunk=16)
    assert row.quality == pytest.approx(loop, rel=1e-4)
    assert (row.blocks_freed > 0) == policy.active
    # 16-token blocks keep whole blocks (40 tokens -> 2 blocks): a different cache, another figure
    blocky = perplexity_engine(llama, None, ids, policy, "fp32", block_size=16, chunk=16)
    assert (blocky.quality == pytest.approx(loop, rel=1e-4)) == (not policy.active)


HYBRID = {"num_hidden_layers": 3, "sliding_window": 6,
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}


def test_a_hybrid_model_evicts_on_its_full_layer_as_a_window_would():
    """Gemma 3's shape (sliding layers and a full one): a policy evicts on the full layer only.
    With 1-token blocks, one token a step and a budget of window - 1, the window policy leaves
    each query of the full layer the same 6 keys a sliding layer sees: the engine's tokens are
    those of the same weights with every layer sliding (the plain loop)."""
    hybrid, sliding = tiny_model(**HYBRID), tiny_model(**{**HYBRID, "layer_types": ["sliding_attention"] * 3})
    batch = prompts((20, 13), seed=7)
    llm = LLM(hybrid, kv_policy="window", kv_budget=5, block_size=1, max_num_batched_tokens=1,
              kv_memory=kv_bytes(hybrid, 128, 1))
    got = [o.token_ids for o in llm.generate(batch, SHORT)]
    assert got == reference(sliding, batch, SHORT)
    assert got != reference(hybrid, batch, SHORT)  # eviction did change the full layer
    assert llm.metrics().evicted_blocks > 0


@pytest.mark.parametrize("policy", ["streaming", "snapkv", "adakv"])
def test_a_hybrid_model_scores_and_frees_its_full_layer_only(policy):
    """Scores come from the full layer's attention (a sliding layer's would favour its window),
    the full group stays within the budget, the sliding group within its window, and every
    block of both pools is free at the end."""
    model = tiny_model(**HYBRID)
    bs, budget = 4, 24
    llm = LLM(model, kv_memory=kv_bytes(model, 48, bs), block_size=bs, kv_policy=policy,
              kv_budget=budget, max_num_batched_tokens=8, preemption="swap-ram")
    engine = llm.engine
    full = next(i for i, g in enumerate(engine.kv.groups) if g.window is None)
    for p in prompts((40, 30), seed=8):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    held, heads, scored = {0: 0, 1: 0}, model.spec.layers[0].num_heads, policy != "adakv"
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            for gi, table in enumerate(seq.block_tables):
                held[gi] = max(held[gi], sum(b >= 0 for b in table))
            if seq.scores is not None and seq.scores.dim() == 2:  # adakv: a column per layer and head
                assert seq.scores[:, :heads].sum() == 0 == seq.scores[:, 2 * heads:].sum()
                scored |= bool(seq.scores[:, heads:2 * heads].sum() > 0)
    bound = budget // bs + 1 + 8 // bs
    if policy != "streaming":  # holds the whole prompt before it compresses
        bound = max(bound, 40 // bs)
    assert 0 < held[full] <= bound and scored
    assert held[1 - full] <= -(-(6 - 1 + 8 - 1) // bs) + 1
    m = llm.metrics()
    assert m.evicted_blocks > 0 and m.kv_blocks_used == 0
    assert all(pool.num_available == 48 for pool in engine.kv.pools)


def test_a_model_whose_every_layer_slides_is_refused_in_one_line():
    model = tiny_model(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=8)
    with pytest.raises(ValueError, match="every layer of .* has a sliding window"):
        LLM(model, kv_policy="h2o", kv_budget=32, block_size=4)


class KeepOldest(EvictionPolicy):
    """A policy no module has heard of: the oldest units within the budget, and the one being
    written (window's opposite). Only its keep rule is its own; the rest is the base class's."""

    name = "oldest-test"

    def keep(self, kept, n, unit, scores):
        allowed = self.allowed_units(n, unit)
        if int(kept.sum()) <= allowed:
            return kept
        out = torch.zeros_like(kept)
        out[torch.nonzero(kept).flatten()[:allowed - 1]] = True
        out[-1] = True
        return out


@pytest.fixture
def oldest():
    register(KeepOldest)
    yield KeepOldest
    unregister(KeepOldest.name)


def test_a_new_policy_is_run_through_its_hooks_alone(llama, oldest):
    """A subclass with its own keep rule, registered by name, is what the paged engine and the
    plain loop run, with no edit to the scheduler, the runner or the attention: the blocks held
    are the oldest ones and the one being written, and 1-token blocks match the loop's cache."""
    from kvlab.models.attention import EvictingKVCache

    bs, budget = 8, 32
    llm = LLM(llama, kv_memory=kv_bytes(llama, 64, bs), block_size=bs, kv_policy=oldest.name,
              kv_budget=budget, max_num_batched_tokens=16)
    llm.engine.add_request(prompts((40,), seed=2)[0], LONG)
    steps = 0
    while llm.engine.has_unfinished():
        llm.engine.step()
        for seq in llm.engine.scheduler.running:
            computed = -(-seq.num_computed_tokens // bs)
            held = [i for i, b in enumerate(seq.block_tables[0][:computed]) if b >= 0]
            assert held == (list(range(computed)) if computed <= budget // bs else [0, 1, 2, computed - 1])
            steps += 1
    m = llm.metrics()
    assert steps > 100 and m.evicted_blocks > 0 and m.kv_blocks_used == 0

    ids = prompts((160,), seed=3)[0]
    policy = make_policy(oldest.name, 40)
    cache = EvictingKVCache(llama.spec, policy, policy.max_tokens_held(160, 160, 16, 1), 160, torch.float32)
    for a in range(0, 160, 16):
        llama(torch.tensor(ids[a:a + 16]), cache.prepare(16), cache, None)
        cache.evict()
    assert cache.positions[:cache.held].tolist() == [*range(39), 159]
    row = perplexity_engine(llama, None, ids, policy, "fp32", block_size=1, chunk=16)
    assert row.blocks_freed > 0
    assert row.quality == pytest.approx(perplexity_loop(llama, ids, policy, chunk=16), rel=1e-4)
    assert row.quality != pytest.approx(
        perplexity_engine(llama, None, ids, make_policy("window", 40), "fp32", block_size=1, chunk=16).quality,
        rel=1e-4)


def test_renumbered_positions_rotate_kept_keys_to_their_place_in_the_cache(llama):
    """StreamingLLM's positions in the loop reference: a kept key rotated down by the places it
    moved equals the key written at its new place; without eviction nothing moves, so the
    perplexity is the text-position one; with eviction the two choices give different figures."""
    from kvlab.models.attention import EvictingKVCache
    from kvlab.models.llama import apply_rope

    cache = EvictingKVCache(llama.spec, make_policy("streaming", 8), 16, 16, torch.float32,
                            renumber=llama.inv_freq)
    raw = torch.randn(llama.spec.num_kv_heads, 16, llama.spec.layers[0].head_dim)
    cos, sin = llama.rope(torch.arange(16), torch.float32)
    for k in cache.k:
        k[:] = apply_rope(raw.transpose(0, 1), cos, sin).transpose(0, 1)
    cache._rotate(16, torch.full((16,), -5))
    moved_cos, moved_sin = llama.rope(torch.arange(16) - 5, torch.float32)
    expected = apply_rope(raw.transpose(0, 1), moved_cos, moved_sin).transpose(0, 1)
    torch.testing.assert_close(cache.k[0], expected, rtol=1e-5, atol=1e-5)

    ids = prompts((160,), seed=3)[0]
    full = make_policy("full")
    assert perplexity_loop(llama, ids, full, 16, renumber=True) == pytest.approx(
        perplexity_loop(llama, ids, full, 16), rel=1e-6)
    streaming = make_policy("streaming", 40)
    assert perplexity_loop(llama, ids, streaming, 16, renumber=True) != pytest.approx(
        perplexity_loop(llama, ids, streaming, 16), rel=1e-4)


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "adakv"])
def test_scoring_policies_are_batch_invariant_under_deterministic(llama, policy):
    """--deterministic lays keys out in whole splits; the scores a policy adds to cover them too
    (a 70-token sequence's last split reaches position 127). Each prompt's tokens in a batch
    are those it gets alone, later, on the same engine: a prefix-cache hit never covers a voting
    query (h2o: every one; snapkv: the prompt's last 32), whose scores it would skip."""
    batch = prompts((40, 70, 9), seed=1)
    llm = LLM(llama, kv_policy=policy, kv_budget=24, deterministic=True, block_size=4, preemption="swap-ram")
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(batch, params)]
    alone = [llm.generate([p], params)[0] for p in batch]
    assert together == [o.token_ids for o in alone] and all(len(t) == 30 for t in together)
    voting = [0 if policy == "h2o" else max(0, len(p) - 32) for p in batch]
    assert [o.num_cached_tokens for o in alone] == [v // 4 * 4 for v in voting]
    assert llm.metrics().evicted_blocks > 0


def test_lossy_blocks_are_never_served_as_a_prefix(llama):
    """Blocks computed before the first eviction saw the full text: they stay in the prefix cache.
    Blocks computed after it did not: never offered. A second identical request hits exactly the
    chunks computed before the first eviction and then computes what the first did, to the same
    tokens."""
    bs = 8
    llm = LLM(llama, kv_memory=kv_bytes(llama, 64, bs), block_size=bs, kv_policy="streaming",
              kv_budget=32, max_num_batched_tokens=16)
    prompt = prompts((100,), seed=5)[0]
    first = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20))
    again = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20))
    # chunks of 16: after the third (48 tokens = 6 blocks > the 32-token budget) blocks leave
    assert again[0].num_cached_tokens == 48
    assert again[0].token_ids == first[0].token_ids
    fresh = LLM(llama, kv_memory=kv_bytes(llama, 64, bs), block_size=bs, kv_policy="streaming",
                kv_budget=32, max_num_batched_tokens=16).generate(prompt, SamplingParams(temperature=0, max_tokens=20))
    assert fresh[0].token_ids == first[0].token_ids


def test_swap_restores_an_evicted_sequence_exactly(llama):
    """Preemption by swap moves the kept blocks out and back: the same tokens as a roomy run.
    Recompute rebuilds the lossy cache from the tokens: it finishes, with every block free."""
    bs, batch = 8, prompts((30, 34, 38, 26), seed=7)
    roomy = LLM(llama, kv_memory=kv_bytes(llama, 64, bs), block_size=bs, kv_policy="streaming",
                kv_budget=32, max_num_batched_tokens=32).generate(batch, LONG)
    for mode in ("swap-ram", "recompute"):
        tight = LLM(llama, kv_memory=kv_bytes(llama, 9, bs), block_size=bs, kv_policy="streaming",
                    kv_budget=32, max_num_batched_tokens=32, preemption=mode)
        outs = tight.generate(batch, LONG)
        m = tight.metrics()
        assert m.preemptions > 0 and m.kv_blocks_used == 0
        assert all(len(o.token_ids) == LONG.max_tokens for o in outs)
        if mode == "swap-ram":
            assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]


def test_cli_evict_table_and_json(capsys, tmp_path):
    argv = ["evict", "austen-demo", "--context", "256", "--budgets", "64", "--chunk", "32",
            "--policies", "full,window,streaming", "--json"]
    assert main(argv) == 0
    said = capsys.readouterr()
    rows = json.loads(said.out)  # the JSON alone on stdout, the stages on stderr (not a terminal: lines)
    assert said.err.startswith("… evict: ")
    assert [(r["policy"], r["budget"]) for r in rows] == [("full", None), ("window", 64), ("streaming", 64)]
    full, window, streaming = rows
    assert full["blocks_freed"] == 0 and window["blocks_freed"] > 0 and streaming["blocks_freed"] > 0
    assert window["kv_bytes_kept"] == streaming["kv_bytes_kept"] == 64 * 2048  # fp32, 1,024 B/token in bf16
    assert full["quality"] == pytest.approx(full["quality_token"], rel=1e-4)
    assert full["quality_token_renumbered"] is None and streaming["quality_token_renumbered"] > 1
    plot = tmp_path / "evict.png"
    assert main(argv[:-1] + ["--task", "needle", "--trials", "5", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "niah_single" in out and "accuracy" in out and plot.stat().st_size > 0  # a two-line header
    assert main(argv + ["--task", "ruler", "--trials", "2", "--context", "384"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["policy"], r["task"]) for r in rows] == [(p, t) for p in ("full", "window", "streaming")
                                                        for t in RULER_TASKS]
    for r in rows:
        lo, hi = r["interval"]
        assert r["trials"] == 2 and 0 <= lo <= r["quality"] <= hi <= 1
        assert 0 < r["kv_bytes_decoding"] <= r["kv_bytes_kept"]
        if r["policy"] != "full":  # the budget, the block being written and the 32-token step
            assert r["kv_bytes_decoding"] <= (64 + 16 + 32) * 2048


def test_server_with_a_policy_counts_evictions(tmp_path):
    """`kvlab serve --kv-policy streaming --kv-budget 32`: a long completion runs in a bounded
    cache and /metrics counts the blocks and tokens given back."""
    import httpx

    from tests.test_server_fixtures import MODEL_ID, LiveServer, tiny_bridge

    live = LiveServer(tiny_bridge(tmp_path, kv_policy="streaming", kv_budget=32,
                                  max_num_batched_tokens=16))
    try:
        res = httpx.post(f"{live.url}/v1/completions", timeout=60, json={
            "model": MODEL_ID, "prompt": "the cache " * 20, "max_tokens": 60, "temperature": 0,
            "ignore_eos": True})
        assert res.status_code == 200 and res.json()["usage"]["completion_tokens"] == 60
        metrics = httpx.get(f"{live.url}/metrics", timeout=10).text
        blocks = float(next(line.split()[-1] for line in metrics.splitlines()
                            if line.startswith("kvlab_evicted_blocks_total")))
        tokens = float(next(line.split()[-1] for line in metrics.splitlines()
                            if line.startswith("kvlab_evicted_tokens_total")))
        assert blocks > 0 and tokens == blocks * 8
    finally:
        live.stop()


@pytest.mark.parametrize("task", ["perplexity", "needle", "ruler"])
def test_evaluate_progress_runs_to_its_total(task):
    """Progress counts tokens through the model, grows within a row (the bar moves during a
    long row, not only between rows) and ends exactly at the total it announced."""
    from kvlab.evaluate import evaluate
    from kvlab.models import load

    from kvlab.evaluate import TASKS

    loaded = load("austen-demo", "fp32")
    calls = []
    context = 128 if task == "perplexity" else 384  # room for the question around the text
    rows = evaluate(loaded.model, loaded.tokenizer, task, ["full", "window"], [64], ["auto"], context=context,
                    chunk=32, trials=2, progress=lambda *a: calls.append(a))
    done = [d for d, _, _ in calls]
    assert len({t for _, t, _ in calls}) == 1 and done == sorted(done) and done[-1] == calls[0][1]
    assert len({w for _, _, w in calls}) == len(rows) == 2 * max(1, len(TASKS[task]))  # a row, a label
    assert len(calls) > 2 * context // 32  # per engine step / loop chunk, not per row


def test_evict_table_headers_are_whole():
    import io

    from rich.console import Console

    from kvlab.evaluate import EvictRow
    from kvlab.render import print_evict

    rows = [EvictRow("perplexity", "streaming", 256, "fp8_e4m3", 12.3, 12.1, 1_234_567, 40, 640, 12.3, 1, 12.9)]
    out = io.StringIO()
    print_evict(rows, "SmolLM2-135M-Instruct.Q4_1", 1024, Console(file=out, width=110))
    table = out.getvalue().split("perplexity (blocks):")[0]
    assert "…" not in table
    for word in ("perplexity", "(blocks)", "(tokens)", "renumbered)", "streaming", "fp8_e4m3", "evicted"):
        assert word in table


def test_snapkv_scores_only_its_voting_queries_and_admits_a_prompt_only_with_room_for_it(llama):
    """A prompt's chunk is cut where snapkv's voters begin (the plain kernels before, the scored
    attention for the last 32 queries only), and a prompt is admitted only when the pool holds
    the rest of it beside the running prompts: none is preempted half-way and recomputed."""
    bs = 4
    llm = LLM(llama, kv_memory=kv_bytes(llama, 26, bs), block_size=bs, kv_policy="snapkv", kv_budget=16,
              max_num_batched_tokens=64, preemption="recompute")
    engine = llm.engine
    cuts = []
    schedule = engine.scheduler.schedule

    def watched():
        out = schedule()
        cuts.extend((c.seq.request_id, c.start, c.num_tokens) for c in out.chunks if c.num_tokens > 1)
        return out
    engine.scheduler.schedule = watched
    batch = prompts((60, 60, 60), seed=12)
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert {(start, n) for _, start, n in cuts} == {(0, 60 - 32), (60 - 32, 32)}
    assert llm.metrics().preemptions == 0 and all(len(o.token_ids) == 30 for o in outs)
