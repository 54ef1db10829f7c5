"""Tensor parallelism (``--tp N``, ``LLM(tp=N)``): N gloo worker processes on this CPU, or
torchrun's processes (``torchrun -m kvlab ... --tp N``).

Greedy tokens at tp=2 and tp=4 equal tp=1 (prefix hits, chunked prefill, preemption by
recompute and swap, an fp8 cache), including a model whose KV heads are fewer than the ranks
(replicated); each rank's cache tensors hold exactly the plan's kv_bytes_per_gpu; an invalid size
gets the planner's message; a worker that is killed or hangs ends the run with a clear error and
leaves no process behind. Under torchrun, the ranks give the tp=1 tokens, --tp must be the
number of processes, and a rank that dies ends rank 0's server with the reason. fp32 tiny models: the ranks' partial sums differ from one matmul by
rounding only, far below the gaps between these models' top logits. A GGUF model run as stored
keeps its blocks on every rank (a split off a block edge: that layer dense), with the tp=1 tokens,
log-probabilities within 1e-4, and about 1/N of the layers' blocks per rank.
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvlab.cli import main
from kvlab.engine.executor import TPExecutor, WorkerError
from kvlab.engine.llm import LLM
from kvlab.models import load
from kvlab.models.llama import CausalLM
from kvlab.models.parallel import RowParallelLinear, RowParallelQuantLinear, shard_model
from kvlab.models.weights import QuantLinear, held_bytes
from kvlab.plan import PlanRequest, make_plan
from kvlab.sampling import SamplingParams
from tests.test_engine_parity import prompts, tiny_model
from tests.test_gguf import write_tiny_gguf
from tests.test_models import make_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def model():
    """4 query heads, 2 KV heads: tp=2 splits the KV heads, tp=4 replicates each on 2 ranks."""
    return tiny_model()


@pytest.fixture(scope="module")
def workload():
    shared = prompts((24,), seed=1)[0]  # a common prefix: later prompts hit the prefix cache
    return [shared + p for p in prompts((5, 17, 9, 3), seed=2)] + prompts((33, 12), seed=3)


def run(model, batch, **options) -> tuple[list[list[int]], LLM]:
    llm = LLM(model, **options)
    try:
        first = llm.generate(batch[:1], GREEDY)  # cached first, so the others hit its prefix
        rest = llm.generate(batch[1:], GREEDY)
        return [o.token_ids for o in first + rest], llm
    finally:
        llm.close()


def rank_kv_bytes(model, blocks: int, options: dict, tp: int) -> int:
    """kv_memory that buys each of `tp` ranks `blocks` blocks (fp32-sized: enough for any dtype)."""
    return blocks * options.get("block_size", 16) * model.spec.tp_shard(tp).kv_bytes_per_token("fp32")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("blocks, options", [
    pytest.param(512, {}, id="prefix-hits"),
    pytest.param(14, {"block_size": 4, "max_num_batched_tokens": 16}, id="preempt-recompute-chunked"),
    pytest.param(14, {"block_size": 4, "preemption": "swap-ram"}, id="preempt-swap"),
    pytest.param(512, {"kv_dtype": "fp8_e4m3"}, id="fp8"),
])
def test_greedy_tokens_equal_tp1(model, workload, blocks, options):
    ref, one = run(model, workload, kv_memory=rank_kv_bytes(model, blocks, options, 1), **options)
    for tp in (2, 4):  # the same blocks: each rank's memory holds its share of the heads
        out, llm = run(model, workload, tp=tp, kv_memory=rank_kv_bytes(model, blocks, options, tp), **options)
        assert out == ref, f"tp={tp}"
        m = llm.metrics()
        assert m.prefix_cache_hits == one.metrics().prefix_cache_hits > 0
        assert m.preemptions == one.metrics().preemptions
        assert (m.preemptions > 0) == (blocks < 512)


def test_kv_heads_fewer_than_ranks_replicate(model):
    """tp=4 over 2 KV heads: every rank holds one whole head (its query head's), as the plan says."""
    plan = make_plan(model.spec, PlanRequest(context=64, kv_dtype="fp32", tp=4))
    assert plan.kv_replicated
    per_rank = model.spec.tp_shard(4)
    assert {layer.kv_heads for layer in per_rank.layers} == {1}
    assert per_rank.kv_bytes_per_token("fp32") * 2 == model.spec.kv_bytes_per_token("fp32")


@pytest.mark.parametrize("tp, kv_dtype", [(1, "fp32"), (2, "fp32"), (4, "fp32"), (2, "int8"), (4, "int8")])
def test_rank_cache_bytes_equal_the_plan(model, tp, kv_dtype):
    """Each rank's cache tensors, measured in the worker, hold the plan's kv_bytes_per_gpu for a
    context of as many tokens as the pool; and --kv-memory buys the plan's blocks per rank."""
    tokens = 256
    plan = make_plan(model.spec, PlanRequest(context=tokens, kv_dtype=kv_dtype, tp=tp, block_size=16,
                                             kv_memory=None))
    llm = LLM(model, kv_memory=plan.kv_bytes_per_gpu, kv_dtype=kv_dtype, tp=tp)
    try:
        ex = llm.engine.executor
        measured = ex.rank_cache_bytes if isinstance(ex, TPExecutor) else [llm.engine.cache.nbytes]
        assert measured == [plan.kv_bytes_per_gpu] * tp
        assert llm.capacity.tokens == tokens
        sized = make_plan(model.spec, PlanRequest(context=tokens, kv_dtype=kv_dtype, tp=tp, block_size=16,
                                                  kv_memory=plan.kv_bytes_per_gpu))
        assert sized.kv_cache_blocks == llm.capacity.blocks
    finally:
        llm.close()


def test_invalid_tp_gets_the_planners_message(model):
    with pytest.raises(ValueError, match=r"^--tp 3 is not valid for tiny: valid sizes are 1, 2, 4"):
        LLM(model, kv_memory="1MiB", tp=3)
    with pytest.raises(ValueError, match="h2o reads attention scores"):
        LLM(model, kv_memory="1MiB", tp=2, kv_policy="h2o", kv_budget=32)


def test_killed_worker_ends_the_run_and_frees_every_process(model, workload):
    llm = LLM(model, kv_memory="1MiB", tp=2)
    procs = llm.engine.executor.procs
    os.kill(procs[1].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"worker 1 \(pid \d+\) was killed by signal 9"):
        llm.generate(workload, GREEDY)
    assert time.monotonic() - start < 10
    assert all(_gone(p.pid) for p in procs)
    with pytest.raises(WorkerError, match="killed by signal 9"):  # and stays ended
        llm.generate(workload[:1], GREEDY)


def test_hung_worker_times_out_and_frees_every_process(model, workload):
    llm = LLM(model, kv_memory="1MiB", tp=2, tp_timeout=2)
    procs = llm.engine.executor.procs
    os.kill(procs[0].pid, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"worker\(s\) [0-9, ]+ did not answer execute within 2 s"):
        llm.generate(workload, GREEDY)
    assert time.monotonic() - start < 15
    assert all(_gone(p.pid) for p in procs)


def test_server_with_tp_survives_a_client_disconnect(tmp_path):
    """`kvlab serve --tp 2`: a client that leaves mid-stream aborts its request, its blocks are
    freed, and the server goes on answering (the same tokens as at tp=1); a worker that dies
    fails the request in flight with the reason and stops the engine."""
    import httpx

    from tests.test_server_fixtures import MODEL_ID, LiveServer, tiny_bridge

    body = {"model": MODEL_ID, "prompt": "the cache holds", "max_tokens": 12, "temperature": 0}
    solo = LiveServer(tiny_bridge(tmp_path / "one"))
    try:
        expected = httpx.post(f"{solo.url}/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
    finally:
        solo.stop()
    live = LiveServer(tiny_bridge(tmp_path / "two", tp=2))
    try:
        with httpx.Client(base_url=live.url, timeout=30) as http:
            long = {**body, "max_tokens": 200, "stream": True, "ignore_eos": True}
            with http.stream("POST", "/v1/completions", json=long) as r:
                lines = r.iter_lines()
                assert any(next(lines).startswith("data:") for _ in range(6))
            deadline = time.monotonic() + 20
            while live.bridge.engine.kv.num_used_blocks and time.monotonic() < deadline:
                time.sleep(0.05)
            assert live.bridge.engine.kv.num_used_blocks == 0
            assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == expected
            # a worker that dies ends the run: the request in flight fails, saying why
            os.kill(live.bridge.engine.executor.procs[1].pid, signal.SIGKILL)
            r = http.post("/v1/completions", json=body)
            assert r.status_code >= 500 and "killed by signal 9" in r.text
            assert "worker 1" in (live.bridge.fatal or "") and http.get("/health").status_code == 503
            assert all(_gone(p.pid) for p in live.bridge.engine.executor.procs)
    finally:
        live.stop()
        live.bridge.engine.close()


# --- weights as stored -----------------------------------------------------------------------------

def _stored_tiny(tmp_path, qtype) -> CausalLM:
    """The tiny Llama (head_dim 16, FFN 128, biases) as a GGUF of `qtype`, held as stored: at tp=2
    every split falls on a block edge (o_proj: 32 columns a rank, down_proj: 64), at tp=4 o_proj's
    (16 columns) does not."""
    folder = make_checkpoint(tmp_path / "hf", "llama", attention_bias=True)
    write_tiny_gguf(folder, tmp_path / "m.gguf", "llama", qtype)
    return load(tmp_path / "m.gguf", weights="as-stored").model


def _blocks_bytes(module: torch.nn.Module) -> int:
    return sum(m.blocks.nbytes for m in module.modules() if isinstance(m, QuantLinear))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0])
