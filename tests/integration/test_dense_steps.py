"""Steps with compression off go bucket by bucket, as DDP's own allreduce (issue 22).

Real gloo ranks and real DDP. The reference for every dense step is the compressed path's
own dense step (forced by ``verify``, which the bucketwise path does not serve): the same
mathematics over a flat gradient, so the parameters must agree to float rounding across
the switch off, with error feedback and momentum correction carried across.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gloo_world import run_world
from rayzip.comm import ring_allreduce_bytes
from rayzip.comm.control import control_nbytes
from rayzip.torch import CompressionConfig, compress

# compressed, compressed, compressed, off x4, compressed x2: two switches each way
SCHEDULE = [True, True, True, False, False, False, False, True, True]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                               torch.nn.ReLU(), torch.nn.Linear(512, 10))


def _flat(model) -> np.ndarray:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).numpy().copy()


def _build(verify: bool, policy: str):
    ddp = torch.nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.5)
    spec = CompressionConfig(codec="topk", density=0.05, momentum_correction=True, verify=verify)
    state = compress(ddp, spec, momentum=0.9, on_nonfinite=policy)
    return ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.0)


def _switching_rank(rank, world, verify, nan_at=None, policy="raise", restart_at=None, kernels=True):
    """Train on SCHEDULE; per step: (stats, params after it, velocities held). With
    ``restart_at``, the model, optimizer and hook are rebuilt from their state dicts before
    that step, as a restarted worker group would. Without ``kernels``, the fused C kernels'
    torch fallback (what CUDA and a build without a compiler run) does their work."""
    if not kernels:
        from rayzip.codecs import kernels as built

        built.fused = None  # this rank's process only
    ddp, state, optimizer = _build(verify, policy)
    gen = torch.Generator().manual_seed(rank)
    out = []
    for step, on in enumerate(SCHEDULE):
        if step == restart_at:
            saved = ({k: v.clone() for k, v in ddp.module.state_dict().items()}, optimizer.state_dict(),
                     state.state_dict())
            ddp, state, optimizer = _build(verify, policy)
            ddp.module.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
            state.load_state_dict(saved[2])
        state.set_enabled(on)
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        if step == nan_at and rank == 1:
            x[0, 0] = float("nan")
        optimizer.zero_grad()
        try:
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}", "step": step, "out": out}
        if not state.last_step.skipped:
            optimizer.step()
        velocities = {k: np.asarray(v).copy() for k, v in state.memory.velocities.items()}
        out.append((dict(state.last_step.__dict__), _flat(ddp), velocities, state.drained))
    return {"error": None, "out": out}


def test_dense_steps_go_bucketwise_and_match_the_flat_path_through_switches():
    world = 3
    fast = run_world(_switching_rank, world, False)
    flat = run_world(_switching_rank, world, True)
    numel = sum(p.numel() for p in _model().parameters())
    ring = ring_allreduce_bytes(4 * numel, world)
    back = SCHEDULE.index(True, SCHEDULE.index(False))
    for r in fast:
        assert r["error"] is None
    for step, on in enumerate(SCHEDULE):
        stats = [r["out"][step][0] for r in fast]
        params = [r["out"][step][1] for r in fast]
        for p in params[1:]:
            np.testing.assert_array_equal(p, params[0])  # replicas stay identical
        if step < back:
            np.testing.assert_allclose(params[0], flat[0]["out"][step][1], rtol=1e-5, atol=1e-6, err_msg=f"step {step}")
        # From the switch back on, the flat path's ranks resume from velocities of their own
        # and the bucketwise path's from the shared one: both are momentum correction, with
        # different top-k choices, so they part ways.
        assert np.isfinite(params[0]).all()
        for s in stats:
            assert s["compressed"] == on
            if on:
                assert s["buckets"] == [numel] and s["bytes_sent"] < ring / 4
                continue
            # Several DDP buckets (bucket_cap_mb=0.5), each all-reduced where it lies.
            assert len(s["buckets"]) > 1 and sum(s["buckets"]) == numel
            assert s["dense_bytes"] == sum(ring_allreduce_bytes(4 * n, world) for n in s["buckets"])
            assert s["control_bytes"] == control_nbytes(world)  # one control word per step
            # The first dense step also averages what the memory held: residuals and velocities.
            drain = ring_allreduce_bytes(2 * 4 * numel, world) if SCHEDULE[step - 1] else 0
            assert s["bytes_sent"] == s["dense_bytes"] + s["control_bytes"] + drain
            assert s["hops"] == 2 * (world - 1) * (len(s["buckets"]) + 1 + (drain > 0))
    # While off, every rank holds the same velocities: SGD momentum on the averaged gradient.
    for step, on in enumerate(SCHEDULE):
        held = [r["out"][step][2] for r in fast]
        drained = [r["out"][step][3] for r in fast]
        assert drained == [not on] * world
        if not on:
            for name, v in held[0].items():
                for other in held[1:]:
                    np.testing.assert_array_equal(other[name], v)
    # The first compressed step after the switch back differs per rank again.
    name = next(iter(fast[0]["out"][back][2]))
    assert not np.array_equal(fast[0]["out"][back][2][name], fast[1]["out"][back][2][name])


def test_a_restart_while_off_resumes_exactly():
    whole = run_world(_switching_rank, 2, False)
    restarted = run_world(_switching_rank, 2, False, None, "raise", 5)  # mid-way through the off steps
    for a, b in zip(whole, restarted):
        assert b["error"] is None
        for step in range(len(SCHEDULE)):
            np.testing.assert_array_equal(a["out"][step][1], b["out"][step][1])


@pytest.mark.parametrize("nan_at, kernels", [(3, True), (5, True), (5, False)])  # the first dense step
def test_a_nan_while_off_every_rank_skips_and_keeps_its_memory(nan_at, kernels):  # (which drains), a later
    """Rank 1's gradient turns NaN while compression is off: each rank checks its own as it
    scales its buckets, and the control word tells every rank which rank and where."""
    results = run_world(_switching_rank, 2, False, nan_at, "skip", None, kernels)
    for r in results:
        assert r["error"] is None
        stats, params, held, drained = r["out"][nan_at]
        before = r["out"][nan_at - 1]
        assert stats["skipped"] and "rank 1's gradient is not finite at 0.weight (parameter 0" in stats["nonfinite"]
        np.testing.assert_array_equal(params, before[1])
        assert drained == before[3]
        assert held.keys() == before[2].keys()
        for name in held:
            np.testing.assert_array_equal(held[name], before[2][name])
        assert not any(s[0]["skipped"] for i, s in enumerate(r["out"]) if i != nan_at)
    np.testing.assert_array_equal(results[0]["out"][-1][1], results[1]["out"][-1][1])


def test_a_nan_while_off_raises_on_every_rank_at_that_step():
    results = run_world(_switching_rank, 2, False, 4, "raise")
    for r in results:
        assert r["step"] == 4
        assert r["error"].startswith("NonFiniteError: step 4: rank 1's gradient is not finite at 0.weight")


def _adam_rank(rank, world, corrected, steps=5):
    ddp = torch.nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.5)
    if corrected:  # compression off from the first step: every step dense, bucket by bucket
        state = compress(ddp, CompressionConfig(codec="topk", density=0.05, adam_correction=True),
                         adam_betas=(0.9, 0.95))
        state.set_enabled(False)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.0)
    else:
        state = None
        optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        assert state is None or not state.last_step.compressed
    return _flat(ddp)


def test_adam_correction_off_is_adam_on_ddps_average():
    corrected = run_world(_adam_rank, 2, True)
    plain = run_world(_adam_rank, 2, False)
    np.testing.assert_array_equal(corrected[0], corrected[1])
    np.testing.assert_allclose(corrected[0], plain[0], rtol=1e-4, atol=1e-6)
    assert np.abs(corrected[0] - _flat(_model())).max() > 1e-3  # it trained


def _overflowing_rank(rank, world):
    """A dense step whose every averaged entry is 3e36, finite, while their float32 sum is
    not (4000 of them): a check by summing would take it for a NaN."""
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 4000, bias=False))
    state = compress(ddp, CompressionConfig(codec="topk", density=0.05), on_nonfinite="raise")
    state.set_enabled(False)
    (ddp(torch.ones(1, 1)).sum() * 3e36).backward()
    grad = ddp.module.weight.grad.flatten()
    return {"skipped": state.last_step.skipped, "compressed": state.last_step.compressed,
            "sum_finite": bool(torch.isfinite(grad.sum())), "grad": grad.numpy().copy()}


def test_a_finite_gradient_whose_sum_overflows_is_not_taken_for_a_nan():
    for r in run_world(_overflowing_rank, 2):
        assert not r["sum_finite"]  # the case the exact look settles
        assert not r["skipped"] and not r["compressed"]
        np.testing.assert_array_equal(r["grad"], np.full(4000, 3e36, dtype=np.float32))
