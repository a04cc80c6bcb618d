/* Fused single-pass kernels for checkpoint compression on the CPU.
 *
 * numpy needs one pass over memory per operation (XOR, rotate, one strided copy per byte
 * plane, a histogram per plane), and zstd's match finder is slow on byte planes that have
 * no repeats to find, only a skewed distribution. These kernels do the plane transforms in
 * one pass and code a plane's bytes with a canonical Huffman code, which is what a skewed
 * order-0 distribution needs. rayzip.checkpoint falls back to numpy and zstd when this
 * module is not built.
 *
 * A code table is 128 bytes of code lengths (two 4-bit lengths per byte, symbol 2k in the
 * low nibble, 0 = absent). Codes form an LSB-first bit stream, each code's bits reversed so
 * that the decoder indexes its table with the low bits of its buffer. Codes are at most
 * MAX_BITS long.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>

#define MAX_BITS 11
#define HEADER 128

static inline uint64_t load64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline void store64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static inline unsigned load16le(const uint8_t *p) { return p[0] | (unsigned)p[1] << 8; }  /* one load on x86 */

static void byte_histogram(const uint8_t *src, Py_ssize_t n, uint64_t counts[256]) {
    /* Four tables, so that runs of one byte value do not serialise on one counter. */
    uint64_t t[4][256];
    memset(t, 0, sizeof t);
    Py_ssize_t i = 0;
    for (; i + 4 <= n; i += 4) {
        t[0][src[i]]++; t[1][src[i + 1]]++; t[2][src[i + 2]]++; t[3][src[i + 3]]++;
    }
    for (; i < n; i++) t[0][src[i]]++;
    for (int s = 0; s < 256; s++) counts[s] = t[0][s] + t[1][s] + t[2][s] + t[3][s];
}

typedef struct { uint64_t weight; int symbol; } Leaf;

static int by_weight(const void *a, const void *b) {
    const Leaf *x = a, *y = b;
    if (x->weight != y->weight) return x->weight < y->weight ? -1 : 1;
    return x->symbol - y->symbol;
}

/* Optimal code lengths of at most MAX_BITS bits for the present symbols, by package-merge
 * (Larmore and Hirschberg). Halving the counts until a plain Huffman tree fits, as before,
 * also gave the frequent symbols of a long-tailed exponent plane (a trained layer's tiny
 * weights span many binades) longer codes than they need: 0.011 bits a byte on the
 * exponent plane of one of the GPT's qkv weights (2.6066 against 2.5959). Level j's list is the leaves merged with the pairs of level j-1's list, by
 * weight; the optimal code takes the first 2k-2 items of the last list, and the items taken
 * from each list are a prefix of it, whose leaves are the lightest ones. A leaf's length is
 * the number of lists whose taken prefix holds it. O(k MAX_BITS) per code. */
static void code_lengths(const uint64_t counts[256], uint8_t lengths[256]) {
    Leaf leaves[256];
    int k = 0;
    for (int s = 0; s < 256; s++) if (counts[s]) { leaves[k].weight = counts[s]; leaves[k].symbol = s; k++; }
    memset(lengths, 0, 256);
    if (k == 0) return;
    if (k == 1) { lengths[leaves[0].symbol] = 1; return; }
    qsort(leaves, k, sizeof(Leaf), by_weight);
    uint64_t weight[2][512];
    uint8_t is_leaf[MAX_BITS][512];
    int size[MAX_BITS];
    for (int i = 0; i < k; i++) { weight[0][i] = leaves[i].weight; is_leaf[0][i] = 1; }
    size[0] = k;
    for (int j = 1; j < MAX_BITS; j++) {
        const uint64_t *below = weight[(j - 1) & 1];
        uint64_t *here = weight[j & 1];
        int pairs = size[j - 1] / 2, leaf = 0, pair = 0, n = 0;
        while (leaf < k || pair < pairs) {
            uint64_t packed = pair < pairs ? below[2 * pair] + below[2 * pair + 1] : UINT64_MAX;
            if (leaf < k && leaves[leaf].weight <= packed) { here[n] = leaves[leaf++].weight; is_leaf[j][n++] = 1; }
            else { here[n] = packed; is_leaf[j][n++] = 0; pair++; }
        }
        size[j] = n;
    }
    uint8_t depth[256] = {0};
    for (int j = MAX_BITS - 1, taken = 2 * k - 2; j >= 0 && taken > 0; j--) {
        int leaves_taken = 0;
        for (int i = 0; i < taken; i++) leaves_taken += is_leaf[j][i];
        for (int i = 0; i < leaves_taken; i++) depth[i]++;
        taken = 2 * (taken - leaves_taken);
    }
    for (int i = 0; i < k; i++) lengths[leaves[i].symbol] = depth[i];
}

/* Canonical codes, bit-reversed for an LSB-first stream. Fails on lengths that overfill
 * the code space (a corrupt header). */
static int canonical_codes(const uint8_t lengths[256], uint16_t codes[256]) {
    int count_of[MAX_BITS + 1] = {0};
    for (int s = 0; s < 256; s++) {
        if (lengths[s] > MAX_BITS) return -1;
        count_of[lengths[s]]++;
    }
    count_of[0] = 0;
    uint32_t next[MAX_BITS + 2], code = 0;
    for (int len = 1; len <= MAX_BITS; len++) {
        code = (code + count_of[len - 1]) << 1;
        next[len] = code;
    }
    uint64_t kraft = 0;
    for (int len = 1; len <= MAX_BITS; len++) kraft += (uint64_t)count_of[len] << (MAX_BITS - len);
    if (kraft > (1u << MAX_BITS)) return -1;
    for (int s = 0; s < 256; s++) {
        int len = lengths[s];
        codes[s] = 0;
        if (!len) continue;
        uint32_t c = next[len]++, r = 0;
        for (int k = 0; k < len; k++) r |= ((c >> k) & 1u) << (len - 1 - k);
        codes[s] = (uint16_t)r;
    }
    return 0;
}

/* n * log2(n), summed over the nonzero cells. */
static double sum_nlogn(const uint64_t *cells, int count) {
    double sum = 0;
    for (int i = 0; i < count; i++) if (cells[i]) sum += (double)cells[i] * log2((double)cells[i]);
    return sum;
}

/* stream_stats(src, max_contexts[, sample]) -> (order-0 bits per byte, order-1 bits per
 * byte or -1, contexts, distinct byte values). Everything that decides how a stream is
 * coded, in one call: a histogram, and only where at most max_contexts contexts can occur
 * (the byte values present, and 0 before the first byte) the order-1 counts, in one row per
 * context instead of 65536 cells. With sample > 0 and a longer src, the statistics are those
 * of four evenly spaced runs of sample / 4 bytes, one after the other (as codecs._sample
 * concatenates them), read in place. */
static PyObject *py_stream_stats(PyObject *self, PyObject *args) {
    Py_buffer src;
    int max_contexts;
    Py_ssize_t sample = 0;
    if (!PyArg_ParseTuple(args, "y*i|n", &src, &max_contexts, &sample)) return NULL;
    const uint8_t *whole = src.buf;
    Py_ssize_t runs = 1, run = src.len, start[4] = {0};
    if (sample > 0 && src.len > sample) {
        runs = 4;
        run = sample / 4;
        for (int r = 0; r < 4; r++) start[r] = (src.len - run) * r / 3;
    }
    Py_ssize_t n = runs * run;
    uint64_t counts[256] = {0};
    double order0 = 0, order1 = -1;
    int distinct = 0, contexts = 0, no_memory = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int r = 0; r < runs; r++) {
        uint64_t part[256];
        byte_histogram(whole + start[r], run, part);
        for (int s = 0; s < 256; s++) counts[s] += part[s];
    }
    for (int s = 0; s < 256; s++) distinct += counts[s] != 0;
    if (n) order0 = (n * log2((double)n) - sum_nlogn(counts, 256)) / n;
    contexts = distinct + (counts[0] == 0);  /* the first byte's context is 0 */
    if (n && contexts <= max_contexts) {
        uint64_t *rows = calloc((size_t)contexts * 256, sizeof(uint64_t));
        if (!rows) no_memory = 1;
        else {
            uint8_t slot[256];
            int k = 0;
            for (int s = 0; s < 256; s++) if (counts[s] || s == 0) slot[s] = (uint8_t)k++;
            unsigned prev = 0;
            for (int r = 0; r < runs; r++) {
                const uint8_t *in = whole + start[r];
                for (Py_ssize_t i = 0; i < run; i++) { rows[((size_t)slot[prev] << 8) | in[i]]++; prev = in[i]; }
            }
            /* H(byte | previous) = sum over contexts of (row * log2(row) - sum of n log2 n);
             * a context counts where a byte follows it (the last byte's value may not). */
            double bits = 0;
            contexts = 0;
            for (int c = 0; c < k; c++) {
                uint64_t row = 0;
                for (int b = 0; b < 256; b++) row += rows[(size_t)c * 256 + b];
                if (!row) continue;
                bits += row * log2((double)row) - sum_nlogn(rows + (size_t)c * 256, 256);
                contexts++;
            }
            order1 = bits / n;
            free(rows);
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    if (no_memory) return PyErr_NoMemory();
    return Py_BuildValue("ddii", order0, order1, contexts, distinct);
}

/* Stream: a first byte holding the order (bit 0: 0 or 1) and the number of groups less one
 * (bits 1-7), a 32-byte bitmap of the contexts that have a code, 128 bytes of code lengths
 * per such context, the byte lengths of the 4 x groups bit streams (uint32 little-endian
 * each), then those streams. Order 0 has the one context 0; order 1 codes each byte with
 * the code of the byte before it, which captures the runs of similar exponents that
 * neighbouring optimizer-state values have.
 *
 * The input is cut into SEGMENTS x groups equal parts, each its own bit stream starting in
 * context 0. Within a group, the encoder and the decoder advance four independent chains of
 * shifts and table lookups at once instead of one; the groups share the code table and are
 * coded by as many threads as the caller allows. The number of groups depends only on the
 * stream's length (one up to 2 MB: the first byte of such a stream is the order, as before
 * groups existed), so the coded bytes do not depend on the threads. */
#define SEGMENTS 4
#define GROUP_BYTES ((Py_ssize_t)1 << 20)
#define MAX_GROUPS 16      /* groups an encoder makes; a decoder takes up to 128 */
#define MAX_SEGMENTS (SEGMENTS * 128)

typedef struct { uint8_t *o; uint64_t acc; int bits; unsigned prev; } BitWriter;

static inline void put_code(BitWriter *w, uint32_t entry) {
    w->acc |= (uint64_t)(entry & 0xFFFF) << w->bits;
    w->bits += entry >> 16;
}

static inline void flush_bits(BitWriter *w) {  /* whole bytes out; < 8 bits stay */
    store64(w->o, w->acc);
    w->o += w->bits >> 3;
    w->acc >>= w->bits & ~7;
    w->bits &= 7;
}

static int group_count(Py_ssize_t n) {
    Py_ssize_t groups = n / GROUP_BYTES;
    return groups < 1 ? 1 : groups > MAX_GROUPS ? MAX_GROUPS : (int)groups;
}

static void segment_bounds(Py_ssize_t n, int groups, Py_ssize_t *start) {  /* start[SEGMENTS * groups + 1] */
    const int segments = SEGMENTS * groups;
    Py_ssize_t part = (n + segments - 1) / segments;
    for (int k = 0; k <= segments; k++) start[k] = k * part < n ? k * part : n;
}

/* fn(ctx, g) for every group g, on up to `threads` threads (this one among them). The
 * kernels run without the GIL. Each thread takes the next group nobody has taken, so a
 * thread that starts late (a new thread waits for an idle vCPU to wake: 0.1 to 4 ms on a
 * cloud VM) or is preempted takes fewer groups, and this one never waits for a group that
 * nobody has begun; a thread that cannot be started is simply not there. */
typedef struct { void (*fn)(void *, int); void *ctx; int groups, next; } GroupQueue;

static void *run_groups(void *arg) {
    GroupQueue *q = arg;
    for (int g; (g = __atomic_fetch_add(&q->next, 1, __ATOMIC_RELAXED)) < q->groups;) q->fn(q->ctx, g);
    return NULL;
}

static inline __attribute__((always_inline)) void for_each_group(void (*fn)(void *, int), void *ctx, int groups,
                                                                 int threads) {
    if (threads > groups) threads = groups;
    if (threads <= 1) {  /* inlined where fn is known: the one-thread path is a plain loop */
        for (int g = 0; g < groups; g++) fn(ctx, g);
        return;
    }
    if (threads > MAX_GROUPS) threads = MAX_GROUPS;
    GroupQueue queue = {.fn = fn, .ctx = ctx, .groups = groups, .next = 0};
    pthread_t ids[MAX_GROUPS];
    int started[MAX_GROUPS] = {0};
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&ids[t], NULL, run_groups, &queue) == 0;
    run_groups(&queue);
    for (int t = 1; t < threads; t++)  /* the join makes their groups' writes visible here */
        if (started[t]) pthread_join(ids[t], NULL);
}

