"""`kvlab plan --kv-offload-*`: the tokens each prefix tier holds (checked against the engine's
own tiers, filled), a token's load against its recompute, the crossover prefix, and the disk
rate measured once per device."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvlab import hardware
from kvlab.catalog import load_spec
from kvlab.engine.llm import LLM
from kvlab.engine.tiers import HEADER
from kvlab.layout import tier_tokens
from kvlab.plan import PlanRequest, make_plan
from kvlab.plan.tiers import recompute_seconds
from tests.test_engine_parity import kv_bytes, prompts, tiny_model
from tests.test_tiers import GREEDY


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
def test_a_full_tier_holds_the_tokens_the_planner_says(tmp_path, kv_dtype):
    """Forty prompts through a 12-block pool fill a RAM tier and a disk tier of odd budgets: the
    blocks each holds are exactly ``tier_tokens`` / block_size (int8's scales counted, a disk
    file's header too)."""
    model = tiny_model()
    ram, disk = 9 * 4 * model.spec.kv_bytes_per_token(kv_dtype) + 123, 2**16 + 77
    llm = LLM(model, kv_memory=kv_bytes(model, 12, 4), block_size=4, kv_dtype=kv_dtype,
              kv_offload_ram=ram, kv_offload_dir=str(tmp_path), kv_offload_disk=disk)
    llm.generate(prompts((33,) * 40, seed=11), GREEDY)
    llm.close()
    by_tier = {t.name: t for t in llm.metrics().tiers}
    for name, budget, header in (("ram", ram, 0), ("disk", disk, HEADER.size)):
        held = tier_tokens(model.spec, budget, 4, kv_dtype, header)
        assert by_tier[name].blocks * 4 == held, name
        assert by_tier[name].used <= budget


def plan(**over):
    return make_plan(load_spec("llama-3.1-8b"), PlanRequest(**{"context": 32768, **over}))


def test_the_crossover_is_the_first_whole_block_a_load_beats_recomputing():
    """A slow disk under a fast GPU: loads win only from a long prefix, and from that block on."""
    p = plan(kv_offload_ram=64 * 2**30, kv_offload_disk=2**40, disk_read_rate=7e9)
    spec, h100 = load_spec("llama-3.1-8b"), hardware.get_device("h100-sxm")
    ram, disk = p.prefix_tiers
    assert (ram.tier, disk.tier) == ("ram", "disk")
    assert ram.load_bytes_per_s == 64e9  # H100 SXM's PCIe Gen5 x16, host to device
    assert disk.load_bytes_per_s == pytest.approx(1 / (1 / 7e9 + 1 / 64e9))
    n = disk.crossover_tokens
    assert n and n % 16 == 0 and n > 16

    def beats(tokens: int) -> bool:
        return tokens * disk.load_seconds_per_token <= recompute_seconds(spec, tokens, h100, 1)

    assert beats(n) and not beats(n - 16)
    assert ram.tokens == tier_tokens(spec, 64 * 2**30, 16, "bf16")
    assert disk.tokens == tier_tokens(spec, 2**40, 16, "bf16", HEADER.size)


def test_a_disk_too_slow_for_the_context_never_wins():
    p = plan(context=1024, kv_offload_disk=2**40, disk_read_rate=1e6)  # a 1 MB/s disk
    assert p.prefix_tiers[0].crossover_tokens is None


def test_tp_splits_the_tier_and_the_recompute():
    one, four = plan(kv_offload_ram=2**36), plan(kv_offload_ram=2**36, tp=4)
    assert four.prefix_tiers[0].tokens == 4 * one.prefix_tiers[0].tokens  # each rank: 2 of 8 KV heads
    assert four.recompute_seconds_per_token == pytest.approx(one.recompute_seconds_per_token / 4)


def test_without_tiers_the_plan_has_none():
    p = plan()
    assert p.prefix_tiers == [] and p.recompute_seconds_per_token is None


def test_the_disk_rate_is_measured_once_per_device(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(hardware, "DISK_FILE", tmp_path / "disks.json")
    monkeypatch.setattr(hardware, "sequential_read_rate", lambda d: calls.append(d) or (3e9, 9e9))
    assert hardware.disk_read_rate(tmp_path / "not-yet" / "made") == 3e9
    assert hardware.disk_read_rate(tmp_path) == 3e9 and len(calls) == 1
    assert list(json.loads((tmp_path / "disks.json").read_text()).values()) == [3e9]


def test_the_sequential_read_rate_reads_a_real_file_and_leaves_nothing(tmp_path):
    cold, warm = hardware.sequential_read_rate(tmp_path, 2**20)
    assert cold > 0 and warm > 0 and list(tmp_path.iterdir()) == []


def test_cpu_figures_measured_on_another_cpu_are_measured_again(tmp_path, monkeypatch):
    cache = tmp_path / "cpu.json"
    cache.write_text(json.dumps({"bandwidth": 1.0, "flops": 1.0, "cores": 2, "method": hardware.METHOD,
                                 "cpu": "another CPU"}))
    monkeypatch.setattr(hardware, "CACHE_FILE", cache)
    monkeypatch.setattr(hardware, "_measure_cpu", lambda: {
        "bandwidth": 5.0, "flops": 7.0, "cores": 2, "method": hardware.METHOD, "cpu": hardware.cpu_identity()})
    assert hardware.cpu_device().flops == 7.0
    assert json.loads(cache.read_text())["cpu"] == hardware.cpu_identity()


@pytest.mark.parametrize("flags, said", [
    (["--kv-offload-disk", "1GB"], "--kv-offload-disk needs --kv-offload-dir"),
    (["--disk-read-rate", "2GB"], "--disk-read-rate is the rate of a disk tier"),
])
def test_tier_flags_that_miss_their_partner_say_so_in_one_line(flags, said):
    r = subprocess.run([sys.executable, "-m", "kvlab", "plan", "llama-3.1-8b", *flags],
                       capture_output=True, text=True)
    assert r.returncode == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_plan_prints_the_tiers_table(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvlab", "plan", "llama-3.1-8b", "--kv-offload-ram", "64GiB",
                        "--kv-offload-dir", str(tmp_path), "--disk-read-rate", "7GB", "--json"],
                       capture_output=True, text=True, check=True)
    tiers = json.loads(r.stdout)["prefix_tiers"]
    assert [t["tier"] for t in tiers] == ["ram", "disk"]
    assert tiers[1]["budget_bytes"] == hardware.default_disk_budget(tmp_path)
    r = subprocess.run([sys.executable, "-m", "kvlab", "plan", "llama-3.1-8b", "--kv-offload-ram", "64GiB"],
                       capture_output=True, text=True, check=True)
    assert "Prefix tiers" in r.stdout and "RAM load: host RAM -> NVIDIA H100 SXM 80GB" in r.stdout
