"""The CUDA path (issue 19): every codec's GPU output against the CPU's on the same input,
and the overlapped hook on CUDA tensors over NCCL. Skipped without a GPU: these are the
checks that can fail only there (misaligned cupy views, streams, devices of futures)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

try:
    import cupy

    HAVE_CUPY = True
except Exception:  # pragma: no cover - depends on the machine
    cupy, HAVE_CUPY = None, False

from rayzip.codecs import get_codec
from rayzip.codecs.bitpack import unpack_bits

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_CUPY),
                                reason="needs a CUDA GPU and cupy (pip install 'rayzip[gpu]')")

CODECS = [("none", {}), ("fp16", {}), ("bf16", {}), ("topk", {"ratio": 0.01}), ("randomk", {"ratio": 0.01}),
          ("group_topk", {"ratio": 0.01}), ("group_topk", {"ratio": 0.01, "value_dtype": "fp32"}),
          ("qsgd", {}), ("qsgd", {"levels": 7}), ("dct_quant", {}), ("dct_quant", {"bits": 4})]


@pytest.mark.parametrize("name, params", CODECS)
def test_gpu_encode_matches_the_cpu(name, params):
    # An odd length: sparse payloads with an odd entry count, tails in every codec.
    host = np.random.default_rng(0).standard_normal(1_000_003, dtype=np.float32)
    cpu = get_codec(name, **params).encode(host)
    gpu = get_codec(name, **params).encode(torch.from_numpy(host).cuda())
    decoded_cpu = np.asarray(get_codec(name, **params).decode(cpu))
    decoded_gpu = get_codec(name, **params).decode(gpu).cpu().numpy()
    if name == "qsgd":  # the same noise; a norm's last bit may move an element by one level
        codec = get_codec(name, **params)
        a = unpack_bits(cpu.arrays["codes"], codec.bits, host.size, np).astype(np.int64)
        b = unpack_bits(cupy.asnumpy(gpu.arrays["codes"]), codec.bits, host.size, np).astype(np.int64)
        assert (a != b).mean() < 1e-3 and np.abs(a - b).max() <= 1
    elif name == "dct_quant":  # a different summation order in the transform: codes within one
        step = 2 * float(np.abs(host).max()) / 2 ** params.get("bits", 8)  # one code of the largest block
        np.testing.assert_allclose(decoded_gpu, decoded_cpu, atol=step)
    else:
        np.testing.assert_array_equal(decoded_gpu, decoded_cpu)
    # From wire bytes on the device, at an odd address: fields are realigned, not faulted on.
    wire = cupy.concatenate([cupy.zeros(1, cupy.uint8), gpu.to_array()])[1:]
    codec = get_codec(name, **params)
    back = codec.decode_flat(codec.from_bytes(wire, like=gpu, xp=cupy))
    np.testing.assert_array_equal(cupy.asnumpy(back), decoded_gpu.reshape(-1))


def _hook_rank(rank, world, overlap):
    import torch.distributed as dist

    from rayzip.torch import CompressionSpec, compress, ddp_kwargs

    torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                torch.nn.ReLU(), torch.nn.Linear(1024, 10)).cuda()
    spec = CompressionSpec(codec="group_topk", ratio=0.05, value_dtype="fp32", segment_mb=1.0, overlap=overlap,
                           momentum_correction=True)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0], **ddp_kwargs(spec))
    state = compress(ddp, spec, momentum=0.9)
    gen = torch.Generator(device="cuda").manual_seed(rank)
    grads = []
    for _ in range(3):
        ddp.zero_grad()
        x = torch.randn(64, 256, device="cuda", generator=gen)
        torch.nn.functional.cross_entropy(ddp(x), x[:, :10].argmax(1)).backward()
        grads.append(torch.cat([p.grad.flatten() for p in ddp.parameters()]).cpu().numpy())
    assert dist.get_backend() == "nccl" and len(state.segments) > 2
    return grads


def test_overlapped_hook_on_cuda_over_nccl_equals_the_serial_one(tmp_path):
    import os

    import torch.multiprocessing as mp

    results = {}
    for overlap in (True, False):
        out = tmp_path / f"{overlap}.npy"
        mp.start_processes(_nccl_entry, args=(str(tmp_path / f"init-{overlap}"), overlap, str(out)), nprocs=1,
                           join=True, start_method="spawn")
        results[overlap] = np.load(out)
    assert os.path.exists(tmp_path / "True.npy")
    np.testing.assert_array_equal(results[True], results[False])


def _nccl_entry(rank, init_file, overlap, out):
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        np.save(out, np.stack(_hook_rank(0, 1, overlap)))
    finally:
        dist.destroy_process_group()
