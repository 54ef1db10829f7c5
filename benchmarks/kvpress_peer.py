"""NVIDIA kvpress's presses on kvlab's retrieval prompts: issue 38's eviction peer.

kvpress is never a kvlab dependency; it lives in its own virtual environment (`bash
benchmarks/peers.sh kvpress`). This script imports neither kvlab nor its tokenizer: the caller
(benchmarks/evict_peers.py) writes the prompts as token ids, kvlab's own, and scores the ids this
script returns with kvlab's tokenizer and `kvlab.ruler.Sample.score`:

    /work/peers/kvpress/bin/python benchmarks/kvpress_peer.py FOLDER requests.json \\
        --presses none,snapkv,tova --budgets 256,512 --threads 2

FOLDER is a Hugging Face checkpoint (the caller writes the GGUF's dequantised fp32 weights there:
the weights kvlab runs). Each prompt is prefilled in one forward pass under the press (kvpress
compresses during the prefill only, once it has seen the whole prompt, question included: the
same setting as kvlab's snapkv), keeping `budget` of its tokens (compression_ratio = 1 - budget /
prompt length); then greedy decoding with positions after the prompt, one sequence at a time (bs
1). `none` is the uncompressed baseline that checks the harness. Prints one JSON object: per
press and budget, the generated ids of every prompt and the seconds it took.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache

import kvpress

# press name -> a press at a compression ratio; observed_attention needs eager attention weights
PRESSES = {
    "snapkv": lambda r: kvpress.SnapKVPress(compression_ratio=r),
    "adakv": lambda r: kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=r)),
    "tova": lambda r: kvpress.TOVAPress(compression_ratio=r),
    "expected_attention": lambda r: kvpress.ExpectedAttentionPress(compression_ratio=r),
    "streaming_llm": lambda r: kvpress.StreamingLLMPress(compression_ratio=r),
    "knorm": lambda r: kvpress.KnormPress(compression_ratio=r),
    "observed_attention": lambda r: kvpress.ObservedAttentionPress(compression_ratio=r),
}


@torch.inference_mode()
def generate(model, ids: list[int], max_tokens: int, press) -> list[int]:
    cache = DynamicCache()
    prompt = torch.tensor([ids])
    if press is None:
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
    else:
        with press(model):
            out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
    token = int(out.logits[0, -1].argmax())
    generated = [token]
    for i in range(max_tokens - 1):
        position = torch.tensor([[len(ids) + i]])  # the text's position, not the compressed cache's length
        out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, position_ids=position, use_cache=True)
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
    return generated


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("requests", help="JSON list of {ids, max_tokens}")
    p.add_argument("--presses", default="none,snapkv")
    p.add_argument("--budgets", default="256,512", help="tokens kept per prompt")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()  # stderr stays readable
    requests = json.loads(open(args.requests).read())
    names = args.presses.split(",")
    unknown = [n for n in names if n != "none" and n not in PRESSES]
    if unknown:
        raise SystemExit(f"unknown press {', '.join(unknown)}: choose from none, {', '.join(PRESSES)}")
    models = {}
    rows = []
    for name in names:
        attn = "eager" if name == "observed_attention" else "sdpa"
        if attn not in models:
            models[attn] = AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32,
                                                                attn_implementation=attn).eval()
        model = models[attn]
        for budget in [None] if name == "none" else [int(b) for b in args.budgets.split(",")]:
            t0 = time.perf_counter()
            outputs = []
            for r in requests:
                press = None if budget is None else PRESSES[name](max(0.0, 1 - budget / len(r["ids"])))
                outputs.append(generate(model, r["ids"], r["max_tokens"], press))
            rows.append({"press": name, "budget": budget, "outputs": outputs, "seconds": time.perf_counter() - t0})
    print(json.dumps({"kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "",
                      "torch": torch.__version__, "threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
