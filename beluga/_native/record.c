/*
 * record.c - invalidate only what can be stale: the read record of one host.
 *
 * A GPU reads the pool through its host's root complex, which snoops the
 * host's CPU caches: a line a CPU path of this host cached is what the GPU
 * gets, even after another host rewrote the block in memory (no hardware
 * keeps caches of different hosts coherent; the single-writer / many-reader
 * protocol of beluga.coherence is how readers cope).  A CPU reader copes by
 * invalidating every line right before it loads it.  A GPU reader has no
 * such instruction; the CPU must invalidate for it, and invalidating every
 * range of every GPU load costs more than the copy (32,768 CLFLUSHOPTs per
 * 2 MiB block, found on 2026-12-04).  Yet a line can be stale in this host's
 * caches only where this host put it there.  So each attachment (one host,
 * as everywhere in the protocol) keeps one state per granule of its mapping
 * and the GPU path invalidates only granules whose state says a stale line
 * may be there.
 *
 * STATES (one u64 per granule; granules are the smallest power of two of at
 * least 4 KiB that keeps the record to BL_REC_MAX_GRANULES, so never larger
 * than 8 MiB; block versions are unique across a pool forever, see
 * server/service.py, so granules may hold several blocks):
 *
 *   START    since the record began, unknown: a line may be cached from
 *            before (a CPU cache outlives the process that filled it).
 *   CLEAN    this host holds no line of the granule that can be stale.
 *   TOUCHED  a CPU path of this host loaded, stored, prefetched, flushed or
 *            invalidated there: lines of any content may be cached, and more
 *            may arrive from prefetches still in flight.
 *   v        a block version: lines may be cached, holding version v's
 *            committed bytes and nothing else.
 *
 * MARKING.  The recording table wraps the attachment's table (native or
 * model) and sets TOUCHED after every load, load_crc, store, prefetch, flush
 * and invalidate, once the operation is done (a store that follows a load in
 * program order is never seen before it: x86 keeps loads before later stores,
 * and the release store says so to the compiler).  Invalidates and flushes
 * mark too: a speculative refill can bring a line back when its invalidation
 * completes (model.c "speculative refill"), and a CPU path may invalidate rows
 * it then does not load.  Non-temporal stores bring no line in; they do not
 * mark.  Marking costs one load of the state (and one store the first time).
 *
 * A DEVICE READ of ranges of a block of version v (bl_invalidate_stale; v 0
 * for an unversioned read) looks at each granule the ranges touch:
 *
 *   CLEAN, or v itself           nothing to do;
 *   START                        invalidate the granule; it becomes CLEAN;
 *   TOUCHED, another version w   invalidate the granule; it becomes v
 *                                (TOUCHED for an unversioned read);
 *
 * then one MFENCE, then the device reads.  The new state is set by a
 * compare-and-swap before the invalidation, so a CPU path that marks the
 * granule meanwhile is never lost: either its line is loaded before the
 * invalidation (and dropped by it) or its mark comes after the swap (and the
 * next device read invalidates again).
 *
 * Why "becomes v" and not "becomes CLEAN" after TOUCHED: the invalidation's
 * own completion may refill a line (a prefetch triggered by the CPU access
 * that marked it, still in flight; the model refills at random), and that
 * line stays cached after the device read.  It holds the memory of that
 * moment.  The reader checked block v's header PUBLISHED before the
 * invalidation and checks it again after the device read; a published block
 * is immutable and its extent is rewritten only after a new WRITING header
 * (block.c), so while v is published such a line holds v's bytes.  A later
 * device read of v (still published: versions never come back) may use it;
 * a read of any other version invalidates again.  START becomes CLEAN: no
 * access of this host to the granule is in flight, and a CLFLUSHOPT brings
 * nothing in.  The model starts every attachment with an empty cache, so its
 * record starts CLEAN and never sees START; the native record starts START.
 *
 * Steady state: a block this host's CPUs never touched is never invalidated
 * by a GPU load (after its first, in native mode); one a CPU path read is
 * invalidated at its next GPU load and at the first load of each later
 * version.  Writes need nothing: a device's write snoops and drops the CPU's
 * copies of its lines.
 *
 * WHAT THE RECORD DOES NOT SEE, on real hardware: other attachments of the
 * same machine share its caches (several processes of one machine are one
 * host to the hardware, several to the pool), and hardware prefetchers may
 * fetch lines near an access.  Granules of at least 4 KiB hold the L2
 * streamer (it stays inside a 4 KiB page); for the rest the GPU path does not
 * rely on the record alone: it checks every block's CRC32C on the GPU, and a
 * block that fails is read once more with every one of its ranges invalidated
 * (beluga/transfer/gpu).  A stale line can then cost a second read, never
 * wrong bytes (barring a CRC collision, which the model's tests force on
 * purpose to show the record itself is right).
 *
 * Sabotage points DEVICE_READ_INVALIDATE and DEVICE_READ_MFENCE remove the
 * two steps; tests/sabotage_checks/blocks.py catches each under the model.
 */
