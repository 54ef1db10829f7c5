"""The prefix tiers behind the pool (kvlab.engine.tiers): budgets, what a restart reads back,
files that must never be read (corrupt, truncated, foreign, half-written), a disk that refuses
writes; then through the engine, tokens after a tier hit against a cold run."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from kvlab.engine.block_pool import hash_block
from kvlab.engine.llm import LLM
from kvlab.engine.tiers import HEADER, SUFFIX, DiskTier, RamTier, fingerprint, tier_key
from kvlab.sampling import SamplingParams
from tests.test_engine_parity import kv_bytes, prompts, reference, tiny_model

FP = fingerprint({"test": 1})
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def block(seed: int, size: int = 1000) -> torch.Tensor:
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def key(i: int) -> bytes:
    return tier_key(0, i.to_bytes(16, "little"))


def files(root: Path) -> list[Path]:
    return sorted(root.rglob("*" + SUFFIX))


@settings(max_examples=200, deadline=None)
@given(budget=st.integers(0, 5000), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 9),
                                                             st.integers(1, 3000)), max_size=40))
def test_ram_tier_keeps_its_budget_and_its_keys(budget, ops):
    tier, written = RamTier(budget), {}
    for put, i, size in ops:
        if put:
            data, held = block(i, size), key(i) in tier
            tier.put(key(i), data)
            if not held and key(i) in tier:  # a held key keeps its first bytes
                written[i] = data
        else:
            got = tier.get(key(i))
            assert got is None or torch.equal(got, written[i])
        assert tier.stats.used == sum(t.numel() for t in tier.entries.values()) <= budget


def test_disk_tier_survives_a_restart_within_its_budget(tmp_path):
    budget = 5 * (HEADER.size + 1000)
    tier = DiskTier(tmp_path, budget, FP)
    for i in range(8):
        tier.write_behind(key(i), block(i))
    tier.close()
    on_disk = files(tmp_path)
    assert len(on_disk) == 5 and sum(p.stat().st_size for p in on_disk) <= budget
    again = DiskTier(tmp_path, budget, FP)  # a new process on the same directory
    assert [i for i in range(8) if key(i) in again] == [3, 4, 5, 6, 7]  # the oldest made room
    assert all(torch.equal(again.read(key(i)), block(i)) for i in range(3, 8))
    assert again.read(key(0)) is None and again.stats.misses == 1 and again.stats.hits == 5
    other = DiskTier(tmp_path, budget, fingerprint({"test": 2}))  # another model, same directory
    assert all(key(i) not in other and other.read(key(i)) is None for i in range(8))
    other.write_behind(key(9), block(9))
    other.close()  # its file counts in the directory's budget: the least recent goes
    assert sum(p.stat().st_size for p in files(tmp_path)) <= budget
    again.close()


@pytest.mark.parametrize("damage", ["flip-a-byte", "truncate", "foreign", "wrong-key", "empty"])
def test_a_damaged_file_is_a_miss_and_is_deleted(tmp_path, damage, caplog):
    tier = DiskTier(tmp_path, 10**6, FP)
    tier.write_behind(key(1), block(1))
    tier.write_behind(key(2), block(2))
    tier.flush()
    path, donor = tier.path(key(1)), tier.path(key(2))
    raw = bytearray(path.read_bytes())
    if damage == "flip-a-byte":
        raw[-10] ^= 0x40
    elif damage == "truncate":
        raw = raw[:-1]
    elif damage == "foreign":  # a block of another fingerprint under this name
        foreign = DiskTier(tmp_path / "elsewhere", 10**6, fingerprint({"test": 2}))
        foreign.write_behind(key(1), block(1))
        foreign.close()
        raw = bytearray(foreign.path(key(1)).read_bytes())
    elif damage == "wrong-key":
        raw = bytearray(donor.read_bytes())
    else:
        raw = bytearray()
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, "kvlab.engine"):
        assert tier.read(key(1)) is None
    assert not path.exists() and tier.stats.bad == 1 and "a miss" in caplog.text
    assert key(1) not in tier  # missing from now on, so a look-up cannot ask again
    assert torch.equal(tier.read(key(2)), block(2))  # the others are untouched
    tier.close()


def test_a_writer_killed_before_its_rename_leaves_nothing_read(tmp_path):
    """kill -9 between writing a block and renaming it into place: the reader sees no block."""
    child = textwrap.dedent(f"""
        import os, sys, time, torch
        from pathlib import Path
        from kvlab.engine import tiers
        def stall(src, dst):
            print("written", flush=True)
            time.sleep(60)
        os.replace = stall
        tier = tiers.DiskTier(Path({str(tmp_path)!r}), 10**6, {FP!r})
        tier.write_behind(tiers.tier_key(0, bytes(16)), torch.ones(5000, dtype=torch.uint8))
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    assert proc.stdout.readline().strip() == "written"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list(tmp_path.rglob("*.tmp")) and not files(tmp_path)  # the whole payload, unrenamed
    reader = DiskTier(tmp_path, 10**6, FP)
    assert tier_key(0, bytes(16)) not in reader and reader.read(tier_key(0, bytes(16))) is None
    assert reader.stats.blocks == 0 and reader.stats.bad == 0
    reader.close()


