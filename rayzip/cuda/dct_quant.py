"""8x8 DCT-II block quantization fused in one kernel per direction.

torch does the encode as a GEMM against the 64x64 Kronecker basis, then abs, a row max, a
reciprocal, scale, round, clip and a cast: each a pass over the coefficients. Here a block
of 256 threads takes 32 DCT blocks: it reads them into shared memory (coalesced), eight
threads per block do the separable transform (rows, then columns: 16 multiply-adds per
value instead of 64), reduce the block's largest kept magnitude by warp shuffles, and write
the codes in wire order. Decoding runs the same steps backwards. The arithmetic is the
torch path's, in float32, with another summation order: a code may differ by one.

Usage::

    scales, codes, finite = encode(body, slot, kept, bits)   # codes packed (uint16 over 8 bits)
    blocks = decode(scales, codes, slot, kept, bits)          # float32, 64 per scale
"""

from __future__ import annotations

import numpy as np

from functools import lru_cache

from . import raw_kernel

__all__ = ["decode", "encode", "slots"]

@lru_cache(maxsize=1)
def _common() -> str:
    # The DCT matrix as constants: with the loops unrolled every multiply-add takes its
    # coefficient from the constant bank, and shared memory holds only the data.
    from ..codecs.dct_quant import dct_matrix

    values = ", ".join(f"{float(v).hex()}f" for v in dct_matrix(8).astype(np.float32).ravel())
    return r"""
#define BLOCKS_PER_CTA 32
// t = threadIdx.x: DCT block t/8 of the CTA's 32, lane t%8 of its eight.
__constant__ float cs[64] = {""" + values + "};\n"

