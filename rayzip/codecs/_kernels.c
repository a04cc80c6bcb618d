/* Fused single-pass encoders for the gradient codecs on the CPU.
 *
 * numpy and torch need one pass over memory per operation, and each pass allocates: group
 * top-k's abs, top-k and gather, QSGD's scale, noise, floor, sign and cast, DCT's matmul
 * then five quantization passes. These kernels read each element once, keep a group or a
 * block in registers or L1, and write only the payload. rayzip.codecs falls back to the
 * torch/numpy path (also the GPU path) when this module is not built.
 *
 * Every kernel takes writable or read-only buffers of the exact sizes documented beside it;
 * the Python side checks the sizes, so the C side trusts them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define WIDE __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define WIDE
#endif

/* --- group top-k --------------------------------------------------------------------- */

typedef struct { float mag; int32_t idx; } Entry;

/* Min-heap on magnitude; among equal magnitudes the later index sits nearer the root, so
 * that it is evicted first and ties keep the lowest indices. */
static inline int below(Entry a, Entry b) { return a.mag < b.mag || (a.mag == b.mag && a.idx > b.idx); }

static void sift_down(Entry *h, int k, int i) {
    for (;;) {
        int l = 2 * i + 1, r = l + 1, m = i;
        if (l < k && below(h[l], h[m])) m = l;
        if (r < k && below(h[r], h[m])) m = r;
        if (m == i) return;
        Entry t = h[i]; h[i] = h[m]; h[m] = t;
        i = m;
    }
}

static int by_index(const void *a, const void *b) {
    int32_t x = ((const Entry *)a)->idx, y = ((const Entry *)b)->idx;
    return (x > y) - (x < y);
}

static void sort_by_index(Entry *h, int k) {
    if (k > 32) { qsort(h, (size_t)k, sizeof(Entry), by_index); return; }
    for (int i = 1; i < k; i++) {
        Entry e = h[i];
        int j = i - 1;
        while (j >= 0 && h[j].idx > e.idx) { h[j + 1] = h[j]; j--; }
        h[j + 1] = e;
    }
}

/* Round half to even without libm (rintf is a call below SSE4.1): adding and subtracting
 * 1.5 * 2^23 leaves the nearest integer, in the default rounding mode, for |v| < 2^22.
 * Strict IEEE semantics (no -ffast-math) keep the compiler from folding the pair away. */
static inline float round_even(float v) { return (v + 12582912.0f) - 12582912.0f; }

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

/* Indices i < n with |row[i]| >= bound, ascending, into hits; their count. The AVX2 version
 * tests eight entries per compare and visits only the set bits of its mask; it is picked at
 * run time, so the module still loads on CPUs without AVX2. */
static Py_ssize_t scan_at_least(const float *row, Py_ssize_t n, float bound, int32_t *hits) {
    Py_ssize_t count = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (fabsf(row[i]) >= bound) hits[count++] = (int32_t)i;
    return count;
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define HAVE_AVX2_SCAN 1
__attribute__((target("avx2"))) static Py_ssize_t scan_at_least_avx2(const float *row, Py_ssize_t n, float bound,
                                                                     int32_t *hits) {
    const __m256 b = _mm256_set1_ps(bound);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    Py_ssize_t count = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 a = _mm256_and_ps(_mm256_loadu_ps(row + i), magnitude);
        unsigned mask = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GE_OQ));
        while (mask) {
            hits[count++] = (int32_t)(i + __builtin_ctz(mask));
            mask &= mask - 1;
        }
    }
    for (; i < n; i++)
        if (fabsf(row[i]) >= bound) hits[count++] = (int32_t)i;
    return count;
}
#endif

/* The group's entries go through the heap in index order: it keeps the k largest |x| seen,
 * a later index never displacing an equal magnitude, so ties keep the lowest indices. */
static inline void offer(Entry *heap, int k, int *filled, float *floor_mag, float a, int32_t idx) {
    if (*filled < k) {
        heap[(*filled)++] = (Entry){a, idx};
        if (*filled == k) {
            for (int i = k / 2 - 1; i >= 0; i--) sift_down(heap, k, i);
            *floor_mag = heap[0].mag;
        }
    } else if (a > *floor_mag) {
        heap[0] = (Entry){a, idx};
        sift_down(heap, k, 0);
        *floor_mag = heap[0].mag;
    }
}

