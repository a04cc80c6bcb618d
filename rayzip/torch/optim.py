"""The optimizer a job spec's ``training`` section names, for workers and parameter shards alike.

Usage::

    optimizer = build_optimizer(spec.training, model.parameters())
"""

from __future__ import annotations

import torch

from ..spec import TrainingSpec

__all__ = ["build_optimizer"]


def build_optimizer(training: TrainingSpec, params, momentum_elsewhere: bool = False,
                    adam_elsewhere: bool = False) -> torch.optim.Optimizer:
    """SGD (with the spec's momentum, or none when ``momentum_elsewhere``: momentum correction
    keeps it on the workers), Adam or AdamW, at the spec's base learning rate. With
    ``adam_elsewhere`` (Adam correction: the hook sends each worker's AdamW direction), SGD
    without momentum whose L2 term is AdamW's decoupled decay: ``p -= lr * (d + wd * p)``."""
    if adam_elsewhere:
        return torch.optim.SGD(params, lr=training.lr, momentum=0.0, weight_decay=training.weight_decay)
    if training.optimizer == "sgd":
        momentum = 0.0 if momentum_elsewhere else training.momentum
        return torch.optim.SGD(params, lr=training.lr, momentum=momentum, weight_decay=training.weight_decay)
    cls = torch.optim.Adam if training.optimizer == "adam" else torch.optim.AdamW
    return cls(params, lr=training.lr, betas=tuple(training.betas), weight_decay=training.weight_decay)