/* Each segment's counts, cells[k * ncells + (context << 8 | byte)], the context being the
 * byte before under order 1 (0 before a segment's first byte) and always 0 under order 0.
 * The segments are counted interleaved, so that a run of one value is four independent
 * chains of increments, not one. Counts are 32-bit: a segment is < 2**32 bytes. `restrict`
 * tells the compiler that the counts' stores never change the input: without it every byte
 * load waits for the increment before it (counting took a third longer on real exponents). */
static inline __attribute__((always_inline)) void count_segments(const uint8_t *restrict in, const Py_ssize_t start[SEGMENTS + 1], int order,
                                                                    uint32_t *restrict cells) {
    const Py_ssize_t ncells = order ? 65536 : 256, common = start[SEGMENTS] - start[SEGMENTS - 1];
    const unsigned context_mask = order ? 0xFFu : 0u;
    const uint8_t *s0 = in + start[0], *s1 = in + start[1], *s2 = in + start[2], *s3 = in + start[3];
    uint32_t *t0 = cells, *t1 = cells + ncells, *t2 = cells + 2 * ncells, *t3 = cells + 3 * ncells;
    unsigned p0 = 0, p1 = 0, p2 = 0, p3 = 0;
    for (Py_ssize_t i = 0; i < common; i++) {
        unsigned b0 = s0[i], b1 = s1[i], b2 = s2[i], b3 = s3[i];
        t0[((p0 & context_mask) << 8) | b0]++; t1[((p1 & context_mask) << 8) | b1]++;
        t2[((p2 & context_mask) << 8) | b2]++; t3[((p3 & context_mask) << 8) | b3]++;
        p0 = b0; p1 = b1; p2 = b2; p3 = b3;
    }
    unsigned last[SEGMENTS] = {p0, p1, p2, p3};
    for (int k = 0; k < SEGMENTS; k++) {
        unsigned prev = last[k];
        for (Py_ssize_t i = start[k] + common; i < start[k + 1]; i++) {
            cells[k * ncells + (((prev & context_mask) << 8) | in[i])]++;
            prev = in[i];
        }
    }
}

/* The segments are written straight into the result at offsets that their exact coded
 * sizes (from their counts and the code lengths) give. Each is followed by PAD zero bytes:
 * the writer stores 8 bytes at a time, and its last stores must not reach the next
 * segment. The recorded segment sizes include the pad, which a decoder never reads into. */
#define PAD 8
#define PAIRS_FROM (1 << 18)

typedef struct {
    const uint8_t *in;
    const Py_ssize_t *start, *offset;
    const uint32_t *stored, *entry, *pairs;
    uint32_t *cells;
    uint8_t *out;
    int order, mismatch[MAX_GROUPS];
    Py_ssize_t ncells;
} Encoding;

/* One function per order, so that each gets its own loop with the context a constant (one
 * function branching on the order had its two inlined loops merged into a slower one). */
static void count_group0(void *arg, int g) {
    Encoding *c = arg;
    count_segments(c->in, c->start + SEGMENTS * g, 0, c->cells + (size_t)g * SEGMENTS * c->ncells);
}

static void count_group1(void *arg, int g) {
    Encoding *c = arg;
    count_segments(c->in, c->start + SEGMENTS * g, 1, c->cells + (size_t)g * SEGMENTS * c->ncells);
}

static void write_group(void *arg, int g) {
    Encoding *c = arg;
    const uint8_t *in = c->in;
    const Py_ssize_t *start = c->start + SEGMENTS * g, *offset = c->offset + SEGMENTS * g;
    const uint32_t *stored = c->stored + SEGMENTS * g, *entry = c->entry, *pairs = c->pairs;
    uint8_t *out = c->out;
    const unsigned context_mask = c->order ? 0xFFu : 0u;
    BitWriter w[SEGMENTS];
    int mismatch = 0;
    for (int k = 0; k < SEGMENTS; k++) { w[k].o = out + offset[k]; w[k].acc = 0; w[k].bits = 0; w[k].prev = 0; }
    /* All four segments have at least `common` bytes; four codes (<= 44 bits) per flush.
     * The writers' state lives in locals: the byte stores could alias a struct's fields. */
    Py_ssize_t common = start[SEGMENTS] - start[SEGMENTS - 1], j = 0;
#define W_DECL(k) uint8_t *o##k = w[k].o; uint64_t acc##k = 0; int bits##k = 0; unsigned prev##k = 0; \
                  const uint8_t *in##k = in + start[k];
#define W_PUT(k, t) { unsigned b = in##k[j + t]; uint32_t e = entry[((prev##k & context_mask) << 8) | b]; \
                      acc##k |= (uint64_t)(e & 0xFFFF) << bits##k; bits##k += e >> 16; prev##k = b; }
#define W_FLUSH(k) { store64(o##k, acc##k); o##k += bits##k >> 3; acc##k >>= bits##k & ~7; bits##k &= 7; }
#define W_SAVE(k) { w[k].o = o##k; w[k].acc = acc##k; w[k].bits = bits##k; w[k].prev = prev##k; }
#define W_PUT0(k, t) { uint32_t e = entry[in##k[j + t]]; acc##k |= (uint64_t)(e & 0xFFFF) << bits##k; bits##k += e >> 16; }
#define W_PUT2(k, t) { uint32_t e = pairs[load16le(in##k + j + t)]; acc##k |= (uint64_t)(e & 0x3FFFFF) << bits##k; \
                       bits##k += e >> 22; }
/* Four codes per segment per flush, or two pairs of them. */
#define W_CODES(PUT) PUT(0, 0) PUT(1, 0) PUT(2, 0) PUT(3, 0) PUT(0, 1) PUT(1, 1) PUT(2, 1) PUT(3, 1) \
                     PUT(0, 2) PUT(1, 2) PUT(2, 2) PUT(3, 2) PUT(0, 3) PUT(1, 3) PUT(2, 3) PUT(3, 3)
#define W_PAIRS W_PUT2(0, 0) W_PUT2(1, 0) W_PUT2(2, 0) W_PUT2(3, 0) W_PUT2(0, 2) W_PUT2(1, 2) W_PUT2(2, 2) W_PUT2(3, 2)
#define W_LOOP(CODES)                                                                              \
    {                                                                                              \
        W_DECL(0) W_DECL(1) W_DECL(2) W_DECL(3)                                                    \
        for (; j + 4 <= common; j += 4) {                                                          \
            CODES                                                                                  \
            W_FLUSH(0) W_FLUSH(1) W_FLUSH(2) W_FLUSH(3)                                            \
        }                                                                                          \
        W_SAVE(0) W_SAVE(1) W_SAVE(2) W_SAVE(3)                                                    \
    }
    if (pairs) W_LOOP(W_PAIRS)
    else if (c->order) W_LOOP(W_CODES(W_PUT)) else W_LOOP(W_CODES(W_PUT0))  /* order 0: four fewer live registers */
#undef W_PUT2
#undef W_CODES
#undef W_PAIRS
#undef W_PUT0
#undef W_LOOP
#undef W_DECL
#undef W_PUT
#undef W_FLUSH
#undef W_SAVE
    for (int k = 0; k < SEGMENTS; k++) {
        for (Py_ssize_t i = start[k] + j; i < start[k + 1]; i++) {
            put_code(&w[k], entry[((w[k].prev & context_mask) << 8) | in[i]]);
            w[k].prev = in[i];
            flush_bits(&w[k]);
        }
        if (w[k].bits) { *w[k].o++ = (uint8_t)w[k].acc; w[k].bits = 0; }
        mismatch |= w[k].o != out + offset[k] + stored[k] - PAD;
        memset(out + offset[k] + stored[k] - PAD, 0, PAD);
    }
    c->mismatch[g] = mismatch;
}

/* huffman_encode(src, order[, dst[, threads]]): the coded stream as bytes; with dst (a
 * writable buffer, or None), written at its start instead, returning its length, or -1
 * where it does not fit. A stream of 2 MB or more is coded by up to `threads` threads
 * (default 1); the bytes are the same for any number. */