/* group_topk(src f32[groups*group], group, k, offsets i64[groups*k] out, values f32[groups*k] out)
 * -> all finite: each group's k largest |x| (ties: lowest index), offsets ascending within a
 * group. Returns False when an entry is NaN or Inf (the outputs are then meaningless; the
 * caller finds and reports the entry).
 *
 * With k <= 16, a first pass over the group (in L1) takes the largest |x| of each of 16
 * lanes: the k-th largest of those 16 entries bounds the group's k-th largest from below, so
 * the second pass offers the heap only entries at or above it, about k of them, and
 * otherwise runs at vector speed. Larger k go through the heap one entry at a time. */
WIDE static int group_topk_run(const float *x, Py_ssize_t groups, Py_ssize_t group, Py_ssize_t k, int64_t *off,
                               float *val, Entry *heap, int32_t *hits) {
#ifdef HAVE_AVX2_SCAN
    const int avx2 = __builtin_cpu_supports("avx2");
    Py_ssize_t (*scan)(const float *, Py_ssize_t, float, int32_t *) = scan_at_least_avx2;
#else
    const int avx2 = 0;
    Py_ssize_t (*scan)(const float *, Py_ssize_t, float, int32_t *) = scan_at_least;
#endif
    v16f fin = {0};
    float scalar_fin = 0.0f;
    const Py_ssize_t chunks = group / 16;
    const int bounded = k <= 16 && chunks >= 2;
    for (Py_ssize_t g = 0; g < groups; g++) {
        const float *row = x + g * group;
        int filled = 0;
        float floor_mag = 0.0f, bound = 0.0f;
        if (bounded) {
            v16f most = {0};
            for (Py_ssize_t c = 0; c < chunks; c++) {
                v16f v;
                memcpy(&v, row + c * 16, sizeof v);
                fin += v - v;
                v16f a = (v16f)((v16i)v & 0x7fffffff);
                v16i gt = a > most;
                most = (v16f)(((v16i)a & gt) | ((v16i)most & ~gt));
            }
            float lanes[16];
            memcpy(lanes, &most, sizeof lanes);
            for (int r = 0; r < k; r++) {  /* partial selection sort: lanes[k-1] is the k-th largest */
                int best = r;
                for (int l = r + 1; l < 16; l++) best = lanes[l] > lanes[best] ? l : best;
                float t = lanes[r]; lanes[r] = lanes[best]; lanes[best] = t;
            }
            bound = lanes[k - 1];
            Py_ssize_t found = avx2 ? scan(row, chunks * 16, bound, hits) : scan_at_least(row, chunks * 16, bound, hits);
            for (Py_ssize_t h = 0; h < found; h++) offer(heap, (int)k, &filled, &floor_mag, fabsf(row[hits[h]]), hits[h]);
        } else {
            for (Py_ssize_t i = 0; i < chunks * 16; i++) {
                float a = fabsf(row[i]);
                scalar_fin += row[i] - row[i];
                offer(heap, (int)k, &filled, &floor_mag, a, (int32_t)i);
            }
        }
        for (Py_ssize_t i = chunks * 16; i < group; i++) {
            scalar_fin += row[i] - row[i];
            float a = fabsf(row[i]);
            if (a >= bound) offer(heap, (int)k, &filled, &floor_mag, a, (int32_t)i);
        }
        while (filled < k) {  /* only when NaNs hid entries from both passes: reported, not used */
            heap[filled] = (Entry){0.0f, (int32_t)filled};
            filled++;
        }
        sort_by_index(heap, (int)k);
        for (int e = 0; e < k; e++) {
            off[g * k + e] = heap[e].idx;
            val[g * k + e] = row[heap[e].idx];
        }
    }
    int ok = 1;
    for (int l = 0; l < 16; l++) ok &= fin[l] == 0.0f;
    return ok && scalar_fin == 0.0f;
}

