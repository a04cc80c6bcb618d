"""Verify mode's self-check (``config.verify``): the collective's average against the mean of
every rank's decoded payload, gathered uncompressed and not counted."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..xp import to_torch

__all__ = ["verify_average"]


def verify_average(communicator, codec, payload, average: torch.Tensor) -> float:
    """The largest absolute difference between ``average`` and the mean of every rank's
    decoded ``payload`` (every rank of the communicator calls it)."""
    transport = communicator.transport  # with a hierarchy, the node leaders'
    mine = to_torch(codec.decode_flat(payload)).float().to(transport.device) / communicator.input_scale
    everyone = [torch.empty_like(mine) for _ in range(transport.world)]
    dist.all_gather(everyone, mine, group=transport.group)
    reference = torch.stack(everyone).mean(dim=0)
    got = average.float().to(reference.device)
    return float((got - reference).abs().max()) if got.numel() else 0.0
