"""The snapshot slot format (rayzip.train.snapshots) and the node keeper (rayzip.keeper), as
plain functions and objects: a slot gives back its nest bit for bit, a torn or corrupt slot is
never taken, and the keeper bounds what a node holds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayzip.keeper import HEADER_BYTES, Keeper, read_header
from rayzip.train.snapshots import SnapshotError, _Slot, read_slot, write_slot


def _nest():
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(3, 5, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16),
                  "t": torch.randn(4, 6, generator=g).t()},  # not contiguous
        "optimizer": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(3, 5, generator=g)}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0, 1], "nesterov": False}]},
        "rng": torch.get_rng_state(),
        "data": {"perm": np.arange(10, dtype=np.int64)[::-1].copy(), "seed": np.int64(3), "none": None},
        "mask": torch.tensor([True, False]),
        "empty": torch.empty(0, 4),
        "bytes": b"\x00\xff", "inf": float("inf"), "dtype": torch.float16,
    }


def _same(a, b) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8) if a.numel() else a, b.reshape(-1).view(torch.uint8)
                           if b.numel() else b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def test_a_slot_gives_back_its_nest_bit_for_bit(tmp_path):
    slot = _Slot(tmp_path / "rank0.0")
    nest = _nest()
    size = write_slot(slot, nest, step=41, world=2, rank=0)
    slot.close()
    assert size <= (tmp_path / "rank0.0").stat().st_size
    header, back = read_slot(tmp_path / "rank0.0")
    assert header == {"step": 41, "world": 2, "rank": 0}
    _same(nest, back)


def test_a_slot_rewritten_in_place_holds_the_new_step_and_grows(tmp_path):
    slot = _Slot(tmp_path / "s.0")
    write_slot(slot, {"x": torch.zeros(4)}, step=1, world=1, rank=0)
    write_slot(slot, {"x": torch.ones(1000)}, step=3, world=1, rank=0)
    slot.close()
    header, back = read_slot(tmp_path / "s.0")
    assert header["step"] == 3 and torch.equal(back["x"], torch.ones(1000))


def test_a_torn_slot_is_not_committed_and_a_corrupt_one_names_its_file(tmp_path):
    slot = _Slot(tmp_path / "rank1.1")
    write_slot(slot, {"x": torch.arange(100.0)}, step=5, world=2, rank=1)
    slot.close()
    path = tmp_path / "rank1.1"
    assert read_header(path)["step"] == 5
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 8] ^= 0x01  # one bit of the data
    path.write_bytes(bytes(raw))
    with pytest.raises(SnapshotError, match=r"rank1\.1.*step 5 fails its checksum"):
        read_slot(path)
    raw[8:12] = b"\0\0\0\0"  # what a worker killed mid-copy leaves: uncommitted
    path.write_bytes(bytes(raw))
    assert read_header(path) is None
    with pytest.raises(SnapshotError, match="not a committed"):
        read_slot(path)


def test_a_slot_refuses_what_json_cannot_hold_safely(tmp_path):
    with pytest.raises(TypeError, match="not <class 'object'>"):
        write_slot(_Slot(tmp_path / "x.0"), {"x": object()}, step=0, world=1, rank=0)


def test_the_keeper_lists_committed_slots_bounds_memory_and_cleans_up(tmp_path, capsys):
    keeper = Keeper(str(tmp_path), "run-1", "node" * 8, max_bytes=10_000)
    directory = keeper.directory()
    for index, step in ((0, 6), (1, 7)):
        slot = _Slot(tmp_path / directory / f"rank0.{index}")
        write_slot(slot, {"x": torch.full((8,), float(step))}, step=step, world=2, rank=0)
        slot.close()
    (tmp_path / directory / "rank1.0").write_bytes(b"\0" * HEADER_BYTES)  # torn: never committed
    held = keeper.inventory()
    assert sorted(s["step"] for s in held["rank0"]) == [6, 7] and "rank1" not in held
    assert keeper.held_bytes() > 0
    import zstandard

    packed = keeper.read("rank0.1")
    assert read_slot("rank0.1", zstandard.ZstdDecompressor().decompress(packed))[0]["step"] == 7
    assert keeper.read("../../etc") is None
    assert keeper.reserve("rank0", 6_000) and not keeper.reserve("rank1", 6_000)
    assert "over snapshots.max_bytes_per_node 10,000: rank1 takes no more snapshots" in capsys.readouterr().out
    keeper.close()
    assert not (tmp_path / "rayzip-snapshots").exists()


def test_a_rank_part_refers_to_the_tensors_its_trainer_slot_holds(tmp_path):
    """Under local steps, inside a round, the writing rank's own part holds its parameters and
    inner optimizer, which the trainer's part holds too: they are written once."""
    from rayzip.train.snapshots import read_arrays

    g = torch.Generator().manual_seed(1)
    weights = {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}
    trainer = {"model": {k: v.detach() for k, v in weights.items()}, "step": 9}
    hook = {"own_model": {k: v.detach() for k, v in weights.items()}, "residual": torch.randn(64, generator=g),
            "empty": torch.empty(0)}
    shared: dict = {}
    full = write_slot(_Slot(tmp_path / "alone.0"), hook, step=9, world=2, rank=0)
    write_slot(_Slot(tmp_path / "trainer.3"), trainer, step=9, world=2, rank=0, keys=shared)
    size = write_slot(_Slot(tmp_path / "rank0.3"), hook, step=9, world=2, rank=0, refs=shared, base=3)
    assert full - size >= 65 * 64 * 4  # the parameters' bytes are not in the rank's slot
    assert read_header(tmp_path / "rank0.3")["base"] == 3 and read_header(tmp_path / "trainer.3")["base"] == -1
    with pytest.raises(SnapshotError, match="read without them"):
        read_slot(tmp_path / "rank0.3")
    _, _, base = read_arrays(tmp_path / "trainer.3")
    header, back = read_slot(tmp_path / "rank0.3", base=base)
    assert header["base"] == 3
    _same(hook, back)


