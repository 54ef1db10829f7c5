"""Token eviction, planned (``kvlab plan --kv-policy P --kv-budget B``): the cache a sequence keeps
under the policy in kvlab's engine, the sequences that buys in the same KV budget, and the accuracy
``kvlab evict --task ruler`` (or ``needle``) measured for that policy on a model of the same family.

The bytes follow the engine's rules (``kvlab.eviction``, ``kvlab.engine.kv_manager``): whole
blocks, the budget plus the block being written; full-attention layers evict, sliding and chunked
layers keep their window; a policy that waits for the prompt (snapkv, adakv) holds the whole
prompt until it is in, so that peak is one sequence's at a time only if prompts go in one by one.

The accuracy comes from ``kvlab/catalog/eviction.json``: figures measured on real models, each
with the command and the CPU that measured it. A plan quotes the rows of its model's family
(``model_type``) nearest its budget ratio, and says when there are none.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from kvlab.eviction import make_policy
from kvlab.layout import layer_groups
from kvlab.spec import ModelSpec

MEASURED = Path(__file__).resolve().parent.parent / "catalog" / "eviction.json"


@dataclass(frozen=True)
class Measured:
    """One measured row of ``kvlab evict``: a policy's accuracy on a task suite, beside the full
    cache's on the same prompts."""

    model: str
    model_type: str
    task: str  # needle | ruler
    context: int
    policy: str
    budget: int  # tokens kept per sequence
    accuracy: float
    low: float  # its 95% Wilson interval
    high: float
    full_accuracy: float  # the full cache's on the same prompts
    trials: int  # prompts per task
    command: str
    cpu: str

    @property
    def ratio(self) -> float:
        return self.budget / self.context


@dataclass(frozen=True)
class EvictionPlan:
    policy: str
    budget: int | float
    budget_tokens: int  # at the plan's context
    held_tokens_generating: int  # a full-attention layer's tokens per sequence while it generates
    held_tokens_peak: int  # ... at most, the prompt going in (snapkv/adakv: the whole prompt)
    bytes_per_sequence: int  # per GPU, while it generates
    bytes_per_sequence_peak: int
    bytes_per_sequence_full: int  # the same sequence without eviction
    saved_fraction: float  # of the full sequence's cache, while it generates
    max_sequences: int  # generating at once in the plan's KV budget (whole-cache figure: max_sequences)
    max_sequences_full: int
    measured: list[Measured] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@cache
def measured_rows() -> tuple[Measured, ...]:
    return tuple(Measured(**row) for row in json.loads(MEASURED.read_text())["rows"])


def nearest_measured(spec: ModelSpec, policy: str, ratio: float) -> list[Measured]:
    """The rows of ``spec``'s family for ``policy`` at the measured budget ratio nearest ``ratio``
    (every model and task measured there), longest context first."""
    rows = [r for r in measured_rows() if r.model_type == spec.model_type and r.policy == policy]
    if not rows:
        return []
    best = min(abs(r.ratio - ratio) for r in rows)
    return sorted((r for r in rows if abs(r.ratio - ratio) == best), key=lambda r: (-r.context, r.model, r.task))


def plan_eviction(spec: ModelSpec, policy_name: str, budget: int | float | None, context: int,
                  block_size: int, chunk: int, tp: int, sequence_bytes: Callable[[int | None], int],
                  sequences: Callable[[int], int]) -> EvictionPlan:
    """The plan of ``policy_name`` at ``budget`` for sequences of ``context`` tokens, in blocks of
    ``block_size`` and prompt chunks of ``chunk``. The planner's own rules give the bytes and the
    count: ``sequence_bytes(kept)`` one sequence's cache per GPU with ``kept`` tokens on its full
    layers (None: all), ``sequences(bytes)`` how many such sequences the KV budget holds."""
    policy = make_policy(policy_name, budget)  # a one-line ValueError for a bad policy or budget
    policy.check_unit(block_size)
    assert policy.budget is not None
    # while generating: the budget in whole blocks and the block a decode writes into (no chunk)
    generating = policy.max_tokens_held(0, context, 0, block_size)
    peak = policy.max_tokens_held(context, context, chunk, block_size)
    full, kept, kept_peak = sequence_bytes(None), sequence_bytes(generating), sequence_bytes(peak)
    notes = []
    if all(g.window is not None for g in layer_groups(spec)):
        notes.append(f"every cached layer of {spec.name} has a window at {context:,} tokens: the engine "
                     f"has nothing to evict (kvlab's engine refuses --kv-policy on it)")
    if policy.needs_scores and tp > 1:
        notes.append(f"--kv-policy {policy.name} reads attention scores, which kvlab's engine does not gather "
                     f"across TP ranks: it runs at --tp 1 only")
    if policy.waits_for_prompt:
        notes.append(f"{policy.name} holds the whole prompt ({peak:,} tokens) until it is in, then keeps "
                     f"{generating:,}: the sequences generating at once are counted after that")
    measured = nearest_measured(spec, policy.name, policy.budget_tokens(context) / context)
    if not measured and policy.active:
        notes.append(f"no accuracy measured for --kv-policy {policy.name} on a {spec.model_type} model: "
                     f"kvlab evict MODEL --task ruler --context {context} --budgets {policy.budget} measures it")
    return EvictionPlan(
        policy=policy.name, budget=policy.budget, budget_tokens=policy.budget_tokens(context),
        held_tokens_generating=generating, held_tokens_peak=peak,
        bytes_per_sequence=kept, bytes_per_sequence_peak=kept_peak, bytes_per_sequence_full=full,
        saved_fraction=1 - kept / full if full else 0.0,
        max_sequences=sequences(kept), max_sequences_full=sequences(full), measured=measured, notes=notes)
