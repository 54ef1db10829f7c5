"""The planner: capacity, tensor parallelism, speed bounds and the lessons' exercises."""

import math

import pytest

from kvlab.catalog import load_spec
from kvlab.dtypes import weight_dtype
from kvlab.hardware import get_device
from kvlab.plan import PlanRequest, make_plan, valid_tp_sizes
from kvlab.plan.memory import weights_split
from kvlab.spec import spec_from_config
from tests.conftest import llama_like

GiB = 2**30


def test_rtx3060_capacity_example():
    """Vietnamese lesson: Qwen2.5-1.5B on a 12.49 GB card, 2,048-token users."""
    spec = load_spec("qwen2.5-1.5b")
    p = make_plan(spec, PlanRequest(context=2048, users=1, gpu="rtx-3060", gpu_memory=12_490_000_000, mem_util=1.0))
    assert p.weights_bytes / 1e9 == pytest.approx(3.087, abs=0.001)
    assert p.kv_bytes_per_sequence == 2048 * 28_672
    # budget = memory - weights - stated allowances; users = budget // per-user cache
    assert p.kv_budget_bytes_per_gpu == (12_490_000_000 - p.weights_bytes - p.activation_allowance_bytes
                                         - p.runtime_overhead_bytes - p.logits_bytes_last_only)
    assert p.max_sequences == p.kv_budget_bytes_per_gpu // p.kv_bytes_per_sequence
    lesson_tokens = (12.49e9 - 3.087e9) // 28_672  # the lesson's ~328,000 tokens, no allowances
    assert 300_000 < lesson_tokens < 330_000
    assert 0.8 * lesson_tokens / 2048 < p.max_sequences <= lesson_tokens / 2048


def test_logits_vs_kv_ratio():
    p = make_plan(load_spec("qwen2.5-1.5b"), PlanRequest(context=8192, gpu="rtx-3060"))
    per_token_logits = p.logits_bytes_all_positions / 8192
    assert per_token_logits == 151_936 * 2
    assert per_token_logits / p.kv_bytes_per_token == pytest.approx(10.6, abs=0.05)
    assert p.logits_bytes_last_only == 151_936 * 2


def test_chinese_exercise_fits_on_8x80():
    """max_model_len 131072, 32 sequences, utilisation 0.9, 8 x 80 GiB: it fits."""
    p = make_plan(load_spec("llama-3.1-8b"), PlanRequest(context=131_072, users=32, gpus=8,
                                                         gpu_memory=80 * GiB, mem_util=0.9))
    assert p.tp == 8 and p.kv_bytes_total == 32 * 16 * GiB
    assert p.max_sequences >= 32
    assert p.gpus_needed <= 8


def test_24gb_exercise_does_not_fit():
    spec = spec_from_config(llama_like())
    p = make_plan(spec, PlanRequest(context=8000, users=50, gpu="rtx-4090", gpu_memory=24 * 10**9))
    assert p.kv_bytes_total == 50 * 750 * 2**20
    assert p.max_sequences < 50
    assert p.gpus_needed > 1
    assert any("do not fit" in n for n in p.notes)


def test_tensor_parallel_splits_gqa_and_replicates():
    spec = load_spec("llama-3.1-70b")  # 8 KV heads
    seq = spec.kv_bytes_per_sequence(8192)
    assert make_plan(spec, PlanRequest(tp=8)).kv_bytes_per_gpu == seq // 8
    p16 = make_plan(spec, PlanRequest(tp=16))
    assert p16.kv_bytes_per_gpu == seq // 8 and p16.kv_replicated
    assert not make_plan(spec, PlanRequest(tp=4)).kv_replicated
    mla = load_spec("deepseek-v3")
    p = make_plan(mla, PlanRequest(tp=8, weights_dtype="fp8"))
    assert p.kv_bytes_per_gpu == p.kv_bytes_per_sequence and p.kv_replicated


def test_valid_tp_sizes():
    # 14 heads and 2 KV heads would allow 14, but the FFN width 4,864 does not split 14 ways
    assert valid_tp_sizes(load_spec("qwen2.5-0.5b")) == [1, 2]
    qwen7 = load_spec("qwen2.5-7b")  # 28 heads, 4 KV heads, FFN 18,944 = 2^7 x 148
    assert 28 not in valid_tp_sizes(qwen7) and valid_tp_sizes(qwen7) == [1, 2, 4]
    with pytest.raises(ValueError, match="--tp 28 is not valid"):
        make_plan(qwen7, PlanRequest(tp=28))
    assert valid_tp_sizes(load_spec("llama-3.1-8b"))[:4] == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="--tp 3 is not valid"):
        make_plan(load_spec("llama-3.1-8b"), PlanRequest(tp=3))
    with pytest.raises(ValueError, match="not a multiple"):
        make_plan(load_spec("llama-3.1-8b"), PlanRequest(tp=4, gpus=6))