static PyObject *py_group_topk(PyObject *self, PyObject *args) {
    Py_buffer src, offsets, values;
    Py_ssize_t group, k;
    if (!PyArg_ParseTuple(args, "y*nnw*w*", &src, &group, &k, &offsets, &values)) return NULL;
    Py_ssize_t groups = group > 0 ? src.len / (Py_ssize_t)sizeof(float) / group : 0;
    Entry *heap = malloc(sizeof(Entry) * (size_t)(k > 0 ? k : 1));
    int32_t *hits = malloc(sizeof(int32_t) * (size_t)(group > 0 ? group : 1));
    if (!heap || !hits) {
        free(heap); free(hits);
        PyBuffer_Release(&src); PyBuffer_Release(&offsets); PyBuffer_Release(&values);
        return PyErr_NoMemory();
    }
    int finite;
    Py_BEGIN_ALLOW_THREADS
    finite = group_topk_run(src.buf, groups, group, k, offsets.buf, values.buf, heap, hits);
    Py_END_ALLOW_THREADS
    free(heap); free(hits);
    PyBuffer_Release(&src); PyBuffer_Release(&offsets); PyBuffer_Release(&values);
    return PyBool_FromLong(finite);
}

/* --- a dense step's bucket: scaled, and checked as it is read -------------------------- */

/* scale_finite(buf f32[n] in place, factor) -> the first index whose value is NaN or +-Inf
 * after scaling, or -1. A dense step scales each rank's bucket by 1 / world before its
 * all-reduce anyway; the check rides on that pass instead of a second one over the sum.
 * Each chunk ORs whether an element's exponent is all ones (NaN or +-Inf) into one flag, a
 * loop the compiler vectorizes; only a chunk whose flag is set is searched again. */
WIDE static Py_ssize_t scale_finite_run(float *x, Py_ssize_t n, float factor) {
    enum { CHUNK = 4096 };
    Py_ssize_t first = -1;
    for (Py_ssize_t lo = 0; lo < n; lo += CHUNK) {
        Py_ssize_t hi = lo + CHUNK < n ? lo + CHUNK : n;
        uint32_t bad = 0;
        for (Py_ssize_t i = lo; i < hi; i++) {
            float v = x[i] * factor;
            uint32_t b;
            memcpy(&b, &v, sizeof b);
            bad |= (b & 0x7f800000u) == 0x7f800000u;  /* an all-ones exponent: NaN or +-Inf */
            x[i] = v;
        }
        if (bad && first < 0)
            for (Py_ssize_t j = lo; j < hi; j++)
                if (!isfinite(x[j])) { first = j; break; }
    }
    return first;
}

static PyObject *py_scale_finite(PyObject *self, PyObject *args) {
    Py_buffer buf;
    float factor;
    if (!PyArg_ParseTuple(args, "w*f", &buf, &factor)) return NULL;
    Py_ssize_t first;
    Py_BEGIN_ALLOW_THREADS
    first = scale_finite_run(buf.buf, buf.len / (Py_ssize_t)sizeof(float), factor);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    return PyLong_FromSsize_t(first);
}

/* --- a dense step's optimizer state in the hook ----------------------------------------- */

/* momentum_dense(grad f32[n] in/out, held f32[n] or None, out f32[n], momentum): SGD's
 * momentum buffer on the averaged gradient, u = momentum * held + grad (held None: u = grad),
 * into both out (the new velocity) and grad (what the optimizer applies), in one pass where
 * torch ops take three. Multiply, then add, each rounded, as SGD's buf.mul_(m).add_(g): the
 * -std=c99 build keeps the compiler from contracting them into a fused multiply-add. */
WIDE static void momentum_run(float *g, const float *held, float *out, Py_ssize_t n, float m) {
    if (held == NULL) {
        memcpy(out, g, (size_t)n * sizeof(float));
        return;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        float t = held[i] * m;
        float v = t + g[i];
        out[i] = v;
        g[i] = v;
    }
}

static PyObject *py_momentum_dense(PyObject *self, PyObject *args) {
    Py_buffer g, held, out;
    float m;
    if (!PyArg_ParseTuple(args, "w*z*w*f", &g, &held, &out, &m)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    momentum_run(g.buf, held.buf, out.buf, g.len / (Py_ssize_t)sizeof(float), m);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&g);
    PyBuffer_Release(&held);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

/* adam_dense(grad f32[n] in/out, m_held or None, v_held or None, m_out, v_out, a1, b1, a2, b2,
 * c1, c2, eps): AdamCorrection's update on the averaged gradient g, in one pass where torch
 * ops take nine: m = a1 g + b1 m_held, v = a2 g^2 + b2 v_held (a = 1 - beta), and grad
 * becomes the Adam direction m / (sqrt(c2 v) + eps) * c1 (c: the bias corrections). */
WIDE static void adam_run(float *g, const float *mh, const float *vh, float *mo, float *vo, Py_ssize_t n,
                          float a1, float b1, float a2, float b2, float c1, float c2, float eps) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float x = g[i];
        float m = x * a1;
        if (mh != NULL) m = m + mh[i] * b1;
        float v = (x * x) * a2;
        if (vh != NULL) v = v + vh[i] * b2;
        mo[i] = m;
        vo[i] = v;
        g[i] = m / (sqrtf(v * c2) + eps) * c1;
    }
}

