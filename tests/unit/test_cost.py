"""The collectives' cost model and ``collective: auto`` (issue 18)."""

from __future__ import annotations

import pytest

from rayzip.codecs import get_codec
from rayzip.comm import Cost, Link, balanced_cost, choose_collective, chunk_nbytes, collective_costs, ring_cost
from rayzip.comm.transport import HEADER_BYTES


@pytest.mark.parametrize("world", [2, 4, 8])
def test_allgather_sends_n_minus_one_payloads_and_allreduce_the_ring_formula(world):
    numel = 1_000_003
    group = get_codec("group_topk", density=0.01)
    assert collective_costs(group, numel, world)["allgather"] == Cost((world - 1) * group.wire_nbytes(numel), world - 1)
    fp16 = get_codec("fp16")
    costs = collective_costs(fp16, numel, world)
    assert set(costs) == {"allreduce"}  # summable: summed on the wire, never gathered
    assert costs["allreduce"] == Cost(2 * (world - 1) * 2 * numel // world, 2 * (world - 1))


def test_the_ring_model_at_its_limits():
    numel, world = 1 << 20, 4
    # Nothing kept: only the headers and the per-block counts.
    empty = ring_cost(numel, 0.0, world, 2)
    steps = 2 * (world - 1)
    assert empty.messages == 2 * steps
    assert empty.bytes == steps * (HEADER_BYTES + chunk_nbytes(numel // world, 0, 2)[0])
    # Everything kept: every chunk goes dense, the ring allreduce's 2(n-1)/n of the values.
    full = ring_cost(numel, 1.0, world, 2)
    assert full.bytes == 2 * (world - 1) * 2 * numel // world + steps * HEADER_BYTES


def test_compression_against_a_dense_allreduce_falls_as_workers_are_added():
    numel, density = 8_000_000, 0.01
    dense = {n: 2 * (n - 1) * 4 * numel // n for n in (2, 4, 8, 16, 64)}
    ring = [dense[n] / ring_cost(numel, density, n, 2).bytes for n in dense]
    assert ring == sorted(ring, reverse=True) and ring[0] > 60 and ring[-1] < 3
    # At 16 workers a reduced chunk holds the union of 16 workers' entries, 1 - 0.99^16 = 15%
    # of it, and its all-gather phase alone passes 15 such chunks on.
    assert ring_cost(numel, density, 16, 2).bytes > 15 * (1 - 0.99 ** 16) * (numel / 16) * 4


def test_the_balanced_model_is_flat_in_the_workers_and_counts_its_messages():
    numel, kept = 4_000_000, 40_000
    costs = {n: balanced_cost(numel, kept, n, 2) for n in (2, 4, 8, 64, 256)}
    for n, cost in costs.items():
        # 2(n-1) sends, each a header and a chunk, posted a phase at once: 4 rounds at any n.
        assert cost.messages == 4
    # About 2k(n-1)/n entries: at most about twice n = 2's (k) at any n (the headers and the
    # offsets' bits grow a little as regions shrink), while the ring's grows with the union.
    assert costs[2].bytes < costs[4].bytes < costs[8].bytes < costs[256].bytes < 2.1 * costs[2].bytes
    assert costs[8].bytes < ring_cost(numel, kept / numel, 8, 2).bytes / 5
    # Each message: k/n entries of a numel/n region, coded (Elias-Fano offsets, fp16 values).
    span, share = numel // 4, kept // 4
    assert costs[4].bytes == 2 * 3 * chunk_nbytes(span, share, 2, coded=True)[0] + 6 * HEADER_BYTES
    assert chunk_nbytes(span, share, 2, coded=True)[0] < chunk_nbytes(span, share, 2)[0]


def test_auto_picks_the_cheaper_collective_by_the_model():
    numel = 1_000_000
    # The balanced allreduce costs least from 4 workers, but it cuts the sum (accuracy the
    # model does not weigh): auto leaves it to be chosen by name.
    costs = collective_costs(get_codec("group_topk", density=0.01), numel, 8)
    assert costs["balanced"].seconds(Link()) < min(costs["allgather"].seconds(Link()), costs["ring"].seconds(Link()))
    assert choose_collective("auto", get_codec("group_topk", density=0.01), [numel], 8) == "allgather"
    assert choose_collective("auto", get_codec("randomk", density=0.01), [numel], 8) == "allreduce"
    assert choose_collective("auto", get_codec("dct_quant"), [numel], 8) == "allgather"
    assert choose_collective("auto", get_codec("none"), [numel], 2) == "allreduce"
    # Dense enough that merged chunks beat gathering 8-byte (uint32 index, fp32) entries.
    dense_topk = get_codec("topk", density=0.5, value_dtype="fp32")
    costs = collective_costs(dense_topk, numel, 2)
    assert costs["ring"].bytes < costs["allgather"].bytes
    assert choose_collective("auto", dense_topk, [numel], 2) == "ring"
    # Dense from where n sparse payloads, or the ring's filled-in chunks, pass the vector
    # (2(n-1)/n of it, summed in the values' fp16): many workers, or a high density.
    gtopk = get_codec("group_topk", density=0.01)
    assert choose_collective("auto", gtopk, [numel], 8) == "allgather"
    assert choose_collective("auto", gtopk, [numel], 256) == "dense"
    assert choose_collective("auto", get_codec("group_topk", density=0.2), [numel], 16) == "dense"
    assert collective_costs(gtopk, numel, 4)["dense"] == Cost(2 * 3 * numel * 2 // 4, 6)
    # Latency counts: many tiny segments on a high-latency link favour fewer messages.
    tiny = get_codec("topk", density=0.5, value_dtype="fp32")
    slow = Link(bandwidth=1e12, latency=1.0)
    assert choose_collective("auto", tiny, [64] * 10, 2, slow) == "allgather"
