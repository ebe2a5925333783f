/*
 * block.c - single-writer / multi-reader publication of one pool block.
 *
 * A block is a one-line header plus a payload.  The protocol is a seqlock
 * whose sequence is the block's version:
 *
 *   publish       header := WRITING(version, length) ; SFENCE
 *                 payload := data (non-temporal) ; SFENCE
 *                 header := PUBLISHED(version, length, crc32c) ; SFENCE
 *   read          invalidate header ; MFENCE ; load and check header
 *                 invalidate payload ; MFENCE ; copy payload ; check crc32c
 *                 invalidate header ; MFENCE ; header must be unchanged
 *
 * If a reader's copy saw any byte of a later writer, that writer's WRITING
 * header was visible first, so the final header check fails.
 *
 * The data path writes a payload in place (one scatter-gather call), so the
 * same protocol is split: begin_write (WRITING), the caller's stores, seal
 * (fence, CRC32C over the payload as the pool holds it, PUBLISHED).  A reader
 * that scatters a payload itself brackets its copy with check_header.  The checksum
 * catches a torn payload even without that ordering.  Every failure is a
 * miss (a negative code), never data.
 *
 * Seal checksums the payload from the pool (invalidate, MFENCE, load): the
 * payload may come from another agent (the GPU's kernel) while this host
 * holds stale lines of the extent, and the MFENCE also drains this host's
 * own payload stores before PUBLISHED is queued behind them, so seal needs
 * no SFENCE of its own before the header.
 *
 * Every step above is a named sabotage point (BL_STEP, beluga_native.h).
 */
#include <string.h>

#include "beluga_native.h"

/* Compute and store the header's own checksum (over bytes 0..59). */
void bl_header_seal(bl_header *h) { bl_record_seal(h, sizeof(*h)); }

/* 1 when the line is a well-formed header (magic and checksum), else 0. */
int bl_header_check(const bl_header *h)
{
    return h->magic == BL_HDR_MAGIC && bl_record_sealed(h, sizeof(*h));
}

/* bl_header_check of n headers at once into ok[i] (their checksums side by side). */
void bl_headers_check(const bl_header *const *h, size_t n, uint8_t *ok)
{
    bl_lines_sealed((const void *const *)h, n, ok);
    for (size_t i = 0; i < n; i++)
        ok[i] = ok[i] && h[i]->magic == BL_HDR_MAGIC;
}

/* Write one header line so that it reaches memory whole; `fenced`: SFENCE after it. */
static void put_header(bl_mem *m, size_t hdr_off, bl_header *h, int fenced)
{
    bl_header_seal(h);
    m->ops->nt_store(m, hdr_off, h, sizeof(*h));
    if (fenced)
        m->ops->sfence(m);
}

/* Announce a write: header := WRITING(version, length), fenced, before any payload store. */
void bl_begin_write(bl_mem *m, size_t hdr_off, const bl_header *proto, size_t n)
{
    bl_header h = *proto;
    h.magic = BL_HDR_MAGIC;
    h.state = BL_WRITING;
    h.length = n; /* so that recovery knows the extent a dead writer held */
    h.payload_crc = 0;
    put_header(m, hdr_off, &h, BL_STEP(BLOCK_WRITING_FENCE));
}

/* Finish a write whose payload (fenced) has the given CRC: header := PUBLISHED. */
void bl_seal(bl_mem *m, size_t hdr_off, const bl_header *proto, size_t n, uint32_t crc)
{
    bl_header h = *proto;
    h.magic = BL_HDR_MAGIC;
    h.state = BL_PUBLISHED;
    h.length = n;
    h.payload_crc = crc;
    put_header(m, hdr_off, &h, BL_STEP(BLOCK_PUBLISHED_FENCE));
}

/* Publish `n` bytes of data as block (hdr_off, payload_off). */
void bl_publish(bl_mem *m, size_t hdr_off, size_t payload_off, const bl_header *proto,
                const void *data, size_t n)
{
    bl_begin_write(m, hdr_off, proto, n);
    m->ops->nt_store(m, payload_off, data, n);
    if (BL_STEP(BLOCK_PAYLOAD_FENCE))
        m->ops->sfence(m);
    bl_seal(m, hdr_off, proto, n, bl_crc32c_of(data, n));
}

