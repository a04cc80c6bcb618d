"""The partial copy of a rank's error feedback that another node's keeper holds
(rayzip.train.residual_copy, rayzip.keeper.Keeper.hold_copy): what it keeps, what it leaves,
its bytes, and a keeper that bounds what copies take."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayzip.keeper import Keeper
from rayzip.train import residual_copy
from rayzip.train.residual_copy import COPY_GROUP, LEVELS, pack_residuals, unpack_residuals


def _memory(n: int = 5 * COPY_GROUP + 300, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"model@0:4000": rng.standard_normal(4000).astype(np.float32),
            "model@4000:%d" % n: rng.standard_normal(n - 4000).astype(np.float32),
            "velocity:model@0:4000": rng.standard_normal(4000).astype(np.float32),
            "bias": rng.standard_normal(50).astype(np.float32),  # fewer than a group keeps: all of it, no mask
            "adam_m:model@0:4000": rng.standard_normal(4000).astype(np.float32)}


@pytest.mark.parametrize("density", [0.1, 0.02, 1.0])
def test_a_copy_keeps_the_largest_entries_of_each_group_within_half_a_level(density):
    memory = _memory()
    copy = unpack_residuals(pack_residuals(memory, density))
    assert set(copy) == {k for k in memory if not k.startswith("adam_")}  # moments are statistics, not pending
    keep = int(np.ceil(density * COPY_GROUP))
    for name, held in copy.items():
        full = memory[name]
        assert held.dtype == np.float32 and held.shape == full.shape
        for lo in range(0, full.size, COPY_GROUP):
            group, kept = full[lo:lo + COPY_GROUP], held[lo:lo + COPY_GROUP]
            chosen = np.argsort(-np.abs(group), kind="stable")[:min(keep, group.size)]
            left = np.setdiff1d(np.arange(group.size), chosen)
            assert not np.any(kept[left])  # the rest is left out
            step = np.abs(group[chosen]).max() / LEVELS  # one level of the group's scale
            np.testing.assert_array_less(np.abs(kept[chosen] - group[chosen]), step / 2 + 1e-7)
            largest = chosen[0]  # 7 levels exactly: it sets the scale
            np.testing.assert_allclose(kept[largest], group[largest], rtol=1e-6)


def test_a_whole_copy_takes_about_half_a_byte_an_entry():
    n = 200 * COPY_GROUP
    memory = {"model": np.random.default_rng(1).standard_normal(n).astype(np.float32)}
    size = len(pack_residuals(memory, 1.0))
    assert size < n / 2 + 4 * 200 + 1024  # 4-bit values and a scale a group, the mask coded to nothing
    assert len(pack_residuals(memory, 0.1)) < size / 3


@pytest.mark.skipif(residual_copy.fused is None, reason="the C kernels are not built (no compiler at install)")
def test_the_c_kernel_writes_the_torch_paths_bytes(monkeypatch):
    memory = _memory()
    memory["model@0:4000"][:8] = [0.5, 1.5, 2.5, -0.5, -2.5, 6.5, -7.0, 0.0]  # halves: rounded to even either way
    memory["bias"][:] = 0  # an all-zero group
    memory["odd"] = np.random.default_rng(2).standard_normal(2 * COPY_GROUP + 7).astype(np.float32)
    fused = pack_residuals(memory, 1.0)
    monkeypatch.setattr(residual_copy, "fused", None)
    assert pack_residuals(memory, 1.0) == fused


def test_a_corrupt_copy_is_refused_naming_it():
    blob = bytearray(pack_residuals(_memory(), 0.1))
    blob[len(blob) // 2] ^= 0xFF
    with pytest.raises(ValueError, match="copy-rank1.8 on node ab"):
        unpack_residuals(bytes(blob), "copy-rank1.8 on node ab")
    with pytest.raises(ValueError, match="share of the entries"):
        pack_residuals(_memory(), 0.0)


def test_the_keeper_holds_each_ranks_two_newest_copies_within_its_bound(tmp_path, capsys):
    keeper = Keeper(str(tmp_path), "run-1", "node" * 8, max_bytes=3_000)
    for step in (3, 7, 11):
        assert keeper.hold_copy("rank1", step, bytes([step]) * 1000)
    assert keeper.copy_of("rank1", 3) is None  # only the two newest stay
    assert keeper.copy_of("rank1", 11) == bytes([11]) * 1000 and keeper.copy_of("rank1", 7) is not None
    assert keeper.inventory() == {}  # copies are not snapshot slots
    assert not keeper.hold_copy("rank0", 3, b"\0" * 1500)  # 2,000 + 1,500 > 3,000
    assert "keeps no more copies of rank0's error feedback" in capsys.readouterr().out
    keeper.close()
    assert not (tmp_path / "rayzip-snapshots").exists()


def test_copies_stop_once_one_takes_more_than_a_quarter_of_a_round_and_a_tenth_of_a_second():
    from rayzip.train.snapshots import copy_fits

    assert copy_fits(None, None) and copy_fits(2.0, None)  # nothing measured yet
    assert copy_fits(1.0, 4.0) and not copy_fits(1.01, 4.0)
    assert copy_fits(1.0, 2.0, share=0.5) and not copy_fits(1.0, 1.9, share=0.5)
    assert copy_fits(0.09, 0.1) and not copy_fits(0.11, 0.1)  # a small copy is latency: it goes on
