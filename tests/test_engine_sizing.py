"""One sizing function for engine and planner: the blocks, tokens and max concurrency the engine
allocates are what `kvlab plan --kv-memory` prints, and its bytes are the planner's bytes/token."""

from __future__ import annotations

import json

import pytest

from kvlab.catalog import load_spec
from kvlab.cli import main
from kvlab.dtypes import kv_dtype
from kvlab.engine.engine import kv_memory_for
from kvlab.engine.llm import LLM
from kvlab.options import EngineOptions
from kvlab.layout import kv_cache_capacity, layer_groups
from kvlab.hardware import system_memory
from kvlab.plan import PlanRequest, make_plan
from tests.test_engine_parity import tiny_config, tiny_model  # noqa: F401 (fixtures)


@pytest.mark.parametrize("kv", ["fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "int8"])
def test_engine_allocates_what_the_planner_predicts(tmp_path, kv):
    cfg = tiny_config(num_hidden_layers=3, sliding_window=24,
                      layer_types=["full_attention", "sliding_attention", "full_attention"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = load_spec(str(tmp_path))
    memory, block_size, max_model_len = 3_000_000, 8, 200
    plan = make_plan(spec, PlanRequest(context=max_model_len, kv_dtype=kv, gpu="cpu",
                                       kv_memory=memory, block_size=block_size))
    llm = LLM(tiny_model(**cfg), kv_memory=memory, block_size=block_size, kv_dtype=kv,
              max_model_len=max_model_len)
    m = llm.metrics()
    assert (m.kv_cache_blocks, m.kv_cache_tokens, m.max_concurrency) == \
        (plan.kv_cache_blocks, plan.kv_cache_tokens, plan.max_concurrency)
    fixed = kv_dtype(kv).fixed_bytes_per_tensor * 2 * 3
    per_token = spec.kv_bytes_per_token(kv)
    assert per_token == plan.kv_bytes_per_token
    assert llm.engine.cache.nbytes == m.kv_cache_blocks * block_size * per_token + fixed <= memory
    assert m.kv_cache_blocks == (memory - fixed) // (block_size * per_token)
    assert m.max_concurrency == m.kv_cache_blocks / 25  # a full layer holds 200 / 8 blocks


def test_plan_cli_gains_engine_capacity(capsys):
    argv = ["plan", "Qwen/Qwen2.5-0.5B", "--kv-memory", "2GiB", "--block-size", "16",
            "--max-model-len", "1024", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    blocks = 2 * 2**30 // (16 * 12288)  # 12 KiB per token at bf16
    assert (out["kv_cache_blocks"], out["kv_cache_tokens"]) == (blocks, blocks * 16)
    assert out["max_concurrency"] == blocks / 64
    assert main(["plan", "Qwen/Qwen2.5-0.5B", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_cache_blocks"] is None  # only with --kv-memory


def test_sliding_windows_cap_what_a_sequence_holds():
    spec = load_spec("mistralai/Mistral-7B-v0.1")  # every layer slides, window 4096
    cap = kv_cache_capacity(spec, 2**31, 16, "bf16", 32768)
    assert [g.kind for g in layer_groups(spec)] == ["sliding"]
    assert cap.max_concurrency == cap.blocks / (4095 // 16 + 1 + 1)


def test_state_layers_are_not_paged():
    with pytest.raises(ValueError, match="not paged"):
        kv_cache_capacity(load_spec("tiiuae/falcon-mamba-7b"), 2**30, 16, "bf16", 1024)
    plan = make_plan(load_spec("tiiuae/falcon-mamba-7b"), PlanRequest(kv_memory=2**30))
    assert plan.kv_cache_blocks is None and any("not paged" in n for n in plan.notes)


def test_memory_utilisation_leaves_room_for_weights_and_activations():
    model = tiny_model()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    ram = system_memory()
    assert 0 < kv_memory_for(EngineOptions(mem_util=0.5), model) < ram * 0.5 - weights
    assert kv_memory_for(EngineOptions(), model) == 2**30  # CPU default
    assert kv_memory_for(EngineOptions(kv_memory="8MiB"), model) == 8 * 2**20