/* CRC32C of a payload as stored in the pool (through the memops table). */
uint32_t bl_payload_crc(bl_mem *m, size_t payload_off, size_t n)
{
    uint8_t chunk[4096];
    uint32_t c = ~0u;
    if (BL_STEP(BLOCK_CHECKSUM_INVALIDATE))
        m->ops->invalidate(m, payload_off, n);
    if (BL_STEP(BLOCK_CHECKSUM_MFENCE))
        m->ops->mfence(m);
    for (size_t done = 0; done < n; done += sizeof(chunk)) {
        size_t k = n - done < sizeof(chunk) ? n - done : sizeof(chunk);
        c = m->ops->load_crc(m, payload_off + done, chunk, k, c);
    }
    return ~c;
}

/* Load a header after dropping any cached copy of it. */
void bl_get_header(bl_mem *m, size_t hdr_off, bl_header *h)
{
    if (BL_STEP(BLOCK_HEADER_INVALIDATE))
        m->ops->invalidate(m, hdr_off, sizeof(*h));
    if (BL_STEP(BLOCK_HEADER_MFENCE))
        m->ops->mfence(m);
    m->ops->load(m, hdr_off, h, sizeof(*h));
}

/*
 * Check the header of a published block (length, or a negative BL_MISS_*):
 * the first half of read_validated, and what a reader that scatters the
 * payload itself calls before and after (a seqlock without the checksum).
 */
int64_t bl_check_header(bl_mem *m, size_t hdr_off, size_t payload_off, const uint8_t digest[16],
                        uint64_t version, size_t block_cap, bl_header *h)
{
    bl_get_header(m, hdr_off, h);
    if (!bl_header_check(h))
        return BL_MISS_MAGIC;
    if (h->state != BL_PUBLISHED)
        return BL_MISS_STATE;
    if (memcmp(h->digest, digest, sizeof(h->digest)))
        return BL_MISS_KEY;
    if (version && h->version != version)
        return BL_MISS_VERSION;
    if (h->length > block_cap || h->length > m->size - payload_off)
        return BL_MISS_LENGTH;
    return (int64_t)h->length;
}

/*
 * The second half of a read, for a header already loaded and checked (h):
 * invalidate the payload, copy it with its CRC32C taken chunk by chunk, and
 * load the header again.  Returns h->length, or BL_MISS_CHECKSUM /
 * BL_MISS_CHANGED.  out must hold h->length bytes.
 */
int64_t bl_read_checked(bl_mem *m, size_t hdr_off, size_t payload_off, const bl_header *h,
                        void *out)
{
    bl_header again;
    if (BL_STEP(BLOCK_PAYLOAD_INVALIDATE))
        m->ops->invalidate(m, payload_off, h->length);
    if (BL_STEP(BLOCK_PAYLOAD_MFENCE))
        m->ops->mfence(m);
    /* copy and checksum in one pass (memops.c: the CRC reads what is still in L1) */
    uint32_t crc = m->ops->load_crc(m, payload_off, out, h->length, ~0u);
    if (~crc != h->payload_crc)
        return BL_MISS_CHECKSUM;
    bl_get_header(m, hdr_off, &again);
    if (memcmp(h, &again, sizeof(again)))
        return BL_MISS_CHANGED;
    return (int64_t)h->length;
}

/*
 * Read a published block into out[0..cap).  Returns the payload length, or a
 * negative BL_MISS_* / BL_TOO_SMALL code; *seen gets the header first read.
 * `version` 0 accepts any version; block_cap bounds a sane payload length.
 */
int64_t bl_read_validated(bl_mem *m, size_t hdr_off, size_t payload_off,
                          const uint8_t digest[16], uint64_t version, size_t block_cap,
                          void *out, size_t cap, bl_header *seen)
{
    bl_header h;
    int64_t r = bl_check_header(m, hdr_off, payload_off, digest, version, block_cap, &h);
    *seen = h;
    if (r < 0)
        return r;
    if (h.length > cap)
        return BL_TOO_SMALL;
    return bl_read_checked(m, hdr_off, payload_off, &h, out);
}
