"""What a run is made to suffer on purpose: a slower link, slow checkpoint writes, a killed
worker. For tests and what-if runs; ``rayzip run`` injects nothing.

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
    it starts, so that a worker can be killed while one is certainly in flight.
    ``kill_after_steps``: steps after which rank 0's worker process kills itself (SIGKILL),
    once the step's snapshot is taken and before the step is reported: a kill at a known
    place in the built-in loop, where a kill from outside lands wherever the worker happens
    to be. The i-th kill strikes in the i-th attempt only, so a resume before its step
    (one that redoes steps) does not strike again."""

    emulation: Emulation | None = None
    checkpoint_write_delay_s: float = 0.0
    kill_after_steps: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.checkpoint_write_delay_s < 0:
            raise ValueError(f"checkpoint_write_delay_s must be >= 0, got {self.checkpoint_write_delay_s}")
        if any(step < 0 for step in self.kill_after_steps):
            raise ValueError(f"kill_after_steps must be steps >= 0, got {self.kill_after_steps}")
