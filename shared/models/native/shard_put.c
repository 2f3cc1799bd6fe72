/* STI's loader in C: a layer's stored shards (full precision, or k-bit codes and their outliers) put straight into
 * their rows and columns of the layer's matrices, by a call through ctypes (which lets go of the GIL for it) or, for
 * a whole plan, by a thread of its own that never takes the GIL: the compute thread needs the interpreter between
 * its torch ops, and waits after each one where a loader thread took it back (docs/design/sti.md). The thread takes
 * shards in memory (a mapped file, the preload buffer) or reads them from their files itself (a cold page cache).
 *
 * A quantized shard is stored as `pack_codes` and `encode_shard` write it (shared/models/shards.py): eight k-bit
 * codes to k bytes, little-endian within a 64-bit word, zero bytes after the last group (WORD_PAD), then the
 * outliers' offsets into the flat vector (uint32, ascending) and their exact values (float32).
 *
 * The flat vector is cut into parts, part p being rows[p] x cols[p] row-major; element (r, c) of part p goes to
 * base[p] + index * step[p] + r * stride[p] + c, `index` being the shard's place in the layer.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define FULL 32
#define WORD_PAD 8

typedef struct {
    int parts;
    const int64_t *rows, *cols, *step, *stride;
    float *const *base;
    int64_t index;
} Layout;

/* zlib's CRC-32 of a buffer, continuing from `crc` (ISA-L's crc32_gzip_refl, found in the process by the caller) */
typedef uint32_t (*Crc32)(uint32_t crc, const uint8_t *buffer, uint64_t length);

/* One layer's stored shards and where they go (`LayerLoad` in shard_native.py mirrors it): shard i from blobs[i]
 * (lengths[i] bytes, bits[i], pair table pairs[i], outliers[i] outliers, checksum crcs[i]) at place index[i] of
 * the layer whose parts the next six fields lay out (Layout). Where `fds` is set and fds[i] >= 0, the plan's thread
 * reads shard i from file fds[i] at offsets[i] instead (blobs[i] unused). */
typedef struct {
    int64_t shards;
    const uint8_t *const *blobs;
    const int64_t *lengths;
    const int *bits;
    const float *const *pairs;
    const int64_t *outliers;
    const uint32_t *crcs;
    const int64_t *index;
    int64_t parts;
    const int64_t *rows, *cols;
    float *const *base;
    const int64_t *step, *stride;
    const int *fds;
    const int64_t *offsets;
} LayerLoad;

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

/* Puts one layer's stored shards into their places, checks included: one call a layer, so that the loader lets go
 * of the GIL once a layer, not several times a shard (docs/design/sti.md). Returns 0; i + 1 for the first shard i
 * whose length is not the size the layout and its outliers make; -(i + 1) for the first whose CRC-32 is not
 * crcs[i] (none checked where crc32 is NULL). Every shard is checked before anything is written. */
int academus_put_layer(const LayerLoad *load, Crc32 crc32) {
    Layout lay = {(int)load->parts, load->rows, load->cols, load->step, load->stride, load->base, 0};
    const int64_t n = total(&lay);
    for (int64_t i = 0; i < load->shards; i++) {
        const int bits = load->bits[i];
        const int64_t expected = stored_length(n, bits, load->outliers[i]);
        if (expected < 0 || load->lengths[i] != expected || (bits != FULL && load->pairs[i] == NULL))
            return (int)(i + 1);
        if (crc32 != NULL && crc32(0, load->blobs[i], (uint64_t)load->lengths[i]) != load->crcs[i])
            return -(int)(i + 1);
    }
    for (int64_t i = 0; i < load->shards; i++) {
        lay.index = load->index[i];
        put_one(load->blobs[i], load->bits[i], load->pairs[i], load->outliers[i], &lay);
    }
    return 0;
}

/* A plan's layers put in order by a thread of its own, which never takes the GIL: each time a Python loader thread
 * took it back, the compute thread waited for it after its next torch op, and a pass through the model ran 1.2-1.8
 * times its time alone (docs/design/sti.md). The thread is kept from plan to plan (starting and joining one cost each
 * run 0.13-0.17 ms): it waits for a plan, puts its layers, and waits again. The caller publishes each layer's
 * LayerLoad as it fills it, waits for a layer before running it, and says when it is done with one: at most `window`
 * layers are put and not yet done with (0: no bound), as the buffers they are put into are reused in turn. */
