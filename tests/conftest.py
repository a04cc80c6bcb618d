"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def local_ray():
    """One real local Ray per test module (2 CPUs). Workers import helper modules in tests/
    (poisoned_data, user_loops) by name, through PYTHONPATH."""
    import ray

    ray.init(address="local", num_cpus=2, runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).parent)}})
    yield
    ray.shutdown()
