"""``python -m kvlab.kernels``: build the native kernels now and say which linear path runs."""

import torch

from kvlab.kernels import describe
from kvlab.models.llama import onednn_bf16_packing

for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
    print(f"kvlab kernels: {name} linear layers run on {describe(dtype, False, onednn_bf16_packing())}")
