"""Evaluate kvlab's demo model (the numbers of ``kvlab/demo_model/README.md``).

Loads the saved checkpoint with ``transformers`` (float32 on CPU) and reports:

* held-out perplexity: next-token perplexity on the held-out 5% of each Jane
  Austen novel (text the model never trained on), in non-overlapping
  1,024-token windows that start with ``<s>``; also bits per character;
* recall accuracy on the fixed held-out recall set (200 examples, seed
  ``RECALL_EVAL_SEED``, 250-550 words of held-out filler between the facts
  and the question), greedy decoding, and the same with the fact sentences
  removed from the prompts (the no-information baseline);
* copying: the loss on a held-out passage said a second time, with its first
  occurrence 300 tokens earlier in the context, and with that occurrence
  replaced by other text (what evicting those cached tokens would cost);
* greedy continuations of a few English prompts.

Needs the same data package as training (see ``train_demo_model.py``)::

    python scripts/eval_demo_model.py kvlab/demo_model \\
        [--austen-dir /usr/lib/R/site-library/janeaustenr] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_demo_model as tdm  # noqa: E402

SAMPLE_PROMPTS = [
    "It was a fine morning, and",
    "Mr. Darcy looked at her and said",
    "The family had been settled in the country for many years, and",
]


def evaluate(model_dir: str, austen_dir: str, n_recall: int = tdm.RECALL_EVAL_N,
             max_windows: int | None = None) -> dict:
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    eos = tok.token_to_id(tdm.EOS)
    _, heldout = tdm.load_splits(austen_dir)
    heldout_text = "\n\n".join(heldout.values())
    res: dict = {"model_dir": str(model_dir),
                 "params": sum(p.numel() for p in model.parameters()),
                 "weights_bytes": (Path(model_dir) / "model.safetensors").stat().st_size}

    t = time.time()
    windows = tdm.heldout_windows(tok, heldout, model.config.max_position_embeddings)
    windows = windows[:max_windows] if max_windows else windows
    loss, n_tok = tdm.heldout_loss(model, windows)
    n_chars = sum(len(tok.decode(w[1:])) for w in windows)
    res["heldout"] = {"tokens": n_tok, "chars": n_chars, "nll": loss,
                      "perplexity": math.exp(loss),
                      "bits_per_char": loss * n_tok / n_chars / math.log(2),
                      "seconds": time.time() - t}
    print(f"held-out: {n_tok} tokens, ppl {math.exp(loss):.2f}, "
          f"{res['heldout']['bits_per_char']:.3f} bits/char", flush=True)

    def generate(prompt: str, max_new: int) -> str:
        ids = torch.tensor([tok.encode(prompt).ids])  # with <s>
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos)
        return tok.decode(out[0, ids.shape[1]:].tolist())

    for name, with_facts in (("recall", True), ("recall_baseline_no_facts", False)):
        t = time.time()
        examples = tdm.recall_eval_examples(heldout_text, n=n_recall, include_facts=with_facts)
        ok, lens, shown = 0, [], []
        for prompt, answer in examples:
            lens.append(len(tok.encode(prompt).ids))
            gen = generate(prompt, 6)
            good = tdm.recall_answer_correct(gen, answer)
            ok += good
            if len(shown) < 3:
                shown.append({"question": prompt[prompt.rfind("Question:"):], "answer": answer,
                              "generated": gen, "correct": good})
        res[name] = {"n": len(examples), "accuracy": ok / len(examples),
                     "prompt_tokens_min": min(lens), "prompt_tokens_mean": sum(lens) / len(lens),
                     "prompt_tokens_max": max(lens), "examples": shown,
                     "seconds": time.time() - t}
        print(f"{name}: {ok}/{len(examples)} = {ok / len(examples):.3f} "
              f"(prompts {min(lens)}-{max(lens)} tokens)", flush=True)

    res["copy"] = copy_benefit(model, tok, heldout_text)
    c = res["copy"]
    print(f"repeated passage: {c['nll_with_first']:.3f} nats/token with its first occurrence in "
          f"context, {c['nll_without_first']:.3f} without", flush=True)

    res["samples"] = [{"prompt": p, "continuation": generate(p, 48)} for p in SAMPLE_PROMPTS]
    for s in res["samples"]:
        print(f"--- {s['prompt']!r}\n{s['prompt']}{s['continuation']}", flush=True)
    return res


def copy_benefit(model, tok, text: str, n: int = 100, passage: int = 64, gap: int = 300,
                 seed: int = 7) -> dict:
    """Mean loss on ``passage`` tokens of held-out text that come a second time, ``gap`` tokens
    after their first occurrence, against the same with the first occurrence swapped for
    another stretch of text: how much the model reads back from its context."""
    import random

    import torch
    import torch.nn.functional as F

    stream = tok.encode(text, add_special_tokens=False).ids
    bos = tok.token_to_id(tdm.BOS)
    rng = random.Random(seed)
    sums = {"with": 0.0, "without": 0.0}
    with torch.no_grad():
        for _ in range(n):
            s = rng.randrange(len(stream) - 2 * passage - gap)
            a, g = stream[s:s + passage], stream[s + passage:s + passage + gap]
            o = rng.randrange(len(stream) - passage)
            for key, first in (("with", a), ("without", stream[o:o + passage])):
                ids = torch.tensor([[bos] + first + g + a])
                logits = model(input_ids=ids).logits[0, -passage - 1:-1]
                sums[key] += F.cross_entropy(logits.float(), torch.tensor(a)).item()
    return {"n": n, "passage_tokens": passage, "gap_tokens": gap,
            "nll_with_first": sums["with"] / n, "nll_without_first": sums["without"] / n}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", nargs="?", default="kvlab/demo_model")
    p.add_argument("--austen-dir", default=tdm.DEFAULT_AUSTEN_DIR)
    p.add_argument("--n-recall", type=int, default=tdm.RECALL_EVAL_N)
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    res = evaluate(args.model_dir, args.austen_dir, args.n_recall, args.max_windows)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
