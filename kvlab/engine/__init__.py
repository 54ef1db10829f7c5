"""The paged KV-cache engine: continuous batching over a block pool with prefix caching.

    sequence.py    a request's tokens, block tables and status
    block_pool.py  blocks, reference counts, chained prefix hashes, LRU of cached free blocks
    kv_manager.py  block tables across layer groups: prefix hits, sliding windows, swap bookkeeping
    scheduler.py   continuous batching, chunked prefill, preemption
    kv_cache.py    the tensors: per-layer blocks, fp8 / int8 with scales, the host swap pool
    attention.py   paged attention backend (plain PyTorch)
    runner.py      a scheduled step -> the model's input (plain data)
    executor.py    where the model runs: here, or N tensor-parallel worker processes
    output.py      detokenising and stop rules of a request's tokens (the plain loop's too)
    engine.py      LLMEngine: requests in, token deltas out; metrics
    llm.py         LLM: the public API

Block counts, memory budgets and TP rules live below the engine, in ``kvlab.layout`` (the planner
shares them); nothing is imported here.
"""