typedef struct {
    pthread_t thread;
    uint8_t *staging;               /* the layer being read: the caller's, of staging_size bytes */
    int64_t staging_size;
    int64_t ahead, advised;         /* layers asked of the disk ahead of the one read; layers asked so far */
    pthread_mutex_t lock;
    pthread_cond_t changed;
    const LayerLoad *layers;
    Crc32 crc32;
    int64_t count, window;
    int64_t published, put, done;   /* layers published by the caller, put by the thread, done with by the caller */
    int failed;                     /* academus_put_layer's code for layer `put`, which was refused */
    int stopped, ended;             /* the plan's loads asked to stop; ended (the thread waits for the next plan) */
    int64_t plans;                  /* plans started */
    int closing;
    int64_t busy_ns;                /* the thread's time in academus_put_layer for the plan */
} Loader;

#define LOADS_STOPPED 0x40000000    /* a wait's answer where the loads stopped before the layer: no shard refused */
#define LOADS_UNREAD 0x40000001     /* its shards outgrew the staging buffer, or a read failed: nothing put */

/* The layout of LayerLoad and the loader's calls: shard_native.py refuses a library built from another. */
int academus_loader_version(void) { return 3; }

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Asks the disk for the shards to read of layers up to k + ahead not yet asked for (POSIX_FADV_WILLNEED), as far as
 * they are published, so that it reads them while the thread decodes. */
static void advise(Loader *loads, int64_t k) {
    pthread_mutex_lock(&loads->lock);
    const int64_t published = loads->published;
    pthread_mutex_unlock(&loads->lock);
    const int64_t upto = k + 1 + loads->ahead < published ? k + 1 + loads->ahead : published;
    for (; loads->advised < upto; loads->advised++) {
        const LayerLoad *load = &loads->layers[loads->advised];
        for (int64_t i = 0; load->fds != NULL && i < load->shards; i++)
            if (load->fds[i] >= 0)
                posix_fadvise(load->fds[i], load->offsets[i], load->lengths[i], POSIX_FADV_WILLNEED);
    }
}

static int read_whole(int fd, uint8_t *into, int64_t length, int64_t offset) {
    while (length > 0) {
        const ssize_t got = pread(fd, into, (size_t)length, offset);
        if (got <= 0)
            return -1;
        into += got, length -= got, offset += got;
    }
    return 0;
}

/* Layer k put, its shards read first where it has files to read: as academus_put_layer answers, or LOADS_UNREAD.
 * The disk is asked ahead before the reads and again before the decoding, which the later layers' reads overlap. */
static int load_layer(Loader *loads, int64_t k) {
    const LayerLoad *load = &loads->layers[k];
    if (load->fds == NULL)
        return academus_put_layer(load, loads->crc32);
    advise(loads, k);
    const uint8_t *blobs[load->shards > 0 ? load->shards : 1];   /* a layer's shards: a few dozen at most */
    int64_t used = 0;
    int failed = 0;
    for (int64_t i = 0; i < load->shards && !failed; i++) {
        blobs[i] = load->blobs[i];
        if (load->fds[i] < 0)
            continue;
        if (load->lengths[i] > loads->staging_size - used ||
            read_whole(load->fds[i], loads->staging + used, load->lengths[i], load->offsets[i]) != 0)
            failed = LOADS_UNREAD;
        blobs[i] = loads->staging + used;
        used += load->lengths[i];
    }
    advise(loads, k);
    if (!failed) {
        LayerLoad read = *load;
        read.blobs = blobs;
        failed = academus_put_layer(&read, loads->crc32);
    }
    return failed;
}

/* The started plan's layers put in order, the lock held between them, until they are all put, one is refused or the
 * caller stops the loads. */
static void put_plan(Loader *loads) {
    for (int64_t k = 0; k < loads->count; k++) {
        while (!loads->stopped &&
               (loads->published <= k || (loads->window > 0 && k - loads->done >= loads->window)))
            pthread_cond_wait(&loads->changed, &loads->lock);
        if (loads->stopped)
            return;
        pthread_mutex_unlock(&loads->lock);
        const int64_t started = now_ns();
        const int failed = load_layer(loads, k);
        const int64_t busy = now_ns() - started;
        pthread_mutex_lock(&loads->lock);
        loads->busy_ns += busy;
        if (failed) {
            loads->failed = failed;
            return;
        }
        loads->put = k + 1;
        pthread_cond_broadcast(&loads->changed);
    }
}

