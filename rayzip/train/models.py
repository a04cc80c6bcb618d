"""Models for job specs: a built-in MLP, or ``module:function`` returning an ``nn.Module``.

A ``module:function`` model is called with ``in_features``, ``num_classes`` and the spec's
``model.kwargs``.
"""

from __future__ import annotations


import torch

from ..spec import ModelSpec, import_callable

__all__ = ["build_model"]


def mlp(in_features: int, num_classes: int, hidden: list[int]) -> torch.nn.Module:
    layers, width = [], in_features
    for h in hidden:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
        width = h
    layers.append(torch.nn.Linear(width, num_classes))
    return torch.nn.Sequential(*layers)


def build_model(spec: ModelSpec, in_features: int, num_classes: int) -> torch.nn.Module:
    if spec.name == "mlp":
        return mlp(in_features, num_classes, spec.hidden)
    return import_callable(spec.name)(in_features=in_features, num_classes=num_classes, **spec.kwargs)
