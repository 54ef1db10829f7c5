"""Plots people would rather look at than tables (matplotlib, written to PNG)."""

from __future__ import annotations

from pathlib import Path

from kvlab.measure import Measurement


def plot_measurement(m: Measurement, path: str | Path) -> None:
    """Left: allocated cache bytes over contexts vs the formula. Right: generation time with and
    without the cache, next to the work ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    s = m.slope
    a.plot(s.contexts, [x / 2**20 for x in s.formula_bytes], "-", color="0.6", label="formula")
    a.plot(s.contexts, [x / 2**20 for x in s.allocated_bytes], "o", label="allocated")
    a.set(xlabel="context (tokens)", ylabel="KV cache (MiB)",
          title=f"slope {s.slope_bytes_per_token:,.0f} B/token ({s.deviation_percent:+.3f}% vs formula)")
    a.legend()
    rows = m.cache_vs_no_cache
    n = [r.new_tokens for r in rows]
    b.plot(n, [r.seconds_with_cache for r in rows], "o-", label="with cache")
    b.plot(n, [r.seconds_without_cache for r in rows], "s-", label="without cache")
    for r in rows:
        b.annotate(f"time {r.time_ratio:.1f}x\nwork {r.work_ratio:.0f}x", (r.new_tokens, r.seconds_without_cache),
                   textcoords="offset points", xytext=(-30, 6), fontsize=8)
    b.set(xlabel="new tokens", ylabel="seconds", title=f"generation, prompt {rows[0].prompt} tokens")
    b.legend()
    fig.suptitle(f"{m.model} ({m.dtype})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
