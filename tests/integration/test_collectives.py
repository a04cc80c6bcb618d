"""Ring, allgather and allreduce collectives on real gloo process groups (issue 3)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gloo_world import run_world
from rayzip.codecs import get_codec
from rayzip.comm import AllGather, AllReduce, Ring, Transport, chunk_nbytes, sparse_ring_allreduce

NUMEL = 200_003


def sparse_input(rank: int, density: float, numel: int = NUMEL):
    rng = np.random.default_rng(100 + rank)
    count = max(1, int(density * numel))
    indices = np.sort(rng.choice(numel, count, replace=False)).astype(np.int64)
    return indices, rng.standard_normal(count).astype(np.float32)


class RecordingTransport(Transport):
    """A transport that also keeps the size of every send."""

    def __init__(self):
        super().__init__()
        self.messages: list[int] = []

    def _count(self, nbytes: int, hops: int = 1) -> None:
        super()._count(nbytes, hops)
        self.messages.append(nbytes)


def _ring_rank(rank, world, density, value_dtype):
    transport = RecordingTransport()
    indices, values = sparse_input(rank, density)
    total = sparse_ring_allreduce(indices, values, NUMEL, transport, value_dtype=value_dtype)
    return total, transport.bytes_sent, transport.messages


def expected_ring_bytes(inputs, world: int, value_bytes: int) -> list[int]:
    """Independent model of the ring schedule: bytes each rank sends (header + chunk)."""
    bounds = [c * NUMEL // world for c in range(world + 1)]
    spans = [bounds[c + 1] - bounds[c] for c in range(world)]
    full = object()
    held = [[set(idx[(idx >= bounds[c]) & (idx < bounds[c + 1])].tolist()) for c in range(world)]
            for idx, _ in inputs]
    sent = [0] * world

    def send(r, c):
        s = held[r][c]
        size, dense = chunk_nbytes(spans[c], spans[c] if s is full else len(s), value_bytes)
        sent[r] += 16 + size
        return full if dense else s

    for step in range(world - 1):  # reduce-scatter: receivers take the union
        moves = [(r, (r - step) % world) for r in range(world)]
        payloads = [send(r, c) for r, c in moves]
        for (r, c), s in zip(moves, payloads):
            mine = held[(r + 1) % world][c]
            held[(r + 1) % world][c] = full if full in (s, mine) else mine | s
    for step in range(world - 1):  # all-gather: receivers replace
        moves = [(r, (r + 1 - step) % world) for r in range(world)]
        payloads = [send(r, c) for r, c in moves]
        for (r, c), s in zip(moves, payloads):
            held[(r + 1) % world][c] = s
    return sent


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("density,value_dtype", [(0.01, "fp32"), (0.01, "fp16"), (0.5, "fp32")])
def test_sparse_ring_sums_like_dense_reference_and_counts_bytes(world, density, value_dtype):
    results = run_world(_ring_rank, world, density, value_dtype)
    inputs = [sparse_input(r, density) for r in range(world)]
    reference = np.zeros(NUMEL, np.float64)
    for idx, val in inputs:
        reference[idx] += val
    tol = 2e-3 * world if value_dtype == "fp16" else 1e-5
    expected = expected_ring_bytes(inputs, world, 2 if value_dtype == "fp16" else 4)
    for rank, (total, bytes_sent, messages) in enumerate(results):
        np.testing.assert_allclose(total, reference, atol=tol)
        assert bytes_sent == sum(messages) == expected[rank]
        assert len(messages) == 2 * 2 * (world - 1)  # header + chunk, 2(n-1) steps
    if density > 0.3:  # merged chunks outgrow their sparse form and go dense
        dense_sizes = {4 * ((c + 1) * NUMEL // world - c * NUMEL // world) for c in range(world)}
        assert dense_sizes & set(results[0][2])
    # Every rank ends with the same bytes: the all-gather hands out one reduced copy.
    for total, _, _ in results[1:]:
        assert np.array_equal(total, results[0][0])


CODECS = {
    "none": ({}, AllReduce), "fp16": ({}, AllReduce), "bf16": ({}, AllReduce),
    "randomk": ({"density": 0.05, "seed": 4}, AllReduce),
    "qsgd": ({}, AllGather), "dct_quant": ({}, AllGather), "group_topk": ({"density": 0.05}, AllGather),
    "topk": ({"density": 0.02}, Ring),
    # Compact group top-k (codec name before the colon): gathered as it is on the wire, and
    # summed on the ring, which carries int8 values' partial sums in fp16.
    "group_topk:compact": ({"density": 0.05, "value_dtype": "int8", "packed_indices": True}, AllGather),
    "group_topk:compact-ring": ({"density": 0.05, "value_dtype": "int8", "packed_indices": True}, Ring),
}


def _collective_rank(rank, world):
    out = {}
    for name, (params, communicator_cls) in CODECS.items():
        codec = get_codec(name.split(":")[0], **params)
        transport = Transport()
        x = np.random.default_rng(rank).standard_normal(10_001).astype(np.float32)
        communicator = communicator_cls(transport)
        alone = get_codec(name.split(":")[0], **params)  # a seeded codec's second call would draw other indices
        mine = alone.decode(alone.encode(x))
        payload = codec.encode(x * communicator.input_scale)  # allreduce: grad / n, summed
        # allreduce moves only the values: a randomk seed is derived, never sent
        wire = payload.arrays["values"].nbytes if communicator_cls is AllReduce else payload.nbytes
        average = communicator.average(codec, payload)
        out[name] = (mine, average, transport.bytes_sent, wire)
    return out


@pytest.fixture(scope="module")
def collective_results():
    return run_world(_collective_rank, 3)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_collectives_average_the_decoded_payloads(name, collective_results):
    world = 3
    results = [per_rank[name] for per_rank in collective_results]
    reference = np.mean([mine for mine, _, _, _ in results], axis=0)
    tol = {"fp16": 2e-3, "bf16": 2e-2, "group_topk:compact-ring": 4e-3}.get(name, 1e-6)
    communicator = CODECS[name][1]
    for mine, average, bytes_sent, wire in results:
        np.testing.assert_allclose(average, reference, atol=tol)
        if communicator is AllReduce:
            assert bytes_sent == 2 * (world - 1) * wire // world
        elif communicator is AllGather:
            assert bytes_sent == (world - 1) * wire
    for _, average, _, _ in results[1:]:
        assert np.array_equal(average, results[0][1])  # replicas agree bitwise


def test_unpacked_fields_are_aligned_for_their_type_with_odd_entry_counts():
    # cupy faults on a float32 view at a 2-byte offset; numpy only reports it in flags.
    import numpy as np

    from rayzip.codecs import get_codec
    from rayzip.comm.ring import Chunk

    indices = np.array([1, 7, 70000, 70001, 131071], dtype=np.int64)  # odd count, three blocks
    values = np.arange(1, 6, dtype=np.float32)
    buf, entries = Chunk(200000, indices, values).pack("fp32")
    back = Chunk.unpack(buf.copy(), 200000, entries, "fp32")
    assert back.values.flags.aligned and np.array_equal(back.values, values)
    assert np.array_equal(back.indices, indices)
    codec = get_codec("group_topk", density=0.5, group_size=3, value_dtype="fp32")  # 1 + 1 + 2 = odd
    payload = codec.encode(np.arange(7, dtype=np.float32) - 3)
    wire = np.concatenate([np.zeros(1, np.uint8), np.frombuffer(payload.to_bytes(), np.uint8)])[1:]
    rebuilt = codec.from_bytes(wire, like=payload)
    assert all(a.flags.aligned for a in rebuilt.arrays.values())
    assert np.array_equal(codec.decode(rebuilt), codec.decode(payload))


def _emulated_rank(rank, world):
    from rayzip.comm import FixedLink, Link

    slow = Transport(emulation=FixedLink(Link(bandwidth=1e6, latency=0.05)))
    fast = Transport()
    payload = torch.zeros(100_000, dtype=torch.uint8)  # 0.1 s at 1 MB/s, plus the latency
    for transport in (slow, fast):
        transport.shift(payload, -1)
    return slow.network_s, fast.network_s, slow.bytes_sent == fast.bytes_sent


def test_an_emulated_link_adds_its_time_to_every_send_and_nothing_to_the_bytes():
    for slow_s, fast_s, same_bytes in run_world(_emulated_rank, 2):
        # The header's send (16 bytes, 0.05 s) and the payload's (0.1 s + 0.05 s).
        assert slow_s - fast_s >= 0.2 - 0.02 and same_bytes, (slow_s, fast_s)


def test_an_emulated_link_refuses_a_bandwidth_that_is_not_positive():
    from rayzip.comm import FixedLink, Link

    with pytest.raises(ValueError, match="positive bandwidth"):
        FixedLink(Link(bandwidth=0.0, latency=0.0))


def _senders_rank(rank, world):
    """Group top-k payloads averaged over their senders, with the 2-bit values and coded
    offsets of SparseLoCo's outer updates."""
    codec = get_codec("group_topk", density=0.05, value_dtype="2bit", coded_indices=True)
    x = np.random.default_rng(rank).standard_normal(10_001).astype(np.float32)
    payload = codec.encode(x)
    transport = Transport()
    average = AllGather(transport, combine="senders").average(codec, payload)
    indices, values = codec.to_coo(payload)
    return average, np.asarray(indices), np.asarray(values), transport.bytes_sent, payload.nbytes


