"""Speed bounds that count compute: decode and prefill take the longer of bytes / bandwidth and
FLOPs / peak; decode's FLOP per byte, the batch where it turns compute-bound, and the work table
in FLOPs. Every expected figure is worked out here from the models' published shapes."""

import json
import math

import pytest

from kvlab.catalog import load_spec
from kvlab.cli import main
from kvlab.hardware import get_device
from kvlab.plan import PlanRequest, decode_flops, make_plan, prefill_flops
from kvlab.spec import spec_from_config
from tests.conftest import llama_like

H100 = get_device("h100-sxm")
PEAK, BW = 989e12, 3.35e12  # the H100 SXM datasheet: dense bf16 FLOP/s, HBM3 bytes/s

# Llama 3.1 8B: 8,030,261,248 parameters; embeddings and LM head 128,256 x 4,096 each, RMSNorm
# weights 65 x 4,096; 32 layers of 32 query heads of 128 dimensions
LLAMA8_LAYERS = 8_030_261_248 - 2 * 128_256 * 4096 - 65 * 4096
LLAMA8_LM_HEAD = 128_256 * 4096


def llama8_token_flops(keys: int) -> float:
    """One token: its matmuls (the embedding is a lookup) and attention over `keys` keys."""
    return 2 * LLAMA8_LAYERS + 2 * LLAMA8_LM_HEAD + 4 * 32 * 32 * 128 * keys


def test_device_figures_are_the_datasheets():
    assert (H100.flops, H100.bandwidth) == (PEAK, BW)


def test_decode_flops_per_token_dense():
    p = make_plan(load_spec("llama-3.1-8b"), PlanRequest(context=8192))
    assert p.decode_flops_per_token == pytest.approx(llama8_token_flops(8192))
    assert p.decode_flops_per_token / 1e9 == pytest.approx(19.30, abs=0.01)


def test_decode_flops_count_only_routed_experts():
    """Qwen3-30B-A3B: 48 layers, hidden 2,048, 32 x 128 query and 4 x 128 KV dims, 8 of 128
    experts of width 768 per token, a 128-way router, vocabulary 151,936."""
    attn = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048
    experts = 8 * 3 * 2048 * 768
    per_layer = attn + experts + 2048 * 128
    want = 2 * 48 * per_layer + 2 * 151_936 * 2048 + 48 * 2 * 32 * 256 * 4096
    assert decode_flops(load_spec("qwen3-30b-a3b"), 4096) == pytest.approx(want)


def test_decode_is_capped_by_the_h100s_compute():
    """Issue #11: Llama 3.1 8B at batch 2,048 read 136k tok/s by bandwidth alone, beyond what the
    H100's FLOP/s allow; the bound is now the compute limit."""
    spec = load_spec("llama-3.1-8b")
    p = make_plan(spec, PlanRequest(context=128, users=2048))
    kv = 2048 * 128 * 131_072  # 2,048 sequences of 128 tokens, 128 KiB per token
    bandwidth_only = 2048 * BW / (2 * 8_030_261_248 + kv)
    assert bandwidth_only == pytest.approx(136_000, rel=0.01)  # the old bound
    compute_limit = PEAK / llama8_token_flops(128)
    assert compute_limit == pytest.approx(65_600, rel=0.01)
    assert p.decode_tokens_per_s == pytest.approx(compute_limit)
    assert p.decode_tokens_per_s <= compute_limit * (1 + 1e-12)
    assert p.decode_step_seconds == pytest.approx(2048 * llama8_token_flops(128) / PEAK)
    assert p.decode_step_seconds == p.decode_compute_seconds > p.decode_weights_seconds + p.decode_kv_seconds


def test_decode_at_batch_one_is_about_one_flop_per_byte():
    """The Polish lesson: ~1 FLOP per byte at batch 1, where the H100 needs ~300."""
    p = make_plan(load_spec("llama-3.1-8b"), PlanRequest(context=8192, users=1))
    read = 2 * 8_030_261_248 + 8192 * 131_072
    assert p.decode_flops_per_byte == pytest.approx(llama8_token_flops(8192) / read)
    assert 1 < p.decode_flops_per_byte < 1.2
    assert p.device_flops_per_byte == pytest.approx(PEAK / BW) and 290 < p.device_flops_per_byte < 300
    assert p.decode_step_seconds == pytest.approx(read / BW)  # memory-bound: the reads decide