static void *run_loader(void *arg) {
    Loader *loads = arg;
    pthread_mutex_lock(&loads->lock);
    for (int64_t seen = 0;;) {
        while (!loads->closing && loads->plans == seen)
            pthread_cond_wait(&loads->changed, &loads->lock);
        if (loads->closing)
            break;
        seen = loads->plans;
        put_plan(loads);
        loads->ended = 1;
        pthread_cond_broadcast(&loads->changed);
    }
    pthread_mutex_unlock(&loads->lock);
    return NULL;
}

/* Starts the loader's thread, waiting for a plan; NULL where no thread could be started. Each shard's CRC-32 is
 * checked with `crc32`. */
Loader *academus_loader_open(Crc32 crc32) {
    Loader *loads = calloc(1, sizeof *loads);
    if (loads == NULL)
        return NULL;
    loads->crc32 = crc32;
    loads->ended = 1;
    pthread_mutex_init(&loads->lock, NULL);
    pthread_cond_init(&loads->changed, NULL);
    if (pthread_create(&loads->thread, NULL, run_loader, loads) != 0) {
        pthread_cond_destroy(&loads->changed);
        pthread_mutex_destroy(&loads->lock);
        free(loads);
        return NULL;
    }
    return loads;
}

/* A plan of `count` layers for the thread, whose LayerLoads the caller fills in `layers` and publishes: 0; -1 where
 * the thread still loads another (academus_loads_finish ends one). Shards read from files go through `staging` (the
 * caller's, `staging_size` bytes: a layer's reads at most), the disk asked for them `ahead` layers ahead of the one
 * read. */
int academus_loads_start(Loader *loads, const LayerLoad *layers, int64_t count, int64_t window, uint8_t *staging,
                         int64_t staging_size, int64_t ahead) {
    pthread_mutex_lock(&loads->lock);
    if (!loads->ended) {
        pthread_mutex_unlock(&loads->lock);
        return -1;
    }
    loads->staging = staging;
    loads->staging_size = staging_size;
    loads->ahead = ahead;
    loads->advised = 0;
    loads->layers = layers;
    loads->count = count;
    loads->window = window;
    loads->published = loads->put = loads->done = 0;
    loads->failed = loads->stopped = loads->ended = 0;
    loads->busy_ns = 0;
    loads->plans++;
    pthread_cond_broadcast(&loads->changed);
    pthread_mutex_unlock(&loads->lock);
    return 0;
}

/* The first `count` LayerLoads are filled: the thread may put them. */
void academus_loads_publish(Loader *loads, int64_t count) {
    pthread_mutex_lock(&loads->lock);
    loads->published = count;
    pthread_cond_broadcast(&loads->changed);
    pthread_mutex_unlock(&loads->lock);
}

/* Waits until layer k is put: 0; academus_put_layer's code where layer k was refused; LOADS_STOPPED where the
 * loads ended before it otherwise (stopped, or an earlier layer refused). */
int academus_loads_wait(Loader *loads, int64_t k) {
    pthread_mutex_lock(&loads->lock);
    while (loads->put <= k && !loads->ended)
        pthread_cond_wait(&loads->changed, &loads->lock);
    const int answer = loads->put > k ? 0 : (loads->failed && loads->put == k ? loads->failed : LOADS_STOPPED);
    pthread_mutex_unlock(&loads->lock);
    return answer;
}

/* The caller is done with one more layer: its buffers may take the next. */
void academus_loads_done(Loader *loads) {
    pthread_mutex_lock(&loads->lock);
    loads->done++;
    pthread_cond_broadcast(&loads->changed);
    pthread_mutex_unlock(&loads->lock);
}

/* Stops the plan's loads after the layer being put and waits until the thread has let go of them (of the LayerLoads,
 * the shards and the staging buffer): its busy time in ns. The thread waits for the next plan. */
int64_t academus_loads_finish(Loader *loads) {
    pthread_mutex_lock(&loads->lock);
    loads->stopped = 1;
    pthread_cond_broadcast(&loads->changed);
    while (!loads->ended)
        pthread_cond_wait(&loads->changed, &loads->lock);
    const int64_t busy = loads->busy_ns;
    pthread_mutex_unlock(&loads->lock);
    return busy;
}

/* Ends the thread, its plan's loads stopped first, and frees the loader. */
void academus_loader_close(Loader *loads) {
    academus_loads_finish(loads);
    pthread_mutex_lock(&loads->lock);
    loads->closing = 1;
    pthread_cond_broadcast(&loads->changed);
    pthread_mutex_unlock(&loads->lock);
    pthread_join(loads->thread, NULL);
    pthread_cond_destroy(&loads->changed);
    pthread_mutex_destroy(&loads->lock);
    free(loads);
}
