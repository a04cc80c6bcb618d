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

import math

__all__ = ["cosine_lr", "learning_rate", "scaled_lr"]


def scaled_lr(base_lr: float, world_size: int, base_world_size: int = 1, step: int = 0,
              warmup_steps: int = 0) -> float:
    """base_lr * world_size / base_world_size, ramped from base_lr over warmup_steps."""
    if world_size < 1 or base_world_size < 1:
        raise ValueError("world sizes must be >= 1")
    target = base_lr * world_size / base_world_size
    if warmup_steps <= 0 or step >= warmup_steps:
        return target
    return base_lr + (target - base_lr) * step / warmup_steps


def cosine_lr(peak_lr: float, step: int, total_steps: int, warmup_steps: int = 0, min_ratio: float = 0.1) -> float:
    """Linear warm-up from 0 to ``peak_lr`` over ``warmup_steps``, then a cosine decay to
    ``min_ratio * peak_lr`` at step ``total_steps - 1`` (and held there after it)."""
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    span = max(1, total_steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return peak_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def learning_rate(training, world_size: int, step: int, total_steps: int) -> float:
    """The learning rate a job spec's ``training`` section sets for ``step``: the linearly
    scaled rate, under its ``lr_schedule``."""
    if training.lr_schedule == "cosine":
        peak = scaled_lr(training.lr, world_size, training.base_world_size)
        return cosine_lr(peak, step, total_steps, training.lr_warmup_steps, training.min_lr_ratio)
    return scaled_lr(training.lr, world_size, training.base_world_size, step, training.lr_warmup_steps)
