"""The `kvlab` command: thin argument parsing that calls the modules which do the work."""

from __future__ import annotations

import argparse
import json
import sys


class UsageError(Exception):
    """A mistake in what the user typed: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + error
        raise UsageError(f"{self.prog}: {message}")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _byte_size(text: str) -> int:
    from kvlab.units import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# --- plan / models -----------------------------------------------------------------------------

def cmd_plan(args: argparse.Namespace) -> int:
    from kvlab.catalog import load_spec
    from kvlab.plan import PlanRequest, make_plan

    spec = load_spec(args.model)
    req = PlanRequest(context=args.context, users=args.users, kv_dtype=args.kv_dtype,
                      weights_dtype=args.weights_dtype, gpu=args.gpu, gpus=args.gpus, tp=args.tp,
                      mem_util=args.mem_util, gpu_memory=args.gpu_memory, prompt=args.prompt)
    plan = make_plan(spec, req)
    if args.json:
        print(json.dumps(plan.to_json(), indent=1))
    else:
        from kvlab.render import print_plan

        print_plan(plan)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvlab.catalog import entries, load_spec
    from kvlab.units import fmt_bytes

    rows = []
    for entry in entries().values():
        spec = load_spec(entry.hf_id)
        rows.append({"id": entry.hf_id, "alias": entry.alias, "model_type": spec.model_type,
                     "layers": spec.layer_kinds(), "params": spec.num_params,
                     "kv_bytes_per_token": spec.kv_bytes_per_token()})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    table = Table(title="kvlab catalogue (KV bytes per token at 16-bit)")
    for col in ("alias", "Hugging Face id", "type", "layers", "params", "KV / token"):
        table.add_column(col, justify="right" if col in ("params", "KV / token") else "left")
    for r in rows:
        kinds = ", ".join(f"{n} {k}" for k, n in r["layers"].items())
        table.add_row(r["alias"], r["id"], r["model_type"], kinds, f"{r['params'] / 1e9:,.2f} B",
                      fmt_bytes(r["kv_bytes_per_token"]))
    Console().print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvlab", description="Plan, run, measure and see the KV cache.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("plan", help="KV-cache memory, capacity and speed bounds for a model")
    p.add_argument("model", help="catalogue name (llama-3.1-70b, Qwen/Qwen2.5-7B), config.json or checkpoint folder")
    p.add_argument("--context", type=_positive_int, default=8192, help="tokens per sequence (default 8192)")
    p.add_argument("--users", type=_positive_int, default=1, help="concurrent sequences (default 1)")
    p.add_argument("--kv-dtype", default="bf16", help="fp32, bf16, fp16, fp8_e4m3, fp8_e5m2, int8, int4")
    p.add_argument("--weights-dtype", default="bf16", help="fp32, bf16, fp16, fp8, int8, int4")
    p.add_argument("--gpu", default="h100-sxm", help="h100-sxm, h100-pcie, h200, a100-40gb, a100-80gb, l4, "
                   "l40s, rtx-3060, rtx-4090, mi300x, b200, or cpu (this machine)")
    p.add_argument("--gpus", type=_positive_int, help="GPUs in the deployment (default: --tp, else 1)")
    p.add_argument("--tp", type=_positive_int, help="tensor-parallel size (default: --gpus)")
    p.add_argument("--mem-util", type=float, default=0.9, help="fraction of GPU memory to use (default 0.9)")
    p.add_argument("--gpu-memory", type=_byte_size, help="override the GPU's memory, e.g. 12.49GB")
    p.add_argument("--prompt", type=_positive_int, default=128, help="prompt length for the cache/no-cache work table")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("models", help="list the built-in model catalogue")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    from kvlab.spec import ConfigError

    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    except (ConfigError, ValueError, OSError) as e:
        print(f"kvlab: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