static PyObject *py_adam_dense(PyObject *self, PyObject *args) {
    Py_buffer g, mh, vh, mo, vo;
    float a1, b1, a2, b2, c1, c2, eps;
    if (!PyArg_ParseTuple(args, "w*z*z*w*w*fffffff", &g, &mh, &vh, &mo, &vo, &a1, &b1, &a2, &b2, &c1, &c2, &eps))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    adam_run(g.buf, mh.buf, vh.buf, mo.buf, vo.buf, g.len / (Py_ssize_t)sizeof(float), a1, b1, a2, b2, c1, c2, eps);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&g);
    PyBuffer_Release(&mh);
    PyBuffer_Release(&vh);
    PyBuffer_Release(&mo);
    PyBuffer_Release(&vo);
    Py_RETURN_NONE;
}

/* --- QSGD ----------------------------------------------------------------------------- */

static inline uint64_t mix64(uint64_t seed, uint64_t counter) {  /* rayzip.codecs.seeding.mix64 */
    uint64_t z = counter * 0x9E3779B97F4A7C15ULL + seed;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* qsgd(src f32[n], bucket, levels, seed, norms f32[ceil(n/bucket)] out, codes u8|u16[n] out, wide):
 * per bucket its L2 norm; per element levels + sign(x) * min(floor(|x| levels / norm + u), levels)
 * with u uniform in [0, 1): element i takes 24 bits of h = mix64(seed, i / 2), the top ones
 * (h >> 40) when i is even, the next (h >> 16) when odd. */
WIDE static void qsgd_run(const float *x, Py_ssize_t n, Py_ssize_t bucket, int levels, uint64_t seed,
                          float *norms, uint8_t *codes8, uint16_t *codes16) {
    enum { CHUNK = 512 };  /* elements whose noise is drawn at once, in a loop the compiler vectorizes */
    uint64_t hashes[CHUNK / 2];
    float noise[CHUNK];
    Py_ssize_t buckets = (n + bucket - 1) / bucket;
    for (Py_ssize_t b = 0; b < buckets; b++) {
        Py_ssize_t lo = b * bucket, hi = lo + bucket < n ? lo + bucket : n;
        float lanes[16] = {0}, sum = 0.0f;  /* sixteen partial sums, so that the loop vectorizes */
        Py_ssize_t i = lo;
        for (; i + 16 <= hi; i += 16)
            for (int l = 0; l < 16; l++) lanes[l] += x[i + l] * x[i + l];
        for (; i < hi; i++) sum += x[i] * x[i];
        for (int l = 0; l < 16; l++) sum += lanes[l];
        float norm = sqrtf(sum);
        norms[b] = norm;
        float scale = norm > 0.0f ? (float)levels / norm : 0.0f;
        for (Py_ssize_t start = lo; start < hi; start += CHUNK - (start & 1)) {
            /* A chunk starts at an even index, but the bucket's first; pairs are (2p, 2p + 1). */
            Py_ssize_t base = start & ~(Py_ssize_t)1, end = base + CHUNK < hi ? base + CHUNK : hi;
            int pairs = (int)((end - base + 1) / 2);
            for (int p = 0; p < pairs; p++) hashes[p] = mix64(seed, (uint64_t)(base / 2 + p));
            for (int p = 0; p < pairs; p++) {
                noise[2 * p] = (float)(hashes[p] >> 40) * (1.0f / 16777216.0f);
                noise[2 * p + 1] = (float)((hashes[p] >> 16) & 0xFFFFFF) * (1.0f / 16777216.0f);
            }
            for (Py_ssize_t i = start; i < end; i++) {
                int level = (int)(fabsf(x[i]) * scale + noise[i - base]);  /* truncation is floor: terms >= 0 */
                level = level > levels ? levels : level;
                int code = x[i] < 0.0f ? levels - level : levels + level;
                if (codes8) codes8[i] = (uint8_t)code; else codes16[i] = (uint16_t)code;
            }
        }
    }
}

static PyObject *py_qsgd(PyObject *self, PyObject *args) {
    Py_buffer src, norms, codes;
    Py_ssize_t bucket;
    int levels, wide;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "y*niKw*w*p", &src, &bucket, &levels, &seed, &norms, &codes, &wide)) return NULL;
    Py_ssize_t n = src.len / (Py_ssize_t)sizeof(float);
    Py_BEGIN_ALLOW_THREADS
    qsgd_run(src.buf, n, bucket, levels, (uint64_t)seed, norms.buf, wide ? NULL : codes.buf,
             wide ? codes.buf : NULL);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src); PyBuffer_Release(&norms); PyBuffer_Release(&codes);
    Py_RETURN_NONE;
}

