"""Steps with compression off, as DDP itself takes them: each bucket all-reduced in place.

A step whose gradient crosses the wire whole (compression switched off by a controller,
warm-up, or the lossless ``none`` codec) needs none of the compressed path's machinery:
no flat copy of the gradient, no codec, no per-segment control word, no per-rank error
feedback. Each DDP bucket is scaled by 1/world and all-reduced where it lies as soon as
backward produces it, as DDP's built-in allreduce does; the hook agrees on the step's
control word once, at the last bucket.

What the compressed path holds carries across a switch. At the first dense step the
workers' residuals and velocities are averaged once (one all-reduce of both, twice the
gradient's size):

* error feedback: the residuals' mean is added to that step's average, once: every rank
  sends what it had held back, as a dense step through the codec would;
* momentum correction: from then on every rank holds the same velocity
  ``u = m * u + mean(g)``, which is SGD momentum on the averaged gradient (what DDP with
  SGD momentum computes), and a later compressed step starts again from it;
* Adam correction: likewise every rank holds the same moments of the averaged gradient and
  sends nothing but that gradient: AdamW on DDP's average. (Compressed, each worker sends
  its own Adam direction; their mean is not linear in the gradient, so at the switch the
  second moments' mean stands in for the second moment of the mean, and decays to it.)

Each rank checks its own gradient for NaN and Inf as it scales each bucket, in the same pass
(:func:`rayzip.codecs.kernels.scale_checked`), rather than the sum in a second pass after it:
the hook puts the first bad element in the step's control word, so that every rank skips the
step or raises together, naming the rank. (A sum of finite gradients that overflows float32
is not caught, as DDP does not catch it.)

Usage (inside the DDP hook, :class:`rayzip.torch.hook.DDPHookState`)::

    steps = DenseSteps(exchange, offsets, segment_of)
    steps.start(device)                                         # at the step's first bucket
    future = steps.bucket(bucket.buffer(), bucket.parameters())  # each bucket: DDP's future
    bad_index = steps.local_bad()                               # at the last bucket, for the control word
    span_s = steps.finish(skip=False)                           # once backward is done
"""

from __future__ import annotations

import time

import torch

from ..codecs.kernels import adam_update, momentum_update, scale_checked
from ..codecs.memory import AdamCorrection, MomentumCorrection
from ..xp import as_array, to_torch

__all__ = ["DenseSteps"]


