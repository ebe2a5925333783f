/*
 * blockio.c - many whole blocks read or written in one call, the checksum
 * fused into the copy.
 *
 * The data path moves KV between an engine's paged cache and pool blocks as
 * one scatter-gather table (rows of buffer index, buffer offset, pool offset,
 * length, checked against the buffers and the mapping by bl_sg_check in
 * sg.c).  A plain scatter-read trusts whatever the pool holds; these do not:
 *
 *   read   every block's header is loaded (all invalidated, one MFENCE) and
 *          checked: well formed, PUBLISHED, this key, this version, a sane
 *          length (a batched get passes the headers its index probe just
 *          loaded the same way and checked alike, saving that round).
 *          Every row's pool range is invalidated, one MFENCE, then
 *          each row is copied a chunk at a time and the CRC32C of each chunk
 *          is taken from the destination while it is still in L1 (the
 *          memops table's load_crc, which overlaps the copy of one piece
 *          with the checksum of the one before).  Per block
 *          the CRCs of its pieces make the CRC of its payload, which must be
 *          the header's; then the headers are loaded again and must not have
 *          changed.  A block that fails any step gets a negative BL_MISS_*
 *          code and its destination bytes are garbage the caller must not use.
 *   write  each row is stored non-temporally a chunk at a time, the CRC32C of
 *          each chunk taken from the source; one SFENCE; per block the CRC of
 *          what the writer meant to store is sealed into its PUBLISHED
 *          header.  Bytes in the extent that the writer did not put there
 *          (a stalled writer's, hostile ones) make the block a miss instead
 *          of being sealed in.
 *
 * A piece is a row cut at block boundaries.  Pieces of a block that follow
 * each other in the pool extend one running CRC (the usual case: tables list
 * a block's runs in order).  Out-of-order pieces each get a CRC, and CRCs of
 * adjacent byte ranges combine into the CRC of their concatenation
 * (bl_crc32c_combine, crc32c.c).  A block whose pieces do not cover its
 * payload exactly once (a partial read, rows that overlap) is checksummed
 * from the pool instead: correct, one more pass.
 */
#include <stdlib.h>
#include <string.h>

#include "beluga_native.h"

#define CHUNK 8192u

/* A run of one block's payload covered by consecutive pieces, with its CRC so far. */
typedef struct {
    uint32_t block;
    uint64_t start, len;
    uint32_t raw; /* running CRC, not yet finalised */
} segment;

typedef struct {
    bl_blockio *blocks;
    size_t nblocks;
    size_t *order;  /* block indexes sorted by payload offset */
    segment *segs;  /* closed segments */
    size_t nsegs, cap_segs;
    segment *open;  /* per block: the segment that the next in-order piece extends */
} job;

/* A block's payload offset and its index, sorted together (no shared state: thread-safe). */
typedef struct {
    size_t off, index;
} keyed;

/* Order keyed pairs by payload offset. */
static int by_payload(const void *a, const void *b)
{
    size_t x = ((const keyed *)a)->off, y = ((const keyed *)b)->off;
    return (x > y) - (x < y);
}

/* Segments of one block together, in payload order. */
static int by_block_start(const void *a, const void *b)
{
    const segment *x = a, *y = b;
    if (x->block != y->block)
        return (x->block > y->block) - (x->block < y->block);
    return (x->start > y->start) - (x->start < y->start);
}

