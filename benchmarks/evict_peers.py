"""kvlab's eviction policies beside NVIDIA kvpress's presses and OpenVINO GenAI's cache eviction on
the same prompts, in one run (issue 38): a table and a plot of accuracy against the KV kept per
sequence.

    .venv/bin/python benchmarks/evict_peers.py --task needle --context 2048 --budgets 256,512 --trials 20

kvlab's rows are `kvlab evict`'s (`kvlab.evaluate.evaluate`: the paged engine, fp32, deterministic,
16-token blocks). The same prompts (`kvlab.ruler.Suite`, the same seed: they are the ones `kvlab
evict` builds) go as kvlab's token ids to benchmarks/kvpress_peer.py in kvpress's own venv
(`bash benchmarks/peers.sh kvpress`), on the same weights: the GGUF's dequantised fp32 tensors,
written once as a Hugging Face folder (`kvlab.gguf.export_folder`). Its `none` row, no press, checks
the harness against kvlab's full cache. The same ids go to benchmarks/openvino_evict_peer.py in
OpenVINO GenAI's venv (`bash benchmarks/peers.sh openvino`), which reads the GGUF itself and runs
it in fp32 under its `CacheEvictionConfig` modes (`none` again the check). Every answer is scored
by kvlab (`Sample.score`). `--presses ''` or `--openvino ''` leaves that peer out, `--policies ''`
kvlab's own rows (they are deterministic: a table taken before holds them).

KV kept per sequence while generating: kvlab's is measured (whole blocks, the budget plus the block
being written); kvpress keeps exactly `budget` tokens per layer (AdaKV: on average over the heads)
in a dense cache, and frees nothing (it masks, one sequence at a time); OpenVINO frees whole
32-token blocks down to `budget` (its `max_cache_size`) once the prompt is in, so its column is the
budget too. Results go to --out:
table.md, results.json, plot.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kvlab.catalog import DEFAULT_MODEL, gguf_file
from kvlab.evaluate import DEFAULT_TEXT, TASKS, evaluate
from kvlab.gguf import export_folder
from kvlab.models import load
from kvlab.ruler import ANSWER_TOKENS, Suite, wilson


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="a GGUF model kvlab names (default: the bundled one)")
    p.add_argument("--task", default="needle", choices=["needle", "ruler"])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--budgets", default="256,512")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--policies", default="full,snapkv,adakv")
    p.add_argument("--presses", default="none,snapkv,adakv,tova,expected_attention,observed_attention,streaming_llm,knorm")
    p.add_argument("--openvino", default="none,sum,norm_sum,kvcrush", help="OpenVINO GenAI's eviction modes")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peers", type=Path, default=Path(os.environ.get("PEERS", "/work/peers")))
    p.add_argument("--out", type=Path, default=Path("out/evict_peers"))
    args = p.parse_args()
    for peer, wanted in (("kvpress", args.presses), ("openvino", args.openvino)):
        if wanted and not (args.peers / peer / "bin/python").is_file():
            raise SystemExit(f"no {peer} venv in {args.peers}: run bash benchmarks/peers.sh {peer}")
    args.out.mkdir(parents=True, exist_ok=True)
    budgets = [int(b) for b in args.budgets.split(",")]
    import torch

    torch.set_num_threads(args.threads)
    loaded = load(args.model, "fp32")
    model, tok = loaded.model, loaded.tokenizer
    print(f"kvlab: {args.task} on {model.name}, {args.context:,} tokens, {args.trials} trials a task", file=sys.stderr)
    policies = [name for name in args.policies.split(",") if name]
    ours = evaluate(model, tok, args.task, policies, budgets, ["auto"], context=args.context,
                    trials=args.trials, chat=loaded.chat_template) if policies else []

    suite = Suite(tok, Path(DEFAULT_TEXT).read_text(), args.context, loaded.chat_template, 0)
    samples = [s for name in TASKS[args.task] for s in suite.samples(name, args.trials)]
    requests = [{"ids": tok.encode(s.prompt), "max_tokens": ANSWER_TOKENS[s.task]} for s in samples]
    (args.out / "requests.json").write_text(json.dumps(requests))
    gguf = gguf_file(args.model)
    if gguf is None:
        raise SystemExit(f"{args.model} is not a GGUF model: the peers read its weights from the file")
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    peers: dict[str, dict] = {}
    commands = []
    if args.presses:
        folder = args.peers / "models" / f"{Path(gguf.path).stem}-hf"
        if not (folder / "model.safetensors").is_file():
            export_folder(gguf, folder)
        commands.append(("kvpress", [str(args.peers / "kvpress/bin/python"), "benchmarks/kvpress_peer.py", str(folder),
                                     str(args.out / "requests.json"), "--presses", args.presses]))
    if args.openvino:
        commands.append(("openvino", [str(args.peers / "openvino/bin/python"), "benchmarks/openvino_evict_peer.py",
                                      str(gguf.path), str(args.out / "requests.json"), "--modes", args.openvino]))
    for peer, cmd in commands:
        cmd += ["--budgets", args.budgets, "--threads", str(args.threads)]
        print(f"{peer}: " + " ".join(cmd), file=sys.stderr)
        t0 = time.perf_counter()
        peers[peer] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout)
        print(f"{peer} took {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    per_token = model.spec.kv_bytes_per_token("fp32")
    tasks = list(TASKS[args.task])
    table = []
    for r in ours:  # one row per policy, budget and task
        table.append(("kvlab", r.policy, r.budget, r.task, r.quality, r.trials, r.kv_bytes_decoding, r.seconds))
    for peer, out in peers.items():
        for row in out["rows"]:
            for task in tasks:
                got = [s.score(tok.decode(ids)) for s, ids in zip(samples, row["outputs"]) if s.task == task]
                prompt = max(len(q["ids"]) for q, s in zip(requests, samples) if s.task == task)
                kept = row["budget"] or prompt
                table.append((peer, row["press"], row["budget"], task, sum(got) / len(got), len(got),
                              kept * per_token, row["seconds"] / len(tasks)))
    results = [dict(zip(("engine", "policy", "budget", "task", "accuracy", "trials", "kv_bytes", "seconds"), t))
               for t in table]
    (args.out / "results.json").write_text(json.dumps({"model": model.name, "task": args.task,
                                                       "context": args.context, "rows": results,
                                                       "peers": {p: {k: v for k, v in o.items() if k != "rows"}
                                                                 for p, o in peers.items()},
                                                       "commands": [c for _, c in commands]}, indent=1))
    lines = [f"| engine | policy / press | budget | {' | '.join(tasks)} | mean [95% CI] | KV kept while generating | time |",
             "| --- " * (6 + len(tasks)) + "|"]
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["engine"], r["policy"], r["budget"]), []).append(r)
    for (engine, policy, budget), rs in groups.items():
        mean = sum(r["accuracy"] for r in rs) / len(rs)
        n = sum(r["trials"] for r in rs)
        lo, hi = wilson(mean * n, n)
        lines.append(f"| {engine} | {policy} | {budget or '-'} | "
                     + " | ".join(f"{r['accuracy']:.0%}" for r in rs)
                     + f" | {mean:.0%} [{lo:.0%}-{hi:.0%}] | {max(r['kv_bytes'] or 0 for r in rs) / 2**20:.1f} MiB"
                     f" | {sum(r['seconds'] for r in rs):.0f} s |")
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(groups, args.out / "plot.png", f"{args.task} on {model.name}, {args.context:,} tokens")


def plot(groups: dict[tuple, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines: dict[tuple, list[tuple[float, float]]] = {}
    for (engine, policy, _), rs in groups.items():
        mean = sum(r["accuracy"] for r in rs) / len(rs)
        lines.setdefault((engine, policy), []).append((max(r["kv_bytes"] or 0 for r in rs) / 2**20, mean))
    for (engine, policy), pts in sorted(lines.items()):
        pts.sort()
        ax.plot([x for x, _ in pts], [y for _, y in pts], "-o" if engine == "kvlab" else "--s",
                label=f"{engine}: {policy}")
    ax.set_xlabel("KV cache kept per sequence while generating (MiB)")
    ax.set_ylabel("accuracy (mean over the tasks)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