class DenseSteps:
    """The dense step in flight, on the engine's transport and memory. The engine keeps
    whether the memory was averaged (``exchange.drained``: every rank holds the same momentum
    or moments, and no residuals), which its checkpoints save.

    Args:
        exchange: the engine (:class:`rayzip.engine.GradientExchange`).
        offsets: each parameter's (flat offset, element count), by ``id``.
        segment_of: each parameter's segment, by ``id``.
    """

    def __init__(self, exchange, offsets: dict[int, tuple[int, int]], segment_of: dict[int, int]):
        self.exchange = exchange
        self.transport, self.memory = exchange.transport, exchange.memory
        self.segments, self.names = exchange.segments, exchange.segment_names
        self.offsets, self.segment_of = offsets, segment_of
        self.numel = exchange.numel
        # The memory's per-segment state that dense steps keep shared and update.
        self.slots = {MomentumCorrection: ("velocities",), AdamCorrection: ("first", "second")}.get(type(self.memory), ())
        self._flush: torch.Tensor | None = None  # the residuals' mean, added once
        self._held: dict[str, list[torch.Tensor | None]] = {}
        self._new: dict[str, list[torch.Tensor]] = {}
        self._bias: dict[int, tuple[float, float]] = {}  # Adam: per segment, 1 / (1 - b ** t)
        self._bad: int | None = None  # the lowest flat index of a non-finite host bucket's entry
        self._pending: list[tuple[torch.Tensor, list[tuple[int, int, int, int]]]] = []  # device buckets' checks
        self._futures: list[torch.futures.Future] = []
        self._snapshot: dict | None = None
        self._was_drained = False
        self._started = self._done = 0.0

    def start(self, device: torch.device) -> None:
        """At the step's first bucket: average what the memory holds, if not done yet."""
        self._started = self._done = time.perf_counter()
        self._bad, self._pending, self._futures = None, [], []
        self._snapshot, self._was_drained = self.memory.snapshot(), self.exchange.drained
        self._flush = None
        if not self.exchange.drained:
            self._drain(device)
        # Written per parameter by the buckets' callbacks (disjoint slices), committed by
        # finish(): a skipped step keeps the state it started with.
        for slot in self.slots:
            held = getattr(self.memory, slot)
            self._held[slot] = [None if held.get(n) is None else to_torch(held[n]) for n in self.names]
            self._new[slot] = [torch.empty(hi - lo, dtype=torch.float32, device=device) for lo, hi in self.segments]
        if isinstance(self.memory, AdamCorrection):
            (b1, b2), steps = self.memory.betas, self.memory.steps
            self._bias = {k: (1 / (1 - b1 ** (steps.get(n, 0) + 1)), 1 / (1 - b2 ** (steps.get(n, 0) + 1)))
                          for k, n in enumerate(self.names)}

    def _drain(self, device: torch.device) -> None:
        rows = [self.memory.residuals] + [getattr(self.memory, slot) for slot in self.slots]
        if any(rows):
            stacked = torch.zeros(len(rows), self.numel, dtype=torch.float32, device=device)
            for k, (lo, hi) in enumerate(self.segments):
                for row, held in enumerate(rows):
                    if held.get(self.names[k]) is not None:
                        stacked[row, lo:hi] = to_torch(held[self.names[k]]).to(device)
            self.transport.all_reduce(stacked)
            stacked /= self.transport.world
            if self.memory.residuals:
                self._flush = stacked[0]
            self.memory.residuals = {}
            for row, slot in enumerate(self.slots, start=1):
                if rows[row]:
                    setattr(self.memory, slot, {self.names[k]: as_array(stacked[row, lo:hi].clone())[0]
                                                for k, (lo, hi) in enumerate(self.segments)})
        self.exchange.drained = True

    def bucket(self, buffer: torch.Tensor, params: list[torch.Tensor]) -> torch.futures.Future:
        """Start the all-reduce of one DDP bucket; its future completes with the average
        (with momentum or Adam correction: the update they make of it)."""
        spans, pos = [], 0
        for p in params:
            offset, n = self.offsets[id(p)]
            spans.append((offset, n, pos, self.segment_of.get(id(p), 0)))
            pos += n
        # As DDP's own allreduce: each rank's share, then the sum; checked as it is scaled.
        first = scale_checked(buffer, 1.0 / self.transport.world)
        if isinstance(first, torch.Tensor):
            self._pending.append((first, spans))
        elif first >= 0:  # rare: name the lowest flat index before the all-reduce overwrites the bucket
            for offset, n, pos, _ in sorted(spans):
                found = torch.nonzero(~torch.isfinite(buffer[pos: pos + n]))
                if found.numel():
                    index = offset + int(found[0])
                    self._bad = index if self._bad is None else min(self._bad, index)
                    break
        future = self.transport.start_all_reduce(buffer).then(lambda f: self._complete(f.value(), spans))
        self._futures.append(future)
        return future

    def _complete(self, average: torch.Tensor, spans: list[tuple[int, int, int, int]]) -> torch.Tensor:
        for offset, n, pos, k in spans:
            if not n:
                continue
            view = average[pos: pos + n]
            at = slice(offset - self.segments[k][0], offset - self.segments[k][0] + n)
            if self.slots == ("velocities",):
                self._momentum(view, self._held["velocities"][k], self._new["velocities"][k][at], at)
            elif self.slots:
                self._adam(view, k, at)
            if self._flush is not None:
                view.add_(self._flush[offset: offset + n])
        self._done = time.perf_counter()
        return average

    def _momentum(self, grad: torch.Tensor, held: torch.Tensor | None, new: torch.Tensor, at: slice) -> None:
        momentum_update(grad, None if held is None else held[at], new, self.memory.momentum)

    def _adam(self, grad: torch.Tensor, k: int, at: slice) -> None:
        """As :class:`rayzip.codecs.memory.AdamCorrection`, on the averaged gradient."""
        m_held, v_held = self._held["first"][k], self._held["second"][k]
        adam_update(grad, None if m_held is None else m_held[at], None if v_held is None else v_held[at],
                    self._new["first"][k][at], self._new["second"][k][at], self.memory.betas, self._bias[k],
                    self.memory.eps)

    def local_bad(self) -> int | None:
        """Once every bucket has started: the lowest flat index at which this rank's own
        gradient is not finite, or None. (On a device, waited for here, once per step; a
        bucket's entry there is its first in DDP's bucket layout, not the lowest.)"""
        bad = self._bad
        for first, spans in self._pending:
            first = int(first)
            if first < 0:
                continue
            for offset, n, pos, _ in spans:
                if pos <= first < pos + n:
                    bad = offset + first - pos if bad is None else min(bad, offset + first - pos)
        return bad

    def finish(self, skip: bool = False) -> float:
        """After the buckets' futures: the exchange's span in seconds. With ``skip`` (every
        rank skips the step: some rank's gradient was not finite) the memory stays as it was."""
        torch.futures.wait_all(self._futures)
        if skip:
            self.memory.restore(self._snapshot)
            self.exchange.drained = self._was_drained
        else:
            for slot in self.slots:
                setattr(self.memory, slot, {n: as_array(v)[0] for n, v in zip(self.names, self._new[slot])})
            if isinstance(self.memory, AdamCorrection):
                self.memory.steps = {n: self.memory.steps.get(n, 0) + 1 for n in self.names}
        self._bad, self._pending, self._futures, self._held, self._new = None, [], [], {}, {}
        self._flush, self._snapshot = None, None
        return self._done - self._started
