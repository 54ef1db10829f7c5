"""kvlab's native fp32 linear kernel (``kvlab.kernels``): F.linear's values, rows that never
depend on the batch or the thread count, and PyTorch's matmul wherever it cannot run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvlab import dispatch, kernels
from kvlab.models.llama import Linear


def native():
    native = dispatch.backends().native
    if not native:  # off, another CPU or no compiler: test_the_kernel_builds_here says why
        pytest.skip(native.why)


def test_the_kernel_builds_here_or_says_why(switch_off):
    """The library builds (to a file in kvlab's cache) or says why not, and kvlab uses it only
    where kvlab.dispatch says so: never with KVLAB_KERNELS=off, which says so too."""
    from pathlib import Path

    s = kernels.status()
    assert s.detail
    if s.available:
        assert Path(s.detail).is_file()
    if not dispatch.switched_off("KVLAB_KERNELS"):
        assert dispatch.backends().native.on is s.available
    switch_off("KVLAB_KERNELS")
    assert not dispatch.backends().native and dispatch.backends().native.why == "KVLAB_KERNELS=off"


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 66])
@pytest.mark.parametrize("n,k", [(1, 3), (5, 8), (13, 17), (64, 96), (9, 200)])
@pytest.mark.parametrize("bias", [False, True])
def test_values_are_f_linears(m, n, k, bias):
    native()
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = kernels.linear(x, w, b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * k ** 0.5)


@pytest.mark.parametrize("m", [1, 2, 5, 50])
def test_bf16_is_the_fp32_sum_of_the_widened_values_rounded_once_as_pytorch_rounds(m):
    native()
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 77, generator=g).bfloat16(), torch.randn(45, 77, generator=g).bfloat16()
    b = torch.randn(45, generator=g).bfloat16()
    got = kernels.linear(x, w, b)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, kernels.linear(x.float(), w.float(), b.float()).bfloat16())
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float(), b.float()), rtol=2 ** -7, atol=1e-2)
    assert torch.equal(kernels.linear(x[-1:], w, b)[0], got[-1])  # rows alone = rows in a batch


def test_a_row_is_bitwise_the_same_in_any_batch_at_any_place_on_any_thread_count():
    native()
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(203, 576, generator=g), torch.randn(203, generator=g)
    row = torch.randn(1, 576, generator=g)
    alone = kernels.linear(row, w, b)[0]
    for m in (2, 3, 4, 5, 8, 13, 40, 100):  # 100: several blocks of input rows
        for pos in (0, m // 2, m - 1):
            batch = torch.randn(m, 576, generator=g)
            batch[pos] = row[0]
            assert torch.equal(kernels.linear(batch, w, b)[pos], alone), (m, pos)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(kernels.linear(row, w, b)[0], alone)
    finally:
        torch.set_num_threads(threads)


def test_linear_runs_the_kernel_up_to_its_rows_and_pytorch_above():
    """A layer set up with the native kernel for 5 rows: the kernel's bits up to 5, F.linear's
    above; one no model has set up runs F.linear (gradients flow); a shape mismatch is F.linear's
    error."""
    native()
    from kvlab import dispatch
    from kvlab.models.methods import Setting

    torch.manual_seed(0)
    layer = Linear(40, 24, bias=True)
    x = torch.randn(6, 40)
    xs = x[:2].clone().requires_grad_()
    layer(xs).sum().backward()
    assert xs.grad is not None and layer.weight.grad is not None
    layer.requires_grad_(False)
    layer.choose(Setting(dispatch.backends(), torch.float32, torch.device("cpu"), native_rows=5))
    assert torch.equal(layer(x[:5]), kernels.linear(x[:5], layer.weight, layer.bias))
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    with pytest.raises(RuntimeError):
        layer(x[:2, :39])


def run_status(env: dict) -> str:
    out = subprocess.run([sys.executable, "-m", "kvlab.kernels"], capture_output=True, text=True,
                         env={**os.environ, **env}, check=True)
    return out.stdout


def test_off_or_a_failed_build_falls_back_to_pytorch_and_says_why(tmp_path):
    said = run_status({"KVLAB_KERNELS": "off"})
    assert "linear layers run on PyTorch's matmul: KVLAB_KERNELS=off" in said
    assert "  KVLAB_KERNELS: off (KVLAB_KERNELS=off)" in said and "KVLAB_ONEDNN_BF16: " in said
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        said = run_status({"CC": "false", "XDG_CACHE_HOME": str(tmp_path),  # a compiler that fails
                           "KVLAB_KERNELS": "on"})
        assert "PyTorch's matmul: false failed" in said
        assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("tmp*"))


def test_deterministic_mode_runs_every_row_count_natively_with_no_padding():
    """Deterministic mode: where the native kernel runs, every linear layer takes every row count
    on it, with no padded rows; elsewhere PyTorch's GEMM pads to the probed block. Off again: the
    fast choices, no padding."""
    from kvlab import dispatch
    from kvlab.models import methods
    from kvlab.models.invariant import check_linears
    from tests.test_deterministic import near_tie_model

    for dtype in ("fp32", "bf16"):
        model = near_tie_model(dtype)
        model.use(deterministic=True)
        chosen = [m.method for m in model.modules() if isinstance(m, Linear) and type(m) is Linear]
        if dispatch.backends().native:
            assert all(isinstance(c, methods.Native) and c.rows == sys.maxsize and c.fallback.row_block == 1
                       for c in chosen), dtype
        else:  # the block the probe finds for their GEMM on plain layers (the attention's is its own)
            plain = near_tie_model(dtype)
            probed, _ = check_linears([m for m in plain.modules() if isinstance(m, Linear)], plain.dtype, plain.device)
            assert {c.row_block for c in chosen} == {probed}, dtype
        model.use(deterministic=False)
        assert model.invariant_rows is None
        assert all(gemm_under(m.method).row_block == 1 for m in model.modules() if isinstance(m, Linear))


def gemm_under(method):
    """The PyTorch GEMM a chosen method ends in (a native kernel's fallback, a sliced head's gemm)."""
    from kvlab.models import methods
    while not isinstance(method, methods.Gemm):
        method = getattr(method, "fallback", None) or method.gemm
    return method


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv,d", [(4, 4, 32), (9, 3, 64), (8, 2, 64), (4, 1, 96)])
def test_paged_attention_is_sdpa_over_each_rows_slots(cache_dtype, heads, kv, d):
    native()
    g = torch.Generator().manual_seed(heads * 100 + d)
    blocks, block_size = 40, 16
    k_cache = torch.randn(kv, blocks, block_size, d, generator=g).to(cache_dtype)
    v_cache = torch.randn(kv, blocks, block_size, d, generator=g).to(cache_dtype)
    lengths = torch.tensor([1, 7, 8, 9, 200, 64])
    slots = torch.stack([torch.randperm(blocks * block_size, generator=g)[:200] for _ in lengths])
    q = torch.randn(len(lengths), heads, d, generator=g)
    out = kernels.paged_attention(q, k_cache, v_cache, slots, lengths)
    for b, n in enumerate(lengths.tolist()):
        keys = k_cache.view(kv, -1, d)[:, slots[b, :n]].float()
        vals = v_cache.view(kv, -1, d)[:, slots[b, :n]].float()
        want = F.scaled_dot_product_attention(q[b][None, :, None], keys[None], vals[None],
                                              enable_gqa=True)[0, :, 0]
        torch.testing.assert_close(out[b], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_scores_a_kv_heads_group_as_each_head_alone(cache_dtype):
    """GQA in one pass: the query heads sharing a KV head score its keys together, 8 at a time
    (hsum8), and get the bits each head gets alone: the same queries against the cache with its
    KV heads repeated (one KV head per query head), lengths off and on a multiple of 8."""
    native()
    g = torch.Generator().manual_seed(5)
    kv, heads, d = 2, 12, 64
    k_cache = torch.randn(kv, 30, 16, d, generator=g).to(cache_dtype)
    v_cache = torch.randn(kv, 30, 16, d, generator=g).to(cache_dtype)
    lengths = torch.tensor([1, 8, 13, 64, 451])
    slots = torch.stack([torch.randperm(480, generator=g)[:451] for _ in lengths])
    q = torch.randn(len(lengths), heads, d, generator=g) * 4
    grouped = kernels.paged_attention(q, k_cache, v_cache, slots, lengths)
    alone = kernels.paged_attention(q, k_cache.repeat_interleave(heads // kv, 0),
                                    v_cache.repeat_interleave(heads // kv, 0), slots, lengths)
    assert torch.equal(grouped, alone)


def test_paged_attention_rows_of_a_prompt_see_their_own_window():
    """Prompt rows: each query reads a run of its sequence's slots (causal, a window of 5), the
    same as SDPA with the window's mask, and the same bits as that query decoded alone."""
    native()
    g = torch.Generator().manual_seed(1)
    kv, heads, d, n, window = 2, 4, 32, 12, 5
    k_cache = torch.randn(kv, 4, 16, d, generator=g)
    v_cache = torch.randn(kv, 4, 16, d, generator=g)
    slots = torch.randperm(64, generator=g)[:n][None]
    q = torch.randn(n, heads, d, generator=g)
    pos = torch.arange(n)
    starts, ends = (pos - window + 1).clamp(min=0), pos + 1
    out = kernels.paged_attention(q, k_cache, v_cache, slots, ends - starts, starts, torch.zeros(n, dtype=torch.long))
    keys, vals = k_cache.view(kv, -1, d)[:, slots[0]], v_cache.view(kv, -1, d)[:, slots[0]]
    mask = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < window)
    want = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], vals[None], mask,
                                          enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    last = kernels.paged_attention(q[-1:], k_cache, v_cache, slots[:, starts[-1]:], (ends - starts)[-1:])
    assert torch.equal(last[0], out[-1])