@pytest.mark.parametrize("fault", [errno.ENOSPC, errno.EACCES, errno.EROFS],
                         ids=["disk-full", "permission-lost", "read-only"])
def test_a_disk_that_refuses_writes_stops_writing_and_keeps_serving(tmp_path, fault, caplog):
    tier = DiskTier(tmp_path, 10**6, FP)
    tier.write_behind(key(1), block(1))
    tier.flush()

    def refuse(path, header, payload):
        raise OSError(fault, os.strerror(fault))
    tier._write_file = refuse  # the file system fails from here on
    with caplog.at_level(logging.WARNING, "kvlab.engine"):
        for i in range(2, 6):
            tier.write_behind(key(i), block(i))
        tier.flush()
    assert not tier.stats.writable and caplog.text.count("writes no more") == 1
    assert not list(tmp_path.rglob("*.tmp"))
    assert torch.equal(tier.read(key(1)), block(1)) and key(2) not in tier
    tier.close()


def test_a_directory_that_cannot_be_made_leaves_the_tier_off(tmp_path, caplog):
    (tmp_path / "file").write_text("not a directory")
    with caplog.at_level(logging.WARNING, "kvlab.engine"):
        tier = DiskTier(tmp_path / "file" / "kv", 10**6, FP)
    tier.write_behind(key(1), block(1))
    tier.close()
    assert not tier.stats.writable and key(1) not in tier and "cannot write" in caplog.text


# --- through the engine -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama():
    return tiny_model()


def run(llm: LLM, batch):
    outs = llm.generate(batch, GREEDY)
    return [o.token_ids for o in outs], outs


def test_blocks_that_leave_the_pool_come_back_from_ram_bitwise(llama):
    """A pool of 12 blocks cycles through ten prompts; the first prompt then comes back from the
    RAM tier: the loaded blocks hold exactly the bytes that left, and the tokens are the cold run's."""
    batch = prompts((33,) * 10, seed=7)
    llm = LLM(llama, kv_memory=kv_bytes(llama, 12, 4), block_size=4, kv_offload_ram=2**24)
    cold, _ = run(llm, batch)
    assert cold == reference(llama, batch, GREEDY)
    tier = llm.engine.tiers.ram
    left = {k: v.clone() for k, v in tier.entries.items()}
    assert left and llm.metrics().tiers[0].stored == len(left)
    again, outs = run(llm, batch[:1])
    assert again == cold[:1] and outs[0].tier_tokens == {"ram": 32} and outs[0].num_cached_tokens == 32
    pool, cache, parent = llm.engine.kv.pools[0], llm.engine.cache, None
    for i in range(8):  # the eight blocks that came back hold the bytes that left, bit for bit
        parent = hash_block(parent, batch[0][4 * i:4 * i + 4])
        assert torch.equal(cache.block_bytes(0, [pool.lookup(parent)])[0], left[tier_key(0, parent)])
    m = llm.metrics()
    assert m.tiers[0].hits == 8 and m.tiers[0].used <= 2**24 and m.kv_blocks_used == 0


