"""What eviction (and a lossy KV dtype) costs in quality: ``kvlab evict``.

Two tasks, each run per policy x budget x KV dtype on one model:

- ``perplexity``: teacher-forced perplexity over a long text (default: the first four chapters of
  Jane Austen's *Persuasion*, public domain, shipped in ``kvlab/data``). The text goes through
  the paged engine as one prompt in chunks of ``chunk`` tokens, the policy evicting blocks
  between chunks as it would during generation; every token after the first is scored from the
  logits of the position before it (prompt log-probabilities). The same text also runs through
  the plain loop's token-granular cache (``EvictingKVCache``): the difference between the two is
  the price of evicting whole blocks. SnapKV compresses a finished prompt, and a teacher-forced
  text is one prompt to its end, so it has no perplexity row of its own meaning (it equals full).
- ``ruler``: the retrieval tasks of ``kvlab.ruler`` (needles of several kinds, variable tracking,
  a question about the text), built from the same text, each trial's facts at a known depth;
  greedy answers from the engine, a task's trials batched; accuracy = the answers found, with
  its 95% interval. ``needle`` is the suite's single needle alone.

Quality runs in deterministic mode by default (``--no-deterministic`` to compare): batch-invariant
kernels, so a needle trial's answer does not depend on the trials batched beside it, and eviction
points do not depend on how the prompts were cut into chunks. And in fp32 by default: bf16
near-ties would make the figures fragile to any change of kernel.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvlab.data import PERSUASION
from kvlab.engine.engine import MODEL_KV_DTYPE
from kvlab.engine.llm import LLM
from kvlab.dtypes import kv_dtype as storage_dtype
from kvlab.engine.sequence import NULL_BLOCK
from kvlab.layout import layer_groups
from kvlab.eviction import EvictionPolicy, make_policy, policy_class
from kvlab.models.attention import EvictingKVCache
from kvlab.models.chat import ChatTemplate
from kvlab.models.llama import CausalLM
from kvlab.models.tokenizer import TextTokenizer
from kvlab.progress import Report, no_report
from kvlab.ruler import ANSWER_TOKENS, Sample, Suite, wilson
from kvlab.ruler import TASKS as RULER_TASKS
from kvlab.sampling import SamplingParams

DEFAULT_TEXT = PERSUASION
TASKS = {"perplexity": (), "needle": ("niah_single",), "ruler": RULER_TASKS}  # --task: its retrieval tasks

Tick = Callable[[int], None]  # tick(tokens): that many more tokens went through the model


@dataclass
class EvictRow:
    task: str
    policy: str
    budget: int | float | None
    kv_dtype: str
    quality: float | None  # perplexity (lower is better) or accuracy in [0, 1] (higher is better)
    quality_token: float | None  # perplexity with token-granular eviction (the plain loop)
    kv_bytes_kept: int  # peak bytes one sequence held
    blocks_freed: int
    tokens_evicted: int
    seconds: float
    trials: int = 1
    # the plain loop again, positions renumbered inside the cache (StreamingLLM) instead of kept
    quality_token_renumbered: float | None = None
    interval: tuple[float, float] | None = None  # an accuracy's 95% Wilson interval
    # the most one sequence held while it generated, once its prompt was in and compressed (what
    # a policy that waits for the prompt keeps); None: it generated nothing (perplexity)
    kv_bytes_decoding: int | None = None


def text_ids(tokenizer: TextTokenizer, path: str | Path | None, context: int) -> list[int]:
    ids = tokenizer.encode(Path(path or DEFAULT_TEXT).read_text())
    if len(ids) < context:
        raise ValueError(f"{path or DEFAULT_TEXT} has {len(ids)} tokens, fewer than --context {context}")
    return ids[:context]


def _llm(model: CausalLM, tokenizer: TextTokenizer, policy: EvictionPolicy, kv_dtype: str,
         block_size: int, chunk: int, context: int, sequences: int, deterministic: bool) -> LLM:
    # the previous row's engine holds GBs of cache in reference cycles that gc sees only rarely
    # (tensors do not count toward its thresholds): free it before this one allocates
    gc.collect()
    stored = MODEL_KV_DTYPE[model.dtype] if kv_dtype == "auto" else kv_dtype
    blocks = sequences * (math.ceil(context / block_size) + 2)  # room for every policy, full too
    # swap, never recompute (there is room for all, so neither happens; deterministic mode
    # refuses recompute under eviction)
    return LLM(model, tokenizer=tokenizer, kv_policy=policy.name, kv_budget=policy.budget,
               kv_dtype=kv_dtype, block_size=block_size, max_num_batched_tokens=chunk,
               max_num_seqs=sequences, max_model_len=context + 16, prefix_caching=False,
               kv_memory=blocks * block_size * model.spec.kv_bytes_per_token(stored),
               deterministic=deterministic, preemption="swap-ram")


def _peak(llm: LLM, run: Callable[[], None], tick: Tick) -> tuple[int, int, float]:
    """Run while watching the engine: (most KV bytes one sequence held after a step's eviction,
    before finished requests let go of theirs; the most once past its prompt; seconds);
    ``tick`` the tokens of each step. A sequence's bytes: its blocks in every layer group (a
    hybrid model's sliding groups hold their window, its full groups what the policy kept)."""
    peak = decoding = 0
    engine = llm.engine
    scheduler = engine.scheduler
    layers, stored = engine.model.spec.layers, storage_dtype(engine.capacity.kv_dtype)
    block_bytes = [engine.capacity.block_size * sum(layers[i].kv_bytes_per_token(stored) for i in g.layers)
                   for g in engine.kv.groups]
    update = scheduler.update

    def watched(out, *args, **kwargs):
        nonlocal peak, decoding
        update(out, *args, **kwargs)
        tick(sum(chunk.num_tokens for chunk in out.chunks))
        for seq in scheduler.running:
            held = sum(size * sum(b != NULL_BLOCK for b in table)
                       for size, table in zip(block_bytes, seq.block_tables))
            peak = max(peak, held)
            if seq.num_computed_tokens > seq.num_prompt_tokens:
                decoding = max(decoding, held)
    scheduler.update = watched  # type: ignore[method-assign]
    t0 = time.perf_counter()
    try:
        run()
    finally:
        scheduler.update = update  # type: ignore[method-assign]
    return peak, decoding, time.perf_counter() - t0


