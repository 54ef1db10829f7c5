"""`kvlab serve`: its flags, and loading the model into an engine behind the app.

Flag parsing imports nothing heavy (so `kvlab --help` stays fast); torch, the model and uvicorn
load only when the command runs. The server binds to 127.0.0.1 unless --host says otherwise: it
runs arbitrary prompts on this machine and has no key unless --api-key sets one.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from kvlab.engine.options import EngineOptions, add_engine_args

if TYPE_CHECKING:  # keep torch out of flag parsing
    from kvlab.server.bridge import EngineBridge


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="GGUF file, checkpoint folder or bundled name (default: smollm2-135m), or "
                   "with --random-weights a catalogue name or config.json")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: the folder name)")
    p.add_argument("--dtype", default="bf16", help="fp32, bf16 (default) or fp16")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, or auto")
    p.add_argument("--random-weights", action="store_true", help="random weights from the config (seeded)")
    p.add_argument("--seed", type=int, default=0, help="seed for --random-weights")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 is fastest for tiny models on a busy machine)")
    add_engine_args(p)


def build_bridge(model: str | Path | None, options: EngineOptions | None = None, *, dtype: str = "bf16",
                 device: str = "cpu", random_weights: bool = False, seed: int = 0,
                 served_model_name: str | None = None) -> EngineBridge:
    """Load the model, allocate the paged cache, and wrap the engine for the app."""
    from kvlab.engine.llm import LLM
    from kvlab.models import load
    from kvlab.server.bridge import EngineBridge

    loaded = load(model, dtype, device=device, random_weights=random_weights, seed=seed)
    llm = LLM(loaded.model, tokenizer=loaded.tokenizer, **asdict(options or EngineOptions()))
    return EngineBridge(llm.engine, served_model_name or loaded.model.name, loaded.chat_template)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvlab.server.app import create_app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    bridge = build_bridge(args.model, EngineOptions.from_args(args), dtype=args.dtype, device=args.device,
                          random_weights=args.random_weights, seed=args.seed,
                          served_model_name=args.served_model_name)
    print(f"kvlab: serving {bridge.model_id} on http://{args.host}:{args.port}/ "
          f"(OpenAI API under /v1, metrics at /metrics)", file=sys.stderr, flush=True)
    uvicorn.run(create_app(bridge, args.api_key), host=args.host, port=args.port, log_level="info")
    return 0
