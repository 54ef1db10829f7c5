"""`kvlab demo`: the main job preempts, hits the prefix cache, agrees with the plan, and tells it."""

import json
import re

from kvlab.cli import main
from kvlab.demo import QUESTIONS, SYSTEM, conversations, run_demo
from kvlab.generate import generate
from kvlab.models import load
from kvlab.sampling import SamplingParams
from tests.test_generate import byte_bpe
from tests.test_models import make_checkpoint


def _checkpoint(tmp_path):
    folder = make_checkpoint(tmp_path, "llama", max_position_embeddings=512)
    byte_bpe().save(str(folder / "tokenizer.json"))
    return folder


def test_demo_preempts_hits_and_matches_the_plan(tmp_path, capsys):
    folder = _checkpoint(tmp_path)
    calls = []
    report = run_demo(str(folder), max_tokens=40, progress=lambda *a: calls.append(a))
    done = [d for d, _, _ in calls]
    assert done == sorted(done) and done[0] == 0 and done[-1] == calls[0][1] == 40 * len(QUESTIONS)
    m, p = report.metrics, report.predicted
    assert (m["kv_cache_blocks"], m["kv_cache_tokens"]) == (p["kv_cache_blocks"], p["kv_cache_tokens"])
    assert m["max_concurrency"] == p["max_concurrency"] < len(QUESTIONS)
    assert m["kv_bytes_per_token"] == p["kv_bytes_per_token"]
    assert m["preemptions"] > 0 and m["swapped_out_blocks"] > 0
    # the story's figures add up to the engine's counters
    chats = report.chats
    assert sum(c.cached_tokens for c in chats) == m["prefix_cache_hits"] > 0
    assert chats[0].cached_tokens == 0 and report.shared_tokens > 16
    assert all(c.cached_tokens <= report.shared_tokens // 16 * 16 for c in chats)
    left = [mv for mv in report.moves if mv.left]
    assert len(left) == m["preemptions"] == sum(c.preemptions for c in chats)
    assert all(mv.how == "swapped out to RAM" and mv.blocks > 0 and "admitted last" in mv.why for mv in left)
    back = [mv for mv in report.moves if not mv.left]
    assert sorted(mv.chat for mv in back) == sorted(mv.chat for mv in left)  # every one came back
    finished = {str(i + 1) for i, c in enumerate(chats)}
    assert all(mv.why.endswith("finished and freed blocks") and set(re.findall(r"\d+", mv.why)) <= finished
               or mv.why.startswith("enough blocks") for mv in back)
    assert sum(mv.blocks for mv in left) == m["swapped_out_blocks"]
    # the plan command it prints predicts exactly these figures
    assert main([*report.plan_command.split()[1:], "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["kv_cache_blocks"], plan["max_concurrency"]) == (p["kv_cache_blocks"], p["max_concurrency"])
    # preemption and swaps never change greedy output: compare with the plain loop
    loaded = load(folder)
    for ids, chat in zip(conversations(loaded)[:2], chats):
        ref = generate(loaded.model, ids, SamplingParams(temperature=0.0, max_tokens=40), loaded.tokenizer)
        assert chat.answer == ref.text


def test_demo_by_recompute_says_so(tmp_path):
    report = run_demo(str(_checkpoint(tmp_path)), max_tokens=40, preemption="recompute")
    assert report.metrics["preemptions"] > 0 and report.metrics["swapped_out_blocks"] == 0
    assert {mv.how for mv in report.moves} == {"dropped, to recompute", "recomputed"}
    # the swap space does not come into it
    assert all("admitted last" in mv.why and "swap space" not in mv.why for mv in report.moves if mv.left)


def test_cli_demo_tells_the_story(tmp_path, capsys):
    folder = _checkpoint(tmp_path)
    assert main(["demo", str(folder), "--max-tokens", "24"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # as read, whatever the terminal's width
    for heading in ("1. What was asked", "2. What was reused", "3. What had to leave and come back",
                    "4. The cache beside the plan"):
        assert heading in out
    assert SYSTEM in out and all(q in out for q in QUESTIONS)
    assert "preempts" in out and "swapped out" in out and "recompute" in out
    # the run says what it ran: dtype, mode, the swap space, and why each chat left
    assert f"model dtype: {load(folder).dtype}" in out
    assert "mode: deterministic (auto: " in out or "mode: fast kernels (auto: " in out
    assert "This run used swap-ram, a swap space of" in out and "it was admitted last" in out
    assert "KV bytes per token" in out and "engine (measured)" in out and "kvlab plan (predicted)" in out
    assert "B/token" not in out  # one unit per row, both columns
