/*
 * model.c - a simulated non-coherent host in front of a shared mapping.
 *
 * On one coherent machine a missing flush, invalidate or fence can never fail
 * a test.  This model makes it fail: every attachment in "model" mode is one
 * host with a private cache of 64-byte lines, a queue of stores on their way
 * to memory and a list of invalidations not yet complete; the real shared
 * mapping stands for the CXL memory behind them.  It lets through only what
 * x86 promises and reorders what x86 allows.  Each rule names the hardware
 * behaviour it stands for (Intel SDM = Intel 64 and IA-32 Architectures
 * Software Developer's Manual, numbered as in its 2016-2022 editions; AMD
 * APM = AMD64 Architecture Programmer's Manual; section titles are quoted).
 *
 *   cache        A load hits a cached line, however stale; a miss fills the
 *                whole line.  A store is write-allocate: the line changes
 *                privately and is dirty.  Lines are written back whole, so
 *                two hosts writing one line lose data.  (SDM Vol. 3A 11.3
 *                "Methods of caching available": write-back memory.)
 *   eviction     After each line touched, with probability evict_rate, the
 *                least recently used of EVICT_SAMPLES random lines is evicted
 *                (written back if dirty), unless it was touched within the
 *                last HOT_WINDOW line touches; a full cache evicts the same
 *                way without sparing.  Real caches replace (pseudo-)LRU
 *                lines, so a line a host keeps polling stays in its L1 and
 *                stays stale for as long as it is polled.  (SDM Vol. 3A 11.1
 *                "Internal caches, TLBs and buffers".)
 *   write        nt_store bytes go to a write-combining buffer for their
 *   combining    line, not to memory (a cached copy of the line is written
 *                back, if dirty, and dropped first).  Buffers drain at the
 *                next SFENCE or MFENCE, in random order, or earlier: after
 *                each line queued, with probability drain_rate, a random
 *                buffer drains, whole or in random 8-byte pieces, and a full
 *                queue (QUEUE_LINES) drains a random buffer.  Stores without
 *                a fence between them reach memory in any order.  (SDM Vol.
 *                3A 11.3.1 "Buffering of write combining memory locations";
 *                Vol. 1 10.4.6.2 "Caching of temporal vs. non-temporal data";
 *                AMD APM Vol. 2 "Memory barrier interaction with memory
 *                types", in chapter 7 "Memory system".)
 *   weak         flush (CLFLUSHOPT) and writeback (CLWB) of a dirty line put
 *   flushes      the whole line in the same queue: other hosts may see the
 *                old contents until the host's next fence.  (SDM Vol. 2
 *                CLFLUSHOPT, CLWB; Vol. 3A 8.2.2 "Memory ordering in P6 and
 *                more recent processor families".)
 *   late         flush and invalidate leave a clean line readable until the
 *   invalidation host's next MFENCE, so loads before it may hit the old copy,
 *                as a load that passes a CLFLUSHOPT does.  A store to such a
 *                line completes the flush first.  At most DOOM_LINES wait;
 *                beyond that the oldest completes to make room (a host that
 *                never fences still has its old flushes done, its latest
 *                ones in flight).
 *   speculative  When an invalidation completes, the line may come straight
 *   refill       back (probability refill_rate) with the memory contents of
 *                that moment, as prefetchers and speculative loads bring
 *                lines in at any time.  Only a load issued after the fence
 *                that follows the invalidate is sure to see memory as it was
 *                at that fence.  (SDM Vol. 2 CLFLUSH, CLFLUSHOPT, MFENCE:
 *                "data could be speculatively loaded into a cache line just
 *                before, during, or after".)
 *   store        Loads pass stores: SFENCE orders stores only, so the loads
 *   buffer (TSO) after it may still see old lines (the two rules above); only
 *                MFENCE orders later loads after earlier stores, flushes and
 *                invalidations, and a Dekker handshake without it fails.  The
 *                queue itself drains at SFENCE, not later, because a host's
 *                later stores must not pass it, including stores the model
 *                cannot see (a system call that tells another process).
 *                (SDM Vol. 3A 8.2.3.4 "Loads may be reordered with earlier
 *                stores to different locations"; AMD APM Vol. 1 chapter 3,
 *                "Forcing memory order": loads may pass an SFENCE.)
 *   own order    A host sees its own stores: a fill overlays the host's
 *                queued bytes of the line, and a line is never written back
 *                ahead of its own queued bytes.  (SDM Vol. 3A 8.2.3.5
 *                "Intra-processor forwarding is allowed".)
 *   invalidate   An invalidate drops a dirty line without writing it back
 *   drops        (counted as dirty_dropped).  CLFLUSHOPT would write it back,
 *                but the operation promises only the drop: a host that needs
 *                its stores in memory flushes them, and a verify-read of a
 *                line written without a flush must not publish that write.
 *   crash        crash_after(k) kills the host once k more lines (or pieces
 *                of lines) of its own have reached memory: the one that would
 *                be the k+1-th, and everything it holds, queues or stores
 *                later, never lands.  Sweeping k over an operation freezes
 *                every state memory passes through on the way, so a test can
 *                look at each at leisure: a missing SFENCE between two stores
 *                shows as the second landed without the first, whatever the
 *                timing (a concurrent reader could be looking at any of those
 *                states; a power cut could leave any of them behind).
 *   fork         A forked child inherits a copy of every model.  Its copy
 *                starts empty (lines, queue and invalidations forgotten,
 *                never written back: they are the parent's) with its own
 *                random stream; pthread_atfork holds every model's mutex
 *                across fork(), so no child inherits one locked mid-update.
 *
 * Limits, all on the lenient side: a load of a line the host neither holds
 * nor has invalidated since its last MFENCE sees memory as it is at the load
 * (a real store buffer could still hold the host's earlier stores back from
 * it); queued bytes drain in 8-byte pieces at the smallest, never torn below
 * that; and time is counted in this host's operations, so a host that does
 * nothing keeps its lines as they are.
 *
 * All randomness comes from a seeded xorshift and all timing is counted in
 * operations, never in seconds, so a failing trial replays exactly.
 *
 * The cache is a dense array of lines plus an open-addressing index (linear
 * probing, backward-shift deletion) from line number to array slot.  One
 * mutex per model makes it safe to share between threads of one process;
 * threads of one attachment are one host.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "beluga_native.h"

#define QUEUE_LINES 16  /* write-combining buffers and write-backs in flight */
#define DOOM_LINES 64   /* invalidations waiting for the next MFENCE */
#define EVICT_SAMPLES 4 /* random lines looked at to find an LRU victim */
#define HOT_WINDOW 64   /* line touches during which a line is never evicted at random */

