"""Accelerators the planner knows: a datasheet catalogue, and "cpu", this machine measured."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

GPU_FILE = Path(__file__).parent / "catalog" / "gpus.json"
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvlab"  # measurements, built kernels
CACHE_FILE = CACHE_DIR / "cpu.json"


@dataclass(frozen=True)
class Device:
    key: str
    name: str
    memory_bytes: int
    bandwidth: float  # bytes/s
    flops: float  # dense 16-bit FLOP/s (cpu: measured fp32 matmul)
    source: str


def gpu_names() -> list[str]:
    return [k for k in json.loads(GPU_FILE.read_text()) if not k.startswith("_")] + ["cpu"]


def get_device(key: str) -> Device:
    """A catalogue GPU by key (h100-sxm, h200, ...; 'h100' means the SXM part) or 'cpu'."""
    key = key.lower().replace("_", "-")
    key = {"h100": "h100-sxm", "a100": "a100-80gb", "3060": "rtx-3060", "4090": "rtx-4090"}.get(key, key)
    if key == "cpu":
        return cpu_device()
    gpus = json.loads(GPU_FILE.read_text())
    if key not in gpus or key.startswith("_"):
        raise ValueError(f"unknown GPU {key!r}; choose one of {', '.join(gpu_names())}")
    g = gpus[key]
    return Device(key, g["name"], g["memory_bytes"], g["bandwidth"], g["bf16_flops"], g["source"])


def system_memory() -> int:
    """This machine's RAM in bytes: the one reader kvlab uses (planner, engine sizing)."""
    return psutil.virtual_memory().total


def available_memory() -> int:
    """RAM that can be allocated now without swapping (psutil's estimate, like `free`'s)."""
    return psutil.virtual_memory().available


def with_memory(device: Device, memory_bytes: int) -> Device:
    """The same device's bandwidth and FLOP/s with `memory_bytes` of memory (`--gpu-memory`):
    the name says the memory is overridden, so no note names a part the user does not have."""
    return dataclasses.replace(
        device, name=f"{device.name} (memory from --gpu-memory)",
        memory_bytes=memory_bytes,
        source=f"{device.source}; memory overridden by --gpu-memory")


# How the figures were measured: a cache written another way is measured again.
METHOD = "read: torch sum on every core; matmul: numpy"


def _measure_cpu() -> dict:
    """Read bandwidth (torch's sum over 256 MiB on every core, best of 5: one core cannot
    saturate the memory, and llama.cpp's decode reads its weights on every core) and fp32 matmul
    FLOP/s (best of 3)."""
    import numpy as np
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        a = torch.ones(256 * 2**20 // 8, dtype=torch.float64)
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            a.sum()
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    bandwidth = a.numel() * a.element_size() / best
    n = 1024
    m = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        m @ m
        best = min(best, time.perf_counter() - t)
    return {"bandwidth": bandwidth, "flops": 2 * n**3 / best, "cores": os.cpu_count(), "method": METHOD}


def cpu_device() -> Device:
    """This machine: RAM (psutil), bandwidth and FLOP/s measured once and cached."""
    try:
        measured = json.loads(CACHE_FILE.read_text())
        if measured.get("method") != METHOD:
            raise ValueError("measured another way")
    except (OSError, ValueError):
        measured = _measure_cpu()
        try:
            CACHE_FILE.parent.mkdir(parents=True, exist_ok=True)
            CACHE_FILE.write_text(json.dumps(measured))
        except OSError:
            pass  # a read-only home only costs a re-measurement next time
    return Device(
        "cpu", f"this machine ({measured['cores']} cores)", system_memory(), measured["bandwidth"],
        measured["flops"],
        f"RAM from psutil; read bandwidth (torch, every core) and fp32 matmul FLOP/s (numpy) "
        f"measured once (cached in {CACHE_FILE})",
    )
