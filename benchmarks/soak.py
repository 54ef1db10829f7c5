"""Soak: mixed streaming traffic on a live `kvlab serve` process for a while, per preemption mode.

Clients (streaming and not, shared openings for prefix hits, about one in five leaving
mid-stream) run greedy requests against a cache far too small for them, so the engine preempts
all the time. Measured: the server process's RSS over time (growth after warm-up and its slope),
block leaks (free + cached = total once idle), swap files left in the server's temp directory,
5xx answers and requests past a deadline, every completed output against the plain loop run alone,
and a clean SIGTERM stop (exit status 0). Run from the repository root, one mode after the other:

    nice -n 10 .venv/bin/python -m benchmarks.soak --minutes 10 --preemption swap-ram swap-disk

With ``--deterministic`` the server runs batch-invariant kernels and every completed output is
compared with its solo run in the same mode, in any dtype (bf16 included). ``--plot`` draws RSS
over time. Growth is measured after a warm-up of one minute (a fifth of shorter runs).

With ``--kv-offload-ram BYTES`` / ``--kv-offload-disk BYTES`` the server also runs the prefix
tiers (the disk one in a temporary directory): each must stay within its budget, on disk too, and
serve some prompt tokens.

Prints one JSON object per mode and exits 1 if any mode misses a target (RSS growth >= 5%, a
leaked block, a swap file left, a 5xx, a hang, an output that differs, an unclean stop, a tier
past its budget or never hit).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:  # torch loads only for the comparison, after the traffic
    from kvlab.models.llama import CausalLM
    from kvlab.models.tokenizer import TextTokenizer

REQUEST_DEADLINE_S = 120  # a request still unanswered after this is a hang
OPENINGS = ["It is a truth universally acknowledged, that a single man in possession of a good fortune, "
            "must be in want of a wife. However little known the feelings or views of such a man may be ",
            "My dear Jane, I write to you from the house of our aunt, where the rain has kept us indoors "
            "for three days together, and where ", ""]
WORDS = "the cache holds keys and values of every earlier token so each step computes one".split()


def prompts(n: int, seed: int = 0) -> list[str]:
    """n seeded prompts: a shared opening (prefix-cache hits) and a few words of their own."""
    rng = random.Random(seed)
    return [rng.choice(OPENINGS) + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12))) + f" ({i})"
            for i in range(n)]


@dataclass
class Traffic:
    """What the clients saw."""

    completed: list[tuple[str, int, str]] = field(default_factory=list)  # (prompt, max_tokens, text)
    statuses: Counter[int] = field(default_factory=Counter)
    left: int = 0  # streams the client closed early on purpose
    hangs: int = 0  # requests past REQUEST_DEADLINE_S
    errors: list[str] = field(default_factory=list)  # first few unexpected answers


async def _one(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, stream: bool,
               leave_after: int | None, traffic: Traffic) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if not stream:
        r = await http.post("/v1/completions", json=body)
        traffic.statuses[r.status_code] += 1
        if r.status_code == 200:
            traffic.completed.append((prompt, max_tokens, r.json()["choices"][0]["text"]))
        elif len(traffic.errors) < 5:
            traffic.errors.append(f"{r.status_code} {r.text[:200]}")
        return
    text, chunks, finish = "", 0, None
    async with http.stream("POST", "/v1/completions", json=body) as r:
        traffic.statuses[r.status_code] += 1
        if r.status_code != 200:
            if len(traffic.errors) < 5:
                traffic.errors.append(f"{r.status_code} {(await r.aread())[:200]!r}")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                traffic.errors.append(f"in-band error: {event['error']}")
                return
            choice = event["choices"][0]
            text, finish, chunks = text + choice["text"], choice["finish_reason"] or finish, chunks + 1
            if leave_after is not None and chunks >= leave_after:
                traffic.left += 1
                return  # leaving the block closes the connection mid-stream
    if finish == "length":
        traffic.completed.append((prompt, max_tokens, text))


async def _client(url: str, model: str, pool: list[str], lengths: list[int], until: float, seed: int,
                  traffic: Traffic, max_requests: int | None) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_DEADLINE_S) as http:
        n = 0
        while time.monotonic() < until and (max_requests is None or n < max_requests):
            n += 1
            leave = rng.random() < 0.2
            job = _one(http, model, rng.choice(pool), rng.choice(lengths), stream=leave or rng.random() < 0.75,
                       leave_after=rng.randint(1, 6) if leave else None, traffic=traffic)
            try:
                await asyncio.wait_for(job, REQUEST_DEADLINE_S)
            except (TimeoutError, httpx.TimeoutException):
                traffic.hangs += 1


async def run_traffic(url: str, model: str, seconds: float, clients: int, pool: list[str],
                      lengths: list[int], seed: int = 0, max_requests: int | None = None) -> Traffic:
    """``clients`` concurrent clients, each sending one request after another for ``seconds``
    (and at most ``max_requests`` each)."""
    traffic = Traffic()
    until = time.monotonic() + seconds
    await asyncio.gather(*(_client(url, model, pool, lengths, until, seed * 1000 + i, traffic, max_requests)
                           for i in range(clients)))
    return traffic


def idle_cache(url: str, headers: dict[str, str] | None = None, timeout_s: float = 30) -> dict:
    """/api/cache once no request is left (aborts of closed streams land between two steps)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=30, headers=headers) as http:
        while True:
            cache = http.get("/api/cache").json()
            if not cache["requests"] or time.monotonic() > deadline:
                return cache


