"""The page's JSON API returns what kvlab's planner and runtime compute, not numbers of its own."""

from __future__ import annotations

import json

import httpx
import pytest

from kvlab.catalog import CONFIG_DIR, load_spec
from kvlab.plan import PlanRequest, make_plan
from tests.test_server_fixtures import MODEL_ID, server  # noqa: F401


@pytest.fixture(scope="module")
def http(server):  # noqa: F811
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_options(http):
    o = http.get("/api/options").json()
    assert {"id": "meta-llama/Llama-3.1-70B", "alias": "llama-3.1-70b"} in o["models"]
    assert "h100-sxm" in [g["key"] for g in o["gpus"]] and "fp8_e4m3" in o["kv_dtypes"]
    assert o["served"]["id"] == MODEL_ID and o["served"]["block_size"] == 8


def test_plan_is_make_plan_on_one_gpu(http):
    body = {"model": "llama-3.1-70b", "context": 131072, "users": 4, "kv_dtype": "bf16", "gpu": "h100-sxm"}
    v = http.post("/api/plan", json=body).json()
    ref = make_plan(load_spec("llama-3.1-70b"), PlanRequest(context=131072, users=4, gpu="h100-sxm", gpus=1))
    assert v["plan"] == json.loads(json.dumps(ref.to_json()))
    assert v["plan"]["kv_bytes_per_token"] == 327_680  # the Polish lesson's figure
    seg = {s["key"]: s["bytes"] for s in v["memory"]["segments"]}
    assert seg["weights"] == ref.weights_bytes and seg["kv"] == ref.kv_bytes_total == 4 * ref.kv_bytes_per_sequence
    assert seg["overhead"] == ref.logits_bytes_last_only + ref.activation_allowance_bytes + ref.runtime_overhead_bytes
    assert v["gpus_cache_only"] == ref.gpus_needed_cache_only and v["gpus_everything"] == ref.gpus_needed
    assert v["max_users"] == ref.max_sequences and v["memory"]["fits"] is False


