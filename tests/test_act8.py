"""``--activations int8`` (kvlab/kernels/act8.h): input rows quantised per 32 values, integer dot
products against the stored blocks. The kernel's quantisation is the reference's to the bit, its
sums are the quantised reference's to fp32 rounding, every row is bitwise the same whatever rows
share its call (batch-invariant), VNNI gives AVX2's bits, and the default model keeps its quality."""

from __future__ import annotations

import json

import pytest
import torch

from kvlab import dispatch, kernels
from kvlab.cli import main
from kvlab.data import PERSUASION
from kvlab.engine.llm import LLM
from kvlab.evaluate import perplexity_loop
from kvlab.eviction import make_policy
from kvlab.models import load
from kvlab.models.methods import Int8Reference, NativeStored, act8_reference
from kvlab.models.weights import ACT8_FORMATS, FORMATS, QuantLinear
from kvlab.sampling import SamplingParams
from tests.test_weights import _blocks

NATIVE = bool(dispatch.backends().native)
needs_kernels = pytest.mark.skipif(not NATIVE, reason="the native kernels do not run here (the reference "
                                   "path is tested below)")


def rows(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows with the cases quantisation meets: an all-zero block, a lone value, ties at .5 steps."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3
    x[0, :32] = 0.0
    if m > 1:
        x[1, 32:64] = 0.0
        x[1, 40] = -7.5
        x[1, 64:96] = torch.arange(32) * 0.5  # max 15.5: steps of 15.5 / 127, several exact .5s
    return x


@needs_kernels
def test_the_kernels_quantisation_is_the_reference_to_the_bit():
    x = rows(9, 576, seed=0)
    q, d, s = kernels.quantize_act8(x)
    b = x.view(9, -1, 32)
    ref_d = b.abs().amax(-1) / 127
    ref_q = torch.round(b * torch.where(ref_d > 0, 1 / ref_d, torch.zeros_like(ref_d))[..., None])
    assert torch.equal(q.view(9, -1, 32).float(), ref_q) and torch.equal(d, ref_d)
    assert torch.equal(s, ref_q.sum(-1).int()) and q.abs().max() <= 127
    assert torch.equal(act8_reference(x), (q.view(9, -1, 32).float() * d[..., None]).view(9, 576))


@needs_kernels
@pytest.mark.parametrize("name", ACT8_FORMATS)
def test_integer_dot_products_are_the_quantised_reference(name):
    """Against the quantised rows times the dequantised weight in float64: within fp32 rounding
    of the sums, at every tile shape (1 row: 8 weight rows a tile; 2-3; past 3: in threes)."""
    k = 224
    blocks, ref = _blocks(name, 21, k, seed=4)
    bias = torch.randn(21)
    for m in (1, 2, 3, 4, 7, 50):
        x = rows(m, k, seed=m)
        y = kernels.linear_q(x, blocks, FORMATS[name].code | kernels.ACT8, bias)
        want = act8_reference(x).double() @ ref.double().T + bias.double()
        scale = (act8_reference(x).abs().double() @ ref.abs().double().T).max()
        assert (y.double() - want).abs().max() <= 1e-6 * scale, (name, m)


@needs_kernels
@pytest.mark.parametrize("name", ACT8_FORMATS)
def test_a_row_is_the_same_whatever_shares_its_call(name):
    blocks, _ = _blocks(name, 37, 160, seed=5)
    code = FORMATS[name].code | kernels.ACT8
    x = rows(53, 160, seed=6)
    batch = kernels.linear_q(x, blocks, code, None)
    for i in (0, 1, 2, 17, 52):
        assert torch.equal(kernels.linear_q(x[i:i + 1].contiguous(), blocks, code, None)[0], batch[i]), i
    assert torch.equal(kernels.linear_q(x[5:9].contiguous(), blocks, code, None), batch[5:9])


VNNI = kernels.status().vnni if NATIVE else ()


@pytest.mark.skipif(not VNNI, reason="no VNNI encoding here (the AVX2 loop is tested above)")
@pytest.mark.parametrize("name", ACT8_FORMATS)
def test_each_vnni_encoding_gives_the_avx2_bits(name):
    blocks, _ = _blocks(name, 19, 224, seed=7)
    code = FORMATS[name].code | kernels.ACT8
    try:
        for m in (1, 2, 3, 5, 40):
            x = rows(m, 224, seed=m + 10)
            kernels.set_vnni(None)
            avx2 = kernels.linear_q(x, blocks, code, None)
            for encoding in VNNI:
                assert kernels.set_vnni(encoding)
                assert torch.equal(kernels.linear_q(x, blocks, code, None), avx2), (encoding, m)
    finally:
        dispatch.vnni_kernels()  # back to this process's choice


def test_the_reference_path_quantises_the_same_rows():
    """Where the kernels are off, Int8Reference: the same quantised rows through PyTorch, close to
    the kernel's sums (not bitwise: another order)."""
    blocks, ref = _blocks("Q4_1", 24, 96, seed=8)
    layer = QuantLinear(FORMATS["Q4_1"], blocks, 96)
    x = rows(6, 96, seed=9)
    y = Int8Reference(layer.format.reference, lambda a, w, b: a @ w.T)(x, blocks, None)
    torch.testing.assert_close(y, act8_reference(x) @ ref.T, rtol=1e-5, atol=1e-5)
    if NATIVE:
        torch.testing.assert_close(kernels.linear_q(x, blocks, FORMATS["Q4_1"].code | kernels.ACT8, None), y,
                                   rtol=1e-5, atol=1e-4)


@pytest.fixture(scope="module")
def default_models():
    return load(activations="fp32"), load(activations="int8")


def test_the_default_model_runs_its_stored_layers_on_int8_rows(default_models):
    exact, int8 = default_models
    assert (exact.model.activations, int8.model.activations) == ("fp32", "int8")
    stored = [m for m in int8.model.modules() if isinstance(m, QuantLinear) and m.format.name in ACT8_FORMATS]
    assert stored
    for m in stored:
        if NATIVE:
            assert isinstance(m.method, NativeStored) and m.method.code & kernels.ACT8
        else:
            assert isinstance(m.method, Int8Reference)


def test_int8_rows_keep_the_default_models_perplexity(default_models):
    """512 tokens of *Persuasion*: perplexity within 3% of the exact mode's (the measured gap is in
    docs/benchmarks.md)."""
    exact, int8 = default_models
    ids = exact.tokenizer.encode(PERSUASION.read_text())[:512]
    full = make_policy("full")
    ppl_exact, ppl_int8 = (perplexity_loop(m.model, ids, full, chunk=128) for m in (exact, int8))
    assert ppl_exact <= ppl_int8 * 1.03 and ppl_int8 <= ppl_exact * 1.03, (ppl_exact, ppl_int8)


def test_int8_mode_is_batch_invariant_in_the_engine(default_models):
    """--deterministic with int8 rows: each prompt's tokens in a batch are its tokens alone."""
    llm = LLM(default_models[1].model, deterministic=True, kv_memory=2**26)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [default_models[1].tokenizer.encode(p) for p in
               ("The KV cache of a transformer", "Anne Elliot walked to", "In a paged cache, blocks")]
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert together == alone


def test_int8_without_a_stored_layer_is_a_one_line_error(capsys):
    with pytest.raises(ValueError, match="--activations int8 runs GGUF"):
        load("smollm2-135m", weights="dense", activations="int8")
    assert main(["generate", "smollm2-135m", "--random-weights", "--activations", "int8", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "this model holds no stored layer" in err[0]


def test_generate_json_says_which_activations_ran(capsys):
    assert main(["generate", "--activations", "int8", "--max-tokens", "4", "--json", "The KV cache"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["activations"] == "int8" and out["new_tokens"] == 4