def test_paged_attention_refuses_what_it_cannot_read():
    q = torch.randn(2, 4, 32)
    cache = torch.zeros(2, 3, 16, 32)
    assert not kernels.attention_usable(q, cache.half(), cache.half())  # fp16: PyTorch's path
    assert not kernels.attention_usable(torch.randn(2, 4, 48), torch.zeros(2, 3, 16, 48), torch.zeros(2, 3, 16, 48))
    assert not kernels.attention_usable(q.double(), cache, cache)
    assert kernels.attention_usable(q.bfloat16(), cache.bfloat16(), cache.bfloat16()) == kernels.status().available
    assert not kernels.attention_usable(torch.randn(2, 3, 32), cache, cache)  # 3 heads over 2 KV heads
    assert kernels.attention_usable(q, cache, cache) == kernels.status().available


@pytest.mark.parametrize("kv_dtype", ["auto", "bf16"])
def test_the_engine_gives_the_same_answers_with_the_native_kernels_and_without(kv_dtype, switch_off):
    """The engine end to end, kvlab's kernels against PyTorch's ops (``KVLAB_KERNELS=off``): the
    same greedy tokens, logprobs within fp32 rounding (a sliding-window and a full layer, batched
    decodes of different lengths; an fp32 and a bf16 cache)."""
    native()
    from kvlab.engine.llm import LLM
    from kvlab.sampling import SamplingParams
    from tests.test_engine_parity import tiny_model

    model = tiny_model(num_hidden_layers=2, sliding_window=6,
                       layer_types=["sliding_attention", "full_attention"])
    prompts = [[1, 2, 3], list(range(5, 40)), list(range(60, 70)) * 3]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)

    def run():
        return LLM(model, kv_dtype=kv_dtype, max_num_batched_tokens=32).generate(prompts, params)

    fast = run()
    switch_off("KVLAB_KERNELS")
    model.use()
    slow = run()
    for a, b in zip(fast, slow):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=5e-3 if kv_dtype == "bf16" else 1e-4)