def leaked_blocks(cache: dict) -> int:
    """Blocks neither free nor cached once idle (0 when nothing leaked): free + cached = total."""
    return sum(len(g["blocks"]) - g["blocks"].count("f") - g["blocks"].count("c") for g in cache["groups"])


def mismatches(model: CausalLM, tokenizer: TextTokenizer, completed: list[tuple[str, int, str]],
               deterministic: bool = False) -> list[str]:
    """Completed outputs that differ from their run alone: in the plain loop (``kvlab.generate``),
    or in deterministic mode the engine's batch-invariant kernels."""
    from kvlab.engine.llm import LLM
    from kvlab.generate import generate
    from kvlab.sampling import SamplingParams

    solo: dict[tuple[str, int], str] = {}
    bad = []
    engine = LLM(model, tokenizer=tokenizer, deterministic=True) if deterministic else None
    for prompt, max_tokens, text in completed:
        key = (prompt, max_tokens)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        if key not in solo:
            solo[key] = (engine.generate([prompt], params)[0].text if engine is not None
                         else generate(model, tokenizer.encode(prompt), params, tokenizer).text)
        if text != solo[key]:
            bad.append(prompt)
    return bad


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServeProcess:
    """A `kvlab serve` child process on a free loopback port, with its own temp directory (where
    a swap file would be left), started by ``serve_process``."""

    proc: subprocess.Popen
    url: str
    tmpdir: Path
    log: Path

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM, then the exit status (-9 if it had to be killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return -9
        return self.proc.returncode


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, log: Path) -> None:
    """Wait until the server at ``url`` answers /health with 200 (it answers 503 or nothing while
    its model loads); RuntimeError, with the end of its log, if it exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.args[0]} did not start in {timeout_s:.0f} s: see {log}")
        time.sleep(0.2)


@contextmanager
def serve_process(args: list[str], env: dict[str, str] | None = None, start_timeout_s: float = 600) -> Iterator[ServeProcess]:
    """Run `kvlab serve ARGS --port P` until /health answers; stop it (SIGTERM) on the way out."""
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="kvlab-serve-"))
    log = tmp.parent / f"{tmp.name}.log"
    kvlab = Path(sys.executable).with_name("kvlab")
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(kvlab), "serve", *args, "--port", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, "TMPDIR": str(tmp), **(env or {})})
    server = ServeProcess(proc, f"http://127.0.0.1:{port}", tmp, log)
    try:
        wait_healthy(proc, server.url, start_timeout_s, log)
        yield server
    finally:
        server.stop()


def tier_bytes(folder: Path | None) -> int:
    """Bytes of the disk tier's block files (temporary ones included: they count against the disk)."""
    if folder is None:
        return 0
    total = 0
    for p in folder.rglob("*"):
        try:
            total += p.stat().st_size if p.is_file() and p.name != "digests.json" else 0
        except FileNotFoundError:
            pass  # deleted by the tier's LRU while listed
    return total


