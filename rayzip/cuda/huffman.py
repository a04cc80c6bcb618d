"""Huffman coding of a byte stream on the GPU, in the C coder's layout
(``rayzip/checkpoint/_kernels.c``): the stream cut into segments, each a bit stream of
LSB-first codes starting at a byte offset of its own, under order 0 (one code) or order 1 (a
code per preceding byte, 0 before a segment's first byte). The code table is the caller's
(:mod:`rayzip.checkpoint.device_huffman` builds it from :func:`count`, as the C coder does).

* :func:`count`: the (context << 8 | byte) histogram; lanes of a warp holding the same key
  add it once (``__match_any_sync``, compute capability 7.0 or newer), so a run of one
  exponent is not 32 atomics on one cell.
* :func:`tile_bits`: the stream in tiles of 4096 bytes, none across a segment's end; each
  block sums its tile's code lengths.
* :func:`write`: each block sums its threads' code lengths again, scans them to each
  thread's first bit (its tile's, which the caller computed from :func:`tile_bits`, plus the
  bits before it in the tile), and each thread ORs its 16 codes into the 32-bit output
  words. Codes never share a bit; a word split between threads takes an atomic OR from each.

Usage::

    counts = count(data, part, order)                       # uint32, 256 or 65536
    bits = tile_bits(data, part, order, entries)            # uint64 per tile, (segments, tiles)
    words = write(data, part, order, entries, first_bits, total_words)
"""

from __future__ import annotations

from . import raw_kernel

__all__ = ["TILE", "count", "tile_bits", "write"]

THREADS = 256
PER_THREAD = 16
TILE = THREADS * PER_THREAD

_SOURCE = r"""
#define THREADS 256
#define PER_THREAD 16
#define TILE (THREADS * PER_THREAD)

extern "C" __global__ void huffman_count(const unsigned char* __restrict__ in, long long n, long long part,
                                         int order, unsigned int* __restrict__ counts) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    // `base` is the same for a whole block, so every lane of a warp runs each iteration
    for (long long base = (long long)blockIdx.x * blockDim.x; base < n; base += stride) {
        const long long i = base + threadIdx.x;
        const bool live = i < n;
        const unsigned active = __ballot_sync(0xffffffffu, live);
        if (!live) continue;
        const unsigned prev = (order && i % part) ? in[i - 1] : 0u;
        const unsigned key = prev << 8 | in[i];
        const unsigned same = __match_any_sync(active, key);
        if ((int)(threadIdx.x & 31) == __ffs(same) - 1) atomicAdd(&counts[key], (unsigned)__popc(same));
    }
}

// This thread's bytes [*start, *stop) of its block's tile, and the start of its segment.
__device__ __forceinline__ void thread_bytes(long long n, long long part, int tiles_per_segment, long long* start,
                                             long long* stop, long long* segment_start) {
    const long long k = blockIdx.x / tiles_per_segment, t = blockIdx.x % tiles_per_segment;
    const long long s0 = min(k * part, n), s1 = min(s0 + part, n);
    const long long a = s0 + t * TILE + (long long)threadIdx.x * PER_THREAD;
    *start = min(a, s1);
    *stop = min(a + PER_THREAD, s1);
    *segment_start = s0;
}

__device__ __forceinline__ unsigned entry_of(const unsigned char* __restrict__ in, long long i, long long s0,
                                             int order, const unsigned* __restrict__ entries) {
    const unsigned prev = (order && i > s0) ? in[i - 1] : 0u;
    return entries[prev << 8 | in[i]];
}

__device__ __forceinline__ unsigned thread_sum(const unsigned char* __restrict__ in, long long a, long long b,
                                               long long s0, int order, const unsigned* __restrict__ entries) {
    unsigned bits = 0;
    for (long long i = a; i < b; ++i) bits += entry_of(in, i, s0, order, entries) >> 16;
    return bits;
}

extern "C" __global__ void huffman_tile_bits(const unsigned char* __restrict__ in, long long n, long long part,
                                             int order, int tiles_per_segment,
                                             const unsigned* __restrict__ entries,
                                             unsigned long long* __restrict__ tile_bits) {
    __shared__ unsigned warp_sums[THREADS / 32];
    long long a, b, s0;
    thread_bytes(n, part, tiles_per_segment, &a, &b, &s0);
    unsigned bits = thread_sum(in, a, b, s0, order, entries);
    for (int d = 16; d; d >>= 1) bits += __shfl_down_sync(0xffffffffu, bits, d);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = bits;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long total = 0;
        for (int w = 0; w < THREADS / 32; ++w) total += warp_sums[w];
        tile_bits[blockIdx.x] = total;
    }
}

extern "C" __global__ void huffman_write(const unsigned char* __restrict__ in, long long n, long long part,
                                         int order, int tiles_per_segment,
                                         const unsigned* __restrict__ entries,
                                         const unsigned long long* __restrict__ first_bits,
                                         unsigned* __restrict__ out) {
    __shared__ unsigned warp_sums[THREADS / 32];
    long long a, b, s0;
    thread_bytes(n, part, tiles_per_segment, &a, &b, &s0);
    const unsigned bits = thread_sum(in, a, b, s0, order, entries);
    // exclusive scan of the threads' bits: within the warp, then over the warps' totals
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned inclusive = bits;
    for (int d = 1; d < 32; d <<= 1) {
        const unsigned up = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += up;
    }
    if (lane == 31) warp_sums[warp] = inclusive;
    __syncthreads();
    unsigned before = inclusive - bits;
    for (int w = 0; w < warp; ++w) before += warp_sums[w];
    unsigned long long at = first_bits[blockIdx.x] + before;
    unsigned long long word = at >> 5, acc = 0;
    int held = (int)(at & 31);  // the word's low bits are earlier codes', ORed as zeros here
    for (long long i = a; i < b; ++i) {
        const unsigned e = entry_of(in, i, s0, order, entries);
        acc |= (unsigned long long)(e & 0xFFFFu) << held;
        held += (int)(e >> 16);
        if (held >= 32) {
            if ((unsigned)acc) atomicOr(&out[word], (unsigned)acc);
            ++word;
            acc >>= 32;
            held -= 32;
        }
    }
    if (acc) atomicOr(&out[word], (unsigned)acc);
}
"""


