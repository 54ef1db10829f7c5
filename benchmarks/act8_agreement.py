"""How far `--activations int8` moves the tokens from the exact mode, on one model.

    .venv/bin/python benchmarks/act8_agreement.py [smollm2-135m] [--max-tokens 128] [--text-tokens 1024]

Two measures, both against the same model loaded with `--activations fp32`:
- greedy agreement: the README's prompts (and a 512-token opening of the bundled long text),
  generated greedily in each mode through the generation loop; for each, the number of new tokens
  before the first difference, whether the two outputs are equal, and the exact mode's margin
  between its two best first tokens (a near-tie there is one that 8-bit inputs can reorder);
- teacher-forced agreement: one forward over --text-tokens tokens of the long text in each mode;
  the fraction of positions whose argmax is the same, and the largest |logit difference|. Greedy
  outputs diverge for good once one near-tie flips (each token then conditions on a different
  past); this measure counts the flips themselves.
Prints a table, then one JSON object.
"""

from __future__ import annotations

import argparse
import json

import torch

from kvlab.data import PERSUASION
from kvlab.generate import generate
from kvlab.models import NoCache, load
from kvlab.sampling import SamplingParams

# the README's prompts (generate, and the LLM example's two); the first through the chat template
PROMPTS = [("chat", "What is the capital of France?"), ("text", "The KV cache of a transformer"),
           ("text", "Once upon a time"), ("text", "Dear Jane,"), ("text", "Mr. Darcy")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--text-tokens", type=int, default=1024)
    args = ap.parse_args()

    modes = {a: load(args.model, "fp32", activations=a) for a in ("fp32", "int8")}
    tok = modes["fp32"].tokenizer
    text_ids = tok.encode(PERSUASION.read_text())
    prompts = [(f"{kind}: {p}", modes["fp32"].chat_template.encode(tok, [{"role": "user", "content": p}])
                if kind == "chat" else tok.encode(p)) for kind, p in PROMPTS]
    prompts.append(("long text: its first 512 tokens", text_ids[:512]))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    greedy = []
    for name, ids in prompts:
        outs = {a: generate(m.model, ids, params, m.tokenizer).token_ids for a, m in modes.items()}
        a, b = outs["fp32"], outs["int8"]
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        with torch.inference_mode():
            first = modes["fp32"].model(torch.tensor(ids), torch.arange(len(ids)), NoCache(modes["fp32"].model.spec))
        top2 = first[-1].float().topk(2).values.tolist()
        greedy.append({"prompt": name, "new_fp32": len(a), "new_int8": len(b), "same_before_first_difference": same,
                       "equal": a == b, "first_token_margin_fp32": top2[0] - top2[1]})

    ids = torch.tensor(text_ids[:args.text_tokens])
    with torch.inference_mode():
        logits = {a: m.model(ids, torch.arange(len(ids)), NoCache(m.model.spec)).float() for a, m in modes.items()}
    top = (logits["fp32"].argmax(-1) == logits["int8"].argmax(-1)).float().mean().item()
    gap = (logits["fp32"] - logits["int8"]).abs().max().item()

    print(f"{'prompt':<44} {'new tokens':>10} {'same before first difference':>29} {'first-token margin':>19}")
    for g in greedy:
        print(f"{g['prompt'][:44]:<44} {g['new_fp32']:>10} {g['same_before_first_difference']:>29}"
              f" {g['first_token_margin_fp32']:>19.3f}{'  (equal)' if g['equal'] else ''}")
    print(f"teacher-forced over {len(ids)} tokens of the long text: argmax agrees at {top:.1%} of positions, "
          f"largest |logit difference| {gap:.3f}")
    print(json.dumps({"model": args.model, "max_tokens": args.max_tokens, "greedy": greedy,
                      "teacher_forced": {"tokens": len(ids), "argmax_agreement": top, "max_abs_logit_diff": gap}}))


if __name__ == "__main__":
    main()