def test_ranks_hold_their_share_of_the_stored_blocks(tmp_path, qtype):
    """Sharded in this process (no forward, so no process group): at tp=2 every layer of every
    rank stays a QuantLinear and each holds half of the decoder layers' blocks; the embedding is
    whole on each, the head (untied here) on rank 0 only. At tp=4 o_proj, split at 16 columns,
    is dense fp32 on every rank and nothing else is."""
    whole = _stored_tiny(tmp_path, qtype)
    layers = _blocks_bytes(whole.model.layers)
    replicated = sum(t.nbytes for layer in whole.model.layers for t in (  # whole on every rank
        layer.input_layernorm.weight, layer.post_attention_layernorm.weight, layer.self_attn.o_proj.bias,
        layer.mlp.down_proj.bias) if t is not None)
    for rank in (0, 1):
        shard = shard_model(copy.deepcopy(whole), rank, 2)
        for layer in shard.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
                       mlp.down_proj)
            assert all(isinstance(m, QuantLinear) for m in linears)
            assert isinstance(attn.o_proj, RowParallelQuantLinear) and attn.o_proj.in_features == 32
            assert attn.o_proj.reduced_bias is not None and attn.o_proj.bias is None  # added once
        assert _blocks_bytes(shard.model.layers) * 2 == layers
        assert shard.model.embed_tokens.blocks.equal(whole.model.embed_tokens.blocks)
        assert isinstance(shard.lm_head, QuantLinear) == (rank == 0)
        # held_bytes: half of the layers' bytes but the replicated norms and biases, beside the
        # embedding, the final norm and, on rank 0, the head
        assert held_bytes(shard.model.layers) * 2 == held_bytes(whole.model.layers) + replicated
        head = held_bytes(whole.lm_head) if rank == 0 else 0
        assert held_bytes(shard) == (held_bytes(shard.model.layers) + held_bytes(whole.model.embed_tokens)
                                     + held_bytes(whole.model.norm) + head)
    for rank in range(4):
        shard = shard_model(copy.deepcopy(whole), rank, 4)
        for layer in shard.model.layers:
            assert type(layer.self_attn.o_proj) is RowParallelLinear  # the fallback, this layer alone
            assert layer.self_attn.o_proj.weight.dtype == torch.float32
            assert isinstance(layer.mlp.down_proj, RowParallelQuantLinear)
            assert isinstance(layer.self_attn.q_proj, QuantLinear)