def count(data, part: int, order: int):
    """uint32 counts of (context << 8 | byte) over ``data`` (uint8 cupy), 256 or 65536 cells."""
    import cupy

    n = data.size
    counts = cupy.zeros(65536 if order else 256, dtype=cupy.uint32)
    blocks = max(1, min(-(-n // THREADS), 132 * 16))
    raw_kernel(_SOURCE, "huffman_count")((blocks,), (THREADS,), (data, cupy.int64(n), cupy.int64(part),
                                                                  cupy.int32(order), counts))
    return counts


def _tiles(part: int) -> int:
    return -(-part // TILE)


def tile_bits(data, part: int, segments: int, order: int, entries):
    """uint64 ``(segments, tiles per segment)``: the code bits of each tile, with ``entries``
    (uint32 per key: code | length << 16)."""
    import cupy

    per = _tiles(part)
    bits = cupy.empty(segments * per, dtype=cupy.uint64)
    raw_kernel(_SOURCE, "huffman_tile_bits")((segments * per,), (THREADS,), (
        data, cupy.int64(data.size), cupy.int64(part), cupy.int32(order), cupy.int32(per), entries, bits))
    return bits.reshape(segments, per)


def write(data, part: int, segments: int, order: int, entries, first_bits, words: int):
    """uint32 ``words`` of output, each tile's codes from its bit ``first_bits`` (uint64, as
    :func:`tile_bits` shapes them) on; bits no code wrote are zero."""
    import cupy

    out = cupy.zeros(words, dtype=cupy.uint32)
    per = _tiles(part)
    raw_kernel(_SOURCE, "huffman_write")((segments * per,), (THREADS,), (
        data, cupy.int64(data.size), cupy.int64(part), cupy.int32(order), cupy.int32(per), entries,
        cupy.ascontiguousarray(first_bits.reshape(-1)), out))
    return out