@pytest.mark.parametrize("options", [
    pytest.param({}, id="fp32"),
    pytest.param({"kv_dtype": "int8"}, id="int8-with-scales"),
    pytest.param({"kv_dtype": "fp8_e4m3"}, id="fp8"),
    pytest.param({"max_num_batched_tokens": 7}, id="chunked-prefill"),
    pytest.param({"hybrid": True}, id="sliding-and-full-groups"),
])
def test_a_restart_reads_the_prompts_back_from_disk_with_the_same_tokens(tmp_path, options):
    """Two engines one after the other (a restart) on one --kv-offload-dir, deterministic: the
    second serves the prompts from disk (and its own pool, once loaded), token for token as cold."""
    options = dict(options)
    model = (tiny_model(num_hidden_layers=3, sliding_window=6, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention"]) if options.pop("hybrid", False)
        else tiny_model())
    batch = prompts((29, 21), seed=3)
    engine = dict(kv_memory=kv_bytes(model, 40, 4), block_size=4, deterministic=True,
                  kv_offload_dir=str(tmp_path), **options)
    first = LLM(model, **engine)
    cold, outs = run(first, batch)
    assert all(not o.tier_tokens for o in outs)
    first.close()
    second = LLM(model, **engine)
    warm, outs = run(second, batch)
    assert warm == cold
    assert [o.tier_tokens.get("disk", 0) for o in outs] == [28, 20]  # all but the last block
    m = second.metrics()
    assert m.tier_hits == 48 and m.tiers[0].bad == 0 and m.kv_blocks_used == 0
    second.close()
    other = LLM(tiny_model(), **{**engine, "kv_offload_dir": str(tmp_path), "block_size": 8})
    _, outs = run(other, batch)  # another block size: another fingerprint, nothing read
    assert all(not o.tier_tokens for o in outs)
    other.close()


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_ranks_keep_one_tier_entry_per_block(tmp_path, llama, tp):
    """At --tp N (2: the KV heads split, 4: each replicated on 2 ranks) a tier entry is every
    rank's shard of the block side by side: a restart at the same N reads the prompts back from
    disk bitwise, with the tokens of its cold run and of --tp 1; --tp 1 reads none of it."""
    batch = prompts((29, 21), seed=3)
    engine = dict(kv_memory=kv_bytes(llama, 40, 4), block_size=4, kv_offload_dir=str(tmp_path))
    first = LLM(llama, tp=tp, **engine)
    cold, _ = run(first, batch)
    pool, parent, hashes = first.engine.kv.pools[0], None, []
    for i in range(7):  # the first prompt's full blocks
        parent = hash_block(parent, batch[0][4 * i:4 * i + 4])
        hashes.append(parent)
    left = first.engine.executor.block_bytes(0, [pool.lookup(h) for h in hashes])
    first.close()
    assert cold == reference(llama, batch, GREEDY)
    second = LLM(llama, tp=tp, **engine)
    warm, outs = run(second, batch)
    assert warm == cold and [o.tier_tokens.get("disk", 0) for o in outs] == [28, 20]
    pool = second.engine.kv.pools[0]
    assert torch.equal(second.engine.executor.block_bytes(0, [pool.lookup(h) for h in hashes]), left)
    assert second.metrics().kv_blocks_used == 0
    second.close()
    one = LLM(llama, **engine)  # tp 1: its blocks are laid out otherwise, another fingerprint
    tokens, outs = run(one, batch)
    assert tokens == cold and all(not o.tier_tokens for o in outs)
    one.close()


def test_the_tier_options_say_what_they_need():
    for bad, said in [({"kv_offload_disk": 2**20}, "give the directory"),
                      ({"kv_offload_ram": 2**20, "prefix_caching": False}, "drop --no-prefix-caching"),
                      ({"kv_offload_ram": 0}, "positive integer")]:
        with pytest.raises(ValueError, match=said):
            LLM(tiny_model(), **bad)


def test_generate_twice_in_two_processes_shares_the_prefill_from_disk(tmp_path):
    """The bundled model, two processes, one --kv-offload-dir: the second reads the prompt from
    disk and answers with the same tokens."""
    prompt = "The KV cache " * 40
    cmd = [sys.executable, "-m", "kvlab", "generate", prompt, "--max-tokens", "6", "--json",
           "--kv-offload-dir", str(tmp_path / "kv")]
    import json
    first = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    second = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    assert first["prompt_tokens_from"]["disk"] == 0
    assert second["prompt_tokens_from"]["disk"] >= first["prompt_tokens"] - 16
    assert second["token_ids"] == first["token_ids"]


def test_the_server_serves_from_the_tiers_and_counts_them(tmp_path):
    """`kvlab serve --kv-offload-ram ... --kv-offload-dir ...`: a prompt that left a small pool
    comes back from RAM, after a restart from disk, with the same text; /metrics counts both."""
    import httpx

    from tests.test_server_fixtures import MODEL_ID, LiveServer, tiny_bridge

    def metric(text: str, name: str) -> float:
        return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name)))

    def ask(live: LiveServer, prompt: str) -> str:
        res = httpx.post(f"{live.url}/v1/completions", timeout=60, json={
            "model": MODEL_ID, "prompt": prompt, "max_tokens": 5, "temperature": 0})
        assert res.status_code == 200
        return res.json()["choices"][0]["text"]

    tiers = dict(kv_memory=12 * 8 * 512, kv_offload_ram=2**22, kv_offload_dir=str(tmp_path / "kv"),
                 deterministic=True)
    prompts_ = [f"{i} the cache holds every key " * 6 for i in range(6)]
    live = LiveServer(tiny_bridge(tmp_path, **tiers))
    try:
        cold = [ask(live, p) for p in prompts_]  # each pushes the one before out of the 12 blocks
        assert ask(live, prompts_[0]) == cold[0]
        text = httpx.get(f"{live.url}/metrics", timeout=10).text
        assert metric(text, 'kvlab_kv_offload_hits_blocks_total{tier="ram"}') > 0
        assert metric(text, "kvlab_external_prefix_cache_hits_total") > 0
        assert metric(text, 'kvlab_kv_offload_used_bytes{tier="ram"}') <= 2**22
    finally:
        live.stop()
    live = LiveServer(tiny_bridge(tmp_path, **tiers))  # a restart: the pool and RAM are empty
    try:
        assert ask(live, prompts_[1]) == cold[1]
        text = httpx.get(f"{live.url}/metrics", timeout=10).text
        assert metric(text, 'kvlab_kv_offload_hits_blocks_total{tier="disk"}') > 0
        assert metric(text, 'kvlab_kv_offload_bad_files_total{tier="disk"}') == 0
    finally:
        live.stop()


def test_read_buffers_are_reused_only_when_given_back(tmp_path):
    tier = DiskTier(tmp_path, 10**6, FP)
    for i in range(3):
        tier.write_behind(key(i), block(i))
    tier.flush()
    first = tier.read_many([key(0), key(1)])
    stranger = block(7)
    tier.recycle([*first, stranger])  # a tensor it did not lend is not taken
    again = tier.read_many([key(2), key(0)])
    assert {id(t) for t in again} == {id(t) for t in first}  # the same pages, filled again
    assert torch.equal(again[0], block(2)) and torch.equal(again[1], block(0))
    assert torch.equal(stranger, block(7)) and torch.equal(tier.read(key(1)), block(1))
    tier.close()