def test_a_k_quant_split_keeps_blocks_only_on_its_256_weight_edges(tmp_path):
    """Q4_K (hidden 256, FFN 512) at tp=2: down_proj's split at 256 inputs keeps its
    super-blocks; o_proj's at 128 would cut one, so that layer alone is dense fp32."""
    from tests.test_weights import _checkpoint

    folder = _checkpoint(tmp_path / "hf", "llama", Q.Q4_K)
    write_tiny_gguf(folder, tmp_path / "m.gguf", "llama", Q.Q4_K)
    whole = load(tmp_path / "m.gguf", weights="as-stored").model
    for rank in (0, 1):
        shard = shard_model(copy.deepcopy(whole), rank, 2)
        for layer, full in zip(shard.model.layers, whole.model.layers):
            down, o = layer.mlp.down_proj, layer.self_attn.o_proj
            assert isinstance(down, RowParallelQuantLinear) and down.in_features == 256
            assert down.blocks.nbytes * 2 == full.mlp.down_proj.blocks.nbytes
            assert type(o) is RowParallelLinear and o.in_features == 128
            assert torch.equal(o.weight, full.self_attn.o_proj.dense()[:, 128 * rank:128 * (rank + 1)])


@pytest.mark.parametrize("tp", [2, 4])
def test_stored_blocks_give_the_tp1_tokens_and_logprobs(tmp_path, tp):
    """Q4_1 as stored over 2 ranks (every layer in blocks) and 4 (o_proj dense): the tp=1 greedy
    tokens, and log-probabilities within 1e-4 (the row-parallel partial sums are added in
    another order than one matmul's, so not bitwise); each worker reports the bytes of its
    shard's blocks."""
    model = _stored_tiny(tmp_path, Q.Q4_1)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    batch = [[5, 6, 7, 8, 9], list(range(20, 50))]
    shards = [held_bytes(shard_model(copy.deepcopy(model), rank, tp)) for rank in range(tp)]  # before it runs
    one = LLM(model)
    ref = one.generate(batch, params)
    llm = LLM(tmp_path / "m.gguf", weights="as-stored", tp=tp)  # the path: the workers' shards of its load
    try:
        out = llm.generate(batch, params)
        assert llm.engine.executor.rank_weight_bytes == shards
    finally:
        llm.close()
        one.close()
    for a, b in zip(out, ref):
        assert a.token_ids == b.token_ids and len(a.logprobs) == 10
        got = torch.tensor([[p for _, p in t.top] for t in a.logprobs])
        want = torch.tensor([[p for _, p in t.top] for t in b.logprobs])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert [[i for i, _ in t.top] for t in a.logprobs] == [[i for i, _ in t.top] for t in b.logprobs]


