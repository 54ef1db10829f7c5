"""Turns a scheduled step into tensors and runs the model once over all its tokens.

Input ids and positions are the chunks' tokens laid end to end (no padding); the attention
backend gets each sequence's block tables; logits are computed only at the last token of each
chunk that samples. The step's block copies for swapping are the engine's, run before this.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from kvlab.engine.attention import PagedAttention, SeqSpan
from kvlab.engine.kv_cache import PagedKVCache
from kvlab.engine.scheduler import SchedulerOutput
from kvlab.models.llama import CausalLM


class ModelRunner:
    def __init__(self, model: CausalLM, cache: PagedKVCache) -> None:
        self.model = model
        self.cache = cache
        self.attn = PagedAttention(cache)
        # bf16 on CPU: packed weight copies make decode matmuls ~1.5x faster (bit-identical);
        # they cost the linear weights' bytes once more, so only when RAM has ample room.
        if model.device.type == "cpu":
            model.prepack(max_bytes=_available_ram() // 2)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> Tensor:
        """Run the step; logits [number of sampling chunks, vocab], in chunk order."""
        device = self.model.device
        if not out.chunks:
            return torch.empty(0, self.model.spec.vocab_size, device=device)
        ids: list[int] = []
        positions: list[Tensor] = []
        last: list[int] = []
        spans = []
        for chunk in out.chunks:
            end = chunk.start + chunk.num_tokens
            ids.extend(chunk.seq.token_ids[chunk.start:end])
            positions.append(torch.arange(chunk.start, end))
            if chunk.samples:
                last.append(len(ids) - 1)
            spans.append(SeqSpan(chunk.seq.block_tables, chunk.start, chunk.num_tokens))
        self.attn.prepare(spans, device)
        return self.model(torch.tensor(ids, device=device), torch.cat(positions).to(device),
                          self.attn, torch.tensor(last, dtype=torch.long, device=device))


def _available_ram() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