def tiny(dtype: str, **over):
    from kvlab.models import build_model
    from kvlab.models.loader import init_random_
    from kvlab.spec import spec_from_config
    from tests.test_engine_parity import tiny_config

    model = build_model(spec_from_config(tiny_config(**over), "tiny"), dtype, random_weights=True)
    init_random_(model, seed=0, std=0.2)
    return model


@pytest.mark.parametrize("onednn", ["off", "this cpu"])
@pytest.mark.parametrize("dtype,kv_dtype,deterministic", [("fp32", "auto", True), ("fp32", "auto", False),
                                                          ("fp32", "bf16", True), ("bf16", "auto", True),
                                                          ("bf16", "fp32", False)])
def test_the_native_decoder_layer_is_bitwise_the_modules_running_the_kernels(dtype, kv_dtype, deterministic,
                                                                             onednn, monkeypatch, switch_off):
    """One native call for the layers (``kvlab.kernels.decoder_layers``) against the layers' modules
    calling the same kernels op by op: the same bits, so a step may take either path (deterministic
    mode runs a step with a scored span through the modules). Biases (Qwen2's q/k/v), a window,
    batched decodes and prompts. Per dispatch choice: with oneDNN's bf16 branch off (an AVX2 CPU's
    branch) every case runs natively; with this CPU's own probe a non-deterministic bf16 run
    packs its weights for oneDNN where it can, and then no layer runs natively."""
    native()
    from kvlab import dispatch
    from kvlab.engine.llm import LLM
    from kvlab.models.llama import CausalLM
    from kvlab.sampling import SamplingParams

    if onednn == "off":
        switch_off("KVLAB_ONEDNN_BF16")
    packs = dtype == "bf16" and not deterministic and bool(dispatch.backends().onednn_bf16)

    model = tiny(dtype, model_type="qwen2", num_hidden_layers=2, sliding_window=6,
                 layer_types=["sliding_attention", "full_attention"])
    prompts = [[1, 2, 3], list(range(5, 40)), list(range(60, 70)) * 3]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True)
    calls = []
    fused = kernels.decoder_layers
    monkeypatch.setattr(kernels, "decoder_layers", lambda *a: calls.append(a[0].shape[0]) or fused(*a))

    def run():
        llm = LLM(model, kv_dtype=kv_dtype, max_num_batched_tokens=32, deterministic=deterministic)
        return [(o.token_ids, [(t.token_id, t.logprob, t.top) for t in o.logprobs])
                for o in llm.generate(prompts, params)]

    one_call = run()
    assert model.is_packed() is packs
    if packs:
        assert not calls  # oneDNN's packed matmuls: the modules run
    else:
        assert calls and max(calls) > 1  # batched rows went through it
    # the reference: the modules op by op (what a step the stack cannot take runs)
    monkeypatch.setattr(CausalLM, "_native_layers", lambda *args: None)
    calls.clear()
    by_modules = run()
    assert not calls
    assert one_call == by_modules


