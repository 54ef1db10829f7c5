"""Parity of kvlab's runtime with transformers, per family, and the loader's contracts.

Each case builds a tiny random model with transformers, saves it (safetensors) and loads it with
kvlab's loader in fp32: logits must match to 1e-4 (whole prompt, and through the contiguous cache
in chunks), and 20 greedy tokens must equal transformers' own ``generate``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvlab import dispatch
from kvlab.models.loader import choose_dtype as loader_choose_dtype
from kvlab.generate import generate
from kvlab.models import (
    ContiguousKVCache,
    NoCache,
    UnsupportedModelError,
    build_model,
    choose_dtype,
    load,
)
from kvlab.sampling import SamplingParams
from kvlab.spec import ConfigError, spec_from_config

transformers = pytest.importorskip("transformers")

VOCAB = 320
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=128,
            initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=None)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}

# name -> (config class, model class, extra config fields, save kwargs)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, {}),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM",
                    {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}, {}),
    "llama-sharded-bias": ("LlamaConfig", "LlamaForCausalLM",
                           {"attention_bias": True, "mlp_bias": True}, {"max_shard_size": "40KB"}),
    "qwen2-tied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}, {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}, {}),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 6}, {}),
}


def make_checkpoint(folder: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a tiny random transformers model of ``family`` to ``folder``; return the folder."""
    cfg_name, model_name, extra, save_kwargs = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(**{**TINY, **extra, **overrides})
    model = getattr(transformers, model_name)(cfg).eval()
    model.save_pretrained(folder, **save_kwargs)
    return folder


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_checkpoint(request, tmp_path_factory):
    folder = make_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    hf = getattr(transformers, FAMILIES[request.param][1]).from_pretrained(folder).eval()
    return request.param, folder, hf


def _prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def test_logits_match_transformers(family_checkpoint):
    name, folder, hf = family_checkpoint
    model = load(folder, "fp32").model
    ids = _prompt(24)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        backend = NoCache(model.spec)
        ours = model(ids, backend.prepare(24), backend, None)
    assert ours.shape == (24, VOCAB)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("chunks", [(24,), (10, 14), (3, 2, 1, 5, 1, 1, 11)])
