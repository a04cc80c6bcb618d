"""A dataset for tests/system/test_train_ray.py: digits with one worker's whole shard made NaN."""

from __future__ import annotations

import torch

from rayzip.spec import DatasetSpec
from rayzip.train.data import digits, shard


def digits_with_a_nan_shard(rank: int = 1, world: int = 2, seed: int = 0):
    x_train, y_train, x_test, y_test = digits(DatasetSpec(), seed)
    x_train[shard(len(x_train), rank, world, seed)] = float("nan")
    return x_train, y_train, x_test, y_test
