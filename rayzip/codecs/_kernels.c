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

/* group_topk(src f32[groups*group], group, k, offsets i64[groups*k] out, values f32[groups*k] out):
 * each group's k largest |x| (ties: lowest index), offsets ascending within a group. */
static PyObject *py_group_topk(PyObject *self, PyObject *args) {
    Py_buffer src, offsets, values;
    Py_ssize_t group, k;
    if (!PyArg_ParseTuple(args, "y*nnw*w*", &src, &group, &k, &offsets, &values)) return NULL;
    const float *x = src.buf;
    int64_t *off = offsets.buf;
    float *val = values.buf;
    Py_ssize_t groups = group > 0 ? src.len / (Py_ssize_t)sizeof(float) / group : 0;
    Entry *heap = malloc(sizeof(Entry) * (size_t)(k > 0 ? k : 1));
    if (!heap) { PyBuffer_Release(&src); PyBuffer_Release(&offsets); PyBuffer_Release(&values); return PyErr_NoMemory(); }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t g = 0; g < groups; g++) {
        const float *row = x + g * group;
        for (int i = 0; i < k; i++) heap[i] = (Entry){fabsf(row[i]), i};
        for (int i = k / 2 - 1; i >= 0; i--) sift_down(heap, (int)k, i);
        float floor_mag = heap[0].mag;
        for (Py_ssize_t i = k; i < group; i++) {
            float a = fabsf(row[i]);
            if (a > floor_mag) {  /* a later index never wins a tie */
                heap[0] = (Entry){a, (int32_t)i};
                sift_down(heap, (int)k, 0);
                floor_mag = heap[0].mag;
            }
        }
        sort_by_index(heap, (int)k);
        for (int i = 0; i < k; i++) {
            off[g * k + i] = heap[i].idx;
            val[g * k + i] = row[heap[i].idx];
        }
    }
    Py_END_ALLOW_THREADS
    free(heap);
    PyBuffer_Release(&src); PyBuffer_Release(&offsets); PyBuffer_Release(&values);
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
 *           (row-major positions in zig-zag order), bits, scales f32[blocks] out,
 *           codes u8|u16[blocks*m] out, wide):
 * per block Y = C X C^T, its first m zig-zag coefficients, the block's peak |Y| as scale,
 * and codes rint((y / peak + 1) * (2^bits - 1) / 2) clipped to [0, 2^bits - 1]. */
WIDE static void dct_run(const float *x, Py_ssize_t blocks, int n, const float *c, const int64_t *order, int m,
                         int bits, float *scales, uint8_t *codes8, uint16_t *codes16) {
    float ct[32 * 32], tmp[32 * 32], y[32 * 32];
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
}

/* The same for 8 x 8 blocks, one row of eight floats per vector (GCC's vector extensions:
 * one AVX register in the x86-64-v3 clone, two SSE ones otherwise): 16 vector multiply-adds
 * per row and column pass, and the quantization in natural order, permuted to zig-zag order
 * only as the codes are stored. */
typedef float v8 __attribute__((vector_size(32)));

WIDE static void dct8_run(const float *x, Py_ssize_t blocks, const float *c, const int64_t *order, int m, int bits,
                          float *scales, uint8_t *codes8, uint16_t *codes16) {
    v8 ct[8];  /* ct[j][l] = C[l][j] */
    float cs[64];
    for (int j = 0; j < 8; j++)
        for (int l = 0; l < 8; l++) ct[j][l] = c[l * 8 + j];
    memcpy(cs, c, sizeof cs);
    int pos[64];  /* zig-zag rank of each row-major position, -1 when not kept */
    for (int q = 0; q < 64; q++) pos[q] = -1;
    for (int q = 0; q < m; q++) pos[order[q]] = q;
    const float half_top = (float)((1 << bits) - 1) / 2.0f, top = (float)((1 << bits) - 1);
    const v8 zero = {0}, one = zero + 1.0f, big = zero + 12582912.0f;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        const float *blk = x + b * 64;
        v8 tmp[8], y[8];
        for (int i = 0; i < 8; i++) {
            v8 t = zero;
            for (int j = 0; j < 8; j++) t += blk[i * 8 + j] * ct[j];
            tmp[i] = t;
        }
        for (int k = 0; k < 8; k++) {
            v8 o = zero;
            for (int i = 0; i < 8; i++) o += cs[k * 8 + i] * tmp[i];
            y[k] = o;
        }
        float peak = 0.0f;
        for (int q = 0; q < m; q++) { float a = fabsf(y[order[q] / 8][order[q] % 8]); peak = a > peak ? a : peak; }
        scales[b] = peak;
        float inverse = peak > 0.0f ? 1.0f / peak : 0.0f;
        for (int k = 0; k < 8; k++) {
            v8 code = (y[k] * inverse + one) * half_top;
            code = (code + big) - big;  /* round half to even, as round_even */
            for (int l = 0; l < 8; l++) {
                int q = pos[k * 8 + l];
                if (q < 0) continue;
                float v = code[l] < 0.0f ? 0.0f : code[l] > top ? top : code[l];
                if (codes8) codes8[b * m + q] = (uint8_t)v; else codes16[b * m + q] = (uint16_t)v;
            }
        }
    }
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
    Py_BEGIN_ALLOW_THREADS
    if (n == 8)
        dct8_run(src.buf, blocks, c.buf, order.buf, m, bits, scales.buf, wide ? NULL : codes.buf,
                 wide ? codes.buf : NULL);
    else
        dct_run(src.buf, blocks, n, c.buf, order.buf, m, bits, scales.buf, wide ? NULL : codes.buf,
                wide ? codes.buf : NULL);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src); PyBuffer_Release(&c); PyBuffer_Release(&order);
    PyBuffer_Release(&scales); PyBuffer_Release(&codes);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"group_topk", py_group_topk, METH_VARARGS,
     "group_topk(src, group, k, offsets, values): each group's k largest |x|, offsets ascending."},
    {"qsgd", py_qsgd, METH_VARARGS,
     "qsgd(src, bucket, levels, seed, norms, codes, wide): norms and codes; codes uint16 when wide."},
    {"dct_quant", py_dct_quant, METH_VARARGS,
     "dct_quant(src, n, c, order, bits, scales, codes, wide): block scales and codes; uint16 when wide."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "Fused codec encoders (CPU).", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
