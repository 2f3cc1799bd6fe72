/* STI's loader in C: a layer's stored shards (full precision, or k-bit codes and their outliers) put straight into
 * their rows and columns of the layer's matrices. Called through ctypes, which lets go of the GIL for the call: the
 * loader thread then never holds the interpreter while the compute thread's layer needs it (docs/design/sti.md).
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

/* codes [first, first + count) of the packed stream into out. `pairs` is the pair table (`pair_table` in shards.py):
 * entry c1 << bits | c0 holds the centroids of codes c0 and c1, so a whole group of eight codes is four 8-byte loads
 * from a table that fits the core's first cache at 6 bits (32 KB); entry c (c < 2^bits) starts with code c's
 * centroid, which a part-group takes one code at a time. `bits` is a constant where this is inlined, so that a
 * group unrolls. */
static inline __attribute__((always_inline)) void decode_run_of(const uint8_t *codes, const int bits,
                                                                const float *pairs, int64_t first, int64_t count,
                                                                float *out) {
    const uint64_t mask = (UINT64_C(1) << bits) - 1;
    const uint64_t pair_mask = (UINT64_C(1) << (2 * bits)) - 1;
    int64_t i = first;
    const int64_t end = first + count;
    while (i < end) {
        const int64_t group = i >> 3;
        uint64_t word;
        memcpy(&word, codes + group * bits, sizeof word);   /* unaligned; WORD_PAD covers the last group */
        if ((i & 7) == 0 && i + 8 <= end) {                 /* a whole group */
            for (int j = 0; j < 4; j++)
                memcpy(out + 2 * j, pairs + 2 * ((word >> (2 * bits * j)) & pair_mask), 2 * sizeof(float));
            out += 8;
            i += 8;
            continue;
        }
        int64_t stop = (group + 1) << 3;
        if (stop > end)
            stop = end;
        word >>= bits * (i & 7);
        for (; i < stop; i++) {
            *out++ = pairs[2 * (word & mask)];
            word >>= bits;
        }
    }
}

static void decode_run(const uint8_t *codes, int bits, const float *pairs, int64_t first, int64_t count,
                       float *out) {
    switch (bits) {
    case 2: decode_run_of(codes, 2, pairs, first, count, out); break;
    case 3: decode_run_of(codes, 3, pairs, first, count, out); break;
    case 4: decode_run_of(codes, 4, pairs, first, count, out); break;
    case 5: decode_run_of(codes, 5, pairs, first, count, out); break;
    case 6: decode_run_of(codes, 6, pairs, first, count, out); break;
    default: decode_run_of(codes, bits, pairs, first, count, out);
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

/* The stored size of a shard of n weights at `bits` with `outliers` outliers, or -1 for a width out of range. */
static int64_t stored_length(int64_t n, int bits, int64_t outliers) {
    if (bits == FULL)
        return 4 * n;
    if (bits < 1 || bits > 8 || outliers < 0)
        return -1;
    return ((n + 7) / 8) * bits + WORD_PAD + 8 * outliers;
}

static void put_one(const uint8_t *blob, int bits, const float *pairs, int64_t outliers, const Layout *lay) {
    if (bits == FULL) {
        const uint8_t *source = blob;
        for (int p = 0; p < lay->parts; p++)
            for (int64_t r = 0; r < lay->rows[p]; r++, source += 4 * lay->cols[p])
                memcpy(row_start(lay, p, r), source, 4 * lay->cols[p]);
        return;
    }
    int64_t first = 0;
    for (int p = 0; p < lay->parts; p++)
        for (int64_t r = 0; r < lay->rows[p]; r++, first += lay->cols[p])
            decode_run(blob, bits, pairs, first, lay->cols[p], row_start(lay, p, r));
    const int64_t coded = ((total(lay) + 7) / 8) * bits + WORD_PAD;
    put_outliers(blob + coded, blob + coded + 4 * outliers, outliers, lay);
}

/* zlib's CRC-32 of a buffer, continuing from `crc` (ISA-L's crc32_gzip_refl, found in the process by the caller) */
typedef uint32_t (*Crc32)(uint32_t crc, const uint8_t *buffer, uint64_t length);

/* Puts `shards` stored shards into their places of one layer: shard i from blobs[i] (lengths[i] bytes, bits[i],
 * pair table pairs[i], outliers[i] outliers, checksum crcs[i]) at place index[i]. One call a layer, checks
 * included: the loader thread lets go of the GIL once a layer, not several times a shard, and every time it takes
 * the GIL back the compute thread waits to take it back after its next op (docs/design/sti.md).
 * Returns 0; i + 1 for the first shard i whose length is not the size the layout and its outliers make; -(i + 1)
 * for the first whose CRC-32 is not crcs[i] (none checked where crc32 is NULL). Every shard is checked before
 * anything is written. */
int academus_put_layer(int64_t shards, const uint8_t *const *blobs, const int64_t *lengths, const int *bits,
                       const float *const *pairs, const int64_t *outliers, const uint32_t *crcs, Crc32 crc32,
                       const int64_t *index, int parts, const int64_t *rows, const int64_t *cols, float *const *base,
                       const int64_t *step, const int64_t *stride) {
    Layout lay = {parts, rows, cols, step, stride, base, 0};
    const int64_t n = total(&lay);
    for (int64_t i = 0; i < shards; i++) {
        const int64_t expected = stored_length(n, bits[i], outliers[i]);
        if (expected < 0 || lengths[i] != expected || (bits[i] != FULL && pairs[i] == NULL))
            return (int)(i + 1);
        if (crc32 != NULL && crc32(0, blobs[i], (uint64_t)lengths[i]) != crcs[i])
            return -(int)(i + 1);
    }
    for (int64_t i = 0; i < shards; i++) {
        lay.index = index[i];
        put_one(blobs[i], bits[i], pairs[i], outliers[i], &lay);
    }
    return 0;
}
