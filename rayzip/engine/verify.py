"""Verify mode's self-check (``config.verify``): the collective's average against the mean of
every rank's decoded payload, gathered uncompressed and not counted."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..xp import to_torch

__all__ = ["verify_average", "verify_segment"]


def verify_average(communicator, codec, payload, average: torch.Tensor, segment: str = "") -> float:
    """The largest absolute difference between ``average`` and the mean of every rank's
    decoded ``payload``, as the collective should leave it (every rank of the communicator
    calls it)."""
    transport = communicator.transport  # with a hierarchy, the node leaders'
    mine = to_torch(codec.decode_flat(payload)).float().to(transport.device) / communicator.input_scale
    everyone = [torch.empty_like(mine) for _ in range(transport.world)]
    dist.all_gather(everyone, mine, group=transport.group)
    reference = communicator.expected(torch.stack(everyone).mean(dim=0), segment)
    got = average.float().to(reference.device)
    return float((got - reference).abs().max()) if got.numel() else 0.0


def verify_segment(stats, communicator, codec, payload, average: torch.Tensor, control: int, hierarchy,
                   numel: int, segment: str = "") -> None:
    """Record one segment's self-check in ``stats`` (a :class:`~rayzip.engine.StepStats`): the
    largest error of ``average`` against every rank's decoded payload, and the bytes the
    collectives' documented formulas give (the control word's ``control`` included), which
    the counted bytes must equal."""
    documented = control
    if payload is not None:
        err = verify_average(communicator, codec, payload, average, segment)
        stats.verify_max_abs_err = max(stats.verify_max_abs_err or 0.0, err)
        documented += communicator.documented_bytes(codec, payload)
    if hierarchy is not None:
        documented += hierarchy.documented_bytes(numel)
    stats.verify_documented_bytes = (stats.verify_documented_bytes or 0) + documented
