"""QSGD in one kernel per direction: a block per bucket reduces the bucket's norm, draws the
counter-hash noise (the splitmix64 of :mod:`rayzip.codecs.seeding`, as the host does) and
writes each entry's code; decoding scales codes by their bucket's norm in one pass.

torch does the encode in a dozen passes (pad, square-sum, abs, scale, the hash on uint64
arrays, stack, floor, min, sign, cast), each over the whole gradient.

Usage::

    norms, codes, finite = encode(flat, bucket_size, levels, seed)   # codes uint8 or uint16
    flat = decode(norms, codes, bucket_size, levels, numel)
"""

from __future__ import annotations

from . import raw_kernel

__all__ = ["decode", "encode"]

_ENCODE = r"""
#define PAIRS %(pairs)d
__device__ __forceinline__ unsigned long long mix64(unsigned long long seed, unsigned long long counter) {
    unsigned long long z = counter * 0x9E3779B97F4A7C15ull + seed;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

template <typename Code>
__device__ void encode(const float* __restrict__ x, long long n, int bucket, int levels,
                       unsigned long long seed, float* __restrict__ norms, Code* __restrict__ codes,
                       int* __restrict__ nonfinite) {
    __shared__ float partial[32];
    __shared__ float norm_shared;
    const long long start = (long long)blockIdx.x * bucket;
    const int count = (int)min((long long)bucket, n - start);
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    float sum = 0.f;
    int bad = 0;
    for (int i = t; i < count; i += blockDim.x) {
        const float v = x[start + i];
        bad |= !isfinite(v);
        sum += v * v;
    }
    if (bad) atomicOr(nonfinite, 1);
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) partial[warp] = sum;
    __syncthreads();
    if (warp == 0) {
        const int warps = (blockDim.x + 31) >> 5;
        float s = lane < warps ? partial[lane] : 0.f;
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) {
            norm_shared = sqrtf(s);
            norms[blockIdx.x] = norm_shared;
        }
    }
    __syncthreads();
    const float norm = norm_shared;
    const float scale = norm > 0.f ? (float)levels / norm : 0.f;
    // Entries 2q and 2q+1 share one hash (the top 24 bits, then the next 24): a thread takes
    // pairs, so each hash is computed once.
    const long long end = start + count;
    for (long long q = (start >> 1) + t; 2 * q < end; q += blockDim.x) {
        const unsigned long long h = mix64(seed, (unsigned long long)q);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const long long index = 2 * q + half;
            if (index < start || index >= end) continue;
            const float v = x[index];
            const unsigned int draw = half ? (unsigned int)((h >> 16) & 0xFFFFFFull) : (unsigned int)(h >> 40);
            const float noise = (float)draw * (1.0f / 16777216.0f);
            // no fused multiply-add: the host and torch round the product, then the sum
            const float level = fminf(floorf(__fadd_rn(__fmul_rn(fabsf(v), scale), noise)), (float)levels);
            codes[index] = (Code)(int)((v < 0.f ? -level : level) + (float)levels);
        }
    }
}

// A warp per bucket, for buckets of a multiple of 64 entries (at most 2048) in 8-byte aligned
// memory: each lane holds PAIRS pairs in registers, so the bucket is read once, its norm is
// a warp sum (no block barrier), and each pair's hash and codes are written as one store.
template <typename Code, typename Pair>
__device__ void encode_warp(const float* __restrict__ x, long long n, int bucket, int levels,
                            unsigned long long seed, float* __restrict__ norms, Code* __restrict__ codes,
                            int* __restrict__ nonfinite) {
    const int lane = threadIdx.x & 31;
    const long long g = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (g * bucket >= n) return;
    const long long first_pair = g * bucket / 2;
    float2 v[PAIRS];
    float sum = 0.f;
    int bad = 0;
#pragma unroll
    for (int j = 0; j < PAIRS; ++j) {
        const long long index = 2 * (first_pair + j * 32 + lane);
        if (index + 1 < n) v[j] = reinterpret_cast<const float2*>(x)[index >> 1];
        else v[j] = make_float2(index < n ? x[index] : 0.f, 0.f);
        bad |= !isfinite(v[j].x) | !isfinite(v[j].y);
        sum += v[j].x * v[j].x + v[j].y * v[j].y;
    }
    if (__any_sync(0xffffffffu, bad) && lane == 0) atomicOr(nonfinite, 1);
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float norm = sqrtf(sum);
    if (lane == 0) norms[g] = norm;
    const float scale = norm > 0.f ? (float)levels / norm : 0.f;
#pragma unroll
    for (int j = 0; j < PAIRS; ++j) {
        const long long q = first_pair + j * 32 + lane, index = 2 * q;
        if (index >= n) continue;
        const unsigned long long h = mix64(seed, (unsigned long long)q);
        Code c[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const float value = half ? v[j].y : v[j].x;
            const unsigned int draw = half ? (unsigned int)((h >> 16) & 0xFFFFFFull) : (unsigned int)(h >> 40);
            const float noise = (float)draw * (1.0f / 16777216.0f);
            const float level = fminf(floorf(__fadd_rn(__fmul_rn(fabsf(value), scale), noise)), (float)levels);
            c[half] = (Code)(int)((value < 0.f ? -level : level) + (float)levels);
        }
        if (index + 1 < n) {
            Pair p;
            p.x = c[0];
            p.y = c[1];
            reinterpret_cast<Pair*>(codes)[q] = p;
        } else {
            codes[index] = c[0];
        }
    }
}

extern "C" __global__ void qsgd_warp_u8(const float* x, long long n, int bucket, int levels,
                                        unsigned long long seed, float* norms, unsigned char* codes, int* nonfinite) {
    encode_warp<unsigned char, uchar2>(x, n, bucket, levels, seed, norms, codes, nonfinite);
}
extern "C" __global__ void qsgd_warp_u16(const float* x, long long n, int bucket, int levels,
                                         unsigned long long seed, float* norms, unsigned short* codes, int* nonfinite) {
    encode_warp<unsigned short, ushort2>(x, n, bucket, levels, seed, norms, codes, nonfinite);
}

extern "C" __global__ void qsgd_encode_u8(const float* x, long long n, int bucket, int levels,
                                          unsigned long long seed, float* norms, unsigned char* codes, int* nonfinite) {
    encode<unsigned char>(x, n, bucket, levels, seed, norms, codes, nonfinite);
}
extern "C" __global__ void qsgd_encode_u16(const float* x, long long n, int bucket, int levels,
                                           unsigned long long seed, float* norms, unsigned short* codes, int* nonfinite) {
    encode<unsigned short>(x, n, bucket, levels, seed, norms, codes, nonfinite);
}
"""

