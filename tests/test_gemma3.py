"""Gemma 3 in kvlab's runtime, on a tiny random-weight GGUF file written with gguf's writer.

The file is what llama.cpp's converter writes for Gemma 3 (norms stored as 1 + w, a SentencePiece
vocabulary with scores and no merges, Q4_K / Q6_K / Q8_0 / F32 tensors), 6 layers with window 8
(llama.cpp's rule: every 6th layer global). transformers reads the same file with its own GGUF
loader: logits, greedy tokens and tokens of text must equal kvlab's. The paged engine must free
the sliding layers' blocks as the window passes and stay lossless against the plain loop, also
when it preempts.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvlab.engine.llm import LLM
from kvlab.layout import cdiv
from kvlab.generate import generate
from kvlab.gguf import export_folder, open_gguf
from kvlab.models import NoCache, load
from kvlab.sampling import SamplingParams
from tests.test_generate import CORPUS
from tests.test_gguf import k_quant

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
Q = gguf.GGMLQuantizationType

# head_dim 256 as in every Gemma 3: transformers' GGUF loader scales queries by 256 whatever the
# file says, llama.cpp (and kvlab) by key_length
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, WINDOW = 256, 512, 6, 2, 1, 256, 8
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary (pieces with U+2581 for spaces, scores, byte pieces) from
    a BPE trained on the test corpus: each merged piece scores by its merge's rank."""
    from tokenizers import Tokenizer, models, normalizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    pieces = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = SPECIAL + [f"<0x{b:02X}>" for b in range(256)] + pieces + ["\n"]
    scores = [0.0] * (len(SPECIAL) + 256) + [-float(i) for i in range(len(pieces))] + [0.0]
    types = [3] * len(SPECIAL) + [6] * 256 + [1] * len(pieces) + [4]
    return tokens, scores, types


