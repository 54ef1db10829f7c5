"""`kvlab bench`: the seeded workload, the engine run's figures, transformers' run, FLOP counts."""

from __future__ import annotations

import json

import pytest

from kvlab import dispatch, kernels
from kvlab.bench import Workload, add_compute_bound, bandwidth_bound, parse_range, run_engine, run_hf
from kvlab.cli import main
from kvlab.options import EngineOptions
from kvlab.dtypes import weight_dtype
from kvlab.hardware import get_device
from kvlab.models import load
from kvlab.models.weights import held_bytes, held_formats
from kvlab.plan import decode_flops, generation_flops, prefill_flops
from kvlab.plan.memory import weights_split
from kvlab.sampling import SamplingParams
from kvlab.spec import spec_from_config
from kvlab.units import fmt_bytes
from tests.conftest import llama_like
from tests.test_engine_parity import kv_bytes, reference, tiny_model
from tests.test_gguf import Q, write_tiny_gguf
from tests.test_models import make_checkpoint


def test_workload_is_seeded_and_in_range():
    w = Workload(20, (5, 30), (2, 9), shared_prefix=4, seed=3)
    reqs = w.requests(128)
    assert reqs == w.requests(128)
    assert reqs != Workload(20, (5, 30), (2, 9), shared_prefix=4, seed=4).requests(128)
    assert all(5 <= len(p) <= 30 and 2 <= n <= 9 for p, n in reqs)
    assert len({tuple(p[:4]) for p, _ in reqs}) == 1  # the shared prefix opens every prompt
    assert len({tuple(p[4:]) for p, _ in reqs}) == 20
    with pytest.raises(ValueError, match="shorter than the shortest input"):
        Workload(2, (4, 8), (1, 1), shared_prefix=4).requests(128)


@pytest.mark.parametrize("text", ["", "0:4", "9:3", "a:b", "1:2:3"])
def test_parse_range_rejects(text):
    with pytest.raises(ValueError, match="not a length range"):
        parse_range(text)


def test_parse_range():
    assert parse_range("64:512") == (64, 512) and parse_range("128") == (128, 128)


def test_generation_flops_adds_one_decode_step_per_token():
    spec = spec_from_config(llama_like(num_hidden_layers=4), "t")
    assert generation_flops(spec, 100, 1) == prefill_flops(spec, 100)
    # per layer: q, o 4096 x 4096; k, v 4096 x 1024; gate, up, down 4096 x 14336
    layer_params = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    for p, n in ((100, 2), (37, 50)):
        context = p + n - 1  # the new step's query attends to every earlier token and itself
        step = (2 * 4 * layer_params + 2 * 32000 * 4096  # the layers' matmuls and the LM head
                + 4 * 4 * 32 * 128 * context)  # 4 layers x (QK^T + PV) x heads x head_dim x keys
        assert generation_flops(spec, p, n) - generation_flops(spec, p, n - 1) == pytest.approx(step)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_run_engine_matches_the_reference_and_counts(model):
    work = Workload(6, (3, 40), (2, 12), seed=1)
    reqs = work.requests(model.spec.vocab_size)
    options = EngineOptions(kv_memory=kv_bytes(model, 64, 4), block_size=4, max_num_batched_tokens=16)
    result, outputs = run_engine(model, options, work)
    assert outputs == [reference(model, [p], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0]
                       for p, n in reqs]
    assert result.output_tokens == sum(n for _, n in reqs)
    assert result.work_flops == sum(generation_flops(model.spec, len(p), n) for p, n in reqs)
    assert 0 < result.peak_kv_usage <= 1 and 0 <= result.kv_waste_at_peak < 1
    assert result.ttft_p50_s <= result.ttft_p99_s <= result.seconds


def test_phases_split_the_workloads_flops(model):
    """Continuous batching mixes prompt chunks and decodes; every step goes to one phase, so the
    phases' FLOPs add up to the workload's (no prefix hits, no preemption here)."""
    work = Workload(6, (3, 40), (2, 12), seed=1)
    result, _ = run_engine(model, EngineOptions(kv_memory=kv_bytes(model, 64, 4), block_size=4,
                                                max_num_batched_tokens=16), work)
    assert result.prefix_hits == 0 and result.preemptions == 0
    assert result.prefill_flops + result.decode_flops == pytest.approx(result.work_flops)
    assert result.prefill_flops > 0 and result.decode_flops > 0
    assert 0 < result.prefill_seconds + result.decode_seconds <= result.seconds


def test_phases_of_one_request(model):
    """One request: its prompt is the prefill phase; each later token a decode step that reads
    the weights and the cache of every token so far."""
    work = Workload(1, (20, 20), (6, 6), seed=3)
    result, _ = run_engine(model, EngineOptions(kv_memory=kv_bytes(model, 64, 4), block_size=4), work)
    spec = model.spec
    assert result.prefill_flops == pytest.approx(prefill_flops(spec, 20))
    contexts = range(21, 26)  # tokens 2..6 attend to the prompt, earlier tokens and themselves
    assert result.decode_flops == pytest.approx(sum(decode_flops(spec, c) for c in contexts))
    weights = sum(weights_split(spec, weight_dtype("fp32")))
    assert weights == 4 * sum(p.numel() for p in model.parameters())  # fp32 weights, as loaded
    assert result.held_weight_bytes == held_bytes(model) == weights  # a dense model: the same count
    assert result.held_formats == held_formats(model) and set(result.held_formats) == {"float32"}
    kv = sum(c * spec.kv_bytes_per_token("fp32") for c in contexts)
    assert result.decode_bytes == 5 * weights + kv
    add_compute_bound(result, model)
    peak = result.matmul_peak_flops
    assert result.prefill_peak_fraction == pytest.approx(result.prefill_flops / result.prefill_seconds / peak)
    assert result.decode_peak_fraction == pytest.approx(result.decode_flops / result.decode_seconds / peak)
    assert result.decode_bandwidth_fraction == pytest.approx(
        result.decode_bytes / result.decode_seconds / result.memory_bandwidth)


