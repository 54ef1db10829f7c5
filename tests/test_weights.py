"""Weights held as the GGUF file stores them (``kvlab.models.weights``): every format's values
are gguf.quants' to the bit, the native kernel is bitwise the fp32 kernel on the dequantised
weight, and a model held as stored gives the very logits and tokens of its dense fp32 load, on
each branch this CPU runs (the native kernels, or the reference path where they are off)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvlab import dispatch, kernels
from kvlab.catalog import load_spec
from kvlab.cli import main
from kvlab.engine.llm import LLM
from kvlab.generate import generate
from kvlab.models import NoCache, load
from kvlab.models.loader import choose_weights
from kvlab.models.llama import Linear
from kvlab.models.methods import Setting
from kvlab.models.weights import FORMATS, QK_K, QuantEmbedding, QuantLinear, check_format, held_bytes, held_formats
from kvlab.sampling import SamplingParams
from tests.test_gemma3 import write_gemma3_gguf
from tests.test_gguf import write_tiny_gguf
from tests.test_models import make_checkpoint

NATIVE = bool(dispatch.backends().native)
K_QUANTS = (Q.Q4_K, Q.Q6_K)


def _cols(name: str, k: int) -> int:
    """k inputs for the 32-weight formats; 3 super-blocks (768) for the k-quants."""
    return k if FORMATS[name].block == 32 else 3 * QK_K


def _blocks(name: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights [n, k] quantised by gguf.quants: (blocks, gguf.quants' dequantised values).
    k-quants, which gguf.quants cannot quantise: random bytes with random finite fp16 factors
    (d, and Q4_K's dmin), every scale and rounding case; the first super-block all zero."""
    rng = np.random.default_rng(seed)
    if getattr(Q, name) in K_QUANTS:
        raw = rng.integers(0, 256, (n, k // QK_K, FORMATS[name].block_bytes), dtype=np.uint8)
        halves = slice(0, 4) if name == "Q4_K" else slice(208, 210)  # Q4_K: d, dmin first; Q6_K: d last
        raw[..., halves] = rng.standard_normal((n, k // QK_K, 2 if name == "Q4_K" else 1)).astype(np.float16).view(np.uint8)
        raw[0, 0] = 0
        raw = raw.reshape(n, -1)
    else:
        w = rng.standard_normal((n, k)).astype(np.float32)
        w[0, :32] = 0.0  # an all-zero block (scale 0)
        raw = gguf.quants.quantize(w, getattr(Q, name))
    ref = gguf.quants.dequantize(raw, getattr(Q, name)).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(ref)


def _checkpoint(folder, family: str, qtype, **overrides):
    """make_checkpoint, 256 wide (FFN 512) for a k-quant qtype: whole super-blocks per row."""
    if qtype in K_QUANTS:
        overrides.update(hidden_size=256, intermediate_size=512)
    return make_checkpoint(folder, family, **overrides)


@pytest.mark.parametrize("name", list(FORMATS))
def test_dequantisation_is_gguf_quants_to_the_bit(name):
    fmt, k = FORMATS[name], _cols(name, 160)
    blocks, ref = _blocks(name, 37, k)
    assert blocks.shape == (37, fmt.row_bytes(k))
    assert torch.equal(fmt.reference(blocks), ref)
    assert torch.equal(fmt.dequantizer(k, native=NATIVE)(blocks), ref)  # the native one where it runs


@pytest.mark.parametrize("name", list(FORMATS))
def test_the_layer_is_the_dense_layer_on_the_dequantised_weight(name):
    """A QuantLinear makes a dense fp32 Linear's choices (native kernel up to its row limit,
    F.linear above) on the same values: bitwise equal at every row count, bias or not, odd N."""
    k = _cols(name, 96)
    blocks, ref = _blocks(name, 45, k, seed=1)
    bias = torch.randn(45)
    q = QuantLinear(FORMATS[name], blocks, k, bias.clone())
    dense = Linear(k, 45)
    with torch.no_grad():
        dense.weight.copy_(ref)
        dense.bias.copy_(bias)
    setting = Setting(dispatch.backends(), torch.float32, torch.device("cpu"))  # as a model's use() sets
    q.choose(setting)
    dense.choose(setting)
    for m in (1, 2, 3, 4, 5, 49, 64, 65, 130):
        x = torch.randn(m, k)
        with torch.no_grad():
            assert torch.equal(q(x), dense(x)), m
    if NATIVE:  # past 3 rows each weight tile is dequantised once for every row (btile): the same chains
        for m in (7, 50):
            x = torch.randn(m, k)
            assert torch.equal(kernels.linear_q(x, blocks, FORMATS[name].code, None), kernels.linear(x, ref, None)), m


@pytest.mark.skipif(not dispatch.backends().avx512, reason="no AVX-512 loop here (the AVX2 one is tested above)")
@pytest.mark.parametrize("name", list(FORMATS))
def test_the_avx512_loop_is_the_avx2_loop_to_the_bit(name):
    """Two weight rows per zmm, each half the AVX2 chain: equal at every tile shape (odd N leaves
    a pair half-empty; 1, 2, 3 and 4 input rows take each tile, and past 3 rows the dequantised
    tile's rows come 8 at a time, then 1-7)."""
    k = _cols(name, 224)
    blocks, _ = _blocks(name, 21, k, seed=2)
    bias = torch.randn(21)
    try:
        for m in (1, 2, 3, 4, 7, 8, 13, 50):
            x = torch.randn(m, k)
            wide = kernels.linear_q(x, blocks, FORMATS[name].code, bias)
            kernels.set_avx512(False)
            narrow = kernels.linear_q(x, blocks, FORMATS[name].code, bias)
            assert kernels.set_avx512(True)
            assert torch.equal(wide, narrow), m
    finally:
        kernels.set_avx512(True)


def test_an_embedding_reads_its_rows_exactly():
    blocks, ref = _blocks("Q8_0", 50, 64)
    emb = QuantEmbedding(FORMATS["Q8_0"], blocks, 64)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    assert torch.equal(emb(ids), ref[ids])
    head = emb.as_linear()
    assert head.blocks is emb.blocks  # tied: one copy


def test_formats_without_a_kernel_name_themselves():
    with pytest.raises(ValueError, match=r"GGUF type Q5_K cannot run as stored; kvlab runs Q8_0, Q4_0, Q4_1, "
                                         r"Q5_0, Q4_K, Q6_K as stored"):
        check_format("Q5_K")
    with pytest.raises(ValueError, match="whole blocks of 32"):
        QuantLinear(FORMATS["Q4_1"], torch.zeros(4, 20, dtype=torch.uint8), 40)
    # a k-quant row is whole super-blocks (llama.cpp writes a 576-wide matrix in another type)
    with pytest.raises(ValueError, match="Q4_K weight of 576 inputs: rows must be whole blocks of 256"):
        QuantLinear(FORMATS["Q4_K"], torch.zeros(4, 2 * 144, dtype=torch.uint8), 576)
    with pytest.raises(ValueError, match="Q6_K weight of 576 inputs"):
        QuantEmbedding(FORMATS["Q6_K"], torch.zeros(4, 2 * 210, dtype=torch.uint8), 576)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q4_K, Q.Q6_K])
def test_a_tiny_gguf_runs_as_stored_with_the_dense_logits_and_tokens(tmp_path, qtype):
    folder = _checkpoint(tmp_path / "hf", "llama", qtype, attention_bias=qtype == Q.Q4_1)
    write_tiny_gguf(folder, tmp_path / "m.gguf", "llama", qtype)
    stored = load(tmp_path / "m.gguf")
    dense = load(tmp_path / "m.gguf", weights="dense")
    assert dense.weights.formats == frozenset()
    if NATIVE:
        assert stored.weights.formats == {qtype.name}, stored.weights
        assert isinstance(stored.model.model.layers[0].self_attn.q_proj, QuantLinear)
        assert held_bytes(stored.model) < held_bytes(dense.model) / 3
    else:  # auto holds blocks only where the kernels run
        assert stored.weights.formats == frozenset() and "native kernels do not run" in stored.weights.why
        stored = load(tmp_path / "m.gguf", weights="as-stored")
        assert "slow" in stored.weights.why
    ids = torch.randint(0, 300, (70,), generator=torch.Generator().manual_seed(0))  # past 64 rows
    with torch.no_grad():
        a = stored.model(ids, NoCache(stored.model.spec).prepare(70), NoCache(stored.model.spec), None)
        b = dense.model(ids, NoCache(dense.model.spec).prepare(70), NoCache(dense.model.spec), None)
    assert torch.equal(a, b)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = generate(stored.model, ids[:9].tolist(), params).token_ids
    assert got == generate(dense.model, ids[:9].tolist(), params).token_ids
    # the paged engine, deterministic mode included, on the stored blocks
    for deterministic in (False, True):
        llm = LLM(stored.model, deterministic=deterministic)
        out = llm.generate([ids[:9].tolist(), ids[:30].tolist()], params)
        assert out[0].token_ids == got


def test_a_gemma3_file_of_k_quants_runs_as_stored_with_the_dense_logits(tmp_path):
    """llama.cpp's Q4_K_M mix on the tiny Gemma 3 file: Q4_K, Q6_K and Q8_0 matrices (the Q8_0
    embedding tied to the head) held as stored, the logits of the dense fp32 load bit for bit."""
    path = write_gemma3_gguf(tmp_path / "g.gguf")
    stored = load(path, weights="auto" if NATIVE else "as-stored")
    dense = load(path, weights="dense")
    assert stored.weights.formats == {"Q4_K", "Q6_K", "Q8_0"}, stored.weights
    assert held_formats(stored.model) == {"Q4_K": 18, "Q6_K": 12, "Q8_0": 13}
    ids = torch.randint(0, 200, (70,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = stored.model(ids, NoCache(stored.model.spec).prepare(70), NoCache(stored.model.spec), None)
        b = dense.model(ids, NoCache(dense.model.spec).prepare(70), NoCache(dense.model.spec), None)
    assert torch.equal(a, b)


@pytest.mark.parametrize("family, arch, qtype", [("llama", "llama", Q.Q4_1), ("qwen2-tied", "qwen2", Q.Q4_0),
                                                  ("qwen3", "qwen3", Q.F16), ("qwen2-tied", "qwen2", Q.Q6_K)])
def test_the_planners_held_bytes_are_the_loaded_models(tmp_path, family, arch, qtype):
    """``StoredWeights.held_bytes`` (torch-free, from the file's header) is what the engine holds
    on the CPU: Q4_1 layers (and their F32 biases), a tied Q4_0 embedding counted once, F16
    matrices dequantised to fp32."""
    folder = _checkpoint(tmp_path / "hf", family, qtype, attention_bias=family == "llama")
    write_tiny_gguf(folder, tmp_path / "m.gguf", arch, qtype)
    stored = load_spec(str(tmp_path / "m.gguf")).stored_weights
    loaded = load(tmp_path / "m.gguf", weights="auto" if NATIVE else "as-stored")
    assert stored.as_stored == tuple(sorted(loaded.weights.formats))
    assert stored.held_bytes == held_bytes(loaded.model)
    # blocks and F32 tensors are held as in the file; F16 matrices take twice their bytes in fp32
    assert stored.held_bytes > stored.bytes if qtype == Q.F16 else stored.held_bytes == stored.bytes


def test_weights_choice_and_its_errors(tmp_path, capsys):
    folder = make_checkpoint(tmp_path / "hf", "llama")
    write_tiny_gguf(folder, tmp_path / "m.gguf", "llama", Q.Q4_1)
    with pytest.raises(ValueError, match="unknown --weights 'q4'"):
        choose_weights("q4", None, torch.float32, "cpu")
    loaded = load(tmp_path / "m.gguf", "bf16")
    assert loaded.weights.formats == frozenset() and "fp32 activations" in loaded.weights.why
    assert main(["generate", str(tmp_path / "m.gguf"), "hi", "--weights", "as-stored", "--dtype", "bf16"]) == 2
    assert "--weights as-stored runs with fp32 activations on the CPU" in capsys.readouterr().err
    # a safetensors folder has no blocks: dense whatever is asked
    assert load(folder, weights="as-stored").weights.formats == frozenset()


def test_reference_path_where_the_kernels_are_off(tmp_path, switch_off):
    """KVLAB_KERNELS=off's branch on any CPU: as-stored dequantises per call, the same logits."""
    folder = make_checkpoint(tmp_path / "hf", "llama")
    write_tiny_gguf(folder, tmp_path / "m.gguf", "llama", Q.Q4_0)
    switch_off("KVLAB_KERNELS")
    stored = load(tmp_path / "m.gguf", weights="as-stored")
    assert stored.weights.formats == {"Q4_0"} and "slow" in stored.weights.why
    assert load(tmp_path / "m.gguf").weights.formats == frozenset()
    dense = load(tmp_path / "m.gguf", weights="dense")
    ids = torch.arange(5, 40)
    with torch.no_grad():
        a = stored.model(ids, NoCache(stored.model.spec).prepare(35), NoCache(stored.model.spec), None)
        b = dense.model(ids, NoCache(dense.model.spec).prepare(35), NoCache(dense.model.spec), None)
    assert torch.equal(a, b)


def test_the_default_model_as_stored_answers_as_dense_fp32(capsys):
    """SmolLM2's Q4_1 layers and Q8_0 embedding as stored: the README's answer, the same tokens
    as the dense fp32 load, at under a fifth of the bytes."""
    stored, dense = load(None), load(None, weights="dense")
    if NATIVE:
        assert stored.weights.formats == {"Q4_1", "Q8_0"}
        assert held_bytes(stored.model) < held_bytes(dense.model) / 5
        # what `kvlab plan smollm2-135m --gpu cpu` counts from the file's header alone
        assert held_bytes(stored.model) == load_spec("smollm2-135m").stored_weights.held_bytes == 96_576_768
    chat = stored.chat_template.encode(stored.tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    params = SamplingParams(temperature=0.0, max_tokens=24)
    a = generate(stored.model, chat, params, stored.tokenizer)
    assert a.token_ids == generate(dense.model, chat, params, dense.tokenizer).token_ids
    assert "Paris" in a.text

