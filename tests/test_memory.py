"""Memory that stays flat: engine steps of ever new row counts (every prompt length once) must not
leave per-shape state behind (issues 18 and 24 saw bf16 RSS climb with traffic on CPUs whose
oneDNN caches a kernel per matmul shape, ~0.5 MB each). The 20-minute soak is
benchmarks/soak.py's; this is its quick form."""

from __future__ import annotations

import gc

from kvlab.engine.llm import LLM
from kvlab.models.loader import build_model, init_random_
from kvlab.sampling import SamplingParams
from kvlab.spec import spec_from_config
from tests.test_engine_parity import tiny_config


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def test_steps_of_new_row_counts_leave_rss_flat():
    cfg = tiny_config(hidden_size=256, intermediate_size=512, vocab_size=512, max_position_embeddings=1024)
    model = build_model(spec_from_config(cfg, "tiny"), "bf16", random_weights=True)
    init_random_(model, seed=0)
    llm = LLM(model, max_num_batched_tokens=1024, max_model_len=1024, prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def prompts_of(lengths: range) -> None:
        for n in lengths:  # one prompt per step: a step of n rows, then one of 1 row
            llm.generate([[(7 * i) % 512 for i in range(n)]], params)

    prompts_of(range(1, 304, 2))  # warm-up: allocator pools, every row-count bucket oneDNN sees
    gc.collect()
    before = rss_bytes()
    prompts_of(range(2, 304, 2))  # 151 row counts never seen before (unbucketed: +270 MiB here)
    gc.collect()
    grown = rss_bytes() - before
    assert grown < 16 * 2**20, f"RSS grew {grown / 2**20:.1f} MiB over 151 new row counts"


def test_onednn_sees_a_bounded_set_of_row_counts(monkeypatch, backends_with):
    """Every matmul kvlab hands oneDNN's packed bf16 path has one of a bounded set of row counts
    (``onednn_rows``), however many prompt lengths the traffic brings. Checked on any CPU: the
    model runs packed as where oneDNN has bf16 kernels, and oneDNN's two calls (the kernel
    boundary) are recorded (pack: the weight as is; matmul: F.linear on the padded rows)."""
    import torch
    import torch.nn.functional as F

    from kvlab.kernels import onednn

    rows: list[int] = []
    monkeypatch.setattr(onednn, "pack", lambda w: w.clone())
    monkeypatch.setattr(onednn, "linear", lambda x, w, b: rows.append(x.shape[0]) or F.linear(x, w, b))
    cfg = tiny_config(hidden_size=64, intermediate_size=128, vocab_size=256, max_position_embeddings=512)
    model = build_model(spec_from_config(cfg, "tiny"), "bf16", random_weights=True)
    init_random_(model, seed=0)
    llm = LLM(model, max_num_batched_tokens=512, max_model_len=512, prefix_caching=False, deterministic=False)
    model.use(backends_with(onednn_bf16=True), pack_bytes=2**40)
    assert model.is_packed()
    lengths = range(1, 400, 3)
    out = llm.generate([[(7 * i) % 256 for i in range(n)] for n in lengths],
                       SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert all(len(o.token_ids) == 2 for o in out)
    shapes = set(rows)
    assert shapes <= {onednn.onednn_rows(m) for m in range(1, 513)}  # 8 + 4 per doubling: 36 shapes
    assert len(shapes) <= 36 and len(shapes) < len(set(lengths)) / 3


def test_packed_bf16_rows_are_plain_f_linear_rows_on_this_cpu():
    """Where oneDNN packs bf16 here, its padded, bucketed rows are bitwise F.linear's (one row's
    sums never read another row); where it does not (or KVLAB_ONEDNN_BF16=off), nothing packs."""
    import torch
    import torch.nn.functional as F

    from kvlab import dispatch
    from kvlab.kernels.onednn import PackedWeights

    gen = torch.Generator().manual_seed(0)
    model = build_model(spec_from_config(tiny_config(hidden_size=96, intermediate_size=160), "tiny"), "bf16",
                        random_weights=True)
    model.prepack(2**40)
    assert model.is_packed() is bool(dispatch.backends().onednn_bf16)
    if not model.is_packed():
        return
    weight = torch.randn(160, 96, generator=gen).to(torch.bfloat16)
    bias = torch.randn(160, generator=gen).to(torch.bfloat16)
    packed = PackedWeights([weight], [bias])
    for m in (1, 7, 9, 37, 65, 130, 301):
        x = torch.randn(m, 96, generator=gen).to(torch.bfloat16)
        with torch.inference_mode():
            assert torch.equal(packed(x), F.linear(x, weight, bias)), m
