"""The public API: LLM / streaming / abort / errors at admission / options and their CLI flags."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

import pytest
from safetensors.torch import save_file

from kvlab import LLM, SamplingParams
from kvlab.options import EngineOptions, add_engine_args
from kvlab.generate import generate
from kvlab.models.loader import ByteTokenizer
from kvlab.server.views import block_map
from tests.test_engine_parity import (  # noqa: F401
    GREEDY, kv_bytes, prompts, reference, tiny_config, tiny_model)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_stream_deltas_add_up(model):
    batch = prompts((6, 19, 11), seed=8)
    llm = LLM(model, kv_memory=kv_bytes(model, 64, 4), block_size=4, max_num_batched_tokens=8)
    got: dict[str, list[int]] = {}
    finished = {}
    for out in llm.stream(batch, GREEDY):
        got.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert out.ttft_s is not None and out.ttft_s > 0
        if out.finished:
            finished[out.request_id] = out
    assert list(got.values()) == reference(model, batch)
    assert all(o.finish_reason == "length" and o.token_ids == got[i] for i, o in finished.items())


def test_leaving_a_stream_aborts_its_requests(model):
    llm = LLM(model, kv_memory=kv_bytes(model, 64, 4), block_size=4)
    for _ in llm.stream(prompts((8, 9)), GREEDY):
        break
    assert not llm.engine.has_unfinished() and llm.metrics().kv_blocks_used == 0


def test_text_stop_strings_and_eos_match_the_plain_loop():
    model = tiny_model()
    tok = ByteTokenizer(model.spec.vocab_size)
    prompt = "The KV cache"
    plain = generate(model, tok.encode(prompt), GREEDY, tok)
    stop = plain.text[6:8]
    params = SamplingParams(temperature=0, max_tokens=20, stop=(stop,))
    llm = LLM(model, tokenizer=tok, kv_memory=kv_bytes(model, 64, 4), block_size=4)
    out = llm.generate(prompt, params)[0]
    ref = generate(model, tok.encode(prompt), params, tok)
    assert (out.text, out.token_ids, out.finish_reason) == (ref.text, ref.token_ids, "stop")
    model.eos_token_ids = (plain.token_ids[3],)
    out = llm.generate(prompt, GREEDY)[0]
    assert out.finish_reason == "stop" and out.token_ids == plain.token_ids[:4]


def test_errors_at_admission_leave_others_running(model):
    llm = LLM(model, kv_memory=kv_bytes(model, 12, 4), block_size=4, max_model_len=64)
    engine = llm.engine
    ok = engine.add_request(prompts((10,))[0], GREEDY)
    with pytest.raises(ValueError, match="longer than max_model_len 64"):
        engine.add_request(prompts((65,))[0], GREEDY)
    with pytest.raises(ValueError, match="KV blocks of 4 tokens, the whole cache has 12"):
        engine.add_request(prompts((30,))[0], GREEDY)  # 30 + 20 - 1 positions > 48 slots
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.add_request([1, 999], GREEDY)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        engine.add_request("hello", GREEDY)
    final = []
    while engine.has_unfinished():
        final += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in final] == [ok]
    with pytest.raises(ValueError):  # all or nothing: the good prompt is not left queued
        llm.generate([prompts((5,))[0], prompts((65,))[0]], GREEDY)
    assert not engine.has_unfinished()


def test_max_model_len_ends_generation(model):
    llm = LLM(model, kv_memory=kv_bytes(model, 64, 4), block_size=4, max_model_len=20)
    out = llm.generate(prompts((15,))[0], SamplingParams(temperature=0, max_tokens=50))[0]
    assert (len(out.token_ids), out.finish_reason) == (5, "length")


def test_abort_frees_blocks_at_once(model):
    llm = LLM(model, kv_memory=kv_bytes(model, 64, 4), block_size=4)
    engine = llm.engine
    a, b = (engine.add_request(p, GREEDY) for p in prompts((9, 13), seed=9))
    for _ in range(3):
        engine.step()
    held_b = sum(x >= 0 for x in engine.scheduler.requests[b].block_tables[0])
    out = engine.abort_request(a)
    assert out.finished and out.finish_reason == "abort"
    assert engine.metrics().kv_blocks_used == held_b
    engine.abort_request(b)
    m = engine.metrics()
    assert (m.kv_blocks_used, m.running, m.waiting) == (0, 0, 0)


def test_block_map_and_cached_blocks(model):
    llm = LLM(model, kv_memory=kv_bytes(model, 64, 4), block_size=4)
    engine = llm.engine
    shared = prompts((8,), seed=3)[0]
    own = prompts((3, 5), seed=4)
    a = engine.add_request(shared + own[0], GREEDY)
    engine.step()  # a's prompt is computed: its full blocks can be found by b
    b = engine.add_request(shared + own[1], GREEDY)
    engine.step()
    snap = block_map(engine)
    (group,) = snap["groups"]
    assert len(group["blocks"]) == snap["num_blocks"] == 64
    tables = {r["id"]: r["blocks"][0] for r in snap["requests"]}
    assert set(tables) == {a, b}
    for block, letter in enumerate(group["blocks"]):
        owners = sum(block in t for t in tables.values())
        assert letter == ("s" if owners > 1 else "u" if owners else "f")
    assert group["blocks"].count("s") >= 1  # the first 8 tokens' blocks are stored once
    while engine.has_unfinished():
        engine.step()
    m = engine.metrics()
    assert m.kv_blocks_used == 0 and m.kv_blocks_cached == block_map(engine)["groups"][0]["blocks"].count("c") > 0


def test_bad_engine_setups(model):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(model, kv_memory=2**20, max_model_len=10_000)
    with pytest.raises(ValueError, match="buys no block"):
        LLM(model, kv_memory=100)
    for bad in ({"block_size": 0}, {"preemption": "swap"}, {"kv_dtype": "int4"}, {"mem_util": 1.5},
                {"kv_memory": "lots"}):
        with pytest.raises(ValueError):
            EngineOptions(**bad)


def test_options_are_cli_flags_with_the_same_names():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--block-size", "8", "--kv-memory", "2GiB", "--kv-dtype", "fp8_e4m3",
                              "--max-model-len", "1024", "--max-num-seqs", "4",
                              "--max-num-batched-tokens", "64", "--preemption", "swap-disk",
                              "--no-prefix-caching"])
    assert set(vars(args)) == {f.name for f in fields(EngineOptions)}
    assert EngineOptions.from_args(args) == EngineOptions(
        block_size=8, kv_memory="2GiB", kv_dtype="fp8_e4m3", max_model_len=1024, max_num_seqs=4,
        max_num_batched_tokens=64, preemption="swap-disk", prefix_caching=False)
    assert EngineOptions.from_args(parser.parse_args([])) == EngineOptions()
    with pytest.raises(SystemExit):
        parser.parse_args(["--preemption", "swap"])


def test_loads_a_checkpoint_folder_through_the_runtime_loader(tmp_path, model):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    llm = LLM(tmp_path, dtype="fp32", kv_memory=kv_bytes(model, 32, 4), block_size=4)
    out = llm.generate("hello", GREEDY)[0]
    ids = llm.engine.tokenizer.encode("hello")
    assert out.prompt_token_ids == ids
    assert out.token_ids == generate(llm.engine.model, ids, GREEDY).token_ids
    assert out.token_ids == generate(model, ids, GREEDY).token_ids
