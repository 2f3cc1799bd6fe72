/* STI's loader in C: one stored shard (full precision, or k-bit codes and their outliers) put straight into its
 * rows and columns of a layer's matrices. Called through ctypes, which lets go of the GIL for the call: the loader
 * thread then never holds the interpreter while the compute thread's layer needs it (docs/design/sti.md).
 *
 * A quantized shard is stored as `pack_codes` and `encode_shard` write it (shared/models/shards.py): eight k-bit
 * codes to k bytes, little-endian within a 64-bit word, zero bytes after the last group (WORD_PAD), then the
 * outliers' offsets into the flat vector (uint32, ascending) and their exact values (float32).
 *
 * The flat vector is cut into parts, part p being rows[p] x cols[p] row-major; element (r, c) of part p goes to
 * base[p] + index * step[p] + r * stride[p] + c, `index` being the shard's place in the layer.
 */
#include <stdint.h>
#include <string.h>

#define FULL 32
#define WORD_PAD 8

typedef struct {
    int parts;
    const int64_t *rows, *cols, *step, *stride;
    float *const *base;
    int64_t index;
} Layout;

static float *row_start(const Layout *lay, int p, int64_t r) {
    return lay->base[p] + lay->index * lay->step[p] + r * lay->stride[p];
}

/* codes [first, first + count) of the packed stream into out; `bits` a constant where it is inlined, so that a
 * whole group's eight codes unroll */
static inline __attribute__((always_inline)) void decode_run_of(const uint8_t *codes, const int bits,
                                                                const float *centroids, int64_t first,
                                                                int64_t count, float *out) {
    const uint64_t mask = (UINT64_C(1) << bits) - 1;
    int64_t i = first;
    const int64_t end = first + count;
    while (i < end) {
        const int64_t group = i >> 3;
        uint64_t word;
        memcpy(&word, codes + group * bits, sizeof word);   /* unaligned; WORD_PAD covers the last group */
        if ((i & 7) == 0 && i + 8 <= end) {                 /* a whole group */
            for (int j = 0; j < 8; j++)
                out[j] = centroids[(word >> (bits * j)) & mask];
            out += 8;
            i += 8;
            continue;
        }
        int64_t stop = (group + 1) << 3;
        if (stop > end)
            stop = end;
        word >>= bits * (i & 7);
        for (; i < stop; i++) {
            *out++ = centroids[word & mask];
            word >>= bits;
        }
    }
}

static void decode_run(const uint8_t *codes, int bits, const float *centroids, int64_t first, int64_t count,
                       float *out) {
    switch (bits) {
    case 2: decode_run_of(codes, 2, centroids, first, count, out); break;
    case 3: decode_run_of(codes, 3, centroids, first, count, out); break;
    case 4: decode_run_of(codes, 4, centroids, first, count, out); break;
    case 5: decode_run_of(codes, 5, centroids, first, count, out); break;
    case 6: decode_run_of(codes, 6, centroids, first, count, out); break;
    default: decode_run_of(codes, bits, centroids, first, count, out);
    }
}

static int64_t total(const Layout *lay) {
    int64_t n = 0;
    for (int p = 0; p < lay->parts; p++)
        n += lay->rows[p] * lay->cols[p];
    return n;
}

static void put_outliers(const uint8_t *where, const uint8_t *values, int64_t outliers, const Layout *lay) {
    int p = 0;
    int64_t start = 0;
    for (int64_t j = 0; j < outliers; j++) {
        uint32_t at;
        float value;
        memcpy(&at, where + 4 * j, 4);
        memcpy(&value, values + 4 * j, 4);
        while (p < lay->parts && at >= start + lay->rows[p] * lay->cols[p]) {   /* ascending: walk the parts */
            start += lay->rows[p] * lay->cols[p];
            p++;
        }
        if (p == lay->parts)
            return;
        const int64_t k = at - start;
        row_start(lay, p, k / lay->cols[p])[k % lay->cols[p]] = value;
    }
}

/* Returns 0, or -1 when `length` is not the size the layout and `outliers` make (nothing is written then). */
int academus_put_shard(const uint8_t *blob, int64_t length, int bits, const float *centroids, int64_t outliers,
                       int parts, const int64_t *rows, const int64_t *cols, float *const *base, const int64_t *step,
                       const int64_t *stride, int64_t index) {
    const Layout lay = {parts, rows, cols, step, stride, base, index};
    const int64_t n = total(&lay);
    if (bits == FULL) {
        if (length != 4 * n)
            return -1;
        const uint8_t *source = blob;
        for (int p = 0; p < parts; p++)
            for (int64_t r = 0; r < rows[p]; r++, source += 4 * cols[p])
                memcpy(row_start(&lay, p, r), source, 4 * cols[p]);
        return 0;
    }
    const int64_t coded = ((n + 7) / 8) * bits + WORD_PAD;
    if (bits < 1 || bits > 8 || outliers < 0 || length != coded + 8 * outliers)
        return -1;
    int64_t first = 0;
    for (int p = 0; p < parts; p++)
        for (int64_t r = 0; r < rows[p]; r++, first += cols[p])
            decode_run(blob, bits, centroids, first, cols[p], row_start(&lay, p, r));
    put_outliers(blob + coded, blob + coded + 4 * outliers, outliers, &lay);
    return 0;
}
