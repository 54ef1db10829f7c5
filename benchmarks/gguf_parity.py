"""kvlab against transformers holding the same dequantised weights, on a real GGUF model.

    .venv/bin/python benchmarks/gguf_parity.py gemma3-270m [--tokens 1024] [--out /tmp/gemma3-hf]

kvlab writes the file as a Hugging Face folder (``kvlab.gguf.export_folder``: float32 weights,
config.json); transformers loads that folder. Both run in fp32 on the CPU over the first
``--tokens`` tokens of the text kvlab's quality runs use (Persuasion, kvlab/data): the largest
logit difference, each side's perplexity, and greedy tokens from a short prompt. Prints one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """exp of the mean negative log-likelihood of every token after the first."""
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), ids[1:], reduction="mean")
    return math.exp(float(nll))


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from transformers import AutoModelForCausalLM

    from kvlab.catalog import gguf_file
    from kvlab.data import PERSUASION
    from kvlab.generate import generate
    from kvlab.gguf import export_folder
    from kvlab.models import NoCache, load
    from kvlab.sampling import SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--out", default="/tmp/kvlab-parity-hf")
    args = ap.parse_args()

    t0 = time.perf_counter()
    ours = load(args.model, "fp32")
    folder = Path(args.out)
    if not (folder / "model.safetensors").is_file():
        export_folder(gguf_file(args.model), folder)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor(ours.tokenizer.encode(PERSUASION.read_text())[:args.tokens])
    with torch.inference_mode():
        mine = ours.model(ids, torch.arange(ids.numel()), NoCache(ours.model.spec))
        theirs = ref(ids[None]).logits[0]
    prompt = ours.tokenizer.encode(args.prompt)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    greedy = generate(ours.model, prompt, params).token_ids
    with torch.inference_mode():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=args.new_tokens, do_sample=False,
                            min_new_tokens=args.new_tokens)[0, len(prompt):].tolist()
    same = next((i for i, (a, b) in enumerate(zip(greedy, want)) if a != b), len(want))
    print(json.dumps({
        "model": args.model, "tokens": int(ids.numel()), "dtype": "fp32",
        "max_abs_logit_diff": float((mine - theirs).abs().max()),
        "max_logit": float(theirs.abs().max()),
        "same_argmax_positions": int((mine.argmax(-1) == theirs.argmax(-1)).sum()),
        "perplexity_kvlab": perplexity(mine, ids), "perplexity_transformers": perplexity(theirs, ids),
        "greedy_identical": f"{same}/{len(want)}", "greedy_text": ours.tokenizer.decode(greedy),
        "seconds": round(time.perf_counter() - t0, 1),
    }, indent=1))


if __name__ == "__main__":
    main()
