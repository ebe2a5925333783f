/*
 * model.c - a simulated non-coherent CPU cache in front of a shared mapping.
 *
 * On one coherent machine a missing flush or invalidate can never fail a
 * test.  This model makes it fail: every attachment in "model" mode gets its
 * own private cache of 64-byte lines, and the real shared mapping stands for
 * the CXL memory behind it.
 *
 *   load        hits a cached line (possibly stale); a miss fills the whole
 *               line from shared memory and keeps it.
 *   store       write-allocate: the line is filled, changed privately and
 *               marked dirty; nobody else sees it.
 *   nt_store    bypasses the cache: a cached copy of the line is written
 *               back (if dirty) and dropped, then the bytes go to memory.
 *   flush /     write a dirty line back whole, then drop it.  (x86 has no
 *   invalidate  user-mode drop-without-write-back, so these are the same.)
 *   writeback   write a dirty line back whole and keep it, clean.
 *   fences      no-ops: the model keeps no store buffer, so ordering bugs
 *               surface through the cache alone.
 *
 * Lines are written back whole, so two hosts writing one line lose data.
 * With probability evict_rate per line touched, a random cached line is
 * evicted (written back if dirty), which is how real caches leak unflushed
 * data at unpredictable times.  A full cache evicts a random victim.  The
 * random source is a seeded xorshift, so a failing trial replays exactly.
 *
 * The cache is a dense array of lines plus an open-addressing index (linear
 * probing, backward-shift deletion) from line number to array slot; a random
 * victim is a random array slot.  A mutex makes one model safe to share
 * between threads of one process; threads of one attachment are one host.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "beluga_native.h"

typedef struct {
    uint64_t line;
    int dirty;
    uint8_t data[BL_LINE];
} cline;

struct bl_model {
    pthread_mutex_t lock;
    uint32_t cap, count, mask;
    cline *lines;
    uint32_t *index; /* slot + 1, 0 when empty */
    uint64_t rng;
    uint64_t evict_threshold; /* evict when next_random() < threshold */
    uint64_t hits, misses, writebacks, evictions, discarded;
};

/* xorshift64*: the model's only source of randomness. */
static uint64_t next_random(bl_model *m)
{
    m->rng ^= m->rng >> 12;
    m->rng ^= m->rng << 25;
    m->rng ^= m->rng >> 27;
    return m->rng * 0x2545f4914f6cdd1dull;
}

/* Home bucket of a line number in the index. */
static uint32_t bucket(const bl_model *m, uint64_t line)
{
    return (uint32_t)((line * 0x9e3779b97f4a7c15ull) >> 32) & m->mask;
}

/* Array slot holding a line, or -1. */
static int64_t find(const bl_model *m, uint64_t line)
{
    for (uint32_t b = bucket(m, line);; b = (b + 1) & m->mask) {
        uint32_t v = m->index[b];
        if (!v)
            return -1;
        if (m->lines[v - 1].line == line)
            return v - 1;
    }
}

/* Index bucket that points at array slot `slot`. */
static uint32_t bucket_of_slot(const bl_model *m, uint32_t slot)
{
    uint32_t b = bucket(m, m->lines[slot].line);
    while (m->index[b] != slot + 1)
        b = (b + 1) & m->mask;
    return b;
}

/* Remove one bucket from the index, shifting later probes back into place. */
static void index_delete(bl_model *m, uint32_t hole)
{
    for (uint32_t b = (hole + 1) & m->mask; m->index[b]; b = (b + 1) & m->mask) {
        uint32_t home = bucket(m, m->lines[m->index[b] - 1].line);
        /* the entry at b may move to the hole if its home is not in (hole, b] */
        if (((b - home) & m->mask) >= ((b - hole) & m->mask)) {
            m->index[hole] = m->index[b];
            hole = b;
        }
    }
    m->index[hole] = 0;
}

/* Drop array slot `slot`, writing it back first when dirty and asked to. */
static void drop(bl_model *m, bl_mem *mem, uint32_t slot, int write_back)
{
    cline *c = &m->lines[slot];
    if (c->dirty && write_back) {
        memcpy(mem->base + c->line * BL_LINE, c->data, BL_LINE);
        m->writebacks++;
    }
    index_delete(m, bucket_of_slot(m, slot));
    uint32_t last = m->count - 1;
    if (slot != last) {
        uint32_t b = bucket_of_slot(m, last);
        m->lines[slot] = m->lines[last];
        m->index[b] = slot + 1;
    }
    m->count--;
}

/* Evict one random line (written back if dirty). */
static void evict_random(bl_model *m, bl_mem *mem)
{
    if (!m->count)
        return;
    drop(m, mem, (uint32_t)(next_random(m) % m->count), 1);
    m->evictions++;
}

/* Slot of a line, filling it from shared memory on a miss. */
static uint32_t fill(bl_model *m, bl_mem *mem, uint64_t line)
{
    int64_t s = find(m, line);
    if (s >= 0) {
        m->hits++;
        return (uint32_t)s;
    }
    m->misses++;
    if (m->count == m->cap)
        evict_random(m, mem);
    uint32_t slot = m->count++;
    cline *c = &m->lines[slot];
    c->line = line;
    c->dirty = 0;
    memcpy(c->data, mem->base + line * BL_LINE, BL_LINE);
    uint32_t b = bucket(m, line);
    while (m->index[b])
        b = (b + 1) & m->mask;
    m->index[b] = slot + 1;
    return slot;
}

/* After touching a line, maybe evict a random one, as real caches do. */
static void maybe_evict(bl_model *m, bl_mem *mem)
{
    if (m->evict_threshold && next_random(m) < m->evict_threshold)
        evict_random(m, mem);
}

