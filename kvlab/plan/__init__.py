"""The planner: KV-cache memory, weights, capacity, tensor parallelism, speed bounds, and what
vLLM and llama.cpp will allocate.

    planner.py     PlanRequest, Plan and make_plan, which runs the steps below in order
    parallel.py    valid TP sizes, each GPU's share of a cache
    memory.py      cache per token / sequence / layer kind, weights (the budget itself is
                   kvlab.layout.memory_budget, shared with the engine)
    capacity.py    longest context that fits, GPUs needed
    speed.py       the FLOP count (forward_flops), the crossover and compute-bound batches, the
                   cache / no-cache work table in tokens and FLOPs
    engines/       vllm.py and llamacpp.py: those engines' own log lines and command lines

It stands on the standard library and the catalogue (no torch, no numpy), so `kvlab plan` answers
at once; tests/test_cli_plan.py holds it to that.
"""

from kvlab.plan.parallel import valid_tp_sizes
from kvlab.plan.planner import Plan, PlanRequest, make_plan
from kvlab.plan.speed import decode_flops, forward_flops, generation_flops, prefill_flops, work_table

__all__ = ["Plan", "PlanRequest", "make_plan", "valid_tp_sizes", "decode_flops", "forward_flops",
           "generation_flops", "prefill_flops", "work_table"]
