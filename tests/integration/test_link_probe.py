"""The timed start-up sync that stands in for DDP's (rayzip.train.probe), on real gloo
processes: it makes every rank's weights rank 0's, refuses models that differ, and
measures a dense-sized transfer for the adaptive controller's link fit."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gloo_world import run_world
from rayzip.train.probe import sync_module_states


def _model(rank: int, width: int = 32) -> torch.nn.Module:
    torch.manual_seed(rank)  # every rank starts from different weights
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.BatchNorm1d(width), torch.nn.Linear(width, 4))
    model.train()(torch.randn(8, 16))  # running statistics that differ by rank too
    return model


def _state(model: torch.nn.Module) -> dict:
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


def _sync_rank(rank: int, world: int, widths: list[int]):
    model = _model(rank, widths[rank])
    before = _state(model)
    try:
        probe = sync_module_states(model)
    except ValueError as exc:
        return {"error": str(exc)}
    return {"before": before, "state": _state(model), "probe": probe}


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_rank_0s_weights_and_buffers_and_the_transfer_is_timed(world):
    results = run_world(_sync_rank, world, [32] * world)
    # rank 0's own state before the sync (running statistics computed in another process
    # may differ in the last bit, with another thread count)
    reference = results[0]["before"]
    assert any(not np.array_equal(results[1]["before"][k], v) for k, v in reference.items())  # it had work to do
    nbytes = sum(v.nbytes for v in reference.values())
    rounds = math.ceil(math.log2(world))
    for r in results:
        for name, value in reference.items():
            np.testing.assert_array_equal(r["state"][name], value, err_msg=name)
        probe = r["probe"]
        # float32 weights and statistics in one broadcast, the int64 batch count in another
        assert probe.bytes == rounds * nbytes and probe.messages == rounds * 2 and probe.seconds > 0


def test_a_rank_whose_model_differs_is_refused_on_every_rank():
    results = run_world(_sync_rank, 2, [32, 48])
    for r in results:
        assert "0.weight" in r["error"] and "(32, 16)" in r["error"] and "(48, 16)" in r["error"], r