def test_data_parallel_replicas_multiply_capacity():
    spec = load_spec("llama-3.1-8b")
    one = make_plan(spec, PlanRequest(context=32768, gpus=1))
    four = make_plan(spec, PlanRequest(context=32768, gpus=4, tp=1))
    assert four.max_sequences == 4 * one.max_sequences


def test_decode_bound_and_crossover_dense():
    spec = load_spec("llama-3.1-8b")
    p = make_plan(spec, PlanRequest(context=8192, users=4, gpu="h100-sxm"))
    bw = get_device("h100-sxm").bandwidth
    assert p.decode_step_seconds == pytest.approx((p.weights_bytes + 4 * p.kv_bytes_per_sequence) / bw)
    assert p.crossover_batch == math.ceil(p.weights_bytes / p.kv_bytes_per_sequence)
    longer = make_plan(spec, PlanRequest(context=65536, gpu="h100-sxm"))
    assert longer.crossover_batch < p.crossover_batch  # longer contexts dominate sooner


def test_moe_decode_reads_only_routed_experts():
    spec = load_spec("qwen3-30b-a3b")
    bw = get_device("h200").bandwidth
    p1 = make_plan(spec, PlanRequest(context=4096, users=1, gpu="h200"))
    assert p1.decode_weights_seconds * bw < 0.25 * p1.weights_bytes
    p64 = make_plan(spec, PlanRequest(context=4096, users=64, gpu="h200"))
    assert p64.decode_weights_seconds > p1.decode_weights_seconds


def test_ttft_bound():
    spec = load_spec("llama-3.1-8b")
    p = make_plan(spec, PlanRequest(context=8192, gpu="h100-sxm"))
    # Llama 3.1 8B: 8,030,261,248 parameters, of which embeddings and LM head 128,256 x 4,096
    # each and RMSNorm weights (2 per layer and a final one) 65 x 4,096
    layers = 8_030_261_248 - 2 * 128_256 * 4096 - 65 * 4096
    matmul = 2 * layers * 8192 + 2 * 128_256 * 4096  # the LM head for the last token only
    attention = 32 * 2 * 32 * 256 * 8192 * 8193 / 2  # layers x 2 x heads x (K+V dims) x pairs
    assert p.prefill_flops == pytest.approx(matmul + attention)
    assert p.ttft_seconds == pytest.approx(p.prefill_flops / 989e12)


def test_ssm_only_model_has_no_crossover_growth():
    p = make_plan(load_spec("falcon-mamba-7b"), PlanRequest(context=100_000, users=4))
    assert p.kv_bytes_per_token == 0
    assert p.kv_bytes_per_sequence == make_plan(load_spec("falcon-mamba-7b"), PlanRequest(context=10)).kv_bytes_per_sequence


def test_work_table_matches_lesson():
    p = make_plan(load_spec("qwen2.5-1.5b"), PlanRequest(prompt=128))
    ratios = [round(r["work_ratio"]) for r in p.work_table]
    assert ratios == [53, 96, 171, 307]
    assert p.work_table[0]["tokens_with_cache"] == 191


def test_weight_dtypes():
    spec = load_spec("llama-3.1-8b")
    bf16 = make_plan(spec, PlanRequest(weights_dtype="bf16")).weights_bytes
    assert bf16 == 2 * spec.num_params
    int4 = make_plan(spec, PlanRequest(weights_dtype="int4")).weights_bytes
    assert 0.3 * bf16 < int4 < 0.4 * bf16  # 4-bit body, 16-bit embeddings, group scales


def test_cpu_device_is_measured():
    d = get_device("cpu")
    assert d.memory_bytes > 2**30 and d.bandwidth > 1e8 and d.flops > 1e8
    assert make_plan(load_spec("qwen2.5-0.5b"), PlanRequest(gpu="cpu")).max_sequences > 0


@pytest.mark.parametrize("over, message", [
    ({"mem_util": 1.5}, "--mem-util"), ({"context": 0}, "--context"), ({"users": 0}, "--users"),
    ({"kv_dtype": "fp6"}, "unknown KV dtype"), ({"gpu": "tpu"}, "unknown GPU")])
def test_bad_requests(over, message):
    with pytest.raises(ValueError, match=message):
        make_plan(load_spec("llama-3.1-8b"), PlanRequest(**over))


def test_weights_default_to_the_checkpoints_own_format():
    """DeepSeek-V3's config says fp8 (quantization_config), gpt-oss's MXFP4 experts: the plan
    uses them unless --weights-dtype says otherwise; an unquantised config plans bf16."""
    v3 = load_spec("deepseek-v3")
    auto, bf16 = make_plan(v3), make_plan(v3, PlanRequest(weights_dtype="bf16"))
    assert auto.weights_dtype == "fp8" and "quantization_config" in auto.weights_dtype_why
    assert auto.weights_bytes == make_plan(v3, PlanRequest(weights_dtype="fp8")).weights_bytes
    assert 0.49 < auto.weights_bytes / bf16.weights_bytes < 0.51  # 1,342 GB -> about 671 GB
    oss = load_spec("gpt-oss-120b")
    mx = make_plan(oss)
    assert mx.weights_dtype == "mxfp4"
    dense, experts = weights_split(oss, weight_dtype("mxfp4"))
    dense16, experts16 = weights_split(oss, weight_dtype("bf16"))
    assert dense == dense16  # attention, router, embeddings stay 16-bit
    assert experts / experts16 == pytest.approx(4.25 / 16, rel=1e-3)  # 4 bits + an 8-bit scale per 32
    assert 60 * GiB < mx.weights_bytes < 62 * GiB  # the published checkpoint: 60.8 GiB
    assert make_plan(load_spec("llama-3.1-8b")).weights_dtype == "bf16"


