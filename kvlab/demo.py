"""kvlab's main job on the bundled model: a short seeded workload through the paged engine.

Several conversations share a long opening (as chats share a system prompt), and the cache is
made small enough that the scheduler must preempt. The report puts what the engine did (blocks,
tokens, prefix hits, preemptions, swaps) beside what `kvlab plan` predicts for the same settings.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.engine.llm import LLM
from kvlab.engine.options import EngineOptions
from kvlab.plan import PlanRequest, make_plan
from kvlab.sampling import SamplingParams

PREAMBLE = ("The following is a letter written in the country, in the spring of the year, by a young "
            "lady to her dearest friend, who had lately gone to live in town with her aunt. ")
OPENINGS = [
    "My dear Jane, I have such news to tell you",
    "It is a truth universally acknowledged that",
    "Mr. Darcy called this morning, and",
    "We walked to Meryton yesterday, where",
    "Mama has been very ill, and",
    "You will hardly believe what Lydia has done:",
]


@dataclass
class DemoReport:
    texts: list[tuple[str, str]]
    options: EngineOptions
    metrics: dict
    predicted: dict


def run_demo(model: str | None = None, max_tokens: int = 48, block_size: int = 16,
             preemption: str = "swap-ram") -> DemoReport:
    """Generate a continuation for each opening (greedy) with a cache that holds one whole
    sequence and a little more, so the others wait, share the opening's blocks, and get
    preempted as they grow; collect the cache report."""
    from kvlab.models import load
    from kvlab.models.loader import DEMO_MODEL

    loaded = load(model or DEMO_MODEL)
    prompts = [PREAMBLE + o for o in OPENINGS]
    longest = max(len(loaded.tokenizer.encode(p)) for p in prompts) + max_tokens
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
        texts=[(o, out.text) for o, out in zip(OPENINGS, outs)],
        options=options,
        metrics=vars(llm.metrics()) | {"kv_cache_bytes": cap.bytes},
        predicted={"kv_cache_blocks": plan.kv_cache_blocks, "kv_cache_tokens": plan.kv_cache_tokens,
                   "max_concurrency": plan.max_concurrency,
                   "kv_bytes_per_token": plan.kv_bytes_per_token},
    )