/* --- DCT block quantization ------------------------------------------------------------ */

static inline void quantize(const float *y, const int64_t *order, int m, int bits, float half_top, float top,
                            float *scale, uint8_t *codes8, uint16_t *codes16) {
    float peak = 0.0f;
    for (int q = 0; q < m; q++) { float a = fabsf(y[order[q]]); peak = a > peak ? a : peak; }
    *scale = peak;
    float inverse = peak > 0.0f ? 1.0f / peak : 0.0f;
    for (int q = 0; q < m; q++) {
        float code = round_even((y[order[q]] * inverse + 1.0f) * half_top);
        code = code < 0.0f ? 0.0f : code > top ? top : code;
        if (codes8) codes8[q] = (uint8_t)code; else codes16[q] = (uint16_t)code;
    }
    (void)bits;
}

/* dct_quant(src f32[blocks*n*n], n, c f32[n*n] (DCT-II, row k = frequency k), order i64[m]
 *           (row-major positions in the wire's order), bits, scales f32[blocks] out,
 *           codes u8|u16[blocks*m] out, wide) -> all finite:
 * per block Y = C X C^T, its coefficients at the first m positions of ``order``, the block's
 * peak |Y| among them as scale, and codes rint((y / peak + 1) * (2^bits - 1) / 2) clipped to
 * [0, 2^bits - 1]. Returns False when an input is NaN or Inf (outputs then meaningless). */
WIDE static int dct_run(const float *x, Py_ssize_t blocks, int n, const float *c, const int64_t *order, int m,
                        int bits, float *scales, uint8_t *codes8, uint16_t *codes16) {
    float ct[32 * 32], tmp[32 * 32], y[32 * 32];
    float fin = 0.0f;
    for (int j = 0; j < n; j++)
        for (int l = 0; l < n; l++) ct[j * n + l] = c[l * n + j];
    const float half_top = (float)((1 << bits) - 1) / 2.0f, top = (float)((1 << bits) - 1);
    for (Py_ssize_t b = 0; b < blocks; b++) {
        const float *blk = x + b * n * n;
        /* Rows: tmp[i][l] = sum_j X[i][j] C[l][j]; columns: y[k][l] = sum_i C[k][i] tmp[i][l]. */
        for (int i = 0; i < n; i++) {
            float *t = tmp + i * n;
            for (int l = 0; l < n; l++) t[l] = 0.0f;
            for (int j = 0; j < n; j++) {
                float v = blk[i * n + j];
                fin += v - v;
                const float *cr = ct + j * n;
                for (int l = 0; l < n; l++) t[l] += v * cr[l];
            }
        }
        for (int k = 0; k < n; k++) {
            float *out = y + k * n;
            for (int l = 0; l < n; l++) out[l] = 0.0f;
            for (int i = 0; i < n; i++) {
                float w = c[k * n + i];
                const float *t = tmp + i * n;
                for (int l = 0; l < n; l++) out[l] += w * t[l];
            }
        }
        quantize(y, order, m, bits, half_top, top, scales + b, codes8 ? codes8 + b * m : NULL,
                 codes16 ? codes16 + b * m : NULL);
    }
    return fin == 0.0f;
}

/* The same for 8 x 8 blocks, one row of eight floats per vector (GCC's vector extensions:
 * one AVX register in the x86-64-v3 clone, two SSE ones otherwise): 16 vector multiply-adds
 * per row and column pass. With every coefficient kept in row-major order (keep = 1, see
 * rayzip.codecs.dct_quant) the peak, the quantization and the stores are vector operations
 * too; a zig-zag subset is permuted as its codes are stored. */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