def test_a_gguf_on_this_cpu_plans_the_bytes_kvlabs_engine_holds():
    """SmolLM2's GGUF on --gpu cpu: the 96.6 MB kvlab's engine holds (Q4_1 and Q8_0 as stored,
    F32 norms), not 269 MB of dense bf16, in the budget and in decode's bandwidth bound. With
    --weights-dtype, or on a GPU (the stored-weights kernels are CPU-only), the dense figures."""
    spec = load_spec("smollm2-135m")
    bw = get_device("cpu").bandwidth
    p = make_plan(spec, PlanRequest(context=4096, gpu="cpu"))
    assert p.weights_held_by_kvlab and p.weights_bytes == spec.stored_weights.held_bytes == 96_576_768
    assert p.weights_dtype == "as stored: Q4_1, Q8_0; the rest fp32" and "--weights auto" in p.weights_dtype_why
    assert p.decode_weights_seconds == pytest.approx(96_576_768 / bw)
    assert p.decode_step_seconds == pytest.approx(max((96_576_768 + p.kv_bytes_per_sequence) / bw,
                                                      p.decode_compute_seconds))
    dense = make_plan(spec, PlanRequest(context=4096, gpu="cpu", weights_dtype="bf16"))
    assert not dense.weights_held_by_kvlab and dense.weights_dtype == "bf16"
    assert dense.weights_bytes == sum(weights_split(spec, weight_dtype("bf16"))) == 269_030_016
    assert p.kv_budget_bytes_per_gpu - dense.kv_budget_bytes_per_gpu == dense.weights_bytes - p.weights_bytes
    gpu = make_plan(spec, PlanRequest(context=4096, gpu="h100-sxm"))
    assert not gpu.weights_held_by_kvlab and (gpu.weights_dtype, gpu.weights_bytes) == ("bf16", dense.weights_bytes)
    assert gpu.stored_weights_as_stored == "Q4_1, Q8_0"


def test_an_unread_quantization_config_says_so():
    spec = spec_from_config(llama_like(quantization_config={"quant_method": "hqq", "bits": 3}))
    p = make_plan(spec)
    assert p.weights_dtype == "bf16" and any("hqq" in n and "--weights-dtype" in n for n in p.notes)
    gptq = spec_from_config(llama_like(quantization_config={"quant_method": "gptq", "bits": 4}))
    assert make_plan(gptq).weights_dtype == "int4"


def test_weights_beyond_memory_leave_no_budget_not_a_negative_one():
    p = make_plan(load_spec("deepseek-v3"), PlanRequest(context=32768, users=16, gpu="h200", gpus=8,
                                                        kv_dtype="fp8", weights_dtype="bf16"))
    taken = (p.weights_bytes_per_gpu + p.logits_bytes_last_only + p.activation_allowance_bytes
             + p.runtime_overhead_bytes)
    assert taken > p.usable_bytes_per_gpu
    assert p.kv_budget_bytes_per_gpu == 0 and p.memory_shortfall_bytes_per_gpu == taken - p.usable_bytes_per_gpu
    assert p.max_sequences == 0 and p.max_context_for_users is None
    assert p.vllm_flags is None  # no `--max-num-seqs 1` beside "room for 0"
    fits = make_plan(load_spec("llama-3.1-8b"))
    assert fits.memory_shortfall_bytes_per_gpu == 0 and fits.kv_budget_bytes_per_gpu > 0


def test_fp8_scales_and_tp_split_as_the_cache_has_them():
    """fp8 keeps one scale per cached tensor of each layer: K and V, or MLA's one latent; MLA's
    latent is whole on every GPU, GQA heads split (and past kv_heads GPUs, replicate)."""
    mla = make_plan(load_spec("deepseek-v3"), PlanRequest(tp=8, kv_dtype="fp8"))
    assert mla.kv_fixed_bytes == 4 * 61 and "latent (4 B per layer)" in mla.kv_layout
    assert "MLA latent" in mla.kv_split and "KV heads" not in mla.kv_split
    gqa = make_plan(load_spec("llama-3.1-70b"), PlanRequest(tp=8, kv_dtype="fp8"))
    assert gqa.kv_fixed_bytes == 8 * 80 and "K and for V (8 B per layer)" in gqa.kv_layout
    assert gqa.kv_split == "split by KV heads: 1 of 8 per GPU"
    assert "replicated" in make_plan(load_spec("llama-3.1-70b"), PlanRequest(tp=16)).kv_split
