"""kvlab's main job on the default model: six chats through the paged engine, told as a story.

The chats share a system prompt, so the blocks of that shared opening are computed once and then
found in the prefix cache; the cache holds about one and a half chats, so the scheduler must
preempt: a chat leaves the cache (its blocks swapped to RAM, or dropped to be recomputed) and comes
back when there is room. The engine is stepped here one step at a time so the report can say
when each chat left and came back, and every figure is put beside what `kvlab plan` predicts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvlab.catalog import DEFAULT_MODEL
from kvlab.engine.llm import LLM
from kvlab.options import EngineOptions
from kvlab.engine.sequence import NULL_BLOCK
from kvlab.models.loader import Loaded
from kvlab.plan import PlanRequest, make_plan
from kvlab.progress import Report, no_report
from kvlab.sampling import SamplingParams

SYSTEM = ("You are a concise assistant for engineers who serve large language models. Answer "
          "every question in one or two plain sentences, without lists.")
QUESTIONS = [
    "What is the capital of France?",
    "What is a KV cache in a transformer?",
    "Why do language models generate text one token at a time?",
    "What does a GPU do?",
    "Name three planets of the solar system.",
    "What is the boiling point of water?",
]
SPARE_BLOCKS = 3  # beyond one whole chat: room for a second chat's start, not for all six


def conversations(loaded: Loaded) -> list[list[int]]:
    """Each question as a chat after the shared system prompt, through the model's template."""
    return [loaded.chat_template.encode(loaded.tokenizer, [{"role": "system", "content": SYSTEM},
                                                           {"role": "user", "content": q}])
            for q in QUESTIONS]


@dataclass
class Chat:
    """One conversation: what was asked, what came back, what the cache did for it."""

    question: str
    answer: str
    prompt_tokens: int  # system prompt + question, through the chat template
    answer_tokens: int
    cached_tokens: int  # prompt tokens found in the prefix cache (not computed)
    preemptions: int  # times it had to leave the cache


@dataclass
class Move:
    """A chat leaving the cache (preempted) or coming back, at an engine step."""

    step: int
    chat: int  # index into QUESTIONS
    left: bool  # True: preempted; False: back in the cache
    how: str  # "swapped out to RAM" / "dropped, to recompute" / "swapped back in" / "recomputed"
    blocks: int  # blocks it held when it left (and gets back, copied or recomputed)
    why: str  # what made it leave, or what let it come back


@dataclass
class DemoReport:
    model: str
    system: str
    shared_tokens: int  # the tokens every conversation opens with (the system prompt, templated)
    chats: list[Chat]
    moves: list[Move]
    steps: int
    dtype: str  # the model's dtype and why (auto's choice or as asked)
    deterministic: bool  # the engine's mode: batch-invariant kernels, or the fast ones
    deterministic_why: str  # the flag, or auto's reason
    options: EngineOptions
    max_model_len: int  # longest conversation: prompt + max_tokens
    metrics: dict  # the engine's EngineMetrics plus kv_cache_bytes and kv_bytes_per_token
    predicted: dict  # the same figures from kvlab plan
    plan_command: str  # the `kvlab plan` line that predicts them


def _chats(indices: list[int]) -> str:
    names = [str(i + 1) for i in sorted(indices)]
    return "chat " + names[0] if len(names) == 1 else "chats " + ", ".join(names[:-1]) + " and " + names[-1]


