"""Shared by the server, page and load tests: a tiny random-weight checkpoint and a live server.

The checkpoint is a config.json + a trained byte-level BPE tokenizer.json, loaded with random
weights (seeded, large init so greedy outputs vary), so a server starts in about a second and a
token costs microseconds. ``LiveServer`` runs uvicorn in a thread on a free loopback port, as
`kvlab serve` would, so clients (openai, httpx, Chromium) talk real HTTP.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import uvicorn
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvlab.options import EngineOptions, ModelOptions
from kvlab.server.app import create_app
from kvlab.server.bridge import EngineBridge
from kvlab.server.run import build_bridge

CORPUS = ["the cache holds keys and values of every earlier token, so each step computes one token"] * 8 + [
    "user: hello\nassistant: hi there, how can I help?", "héllo wörld 日本語 🙂 naïve café"]
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 320, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "initializer_range": 0.3, "eos_token_id": 0,
}
MODEL_ID = "tiny-llama"


def make_tiny_model(folder: Path, chat_template: str | None = None) -> Path:
    """A folder with config.json and tokenizer.json (and a chat template if given): the server
    loads it with --random-weights. Returns the config.json path."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_CONFIG["vocab_size"], special_tokens=["<eos>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG))
    if chat_template is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"chat_template": chat_template, "bos_token": "", "eos_token": "<eos>"}))
    return folder / "config.json"


def tiny_bridge(folder: Path, **engine: object) -> EngineBridge:
    """An engine over the tiny model in fp32 (exact greedy comparisons): 8-token blocks and a
    1 MiB cache (256 blocks) unless ``engine`` options say otherwise."""
    options = EngineOptions(**{"block_size": 8, "kv_memory": 2**20, **engine})  # type: ignore[arg-type]
    return build_bridge(ModelOptions(str(make_tiny_model(folder)), dtype="fp32", random_weights=True), options,
                        served_model_name=MODEL_ID)


class LiveServer:
    """uvicorn on 127.0.0.1:<free port> in a daemon thread; ``stop`` shuts it down cleanly.

    While it runs torch uses one intra-op thread: a tiny model's matmuls gain nothing from two,
    and on a shared 2-core machine two spinning OpenMP threads make each step up to 100x slower."""

    def __init__(self, bridge: EngineBridge, api_key: str | None = None, max_body_bytes: int | None = None) -> None:
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)
        self.bridge = bridge
        kwargs = {} if max_body_bytes is None else {"max_body_bytes": max_body_bytes}
        app = create_app(bridge, api_key, **kwargs)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
        torch.set_num_threads(self.threads)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[LiveServer]:
    live = LiveServer(tiny_bridge(tmp_path_factory.mktemp("tiny")))
    yield live
    live.stop()