#include <stdlib.h>

#include "beluga_native.h"

/* Set TOUCHED on every granule of [off, off + n): after the access that may have cached them. */
static inline void mark(bl_mem *m, size_t off, size_t n)
{
    if (!n || off >= m->size)
        return;
    size_t last = (off + n - 1) >> m->rec_shift;
    for (size_t g = off >> m->rec_shift; g <= last && g < m->rec_count; g++)
        if (atomic_load_explicit(&m->rec[g], memory_order_relaxed) != BL_REC_TOUCHED)
            atomic_store_explicit(&m->rec[g], BL_REC_TOUCHED, memory_order_release);
}

/* Recording table: load, then mark. */
static void rec_load(bl_mem *m, size_t off, void *dst, size_t n)
{
    m->inner->load(m, off, dst, n);
    mark(m, off, n);
}

/* Recording table: load with its CRC, then mark. */
static uint32_t rec_load_crc(bl_mem *m, size_t off, void *dst, size_t n, uint32_t crc)
{
    crc = m->inner->load_crc(m, off, dst, n, crc);
    mark(m, off, n);
    return crc;
}

/* Recording table: a plain store allocates its lines; mark. */
static void rec_store(bl_mem *m, size_t off, const void *src, size_t n)
{
    m->inner->store(m, off, src, n);
    mark(m, off, n);
}

/* Recording table: non-temporal stores bring no line in. */
static void rec_nt_store(bl_mem *m, size_t off, const void *src, size_t n)
{
    m->inner->nt_store(m, off, src, n);
}

/* Recording table: a flush may be followed by a speculative refill; mark. */
static void rec_flush(bl_mem *m, size_t off, size_t n)
{
    m->inner->flush(m, off, n);
    mark(m, off, n);
}

/* Recording table: a write-back keeps the line (already marked by what cached it). */
static void rec_writeback(bl_mem *m, size_t off, size_t n) { m->inner->writeback(m, off, n); }

/* Recording table: an invalidation may be followed by a speculative refill; mark. */
static void rec_invalidate(bl_mem *m, size_t off, size_t n)
{
    m->inner->invalidate(m, off, n);
    mark(m, off, n);
}

/* Recording table: a prefetch brings lines in; mark. */
static void rec_prefetch(bl_mem *m, size_t off, size_t n)
{
    m->inner->prefetch(m, off, n);
    mark(m, off, n);
}

/* Recording table: fences pass through. */
static void rec_sfence(bl_mem *m) { m->inner->sfence(m); }

/* Recording table: fences pass through. */
static void rec_mfence(bl_mem *m) { m->inner->mfence(m); }

/* Recording table: a device's read fills no CPU line. */
static void rec_dma_load(bl_mem *m, size_t off, void *dst, size_t n)
{
    m->inner->dma_load(m, off, dst, n);
}

