"""Local steps on shards (DiLoCo on FSDP2, issue 47): four gloo ranks as two nodes of two.
Each node trains with FSDP2 alone between synchronizations; then ranks {0, 2} and {1, 3},
which hold the same shards, average their pseudo-gradient shards through rayzip's engine,
and each steps its own shards' outer optimizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gloo_world import run_world
from test_fsdp import _batch, _full_weights, _model, _shard, _train

STEPS = 6


def _local_train(rank, world, spec, every, nan_at=None, on_nonfinite="raise", outer=(0.7, 0.5, True)):
    """STEPS inner steps of SGD with momentum under local steps on shards: each step's loss,
    the full weights at the end, and what the synchronizations did."""
    from rayzip.engine import CompressionConfig
    from rayzip.torch.fsdp import hsdp_mesh, local_steps_on_shards

    model = _model()
    shard_mesh, replicate = hsdp_mesh(2, "cpu")
    _shard(model, shard_mesh)
    lr, momentum, nesterov = outer
    local = local_steps_on_shards(model, replicate, every=every, compression=CompressionConfig(**spec),
                                  outer_lr=lr, outer_momentum=momentum, nesterov=nesterov, on_nonfinite=on_nonfinite)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, rounds, after_sync = [], [], []
    for step in range(STEPS):
        x, y = _batch(rank, nan=rank == 3 and step == nan_at)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
        if local.gradient_ok(step):
            opt.step()
        try:
            synced = local.after_inner_step()
        except Exception as exc:
            return {"raised": f"{type(exc).__name__}: {exc}", "step": step}
        if synced:
            rounds.append((step, local.last_sync.skipped, local.last_sync.bytes_sent, local.last_sync.dense_bytes))
            after_sync.append(_full_weights(model))
    outer_state = [s["momentum_buffer"].numel() for s in local.outer.state.values() if "momentum_buffer" in s]
    return {"losses": losses, "weights": _full_weights(model), "rounds": rounds, "after_sync": after_sync,
            "local_numel": sum(p.to_local().numel() for p in model.parameters()),
            "numel": sum(p.numel() for p in model.parameters()), "outer_numel": sum(outer_state),
            "local": [p.to_local().detach().numpy().copy() for p in model.parameters()]}


def test_at_one_step_a_round_without_codec_it_trains_as_fsdp2s_own_hsdp():
    # H = 1, no codec, outer SGD at learning rate 1 without momentum: the mean of the
    # replicas' inner steps is the step on the mean gradient (SGD's momentum is linear too).
    native = run_world(_train, 4, "native", timeout_s=120)
    ours = run_world(_local_train, 4, {"codec": "none"}, 1, None, "raise", (1.0, 0.0, False), timeout_s=120)
    for rank in range(4):
        np.testing.assert_allclose(ours[rank]["losses"][:4], native[rank]["losses"], rtol=1e-5)
    # The same weights after the fourth synchronization as FSDP2's HSDP after its fourth step.
    for rank in range(4):
        np.testing.assert_allclose(ours[rank]["after_sync"][3], native[rank]["weights"], rtol=1e-5, atol=1e-6)


def test_pseudo_gradient_shards_cross_nodes_compressed_and_the_outer_state_is_sharded():
    spec = {"codec": "group_topk", "density": 0.1}
    ranks = run_world(_local_train, 4, spec, 3, timeout_s=120)
    for pair in ((0, 2), (1, 3)):  # the replicas of a shard are identical after each synchronization
        for mine, theirs in zip(ranks[pair[0]]["local"], ranks[pair[1]]["local"]):
            np.testing.assert_array_equal(mine, theirs)
    for rank in range(4):
        # Two rounds of three inner steps; between nodes only, at a tenth of the entries.
        assert [r[0] for r in ranks[rank]["rounds"]] == [2, 5]
        assert all(0 < sent < dense / 3 for _, _, sent, dense in ranks[rank]["rounds"]), ranks[rank]["rounds"]
        # Each rank's outer momentum covers its own shards, about half of the model.
        assert ranks[rank]["outer_numel"] == ranks[rank]["local_numel"] < 0.6 * ranks[rank]["numel"]
    np.testing.assert_array_equal(ranks[0]["weights"], ranks[3]["weights"])
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]


def test_a_nan_in_one_shard_drops_the_round_on_every_rank():
    spec = {"codec": "group_topk", "density": 0.1}
    ranks = run_world(_local_train, 4, spec, 3, 1, "skip", timeout_s=120)
    for rank in range(4):  # rank 3's batch in the first round: every shard group drops that round
        assert [r[1] for r in ranks[rank]["rounds"]] == [True, False], rank
        assert np.all(np.isfinite(ranks[rank]["weights"]))
    np.testing.assert_array_equal(ranks[0]["weights"], ranks[3]["weights"])


def test_a_nan_in_one_shard_raises_on_every_rank_at_the_synchronization():
    ranks = run_world(_local_train, 4, {"codec": "group_topk", "density": 0.1}, 3, 4, timeout_s=120)
    for rank in range(4):  # the NaN at step 4, found at the round's synchronization, step 5
        assert ranks[rank].get("step") == 5, ranks[rank]
        assert "NonFiniteError" in ranks[rank]["raised"] and "not finite" in ranks[rank]["raised"]


def test_without_fully_shard_it_says_what_to_do():
    from rayzip.torch.fsdp import local_steps_on_shards

    with pytest.raises(ValueError, match="apply torch.distributed.fsdp.fully_shard first"):
        local_steps_on_shards(torch.nn.Linear(2, 2), replicate_group=None)


def _outer_full(state) -> dict:
    return {name: t.full_tensor().numpy().copy() for name, t in state.outer_shards().items()}


def _save_round(rank, world, path):
    """Two rounds of local steps on shards (2 nodes of 2), then a DCP checkpoint of the
    model's, inner optimizer's and outer momentum's shards."""
    from rayzip.engine import CompressionConfig
    from rayzip.torch.fsdp import hsdp_mesh, local_steps_on_shards
    from rayzip.train.checkpoints import take_shards, write_shards
    from rayzip.train.exchange import _ShardedLocalState

    model = _model()
    shard_mesh, replicate = hsdp_mesh(2, "cpu")
    _shard(model, shard_mesh)
    local = local_steps_on_shards(model, replicate, every=2, compression=CompressionConfig(codec="group_topk",
                                                                                           density=0.1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        x, y = _batch(rank)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        local.after_inner_step()
    state = _ShardedLocalState(local)
    shards = take_shards(model, opt)
    shards["outer"] = state.outer_shards()
    from pathlib import Path

    write_shards(Path(path), shards)
    return {"outer": _outer_full(state), "weights": _full_weights(model)}


def _resume_on_two(rank, world, path):
    """The checkpoint resumed by one node of two: the outer momentum resharded by DCP, the
    loaded weights the synchronized ones, and training goes on alone."""
    from pathlib import Path

    from rayzip.engine import CompressionConfig
    from rayzip.torch.fsdp import ShardingConfig, local_steps_on_shards, shard_model
    from rayzip.train.checkpoints import load_shards
    from rayzip.train.exchange import _ShardedLocalState

    torch.manual_seed(1)  # other weights than the saved ones, to be overwritten
    model = torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.ReLU(), torch.nn.Linear(31, 29), torch.nn.ReLU(),
                                torch.nn.Linear(29, 5))
    model, replicate = shard_model(model, ShardingConfig(mode="hsdp", shard_size=2), ranks_per_node=2)
    local = local_steps_on_shards(model, replicate, every=2, compression=CompressionConfig(codec="group_topk",
                                                                                           density=0.1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = _ShardedLocalState(local)
    outer = state.outer_shards(fresh=True)
    load_shards(Path(path), model, opt, extra={"outer": outer})
    state.start_at(4)
    state.load_outer(outer)
    anchored = all(torch.equal(a, p.to_local().detach()) for a, p in zip(local.anchor, model.parameters()))
    out = {"replicate": replicate, "outer": _outer_full(state), "weights": _full_weights(model), "anchored": anchored,
           "rounds": local.rounds}
    losses = []
    for step in range(4, 8):
        x, y = _batch(rank)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
        local.after_inner_step()
    out.update(losses=losses, synced=local.rounds, exchanged=local.last_sync is not None)
    return out


def test_a_resize_from_two_nodes_to_one_reshards_the_outer_momentum_and_trains_on(tmp_path):
    saved = run_world(_save_round, 4, str(tmp_path / "ckpt"), timeout_s=120)
    resumed = run_world(_resume_on_two, 2, str(tmp_path / "ckpt"), timeout_s=120)
    assert saved[0]["outer"] and all(np.abs(m).sum() > 0 for m in saved[0]["outer"].values())
    for rank in range(2):
        got = resumed[rank]
        assert got["replicate"] is None  # one shard group: nothing to exchange
        assert got["outer"].keys() == saved[0]["outer"].keys()
        for name, momentum in saved[0]["outer"].items():
            np.testing.assert_array_equal(got["outer"][name], momentum)  # resharded bit for bit
        np.testing.assert_array_equal(got["weights"], saved[0]["weights"])
        assert got["anchored"] and got["rounds"] == 2
        assert got["synced"] == 4 and not got["exchanged"], got  # two more rounds, alone
        assert np.all(np.isfinite(got["losses"])) and got["losses"][-1] < got["losses"][0]


def _tuned(rank, world):
    """Local steps on shards with a tuned H, each rank reporting another compute time; on
    two ranks, one shard group alone (no replicas)."""
    from rayzip.adaptive.every import EveryTuner
    from rayzip.engine import CompressionConfig
    from rayzip.torch.fsdp import ShardingConfig, local_steps_on_shards, shard_model

    model, replicate = shard_model(_model(), ShardingConfig(mode="hsdp", shard_size=2), ranks_per_node=2)
    assert (replicate is None) == (world == 2)
    local = local_steps_on_shards(model, replicate, every=2, compression=CompressionConfig(codec="group_topk",
                                                                                           density=0.1),
                                  tuner=EveryTuner(1, 8, 0.1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    every = []
    for step in range(12):
        x, y = _batch(rank)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        local.after_inner_step(compute_s=0.001 * (1 + rank))
        every.append(local.every)
    return every


@pytest.mark.parametrize("world", [4, 2], ids=["two shard groups", "one shard group alone"])
def test_the_tuned_h_is_every_ranks_across_shard_groups(world):
    # The ranks see different compute times; were H agreed within each replicate group (or
    # not at all, alone), the ranks of a shard group would synchronize at different steps and
    # FSDP2 would hang.
    ranks = run_world(_tuned, world, timeout_s=120)
    assert all(r == ranks[0] for r in ranks), ranks
    assert len(set(ranks[0])) > 1, ranks[0]  # the tuner moved H