static PyObject *py_huffman_encode(PyObject *self, PyObject *args) {
    Py_buffer src, dst = {0};
    int order, threads = 1;
    PyObject *dst_obj = Py_None;
    if (!PyArg_ParseTuple(args, "y*i|Oi", &src, &order, &dst_obj, &threads)) return NULL;
    if (dst_obj != Py_None && PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    const int into = dst_obj != Py_None;
#define RELEASE_IO() { PyBuffer_Release(&src); if (into) PyBuffer_Release(&dst); }
    if (order != 0 && order != 1) {
        RELEASE_IO()
        PyErr_SetString(PyExc_ValueError, "order must be 0 or 1");
        return NULL;
    }
    const uint8_t *in = src.buf;
    const Py_ssize_t n = src.len;
    const int groups = group_count(n), segments = SEGMENTS * groups;
    Py_ssize_t start[SEGMENTS * MAX_GROUPS + 1];
    if ((uint64_t)n >= ((uint64_t)segments << 32)) {  /* per-segment counts are 32-bit */
        RELEASE_IO()
        PyErr_SetString(PyExc_ValueError, "huffman_encode: stream too large (split it)");
        return NULL;
    }
    segment_bounds(n, groups, start);
    const Py_ssize_t ncells = order ? 65536 : 256;
    uint32_t *cells = calloc((size_t)segments * ncells, sizeof(uint32_t));
    uint32_t *entry = malloc(ncells * sizeof(uint32_t));  /* code | length << 16, per context */
    uint8_t *lengths = malloc(ncells);
    /* Large order-0 streams are coded a pair of bytes at a time (without the table, one at a time). */
    uint32_t *pairs = order == 0 && n >= PAIRS_FROM ? malloc(65536 * sizeof(uint32_t)) : NULL;
    if (!cells || !entry || !lengths || (order == 0 && n >= PAIRS_FROM && !pairs)) {
        free(cells); free(entry); free(lengths); free(pairs); RELEASE_IO()
        return PyErr_NoMemory();
    }
    int contexts = 0;
    uint8_t bitmap[32] = {0};
    uint64_t segment_bits[SEGMENTS * MAX_GROUPS] = {0};
    Encoding coding = {.in = in, .start = start, .cells = cells, .entry = entry, .pairs = pairs,
                       .order = order, .ncells = ncells};
    Py_BEGIN_ALLOW_THREADS
    if (order) for_each_group(count_group1, &coding, groups, threads);
    else for_each_group(count_group0, &coding, groups, threads);
    for (Py_ssize_t c = 0; c < ncells / 256; c++) {
        uint64_t row[256] = {0}, total = 0;
        for (int k = 0; k < segments; k++) {  /* a segment's row at a time: contiguous, vectorised */
            const uint32_t *counts = cells + (size_t)k * ncells + 256 * c;
            for (int s = 0; s < 256; s++) row[s] += counts[s];
        }
        for (int s = 0; s < 256; s++) total += row[s];
        uint16_t codes[256] = {0};
        memset(lengths + 256 * c, 0, 256);
        if (total) {
            code_lengths(row, lengths + 256 * c);
            canonical_codes(lengths + 256 * c, codes);
            bitmap[c >> 3] |= (uint8_t)(1u << (c & 7));
            contexts++;
        }
        for (int s = 0; s < 256; s++) entry[256 * c + s] = codes[s] | ((uint32_t)lengths[256 * c + s] << 16);
    }
    for (int k = 0; k < segments; k++)  /* over the contexts that have a code only: order 1 has few */
        for (Py_ssize_t c = 0; c < ncells / 256; c++) {
            if (!(bitmap[c >> 3] >> (c & 7) & 1)) continue;
            const uint32_t *counts = cells + (size_t)k * ncells + 256 * c;
            const uint8_t *length = lengths + 256 * c;
            for (int s = 0; s < 256; s++) segment_bits[k] += (uint64_t)counts[s] * length[s];
        }
    Py_END_ALLOW_THREADS
    free(cells);
    Py_ssize_t header = 1 + 32 + (Py_ssize_t)HEADER * contexts + 4 * segments, total = header;
    Py_ssize_t offset[SEGMENTS * MAX_GROUPS];
    uint32_t stored[SEGMENTS * MAX_GROUPS];
    for (int k = 0; k < segments; k++) {
        stored[k] = (uint32_t)((segment_bits[k] + 7) / 8 + PAD);
        offset[k] = total;
        total += stored[k];
    }
    if (into && total > dst.len) {
        free(entry); free(lengths); free(pairs); RELEASE_IO()
        return PyLong_FromSsize_t(-1);
    }
    PyObject *result = into ? NULL : PyBytes_FromStringAndSize(NULL, total);
    if (!into && !result) {
        free(entry); free(lengths); free(pairs); RELEASE_IO()
        return NULL;
    }
    uint8_t *out = into ? (uint8_t *)dst.buf : (uint8_t *)PyBytes_AS_STRING(result), *o = out;
    *o++ = (uint8_t)(order | (groups - 1) << 1);
    memcpy(o, bitmap, 32); o += 32;
    for (int c = 0; c < 256; c++) {
        if (!(bitmap[c >> 3] >> (c & 7) & 1)) continue;
        for (int k = 0; k < HEADER; k++) *o++ = (uint8_t)(lengths[256 * c + 2 * k] | (lengths[256 * c + 2 * k + 1] << 4));
    }
    for (int k = 0; k < segments; k++) { memcpy(o, &stored[k], 4); o += 4; }
    coding.out = out; coding.offset = offset; coding.stored = stored;
    int mismatch = 0;
    Py_BEGIN_ALLOW_THREADS
    if (pairs) {
        /* Two order-0 codes per lookup: the entry for the little-endian pair (a, b) is a's code
         * then b's (<= 22 bits), in a 256 KB table. Only pairs of the stream's own byte values
         * are ever looked up, so only they are filled: an exponent plane has a few dozen
         * values, and with all 65536 entries filled the GPT checkpoint's streams took 23.0
         * ms to code instead of 19.3. */
        unsigned present[256], count = 0;
        for (unsigned s = 0; s < 256; s++) if (entry[s] >> 16) present[count++] = s;
        for (unsigned i = 0; i < count; i++)
            for (unsigned k = 0; k < count; k++) {
                uint32_t a = entry[present[i]], b = entry[present[k]], la = a >> 16;
                pairs[present[i] | present[k] << 8] =
                    (((a & 0xFFFF) | ((b & 0xFFFF) << la)) & 0x3FFFFF) | ((la + (b >> 16)) << 22);
            }
    }
    for_each_group(write_group, &coding, groups, threads);
    for (int g = 0; g < groups; g++) mismatch |= coding.mismatch[g];
    Py_END_ALLOW_THREADS
    free(entry); free(lengths); free(pairs);
    RELEASE_IO()
    if (mismatch) {  /* the sizes computed from the counts are what the writers wrote */
        Py_XDECREF(result);
        PyErr_SetString(PyExc_SystemError, "huffman_encode: a segment's size differs from its counts");
        return NULL;
    }
    return into ? PyLong_FromSsize_t(total) : result;
}
#undef RELEASE_IO

/* huffman_codes(counts, lengths, codes): for each row of 256 uint64 counts, the code lengths
 * (uint8) and codes (uint16, bit-reversed for an LSB-first stream) that huffman_encode gives a
 * context with those counts; an empty row gets zeros. A coder elsewhere (the GPU's, in
 * rayzip/checkpoint/device_huffman.py) counts, and writes the bits, itself: with this table
 * its bytes are this coder's. */
static PyObject *py_huffman_codes(PyObject *self, PyObject *args) {
    Py_buffer counts, lengths, codes;
    if (!PyArg_ParseTuple(args, "y*w*w*", &counts, &lengths, &codes)) return NULL;
    const Py_ssize_t rows = counts.len / (256 * (Py_ssize_t)sizeof(uint64_t));
    const char *error = NULL;
    if (counts.len != rows * 256 * (Py_ssize_t)sizeof(uint64_t) || lengths.len != rows * 256
        || codes.len != rows * 256 * (Py_ssize_t)sizeof(uint16_t))
        error = "huffman_codes: counts must be rows of 256 uint64, lengths and codes as many uint8 and uint16";
    else {
        const uint64_t *in = counts.buf;
        uint8_t *length = lengths.buf;
        uint16_t *code = codes.buf;
        for (Py_ssize_t r = 0; r < rows; r++) {
            uint64_t total = 0;
            for (int s = 0; s < 256; s++) total += in[256 * r + s];
            memset(length + 256 * r, 0, 256);
            memset(code + 256 * r, 0, 256 * sizeof(uint16_t));
            if (!total) continue;
            code_lengths(in + 256 * r, length + 256 * r);
            canonical_codes(length + 256 * r, code + 256 * r);
        }
    }
    PyBuffer_Release(&counts); PyBuffer_Release(&lengths); PyBuffer_Release(&codes);
    if (error) { PyErr_SetString(PyExc_ValueError, error); return NULL; }
    Py_RETURN_NONE;
}

typedef struct { const uint8_t *p, *end; uint64_t acc; int bits; unsigned prev; } BitReader;

typedef struct {
    const uint16_t *tables;
    const int *slot_of;
    const Py_ssize_t *start;
    BitReader *r;
    uint8_t *out;
    unsigned context_mask;
    const char *error[128];
} Decoding;

static void decode_group(void *arg, int g) {
    Decoding *c = arg;
    const uint16_t *restrict tables = c->tables;  /* the output's byte stores do not reach the tables */
    const int *restrict slot_of = c->slot_of;
    const Py_ssize_t *start = c->start + SEGMENTS * g;
    BitReader *r = c->r + SEGMENTS * g;
    uint8_t *restrict out = c->out;
    const unsigned context_mask = c->context_mask;
    const uint32_t mask = (1u << MAX_BITS) - 1;
    const char *error = NULL;
    int invalid = 0;
    /* Fast path: each segment refills 8 bytes at once (>= 56 bits), then decodes five
     * codes of <= 11 bits; the four segments' chains interleave. An invalid entry has
     * length 0, checked once per batch. Order 0 has one table: its loop does not look up
     * the previous byte's table, a load that otherwise lengthens each code's chain of
     * dependent loads by half (order-0 streams decoded at 0.55 GB/s with it). */
    Py_ssize_t common = start[SEGMENTS] - start[SEGMENTS - 1], j = 0;
#define R_DECL(k) const uint8_t *p##k = r[k].p, *end##k = r[k].end; uint64_t acc##k = 0; int bits##k = 0; \
                  unsigned prev##k = 0; uint8_t *out##k = out + start[k];
#define R_REFILL(k) { acc##k |= load64(p##k) << bits##k; p##k += (63 - bits##k) >> 3; bits##k |= 56; }
#define R_TABLE1(k) tables + ((size_t)slot_of[prev##k & context_mask] << MAX_BITS)
#define R_TABLE0(k) table0
#define R_GET(k, t, TABLE) { uint16_t e = (TABLE(k))[acc##k & mask]; \
                             int len = e >> 8; invalid |= !len; prev##k = out##k[j + t] = (uint8_t)e; \
                             acc##k >>= len; bits##k -= len; }
#define R_SAVE(k) { r[k].p = p##k; r[k].acc = acc##k; r[k].bits = bits##k; r[k].prev = prev##k; }
#define R_LOOP(TABLE)                                                                              \
    while (j + 5 <= common && !invalid && end0 - p0 >= 8 && end1 - p1 >= 8 && end2 - p2 >= 8        \
           && end3 - p3 >= 8) {                                                                     \
        R_REFILL(0) R_REFILL(1) R_REFILL(2) R_REFILL(3)                                             \
        for (int t = 0; t < 5; t++) { R_GET(0, t, TABLE) R_GET(1, t, TABLE) R_GET(2, t, TABLE) R_GET(3, t, TABLE) } \
        j += 5;                                                                                     \
    }
    {
        R_DECL(0) R_DECL(1) R_DECL(2) R_DECL(3)
        if (context_mask) {
            R_LOOP(R_TABLE1)
        } else {
            const uint16_t *restrict table0 = tables + ((size_t)slot_of[0] << MAX_BITS);
            R_LOOP(R_TABLE0)
        }
        R_SAVE(0) R_SAVE(1) R_SAVE(2) R_SAVE(3)
    }
#undef R_DECL
#undef R_REFILL
#undef R_TABLE1
#undef R_TABLE0
#undef R_GET
#undef R_SAVE
#undef R_LOOP
    if (invalid) error = "huffman stream holds an invalid code";
    for (int k = 0; k < SEGMENTS && !error; k++) {
        for (Py_ssize_t i = start[k] + j; i < start[k + 1] && !error; ) {
            while (r[k].bits <= 56 && r[k].p < r[k].end) { r[k].acc |= (uint64_t)*r[k].p++ << r[k].bits; r[k].bits += 8; }
            uint16_t e = tables[((size_t)slot_of[r[k].prev & context_mask] << MAX_BITS) | (r[k].acc & mask)];
            int len = e >> 8;
            if (!len) error = "huffman stream holds an invalid code";
            else if (len > r[k].bits) error = "huffman stream ends early";
            else { r[k].prev = out[i++] = (uint8_t)e; r[k].acc >>= len; r[k].bits -= len; }
        }
    }
    c->error[g] = error;
}

/* huffman_decode(stream, dst[, threads]): fills dst, its groups on up to `threads` threads
 * (default 1); ValueError if the stream is invalid. */
static PyObject *py_huffman_decode(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "y*w*|i", &src, &dst, &threads)) return NULL;
    const char *error = NULL;
    const uint8_t *in = src.buf, *end = in + src.len, *p = in + 33;
    uint8_t *out = dst.buf;
    Py_ssize_t n = dst.len, start[MAX_SEGMENTS + 1];
    const int order = src.len >= 33 ? in[0] & 1 : -1, groups = src.len >= 33 ? (in[0] >> 1) + 1 : 1;
    const int segments = SEGMENTS * groups;
    segment_bounds(n, groups, start);
    int contexts = 0, slot_of[256];
    uint16_t *tables = NULL;
    BitReader r[MAX_SEGMENTS];
    if (order < 0) error = "huffman stream has a bad header";
    if (!error) {
        for (int c = 0; c < 256; c++) {
            /* Contexts without a code share table 0, all length 0: any code there is invalid. */
            slot_of[c] = (in[1 + (c >> 3)] >> (c & 7) & 1) ? ++contexts : 0;
        }
        if (!contexts || end - p < (Py_ssize_t)HEADER * contexts + 4 * segments) error = "huffman stream shorter than its header";
        else if (!order && (contexts != 1 || slot_of[0] != 1)) error = "huffman stream has a bad header";
        else if (!(tables = calloc((size_t)(contexts + 1) << MAX_BITS, sizeof(uint16_t)))) {
            PyBuffer_Release(&src); PyBuffer_Release(&dst);
            return PyErr_NoMemory();
        }
    }
    if (!error) {
        const uint8_t *segment = p + (Py_ssize_t)HEADER * contexts + 4 * segments;
        for (int k = 0; k < segments; k++) {
            uint32_t size;
            memcpy(&size, p + (Py_ssize_t)HEADER * contexts + 4 * k, 4);
            if (size > (uint64_t)(end - segment)) { error = "huffman stream shorter than its segments"; break; }
            r[k].p = segment; r[k].end = segment + size; r[k].acc = 0; r[k].bits = 0; r[k].prev = 0;
            segment += size;
        }
    }
    if (!error) {
        Py_BEGIN_ALLOW_THREADS
        for (int c = 0; c < 256 && !error; c++) {
            if (!slot_of[c]) continue;
            uint8_t lengths[256];
            uint16_t codes[256], *table = tables + ((size_t)slot_of[c] << MAX_BITS);
            for (int k = 0; k < HEADER; k++) { lengths[2 * k] = p[k] & 15; lengths[2 * k + 1] = p[k] >> 4; }
            p += HEADER;
            if (canonical_codes(lengths, codes) < 0) { error = "huffman code lengths overfill the code space"; break; }
            for (int s = 0; s < 256; s++) {
                int len = lengths[s];
                if (!len) continue;
                for (uint32_t hi = 0; hi < (1u << (MAX_BITS - len)); hi++)
                    table[codes[s] | (hi << len)] = (uint16_t)(s | (len << 8));
            }
        }
        if (!error) {
            Decoding decoding = {.tables = tables, .slot_of = slot_of, .start = start, .r = r, .out = out,
                                 .context_mask = order ? 0xFFu : 0u};
            for_each_group(decode_group, &decoding, groups, threads);
            for (int g = 0; g < groups && !error; g++) error = decoding.error[g];
        }
        Py_END_ALLOW_THREADS
    }
    free(tables);
    PyBuffer_Release(&src); PyBuffer_Release(&dst);
    if (error) { PyErr_SetString(PyExc_ValueError, error); return NULL; }
    Py_RETURN_NONE;
}