def test_decode_reads_the_weights_as_held(tmp_path, capsys):
    """A GGUF model held as stored: its decode steps and its batch-1 bound read the Q4_1 blocks'
    bytes (held_bytes), not the dense fp32 load's, beside the same cache."""
    folder = make_checkpoint(tmp_path / "hf", "llama")
    write_tiny_gguf(folder, tmp_path / "m.gguf", "llama", Q.Q4_1)
    stored, dense = (load(tmp_path / "m.gguf", weights=w).model for w in ("as-stored", "dense"))
    work = Workload(1, (20, 20), (6, 6), seed=3)
    options = EngineOptions(kv_memory=kv_bytes(dense, 64, 4), block_size=4)
    s, d = (run_engine(m, options, work)[0] for m in (stored, dense))
    assert s.held_weight_bytes == held_bytes(stored) < d.held_weight_bytes / 3
    assert d.held_weight_bytes == held_bytes(dense) == sum(weights_split(dense.spec, weight_dtype("fp32")))
    assert s.held_formats == {"Q4_1": 16} and d.held_formats == {"float32": 16}  # 2 layers x 7, embedding, head
    assert s.decode_bytes - 5 * s.held_weight_bytes == d.decode_bytes - 5 * d.held_weight_bytes > 0
    cpu, spec = get_device("cpu"), stored.spec
    read = s.held_weight_bytes + spec.kv_bytes_per_sequence(23, "fp32")
    assert bandwidth_bound(stored, 23) == pytest.approx(1 / max(read / cpu.bandwidth,
                                                                decode_flops(spec, 23) / cpu.flops))
    # the text says what the engine held and why
    argv = ["bench", str(tmp_path / "m.gguf"), "--weights", "as-stored", "--num-requests", "1",
            "--input-len", "20", "--output-len", "6", "--seed", "3"]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"weights held {fmt_bytes(s.held_weight_bytes)} matrices 16 Q4_1; Q4_1 as stored (as asked" in out


def test_hf_runs_the_same_requests(model):
    work = Workload(5, (3, 30), (2, 10), seed=2)
    result, outputs = run_engine(model, EngineOptions(kv_memory=kv_bytes(model, 64, 4), block_size=4),
                                 work)
    tps, hf_outputs = run_hf(model, work, batch_size=2)
    assert tps > 0 and hf_outputs == outputs


def test_cli_bench_json_on_the_bundled_model(capsys):
    args = ["bench", "--num-requests", "3", "--input-len", "8:24", "--output-len", "4:6", "--json"]
    assert main(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["num_requests"] == 3 and 12 <= r["output_tokens"] <= 18
    # the default dtype, auto: the Q4_1 file's values exactly, fp32 on every CPU, and why
    assert r["dtype"] == "fp32" and r["dtype_why"].startswith("auto: Q4_1 weights, exact in fp32")
    assert r["matmul_peak_flops"] > 0
    # the weights the engine holds, which each decode step reads: SmolLM2's blocks as stored
    if kernels.status().available:
        assert r["held_weight_bytes"] == 96_576_768 and r["held_formats"] == {"Q4_1": 210, "Q8_0": 1}
        assert r["weights"] == "Q4_1, Q8_0 as stored (auto)"
    assert r["compute_bound_tokens_per_s"] == pytest.approx(
        r["output_tokens"] * r["matmul_peak_flops"] / r["work_flops"])
    assert r["prefill_flops"] + r["decode_flops"] == pytest.approx(r["work_flops"])
    for phase in ("prefill_peak_fraction", "decode_peak_fraction", "decode_bandwidth_fraction"):
        assert r[phase] > 0


@pytest.mark.parametrize("activations", ["fp32", "int8"])
def test_the_compute_peaks_time_the_kernels_the_mode_runs(tmp_path, monkeypatch, activations):
    """kernel_peak (the planner's CPU rate) and matmul_peak (bench's bound) run the method a model
    in that mode runs: the native block kernel, with ACT8 in the int8 mode, where it runs."""
    import kvlab.bench as bench

    calls = []
    real = kernels.linear_q
    monkeypatch.setattr(kernels, "linear_q", lambda x, b, fmt, bias: calls.append(fmt) or real(x, b, fmt, bias))
    assert bench.kernel_peak(activations) > 0
    folder = make_checkpoint(tmp_path / "hf", "llama")
    write_tiny_gguf(folder, tmp_path / "m.gguf", "llama", Q.Q4_1)
    assert bench.matmul_peak(load(tmp_path / "m.gguf", activations=activations).model, rows=64) > 0
    if dispatch.backends().native:
        assert calls and all(bool(fmt & kernels.ACT8) == (activations == "int8") for fmt in calls)
