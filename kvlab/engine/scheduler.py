"""Continuous batching: which tokens of which sequences run in the next step.

Each step (as vLLM v1) spends a token budget: first on the running sequences in admission order
(one token for a decode, a chunk for an unfinished prefill), then on admitting waiting ones (FCFS,
preempted ones first). A prefill longer than what is left of the budget runs in chunks over
several steps. When a running sequence needs blocks and none are left, the latest-admitted
sequence is preempted: its blocks are freed (recompute: it restarts from its prefix-cache hits)
or copied to the host pool (swap), and it goes back to the front of the queue. Either way the
tokens it will produce are the same; only the time differs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from kvlab.eviction import EvictionPolicy, Full
from kvlab.engine.kv_manager import BlockCopies, BlockLoads, KVCacheManager
from kvlab.engine.sequence import SeqStatus, Sequence
from kvlab.layout import cdiv


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute positions [start, start + num_tokens) of `seq` in this step. `samples`: the chunk
    reaches the sequence's last token, so its logits give the next token."""

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool

    @classmethod
    def of(cls, seq: Sequence, start: int, num_tokens: int) -> ScheduledChunk:
        return cls(seq, start, num_tokens, start + num_tokens == seq.num_tokens)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    swap_out: BlockCopies  # (device, host) per group: run before the forward pass
    swap_in: BlockCopies  # (host, device) per group: run after swap_out, before the forward pass
    preempted: list[Sequence] = field(default_factory=list)
    loads: BlockLoads = field(default_factory=list)  # prefix-tier blocks: after swap_in, before the pass

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, swap: bool = False,
                 eviction: EvictionPolicy = Full(), eviction_grid: int | None = None) -> None:
        """``eviction_grid`` (deterministic mode): while a prompt goes in, a lossy policy evicts
        only when the computed tokens reach a multiple of it (or the prompt's end), and no prompt
        chunk crosses one; so what a sequence keeps does not depend on how the other requests cut
        its prompt into chunks."""
        self.kv = kv
        self.eviction = eviction
        self.eviction_grid = eviction_grid if eviction.active and not eviction.waits_for_prompt else None
        self.num_evicted_blocks = 0
        self.num_evicted_tokens = 0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.swap = swap
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.requests: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache (first admissions)
        self.prefix_hits = 0  # of which found cached
        self.tier_hits = 0  # of which loaded from a prefix tier (kvlab.engine.tiers)
        self._admissions = 0

    # --- requests -------------------------------------------------------------------------------
    def check(self, seq: Sequence) -> None:
        """Refuse (ValueError) a request that could never run, so it cannot stall the queue."""
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        prompt = seq.num_tokens
        if prompt == 0:
            raise ValueError("the prompt is empty (0 tokens)")
        if prompt > self.max_model_len:
            raise ValueError(f"prompt is {prompt} tokens, longer than max_model_len "
                             f"{self.max_model_len}")
        final = min(prompt + seq.max_tokens, self.max_model_len)
        positions = max(prompt, final - 1)  # the last sampled token's K/V is never computed
        positions = self.eviction.max_tokens_held(prompt, positions, self.max_num_batched_tokens,
                                                  self.kv.block_size)
        need = self.kv.blocks_needed(positions)
        if need > self.kv.num_blocks:
            bs = self.kv.block_size
            raise ValueError(
                f"prompt ({prompt} tokens) + max_tokens needs {need} KV blocks of {bs} tokens, "
                f"the whole cache has {self.kv.num_blocks} ({self.kv.num_blocks * bs} tokens): "
                f"lower max_tokens or raise kv_memory")

    def add(self, seq: Sequence) -> None:
        self.check(seq)
        seq.status = SeqStatus.WAITING
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def finish(self, request_id: str) -> Sequence:
        """End a request (finished or aborted): its blocks are released at once."""
        seq = self.requests.pop(request_id)
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SeqStatus.FINISHED
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return sum(1 for s in self.waiting if s.status is SeqStatus.WAITING)

    @property
    def num_swapped(self) -> int:
        return sum(1 for s in self.waiting if s.status is SeqStatus.SWAPPED)

    # --- the step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([], [[] for _ in self.kv.groups], [[] for _ in self.kv.groups])
        budget = self.max_num_batched_tokens
        for seq in self.running:
            self.kv.free_outside_window(seq)

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            start = seq.num_computed_tokens
            n = self._on_grid(seq, start, self.kv.max_chunk(start, min(seq.num_tokens - start, budget), seq))
            while self.kv.allocate(seq, n) is None:  # a running sequence never swaps in: no copies
                victim = self.running.pop()  # latest admitted
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break
            out.chunks.append(ScheduledChunk.of(seq, start, n))
            budget -= n
            i += 1

        # Admit only when nobody was preempted: swap-ins and swap-outs then never share a step
        # (host blocks freed by a swap-in are not reused before its copy ran).
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            hit = (self.kv.find_prefix(seq, self.eviction.prefix_limit(seq.num_prompt_tokens))
                   if seq.status is SeqStatus.WAITING else None)
            if hit is not None and hit.from_tiers:
                hit = self.kv.fetch(seq, hit)
            start = hit.tokens if hit is not None else seq.num_computed_tokens
            if not self._prompt_fits(seq, start):
                break
            n = self._on_grid(seq, start, self.kv.max_chunk(start, min(seq.num_tokens - start, budget),
                                                            seq if hit is None else None))
            copies = self.kv.allocate(seq, n, hit)
            if copies is None:
                break
            for group, pairs in zip(out.swap_in, copies):
                group.extend(pairs)
            self.waiting.popleft()
            if seq.admitted < 0 and hit is not None:  # first admission: count the prefix cache
                self.prefix_queries += seq.num_tokens
                self.prefix_hits += hit.tokens
                self.tier_hits += sum(seq.tier_tokens.values())
                seq.num_cached_tokens = hit.tokens
            seq.status = SeqStatus.RUNNING
            seq.admitted = self._admissions
            self._admissions += 1
            self.running.append(seq)
            out.chunks.append(ScheduledChunk.of(seq, start, n))
            budget -= n
        out.loads = self.kv.take_loads()
        return out

    def _prompt_fits(self, seq: Sequence, start: int) -> bool:
        """Under a policy that holds the whole prompt before it compresses (snapkv, adakv): whether
        the pool has room for the rest of ``seq``'s prompt (from ``start``) beside the rest of every
        running prompt. A prompt admitted without it is preempted before it can finish, and by
        recompute loses its chunks (8 prompts of 4,096 tokens in room for 2: 5 preemptions
        without this check, none with it)."""
        if not (self.eviction.active and self.eviction.waits_for_prompt) or start >= seq.num_prompt_tokens:
            return True
        bs, full = self.kv.block_size, self.kv.full_group

        def rest(prompt: int, held: int) -> int:
            return max(0, cdiv(prompt, bs) - held)
        running = sum(rest(q.num_prompt_tokens, len(q.block_tables[full])) for q in self.running
                      if q.num_computed_tokens < q.num_prompt_tokens and q.block_tables)
        return rest(seq.num_prompt_tokens, start // bs) + running <= self.kv.pools[full].num_available

    def _on_grid(self, seq: Sequence, start: int, n: int) -> int:
        """Cap a prompt chunk at the next eviction grid point (see ``eviction_grid``), and where
        the voting queries begin: the chunk before them runs the plain kernels, only the voters
        the scored attention (snapkv's 32 queries, not the whole 2,048-token chunk that ends a
        prompt: its prefill took 5x the full cache's)."""
        if start >= seq.num_prompt_tokens:
            return n
        voting = self.eviction.voters(seq.num_prompt_tokens)
        if voting is not None and start < voting.start < start + n:
            n = voting.start - start
        if self.eviction_grid is None:
            return n
        return min(n, (start // self.eviction_grid + 1) * self.eviction_grid - start)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        seq.num_preemptions += 1
        self.num_preemptions += 1
        copies = self.kv.swap_out(seq) if self.swap else None
        if copies is not None:
            for group, pairs in zip(out.swap_out, copies):
                group.extend(pairs)
            seq.status = SeqStatus.SWAPPED
        else:  # recompute (or the host pool is full)
            self.recompute(seq)
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def recompute(self, seq: Sequence) -> None:
        """Drop a preempted sequence's K/V (device and host blocks): it is computed again from
        its tokens (and prefix-cache hits) when next admitted. Under an eviction policy that
        rebuilds the lossy cache from the tokens (the policy runs again over them), so what
        follows may differ from a run never preempted; a swap restores it exactly."""
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        if seq.scores is not None:
            seq.scores.zero_()
        seq.status = SeqStatus.WAITING

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> None:
        """After the forward pass: the chunks' K/V exist now; append each sampled token."""
        for chunk in out.chunks:
            seq = chunk.seq
            seq.num_computed_tokens = chunk.start + chunk.num_tokens
            self.kv.cache_computed(seq)
            self._evict(seq)
            if chunk.samples:
                seq.append(sampled[seq.request_id])

    def _evict(self, seq: Sequence) -> None:
        """Apply the eviction policy to what ``seq`` has computed: blocks go back to the pool."""
        policy, n, bs = self.eviction, seq.num_computed_tokens, self.kv.block_size
        if not policy.ready(n, seq.num_prompt_tokens):
            return  # e.g. snapkv compresses once the whole prompt is in
        if self.eviction_grid and n < seq.num_prompt_tokens and n % self.eviction_grid:
            return  # between grid points: as if the chunk had not ended
        held = self.kv.held_blocks(seq)
        computed = cdiv(n, bs)  # blocks past the computed tokens (none, after update) stay
        kept = torch.tensor(held[:computed], dtype=torch.bool)
        keep = policy.keep(kept, n, bs, seq.scores)
        if bool((keep == kept).all()):
            return
        freed = self.kv.evict(seq, keep.tolist() + held[computed:])
        self.num_evicted_blocks += freed
        self.num_evicted_tokens += freed * bs
        seq.num_evicted_tokens += freed * bs
