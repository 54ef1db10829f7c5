"""`kvlab plan --kv-policy P --kv-budget B`: what a sequence keeps (checked against the engine's
own blocks), the sequences that buys, hybrid and all-sliding models, and the measured accuracy
it quotes (kvlab/catalog/eviction.json)."""

from __future__ import annotations

import json

import pytest

from kvlab.catalog import load_spec
from kvlab.cli import main
from kvlab.dtypes import kv_dtype
from kvlab.engine.llm import LLM
from kvlab.plan import PlanRequest, make_plan
from kvlab.plan import eviction as plan_eviction
from kvlab.plan.eviction import Measured, measured_rows
from kvlab.sampling import SamplingParams
from kvlab.spec import spec_from_config
from tests.test_engine_parity import kv_bytes, prompts, tiny_config, tiny_model

HYBRID = {"num_hidden_layers": 3, "sliding_window": 6,
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}


def test_a_policy_keeps_its_budget_in_blocks_and_buys_sequences():
    spec = load_spec("smollm2-135m")
    plan = make_plan(spec, PlanRequest(context=4096, gpu="h100-sxm", kv_dtype="bf16",
                                       kv_policy="snapkv", kv_budget=0.25))
    e = plan.eviction
    per_token = spec.kv_bytes_per_token("bf16")
    assert e.budget_tokens == 1024 and e.held_tokens_generating == 1024 + 16  # + the block being written
    assert e.held_tokens_peak == 4096  # snapkv holds the whole prompt first
    assert e.bytes_per_sequence == 1040 * per_token and e.bytes_per_sequence_full == 4096 * per_token
    assert e.saved_fraction == pytest.approx(1 - 1040 / 4096)
    assert e.max_sequences_full == plan.max_sequences
    assert e.max_sequences == plan.kv_budget_bytes_per_gpu // (1040 * per_token)
    assert any("holds the whole prompt" in n for n in e.notes)
    assert make_plan(spec, PlanRequest(context=4096)).eviction is None  # full: no section


def test_a_hybrid_model_saves_on_its_full_layers_only():
    """Gemma 3 1B: 22 sliding layers (window 512) keep their window, 4 full layers the budget."""
    spec = load_spec("google/gemma-3-1b-it")
    e = make_plan(spec, PlanRequest(context=8192, kv_policy="streaming", kv_budget=512)).eviction
    d = kv_dtype("bf16")
    full = [layer for layer in spec.layers if layer.kind == "full"]
    sliding = [layer for layer in spec.layers if layer.kind == "sliding"]
    held = 512 + 16
    assert e.held_tokens_generating == held and len(full) == 4 and len(sliding) == 22
    assert e.bytes_per_sequence == (sum(layer.kv_bytes_per_token(d) for layer in full) * held
                                    + sum(layer.kv_bytes_per_token(d) for layer in sliding) * 512)
    assert e.bytes_per_sequence_full == spec.kv_bytes_per_sequence(8192, d)


def test_a_model_whose_every_layer_slides_has_nothing_to_evict():
    e = make_plan(load_spec("mistralai/Mistral-7B-v0.1"),
                  PlanRequest(context=8192, kv_policy="window", kv_budget=1024)).eviction
    assert any("nothing to evict" in n for n in e.notes)


@pytest.mark.parametrize("policy", ["streaming", "adakv"])
def test_the_blocks_planned_are_those_the_engine_holds_while_generating(policy):
    """The most full-layer blocks one sequence of a hybrid model holds in a decode step (before
    the step's eviction) are the plan's held_tokens_generating / block size."""
    model = tiny_model(**HYBRID)
    bs, budget, prompt, new = 4, 24, 40, 40
    llm = LLM(model, kv_memory=kv_bytes(model, 64, bs), block_size=bs, kv_policy=policy, kv_budget=budget,
              max_num_batched_tokens=8, preemption="swap-ram")
    engine = llm.engine
    full = next(i for i, g in enumerate(engine.kv.groups) if g.window is None)
    most = 0
    update = engine.scheduler.update

    def watched(out, *a, **k):
        nonlocal most
        for chunk in out.chunks:
            if chunk.start >= chunk.seq.num_prompt_tokens:  # a decode step
                most = max(most, sum(b >= 0 for b in chunk.seq.block_tables[full]))
        return update(out, *a, **k)
    engine.scheduler.update = watched
    llm.generate(prompts((prompt,), seed=9), SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    e = make_plan(model.spec, PlanRequest(context=prompt + new, kv_dtype="fp32", block_size=bs,
                                          kv_policy=policy, kv_budget=budget)).eviction
    assert most * bs == e.held_tokens_generating


def test_the_nearest_measured_budget_is_quoted(monkeypatch):
    def row(model_type, policy, budget, context=4096):
        return Measured("m", model_type, "ruler", context, policy, budget, 0.5, 0.3, 0.7, 0.9, 10,
                        "kvlab evict m", "cpu")
    rows = (row("qwen2", "adakv", 410), row("qwen2", "adakv", 1024), row("qwen2", "adakv", 512, 2048),
            row("qwen2", "snapkv", 1024), row("llama", "adakv", 1024))
    monkeypatch.setattr(plan_eviction, "measured_rows", lambda: rows)
    spec = spec_from_config(tiny_config(model_type="qwen2", architectures=["Qwen2ForCausalLM"]), "tiny-qwen")
    got = plan_eviction.nearest_measured(spec, "adakv", 0.3)
    assert got == [rows[1], rows[2]]  # 25% at 4k and 2k, longest context first; not 10%, not snapkv
    assert plan_eviction.nearest_measured(spec, "h2o", 0.25) == []


def test_the_shipped_figures_name_their_command_and_a_known_family():
    rows = measured_rows()
    assert rows, "kvlab/catalog/eviction.json holds no measured row"
    families = {load_spec(name).model_type for name in ("smollm2-135m", "google/gemma-3-1b-it", "Qwen/Qwen2.5-1.5B")}
    for r in rows:
        assert r.model_type in families and r.command.startswith("kvlab evict ") and r.cpu
        assert 0 <= r.low <= r.accuracy <= r.high <= 1 and 0 <= r.full_accuracy <= 1 and r.budget < r.context


def test_cli_plan_with_a_policy(capsys):
    assert main(["plan", "smollm2-135m", "--context", "2048", "--kv-policy", "adakv", "--kv-budget", "512",
                 "--json"]) == 0
    e = json.loads(capsys.readouterr().out)["eviction"]
    assert e["policy"] == "adakv" and e["budget_tokens"] == 512 and e["measured"]
    assert main(["plan", "smollm2-135m", "--context", "2048", "--kv-policy", "adakv", "--kv-budget", "512"]) == 0
    out = capsys.readouterr().out
    assert "Eviction: --kv-policy adakv --kv-budget 512" in out and "measured by: kvlab evict" in out


def test_cli_plan_bad_budget_is_one_line(capsys):
    assert main(["plan", "smollm2-135m", "--kv-policy", "h2o"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs --kv-budget" in err[0]