/* Model table: loads through the private cache. */
static void model_load(bl_mem *mem, size_t off, void *dst, size_t n)
{
    bl_model *m = mem->model;
    uint8_t *d = dst;
    pthread_mutex_lock(&m->lock);
    while (n) {
        uint64_t line = off / BL_LINE;
        size_t in = off % BL_LINE, k = BL_LINE - in < n ? BL_LINE - in : n;
        uint32_t slot = fill(m, mem, line);
        memcpy(d, m->lines[slot].data + in, k);
        d += k, off += k, n -= k;
        maybe_evict(m, mem);
    }
    pthread_mutex_unlock(&m->lock);
}

/* Model table: write-allocate stores into the private cache. */
static void model_store(bl_mem *mem, size_t off, const void *src, size_t n)
{
    bl_model *m = mem->model;
    const uint8_t *s = src;
    pthread_mutex_lock(&m->lock);
    while (n) {
        uint64_t line = off / BL_LINE;
        size_t in = off % BL_LINE, k = BL_LINE - in < n ? BL_LINE - in : n;
        uint32_t slot = fill(m, mem, line);
        memcpy(m->lines[slot].data + in, s, k);
        m->lines[slot].dirty = 1;
        s += k, off += k, n -= k;
        maybe_evict(m, mem);
    }
    pthread_mutex_unlock(&m->lock);
}

/* Model table: stores that bypass the cache. */
static void model_nt_store(bl_mem *mem, size_t off, const void *src, size_t n)
{
    bl_model *m = mem->model;
    pthread_mutex_lock(&m->lock);
    for (uint64_t line = off / BL_LINE; n && line <= (off + n - 1) / BL_LINE; line++) {
        int64_t s = find(m, line);
        if (s >= 0)
            drop(m, mem, (uint32_t)s, 1);
    }
    memcpy(mem->base + off, src, n);
    pthread_mutex_unlock(&m->lock);
}

/* Write back (when dirty) every cached line of a range; drop them if asked. */
static void model_range_writeback(bl_mem *mem, size_t off, size_t n, int drop_lines)
{
    bl_model *m = mem->model;
    if (!n)
        return;
    pthread_mutex_lock(&m->lock);
    for (uint64_t line = off / BL_LINE; line <= (off + n - 1) / BL_LINE; line++) {
        int64_t s = find(m, line);
        if (s < 0)
            continue;
        if (drop_lines) {
            drop(m, mem, (uint32_t)s, 1);
        } else if (m->lines[s].dirty) {
            memcpy(mem->base + line * BL_LINE, m->lines[s].data, BL_LINE);
            m->lines[s].dirty = 0;
            m->writebacks++;
        }
    }
    pthread_mutex_unlock(&m->lock);
}

/* Model table: flush (write back and drop). */
static void model_flush(bl_mem *mem, size_t off, size_t n) { model_range_writeback(mem, off, n, 1); }

/* Model table: write back and keep. */
static void model_writeback(bl_mem *mem, size_t off, size_t n)
{
    model_range_writeback(mem, off, n, 0);
}

/* Model table: fences have nothing to order in this model. */
static void model_fence(bl_mem *mem) {}

static const bl_memops model_ops = {
    .name = "model",
    .load = model_load,
    .store = model_store,
    .nt_store = model_nt_store,
    .flush = model_flush,
    .writeback = model_writeback,
    .invalidate = model_flush,
    .sfence = model_fence,
    .mfence = model_fence,
};

/* The table that runs every access through the simulated cache. */
const bl_memops *bl_model_ops(void) { return &model_ops; }

/* A new empty cache of cache_lines lines; NULL when out of memory. */
bl_model *bl_model_new(uint32_t cache_lines, double evict_rate, uint64_t seed)
{
    bl_model *m = calloc(1, sizeof(*m));
    if (!m)
        return NULL;
    pthread_mutex_init(&m->lock, NULL);
    uint32_t buckets = 2;
    while (buckets < 2 * cache_lines)
        buckets <<= 1;
    m->cap = cache_lines;
    m->mask = buckets - 1;
    m->lines = calloc(cache_lines, sizeof(cline));
    m->index = calloc(buckets, sizeof(uint32_t));
    if (!m->lines || !m->index) {
        bl_model_free(m);
        return NULL;
    }
    m->rng = seed * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull;
    if (!m->rng)
        m->rng = 1;
    m->evict_threshold = evict_rate >= 1.0 ? UINT64_MAX : (uint64_t)(evict_rate * 18446744073709551616.0);
    return m;
}

/* Free a cache (its dirty lines are lost, as in a crash). */
void bl_model_free(bl_model *m)
{
    if (!m)
        return;
    pthread_mutex_destroy(&m->lock);
    free(m->lines);
    free(m->index);
    free(m);
}

/* Forget every cached line without writing anything back. */
void bl_model_discard(bl_model *m)
{
    pthread_mutex_lock(&m->lock);
    m->discarded += m->count;
    m->count = 0;
    memset(m->index, 0, (size_t)(m->mask + 1) * sizeof(uint32_t));
    pthread_mutex_unlock(&m->lock);
}

/* hits, misses, write-backs, random evictions, lines discarded. */
void bl_model_stats(bl_model *m, uint64_t out[5])
{
    pthread_mutex_lock(&m->lock);
    out[0] = m->hits, out[1] = m->misses, out[2] = m->writebacks;
    out[3] = m->evictions, out[4] = m->discarded;
    pthread_mutex_unlock(&m->lock);
}
