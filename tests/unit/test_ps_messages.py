"""Parameter-server mode (issue 7) without Ray: shard bounds, optimizer state slices, pull
messages, and the spec's rules."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from rayzip.codecs import get_codec
from rayzip.ps import (decode_pull, encode_pull, merge_optimizer_states, message_nbytes, shard_bounds,
                       slice_optimizer_state)
from rayzip.spec import SpecError, parse_spec


# --- pure functions -------------------------------------------------------------------------


# --- pure functions -------------------------------------------------------------------------
@pytest.mark.parametrize("numel,shards", [(10, 3), (1000, 7), (5, 5), (7, 1)])
def test_shards_split_the_parameters_evenly_by_bytes(numel, shards):
    bounds = shard_bounds(numel, shards)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_optimizer_state_merges_and_slices_back_exactly():
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 7)]
    states = []
    for p in params:
        opt = torch.optim.Adam([p], lr=0.1)
        p.grad = torch.randn_like(p)
        opt.step()
        states.append(opt.state_dict())
    merged = merge_optimizer_states(states, [5, 7])
    assert merged["state"][0]["exp_avg"].shape == (12,)
    for (a, b), state in zip([(0, 5), (5, 12)], states):
        back = slice_optimizer_state(merged, a, b, 12)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(back["state"][0][key], state["state"][0][key])


@pytest.mark.parametrize("mode", ["dense", "lossless", "codec"])
def test_pull_messages_rebuild_the_workers_copy_bit_for_bit(mode):
    rng = np.random.default_rng(1)
    codec = get_codec("group_topk", density=0.05)
    params = rng.standard_normal(5000).astype(np.float32)
    message, shard_copy = encode_pull(mode, params, None, codec)
    assert message["kind"] == "dense"  # no copy yet: dense, whatever the mode
    worker_copy = decode_pull(message, None, params.size)
    for _ in range(30):
        params = params - 0.01 * rng.standard_normal(params.size).astype(np.float32)
        message, shard_copy = encode_pull(mode, params, shard_copy, codec)
        worker_copy = decode_pull(message, worker_copy, params.size)
        # The shard's record of the worker's copy is exactly the worker's copy.
        assert np.array_equal(worker_copy.view(np.uint32), shard_copy.view(np.uint32))
    if mode == "codec":
        # What the codec left out travels in later pulls: with the parameters still, the copy converges.
        for _ in range(60):
            message, shard_copy = encode_pull(mode, params, shard_copy, codec)
            worker_copy = decode_pull(message, worker_copy, params.size)
        assert np.abs(worker_copy - params).max() < 1e-6
        assert message_nbytes(message) == codec.wire_nbytes(params.size)
    else:
        assert np.array_equal(worker_copy.view(np.uint32), params.view(np.uint32))
    if mode == "lossless":  # small steps: the XOR delta's high bytes are mostly zero
        assert message_nbytes(message) < 0.8 * params.nbytes


def test_a_delta_pull_without_a_copy_is_refused():
    message, _ = encode_pull("lossless", np.ones(10, np.float32), np.zeros(10, np.float32), None)
    with pytest.raises(ValueError, match="holds none"):
        decode_pull(message, None, 10)


def test_spec_refuses_what_ps_mode_cannot_do():
    with pytest.raises(SpecError, match="ps: the ps section applies only with compression.collective: ps"):
        parse_spec({"name": "x", "ps": {"shards": 2}})
    with pytest.raises(SpecError, match="compression: verify and torch_hook work on collectives among the workers"):
        parse_spec({"name": "x", "compression": {"collective": "ps", "verify": True}})
    with pytest.raises(SpecError, match="adaptive: the adaptive controller tunes collectives among the workers"):
        parse_spec({"name": "x", "compression": {"codec": "topk", "collective": "ps"}, "adaptive": {"enabled": True}})
    with pytest.raises(SpecError, match="ps.pull"):
        parse_spec({"name": "x", "compression": {"collective": "ps"}, "ps": {"pull": "zip"}})
    # Any codec fits: the shard decodes every push (dct_quant cannot ring or allreduce).
    assert parse_spec({"name": "x", "compression": {"codec": "dct_quant", "collective": "ps"}})