typedef struct {
    uint64_t line;
    uint64_t used; /* the model's clock at the last touch */
    uint8_t dirty;
    uint8_t doomed; /* flushed or invalidated: dropped at the next MFENCE */
    uint8_t data[BL_LINE];
} cline;

typedef struct {
    uint64_t line;
    uint64_t mask; /* bytes not yet in memory */
    uint8_t data[BL_LINE];
} qline;

struct bl_model {
    pthread_mutex_t lock;
    bl_model *prev, *next; /* every live model, for the fork handlers */
    uint32_t cap, count, mask;
    cline *lines;
    uint32_t *index; /* slot + 1, 0 when empty */
    qline queue[QUEUE_LINES];
    uint32_t queued;
    uint64_t doomed[DOOM_LINES];
    uint32_t ndoomed;
    uint64_t clock; /* line touches so far */
    uint64_t rng;
    uint64_t evict_threshold, drain_threshold, refill_threshold;
    uint64_t stats[BL_MODEL_NSTATS];
    int64_t crash_budget; /* landings left before the host dies; -1: never */
    int dead;             /* crashed: nothing of this host reaches memory any more */
};

static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static bl_model *registry;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

/* xorshift64*: the model's only source of randomness. */
static uint64_t next_random(bl_model *m)
{
    m->rng ^= m->rng >> 12;
    m->rng ^= m->rng << 25;
    m->rng ^= m->rng >> 27;
    return m->rng * 0x2545f4914f6cdd1dull;
}