def test_plan_on_several_gpus_is_make_plan_with_them(http):
    body = {"model": "llama-3.1-70b", "context": 131072, "users": 4, "gpu": "h100-sxm", "gpus": 8}
    v = http.post("/api/plan", json=body).json()
    ref = make_plan(load_spec("llama-3.1-70b"), PlanRequest(context=131072, users=4, gpu="h100-sxm", gpus=8))
    assert v["plan"] == json.loads(json.dumps(ref.to_json())) and (v["gpus"], v["tp"]) == (8, 8)
    seg = {s["key"]: s["bytes"] for s in v["memory"]["segments"]}
    assert seg["weights"] == -(-ref.weights_bytes // 8)  # this GPU's share
    assert seg["kv"] == ref.kv_bytes_batch_per_gpu and v["memory"]["fits"] is True
    tp2 = http.post("/api/plan", json={**body, "tp": 2}).json()
    assert (tp2["gpus"], tp2["tp"]) == (8, 2)
    r = http.post("/api/plan", json={**body, "tp": 3})
    assert r.status_code == 400


def test_plan_reads_a_bundled_gguf_as_the_cli_does(http):
    v = http.post("/api/plan", json={"model": "smollm2-135m", "context": 2048}).json()
    ref = make_plan(load_spec("smollm2-135m"), PlanRequest(context=2048, gpus=1))
    assert v["plan"] == json.loads(json.dumps(ref.to_json())) and v["plan"]["stored_weights_formats"]
    assert {"id": "smollm2-135m", "alias": "smollm2-135m (bundled)"} in http.get("/api/options").json()["models"]


def test_a_cpu_plan_computes_at_the_served_modes_kernel_rate(http, server):  # noqa: F811
    """The page plans this CPU as `kvlab plan --gpu cpu --activations` does: at the rate kvlab's
    kernel reached here in the served model's activations mode (measured as the server started)."""
    mode, rate = server.bridge.cpu_compute
    assert mode == server.bridge.engine.model.activations and rate > 0
    v = http.post("/api/plan", json={"model": "smollm2-135m", "context": 4096, "gpu": "cpu"}).json()
    ref = make_plan(load_spec("smollm2-135m"), PlanRequest(context=4096, gpu="cpu", gpus=1, activations=mode,
                                                           kernel_flops=rate))
    assert v["plan"] == json.loads(json.dumps(ref.to_json())) and v["plan"]["device_flops"] == rate
    gpu = http.post("/api/plan", json={"model": "smollm2-135m", "context": 4096, "gpu": "h100-sxm"}).json()
    assert gpu["plan"]["device_flops_why"] == "the datasheet's dense bf16"
    c = http.post("/api/crossover", json={"model": "smollm2-135m", "context": 4096, "batch": 64, "gpu": "cpu"}).json()
    at = next(r for r in c["by_batch"] if r["batch"] == 64)
    assert at["compute_s"] == pytest.approx(make_plan(load_spec("smollm2-135m"), PlanRequest(
        context=4096, users=64, gpu="cpu", gpus=1, activations=mode, kernel_flops=rate)).decode_compute_seconds)


def test_plan_from_a_pasted_config(http):
    cfg = json.loads((CONFIG_DIR / "Qwen--Qwen2.5-1.5B.json").read_text())
    v = http.post("/api/plan", json={"config": cfg, "context": 2048, "users": 1, "gpu": "rtx-3060"}).json()
    assert v["plan"]["kv_bytes_per_token"] == 28_672  # the Vietnamese lesson's 28 KiB
    r = http.post("/api/plan", json={"config": {"model_type": "llama"}, "context": 2048})
    assert r.status_code == 400 and r.json()["error"]["param"] == "config"
    r = http.post("/api/plan", json={"model": "/etc/passwd"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"  # never a path
    r = http.post("/api/plan", json={"model": "llama-3.1-8b", "gpu": "toaster"})
    assert r.status_code == 400 and "unknown GPU" in r.json()["error"]["message"]


def test_crossover_marks_where_the_cache_dominates(http):
    v = http.post("/api/crossover", json={"model": "llama-3.1-70b", "context": 8192, "batch": 8}).json()
    spec = load_spec("llama-3.1-70b")
    here = make_plan(spec, PlanRequest(context=8192, users=8, gpus=1))
    assert v["crossover_batch"] == here.crossover_batch
    assert v["point"] == {"weights_s": here.decode_weights_seconds, "kv_s": here.decode_kv_seconds,
                          "compute_s": here.decode_compute_seconds, "step_s": here.decode_step_seconds}
    assert v["compute_bound_batch"] == here.compute_bound_batch
    by_batch = {r["batch"]: r for r in v["by_batch"]}
    cb = v["crossover_batch"]
    assert by_batch[cb]["kv_s"] >= by_batch[cb]["weights_s"] and 8 in by_batch
    assert all(r["kv_s"] < r["weights_s"] for r in v["by_batch"] if r["batch"] < cb)
    cc = v["crossover_context"]

    def kv_minus_weights(context: int) -> float:
        p = make_plan(spec, PlanRequest(context=context, users=8, gpus=1))
        return p.decode_kv_seconds - p.decode_weights_seconds
    assert kv_minus_weights(cc) >= 0 > kv_minus_weights(cc - 1)
    assert [r["context"] for r in v["by_context"]] == sorted(r["context"] for r in v["by_context"])


def test_steps_count_the_tokens_each_side_processes(http):
    v = http.post("/api/steps", json={"prompt": "the cache holds keys", "max_tokens": 6}).json()
    p, n = len(v["prompt"]), len(v["steps"])
    assert n == 6 and v["same_tokens"] is True  # fp32: cache and recompute agree exactly
    first, later = v["steps"][0], v["steps"][1:]
    assert first["cache"]["computed"] == [0, p] and first["no_cache"]["computed"] == [0, p]
    for i, s in enumerate(later, start=1):
        assert s["cache"]["computed"] == [p + i - 1, p + i] and s["cache"]["read_from_cache"] == p + i - 1
        assert s["no_cache"]["computed"] == [0, p + i] and s["no_cache"]["read_from_cache"] == 0
    assert v["totals"]["cache"] == v["formula"]["expected_cache"] == p + n - 1
    assert v["totals"]["no_cache"] == v["formula"]["expected_no_cache"] == n * p + n * (n - 1) // 2
    r = http.post("/api/steps", json={"prompt": "x", "max_tokens": 1000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_cache_snapshot_accounts_for_every_block(http):
    c = http.get("/api/cache").json()
    s = c["stats"]
    blocks = "".join(g["blocks"] for g in c["groups"])
    assert len(blocks) == c["num_blocks"] * len(c["groups"]) and set(blocks) <= {"f", "u", "s", "c"}
    assert (blocks.count("u") + blocks.count("s"), blocks.count("c"), blocks.count("f")) == \
        (s["used_blocks"], s["cached_blocks"], s["free_blocks"])


def test_page_and_vendored_chart_library_are_served(http):
    page = http.get("/")
    assert page.status_code == 200 and "static/vendor/uPlot.iife.min.js" in page.text
    assert "http://" not in page.text and "https://" not in page.text  # offline: nothing from a CDN
    js = http.get("/static/vendor/uPlot.iife.min.js")
    assert js.status_code == 200 and "uPlot" in js.text
    assert http.get("/static/app.js").status_code == 200