_DECODE = r"""
template <typename Code>
__device__ void decode(const float* __restrict__ norms, const Code* __restrict__ codes, long long n,
                       int bucket, int levels, float* __restrict__ out) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float factor = norms[i / bucket] / (float)levels;
    out[i] = ((float)codes[i] - (float)levels) * factor;
}

extern "C" __global__ void qsgd_decode_u8(const float* norms, const unsigned char* codes, long long n,
                                          int bucket, int levels, float* out) {
    decode<unsigned char>(norms, codes, n, bucket, levels, out);
}
extern "C" __global__ void qsgd_decode_u16(const float* norms, const unsigned short* codes, long long n,
                                           int bucket, int levels, float* out) {
    decode<unsigned short>(norms, codes, n, bucket, levels, out);
}
"""


def encode(flat, bucket_size: int, levels: int, seed: int, bits: int):
    """``(norms, codes, finite)``: each bucket's L2 norm and each entry's code (level +
    levels) as uint8 when ``bits`` <= 8, else uint16, not yet bit-packed."""
    import cupy

    n = flat.size
    buckets = -(-n // bucket_size)
    norms = cupy.empty(buckets, dtype=cupy.float32)
    codes = cupy.empty(n, dtype=cupy.uint8 if bits <= 8 else cupy.uint16)
    nonfinite = cupy.zeros(1, dtype=cupy.int32)
    if n:
        flat = cupy.ascontiguousarray(flat, dtype=cupy.float32)
        args = (flat, cupy.int64(n), cupy.int32(bucket_size), cupy.int32(levels), cupy.uint64(seed), norms, codes,
                nonfinite)
        wide = "u8" if bits <= 8 else "u16"
        if bucket_size % 64 == 0 and bucket_size <= 2048 and flat.data.ptr % 8 == 0:
            raw_kernel(_ENCODE % {"pairs": bucket_size // 64}, f"qsgd_warp_{wide}")((-(-buckets // 4),), (128,), args)
        else:
            threads = min(512, max(32, 1 << (min(bucket_size // 2, 512) - 1).bit_length()))  # a pair each
            raw_kernel(_ENCODE % {"pairs": 1}, f"qsgd_encode_{wide}")((buckets,), (threads,), args)
    return norms, codes, not bool(nonfinite.get()[0])


def decode(norms, codes, bucket_size: int, levels: int, numel: int):
    """float32 cupy (numel,) from unpacked codes (uint8 or uint16) and bucket norms."""
    import cupy

    out = cupy.empty(numel, dtype=cupy.float32)
    if numel:
        name = "qsgd_decode_u8" if codes.dtype == cupy.uint8 else "qsgd_decode_u16"
        raw_kernel(_DECODE, name)((-(-numel // 256),), (256,), (
            cupy.ascontiguousarray(norms, dtype=cupy.float32), cupy.ascontiguousarray(codes), cupy.int64(numel),
            cupy.int32(bucket_size), cupy.int32(levels), out))
    return out
