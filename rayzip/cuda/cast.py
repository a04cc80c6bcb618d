"""fp16 and bf16 narrowing with the finiteness check in the same pass.

The codecs' torch path casts, then reads the narrowed values again for NaN/Inf (which also
catches fp16 overflow). Here each thread casts its entry (round to nearest even, as torch
does) and flags a non-finite result as it writes it: one read of the fp32 input, one write
of the 16-bit output.

Usage::

    values, finite = narrow(flat, "fp16")     # cupy float16 (uint16 bit patterns for bf16)
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from . import nonfinite_flag, raw_kernel

__all__ = ["narrow"]

_SOURCE = r"""
// Four entries a thread: one 16-byte load and one 8-byte store where the input is 16-byte
// aligned (VEC), which halves the instructions of a memory-bound pass; one at a time
// otherwise. A non-finite result sets *nonfinite (pinned host memory, see
// rayzip.cuda.nonfinite_flag).
#define VEC %(vec)d
__device__ __forceinline__ unsigned short fp16_of(unsigned int w) {
    unsigned short h;  // round to nearest even, overflow to Inf
    asm("{ .reg .f16 t; cvt.rn.f16.f32 t, %%1; mov.b16 %%0, t; }" : "=h"(h) : "f"(__uint_as_float(w)));
    return h;
}
__device__ __forceinline__ unsigned short bf16_of(unsigned int w) {
    // torch's rounding (c10::round_to_nearest_even): NaN becomes 0x7fc0, the rest rounds half to even
    const bool nan = (w & 0x7fffffffu) > 0x7f800000u;
    return nan ? (unsigned short)0x7fc0u : (unsigned short)((w + ((w >> 16) & 1u) + 0x7fffu) >> 16);
}
__device__ __forceinline__ bool bad_fp16(unsigned short h) { return (h & 0x7c00u) == 0x7c00u; }
__device__ __forceinline__ bool bad_bf16(unsigned short b) { return (b & 0x7f80u) == 0x7f80u; }

#define NARROW(NAME, OF, BAD)                                                                         \
extern "C" __global__ void NAME(const unsigned int* __restrict__ x, long long n, unsigned short* __restrict__ out, \
                                int* __restrict__ nonfinite) {                                        \
    const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 4;                       \
    if (i >= n) return;                                                                               \
    bool bad = false;                                                                                 \
    if (VEC && i + 4 <= n) {                                                                          \
        const uint4 w = *(const uint4*)(x + i);                                                       \
        const unsigned short a = OF(w.x), b = OF(w.y), c = OF(w.z), d = OF(w.w);                      \
        bad = BAD(a) | BAD(b) | BAD(c) | BAD(d);                                                      \
        *(uint2*)(out + i) = make_uint2(a | ((unsigned int)b << 16), c | ((unsigned int)d << 16));    \
    } else {                                                                                          \
        for (long long j = i; j < n && j < i + 4; ++j) {                                              \
            const unsigned short h = OF(x[j]);                                                        \
            out[j] = h;                                                                               \
            bad |= BAD(h);                                                                            \
        }                                                                                             \
    }                                                                                                 \
    if (bad) *nonfinite = 1;                                                                          \
}
NARROW(to_fp16, fp16_of, bad_fp16)
NARROW(to_bf16, bf16_of, bad_bf16)
"""


@lru_cache(maxsize=None)
def _kernel(kind: str, vec: bool):
    return raw_kernel(_SOURCE % {"vec": int(vec)}, f"to_{kind}")


def narrow(flat, kind: str):
    """``(values, finite)``: float32 cupy ``flat`` as float16 (``kind`` "fp16") or as
    bfloat16 bit patterns in uint16 ("bf16"), and whether every narrowed value is finite."""
    import cupy

    n = flat.size
    out = cupy.empty(n, dtype=cupy.float16 if kind == "fp16" else cupy.uint16)
    if not n:
        return out, True
    # The kernel reads and writes words: arrays pass as their pointers, whatever their dtype.
    src = flat if flat.flags.c_contiguous and flat.dtype == cupy.float32 else cupy.ascontiguousarray(flat, cupy.float32)
    flag = nonfinite_flag()
    _kernel(kind, src.data.ptr % 16 == 0)((-(-n // 1024),), (256,), (src, np.int64(n), out, flag.pointer))
    return out, flag.finite()