/* On x86-64 with GCC, an AVX2 build of a loop beside the baseline one, picked at load time
 * by the CPU (the baseline, SSE2, has no byte shuffle to vectorise the transposes with). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define SIMD_CLONES
#endif

/* Byte planes of width-byte little-endian words: plane j holds byte j of every word, after
 * the word is XORed with its base (when given) and rotated left by `rotate` bits. One loop
 * per width and base/no-base, with restrict pointers and a branch-free rotate, so that the
 * compiler vectorises it. */
#define ROTL(T, v, r) ((T)(((v) << (r)) | ((v) >> ((8 * sizeof(T) - (r)) & (8 * sizeof(T) - 1)))))
#define ROTR(T, v, r) ((T)(((v) >> (r)) | ((v) << ((8 * sizeof(T) - (r)) & (8 * sizeof(T) - 1)))))

#define DEFINE_PLANES(T, W)                                                                       \
    SIMD_CLONES static void split_##W(const T *restrict in, const T *restrict base,                \
                                      uint8_t *restrict out, Py_ssize_t n, Py_ssize_t lo,         \
                                      Py_ssize_t hi, int r) {                                     \
        if (base) {                                                                               \
            for (Py_ssize_t i = lo; i < hi; i++) {                                                \
                T v = ROTL(T, (T)(in[i] ^ base[i]), r);                                           \
                for (int j = 0; j < W; j++) out[j * n + i] = (uint8_t)(v >> (8 * j));            \
            }                                                                                     \
        } else {                                                                                  \
            for (Py_ssize_t i = lo; i < hi; i++) {                                                \
                T v = ROTL(T, in[i], r);                                                          \
                for (int j = 0; j < W; j++) out[j * n + i] = (uint8_t)(v >> (8 * j));            \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    SIMD_CLONES static void join_##W(const uint8_t *const *rows, const T *restrict base,           \
                                     T *restrict out, Py_ssize_t lo, Py_ssize_t hi, int r) {      \
        const uint8_t *row[W];                                                                    \
        for (int j = 0; j < W; j++) row[j] = rows[j];                                             \
        for (Py_ssize_t i = lo; i < hi; i++) {                                                    \
            T v = 0;                                                                              \
            for (int j = 0; j < W; j++) v |= (T)((T)row[j][i] << (8 * j));                        \
            out[i] = (T)(ROTR(T, v, r) ^ (base ? base[i] : 0));                                   \
        }                                                                                         \
    }

DEFINE_PLANES(uint8_t, 1)
DEFINE_PLANES(uint16_t, 2)
DEFINE_PLANES(uint32_t, 4)
DEFINE_PLANES(uint64_t, 8)

/* Split or join on up to `threads` threads, a range of words each; below PLANE_CHUNK words
 * a thread costs more than it saves. */
#define PLANE_CHUNK ((Py_ssize_t)1 << 20)

typedef struct {
    const void *in, *base;
    const uint8_t *const *rows;
    void *out;
    Py_ssize_t n, part;
    int width, rotate, split;
} Planes;

static void planes_range(void *arg, int g) {
    Planes *c = arg;
    Py_ssize_t lo = (Py_ssize_t)g * c->part, hi = lo + c->part < c->n ? lo + c->part : c->n;
    if (c->split) {
        switch (c->width) {
            case 1: split_1(c->in, c->base, c->out, c->n, lo, hi, c->rotate); break;
            case 2: split_2(c->in, c->base, c->out, c->n, lo, hi, c->rotate); break;
            case 4: split_4(c->in, c->base, c->out, c->n, lo, hi, c->rotate); break;
            default: split_8(c->in, c->base, c->out, c->n, lo, hi, c->rotate); break;
        }
    } else {
        switch (c->width) {
            case 1: join_1(c->rows, c->base, c->out, lo, hi, c->rotate); break;
            case 2: join_2(c->rows, c->base, c->out, lo, hi, c->rotate); break;
            case 4: join_4(c->rows, c->base, c->out, lo, hi, c->rotate); break;
            default: join_8(c->rows, c->base, c->out, lo, hi, c->rotate); break;
        }
    }
}

/* The parts worth splitting n words into for `threads` threads: none below PLANE_CHUNK, up
 * to PARTS_PER_THREAD a thread (threads take them in turn: one that starts late or is
 * preempted leaves its share to the others), one for one thread. */
#define PARTS_PER_THREAD 2

static int chunk_parts(Py_ssize_t n, int threads) {
    if (threads <= 1) return 1;
    const Py_ssize_t chunks = n / PLANE_CHUNK, most = (Py_ssize_t)PARTS_PER_THREAD * threads;
    const Py_ssize_t parts = chunks < most ? chunks : most;
    return parts < 1 ? 1 : (int)parts;
}

static void run_planes(Planes *c, int threads) {
    const int parts = chunk_parts(c->n, threads);
    c->part = (c->n + parts - 1) / parts;
    for_each_group(planes_range, c, parts, threads);
}

static const char *width_rotate_error(int width, int rotate) {
    if (width != 1 && width != 2 && width != 4 && width != 8) return "width must be 1, 2, 4 or 8";
    if (rotate < 0 || rotate >= 8 * width) return "rotate must be in [0, 8 * width)";
    return NULL;
}

static int parse_planes(PyObject *args, Py_buffer *src, Py_buffer *dst, int *width, int *rotate,
                        Py_buffer *base, int *has_base, int *threads) {
    PyObject *base_obj;
    if (!PyArg_ParseTuple(args, "y*w*iiO|i", src, dst, width, rotate, &base_obj, threads)) return -1;
    *has_base = base_obj != Py_None;
    if (*has_base && PyObject_GetBuffer(base_obj, base, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(src); PyBuffer_Release(dst);
        return -1;
    }
    const char *error = width_rotate_error(*width, *rotate);
    if (!error && (src->len != dst->len || src->len % *width)) error = "src and dst must hold the same whole words";
    if (!error && *has_base && base->len != src->len) error = "base must be as long as src";
    if (error) {
        PyBuffer_Release(src); PyBuffer_Release(dst);
        if (*has_base) PyBuffer_Release(base);
        PyErr_SetString(PyExc_ValueError, error);
        return -1;
    }
    return 0;
}

static PyObject *py_split_planes(PyObject *self, PyObject *args) {
    Py_buffer src, dst, base_buf;
    int width, rotate, has_base, threads = 1;
    if (parse_planes(args, &src, &dst, &width, &rotate, &base_buf, &has_base, &threads) < 0) return NULL;
    Planes job = {.in = src.buf, .base = has_base ? base_buf.buf : NULL, .out = dst.buf, .n = src.len / width,
                  .width = width, .rotate = rotate, .split = 1};
    Py_BEGIN_ALLOW_THREADS
    run_planes(&job, threads);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src); PyBuffer_Release(&dst);
    if (has_base) PyBuffer_Release(&base_buf);
    Py_RETURN_NONE;
}

/* join_planes(planes, words, width, rotate, base|None): planes is a sequence of `width`
 * buffers of one byte per word each (a decoder's separate streams, not copied together). */
static PyObject *py_join_planes(PyObject *self, PyObject *args) {
    PyObject *planes_obj, *base_obj;
    Py_buffer dst, base_buf = {0}, rows[8];
    int width, rotate, held = 0, threads = 1;
    if (!PyArg_ParseTuple(args, "Ow*iiO|i", &planes_obj, &dst, &width, &rotate, &base_obj, &threads)) return NULL;
    PyObject *seq = PySequence_Fast(planes_obj, "planes must be a sequence of buffers");
    if (!seq) { PyBuffer_Release(&dst); return NULL; }
    Py_ssize_t n = width > 0 ? dst.len / width : 0;
    const char *error = width_rotate_error(width, rotate);
    if (!error && dst.len % width) error = "words must be whole";
    if (!error && PySequence_Fast_GET_SIZE(seq) != width) error = "planes must hold `width` buffers";
    int failed = 0;
    for (int j = 0; j < width && !error; j++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, j), &rows[j], PyBUF_SIMPLE) < 0) { failed = 1; break; }
        held = j + 1;
        if (rows[j].len != n) error = "every plane must hold one byte per word";
    }
    failed = failed || error;
    if (!failed && base_obj != Py_None) {
        if (PyObject_GetBuffer(base_obj, &base_buf, PyBUF_SIMPLE) < 0) failed = 1;
        else if (base_buf.len != dst.len) { error = "base must be as long as the words"; failed = 1; }
    }
    if (!failed) {
        const uint8_t *row[8];
        for (int j = 0; j < width; j++) row[j] = rows[j].buf;
        Planes job = {.rows = row, .base = base_buf.buf, .out = dst.buf, .n = n, .width = width, .rotate = rotate,
                      .split = 0};
        Py_BEGIN_ALLOW_THREADS
        run_planes(&job, threads);
        Py_END_ALLOW_THREADS
    }
    for (int j = 0; j < held; j++) PyBuffer_Release(&rows[j]);
    if (base_buf.buf) PyBuffer_Release(&base_buf);
    PyBuffer_Release(&dst);
    Py_DECREF(seq);
    if (error) PyErr_SetString(PyExc_ValueError, error);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

/* Prefix mapping of words (XORed with a base when given): the top `bits` bits of each
 * word. prefix_histogram counts them; prefix_map replaces each with lookup[prefix] (1- or
 * 2-byte indices), appends the prefixes that map to `escape` to `escapes` (2 bytes each),
 * and writes the low bits as byte planes. Returns the number of escapes. */
#define WORD_AT(i) (width == 2 ? (uint64_t)((const uint16_t *)in)[i] ^ (base ? ((const uint16_t *)base)[i] : 0)       \
                  : width == 4 ? (uint64_t)((const uint32_t *)in)[i] ^ (base ? ((const uint32_t *)base)[i] : 0)       \
                               : ((const uint64_t *)in)[i] ^ (base ? ((const uint64_t *)base)[i] : 0))

static int parse_words(PyObject *base_obj, Py_buffer *src, Py_buffer *base, int width, int bits) {
    if (base_obj != Py_None && PyObject_GetBuffer(base_obj, base, PyBUF_SIMPLE) < 0) return -1;
    const char *error = NULL;
    if (width != 2 && width != 4 && width != 8) error = "width must be 2, 4 or 8";
    else if (bits < 1 || bits > 16 || bits >= 8 * width) error = "bits must be in 1..16 and below the word width";
    else if (src->len % width) error = "words must be whole";
    else if (base->buf && base->len != src->len) error = "base must be as long as the words";
    if (error) {
        if (base->buf) PyBuffer_Release(base);
        PyErr_SetString(PyExc_ValueError, error);
        return -1;
    }
    return 0;
}

static PyObject *py_prefix_histogram(PyObject *self, PyObject *args) {
    Py_buffer src, out, base_buf = {0};
    PyObject *base_obj;
    int width, bits;
    if (!PyArg_ParseTuple(args, "y*iiOw*", &src, &width, &bits, &base_obj, &out)) return NULL;
    if (parse_words(base_obj, &src, &base_buf, width, bits) < 0 || out.len != ((Py_ssize_t)8 << bits)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "out must hold 2**bits uint64");
        if (base_buf.buf) PyBuffer_Release(&base_buf);
        PyBuffer_Release(&src); PyBuffer_Release(&out);
        return NULL;
    }
    const uint8_t *in = src.buf, *base = base_buf.buf;
    uint64_t *counts = out.buf;
    Py_ssize_t n = src.len / width;
    const int shift = 8 * width - bits;
    Py_BEGIN_ALLOW_THREADS
    memset(counts, 0, (size_t)8 << bits);
    for (Py_ssize_t i = 0; i < n; i++) counts[WORD_AT(i) >> shift]++;
    Py_END_ALLOW_THREADS
    if (base_buf.buf) PyBuffer_Release(&base_buf);
    PyBuffer_Release(&src); PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

