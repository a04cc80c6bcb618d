"""The balanced sparse allreduce on real gloo process groups (issue 49): the sum it keeps, the
mass it cuts and where that goes, and its bytes, against references computed here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gloo_world import run_world
from rayzip.codecs import get_codec
from rayzip.codecs.memory import ErrorFeedback
from rayzip.comm import BalancedAllReduce, Plan, Transport, balanced_sparse_allreduce, chunk_nbytes
from rayzip.comm.balanced import region_cap
from rayzip.engine import CompressionConfig, GradientExchange

NUMEL = 100_003
K = 1000


def _input(rank: int, step: int):
    """Each rank's k entries: half on a hot band all ranks share, half spread (so that the
    sum is not uniform and the regions must move to balance it)."""
    rng = np.random.default_rng(1000 * step + rank)
    hot = rng.choice(np.arange(10_000, 12_000), K // 2, replace=False)
    rest = rng.choice(NUMEL, K, replace=False)
    indices = np.unique(np.concatenate([hot, rest]))[:K]
    indices = np.sort(rng.permutation(indices)[:K]).astype(np.int64)
    return indices, rng.standard_normal(indices.size).astype(np.float32)


def _rank(rank, world, steps, value_dtype, senders=False):
    transport = Transport()
    plan = Plan()
    out = []
    for step in range(steps):
        before = (plan.bounds, plan.threshold)
        sent: list = []
        start = transport.bytes_sent
        indices, values = _input(rank, step)
        total, kept = balanced_sparse_allreduce(indices, values, NUMEL, transport, plan, K,
                                                value_dtype=value_dtype, sent=sent, senders=senders)
        out.append({"total": total, "kept": kept, "plan": before, "bytes": transport.bytes_sent - start,
                    "sent": sent})
    return out


def _expected_kept(sums: np.ndarray, bounds: list[int] | None, threshold: float | None, world: int) -> list[int]:
    """Each region's kept entries, by the rule: at least the threshold (without one, the
    region's share of k), at most the cap, the largest first."""
    bounds = bounds or [c * NUMEL // world for c in range(world + 1)]
    kept = []
    for c in range(world):
        lo, hi = bounds[c], bounds[c + 1]
        region = np.flatnonzero(sums[lo:hi])
        magnitudes = np.abs(sums[lo:hi][region])
        if threshold is None:
            limit, chosen = math.ceil(K / world), region
        else:
            limit, chosen = region_cap(K, world), region[magnitudes >= threshold]
        if chosen.size > limit:
            chosen = chosen[np.argsort(-np.abs(sums[lo:hi][chosen]), kind="stable")[:limit]]
        kept.extend((np.sort(chosen) + lo).tolist())
    return kept


@pytest.mark.parametrize("world", [3, 4])
def test_the_sum_is_the_dense_sum_cut_to_its_kept_entries_and_the_bytes_are_the_formulas(world):
    results = run_world(_rank, world, 3, "fp32")
    for step in range(3):
        inputs = [_input(r, step) for r in range(world)]
        sums = np.zeros(NUMEL, np.float64)
        for indices, values in inputs:
            sums[indices] += values
        sums = sums.astype(np.float32)
        bounds, threshold = results[0][step]["plan"]
        assert all(r[step]["plan"] == (bounds, threshold) for r in results)  # every rank's plan alike
        if step:  # regions from the last step's kept entries, a threshold from their magnitudes
            assert bounds is not None and threshold is not None and bounds != [c * NUMEL // world for c in range(world + 1)]
        kept = results[0][step]["kept"]
        assert kept.tolist() == _expected_kept(sums, bounds, threshold, world)
        assert 0.5 * K <= kept.size <= world * region_cap(K, world)
        reference = np.zeros(NUMEL, np.float32)
        reference[kept] = sums[kept]
        for r in results:  # every rank holds the same sum, bit for bit: the dense sum's kept entries
            np.testing.assert_array_equal(r[step]["total"], results[0][step]["total"])
        np.testing.assert_allclose(results[0][step]["total"], reference, rtol=1e-6, atol=1e-6)
        _check_bytes(results, step, inputs, bounds, kept, world)


def _check_bytes(results, step, inputs, bounds, kept, world):
    """Rank r sends its entries of every other region, then passes on the kept entries of
    every region but the next rank's; a 16-byte header before each message."""
    b = bounds or [c * NUMEL // world for c in range(world + 1)]
    kept_in = [int(((kept >= b[c]) & (kept < b[c + 1])).sum()) for c in range(world)]
    for rank, r in enumerate(results):
        indices = inputs[rank][0]
        mine = [int(((indices >= b[c]) & (indices < b[c + 1])).sum()) for c in range(world)]
        scatter = sum(chunk_nbytes(b[c + 1] - b[c], mine[c], 4, coded=True)[0] for c in range(world) if c != rank)
        # Its own region's kept entries, to each of the others.
        gather = (world - 1) * chunk_nbytes(b[rank + 1] - b[rank], kept_in[rank], 4, coded=True)[0]
        assert r[step]["bytes"] == scatter + gather + 2 * (world - 1) * 16, (step, rank)


@pytest.mark.parametrize("world", [3, 4])
def test_senders_average_each_entry_over_the_ranks_that_sent_it_before_the_cut(world):
    """SparseLoCo's average on the balanced allreduce: each owner divides each sum by the
    ranks whose payload held that entry, counted from what it received, then cuts: the same
    bytes as the mean for the same entries."""
    results = run_world(_rank, world, 3, "fp32", True)
    for step in range(3):
        inputs = [_input(r, step) for r in range(world)]
        sums, count = np.zeros(NUMEL, np.float64), np.zeros(NUMEL, np.float32)
        for indices, values in inputs:
            sums[indices] += values
            count[indices] += 1
        # The owner's arithmetic: float32 sums, divided in float32.
        averages = np.zeros(NUMEL, np.float32)
        held = count > 0
        averages[held] = sums.astype(np.float32)[held] / count[held]
        assert np.any(count > 1) and np.any(count == 1)  # shared entries and lone ones
        bounds, threshold = results[0][step]["plan"]
        kept = results[0][step]["kept"]
        assert kept.tolist() == _expected_kept(averages, bounds, threshold, world)
        reference = np.zeros(NUMEL, np.float32)
        reference[kept] = averages[kept]
        for r in results:
            np.testing.assert_array_equal(r[step]["total"], reference)
        _check_bytes(results, step, inputs, bounds, kept, world)


def test_fp16_values_keep_every_rank_bitwise_equal():
    results = run_world(_rank, 3, 2, "fp16")
    for step in range(2):
        for r in results:
            np.testing.assert_array_equal(r[step]["total"], results[0][step]["total"])


def _feedback_rank(rank, world, steps):
    """BalancedAllReduce with group top-k and error feedback, as the engine drives them."""
    codec = get_codec("topk", density=0.01, value_dtype="fp32")
    memory, communicator = ErrorFeedback(), BalancedAllReduce(Transport())
    out = []
    for step in range(steps):
        grad = np.random.default_rng(100 * step + rank).standard_normal(NUMEL).astype(np.float32)
        grad[:20_000] *= 3  # a hot band
        before = memory.residuals.get("g", np.zeros(NUMEL, np.float32)).copy()
        payload = memory.encode(codec, "g", grad)
        average = np.asarray(communicator.average(codec, payload, "g"))
        sent_indices, sent_values = codec.to_coo(payload)
        dropped = communicator.dropped["g"]
        memory.add_back("g", *communicator.take_dropped("g"))
        out.append({"grad": grad, "before": before, "after": memory.residuals["g"].copy(), "average": average,
                    "sent": (sent_indices, sent_values), "dropped": dropped})
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_the_mass_the_sum_cuts_lands_in_the_residuals_exactly(world):
    results = run_world(_feedback_rank, world, 3)
    for step in range(3):
        rows = [r[step] for r in results]
        kept = np.flatnonzero(rows[0]["average"])
        for row in rows:
            indices, values = row["dropped"]
            # What was cut is this rank's own payload at the indices the sum left out...
            sent_indices, sent_values = row["sent"]
            left_out = ~np.isin(sent_indices, kept)
            np.testing.assert_array_equal(indices, sent_indices[left_out])
            np.testing.assert_array_equal(values, sent_values[left_out])
            # ...and it waits in the residual exactly as if the codec had never picked it.
            compensated = row["grad"] + row["before"]
            np.testing.assert_array_equal(row["after"][indices], compensated[indices])
            assert not np.any(row["after"][sent_indices[~left_out]])
        # Nothing lost: the residuals and the applied sum add up to every gradient sent.
        held = sum(r["after"].astype(np.float64) - r["before"] for r in rows)
        applied = world * rows[0]["average"].astype(np.float64)
        np.testing.assert_allclose(held + applied, sum(r["grad"].astype(np.float64) for r in rows), atol=1e-4)
        assert 0 < len(rows[0]["dropped"][0])  # the cut did cut something


def _engine_rank(rank, world, steps):
    torch.manual_seed(0)
    exchange = GradientExchange(CompressionConfig(codec="group_topk", density=0.01, value_dtype="fp32",
                                                  collective="balanced", verify=True, segment_mb=0.1), [60_000, 40_000])
    out = []
    for step in range(steps):
        grad = torch.from_numpy(np.random.default_rng(10 * step + rank).standard_normal(100_000).astype(np.float32))
        average = exchange.average(grad)
        s = exchange.last_step
        out.append((average.numpy().copy(), s.bytes_sent, s.verify_documented_bytes, s.verify_max_abs_err))
    state = exchange.state_dict()["collective"]
    return out, exchange.communicator.name, state


def test_the_engine_verifies_it_and_checkpoints_its_plans():
    results = run_world(_engine_rank, 3, 3)
    for (out, name, state) in results:
        assert name == "balanced"
        assert len(state["plans"]) >= 2 and all(p["threshold"] for p in state["plans"].values())
        for step, (average, sent, documented, err) in enumerate(out):
            np.testing.assert_array_equal(average, results[0][0][step][0])
            assert sent == documented > 0 and err < 1e-6, (step, sent, documented, err)
    assert results[0][2] == results[1][2] == results[2][2]
