"""ModelSpec: the lessons' figures, every catalogue model, and bad configs."""

import json
import warnings

import pytest

from kvlab.catalog import entries, find, load_spec, suggestions
from kvlab.dtypes import kv_dtype
from kvlab.spec import ConfigError, spec_from_config
from tests.conftest import llama_like

KiB, MiB, GiB = 2**10, 2**20, 2**30


def test_llama_31_70b_seed_figures():
    spec = load_spec("llama-3.1-70b")
    assert spec.kv_bytes_per_token() == 327_680
    assert spec.kv_bytes_per_sequence(131_072) / 1e9 == pytest.approx(42.95, abs=0.01)
    no_gqa = 80 * 2 * 64 * 128 * 2 * 131_072  # every query head with its own K and V
    assert no_gqa / 1e9 == pytest.approx(343.6, abs=0.1)


@pytest.mark.parametrize("context, expected", [(2048, 256 * MiB), (8192, 1 * GiB), (32768, 4 * GiB)])
def test_llama3_8b_table(context, expected):
    spec = load_spec("meta-llama/Llama-3.1-8B")
    assert spec.kv_bytes_per_token() == 131_072
    assert spec.kv_bytes_per_sequence(context) == expected


def test_llama3_8b_long_contexts():
    spec = load_spec("llama-3.1-8b")
    assert spec.kv_bytes_per_sequence(128_000) / GiB == pytest.approx(15.6, abs=0.1)
    assert 8 * spec.kv_bytes_per_sequence(131_072) == 128 * GiB


@pytest.mark.parametrize("model, per_token, without_gqa", [
    ("qwen2.5-0.5b", 12 * KiB, 84 * KiB), ("qwen2.5-1.5b", 28 * KiB, 168 * KiB),
    ("qwen2.5-7b", 56 * KiB, 392 * KiB)])
def test_qwen25_family(model, per_token, without_gqa):
    spec = load_spec(model)
    assert spec.kv_bytes_per_token() == per_token
    mha = sum(2 * layer.num_heads * layer.head_dim * 2 for layer in spec.layers)
    assert mha == without_gqa


def test_exercise_24_layer_model():
    spec = spec_from_config(llama_like(num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=8))
    assert spec.kv_bytes_per_token() == 98_304
    assert spec.kv_bytes_per_sequence(8000) == 750 * MiB
    assert 50 * spec.kv_bytes_per_sequence(8000) == 37_500 * MiB


def test_mla_caches_one_latent():
    v3 = load_spec("deepseek-v3")
    assert v3.kv_bytes_per_token() == 61 * 576 * 2 == 70_272
    assert all(layer.kind == "mla" and layer.kv_vectors == ((1, 576),) for layer in v3.layers)
    assert load_spec("deepseek-v2-lite").kv_bytes_per_token() == 27 * 576 * 2
    assert load_spec("moonshotai/Kimi-K2-Instruct").kv_bytes_per_token() == 70_272


def test_gemma3_sliding_share_at_128k():
    spec = load_spec("gemma-3-27b")
    kinds = spec.layer_kinds()
    assert kinds == {"sliding(1024)": 52, "full": 10}
    all_full = spec.kv_bytes_per_token() * 131_072
    assert spec.kv_bytes_per_sequence(131_072) / all_full == pytest.approx(0.168, abs=0.002)
    assert any("defaults used" in n for n in spec.notes)


def test_sliding_windows_cap_growth():
    m = load_spec("mistral-7b-v0.1")
    assert {layer.window for layer in m.layers} == {4096}
    assert m.kv_bytes_per_sequence(32_768) == m.kv_bytes_per_sequence(4096)
    assert load_spec("mistral-7b-instruct-v0.3").layer_kinds() == {"full": 32}
    oss = load_spec("gpt-oss-20b")
    assert [layer.kind for layer in oss.layers[:4]] == ["sliding", "full", "sliding", "full"]
    g2 = load_spec("gemma-2-9b")
    assert g2.layers[0].kind == "sliding" and g2.layers[1].kind == "full"
    assert load_spec("phi-3-mini-4k").layers[0].window == 2047
    assert load_spec("phi-3-mini-128k").layer_kinds() == {"full": 32}  # window beyond max length
    assert load_spec("qwen2.5-7b").layer_kinds() == {"full": 28}  # use_sliding_window false


