"""Accelerators the planner knows: a datasheet catalogue, and "cpu", this machine measured."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
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
    flops: float  # dense 16-bit FLOP/s (cpu: measured fp32 matmul; with_flops: kvlab's own kernel)
    source: str
    host_bandwidth: float | None = None  # host RAM -> device bytes/s (None: the device is the host)


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
    return Device(key, g["name"], g["memory_bytes"], g["bandwidth"], g["bf16_flops"],
                  f"{g['source']}; {g['host_source']}", g["host_bandwidth"])


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


def with_flops(device: Device, flops: float, source: str) -> Device:
    """The same device computing at ``flops`` FLOP/s, measured as ``source`` says (kvlab's own
    kernel in an activations mode, in place of the generic matmul probe)."""
    return dataclasses.replace(device, flops=flops, source=f"{device.source}; FLOP/s: {source}")


# How the figures were measured: a cache written another way is measured again.
METHOD = "read: torch sum on every core; matmul: numpy"


def cpu_identity() -> str:
    """This CPU's model name, core count and a hash of its flags: the figures cached for one CPU
    are measured again on another (a machine's CPU may change under the same home directory)."""
    import hashlib
    import platform

    name, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value.strip()
    except OSError:
        pass
    return f"{name or platform.processor()}, {os.cpu_count()} cores, flags {hashlib.sha256(flags.encode()).hexdigest()[:12]}"


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
    return {"bandwidth": bandwidth, "flops": 2 * n**3 / best, "cores": os.cpu_count(), "method": METHOD,
            "cpu": cpu_identity()}


def cpu_device() -> Device:
    """This machine: RAM (psutil), bandwidth and FLOP/s measured once and cached."""
    try:
        measured = json.loads(CACHE_FILE.read_text())
        if measured.get("method") != METHOD or measured.get("cpu") != cpu_identity():
            raise ValueError("measured another way, or on another CPU")
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


# --- the disk a prefix tier lives on ----------------------------------------------------------

DISK_FILE = CACHE_DIR / "disks.json"
DISK_PROBE_BYTES = 64 * 2**20  # long enough for the device's sequential rate, short to write
DEFAULT_DISK_FRACTION = 0.5  # --kv-offload-dir alone: half the file system's free space...
DEFAULT_DISK_MAX = 10 * 2**30  # ...up to 10 GiB


def _existing(directory: Path) -> Path:
    """The directory, or its nearest existing parent (a tier's directory is made on first use)."""
    probe = Path(directory)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def default_disk_budget(directory: Path) -> int:
    """``--kv-offload-dir`` without ``--kv-offload-disk``: half the free space, at most 10 GiB."""
    try:
        st = os.statvfs(_existing(directory))
    except OSError:
        return DEFAULT_DISK_MAX
    return int(min(DEFAULT_DISK_MAX, st.f_bavail * st.f_frsize * DEFAULT_DISK_FRACTION))


def drop_page_cache(paths: list[Path]) -> None:
    """Evict these files' pages (clean pages go, so the next read comes from the device)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential_read_rate(directory: Path, nbytes: int = DISK_PROBE_BYTES) -> tuple[float, float]:
    """(from the device, page-cached) bytes/s reading a file of ``nbytes`` written in
    ``directory``, in 1 MiB reads; the first read follows a page-cache drop of the file."""
    path = Path(directory) / f".kvlab-read-probe.{os.getpid()}"
    try:
        with open(path, "wb") as f:
            f.write(os.urandom(nbytes))
        drop_page_cache([path])
        rates = []
        for _ in range(2):
            start = time.perf_counter()
            with open(path, "rb", buffering=0) as f:
                while f.read(1 << 20):
                    pass
            rates.append(nbytes / (time.perf_counter() - start))
    finally:
        path.unlink(missing_ok=True)
    return rates[0], rates[1]


def disk_read_rate(directory: Path) -> float:
    """Sequential read rate from the device that holds ``directory``, in bytes/s: measured once
    per device of this machine (``sequential_read_rate``) and cached in DISK_FILE."""
    where = _existing(directory)
    return _measured_once(DISK_FILE, f"{cpu_identity()}, device {os.stat(where).st_dev}",
                          lambda: sequential_read_rate(where)[0])


# --- kvlab's own kernels ----------------------------------------------------------------------

KERNEL_FILE = CACHE_DIR / "kernels.json"


def kernel_flops(mode: str, measure: Callable[[], float]) -> float:
    """FLOP/s of kvlab's linear kernel on this CPU in activations ``mode``: ``measure()`` (which
    runs the kernel: ``kvlab.bench.kernel_peak``, from a layer above this one) once per CPU,
    mode and kvlab switch setting, cached in KERNEL_FILE. Torch's thread count follows
    OMP_NUM_THREADS, which the key holds too."""
    env = ",".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                   if k.startswith("KVLAB_") or k == "OMP_NUM_THREADS")
    return _measured_once(KERNEL_FILE, f"{cpu_identity()}, {mode}, {env}", measure)


def _measured_once(path: Path, key: str, measure: Callable[[], float]) -> float:
    """``measure()`` the first time ``key`` is asked for, then the figure cached in the JSON
    file ``path`` (a read-only home only costs a re-measurement next time)."""
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        known[key] = measure()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(known))
        except OSError:
            pass
    return float(known[key])