def test_compute_bound_batch_dense():
    """Solve b x flops / peak = (weights + b x cache) / bandwidth for b."""
    spec = load_spec("llama-3.1-8b")
    f, weights, per_seq = llama8_token_flops(128), 2 * 8_030_261_248, 128 * 131_072
    want = math.ceil(weights / BW / (f / PEAK - per_seq / BW))
    assert want == 469
    assert make_plan(spec, PlanRequest(context=128)).compute_bound_batch == want

    def limited_by_compute(users: int) -> bool:
        p = make_plan(spec, PlanRequest(context=128, users=users))
        return p.decode_compute_seconds >= p.decode_weights_seconds + p.decode_kv_seconds
    assert limited_by_compute(want) and not limited_by_compute(want - 1)
    # at 8,192 tokens a sequence's cache reads (1 GiB) outgrow its FLOPs / peak: never
    assert llama8_token_flops(8192) / PEAK < 8192 * 131_072 / BW
    assert make_plan(spec, PlanRequest(context=8192)).compute_bound_batch is None


def test_tensor_parallel_splits_compute_and_reads_alike():
    spec = load_spec("llama-3.1-8b")
    one = make_plan(spec, PlanRequest(context=128, users=2048))
    two = make_plan(spec, PlanRequest(context=128, users=2048, tp=2))
    assert two.decode_compute_seconds == pytest.approx(one.decode_compute_seconds / 2)
    assert two.compute_bound_batch == one.compute_bound_batch


def test_prefill_bound_is_the_longer_of_compute_and_reads():
    spec = load_spec("llama-3.1-8b")
    long = make_plan(spec, PlanRequest(context=8192))
    assert long.ttft_seconds == pytest.approx(prefill_flops(spec, 8192) / PEAK)
    short = make_plan(spec, PlanRequest(context=16))  # 16 tokens: the weights' read decides
    assert short.ttft_seconds == pytest.approx((2 * 8_030_261_248 + 16 * 131_072) / BW)
    assert short.ttft_seconds > prefill_flops(spec, 16) / PEAK


def test_sliding_window_caps_the_keys_a_decode_token_reads():
    spec = load_spec("mistral-7b")  # every layer slides over 4,096 tokens
    assert decode_flops(spec, 8192) == decode_flops(spec, 4096) > decode_flops(spec, 4095)


def tiny() -> tuple:
    """4 Llama layers (4,096 wide, 32 x 128 query heads, 8 KV heads, FFN 14,336, vocab 32,000):
    the spec and its matmul parameters per layer."""
    spec = spec_from_config(llama_like(num_hidden_layers=4), "t")
    return spec, 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336


def test_work_table_counts_flops_with_and_without_a_cache():
    spec, layer = tiny()
    p = make_plan(spec, PlanRequest(prompt=100, new_tokens=(1, 7, 50)))

    def prefill(n: int) -> float:  # n tokens, each attending to itself and every earlier one
        return 2 * 4 * layer * n + 2 * 32000 * 4096 + 4 * 2 * 32 * 256 * n * (n + 1) // 2
    for row, n in zip(p.work_table, (1, 7, 50)):
        assert row["new_tokens"] == n
        assert row["flops_without_cache"] == pytest.approx(sum(prefill(100 + i) for i in range(n)))
        with_cache = prefill(100 + n - 1) + (n - 1) * 2 * 32000 * 4096  # one LM head per new token
        assert row["flops_with_cache"] == pytest.approx(with_cache)
        assert row["flops_ratio"] == pytest.approx(row["flops_without_cache"] / row["flops_with_cache"])
    assert p.work_table[0]["flops_ratio"] == 1.0  # one new token: the same single prefill


def test_work_table_attention_grows_with_the_cube_without_a_cache():
    spec, layer = tiny()

    def attention_without(n: int) -> float:
        row = make_plan(spec, PlanRequest(prompt=1, new_tokens=(n,))).work_table[0]
        return row["flops_without_cache"] - 2 * 4 * layer * row["tokens_without_cache"] - n * 2 * 32000 * 4096
    assert attention_without(4000) / attention_without(2000) == pytest.approx(8, rel=0.01)

    def attention_with(n: int) -> float:
        row = make_plan(spec, PlanRequest(prompt=1, new_tokens=(n,))).work_table[0]
        return row["flops_with_cache"] - 2 * 4 * layer * row["tokens_with_cache"] - n * 2 * 32000 * 4096
    assert attention_with(4000) / attention_with(2000) == pytest.approx(4, rel=0.01)


