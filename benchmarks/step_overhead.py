"""Where an engine step's time goes, by cProfile: the forward pass against the Python around it
(scheduling, step inputs, sampling, output processing), per step, for greedy or sampled requests.

    python benchmarks/step_overhead.py --num-requests 16 --sampling mixed

The profile counts CPU time, not wall-clock: on a machine shared with other work, time spent
waiting for a core is not the engine's. Its split of each step is what the issue-11 figures in
docs/benchmarks.md quote. ``--sampling``: greedy (temperature 0), mixed (seeded temperature /
top-k / top-p / min-p requests, as an API server sees) or half of each.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

import torch

from kvlab.bench import Workload, parse_range
from kvlab.engine.engine import LLMEngine
from kvlab.options import EngineOptions
from kvlab.models import load
from kvlab.sampling import SamplingParams

# the rows of the table: (label, (file, function) whose cumulative time it is); "step inputs" is
# the runner's and worker's own work around the model: input lists, block tables, slot mapping
STEP, FORWARD, EXECUTE = ("engine.py", "step"), ("llama.py", "forward"), ("runner.py", "execute")
PARTS = [
    ("model forward", FORWARD),
    ("sampling", ("engine.py", "_sample")),
    ("step inputs", EXECUTE),
    ("schedule", ("scheduler.py", "schedule")),
    ("scheduler.update", ("scheduler.py", "update")),
    ("output processing", ("engine.py", "_advance")),
]


def params_for(i: int, n_out: int, sampling: str) -> SamplingParams:
    """Request i's parameters: greedy, or one of four seeded sampling set-ups."""
    greedy = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
    if sampling == "greedy" or (sampling == "half" and i % 2 == 0):
        return greedy
    kinds = [dict(temperature=0.8), dict(temperature=0.7, top_k=40), dict(temperature=1.0, top_p=0.9),
             dict(temperature=0.9, top_k=50, top_p=0.95, min_p=0.05)]
    return SamplingParams(seed=i, max_tokens=n_out, ignore_eos=True, **kinds[i % len(kinds)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None, help="default: smollm2-135m")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--input-len", default="32:128")
    ap.add_argument("--output-len", default="32:64")
    ap.add_argument("--sampling", choices=["greedy", "mixed", "half"], default="mixed")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bf16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load(args.model, args.dtype)
    engine = LLMEngine(loaded.model, loaded.tokenizer, EngineOptions(kv_memory=2**28))
    work = Workload(args.num_requests, parse_range(args.input_len), parse_range(args.output_len)).requests(
        loaded.model.spec.vocab_size)
    # warm-up: one-time costs (kernel choice, buffers) out of the profile
    engine.add_request(work[0][0], SamplingParams(max_tokens=4, seed=0))
    while engine.has_unfinished():
        engine.step()
    for i, (prompt, n_out) in enumerate(work):
        engine.add_request(prompt, params_for(i, n_out, args.sampling))
    prof, steps, tokens = cProfile.Profile(time.process_time), 0, 0
    t0, c0 = time.perf_counter(), time.process_time()
    prof.enable()
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    prof.disable()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    cum: dict[tuple[str, str], float] = {}
    for (path, _, name), (_, _, _, ct, _) in stats.items():  # same-named methods: the outermost
        key = (Path(path).name, name)
        cum[key] = max(cum.get(key, 0.0), ct)
    cum[EXECUTE] -= cum[FORWARD]
    print(f"{steps} steps, {tokens} tokens, {wall:.2f} s wall, {cpu:.2f} s CPU (profiled); "
          f"sampling={args.sampling}, {args.num_requests} requests, {args.threads} thread(s); per step, CPU:")
    step = cum[STEP]
    print(f"  {'step':<18} {1000 * step / steps:8.2f} ms  100.0%")
    for label, key in PARTS:
        print(f"  {label:<18} {1000 * cum.get(key, 0.0) / steps:8.2f} ms  {100 * cum.get(key, 0.0) / step:5.1f}%")


if __name__ == "__main__":
    main()