def perplexity_engine(model: CausalLM, tokenizer: TextTokenizer, ids: list[int], policy: EvictionPolicy,
                      kv_dtype: str, block_size: int, chunk: int, deterministic: bool = True,
                      tick: Tick = lambda n: None) -> EvictRow:
    llm = _llm(model, tokenizer, policy, kv_dtype, block_size, chunk, len(ids), 1, deterministic)
    result = {}

    def run():
        result["out"] = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    peak, _, seconds = _peak(llm, run, tick)
    scored = [lp.logprob for lp in result["out"].prompt_logprobs if lp is not None]
    m = llm.metrics()
    return EvictRow("perplexity", policy.name, policy.budget, llm.capacity.kv_dtype,
                    math.exp(-sum(scored) / len(scored)), None,
                    peak, m.evicted_blocks,
                    m.evicted_tokens, seconds)


@torch.inference_mode()
def perplexity_loop(model: CausalLM, ids: list[int], policy: EvictionPolicy, chunk: int,
                    renumber: bool = False, tick: Tick = lambda n: None) -> float:
    """The same perplexity with token-granular eviction in the plain loop's compacting cache;
    ``renumber``: RoPE positions are places in the cache (StreamingLLM), not the text's."""
    held = policy.max_tokens_held(len(ids), len(ids), chunk, 1)
    cache = EvictingKVCache(model.spec, policy, held, len(ids), model.dtype, model.device,
                            renumber=model.inv_freq if renumber else None)
    nll, count = 0.0, 0
    for a in range(0, len(ids), chunk):
        piece = torch.tensor(ids[a:a + chunk], device=model.device)
        positions = cache.prepare(len(piece))
        logits = model(piece, positions, cache, None).float()
        cache.evict()
        targets = ids[a + 1:a + 1 + len(piece)]
        logp = torch.log_softmax(logits[:len(targets)], dim=-1)
        nll -= float(logp[torch.arange(len(targets)), torch.tensor(targets)].sum())
        count += len(targets)
        tick(len(piece))
    return math.exp(nll / count)


def retrieval(model: CausalLM, tokenizer: TextTokenizer, samples: list[Sample], policy: EvictionPolicy,
              kv_dtype: str, block_size: int, chunk: int, deterministic: bool = True,
              tick: Tick = lambda n: None) -> EvictRow:
    """One task's samples through the engine under ``policy``, all batched, greedy answers."""
    task = samples[0].task
    prompts = [tokenizer.encode(s.prompt) for s in samples]
    answer = ANSWER_TOKENS[task]
    llm = _llm(model, tokenizer, policy, kv_dtype, block_size, chunk, max(map(len, prompts)) + answer,
               len(samples), deterministic)
    result = {}

    def run():
        result["outs"] = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=answer, ignore_eos=True))
    peak, decoding, seconds = _peak(llm, run, tick)
    score = sum(s.score(out.text) for s, out in zip(samples, result["outs"]))
    m = llm.metrics()
    return EvictRow(task, policy.name, policy.budget, llm.capacity.kv_dtype, score / len(samples), None,
                    peak, m.evicted_blocks,
                    m.evicted_tokens, seconds, len(samples), interval=wilson(score, len(samples)),
                    kv_bytes_decoding=decoding)