def soak(mode: str, minutes: float, model: str, dtype: str, kv_memory: str, clients: int, seed: int,
         deterministic: bool = False, offload_ram: str | None = None, offload_disk: str | None = None) -> dict:
    """One mode: start the server, run traffic while sampling RSS (and the disk tier's bytes),
    then check everything."""
    pool, lengths = prompts(48, seed), [16, 32, 64, 96]
    args = [model, "--dtype", dtype, "--threads", "1", "--kv-memory", kv_memory, "--preemption", mode,
            "--max-model-len", "512", "--served-model-name", "soak"] + (["--deterministic"] if deterministic else [])
    tier_dir = Path(tempfile.mkdtemp(prefix="kvlab-soak-tier-")) if offload_disk else None
    if offload_ram:
        args += ["--kv-offload-ram", offload_ram]
    if tier_dir is not None:
        args += ["--kv-offload-dir", str(tier_dir), "--kv-offload-disk", str(offload_disk)]
    disk_samples: list[int] = []
    with serve_process(args) as server:
        pid = server.proc.pid
        samples: list[tuple[float, int]] = []
        t0 = time.monotonic()

        async def sample_rss(stop: asyncio.Event) -> None:
            while not stop.is_set():
                samples.append((time.monotonic() - t0, rss_bytes(pid)))
                disk_samples.append(tier_bytes(tier_dir))
                try:
                    await asyncio.wait_for(stop.wait(), 10)
                except TimeoutError:
                    pass

        async def run() -> Traffic:
            stop = asyncio.Event()
            sampler = asyncio.create_task(sample_rss(stop))
            traffic = await run_traffic(server.url, "soak", minutes * 60, clients, pool, lengths, seed)
            stop.set()
            await sampler
            return traffic

        traffic = asyncio.run(run())
        cache = idle_cache(server.url)
        swap_fd = any("kvlab-swap" in target for target in open_files(pid))
        metrics = httpx.get(f"{server.url}/metrics").text
        status = server.stop()
    disk_samples.append(tier_bytes(tier_dir))  # after the stop: the writes it flushed
    left_files = sorted(str(p.relative_to(server.tmpdir)) for p in server.tmpdir.rglob("kvlab-swap-*"))
    # warm-up (allocator pools, the prefix cache and the host pool fill): one minute, or the
    # first fifth of a shorter run
    warmup_s = min(60.0, minutes * 60 / 5)
    warm = [r for t, r in samples if t >= warmup_s]
    growth = (max(warm[-3:]) - warm[0]) / warm[0] if len(warm) >= 4 else float("nan")
    ts = [t for t, _ in samples if t >= warmup_s]
    slope = _slope(ts, warm) * 60 / 2**20 if len(warm) >= 4 else float("nan")  # MiB per minute
    bad = None
    if dtype == "fp32" or deterministic:
        from kvlab.models import load

        loaded = load(model, dtype)
        bad = mismatches(loaded.model, loaded.tokenizer, traffic.completed, deterministic)
    stats = cache["stats"]
    result = {
        "mode": mode, "minutes": minutes, "model": model, "dtype": dtype, "kv_memory": kv_memory,
        "deterministic": deterministic, "warmup_s": warmup_s,
        "clients": clients, "requests": sum(traffic.statuses.values()), "statuses": dict(traffic.statuses),
        "completed": len(traffic.completed), "left_early": traffic.left, "hangs": traffic.hangs,
        "errors": traffic.errors, "preemptions": stats["preemptions"],
        "swapped_out_blocks": stats["swapped_out_blocks"], "prefix_hits_tokens": stats["prefix_hits_tokens"],
        "rss_mib_after_warmup": round(warm[0] / 2**20, 1) if warm else None,
        "rss_mib_end": round(warm[-1] / 2**20, 1) if warm else None,
        "rss_growth_pct": round(100 * growth, 2), "rss_slope_mib_per_min": round(slope, 3),
        "rss_samples_mib": [round(r / 2**20, 1) for _, r in samples],
        "rss_sample_times_s": [round(t, 1) for t, _ in samples],
        "leaked_blocks": leaked_blocks(cache), "swap_file_open": swap_fd, "files_left": left_files,
        "mismatches": None if bad is None else len(bad), "exit_status": status,
        "swap_fallbacks": _metric(metrics, "kvlab_swap_fallbacks_total"),
        "tiers": stats["tiers"], "tier_hits_tokens": stats["external_hits_tokens"],
        "disk_tier_max_bytes": max(disk_samples, default=0),
    }
    budgets = {t["name"]: t["budget"] for t in stats["tiers"]}
    within = all(t["used"] <= t["budget"] for t in stats["tiers"]) and (
        tier_dir is None or result["disk_tier_max_bytes"] <= budgets["disk"])
    if tier_dir is not None:
        shutil.rmtree(tier_dir, ignore_errors=True)
    result["ok"] = (growth < 0.05 and result["leaked_blocks"] == 0 and not left_files and not bad
                    and traffic.hangs == 0 and not any(s >= 500 for s in traffic.statuses)
                    and not traffic.errors and status == 0 and stats["preemptions"] > 0 and within
                    and (not stats["tiers"] or stats["external_hits_tokens"] > 0))
    return result