def write_gemma3_gguf(out: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    tokens, scores, types = spm_vocab()
    w = gguf.GGUFWriter(str(out), "gemma3")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(WINDOW)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)

    def norm(name: str, n: int) -> None:  # llama.cpp stores Gemma's (1 + w)
        w.add_tensor(name, (1.0 + 0.3 * rng.standard_normal(n)).astype(np.float32))

    def matrix(name: str, rows: int, cols: int, qtype) -> None:
        if qtype in (Q.Q4_K, Q.Q6_K):
            w.add_tensor(name, k_quant(rng, rows, cols, qtype), raw_dtype=qtype)
        else:
            data = (0.05 * rng.standard_normal((rows, cols))).astype(np.float32)
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    matrix("token_embd.weight", len(tokens), HIDDEN, Q.Q8_0)
    norm("output_norm.weight", HIDDEN)
    for i in range(LAYERS):
        b = f"blk.{i}."
        matrix(b + "attn_q.weight", HEADS * HEAD_DIM, HIDDEN, Q.Q4_K)
        matrix(b + "attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN, Q.Q8_0)
        matrix(b + "attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN, Q.Q6_K)
        matrix(b + "attn_output.weight", HIDDEN, HEADS * HEAD_DIM, Q.Q4_K)
        matrix(b + "ffn_gate.weight", FFN, HIDDEN, Q.Q4_K)
        matrix(b + "ffn_up.weight", FFN, HIDDEN, Q.Q8_0)
        matrix(b + "ffn_down.weight", HIDDEN, FFN, Q.Q6_K)
        for part, n in (("attn_norm", HIDDEN), ("post_attention_norm", HIDDEN), ("ffn_norm", HIDDEN),
                        ("post_ffw_norm", HIDDEN), ("attn_q_norm", HEAD_DIM), ("attn_k_norm", HEAD_DIM)):
            norm(f"{b}{part}.weight", n)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def gemma_file(tmp_path_factory) -> Path:
    return write_gemma3_gguf(tmp_path_factory.mktemp("gemma3") / "tiny-gemma3.gguf")


@pytest.fixture(scope="module")
def reference(gemma_file):
    """transformers' Gemma 3 reading the same file with its own GGUF loader, fp32."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gemma_file.parent, gguf_file=gemma_file.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def ours(gemma_file):
    return load(gemma_file, "fp32")


def test_spec_has_the_window_pattern(ours):
    spec = ours.model.spec
    assert spec.model_type == "gemma3_text"
    assert [layer.kind for layer in spec.layers] == ["sliding"] * 5 + ["full"]
    assert {layer.window for layer in spec.layers if layer.kind == "sliding"} == {WINDOW}


def test_logits_match_transformers(ours, reference):
    ids = torch.randint(4, ours.model.spec.vocab_size, (3 * WINDOW,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(ids[None]).logits[0]
        got = ours.model(ids, torch.arange(ids.numel()), NoCache(ours.model.spec))
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # the window binds: a prompt past it gives other last logits than its last WINDOW tokens alone
    with torch.no_grad():
        tail = ours.model(ids[-WINDOW:], torch.arange(WINDOW), NoCache(ours.model.spec))
    assert not torch.allclose(tail[-1], got[-1], atol=1e-3)


def test_greedy_tokens_match_transformers(ours, reference):
    prompt = [2, 40, 41, 42, 43]
    params = SamplingParams(temperature=0, max_tokens=3 * WINDOW, ignore_eos=True)
    got = generate(ours.model, prompt, params).token_ids
    want = reference.generate(torch.tensor([prompt]), max_new_tokens=3 * WINDOW, do_sample=False,
                              min_new_tokens=3 * WINDOW)[0, len(prompt):].tolist()
    assert got == want


def test_sentencepiece_tokens_match_transformers(gemma_file, ours):
    ref = transformers.AutoTokenizer.from_pretrained(gemma_file.parent, gguf_file=gemma_file.name)
    for text in ["hello world, the cache holds keys", "keys  and\nvalues é!", "Tiếng Việt"]:
        assert ours.tokenizer._tok.encode(text).ids == ref(text)["input_ids"], text
        assert ours.tokenizer._tok.decode(ref(text)["input_ids"], skip_special_tokens=True) == text


def test_exported_folder_runs_the_same_weights(gemma_file, ours, tmp_path):
    folder = export_folder(open_gguf(gemma_file), tmp_path / "hf")
    ids = torch.arange(4, 4 + 2 * WINDOW)
    positions = torch.arange(ids.numel())
    again = load(folder, "fp32").model
    with torch.no_grad():
        want = ours.model(ids, positions, NoCache(ours.model.spec))
        torch.testing.assert_close(again(ids, positions, NoCache(again.spec)), want, atol=0, rtol=0)
    # a folder's config may scale queries otherwise than by head_dim (Gemma 3 27B does)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "query_pre_attn_scalar": 96}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    scaled = load(folder, "fp32").model
    with torch.no_grad():
        got = scaled(ids, positions, NoCache(scaled.spec))
        torch.testing.assert_close(got, hf(ids[None]).logits[0], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got, want, atol=1e-3)


@pytest.mark.parametrize("preemption", ["recompute", "swap-ram"])
def test_engine_frees_window_blocks_and_matches_the_plain_loop(ours, preemption):
    model = ours.model
    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(4, model.spec.vocab_size, (n,), generator=g).tolist() for n in (30, 5, 19)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [generate(model, p, params).token_ids for p in batch]
    block, chunk = 4, 6
    blocks = 24  # too few for all three at full length: the engine must preempt
    llm = LLM(model, kv_memory=blocks * block * model.spec.kv_bytes_per_token("fp32"), block_size=block,
              max_num_batched_tokens=chunk, preemption=preemption)
    engine = llm.engine
    sliding = next(i for i, grp in enumerate(engine.kv.groups) if grp.kind == "sliding")
    ids = [engine.add_request(p, params) for p in batch]
    final, held = {}, []
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.token_ids
        held += [sum(b >= 0 for b in s.block_tables[sliding]) for s in engine.scheduler.running]
    assert [final[i] for i in ids] == want
    assert llm.metrics().preemptions > 0
    # a sliding table spans at most the window plus one step's chunk, never the whole sequence
    assert max(held) <= cdiv(WINDOW - 1 + chunk - 1, block) + 1 < cdiv(30 + 40, block)


def test_transformers_folder_with_scaled_global_rope(tmp_path):
    """A folder transformers 5 writes (rope_parameters per layer type, linear scaling on the
    global layers as Gemma 3 4B+ have, layer_types listed) runs as transformers runs it."""
    cfg = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, sliding_window=4, max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], query_pre_attn_scalar=32,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from their zero init, so that (1 + w) is exercised
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path)
    ours = load(tmp_path, "fp32").model
    assert [layer.kind for layer in ours.spec.layers] == ["sliding", "full", "sliding"]
    ids = torch.arange(20) % 128
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, torch.arange(20), NoCache(ours.spec)), hf(ids[None]).logits[0],
                                   atol=1e-4, rtol=1e-4)


def test_optional_model_by_short_name(gemma_file, tmp_path, monkeypatch, capsys):
    """An optional model's file in KVLAB_MODELS is listed with its path and taken by short name;
    without it, a one-line message says how to install it."""
    from kvlab.catalog import OPTIONAL, model_path
    from kvlab.cli import main
    from kvlab.spec import ConfigError

    monkeypatch.setenv("KVLAB_MODELS", str(tmp_path))
    with pytest.raises(ConfigError, match="kvlab models --install gemma3-270m"):
        model_path("gemma3-270m")
    assert main(["generate", "gemma3-270m", "hello"]) == 2
    assert "kvlab models --install gemma3-270m" in capsys.readouterr().err
    (tmp_path / OPTIONAL["gemma3-270m"].file).symlink_to(gemma_file)
    assert main(["models", "--json"]) == 0
    rows = {r["alias"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["gemma3-270m"]["path"] == str(tmp_path / OPTIONAL["gemma3-270m"].file)
    assert rows["gemma3-270m"]["layers"] == {f"sliding({WINDOW})": 5, "full": 1}
    assert "qwen2.5-coder-1.5b" not in rows
    assert main(["generate", "gemma3-270m", "hello", "--max-tokens", "3", "--dtype", "fp32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "tiny-gemma3" and out["new_tokens"] == 3
