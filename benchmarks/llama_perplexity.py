"""kvlab's perplexity computed the way llama.cpp's llama-perplexity computes it, on the same tokens.

    .venv/bin/python benchmarks/llama_perplexity.py [gemma3-270m] [--ctx 1024] [--chunks N]
        [--weights auto|as-stored|dense] [--activations fp32|int8]
        [--llama-perplexity PATH [--llama-args "..."]]

llama-perplexity tokenises the whole text (its -f drops one final newline; BOS first when the
vocabulary adds one), cuts it into len // ctx chunks of ctx tokens (the tail is dropped),
evaluates each chunk from an empty cache with its first token replaced by BOS, and scores only the
second half: the logits at positions ctx/2 .. ctx-2 against the tokens after them, ctx/2 - 1
tokens a chunk. Its "PPL = x +/- y" is exp of the mean negative log-likelihood over all scored
tokens, y the standard error of that mean times x. kvlab does the same here in fp32, one
full-chunk forward with NoCache a chunk.

With --llama-perplexity, the binary runs too (`-c CTX -b CTX -t 2`, `--chunks N` if given, then
any --llama-args, e.g. "-ctk f32 -ctv f32"),
and once more with a context too large for the text, which makes it print its token count; the
JSON then holds both figures, both per-chunk running values and their relative difference.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
RUNNING = re.compile(r"\[(\d+)\]([0-9.]+),")
COUNT = re.compile(r"tokenizes to only (\d+) tokens")
CHUNKS = re.compile(r"over (\d+) chunks")


def llama_run(binary: str, gguf: Path, text: Path, ctx: int, chunks: int | None,
              extra: list[str]) -> tuple[dict, str]:
    cmd = [binary, "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "-t", "2"]
    if chunks is not None:
        cmd += ["--chunks", str(chunks)]
    cmd += extra
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    log = out.stdout + out.stderr
    final = FINAL.search(log)
    if not final:
        raise SystemExit(f"no 'Final estimate' in llama-perplexity's output:\n{log[-3000:]}")
    return {"ppl": float(final.group(1)), "ppl_stderr": float(final.group(2)),
            "chunks": int(CHUNKS.search(log).group(1)),
            "running": [float(v) for _, v in RUNNING.findall(log)],
            "seconds": round(time.perf_counter() - t0, 1),
            "command": shlex.join(cmd)}, log


def llama_token_count(binary: str, gguf: Path, text: Path, at_least: int) -> int | None:
    """llama-perplexity prints the text's token count only when it is under 2 x ctx: ask with a
    context of at least `at_least` tokens (a multiple of 256)."""
    ctx = 256 * -(-at_least // 256)
    out = subprocess.run([binary, "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-t", "2"],
                         capture_output=True, text=True)
    m = COUNT.search(out.stdout + out.stderr)
    return int(m.group(1)) if m else None


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from kvlab.catalog import gguf_file
    from kvlab.data import PERSUASION
    from kvlab.models import NoCache, load

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="gemma3-270m")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--chunks", type=int, help="score only the first N chunks (both sides)")
    ap.add_argument("--weights", default="auto", help="kvlab's --weights (auto, as-stored, dense)")
    ap.add_argument("--activations", default="fp32", help="kvlab's --activations (fp32, int8)")
    ap.add_argument("--llama-perplexity", metavar="PATH", help="run this llama-perplexity too")
    ap.add_argument("--llama-args", default="", help="more flags for llama-perplexity, one string")
    args = ap.parse_args()
    torch.set_num_threads(2)

    t0 = time.perf_counter()
    gguf = gguf_file(args.model)
    ours = load(args.model, "fp32", weights=args.weights, activations=args.activations)
    text = PERSUASION.read_text()
    ids = torch.tensor(ours.tokenizer.encode(text.removesuffix("\n")))  # as llama.cpp's -f reads it
    add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", False))
    bos = int(gguf.get("tokenizer.ggml.bos_token_id"))
    assert not add_bos or int(ids[0]) == bos, "kvlab's tokenizer did not put BOS first"

    n_chunk = len(ids) // args.ctx
    if args.chunks is not None:
        n_chunk = min(n_chunk, args.chunks)
    first = args.ctx // 2
    nll = nll2 = 0.0
    count, running = 0, []
    with torch.inference_mode():
        for i in range(n_chunk):
            chunk = ids[i * args.ctx:(i + 1) * args.ctx].clone()
            if add_bos:
                chunk[0] = bos
            logits = ours.model(chunk, torch.arange(args.ctx), NoCache(ours.model.spec))
            logp = torch.log_softmax(logits[first:args.ctx - 1].float(), dim=-1)
            v = -logp.gather(1, chunk[first + 1:, None])[:, 0].double()
            nll += float(v.sum())
            nll2 += float((v * v).sum())
            count += v.numel()
            running.append(round(math.exp(nll / count), 4))
    mean = nll / count
    ppl = math.exp(mean)
    stderr = math.sqrt((nll2 / count - mean * mean) / (count - 1)) * ppl
    result = {
        "model": args.model, "file": str(gguf.path), "dtype": "fp32", "weights": args.weights, "activations": args.activations,
        "weights_held": str(ours.weights),
        "ctx": args.ctx, "chunks": n_chunk, "tokens_scored": count, "text_tokens_kvlab": len(ids),
        "text_tokens_kvlab_with_final_newline": len(ours.tokenizer.encode(text)),
        "ppl_kvlab": round(ppl, 4), "ppl_stderr_kvlab": round(stderr, 5), "running_kvlab": running,
        "seconds_kvlab": round(time.perf_counter() - t0, 1),
    }
    if args.llama_perplexity:
        theirs, _ = llama_run(args.llama_perplexity, gguf.path, PERSUASION, args.ctx, args.chunks,
                              shlex.split(args.llama_args))
        n = llama_token_count(args.llama_perplexity, gguf.path, PERSUASION, len(ids))
        result.update({
            "text_tokens_llama_cpp": n, "token_counts_equal": n == len(ids),
            "ppl_llama_cpp": theirs["ppl"], "ppl_stderr_llama_cpp": theirs["ppl_stderr"],
            "chunks_llama_cpp": theirs["chunks"], "running_llama_cpp": theirs["running"],
            "rel_diff": round(ppl / theirs["ppl"] - 1, 5), "seconds_llama_cpp": theirs["seconds"],
            "llama_cpp_command": theirs["command"],
        })
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
