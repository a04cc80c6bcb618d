"""Where each codec's GPU encode and decode spend their time: the CUDA kernels' time (torch's
profiler, which sees cupy's kernels too) against the wall time of the call, whose
difference is the host's (Python, launches, the wait for the flag). Then the registers,
local memory and shared memory of the DCT and cast kernels. Run by tools/gpu/check.sh."""

import statistics
import time

import cupy
import numpy as np
from torch.profiler import ProfilerActivity, profile

from rayzip.codecs import get_codec

x = cupy.asarray(np.random.default_rng(0).standard_normal(64 << 20, dtype=np.float32))
SPECS = [("fp16", {}), ("bf16", {}), ("group_topk", {"density": 0.01}), ("qsgd", {}), ("dct_quant", {}),
         ("dct_quant", {"bits": 4})]


def wall_ms(call, times=15):
    for _ in range(3):
        call()
    cupy.cuda.Device().synchronize()
    spent = []
    for _ in range(times):
        start = time.perf_counter()
        call()
        cupy.cuda.Device().synchronize()
        spent.append(time.perf_counter() - start)
    return statistics.median(spent) * 1e3


def kernel_ms(call, times=10):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(times):
            call()
        cupy.cuda.Device().synchronize()
    return sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0) / times / 1e3


print(f"{'codec':24s} {'op':7s} {'wall ms':>8s} {'kernels ms':>10s} {'host ms':>8s}")
for name, params in SPECS:
    codec = get_codec(name, **params)
    payload = codec.encode(x)
    for op, call in (("encode", lambda: codec.encode(x)), ("decode", lambda: codec.decode(payload))):
        wall, kernels = wall_ms(call), kernel_ms(call)
        label = name + "".join(f" {k}={v}" for k, v in params.items())
        print(f"{label:24s} {op:7s} {wall:8.3f} {kernels:10.3f} {wall - kernels:8.3f}")

from rayzip.cuda import cast, dct_quant, raw_kernel  # noqa: E402

for label, source, name in [
        ("dct encode, 8 bits", dct_quant._common() + dct_quant._ENCODE % {"bits": 8, "kept": 64, "vec": 1}, "dct_encode"),
        ("dct encode, 4 bits", dct_quant._common() + dct_quant._ENCODE % {"bits": 4, "kept": 64, "vec": 1}, "dct_encode"),
        ("dct decode, 4 bits", dct_quant._common() + dct_quant._DECODE % {"bits": 4, "kept": 64, "aligned": 1, "vec": 1},
         "dct_decode"),
        ("bf16 cast", cast._SOURCE % {"vec": 1}, "to_bf16")]:
    kernel = raw_kernel(source, name)
    print(f"{label}: {kernel.num_regs} registers, {kernel.local_size_bytes} B local, "
          f"{kernel.shared_size_bytes} B shared")
