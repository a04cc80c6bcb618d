"""Which copy a restart resumes from (issue 48): the in-memory snapshot unless the checkpoint
in storage is newer, by the step both trainer parts hold, read from the manifest alone."""

from __future__ import annotations

import pytest
import torch
from ray.train import Checkpoint

from rayzip.checkpoint import CheckpointError
from rayzip.checkpoint.store import MANIFEST, manifest_entry, read_manifest
from rayzip.train.checkpoints import newest_of, trainer_step, write_parts


def _checkpoint(directory, step=None) -> Checkpoint:
    """A one-rank checkpoint folder whose trainer part says ``step`` (nothing where None)."""
    trainer = {"model": {"w": torch.arange(4.0)}, "extra": {"step": 7}}
    if step is not None:
        trainer["step"] = step
    write_parts(directory, 0, 1, lambda: trainer, None)
    return Checkpoint.from_directory(str(directory))


def test_the_newer_copy_is_taken_and_a_tie_keeps_memory(tmp_path):
    memory = _checkpoint(tmp_path / "memory", step=79)
    older, newer, tie = (_checkpoint(tmp_path / name, step) for name, step in
                         (("older", 59), ("newer", 99), ("tie", 79)))
    assert newest_of(memory, newer) == (newer, "storage")
    assert newest_of(memory, older) == (memory, "memory")
    assert newest_of(memory, tie) == (memory, "memory")  # the faster read
    assert newest_of(memory, None) == (memory, "memory")
    assert newest_of(None, older) == (older, "storage")
    assert newest_of(None, None) == (None, "start")


def test_parts_that_name_no_step_keep_memory(tmp_path):
    memory, stored = _checkpoint(tmp_path / "memory"), _checkpoint(tmp_path / "stored")
    assert trainer_step(memory) == trainer_step(stored) == -1
    assert newest_of(memory, stored) == (memory, "memory")


def test_the_step_comes_from_the_manifest_through_the_checkpoints_filesystem(tmp_path):
    stored = _checkpoint(tmp_path / "stored", step=99)
    (tmp_path / "stored" / "trainer" / "tensors.bin").unlink()  # no tensor is read for it
    assert trainer_step(stored) == 99
    opened = []

    def opener(path: str) -> bytes:
        opened.append(path)
        with open(path, "rb") as f:
            return f.read()

    manifest = read_manifest(tmp_path / "stored" / "trainer", opener=opener)
    assert opened == [f"{tmp_path}/stored/trainer/{MANIFEST}"]
    assert manifest_entry(manifest, "step") == 99
    assert manifest_entry(manifest, "model", "none") == "none"  # not a leaf: the default
    assert manifest_entry(manifest, "missing", -1) == -1


def test_a_stored_checkpoint_without_a_manifest_is_named(tmp_path):
    stored = _checkpoint(tmp_path / "stored", step=99)
    (tmp_path / "stored" / "trainer" / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=r"stored/trainer/manifest\.json\.zst: no manifest"):
        newest_of(_checkpoint(tmp_path / "memory", step=79), stored)
