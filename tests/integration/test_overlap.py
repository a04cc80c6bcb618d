"""Overlap of the exchange with backward (issue 18): the same gradients, segment by segment,
whatever DDP's bucket layout, and a restarted run that repeats the uninterrupted one."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from gloo_world import run_world
from rayzip.codecs.memory import relayout_state, segment_name
from rayzip.torch import CompressionConfig, compress
from rayzip.engine import plan_segments

# ~2.3 MB of gradient in segments of whole parameters from 0.25 MiB: 4 segments, cut otherwise
# than DDP's 0.5 MB buckets (the first of which is capped at 1 MB).
SEGMENT_MB = 0.25


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                               torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))


def _batches(rank, steps):
    gen = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)) for _ in range(steps)]


def _setup(spec: dict, momentum: float):
    ddp = torch.nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.5)
    state = compress(ddp, CompressionConfig(**spec), momentum=momentum if spec.get("momentum_correction") else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.0)
    return ddp, state, optimizer


def _steps(ddp, state, optimizer, batches):
    grads = []
    for x, y in batches:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        grads.append(torch.cat([p.grad.flatten() for p in ddp.parameters()]).numpy().copy())
        optimizer.step()
    return grads


def _grads_rank(rank, world, spec, steps):
    ddp, state, optimizer = _setup(spec, momentum=0.9)
    grads = _steps(ddp, state, optimizer, _batches(rank, steps))
    return grads, len(state.segments), state.last_step.buckets, state.totals["busy_s"]


@pytest.mark.parametrize("world", [2, 3])
def test_overlapped_exchange_gives_the_same_gradients_bitwise(world):
    base = {"codec": "group_topk", "density": 0.05, "value_dtype": "fp32", "segment_mb": SEGMENT_MB,
            "momentum_correction": True}
    overlapped = run_world(_grads_rank, world, {**base, "overlap": True}, 4)
    inline = run_world(_grads_rank, world, {**base, "overlap": False}, 4)
    numel = sum(p.numel() for p in _model().parameters())
    for rank in range(world):
        grads, segments, buckets, busy_s = overlapped[rank]
        assert segments >= 3 and sum(buckets) == numel and len(buckets) == segments
        assert busy_s > 0
        for step in range(4):
            assert np.array_equal(grads[step], inline[rank][0][step])  # bitwise, fp32 on the wire
            assert np.array_equal(grads[step], overlapped[0][0][step])  # replicas identical
    assert not np.array_equal(overlapped[0][0][0], overlapped[0][0][1])


def _restart_rank(rank, world, spec, steps, cut):
    spec = dict(spec)
    resume_mb = spec.pop("resume_segment_mb", spec["segment_mb"])
    batches = _batches(rank, steps)
    ddp, state, optimizer = _setup(spec, momentum=0.9)
    uninterrupted = _steps(ddp, state, optimizer, batches)
    # A fresh job: new DDP (its first step's buckets follow registration order again), state
    # from the checkpoint written after `cut` steps.
    ddp, state, optimizer = _setup(spec, momentum=0.9)
    _steps(ddp, state, optimizer, batches[:cut])
    buffer = io.BytesIO()
    torch.save({"model": ddp.module.state_dict(), "optimizer": optimizer.state_dict(),
                "compression": state.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    ddp, state, optimizer = _setup({**spec, "segment_mb": resume_mb}, momentum=0.9)
    ddp.module.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    state.load_state_dict(saved["compression"])
    whole = [(0, state.numel)]
    held = relayout_state(state.memory.state_dict(), whole, state.numel)
    was = relayout_state(saved["compression"]["memory"], whole, state.numel)
    kept = sorted(held) == sorted(was) and all(np.array_equal(held[k], was[k]) for k in held)
    resumed = _steps(ddp, state, optimizer, batches[cut:])
    return uninterrupted[cut:], resumed, (kept, len(state.segments), sorted(was))


def test_a_restarted_overlapped_run_repeats_the_uninterrupted_one():
    spec = {"codec": "group_topk", "density": 0.05, "value_dtype": "fp32", "segment_mb": SEGMENT_MB,
            "momentum_correction": True, "overlap": True}
    for uninterrupted, resumed, _ in run_world(_restart_rank, 2, spec, 6, 3):
        assert len(resumed) == 3
        for a, b in zip(uninterrupted, resumed):
            assert np.array_equal(a, b)


def test_plan_segments_cuts_whole_parameters_from_the_end():
    assert plan_segments([10, 10, 10, 10], cap=15) == [(20, 40), (0, 20)]
    assert plan_segments([10, 10, 10, 10], cap=10**9) == [(0, 40)]
    assert plan_segments([10, 0, 30, 5], cap=20) == [(10, 45), (0, 10)]
    assert plan_segments([7], cap=1) == [(0, 7)]
    segments = plan_segments([3, 1, 4, 1, 5, 9, 2, 6], cap=5)
    assert segments[0][1] == 31 and segments[-1][0] == 0
    assert all(a[0] == b[1] for a, b in zip(segments, segments[1:]))  # contiguous, no gap


def test_state_saved_under_other_segments_is_recut_element_for_element():
    numel = 100
    rng = np.random.default_rng(0)
    whole = {"model": rng.standard_normal(numel).astype(np.float32),
             "velocity:model": rng.standard_normal(numel).astype(np.float32),
             "adam_m:model": rng.standard_normal(numel).astype(np.float32),
             "adam_t:model": np.array([7], dtype=np.float32)}
    cut = [(60, 100), (25, 60), (0, 25)]
    recut = relayout_state(whole, cut, numel)
    for lo, hi in cut:
        name = segment_name(lo, hi, numel)
        assert np.array_equal(recut[name], whole["model"][lo:hi])
        assert np.array_equal(recut["velocity:" + name], whole["velocity:model"][lo:hi])
        assert recut["adam_t:" + name][0] == 7
    back = relayout_state(recut, [(0, numel)], numel)
    assert set(back) == set(whole)
    for key in whole:
        assert np.array_equal(back[key], whole[key])
    with pytest.raises(ValueError, match="saved for another model"):
        relayout_state({"model@0:40": whole["model"][:40]}, [(0, numel)], numel)


def test_a_job_restarted_with_other_segments_keeps_its_error_feedback():
    spec = {"codec": "group_topk", "density": 0.05, "value_dtype": "fp32", "segment_mb": SEGMENT_MB,
            "momentum_correction": True, "overlap": True, "resume_segment_mb": 100.0}
    for uninterrupted, resumed, (kept, segments, saved_keys) in run_world(_restart_rank, 2, spec, 6, 3):
        assert segments == 1 and saved_keys == ["model", "velocity:model"]
        assert kept  # every residual and velocity element, recut from 4 segments into 1
        # Other segments select another top k from the next step on.
        assert not np.array_equal(uninterrupted[0], resumed[0])


def _pipeline_rank(rank, world, steps, verify=False):
    spec = {"codec": "dct_quant", "bits": 4, "collective": "allgather", "segment_mb": SEGMENT_MB, "verify": verify}
    ddp, state, optimizer = _setup(spec, momentum=0.0)
    transport, events = state.transport, []
    all_reduce, start_all_gather = transport.all_reduce, transport.start_all_gather

    def recording_all_reduce(tensor, *args, **kwargs):
        events.append("agree")
        return all_reduce(tensor, *args, **kwargs)

    def recording_start(tensor):
        wait = start_all_gather(tensor)
        events.append("send")

        def recording_wait():
            events.append("wait")
            return wait()
        return recording_wait

    transport.all_reduce, transport.start_all_gather = recording_all_reduce, recording_start
    grads = _steps(ddp, state, optimizer, _batches(rank, steps))
    return events, len(state.segments), grads


def test_a_segments_payload_is_on_the_wire_while_the_next_is_encoded_and_agreed():
    steps = 3
    results = run_world(_pipeline_rank, 2, steps)
    # verify runs each segment to its end before the next (and checks the average against
    # the collective's documented result): the pipelined averages must be the same bits.
    serial = run_world(_pipeline_rank, 2, steps, True)
    for (events, segments, grads), (_, _, serial_grads) in zip(results, serial):
        assert segments >= 3
        # Two deep: segment k+1's control word and payload go out before k's payload is waited for.
        step = ["agree", "send"] + ["agree", "send", "wait"] * (segments - 1) + ["wait"]
        assert events == step * steps
        for a, b, c in zip(grads, results[0][2], serial_grads):
            assert np.isfinite(a).all() and np.array_equal(a, b) and np.array_equal(a, c)
        assert not np.array_equal(grads[0], grads[1])
