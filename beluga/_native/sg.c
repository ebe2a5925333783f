/*
 * sg.c - one call for a whole scatter-gather list: gather-write and scatter-read.
 *
 * KV blocks move between an engine's paged cache and the pool as one table
 * of rows (buffer index, buffer offset, pool offset, length), all uint64:
 * one call per batch, with no limit on the number of pieces.  A table is
 * checked whole (bl_sg_check) before any byte moves, so a bad row fails the
 * call instead of half-running it; then it runs (bl_sg_run):
 *
 *   gather-write   every row stored non-temporally ; SFENCE, so the rows are
 *                  in memory before the caller tells anyone;
 *   scatter-read   every row's pool range invalidated ; MFENCE ; every row
 *                  loaded.  No checksum: blockio.c is the validated read.
 *
 * Both run through the Memory's memops table (native or model) and their
 * fences and invalidations are sabotage points.  Python calls them as
 * Memory.gather_write and Memory.scatter_read (memory_py.c); blockio.c runs
 * the same kind of table with checksums.
 */
#include <stdio.h>

#include "beluga_native.h"

/*
 * Check every row against the buffers (buf_len[i] bytes each) and a mapping of
 * mem_size bytes; 0 with *total = the bytes the table moves, or -1 with a
 * message in why.
 */
int bl_sg_check(const uint64_t *rows, size_t nrows, const size_t *buf_len, size_t nbufs,
                size_t mem_size, uint64_t *total, char why[BL_SG_WHY])
{
    *total = 0;
    for (size_t r = 0; r < nrows; r++) {
        const uint64_t *row = rows + 4 * r;
        if (row[0] >= (uint64_t)nbufs) {
            snprintf(why, BL_SG_WHY, "row %zu names buffer %llu but only %zu were given", r,
                     (unsigned long long)row[0], nbufs);
            return -1;
        }
        uint64_t blen = (uint64_t)buf_len[row[0]];
        if (row[1] > blen || row[3] > blen - row[1]) {
            snprintf(why, BL_SG_WHY, "row %zu: [%llu, +%llu) is outside buffer %llu (%llu bytes)",
                     r, (unsigned long long)row[1], (unsigned long long)row[3],
                     (unsigned long long)row[0], (unsigned long long)blen);
            return -1;
        }
        if (row[2] > mem_size || row[3] > mem_size - row[2]) {
            snprintf(why, BL_SG_WHY,
                     "row %zu: pool range [%llu, +%llu) is outside the %zu-byte mapping", r,
                     (unsigned long long)row[2], (unsigned long long)row[3], mem_size);
            return -1;
        }
        *total += row[3];
    }
    return 0;
}

/* Run a checked table: gather-write (non-temporal, fenced) or scatter-read (invalidating). */
void bl_sg_run(bl_mem *m, const uint64_t *rows, size_t nrows, uint8_t *const *bufs, int write)
{
    const uint64_t *row = rows;
    if (write) {
        for (size_t r = 0; r < nrows; r++, row += 4)
            m->ops->nt_store(m, row[2], bufs[row[0]] + row[1], row[3]);
        if (BL_STEP(GATHER_FENCE))
            m->ops->sfence(m);
        return;
    }
    if (BL_STEP(SCATTER_INVALIDATE))
        for (size_t r = 0; r < nrows; r++, row += 4)
            m->ops->invalidate(m, row[2], row[3]);
    if (BL_STEP(SCATTER_MFENCE))
        m->ops->mfence(m);
    row = rows;
    for (size_t r = 0; r < nrows; r++, row += 4)
        m->ops->load(m, row[2], bufs[row[0]] + row[1], row[3]);
}
