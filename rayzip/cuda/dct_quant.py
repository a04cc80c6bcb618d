"""8x8 DCT-II block quantization fused in one kernel per direction, bit for bit the host's.

torch does the encode as a GEMM against the 64x64 Kronecker basis, then abs, a row max, a
reciprocal, scale, round, clip and a cast: each a pass over the coefficients. Here a block
of 256 threads takes 32 DCT blocks, eight threads a block, one row each: the row pass, then
(through shared memory) the column pass that leaves each thread a row of coefficients, the
block's peak by warp shuffles, the codes, and the row's eight codes packed into its
``bits`` bytes of the wire with one store (keep = 1; a zig-zag subset is staged and packed
per CTA). Decoding reads the packed codes as they are on the wire, unpacks them in shared
memory, and runs the inverse passes.

The arithmetic is the host C kernel's (``rayzip/codecs/_kernels.c``: ``dct8_run`` and
``idct8_run``), operation for operation: the same summation order, every multiply and add
rounded on its own (``__fmul_rn``/``__fadd_rn``: nvcc would otherwise contract them into
fused multiply-adds). A GPU worker and a CPU worker therefore send and decode the same
bits, and a run repeats on either.

Usage::

    scales, codes, finite = encode(body, slot, kept, bits)   # codes packed (uint16 over 8 bits)
    blocks = decode(scales, codes, slot, kept, bits)          # float32, 64 per scale
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from . import nonfinite_flag, raw_kernel

__all__ = ["dct_matrix", "decode", "encode", "slots"]


def dct_matrix(n: int) -> np.ndarray:
    """Orthonormal DCT-II matrix C (float64): coefficients = C @ x."""
    k = np.arange(n)[:, None]
    i = np.arange(n)[None, :]
    c = np.cos(np.pi * (2 * i + 1) * k / (2 * n)) * np.sqrt(2.0 / n)
    c[0] /= np.sqrt(2.0)
    return c


@lru_cache(maxsize=1)
def _common() -> str:
    # The DCT matrix as constants: with the loops unrolled every multiply takes its
    # coefficient from the constant bank, and shared memory holds only the data.
    values = ", ".join(f"{float(v).hex()}f" for v in dct_matrix(8).astype(np.float32).ravel())
    return r"""
