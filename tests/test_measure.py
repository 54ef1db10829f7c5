"""`kvlab measure`: the runtime's tensors and allocations against the planner's formula."""

import json

import pytest

from kvlab.cli import main
from kvlab.measure import cache_slope, cache_vs_no_cache, count_cache, measure, prefill_memory
from kvlab.models.loader import build_model
from kvlab.spec import spec_from_config
from tests.conftest import llama_like

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)


def tiny_model(dtype="fp32", **over):
    return build_model(spec_from_config(llama_like(**{**TINY, **over})), dtype, random_weights=True, seed=1)


def test_counted_tensors_match_formula():
    model = tiny_model("bf16")
    c = count_cache(model, 100)
    assert c.tensors == 2 * 2  # K and V per layer
    assert c.shapes == [[1, 2, 100, 16]]
    assert c.dtype == "bf16"
    assert c.total_bytes == c.formula_bytes == 100 * c.formula_bytes_per_token
    assert c.formula_bytes_per_token == 2 * 2 * 2 * 16 * 2  # layers x (K,V) x heads x dim x bytes


def test_sliding_window_cache_is_capped():
    model = tiny_model(model_type="mistral", sliding_window=32)
    c = count_cache(model, 100)
    assert c.shapes == [[1, 2, 32, 16]]
    assert c.total_bytes == c.formula_bytes == model.spec.kv_bytes_per_sequence(100, "fp32")


def test_allocated_slope_equals_formula():
    s = cache_slope(tiny_model(), [32, 64, 128])
    assert s.allocated_bytes == s.formula_bytes
    assert s.slope_bytes_per_token == pytest.approx(s.formula_bytes_per_token)
    assert abs(s.deviation_percent) < 1e-9


GEMMA3 = llama_like(**{**TINY, "num_hidden_layers": 6, "num_key_value_heads": 1, "head_dim": 16},
                    model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], sliding_window=32,
                    hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=16)


def test_gemma3_window_bends_the_growth():
    """Gemma 3's pattern (5 sliding layers, window 32, then a global one): per layer type the
    counted bytes equal the formula, and past the window only the global layer still grows."""
    model = build_model(spec_from_config(GEMMA3), "fp32", random_weights=True, seed=1)
    c = count_cache(model, 100)
    per_layer = 2 * 16 * 4  # K and V, one head of 16, fp32
    assert c.by_kind == {"sliding(32)": [10, 5 * 32 * per_layer, 5 * 32 * per_layer],
                         "full": [2, 100 * per_layer, 100 * per_layer]}
    s = cache_slope(model, [16, 32, 64, 128])
    assert s.allocated_bytes == s.formula_bytes
    assert s.marginal_bytes_per_token == s.formula_marginal_bytes_per_token == [6 * per_layer, per_layer,
                                                                                per_layer]


def test_all_position_logits_dominate_prefill_memory():
    model = tiny_model(vocab_size=8192)  # vocab >> hidden, as in real models
    p = prefill_memory(model, 256)
    assert p.logits_bytes_all_positions == 256 * 8192 * 4
    assert p.extra_all_positions >= p.logits_bytes_all_positions > p.extra_last_only
    assert 50 < p.logits_share_percent <= 100
    assert p.logits_to_kv_ratio == pytest.approx(8192 * 4 / (2 * 2 * 2 * 16 * 4))


def test_cache_vs_no_cache_rows():
    rows = cache_vs_no_cache(tiny_model(), prompt=16, new_tokens=[8, 16])
    assert [r.tokens_with_cache for r in rows] == [23, 31]
    assert [r.tokens_without_cache for r in rows] == [8 * 16 + 28, 16 * 16 + 120]
    assert all(r.identical_tokens == r.new_tokens for r in rows)  # fp32: no ties
    assert all(r.seconds_with_cache > 0 and r.seconds_without_cache > 0 for r in rows)


def test_progress_runs_to_its_total():
    """Every stage reports, the count only grows, and it ends exactly at the total it announced
    (so the bar reaches its end and the estimate of the time left had the whole work to go by)."""
    calls = []
    measure(tiny_model(), [16, 32], [4, 8], prompt=8, progress=lambda *a: calls.append(a))
    done = [d for d, _, _ in calls]
    assert len({t for _, t, _ in calls}) == 1 and done == sorted(done)
    assert done[0] == 0 and done[-1] == calls[0][1]
    assert len({w for _, _, w in calls}) == 4  # the four measurements
    assert len(calls) > 4 + 2 * (4 + 8)  # generation reports each model pass


def test_cli_json_and_plot(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(llama_like(**TINY)))
    png = tmp_path / "m.png"
    argv = ["measure", str(cfg), "--random-weights", "--dtype", "fp32", "--contexts", "16,32",
            "--new-tokens", "4,8", "--prompt", "8", "--json", "--plot", str(png)]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["formula_bytes_per_token"] == out["counted_bytes_per_token"] == out["slope_bytes_per_token"]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_cli_shows_the_bend_per_layer_type(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(GEMMA3))
    assert main(["measure", str(cfg), "--random-weights", "--dtype", "fp32", "--contexts", "16,32,64",
                 "--new-tokens", "2", "--prompt", "4"]) == 0
    out = capsys.readouterr().out
    per_layer = 2 * 16 * 4
    assert f"growth bends where sliding layers reach their window: {6 * per_layer:,}.0 -> {per_layer}.0" in out
    assert "sliding(32) layers" in out and "full layers" in out


def test_cli_rejects_context_beyond_model(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(llama_like(**TINY)))
    assert main(["measure", str(cfg), "--random-weights", "--contexts", "1024"]) == 2
    assert "exceeds the model's maximum" in capsys.readouterr().err


def test_plot_labels_stay_inside_their_axes():
    """The ratio written above each no-cache point lies inside the plot, clear of the tick labels
    and the title (it used to sit over the y ticks and above the axes)."""
    from kvlab.measure import measure
    from kvlab.plots import measurement_figure

    m = measure(tiny_model(), [16, 32], [4, 8, 16], prompt=8)
    fig = measurement_figure(m)
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[1]
    box = ax.get_window_extent(renderer)
    labels = ax.texts
    assert len(labels) == 3
    for text in labels:
        t = text.get_window_extent(renderer)
        assert box.x0 <= t.x0 and t.x1 <= box.x1 and box.y0 <= t.y0 and t.y1 <= box.y1, text.get_text()
    ticks = [label.get_window_extent(renderer) for label in ax.get_yticklabels() if label.get_text()]
    assert not any(t.overlaps(label.get_window_extent(renderer)) for t in ticks for label in labels)