/* A probability as a threshold that next_random() falls under. */
static uint64_t threshold(double rate)
{
    return rate >= 1.0 ? UINT64_MAX : (uint64_t)(rate * 18446744073709551616.0);
}

/* True with the probability a threshold stands for. */
static int chance(bl_model *m, uint64_t t) { return t && next_random(m) < t; }

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

/* Bytes [in, in + k) of a line as a mask. */
static uint64_t span_mask(size_t in, size_t k)
{
    return k >= BL_LINE ? ~0ull : ((1ull << k) - 1) << in;
}

/* Whether a write of this host reaches memory now: counts it, or kills the host (crash_after). */
static int lands(bl_model *m)
{
    if (m->dead)
        return 0;
    if (m->crash_budget == 0) {
        m->dead = 1;
        return 0;
    }
    if (m->crash_budget > 0)
        m->crash_budget--;
    m->stats[BL_MS_LANDED]++;
    return 1;
}

/* Queue slot of a line, or -1. */
static int queued_at(const bl_model *m, uint64_t line)
{
    for (uint32_t q = 0; q < m->queued; q++)
        if (m->queue[q].line == line)
            return (int)q;
    return -1;
}

/* Write the bytes of queue slot q that `mask` selects to memory; free the slot when done. */
static void queue_write(bl_model *m, bl_mem *mem, uint32_t q, uint64_t mask)
{
    qline *e = &m->queue[q];
    uint8_t *dst = mem->base + e->line * BL_LINE;
    mask &= e->mask;
    if (!lands(m)) {
        /* a dead host's bytes leave the queue without reaching memory */
    } else if (mask == ~0ull) {
        memcpy(dst, e->data, BL_LINE);
    } else {
        for (int piece = 0; piece < (int)BL_LINE; piece += 8) {
            uint8_t bits = (uint8_t)(mask >> piece);
            if (bits == 0xff)
                memcpy(dst + piece, e->data + piece, 8);
            else
                for (int i = piece; bits; i++, bits >>= 1)
                    if (bits & 1)
                        dst[i] = e->data[i];
        }
    }
    e->mask &= ~mask;
    if (!e->mask)
        m->queue[q] = m->queue[--m->queued];
}

/* Drain one random queued line before any fence: whole, or some of its 8-byte pieces. */
static void drain_early(bl_model *m, bl_mem *mem)
{
    uint64_t r = next_random(m), mask = ~0ull;
    if (r & 1) { /* a partial drain: the pieces picked by 8 random bits */
        mask = 0;
        for (int piece = 0; piece < 8; piece++)
            if (r >> (8 + piece) & 1)
                mask |= 0xffull << (8 * piece);
    }
    uint32_t q = (uint32_t)((r >> 16) % m->queued);
    if (!(mask & m->queue[q].mask))
        mask = ~0ull;
    queue_write(m, mem, q, mask);
    m->stats[BL_MS_EARLY_DRAINS]++;
}

/* Drain every queued line, in random order: what SFENCE and MFENCE wait for. */
static void drain_all(bl_model *m, bl_mem *mem)
{
    while (m->queued)
        queue_write(m, mem, (uint32_t)(next_random(m) % m->queued), ~0ull);
}

/* Drain one line's queued bytes, so that memory sees this host's writes to it in order. */
static void drain_line(bl_model *m, bl_mem *mem, uint64_t line)
{
    int q = queued_at(m, line);
    if (q >= 0)
        queue_write(m, mem, (uint32_t)q, ~0ull);
}

/* Queue bytes [in, in + k) of a line on their way to memory. */
static void enqueue(bl_model *m, bl_mem *mem, uint64_t line, size_t in, const void *src, size_t k)
{
    int q = queued_at(m, line);
    if (q < 0) {
        if (m->queued == QUEUE_LINES) {
            queue_write(m, mem, (uint32_t)(next_random(m) % m->queued), ~0ull);
            m->stats[BL_MS_EARLY_DRAINS]++;
        }
        q = (int)m->queued++;
        m->queue[q].line = line;
        m->queue[q].mask = 0;
    }
    memcpy(m->queue[q].data + in, src, k);
    m->queue[q].mask |= span_mask(in, k);
    if (chance(m, m->drain_threshold))
        drain_early(m, mem);
}