_ENCODE = r"""
// MODE 0: codes over 8 bits, written as uint16 for pack_bits. MODE 1: 8-bit codes, which are
// the packed stream, written in place. MODE 2: fewer bits: the CTA stages its 32 blocks' codes
// in shared memory and writes them bit-packed (rayzip.codecs.bitpack's little-endian stream);
// a CTA's codes start on a byte, since 32 * kept * bits is a multiple of 8.
// FULL: every coefficient is sent, in row-major order (keep = 1), so no slot table is read.
#define MODE %(mode)d
#define FULL %(full)d
typedef %(code_t)s code_t;
extern "C" __global__ void dct_encode(const float* __restrict__ x, long long blocks, const int* __restrict__ slot,
                                      int kept, int bits, float* __restrict__ scales, code_t* __restrict__ codes,
                                      int* __restrict__ nonfinite) {
    __shared__ float tile[BLOCKS_PER_CTA][65];      // 65: rows of a tile fall in different banks
    __shared__ int slots[64];
    __shared__ unsigned char staged[MODE == 2 ? BLOCKS_PER_CTA * 64 : 1];
    const int t = threadIdx.x, b = t >> 3, r = t & 7;
    const long long first = (long long)blockIdx.x * BLOCKS_PER_CTA;
    const int here = (int)min((long long)BLOCKS_PER_CTA, blocks - first);
    const bool live = b < here;
    if (!FULL) for (int i = t; i < 64; i += blockDim.x) slots[i] = slot[i];
    if (live) {                                       // row r of block b: y[u] = sum_c C[u][c] x[r][c]
        const float* src = x + (first + b) * 64 + r * 8;
        float row[8];
        int bad = 0;
#pragma unroll
        for (int cc = 0; cc < 8; ++cc) {
            row[cc] = src[cc];
            bad |= !isfinite(row[cc]);
        }
        if (bad) atomicOr(nonfinite, 1);
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            float s = 0.f;
#pragma unroll
            for (int cc = 0; cc < 8; ++cc) s += cs[u * 8 + cc] * row[cc];
            tile[b][r * 8 + u] = s;
        }
    }
    __syncthreads();
    // this thread now takes column u = r: coefficient (v, u) = sum_r' C[v][r'] y[r'][u]
    float z[8];
    float peak = 0.f;
    if (live) {
        float column[8];
#pragma unroll
        for (int rr = 0; rr < 8; ++rr) column[rr] = tile[b][rr * 8 + r];
#pragma unroll
        for (int v = 0; v < 8; ++v) {
            float s = 0.f;
#pragma unroll
            for (int rr = 0; rr < 8; ++rr) s += cs[v * 8 + rr] * column[rr];
            z[v] = s;
            if (FULL || slots[v * 8 + r] >= 0) peak = fmaxf(peak, fabsf(s));
        }
    }
    for (int o = 1; o < 8; o <<= 1) peak = fmaxf(peak, __shfl_xor_sync(0xffffffffu, peak, o));
    if (live) {
        const long long block = first + b;
        if (r == 0) scales[block] = peak;
        const float inverse = peak > 0.f ? 1.f / peak : 0.f;
        const float top = (float)((1 << bits) - 1), half = top / 2.f;
#pragma unroll
        for (int v = 0; v < 8; ++v) {
            const int s = FULL ? v * 8 + r : slots[v * 8 + r];
            if (s < 0) continue;
            float q = rintf((z[v] * inverse + 1.f) * half);
            q = fminf(fmaxf(q, 0.f), top);
            if (MODE == 2) staged[b * kept + s] = (unsigned char)q;
            else codes[block * kept + s] = (code_t)q;
        }
    }
    if (MODE == 2) {
        __syncthreads();
        const int count = here * kept, nbytes = (count * bits + 7) / 8;
        unsigned char* out = (unsigned char*)codes + first * kept * bits / 8;
        if (8 %% bits == 0) {                          // whole codes per byte: no division
            const int per = 8 / bits;
            for (int byte = t; byte < nbytes; byte += blockDim.x) {
                unsigned int v = 0;
                for (int j = 0, i = byte * per; j < per && i < count; ++j, ++i) v |= (unsigned int)staged[i] << (j * bits);
                out[byte] = (unsigned char)v;
            }
        } else {
            for (int byte = t; byte < nbytes; byte += blockDim.x) {
                int i = byte * 8 / bits, skip = byte * 8 - i * bits, have = 0;
                unsigned int v = 0;
                while (have < 8 && i < count) {
                    v |= ((unsigned int)staged[i] >> skip) << have;
                    have += bits - skip;
                    skip = 0;
                    ++i;
                }
                out[byte] = (unsigned char)v;
            }
        }
    }
}
"""

_DECODE = r"""
template <typename Code>
__device__ void decode(const float* __restrict__ scales, const Code* __restrict__ codes, long long blocks,
                       const int* __restrict__ slot, int kept, int bits, float* __restrict__ out) {
    __shared__ float tile[BLOCKS_PER_CTA][65];
    __shared__ int slots[64];
    const int t = threadIdx.x, b = t >> 3, r = t & 7;
    const long long first = (long long)blockIdx.x * BLOCKS_PER_CTA;
    const int here = (int)min((long long)BLOCKS_PER_CTA, blocks - first);
    for (int i = t; i < 64; i += blockDim.x) slots[i] = slot[i];
    __syncthreads();
    float w[8];
    if (b < here) {                   // row v = r of Z; w[c] = sum_u Z[v][u] C[u][c]
        const long long block = first + b;
        const float scale = scales[block], step = 2.f / (float)((1 << bits) - 1);
        float zrow[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int s = slots[r * 8 + u];
            zrow[u] = s < 0 ? 0.f : ((float)codes[block * kept + s] * step - 1.f) * scale;
        }
#pragma unroll
        for (int cc = 0; cc < 8; ++cc) {
            float s = 0.f;
#pragma unroll
            for (int u = 0; u < 8; ++u) s += zrow[u] * cs[u * 8 + cc];
            w[cc] = s;
        }
#pragma unroll
        for (int cc = 0; cc < 8; ++cc) tile[b][r * 8 + cc] = w[cc];
    }
    __syncthreads();
    float x[8];
    if (b < here) {                   // column c = r: x[rr][c] = sum_v C[v][rr] w[v][c]
        float column[8];
#pragma unroll
        for (int v = 0; v < 8; ++v) column[v] = tile[b][v * 8 + r];
#pragma unroll
        for (int rr = 0; rr < 8; ++rr) {
            float s = 0.f;
#pragma unroll
            for (int v = 0; v < 8; ++v) s += cs[v * 8 + rr] * column[v];
            x[rr] = s;
        }
    }
    __syncthreads();
    if (b < here) {
#pragma unroll
        for (int rr = 0; rr < 8; ++rr) tile[b][rr * 8 + r] = x[rr];
    }
    __syncthreads();
    for (int i = t; i < here * 64; i += blockDim.x) out[first * 64 + i] = tile[i >> 6][i & 63];
}

extern "C" __global__ void dct_decode_u8(const float* scales, const unsigned char* codes, long long blocks,
                                         const int* slot, int kept, int bits, float* out) {
    decode<unsigned char>(scales, codes, blocks, slot, kept, bits, out);
}
extern "C" __global__ void dct_decode_u16(const float* scales, const unsigned short* codes, long long blocks,
                                          const int* slot, int kept, int bits, float* out) {
    decode<unsigned short>(scales, codes, blocks, slot, kept, bits, out);
}
"""

