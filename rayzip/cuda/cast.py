"""fp16 and bf16 narrowing with the finiteness check in the same pass.

The codecs' torch path casts, then reads the narrowed values again for NaN/Inf (which also
catches fp16 overflow). Here each thread casts its entry (round to nearest even, as torch
does) and flags a non-finite result as it writes it: one read of the fp32 input, one write
of the 16-bit output.

Usage::

    values, finite = narrow(flat, "fp16")     # cupy float16 (uint16 bit patterns for bf16)
"""

from __future__ import annotations

from . import raw_kernel

__all__ = ["narrow"]

_SOURCE = r"""
extern "C" __global__ void to_fp16(const float* __restrict__ x, long long n, unsigned short* __restrict__ out,
                                   int* __restrict__ nonfinite) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned short h;  // round to nearest even, overflow to Inf (no header needed for one instruction)
    asm("{ .reg .f16 t; cvt.rn.f16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(x[i]));
    out[i] = h;
    if ((h & 0x7c00u) == 0x7c00u) atomicOr(nonfinite, 1);
}

extern "C" __global__ void to_bf16(const unsigned int* __restrict__ x, long long n, unsigned short* __restrict__ out,
                                   int* __restrict__ nonfinite) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const unsigned int w = x[i];
    // torch's rounding (c10::round_to_nearest_even): NaN becomes 0x7fc0, the rest rounds half to even
    const bool nan = (w & 0x7fffffffu) > 0x7f800000u;
    const unsigned short b = nan ? (unsigned short)0x7fc0u : (unsigned short)((w + ((w >> 16) & 1u) + 0x7fffu) >> 16);
    out[i] = b;
    if ((b & 0x7f80u) == 0x7f80u) atomicOr(nonfinite, 1);
}
"""


def narrow(flat, kind: str):
    """``(values, finite)``: float32 cupy ``flat`` as float16 (``kind`` "fp16") or as
    bfloat16 bit patterns in uint16 ("bf16"), and whether every narrowed value is finite."""
    import cupy

    n = flat.size
    out = cupy.empty(n, dtype=cupy.float16 if kind == "fp16" else cupy.uint16)
    nonfinite = cupy.zeros(1, dtype=cupy.int32)
    if n:
        src = cupy.ascontiguousarray(flat, dtype=cupy.float32)
        raw_kernel(_SOURCE, f"to_{kind}")((-(-n // 256),), (256,), (
            src if kind == "fp16" else src.view(cupy.uint32), cupy.int64(n), out.view(cupy.uint16), nonfinite))
    return out, not bool(nonfinite.get()[0])
