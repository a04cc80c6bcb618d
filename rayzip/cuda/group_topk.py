"""The k largest magnitudes of every row of a (groups, G) float32 matrix, one warp per row.

torch does this as ``topk`` of ``abs`` (a copy of the matrix), a sort of the chosen columns
and a gather: four launches and two extra passes. Here a warp reads its row once into
registers (G <= 2048: 64 words a lane), finds the k-th largest magnitude exactly by a binary
search over its 31 bits (each step one compare per word and one warp-wide sum, no shared
memory, no atomics), then writes the chosen columns in ascending order by ballots. Ties at
the k-th magnitude keep the lowest columns, as the C kernel on the host does, so both
devices choose the same entries. Wider groups take the torch path.

Usage::

    columns, values, finite = top_magnitude_rows(rows, k)   # cupy (groups, k) int64, float32
"""

from __future__ import annotations

from . import raw_kernel

__all__ = ["MAX_WIDTH", "top_magnitude_rows", "wire_rows"]

MAX_WIDTH = 2048  # a row lives in its warp's registers: 64 words a lane at most

_SOURCE = r"""
#define PER %(per)d   // words of a row each lane holds: ceil(width / 32)
#define FULL 0xffffffffu
#if __CUDA_ARCH__ >= 800
#define WARP_SUM(v) __reduce_add_sync(FULL, (v))
#else
__device__ __forceinline__ unsigned int warp_sum(unsigned int v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}
#define WARP_SUM(v) warp_sum(v)
#endif
typedef %(column_t)s column_t;   // int64 for the codec's own use, uint16 for the wire
typedef %(value_t)s value_t;     // float, or the fp16 bits of the wire
// flags: 1 a NaN/Inf in the rows, 2 a kept value beyond fp16's range (when the values are fp16)
__device__ __forceinline__ void put(float* out, float v, int* flags) { *out = v; }
__device__ __forceinline__ void put(unsigned short* out, float v, int* flags) {
    unsigned short h;
    asm("{ .reg .f16 t; cvt.rn.f16.f32 t, %%1; mov.b16 %%0, t; }" : "=h"(h) : "f"(v));
    *out = h;
    if (fabsf(v) > 65504.f) atomicOr(flags, 2);
}
extern "C" __global__ void group_topk(const unsigned int* __restrict__ rows, int width, int k, long long groups,
                                      column_t* __restrict__ columns, value_t* __restrict__ values,
                                      int* __restrict__ nonfinite) {
    const int lane = threadIdx.x & 31;
    const long long g = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (g >= groups) return;                       // the whole warp leaves together
    const unsigned int* src = rows + g * width;
    unsigned int key[PER];                         // |x| as bits, ordered like |x|; 0 past the row
    int bad = 0;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = j * 32 + lane;
        const unsigned int w = i < width ? src[i] : 0u;
        bad |= (w & 0x7f800000u) == 0x7f800000u;
        key[j] = w & 0x7fffffffu;
    }
    if (__any_sync(FULL, bad) && lane == 0) atomicOr(nonfinite, 1);
    // The k-th largest key, bit by bit from the top: the largest t with at least k keys >= t.
    unsigned int threshold = 0;
    for (int bit = 30; bit >= 0; --bit) {
        const unsigned int candidate = threshold | (1u << bit);
        int count = 0;
#pragma unroll
        for (int j = 0; j < PER; ++j) count += key[j] >= candidate;
        if ((int)WARP_SUM((unsigned int)count) >= k) threshold = candidate;
    }
    int above_all = 0;
#pragma unroll
    for (int j = 0; j < PER; ++j) above_all += key[j] > threshold;
    const unsigned int wanted = k - (int)WARP_SUM((unsigned int)above_all);  // equal keys taken
    // Choices in column order: an entry's slot is the count of choices before it, those
    // above the threshold and the equal ones as far as they are wanted (the lowest columns).
    const unsigned int before = (1u << lane) - 1u;
    unsigned int above = 0, equal = 0;
    column_t* out_columns = columns + g * k;
    value_t* out_values = values + g * k;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = j * 32 + lane;
        const bool valid = i < width;
        const bool gt = valid && key[j] > threshold, eq = valid && key[j] == threshold;
        const unsigned int gts = __ballot_sync(FULL, gt), eqs = __ballot_sync(FULL, eq);
        const unsigned int a = above + __popc(gts & before), e = equal + __popc(eqs & before);
        if (gt || (eq && e < wanted)) {
            const unsigned int slot = gt ? a + min(e, wanted) : a + e;
            out_columns[slot] = (column_t)i;
            put(out_values + slot, __uint_as_float(src[i]), nonfinite);
        }
        above += __popc(gts);
        equal += __popc(eqs);
    }
}
"""


def _run(rows, k: int, column_dtype, value_dtype):
    import cupy

    groups, width = rows.shape
    if width > MAX_WIDTH or not 1 <= k <= width:
        raise ValueError(f"group top-k on the GPU takes rows of at most {MAX_WIDTH} and 1 <= k <= width, "
                         f"got width {width}, k {k}")
    rows = cupy.ascontiguousarray(rows, dtype=cupy.float32)
    columns = cupy.empty((groups, k), dtype=column_dtype)
    values = cupy.empty((groups, k), dtype=value_dtype)
    flags = cupy.zeros(1, dtype=cupy.int32)
    if groups:
        source = _SOURCE % {"per": -(-width // 32),
                            "column_t": "long long" if columns.dtype == cupy.int64 else "unsigned short",
                            "value_t": "float" if values.dtype == cupy.float32 else "unsigned short"}
        raw_kernel(source, "group_topk")((-(-groups // 4),), (128,), (
            rows.view(cupy.uint32), cupy.int32(width), cupy.int32(k), cupy.int64(groups), columns,
            values.view(cupy.uint16) if values.dtype == cupy.float16 else values, flags))
    return columns, values, int(flags.get()[0])


def top_magnitude_rows(rows, k: int):
    """``(columns, values, finite)`` of the k largest |values| in each row of the 2-D float32
    cupy array ``rows``: columns (int64) ascending in each row, ties keeping the lowest, and
    whether every entry was finite (columns and values are meaningless when it is False)."""
    import cupy

    columns, values, flags = _run(rows, k, cupy.int64, cupy.float32)
    return columns, values, not flags & 1


def wire_rows(rows, k: int, value_dtype: str):
    """``(offsets, values, finite, fits)``: the same choice written as the codec's wire, flat:
    uint16 offsets and fp16 (``value_dtype`` "fp16") or fp32 values, whether every entry was
    finite, and whether every kept value fits fp16 (always True for fp32)."""
    import cupy

    columns, values, flags = _run(rows, k, cupy.uint16, cupy.float16 if value_dtype == "fp16" else cupy.float32)
    return columns.reshape(-1), values.reshape(-1), not flags & 1, not flags & 2
