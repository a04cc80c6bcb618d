"""Counter-based randomness that numpy and cupy compute identically (splitmix64).

Random-k regenerates its indices from a seed on every receiver, which may run a different
array library than the sender (a GPU worker pushing to a CPU parameter server), so the
indices come from this integer hash rather than from a library's generator.
"""

from __future__ import annotations

__all__ = ["mix64", "call_seed"]

_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_MASK = (1 << 64) - 1


def mix64(seed: int, counters, xp):
    """splitmix64 of ``seed`` advanced by each counter: uint64 array like ``counters``."""
    u64 = xp.uint64
    z = counters.astype(u64) * u64(_GOLDEN) + u64(seed & _MASK)
    z = (z ^ (z >> u64(30))) * u64(_M1)
    z = (z ^ (z >> u64(27))) * u64(_M2)
    return z ^ (z >> u64(31))


def call_seed(seed: int, call: int) -> int:
    """The seed of the ``call``-th encode of a codec seeded with ``seed`` (pure Python)."""
    z = (seed + (call + 1) * _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)