def test_hybrid_ssm_layers():
    jamba = load_spec("ai21labs/AI21-Jamba-1.5-Mini")
    assert [i for i, layer in enumerate(jamba.layers) if layer.has_kv] == [4, 12, 20, 28]
    mamba = jamba.layers[0]
    assert mamba.state_elems == 3 * 8192 + 8192 * 16
    nemo = load_spec("nemotron-h-56b")
    assert nemo.layer_kinds() == {"ssm": 54, "none": 54, "full": 10}
    m2 = next(layer for layer in nemo.layers if layer.mixer == "mamba2")
    assert m2.state_elems == 3 * (256 * 64 + 2 * 8 * 256) + 256 * 64 * 256
    nxt = load_spec("qwen3-next-80b-a3b")
    assert nxt.layer_kinds() == {"ssm": 36, "full": 12}
    assert nxt.kv_bytes_per_token() == 12 * 2 * 2 * 256 * 2
    falcon = load_spec("falcon-mamba-7b")
    assert falcon.kv_bytes_per_token() == 0
    assert falcon.kv_bytes_per_sequence(1) == falcon.kv_bytes_per_sequence(100_000) == 64 * (3 * 8192 + 8192 * 16) * 2


def test_explicit_head_dim_wins():
    spec = load_spec("qwen3-0.6b")  # hidden 1024 / 16 heads = 64, but head_dim is 128
    assert spec.layers[0].head_dim == 128
    assert spec.kv_bytes_per_token() == 28 * 2 * 8 * 128 * 2


# Transformers builds each model on the meta device; our parameter count must match it.
# Known differences: DeepSeek-V2-Lite's config has no q_lora_rank and its checkpoint no q-LoRA,
# but transformers' config class fills in 1536; V3's e_score_correction_bias is a buffer there.
HF_KNOWN = {"deepseek-ai/DeepSeek-V2-Lite": -27 * 1_574_400 + 26 * 0, "deepseek-ai/DeepSeek-V3": 58 * 256,
            "deepseek-ai/DeepSeek-R1": 58 * 256}


@pytest.mark.parametrize("hf_id", [e.hf_id for e in entries().values() if "Kimi" not in e.hf_id])
def test_param_count_matches_transformers(hf_id):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = json.loads(find(hf_id).path.read_text())
    cfg.pop("auto_map", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_cfg = transformers.AutoConfig.for_model(**cfg)
        hf_cfg = getattr(hf_cfg, "text_config", hf_cfg) if cfg["model_type"] == "gemma3" else hf_cfg
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    hf = sum(p.numel() for p in model.parameters())
    assert load_spec(hf_id).num_params - hf == HF_KNOWN.get(hf_id, 0)


def test_moe_active_params():
    spec = load_spec("mixtral-8x7b")
    assert spec.num_params == 46_702_792_704
    assert 12.5e9 < spec.active_params < 13.0e9  # two of eight experts per token
    q = load_spec("qwen3-30b-a3b")
    assert 2.9e9 < q.active_params < 3.4e9


def test_kv_dtypes_bytes():
    spec = load_spec("llama-3.1-8b")
    assert spec.kv_bytes_per_token("fp32") == 2 * spec.kv_bytes_per_token("bf16")
    assert spec.kv_bytes_per_token("fp8_e4m3") == spec.kv_bytes_per_token("bf16") // 2
    vectors = 32 * 2 * 8  # layers x (K, V) x kv heads, 128 elements each
    assert spec.kv_bytes_per_token("int8") == vectors * (128 + 4 * 2)
    assert spec.kv_bytes_per_token("int4") == vectors * (64 + 4 * 2)
    with pytest.raises(ValueError, match="unknown KV dtype"):
        kv_dtype("fp6")


def test_catalogue_lookup():
    assert find("META-LLAMA/LLAMA-3.1-70B").hf_id == "meta-llama/Llama-3.1-70B"
    assert find("llama-3.1-70b").hf_id == "meta-llama/Llama-3.1-70B"
    assert find("gemma-3-27b").hf_id == "google/gemma-3-27b-it"
    assert find("nope") is None
    assert "llama-3.1-8b" in suggestions("llama-3.1-8")
    assert len(entries()) == 51


def test_checkpoint_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(llama_like()))
    assert load_spec(str(tmp_path)).kv_bytes_per_token() == 98_304
    assert load_spec(str(tmp_path / "config.json")).num_layers == 24


def test_unknown_architecture_warns():
    with pytest.warns(UserWarning, match="unknown architecture 'brandnew'"):
        spec = spec_from_config(llama_like(model_type="brandnew"))
    assert spec.kv_bytes_per_token() == 98_304


@pytest.mark.parametrize("over, message", [
    ({"num_key_value_heads": 5}, "not a multiple"),
    ({"num_attention_heads": 30, "num_key_value_heads": 30}, "not divisible"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types has 3 entries"),
    ({"num_hidden_layers": 0}, "positive integer"),
    ({"vocab_size": "many"}, "positive integer"),
    ({"sliding_window": -1, "layer_types": ["sliding_attention"] * 24}, "positive sliding_window"),
])
def test_contradictory_configs(over, message):
    with pytest.raises(ConfigError, match=message):
        spec_from_config(llama_like(**over))


def test_missing_and_malformed_files(tmp_path):
    from kvlab.catalog import load_config

    with pytest.raises(ConfigError, match="unknown model"):
        load_config(str(tmp_path / "absent"))
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(str(bad))
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(str(bad))
