"""The prefix tiers behind the pool (``--kv-offload-ram``, ``--kv-offload-dir``), planned: the
prefix tokens each tier holds, what loading a token from it costs against recomputing it, and the
prefix length from which a load beats the prefill it replaces.

A hit skips the prefix's prefill, which is compute-bound: recomputing L tokens takes at least
``forward_flops(0, L)`` / peak FLOP/s. A load moves the same L tokens' K/V bytes, at the slowest
rate on their way into the pool. Per token the load is constant while the prefill grows with the
keys each token attends to, so once a load wins it keeps winning for longer prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.dtypes import StorageDtype
from kvlab.hardware import Device
from kvlab.layout import TIER_FILE_HEADER, layer_groups, tier_tokens
from kvlab.plan.speed import first_reached, forward_flops
from kvlab.spec import ModelSpec


@dataclass(frozen=True)
class TierPlan:
    tier: str  # "ram" or "disk"
    budget_bytes: int
    tokens: int  # prefix tokens it holds: whole blocks of every layer group
    load_bytes_per_s: float  # the slowest stage a loaded block passes
    load_path: str  # those stages, for the reader
    load_seconds_per_token: float
    crossover_tokens: int | None  # shortest prefix (whole blocks) a load beats recomputing; None: not within the context searched


def ram_load(device: Device) -> tuple[float, str]:
    """(bytes/s, how) a block comes from host RAM into the pool: over the host link into a GPU;
    on the CPU, a copy that reads and writes every byte at the measured read bandwidth."""
    if device.host_bandwidth is not None:
        return device.host_bandwidth, f"host RAM -> {device.name} over its host link"
    return device.bandwidth / 2, "a copy in RAM: each byte read and written at the measured bandwidth"


def disk_load(device: Device, disk_rate: float) -> tuple[float, str]:
    """(bytes/s, how) a block comes from the disk: read into host memory, then on into the pool."""
    ram_rate, _ = ram_load(device)
    into = "over the host link" if device.host_bandwidth is not None else "copied into the pool"
    return 1 / (1 / disk_rate + 1 / ram_rate), f"disk at {disk_rate / 1e9:,.2f} GB/s, then {into}"


def recompute_seconds(spec: ModelSpec, tokens: int, device: Device, tp: int) -> float:
    """The compute-bound prefill of a ``tokens``-token prefix on each of ``tp`` GPUs (no LM head:
    the prompt's last position is computed either way)."""
    return forward_flops(spec, 0, tokens, lm_head_tokens=0) / (device.flops * tp)


def plan_tier(spec: ModelSpec, tier: str, budget: int, rate_and_path: tuple[float, str], kvd: StorageDtype,
              block_size: int, device: Device, tp: int, longest: int) -> TierPlan:
    """One tier's figures on each of ``tp`` ranks; the crossover searched up to ``longest`` tokens."""
    rate, path = rate_and_path
    shard = spec.tp_shard(tp)
    header = TIER_FILE_HEADER.size if tier == "disk" else 0  # a disk file per layer group's block
    per_token = shard.kv_bytes_per_token(kvd) + len(layer_groups(spec)) * header / block_size
    load = per_token / rate

    def wins(blocks: int) -> bool:
        n = blocks * block_size
        return n * load <= recompute_seconds(spec, n, device, tp)

    blocks = first_reached(wins, limit=max(1, longest // block_size))
    return TierPlan(tier=tier, budget_bytes=budget, tokens=tier_tokens(shard, budget, block_size, kvd.name, header),
                    load_bytes_per_s=rate, load_path=path, load_seconds_per_token=load,
                    crossover_tokens=blocks * block_size if blocks else None)