def test_a_rank_slot_takes_its_stable_slots_entries_only_while_that_slot_holds_them(tmp_path):
    """Under local steps a round's start (anchor, error feedback) is written once a round into
    a stable slot; each step's rank slot names it, and is taken (and read) only while the
    stable slot still holds the step it was written at."""
    from rayzip.train.snapshots import newest_complete, placed, read_arrays, read_part

    keeper = Keeper(str(tmp_path), "run-2", "node" * 8, max_bytes=1 << 30)
    directory = tmp_path / keeper.directory()
    g = torch.Generator().manual_seed(2)
    start = {"round": {"anchor": [torch.randn(32, generator=g)], "rounds": 3, "compression": None}}
    step_part = {"round_step": {"inner": 2, "bad": None, "compute_s": 0.5}, "own_model": {"w": torch.randn(8)}}
    write_slot(_Slot(directory / "stable0.1"), start, step=40, world=1, rank=0)
    write_slot(_Slot(directory / "trainer.2"), {"model": {"w": torch.randn(8)}, "step": 42}, step=42, world=1,
               rank=0)
    small = write_slot(_Slot(directory / "rank0.2"), {"world_size": 1, "hook": step_part}, step=42, world=1,
                       rank=0, stable=(1, 40))
    whole = write_slot(_Slot(tmp_path / "alone.0"), {"world_size": 1, "hook": {**step_part, **start}}, step=42,
                       world=1, rank=0)
    assert whole - small >= 32 * 4  # the anchor is not in the step's slot
    assert read_header(directory / "rank0.2")["stable"] == 1 and read_header(directory / "rank0.2")["stable_step"] == 40

    def arrays_of(name):
        return read_arrays(directory / name)

    held = {"n": keeper.inventory()}
    where, worlds = placed(held)
    assert newest_complete(where, worlds, held, []) == 42 and where[42]["rank0"] == ("n", "rank0.2")
    header, nest = read_part("rank0.2", arrays_of)
    _same({"world_size": 1, "hook": {**step_part, **start}}, nest)

    # The next round's start lands in the other slot; two rounds on, this one's is overwritten.
    write_slot(_Slot(directory / "stable0.1"), start, step=48, world=1, rank=0)
    held = {"n": keeper.inventory()}
    where, worlds = placed(held)
    assert "rank0" not in where.get(42, {}) and newest_complete(where, worlds, held, []) == -1
    with pytest.raises(SnapshotError, match=r"rank0.2 refers to stable0.1 of step 40, which holds rank 0's step 48"):
        read_part("rank0.2", arrays_of)
    keeper.close()


def test_a_keeper_hands_its_settings_to_the_workers_that_find_it(tmp_path):
    keeper = Keeper(str(tmp_path), "run-3", "node" * 8, max_bytes=1 << 20, known=["a", "b"], every=4,
                    copy_density=0.1)
    assert keeper.settings() == {"root": str(tmp_path), "max_bytes": 1 << 20, "known": ["a", "b"], "every": 4,
                                 "copy_density": 0.1}
    assert Keeper(str(tmp_path), "run-4", "node" * 8, max_bytes=1).settings()["every"] == "auto"


@pytest.mark.parametrize("run, every, message", [
    ("", "auto", "needs the run's name"),
    ("run", 0, "every is a number of steps >= 1"),
    ("run", "often", "every is a number of steps >= 1"),
    ("run", True, "every is a number of steps >= 1"),
])
def test_keep_snapshots_refuses_a_run_without_a_name_and_a_bad_interval(run, every, message):
    from rayzip.train import keep_snapshots

    with pytest.raises(ValueError, match=message):
        with keep_snapshots(run, every=every):
            pass
