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

from rayzip import cuda
from rayzip.codecs import get_codec
from rayzip.codecs.bitpack import unpack_bits
from rayzip.codecs.kernels import fused

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_CUPY),
                                reason="needs a CUDA GPU and cupy (pip install 'rayzip[gpu]')")

CODECS = [("none", {}), ("fp16", {}), ("bf16", {}), ("topk", {"density": 0.01}), ("randomk", {"density": 0.01}),
          ("group_topk", {"density": 0.01}), ("group_topk", {"density": 0.01, "value_dtype": "fp32"}),
          ("group_topk", {"density": 0.01, "group_size": 4096}),  # wider than the kernel's rows: torch ops
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
    elif name == "dct_quant" and fused is None:  # torch's GEMM on the host sums in another order
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

    from rayzip.torch import CompressionConfig, compress, ddp_kwargs

    torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                torch.nn.ReLU(), torch.nn.Linear(1024, 10)).cuda()
    spec = CompressionConfig(codec="group_topk", density=0.05, value_dtype="fp32", segment_mb=1.0, overlap=overlap,
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
    assert dist.get_backend() == "nccl" and len(state.segments) >= 2
    return grads


def test_overlapped_hook_on_cuda_with_one_nccl_rank_equals_the_serial_one(tmp_path):
    """One rank: NCCL refuses two ranks on one GPU, so nothing crosses a wire here. What runs is
    the overlapped hook's CUDA machinery (side stream, events, futures, the codec's kernels on
    each segment) against the serial hook. Two ranks on one GPU, over gloo, are
    tests/integration/test_gpu_ranks.py."""
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


# --- the CUDA kernels (rayzip.cuda) against the torch-op path they replace --------------------

def _gpu_pair(codec_name, params, x):
    """(payload with the kernels, payload with torch ops) of the same input on the GPU."""
    with cuda.kernels_on(True):
        fast = get_codec(codec_name, **params).encode(x)
    with cuda.kernels_on(False):
        slow = get_codec(codec_name, **params).encode(x)
    return fast, slow


@pytest.mark.parametrize("width, k", [(1024, 11), (1024, 21), (512, 1), (2048, 41), (1000, 10), (33, 2)])
def test_group_topk_kernel_picks_what_the_host_kernel_picks_ties_included(width, k):
    from rayzip.codecs.kernels import fused, top_magnitude_rows
    from rayzip.cuda.group_topk import top_magnitude_rows as on_gpu

    rng = np.random.default_rng(width + k)
    smooth = rng.standard_normal((257, width), dtype=np.float32)
    ties = rng.integers(-3, 4, size=(257, width)).astype(np.float32)  # many equal magnitudes
    for rows in (smooth, ties):
        columns, values, finite = on_gpu(cupy.asarray(rows), k)
        assert finite
        if fused is not None:
            want_columns, want_values, _ = top_magnitude_rows(rows, k)
        else:  # the rule: largest magnitudes, ties to the lowest column, columns ascending
            order = np.lexsort((np.broadcast_to(np.arange(width), rows.shape), -np.abs(rows)), axis=-1)[:, :k]
            want_columns = np.sort(order, axis=1)
            want_values = np.take_along_axis(rows, want_columns, axis=1)
        np.testing.assert_array_equal(cupy.asnumpy(columns), want_columns)
        np.testing.assert_array_equal(cupy.asnumpy(values), want_values)


def test_kernels_equal_the_torch_ops_on_the_gpu():
    x = torch.from_numpy(np.random.default_rng(1).standard_normal(3_000_017, dtype=np.float32)).cuda()
    fast, slow = _gpu_pair("group_topk", {"density": 0.01}, x)
    for field in ("indices", "values"):
        np.testing.assert_array_equal(cupy.asnumpy(fast.arrays[field]), cupy.asnumpy(slow.arrays[field]))
    fast, slow = _gpu_pair("group_topk", {"density": 0.02, "value_dtype": "int8", "packed_indices": True}, x)
    for field in ("scales", "indices", "values"):
        np.testing.assert_array_equal(cupy.asnumpy(fast.arrays[field]), cupy.asnumpy(slow.arrays[field]))
    # the warp kernel (buckets of 64k entries, aligned) and the general one (any bucket, any address)
    for params, values in (({"levels": 127}, x), ({"levels": 7}, x), ({"levels": 1000}, x),
                           ({"bucket_size": 100}, x), ({"levels": 127}, x[1:])):
        fast, slow = _gpu_pair("qsgd", params, values)
        np.testing.assert_allclose(cupy.asnumpy(fast.arrays["norms"]), cupy.asnumpy(slow.arrays["norms"]), rtol=1e-5)
        codec = get_codec("qsgd", **params)
        a = unpack_bits(fast.arrays["codes"], codec.bits, values.numel(), cupy).astype(cupy.int64)
        b = unpack_bits(slow.arrays["codes"], codec.bits, values.numel(), cupy).astype(cupy.int64)
        assert float((a != b).mean()) < 1e-3 and int(cupy.abs(a - b).max()) <= 1
        with cuda.kernels_on(True):
            decoded = codec.decode(slow)
        with cuda.kernels_on(False):
            want = codec.decode(slow)
        torch.testing.assert_close(decoded, want, rtol=0, atol=0)
    for bits, keep in ((8, 1.0), (4, 1.0), (2, 1.0), (12, 1.0), (8, 0.25), (3, 0.3), (3, 1.0)):
        params = {"bits": bits, "keep": keep}
        fast, slow = _gpu_pair("dct_quant", params, x)
        np.testing.assert_allclose(cupy.asnumpy(fast.arrays["scales"]), cupy.asnumpy(slow.arrays["scales"]),
                                   rtol=1e-5)
        codec = get_codec("dct_quant", **params)
        count = fast.arrays["scales"].size * codec.kept
        a = unpack_bits(fast.arrays["codes"], bits, count, cupy).astype(cupy.int64)
        b = unpack_bits(slow.arrays["codes"], bits, count, cupy).astype(cupy.int64)
        assert int(cupy.abs(a - b).max()) <= 1 and float((a != b).mean()) < 1e-3
        with cuda.kernels_on(True):
            decoded = codec.decode(slow)
        with cuda.kernels_on(False):
            want = codec.decode(slow)
        torch.testing.assert_close(decoded, want, rtol=1e-5, atol=1e-6 * float(x.abs().max()))


@pytest.mark.parametrize("name, params", [("group_topk", {"density": 0.01}), ("qsgd", {}), ("dct_quant", {})])
def test_a_nan_on_the_gpu_is_reported_with_its_index(name, params):
    from rayzip.codecs import NonFiniteError

    x = torch.randn(1_000_003, device="cuda")
    x[777_777] = float("nan")
    x[900_000] = float("inf")
    with pytest.raises(NonFiniteError, match="2 NaN/Inf value.*first at flat index 777777"):
        get_codec(name, **params).encode(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_checkpoint_byte_planes_kernel_equals_the_host_and_round_trips(dtype):
    from rayzip.checkpoint.transforms import byte_planes, from_byte_planes, tensor_words

    x = torch.randn(1_000_003, dtype=dtype)
    base = (x + 1e-3 * torch.randn_like(x)).to(dtype)
    words, _ = tensor_words(x)
    base_words, _ = tensor_words(base)
    want = byte_planes(words.copy(), np, base=base_words.copy(), rotate=1)
    gpu_words, xp = tensor_words(x.cuda())
    gpu_base, _ = tensor_words(base.cuda())
    assert xp is cupy
    with cuda.kernels_on(True):
        planes = byte_planes(gpu_words, cupy, base=gpu_base, rotate=1)
        back = from_byte_planes(planes, gpu_words.dtype, cupy, base=gpu_base, rotate=1)
    np.testing.assert_array_equal(cupy.asnumpy(planes), want)
    np.testing.assert_array_equal(cupy.asnumpy(back), words)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernels", "torch ops"])
@pytest.mark.parametrize("order", [0, 1])
def test_the_gpus_huffman_coder_writes_the_host_coders_bytes(order, kernel):
    """On exponent planes (trained-like weights', rotated as checkpoints rotate them) of
    several 1 MB groups and of one, on a short stream and on one value throughout."""
    from rayzip.checkpoint import device_huffman
    from rayzip.checkpoint.transforms import byte_planes, kernels, tensor_words

    streams = []
    for x in (torch.randn(3_000_017) * 0.02, torch.randn(600_001) * 1e-3, torch.randn(25)):
        words, _ = tensor_words(x)
        streams.append(byte_planes(words.copy(), np, rotate=1)[3].copy())
    streams.append(np.full(2_000_003, 126, dtype=np.uint8))
    with cuda.kernels_on(kernel):
        for plane in streams:
            want = kernels.huffman_encode(plane, order)
            assert device_huffman.encode(torch.from_numpy(plane).cuda(), order).tobytes() == want, plane.size
            assert device_huffman.encode(cupy.asarray(plane), order).tobytes() == want, plane.size


def test_a_checkpoint_of_cuda_tensors_codes_its_exponents_on_the_gpu_when_asked(tmp_path, monkeypatch):
    """With ``gpu_coding``, the exponent planes are Huffman-coded on the GPU (only the coded
    bytes cross), and the checkpoint loads bit for bit; its streams are the ones the host
    codes from a host copy."""
    from rayzip import checkpoint
    from rayzip.checkpoint import device_huffman

    coded_on = []
    encode = device_huffman.encode
    monkeypatch.setattr(device_huffman, "encode",
                        lambda data, order: coded_on.append(device_huffman.as_bytes(data).device.type)
                        or encode(data, order))
    torch.manual_seed(0)
    state = {"w": torch.randn(1024, 1024, device="cuda") * 0.02, "b": torch.randn(4096, device="cuda"),
             "h": (torch.randn(2048, 512, device="cuda") * 0.1).to(torch.bfloat16)}
    checkpoint.save(tmp_path / "default", state)
    assert not coded_on  # coded on the host unless asked
    checkpoint.save(tmp_path / "gpu", state, gpu_coding=True)
    assert coded_on and set(coded_on) == {"cuda"}
    back = checkpoint.load(tmp_path / "gpu")
    for name, tensor in state.items():
        assert torch.equal(back[name].view(torch.uint8), tensor.cpu().view(torch.uint8)), name
    on_host = {"w": state["w"].cpu(), "b": state["b"].cpu(), "h": state["h"].cpu()}
    checkpoint.save(tmp_path / "host", on_host)
    gpu, host = checkpoint.read_manifest(tmp_path / "gpu"), checkpoint.read_manifest(tmp_path / "host")
    for name in ("/w", "/h"):  # both chose byte planes: the same streams, coded alike
        assert gpu["tensors"][name]["codec"] == host["tensors"][name]["codec"] == "planes", name
        assert [(s["coding"], s["xxh3"]) for s in gpu["tensors"][name]["streams"]] == \
            [(s["coding"], s["xxh3"]) for s in host["tensors"][name]["streams"]], name


def test_cupy_allocates_from_torch_caching_allocator():
    from rayzip.xp import as_array

    as_array(torch.ones(4, device="cuda"))  # the first CUDA tensor through the seam shares the pool
    before = torch.cuda.memory_allocated()
    block = cupy.empty(64 << 20, dtype=cupy.uint8)
    assert torch.cuda.memory_allocated() - before >= 64 << 20
    del block


def _restart_rank(init_file, directory, split):
    """Five AdamW steps with group top-k over NCCL, or ``split`` steps, a compressed checkpoint,
    a fresh model, optimizer and hook loaded from it, and the rest: the final weights."""
    import torch.distributed as dist

    from restarts import reload_from_checkpoint

    from rayzip.torch import CompressionConfig, compress, ddp_kwargs

    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=0, world_size=1)
    spec = CompressionConfig(codec="group_topk", density=0.05, segment_mb=1.0)

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 10)).cuda()
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0], **ddp_kwargs(spec))
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2), compress(ddp, spec)

    def steps(ddp, opt, lo, hi):
        for step in range(lo, hi):
            gen = torch.Generator(device="cuda").manual_seed(step)
            x = torch.randn(128, 64, device="cuda", generator=gen)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), x[:, :10].argmax(1)).backward()
            opt.step()

    try:
        ddp, opt, state = build()
        steps(ddp, opt, 0, split)
        if split < 5:
            ddp, opt, state = reload_from_checkpoint(directory, ddp, opt, state, build)
            steps(ddp, opt, split, 5)
        return torch.cat([p.detach().flatten() for p in ddp.parameters()]).cpu().numpy()
    finally:
        dist.destroy_process_group()