/* Index (in j->order) of the block whose [payload_off, +span) holds pool offset off; -1 if none. */
static long find_block(const job *j, uint64_t off, int use_cap)
{
    size_t lo = 0, hi = j->nblocks;
    while (lo < hi) { /* first block that starts after off */
        size_t mid = (lo + hi) / 2;
        if (j->blocks[j->order[mid]].payload_off <= off)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (!lo)
        return -1;
    const bl_blockio *b = &j->blocks[j->order[lo - 1]];
    uint64_t span = use_cap ? b->cap : b->length;
    return off < b->payload_off + span ? (long)(lo - 1) : -1;
}

/* Sort the blocks and refuse overlapping ones; 0, or -1 with *why. */
static int job_init(job *j, bl_blockio *blocks, size_t nblocks, size_t nrows, const char **why)
{
    memset(j, 0, sizeof(*j));
    j->blocks = blocks;
    j->nblocks = nblocks;
    j->cap_segs = nrows + nblocks + 1;
    j->order = malloc((nblocks + 1) * sizeof(size_t));
    j->segs = malloc(j->cap_segs * sizeof(segment));
    j->open = calloc(nblocks + 1, sizeof(segment));
    if (!j->order || !j->segs || !j->open)
        return *why = "out of memory", -1;
    keyed *pairs = malloc((nblocks + 1) * sizeof(keyed));
    if (!pairs)
        return *why = "out of memory", -1;
    for (size_t i = 0; i < nblocks; i++)
        pairs[i] = (keyed){blocks[i].payload_off, i};
    qsort(pairs, nblocks, sizeof(keyed), by_payload);
    for (size_t i = 0; i < nblocks; i++)
        j->order[i] = pairs[i].index;
    free(pairs);
    for (size_t i = 1; i < nblocks; i++) {
        const bl_blockio *a = &blocks[j->order[i - 1]], *b = &blocks[j->order[i]];
        if (a->payload_off + a->cap > b->payload_off)
            return *why = "two blocks of one call overlap in the pool; give each block once", -1;
    }
    for (size_t i = 0; i < nblocks; i++)
        j->open[i].block = UINT32_MAX; /* no open segment yet */
    return 0;
}

/* Free what job_init allocated. */
static void job_free(job *j)
{
    free(j->order);
    free(j->segs);
    free(j->open);
}

/* Every row must lie inside the blocks of the call (their extents, or their lengths). */
static int rows_inside(const job *j, const uint64_t *rows, size_t nrows, int use_cap)
{
    for (size_t r = 0; r < nrows; r++) {
        uint64_t off = rows[4 * r + 2], end = off + rows[4 * r + 3];
        while (off < end) {
            long i = find_block(j, off, use_cap);
            if (i < 0)
                return 0;
            const bl_blockio *b = &j->blocks[j->order[i]];
            uint64_t stop = b->payload_off + (use_cap ? b->cap : b->length);
            off = stop < end ? stop : end;
        }
    }
    return 1;
}

/* The segment of block bi that bytes at pool offset off extend, opened as needed. */
static segment *segment_at(job *j, size_t bi, uint64_t off)
{
    segment *s = &j->open[bi];
    uint64_t start = off - j->blocks[bi].payload_off;
    if (s->block != UINT32_MAX && s->start + s->len != start) {
        j->segs[j->nsegs++] = *s; /* out of order: close it, start another */
        s->block = UINT32_MAX;
    }
    if (s->block == UINT32_MAX)
        *s = (segment){(uint32_t)bi, start, 0, ~0u};
    return s;
}

/* Per block: 1 and *crc when its segments cover [0, length) exactly once, else 0. */
static void finish_segments(job *j)
{
    for (size_t i = 0; i < j->nblocks; i++)
        if (j->open[i].block != UINT32_MAX)
            j->segs[j->nsegs++] = j->open[i];
    qsort(j->segs, j->nsegs, sizeof(segment), by_block_start);
}

/* The payload CRC of block bi from its segments, or -1 when they do not tile it. */
static int64_t tiled_crc(const job *j, size_t bi, size_t *cursor)
{
    size_t k = *cursor;
    while (k < j->nsegs && j->segs[k].block < bi)
        k++;
    uint64_t covered = 0;
    uint32_t crc = 0;
    int tiles = 1;
    for (; k < j->nsegs && j->segs[k].block == bi; k++) {
        const segment *s = &j->segs[k];
        if (s->start != covered)
            tiles = 0;
        crc = covered ? bl_crc32c_combine(crc, ~s->raw, s->len) : ~s->raw;
        covered += s->len;
    }
    *cursor = k;
    return tiles && covered == j->blocks[bi].length ? (int64_t)crc : -1;
}

/* Copy one row between the pool and a buffer in chunks, accounting each chunk to its block. */
static void move_row(job *j, bl_mem *m, const uint64_t *row, uint8_t *buf, int write)
{
    uint64_t off = row[2], end = row[2] + row[3];
    uint8_t *p = buf + row[1];
    while (off < end) {
        /* rows_inside() put every byte in some block's extent (read) or payload (write) */
        size_t bi = j->order[find_block(j, off, 1)];
        bl_blockio *b = &j->blocks[bi];
        if (!write && b->result < 0) { /* a failed block's bytes are not worth moving */
            uint64_t stop = b->payload_off + b->cap, skip = (stop < end ? stop : end) - off;
            off += skip, p += skip;
            continue;
        }
        uint64_t stop = b->payload_off + b->length; /* a read past it failed the block */
        uint64_t piece_end = stop < end ? stop : end;
        while (off < piece_end) {
            /* a write checksums its source a chunk at a time so that the store reads L1;
             * a read's load_crc pieces the copy itself */
            size_t n = write && piece_end - off > CHUNK ? CHUNK : (size_t)(piece_end - off);
            segment *s = segment_at(j, bi, off);
            if (write) {
                s->raw = bl_crc32c(s->raw, p, n);
                m->ops->nt_store(m, off, p, n);
            } else {
                s->raw = m->ops->load_crc(m, off, p, n, s->raw);
            }
            s->len += n;
            off += n, p += n;
        }
    }
}

/* Load every block's header after one invalidate pass and one fence. */
static void load_headers(bl_mem *m, const bl_blockio *blocks, size_t nblocks, bl_header *out)
{
    if (BL_STEP(BLOCKIO_HEADER_INVALIDATE))
        for (size_t i = 0; i < nblocks; i++)
            m->ops->invalidate(m, blocks[i].hdr_off, BL_LINE);
    if (BL_STEP(BLOCKIO_HEADER_MFENCE))
        m->ops->mfence(m);
    for (size_t i = 0; i < nblocks; i++)
        m->ops->load(m, blocks[i].hdr_off, &out[i], BL_LINE);
}

/* What a loaded header says about a block: its length, or a negative BL_MISS_* code. */
static int64_t judge(const bl_mem *m, const bl_blockio *b, const bl_header *h)
{
    if (!bl_header_check(h))
        return BL_MISS_MAGIC;
    if (h->state != BL_PUBLISHED)
        return BL_MISS_STATE;
    if (memcmp(h->digest, b->digest, sizeof(h->digest)))
        return BL_MISS_KEY;
    if (h->version != b->version)
        return BL_MISS_VERSION;
    if (h->length > b->cap || h->length > m->size - b->payload_off)
        return BL_MISS_LENGTH;
    return (int64_t)h->length;
}

/*
 * Look at many blocks' headers (all invalidated, one MFENCE, loaded) and judge
 * each: blocks[i].result gets its length or a BL_MISS_* code, out[i] the
 * header as loaded.  The first and last steps of a validated read whose
 * payload another agent moves (a GPU): it is called before and after that
 * move, and a block whose header changed between the two is a miss.
 */
void bl_check_headers(bl_mem *m, bl_blockio *blocks, size_t nblocks, bl_header *out)
{
    load_headers(m, blocks, nblocks, out);
    for (size_t i = 0; i < nblocks; i++) {
        blocks[i].result = judge(m, &blocks[i], &out[i]);
        blocks[i].length = blocks[i].result >= 0 ? out[i].length : 0;
    }
}

/*
 * Read many blocks through one table, each validated (see the top of the
 * file).  blocks[i].result gets the block's length or a BL_MISS_* code.
 * seen: NULL, or each block's header as the caller already loaded it fresh
 * (invalidated, fenced, loaded: the index probe's confirmation) before this
 * call, which then stands for the first header load; a header loaded any
 * other way would let a stale one pass.  Returns 0, or -1 with *why when the
 * call itself is wrong (a row outside every block's extent, overlapping
 * blocks): then nothing was copied.
 */
int bl_read_blocks(bl_mem *m, bl_blockio *blocks, size_t nblocks, const uint64_t *rows,
                   size_t nrows, uint8_t *const *bufs, const bl_header *seen, const char **why)
{
    job j;
    bl_header *first = malloc((nblocks + 1) * sizeof(bl_header));
    bl_header *again = malloc((nblocks + 1) * sizeof(bl_header));
    int rc = -1;
    if (!first || !again) {
        *why = "out of memory";
        goto out;
    }
    if (job_init(&j, blocks, nblocks, nrows, why) < 0)
        goto out_job;
    if (!rows_inside(&j, rows, nrows, 1)) {
        *why = "a row reads pool bytes outside every block of the call";
        goto out_job;
    }
    if (seen)
        memcpy(first, seen, nblocks * sizeof(bl_header));
    else
        load_headers(m, blocks, nblocks, first);
    for (size_t i = 0; i < nblocks; i++) {
        blocks[i].result = judge(m, &blocks[i], &first[i]);
        blocks[i].length = blocks[i].result >= 0 ? first[i].length : 0;
    }
    for (size_t r = 0; r < nrows; r++) { /* a row past a block's length fails that block */
        uint64_t off = rows[4 * r + 2], end = off + rows[4 * r + 3];
        while (off < end) {
            size_t bi = j.order[find_block(&j, off, 1)];
            bl_blockio *b = &blocks[bi];
            uint64_t stop = b->payload_off + b->cap, in_extent = stop < end ? stop : end;
            if (b->result >= 0 && in_extent > b->payload_off + b->length)
                b->result = BL_MISS_LENGTH; /* the caller reads more than the block holds */
            off = in_extent;
        }
    }
    if (BL_STEP(BLOCKIO_PAYLOAD_INVALIDATE))
        for (size_t r = 0; r < nrows; r++)
            if (rows[4 * r + 3])
                m->ops->invalidate(m, rows[4 * r + 2], rows[4 * r + 3]);
    if (BL_STEP(BLOCKIO_PAYLOAD_MFENCE))
        m->ops->mfence(m);
    for (size_t r = 0; r < nrows; r++)
        move_row(&j, m, &rows[4 * r], bufs[rows[4 * r]], 0);
    finish_segments(&j);
    size_t cursor = 0;
    for (size_t k = 0; k < nblocks; k++) { /* in payload order, as the segments are */
        size_t bi = j.order[k];
        bl_blockio *b = &blocks[bi];
        int64_t crc = tiled_crc(&j, bi, &cursor);
        if (b->result < 0)
            continue;
        if (crc < 0) /* the rows do not cover the payload once: checksum it from the pool */
            crc = bl_payload_crc(m, b->payload_off, b->length);
        if ((uint32_t)crc != first[bi].payload_crc)
            b->result = BL_MISS_CHECKSUM;
    }
    load_headers(m, blocks, nblocks, again);
    for (size_t i = 0; i < nblocks; i++)
        if (blocks[i].result >= 0 && memcmp(&first[i], &again[i], sizeof(bl_header)))
            blocks[i].result = BL_MISS_CHANGED;
    rc = 0;
out_job:
    job_free(&j);
out:
    free(first);
    free(again);
    return rc;
}

/*
 * Write many blocks through one table and seal each (see the top of the
 * file).  Each block's header must already say WRITING (begin_write);
 * blocks[i].proto holds the fields to seal with and .length the value's
 * length.  Returns 0, or -1 with *why when a row writes outside every
 * block's payload (then nothing was written).
 */
int bl_write_blocks(bl_mem *m, bl_blockio *blocks, size_t nblocks, const uint64_t *rows,
                    size_t nrows, const uint8_t *const *bufs, const char **why)
{
    job j;
    int rc = -1;
    if (job_init(&j, blocks, nblocks, nrows, why) < 0)
        goto out;
    if (!rows_inside(&j, rows, nrows, 0)) {
        *why = "a row writes pool bytes outside every block's payload";
        goto out;
    }
    for (size_t r = 0; r < nrows; r++)
        move_row(&j, m, &rows[4 * r], (uint8_t *)bufs[rows[4 * r]], 1);
    if (BL_STEP(BLOCKIO_WRITE_FENCE))
        m->ops->sfence(m);
    finish_segments(&j);
    size_t cursor = 0;
    for (size_t k = 0; k < nblocks; k++) {
        size_t bi = j.order[k];
        bl_blockio *b = &blocks[bi];
        int64_t crc = tiled_crc(&j, bi, &cursor);
        if (crc < 0) /* not written exactly once by this call: checksum what the pool holds */
            crc = bl_payload_crc(m, b->payload_off, b->length);
        bl_seal(m, b->hdr_off, &b->proto, b->length, (uint32_t)crc);
    }
    rc = 0;
out:
    job_free(&j);
    return rc;
}
