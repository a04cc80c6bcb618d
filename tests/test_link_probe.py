"""The timed start-up sync that stands in for DDP's (rayzip.train.probe), on real gloo
processes: it makes every rank's weights rank 0's, refuses models that differ, and
measures a dense-sized transfer for the adaptive controller's link fit."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

try:
    from gloo_world import run_world
except ImportError:
    from tests.gloo_world import run_world
from rayzip.train.probe import sync_module_states


def _model(rank: int, width: int = 32) -> torch.nn.Module:
    torch.manual_seed(rank)  # every rank starts from different weights
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.BatchNorm1d(width), torch.nn.Linear(width, 4))
    model.train()(torch.randn(8, 16))  # running statistics that differ by rank too
    return model


def _sync_rank(rank: int, world: int, widths: list[int]):
    model = _model(rank, widths[rank])
    try:
        probe = sync_module_states(model)
    except ValueError as exc:
        return {"error": str(exc)}
    return {"state": {k: v.numpy().copy() for k, v in model.state_dict().items()}, "probe": probe}


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_rank_0s_weights_and_buffers_and_the_transfer_is_timed(world):
    results = run_world(_sync_rank, world, [32] * world)
    reference = _model(0).state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in reference.values())
    rounds = math.ceil(math.log2(world))
    for r in results:
        for name, value in reference.items():
            np.testing.assert_array_equal(r["state"][name], value.numpy(), err_msg=name)
        probe = r["probe"]
        # float32 weights and statistics in one broadcast, the int64 batch count in another
        assert probe.bytes == rounds * nbytes and probe.messages == rounds * 2 and probe.seconds > 0


def test_a_rank_whose_model_differs_is_refused_on_every_rank():
    results = run_world(_sync_rank, 2, [32, 48])
    for r in results:
        assert "0.weight" in r["error"] and "(32, 16)" in r["error"] and "(48, 16)" in r["error"], r
