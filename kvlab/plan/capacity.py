"""Capacity searches: the longest context that fits, and the fewest GPUs that hold everything."""

from __future__ import annotations

from collections.abc import Callable

MAX_GPUS = 4096  # beyond this the planner reports "> 4096"


def longest_context(fits: Callable[[int], bool], upper: int) -> int | None:
    """Largest context in [1, upper] for which `fits` holds (it is monotone), or None."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo or None


def gpus_needed(tp_sizes: list[int], fits: Callable[[int, int], bool]) -> int | None:
    """Fewest GPUs n for which some valid TP size t dividing n makes `fits(t, n)` hold."""
    for n in range(1, MAX_GPUS + 1):
        if any(n % t == 0 and fits(t, n) for t in tp_sizes):
            return n
    return None
