"""`kvlab serve` as a user runs it: a subprocess on a free loopback port, answering over HTTP."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx

from kvlab.cli import build_parser
from tests.test_server_fixtures import MODEL_ID, make_tiny_model


def test_defaults_bind_to_loopback():
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.api_key, args.model) == ("127.0.0.1", 8000, None, None)
    assert args.block_size == 16 and args.prefix_caching is True  # the engine's own flags


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_subprocess(tmp_path):
    config = make_tiny_model(tmp_path)
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvlab.cli", "serve", str(config), "--random-weights", "--dtype", "fp32",
         "--port", str(port), "--served-model-name", MODEL_ID, "--kv-memory", "1MiB", "--block-size", "8",
         "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "kvlab serve did not come up"
            time.sleep(0.1)
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL_ID, "prompt": "the cache", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    assert "Application shutdown complete" in out  # SIGTERM: a clean shutdown (the engine thread stopped)
    assert f"serving {MODEL_ID} on http://127.0.0.1:{port}/" in out
