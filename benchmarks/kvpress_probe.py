"""One of evict_peers.py's prompts through a few kvpress presses, the answers decoded side by side:
the probe behind docs/benchmarks.md's reading of kvpress's 0% rows (issue 38).

    /work/peers/kvpress/bin/python benchmarks/kvpress_probe.py out/evict_peers/requests.json 0

Runs in kvpress's venv (`bash benchmarks/peers.sh kvpress`), after `benchmarks/evict_peers.py` wrote
the requests and the model folder. Prints each press's generated ids and their text (the folder's
own tokenizer, in its byte-level symbols: Ġ a space, Ċ a newline), greedy, as kvpress_peer.py generates them.
"""

from __future__ import annotations

import argparse
import json

import kvpress
import torch
import transformers
from kvpress_peer import generate  # benchmarks/ is this script's path
from transformers import AutoModelForCausalLM, AutoTokenizer

class LayerSnapKV(kvpress.SnapKVPress):
    """SnapKV's scores averaged over a layer's KV heads: one kept set per layer, every head the same
    tokens (as kvlab's blocks and kvpress's own TOVA keep them), against SnapKV's set per KV head."""

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        scores = super().score(module, hidden_states, keys, values, attentions, kwargs)
        return scores.mean(1, keepdim=True).expand_as(scores)


class BlockSnapKV(LayerSnapKV):
    """One set per layer, scored by 16-token blocks (each position gets its block's mean score):
    whole blocks stay, as in kvlab's paged cache, so a number's digits stay together."""

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        scores = super().score(module, hidden_states, keys, values, attentions, kwargs)
        n = scores.shape[-1]
        pad = torch.nn.functional.pad
        blocks = pad(scores, (0, -n % 16)).unflatten(-1, (-1, 16))
        counts = pad(torch.ones(n), (0, -n % 16)).unflatten(-1, (-1, 16)).sum(-1, keepdim=True)
        sums = blocks.sum(-1, keepdim=True) / counts
        return sums.expand_as(blocks).flatten(-2)[..., :n]


# name: press. The first five keep most of the prompt (one that loses the needle there is not short of
# room); the rest set SnapKV's one set per KV head against one per layer, and tokens against blocks
PROBES = {
    "none": lambda: None,
    "tova 50%": lambda: kvpress.TOVAPress(compression_ratio=0.5),
    "knorm 10%": lambda: kvpress.KnormPress(compression_ratio=0.1),
    "snapkv 10%": lambda: kvpress.SnapKVPress(compression_ratio=0.1),
    "snapkv 50%, window 1": lambda: kvpress.SnapKVPress(compression_ratio=0.5, window_size=1),
    "snapkv 10%, per layer": lambda: LayerSnapKV(compression_ratio=0.1),
    "snapkv 87.5%": lambda: kvpress.SnapKVPress(compression_ratio=0.875),
    "snapkv 87.5%, per layer": lambda: LayerSnapKV(compression_ratio=0.875),
    "snapkv 87.5%, per layer, blocks": lambda: BlockSnapKV(compression_ratio=0.875),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("requests", help="evict_peers.py's requests.json")
    p.add_argument("index", type=int, nargs="?", default=0, help="which prompt")
    p.add_argument("--folder", default="/work/peers/models/SmolLM2-135M-Instruct.Q4_1-hf")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    request = json.loads(open(args.requests).read())[args.index]
    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(args.folder)
    print(f"prompt {args.index}: {len(request['ids'])} tokens")
    for name, press in PROBES.items():
        ids = generate(model, request["ids"], request["max_tokens"], press())
        print(f"{name:>22}: {tok.decode(ids)!r} {ids}")


if __name__ == "__main__":
    main()
