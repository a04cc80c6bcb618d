"""The user's side of the engine: requests that take effect at a step boundary, so that every
rank switches at the same step.

A request made on one rank alone (a controller's proposal, a stop) rides on the next control
word; the others (:meth:`Knobs.set_density`, :meth:`Knobs.set_enabled`,
:meth:`Knobs.compress_at`) must be made on every rank for the same step: a rank that does
not is caught by the control word, and every rank raises.
"""

from __future__ import annotations

import threading

from ..comm.control import proposal_key

__all__ = ["Knobs"]


class Knobs:
    """Pending requests, applied by the engine at its next step (see the module docstring)."""

    def __init__(self):
        self.enabled = True
        self._pending_density: float | None = None
        self._pending_enabled: bool | None = None
        self._proposal = 0
        self._stop = False
        self._requests = threading.Lock()  # propose/request_stop may run while the worker sends

    @property
    def density(self) -> float | None:
        """The kept fraction in force (None: a codec that sends every entry)."""
        raise NotImplementedError

    def set_density(self, density: float) -> None:
        """Keep ``density`` of the entries from the next step on. Call it on every rank for the
        same step."""
        if self.density is None:
            raise ValueError("this codec has no density to change")
        self._pending_density = float(density)

    def set_enabled(self, enabled: bool) -> None:
        """Compression on, or off (dense fp32 allreduce), from the next step on, on every rank."""
        self._pending_enabled = bool(enabled)

    def compress_at(self, compression: float) -> None:
        """From the next step on, compress at ``compression`` (1 / kept fraction; 1 or
        less: off). Every rank must call it for the same step, as :meth:`propose`'s agreed
        proposals do."""
        self._pending_enabled = compression > 1.0
        if compression > 1.0 and self.density is not None:
            self._pending_density = 1.0 / compression

    def propose(self, compression: float, seq: int = 0) -> None:
        """Ask every rank to compress at ``compression`` (1 / kept fraction; 1 or less:
        off) from the step after the next exchange. One rank may call it alone (a controller's
        decision reaches rank 0 only); the control word carries it to the others, and the
        highest ``seq`` wins. ``last_step.adopted`` says when it was agreed."""
        with self._requests:
            self._proposal = proposal_key(seq, compression)

    def request_stop(self) -> None:
        """Ask every rank to stop: ``last_step.stop`` is set on every rank after the next
        exchange. A rank whose data ran out, or that was told of its preemption, calls it
        while still running that step."""
        with self._requests:
            self._stop = True

    def _take_requests(self) -> tuple[bool, int]:
        """(stop, proposal) for the next control word; each is sent once."""
        with self._requests:
            stop, self._stop = self._stop, False
            proposal, self._proposal = self._proposal, 0
        return stop, proposal

    def _take_pending(self) -> float | None:
        """At a step boundary: switch on or off as asked; the density asked for, if any."""
        if self._pending_enabled is not None:
            self.enabled, self._pending_enabled = self._pending_enabled, None
        density, self._pending_density = self._pending_density, None
        return density