def test_the_default_model_as_stored_over_3_ranks():
    """SmolLM2's Q4_1 layers and tied Q8_0 embedding/head, as stored on 3 ranks (every split a
    block edge): the tp=1 tokens of the README's question, each rank a third of the layers."""
    loaded = load(None, weights="as-stored")
    model = loaded.model
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = loaded.chat_template.encode(loaded.tokenizer, question)
    params = SamplingParams(temperature=0, max_tokens=12)
    one = LLM(model)
    ref = one.generate([chat], params)[0].token_ids
    one.close()
    llm = LLM(model, tp=3)
    try:
        assert llm.generate([chat], params)[0].token_ids == ref
        weights = llm.engine.executor.rank_weight_bytes
    finally:
        llm.close()
    embedding = held_bytes(model.model.embed_tokens)  # replicated; rank 0's tied head reads it
    layers = held_bytes(model.model.layers)
    for held in weights:  # the rest of a rank (its norms replicated): a third of the layers
        assert abs((held - embedding) * 3 - layers) < 0.01 * layers
    assert "Paris" in loaded.tokenizer.decode(ref)


# --- torchrun --------------------------------------------------------------------------------------

def _tiny_generate(config) -> list[str]:
    """`kvlab generate` arguments for the tiny model: fp32, one thread (the machine is shared)."""
    return ["generate", str(config), "the cache holds", "--random-weights", "--dtype", "fp32",
            "--max-tokens", "12", "--json", "--threads", "1"]