/* Drop array slot `slot`, writing it back first when dirty and asked to. */
static void drop(bl_model *m, bl_mem *mem, uint32_t slot, int write_back)
{
    cline *c = &m->lines[slot];
    if (c->dirty && write_back) {
        drain_line(m, mem, c->line);
        if (lands(m))
            memcpy(mem->base + c->line * BL_LINE, c->data, BL_LINE);
        m->stats[BL_MS_WRITEBACKS]++;
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

/* The least recently used of a few random lines; -1 when it is hot and spared. */
static int64_t victim(bl_model *m, int spare_hot)
{
    uint32_t best = (uint32_t)(next_random(m) % m->count);
    for (int i = 1; i < EVICT_SAMPLES; i++) {
        uint32_t s = (uint32_t)(next_random(m) % m->count);
        if (m->lines[s].used < m->lines[best].used)
            best = s;
    }
    if (spare_hot && m->clock - m->lines[best].used < HOT_WINDOW)
        return -1;
    return best;
}

/* Evict a victim (written back if dirty), as a cache does to make room. */
static void evict(bl_model *m, bl_mem *mem, int spare_hot)
{
    int64_t v = m->count ? victim(m, spare_hot) : -1;
    if (v >= 0) {
        drop(m, mem, (uint32_t)v, 1);
        m->stats[BL_MS_EVICTIONS]++;
    }
}

/* Bring a line into the cache from memory, with this host's queued bytes over it. */
static uint32_t insert(bl_model *m, bl_mem *mem, uint64_t line)
{
    if (m->count == m->cap)
        evict(m, mem, 0);
    uint32_t slot = m->count++;
    cline *c = &m->lines[slot];
    c->line = line;
    c->used = m->clock;
    c->dirty = c->doomed = 0;
    memcpy(c->data, mem->base + line * BL_LINE, BL_LINE);
    int q = queued_at(m, line);
    if (q >= 0)
        for (int i = 0; i < (int)BL_LINE; i++)
            if (m->queue[q].mask >> i & 1)
                c->data[i] = m->queue[q].data[i];
    uint32_t b = bucket(m, line);
    while (m->index[b])
        b = (b + 1) & m->mask;
    m->index[b] = slot + 1;
    return slot;
}

/* Slot of a line, filling it on a miss; the line counts as just used. */
static uint32_t touch(bl_model *m, bl_mem *mem, uint64_t line)
{
    int64_t s = find(m, line);
    m->clock++;
    if (s >= 0) {
        m->stats[BL_MS_HITS]++;
        m->lines[s].used = m->clock;
        return (uint32_t)s;
    }
    m->stats[BL_MS_MISSES]++;
    return insert(m, mem, line);
}

/* After touching a line, maybe evict a cold one, as real caches do. */
static void maybe_evict(bl_model *m, bl_mem *mem)
{
    if (chance(m, m->evict_threshold))
        evict(m, mem, 1);
}

/* Queue a cached line's dirty contents for memory (a write-back in flight); it stays, clean. */
static void write_back_async(bl_model *m, bl_mem *mem, uint32_t slot)
{
    cline *c = &m->lines[slot];
    if (!c->dirty)
        return;
    c->dirty = 0;
    m->stats[BL_MS_WRITEBACKS]++;
    enqueue(m, mem, c->line, 0, c->data, BL_LINE);
}

/* Start an invalidation: the line stays readable until the next MFENCE. */
static void doom(bl_model *m, bl_mem *mem, uint64_t line)
{
    int64_t s = find(m, line);
    if (s >= 0 && m->lines[s].doomed)
        return;
    if (m->ndoomed == DOOM_LINES) { /* too many in flight: the oldest completes */
        int64_t old = find(m, m->doomed[0]);
        if (old >= 0 && m->lines[old].doomed)
            drop(m, mem, (uint32_t)old, 1);
        memmove(m->doomed, m->doomed + 1, (DOOM_LINES - 1) * sizeof(m->doomed[0]));
        m->ndoomed--;
        s = find(m, line); /* the drop may have moved this line's slot */
    }
    if (s >= 0)
        m->lines[s].doomed = 1;
    m->doomed[m->ndoomed++] = line;
}

/* Complete every pending invalidation (at MFENCE); a line may be refilled at once. */
static void complete_invalidations(bl_model *m, bl_mem *mem)
{
    for (uint32_t i = 0; i < m->ndoomed; i++) {
        int64_t s = find(m, m->doomed[i]);
        if (s >= 0 && !m->lines[s].doomed)
            continue; /* loaded again since: that copy is newer than the invalidate */
        if (s >= 0)
            drop(m, mem, (uint32_t)s, 1);
        if (chance(m, m->refill_threshold)) {
            insert(m, mem, m->doomed[i]);
            m->stats[BL_MS_REFILLS]++;
        }
    }
    m->ndoomed = 0;
}

/* Model table: loads through the private cache (own queued bytes included). */
static void model_load(bl_mem *mem, size_t off, void *dst, size_t n)
{
    bl_model *m = mem->model;
    uint8_t *d = dst;
    pthread_mutex_lock(&m->lock);
    while (n) {
        uint64_t line = off / BL_LINE;
        size_t in = off % BL_LINE, k = BL_LINE - in < n ? BL_LINE - in : n;
        memcpy(d, m->lines[touch(m, mem, line)].data + in, k);
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
        int64_t old = find(m, line);
        if (old >= 0 && m->lines[old].doomed)
            drop(m, mem, (uint32_t)old, 1); /* the flush completes before the store */
        uint32_t slot = touch(m, mem, line);
        memcpy(m->lines[slot].data + in, s, k);
        m->lines[slot].dirty = 1;
        s += k, off += k, n -= k;
        maybe_evict(m, mem);
    }
    pthread_mutex_unlock(&m->lock);
}

/* Model table: stores into write-combining buffers, bypassing the cache. */
static void model_nt_store(bl_mem *mem, size_t off, const void *src, size_t n)
{
    bl_model *m = mem->model;
    const uint8_t *s = src;
    pthread_mutex_lock(&m->lock);
    while (n) {
        uint64_t line = off / BL_LINE;
        size_t in = off % BL_LINE, k = BL_LINE - in < n ? BL_LINE - in : n;
        int64_t slot = find(m, line);
        if (slot >= 0) { /* the cached copy goes first: written back if dirty, dropped */
            write_back_async(m, mem, (uint32_t)slot);
            drop(m, mem, (uint32_t)slot, 0);
        }
        enqueue(m, mem, line, in, s, k);
        s += k, off += k, n -= k;
    }
    pthread_mutex_unlock(&m->lock);
}

/* Apply a per-line operation to every line of [off, off + n) under the lock. */
static void each_line(bl_mem *mem, size_t off, size_t n,
                      void (*op)(bl_model *, bl_mem *, uint64_t))
{
    bl_model *m = mem->model;
    if (!n)
        return;
    pthread_mutex_lock(&m->lock);
    for (uint64_t line = off / BL_LINE; line <= (off + n - 1) / BL_LINE; line++)
        op(m, mem, line);
    pthread_mutex_unlock(&m->lock);
}

/* CLFLUSHOPT on one line: write back (async), then invalidate (late). */
static void flush_line(bl_model *m, bl_mem *mem, uint64_t line)
{
    int64_t s = find(m, line);
    if (s >= 0)
        write_back_async(m, mem, (uint32_t)s);
    doom(m, mem, line);
}

/* CLWB on one line: write back (async) and keep it. */
static void writeback_line(bl_model *m, bl_mem *mem, uint64_t line)
{
    int64_t s = find(m, line);
    if (s >= 0)
        write_back_async(m, mem, (uint32_t)s);
}

/* Invalidate one line: a dirty copy is dropped unwritten, a clean one lingers. */
static void invalidate_line(bl_model *m, bl_mem *mem, uint64_t line)
{
    int64_t s = find(m, line);
    if (s >= 0 && m->lines[s].dirty) {
        drop(m, mem, (uint32_t)s, 0);
        m->stats[BL_MS_DIRTY_DROPPED]++;
    }
    doom(m, mem, line);
}

/* Model table: flush (write back and drop). */
static void model_flush(bl_mem *mem, size_t off, size_t n) { each_line(mem, off, n, flush_line); }

/* Model table: write back and keep. */
static void model_writeback(bl_mem *mem, size_t off, size_t n)
{
    each_line(mem, off, n, writeback_line);
}

/* Model table: drop before a read. */
static void model_invalidate(bl_mem *mem, size_t off, size_t n)
{
    each_line(mem, off, n, invalidate_line);
}

/* Model table: SFENCE: every queued store and write-back reaches memory. */
static void model_sfence(bl_mem *mem)
{
    bl_model *m = mem->model;
    pthread_mutex_lock(&m->lock);
    drain_all(m, mem);
    pthread_mutex_unlock(&m->lock);
}

/* Model table: MFENCE: SFENCE, then every invalidation completes. */
static void model_mfence(bl_mem *mem)
{
    bl_model *m = mem->model;
    pthread_mutex_lock(&m->lock);
    drain_all(m, mem);
    complete_invalidations(m, mem);
    pthread_mutex_unlock(&m->lock);
}

/* Model table: a load, then the CRC of what it loaded (the model has no faster order). */
static uint32_t model_load_crc(bl_mem *mem, size_t off, void *dst, size_t n, uint32_t crc)
{
    model_load(mem, off, dst, n);
    return bl_crc32c(crc, dst, n);
}

/* A prefetch is only a hint: the simulated host ignores it. */
static void model_prefetch(bl_mem *mem, size_t off, size_t n) {}

/* Model table: a device reads through the root complex, which snoops this host's cache:
 * a line the host holds (however stale, doomed or not) is what the device gets, else
 * memory (write-combining buffers are not snooped).  Nothing is filled or touched. */
static void model_dma_load(bl_mem *mem, size_t off, void *dst, size_t n)
{
    bl_model *m = mem->model;
    uint8_t *d = dst;
    pthread_mutex_lock(&m->lock);
    while (n) {
        uint64_t line = off / BL_LINE;
        size_t in = off % BL_LINE, k = BL_LINE - in < n ? BL_LINE - in : n;
        int64_t s = find(m, line);
        memcpy(d, s >= 0 ? m->lines[s].data + in : mem->base + off, k);
        d += k, off += k, n -= k;
    }
    pthread_mutex_unlock(&m->lock);
}

/* Model table: a device's write snoops and drops this host's cached copy of each line
 * (written back first when dirty, as the snoop of a modified line does), then lands. */
static void model_dma_store(bl_mem *mem, size_t off, const void *src, size_t n)
{
    bl_model *m = mem->model;
    const uint8_t *s = src;
    pthread_mutex_lock(&m->lock);
    while (n) {
        uint64_t line = off / BL_LINE;
        size_t in = off % BL_LINE, k = BL_LINE - in < n ? BL_LINE - in : n;
        int64_t slot = find(m, line);
        if (slot >= 0)
            drop(m, mem, (uint32_t)slot, 1);
        memcpy(mem->base + off, s, k);
        s += k, off += k, n -= k;
    }
    pthread_mutex_unlock(&m->lock);
}

static const bl_memops model_ops = {
    .name = "model",
    .load = model_load,
    .load_crc = model_load_crc,
    .store = model_store,
    .nt_store = model_nt_store,
    .flush = model_flush,
    .writeback = model_writeback,
    .invalidate = model_invalidate,
    .prefetch = model_prefetch,
    .sfence = model_sfence,
    .mfence = model_mfence,
    .dma_load = model_dma_load,
    .dma_store = model_dma_store,
};

/* The table that runs every access through the simulated host. */
const bl_memops *bl_model_ops(void) { return &model_ops; }

/* Forget every line, queued store and invalidation, writing nothing back. */
static void forget(bl_model *m)
{
    m->count = m->queued = m->ndoomed = 0;
    memset(m->index, 0, (size_t)(m->mask + 1) * sizeof(uint32_t));
}

/* pthread_atfork prepare: no model may be mid-update while the process is copied. */
static void before_fork(void)
{
    pthread_mutex_lock(&registry_lock);
    for (bl_model *m = registry; m; m = m->next)
        pthread_mutex_lock(&m->lock);
}

/* pthread_atfork parent: carry on. */
static void after_fork_parent(void)
{
    for (bl_model *m = registry; m; m = m->next)
        pthread_mutex_unlock(&m->lock);
    pthread_mutex_unlock(&registry_lock);
}

/* pthread_atfork child: every inherited model starts empty, with a stream of its own. */
static void after_fork_child(void)
{
    for (bl_model *m = registry; m; m = m->next) {
        forget(m);
        m->crash_budget = -1, m->dead = 0;
        m->rng = (m->rng ^ 0xd1b54a32d192ed03ull) * 0x9e3779b97f4a7c15ull | 1;
        pthread_mutex_unlock(&m->lock);
    }
    pthread_mutex_unlock(&registry_lock);
}

/* Register the fork handlers, once per process. */
static void install_fork_handlers(void)
{
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}

/* A new empty host; NULL when out of memory.  Rates are probabilities in [0, 1]. */
bl_model *bl_model_new(uint32_t cache_lines, double evict_rate, double drain_rate,
                       double refill_rate, uint64_t seed)
{
    pthread_once(&atfork_once, install_fork_handlers);
    bl_model *m = calloc(1, sizeof(*m));
    if (!m)
        return NULL;
    uint32_t buckets = 2;
    while (buckets < 2 * cache_lines)
        buckets <<= 1;
    m->cap = cache_lines;
    m->mask = buckets - 1;
    m->lines = calloc(cache_lines, sizeof(cline));
    m->index = calloc(buckets, sizeof(uint32_t));
    if (!m->lines || !m->index) {
        free(m->lines);
        free(m->index);
        free(m);
        return NULL;
    }
    pthread_mutex_init(&m->lock, NULL);
    m->rng = seed * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull;
    if (!m->rng)
        m->rng = 1;
    m->evict_threshold = threshold(evict_rate);
    m->drain_threshold = threshold(drain_rate);
    m->refill_threshold = threshold(refill_rate);
    m->crash_budget = -1;
    pthread_mutex_lock(&registry_lock);
    m->next = registry;
    if (registry)
        registry->prev = m;
    registry = m;
    pthread_mutex_unlock(&registry_lock);
    return m;
}

/* Free a host: its dirty lines and unfenced stores are lost, as in a crash. */
void bl_model_free(bl_model *m)
{
    if (!m)
        return;
    pthread_mutex_lock(&registry_lock);
    if (m->prev)
        m->prev->next = m->next;
    else
        registry = m->next;
    if (m->next)
        m->next->prev = m->prev;
    pthread_mutex_unlock(&registry_lock);
    pthread_mutex_destroy(&m->lock);
    free(m->lines);
    free(m->index);
    free(m);
}

/* Forget every cached line and queued store without writing anything back (a crash). */
void bl_model_discard(bl_model *m)
{
    pthread_mutex_lock(&m->lock);
    m->stats[BL_MS_DISCARDED] += m->count + m->queued;
    forget(m);
    pthread_mutex_unlock(&m->lock);
}

/* Kill the host once `lines` more of its writes have reached memory (see "crash"). */
void bl_model_crash_after(bl_model *m, uint64_t lines)
{
    pthread_mutex_lock(&m->lock);
    m->crash_budget = lines > INT64_MAX ? INT64_MAX : (int64_t)lines;
    pthread_mutex_unlock(&m->lock);
}

/* Whether the host has crashed (crash_after). */
int bl_model_crashed(bl_model *m)
{
    pthread_mutex_lock(&m->lock);
    int dead = m->dead;
    pthread_mutex_unlock(&m->lock);
    return dead;
}

/* The counters, indexed by BL_MS_*. */
void bl_model_stats(bl_model *m, uint64_t out[BL_MODEL_NSTATS])
{
    pthread_mutex_lock(&m->lock);
    memcpy(out, m->stats, sizeof(m->stats));
    pthread_mutex_unlock(&m->lock);
}