/* Recording table: a device's write fills no CPU line. */
static void rec_dma_store(bl_mem *m, size_t off, const void *src, size_t n)
{
    m->inner->dma_store(m, off, src, n);
}

static const bl_memops recording_ops = {
    .name = NULL, /* the wrapped table's name is the mode */
    .load = rec_load,
    .load_crc = rec_load_crc,
    .store = rec_store,
    .nt_store = rec_nt_store,
    .flush = rec_flush,
    .writeback = rec_writeback,
    .invalidate = rec_invalidate,
    .prefetch = rec_prefetch,
    .sfence = rec_sfence,
    .mfence = rec_mfence,
    .dma_load = rec_dma_load,
    .dma_store = rec_dma_store,
};

/* Start the record of an attachment (every granule START, or CLEAN); 0, or -1 out of memory. */
int bl_record_init(bl_mem *m, int clean)
{
    unsigned shift = 12;
    while (((m->size + ((size_t)1 << shift) - 1) >> shift) > BL_REC_MAX_GRANULES)
        shift++;
    size_t count = (m->size + ((size_t)1 << shift) - 1) >> shift;
    _Atomic uint64_t *rec = calloc(count ? count : 1, sizeof(uint64_t));
    if (!rec)
        return -1;
    for (size_t g = 0; clean && g < count; g++)
        atomic_init(&rec[g], BL_REC_CLEAN);
    m->rec = rec, m->rec_count = count, m->rec_shift = shift;
    m->inner = m->ops;
    m->ops = &recording_ops;
    return 0;
}

/* Stop recording and free the record (the attachment is going away). */
void bl_record_free(bl_mem *m)
{
    if (m->inner)
        m->ops = m->inner;
    free((void *)m->rec);
    m->rec = NULL, m->inner = NULL, m->rec_count = 0;
}

/* The state of the granule holding offset off (BL_REC_TOUCHED past the end, or unrecorded). */
uint64_t bl_record_state(const bl_mem *m, size_t off)
{
    size_t g = m->rec ? off >> m->rec_shift : 0;
    return m->rec && g < m->rec_count ? atomic_load(&m->rec[g]) : BL_REC_TOUCHED;
}

/*
 * Before a device reads `n` ranges (off, len, version) of the mapping:
 * invalidate each granule that may hold a stale line (see the top of the
 * file), then one MFENCE.  Returns the bytes invalidated (0: no fence was
 * needed).  Ranges must lie inside the mapping (the binding checks).
 */
size_t bl_invalidate_stale(bl_mem *m, const uint64_t *ranges, size_t n)
{
    size_t bytes = 0, granule = (size_t)1 << m->rec_shift;
    const bl_memops *raw = m->inner ? m->inner : m->ops; /* our own steps mark nothing */
    for (size_t i = 0; i < n; i++) {
        uint64_t off = ranges[3 * i], len = ranges[3 * i + 1], v = ranges[3 * i + 2];
        if (!len)
            continue;
        size_t first = off >> m->rec_shift, last = (off + len - 1) >> m->rec_shift;
        for (size_t g = first; g <= last; g++) {
            int stale = 1;
            if (m->rec && g < m->rec_count) {
                uint64_t s = atomic_load(&m->rec[g]);
                for (;;) {
                    if (s == BL_REC_CLEAN || (v && s == v)) {
                        stale = 0;
                        break;
                    }
                    uint64_t next = s == BL_REC_START ? BL_REC_CLEAN : v ? v : BL_REC_TOUCHED;
                    if (atomic_compare_exchange_weak(&m->rec[g], &s, next))
                        break;
                }
            }
            if (!stale)
                continue;
            size_t start = g << m->rec_shift;
            size_t span = start + granule > m->size ? m->size - start : granule;
            if (BL_STEP(DEVICE_READ_INVALIDATE))
                raw->invalidate(m, start, span);
            bytes += span;
        }
    }
    if (bytes && BL_STEP(DEVICE_READ_MFENCE))
        raw->mfence(m);
    return bytes;
}