def test_torchrun_ranks_give_the_tp1_tokens(tmp_path, capsys):
    """`torchrun --nproc-per-node 2 -m kvlab generate --tp 2`: rank 0 alone prints, the tokens of
    tp=1, and rank 1 exits 0 once rank 0 closes (else torchrun's status is not 0)."""
    from tests.test_server_fixtures import make_tiny_model

    argv = _tiny_generate(make_tiny_model(tmp_path))
    threads = torch.get_num_threads()
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    expected = json.loads(capsys.readouterr().out)["token_ids"]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "kvlab", *argv, "--tp", "2"], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    [line] = [line for line in run.stdout.splitlines() if line.startswith("{")]
    out = json.loads(line)
    assert out["tp"] == 2 and out["token_ids"] == expected


@pytest.mark.parametrize("tp", [1, 3])
def test_torchrun_tp_must_be_the_number_of_processes(model, monkeypatch, capsys, tp):
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    assert main(["generate", "any-model", "hi", "--tp", str(tp)]) == 2  # before loading anything
    assert capsys.readouterr().err == (f"kvlab: error: --tp {tp} under torchrun with 2 processes "
                                       f"(WORLD_SIZE): each process is one rank, so pass --tp 2\n")
    with pytest.raises(ValueError, match=f"^--tp {tp} under torchrun with 2 processes"):
        LLM(model, kv_memory="1MiB", tp=tp)


@pytest.mark.parametrize("sig, reason", [(signal.SIGKILL, r"Connection (closed|reset) by peer"),
                                         (signal.SIGSTOP, r"Timed out waiting 3000ms")], ids=["killed", "hung"])
def test_a_lost_torchrun_rank_ends_rank_0_with_the_reason(tmp_path, sig, reason):
    """Two ranks as on two machines (plain processes with torchrun's environment, no torchrun agent
    to stop the others): `kvlab serve --tp 2` answers; once rank 1 is killed or stopped, the next
    request fails saying why (at once, or after --tp-timeout) and rank 0 exits 1 with the reason,
    instead of waiting for rank 1 for ever."""
    import httpx

    from kvlab.engine.executor import _free_port
    from tests.test_server_fixtures import make_tiny_model

    config = make_tiny_model(tmp_path)
    port = _free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
           "LOCAL_RANK": "0"}
    argv = [sys.executable, "-m", "kvlab", "serve", str(config), "--random-weights", "--dtype", "fp32",
            "--threads", "1", "--tp", "2", "--tp-timeout", "3", "--kv-memory", "1MiB", "--port", str(port), "--served-model-name", "tiny"]
    logs = [tmp_path / f"rank{rank}.log" for rank in (0, 1)]
    ranks = [subprocess.Popen(argv, env={**env, "RANK": str(rank)}, stdout=subprocess.DEVNULL,
                              stderr=log.open("w")) for rank, log in enumerate(logs)]
    url = f"http://127.0.0.1:{port}"
    body = {"model": "tiny", "prompt": "the cache holds", "max_tokens": 8, "temperature": 0}
    try:
        deadline = time.monotonic() + 120
        while "serving" not in logs[0].read_text():
            assert time.monotonic() < deadline and ranks[0].poll() is None, logs[0].read_text()
            time.sleep(0.2)
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
        ranks[1].send_signal(sig)
        if sig == signal.SIGKILL:
            ranks[1].wait()  # its sockets are closed only once it is gone
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code >= 500 and re.search(reason, r.text), r.text
        assert ranks[0].wait(timeout=30) == 1
        last = logs[0].read_text().splitlines()[-1]
        assert last.startswith("kvlab: tensor-parallel") and re.search(reason, last), last
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