def test_cached_chunks_match_transformers(family_checkpoint, chunks):
    """Prefill in pieces then decode: the cache must give the whole-sequence logits (for the
    6-token window this covers the ring buffer's wrap in every path)."""
    name, folder, hf = family_checkpoint
    model = load(folder, "fp32").model
    ids = _prompt(24)
    cache = ContiguousKVCache(model.spec, capacity=30, dtype=torch.float32)
    outs, at = [], 0
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        for n in chunks:
            outs.append(model(ids[at:at + n], cache.prepare(n), cache, None))
            at += n
    torch.testing.assert_close(torch.cat(outs), ref, atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers_generate(family_checkpoint):
    name, folder, hf = family_checkpoint
    model = load(folder, "fp32").model
    prompt = _prompt(9, seed=2)
    with torch.no_grad():
        ref = hf.generate(prompt[None], max_new_tokens=20, min_new_tokens=20, do_sample=False)
    ref_new = ref[0, 9:].tolist()
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert generate(model, prompt.tolist(), params).token_ids == ref_new
    assert generate(model, prompt.tolist(), params, use_cache=False).token_ids == ref_new


def test_sharded_checkpoint_is_really_sharded(tmp_path):
    folder = make_checkpoint(tmp_path, "llama-sharded-bias")
    shards = list(folder.glob("*.safetensors"))
    assert len(shards) > 1 and (folder / "model.safetensors.index.json").is_file()
    model = load(folder, "fp32").model
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert model.model.layers[0].mlp.down_proj.bias is not None


def test_tied_embeddings_share_one_tensor(tmp_path):
    folder = make_checkpoint(tmp_path, "qwen2-tied")
    model = load(folder, "fp32").model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()


def test_legacy_rope_config_fields(tmp_path):
    """Catalogue configs use rope_theta + rope_scaling (transformers 4); transformers 5 writes
    rope_parameters. Both must give the same model."""
    folder = make_checkpoint(tmp_path, "llama3-rope")
    new = load(folder, "fp32").model
    cfg = json.loads((folder / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    (folder / "config.json").write_text(json.dumps(cfg))
    old = load(folder, "fp32").model
    assert torch.equal(old.inv_freq, new.inv_freq)
    assert not torch.allclose(old.inv_freq, 1 / 500000.0 ** (torch.arange(0, 16, 2) / 16))


def test_logits_only_for_requested_positions(tmp_path):
    model = load(make_checkpoint(tmp_path), "fp32").model
    ids = _prompt(12)
    backend = NoCache(model.spec)
    with torch.no_grad():
        all_logits = model(ids, backend.prepare(12), backend, None)
        last = model(ids, backend.prepare(12), backend, torch.tensor([11]))
        some = model(ids, backend.prepare(12), backend, torch.tensor([0, 5]))
    assert all_logits.shape == (12, VOCAB) and last.shape == (1, VOCAB) and some.shape == (2, VOCAB)
    torch.testing.assert_close(last[0], all_logits[11])
    torch.testing.assert_close(some, all_logits[[0, 5]])


def test_lm_head_sees_only_the_requested_rows(tmp_path):
    """Generation must never build [T, vocab] logits for the prompt."""
    model = load(make_checkpoint(tmp_path), "fp32").model
    rows: list[int] = []
    model.lm_head.register_forward_hook(lambda mod, inp, out: rows.append(inp[0].shape[0]))
    generate(model, _prompt(20).tolist(), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert rows == [1, 1, 1, 1]


@pytest.mark.parametrize("family", ["llama", "mistral-window"])
def test_cache_bytes_match_the_spec(tmp_path, family):
    model = load(make_checkpoint(tmp_path, family), "bf16").model
    cache = ContiguousKVCache(model.spec, capacity=40, batch_size=2, dtype=torch.bfloat16)
    assert cache.kv_bytes == 2 * model.spec.kv_bytes_per_sequence(40, "bf16")
    slots = 6 if family == "mistral-window" else 40
    assert [tuple(t.shape) for t in cache.k] == [(2, 2, slots, 16)] * 2
    with pytest.raises(ValueError, match="full"):
        cache.prepare(41)


def test_batched_cache_matches_single_sequences(tmp_path):
    model = load(make_checkpoint(tmp_path, "mistral-window"), "fp32").model
    a, b = _prompt(10, 3), _prompt(10, 4)
    cache = ContiguousKVCache(model.spec, capacity=12, batch_size=2, dtype=torch.float32)
    with torch.no_grad():
        both = model(torch.cat([a, b]), cache.prepare(10), cache, None)
        for i, ids in enumerate((a, b)):
            nc = NoCache(model.spec)
            torch.testing.assert_close(both[i * 10:(i + 1) * 10], model(ids, nc.prepare(10), nc),
                                       atol=1e-5, rtol=0)


def bf16_checkpoint(folder: Path) -> Path:
    """make_checkpoint's model saved in bf16, as most Hugging Face checkpoints are."""
    make_checkpoint(folder)
    transformers.AutoModelForCausalLM.from_pretrained(folder).to(torch.bfloat16).save_pretrained(folder)
    return folder


def test_dtype_choice_and_default(tmp_path):
    folder = make_checkpoint(tmp_path / "fp32")
    assert load(folder).dtype.why == "auto: fp32 weights"  # on every CPU
    assert load(folder).model.dtype == torch.float32
    assert load(folder, "bf16").model.dtype == torch.bfloat16  # an explicit choice stands
    assert load(folder, "fp16").model.dtype == torch.float16
    assert load(folder, "fp32").model.dtype == torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        load(folder, "int3")
    # a bf16 checkpoint runs in fp32 (exact) on every CPU; --dtype bf16 where it is faster
    bf16 = load(bf16_checkpoint(tmp_path / "bf16"))
    assert bf16.model.dtype == torch.float32 and bf16.dtype.why.startswith("auto: bf16 weights, exact in fp32")
    assert ("--dtype bf16 runs faster here" in bf16.dtype.why) is bool(dispatch.backends().onednn_bf16)


def test_stored_format_of_each_kind_of_checkpoint(tmp_path):
    from kvlab.catalog import gguf_file
    from kvlab.models.loader import stored_format

    assert stored_format(None, make_checkpoint(tmp_path / "a"), {}) == "fp32"
    assert stored_format(None, bf16_checkpoint(tmp_path / "b"), {}) == "bf16"
    assert stored_format(None, None, {"torch_dtype": "float16"}) == "fp16"
    assert stored_format(None, None, {"dtype": "bfloat16"}) == "bf16"
    assert stored_format(None, None, {}) == "fp32"  # transformers' default without one
    if gguf_file("smollm2-135m") is not None:
        assert stored_format(gguf_file("smollm2-135m"), None, {}) == "Q4_1"


@pytest.mark.parametrize("onednn", [True, False])
def test_auto_dtype_rule(onednn, backends_with):
    """auto keeps the checkpoint's values exactly and the same tokens on every CPU: fp32 for every
    stored format on a CPU, with or without oneDNN's bf16 kernels (both branches, whatever this
    CPU has); on a GPU fp16 for fp16 weights, else bf16. Each choice says why."""
    here = backends_with(onednn_bf16=onednn)

    def choose_dtype(name, device="cpu", stored="fp32"):
        return loader_choose_dtype(name, device, stored, here)

    for stored in ("bf16", "fp32", "fp16", "Q4_1", "Q8_0"):
        cpu = choose_dtype("auto", "cpu", stored)
        assert cpu.dtype == torch.float32 and cpu.why.startswith(f"auto: {stored} weights") and cpu.name in str(cpu)
    assert "exact in fp32 (bf16 would round them)" in choose_dtype("auto", "cpu", "Q4_1").why
    assert ("forced by a test" in choose_dtype("auto", "cpu", "bf16").why) is not onednn
    assert ("--dtype bf16 runs faster here" in choose_dtype("auto", "cpu", "bf16").why) is onednn
    for stored, want in (("fp16", torch.float16), ("bf16", torch.bfloat16), ("Q4_1", torch.bfloat16)):
        gpu = choose_dtype("auto", "cuda:0", stored)  # no GPU needed: the rule reads the device's kind
        assert gpu.dtype == want and "cuda" in gpu.why
    for name, dtype in (("fp32", torch.float32), ("BF16", torch.bfloat16), ("half", torch.float16),
                        (torch.bfloat16, torch.bfloat16)):
        assert choose_dtype(name, "cpu").dtype == dtype
    assert ("slow here" in choose_dtype("bf16", "cpu").why) is not onednn
    assert "slow" not in choose_dtype("bf16", "cuda").why
    with pytest.raises(ValueError, match="choose auto, fp32, bf16 or fp16"):
        choose_dtype(torch.int8)


def test_auto_says_bf16_is_faster_exactly_where_bf16_weights_get_packed(tmp_path):
    """The real probe, on this CPU: the hint that --dtype bf16 is faster and oneDNN's packing are
    one decision."""
    folder = bf16_checkpoint(tmp_path)
    auto = load(folder, "auto")
    bf16 = load(folder, "bf16").model
    assert ("--dtype bf16 runs faster here" in auto.dtype.why) == (bf16.prepack(2**40) > 0)


def test_eos_from_generation_config(tmp_path):
    folder = make_checkpoint(tmp_path, eos_token_id=7)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 9]}))
    assert load(folder, "fp32").model.eos_token_ids == (5, 9)
    (folder / "generation_config.json").unlink()
    assert load(folder, "fp32").model.eos_token_ids == (7,)


