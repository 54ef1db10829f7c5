"""The optional real models (``kvlab models --install NAME``), when installed: Gemma 3 270M against
transformers reading the same file, its windows in the paged engine and in the plan, and the
Vietnamese lesson's cache count on Qwen2.5-Coder-1.5B. CI installs Gemma 3 (make test)."""

from __future__ import annotations

import pytest
import torch

from kvlab.catalog import OPTIONAL, load_spec, model_path
from kvlab.engine.llm import LLM
from kvlab.layout import cdiv
from kvlab.generate import generate
from kvlab.measure import count_cache
from kvlab.models import NoCache, load
from kvlab.plan import PlanRequest, make_plan
from kvlab.sampling import SamplingParams


def needs(name: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not OPTIONAL[name].installed(),
                              reason=f"optional model {name} not installed (kvlab models --install {name})")


GEMMA = "gemma3-270m"
WINDOW = 512


@pytest.fixture(scope="module")
def gemma():
    return load(GEMMA, "fp32")


@needs(GEMMA)
def test_gemma3_header_and_windows(gemma):
    spec = gemma.model.spec
    assert (spec.num_layers, spec.layers[0].num_heads, spec.layers[0].kv_heads, spec.layers[0].head_dim) == (18, 4, 1, 256)
    assert spec.layer_kinds() == {f"sliding({WINDOW})": 15, "full": 3}
    assert [i for i, layer in enumerate(spec.layers) if layer.kind == "full"] == [5, 11, 17]


@needs(GEMMA)
def test_gemma3_matches_transformers_on_the_same_file(gemma):
    transformers = pytest.importorskip("transformers")
    path = model_path(GEMMA)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.tensor([2]), torch.randint(236, 20000, (WINDOW + 100,), generator=g)])
    with torch.inference_mode():
        want = ref(ids[None]).logits[0]
        got = gemma.model(ids, torch.arange(ids.numel()), NoCache(gemma.model.spec))
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
    prompt = gemma.tokenizer.encode("The capital of France is")
    ours = generate(gemma.model, prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    with torch.inference_mode():
        theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert ours.token_ids == theirs[0, len(prompt):].tolist()


@needs(GEMMA)
def test_gemma3_engine_allocates_the_plan_and_frees_window_blocks(gemma):
    block, budget, max_len, chunk = 16, 64 * 2**20, 4096, 256
    llm = LLM(gemma.model, kv_memory=budget, block_size=block, max_model_len=max_len,
              max_num_batched_tokens=chunk, kv_dtype="fp32")
    plan = make_plan(load_spec(GEMMA), PlanRequest(context=max_len, kv_memory=budget, block_size=block,
                                                   kv_dtype="fp32"))
    cap = llm.capacity
    assert (cap.blocks, cap.tokens, cap.max_concurrency) == (plan.kv_cache_blocks, plan.kv_cache_tokens,
                                                            plan.max_concurrency)
    engine = llm.engine
    groups = engine.kv.groups
    sliding = next(i for i, grp in enumerate(groups) if grp.kind == "sliding")
    full = next(i for i, grp in enumerate(groups) if grp.kind == "full")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(236, 20000, (3 * WINDOW,), generator=g).tolist()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    held = []
    while engine.has_unfinished():
        engine.step()
        held += [(sum(b >= 0 for b in s.block_tables[sliding]), sum(b >= 0 for b in s.block_tables[full]))
                 for s in engine.scheduler.running]
    most_sliding = max(h[0] for h in held)
    assert most_sliding <= cdiv(WINDOW - 1 + chunk - 1, block) + 1
    assert max(h[1] for h in held) >= cdiv(3 * WINDOW, block) > most_sliding


QWEN = "qwen2.5-coder-1.5b"


@needs(QWEN)
def test_qwen_cache_tensors_are_the_lessons():
    model = load(QWEN, "bf16").model
    c = count_cache(model, 64)
    assert (c.tensors, c.shapes) == (56, [[1, 2, 64, 128]])
    assert c.formula_bytes_per_token == c.counted_bytes_per_token == 28_672
