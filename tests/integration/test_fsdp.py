"""HSDP through rayzip (issue 47): FSDP2 shards inside a node, rayzip's engine averages each
shard across nodes. Four gloo ranks as two nodes of two: FSDP2 reduce-scatters within
{0, 1} and {2, 3}; the replicas {0, 2} and {1, 3} exchange through the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gloo_world import run_world
from rayzip.codecs import get_codec
from rayzip.codecs.memory import ErrorFeedback
from rayzip.engine import CompressionConfig, plan_segments

STEPS = 4
SEGMENT_MB = 0.0005  # a few segments per parameter group


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # every rank starts from the same weights
    # odd sizes: FSDP2 pads dimension 0 of each parameter to a multiple of the shard group
    return torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.ReLU(), torch.nn.Linear(31, 29), torch.nn.ReLU(),
                               torch.nn.Linear(29, 5))


def _batch(rank: int, nan: bool = False):
    """Each rank's own batch, the same at every step: the loss must fall."""
    gen = torch.Generator().manual_seed(100 * rank)
    x, y = torch.randn(16, 13, generator=gen), torch.randint(0, 5, (16,), generator=gen)
    if nan:
        x[2, 3] = float("nan")
    return x, y


def _shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full_weights(model) -> np.ndarray:
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def _train(rank, world, how, spec=None, nan_at=None, on_nonfinite="raise"):
    """STEPS steps of SGD with momentum: each step's loss, the full weights at the end, and
    (rayzip's path) what each engine averaged."""
    from torch.distributed.device_mesh import init_device_mesh

    from rayzip.torch.fsdp import compress_sharded, hsdp_mesh

    model = _model()
    if how == "native":  # FSDP2's own HSDP: a 2-D mesh, dense all-reduce between replicas
        _shard(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
        sharded = None
    else:
        shard_mesh, replicate = hsdp_mesh(2, "cpu")
        _shard(model, shard_mesh)
        sharded = compress_sharded(model, CompressionConfig(**spec, segment_mb=SEGMENT_MB), replicate,
                                   on_nonfinite=on_nonfinite)
        seen = []
        for k, exchange in enumerate(sharded.exchanges):
            average = exchange.average

            def recorded(grad, k=k, average=average):
                out = average(grad)
                seen.append((k, grad.detach().clone().numpy(), out.detach().clone().numpy()))
                return out

            exchange.average = recorded
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, skipped = [], []
    for step in range(STEPS):
        x, y = _batch(rank, nan=rank == 3 and step == nan_at)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        try:
            loss.backward()
        except Exception as exc:
            return {"raised": f"{type(exc).__name__}: {exc}", "step": step}
        losses.append(float(loss.detach()))
        skip = sharded is not None and sharded.last_step.skipped
        skipped.append(skip)
        if not skip:
            opt.step()
    out = {"losses": losses, "weights": _full_weights(model), "skipped": skipped}
    if sharded is not None:
        out.update(seen=seen, sizes=[e.layout.starts for e in sharded.exchanges],
                   bytes=sharded.totals["bytes_sent"], dense=sharded.totals["dense_bytes"],
                   local=[p.to_local().detach().numpy().copy() for p in model.parameters()])
    return out


def test_dense_hsdp_through_rayzip_trains_as_fsdp2s_own_hsdp():
    native = run_world(_train, 4, "native", timeout_s=120)
    ours = run_world(_train, 4, "rayzip", {"codec": "none"}, timeout_s=120)
    for rank in range(4):
        np.testing.assert_allclose(ours[rank]["losses"], native[rank]["losses"], rtol=1e-5)
        np.testing.assert_allclose(ours[rank]["weights"], native[rank]["weights"], rtol=1e-5, atol=1e-6)
    assert native[0]["losses"][-1] < native[0]["losses"][0]  # it trained


def test_each_shard_is_averaged_across_nodes_through_codec_and_error_feedback():
    spec = {"codec": "group_topk", "density": 0.1, "value_dtype": "fp32"}
    ranks = run_world(_train, 4, "rayzip", spec, timeout_s=120)
    codec = get_codec("group_topk", density=0.1, value_dtype="fp32")
    for pair in ((0, 2), (1, 3)):
        a, b = (ranks[r] for r in pair)
        for mine, theirs in zip(a["local"], b["local"]):
            np.testing.assert_array_equal(mine, theirs)  # the replicas of a shard stay identical
        memories = {r: ErrorFeedback() for r in pair}
        groups = len(a["sizes"])
        assert len(a["seen"]) == len(b["seen"]) == groups * STEPS
        for (k, grad_a, out_a), (k_b, grad_b, out_b) in zip(a["seen"], b["seen"]):
            assert k == k_b
            np.testing.assert_array_equal(out_a, out_b)
            # The reference: each replica's node-mean shard through a fresh codec and error
            # feedback of its own, per segment as the engine cuts them, decoded and averaged.
            starts = a["sizes"][k]
            cuts = plan_segments(np.diff(starts).tolist(), int(SEGMENT_MB * 2**20) // 4)
            expected = np.zeros_like(out_a)
            for lo, hi in cuts:
                decoded = [codec.decode(memories[r].encode(codec, f"{k}:{lo}", g[lo:hi]))
                           for r, g in ((pair[0], grad_a), (pair[1], grad_b))]
                expected[lo:hi] = np.mean(decoded, axis=0)
            np.testing.assert_allclose(out_a, expected, rtol=1e-6, atol=1e-9)
    assert 0 < ranks[0]["bytes"] < ranks[0]["dense"] / 3  # compressed between the nodes
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]


def test_a_nan_on_one_rank_skips_the_step_on_every_rank():
    spec = {"codec": "group_topk", "density": 0.1}
    ranks = run_world(_train, 4, "rayzip", spec, 1, "skip", timeout_s=120)
    for rank in range(4):  # rank 3's batch; ranks 0 and 1, on the other node, skip it too
        assert ranks[rank]["skipped"] == [False, True, False, False], rank
        assert np.all(np.isfinite(ranks[rank]["weights"]))
    np.testing.assert_array_equal(ranks[0]["weights"], ranks[3]["weights"])


def test_a_nan_on_one_rank_raises_on_every_rank_at_that_step():
    ranks = run_world(_train, 4, "rayzip", {"codec": "group_topk", "density": 0.1}, 2, timeout_s=120)
    for rank in range(4):
        assert ranks[rank].get("step") == 2, ranks[rank]
        assert "NonFiniteError" in ranks[rank]["raised"] and "is not finite" in ranks[rank]["raised"]


def _proposed(rank, world):
    """Each rank's own initial weights, made the replicas' by the timed start-up sync; then
    rank 0 alone proposes dense at step 1 (as the controller's decision reaches it)."""
    from rayzip.torch.fsdp import compress_sharded, hsdp_mesh
    from rayzip.train.probe import sync_replicas

    torch.manual_seed(rank)  # the replicas start apart
    model = torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.ReLU(), torch.nn.Linear(31, 5))
    shard_mesh, replicate = hsdp_mesh(2, "cpu")
    _shard(model, shard_mesh)
    before = [p.to_local().detach().clone().numpy() for p in model.parameters()]
    probe = sync_replicas(model, replicate)
    after = [p.to_local().detach().clone().numpy() for p in model.parameters()]
    sharded = compress_sharded(model, CompressionConfig(codec="group_topk", density=0.1), replicate)
    sharded.link_probe = probe
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for step in range(4):
        if rank == 0 and step == 1:
            sharded.propose(1.0, seq=7)
        x, y = _batch(rank)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        last = sharded.last_step
        steps.append({"adopted": last.adopted, "compressed": [e.last_step.compressed for e in sharded.exchanges],
                      "bytes": last.bytes_sent - last.control_bytes, "dense": last.dense_bytes})
    return {"before": before, "after": after, "steps": steps, "probe": (probe.bytes, probe.seconds, probe.messages),
            "weights": [p.to_local().detach().numpy().copy() for p in model.parameters()]}


