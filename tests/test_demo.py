"""`kvlab demo`: the main job preempts, hits the prefix cache, and agrees with the plan."""

import torch

from kvlab.cli import main
from kvlab.demo import QUESTIONS, conversations, run_demo
from kvlab.generate import generate
from kvlab.models import load
from kvlab.sampling import SamplingParams
from tests.test_generate import byte_bpe
from tests.test_models import make_checkpoint


def _checkpoint(tmp_path):
    folder = make_checkpoint(tmp_path, "llama", max_position_embeddings=512)
    byte_bpe().save(str(folder / "tokenizer.json"))
    return folder


def test_demo_preempts_hits_and_matches_the_plan(tmp_path):
    folder = _checkpoint(tmp_path)
    report = run_demo(str(folder), max_tokens=40)
    m, p = report.metrics, report.predicted
    assert (m["kv_cache_blocks"], m["kv_cache_tokens"]) == (p["kv_cache_blocks"], p["kv_cache_tokens"])
    assert m["max_concurrency"] == p["max_concurrency"] < len(QUESTIONS)
    assert m["preemptions"] > 0 and m["swapped_out_blocks"] > 0
    assert m["prefix_cache_hits"] > 0
    # preemption and swaps never change greedy output: compare with the plain loop
    loaded = load(folder)
    for ids, (_, text) in zip(conversations(loaded)[:2], report.texts):
        ref = generate(loaded.model, ids, SamplingParams(temperature=0.0, max_tokens=40), loaded.tokenizer)
        assert text == ref.text


def test_cli_demo_prints_texts_and_report(tmp_path, capsys):
    assert main(["demo", str(_checkpoint(tmp_path)), "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "Cache report" in out and "preemptions" in out
    assert all(q in out for q in QUESTIONS)
