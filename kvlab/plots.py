"""Plots people would rather look at than tables (matplotlib, written to PNG)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvlab.measure import Measurement

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def measurement_figure(m: Measurement) -> Figure:
    """Left: allocated cache bytes over contexts vs the formula. Right: generation time with and
    without the cache, each ratio written above its point, inside the axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    s = m.slope
    a.plot(s.contexts, [x / 2**20 for x in s.formula_bytes], "-", color="0.6", label="formula")
    a.plot(s.contexts, [x / 2**20 for x in s.allocated_bytes], "o", label="allocated")
    a.set(xlabel="context (tokens)", ylabel="KV cache (MiB)", xticks=s.contexts,
          title=f"slope {s.slope_bytes_per_token:,.0f} B/token ({s.deviation_percent:+.3f}% vs formula)")
    a.legend()
    rows = m.cache_vs_no_cache
    n = [r.new_tokens for r in rows]
    b.plot(n, [r.seconds_with_cache for r in rows], "o-", label="with cache")
    b.plot(n, [r.seconds_without_cache for r in rows], "s-", label="without cache")
    for r in rows:
        b.annotate(f"time {r.time_ratio:.1f}x\nwork {r.work_ratio:.0f}x", (r.new_tokens, r.seconds_without_cache),
                   textcoords="offset points", xytext=(0, 8), ha="center", va="bottom", fontsize=8)
    # room for the labels: beside the first and last points, and above the highest
    b.margins(x=0.15)
    b.set(xlabel="new tokens", ylabel="seconds", xticks=n, ylim=(0, 1.35 * max(r.seconds_without_cache for r in rows)),
          title=f"generation, prompt {rows[0].prompt} tokens")
    b.legend(loc="upper left")
    fig.suptitle(f"{m.model} ({m.dtype})")
    fig.tight_layout()
    return fig


def plot_measurement(m: Measurement, path: str | Path) -> None:
    """``measurement_figure`` written to a PNG."""
    import matplotlib.pyplot as plt

    fig = measurement_figure(m)
    fig.savefig(path, dpi=110)
    plt.close(fig)