def test_cli_plan_new_tokens_and_json_fields(capsys):
    assert main(["plan", "llama-3.1-8b", "--context", "128", "--users", "2048", "--new-tokens", "10,1000",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["new_tokens"] for r in out["work_table"]] == [10, 1000]
    assert out["decode_tokens_per_s"] == pytest.approx(PEAK / llama8_token_flops(128))
    assert out["compute_bound_batch"] == 469 and out["device_flops_per_byte"] == pytest.approx(PEAK / BW)
    for key in ("decode_compute_seconds", "decode_flops_per_token", "decode_flops_per_byte"):
        assert isinstance(out[key], float)
    assert main(["plan", "llama-3.1-8b", "--context", "8192"]) == 0
    text = capsys.readouterr().out
    assert "decode FLOP per byte" in text and "compute-bound from batch" in text and "FLOPs without" in text
    assert main(["plan", "llama-3.1-8b", "--new-tokens", "0"]) == 2
    assert capsys.readouterr().err == "kvlab plan: argument --new-tokens: need positive whole numbers, got '0'\n"


def test_a_cpu_plan_computes_at_kvlabs_own_kernel_rate():
    """kernel_flops (kvlab's kernel in the activations mode, measured by the CLI) replaces the
    matmul probe in every compute bound: a compute-bound prefill takes FLOPs / that rate."""
    spec = load_spec("smollm2-135m")
    slow, fast = (make_plan(spec, PlanRequest(context=4096, gpu="cpu", kernel_flops=f, activations=a))
                  for f, a in ((1e9, "fp32"), (4e9, "int8")))
    assert (slow.device_flops, fast.device_flops) == (1e9, 4e9)
    assert slow.ttft_seconds == pytest.approx(prefill_flops(spec, 4096) / 1e9)
    assert fast.ttft_seconds == pytest.approx(prefill_flops(spec, 4096) / 4e9)
    assert "int8 activations" in fast.device_flops_why and fast.activations == "int8"
    assert "kvlab's linear kernel" in fast.sources["device"]
    assert make_plan(spec, PlanRequest(gpu="cpu")).device_flops_why == "an fp32 matmul probe (numpy)"


@pytest.mark.parametrize("over, message", [
    ({"activations": "int8", "gpu": "h100-sxm"}, "--activations int8 is a mode of kvlab's CPU kernels"),
    ({"activations": "int4", "gpu": "cpu"}, "--activations must be fp32 or int8"),
    ({"kernel_flops": 1e12, "gpu": "h200"}, "kernel_flops is the rate of kvlab's CPU kernels")])
def test_activations_that_cannot_be_planned_say_so(over, message):
    with pytest.raises(ValueError, match=message):
        make_plan(load_spec("smollm2-135m"), PlanRequest(**over))


def test_cli_cpu_plan_measures_the_modes_kernel_once(capsys, monkeypatch, tmp_path):
    """`kvlab plan --gpu cpu --activations M` times kvlab's kernel in mode M the first time (a
    real run of kvlab.bench.kernel_peak), then reads the figure cached for this CPU and mode."""
    import kvlab.bench
    import kvlab.hardware

    monkeypatch.setattr(kvlab.hardware, "KERNEL_FILE", tmp_path / "kernels.json")  # nothing measured yet

    def plan(mode: str) -> dict:
        assert main(["plan", "smollm2-135m", "--gpu", "cpu", "--context", "2048", "--activations", mode,
                     "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    timed = []
    real = kvlab.bench.kernel_peak
    monkeypatch.setattr(kvlab.bench, "kernel_peak", lambda mode: timed.append(mode) or real(mode))
    first = plan("int8")
    assert timed == ["int8"] and first["activations"] == "int8" and first["device_flops"] > 1e8
    assert first["ttft_seconds"] >= first["prefill_flops"] / first["device_flops"] * (1 - 1e-9)
    assert plan("int8")["device_flops"] == first["device_flops"] and timed == ["int8"]
    assert plan("fp32")["activations"] == "fp32" and timed == ["int8", "fp32"]
