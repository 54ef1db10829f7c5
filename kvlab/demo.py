"""kvlab's main job on the bundled model: a short seeded workload through the paged engine.

Several chats share a system prompt (so their first blocks are computed once and then found in
the prefix cache), and the cache is made small enough that the scheduler must preempt. The report puts what the engine did (blocks,
tokens, prefix hits, preemptions, swaps) beside what `kvlab plan` predicts for the same settings.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.engine.llm import LLM
from kvlab.engine.options import EngineOptions
from kvlab.models.loader import Loaded
from kvlab.plan import PlanRequest, make_plan
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


def conversations(loaded: Loaded) -> list[list[int]]:
    """Each question as a chat after the shared system prompt, through the model's template."""
    return [loaded.chat_template.encode(loaded.tokenizer, [{"role": "system", "content": SYSTEM},
                                                           {"role": "user", "content": q}])
            for q in QUESTIONS]


@dataclass
class DemoReport:
    texts: list[tuple[str, str]]
    options: EngineOptions
    metrics: dict
    predicted: dict


def run_demo(model: str | None = None, max_tokens: int = 48, block_size: int = 16,
             preemption: str = "swap-ram") -> DemoReport:
    """Answer each question (greedy) with a cache that holds one whole conversation and a little
    more, so the others wait, share the system prompt's blocks, and get preempted as they grow;
    collect the cache report."""
    from kvlab.models import load

    loaded = load(model)
    prompts = conversations(loaded)
    longest = max(len(p) for p in prompts) + max_tokens
    blocks = -(-longest // block_size) + 3
    spec = loaded.model.spec
    options = EngineOptions(kv_memory=blocks * block_size * spec.kv_bytes_per_token("bf16"),
                            block_size=block_size, max_num_seqs=len(prompts),
                            max_num_batched_tokens=256, preemption=preemption,
                            max_model_len=longest)
    llm = LLM(loaded.model, tokenizer=loaded.tokenizer, **vars(options))
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    cap = llm.capacity
    plan = make_plan(spec, PlanRequest(context=longest, kv_dtype=cap.kv_dtype, gpu="cpu",
                                       kv_memory=options.kv_memory, block_size=block_size,
                                       max_model_len=longest))
    return DemoReport(
        texts=[(q, out.text) for q, out in zip(QUESTIONS, outs)],
        options=options,
        metrics=vars(llm.metrics()) | {"kv_cache_bytes": cap.bytes},
        predicted={"kv_cache_blocks": plan.kv_cache_blocks, "kv_cache_tokens": plan.kv_cache_tokens,
                   "max_concurrency": plan.max_concurrency,
                   "kv_bytes_per_token": plan.kv_bytes_per_token},
    )
