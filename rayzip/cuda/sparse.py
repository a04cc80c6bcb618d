"""The sum of two sparse chunks (sorted, unique int64 indices and float32 values), as the
ring's reduce-scatter adds a received chunk to its own, by merging instead of sorting.

The array-op path concatenates both, sorts them (``unique``), and sums duplicates with a
float64 ``bincount``. Both inputs are already sorted, so each entry's place in the union is
its rank in its own list plus its rank in the other (a binary search), less the duplicates
before it: one kernel ranks, two prefix sums count the duplicates, one kernel writes. A
duplicate's sum is the float32 sum of its two values, which is what the float64 path rounds
to as well.

Usage::

    indices, values = merge_sum(a_indices, a_values, b_indices, b_values)
"""

from __future__ import annotations

from . import raw_kernel

__all__ = ["merge_sum"]

_SOURCE = r"""
__device__ __forceinline__ long long lower_bound(const long long* __restrict__ sorted, long long n, long long key) {
    long long lo = 0, hi = n;
    while (lo < hi) {
        const long long mid = (lo + hi) >> 1;
        if (sorted[mid] < key) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// For each entry of `mine`: its rank in `other` and whether `other` holds the same index.
extern "C" __global__ void rank_in(const long long* __restrict__ mine, long long n_mine,
                                   const long long* __restrict__ other, long long n_other,
                                   long long* __restrict__ rank, int* __restrict__ duplicate) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_mine) return;
    const long long key = mine[i], at = lower_bound(other, n_other, key);
    rank[i] = at;
    duplicate[i] = at < n_other && other[at] == key;
}

// Writes the union: A's entries (summed with B's where both hold the index), then B's others.
extern "C" __global__ void merge_write(const long long* __restrict__ a, const float* __restrict__ a_values, long long na,
                                       const long long* __restrict__ b, const float* __restrict__ b_values, long long nb,
                                       const long long* __restrict__ a_rank, const long long* __restrict__ a_dups_before,
                                       const long long* __restrict__ b_rank, const long long* __restrict__ b_dups_before,
                                       const int* __restrict__ b_duplicate,
                                       long long* __restrict__ out, float* __restrict__ out_values) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < na) {
        const long long at = i + a_rank[i] - a_dups_before[i], r = a_rank[i];
        const bool both = r < nb && b[r] == a[i];
        out[at] = a[i];
        out_values[at] = both ? __fadd_rn(a_values[i], b_values[r]) : a_values[i];
    } else if (i < na + nb) {
        const long long j = i - na;
        if (b_duplicate[j]) return;                   // written with A's entry
        const long long at = j + b_rank[j] - b_dups_before[j];
        out[at] = b[j];
        out_values[at] = b_values[j];
    }
}
"""


def _exclusive_sum(flags):
    import cupy

    total = cupy.cumsum(flags, dtype=cupy.int64)
    return total - flags, int(total[-1]) if total.size else 0


def merge_sum(a, a_values, b, b_values):
    """``(indices, values)``: the sorted union of two sorted, unique int64 index arrays, with
    the float32 values of an index held by both summed."""
    import cupy

    a, b = cupy.ascontiguousarray(a, dtype=cupy.int64), cupy.ascontiguousarray(b, dtype=cupy.int64)
    a_values = cupy.ascontiguousarray(a_values, dtype=cupy.float32)
    b_values = cupy.ascontiguousarray(b_values, dtype=cupy.float32)
    na, nb = a.size, b.size
    a_rank, b_rank = cupy.empty(na, dtype=cupy.int64), cupy.empty(nb, dtype=cupy.int64)
    a_dup, b_dup = cupy.empty(na, dtype=cupy.int32), cupy.empty(nb, dtype=cupy.int32)
    if na:
        raw_kernel(_SOURCE, "rank_in")((-(-na // 256),), (256,), (a, cupy.int64(na), b, cupy.int64(nb), a_rank, a_dup))
    if nb:
        raw_kernel(_SOURCE, "rank_in")((-(-nb // 256),), (256,), (b, cupy.int64(nb), a, cupy.int64(na), b_rank, b_dup))
    a_before, duplicates = _exclusive_sum(a_dup)
    b_before, _ = _exclusive_sum(b_dup)
    out = cupy.empty(na + nb - duplicates, dtype=cupy.int64)
    out_values = cupy.empty(out.size, dtype=cupy.float32)
    if na + nb:
        raw_kernel(_SOURCE, "merge_write")((-(-(na + nb) // 256),), (256,), (
            a, a_values, cupy.int64(na), b, b_values, cupy.int64(nb), a_rank, a_before, b_rank, b_before, b_dup,
            out, out_values))
    return out, out_values
