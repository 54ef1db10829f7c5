"""What one kernel call costs in Python: the ctypes call kvlab makes against the same call
registered as a torch op with ``torch.library`` (issue 35: "only if it costs no decode speed"),
on a small ``kvlab_rms_norm`` (one row of the bundled model's 576 values, one thread) so that the
call's overhead, not the kernel, is what is timed.

    .venv/bin/python benchmarks/op_overhead.py

Rows, each the best of --repeat timeit runs of --number calls, in microseconds a call, under
``torch.inference_mode()`` as the engine's steps run:
- ctypes: ``lib.kvlab_rms_norm`` on prepared addresses (the C call and ctypes' conversions only);
- kvlab.kernels.rms_norm: the Python wrapper the model calls (allocates the output, takes the
  addresses, then the ctypes call);
- torch.library.custom_op: that wrapper as ``kvlab::rms_norm`` through ``torch.library.custom_op``
  (the dispatcher, the op's schema checks and its Python kernel);
- torch.library.Library.impl: the same registered the lower-level way (a schema and a CPU kernel
  in Python, no autograd or fake-tensor wrapper), called as ``torch.ops``.
"""

from __future__ import annotations

import argparse
import timeit

import torch

from kvlab import kernels

D = 576  # the bundled model's hidden size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--number", type=int, default=20000, help="calls per timing")
    ap.add_argument("--repeat", type=int, default=7, help="timings; the best is reported")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lib = kernels._load()[0]
    if lib is None:
        raise SystemExit(f"kvlab's kernels do not run here: {kernels.status().detail}")
    x, w, y = torch.randn(1, D), torch.randn(D), torch.empty(1, D)
    xp, wp, yp = x.data_ptr(), w.data_ptr(), y.data_ptr()

    @torch.library.custom_op("kvlab_overhead::rms_norm", mutates_args=())
    def custom(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return kernels.rms_norm(x, weight, eps)[0]

    low = torch.library.Library("kvlab_overhead_low", "DEF")
    low.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
    low.impl("rms_norm", lambda x, weight, eps: kernels.rms_norm(x, weight, eps)[0], "CPU")
    by_ops = torch.ops.kvlab_overhead_low.rms_norm

    calls = {
        "ctypes": lambda: lib.kvlab_rms_norm(xp, None, None, wp, yp, 1, D, 1e-5, 0, 1),
        "kvlab.kernels.rms_norm": lambda: kernels.rms_norm(x, w, 1e-5),
        "torch.library.custom_op": lambda: custom(x, w, 1e-5),
        "torch.library.Library.impl": lambda: by_ops(x, w, 1e-5),
    }
    with torch.inference_mode():
        want = kernels.rms_norm(x, w, 1e-5)[0]
        assert torch.equal(custom(x, w, 1e-5), want) and torch.equal(by_ops(x, w, 1e-5), want)
        print(f"torch {torch.__version__}, {args.number} calls x {args.repeat}, best, µs a call")
        for name, fn in calls.items():
            best = min(timeit.repeat(fn, number=args.number, repeat=args.repeat)) / args.number
            print(f"  {name:28s} {best * 1e6:6.2f}")


if __name__ == "__main__":
    main()
