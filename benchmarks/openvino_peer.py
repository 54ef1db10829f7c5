"""Requests through OpenVINO GenAI's continuous-batching pipeline, on a GGUF file as its own
reader loads it: issue 25's performance peer.

OpenVINO GenAI is never a kvlab dependency; it lives in its own virtual environment (`bash
benchmarks/peers.sh openvino`). This script imports neither kvlab nor torch: the caller
(benchmarks/side_by_side.py) writes the requests, `kvlab.bench.Workload`'s, as a JSON list of
[prompt token ids, output length] pairs:

    /work/peers/openvino/bin/python benchmarks/openvino_peer.py MODEL.gguf requests.json --threads 2

Every request runs greedy with EOS ignored, all of them submitted together to one
`openvino_genai.ContinuousBatchingPipeline` (its default SchedulerConfig) on the CPU, limited to
--threads by the CPU plugin's INFERENCE_NUM_THREADS; every other CPU setting is OpenVINO's
default. One short request of the first prompt's length runs first, untimed: OpenVINO compiles
its kernels on the first inference. Prints one JSON object with ``output_tokens_per_s`` (output
tokens over the wall time of ``generate``); for a single request also ``ttft_s`` and
``decode_tokens_per_s`` (from a streamer's token times, as `kvlab bench` reports them), and the
process's RSS after load and its peak.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import openvino as ov
import openvino_genai as ov_genai

# the CPU plugin's defaults that decide what a step computes, reported beside the figures
CPU_DEFAULTS = ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "DYNAMIC_QUANTIZATION_GROUP_SIZE",
                "ENABLE_CPU_PINNING")


class TokenTimes(ov_genai.StreamerBase):
    """A streamer that keeps the time each token arrived (one write may carry several)."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def write(self, token: int | list[int]) -> ov_genai.StreamingStatus:
        now = time.perf_counter()
        self.times += [now] * (len(token) if isinstance(token, list) else 1)
        return ov_genai.StreamingStatus.RUNNING

    def end(self) -> None:
        pass


def config(n: int) -> ov_genai.GenerationConfig:
    """Greedy, exactly `n` new tokens."""
    c = ov_genai.GenerationConfig()
    c.max_new_tokens, c.ignore_eos, c.do_sample = n, True, False
    return c


def rss_bytes(key: str) -> int:
    """VmRSS or VmHWM of this process, in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def setting(value: object) -> str:
    """A CPU property as text: an element type by its short name (bf16, u8)."""
    return value.to_string() if isinstance(value, ov.Type) else str(value)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gguf", help="the GGUF file")
    p.add_argument("requests", help="JSON list of [prompt token ids, output length]")
    p.add_argument("--threads", type=int, default=2, help="INFERENCE_NUM_THREADS (default 2)")
    args = p.parse_args()
    with open(args.requests) as f:
        reqs: list[tuple[list[int], int]] = [(ids, n) for ids, n in json.load(f)]

    pipe = ov_genai.ContinuousBatchingPipeline(args.gguf, ov_genai.SchedulerConfig(), "CPU",
                                               {"INFERENCE_NUM_THREADS": args.threads})
    rss_loaded = rss_bytes("VmRSS")

    def tensor(ids: list[int]) -> ov.Tensor:
        return ov.Tensor(np.array([ids], dtype=np.int64))

    first = reqs[0][0]
    pipe.generate([tensor(first[1:] + first[:1])], [config(2)])  # warm-up, another prompt
    streamer = TokenTimes() if len(reqs) == 1 else None
    cpu0, t0 = os.times(), time.perf_counter()
    outs = pipe.generate([tensor(ids) for ids, _ in reqs], [config(n) for _, n in reqs], streamer)
    seconds, cpu1 = time.perf_counter() - t0, os.times()
    for (_, n), out in zip(reqs, outs, strict=True):
        if len(out.m_generation_ids[0]) != n:
            raise RuntimeError(f"asked for {n} tokens, got {len(out.m_generation_ids[0])}")
    tokens = sum(n for _, n in reqs)
    single = {}
    if streamer:
        if len(streamer.times) != tokens:
            raise RuntimeError(f"the streamer saw {len(streamer.times)} tokens of {tokens}")
        single = {"ttft_s": streamer.times[0] - t0,
                  "decode_tokens_per_s": (tokens - 1) / (streamer.times[-1] - streamer.times[0])}
    core = ov.Core()
    print(json.dumps({
        "engine": "openvino-genai", "version": ov_genai.__version__, "model": args.gguf,
        "num_requests": len(reqs), "output_tokens": tokens, "seconds": seconds,
        "output_tokens_per_s": tokens / seconds, **single,
        # user + system CPU seconds of the timed run: at most --threads x seconds if the limit holds
        "cpu_s": (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system), "threads": args.threads,
        "rss_after_load": rss_loaded, "rss_peak": rss_bytes("VmHWM"),
        "cpu_defaults": {k: setting(core.get_property("CPU", k)) for k in CPU_DEFAULTS}}))


if __name__ == "__main__":
    main()
