"""A slower link than the real one, for trying a controller or a codec without root.

A :class:`~rayzip.comm.Transport` given an emulation waits, after each send, the time the
emulated link would add: ``bytes / bandwidth + latency``, counted as network time like the
wire's own. The cluster benchmark emulates links for real instead (tc in network namespaces).

Usage::

    transport = Transport(emulation=FixedLink(Link(bandwidth=12.5e6, latency=1e-3)))  # 100 Mbit/s

A link that changes during a run overrides :meth:`Emulation.link`.
"""

from __future__ import annotations

from .cost import Link

__all__ = ["Emulation", "FixedLink"]


class Emulation:
    """The base: no link emulated, nothing added."""

    def link(self) -> Link | None:
        """The emulated link now; None: only the real one."""
        return None

    def delay_s(self, nbytes: int) -> float:
        """Seconds a send of ``nbytes`` takes on the emulated link."""
        link = self.link()
        return 0.0 if link is None else nbytes / link.bandwidth + link.latency


class FixedLink(Emulation):
    """One link for the whole run."""

    def __init__(self, link: Link):
        if link.bandwidth <= 0 or link.latency < 0:
            raise ValueError(f"an emulated link needs a positive bandwidth and a latency >= 0, got {link}")
        self._link = link

    def link(self) -> Link:
        return self._link
