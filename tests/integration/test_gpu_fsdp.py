"""FSDP2 with rayzip's exchange on CUDA (issues 47 and 50): FSDP2's all-reduce hook runs the
engine on FSDP2's own stream, with the codecs' CUDA kernels.

* World size 1 over NCCL: a shard group of one and a replicate group of one; the engine
  encodes, agrees and decodes on the GPU.
* Two ranks on one GPU over gloo (NCCL refuses two ranks on one device): shard groups of one,
  so FSDP2's own collectives are trivial and every byte between the ranks is the engine's.

Each run is repeated on the CPU from the same seeds; the weights and inputs are small
multiples of powers of two, so forward and backward are exact in float32 in any order (see
test_gpu_ranks.py), and the two devices must agree bit for bit.

Skipped without a GPU.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
import torch

from gloo_world import run_world
from test_gpu_ranks import _batch, _exact_model  # weights and inputs exact in float32 (see there)

HAVE_GPU = torch.cuda.is_available()
try:
    import cupy  # noqa: F401
except Exception:  # pragma: no cover - depends on the machine
    HAVE_GPU = False

pytestmark = pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU and cupy (pip install 'rayzip[gpu]')")

STEPS = 3


def _hsdp(rank, world, device):
    """STEPS steps on fixed weights (the error feedback still moves): each step's averaged
    gradient shards, gathered whole, and the bytes the engine sent."""
    from torch.distributed.fsdp import fully_shard

    from rayzip.engine import CompressionConfig
    from rayzip.torch.fsdp import compress_sharded, hsdp_mesh

    if device == "cuda":
        torch.cuda.set_device(0)
    model = _exact_model(device)
    shard_mesh, replicate = hsdp_mesh(1, device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    exchange = compress_sharded(model, CompressionConfig(codec="group_topk", density=0.05, segment_mb=0.05),
                                replicate)
    out = []
    for step in range(STEPS):
        model.zero_grad()
        x, target = _batch(rank, step, device)
        (model(x) * target).sum().backward()
        grads = torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()]).cpu().numpy().copy()
        out.append({"grad": grads, "bytes": exchange.last_step.bytes_sent, "skipped": exchange.last_step.skipped})
    return {"steps": out, "residuals_on": _devices([v for e in exchange.exchanges
                                                    for v in e.memory.residuals.values()])}


def _devices(arrays: list) -> list[str]:
    """Where the error-feedback residuals live: "cuda" or "cpu", whatever their kind."""
    from rayzip.xp import array_module, is_torch

    return sorted({("cuda" if a.is_cuda else "cpu") if is_torch(a) else
                   ("cuda" if array_module(a).__name__ == "cupy" else "cpu") for a in arrays})


def _nccl_world_of_one(index, device, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    try:
        result = _hsdp(0, 1, device)
    finally:
        dist.destroy_process_group()
    np.save(out, np.stack([s["grad"] for s in result["steps"]]))


def _world_of_one(device) -> np.ndarray:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "grads.npy")
        mp.start_processes(_nccl_world_of_one, args=(device, out), nprocs=1, join=True, start_method="spawn")
        return np.load(out)


def test_hsdp_at_world_size_one_over_nccl_matches_the_cpu():
    np.testing.assert_array_equal(_world_of_one("cuda"), _world_of_one("cpu"))


def test_hsdp_on_two_cuda_ranks_over_gloo_averages_as_the_cpu_does():
    cpu = run_world(_hsdp, 2, "cpu", timeout_s=120)
    gpu = run_world(_hsdp, 2, "cuda", timeout_s=120)
    for rank in range(2):
        assert gpu[rank]["residuals_on"] == ["cuda"] and cpu[rank]["residuals_on"] == ["cpu"]
        for step, (a, b) in enumerate(zip(cpu[rank]["steps"], gpu[rank]["steps"])):
            assert a["bytes"] == b["bytes"] > 0 and not b["skipped"], (rank, step)
            np.testing.assert_array_equal(b["grad"], a["grad"], err_msg=f"rank {rank}, step {step}")
    np.testing.assert_array_equal(gpu[0]["steps"][-1]["grad"], gpu[1]["steps"][-1]["grad"])


def _dcp_round_trip(index, device, path, out):
    """A world of one over NCCL: an FSDP2 model on the GPU trains with AdamW, its CUDA shards
    are saved through rayzip's DCP writer, and a blank model on the GPU loads them (``device``
    "cpu": the same over gloo, to try the test where no GPU is)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from rayzip.checkpoint.dcp import CompressedStorageReader, CompressedStorageWriter
    from test_dcp import SAVED_AT, _full, _sharded

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    try:
        model, optimizer = _sharded(1, blank=False, device=device)
        gen = torch.Generator().manual_seed(0)
        for _ in range(SAVED_AT):
            x, y = torch.randn(16, 13, generator=gen).to(device), torch.randint(0, 5, (16,), generator=gen).to(device)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        model_state, optim_state = get_state_dict(model, optimizer)
        on_gpu = {p.to_local().device.type for p in model_state.values()}
        dcp.save({"model": model_state, "optim": optim_state}, storage_writer=CompressedStorageWriter(path, threads=1))
        saved = _full(model, optimizer)
        model, optimizer = _sharded(1, blank=True, device=device)
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, storage_reader=CompressedStorageReader(path, threads=1))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        torch.save({"saved": saved, "loaded": _full(model, optimizer), "on_gpu": sorted(on_gpu)}, out)
    finally:
        dist.destroy_process_group()


def test_sharded_cuda_state_saved_through_dcp_loads_bit_for_bit_on_the_gpu_and_the_host(tmp_path):
    import torch.distributed.checkpoint as dcp
    import torch.multiprocessing as mp

    from bits import assert_same_bits
    from rayzip.checkpoint.dcp import CompressedStorageReader
    from test_dcp import _model

    path, out = tmp_path / "dcp", tmp_path / "states.pt"
    mp.start_processes(_dcp_round_trip, args=("cuda", str(path), str(out)), nprocs=1, join=True, start_method="spawn")
    states = torch.load(out, weights_only=False)
    assert states["on_gpu"] == ["cuda"]
    assert_same_bits(states["loaded"], states["saved"])
    # The same pieces, no process group, into a plain model on the host.
    plain = {"model": _model().state_dict()}
    dcp.load(plain, storage_reader=CompressedStorageReader(path, threads=1))
    assert_same_bits(plain["model"], states["saved"]["model"])
