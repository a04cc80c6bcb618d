"""Where each codec's GPU encode spends its time: CUDA kernel time (torch's profiler, which
sees cupy's kernels too) against the wall time of the call. Run by tools/gpu/check.sh."""

import time

import cupy
import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from rayzip.codecs import get_codec

x = cupy.asarray(np.random.default_rng(0).standard_normal(64 << 20, dtype=np.float32))
for spec in [("fp16", {}), ("group_topk", {"ratio": 0.01}), ("qsgd", {}), ("dct_quant", {}), ("dct_quant", {"bits": 4})]:
    codec = get_codec(spec[0], **spec[1])
    for _ in range(3):
        payload = codec.encode(x)
    cupy.cuda.Device().synchronize()
    start = time.perf_counter()
    for _ in range(10):
        payload = codec.encode(x)
    cupy.cuda.Device().synchronize()
    wall = (time.perf_counter() - start) / 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            payload = codec.encode(x)
        cupy.cuda.Device().synchronize()
    kernels = sorted(((e.key, e.device_time_total / 10) for e in prof.key_averages() if e.device_time_total > 0),
                     key=lambda kv: -kv[1])
    total = sum(t for _, t in kernels)
    print(f"{spec}: wall {wall * 1e3:.3f} ms, kernels {total / 1e3:.3f} ms")

    for name, t in kernels[:6]:
        print(f"    {t / 1e3:8.3f} ms  {name[:90]}")

from rayzip.cuda import raw_kernel
from rayzip.cuda import dct_quant, group_topk, qsgd

for label, source, name in [
        ("dct encode", dct_quant._common() + dct_quant._ENCODE % {"mode": 1, "full": 1, "code_t": "unsigned char"},
         "dct_encode"),
        ("group top-k", group_topk._SOURCE % {"per": 32, "column_t": "unsigned short", "value_t": "unsigned short"},
         "group_topk"),
        ("qsgd warp", qsgd._ENCODE % {"pairs": 8}, "qsgd_warp_u8")]:
    kernel = raw_kernel(source, name)
    print(f"{label}: {kernel.num_regs} registers, {kernel.local_size_bytes} B local, "
          f"{kernel.shared_size_bytes} B shared")
