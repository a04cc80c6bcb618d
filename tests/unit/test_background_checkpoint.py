"""Checkpoints written in the background (issue 21): the snapshot is what the step saw, writes
complete in order, a failed write is raised where it is waited for, and a checkpoint is ready
to report only once its write is whole."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rayzip import checkpoint
from rayzip.checkpoint import CheckpointError
from rayzip.checkpoint.background import BackgroundWriter, snapshot
from rayzip.train.checkpoints import GroupCheckpoints, Parts


def test_a_snapshot_is_not_changed_by_later_steps_and_keeps_ties():
    model = torch.nn.Linear(4, 3)
    tied = {"a": model.weight, "b": model.weight, "n": np.arange(3.0), "step": 7, "nested": [(model.bias,)]}
    taken = snapshot(tied)
    before = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
        model.bias.zero_()
    tied["n"][0] = 99.0
    assert torch.equal(taken["a"], before)
    assert taken["a"] is taken["b"]  # tied tensors share one copy
    assert taken["n"][0] == 0.0 and taken["step"] == 7
    assert isinstance(taken["nested"][0], tuple) and not torch.equal(taken["nested"][0][0], model.bias)


def test_writes_run_one_at_a_time_in_order_and_a_submit_reports_its_wait():
    writer = BackgroundWriter()
    order, release = [], threading.Event()

    def slow():
        release.wait(5)
        order.append("first")

    assert writer.submit(slow) == 0.0
    assert writer.pending and not writer.done()
    threading.Timer(0.3, release.set).start()
    waited = writer.submit(lambda: order.append("second"))  # waits for the first
    assert waited >= 0.2 and order == ["first"]
    writer.wait()
    assert order == ["first", "second"] and not writer.pending
    writer.close()


def test_a_failed_write_is_raised_where_it_is_waited_for():
    writer = BackgroundWriter()

    def fail():
        raise OSError("disk full")

    writer.submit(fail)
    with pytest.raises(OSError, match="disk full"):
        writer.wait()
    writer.close()


def _parts(value: float) -> Parts:
    return Parts(rank=0, world=1, trainer={"model": {"w": torch.full((1000,), value)}, "step": int(value)}, hook=None)


def test_group_checkpoints_hand_back_a_background_checkpoint_only_when_written(tmp_path):
    group = GroupCheckpoints(world=1, device="cpu", background=True)
    release = threading.Event()
    weights = {"w": torch.zeros(1000)}

    def take(copy) -> Parts:
        parts = Parts(0, 1, {"model": weights, "step": 0}, None)
        return Parts(0, 1, copy(parts.trainer), None) if copy is not None else parts

    def write(parts: Parts) -> None:
        release.wait(5)
        checkpoint.save(tmp_path / "a" / "trainer", parts.trainer)

    assert group.save(tmp_path / "a", take, write) == []
    weights["w"] += 5  # the next steps change the weights while the write waits
    assert group.poll() == []  # not written yet: nothing to report
    with pytest.raises(CheckpointError, match="no manifest"):
        checkpoint.load(tmp_path / "a" / "trainer")  # what a reader finds meanwhile
    release.set()
    deadline = time.time() + 5
    ready = []
    while not ready and time.time() < deadline:
        ready = group.poll()
    assert ready == [tmp_path / "a"]
    assert torch.equal(checkpoint.load(tmp_path / "a" / "trainer")["model"]["w"], torch.zeros(1000))
    # A sync save comes back at once; the stall it caused is counted.
    before = group.stall_s
    ready = group.save(tmp_path / "b", lambda copy: _parts(2.0),
                       lambda parts: checkpoint.save(tmp_path / "b" / "trainer", parts.trainer), background=False)
    assert ready == [tmp_path / "b"] and group.stall_s > before
    assert group.flush() == []
    group.close()


def test_a_save_waits_for_the_write_before_it_and_hands_both_back_in_order(tmp_path):
    group = GroupCheckpoints(world=1, device="cpu", background=True)
    release = threading.Event()

    def write(name: str, gate: threading.Event | None):
        def run(parts: Parts) -> None:
            if gate is not None:
                gate.wait(5)
            checkpoint.save(tmp_path / name / "trainer", parts.trainer)
        return run

    group.save(tmp_path / "a", lambda copy: _parts(1.0), write("a", release))
    threading.Timer(0.2, release.set).start()
    ready = group.save(tmp_path / "b", lambda copy: _parts(2.0), write("b", None))
    assert ready == [tmp_path / "a"]  # the first, waited for; the second now in flight
    assert group.flush() == [Path(tmp_path / "b")]
    assert checkpoint.load(tmp_path / "b" / "trainer")["step"] == 2
    group.close()


def test_a_snapshot_reuses_the_host_tensors_of_one_that_was_written():
    from rayzip.checkpoint.background import SnapshotBuffers

    buffers = SnapshotBuffers()
    model = torch.nn.Linear(8, 4)
    first = snapshot(model.state_dict(), buffers=buffers)
    kept = {name: t.data_ptr() for name, t in first.items()}
    buffers.release(first)
    with torch.no_grad():
        model.weight.mul_(2)
    second = snapshot(model.state_dict(), buffers=buffers)
    assert {name: t.data_ptr() for name, t in second.items()} == kept  # the same memory
    assert torch.equal(second["weight"], model.weight) and torch.equal(second["bias"], model.bias)


def _adamw_model():
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step():
        optimizer.zero_grad()
        model(torch.randn(32, 64, generator=gen)).square().mean().backward()  # BatchNorm's buffers change here
        optimizer.step()

    step()  # the optimizer has state
    return model, optimizer, step


def _exact_copy(nest):
    return {k: (v.clone() if torch.is_tensor(v) else _exact_copy(v) if isinstance(v, dict) else v) for k, v in nest.items()}


def _assert_same(a, b, path=""):
    if torch.is_tensor(a):
        assert torch.equal(a.view(torch.uint8) if a.dim() else a.reshape(1).view(torch.uint8),
                           b.view(torch.uint8) if b.dim() else b.reshape(1).view(torch.uint8)), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            _assert_same(a[key], b[key], f"{path}/{key}")
    else:
        assert a == b, path


def test_deferred_copies_hold_the_state_at_the_checkpoint_and_the_optimizer_waits_for_them():
    """Parameters and AdamW's moments are copied later, on another thread; the next forward
    and backward run meanwhile (changing BatchNorm's buffers, which were copied at once), and
    the optimizer's step waits until the copies are made."""
    from rayzip.checkpoint.background import Deferred

    model, optimizer, step = _adamw_model()
    at_checkpoint = {"model": _exact_copy(model.state_dict()), "optimizer": _exact_copy(optimizer.state_dict()["state"])}
    deferred = Deferred.for_optimizer(optimizer)
    handle = deferred.guard(optimizer)
    taken = snapshot({"model": model.state_dict(), "optimizer": optimizer.state_dict()["state"]}, defer=deferred)
    assert len(deferred.jobs) == 6 + 6 * 3  # 6 parameters, 3 tensors of AdamW state each; not the 3 buffers
    late = threading.Timer(0.3, deferred.finish)
    late.start()
    started = time.perf_counter()
    step()  # forward and backward run now; the step waits for the copies
    waited = time.perf_counter() - started
    late.join()
    handle.remove()
    assert waited >= 0.25 and deferred.waited_s >= 0.2, (waited, deferred.waited_s)
    _assert_same(at_checkpoint, taken)
    assert not torch.equal(model[0].weight, taken["model"]["0.weight"])  # the step did change them


def test_group_checkpoints_guarding_an_optimizer_write_the_state_of_the_checkpoint_step(tmp_path):
    model, optimizer, step = _adamw_model()
    group = GroupCheckpoints(world=1, device="cpu", background=True)
    group.guard(optimizer)
    for round_ in range(3):
        at_checkpoint = {"model": _exact_copy(model.state_dict()), "optimizer": _exact_copy(optimizer.state_dict()["state"])}
        target = tmp_path / f"c{round_}"
        group.save(target, lambda copy: Parts(0, 1, copy({"model": model.state_dict(),
                                                          "optimizer": optimizer.state_dict()["state"]}), None),
                   lambda parts, target=target: checkpoint.save(target, parts.trainer))
        assert group._deferred is not None and group._deferred.storages
        for _ in range(2):
            step()
        assert group.flush() == [target]
        back = checkpoint.load(target)
        _assert_same(at_checkpoint["model"], back["model"])
        _assert_same({str(k): v for k, v in at_checkpoint["optimizer"].items()}, {str(k): v for k, v in back["optimizer"].items()})
    group.close()


def test_a_checkpoint_that_fails_before_its_write_does_not_hold_the_optimizer_up(tmp_path):
    model, optimizer, step = _adamw_model()
    group = GroupCheckpoints(world=1, device="cpu", background=True)
    group.guard(optimizer)

    def take(copy):
        copy({"model": model.state_dict()})  # deferred copies queued, then the checkpoint fails
        raise RuntimeError("a part could not be taken")

    with pytest.raises(RuntimeError, match="could not be taken"):
        group.save(tmp_path / "c", take, lambda parts: None)
    done = threading.Event()
    stepping = threading.Thread(target=lambda: (step(), done.set()), daemon=True)
    stepping.start()
    assert done.wait(timeout=30), "the optimizer's step waited for copies that no write will make"
    group.close()
