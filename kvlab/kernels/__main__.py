"""``python -m kvlab.kernels``: build the native kernels now and say which linear path runs."""

import torch

from kvlab.kernels import describe

print(f"kvlab kernels: fp32 linear layers run on {describe(torch.float32)}")
