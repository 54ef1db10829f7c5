"""``python -m kvlab.kernels``: build the native kernels now, say which linear path runs, and
list every CPU-dependent path with its switch (``kvlab.dispatch``)."""

import torch

from kvlab import dispatch

here = dispatch.backends()
for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
    print(f"kvlab kernels: {name} linear layers run on {here.linear_kernel(dtype, False)}")
for feature in here.features():
    print(f"  {feature.switch}: {'on' if feature.on else 'off'} ({feature.why})")
