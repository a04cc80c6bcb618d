"""Hierarchy (issue 18): workers of one node average densely, one compressed exchange per
node. Nodes are set per rank with RAYZIP_NODE_ID on real gloo ranks."""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch

from gloo_world import run_world
from rayzip.codecs import NonFiniteError
from rayzip.comm.control import control_nbytes
from rayzip.comm.hierarchy import Topology
from rayzip.comm.transport import ring_allreduce_bytes
from rayzip.torch import CompressionConfig
from rayzip.engine import GradientExchange

NUMEL = 40_000
SIZES = [30_000, 10_000]  # two parameters, so two segments below
SEGMENT_MB = 0.03  # 7864 entries: one segment per parameter


def _grad(rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(NUMEL, generator=gen) * (1 + rank)


def _state(spec: dict, rank_nodes: list[str] | None, rank: int) -> GradientExchange:
    if rank_nodes is not None:
        os.environ["RAYZIP_NODE_ID"] = rank_nodes[rank]
    return GradientExchange(CompressionConfig(segment_mb=SEGMENT_MB, **spec), SIZES)


def _run(rank, world, spec, nodes, grads_of, steps):
    state = _state(spec, nodes, rank)
    out = []
    for step in range(steps):
        average = state.average(grads_of(rank, step))
        s = state.last_step
        out.append((average.numpy().copy(), s.bytes_sent, s.local_bytes, s.control_bytes,
                    s.verify_documented_bytes, s.verify_max_abs_err))
    h = state.hierarchy
    return out, (None if h is None else (h.nodes, h.is_leader, h.local_world))


def _node_share(nodes, rank, step):
    """Rank r of the flat reference holds node r's share of the mean, formed as the
    hierarchy forms it (the node's sum times nodes / world)."""
    groups = Topology(tuple(nodes)).groups
    total = _grad(groups[rank][0], step).clone()
    for r in groups[rank][1:]:
        total += _grad(r, step)
    return total.mul_(len(groups) / len(nodes))


@pytest.mark.parametrize("nodes", [["a", "a", "b", "b"], ["a", "a", "a", "b"]])
def test_dense_hierarchy_gives_the_mean_of_every_worker(nodes):
    results = run_world(_run, 4, {"codec": "none", "hierarchy": "node", "verify": True}, nodes,
                        _grad, 2, timeout_s=120)
    for step in range(2):
        exact = torch.stack([_grad(r, step) for r in range(4)]).mean(0).numpy()
        for (steps, (n_nodes, _, _)) in results:
            assert n_nodes == 2
            np.testing.assert_allclose(steps[step][0], exact, rtol=1e-5, atol=1e-5)
        # the same bits everywhere: the leaders' sum, broadcast
        assert all(np.array_equal(results[0][0][step][0], r[0][step][0]) for r in results)


@pytest.mark.parametrize("collective", ["allgather", "balanced"])
def test_compressed_hierarchy_is_the_flat_exchange_of_node_shares_bitwise(collective):
    """Four workers on two nodes send what two workers holding their nodes' shares send, and
    average to the same bits, step after step (error feedback included: with the balanced
    allreduce, what its cut hands back to the leaders' memory)."""
    nodes = ["a", "a", "b", "b"]
    spec = {"codec": "group_topk", "density": 0.05, "collective": collective, "verify": True}
    hier = run_world(_run, 4, {**spec, "hierarchy": "node"}, nodes, _grad, 3, timeout_s=120)
    flat = run_world(_run, 2, {**spec, "hierarchy": "none"}, None, functools.partial(_node_share, nodes), 3, timeout_s=120)
    assert [h for _, h in hier] == [(2, True, 2), (2, False, 2), (2, True, 2), (2, False, 2)]
    assert flat[0][1] is None
    for step in range(3):
        for rank, (steps, _) in enumerate(hier):
            average, sent, local, control, documented, err = steps[step]
            assert np.array_equal(average, flat[0][0][step][0]), (rank, step)
            assert sent == documented  # every byte by the wire formulas, inside the node and out
            leader = rank % 2 == 0
            # Off the node: a leader sends the flat two-worker exchange (its payloads; the
            # control word over 4 ranks instead of 2), the other worker the control word alone.
            flat_sent, flat_control = flat[rank // 2][0][step][1], flat[rank // 2][0][step][3]
            assert control == 2 * control_nbytes(4)  # two segments
            assert flat_control == 2 * control_nbytes(2)
            assert sent - local == (flat_sent - flat_control + control if leader else control)
            # Inside: the sum's and the bad word's all-reduce, and the leader's broadcast.
            expected = sum(ring_allreduce_bytes(4 * n, 2) + ring_allreduce_bytes(8, 2) + (4 * n if leader else 0)
                           for n in SIZES)
            assert local == expected
            if leader:  # the balanced allreduce's sums travel in fp16 (group top-k's value type)
                assert err is not None and err < (1e-5 if collective == "allgather" else 1e-2)


def _bad_grads(rank, step):
    g = _grad(rank, step)
    if rank == 3 and step == 1:
        g[35_000] = float("nan")  # in the first segment exchanged (the last parameter)
    return g


def _run_bad(rank, world, policy):
    os.environ["RAYZIP_NODE_ID"] = "ab"[rank // 2]
    state = GradientExchange(CompressionConfig(segment_mb=SEGMENT_MB, codec="group_topk", density=0.05,
                                               hierarchy="node"), SIZES, on_nonfinite=policy)
    state.average(_bad_grads(rank, 0))
    try:
        average = state.average(_bad_grads(rank, 1))
    except NonFiniteError as exc:
        return str(exc)
    return (state.last_step.skipped, state.last_step.nonfinite, bool(torch.isnan(average).all()),
            state.average(_bad_grads(rank, 2)).isfinite().all().item())


def test_a_bad_gradient_on_a_node_s_other_worker_is_named_on_every_rank():
    for message in run_world(_run_bad, 4, "raise", timeout_s=120):
        assert "rank 3's gradient is not finite" in message
        assert "parameter 1 of the model), element 5000" in message
    for skipped, why, all_nan, next_finite in run_world(_run_bad, 4, "skip", timeout_s=120):
        assert skipped and all_nan and next_finite and "rank 3" in why


def test_topology_decides_when_a_hierarchy_helps():
    assert Topology(("a", "a", "b", "b")).helps
    assert Topology(("a", "a", "a", "b")).groups == [[0, 1, 2], [3]]
    assert not Topology(("a", "b", "c")).helps  # one worker per node: nothing to average locally
    assert not Topology(("a", "a", "a")).helps  # one node: nothing crosses a network
    assert Topology(("b", "a", "b", "a")).groups == [[0, 2], [1, 3]]


def _auto(rank, world, nodes):
    return _state({"codec": "group_topk", "density": 0.05, "hierarchy": "auto"}, nodes, rank).hierarchy is not None


def test_auto_turns_the_hierarchy_on_only_for_several_workers_on_several_nodes():
    assert run_world(_auto, 4, ["a", "a", "b", "b"]) == [True] * 4
    assert run_world(_auto, 3, ["a", "b", "c"]) == [False] * 3


def _ddp_rank(rank, world):
    os.environ["RAYZIP_NODE_ID"] = "ab"[rank // 2]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    from rayzip.torch import compress, ddp_kwargs

    spec = CompressionConfig(codec="group_topk", density=0.05, segment_mb=0.005, hierarchy="auto")
    ddp = torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs(spec))
    state = compress(ddp, spec)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        optimizer.zero_grad()
        x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    weights = torch.cat([p.detach().flatten() for p in ddp.parameters()]).numpy()
    return weights, state.hierarchy is not None, len(state.segments), state.totals["local_bytes"]


def test_ddp_hook_with_overlap_runs_the_hierarchy_on_its_worker_thread():
    results = run_world(_ddp_rank, 4, timeout_s=120)
    for weights, hierarchical, segments, local in results:
        assert hierarchical and segments > 1 and local > 0
        assert np.array_equal(weights, results[0][0]) and np.isfinite(weights).all()


def test_error_feedback_moves_between_holders_keeping_the_pending_mean():
    """Pending update = the mean of the holders' residuals. Re-sharding between layouts keeps
    it: four flat workers into two nodes' leaders, two leaders into three flat workers, and
    two leaders into three (a resize under the hierarchy)."""
    from rayzip.codecs.memory import reshard_state
    from rayzip.train.checkpoints import holder_parts

    def move(residuals: dict[int, np.ndarray], old_holders, new_holders):
        out = {}
        for rank, holder in new_holders.items():
            parts = holder_parts(old_holders, holder)
            saved = {index: {"residual:model": residuals[r]} for r, index in parts.items()}
            out[rank] = reshard_state(saved, next(iter(old_holders.values()))[1], holder[1], holder[0])
        return {rank: state.get("residual:model", np.zeros(3, np.float32)) for rank, state in out.items()}

    rng = np.random.default_rng(0)
    flat4 = {r: (r, 4) for r in range(4)}
    nodes2 = {0: (0, 2), 2: (1, 2)}  # leaders of nodes {0, 1} and {2, 3}
    flat3 = {r: (r, 3) for r in range(3)}
    nodes3 = {0: (0, 3), 2: (1, 3), 4: (2, 3)}
    for old, new in ((flat4, nodes2), (nodes2, flat3), (nodes2, nodes3), (nodes3, nodes2)):
        residuals = {r: rng.standard_normal(3).astype(np.float32) for r in old}
        moved = move(residuals, old, new)
        assert set(moved) == set(new)
        np.testing.assert_allclose(np.mean(list(moved.values()), axis=0), np.mean(list(residuals.values()), axis=0),
                                   rtol=1e-5, atol=1e-6)
    assert holder_parts(nodes2, None) == {}  # a node's other workers hold nothing