/* Macros, not functions: a vector passed by value would cross an ABI that differs by clone. */
#define V8_ABS(v) ((v8)((v8i)(v) & 0x7fffffff))
#define V8_MAX(a, b) ((v8)(((v8i)(a) & ((a) > (b))) | ((v8i)(b) & ~((a) > (b)))))

WIDE static int dct8_run(const float *x, Py_ssize_t blocks, const float *c, const int64_t *order, int m, int bits,
                         float *scales, uint8_t *codes8, uint16_t *codes16) {
    v8 ct[8];  /* ct[j][l] = C[l][j] */
    float cs[64];
    for (int j = 0; j < 8; j++)
        for (int l = 0; l < 8; l++) ct[j][l] = c[l * 8 + j];
    memcpy(cs, c, sizeof cs);
    int pos[64];  /* rank in the wire's order of each row-major position, -1 when not kept */
    for (int q = 0; q < 64; q++) pos[q] = -1;
    int natural = m == 64;
    for (int q = 0; q < m; q++) { pos[order[q]] = q; natural &= order[q] == q; }
    const float half_top = (float)((1 << bits) - 1) / 2.0f, top = (float)((1 << bits) - 1);
    const v8 zero = {0}, one = zero + 1.0f, big = zero + 12582912.0f;
    const v8i top_i = (v8i){0} + ((1 << bits) - 1);
    v8 fin = zero;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        const float *blk = x + b * 64;
        v8 tmp[8], y[8];
        for (int i = 0; i < 8; i++) {
            v8 row;
            memcpy(&row, blk + i * 8, sizeof row);
            fin += row - row;
            v8 t = zero;
            for (int j = 0; j < 8; j++) t += row[j] * ct[j];
            tmp[i] = t;
        }
        for (int k = 0; k < 8; k++) {
            v8 o = zero;
            for (int i = 0; i < 8; i++) o += cs[k * 8 + i] * tmp[i];
            y[k] = o;
        }
        float peak = 0.0f;
        if (natural) {
            v8 most = V8_ABS(y[0]);
            for (int k = 1; k < 8; k++) { v8 a = V8_ABS(y[k]); most = V8_MAX(most, a); }
            for (int l = 0; l < 8; l++) peak = most[l] > peak ? most[l] : peak;
        } else {
            for (int q = 0; q < m; q++) { float a = fabsf(y[order[q] / 8][order[q] % 8]); peak = a > peak ? a : peak; }
        }
        scales[b] = peak;
        float inverse = peak > 0.0f ? 1.0f / peak : 0.0f;
        for (int k = 0; k < 8; k++) {
            v8 code = (y[k] * inverse + one) * half_top;
            code = (code + big) - big;  /* round half to even, as round_even */
            v8i ci = __builtin_convertvector(code, v8i);
            ci &= ~(ci < 0);  /* clip to [0, top] (a NaN converts to INT_MIN: 0) */
            v8i over = ci > top_i;
            ci = (ci & ~over) | (top_i & over);
            if (natural) {
                if (codes8) for (int l = 0; l < 8; l++) codes8[b * 64 + k * 8 + l] = (uint8_t)ci[l];
                else for (int l = 0; l < 8; l++) codes16[b * 64 + k * 8 + l] = (uint16_t)ci[l];
                continue;
            }
            for (int l = 0; l < 8; l++) {
                int q = pos[k * 8 + l];
                if (q < 0) continue;
                if (codes8) codes8[b * m + q] = (uint8_t)ci[l]; else codes16[b * m + q] = (uint16_t)ci[l];
            }
        }
    }
    (void)top;
    int ok = 1;
    for (int l = 0; l < 8; l++) ok &= fin[l] == 0.0f;
    return ok;
}