/* One loop per word type and index type; the escape branch is rarely taken. */
#define DEFINE_PREFIX_MAP(T, IT, NAME)                                                             \
    static Py_ssize_t NAME(const T *restrict in, const T *restrict base, Py_ssize_t n, int shift,   \
                           const IT *restrict lookup, unsigned escape, IT *restrict indices,        \
                           uint8_t *restrict esc, uint8_t *restrict low, int low_planes) {          \
        Py_ssize_t escaped = 0;                                                                     \
        const T low_mask = (T)(((T)1 << shift) - 1);                                                \
        for (Py_ssize_t i = 0; i < n; i++) {                                                        \
            T w = base ? (T)(in[i] ^ base[i]) : in[i];                                              \
            unsigned prefix = (unsigned)(w >> shift);                                               \
            IT index = lookup[prefix];                                                              \
            indices[i] = index;                                                                     \
            if (index == escape) {                                                                  \
                esc[2 * escaped] = (uint8_t)prefix;                                                 \
                esc[2 * escaped + 1] = (uint8_t)(prefix >> 8);                                      \
                escaped++;                                                                          \
            }                                                                                       \
            T rest = w & low_mask;                                                                  \
            low[i] = (uint8_t)rest;                                                                 \
            if (low_planes > 1) low[n + i] = (uint8_t)(rest >> 8);                                  \
            if (low_planes > 2) low[2 * n + i] = (uint8_t)(rest >> 16);                             \
            for (int j = 3; j < low_planes; j++) low[j * n + i] = (uint8_t)(rest >> (8 * j));       \
        }                                                                                           \
        return escaped;                                                                             \
    }

DEFINE_PREFIX_MAP(uint16_t, uint8_t, prefix_map_2_1)
DEFINE_PREFIX_MAP(uint16_t, uint16_t, prefix_map_2_2)
DEFINE_PREFIX_MAP(uint32_t, uint8_t, prefix_map_4_1)
DEFINE_PREFIX_MAP(uint32_t, uint16_t, prefix_map_4_2)
DEFINE_PREFIX_MAP(uint64_t, uint8_t, prefix_map_8_1)
DEFINE_PREFIX_MAP(uint64_t, uint16_t, prefix_map_8_2)

static PyObject *py_prefix_map(PyObject *self, PyObject *args) {
    Py_buffer src, lookup, indices, escapes, planes, base_buf = {0};
    PyObject *base_obj;
    int width, bits, escape;
    if (!PyArg_ParseTuple(args, "y*iiOy*iw*w*w*", &src, &width, &bits, &base_obj, &lookup, &escape,
                          &indices, &escapes, &planes))
        return NULL;
    Py_ssize_t n = src.len / (width ? width : 1);
    int index_width = n ? (int)(indices.len / n) : 1, low_planes = (8 * width - bits + 7) / 8;
    int bad = parse_words(base_obj, &src, &base_buf, width, bits) < 0;
    if (!bad && (lookup.len != ((Py_ssize_t)index_width << bits) || (index_width != 1 && index_width != 2)
                 || indices.len != n * index_width || escapes.len < 2 * n || planes.len != n * low_planes)) {
        PyErr_SetString(PyExc_ValueError, "prefix_map: buffer sizes do not match");
        if (base_buf.buf) PyBuffer_Release(&base_buf);
        bad = 1;
    }
    if (bad) {
        PyBuffer_Release(&src); PyBuffer_Release(&lookup); PyBuffer_Release(&indices);
        PyBuffer_Release(&escapes); PyBuffer_Release(&planes);
        return NULL;
    }
    Py_ssize_t escaped = 0;
    const int shift = 8 * width - bits;
    void *in = src.buf, *base = base_buf.buf, *map = lookup.buf, *out = indices.buf;
    uint8_t *esc = escapes.buf, *low = planes.buf;
    Py_BEGIN_ALLOW_THREADS
#define CALL(NAME, T, IT) NAME((const T *)in, (const T *)base, n, shift, (const IT *)map, (unsigned)escape, (IT *)out, esc, low, low_planes)
    switch (width * 10 + index_width) {
        case 21: escaped = CALL(prefix_map_2_1, uint16_t, uint8_t); break;
        case 22: escaped = CALL(prefix_map_2_2, uint16_t, uint16_t); break;
        case 41: escaped = CALL(prefix_map_4_1, uint32_t, uint8_t); break;
        case 42: escaped = CALL(prefix_map_4_2, uint32_t, uint16_t); break;
        case 81: escaped = CALL(prefix_map_8_1, uint64_t, uint8_t); break;
        default: escaped = CALL(prefix_map_8_2, uint64_t, uint16_t); break;
    }
#undef CALL
    Py_END_ALLOW_THREADS
    if (base_buf.buf) PyBuffer_Release(&base_buf);
    PyBuffer_Release(&src); PyBuffer_Release(&lookup); PyBuffer_Release(&indices);
    PyBuffer_Release(&escapes); PyBuffer_Release(&planes);
    return PyLong_FromSsize_t(escaped);
}

/* The exponent model of a matrix (rows x cols bytes, row-major): each byte, the exponent of
 * a float, is predicted from its row's and its column's mean, as Adafactor factors Adam's
 * second moment, and replaced by its difference from the prediction (mod 256). In fixed
 * point, 1/16: row_fix[i] = round(16 * row mean), col_fix[j] = round(16 * column mean of
 * (byte - row mean)), prediction = clamp((row_fix[i] + col_fix[j] + 8) >> 4, 0, 255). The
 * numpy fallback (transforms.exponent_residual) computes the same integers. */
static inline int64_t floor_div(int64_t a, int64_t b) {  /* b > 0 */
    int64_t q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
}

static int exponent_fit(const uint8_t *e, Py_ssize_t rows, Py_ssize_t cols, int16_t *row_fix, int16_t *col_fix) {
    uint64_t *col_sum = calloc((size_t)cols, sizeof(uint64_t));
    if (!col_sum) return -1;
    int64_t row_total = 0;
    for (Py_ssize_t i = 0; i < rows; i++) {
        const uint8_t *row = e + i * cols;
        uint64_t sum = 0;
        for (Py_ssize_t j = 0; j < cols; j++) { sum += row[j]; col_sum[j] += row[j]; }
        row_fix[i] = (int16_t)((32 * sum + (uint64_t)cols) / (2 * (uint64_t)cols));
        row_total += row_fix[i];
    }
    for (Py_ssize_t j = 0; j < cols; j++)
        col_fix[j] = (int16_t)floor_div(32 * (int64_t)col_sum[j] - 2 * row_total + rows, 2 * (int64_t)rows);
    free(col_sum);
    return 0;
}

/* sign = -1: byte - prediction (encode); +1: residual + prediction (decode). In place. */
static void exponent_apply(uint8_t *e, Py_ssize_t rows, Py_ssize_t cols, const int16_t *row_fix,
                           const int16_t *restrict col_fix, int sign) {
    for (Py_ssize_t i = 0; i < rows; i++) {
        uint8_t *restrict row = e + i * cols;
        const int r = row_fix[i] + 8;
        for (Py_ssize_t j = 0; j < cols; j++) {
            int x = r + col_fix[j];
            x = x < 0 ? 0 : x > 4095 ? 4095 : x;
            const uint8_t p = (uint8_t)(x >> 4);
            row[j] = (uint8_t)(sign < 0 ? row[j] - p : row[j] + p);
        }
    }
}

static int parse_exponents(PyObject *args, Py_buffer *top, Py_ssize_t *rows, Py_ssize_t *cols,
                           Py_buffer *row_fix, Py_buffer *col_fix, int writable_fix) {
    PyObject *row_obj, *col_obj;
    if (!PyArg_ParseTuple(args, "w*nnOO", top, rows, cols, &row_obj, &col_obj)) return -1;
    int flags = writable_fix ? PyBUF_WRITABLE : PyBUF_SIMPLE;
    if (PyObject_GetBuffer(row_obj, row_fix, flags) < 0) { PyBuffer_Release(top); return -1; }
    if (PyObject_GetBuffer(col_obj, col_fix, flags) < 0) { PyBuffer_Release(top); PyBuffer_Release(row_fix); return -1; }
    const char *error = NULL;
    if (*rows < 1 || *cols < 1 || top->len != *rows * *cols) error = "top must hold rows x cols bytes";
    else if (row_fix->len != 2 * *rows || col_fix->len != 2 * *cols) error = "row_fix and col_fix must hold rows and cols int16";
    if (error) {
        PyBuffer_Release(top); PyBuffer_Release(row_fix); PyBuffer_Release(col_fix);
        PyErr_SetString(PyExc_ValueError, error);
        return -1;
    }
    return 0;
}

static PyObject *py_exponent_residual(PyObject *self, PyObject *args) {
    Py_buffer top, row_fix, col_fix;
    Py_ssize_t rows, cols;
    if (parse_exponents(args, &top, &rows, &cols, &row_fix, &col_fix, 1) < 0) return NULL;
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = exponent_fit(top.buf, rows, cols, row_fix.buf, col_fix.buf);
    if (!failed) exponent_apply(top.buf, rows, cols, row_fix.buf, col_fix.buf, -1);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&top); PyBuffer_Release(&row_fix); PyBuffer_Release(&col_fix);
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_exponent_restore(PyObject *self, PyObject *args) {
    Py_buffer top, row_fix, col_fix;
    Py_ssize_t rows, cols;
    if (parse_exponents(args, &top, &rows, &cols, &row_fix, &col_fix, 0) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    exponent_apply(top.buf, rows, cols, row_fix.buf, col_fix.buf, 1);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&top); PyBuffer_Release(&row_fix); PyBuffer_Release(&col_fix);
    Py_RETURN_NONE;
}

/* The scaled split of an fp32 matrix (transforms.scaled_split, whose numpy code is the
 * reference): each float's log magnitude to a quarter binade (exponent and top two mantissa
 * bits, LOG_BITS) minus a row-and-column prediction, with whether its sign disagrees with a
 * sign model (rank 1: a sign per row and per column; above: int8 factors), as one symbol byte; the 21 mantissa bits below as two byte planes and
 * five-bit fields, eight in five bytes. */
#define LOG_BITS 10
#define LOW_BITS 21
#define RESIDUAL_ZERO 64
#define RESIDUAL_REACH 39
#define SIGN_RANK_MAX 8
#define SCALED_MAX ((Py_ssize_t)1 << 22)  /* rows and columns: 32-bit sums of 10-bit values */

/* The model's log magnitude for a cell: row_fix + col_fix + 8 (1/16 quarter binades), clamped
 * to 0..1023 quarter binades, as transforms._prediction. */
static inline int32_t log_prediction(int32_t total) {
    return (total < 0 ? 0 : total > 16383 ? 16383 : total) >> 4;
}

/* One row's sum of log magnitudes (added into the columns' too) and its count of signs that
 * disagree with the columns' (cneg: 0 or 1 per column). 32-bit sums, eight to a vector:
 * the caller keeps rows and columns below 2**22, so that they cannot overflow. */
SIMD_CLONES static void scaled_row_sums(const uint32_t *restrict row, const uint32_t *restrict cneg,
                                        uint32_t *restrict col_sum, Py_ssize_t cols, uint64_t *sum_out,
                                        uint64_t *disagree_out) {
    uint32_t sum = 0, disagree = 0;
    for (Py_ssize_t j = 0; j < cols; j++) {
        const uint32_t v = row[j], l = (v >> LOW_BITS) & ((1u << LOG_BITS) - 1);
        sum += l;
        col_sum[j] += l;
        disagree += (v >> 31) ^ cneg[j];
    }
    *sum_out = sum;
    *disagree_out = disagree;
}

static inline float finite_or_zero(uint32_t v) {  /* inf and NaN count as 0 */
    v = (v & 0x7F800000u) == 0x7F800000u ? 0u : v;
    float x;
    memcpy(&x, &v, 4);
    return x;
}

/* The row's dot product with one factor, in sixteen running sums, so that it vectorises
 * without reassociating. */
SIMD_CLONES static float project_one(const uint32_t *restrict row, const float *restrict b, Py_ssize_t cols) {
    float part[16] = {0}, sum = 0.0f;
    Py_ssize_t j = 0;
    for (; j + 16 <= cols; j += 16)
        for (int l = 0; l < 16; l++) part[l] += finite_or_zero(row[j + l]) * b[j + l];
    for (; j < cols; j++) sum += finite_or_zero(row[j]) * b[j];
    for (int l = 0; l < 16; l++) sum += part[l];
    return sum;
}

/* A row's int8 factors (the encoder's): its finite floats projected on each of the columns'
 * factors (a factor at a time: the row stays in L1), scaled so that the largest is +-127
 * (all 0 for a row with no usable projection). */
