"""Choosing H, the inner steps between synchronizations of local steps
(:class:`rayzip.torch.local_steps.LocalSteps`), from the cost of a synchronization against
the compute of a step.

With H inner steps per synchronization a step costs, on average, ``compute + sync / H``.
A larger H always runs faster and always drifts further from synchronous training, so H
follows the cost model's rule for the compression: the least compression (here the
smallest H, within ``[low, high]``) whose predicted step is within ``slack`` of the fastest
(H = ``high``). A slow link (a long ``sync``) raises H; a fast one, or heavy compute,
lowers it toward ``low``.

The inputs are medians over the last few synchronizations, so that one slow round (a
straggler, a hiccup of the link) does not move H by itself, and H falls only once it is a
quarter above the choice (it rises at once: a slower link needs it), so that it does not
flap with the noise of the timings. :class:`LocalSteps` feeds it
every rank's slowest compute and the shortest synchronization (the rank that arrived last
waited least, so its time is the wire's, not a straggler's), all-reduced, so every rank
holds the same inputs and takes the same H at the same step.

Usage::

    tuner = EveryTuner(low=1, high=100, slack=0.1)
    every = tuner.observe(sync_s=2.0, compute_s=0.9)    # 18: a step 0.1 s slower than at H = 100
"""

from __future__ import annotations

import math
import statistics
from collections import deque

__all__ = ["EveryTuner", "choose_every"]

HYSTERESIS = 0.25  # H is kept while at most this share above the choice


def choose_every(sync_s: float, compute_s: float, low: int, high: int, slack: float,
                 overlap: bool = False) -> int:
    """The smallest H in ``[low, high]`` with ``compute_s + sync_s / H`` within ``slack``
    of ``compute_s + sync_s / high``. With ``overlap`` (a round's synchronization runs
    during the next round's inner steps) a step costs ``max(compute_s, sync_s / H)``
    instead."""
    if not low <= high:
        raise ValueError(f"low ({low}) is above high ({high})")
    if sync_s <= 0:
        return low
    if overlap:
        fastest = max(compute_s, sync_s / high)
        return min(high, max(low, math.ceil(sync_s / ((1 + slack) * fastest) - 1e-9)))
    # What a step may spend on synchronization: the fastest step's share, plus the slack.
    budget = slack * compute_s + (1 + slack) * sync_s / high
    if budget <= 0:
        return high
    return min(high, max(low, math.ceil(sync_s / budget - 1e-9)))


class EveryTuner:
    """H from the medians of the last ``window`` synchronizations' measurements."""

    def __init__(self, low: int, high: int, slack: float, window: int = 3, overlap: bool = False):
        if not 1 <= low <= high:
            raise ValueError(f"need 1 <= low <= high, got low {low}, high {high}")
        self.low, self.high, self.slack, self.overlap = int(low), int(high), float(slack), bool(overlap)
        self.window = int(window)
        self.seen: deque[tuple[float, float]] = deque(maxlen=self.window)

    def observe(self, sync_s: float, compute_s: float, current: int | None = None) -> int:
        """Record one synchronization's time and the mean compute per inner step since the
        one before; the H to use from now on (``current`` where that is still fast enough
        and not far above the choice)."""
        self.seen.append((float(sync_s), float(compute_s)))
        sync = statistics.median(s for s, _ in self.seen)
        compute = statistics.median(c for _, c in self.seen)
        chosen = choose_every(sync, compute, self.low, self.high, self.slack, self.overlap)
        if current is not None and chosen <= current <= math.ceil(chosen * (1 + HYSTERESIS)):
            return current
        return chosen

    def state_dict(self) -> dict:
        return {"seen": [list(pair) for pair in self.seen]}

    def load_state_dict(self, state: dict | None) -> None:
        self.seen.clear()
        for sync_s, compute_s in (state or {}).get("seen", []):
            self.seen.append((float(sync_s), float(compute_s)))
