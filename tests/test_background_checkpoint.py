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
