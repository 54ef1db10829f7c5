"""The plain generation loop: prefill the prompt once, then one model pass per new token.

With the cache (default) each decode step feeds only the newest token; its K/V are appended to
a ``ContiguousKVCache`` sized once for prompt + max_tokens. Without it (``use_cache=False``)
every step recomputes the whole sequence, which is the lesson's baseline: the same greedy tokens,
at quadratic cost. Either way only the last position's logits are computed.

    gen = Generation(model, prompt_ids, SamplingParams(temperature=0), tokenizer)
    for delta in gen:          # streams tokens and text deltas
        print(delta.text, end="")
    gen.result                 # figures: TTFT, decode tokens/s, KV bytes held...
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

import torch

from kvlab.engine.output import FinishReason, OutputProcessor
from kvlab.models.attention import ContiguousKVCache, NoCache
from kvlab.models.llama import CausalLM
from kvlab.models.tokenizer import TextTokenizer
from kvlab.sampling import Sampler, SamplingParams, TokenLogprob, token_logprobs


@dataclass(frozen=True)
class Delta:
    """One streamed step: the new token and the text it adds (may be "" while a character or
    a possible stop string is incomplete; the last delta carries whatever was held back)."""

    token_id: int
    text: str
    logprob: TokenLogprob | None = None  # with params.logprobs set


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids (a final EOS included, as vLLM reports it)
    finish_reason: FinishReason
    prompt_tokens: int
    new_tokens: int
    ttft_s: float  # prefill + first sample
    decode_tokens_per_s: float  # tokens after the first / time after the first
    total_s: float
    kv_bytes: int  # bytes of the cache tensors held (0 without a cache)
    use_cache: bool
    load_s: float | None = None  # a command's start-up before the first step (imports, model, tokenizer)
    # the paged engine's: prompt tokens whose K/V came from the pool, each prefix tier, or were computed
    prompt_tokens_from: dict[str, int] | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    def figures(self) -> str:
        """One short line for the terminal."""
        tps = f"{self.decode_tokens_per_s:.1f} tok/s" if self.new_tokens > 1 else "- tok/s"
        kv = f"KV {self.kv_bytes:,} B held" if self.use_cache else "no KV cache (recomputed)"
        load = f"load {self.load_s:.1f} s, " if self.load_s is not None else ""
        cached = {k: n for k, n in (self.prompt_tokens_from or {}).items() if k != "computed" and n}
        came = f" ({', '.join(f'{n} from {k}' for k, n in cached.items())})" if cached else ""
        return (f"prompt {self.prompt_tokens} tok{came}, new {self.new_tokens} tok, "
                f"TTFT {self.ttft_s * 1000:.0f} ms, {tps}, {load}total {self.total_s:.2f} s, {kv}")


def check_length(model: CausalLM, prompt_tokens: int, max_tokens: int) -> None:
    """Refuse what the model cannot address: prompt + max_tokens beyond max_position_embeddings."""
    limit = model.spec.max_position_embeddings
    if prompt_tokens == 0:
        raise ValueError("the prompt is empty (0 tokens)")
    if limit and prompt_tokens >= limit:
        raise ValueError(f"prompt is {prompt_tokens} tokens, the model's context is {limit}")
    if limit and prompt_tokens + max_tokens > limit:
        raise ValueError(f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the "
                         f"model's context of {limit}; use max_tokens <= {limit - prompt_tokens}")


class Generation:
    """One prompt's generation, streamed by iterating (once); ``result`` is set when it ends.

    Time the consumer spends between two deltas (printing, say) is not counted in the figures.
    """

    def __init__(self, model: CausalLM, prompt_ids: Sequence[int], params: SamplingParams,
                 tokenizer: TextTokenizer | None = None, use_cache: bool = True) -> None:
        check_length(model, len(prompt_ids), params.max_tokens)
        vocab = model.spec.vocab_size
        if any(not 0 <= int(i) < vocab for i in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        self.model = model
        self.prompt_ids = [int(i) for i in prompt_ids]
        self.params = params
        self.use_cache = use_cache
        self.result: GenerationResult | None = None
        self.cache: ContiguousKVCache | None = None
        # built here, not when iterating, so that a request it refuses (stop strings without a
        # tokenizer) is refused at construction like the length checks above
        self.output = OutputProcessor(params, self.prompt_ids, model.eos_token_ids, tokenizer)

    def __iter__(self) -> Iterator[Delta]:
        return self._run()

    @torch.inference_mode()
    def _run(self) -> Iterator[Delta]:
        model, params = self.model, self.params
        device = model.device
        sampler = Sampler(params, device)
        output = self.output
        n_prompt = len(self.prompt_ids)
        last = torch.tensor([n_prompt - 1], device=device)

        def pick(logits: torch.Tensor) -> tuple[int, TokenLogprob | None]:
            token = int(sampler(logits)[0])
            if params.logprobs is None:
                return token, None
            return token, token_logprobs(logits, [token], params.logprobs)[0]
        paused = 0.0
        t0 = time.perf_counter()

        if self.use_cache:
            self.cache = backend = ContiguousKVCache(model.spec, n_prompt + params.max_tokens,
                                                     dtype=model.dtype, device=device)
            positions = backend.prepare(n_prompt)
        else:
            backend = NoCache(model.spec)
            positions = backend.prepare(n_prompt, device)
        ids = torch.tensor(self.prompt_ids, device=device)
        logits = model(ids, positions, backend, last)
        token, logprob = pick(logits)
        t_first = time.perf_counter()

        out: list[int] = []
        while True:
            out.append(token)
            delta = output.add(token)
            t_pause = time.perf_counter()
            yield Delta(token, delta, logprob)
            paused += time.perf_counter() - t_pause
            if output.finished:
                break
            if self.use_cache:
                assert isinstance(backend, ContiguousKVCache)
                positions = backend.prepare(1)
                logits = model(torch.tensor([token], device=device), positions, backend,
                               torch.zeros(1, dtype=torch.long, device=device))
            else:
                seq = self.prompt_ids + out
                positions = backend.prepare(len(seq), device)
                logits = model(torch.tensor(seq, device=device), positions, backend,
                               torch.tensor([len(seq) - 1], device=device))
            token, logprob = pick(logits)

        assert output.finish_reason is not None  # the loop above ends only when it is set
        t_end = time.perf_counter() - paused
        decode_s = t_end - t_first
        self.result = GenerationResult(
            text=output.text,
            token_ids=out,
            finish_reason=output.finish_reason,
            prompt_tokens=n_prompt,
            new_tokens=len(out),
            ttft_s=t_first - t0,
            decode_tokens_per_s=(len(out) - 1) / decode_s if len(out) > 1 and decode_s > 0 else 0.0,
            total_s=t_end - t0,
            kv_bytes=self.cache.kv_bytes if self.cache is not None else 0,
            use_cache=self.use_cache,
        )


def generate(model: CausalLM, prompt_ids: Sequence[int], params: SamplingParams,
             tokenizer: TextTokenizer | None = None, use_cache: bool = True) -> GenerationResult:
    """Run to the end and return the result (no streaming)."""
    gen = Generation(model, prompt_ids, params, tokenizer, use_cache)
    for _ in gen:
        pass
    assert gen.result is not None
    return gen.result
