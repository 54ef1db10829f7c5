"""`kvlab plan --engine`: vLLM's and llama-server's own KV-cache lines, checked against lines the
real engines logged (tests/fixtures/engine_lines/*.json, recorded by benchmarks/engine_lines.py
with the engine version, command, date and machine), and the formulas' parts one by one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlab.catalog import OPTIONAL, find, load_spec
from kvlab.cli import main
from kvlab.plan import PlanRequest, make_plan
from kvlab.plan.engines import llamacpp, vllm

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "engine_lines").glob("*.json"))
ROOT = Path(__file__).resolve().parent.parent


def plan_json(argv: list[str], capsys) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_plan_prints_the_engines_own_lines(path, capsys, monkeypatch):
    rec = json.loads(path.read_text())
    needed = rec.get("optional_model")  # a real file's run: kvlab plan reads the file's header
    if needed and not OPTIONAL[needed].installed():
        pytest.skip(f"optional model {needed} not installed (kvlab models --install {needed})")
    for key in ("engine", "engine_version", "model", "command", "date", "machine", "log_lines"):
        assert rec[key], key
    monkeypatch.chdir(ROOT)  # fixtures name config files relative to the repository
    out = plan_json(rec["kvlab_plan"][1:], capsys)
    assert out["engine_log_lines"] == rec["log_lines"]


def test_fixtures_cover_the_issue_configs():
    """Dense GQA, a sliding-window model, an fp8 cache, two memory sizes, for each engine present."""
    recs = [json.loads(p.read_text()) for p in FIXTURES]
    vllm_runs = [" ".join(r["kvlab_plan"]) for r in recs if r["engine"] == "vllm"]
    assert any("gemma3" in r for r in vllm_runs) and any("fp8" in r for r in vllm_runs)
    assert {"1GiB", "2GiB"} <= {a for r in recs for a in r["kvlab_plan"]}
    llama_runs = [" ".join(r["kvlab_plan"]) for r in recs if r["engine"] == "llama.cpp"]
    assert any("gemma3" in r for r in llama_runs) and any("q8_0" in r for r in llama_runs)
    assert any(len(r["log_lines"]) == 2 for r in recs if r["engine"] == "llama.cpp")  # the SWA cache


# --- vLLM ------------------------------------------------------------------------------------

def test_vllm_tokens_are_concurrency_times_length_in_0_32():
    """Qwen2.5-0.5B, 1 GiB on CPU: 24 layers x 128-token pages of 2 KV heads x 128 x 2 B = 1.5 MiB a
    block, 682 blocks; a 4,096-token request takes 32, so 21.31x and 21.3125 x 4096 tokens (blocks x
    block size would say 87,296 too only by accident: check a length that does not divide)."""
    spec = load_spec("qwen2.5-0.5b")
    p = vllm.predict(spec, vllm.VllmSettings(max_model_len=4000, device="cpu", kv_memory=2**30))
    assert p.block_size == 128 and p.bytes_per_block == 24 * 128 * 2 * 2 * 64 * 2 and p.num_blocks == 682
    assert p.max_concurrency == 682 / 32 and p.tokens == int(682 / 32 * 4000) != 682 * 128
    assert p.log_line == "CPU KV cache size: 85,250 tokens, Maximum concurrency for 4,000 tokens per request: 21.31x"


def test_vllm_sliding_groups_and_window_blocks():
    """Gemma-3-1B: 22 sliding + 4 full layers -> groups of 4: six sliding groups taking every sixth
    layer (4, 4, 4, 4, 3, 3: two padding slots) and one full group;
    a sliding group needs cdiv(min(W - 1 + batched tokens, L), block) + 1 blocks per request."""
    spec = load_spec("gemma-3-1b")
    s = vllm.VllmSettings(max_model_len=32768, device="gpu", kv_memory=8 * 2**30, block_size=16,
                          max_num_batched_tokens=2048)
    p = vllm.predict(spec, s)
    kinds = [g.kind for g in p.groups]
    assert kinds.count("sliding") == 6 and kinds.count("full") == 1
    assert sorted(len(g.layers) for g in p.groups) == [3, 3, 4, 4, 4, 4, 4]
    sliding = next(g for g in p.groups if g.kind == "sliding")
    assert sliding.blocks_per_request == -(-(512 - 1 + 2 * 2048) // 16) + 1  # GPUs: 2 batches in flight
    assert p.bytes_per_block == 4 * p.page_bytes
    assert p.num_blocks == 8 * 2**30 // p.bytes_per_block


def test_vllm_tp_replicates_kv_heads_and_fp8_halves_pages():
    spec = load_spec("llama-3.1-8b")  # 8 KV heads
    page = lambda **kw: vllm.predict(spec, vllm.VllmSettings(max_model_len=8192, kv_memory=2**34, **kw)).page_bytes  # noqa: E731
    assert page(tp=8) == page(tp=16) == page() // 8  # one head per rank, then replicas
    assert page(kv_cache_dtype="fp8") == page() // 2


def test_vllm_estimate_is_labelled_and_command_realises_the_plan(capsys):
    out = plan_json(["plan", "llama-3.1-8b", "--engine", "vllm", "--gpu", "h100", "--max-model-len", "16384"], capsys)
    assert out["engine_details"]["available_is_estimate"]
    assert any("estimate" in n for n in out["notes"])
    assert out["engine_command"].startswith("vllm serve meta-llama/Llama-3.1-8B --max-model-len 16384 --block-size 16")
    exact = plan_json(["plan", "qwen2.5-0.5b", "--engine", "vllm", "--gpu", "cpu", "--kv-memory", "1GiB",
                       "--kv-cache-dtype", "fp8", "--max-model-len", "4096"], capsys)
    assert not exact["engine_details"]["available_is_estimate"]
    assert exact["engine_command"].endswith("--kv-cache-memory-bytes 1073741824 --kv-cache-dtype fp8")


def test_vllm_unpredicted_layouts_say_so():
    with pytest.raises(ValueError, match="not predicted"):
        vllm.predict(load_spec("falcon-mamba-7b"), vllm.VllmSettings(max_model_len=1024, kv_memory=2**30))
    with pytest.raises(ValueError, match="--vllm-version 0.6"):
        vllm.predict(load_spec("qwen2.5-0.5b"), vllm.VllmSettings(max_model_len=1024, kv_memory=2**30, version="0.6"))


# --- llama.cpp -------------------------------------------------------------------------------

def test_llamacpp_padding_streams_and_quantised_rows():
    """SmolLM2-135M: 30 layers, 3 KV heads x 64. -c 5000 -np 3: 5,120 cells padded, 1,707 per
    slot padded to 1,792, three streams; q8_0 rows of 192 values are 6 blocks of 34 B."""
    spec = load_spec("smollm2-135m")
    p = llamacpp.predict(spec, llamacpp.LlamaCppSettings(ctx_size=5000, parallel=3, cache_type_k="q8_0"))
    (c,) = p.caches
    assert (p.n_ctx_seq, p.n_ctx, c.cells, c.streams, c.seqs) == (1792, 5376, 1792, 3, 3)
    assert c.k_bytes == 30 * 6 * 34 * 1792 * 3 and c.v_bytes == 30 * 192 * 2 * 1792 * 3
    auto = llamacpp.predict(spec, llamacpp.LlamaCppSettings(ctx_size=0))  # the model's 8,192, 4 unified slots
    assert auto.caches[0].text() == ("llama_kv_cache: size =  180.00 MiB (  8192 cells,  30 layers,  "
                                     "4/1 seqs), K (f16):   90.00 MiB, V (f16):   90.00 MiB")
    assert llamacpp.row_bytes("q4_0", 64) == 36 and llamacpp.mib(3 * 2**20 // 7) == "   0.43"


def test_llamacpp_sliding_layers_get_their_own_cache():
    """Gemma-2-2B: 13 sliding layers of W=4096 in a cache of pad256(min(cells, W x slots + ubatch))."""
    spec = load_spec("gemma-2-2b")
    p = llamacpp.predict(spec, llamacpp.LlamaCppSettings(ctx_size=32768, parallel=2))
    full, swa = p.caches
    assert (full.layers, swa.layers) == (13, 13)
    assert full.cells == 16384 and swa.cells == 4096 + 512  # per stream: W + n_ubatch, padded
    unified = llamacpp.predict(spec, llamacpp.LlamaCppSettings(ctx_size=32768))
    assert unified.caches[1].cells == 4 * 4096 + 512  # 4 unified slots share it; a multiple of 256
    mistral = llamacpp.predict(load_spec("mistral-7b"), llamacpp.LlamaCppSettings(ctx_size=8192))
    assert len(mistral.caches) == 1  # llama.cpp runs Mistral as llama: no SWA cache


def test_llamacpp_command_names_the_gguf(capsys):
    out = plan_json(["plan", "smollm2-135m", "--engine", "llama.cpp", "-c", "4096", "-np", "2",
                     "-ctk", "q8_0"], capsys)
    assert out["engine"].startswith("llama.cpp")
    assert out["engine_command"].endswith(".gguf -c 4096 -np 2 -ctk q8_0")


@pytest.mark.parametrize("argv, message", [
    (["plan", "smollm2-135m", "-c", "4096"], "--ctx-size needs --engine llama.cpp"),
    (["plan", "smollm2-135m", "--engine", "vllm", "-ctk", "q8_0"], "--cache-type-k needs --engine llama.cpp"),
    (["plan", "qwen2.5-0.5b", "--kv-cache-dtype", "fp8"], "--kv-cache-dtype needs --engine vllm"),
    (["plan", "smollm2-135m", "--engine", "llama.cpp", "-ctk", "q3_k"], "not a llama.cpp cache type"),
    (["plan", "qwen2.5-0.5b", "--engine", "vllm", "--vllm-version", "0.6"], "--vllm-version 0.6"),
    (["plan", "qwen2.5-0.5b", "--engine", "sglang"], "invalid choice"),
    (["plan", "llama-3.1-8b", "--dp-attention"], "--dp-attention is for MLA models"),
])
def test_engine_flag_mistakes_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


# --- while in the planner --------------------------------------------------------------------

@pytest.mark.parametrize("typed, hf_id", [
    ("llama3.1-8b", "meta-llama/Llama-3.1-8B"), ("Meta-Llama-3.1-8B", "meta-llama/Llama-3.1-8B"),
    ("meta-llama/Meta-Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B"),
    ("llama-3-70b", "meta-llama/Meta-Llama-3-70B"), ("llama3-70b", "meta-llama/Meta-Llama-3-70B"),
    ("qwen-2.5-7b", "Qwen/Qwen2.5-7B"), ("Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B"),
    ("gemma3-1b", "google/gemma-3-1b-it"), ("gptoss-20b", "openai/gpt-oss-20b"),
])
def test_catalogue_accepts_common_spellings(typed, hf_id):
    assert find(typed).hf_id == hf_id


def test_dp_attention_splits_the_batch_instead_of_replicating():
    spec = load_spec("deepseek-v3")
    req = dict(context=16384, users=64, tp=8, gpu="h200", weights_dtype="fp8")
    tp_attn, dp_attn = make_plan(spec, PlanRequest(**req)), make_plan(spec, PlanRequest(**req, dp_attention=True))
    per_seq = spec.kv_bytes_per_sequence(16384)
    assert tp_attn.kv_bytes_batch_per_gpu == 64 * per_seq  # MLA: every rank holds every sequence
    assert dp_attn.kv_bytes_batch_per_gpu == 8 * per_seq  # each rank holds 64 / 8 sequences
    assert dp_attn.max_sequences == 8 * tp_attn.max_sequences
    assert "--enable-dp-attention" in dp_attn.vllm_flags


def test_gpu_memory_override_names_itself():
    p = make_plan(load_spec("qwen2.5-1.5b"), PlanRequest(gpu="rtx-3060", gpu_memory=12_490_000_000))
    assert p.gpu == "rtx-3060" and "RTX 3060" in p.gpu_name and "--gpu-memory" in p.gpu_name
    assert p.gpu_memory_bytes == 12_490_000_000
    assert any("12.49 GB" in n and "stay those of --gpu rtx-3060" in n for n in p.notes)
