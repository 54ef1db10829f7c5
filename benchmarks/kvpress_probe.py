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

PROBES = {  # name: press, each keeping most of the prompt (a press that loses the needle here is not short of room)
    "none": lambda: None,
    "tova 50%": lambda: kvpress.TOVAPress(compression_ratio=0.5),
    "knorm 10%": lambda: kvpress.KnormPress(compression_ratio=0.1),
    "snapkv 10%": lambda: kvpress.SnapKVPress(compression_ratio=0.1),
    "snapkv 50%, window 1": lambda: kvpress.SnapKVPress(compression_ratio=0.5, window_size=1),
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
