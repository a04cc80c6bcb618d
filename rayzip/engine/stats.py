"""What the engine counts: one step's statistics, the running totals, where each parameter
lies in the flat gradient, and the segments the flat gradient is cut into."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from itertools import accumulate

__all__ = ["FlatLayout", "StepStats", "TOTALS", "plan_segments"]

# The running totals a state_dict keeps: StepStats fields summed over the steps.
TOTALS = ("bytes_sent", "local_bytes", "dense_bytes", "comm_s", "busy_s", "network_s")


@dataclass
class StepStats:
    """What one worker's exchange did during one optimizer step."""

    step: int = 0
    compressed: bool = True
    density: float | None = None  # the kept fraction in force; None: dense, or a codec without one
    bytes_sent: int = 0  # bytes this worker handed to torch.distributed to send (ps: pushed)
    local_bytes: int = 0  # of bytes_sent, those to workers on its own node (hierarchy)
    # hierarchy: what this worker's node sends off the node, by the counts: this worker's
    # bytes off it, and the control word of each other worker there (all they send off it)
    node_bytes: int | None = None
    bytes_received: int = 0  # ps: bytes pulled from the shards
    dense_bytes: int = 0  # an fp32 ring allreduce of the same gradient: 2(n-1)/n * 4 * numel
    control_bytes: int = 0  # of bytes_sent, the control word's all-reduce
    comm_s: float = 0.0  # what the step waited for: the copies into the flat gradient, and
    # from the end of backward to the averaged gradient (all of the exchange without overlap)
    busy_s: float = 0.0  # the exchange's own time, start to end, whether overlapped or not
    network_s: float = 0.0  # of busy_s, inside torch.distributed (wire and waiting for peers)
    numel: int = 0
    buckets: list[int] = field(default_factory=list)  # element count of each segment exchanged
    verify_max_abs_err: float | None = None
    verify_documented_bytes: int | None = None  # verify mode: bytes_sent by the wire formulas
    hops: int = 0  # latency-bound sends (rayzip.comm.transport.Transport.hops)
    skipped: bool = False  # a rank's gradient was not finite: every rank dropped this step
    nonfinite: str | None = None  # why, when skipped
    stop: bool = False  # some rank asked every rank to stop after this step
    adopted: tuple[int, float] | None = None  # (seq, compression) agreed this step, applied from the next


def plan_segments(sizes: list[int], cap: int) -> list[tuple[int, int]]:
    """Cut a flat gradient of parameters with ``sizes`` (in order) into ``(lo, hi)`` ranges of
    whole parameters, each at least ``cap`` elements but the last, listed from the end of
    the gradient to its start (backward's order).

    >>> plan_segments([10, 10, 10, 10], cap=15)
    [(20, 40), (0, 20)]
    """
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    segments, hi, held = [], starts[-1], 0
    for i in reversed(range(len(sizes))):
        held += sizes[i]
        if held >= max(cap, 1) or i == 0:
            segments.append((starts[i], hi))
            hi, held = starts[i], 0
    return segments


class FlatLayout:
    """Where each parameter lies in the flat gradient: its start, and its name for messages.

    >>> FlatLayout([3, 4], ["w", "b"]).where(5)
    'b (parameter 1 of the model), element 2'
    """

    def __init__(self, sizes: list[int], names: list[str] | None = None):
        self.starts = list(accumulate(sizes, initial=0))
        self.numel = self.starts[-1]
        self.names = list(names) if names else [f"parameter {i}" for i in range(len(sizes))]

    def where(self, index: int) -> str:
        """'parameter NAME, element j' for a flat index of the gradient."""
        i = bisect.bisect_right(self.starts, index) - 1
        if 0 <= i < len(self.names):
            return f"{self.names[i]} (parameter {i} of the model), element {index - self.starts[i]}"
        return f"flat element {index}"
