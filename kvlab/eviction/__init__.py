"""Token eviction: which cached tokens a sequence keeps when its cache may not grow without end.

One small interface serves the paged engine and the plain generation loop: a policy is an object
(``EvictionPolicy``, kvlab/eviction/base.py) that looks at a sequence of ``n`` cached positions
cut into units of ``unit`` tokens (a KV block in the engine, one token in the loop) and says
which units stay. The built-in policies, one class each (kvlab/eviction/policies.py):

- ``full``: everything (no eviction);
- ``window``: the most recent tokens only (the lesson's failure case: the first tokens, where
  attention piles up, are lost);
- ``streaming``: ``sinks`` first tokens + the most recent (StreamingLLM, arXiv 2309.17453);
- ``h2o``: half the budget for the recent tokens, half for the "heavy hitters", the tokens with
  the most attention accumulated over every query so far (arXiv 2306.14048);
- ``snapkv``: once the prompt is in, its last ``obs_window`` positions vote (attention summed
  over 7 neighbouring positions) for the earlier tokens worth keeping, + the recent window
  (arXiv 2404.14469). Tokens generated later have no votes: they leave in age order.
- ``adakv``: snapkv's votes per layer and query head, a token kept for its best head's vote
  (Ada-KV's adaptive per-head budgets, arXiv 2407.11550, in a cache every head shares).

The engine, the plain loop and the evaluation ask a policy through its hooks (what it scores,
when it may evict, which units it keeps, its budget: see ``EvictionPolicy``), never by its name;
``make_policy(name, budget)`` turns the CLI's and the server's spelling into one. A new policy
is a subclass that overrides the hooks it changes, made available by ``register``.

One kept set per sequence, shared by all layers and heads: a KV block holds every layer's and
head's K/V of its tokens, so per-head selection (as the papers do) would only mask tokens and
free no memory. Attention scores are summed over layers and heads (adakv: kept per head, and a
token's best head decides), in fixed point (``fixed_point``):
integer sums do not depend on their order, so the same tokens are evicted however the queries
were batched or chunked. Keys keep the RoPE positions
they were written with (evicting never renumbers the rest), as in any paged cache.

A policy evicts only once the kept tokens exceed the budget, and never a unit still being
written (the last one) or a sink. Evicted tokens never come back.

torch is imported only by the functions that handle tensors: the CLI's flag parsing reads the
policy names and budgets (kvlab.options) and must not load it (`kvlab plan` stays instant).
"""

from kvlab.eviction.base import SCORE_ONE, EvictionPolicy, add_scores, fixed_point
from kvlab.eviction.policies import H2O, SNAPKV_POOL, AdaKV, Full, SnapKV, Streaming, Window
from kvlab.eviction.registry import POLICIES, make_policy, parse_budget, policy_class, register, unregister

__all__ = ["H2O", "AdaKV", "POLICIES", "SCORE_ONE", "SNAPKV_POOL", "EvictionPolicy", "add_scores", "Full", "SnapKV", "Streaming",
           "Window", "fixed_point", "make_policy", "parse_budget", "policy_class", "register", "unregister"]