def _restart_entry(rank, init_file, directory, split, out):
    np.save(out, _restart_rank(init_file, directory, split))


def test_restart_from_a_compressed_checkpoint_on_the_gpu_continues_exactly(tmp_path):
    import torch.multiprocessing as mp

    finals = []
    for split in (5, 2):
        out = tmp_path / f"final-{split}.npy"
        mp.start_processes(_restart_entry, args=(str(tmp_path / f"init-{split}"), str(tmp_path / f"ckpt-{split}"),
                                                 split, str(out)), nprocs=1, join=True, start_method="spawn")
        finals.append(np.load(out))
    np.testing.assert_array_equal(finals[0], finals[1])


def test_narrowing_kernels_round_as_torch_does_and_report_overflow():
    from rayzip.codecs import NonFiniteError, WireOverflowError

    ties = [65504.0, 65519.0, 2.0**-24, 3 * 2.0**-25, 1 + 2.0**-11, 1 + 3 * 2.0**-11, -0.0, 1e-30, 1 + 2.0**-8,
            1 + 3 * 2.0**-8, 3.0e38]
    x = torch.cat([torch.randn(100_003), torch.tensor(ties)]).cuda()
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        values = x if name == "bf16" else x[:-1]  # 3e38 overflows fp16
        fast, slow = _gpu_pair(name, {}, values)
        want = values.to(dtype).view(torch.int16).cpu().numpy().view(np.uint16)
        np.testing.assert_array_equal(cupy.asnumpy(fast.arrays["values"]).view(np.uint16), want)
        np.testing.assert_array_equal(cupy.asnumpy(slow.arrays["values"]).view(np.uint16), want)
    with pytest.raises(WireOverflowError):
        get_codec("fp16").encode(torch.tensor([1.0, 70000.0, 2.0], device="cuda"))
    with pytest.raises(NonFiniteError, match="first at flat index 1"):
        get_codec("bf16").encode(torch.tensor([1.0, float("nan"), 2.0], device="cuda"))