#define BLOCKS_PER_CTA 32
#define STRIDE 72   // floats per DCT block in shared memory: rows 16-byte aligned, lanes in distinct banks
// t = threadIdx.x: DCT block t/8 of the CTA's 32, row (lane) t%8 of its eight.
__constant__ float cs[64] = {""" + values + "};\n"


_ENCODE = r"""
// BITS and KEPT are the codec's, compiled in (constant shifts, masks and loop bounds).
// MODE 0: codes over 8 bits, written as uint16 for pack_bits. MODE 1: 8-bit codes. MODE 2:
// fewer bits. FULL: every coefficient is sent, in row-major order (keep = 1): a thread's row
// of eight codes is exactly BITS bytes of the packed stream, stored at once. Otherwise the
// CTA stages its codes in wire order and packs them (rayzip.codecs.bitpack's little-endian
// stream; a CTA's codes start on a byte, since 32 * KEPT * BITS is a multiple of 8).
// VEC: the input is 16-byte aligned (float4 loads).
#define BITS %(bits)d
#define KEPT %(kept)d
#define VEC %(vec)d
#define MODE (BITS > 8 ? 0 : BITS == 8 ? 1 : 2)
#define FULL (KEPT == 64)
extern "C" __global__ void dct_encode(const float* __restrict__ x, long long blocks, const int* __restrict__ slot,
                                      float* __restrict__ scales, void* __restrict__ codes,
                                      int* __restrict__ nonfinite) {
    const int kept = KEPT, bits = BITS;
    unsigned char* const codes8 = (unsigned char*)codes;
    unsigned short* const codes16 = (unsigned short*)codes;
    __shared__ __align__(16) float tile[BLOCKS_PER_CTA * STRIDE];
    __shared__ int slots[64];
    __shared__ float ct[64];    // C transposed, for the column pass (see there)
    __shared__ unsigned char staged[MODE == 2 && !FULL ? BLOCKS_PER_CTA * 64 : 1];
    const int t = threadIdx.x, b = t >> 3, r = t & 7;
    const long long first = (long long)blockIdx.x * BLOCKS_PER_CTA;
    const int here = (int)min((long long)BLOCKS_PER_CTA, blocks - first);
    const bool live = b < here;
    if (!FULL) for (int i = t; i < 64; i += blockDim.x) slots[i] = slot[i];
    if (t < 64) ct[t] = cs[(t & 7) * 8 + (t >> 3)];
    float* mine = tile + b * STRIDE;
    if (live) {                     // row pass: tmp[r][l] = sum_j X[r][j] C[l][j], j ascending
        const float* src = x + (first + b) * 64 + r * 8;
        float row[8];
        if (VEC) {
            const float4 lo = *(const float4*)src, hi = *(const float4*)(src + 4);
            row[0] = lo.x; row[1] = lo.y; row[2] = lo.z; row[3] = lo.w;
            row[4] = hi.x; row[5] = hi.y; row[6] = hi.z; row[7] = hi.w;
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) row[j] = src[j];
        }
        int bad = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) bad |= !isfinite(row[j]);
        if (bad) *nonfinite = 1;               // pinned host memory (rayzip.cuda.nonfinite_flag)
        float out[8];
#pragma unroll
        for (int l = 0; l < 8; ++l) {
            float s = 0.f;
#pragma unroll
            for (int j = 0; j < 8; ++j) s = __fadd_rn(s, __fmul_rn(row[j], cs[l * 8 + j]));
            out[l] = s;
        }
        *(float4*)(mine + r * 8) = make_float4(out[0], out[1], out[2], out[3]);
        *(float4*)(mine + r * 8 + 4) = make_float4(out[4], out[5], out[6], out[7]);
    }
    __syncthreads();
    // column pass, row k = r of the coefficients: y[r][l] = sum_i C[r][i] tmp[i][l], i ascending
    float y[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float peak = 0.f;
    if (live) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            // C[r][i] differs between a warp's lanes: from the constant bank the eight
            // addresses would be served one after another, from shared memory at once.
            const float c = ct[i * 8 + r];
            const float4 lo = *(const float4*)(mine + i * 8), hi = *(const float4*)(mine + i * 8 + 4);
            const float tmp[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
            for (int l = 0; l < 8; ++l) y[l] = __fadd_rn(y[l], __fmul_rn(c, tmp[l]));
        }
#pragma unroll
        for (int l = 0; l < 8; ++l)
            if (FULL || slots[r * 8 + l] >= 0) peak = fmaxf(peak, fabsf(y[l]));
    }
    for (int o = 1; o < 8; o <<= 1) peak = fmaxf(peak, __shfl_xor_sync(0xffffffffu, peak, o));
    if (live) {
        const long long block = first + b;
        if (r == 0) scales[block] = peak;
        const float inverse = peak > 0.f ? 1.f / peak : 0.f;
        const float top = (float)((1 << bits) - 1), half = top / 2.f;
        unsigned int code[8];
#pragma unroll
        for (int l = 0; l < 8; ++l) {   // rint((y / peak + 1) * (2^bits - 1) / 2), each step rounded
            // Clamped to [0, top] first, then one conversion rounding to nearest even: the
            // host's rint-then-clamp code for every input (top is whole), without a FRND.
            const float q = __fmul_rn(__fadd_rn(__fmul_rn(y[l], inverse), 1.f), half);
            code[l] = __float2uint_rn(fminf(fmaxf(q, 0.f), top));
        }
        if (FULL && MODE != 0) {        // this row's eight codes: `bits` whole bytes of the stream
            unsigned long long word = 0;
#pragma unroll
            for (int l = 0; l < 8; ++l) word |= (unsigned long long)code[l] << (l * bits);
            unsigned char* out = codes8 + (block * 8 + r) * bits;
            if (bits == 8) *(unsigned long long*)out = word;
            else if (bits == 4) *(unsigned int*)out = (unsigned int)word;
            else if (bits == 2) *(unsigned short*)out = (unsigned short)word;
            else for (int j = 0; j < bits; ++j) out[j] = (unsigned char)(word >> (8 * j));
        } else if (FULL) {
            uint4 pair;
            pair.x = code[0] | (code[1] << 16); pair.y = code[2] | (code[3] << 16);
            pair.z = code[4] | (code[5] << 16); pair.w = code[6] | (code[7] << 16);
            *(uint4*)(codes16 + block * 64 + r * 8) = pair;
        } else {
#pragma unroll
            for (int l = 0; l < 8; ++l) {
                const int s = slots[r * 8 + l];
                if (s < 0) continue;
                if (MODE == 0) codes16[block * kept + s] = (unsigned short)code[l];
                else if (MODE == 1) codes8[block * kept + s] = (unsigned char)code[l];
                else staged[b * kept + s] = (unsigned char)code[l];
            }
        }
    }
    if (MODE == 2 && !FULL) {
        __syncthreads();
        const int count = here * kept, nbytes = (count * bits + 7) / 8;
        unsigned char* out = codes8 + first * kept * bits / 8;
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
// BITS and KEPT are the codec's, compiled in. WIDE: codes over 8 bits, as uint16 (pack_bits'
// split planes unpacked first). Otherwise the packed stream itself: the CTA copies its bytes
// (a whole number, starting on a byte) into shared memory and each thread takes its codes
// from there. ALIGNED: the stream starts on 4 bytes (word loads); VEC: the output does
// (float4 stores).
#define BITS %(bits)d
#define KEPT %(kept)d
#define ALIGNED %(aligned)d
#define VEC %(vec)d
#define WIDE (BITS > 8)
#define FULL (KEPT == 64)
extern "C" __global__ void dct_decode(const float* __restrict__ scales, const void* __restrict__ codes,
                                      long long blocks, const int* __restrict__ slot, float* __restrict__ out) {
    const int kept = KEPT, bits = BITS;
    const unsigned char* const codes8 = (const unsigned char*)codes;
    const unsigned short* const codes16 = (const unsigned short*)codes;
    __shared__ __align__(16) float tile[BLOCKS_PER_CTA * STRIDE];
    __shared__ int slots[64];
    __shared__ __align__(4) unsigned char staged[WIDE ? 4 : BLOCKS_PER_CTA * 64 + 4];
    const int t = threadIdx.x, b = t >> 3, r = t & 7;
    const long long first = (long long)blockIdx.x * BLOCKS_PER_CTA;
    const int here = (int)min((long long)BLOCKS_PER_CTA, blocks - first);
    if (!FULL) for (int i = t; i < 64; i += blockDim.x) slots[i] = slot[i];
    if (!WIDE) {
        const long long start = first * kept * bits / 8;
        const int nbytes = (here * kept * bits + 7) / 8;
        if (ALIGNED) {
            const int words = nbytes / 4;
            const unsigned int* src = (const unsigned int*)(codes8 + start);
            for (int i = t; i < words; i += blockDim.x) ((unsigned int*)staged)[i] = src[i];
            for (int i = words * 4 + t; i < nbytes; i += blockDim.x) staged[i] = codes8[start + i];
        } else {
            for (int i = t; i < nbytes; i += blockDim.x) staged[i] = codes8[start + i];
        }
        if (t == 0) staged[nbytes] = 0;             // a code's second byte may lie past the end
    }
    __syncthreads();
    float* mine = tile + b * STRIDE;
    const bool live = b < here;
    if (live) {                  // column l = r: y[k][r] = (code * step - 1) * scale, 0 where not sent;
        const long long block = first + b;          // z[i][r] = sum_k C[k][i] y[k][r], k ascending
        const float scale = scales[block], step = 2.f / (float)((1 << bits) - 1);
        const unsigned int mask = (1u << bits) - 1u;
        float y[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int s = FULL ? k * 8 + r : slots[k * 8 + r];
            if (s < 0) { y[k] = 0.f; continue; }
            unsigned int c;
            if (WIDE) c = codes16[block * kept + s];
            else {
                const int bit = (b * kept + s) * bits;
                const unsigned int pair = staged[bit >> 3] | ((unsigned int)staged[(bit >> 3) + 1] << 8);
                c = (pair >> (bit & 7)) & mask;
            }
            y[k] = __fmul_rn(__fsub_rn(__fmul_rn((float)c, step), 1.f), scale);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float z = 0.f;
#pragma unroll
            for (int k = 0; k < 8; ++k) z = __fadd_rn(z, __fmul_rn(cs[k * 8 + i], y[k]));
            mine[i * 8 + r] = z;
        }
    }
    __syncthreads();
    float x[8];
    if (live) {                  // row i = r: x[r][j] = sum_l z[r][l] C[l][j], l ascending
        const float4 lo = *(const float4*)(mine + r * 8), hi = *(const float4*)(mine + r * 8 + 4);
        const float z[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            float s = 0.f;
#pragma unroll
            for (int l = 0; l < 8; ++l) s = __fadd_rn(s, __fmul_rn(z[l], cs[l * 8 + j]));
            x[j] = s;
        }
    }
    __syncthreads();
    if (live) {
        *(float4*)(mine + r * 8) = make_float4(x[0], x[1], x[2], x[3]);
        *(float4*)(mine + r * 8 + 4) = make_float4(x[4], x[5], x[6], x[7]);
    }
    __syncthreads();
    float* dst = out + first * 64;               // the CTA's blocks, written coalesced
    if (VEC) {
        for (int i = t; i < here * 16; i += blockDim.x)
            ((float4*)dst)[i] = *(const float4*)(tile + (i >> 4) * STRIDE + (i & 15) * 4);
    } else {
        for (int i = t; i < here * 64; i += blockDim.x) dst[i] = tile[(i >> 6) * STRIDE + (i & 63)];
    }
}
"""

_THREADS = 256  # 32 DCT blocks of 8 threads


def slots(order: np.ndarray) -> np.ndarray:
    """int32 (64,): each row-major position's place in the wire order, -1 where not sent."""
    out = np.full(64, -1, dtype=np.int32)
    out[np.asarray(order)] = np.arange(len(order), dtype=np.int32)
    return out


@lru_cache(maxsize=None)
def _encoder(bits: int, kept: int, vec: bool):
    return raw_kernel(_common() + _ENCODE % {"bits": bits, "kept": kept, "vec": int(vec)}, "dct_encode")


@lru_cache(maxsize=None)
def _decoder(bits: int, kept: int, aligned: bool, vec: bool):
    source = _common() + _DECODE % {"bits": bits, "kept": kept, "aligned": int(aligned), "vec": int(vec)}
    return raw_kernel(source, "dct_decode")


def encode(body, slot, kept: int, bits: int):
    """``(scales, codes, flag)`` for the whole 8x8 blocks in contiguous float32 cupy ``body``,
    launched: ``flag.finite()`` waits for them and says whether every input was finite.
    ``slot`` (int32 on the device, :func:`slots`) places the ``kept`` coefficients sent. Up to
    8 bits the codes come bit-packed (the wire's field); wider, as uint16 for ``pack_bits``."""
    import cupy

    blocks = body.size // 64
    scales = cupy.empty(blocks, dtype=cupy.float32)
    codes = (cupy.empty((blocks * kept * bits + 7) // 8, dtype=cupy.uint8) if bits <= 8
             else cupy.empty(blocks * kept, dtype=cupy.uint16))
    flag = nonfinite_flag()
    if blocks:
        _encoder(bits, kept, body.data.ptr % 16 == 0)((-(-blocks // 32),), (_THREADS,), (
            body, np.int64(blocks), slot, scales, codes, flag.pointer))
    return scales, codes, flag


def decode(scales, codes, slot, kept: int, bits: int, out=None):
    """float32 cupy (64 * len(scales),): the blocks the codes stand for, written into ``out``
    (its first 64 * len(scales) entries) when given. Up to 8 bits ``codes`` is the packed
    stream (uint8, any address); wider, uint16 codes."""
    import cupy

    blocks = scales.size
    out = cupy.empty(blocks * 64, dtype=cupy.float32) if out is None else out
    if blocks:
        codes = cupy.ascontiguousarray(codes)
        kernel = _decoder(bits, kept, bits <= 8 and codes.data.ptr % 4 == 0, out.data.ptr % 16 == 0)
        kernel((-(-blocks // 32),), (_THREADS,), (
            cupy.ascontiguousarray(scales, dtype=cupy.float32), codes, np.int64(blocks), slot, out))
    return out
