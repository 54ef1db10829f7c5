"""How often a bf16 run changes a greedy token against fp32, on the default model (issue 24).

For each prompt the fp32 model generates greedily; that continuation is then fed whole to the
bf16 model (teacher-forced, one forward pass), and at every position the bf16 run's top token is
compared with fp32's, twice: from the fp32 logits kvlab's LM head now returns, and from the same
logits rounded to bf16 (what a bf16 LM head returned before; ties go to the lower token id, as
torch.argmax breaks them). Exact ties among the rounded logits are counted too.

    .venv/bin/python benchmarks/bf16_flips.py --prompts 24 --tokens 48

Prompts: the chat question of the README, then excerpts of *Persuasion* (kvlab/data). Nothing is
timed: the figures do not depend on load, only on this CPU's bf16 kernels.
"""

from __future__ import annotations

import argparse

import torch

from kvlab.data import PERSUASION
from kvlab.generate import generate
from kvlab.models import load
from kvlab.models.attention import NoCache
from kvlab.sampling import SamplingParams


def prompts(loaded, count: int) -> list[list[int]]:
    chat = loaded.chat_template.encode(loaded.tokenizer,
                                       [{"role": "user", "content": "What is the capital of France?"}])
    words = PERSUASION.read_text().split()
    excerpts = [loaded.tokenizer.encode(" ".join(words[i * 40:i * 40 + 24])) for i in range(count - 1)]
    return [chat] + excerpts


@torch.inference_mode()
def all_logits(model, ids: list[int]) -> torch.Tensor:
    backend = NoCache(model.spec)
    return model(torch.tensor(ids), backend.prepare(len(ids)), backend, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    fp32, bf16 = load(None, "fp32"), load(None, "bf16")
    total = flips_fp32 = flips_rounded = ties = first_fp32 = first_rounded = 0
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    for prompt in prompts(fp32, args.prompts):
        out = generate(fp32.model, prompt, params).token_ids
        seq = prompt + out[:-1]
        ref = all_logits(fp32.model, seq)[len(prompt) - 1:].argmax(-1)
        assert ref.tolist() == out, "fp32 teacher forcing disagrees with fp32 generation"
        logits = all_logits(bf16.model, seq)[len(prompt) - 1:]
        assert logits.dtype == torch.float32
        rounded = logits.bfloat16()
        top2 = rounded.float().topk(2, -1).values
        a, b = logits.argmax(-1), rounded.argmax(-1)
        total += len(out)
        flips_fp32 += int((a != ref).sum())
        flips_rounded += int((b != ref).sum())
        ties += int((top2[:, 0] == top2[:, 1]).sum())
        first_fp32 += int(a[0] != ref[0])
        first_rounded += int(b[0] != ref[0])
    n = args.prompts
    print(f"{fp32.model.name}: {n} prompts x {args.tokens} greedy tokens = {total} positions, "
          f"bf16 against fp32 (teacher-forced)")
    print(f"  bf16 model, fp32 logits (now):        {flips_fp32:4d} flipped ({100 * flips_fp32 / total:.2f}%), "
          f"first token {first_fp32}/{n}")
    print(f"  bf16 model, logits rounded to bf16:   {flips_rounded:4d} flipped ({100 * flips_rounded / total:.2f}%), "
          f"first token {first_rounded}/{n}; exact top-2 ties {ties}")


if __name__ == "__main__":
    main()