def test_the_native_stack_is_gathered_once_and_again_after_a_weight_moves(monkeypatch):
    """The layers' weights are gathered when the model chooses how it runs, not per step; a
    prompt past the linear kernel's rows runs through the modules (decode still takes the
    stack); and a weight moved under it (``.data =``) is gathered again, giving the modules'
    tokens."""
    native()
    from kvlab.engine.llm import LLM
    from kvlab.models.llama import CausalLM
    from kvlab.sampling import SamplingParams

    model = tiny("fp32", num_hidden_layers=3)
    built = []
    real = kernels.LayerStack
    monkeypatch.setattr(kernels, "LayerStack", lambda layers: built.append(len(layers)) or real(layers))
    llm = LLM(model, deterministic=False)
    gathered = len(built)
    assert gathered and set(built) == {3, 2}  # all layers, and all but the last (logits from some rows)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = list(range(1, 2 + kernels.MAX_ROWS))  # past the kernel's rows: the modules run it
    llm.generate([prompt], params)
    assert len(built) == gathered  # eight steps, nothing gathered again
    weight = model.model.layers[1].mlp.up_proj.weight
    weight.data = weight.data * 0.5
    stacked = llm.generate([prompt], params)[0].token_ids
    assert len(built) > gathered
    monkeypatch.setattr(CausalLM, "_native_layers", lambda *args: None)
    assert llm.generate([prompt], params)[0].token_ids == stacked


def test_the_native_decoder_layer_runs_only_where_every_op_is_native():
    """Packed or tensor-parallel linears, q/k norms (Qwen3), another dtype or no native linear
    kernel: the modules run the layer."""
    native()
    from kvlab import dispatch
    from kvlab.models.methods import Setting
    from kvlab.models.parallel import RowParallelLinear

    model = tiny("fp32")
    layer = model.model.layers[0]
    gathered = layer.native_weights(torch.float32)
    assert gathered is not None
    weights, rows = gathered
    assert len(weights.weights) == 16 and rows == kernels.MAX_ROWS
    assert weights.weights[2] is None and weights.weights[9] is layer.post_attention_layernorm.weight
    assert layer.native_weights(torch.bfloat16) is None  # the weights are fp32
    assert tiny("fp32", model_type="qwen3").model.layers[0].native_weights(torch.float32) is None
    layer.choose(Setting(dispatch.backends(), torch.float32, torch.device("cpu"), native_rows=0), False)
    assert layer.native_weights(torch.float32) is None
    o = layer.self_attn.o_proj
    layer.self_attn.o_proj = RowParallelLinear(o.weight, o.bias, None)
    model.use()
    assert layer.native_weights(torch.float32) is None and not model._stacks


