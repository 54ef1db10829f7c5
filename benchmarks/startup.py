"""Where `kvlab generate`'s start-up goes: each step of loading a GGUF model, timed in turn in one
fresh process (what `kvlab.models.load` does, taken apart), then a first 2-token generation.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/startup.py [--model smollm2-135m] [--dtype fp32]

Run it from a checkout's root to time that checkout (PYTHONPATH=ROOT for another one); each
phase's imports are counted in the phase that first needs them. docs/benchmarks.md (issue 27)
quotes it before and after.
"""

from __future__ import annotations

import argparse
import time

t_start = time.perf_counter()
import torch  # noqa: E402  (timed: the first phase)

t_torch = time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF model (default: the bundled smollm2-135m)")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    phases = [("import torch", t_torch - t_start)]
    t = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        phases.append((name, now - t))
        t = now

    import kvlab.cli  # noqa: F401
    phase("import kvlab.cli")
    from kvlab.catalog import DEFAULT_MODEL, gguf_file, load_config, model_path
    from kvlab.spec import spec_from_config

    name = args.model or DEFAULT_MODEL
    cfg, label = load_config(name)
    phase("GGUF metadata and config")
    from kvlab.models.loader import _assign_weights, build_model, choose_dtype, stored_format

    file = gguf_file(model_path(name))
    choice = choose_dtype(args.dtype, "cpu", stored_format(file, None, cfg))
    phase(f"choose the dtype: {choice}")
    model = build_model(spec_from_config(cfg, label), choice.dtype)
    phase("build the model on the meta device")
    arrays = list(file.tensors())
    phase("dequantise the weights")
    _assign_weights(model, ((k, torch.from_numpy(a)) for k, a in arrays), label, choice.dtype, torch.device("cpu"))
    phase(f"give the model its weights in {choice.name}")
    from kvlab.models.tokenizer import HFTokenizer

    tok = HFTokenizer(file.tokenizer(), source="GGUF vocabulary")
    phase("tokenizer")
    from kvlab.generate import generate
    from kvlab.sampling import SamplingParams

    generate(model, tok.encode("The KV cache"), SamplingParams(max_tokens=2))
    phase("first 2-token generation")
    for what, seconds in phases:
        print(f"{seconds:7.2f} s  {what}")
    print(f"{sum(s for _, s in phases):7.2f} s  in all")


if __name__ == "__main__":
    main()
