"""Linear learning-rate scaling for data-parallel training.

With w workers each taking the same per-worker batch, the global batch is w times larger,
so the learning rate scales by w / base_world_size (Goyal et al. 2017), ramped up linearly
over ``warmup_steps`` to avoid the early instability of a large step. Elastic resizes
restart the workers, which then recompute it for the new world size.

Usage::

    for group in optimizer.param_groups:
        group["lr"] = scaled_lr(0.05, world_size, base_world_size=1, step=step, warmup_steps=100)
"""

from __future__ import annotations

__all__ = ["scaled_lr"]


def scaled_lr(base_lr: float, world_size: int, base_world_size: int = 1, step: int = 0,
              warmup_steps: int = 0) -> float:
    """base_lr * world_size / base_world_size, ramped from base_lr over warmup_steps."""
    if world_size < 1 or base_world_size < 1:
        raise ValueError("world sizes must be >= 1")
    target = base_lr * world_size / base_world_size
    if warmup_steps <= 0 or step >= warmup_steps:
        return target
    return base_lr + (target - base_lr) * step / warmup_steps