def test_a_proposal_from_rank_zero_switches_every_shards_exchange_at_the_same_step():
    ranks = run_world(_proposed, 4, timeout_s=120)
    for a, b in ((0, 2), (1, 3)):  # the start-up sync made each shard's replicas equal
        assert any(not np.array_equal(x, y) for x, y in zip(ranks[a]["before"], ranks[b]["before"]))
        for x, y, w_a, w_b in zip(ranks[a]["after"], ranks[b]["after"], ranks[a]["weights"], ranks[b]["weights"]):
            np.testing.assert_array_equal(x, y)
            np.testing.assert_array_equal(w_a, w_b)  # and they stay equal
        for x, y in zip(ranks[a]["before"], ranks[a]["after"]):
            np.testing.assert_array_equal(x, y)  # from the first shard group's
    shard_bytes = [sum(x.nbytes for x in ranks[r]["before"]) for r in range(4)]
    for rank in range(4):
        steps = ranks[rank]["steps"]
        assert [s["adopted"] for s in steps] == [None, (7, 1.0), None, None], rank
        assert [all(s["compressed"]) for s in steps] == [True, True, False, False], rank
        assert steps[0]["bytes"] < steps[0]["dense"] / 3 and steps[2]["bytes"] >= steps[2]["dense"], rank
        nbytes, seconds, messages = ranks[rank]["probe"]
        assert nbytes == shard_bytes[rank] and seconds > 0 and messages == 1  # a tree of two: one round


def test_without_fully_shard_it_says_what_to_do():
    from rayzip.torch.fsdp import compress_sharded

    with pytest.raises(ValueError, match="apply torch.distributed.fsdp.fully_shard first"):
        compress_sharded(torch.nn.Linear(2, 2), CompressionConfig(), replicate_group=None)


def _example(*args: str):
    import os
    import subprocess
    import sys

    from own_processes import free_port
    from paths import ROOT

    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(ROOT / "examples" / "fsdp_loop.py"), *args],
                          env={**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)


def test_the_torchrun_example_trains_two_ranks_as_two_nodes():
    import re

    result = _example("--shard-size", "1", "--steps", "20")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    found = re.search(r"loss ([\d.]+) -> ([\d.]+); between nodes ([\d,]+) bytes sent, ([\d.]+)x fewer", result.stdout)
    assert found, result.stdout
    first, last, sent, fewer = float(found[1]), float(found[2]), int(found[3].replace(",", "")), float(found[4])
    assert last < first and sent > 0 and fewer > 3, found[0]  # 8-bit DCT, the default on shards under AdamW


def test_the_torchrun_example_trains_local_steps_on_shards():
    import re

    result = _example("--shard-size", "1", "--steps", "20", "--local-steps", "4")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    found = re.search(r"loss ([\d.]+) -> ([\d.]+); between nodes ([\d,]+) bytes sent, ([\d.]+)x fewer", result.stdout)
    assert found, result.stdout
    first, last, sent, fewer = float(found[1]), float(found[2]), int(found[3].replace(",", "")), float(found[4])
    # Five synchronizations in 20 steps, each of group top-k at 10% with int8 values.
    assert last < first and sent > 0 and fewer > 4 * 8, found[0]
