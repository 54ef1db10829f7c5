"""The public API: ``LLM(model, **engine_options).generate(prompts, SamplingParams(...))``.

    from kvlab import LLM, SamplingParams
    llm = LLM("path/to/checkpoint", kv_memory="512MiB", block_size=16)
    for out in llm.generate(["Hello", "Bonjour"], SamplingParams(temperature=0, max_tokens=32)):
        print(out.text, out.finish_reason, out.ttft_s, out.num_cached_tokens)
    for delta in llm.stream(["Hello"], SamplingParams(max_tokens=32)):
        print(delta.new_text, end="")
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from kvlab.engine.engine import EngineMetrics, LLMEngine, RequestOutput
from kvlab.layout import KVCapacity
from kvlab.models.llama import CausalLM
from kvlab.models.loader import load_options
from kvlab.options import EngineOptions, ModelOptions
from kvlab.models.tokenizer import TextTokenizer
from kvlab.sampling import SamplingParams

Prompt = str | list[int]

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


class LLM:
    """A model behind the paged engine. ``model``: a GGUF file, a checkpoint folder, a bundled name
    (default ``smollm2-135m``), a catalogue name / config.json with ``random_weights=True``, or a
    built CausalLM.
    Every ModelOptions field but ``model`` (dtype, weights, activations, device, random_weights,
    seed, threads) and every EngineOptions field (block_size, kv_memory, kv_dtype, tp, ...) is a
    keyword argument, with the same defaults as the CLI flags (kvlab.options). For a built CausalLM only ``device``
    of the model's fields applies. With ``tp=N`` the model runs as N worker processes on
    ``device`` (see kvlab.engine.executor)."""

    def __init__(self, model: str | Path | CausalLM | None = None, *,
                 tokenizer: TextTokenizer | None = None, **options: Any) -> None:
        model_fields = {f.name for f in fields(ModelOptions)} - {"model"}
        held = ModelOptions(None if model is None or isinstance(model, CausalLM) else str(model),
                            **{k: options.pop(k) for k in list(options) if k in model_fields})
        engine_options = EngineOptions(**options)
        parallel = engine_options.tp > 1
        if isinstance(model, CausalLM):
            built = model
        else:
            loaded = load_options(held, engine_options.tp)
            built, tokenizer = loaded.model, tokenizer or loaded.tokenizer
        self.engine = LLMEngine(built, tokenizer, engine_options, device=held.device if parallel else None)

    def close(self) -> None:
        """Stop the tensor-parallel worker processes now (they also stop when this process ends)."""
        self.engine.close()

    @property
    def capacity(self) -> KVCapacity:
        return self.engine.capacity

    def metrics(self) -> EngineMetrics:
        return self.engine.metrics()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Run the prompts together to the end; final outputs in prompt order."""
        final: dict[str, RequestOutput] = {}
        ids = self._add(prompts, params, cache_salt)
        for out in self._run(ids):
            if out.finished:
                final[out.request_id] = out
        return [final[i] for i in ids]

    def stream(self, prompts: Prompt | Sequence[Prompt],
               params: SamplingParams | Sequence[SamplingParams] | None = None,
               cache_salt: str | None = None) -> Iterator[RequestOutput]:
        """Yield each request's update as soon as its step ends (`new_token_ids`, `new_text`).
        Leaving the loop early aborts the requests still running."""
        return self._run(self._add(prompts, params, cache_salt))

    def _add(self, prompts: Prompt | Sequence[Prompt],
             params: SamplingParams | Sequence[SamplingParams] | None,
             cache_salt: str | None) -> list[str]:
        single = isinstance(prompts, str) or (
            isinstance(prompts, list) and bool(prompts) and all(isinstance(p, int) for p in prompts))
        batch: list[Prompt] = [prompts] if single else list(prompts)  # type: ignore[list-item]
        if params is None or isinstance(params, SamplingParams):
            per = [params or SamplingParams()] * len(batch)
        else:
            per = list(params)
            if len(per) != len(batch):
                raise ValueError(f"{len(per)} SamplingParams for {len(batch)} prompts")
        ids: list[str] = []
        try:
            for prompt, p in zip(batch, per):
                ids.append(self.engine.add_request(prompt, p, cache_salt=cache_salt))
        except ValueError:
            for rid in ids:  # all or nothing
                self.engine.abort_request(rid)
            raise
        return ids

    def _run(self, ids: list[str]) -> Iterator[RequestOutput]:
        pending = set(ids)
        try:
            while pending:
                for out in self.engine.step():
                    if out.request_id in pending:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield out
        finally:
            for rid in pending:
                self.engine.abort_request(rid)