static PyObject *py_dct_quant(PyObject *self, PyObject *args) {
    Py_buffer src, c, order, scales, codes;
    int n, bits, wide;
    if (!PyArg_ParseTuple(args, "y*iy*y*iw*w*p", &src, &n, &c, &order, &bits, &scales, &codes, &wide)) return NULL;
    if (n < 2 || n > 32) {
        PyBuffer_Release(&src); PyBuffer_Release(&c); PyBuffer_Release(&order);
        PyBuffer_Release(&scales); PyBuffer_Release(&codes);
        PyErr_SetString(PyExc_ValueError, "dct_quant kernel: block side must be in 2..32");
        return NULL;
    }
    Py_ssize_t blocks = src.len / (Py_ssize_t)sizeof(float) / ((Py_ssize_t)n * n);
    int m = (int)(order.len / (Py_ssize_t)sizeof(int64_t));
    int finite;
    Py_BEGIN_ALLOW_THREADS
    if (n == 8)
        finite = dct8_run(src.buf, blocks, c.buf, order.buf, m, bits, scales.buf, wide ? NULL : codes.buf,
                          wide ? codes.buf : NULL);
    else
        finite = dct_run(src.buf, blocks, n, c.buf, order.buf, m, bits, scales.buf, wide ? NULL : codes.buf,
                         wide ? codes.buf : NULL);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src); PyBuffer_Release(&c); PyBuffer_Release(&order);
    PyBuffer_Release(&scales); PyBuffer_Release(&codes);
    return PyBool_FromLong(finite);
}

/* dct_dequant(scales f32[blocks], codes u8|u16[blocks*m], c f32[64] (8 x 8 DCT-II), order i64[m],
 *             bits, out f32[blocks*64] out, wide):
 * the inverse of dct8_run: y = (code * 2 / (2^bits - 1) - 1) * scale at each kept position
 * (0 elsewhere), then X = C^T Y C, in the same vector layout. -std=c99 keeps the compiler
 * from fusing multiply-adds, so every clone (and every worker) decodes the same bits. */
WIDE static void idct8_run(const float *scales, const uint8_t *codes8, const uint16_t *codes16, Py_ssize_t blocks,
                           const float *c, const int64_t *order, int m, int bits, float *out) {
    v8 cr[8];  /* cr[l][j] = C[l][j] */
    float cs[64];
    memcpy(cs, c, sizeof cs);
    for (int l = 0; l < 8; l++)
        for (int j = 0; j < 8; j++) cr[l][j] = c[l * 8 + j];
    int natural = m == 64;
    for (int q = 0; q < m; q++) natural &= order[q] == q;
    const float step = 2.0f / (float)((1 << bits) - 1);
    const v8 zero = {0}, one = zero + 1.0f;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        const float scale = scales[b];
        v8 y[8], z[8];
        if (natural) {
            for (int k = 0; k < 8; k++) {
                v8i ci;
                for (int l = 0; l < 8; l++) ci[l] = codes8 ? codes8[b * 64 + k * 8 + l] : codes16[b * 64 + k * 8 + l];
                y[k] = (__builtin_convertvector(ci, v8) * step - one) * scale;
            }
        } else {
            for (int k = 0; k < 8; k++) y[k] = zero;
            for (int q = 0; q < m; q++) {
                float code = codes8 ? codes8[b * m + q] : codes16[b * m + q];
                y[order[q] / 8][order[q] % 8] = (code * step - 1.0f) * scale;
            }
        }
        for (int i = 0; i < 8; i++) {  /* Z = C^T Y: z[i] = sum_k C[k][i] y[k] */
            v8 t = zero;
            for (int k = 0; k < 8; k++) t += cs[k * 8 + i] * y[k];
            z[i] = t;
        }
        for (int i = 0; i < 8; i++) {  /* X = Z C: x[i] = sum_l z[i][l] C[l] */
            v8 x = zero;
            for (int l = 0; l < 8; l++) x += z[i][l] * cr[l];
            memcpy(out + b * 64 + i * 8, &x, sizeof x);
        }
    }
}

static PyObject *py_dct_dequant(PyObject *self, PyObject *args) {
    Py_buffer scales, codes, c, order, out;
    int bits, wide;
    if (!PyArg_ParseTuple(args, "y*y*y*y*iw*p", &scales, &codes, &c, &order, &bits, &out, &wide)) return NULL;
    Py_ssize_t blocks = scales.len / (Py_ssize_t)sizeof(float);
    int m = (int)(order.len / (Py_ssize_t)sizeof(int64_t));
    Py_BEGIN_ALLOW_THREADS
    idct8_run(scales.buf, wide ? NULL : codes.buf, wide ? codes.buf : NULL, blocks, c.buf, order.buf, m, bits, out.buf);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&scales); PyBuffer_Release(&codes); PyBuffer_Release(&c); PyBuffer_Release(&order);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