static void row_factors_of(const uint32_t *row, const float *b, int rank, Py_ssize_t cols, int8_t *out) {
    float projection[SIGN_RANK_MAX], most = 0.0f;
    for (int t = 0; t < rank; t++) {
        projection[t] = project_one(row, b + t * cols, cols);
        const float size = fabsf(projection[t]);
        most = size > most ? size : most;
    }
    const int usable = most > 0.0f && isfinite(most);  /* huge rows overflow: no factors, not garbage */
    for (int t = 0; t < rank; t++)
        out[t] = (int8_t)(usable && isfinite(projection[t]) ? lrintf(127.0f * projection[t] / most) : 0);
}

/* A row's predicted signs (1 negative) from rank-k factors: whether the sum over t of
 * a[t] * b[t * cols + j] is below zero. The factors are int8 values held as floats, so every
 * product and partial sum is an integer below 2**24, exact in any order, and a zero sum
 * (even -0.0) is not below zero: the prediction is the integer one, as numpy computes it. A
 * factor at a time, so that the column loop vectorises. */
SIMD_CLONES static void predict_signs(const float *a, const float *restrict b, int rank, Py_ssize_t cols,
                                      uint32_t *restrict negative) {
    float *restrict sum = (float *)negative;
    for (Py_ssize_t j = 0; j < cols; j++) sum[j] = a[0] * b[j];
    for (int t = 1; t < rank; t++) {
        const float at = a[t];
        const float *restrict bt = b + t * cols;
        for (Py_ssize_t j = 0; j < cols; j++) sum[j] += at * bt[j];
    }
    for (Py_ssize_t j = 0; j < cols; j++) negative[j] = sum[j] < 0.0f;
}

/* One row's symbols and high and middle planes (cbias: a column's col_fix + 8); returns
 * whether any residual fell outside the symbols (the caller finds those again, rarely). */
SIMD_CLONES static int scaled_row_split(const uint32_t *restrict row, const int32_t *restrict cbias,
                                        const uint32_t *restrict cneg, Py_ssize_t cols, int32_t row_fix,
                                        uint32_t flip, uint8_t *restrict s, uint8_t *restrict h,
                                        uint8_t *restrict m) {
    uint32_t outside = 0;
    for (Py_ssize_t j = 0; j < cols; j++) {
        const uint32_t v = row[j];
        const int32_t l = (int32_t)((v >> LOW_BITS) & ((1u << LOG_BITS) - 1));
        const int32_t residual = l - log_prediction(row_fix + cbias[j]);
        const uint32_t inside = (uint32_t)(residual + RESIDUAL_REACH) <= 2 * RESIDUAL_REACH;
        outside |= inside ^ 1;
        s[j] = (uint8_t)((inside ? (uint32_t)(residual + RESIDUAL_ZERO) << 1 : 0) | ((v >> 31) ^ flip ^ cneg[j]));
        h[j] = (uint8_t)(v >> 13);
        m[j] = (uint8_t)(v >> 5);
    }
    return outside != 0;
}

/* One row's words from its symbols (escaped ones take the prediction here: the caller
 * corrects them); returns whether the row has escapes. */
SIMD_CLONES static int scaled_row_join(const uint8_t *restrict s, const uint8_t *restrict h,
                                       const uint8_t *restrict m, const int32_t *restrict cbias,
                                       const uint32_t *restrict cneg, Py_ssize_t cols, int32_t row_fix, uint32_t flip,
                                       uint32_t *restrict out) {
    uint32_t escaped = 0;
    for (Py_ssize_t j = 0; j < cols; j++) {
        const uint32_t symbol = s[j];
        const uint32_t l = (uint32_t)((int32_t)(symbol >> 1) - RESIDUAL_ZERO + log_prediction(row_fix + cbias[j]))
                           & ((1u << LOG_BITS) - 1);
        escaped |= symbol < 2;
        out[j] = ((symbol & 1) ^ flip ^ cneg[j]) << 31 | l << LOW_BITS | (uint32_t)h[j] << 13 | (uint32_t)m[j] << 5;
    }
    return escaped != 0;
}

/* The five low bits of eight floats in five bytes (little-endian bit order). Groups are
 * stored 8 bytes at a time, each store's last 3 bytes overwritten by the next group's. */
static inline uint64_t low_pair(uint64_t x) { return (x & 31) | (x >> 27 & 0x3E0); }  /* two words' low bits */

static inline uint64_t low_group(const uint32_t *v) {
    const uint8_t *p = (const uint8_t *)v;
    return low_pair(load64(p)) | low_pair(load64(p + 8)) << 10 | low_pair(load64(p + 16)) << 20
           | low_pair(load64(p + 24)) << 30;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#include <immintrin.h>
#define LOW_AVX2 1
/* Eight floats' low bits a group at a time in AVX2 lanes: scalar shifts and ORs took a
 * quarter of the split. */
__attribute__((target("avx2"))) static Py_ssize_t pack_low_avx2(const uint32_t *w, Py_ssize_t groups, uint8_t *low) {
    const __m256i m31 = _mm256_set1_epi32(31), m10 = _mm256_set1_epi64x(0x3FF);
    const __m256i odd = _mm256_setr_epi32(0, 5, 0, 5, 0, 5, 0, 5), pairs = _mm256_setr_epi64x(0, 10, 20, 30);
    Py_ssize_t g = 0;
    for (; g < groups; g++) {
        __m256i v = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(w + 8 * g)), m31);
        v = _mm256_sllv_epi32(v, odd);
        v = _mm256_and_si256(_mm256_or_si256(v, _mm256_srli_epi64(v, 32)), m10);
        v = _mm256_sllv_epi64(v, pairs);
        __m128i o = _mm_or_si128(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        o = _mm_or_si128(o, _mm_unpackhi_epi64(o, o));
        store64(low + 5 * g, (uint64_t)_mm_cvtsi128_si64(o));
    }
    return g;
}

__attribute__((target("avx2"))) static Py_ssize_t unpack_low_avx2(const uint8_t *low, Py_ssize_t groups, uint32_t *w) {
    const __m256i m31 = _mm256_set1_epi32(31), pairs = _mm256_setr_epi64x(0, 10, 20, 30);
    Py_ssize_t g = 0;
    for (; g < groups; g++) {
        __m256i a = _mm256_srlv_epi64(_mm256_set1_epi64x((long long)load64(low + 5 * g)), pairs);
        a = _mm256_and_si256(_mm256_blend_epi32(a, _mm256_slli_epi64(a, 27), 0xAA), m31);
        __m256i *out = (__m256i *)(w + 8 * g);
        _mm256_storeu_si256(out, _mm256_or_si256(_mm256_loadu_si256(out), a));
    }
    return g;
}
#endif

static void pack_low(const uint32_t *w, Py_ssize_t n, uint8_t *low) {
    const Py_ssize_t groups = (n + 7) / 8;
    Py_ssize_t g = 0;
#ifdef LOW_AVX2
    if (groups > 1 && __builtin_cpu_supports("avx2")) g = pack_low_avx2(w, groups - 1, low);
#endif
    for (; g + 1 < groups; g++) store64(low + 5 * g, low_group(w + 8 * g));
    if (groups) {
        uint32_t last[8] = {0};
        memcpy(last, w + 8 * g, (size_t)(n - 8 * g) * 4);
        const uint64_t acc = low_group(last);
        for (int t = 0; t < 5; t++) low[5 * g + t] = (uint8_t)(acc >> (8 * t));
    }
}

static void unpack_low(const uint8_t *low, Py_ssize_t n, uint32_t *w) {
    const Py_ssize_t groups = (n + 7) / 8;
    Py_ssize_t g = 0;
#ifdef LOW_AVX2
    if (groups > 1 && __builtin_cpu_supports("avx2")) g = unpack_low_avx2(low, groups - 1, w);
#endif
    for (; g + 1 < groups; g++) {  /* reads 3 bytes past the group: the next group's */
        const uint64_t acc = load64(low + 5 * g);
        uint32_t *v = w + 8 * g;
        for (int t = 0; t < 8; t++) v[t] |= (uint32_t)(acc >> (5 * t)) & 31;
    }
    if (groups) {
        uint64_t acc = 0;
        for (int t = 0; t < 5; t++) acc |= (uint64_t)low[5 * g + t] << (8 * t);
        for (Py_ssize_t i = 8 * g; i < n; i++) w[i] |= (uint32_t)(acc >> (5 * (i - 8 * g))) & 31;
    }
}

/* The first byte below 2 (an escaped symbol) from s[j] on, or cols: eight at a time. */
static inline Py_ssize_t next_escape(const uint8_t *s, Py_ssize_t j, Py_ssize_t cols) {
    for (; j + 8 <= cols; j += 8) {
        const uint64_t x = load64(s + j) & 0xFEFEFEFEFEFEFEFEull;  /* a zero byte: a symbol below 2 */
        const uint64_t zero = (x - 0x0101010101010101ull) & ~x & 0x8080808080808080ull;
        if (zero) return j + (__builtin_ctzll(zero) >> 3);
    }
    for (; j < cols; j++) if (s[j] < 2) return j;
    return cols;
}

/* Whether words hold a rows x cols fp32 matrix and picked (int64) 1 to 64 of its rows. */
static int picked_rows_fit(const Py_buffer *words, Py_ssize_t rows, Py_ssize_t cols, const Py_buffer *picked) {
    const Py_ssize_t k = picked->len / 8;
    const int64_t *pick = picked->buf;
    int fits = rows >= 1 && cols >= 1 && words->len == 4 * rows * cols && picked->len % 8 == 0 && k >= 1 && k <= 64;
    for (Py_ssize_t t = 0; fits && t < k; t++) fits = pick[t] >= 0 && pick[t] < rows;
    return fits;
}

/* The end of a kernel over picked rows: its two scratch blocks freed, its buffers released. */
static void picked_rows_done(Py_buffer *words, Py_buffer *picked, Py_buffer *out, void *scratch, void *more) {
    free(scratch); free(more);
    PyBuffer_Release(words); PyBuffer_Release(picked); PyBuffer_Release(out);
}

/* column_signs(words, rows, cols, picked, rounds, col_negative): transforms.column_signs,
 * the alternating majority votes over the picked rows' signs (at most 64 rows: 8-bit
 * counts). */
SIMD_CLONES static uint32_t sign_disagreements(const uint8_t *restrict s, const uint8_t *restrict col, Py_ssize_t cols) {
    uint32_t disagree = 0;
    for (Py_ssize_t j = 0; j < cols; j++) disagree += s[j] ^ col[j];
    return disagree;
}

SIMD_CLONES static void sign_count(const uint8_t *restrict s, uint8_t flip, uint8_t *restrict count, Py_ssize_t cols) {
    for (Py_ssize_t j = 0; j < cols; j++) count[j] += s[j] ^ flip;
}

SIMD_CLONES static void sign_majority(const uint8_t *restrict count, Py_ssize_t k, uint8_t *restrict col, Py_ssize_t cols) {
    for (Py_ssize_t j = 0; j < cols; j++) col[j] = 2 * count[j] > k;
}

static PyObject *py_column_signs(PyObject *self, PyObject *args) {
    Py_buffer words, picked, out;
    Py_ssize_t rows, cols;
    int rounds;
    if (!PyArg_ParseTuple(args, "y*nny*iw*", &words, &rows, &cols, &picked, &rounds, &out)) return NULL;
    const Py_ssize_t k = picked.len / 8;
    const int64_t *pick = picked.buf;
    const int fits = picked_rows_fit(&words, rows, cols, &picked) && out.len == cols;
    uint8_t *signs = fits ? malloc((size_t)(k * cols)) : NULL, *count = fits ? malloc((size_t)cols) : NULL;
    if (fits && (!signs || !count)) {
        picked_rows_done(&words, &picked, &out, signs, count);
        return PyErr_NoMemory();
    }
    if (fits) {
        Py_BEGIN_ALLOW_THREADS
        const uint32_t *w = words.buf;
        uint8_t *col = out.buf, row_neg[64];
        memset(count, 0, (size_t)cols);
        for (Py_ssize_t t = 0; t < k; t++) {
            const uint32_t *restrict row = w + pick[t] * cols;
            uint8_t *restrict s = signs + t * cols;
            for (Py_ssize_t j = 0; j < cols; j++) s[j] = (uint8_t)(row[j] >> 31);
            sign_count(s, 0, count, cols);
        }
        sign_majority(count, k, col, cols);
        for (int round = 0; round < rounds; round++) {
            for (Py_ssize_t t = 0; t < k; t++) row_neg[t] = 2 * (uint64_t)sign_disagreements(signs + t * cols, col, cols) > (uint64_t)cols;
            memset(count, 0, (size_t)cols);
            for (Py_ssize_t t = 0; t < k; t++) sign_count(signs + t * cols, row_neg[t], count, cols);
            sign_majority(count, k, col, cols);
        }
        Py_END_ALLOW_THREADS
    }
    picked_rows_done(&words, &picked, &out, signs, count);
    if (!fits) { PyErr_SetString(PyExc_ValueError, "column_signs: buffers do not fit rows x cols (64 picked rows at most)"); return NULL; }
    Py_RETURN_NONE;
}

