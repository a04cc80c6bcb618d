"""Every rank takes the same decision at the same step, and nothing hangs (issue 16).

All of these run real gloo ranks. Collectives time out after ``TIMEOUT_S`` here, so a rank
left waiting fails the test instead of hanging it.
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch

from gloo_world import run_world
from rayzip.comm.control import Agreed, ControlWord, RankDisagreement, bad_key, proposal_key
from rayzip.torch import CompressionConfig, compress
from rayzip.engine import GradientExchange, NonFiniteError
from rayzip.train.loop import Adoption

TIMEOUT_S = 20


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _flat_params(model) -> np.ndarray:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).numpy().copy()


def _nan_rank(rank, world, spec, policy, bad_rank, bad_step, steps):
    """Train with SGD; rank ``bad_rank`` alone feeds a NaN at ``bad_step`` (an Inf under
    momentum correction). Returns, per step, (skipped, params after the step, what error
    feedback holds), or the error this rank raised."""
    momentum = 0.9 if spec.get("momentum_correction") else None
    ddp = torch.nn.parallel.DistributedDataParallel(_model())
    state = compress(ddp, CompressionConfig(**spec), momentum=momentum, on_nonfinite=policy)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.0)
    gen = torch.Generator().manual_seed(rank)
    out = []
    for step in range(steps):
        x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        if rank == bad_rank and step == bad_step:
            x[3, 5] = float("inf") if momentum else float("nan")
        optimizer.zero_grad()
        started = time.perf_counter()
        try:
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
        except NonFiniteError as exc:
            return {"error": str(exc), "step": step, "waited_s": time.perf_counter() - started, "out": out}
        if not state.last_step.skipped:
            optimizer.step()
        held = (state.memory.velocities if momentum else state.memory.residuals).get("model")
        out.append((state.last_step.skipped, _flat_params(ddp), None if held is None else np.asarray(held).copy()))
    return {"error": None, "out": out}


def test_nan_on_one_rank_every_rank_raises_together_within_the_step():
    started = time.perf_counter()
    results = run_world(_nan_rank, 3, {"codec": "group_topk", "density": 0.05}, "raise", 1, 2, 5,
                        timeout_s=TIMEOUT_S)
    wall_s = time.perf_counter() - started
    print(f"3 gloo ranks, NaN on rank 1 at step 2, policy raise: wall {wall_s:.1f} s")
    for r in results:
        assert r["error"] is not None and r["step"] == 2, r["error"]
        assert "step 2: rank 1's gradient is not finite at 0.weight (parameter 0 of the model)" in r["error"]
        assert r["waited_s"] < TIMEOUT_S / 2  # decided by the control word, not by a timeout
    assert wall_s < 3 * TIMEOUT_S


@pytest.mark.parametrize("spec", [{"codec": "group_topk", "density": 0.05},
                                  {"codec": "topk", "density": 0.05, "momentum_correction": True}])
def test_nan_on_one_rank_every_rank_skips_the_same_step_and_keeps_its_residual(spec):
    results = run_world(_nan_rank, 3, spec, "skip", 1, 2, 5, timeout_s=TIMEOUT_S)
    for r in results:
        assert r["error"] is None
        assert [skipped for skipped, _, _ in r["out"]] == [False, False, True, False, False]
        # The skipped step changed neither the parameters nor the error-feedback residual.
        np.testing.assert_array_equal(r["out"][2][1], r["out"][1][1])
        np.testing.assert_array_equal(r["out"][2][2], r["out"][1][2])
        assert np.isfinite(r["out"][-1][1]).all()
    for step in range(5):  # replicas stay identical
        for r in results[1:]:
            np.testing.assert_array_equal(r["out"][step][1], results[0]["out"][step][1])


def _exchange_rank(rank, world, spec, values_by_rank, policy):
    """One GradientExchange.average of a crafted flat gradient per step."""
    state = GradientExchange(CompressionConfig(**spec), sizes=[len(values_by_rank[0][0])], on_nonfinite=policy)
    out = []
    for step_values in values_by_rank:
        grad = torch.tensor(step_values[rank], dtype=torch.float32)
        try:
            average = state.average(grad)
        except NonFiniteError as exc:
            out.append(("error", str(exc)))
            continue
        out.append(("ok", average.numpy().copy(), state.last_step.skipped, state.last_step.nonfinite))
    return out


def test_fp16_allreduce_divides_before_it_sums():
    # 2 x 40000 overflows fp16 (65504); their mean does not. torch's fp16 hook divides first too.
    values = [[[40000.0] * 8, [40000.0] * 8]]
    results = run_world(_exchange_rank, 2, {"codec": "fp16"}, values, "raise", timeout_s=TIMEOUT_S)
    for status, average, skipped, _ in (r[0] for r in results):
        assert status == "ok" and not skipped
        np.testing.assert_array_equal(average, np.full(8, 40000.0, np.float32))


def test_fp16_encode_overflow_on_one_rank_skips_on_every_rank():
    # Rank 1 alone holds a value whose share (x / 2) is beyond fp16: its encode fails, before
    # any payload moves, and the control word carries that to rank 0.
    values = [[[1.0] * 8, [1.0] * 7 + [300000.0]], [[2.0] * 8, [4.0] * 8]]
    results = run_world(_exchange_rank, 2, {"codec": "fp16"}, values, "skip", timeout_s=TIMEOUT_S)
    for r in results:
        assert r[0][0] == "ok" and r[0][2] is True and np.isnan(r[0][1]).all()
        assert "rank 1's gradient overflows the fp16 wire type at parameter 0 (parameter 0 of the model), element 7" in r[0][3]
        assert r[1][0] == "ok" and not r[1][2]
        np.testing.assert_array_equal(r[1][1], np.full(8, 3.0, np.float32))


def test_fp16_ring_sum_that_overflows_on_the_wire_is_seen_by_every_rank():
    # Each rank's kept values fit fp16; their ring partial sums (3 x 40000) do not. The Inf
    # travels on to every rank's result, and every rank raises at the same step.
    n = 4096
    values = [[[40000.0 if i % 64 == 0 else 0.001 for i in range(n)] for _ in range(3)]]
    spec = {"codec": "group_topk", "density": 1 / 64, "group_size": 1024, "collective": "ring"}
    results = run_world(_exchange_rank, 3, spec, values, "raise", timeout_s=TIMEOUT_S)
    for r in results:
        assert r[0][0] == "error"
        assert "the averaged gradient is not finite after the ring (the sum overflowed fp16 on the wire)" in r[0][1]


def _disagree_rank(rank, world, what):
    state = GradientExchange(CompressionConfig(codec="topk", density=0.05), sizes=[1000])
    if what == "density" and rank == 1:
        state.set_density(0.2)  # one rank alone: a different payload size every step from now on
    if what == "step" and rank == 2:
        state.step = 7  # a rank restored at another step
    try:
        state.average(torch.randn(1000))
    except RankDisagreement as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("what, message", [("density", "density ranges over 0.05 .. 0.2"),
                                           ("step", "ranks disagree at step 0..7")])
def test_ranks_that_disagree_all_raise_instead_of_hanging(what, message):
    results = run_world(_disagree_rank, 3, what, timeout_s=TIMEOUT_S)
    for text in results:
        assert text is not None and message in text


def _stop_rank(rank, world):
    state = GradientExchange(CompressionConfig(codec="topk", density=0.1), sizes=[100])
    stops = []
    for step in range(4):
        if rank == 2 and step == 1:
            state.request_stop()
        state.average(torch.randn(100))
        stops.append(state.last_step.stop)
    return stops


def test_a_stop_asked_by_one_rank_reaches_every_rank_at_the_same_step():
    assert run_world(_stop_rank, 3, timeout_s=TIMEOUT_S) == [[False, True, False, False]] * 3


def _adoption_rank(rank, world, seed):
    state = GradientExchange(CompressionConfig(codec="topk", density=0.01), sizes=[2000])
    # Rank 0's controller answers slowly and at random: each decision arrives a few ms to
    # tens of ms later, while the ranks keep stepping.
    decisions: list[dict] = []
    rng = random.Random(seed)

    def controller():
        for seq in range(1, 8):
            time.sleep(rng.uniform(0.005, 0.06))
            decisions.append({"seq": seq, "compression": float(rng.choice([1.0, 5.0, 20.0, 50.0]))})

    if rank == 0:
        threading.Thread(target=controller, daemon=True).start()
    poll = lambda: decisions[-1] if decisions else None  # noqa: E731
    applied = []
    adoption = Adoption(poll, lambda seq, step: applied.append((seq, step)), rank, state)
    seen = []
    for step in range(60):
        adoption.before_step()
        state.average(torch.randn(2000))
        seen.append((state.last_step.compressed, state.last_step.density, state.last_step.adopted))
        adoption.after_step(step)
        time.sleep(0.005 * (rank + 1))  # ranks run at different speeds
    return seen, applied


def test_a_late_controller_decision_is_adopted_by_every_rank_at_the_same_step():
    results = run_world(_adoption_rank, 3, 7, timeout_s=TIMEOUT_S)
    seen = [r[0] for r in results]
    assert seen[1] == seen[0] and seen[2] == seen[0]
    adopted = [(step, a) for step, (_, _, a) in enumerate(seen[0]) if a is not None]
    assert adopted, "no decision reached the ranks"
    for step, (seq, compression) in adopted:  # applied from the next step on
        if step + 1 < len(seen[0]):
            compressed, kept, _ = seen[0][step + 1]
            assert compressed == (compression > 1.0)
            if compression > 1.0:
                assert kept == pytest.approx(1.0 / compression)
    assert results[0][1] == [(seq, step + 1) for step, (seq, _) in adopted]


def test_the_control_word_reduces_to_min_max_and_names_the_lowest_bad_rank():
    words = [ControlWord(step=3, density=0.01, bad=bad_key(2, 4, 99), proposal=proposal_key(5, 20.0)),
             ControlWord(step=3, density=0.01, bad=bad_key(1, 4, 7)),
             ControlWord(step=3, density=0.01, stop=1)]
    rows = [list(vars(w).values()) for w in words]
    high = ControlWord(*np.max(rows, axis=0).tolist())
    low = ControlWord(*np.min(rows, axis=0).tolist())
    agreed = Agreed(low=low, high=high, world=4)
    agreed.check()
    assert agreed.bad == (1, 7, False) and agreed.stop and agreed.proposal == (5, 20.0)


def _frozen_rank(rank, world):
    model = _model()
    model[0].weight.requires_grad_(False)  # fine-tuning: the first layer's weight is frozen
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = compress(ddp, CompressionConfig(codec="topk", density=0.01, value_dtype="fp32", verify=True))
    gen = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(3):
        x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        ddp.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        out.append((state.last_step.numel, state.last_step.dense_bytes, state.last_step.verify_max_abs_err,
                    model[0].weight.grad is None))
    return out


def test_frozen_parameters_never_enter_the_flat_gradient():
    trainable = sum(p.numel() for p in _model().parameters()) - 64 * 256
    for rank_steps in run_world(_frozen_rank, 2, timeout_s=TIMEOUT_S):
        for numel, dense_bytes, err, frozen_has_no_grad in rank_steps:
            assert numel == trainable
            assert dense_bytes == 2 * 1 * 4 * trainable // 2
            assert err < 1e-6 and frozen_has_no_grad


def _amp_rank(rank, world, steps):
    from sklearn.datasets import load_digits

    data = load_digits()
    x_all = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y_all = torch.tensor(data.target)
    order = np.random.default_rng(0).permutation(len(x_all))
    test, train = order[:400], order[400:]
    mine = train[rank::world]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    # A high initial scale overflows fp16 at first: GradScaler must skip those steps on every
    # rank and lower its scale, and the residuals must follow the scale.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=50)
    state = compress(ddp, CompressionConfig(codec="group_topk", density=0.01, momentum_correction=True),
                     momentum=0.9, on_nonfinite="skip", grad_scaler=scaler)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.0)
    gen = torch.Generator().manual_seed(rank)
    skipped, scales = [], []
    for _ in range(steps):
        idx = torch.from_numpy(mine)[torch.randint(0, len(mine), (64,), generator=gen)]
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(ddp(x_all[idx]), y_all[idx])
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        skipped.append(state.last_step.skipped)
        scales.append(scaler.get_scale())
    with torch.no_grad():
        accuracy = float((model(x_all[test]).argmax(1) == y_all[test]).float().mean())
    return skipped, scales, accuracy, _flat_params(model)


def test_fp16_autocast_with_grad_scaler_under_group_topk_reaches_the_digits_target():
    results = run_world(_amp_rank, 2, 300, timeout_s=60)
    (skipped0, scales0, acc0, params0), (skipped1, scales1, acc1, params1) = results
    assert skipped0 == skipped1 and scales0 == scales1  # the same steps skipped, the same scale
    assert sum(skipped0) >= 3  # 2**24 overflowed: GradScaler backed off through skipped steps
    np.testing.assert_array_equal(params0, params1)
    print(f"fp16 AMP + group_topk 1%: accuracy {acc0:.4f}, {sum(skipped0)} skipped steps, final scale {scales0[-1]}")
    assert acc0 >= 0.93
