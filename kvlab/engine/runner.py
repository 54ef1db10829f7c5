"""Turns a scheduled step into the model's input and has the executor run it.

Input ids and positions are the chunks' tokens laid end to end (no padding); the attention
backend gets each sequence's block tables; logits are computed only at the last token of each
chunk that samples. The step goes to the executor as plain data (``StepInput``), so it reaches
tensor-parallel workers as it is. The step's block copies for swapping are the engine's, run
before this.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import Tensor

from kvlab.engine.attention import SeqSpan
from kvlab.engine.executor import Executor, StepInput
from kvlab.eviction import EvictionPolicy, Full
from kvlab.layout import cdiv
from kvlab.models.invariant import SPLIT
from kvlab.engine.scheduler import SchedulerOutput
from kvlab.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, executor: Executor, vocab_size: int,
                 eviction: EvictionPolicy = Full(), score_columns: int = 1) -> None:
        self.executor = executor
        self.vocab_size = vocab_size
        self.eviction = eviction
        self.score_columns = score_columns  # of a sequence's scores (the policy's, for this model)

    def execute(self, out: SchedulerOutput,
                score_prompt: Collection[str] = ()) -> tuple[Tensor, dict[str, tuple[int, Tensor]]]:
        """Run the step. Returns logits [number of sampling chunks, vocab], in chunk order, and
        for the requests in ``score_prompt`` (prompt logprobs) the rows that score the prompt
        tokens this step reaches: request id -> (first prompt position scored, logits), row j
        predicting the prompt token at that position + j. Those rows cost the last layer's
        o_proj, MLP and lm_head per prompt token, so they are computed only when asked."""
        if not out.chunks:
            return torch.empty(0, self.vocab_size), {}
        ids: list[int] = []
        positions: list[tuple[int, int]] = []
        last: list[int] = []
        scored: dict[str, tuple[int, range]] = {}
        spans = []
        for chunk in out.chunks:
            end = chunk.start + chunk.num_tokens
            seq = chunk.seq
            if seq.request_id in score_prompt:
                # position p's logits predict token p + 1; the last prompt position's row is the
                # sampling row (it predicts the first new token), so it is not a prompt score
                stop = min(end, seq.num_prompt_tokens - 1)
                if stop > chunk.start:
                    scored[seq.request_id] = (chunk.start + 1, range(len(ids), len(ids) + stop - chunk.start))
            ids.extend(seq.token_ids[chunk.start:end])
            positions.append((chunk.start, end))
            if chunk.samples:
                last.append(len(ids) - 1)
            spans.append(self._span(seq, chunk.start, chunk.num_tokens))
        rows = last + [i for _, r in scored.values() for i in r]
        logits = self.executor.execute(StepInput(ids, positions, spans, rows))
        prompt: dict[str, tuple[int, Tensor]] = {}
        at = len(last)
        for rid, (first, r) in scored.items():
            prompt[rid] = (first, logits[at:at + len(r)])
            at += len(r)
        return logits[:len(last)], prompt

    def _span(self, seq: Sequence, start: int, num_tokens: int) -> SeqSpan:
        """The chunk's span; with a scoring eviction policy, the sequence's attention scores and
        the queries that vote (h2o: every query; snapkv: the prompt's last obs_window)."""
        if not self.eviction.needs_scores:
            return SeqSpan(seq.block_tables, start, num_tokens)
        if seq.scores is None or seq.scores.shape[0] < seq.num_tokens:
            # whole splits: deterministic mode lays keys out by position in splits of SPLIT, and
            # adds the (zero) mass of a last split's empty tail at its positions too
            size = cdiv(max(2 * seq.num_tokens, SPLIT), SPLIT) * SPLIT
            grown = self.eviction.new_scores(size, self.score_columns, self.executor.device)
            if seq.scores is not None:
                grown[:seq.scores.shape[0]] = seq.scores
            seq.scores = grown
        voters = self.eviction.voters(seq.num_prompt_tokens)
        # no query of this chunk votes (snapkv: the prompt before its window, or decoding after
        # the votes were cast): the unscored kernels, which add no mass either
        if voters is None or start >= voters.stop or start + num_tokens <= voters.start:
            return SeqSpan(seq.block_tables, start, num_tokens)
        return SeqSpan(seq.block_tables, start, num_tokens, seq.scores, voters)