_THREADS = 256  # 32 DCT blocks of 8 threads


def slots(order: np.ndarray) -> np.ndarray:
    """int32 (64,): each row-major position's place in the wire order, -1 where not sent."""
    out = np.full(64, -1, dtype=np.int32)
    out[np.asarray(order)] = np.arange(len(order), dtype=np.int32)
    return out


def encode(body, slot, kept: int, bits: int):
    """``(scales, codes, finite)`` for the whole 8x8 blocks in float32 cupy ``body``; ``slot``
    (int32 on the device, :func:`slots`) places the ``kept`` coefficients sent. Up to 8 bits
    the codes come bit-packed (the wire's field); wider, as uint16 for ``pack_bits``."""
    import cupy

    from ..codecs.bitpack import packed_nbytes

    blocks = body.size // 64
    scales = cupy.empty(blocks, dtype=cupy.float32)
    codes = (cupy.empty(packed_nbytes(blocks * kept, bits), dtype=cupy.uint8) if bits <= 8
             else cupy.empty(blocks * kept, dtype=cupy.uint16))
    nonfinite = cupy.zeros(1, dtype=cupy.int32)
    if blocks:
        mode = 0 if bits > 8 else 1 if bits == 8 else 2
        source = _common() + _ENCODE % {"mode": mode, "full": int(kept == 64),
                                        "code_t": "unsigned short" if mode == 0 else "unsigned char"}
        raw_kernel(source, "dct_encode")((-(-blocks // 32),), (_THREADS,), (
            cupy.ascontiguousarray(body, dtype=cupy.float32), cupy.int64(blocks), slot, cupy.int32(kept),
            cupy.int32(bits), scales, codes, nonfinite))
    return scales, codes, not bool(nonfinite.get()[0])


def decode(scales, codes, slot, kept: int, bits: int, out=None):
    """float32 cupy (64 * len(scales),): the blocks the codes stand for, written into ``out``
    (its first 64 * len(scales) entries) when given."""
    import cupy

    blocks = scales.size
    out = cupy.empty(blocks * 64, dtype=cupy.float32) if out is None else out
    if blocks:
        name = "dct_decode_u8" if codes.dtype == cupy.uint8 else "dct_decode_u16"
        raw_kernel(_common() + _DECODE, name)((-(-blocks // 32),), (_THREADS,), (
            cupy.ascontiguousarray(scales, dtype=cupy.float32), cupy.ascontiguousarray(codes), cupy.int64(blocks),
            slot, cupy.int32(kept), cupy.int32(bits), out))
    return out
