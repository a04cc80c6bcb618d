"""The gradient-exchange engine alone, on real gloo ranks, with no DDP: the seam every way of
training sits on. A flat shard of a sharded model is one more flat tensor: here four ranks
hold two shards, and each shard's replicas (ranks {0, 2} and {1, 3}, as HSDP's replicate
groups) average theirs through an engine on a process group of their own."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from gloo_world import run_world
from rayzip.codecs import get_codec
from rayzip.codecs.memory import ErrorFeedback
from rayzip.engine import CompressionConfig, GradientExchange, plan_segments

SIZES = {0: [3000, 40, 500], 1: [700, 300, 7]}  # the two shards' parameters
SEGMENT_MB = 0.001  # a few segments per shard


def _gradient(rank: int, step: int) -> torch.Tensor:
    shard = rank % 2
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(sum(SIZES[shard]), generator=gen) * (1 + rank)


def _replica_rank(rank, world, steps):
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank builds every group, in order
    shard = rank % 2
    exchange = GradientExchange(CompressionConfig(codec="group_topk", density=0.05, value_dtype="fp32",
                                                  segment_mb=SEGMENT_MB),
                                sizes=SIZES[shard], process_group=groups[shard])
    out = []
    for step in range(steps):
        mean = exchange.average(_gradient(rank, step))
        out.append((mean.numpy().copy(), exchange.last_step.bytes_sent, len(exchange.last_step.buckets)))
    return {"shard": shard, "steps": out, "state": exchange.state_dict()["step"]}


def test_each_shard_is_averaged_over_its_replicas_only_through_codec_and_error_feedback():
    steps = 3
    results = run_world(_replica_rank, 4, steps)
    codec = get_codec("group_topk", density=0.05, value_dtype="fp32")
    for shard, ranks in ((0, (0, 2)), (1, (1, 3))):
        memories = {r: ErrorFeedback() for r in ranks}
        numel = sum(SIZES[shard])
        for step in range(steps):
            got = [results[r]["steps"][step][0] for r in ranks]
            assert np.array_equal(got[0], got[1])  # the replicas hold the same mean
            # The reference: each replica's gradient through a fresh codec and error feedback
            # of its own, per segment as the engine cuts them, decoded and averaged.
            cuts = plan_segments(SIZES[shard], int(SEGMENT_MB * 2**20) // 4)
            expected = np.zeros(numel, dtype=np.float32)
            for lo, hi in cuts:
                decoded = [codec.decode(memories[r].encode(codec, f"{lo}", _gradient(r, step).numpy()[lo:hi]))
                           for r in ranks]
                expected[lo:hi] = np.mean(decoded, axis=0)
            np.testing.assert_allclose(got[0], expected, rtol=1e-6, atol=1e-9)
            assert results[ranks[0]]["steps"][step][2] == len(cuts) > 1
            assert 0 < results[ranks[0]]["steps"][step][1] < 4 * numel / 5  # compressed, within the pair
        assert results[ranks[0]]["state"] == steps