def _track(llm: LLM, prompts: list[list[int]], params: SamplingParams, progress: Report
           ) -> tuple[list, list[Move], int]:
    """Run the requests step by step; note each change of a chat's place (running, swapped,
    waiting) from the scheduler's sequences, which the server's live view reads too, with its
    reason. Progress: answer tokens written (a finished chat counts its whole max_tokens)."""
    engine = llm.engine
    kv = engine.kv
    space = "disk" if engine.options.preemption == "swap-disk" else "RAM"
    rids = [engine.add_request(p, params) for p in prompts]
    chat = {rid: i for i, rid in enumerate(rids)}
    total = len(prompts) * params.max_tokens
    final, moves, where, held, step = {}, [], {}, {}, 0
    finished_since: list[int] = []  # chats that ended since the last step where one came back
    what = f"answering {len(prompts)} chats"
    progress(0, total, what)
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
                finished_since.append(chat[out.request_id])
        seqs = engine.scheduler.requests
        came_back = False
        for rid, seq in seqs.items():
            status = seq.status.value
            blocks = sum(b != NULL_BLOCK for t in seq.block_tables for b in t)
            before = where.get(rid)
            if before == "running" and status != "running":
                why = "the running chats needed a new block, none was free, and it was admitted last"
                if status == "swapped":
                    how = f"swapped out to {space}"
                else:
                    how = "dropped, to recompute"
                    if kv.num_host_blocks:  # a swap run: the swap space had no room for it
                        on_host = [chat[r] for r, s in seqs.items() if s.status.value == "swapped"]
                        why += (f"; the {space} swap space had only {len(kv.host_free[0])} of its "
                                f"{kv.num_host_blocks} blocks free"
                                + (f" ({_chats(on_host)} swapped there)" if on_host else "")
                                + f", fewer than its {held[rid]}, so they were dropped, not copied")
                moves.append(Move(step, chat[rid], True, how, held[rid], why))
            elif before in ("swapped", "waiting") and status == "running" and held.get(rid):
                why = (f"{_chats(finished_since)} finished and freed blocks" if finished_since
                       else "enough blocks were free again for its next chunk")
                moves.append(Move(step, chat[rid], False, "swapped back in" if before == "swapped"
                                  else "recomputed", held[rid], why))
                came_back = True
            where[rid] = status
            if status == "running":
                held[rid] = blocks
        if came_back:
            finished_since = []
        written = params.max_tokens * len(final) + sum(len(seq.output_ids) for r, seq in seqs.items()
                                                       if r not in final)
        progress(written, total, what)
    return [final[rid] for rid in rids], moves, step


def run_demo(model: str | None = None, max_tokens: int = 48, block_size: int = 16,
             preemption: str = "swap-ram", tp: int = 1, progress: Report = no_report) -> DemoReport:
    """Answer each question (greedy) with a cache that holds one whole conversation and a little
    more, so the others wait, share the system prompt's blocks, and get preempted as they grow.
    With ``tp`` > 1 the model runs on that many worker processes and the cache figures are each
    rank's (its share of the KV heads, the same blocks)."""
    from kvlab.models import load

    loaded = load(model)
    prompts = conversations(loaded)
    longest = max(len(p) for p in prompts) + max_tokens
    blocks = -(-longest // block_size) + SPARE_BLOCKS
    spec = loaded.model.spec
    # sized in the model's dtype (auto: bf16 or fp32 by machine), the cache's by default
    options = EngineOptions(kv_memory=blocks * block_size * spec.tp_shard(tp).kv_bytes_per_token(loaded.dtype.name),
                            block_size=block_size, max_num_seqs=len(prompts),
                            max_num_batched_tokens=256, preemption=preemption,
                            max_model_len=longest, tp=tp)
    llm = LLM(loaded.model, tokenizer=loaded.tokenizer, **vars(options))
    try:
        outs, moves, steps = _track(llm, prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                                    progress)
    finally:
        llm.close()
    cap = llm.capacity
    plan = make_plan(spec, PlanRequest(context=longest, kv_dtype=cap.kv_dtype, gpu="cpu",
                                       kv_memory=options.kv_memory, block_size=block_size,
                                       max_model_len=longest, tp=tp))
    name = model or DEFAULT_MODEL
    return DemoReport(
        model=loaded.model.name, system=SYSTEM,
        shared_tokens=len(os.path.commonprefix(prompts)),
        chats=[Chat(q, out.text, len(out.prompt_token_ids), len(out.token_ids), out.num_cached_tokens,
                    out.num_preemptions) for q, out in zip(QUESTIONS, outs, strict=True)],
        moves=moves, steps=steps, dtype=str(loaded.dtype), deterministic=bool(llm.engine.options.deterministic),
        deterministic_why=llm.engine.deterministic_why, options=options, max_model_len=longest,
        metrics=vars(llm.metrics()) | {"kv_cache_bytes": cap.bytes, "kv_bytes_per_token": cap.bytes_per_token},
        predicted={"kv_cache_blocks": plan.kv_cache_blocks, "kv_cache_tokens": plan.kv_cache_tokens,
                   "max_concurrency": plan.max_concurrency, "kv_bytes_per_token": plan.kv_bytes_per_token_per_gpu},
        plan_command=(f"kvlab plan {name} --kv-dtype {cap.kv_dtype} --kv-memory {options.kv_memory} "
                      f"--block-size {block_size} --max-model-len {longest}" + (f" --tp {tp}" if tp > 1 else "")),
    )
