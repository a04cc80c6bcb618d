"""Checkpoint byte planes on the GPU: XOR with the base, rotate and split in one pass, and
the inverse, over 2-, 4- or 8-byte words.

The array-module path does the XOR, the rotation (two shifts and an OR) and one strided copy
per plane: up to seven passes over the tensor. Each thread here reads one word (and its
base word) and writes its bytes to the planes.

Usage::

    planes = split(words, base=None, rotate=1)      # (itemsize, numel) uint8 cupy
    words = join(planes, words.dtype, base=None, rotate=1)
"""

from __future__ import annotations

from . import raw_kernel

__all__ = ["join", "split"]

_SOURCE = r"""
template <typename W>
__device__ __forceinline__ W rotl(W w, int r) {
    const int bits = 8 * sizeof(W);
    return r ? (W)((w << r) | (w >> (bits - r))) : w;
}

template <typename W>
__device__ void split(const W* __restrict__ words, const W* __restrict__ base, int has_base, long long n,
                      int rotate, unsigned char* __restrict__ planes) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    W w = words[i];
    if (has_base) w ^= base[i];
    w = rotl<W>(w, rotate);
    for (int j = 0; j < (int)sizeof(W); ++j) planes[j * n + i] = (unsigned char)(w >> (8 * j));
}

template <typename W>
__device__ void join(const unsigned char* __restrict__ planes, const W* __restrict__ base, int has_base,
                     long long n, int rotate, W* __restrict__ words) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    W w = 0;
    for (int j = 0; j < (int)sizeof(W); ++j) w |= (W)planes[j * n + i] << (8 * j);
    w = rotl<W>(w, rotate ? 8 * (int)sizeof(W) - rotate : 0);
    if (has_base) w ^= base[i];
    words[i] = w;
}

#define KERNELS(W, NAME) \
extern "C" __global__ void split_##NAME(const W* words, const W* base, int has_base, long long n, int rotate, \
                                        unsigned char* planes) \
    { split<W>(words, base, has_base, n, rotate, planes); } \
extern "C" __global__ void join_##NAME(const unsigned char* planes, const W* base, int has_base, long long n, \
                                       int rotate, W* words) \
    { join<W>(planes, base, has_base, n, rotate, words); }
KERNELS(unsigned short, u16)
KERNELS(unsigned int, u32)
KERNELS(unsigned long long, u64)
"""

_NAMES = {2: "u16", 4: "u32", 8: "u64"}


def _base(base, like):
    """(base words, whether there is a base): without one, ``like`` stands in, unread."""
    import cupy

    return (like, cupy.int32(0)) if base is None else (cupy.ascontiguousarray(base).view(like.dtype), cupy.int32(1))


def split(words, base=None, rotate: int = 0):
    """``(itemsize, numel)`` uint8: byte j of every word after XOR with ``base`` (if given)
    and a left rotation by ``rotate`` bits."""
    import cupy

    words = cupy.ascontiguousarray(words)
    n, width = words.size, words.dtype.itemsize
    planes = cupy.empty((width, n), dtype=cupy.uint8)
    if n:
        raw_kernel(_SOURCE, f"split_{_NAMES[width]}")((-(-n // 256),), (256,), (
            words, *_base(base, words), cupy.int64(n), cupy.int32(rotate), planes))
    return planes


def join(planes, dtype, base=None, rotate: int = 0):
    """Inverse of :func:`split`: words of ``dtype`` (an unsigned type of the planes' count)."""
    import cupy

    width, n = len(planes), len(planes[0])
    stacked = planes if isinstance(planes, cupy.ndarray) and planes.ndim == 2 else cupy.stack(list(planes))
    words = cupy.empty(n, dtype=dtype)
    if n:
        raw_kernel(_SOURCE, f"join_{_NAMES[width]}")((-(-n // 256),), (256,), (
            cupy.ascontiguousarray(stacked), *_base(base, words), cupy.int64(n), cupy.int32(rotate), words))
    return words