@pytest.mark.parametrize("world", [3, 4])
def test_combine_senders_averages_each_entry_over_the_ranks_that_sent_it(world):
    results = run_world(_senders_rank, world)
    total, count = np.zeros(10_001, np.float64), np.zeros(10_001)
    for _, indices, values, _, _ in results:
        total[indices] += values
        count[indices] += 1
    reference = total / np.maximum(count, 1)
    assert (count > 1).any() and (count == 1).any()  # both cases occur
    assert not np.allclose(reference, total / world)  # the mean over every rank differs
    for average, _, _, bytes_sent, wire in results:
        np.testing.assert_allclose(average, reference, rtol=1e-6, atol=1e-7)
        assert bytes_sent == (world - 1) * wire  # the allgather's bytes: nothing more is sent
    for average, *_ in results[1:]:
        assert np.array_equal(average, results[0][0])  # replicas agree bitwise


def _dense_rank(rank, world):
    """Sparse payloads (fp32 top-k, and group top-k's 2-bit values, summed in fp16) scattered
    into a vector and all-reduced."""
    from rayzip.comm import DenseAllReduce

    out = {}
    for name, codec in (("topk", get_codec("topk", density=0.02, value_dtype="fp32")),
                        ("group_topk:2bit", get_codec("group_topk", density=0.05, value_dtype="2bit"))):
        transport = Transport()
        communicator = DenseAllReduce(transport)
        x = np.random.default_rng(rank).standard_normal(10_001).astype(np.float32)
        payload = codec.encode(x * communicator.input_scale)
        indices, values = codec.to_coo(payload)
        average = communicator.average(codec, payload)
        out[name] = (average, np.asarray(indices), np.asarray(values), transport.bytes_sent,
                     communicator.documented_bytes(codec, payload))
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_the_dense_collective_sums_the_sparse_payloads_exactly_and_counts_the_vector(world):
    results = run_world(_dense_rank, world)
    for name, tol, value_bytes in (("topk", 1e-6, 4), ("group_topk:2bit", 2e-3, 2)):
        total = np.zeros(10_001, np.float64)
        for per_rank in results:
            _, indices, values, _, _ = per_rank[name]
            total[indices] += values  # each rank sent grad / n: the sum is the mean
        for per_rank in results:
            average, _, _, bytes_sent, documented = per_rank[name]
            np.testing.assert_allclose(average, total, atol=tol)
            # 2(n-1)/n of the vector, in the type the values are summed in, at any density.
            assert bytes_sent == documented == 2 * (world - 1) * 10_001 * value_bytes // world, name
        for per_rank in results[1:]:
            assert np.array_equal(per_rank[name][0], results[0][name][0])  # replicas agree bitwise