/* A dot product in eight running sums, so that it vectorises without reassociating. */
SIMD_CLONES static double dot_product(const double *restrict a, const double *restrict b, Py_ssize_t n) {
    double part[8] = {0}, sum = 0.0;
    Py_ssize_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) part[l] += a[j + l] * b[j + l];
    for (; j < n; j++) sum += a[j] * b[j];
    for (int l = 0; l < 8; l++) sum += part[l];
    return sum;
}

/* sign_directions(words, rows, cols, picked, rank, col_factors): the columns' int8 factors of
 * the sign model (transforms.sign_factors): the top `rank` right singular vectors of the
 * picked rows, from a subspace iteration on their Gram matrix (at most 64 rows: a small one),
 * scaled to +-127 per column. In C because LAPACK's threads, on a machine whose cores the
 * checkpoint's own threads already use, made two-thread encodes twice as slow as one. */
#define DIRECTION_ROUNDS 12  /* rounds of subspace iteration: more change the stored size by a hair */
static PyObject *py_sign_directions(PyObject *self, PyObject *args) {
    Py_buffer words, picked, out;
    Py_ssize_t rows, cols;
    int rank;
    if (!PyArg_ParseTuple(args, "y*nny*iw*", &words, &rows, &cols, &picked, &rank, &out)) return NULL;
    const Py_ssize_t k = picked.len / 8;
    const int64_t *pick = picked.buf;
    const int fits = picked_rows_fit(&words, rows, cols, &picked) && rank >= 2 && rank <= SIGN_RANK_MAX
                     && out.len == rank * cols;
    double *sample = fits ? malloc((size_t)(k * cols) * sizeof(double)) : NULL;
    double *right = fits ? calloc((size_t)(cols * rank), sizeof(double)) : NULL;
    if (fits && (!sample || !right)) {
        picked_rows_done(&words, &picked, &out, sample, right);
        return PyErr_NoMemory();
    }
    if (fits) {
        Py_BEGIN_ALLOW_THREADS
        const uint32_t *w = words.buf;
        for (Py_ssize_t t = 0; t < k; t++)
            for (Py_ssize_t j = 0; j < cols; j++) sample[t * cols + j] = finite_or_zero(w[pick[t] * cols + j]);
        double gram[64][64], q[SIGN_RANK_MAX][64], z[SIGN_RANK_MAX][64];  /* directions in the sample's row space */
        for (Py_ssize_t a = 0; a < k; a++)
            for (Py_ssize_t b = a; b < k; b++) gram[a][b] = gram[b][a] = dot_product(sample + a * cols, sample + b * cols, cols);
        uint32_t seed = 12345u;  /* a fixed start, not aligned with any axis */
        for (int r = 0; r < rank; r++)
            for (Py_ssize_t a = 0; a < k; a++) { seed = seed * 1664525u + 1013904223u; q[r][a] = (double)(seed >> 8) / 16777216.0 - 0.5; }
        for (int round = 0; round < DIRECTION_ROUNDS; round++) {
            for (int r = 0; r < rank; r++) {
                for (Py_ssize_t a = 0; a < k; a++) z[r][a] = 0.0;
                for (Py_ssize_t b = 0; b < k; b++) {
                    const double weight = q[r][b];
                    for (Py_ssize_t a = 0; a < k; a++) z[r][a] += gram[b][a] * weight;  /* gram is symmetric */
                }
            }
            for (int r = 0; r < rank; r++) {  /* modified Gram-Schmidt */
                for (int p = 0; p < r; p++) {
                    double dot = 0.0;
                    for (Py_ssize_t a = 0; a < k; a++) dot += z[r][a] * z[p][a];
                    for (Py_ssize_t a = 0; a < k; a++) z[r][a] -= dot * z[p][a];
                }
                double norm = 0.0;
                for (Py_ssize_t a = 0; a < k; a++) norm += z[r][a] * z[r][a];
                norm = sqrt(norm);
                for (Py_ssize_t a = 0; a < k; a++) q[r][a] = z[r][a] = norm > 0.0 ? z[r][a] / norm : 0.0;
            }
        }
        for (int r = 0; r < rank; r++) {  /* right, rank x cols: the sample's rows combined */
            double *restrict direction = right + r * cols;
            for (Py_ssize_t a = 0; a < k; a++) {
                const double weight = q[r][a], *restrict from = sample + a * cols;
                for (Py_ssize_t j = 0; j < cols; j++) direction[j] += weight * from[j];
            }
            const double norm = sqrt(dot_product(direction, direction, cols));
            for (Py_ssize_t j = 0; j < cols; j++) direction[j] = norm > 0.0 ? direction[j] / norm : 0.0;
        }
        int8_t *factors = out.buf;
        for (Py_ssize_t j = 0; j < cols; j++) {
            double most = 0.0;
            for (int r = 0; r < rank; r++) most = fabs(right[r * cols + j]) > most ? fabs(right[r * cols + j]) : most;
            for (int r = 0; r < rank; r++)
                factors[r * cols + j] = (int8_t)(most > 0.0 ? lrint(127.0 * right[r * cols + j] / most) : 0);
        }
        Py_END_ALLOW_THREADS
    }
    picked_rows_done(&words, &picked, &out, sample, right);
    if (!fits) { PyErr_SetString(PyExc_ValueError, "sign_directions: buffers do not fit (64 picked rows at most)"); return NULL; }
    Py_RETURN_NONE;
}

/* The sign model: rank 1 is a sign per row times a sign per column (row_negative,
 * col_negative); rank 2 to SIGN_RANK_MAX, int8 factors, rank per row (row-major) and per
 * column (factor-major), whose products' sum predicts the sign. */
typedef struct { int rank; const int8_t *a; const float *b; const uint32_t *cneg; } SignModel;

/* Row i's predicted signs, against which its floats are coded: the columns' (rank 1, the
 * row's own sign applied by the caller) or the factors' prediction, written to `negative`. */
static const uint32_t *row_signs_of(const SignModel *f, Py_ssize_t i, Py_ssize_t cols, uint32_t *negative) {
    if (f->rank == 1) return f->cneg;
    float a_row[SIGN_RANK_MAX];
    for (int t = 0; t < f->rank; t++) a_row[t] = (float)f->a[i * f->rank + t];
    predict_signs(a_row, f->b, f->rank, cols, negative);
    return negative;
}

/* The scaled transform of one matrix, on up to `threads` threads, in ranges of rows
 * (chunk_parts: none below PLANE_CHUNK floats). A range is a multiple of 8 rows, so that the
 * low bits' groups of eight floats start at its start (the last range ends the matrix). The
 * bytes do not depend on the threads: the column sums are integers, summed over the ranges;
 * the escapes, each range's kept apart, are put back in order. */
typedef struct {
    Py_ssize_t rows, cols, part_rows;
    int parts, threads, rank;
    SignModel model;
    uint32_t *words;  /* the input of a split, the output of a join */
    uint8_t *sym, *high, *middle, *low, *rneg;
    uint16_t *esc;
    Py_ssize_t escapes;  /* a join's */
    int16_t *row_fix, *col_fix;
    int8_t *row_factors;
    /* the scratch: */
    float *b;              /* rank x cols: the columns' factors as floats (rank > 1) */
    uint32_t *cneg32;      /* cols: the columns' signs, 0 or 1 */
    int32_t *cbias;        /* cols: a column's col_fix + 8 */
    uint32_t *col_sums;    /* parts x cols (a split's) */
    uint32_t *negative;    /* parts x cols: a row's predicted signs (rank > 1) */
    Py_ssize_t *found;     /* parts: escapes found (split) or counted (join) */
    Py_ssize_t *first;     /* parts + 1: where a join's range takes its escapes from */
    int *bad;              /* parts: a join's range had too few or too many escapes */
} Scaled;

static void scaled_free(Scaled *c) {
    free(c->b); free(c->cneg32); free(c->cbias); free(c->col_sums); free(c->negative);
    free(c->found); free(c->first); free(c->bad);
}

/* Splits the rows into parts and takes the scratch; -1 where memory is short (the caller
 * frees what was taken). */
static int scaled_init(Scaled *c, int threads, const uint8_t *cneg, const int8_t *col_factors, int split) {
    const Py_ssize_t rows = c->rows, cols = c->cols;
    int parts = chunk_parts(rows * cols, threads);
    c->threads = threads;
    c->part_rows = ((rows + parts - 1) / parts + 7) & ~(Py_ssize_t)7;
    c->parts = parts = (int)((rows + c->part_rows - 1) / c->part_rows);
    c->cneg32 = malloc((size_t)cols * 4);
    c->cbias = malloc((size_t)cols * 4);
    c->found = calloc((size_t)parts, sizeof(Py_ssize_t));
    c->first = calloc((size_t)parts + 1, sizeof(Py_ssize_t));
    c->bad = calloc((size_t)parts, sizeof(int));
    c->col_sums = split ? calloc((size_t)parts * cols, 4) : NULL;
    if (c->rank > 1) {
        c->b = malloc((size_t)c->rank * cols * sizeof(float));
        c->negative = malloc((size_t)parts * cols * 4);
    }
    if (!c->cneg32 || !c->cbias || !c->found || !c->first || !c->bad || (split && !c->col_sums)
        || (c->rank > 1 && (!c->b || !c->negative)))
        return -1;
    for (Py_ssize_t j = 0; j < cols; j++) c->cneg32[j] = cneg[j] & 1;
    for (Py_ssize_t k = 0; c->rank > 1 && k < c->rank * cols; k++) c->b[k] = (float)col_factors[k];
    c->model = (SignModel){c->rank, c->row_factors, c->b, c->cneg32};
    return 0;
}

static void part_bounds(const Scaled *c, int g, Py_ssize_t *lo, Py_ssize_t *hi) {
    *lo = g * c->part_rows;
    *hi = *lo + c->part_rows < c->rows ? *lo + c->part_rows : c->rows;
}

/* A split's first pass over a range: the rows' factors (rank > 1) and fixes, their signs
 * (rank 1), and the range's column sums. */
static void scaled_fit_part(void *arg, int g) {
    Scaled *c = arg;
    const Py_ssize_t cols = c->cols;
    Py_ssize_t lo, hi;
    part_bounds(c, g, &lo, &hi);
    uint32_t *col_sum = c->col_sums + g * cols;
    for (Py_ssize_t i = lo; i < hi; i++) {
        const uint32_t *row = c->words + i * cols;
        uint64_t sum, disagree;
        if (c->rank > 1) row_factors_of(row, c->b, c->rank, cols, c->row_factors + i * c->rank);
        scaled_row_sums(row, c->cneg32, col_sum, cols, &sum, &disagree);
        c->row_fix[i] = (int16_t)((32 * sum + (uint64_t)cols) / (2 * (uint64_t)cols));
        c->rneg[i] = c->rank == 1 && 2 * disagree > (uint64_t)cols;
    }
}

/* A split's second pass: the range's symbols, planes and low bits, its escapes at the
 * start of the range's own place in esc (a float escapes at most once). */
static void scaled_code_part(void *arg, int g) {
    Scaled *c = arg;
    const Py_ssize_t cols = c->cols;
    Py_ssize_t lo, hi, found = 0;
    part_bounds(c, g, &lo, &hi);
    uint16_t *esc = c->esc + lo * cols;
    uint32_t *negative = c->negative ? c->negative + g * cols : NULL;
    for (Py_ssize_t block = lo; block < hi; block += 8) {  /* the low bits of 8 rows while they are in cache */
        const Py_ssize_t end = block + 8 < hi ? block + 8 : hi;
        for (Py_ssize_t i = block; i < end; i++) {
            const uint32_t *row = c->words + i * cols;
            uint8_t *s = c->sym + i * cols;
            if (scaled_row_split(row, c->cbias, row_signs_of(&c->model, i, cols, negative), cols, c->row_fix[i],
                                 c->rank == 1 ? c->rneg[i] & 1u : 0, s, c->high + i * cols, c->middle + i * cols))
                for (Py_ssize_t j = next_escape(s, 0, cols); j < cols; j = next_escape(s, j + 1, cols))
                    esc[found++] = (uint16_t)((row[j] >> LOW_BITS) & ((1u << LOG_BITS) - 1));
        }
        pack_low(c->words + block * cols, (end - block) * cols, c->low + block * cols / 8 * 5);
    }
    c->found[g] = found;
}

