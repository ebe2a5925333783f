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
 * header was visible first, so the final header check fails.  The checksum
 * catches a torn payload even without that ordering.  Every failure is a
 * miss (a negative code), never data.
 */
#include <string.h>

#include "beluga_native.h"

/* Compute and store the header's own checksum (over bytes 0..59). */
void bl_header_seal(bl_header *h)
{
    h->header_crc = ~bl_crc32c(~0u, h, offsetof(bl_header, header_crc));
}

/* 1 when the line is a well-formed header (magic and checksum), else 0. */
int bl_header_check(const bl_header *h)
{
    return h->magic == BL_HDR_MAGIC &&
           h->header_crc == ~bl_crc32c(~0u, h, offsetof(bl_header, header_crc));
}

/* Write one header line so that it reaches memory whole. */
static void put_header(bl_mem *m, size_t hdr_off, bl_header *h)
{
    bl_header_seal(h);
    m->ops->nt_store(m, hdr_off, h, sizeof(*h));
    m->ops->sfence(m);
}

/* Publish `n` bytes of data as block (hdr_off, payload_off). */
void bl_publish(bl_mem *m, size_t hdr_off, size_t payload_off, const bl_header *proto,
                const void *data, size_t n)
{
    bl_header h = *proto;
    h.magic = BL_HDR_MAGIC;
    h.state = BL_WRITING;
    h.length = n; /* so that recovery knows the extent a dead writer held */
    h.payload_crc = 0;
    put_header(m, hdr_off, &h);
    m->ops->nt_store(m, payload_off, data, n);
    m->ops->sfence(m);
    h.state = BL_PUBLISHED;
    h.length = n;
    h.payload_crc = ~bl_crc32c(~0u, data, n);
    put_header(m, hdr_off, &h);
}

/* Load a header after dropping any cached copy of it. */
static void get_header(bl_mem *m, size_t hdr_off, bl_header *h)
{
    m->ops->invalidate(m, hdr_off, sizeof(*h));
    m->ops->mfence(m);
    m->ops->load(m, hdr_off, h, sizeof(*h));
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
    bl_header h, again;
    get_header(m, hdr_off, &h);
    *seen = h;
    if (!bl_header_check(&h))
        return BL_MISS_MAGIC;
    if (h.state != BL_PUBLISHED)
        return BL_MISS_STATE;
    if (memcmp(h.digest, digest, sizeof(h.digest)))
        return BL_MISS_KEY;
    if (version && h.version != version)
        return BL_MISS_VERSION;
    if (h.length > block_cap || h.length > m->size - payload_off)
        return BL_MISS_LENGTH;
    if (h.length > cap)
        return BL_TOO_SMALL;
    m->ops->invalidate(m, payload_off, h.length);
    m->ops->mfence(m);
    m->ops->load(m, payload_off, out, h.length);
    if (~bl_crc32c(~0u, out, h.length) != h.payload_crc)
        return BL_MISS_CHECKSUM;
    get_header(m, hdr_off, &again);
    if (memcmp(&h, &again, sizeof(h)))
        return BL_MISS_CHANGED;
    return (int64_t)h.length;
}
