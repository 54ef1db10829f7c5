"""GGUF checkpoints: the reader on tiny files written by the gguf package, and parity with
transformers' own GGUF loading on the bundled SmolLM2-135M-Instruct file.

Tiny files: a transformers model is saved, its weights are quantised by llama.cpp's rules
(gguf.quants) with llama.cpp's Q/K row permutation applied, and written with GGUFWriter. kvlab
must recover exactly dequantise(quantise(w)) under the Hugging Face names, and its logits must
equal transformers' model holding those same weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kvlab.catalog import load_spec, model_path
from kvlab.cli import main
from kvlab.generate import generate
from kvlab.gguf import open_gguf
from kvlab.models import NoCache, load
from kvlab.sampling import SamplingParams
from kvlab.spec import ConfigError
from tests.test_generate import byte_bpe
from tests.test_models import VOCAB, make_checkpoint

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
Q = gguf.GGMLQuantizationType

_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
          "post_attention_layernorm": "ffn_norm"}


def _gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, idx, rest = hf.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{idx}.{_NAMES[module]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """The row order llama.cpp's converter writes for Q and K of "llama" models (its own rule,
    written out here so the test checks the reader against it, not against itself)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def k_quant(rng: np.random.Generator, rows: int, cols: int, qtype) -> np.ndarray:
    """Random blocks of a K-quant type with small f16 scales (gguf cannot quantise to K types)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    if qtype == Q.Q4_K:  # d, dmin first
        raw[..., 0:4] = np.frombuffer(np.array([2e-4, 2e-4], np.float16).tobytes(), np.uint8)
    else:  # Q6_K: d last
        raw[..., -2:] = np.frombuffer(np.array([4e-5], np.float16).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def write_tiny_gguf(folder: Path, out: Path, arch: str, qtype, *, pre: str = "default",
                    add_bos: bool = False, chat_template: str | None = None) -> dict[str, torch.Tensor]:
    """Write ``folder``'s model as a GGUF file; linear weights in ``qtype``, norms and biases F32.
    Returns the weights kvlab should load (quantisation round trip, HF names and row order). A
    k-quant ``qtype`` (Q4_K, Q6_K: gguf cannot quantise to them) writes random blocks
    (``k_quant``) in place of the matrices; their columns must be multiples of 256."""
    cfg = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    w.add_value_length(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(VOCAB)
    tok = json.loads(byte_bpe(VOCAB).to_str())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab] + [f"[PAD{i}]" for i in range(VOCAB - len(vocab))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t == "<eos>" else 5 if t.startswith("[PAD") else 1 for t in tokens])
    w.add_bos_token_id(tokens.index("<eos>"))
    w.add_eos_token_id(tokens.index("<eos>"))
    w.add_add_bos_token(add_bos)
    if chat_template:
        w.add_chat_template(chat_template)
    expected = {}
    rng = np.random.default_rng(0)
    for name, t in state.items():
        data = t.float().numpy()
        # llama.cpp quantises rows in blocks along the columns, so permuting rows commutes with
        # the quantisation round trip: kvlab must give back dequantise(quantise(w)) in HF order
        if data.ndim == 2:
            data = (k_quant(rng, *data.shape, qtype) if qtype in (Q.Q4_K, Q.Q6_K)
                    else gguf.quants.quantize(data, qtype))
            expected[name] = torch.from_numpy(gguf.quants.dequantize(data, qtype))
        else:
            expected[name] = t.float()
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = _llama_cpp_permute(data, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = _llama_cpp_permute(data, kv_heads)
        if data.ndim == 2:
            w.add_tensor(_gguf_name(name), data, raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


CASES = {  # id -> (test family, config overrides, GGUF architecture, linear weights' type)
    "llama-q8_0": ("llama", {}, "llama", Q.Q8_0),
    "llama-bias-q4_1": ("llama", {"attention_bias": True}, "llama", Q.Q4_1),
    "qwen2-tied-q4_0": ("qwen2-tied", {}, "qwen2", Q.Q4_0),
    "qwen3-f16": ("qwen3", {}, "qwen3", Q.F16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_gguf_weights_and_logits(tmp_path, case):
    family, overrides, arch, qtype = CASES[case]
    folder = make_checkpoint(tmp_path / "hf", family, **overrides)
    expected = write_tiny_gguf(folder, tmp_path / "m.gguf", arch, qtype)
    model = load(tmp_path / "m.gguf", "fp32", weights="dense").model  # the values (stored: test_weights)
    got = model.state_dict()
    for name, want in expected.items():
        if name == "lm_head.weight" and model.spec.tie_word_embeddings:
            continue
        assert torch.equal(got[name], want.reshape(got[name].shape)), name
    # the same weights in transformers' own model give the same logits
    hf_cls = getattr(transformers, json.loads((folder / "config.json").read_text())["architectures"][0])
    hf = hf_cls.from_pretrained(folder).eval()
    hf.load_state_dict({k: v.reshape(hf.state_dict()[k].shape) for k, v in expected.items()}, strict=False)
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        backend = NoCache(model.spec)
        ours = model(ids, backend.prepare(20), backend, None)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_tiny_gguf_config_tokenizer_and_template(tmp_path):
    folder = make_checkpoint(tmp_path / "hf", "qwen3")
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    write_tiny_gguf(folder, tmp_path / "m.gguf", "qwen3", Q.Q8_0, add_bos=True, chat_template=template)
    spec = load_spec(str(tmp_path / "m.gguf"))
    assert (spec.model_type, spec.num_layers, spec.layers[0].head_dim) == ("qwen3", 2, 16)
    assert spec.kv_bytes_per_token("bf16") == 2 * 2 * 2 * 16 * 2  # K and V, 2 layers, 2 heads x 16
    assert spec.stored_weights is not None and spec.stored_weights.formats["Q8_0"] > 0
    loaded = load(tmp_path / "m.gguf", "fp32")
    ref = byte_bpe(VOCAB)
    for text in ["hello world", "a  b\n\nc", "zażółć 缓存 😀"]:
        ids = loaded.tokenizer.encode(text)
        assert ids[0] == ref.token_to_id("<eos>")  # add_bos_token: the file's BOS comes first
        assert ids[1:] == ref.encode(text).ids
        assert loaded.tokenizer.decode(ids) == text
    assert loaded.model.eos_token_ids == (ref.token_to_id("<eos>"),)
    chat = loaded.chat_template.encode(loaded.tokenizer, [{"role": "user", "content": "hi"}])
    assert loaded.tokenizer.decode(chat) == "<user>hi<assistant>"


def test_reader_reads_the_fields_the_package_reads(tmp_path):
    """kvlab's one-pass reading of string and number arrays builds exactly the package's fields:
    the same parts (dtypes and bytes), indices, types and contents, and the same tensors."""
    from kvlab.gguf import GGUFFile

    folder = make_checkpoint(tmp_path / "hf", "llama")
    path = tmp_path / "m.gguf"
    write_tiny_gguf(folder, path, "llama", Q.Q8_0, chat_template="{{ messages }}")
    w = gguf.GGUFWriter(str(tmp_path / "arrays.gguf"), "llama")
    w.add_array("test.floats", [0.5, -2.0, 3.25])
    w.add_array("test.empty", [])
    w.add_array("test.strings", ["", "ż", "two words"])
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for file in (path, tmp_path / "arrays.gguf"):
        ours, theirs = GGUFFile(file).reader, gguf.GGUFReader(str(file))
        assert list(ours.fields) == list(theirs.fields)
        for key, want in theirs.fields.items():
            got = ours.fields[key]
            assert (got.offset, got.data, got.types) == (want.offset, want.data, want.types), key
            assert [(p.dtype, p.tobytes()) for p in got.parts] == [(p.dtype, p.tobytes()) for p in want.parts], key
            assert got.contents() == want.contents(), key
        assert [(t.name, t.data_offset) for t in ours.tensors] == [(t.name, t.data_offset) for t in theirs.tensors]


def test_bad_gguf_files_give_one_line(tmp_path, capsys):
    folder = make_checkpoint(tmp_path / "hf", "llama")
    good = tmp_path / "m.gguf"
    write_tiny_gguf(folder, good, "llama", Q.Q8_0)
    data = good.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    (tmp_path / "text.gguf").write_text("not a model\n")
    w = gguf.GGUFWriter(str(tmp_path / "gemma.gguf"), "gemma2")
    w.add_block_count(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    capsys.readouterr()  # drop the checkpoint writer's progress bar
    for name, words in [("cut.gguf", "truncated"), ("text.gguf", "not a GGUF file"),
                        ("gemma.gguf", "architecture 'gemma2' is not supported")]:
        with pytest.raises(ConfigError, match=words):
            load(tmp_path / name)
        assert main(["generate", str(tmp_path / name), "hi"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0]


def test_unpermute_is_llama_cpp_inverse():
    from kvlab.gguf import unpermute_rope_rows

    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)  # 4 heads of head_dim 8
    assert np.array_equal(unpermute_rope_rows(_llama_cpp_permute(w, 4), 4), w)
    assert not np.array_equal(_llama_cpp_permute(w, 4), w)


# --- the bundled SmolLM2-135M-Instruct file against transformers ------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,"]
TEXTS = [
    "Hello, world! The KV cache stores keys and values.",
    "Zażółć gęślą jaźń. Pamięć podręczna KV rośnie z długością kontekstu.",
    "键值缓存随着上下文长度线性增长。你好，世界！",
    "Bộ nhớ đệm KV tăng tuyến tính theo độ dài ngữ cảnh.",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\n",
    "Digits 0123456789, 3.14159, 1,000,000 and 2026-12-01.",
    "runs of spaces:    four, tabs\t\there,\r\nand newlines\n\n\n\nend",
    "emoji 😀👍🏽🇵🇱 and symbols ∑∫ ≠ ≤",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    " leading space and trailing space ",
]


@pytest.fixture(scope="module")
def smollm2():
    path = model_path("smollm2-135m")
    ours = load(path, "fp32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return ours, hf, hf_tok


def test_smollm2_tokenizer_matches_transformers(smollm2):
    ours, _, hf_tok = smollm2
    for text in TEXTS:
        ids = ours.tokenizer.encode(text)
        assert ids == hf_tok.encode(text, add_special_tokens=True), text
        assert ours.tokenizer._tok.decode(ids, skip_special_tokens=False) == text


def test_smollm2_greedy_and_logits_match_transformers(smollm2):
    ours, hf, _ = smollm2
    chat = ours.chat_template.encode(ours.tokenizer, [{"role": "user", "content": "Name a colour."}])
    prompts = [ours.tokenizer.encode(p) for p in PROMPTS] + [chat]
    for ids in prompts:
        res = generate(ours.model, ids, SamplingParams(temperature=0.0, max_tokens=16), ours.tokenizer)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                              eos_token_id=list(ours.model.eos_token_ids))[0, len(ids):].tolist()
            ref_logits = hf(torch.tensor([ids])).logits[0, -1]
            backend = NoCache(ours.model.spec)
            logits = ours.model(torch.tensor(ids), backend.prepare(len(ids)), backend, None)[-1]
        ref = ref[: len(res.token_ids)] if ref[-1] in ours.model.eos_token_ids else ref
        assert res.token_ids == ref[: len(res.token_ids)] and len(res.token_ids) >= len(ref) - 1
        # fp32 on both sides; differences are summation order only
        torch.testing.assert_close(logits, ref_logits, atol=2e-4, rtol=0)


def test_smollm2_chat_template_matches_transformers(smollm2):
    ours, _, hf_tok = smollm2
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert ours.chat_template.encode(ours.tokenizer, messages) == hf_tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_smollm2_answers_paris_from_the_cli(capsys):
    """The default model in the default dtype (auto), through the CLI exactly as the README shows it."""
    assert main(["generate", "--chat", "What is the capital of France?", "--temperature", "0",
                 "--max-tokens", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "SmolLM2-135M-Instruct.Q4_1" and out["chat"] is True
    assert "Paris" in out["text"]


def test_smollm2_plan_reports_stored_and_kv_bytes(capsys):
    assert main(["plan", "smollm2-135m", "--json", "--context", "2048"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 2 == 23_040
    gg = open_gguf(model_path("smollm2-135m"))
    assert plan["stored_weights_bytes"] == sum(int(t.n_bytes) for t in gg.reader.tensors)
    assert plan["stored_weights_bytes"] < 98_362_432 < plan["weights_bytes"]  # below the file, below bf16


def test_smollm2_served_chat_uses_the_files_template(caplog):
    """`kvlab serve` on the default GGUF: /v1/chat/completions renders the file's ChatML template,
    and the paged engine answers as the plain loop does."""
    openai = pytest.importorskip("openai")
    from kvlab.options import EngineOptions, ModelOptions
    from kvlab.server.run import build_bridge
    from tests.test_server_fixtures import LiveServer

    with caplog.at_level("INFO", "kvlab.server"):  # fp32 where auto picks it: 45 KiB per token
        bridge = build_bridge(ModelOptions(), EngineOptions(kv_memory="32MiB", max_model_len=512))
    # start-up log: the Q4_1 file runs in fp32 on every CPU
    assert "SmolLM2-135M-Instruct.Q4_1 in fp32 (auto: Q4_1 weights, exact in fp32" in caplog.text
    live = LiveServer(bridge)
    try:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert client.models.list().data[0].id == "SmolLM2-135M-Instruct.Q4_1"
        question = [{"role": "user", "content": "What is the capital of France?"}]
        res = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=question,
                                             max_tokens=12, temperature=0)
        ids = bridge.chat_template.encode(bridge.tokenizer, question)
        assert "<|im_start|>user" in bridge.tokenizer._tok.decode(ids, skip_special_tokens=False)
        assert res.usage.prompt_tokens == len(ids)
        assert "Paris" in res.choices[0].message.content
    finally:
        live.stop()


def test_llm_api_defaults_to_smollm2():
    from kvlab import LLM, SamplingParams

    llm = LLM(kv_memory="16MiB", max_model_len=256)  # room for 256 tokens in fp32 (auto's pick here)
    assert llm.engine.model.name == "SmolLM2-135M-Instruct.Q4_1"
    out = llm.generate(["The capital of France is", [1, 2, 3]],
                       SamplingParams(temperature=0, max_tokens=4))
    assert [o.finish_reason for o in out] == ["length", "length"] and "Paris" in out[0].text