def test_random_weights_are_seeded_and_scaled(tmp_path):
    cfg = {**TINY, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
           "hidden_size": 128, "intermediate_size": 256, "initializer_range": 0.05,
           "tie_word_embeddings": True, "rms_norm_eps": 1e-6}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    a = load(path, "fp32", random_weights=True, seed=3).model
    b = load(path, "fp32", random_weights=True, seed=3).model
    c = load(path, "fp32", random_weights=True, seed=4).model
    wa = a.model.layers[0].mlp.up_proj.weight
    assert torch.equal(wa, b.model.layers[0].mlp.up_proj.weight)
    assert not torch.equal(wa, c.model.layers[0].mlp.up_proj.weight)
    assert abs(wa.std().item() - 0.05) < 0.005
    assert torch.all(a.model.layers[0].self_attn.q_proj.bias == 0)
    assert torch.all(a.model.norm.weight == 1)
    assert a.lm_head.weight is a.model.embed_tokens.weight


def test_random_weights_from_the_catalogue_build_on_meta():
    """Real-size models: the spec's parameter count is what gets built (checked without memory)."""
    from kvlab.catalog import load_spec

    for name in ("qwen2.5-0.5b", "llama-3.2-1b", "qwen3-0.6b", "mistral-7b"):
        spec = load_spec(name)
        with torch.device("meta"):
            from kvlab.models import CausalLM

            model = CausalLM(spec)
        assert sum(p.numel() for p in model.parameters()) == spec.num_params, name


@pytest.mark.parametrize("name, word", [("deepseek-v3", "MLA"), ("mixtral-8x7b", "mixture of experts"),
                                        ("falcon-mamba-7b", "SSM"), ("gemma-2-2b", "gemma2"),
                                        ("qwen3-30b-a3b", "qwen3_moe")])
def test_unsupported_architectures_fail_clearly(name, word):
    with pytest.raises(UnsupportedModelError) as err:
        load(name, random_weights=True)
    msg = str(err.value)
    assert word in msg and "supported: llama, mistral, qwen2, qwen3" in msg and "\n" not in msg


def test_unsupported_rope_type(tmp_path):
    cfg = {**TINY, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    spec = spec_from_config(cfg)
    with pytest.raises(UnsupportedModelError, match="yarn"):
        build_model(spec, "fp32", random_weights=True)


def test_missing_or_mismatched_weights(tmp_path):
    folder = make_checkpoint(tmp_path / "a")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="missing 9 tensors"):
        load(folder)
    empty = tmp_path / "b"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        load(empty)
    with pytest.raises(ConfigError, match="without weights"):
        load("qwen2.5-0.5b")


# PyTorch's and oneDNN's own switches that make this CPU take an AVX2-only CPU's branches
AVX2_BRANCHES = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_the_default_dtype_gives_the_same_tokens_on_the_avx2_branches():
    """The README's examples print the same text on every CPU: in the default dtype (fp32 for
    this bf16 checkpoint) the tokens on this CPU equal those of its AVX2 branches (an AVX2 CPU
    runs them: the same case, so there it cannot differ)."""
    import os
    import subprocess
    import sys

    def tokens(env: dict) -> list[int]:
        out = subprocess.run([sys.executable, "-m", "kvlab", "generate", "austen-demo",
                              "It is a truth universally acknowledged", "--max-tokens", "64", "--json"],
                             capture_output=True, text=True, check=True, env={**os.environ, **env})
        result = json.loads(out.stdout)
        assert result["dtype"] == "float32"
        return result["token_ids"]

    assert tokens({}) == tokens(AVX2_BRANCHES)
