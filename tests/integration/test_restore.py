"""Restores and resizes keep every rank in step, and keep error feedback (issue 16)."""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from gloo_world import run_world
from rayzip.codecs.memory import reshard_state
from rayzip.spec import TrainingSpec
from rayzip.torch import CompressionConfig
from rayzip.engine import GradientExchange
from rayzip.xp import array_module, as_array

TIMEOUT_S = 30
NUMEL = 3000


@pytest.mark.parametrize("world", [2, 3, 7, 8])
def test_every_rank_runs_the_same_steps_in_epochs_mode(world):
    from rayzip.train.loop import shard_plan

    training = TrainingSpec(epochs=2, batch_size=64)
    train_size = 1347  # digits' training split: 7 shards of 193 and 192 examples
    plans = [shard_plan(training, train_size, rank, world) for rank in range(world)]
    assert len({steps for _, steps in plans}) == 1
    assert plans[0][1] == 2 * math.ceil((train_size // world) / 64)
    assert sorted(int(i) for mine, _ in plans for i in mine) == list(range(train_size))  # disjoint cover


@pytest.mark.parametrize("old, new", [(2, 3), (3, 2), (4, 1), (1, 2), (2, 2)])
def test_reshard_keeps_the_mean_of_pending_error_feedback(old, new):
    rng = np.random.default_rng(old * 10 + new)
    saved = {r: {"model": rng.standard_normal(50).astype(np.float32),
                 "velocity:model": rng.standard_normal(50).astype(np.float32)} for r in range(old)}
    resharded = [reshard_state(saved, old, new, r) for r in range(new)]
    for key in ("model", "velocity:model"):
        before = np.mean([saved[r][key] for r in range(old)], axis=0)
        after = np.sum([s[key] for s in resharded if key in s], axis=0) / new
        np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("old, new, kept", [(2, 2, [1]), (2, 2, [0]), (4, 4, [0, 2, 3]), (4, 2, [1, 2]),
                                            (2, 1, [1])])
def test_reshard_estimates_a_lost_rank_from_the_survivors(old, new, kept):
    """A rank whose state was lost with its node counts as the survivors' mean: the pending
    mean after the restore is the kept ranks' mean, not shrunk by the lost ranks' share."""
    rng = np.random.default_rng(old * 100 + new * 10 + len(kept))
    saved = {r: {"model": rng.standard_normal(50).astype(np.float32)} for r in kept}
    resharded = [reshard_state(saved, old, new, r) for r in range(new)]
    survivors = np.mean([saved[r]["model"] for r in kept], axis=0)
    after = np.sum([s["model"] for s in resharded], axis=0) / new
    np.testing.assert_allclose(after, survivors, rtol=1e-5, atol=1e-6)
    for r in range(new):  # a survivor that stays in place keeps its own state, unscaled
        if old == new and r in kept:
            np.testing.assert_array_equal(resharded[r]["model"], saved[r]["model"])
        if old == new and r not in kept:
            np.testing.assert_allclose(resharded[r]["model"], survivors, rtol=1e-6)


def test_reshard_without_an_estimate_leaves_a_lost_rank_empty():
    """Under combine senders a lost rank held nothing: a survivor in place keeps its own
    state, the lost rank's place starts empty."""
    rng = np.random.default_rng(7)
    saved = {0: {"model": rng.standard_normal(50).astype(np.float32)}}
    survivor = reshard_state(saved, 2, 2, 0, estimate_lost=False)
    np.testing.assert_array_equal(survivor["model"], saved[0]["model"])
    assert reshard_state(saved, 2, 2, 1, estimate_lost=False) == {}


def test_reshard_with_every_rank_kept_ignores_the_others_states():
    """States of old ranks that go to other new ranks change nothing when none was lost."""
    rng = np.random.default_rng(7)
    saved = {r: {"model": rng.standard_normal(20).astype(np.float32)} for r in range(4)}
    mine = {r: saved[r] for r in (1, 3)}
    np.testing.assert_array_equal(reshard_state(saved, 4, 2, 1)["model"], reshard_state(mine, 4, 2, 1)["model"])


def _state(rank, world, warmup=5):
    spec = CompressionConfig(codec="topk", density=0.02, momentum_correction=True, warmup_steps=warmup)
    return GradientExchange(spec, sizes=[NUMEL], momentum=0.9)


def _save_rank(rank, world, directory, steps):
    from rayzip.train.loop import save_step
    from rayzip.train.records import Totals

    state = _state(rank, world)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        state.average(torch.randn(NUMEL, generator=gen))
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    weights = lambda: (model.state_dict(), optimizer.state_dict())  # noqa: E731
    save_step(Path(directory), rank, world, steps - 1, weights, state, Totals(), {}, None)
    return {k: np.asarray(v).copy() for k, v in state.memory.state_dict().items()}


def _restore_rank(rank, world, directory, device):
    import ray.train

    from rayzip.train.exchange import restore_collective

    state = _state(rank, world)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    start, _ = restore_collective(ray.train.Checkpoint.from_directory(directory), rank, world, model, optimizer, state)
    held = state.memory.residuals.get("model")
    on_device = held is None or array_module(held) is as_array(torch.empty(0, device=device))[1]
    memory = {k: np.asarray(v).copy() for k, v in state.memory.state_dict().items()}
    state.average(torch.ones(NUMEL))  # every rank at the same step: no RankDisagreement
    return start, state.last_step.step, state.last_step.compressed, memory, on_device


@pytest.mark.parametrize("old, new", [(2, 3), (3, 2)])
def test_a_resize_resumes_every_rank_at_the_checkpoint_step_with_error_feedback_kept(old, new):
    with tempfile.TemporaryDirectory() as directory:
        saved = run_world(_save_rank, old, directory, 8, timeout_s=TIMEOUT_S)
        restored = run_world(_restore_rank, new, directory, "cpu", timeout_s=TIMEOUT_S)
    for start, step, compressed, _, on_device in restored:
        # A new rank at step 0 would still be in its dense warm-up (5 steps) while the others ran the ring.
        assert start == 8 and step == 8 and compressed and on_device
    for key in ("model", "velocity:model"):
        before = np.mean([s[key] for s in saved], axis=0)
        after = np.sum([r[3][key] for r in restored if key in r[3]], axis=0) / new
        assert np.abs(before).max() > 0.1  # there was something pending to keep
        np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-6)


def test_a_rank_whose_part_was_lost_resumes_with_the_survivors_error_feedback():
    """A snapshot restored without one rank's part (lost with its node's keeper): the
    survivor keeps its own residual and velocity, the lost rank takes the survivor's, so
    the pending mean is the survivor's rather than half of it."""
    with tempfile.TemporaryDirectory() as directory:
        saved = run_world(_save_rank, 2, directory, 8, timeout_s=TIMEOUT_S)
        shutil.rmtree(Path(directory) / "rank1")
        restored = run_world(_restore_rank, 2, directory, "cpu", timeout_s=TIMEOUT_S)
    for start, step, compressed, memory, _ in restored:
        assert start == 8 and step == 8 and compressed
        for key in ("model", "velocity:model"):
            assert np.abs(saved[0][key]).max() > 0.1
            np.testing.assert_array_equal(memory[key], saved[0][key])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (and cupy) to restore onto")
def test_restored_error_feedback_lands_on_the_gradients_device_on_cuda():
    from rayzip.codecs import ErrorFeedback

    memory = ErrorFeedback()
    grad = torch.randn(NUMEL, device="cuda")
    memory.load_state_dict({"model": np.ones(NUMEL, np.float32)}, like=grad)
    assert array_module(memory.residuals["model"]) is as_array(grad)[1]
    memory.encode(CompressionConfig(codec="topk", density=0.1).build_codec(), "model", grad)
    assert array_module(memory.residuals["model"]) is as_array(grad)[1]


def test_restored_error_feedback_follows_the_gradient_to_its_array_module():
    # The device-agnostic check: state restored from a checkpoint (host numpy) is moved to
    # wherever the first gradient lives, and ``like=`` moves it up front.
    from rayzip.codecs import ErrorFeedback, MomentumCorrection

    grad = torch.randn(NUMEL)
    for memory in (ErrorFeedback(), MomentumCorrection(0.9)):
        saved = {"model": torch.ones(NUMEL), "velocity:model": torch.ones(NUMEL)}  # as checkpoint.load gives
        if not isinstance(memory, MomentumCorrection):
            saved.pop("velocity:model")
        memory.load_state_dict(saved, like=grad)
        assert array_module(memory.residuals["model"]) is as_array(grad)[1]
        memory.encode(CompressionConfig(codec="topk", density=0.1).build_codec(), "model", grad)
        held = [memory.residuals["model"], *getattr(memory, "velocities", {}).values()]
        assert all(array_module(h) is as_array(grad)[1] for h in held)


def _accuracy_rank(rank, world):
    from rayzip.train.loop import agreed_accuracy

    # In asynchronous parameter-server mode each rank evaluates its own copy of the model.
    own = [0.80, 0.95, 0.91][rank]
    return agreed_accuracy(own, "cpu"), agreed_accuracy(None if rank == 0 else own, "cpu")


def test_every_rank_takes_rank_zeros_accuracy_for_the_stop_decision():
    assert run_world(_accuracy_rank, 3, timeout_s=TIMEOUT_S) == [(0.80, None)] * 3
