"""What a run is made to suffer on purpose: a slower link, slow checkpoint writes. For tests
and what-if runs; ``rayzip run`` injects nothing.

Usage::

    from rayzip.comm import FixedLink, Link
    run_job(spec, faults=Faults(emulation=FixedLink(Link(bandwidth=12.5e6, latency=1e-3)),
                                checkpoint_write_delay_s=8))

The object travels to every worker with the job (pickled), so an :class:`Emulation` of your
own must be importable there.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..comm.emulation import Emulation

__all__ = ["Faults"]


@dataclass(frozen=True)
class Faults:
    """``emulation``: the link every rayzip exchange's sends are slowed to (none: the real
    one). ``checkpoint_write_delay_s``: seconds each background checkpoint write sleeps before
    it starts, so that a worker can be killed while one is certainly in flight."""

    emulation: Emulation | None = None
    checkpoint_write_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.checkpoint_write_delay_s < 0:
            raise ValueError(f"checkpoint_write_delay_s must be >= 0, got {self.checkpoint_write_delay_s}")