def evaluate(model: CausalLM, tokenizer: TextTokenizer, task: str, policies: list[str],
             budgets: list[int | float], kv_dtypes: list[str], *, text: str | Path | None = None,
             context: int = 2048, block_size: int = 16, chunk: int = 64, trials: int = 20,
             token_reference: bool = True, deterministic: bool = True, chat: ChatTemplate | None = None,
             seed: int = 0, progress: Report = no_report) -> list[EvictRow]:
    """One row per policy x budget x KV dtype (``full`` once per dtype, its budget None), and for
    ``needle`` and ``ruler`` per retrieval task, their prompts through ``chat`` (the model's
    template, if it has one); progress in tokens through the model."""
    if task not in TASKS:
        raise ValueError(f"--task is {', '.join(TASKS)}, not {task!r}")
    ids = text_ids(tokenizer, text, context)
    samples = {}
    if TASKS[task]:
        suite = Suite(tokenizer, Path(text or DEFAULT_TEXT).read_text(), context, chat, seed)
        samples = {name: suite.samples(name, trials) for name in TASKS[task]}
    configs = [make_policy(p, b) for p in policies for b in (budgets if policy_class(p).active else [None])]
    for c in configs:
        c.check_unit(block_size)
    # the plain loop's compacting cache holds full-attention layers only
    compacting = all(g.window is None for g in layer_groups(model.spec))

    def loops(policy: EvictionPolicy, kv_dtype: str) -> tuple[bool, ...]:
        """The plain-loop references of a perplexity row: renumber False, then True."""
        if not token_reference or not compacting or kv_dtype not in ("auto", "fp32"):
            return ()
        return (False, True) if policy.active and not policy.waits_for_prompt else (False,)

    def units(policy: EvictionPolicy, kv_dtype: str) -> int:
        if task != "perplexity":  # each prompt is about len(ids) tokens
            return sum(trials * (len(ids) + ANSWER_TOKENS[name]) for name in samples)
        return len(ids) * (1 + len(loops(policy, kv_dtype)))
    total = sum(units(p, d) for d in kv_dtypes for p in configs)
    done, what = 0, ""

    def tick(tokens: int) -> None:
        nonlocal done
        done = min(total, done + tokens)
        progress(done, total, what)
    rows = []
    for kv_dtype in kv_dtypes:
        for policy in configs:
            end = done + units(policy, kv_dtype)
            label = f"{policy.name}{f' {policy.budget}' if policy.budget else ''}, KV {kv_dtype}"
            if task != "perplexity":
                for name, trial in samples.items():
                    what = f"{name}, {label}"
                    tick(0)
                    rows.append(retrieval(model, tokenizer, trial, policy, kv_dtype, block_size, chunk,
                                          deterministic, tick))
            else:
                what = f"{task}, {label}"
                tick(0)
                row = perplexity_engine(model, tokenizer, ids, policy, kv_dtype, block_size, chunk,
                                        deterministic, tick)
                for renumber in loops(policy, kv_dtype):
                    ppl = perplexity_loop(model, ids, policy, chunk, renumber, tick)
                    if renumber:
                        row.quality_token_renumbered = ppl
                    else:
                        row.quality_token = ppl
                rows.append(row)
            tick(max(0, end - done))  # the row's whole share, whatever its steps counted
    return rows


def rows_json(rows: list[EvictRow]) -> list[dict]:
    return [asdict(r) for r in rows]


def plot_rows(rows: list[EvictRow], path: str | Path) -> None:
    """Quality against KV bytes kept, one line per policy and dtype (kvpress-style)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    task = rows[0].task if rows else ""
    tasks = list(dict.fromkeys(r.task for r in rows))
    if task != "perplexity" and len(tasks) > 1:  # one point per configuration: its tasks' mean
        task = f"mean of {', '.join(tasks)}"
        configs: dict[tuple, list[EvictRow]] = {}
        for r in rows:
            configs.setdefault((r.policy, r.budget, r.kv_dtype), []).append(r)
        rows = [EvictRow(task, p, b, d, sum(r.quality or 0 for r in g) / len(g), None,
                         max(r.kv_bytes_kept for r in g), 0, 0, 0.0,
                         kv_bytes_decoding=max(r.kv_bytes_decoding or 0 for r in g))
                for (p, b, d), g in configs.items()]
    # snapkv's perplexity is full's by construction (see the module doc): drawn, it would hide full
    keys = sorted({(r.policy, r.kv_dtype) for r in rows
                   if not (task == "perplexity" and policy_class(r.policy).waits_for_prompt)})
    for policy, dtype in keys:
        # retrieval: what stays for generating (a policy that waits for the prompt holds all of it
        # first: the table's peak says so); perplexity: the peak
        pts = sorted((r.kv_bytes_decoding or r.kv_bytes_kept, r.quality) for r in rows
                     if (r.policy, r.kv_dtype) == (policy, dtype) and r.quality is not None)
        style = "-o" if policy_class(policy).active else "o"
        ax.plot([p[0] / 2**20 for p in pts], [p[1] for p in pts], style, label=f"{policy} ({dtype})")
    ax.set_xlabel("KV cache kept per sequence (MiB, peak)" if task == "perplexity"
                  else "KV cache kept per sequence while generating (MiB)")
    ax.set_ylabel("perplexity (lower is better)" if task == "perplexity" else "accuracy")
    if task == "perplexity":
        from matplotlib.ticker import ScalarFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.set_title(f"kvlab evict: {task}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
