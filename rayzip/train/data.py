"""Datasets for job specs: scikit-learn digits, a synthetic task with a known optimum, or yours.

Every loader returns ``(x_train, y_train, x_test, y_test)`` as float32/int64 torch tensors,
identical on every worker (seeded), so each worker can cut its own shard.
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

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
    data = _digits_table()
    return _split(data[:, :-1].astype(np.float32) / 16.0, data[:, -1].astype(np.int64), spec.test_fraction, seed)


def _digits_table() -> np.ndarray:
    """The file that ``sklearn.datasets.load_digits`` parses (rows of 64 pixels and a label),
    read without importing scikit-learn: that import (scipy and more) costs every worker
    seconds of CPU at start-up, more than the rest of a short job."""
    package = importlib.util.find_spec("sklearn")
    if package is None or not package.submodule_search_locations:
        raise ModuleNotFoundError("the digits dataset ships with scikit-learn: pip install scikit-learn")
    path = Path(package.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as lines:
        return np.loadtxt(lines, delimiter=",")


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