def test_the_row_wise_kernels_are_pytorchs_ops():
    """RoPE, the residual add and the cache write bitwise; RMSNorm and silu within rounding (the
    order of the sum of squares and the exponential are kvlab's own)."""
    native()
    from kvlab.models.llama import RMSNorm, apply_rope

    for dtype in (torch.float32, torch.bfloat16):
        x, a = torch.randn(7, 96).to(dtype), torch.randn(7, 96).to(dtype)
        norm = RMSNorm(96, 1e-5).to(dtype)
        norm.weight.data = torch.randn(96).to(dtype)
        with torch.inference_mode():
            y, h = kernels.rms_norm(x, norm.weight, 1e-5, a)
            assert torch.equal(h, x + a)
            h32 = h.float()
            want = norm.weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
            torch.testing.assert_close(y, want)
        q = torch.randn(5, 4, 64).to(dtype)
        wide = torch.randn(5, 6, 64).to(dtype)
        wide[:, 1:5] = q
        cos, sin = torch.randn(5, 64).to(dtype), torch.randn(5, 64).to(dtype)
        kernels.rope_(wide[:, 1:5], cos, sin)  # heads contiguous, tokens strided
        assert torch.equal(wide[:, 1:5], apply_rope(q, cos, sin))
        for cache_dtype in (torch.float32, torch.bfloat16):
            kc, vc = torch.zeros(2, 40, 64, dtype=cache_dtype), torch.zeros(2, 40, 32, dtype=cache_dtype)
            k, v = torch.randn(3, 2, 64).to(dtype), torch.randn(3, 2, 32).to(dtype)
            slots = torch.tensor([7, 0, 39])
            kernels.store_kv(k, v, kc, vc, slots)
            assert torch.equal(kc[:, slots], k.to(cache_dtype).transpose(0, 1))
            assert torch.equal(vc[:, slots], v.to(cache_dtype).transpose(0, 1))
            rest = kc.clone()
            rest[:, slots] = 0
            assert not rest.any()  # nothing else written
        g, u = torch.randn(3, 37).to(dtype), torch.randn(3, 37).to(dtype)
        want = F.silu(g.float()).to(dtype) * u
        got = kernels.silu_mul_(g.clone(), u)
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-6 if dtype == torch.float32 else 8e-3,
                                   atol=1e-6)
        assert torch.equal(kernels.silu_mul_(g[1:2].clone(), u[1:2]), got[1:2])  # any row, any place


def test_a_torch_profile_names_the_kernels():
    """benchmarks/decode_ops.py groups ops by name: a ctypes call would otherwise be invisible."""
    native()
    from torch.profiler import profile

    cache = torch.randn(1, 2, 16, 32)
    with profile() as prof:
        kernels.linear(torch.randn(2, 8), torch.randn(4, 8), None)
        kernels.paged_attention(torch.randn(1, 2, 32), cache, cache, torch.arange(5)[None], torch.tensor([5]))
    assert {"kvlab::linear", "kvlab::paged_attention"} <= {e.key for e in prof.key_averages()}


def test_torchs_openmp_threads_sleep_between_regions_unless_the_user_sets_otherwise():
    """``import kvlab`` loads torch's libgomp with OMP_WAIT_POLICY=PASSIVE (its threads spun on
    the cores kvlab's kernel threads needed) and leaves the environment as it was, for child
    processes such as llama.cpp; a user's own OMP_WAIT_POLICY wins. libgomp says what it took
    (OMP_DISPLAY_ENV): a passive policy spins 0 times, its default 300,000."""
    code = "import kvlab, os, torch; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["OMP_DISPLAY_ENV"] = "verbose"
    for given, spins in ((None, "'0'"), ("ACTIVE", None)):
        if given:
            env["OMP_WAIT_POLICY"] = given
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == str(given)  # the environment as it was
        count = next(line.split("=")[1].strip() for line in out.stderr.splitlines() if "GOMP_SPINCOUNT" in line)
        assert count == spins if spins else count != "'0'"


def test_the_thread_pool_gives_the_same_bits_at_any_thread_count_from_any_caller():
    """kvlab's pool (pool.c): more threads than cores (chunks taken by whoever runs), several
    Python threads calling at once (one runs its loop alone), and a forked child (the pool starts
    afresh there) all give the serial call's bits."""
    import threading

    native()
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(1000, 576, generator=g), torch.randn(1000, generator=g)
    x = torch.randn(3, 576, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = kernels.linear(x, w, b)
        for n in (2, 3, 7):
            torch.set_num_threads(n)
            for _ in range(20):
                assert torch.equal(kernels.linear(x, w, b), serial), n
        results: list[bool] = []

        def call() -> None:
            results.extend(torch.equal(kernels.linear(x, w, b), serial) for _ in range(50))

        callers = [threading.Thread(target=call) for _ in range(3)]
        for t in callers:
            t.start()
        for t in callers:
            t.join()
        assert results == [True] * 150
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if its own pool gives the same bits
            os._exit(0 if torch.equal(kernels.linear(x, w, b), serial) else 1)
        assert os.waitpid(pid, 0)[1] == 0
    finally:
        torch.set_num_threads(threads)