/* --- a residual's copy: 4-bit levels of a scale per group -------------------------------- */

/* nibbles(src f32[n], group, levels, scales f32[ceil(n / group)], out u8[ceil(n / 2)]): each
 * group's scale, its largest |x| over levels, and each x as round(x / scale) + levels + 1 in
 * 4 bits, two to a byte (the even index low), an odd n's last high nibble levels + 1 (zero).
 * The same arithmetic as rayzip.train.residual_copy's torch path, bit for bit: a division,
 * rounded half to even, where the torch path reads the array five times and allocates thrice.
 * An all-zero group's scale is 0 and its values stay 0. group is even (the caller checks). */
#define NIBBLE_CHUNK 4096 /* codes made before they are paired: vectorized loops both */

WIDE static void nibbles_run(const float *src, Py_ssize_t n, Py_ssize_t group, float levels, float *scales,
                             uint8_t *out) {
    uint8_t codes[NIBBLE_CHUNK];
    float zero = levels + 1.0f;
    for (Py_ssize_t g = 0, lo = 0; lo < n; g++, lo += group) {
        Py_ssize_t hi = lo + group < n ? lo + group : n;
        float top = 0.0f;
        for (Py_ssize_t i = lo; i < hi; i++) {
            float a = fabsf(src[i]);
            top = a > top ? a : top;
        }
        float scale = top / levels;
        scales[g] = scale;
        float by = scale > 0.0f ? scale : 1.0f;
        for (Py_ssize_t at = lo; at < hi; at += NIBBLE_CHUNK) {  /* at is even: so are lo and the chunk */
            Py_ssize_t m = hi - at < NIBBLE_CHUNK ? hi - at : NIBBLE_CHUNK;
            for (Py_ssize_t i = 0; i < m; i++) {
                float q = rintf(src[at + i] / by);
                q = q < -levels ? -levels : (q > levels ? levels : q);
                codes[i] = (uint8_t)(int32_t)(q + zero);
            }
            if (m & 1) codes[m++] = (uint8_t)zero;  /* the array's last, odd element */
            uint8_t *dst = out + (at >> 1);
            for (Py_ssize_t j = 0; j < m / 2; j++) dst[j] = (uint8_t)(codes[2 * j] | (codes[2 * j + 1] << 4));
        }
    }
}

static PyObject *py_nibbles(PyObject *self, PyObject *args) {
    Py_buffer src, scales, out;
    Py_ssize_t group;
    float levels;
    if (!PyArg_ParseTuple(args, "y*nfw*w*", &src, &group, &levels, &scales, &out)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    nibbles_run(src.buf, src.len / (Py_ssize_t)sizeof(float), group, levels, scales.buf, out.buf);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&scales);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"momentum_dense", py_momentum_dense, METH_VARARGS,
     "momentum_dense(grad, held, out, momentum): out = grad = momentum * held + grad (held None: grad)."},
    {"adam_dense", py_adam_dense, METH_VARARGS,
     "adam_dense(grad, m_held, v_held, m_out, v_out, a1, b1, a2, b2, c1, c2, eps): Adam's moments and direction."},
    {"scale_finite", py_scale_finite, METH_VARARGS,
     "scale_finite(buf, factor) -> first non-finite index or -1: buf *= factor in place, checked as it is read."},
    {"group_topk", py_group_topk, METH_VARARGS,
     "group_topk(src, group, k, offsets, values) -> all finite: each group's k largest |x|, offsets ascending."},
    {"qsgd", py_qsgd, METH_VARARGS,
     "qsgd(src, bucket, levels, seed, norms, codes, wide): norms and codes; codes uint16 when wide."},
    {"dct_quant", py_dct_quant, METH_VARARGS,
     "dct_quant(src, n, c, order, bits, scales, codes, wide) -> all finite: block scales and codes; uint16 when wide."},
    {"dct_dequant", py_dct_dequant, METH_VARARGS,
     "dct_dequant(scales, codes, c, order, bits, out, wide): 8 x 8 blocks back from scales and codes."},
    {"nibbles", py_nibbles, METH_VARARGS,
     "nibbles(src, group, levels, scales, out): a scale per group and each value in 4 bits, two to a byte."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "Fused codec encoders (CPU).", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
