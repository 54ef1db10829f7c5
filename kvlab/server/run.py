"""`kvlab serve`: its flags, and loading the model into an engine behind the app.

Flag parsing imports nothing heavy (so `kvlab --help` stays fast); torch, the model and uvicorn
load only when the command runs. The server binds to 127.0.0.1 unless --host says otherwise: it
runs arbitrary prompts on this machine, so any other address needs --api-key (or an explicit
--allow-unauthenticated). SIGTERM (or Ctrl+C) stops it cleanly: new requests are refused, running
ones get --shutdown-timeout seconds to finish and are then ended, and the process exits 0. With
--tp, a worker process that dies or hangs fails the requests in flight and stops the server
(exit 1, the error on stderr): the model cannot run without it.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from kvlab import dispatch
from kvlab.options import EngineOptions, ModelOptions, add_engine_args, add_model_args

if TYPE_CHECKING:  # keep torch out of flag parsing
    from types import FrameType

    import uvicorn

    from kvlab.server.bridge import EngineBridge


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("KVLAB_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route that runs the model or shows "
                   "the cache (/v1, /api; the page asks for the key); default: $KVLAB_API_KEY")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve a non-loopback --host without --api-key (anyone who reaches the port "
                   "can run the model and watch the cache)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long running requests may take to finish before they are "
                   "ended (default 30)")
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: the folder name)")
    add_engine_args(p)


def build_bridge(model: ModelOptions, options: EngineOptions | None = None, *,
                 served_model_name: str | None = None) -> EngineBridge:
    """Load the model, allocate the paged cache, and wrap the engine for the app."""
    from kvlab.engine.llm import LLM
    from kvlab.models import load_options
    from kvlab.server.bridge import EngineBridge

    options = options or EngineOptions()
    loaded = load_options(model, options.tp)
    logger = logging.getLogger("kvlab.server")
    logger.info("%s in %s; weights %s", loaded.model.name, loaded.dtype, loaded.weights)
    logger.info("CPU paths: %s", dispatch.backends().line())
    llm = LLM(loaded.model, tokenizer=loaded.tokenizer, device=model.device, **asdict(options))
    return EngineBridge(llm.engine, served_model_name or loaded.model.name, loaded.chat_template)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server to this machine (names other than localhost are
    not resolved: they count as reachable from elsewhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvlab.server.app import create_app

    if args.api_key is not None and not (args.api_key.isascii() and args.api_key.isprintable() and args.api_key):
        # an HTTP header carries latin-1 at most, and browsers' fetch refuses anything else
        print("kvlab: --api-key must be printable ASCII characters", file=sys.stderr)
        return 2
    if not args.api_key and not is_loopback(args.host) and not args.allow_unauthenticated:
        print(f"kvlab: refusing to serve on {args.host} without --api-key: anyone who reaches the "
              "port could run the model (--allow-unauthenticated to do it anyway)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    bridge = build_bridge(ModelOptions.from_args(args), EngineOptions.from_args(args),
                          served_model_name=args.served_model_name)
    print(f"kvlab: serving {bridge.model_id} on http://{args.host}:{args.port}/ "
          f"(OpenAI API under /v1, metrics at /metrics)", file=sys.stderr, flush=True)
    config = uvicorn.Config(create_app(bridge, args.api_key), host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=args.shutdown_timeout + 5)
    # uvicorn re-raises the stop signal once it has shut down; after a clean stop that should not
    # turn into death by SIGTERM (status 143), so the re-raised signal lands here and is dropped.
    signal.signal(signal.SIGTERM, lambda sig, frame: None)
    server = _server(config, bridge, args.shutdown_timeout)
    bridge.on_fatal = lambda: setattr(server, "should_exit", True)
    server.run()
    if bridge.fatal is not None:  # a tensor-parallel worker died or hung: the run is over
        print(f"kvlab: {bridge.fatal}", file=sys.stderr)
        return 1
    return 0


def _server(config: uvicorn.Config, bridge: EngineBridge, timeout_s: float) -> uvicorn.Server:
    """uvicorn's server, but a stop signal first tells the engine bridge to shut down: uvicorn
    stops accepting connections and waits for open ones, the bridge refuses requests that still
    arrive on them (503) and ends the running ones after the timeout, so every stream closes
    with a last event and [DONE] instead of a cut connection. (timeout_graceful_shutdown, a few
    seconds later, is the backstop for a client that stops reading.)"""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            bridge.shut_down(timeout_s)
            super().handle_exit(sig, frame)

    return Server(config)