def _slope(xs: list[float], ys: list[int]) -> float:
    """Least-squares slope of ys over xs (bytes per second)."""
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def open_files(pid: int) -> list[str]:
    """What a process's open file descriptors point to; one closed while they are listed (the
    server still answers requests then) is skipped."""
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:
            pass
    return targets


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10, help="traffic per mode (default 10)")
    p.add_argument("--preemption", nargs="+", default=["swap-ram", "swap-disk"])
    p.add_argument("--model", default="austen-demo")
    p.add_argument("--dtype", default="fp32",
                   help="fp32 (default) compares every completed output with its solo run; in bf16 or fp16 "
                   "batching changes rounding, so outputs may differ at near-ties and are not compared")
    p.add_argument("--kv-memory", default="512KiB", help="cache size (default 512KiB: constant preemption)")
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deterministic", action="store_true",
                   help="serve with --deterministic and compare every output bitwise with its solo run")
    p.add_argument("--plot", help="write RSS over time (one line per mode) to this PNG")
    p.add_argument("--kv-offload-ram", metavar="BYTES", help="serve with a RAM prefix tier of this size")
    p.add_argument("--kv-offload-disk", metavar="BYTES",
                   help="serve with a disk prefix tier of this budget (in a temporary directory); its "
                   "bytes on disk are sampled with the RSS and must stay within it")
    args = p.parse_args()
    ok = True
    results = []
    for mode in args.preemption:
        result = soak(mode, args.minutes, args.model, args.dtype, args.kv_memory, args.clients, args.seed,
                      args.deterministic, args.kv_offload_ram, args.kv_offload_disk)
        print(json.dumps(result), flush=True)
        results.append(result)
        ok &= result["ok"]
    if args.plot:
        plot_rss(results, args.plot)
    return 0 if ok else 1


def plot_rss(results: list[dict], path: str) -> None:
    """RSS of the server process over time, the warm-up shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        minutes = [t / 60 for t in r["rss_sample_times_s"]]
        ax.plot(minutes, r["rss_samples_mib"],
                label=f"{r['model']} {r['dtype']} {r['mode']}{' deterministic' if r['deterministic'] else ''}"
                      f": {r['rss_growth_pct']:+.1f}% after warm-up")
    if results:
        ax.axvspan(0, results[0]["warmup_s"] / 60, color="0.9", label="warm-up")
    ax.set_xlabel("minutes of traffic")
    ax.set_ylabel("server RSS (MiB)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
