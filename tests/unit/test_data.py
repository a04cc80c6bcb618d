"""The job specs' built-in datasets (rayzip.train.data)."""

from __future__ import annotations

import numpy as np

from rayzip.spec import DatasetSpec
from rayzip.train.data import load_dataset


def test_digits_are_scikit_learns_digits_read_without_importing_it():
    from sklearn.datasets import load_digits

    reference = load_digits()
    x_train, y_train, x_test, y_test = load_dataset(DatasetSpec(name="digits", test_fraction=0.25), seed=3)
    order = np.random.default_rng(3).permutation(len(reference.data))
    n_test = round(0.25 * len(order))
    np.testing.assert_array_equal(x_test.numpy(), (reference.data[order[:n_test]] / 16.0).astype(np.float32))
    np.testing.assert_array_equal(y_test.numpy(), reference.target[order[:n_test]])
    np.testing.assert_array_equal(x_train.numpy(), (reference.data[order[n_test:]] / 16.0).astype(np.float32))
    np.testing.assert_array_equal(y_train.numpy(), reference.target[order[n_test:]])