def test_chunk_sum_by_merging_equals_the_sorting_one():
    from rayzip.comm.ring import Chunk

    rng = np.random.default_rng(5)
    span = 1_000_003
    for sizes in ((20_000, 30_000), (0, 500), (500, 0), (1, 1)):
        shared = rng.choice(span, min(sizes) // 2, replace=False)
        chunks = []
        for size in sizes:
            indices = np.unique(np.concatenate([shared, rng.choice(span, size - shared.size, replace=False)]))
            values = rng.standard_normal(indices.size, dtype=np.float32)
            chunks.append(Chunk(span, cupy.asarray(indices), cupy.asarray(values)))
        results = []
        for kernel in (True, False):
            with cuda.kernels_on(kernel):
                results.append(chunks[0].add(chunks[1]))
        np.testing.assert_array_equal(cupy.asnumpy(results[0].indices), cupy.asnumpy(results[1].indices))
        np.testing.assert_array_equal(cupy.asnumpy(results[0].values), cupy.asnumpy(results[1].values))


@pytest.mark.skipif(fused is None, reason="the host's C kernels are not built (python setup.py build_ext --inplace)")
@pytest.mark.parametrize("bits, keep", [(8, 1.0), (4, 1.0), (2, 1.0), (1, 1.0), (3, 1.0), (5, 1.0), (12, 1.0),
                                        (16, 1.0), (8, 0.25), (4, 0.3), (3, 0.3), (12, 0.5)])
def test_dct_kernels_send_and_decode_the_host_kernels_bits(bits, keep):
    """The GPU's DCT encode and decode are the host C kernel's arithmetic, operation for
    operation: the same wire bytes and the same decoded floats, from aligned and misaligned
    input (float4 loads or single ones) and from wire bytes at an odd address."""
    rng = np.random.default_rng(bits * 100 + int(keep * 10))
    host = rng.standard_normal(64 * 4099 + 37, dtype=np.float32) * np.float32(3e-3)
    host[64 * 17: 64 * 18] = 0  # a block of zeros: peak 0, every code half the range
    codec = get_codec("dct_quant", bits=bits, keep=keep)
    want = codec.encode(host)
    want_bytes = want.to_bytes()
    decoded = np.asarray(codec.decode(want))
    padded = torch.from_numpy(np.concatenate([np.zeros(1, np.float32), host])).cuda()
    for x in (torch.from_numpy(host).cuda(), padded[1:]):  # 16-byte aligned, then 4 bytes off
        with cuda.kernels_on(True):
            got = codec.encode(x)
        assert got.to_bytes() == want_bytes
    wire = cupy.concatenate([cupy.zeros(1, cupy.uint8), cupy.asarray(np.frombuffer(want_bytes, np.uint8))])[1:]
    for payload in (codec.from_bytes(cupy.asarray(np.frombuffer(want_bytes, np.uint8)), like=want, xp=cupy),
                    codec.from_bytes(wire, like=want, xp=cupy)):
        with cuda.kernels_on(True):
            back = codec.decode_flat(payload)
        np.testing.assert_array_equal(cupy.asnumpy(back), decoded)


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_cupy_memory_freed_by_the_garbage_collector_goes_back_to_torch():
    """A cupy array kept alive by a traceback cycle (an encode that raised) is freed by the
    collector, its block back in torch's cache, with no "Exception ignored" warning."""
    import gc

    from rayzip.codecs import NonFiniteError
    from rayzip.xp import as_array

    as_array(torch.ones(4, device="cuda"))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()

    def fail():
        block = cupy.ones(16 << 20, dtype=cupy.uint8)  # noqa: F841 - held by the frame
        x = torch.randn(1000, device="cuda")
        x[5] = float("nan")
        get_codec("dct_quant").encode(x)

    caught = []
    try:
        fail()
    except NonFiniteError as exc:
        caught.append(exc)
    cycle = [caught.pop()]
    cycle.append(cycle)  # the exception, its traceback and the frame's locals now sit in a cycle
    del cycle
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 1 << 20


def test_nonfinite_flag_sees_every_kernel_of_its_block_and_clears():
    from rayzip.cuda.cast import narrow

    for kind in ("fp16", "bf16"):
        x = cupy.ones(4096 + 3, dtype=cupy.float32)
        assert narrow(x, kind)[1]
        x[4096 + 2] = cupy.inf  # the scalar tail
        assert not narrow(x, kind)[1]
        assert narrow(cupy.ones(8, dtype=cupy.float32), kind)[1]  # cleared for the next call
        x = cupy.ones(4096 + 1, dtype=cupy.float32)[1:]  # misaligned: one entry a thread
        x[77] = cupy.nan
        assert not narrow(x, kind)[1]