/* The symbols below 2 (escaped) among n, eight at a time. */
static Py_ssize_t count_escapes(const uint8_t *s, Py_ssize_t n) {
    const uint64_t seven = 0x7F7F7F7F7F7F7F7Full;
    Py_ssize_t count = 0, j = 0;
    for (; j + 8 <= n; j += 8) {
        const uint64_t x = load64(s + j) & 0xFEFEFEFEFEFEFEFEull;
        const uint64_t zero = ~(((x & seven) + seven) | x | seven);  /* 0x80 in each zero byte */
        count += (Py_ssize_t)((zero >> 7) * 0x0101010101010101ull >> 56);  /* not popcount: SSE2 has none */
    }
    for (; j < n; j++) count += s[j] < 2;
    return count;
}

static void scaled_count_part(void *arg, int g) {
    Scaled *c = arg;
    Py_ssize_t lo, hi;
    part_bounds(c, g, &lo, &hi);
    c->found[g] = count_escapes(c->sym + lo * c->cols, (hi - lo) * c->cols);
}

/* A join over a range: its words, the escaped log magnitudes from first[g] to first[g + 1],
 * then the low bits. */
static void scaled_join_part(void *arg, int g) {
    Scaled *c = arg;
    const Py_ssize_t cols = c->cols, limit = c->first[g + 1];
    const uint32_t log_mask = ((1u << LOG_BITS) - 1) << LOW_BITS;
    Py_ssize_t lo, hi, used = c->first[g];
    part_bounds(c, g, &lo, &hi);
    uint32_t *negative = c->negative ? c->negative + g * cols : NULL;
    for (Py_ssize_t block = lo; block < hi && !c->bad[g]; block += 8) {  /* as the split's */
        const Py_ssize_t end = block + 8 < hi ? block + 8 : hi;
        for (Py_ssize_t i = block; i < end && !c->bad[g]; i++) {
            const uint8_t *s = c->sym + i * cols;
            uint32_t *out = c->words + i * cols;
            if (!scaled_row_join(s, c->high + i * cols, c->middle + i * cols, c->cbias,
                                 row_signs_of(&c->model, i, cols, negative), cols, c->row_fix[i],
                                 c->rank == 1 ? c->rneg[i] & 1u : 0, out))
                continue;
            for (Py_ssize_t j = next_escape(s, 0, cols); j < cols; j = next_escape(s, j + 1, cols)) {
                if (used == limit) { c->bad[g] = 1; break; }
                out[j] = (out[j] & ~log_mask) | ((uint32_t)c->esc[used++] << LOW_BITS & log_mask);
            }
        }
        unpack_low(c->low + block * cols / 8 * 5, (end - block) * cols, c->words + block * cols);
    }
    c->bad[g] |= used != limit;
}

/* scaled_split(words, rows, cols, col_negative, row_negative, symbols, escapes, high,
 * middle, low, row_fix, col_fix, rank, row_factors, col_factors[, threads]) -> the number
 * of escapes written. Fills the model: for rank 1, row_negative (each row's sign: the
 * majority of its floats' against the columns', ties positive); above, row_factors (rows x
 * rank). */
static PyObject *py_scaled_split(PyObject *self, PyObject *args) {
    Py_buffer b[12];
    Py_ssize_t rows, cols;
    int rank, threads = 1;
    if (!PyArg_ParseTuple(args, "y*nny*w*w*w*w*w*w*w*w*iw*y*|i", &b[0], &rows, &cols, &b[2], &b[1], &b[3], &b[4],
                          &b[5], &b[6], &b[7], &b[8], &b[9], &rank, &b[10], &b[11], &threads))
        return NULL;
    const Py_ssize_t n = rows * cols;
    const int fits = rows >= 1 && cols >= 1 && rows <= SCALED_MAX && cols <= SCALED_MAX && b[0].len == 4 * n
                     && b[1].len == rows && b[2].len == cols
                     && b[3].len == n && b[4].len >= 2 * n && b[5].len == n && b[6].len == n
                     && b[7].len == (n + 7) / 8 * 5 && b[8].len == 2 * rows && b[9].len == 2 * cols
                     && rank >= 1 && rank <= SIGN_RANK_MAX
                     && (rank == 1 || (b[10].len == rank * rows && b[11].len == rank * cols));
    Py_ssize_t found = 0;
    int failed = !fits;
    if (fits) {
        Py_BEGIN_ALLOW_THREADS
        Scaled c = {.rows = rows, .cols = cols, .rank = rank, .words = b[0].buf, .rneg = b[1].buf, .sym = b[3].buf,
                    .esc = b[4].buf, .high = b[5].buf, .middle = b[6].buf, .low = b[7].buf, .row_fix = b[8].buf,
                    .col_fix = b[9].buf, .row_factors = b[10].buf};
        if (scaled_init(&c, threads, b[2].buf, b[11].buf, 1) < 0)
            failed = 1;
        else {
            for_each_group(scaled_fit_part, &c, c.parts, c.threads);
            int64_t row_total = 0;
            for (Py_ssize_t i = 0; i < rows; i++) row_total += c.row_fix[i];
            for (int g = 1; g < c.parts; g++)
                for (Py_ssize_t j = 0; j < cols; j++) c.col_sums[j] += c.col_sums[g * cols + j];
            for (Py_ssize_t j = 0; j < cols; j++) {
                c.col_fix[j] = (int16_t)floor_div(32 * (int64_t)c.col_sums[j] - 2 * row_total + rows, 2 * (int64_t)rows);
                c.cbias[j] = c.col_fix[j] + 8;
            }
            for_each_group(scaled_code_part, &c, c.parts, c.threads);
            for (int g = 0; g < c.parts; g++) {  /* the ranges' escapes, in order */
                Py_ssize_t lo, hi;
                part_bounds(&c, g, &lo, &hi);
                memmove(c.esc + found, c.esc + lo * cols, (size_t)c.found[g] * 2);
                found += c.found[g];
            }
        }
        scaled_free(&c);
        Py_END_ALLOW_THREADS
    }
    for (int k = 0; k < 12; k++) PyBuffer_Release(&b[k]);
    if (!fits) { PyErr_SetString(PyExc_ValueError, "scaled_split: buffers do not fit rows x cols"); return NULL; }
    if (failed) return PyErr_NoMemory();
    return PyLong_FromSsize_t(found);
}

/* scaled_join(symbols, escapes, high, middle, low, row_fix, col_fix, row_negative,
 * col_negative, rows, cols, words, rank, row_factors, col_factors[, threads]): the inverse;
 * ValueError where the escapes do not match. */
static PyObject *py_scaled_join(PyObject *self, PyObject *args) {
    Py_buffer b[12];
    Py_ssize_t rows, cols;
    int rank, threads = 1;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*y*y*nnw*iy*y*|i", &b[0], &b[1], &b[2], &b[3], &b[4], &b[5], &b[6],
                          &b[7], &b[8], &rows, &cols, &b[9], &rank, &b[10], &b[11], &threads))
        return NULL;
    const Py_ssize_t n = rows * cols;
    const int fits = rows >= 1 && cols >= 1 && rows <= SCALED_MAX && cols <= SCALED_MAX && b[0].len == n
                     && b[1].len % 2 == 0 && b[2].len == n && b[3].len == n
                     && b[4].len == (n + 7) / 8 * 5 && b[5].len == 2 * rows && b[6].len == 2 * cols
                     && b[7].len == rows && b[8].len == cols && b[9].len == 4 * n
                     && rank >= 1 && rank <= SIGN_RANK_MAX
                     && (rank == 1 || (b[10].len == rank * rows && b[11].len == rank * cols));
    const char *error = fits ? NULL : "scaled_join: buffers do not fit rows x cols";
    int failed = 0;
    if (fits) {
        Py_BEGIN_ALLOW_THREADS
        Scaled c = {.rows = rows, .cols = cols, .rank = rank, .sym = b[0].buf, .esc = b[1].buf, .escapes = b[1].len / 2,
                    .high = b[2].buf, .middle = b[3].buf, .low = b[4].buf, .row_fix = b[5].buf, .col_fix = b[6].buf,
                    .rneg = b[7].buf, .words = b[9].buf, .row_factors = b[10].buf};
        if (scaled_init(&c, threads, b[8].buf, b[11].buf, 0) < 0)
            failed = 1;
        else {
            for (Py_ssize_t j = 0; j < cols; j++) c.cbias[j] = c.col_fix[j] + 8;
            if (c.parts > 1)  /* each range's escapes start where the ranges before it end */
                for_each_group(scaled_count_part, &c, c.parts, c.threads);
            else
                c.found[0] = c.escapes;
            for (int g = 0; g < c.parts; g++) c.first[g + 1] = c.first[g] + c.found[g];
            if (c.first[c.parts] < c.escapes) error = "scaled stream escapes holds too many values";
            else if (c.first[c.parts] > c.escapes) error = "scaled stream escapes holds too few values";
            else {
                for_each_group(scaled_join_part, &c, c.parts, c.threads);
                for (int g = 0; g < c.parts && !error; g++)
                    if (c.bad[g]) error = "scaled stream escapes does not match its symbols";
            }
        }
        scaled_free(&c);
        Py_END_ALLOW_THREADS
    }
    for (int k = 0; k < 12; k++) PyBuffer_Release(&b[k]);
    if (failed) return PyErr_NoMemory();
    if (error) { PyErr_SetString(PyExc_ValueError, error); return NULL; }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"stream_stats", py_stream_stats, METH_VARARGS,
     "stream_stats(src, max_contexts[, sample]) -> (order-0 bits, order-1 bits or -1, contexts, distinct values)."},
    {"huffman_encode", py_huffman_encode, METH_VARARGS, "huffman_encode(src, order[, dst[, threads]]) -> bytes, or its length written into dst (-1: too small); order 0 or 1."},
    {"huffman_codes", py_huffman_codes, METH_VARARGS,
     "huffman_codes(counts, lengths, codes): per row of 256 uint64 counts, huffman_encode's code lengths and codes."},
    {"huffman_decode", py_huffman_decode, METH_VARARGS, "huffman_decode(stream, dst[, threads]): fills dst; ValueError if invalid."},
    {"prefix_histogram", py_prefix_histogram, METH_VARARGS,
     "prefix_histogram(words, width, bits, base|None, out): counts of the top bits."},
    {"prefix_map", py_prefix_map, METH_VARARGS,
     "prefix_map(words, width, bits, base|None, lookup, escape, indices, escapes, low_planes) -> escapes."},
    {"exponent_residual", py_exponent_residual, METH_VARARGS,
     "exponent_residual(top, rows, cols, row_fix, col_fix): fits the row and column model (int16 out) and "
     "replaces top by its residual, in place."},
    {"exponent_restore", py_exponent_restore, METH_VARARGS,
     "exponent_restore(residual, rows, cols, row_fix, col_fix): the inverse, in place."},
    {"column_signs", py_column_signs, METH_VARARGS,
     "column_signs(words, rows, cols, picked, rounds, col_negative): the columns' signs in the rank-one pattern."},
    {"sign_directions", py_sign_directions, METH_VARARGS,
     "sign_directions(words, rows, cols, picked, rank, col_factors): the columns' int8 factors of the sign model."},
    {"scaled_split", py_scaled_split, METH_VARARGS,
     "scaled_split(words, rows, cols, col_negative, row_negative, symbols, escapes, high, middle, low, row_fix, "
     "col_fix, rank, row_factors (out, rank > 1), col_factors[, threads]) -> escapes written."},
    {"scaled_join", py_scaled_join, METH_VARARGS,
     "scaled_join(symbols, escapes, high, middle, low, row_fix, col_fix, row_negative, col_negative, rows, cols, "
     "words, rank, row_factors, col_factors[, threads]): the inverse."},
    {"split_planes", py_split_planes, METH_VARARGS,
     "split_planes(words, planes, width, rotate, base|None[, threads]): XOR, rotate left, byte planes."},
    {"join_planes", py_join_planes, METH_VARARGS,
     "join_planes(planes, words, width, rotate, base|None[, threads]): inverse; planes is a sequence of width rows."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
