"""Sharded checkpoints through torch.distributed.checkpoint with rayzip's codec as the storage
layer (issue 47): four gloo ranks save an FSDP2 model and its AdamW state, each rank its own
compressed pieces; two ranks load them, DCP's planner resharding."""

from __future__ import annotations

import os

import pytest
import torch

from bits import assert_same_bits
from gloo_world import run_world

SAVED_AT = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # odd sizes: FSDP2 pads dimension 0 of each parameter to a multiple of the world
    return torch.nn.Sequential(torch.nn.Linear(13, 62), torch.nn.ReLU(), torch.nn.Linear(62, 29), torch.nn.ReLU(),
                               torch.nn.Linear(29, 5))


def _sharded(world: int, blank: bool, device: str = "cpu"):
    from torch.distributed.fsdp import fully_shard

    model = _model().to(device)
    if blank:  # a restart's model: nothing of the saved run's weights
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _full(model, optimizer) -> dict:
    """The whole state, gathered: what a resume must reproduce bit for bit."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer,
                                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": model_state, "optim": optim_state}


def _train(model, optimizer, rank) -> None:
    gen = torch.Generator().manual_seed(rank)
    for _ in range(SAVED_AT):
        x, y = torch.randn(16, 13, generator=gen), torch.randint(0, 5, (16,), generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def _save_rank(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from rayzip.checkpoint.dcp import CompressedStorageWriter

    model, optimizer = _sharded(world, blank=False)
    _train(model, optimizer, rank)
    model_state, optim_state = get_state_dict(model, optimizer)  # this rank's shards, no gather
    dcp.save({"model": model_state, "optim": optim_state}, storage_writer=CompressedStorageWriter(path, threads=1))
    return _full(model, optimizer)


def _load_rank(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from rayzip.checkpoint import CheckpointError
    from rayzip.checkpoint.dcp import CompressedStorageReader

    model, optimizer = _sharded(world, blank=True)
    model_state, optim_state = get_state_dict(model, optimizer)  # also creates AdamW's state to load into
    state = {"model": model_state, "optim": optim_state}
    try:
        dcp.load(state, storage_reader=CompressedStorageReader(path, threads=1))
    except CheckpointException as exc:  # DCP gathers every rank's failure and raises it on every rank
        return {"error": f"{type(exc).__name__}: {exc}", "checkpoint_error": CheckpointError.__name__ in str(exc)}
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _full(model, optimizer)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("dcp") / "step4"
    full = run_world(_save_rank, 4, str(path), timeout_s=120)[0]
    return path, full


def test_each_rank_writes_its_own_compressed_pieces_and_metadata_maps_them(saved):
    from rayzip.checkpoint import verify
    from rayzip.checkpoint.dcp import stored_bytes

    path, _ = saved
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0", "__1", "__2", "__3"]
    for rank in range(4):
        assert verify(path / f"__{rank}")["tensors"] > 0  # every rank holds pieces of the model and of AdamW
    sizes = stored_bytes(path)
    assert 0 < sizes["stored_bytes"] < sizes["raw_bytes"]
    print(f"DCP through rayzip, 4 ranks: {sizes['raw_bytes']} raw bytes stored in {sizes['stored_bytes']}")


def test_loading_on_fewer_ranks_gives_the_saved_state_bit_for_bit(saved):
    """Four ranks' shards resharded onto two (a resume on the same world size is
    tests/system/test_sharding.py's, through Ray Train)."""
    path, full = saved
    results = run_world(_load_rank, 2, str(path), timeout_s=120)
    assert not any("error" in r for r in results), results
    assert_same_bits(results[0], full)  # the state gathered to rank 0 (cpu_offload: to rank 0 only)
    assert int(full["optim"]["state"]["0.weight"]["step"]) == SAVED_AT


def test_a_damaged_piece_fails_the_load_on_every_rank_naming_the_file_and_the_piece(saved, tmp_path):
    import shutil

    path, _ = saved
    damaged = tmp_path / "damaged"
    shutil.copytree(path, damaged)
    data = damaged / "__2" / "tensors.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    results = run_world(_load_rank, 2, str(damaged), timeout_s=120)
    for result in results:
        assert "error" in result and result["checkpoint_error"], result
        # the file, and the piece: AdamW's second moment of a layer, at its offset
        assert f"{os.sep}__2{os.sep}tensors.bin: tensor '/optim.state." in result["error"], result["error"]


def test_a_folder_without_metadata_is_refused_by_name(tmp_path):
    from rayzip.checkpoint import CheckpointError
    from rayzip.checkpoint.dcp import CompressedStorageReader

    with pytest.raises(CheckpointError, match=r"\.metadata: missing"):
        CompressedStorageReader(tmp_path).read_metadata()


def _snapshot_rank(rank, world, path):
    """A snapshot's way (rayzip.train.snapshots): this rank's local shards copied into its slot
    file, then loaded back into a blank model's DTensors with no collective."""
    from pathlib import Path

    from rayzip.train.checkpoints import load_local_shards, local_shards, take_shards
    from rayzip.train.snapshots import _Slot, read_slot, write_slot

    model, optimizer = _sharded(world, blank=False)
    _train(model, optimizer, rank)
    slot = _Slot(Path(path) / f"rank{rank}.0")
    write_slot(slot, local_shards(take_shards(model, optimizer)), step=SAVED_AT - 1, world=world, rank=rank)
    slot.close()
    blank, blank_optimizer = _sharded(world, blank=True)
    _, saved = read_slot(Path(path) / f"rank{rank}.0")
    load_local_shards(saved, blank, blank_optimizer)
    # One more step on both, from the same batch: the loaded AdamW moments and step count act alike.
    results = []
    for m, o in ((model, optimizer), (blank, blank_optimizer)):
        g = torch.Generator().manual_seed(100 + rank)
        x, y = torch.randn(16, 13, generator=g), torch.randint(0, 5, (16,), generator=g)
        o.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        o.step()
        results.append(_full(m, o))
    return results


def test_a_snapshots_local_shards_load_back_bit_for_bit_on_the_same_layout(tmp_path):
    """Three ranks (FSDP2 pads the odd dimensions unevenly): what a snapshot copies of each
    rank's shards, loaded into a blank model on the same layout, is the saved state, and the
    next step from it is the same step."""
    results = run_world(_snapshot_rank, 3, str(tmp_path), timeout_s=120)
    trained, restored = results[0]
    assert_same_bits(restored, trained)
    assert int(restored["optim"]["state"]["0.weight"]["step"]) == SAVED_AT + 1
