"""Datasets for job specs: scikit-learn digits, a synthetic task with a known optimum, or yours.

Every loader returns ``(x_train, y_train, x_test, y_test)`` as float32/int64 torch tensors,
identical on every worker (seeded), so each worker can cut its own shard.
"""

from __future__ import annotations


import numpy as np
import torch

from ..spec import DatasetSpec, import_callable

__all__ = ["load_dataset", "shard"]


def _split(x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int):
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = max(1, int(round(test_fraction * len(x))))
    test, train = order[:n_test], order[n_test:]
    as_t = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a)).to(dt)  # noqa: E731
    return as_t(x[train], torch.float32), as_t(y[train], torch.int64), as_t(x[test], torch.float32), as_t(y[test], torch.int64)


def digits(spec: DatasetSpec, seed: int):
    """scikit-learn's 8x8 digits (1797 images, shipped inside the package), scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    data = load_digits()
    return _split(data.data.astype(np.float32) / 16.0, data.target, spec.test_fraction, seed)


def synthetic(spec: DatasetSpec, seed: int):
    """Gaussian inputs labelled by a random linear teacher: the optimum is known.

    A perfect model reaches 1 - label_noise * (classes - 1) / classes test accuracy.
    """
    rng = np.random.default_rng(seed + 1)
    teacher = rng.standard_normal((spec.features, spec.classes))
    x = rng.standard_normal((spec.samples, spec.features)).astype(np.float32)
    y = (x @ teacher).argmax(axis=1)
    flip = rng.random(spec.samples) < spec.label_noise
    y[flip] = rng.integers(0, spec.classes, int(flip.sum()))
    return _split(x, y, spec.test_fraction, seed)


def optimum_accuracy(spec: DatasetSpec) -> float:
    return 1.0 - spec.label_noise * (spec.classes - 1) / spec.classes


def load_dataset(spec: DatasetSpec, seed: int):
    if spec.name == "digits":
        return digits(spec, seed)
    if spec.name == "synthetic":
        return synthetic(spec, seed)
    return import_callable(spec.name)(**spec.kwargs)


def shard(n: int, rank: int, world: int, seed: int) -> torch.Tensor:
    """This worker's disjoint share of ``n`` training examples."""
    order = torch.from_numpy(np.random.default_rng(seed + 2).permutation(n))
    return order[rank::world]
