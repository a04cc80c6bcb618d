"""Timing helpers shared by the benchmarks."""

from __future__ import annotations

import time
from typing import Any, Callable

__all__ = ["best_time", "device_sync", "interleaved"]


def device_sync(xp) -> None:
    """Wait for queued GPU work (a no-op for numpy)."""
    if xp.__name__ == "cupy":
        xp.cuda.get_current_stream().synchronize()


def best_time(fn: Callable[[], Any], repeat: int, xp) -> tuple[float, Any]:
    """Fastest of ``repeat`` timed calls after one warm-up, and the last result.

    The minimum is the figure least disturbed by other load on a shared machine.
    """
    result = fn()
    device_sync(xp)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        device_sync(xp)
        best = min(best, time.perf_counter() - start)
    return best, result


def interleaved(items: list, round_: int) -> list:
    """``items`` rotated by ``round_``: the order of round ``round_`` of repeated runs, so
    that no item always runs first or last on a machine whose load drifts."""
    shift = round_ % len(items)
    return items[shift:] + items[:shift]
