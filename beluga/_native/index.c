/*
 * index.c - the pool-resident hash index, and reads that need no server.
 *
 * The metadata server is the index's only writer; every host reads it with
 * loads.  A bucket is one cache line (bl_ix_bucket): a sequence number, three
 * slots of (tag, first block, version) and a CRC32C of the line.  A key's
 * 16-byte digest names two buckets (bl_ix_hash: bytes 4..7 and 8..11 of the
 * digest, masked to the power-of-two bucket count) and a 32-bit tag (bytes
 * 0..3).  The server (beluga/server/index.py) keeps a mirror, rewrites a whole
 * bucket line with one non-temporal store, and moves entries between a key's
 * two buckets cuckoo-style, always writing the entry's new bucket (fenced)
 * before the old one: at every instant a key sits in at least one bucket.
 *
 *   probe   invalidate both bucket lines ; MFENCE ; load them ; a line whose
 *           CRC fails is torn (a rewrite in flight, a server killed in the
 *           middle of one, or hostile bytes): load again, a bounded number of
 *           times, then use it as it is.  Every slot with the key's tag is a
 *           candidate.  A slot of a torn line is still a hint: its bytes are
 *           the old line's or the new one's (a server that died there left
 *           every slot it did not change whole; it changes a key's slot only
 *           with the key placed elsewhere first), or hostile, or torn itself,
 *           and the confirm below is what a reader trusts.  With no candidate, the
 *           first bucket is loaded again: a changed sequence means a move
 *           raced the probe (its new bucket was read before the entry
 *           arrived, its old one after it left), so the probe is redone.
 *   confirm a candidate counts only if its block's header (block.c) is
 *           PUBLISHED with the key's full digest and the slot's version.
 *   read    bl_read_checked (block.c), right after the confirm: payload
 *           invalidated, copied with the CRC32C fused into the copy, header
 *           loaded again and compared whole with the confirmed one.
 *
 * Why no read lease is needed (the reuse rule, server/service.py): versions never
 * repeat; an extent goes back to the allocator only after the server has
 * cleared (and fenced) the header at its first block; a new writer publishes
 * WRITING (fenced) before its first payload store.  So a reader whose copy saw
 * any byte stored after the reuse loads a changed header at its re-check, and
 * the read is a miss.  The index entry is only a hint: a stale or hostile
 * entry costs a miss, never other bytes.
 *
 * Hits and misses are counted where only the reading host writes: after the
 * buckets, each host id owns a counts line and a ring of 64 hints (block and
 * the low 32 bits of its version, bl_ix_hint).  A reader buffers them
 * (bl_ix_hints) and stores them every 64 probes (a ring's worth) with
 * non-temporal stores; the server folds them into its LRU order and its
 * statistics on its own schedule.  Hints made before a fork stop being
 * written in the child (they are its parent's host id's); reads stay correct.
 *
 * This file has no Python in it.  The Python type Index (index_py.c) runs a
 * whole get / get_into / batch in one call: key digest (blake3.c), probe,
 * confirm, copy, checksum, re-check, through the functions here.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "beluga_native.h"

#define TORN_RETRIES 8     /* loads of a torn bucket before it counts as empty */
#define MOVE_RETRIES 4     /* probes redone because a move raced them */
#define FLUSH_EVERY 64u    /* probes between two stores of the hint lines (a ring) */

/* ---- the bucket format --------------------------------------------------------------------- */

/* A digest's tag (never 0) and its two buckets (distinct when there are two or more). */
void bl_ix_hash(const uint8_t digest[16], uint64_t nbuckets, uint32_t *tag, uint64_t *b1,
                uint64_t *b2)
{
    uint32_t t, x, y;
    memcpy(&t, digest, 4);
    memcpy(&x, digest + 4, 4);
    memcpy(&y, digest + 8, 4);
    *tag = t ? t : 1;
    *b1 = x & (nbuckets - 1);
    *b2 = y & (nbuckets - 1);
    if (*b2 == *b1)
        *b2 = *b1 ^ (nbuckets > 1);
}

/* Set a bucket's CRC over its other bytes. */
void bl_ix_seal(bl_ix_bucket *b) { bl_record_seal(b, sizeof(*b)); }

/* 1 when a loaded line is a whole bucket: its CRC matches, or it is all zeros (never written). */
int bl_ix_bucket_ok(const bl_ix_bucket *b)
{
    static const bl_ix_bucket zero;
    return bl_record_sealed(b, sizeof(*b)) || !memcmp(b, &zero, sizeof(zero));
}

/* 1 when a loaded line is a whole counts line: its CRC matches, or it is all zeros. */
int bl_ix_counts_ok(const bl_ix_counts *c)
{
    static const bl_ix_counts zero;
    return bl_record_sealed(c, sizeof(*c)) || !memcmp(c, &zero, sizeof(zero));
}

/* Whether an index of this geometry (and hint lines at hint_off, or -1) fits the mapping. */
int bl_ix_geometry_ok(size_t size, const bl_ix *ix, long long hint_off)
{
    uint64_t nb = ix->nbuckets, nblocks = ix->nblocks;
    return nb && !(nb & (nb - 1)) && !(ix->index_off % BL_LINE) && ix->index_off <= size &&
           nb <= (size - ix->index_off) / BL_LINE && ix->block_size && nblocks &&
           !(ix->headers_off % BL_LINE) && ix->headers_off <= size &&
           nblocks <= (size - ix->headers_off) / BL_LINE && ix->payloads_off <= size &&
           nblocks <= (size - ix->payloads_off) / ix->block_size &&
           (hint_off < 0 || (!((unsigned long long)hint_off % BL_LINE) &&
                             (unsigned long long)hint_off + BL_IX_HINT_LINES * BL_LINE <= size));
}

/* Load buckets b1 and b2 after dropping cached copies (one fence for both). */
static void load_buckets(bl_mem *m, const bl_ix *ix, uint64_t b1, uint64_t b2, bl_ix_bucket out[2])
{
    size_t o1 = ix->index_off + b1 * BL_LINE, o2 = ix->index_off + b2 * BL_LINE;
    if (BL_STEP(INDEX_BUCKET_INVALIDATE)) {
        m->ops->invalidate(m, o1, BL_LINE);
        m->ops->invalidate(m, o2, BL_LINE);
    }
    if (BL_STEP(INDEX_BUCKET_MFENCE))
        m->ops->mfence(m);
    m->ops->load(m, o1, &out[0], BL_LINE);
    m->ops->load(m, o2, &out[1], BL_LINE);
}

/* Load both buckets until each is whole, or TORN_RETRIES times: a line torn still is used as
 * it is (its slots are hints like any; a slot torn itself confirms nothing). */
static void load_whole(bl_mem *m, const bl_ix *ix, uint64_t b1, uint64_t b2, bl_ix_bucket out[2])
{
    for (int i = 0; i <= TORN_RETRIES; i++) {
        load_buckets(m, ix, b1, b2, out);
        if (bl_ix_bucket_ok(&out[0]) && bl_ix_bucket_ok(&out[1]))
            return;
    }
}

/*
 * Find a key: its first block and confirmed header, returning the value's
 * length; or a negative BL_MISS_* code (BL_MISS_KEY: not in the index).
 */
int64_t bl_ix_lookup(bl_mem *m, const bl_ix *ix, const uint8_t digest[16], uint32_t *block,
                     bl_header *h)
{
    uint32_t tag;
    uint64_t b1, b2;
    bl_ix_hash(digest, ix->nbuckets, &tag, &b1, &b2);
    int64_t r = BL_MISS_KEY;
    for (int attempt = 0; attempt <= MOVE_RETRIES; attempt++) {
        bl_ix_bucket b[2];
        load_whole(m, ix, b1, b2, b);
        int found = 0;
        for (int i = 0; i < 2; i++)
            for (int s = 0; s < BL_IX_SLOTS; s++) {
                const bl_ix_slot *e = &b[i].slot[s];
                if (e->tag != tag || e->block >= ix->nblocks || e->version == 0)
                    continue;
                found = 1;
                size_t cap = (size_t)(ix->nblocks - e->block) * ix->block_size;
                r = bl_check_header(m, ix->headers_off + (size_t)e->block * BL_LINE,
                                    ix->payloads_off + (size_t)e->block * ix->block_size, digest,
                                    e->version, cap, h);
                if (r >= 0) {
                    *block = e->block;
                    return r;
                }
            }
        if (found)
            return r; /* the index named it but the header did not confirm: replaced or gone */
        bl_ix_bucket again[2];
        load_buckets(m, ix, b1, b1, again);
        if (!bl_ix_bucket_ok(&again[0]) || again[0].seq == b[0].seq)
            return BL_MISS_KEY;
    }
    return r;
}

#define PROBE_GROUP 16 /* keys digested between two fences of a pipelined probe (8, 32: slower) */

/* Invalidate the lines of buckets at[0..n), one MFENCE, then load them all into out. */
static void load_lines(bl_mem *m, const bl_ix *ix, uint64_t *at, size_t n, bl_ix_bucket *out)
{
    if (BL_STEP(INDEX_BUCKET_INVALIDATE))
        for (size_t i = 0; i < n; i++)
            m->ops->invalidate(m, ix->index_off + at[i] * BL_LINE, BL_LINE);
    if (BL_STEP(INDEX_BUCKET_MFENCE))
        m->ops->mfence(m);
    for (size_t i = 0; i < n; i++)
        m->ops->load(m, ix->index_off + at[i] * BL_LINE, &out[i], BL_LINE);
}

/* The first usable slot of bucket b with this tag: its block (version in *version), or
 * UINT32_MAX when there is none. */
static uint32_t candidate(const bl_ix *ix, const bl_ix_bucket *b, uint32_t tag, uint64_t *version)
{
    for (int s = 0; s < BL_IX_SLOTS; s++) {
        const bl_ix_slot *e = &b->slot[s];
        if (e->tag == tag && e->block < ix->nblocks && e->version) {
            *version = e->version;
            return e->block;
        }
    }
    return UINT32_MAX;
}

/* What a candidate's loaded header says: the value's length when it confirms the candidate
 * (well formed by bl_header_check, PUBLISHED, the full digest, the slot's version), else -1. */
static int64_t confirmed(const bl_mem *m, const bl_ix *ix, const uint8_t digest[16],
                         uint32_t block, const bl_header *h, uint64_t version, int well_formed)
{
    size_t cap = (size_t)(ix->nblocks - block) * ix->block_size;
    if (well_formed && h->state == BL_PUBLISHED && h->version == version &&
        !memcmp(h->digest, digest, 16) && h->length <= cap &&
        h->length <= m->size - (ix->payloads_off + (size_t)block * ix->block_size))
        return (int64_t)h->length;
    return -1;
}

/* Load a candidate's header (invalidated and fenced already) into h, whose version field
 * holds the slot's: confirmed's answer. */
static int64_t confirm(bl_mem *m, const bl_ix *ix, const uint8_t digest[16], uint32_t block,
                       bl_header *h)
{
    uint64_t version = h->version;
    m->ops->load(m, ix->headers_off + (size_t)block * BL_LINE, h, BL_LINE);
    return confirmed(m, ix, digest, block, h, version, bl_header_check(h));
}

/* confirm of every candidate among keys [lo, hi), PROBE_GROUP at a time: their headers
 * loaded first, then checked side by side (bl_headers_check); one that fails is alone. */
static void confirm_group(bl_mem *m, const bl_ix *ix, const uint8_t *digests,
                          const uint32_t *block, bl_header *h, size_t lo, size_t hi, int64_t *r,
                          uint8_t *alone)
{
    for (; hi - lo > PROBE_GROUP; lo += PROBE_GROUP)
        confirm_group(m, ix, digests, block, h, lo, lo + PROBE_GROUP, r, alone);
    const bl_header *loaded[PROBE_GROUP];
    uint64_t version[PROBE_GROUP];
    size_t at[PROBE_GROUP], k = 0;
    uint8_t ok[PROBE_GROUP];
    for (size_t i = lo; i < hi; i++)
        if (block[i] != UINT32_MAX) {
            version[k] = h[i].version;
            m->ops->load(m, ix->headers_off + (size_t)block[i] * BL_LINE, &h[i], BL_LINE);
            loaded[k] = &h[i], at[k++] = i;
        }
    bl_headers_check(loaded, k, ok);
    for (size_t j = 0; j < k; j++) {
        size_t i = at[j];
        r[i] = confirmed(m, ix, digests + 16 * i, block[i], &h[i], version[j], ok[j]);
        if (r[i] < 0)
            alone[i] = 1;
    }
}

/* The header lines of the candidates among keys [lo, hi): invalidated (drop) or prefetched. */
static void header_lines(bl_mem *m, const bl_ix *ix, const uint32_t *block, size_t lo, size_t hi,
                         int drop)
{
    for (size_t i = lo; i < hi; i++)
        if (block[i] != UINT32_MAX) {
            size_t off = ix->headers_off + (size_t)block[i] * BL_LINE;
            if (!drop)
                m->ops->prefetch(m, off, BL_LINE);
            else if (BL_STEP(BLOCK_HEADER_INVALIDATE))
                m->ops->invalidate(m, off, BL_LINE);
        }
}

/* Keys [lo, hi) of the group `back` steps behind `step`; 0 when there is none. */
static int group_of(size_t step, size_t back, size_t group, size_t groups, size_t n, size_t *lo,
                    size_t *hi)
{
    if (step < back || step - back >= groups)
        return 0;
    *lo = (step - back) * group;
    *hi = *lo + group < n ? *lo + group : n;
    return 1;
}

/*
 * Look many keys up at once.  Keys (key, len) are digested into `digests` on
 * the way, a group of PROBE_GROUP at a time; with key NULL, `digests` holds
 * them already and the whole batch is one group.
 *
 * THE PIPELINE.  Every line is invalidated, then an MFENCE, then loaded, as
 * in bl_ix_lookup; what the batch adds is that one fence serves every line
 * invalidated before it, and that the reloads of one group's lines run while
 * the next groups are digested (a digest is ALU work; a reload waits on
 * memory).  Step s of the loop, for groups x:
 *
 *   digest group s (keys only) ; MFENCE ;
 *   prefetch the first buckets of group s-1 (a hint; invalidated in step s-1) ;
 *   load the first buckets of group s-2, pick each key's candidate, and
 *     invalidate the candidates' header lines ;
 *   prefetch the header lines of group s-3 ;
 *   load and check the headers of group s-4 ;
 *   invalidate the first buckets of group s.
 *
 * So each line is loaded at least one MFENCE after its invalidate, and the
 * prefetch that brings it in comes after that MFENCE too.  Only first
 * buckets: the server fills a key's first bucket first, so most keys are
 * there, a third fewer lines than loading both.  Then, for the keys that need
 * it, rounds of one fence each:
 *
 *   - the second bucket of each key without a candidate in its first, and
 *     the headers of candidates found there;
 *   - for each key with no candidate in either bucket, the first bucket
 *     again: both lines whole and its sequence unchanged make it a miss, as
 *     in bl_ix_lookup (a move from the second bucket to the first that raced
 *     the two loads changed the sequence).
 *
 * For every key at once; for a prefix (lookup_prefix, locate), PROBE_GROUP
 * such keys a round in key order, until a round ends in a miss: a chain
 * stored up to its middle pays the rounds of its first missing keys, not of
 * all the keys after them, which the prefix never looks at.
 *
 * No bucket CRC before a hit: a candidate counts only once its header
 * confirms it, so a torn bucket can cost a redo, never a wrong hit (checking
 * both lines' CRCs was a fifth of lookup_prefix(256)).  Anything else (a
 * candidate that did not confirm, a torn line, a moved bucket) goes through
 * bl_ix_lookup alone: torn-line retries, the other candidates, the race with
 * a move.  r[i]: the length, or a BL_MISS_* code; block[i], h[i] as
 * bl_ix_lookup.
 */
static void lookup_batch(bl_mem *m, const bl_ix *ix, const uint8_t *const *key, const size_t *len,
                         uint8_t *digests, size_t n, uint32_t *block, bl_header *h, int64_t *r,
                         int prefix)
{
    if (!n)
        return;
    uint64_t *b1 = malloc(n * sizeof(uint64_t)), *b2 = malloc(n * sizeof(uint64_t));
    uint64_t *at = malloc(n * sizeof(uint64_t));
    uint32_t *tag = malloc(n * sizeof(uint32_t));
    size_t *which = malloc(n * sizeof(size_t));
    uint8_t **out = malloc(n * sizeof(uint8_t *));
    uint8_t *alone = calloc(n, 1); /* 1: settle through bl_ix_lookup; 2: a clean miss */
    bl_ix_bucket *first = malloc(n * sizeof(bl_ix_bucket));
    bl_ix_bucket *second = malloc(n * sizeof(bl_ix_bucket));
    if (!b1 || !b2 || !at || !tag || !which || !out || !alone || !first || !second) {
        for (size_t i = 0; i < n; i++) { /* no room to batch: one at a time */
            if (key)
                bl_key_digest(key[i], len[i], digests + 16 * i);
            r[i] = bl_ix_lookup(m, ix, digests + 16 * i, &block[i], &h[i]);
        }
        goto out;
    }
    size_t group = key ? PROBE_GROUP : n, groups = (n + group - 1) / group;
    for (size_t i = 0; i < n; i++)
        out[i] = digests + 16 * i;
    size_t lo, hi;
    for (size_t step = 0; step < groups + 4; step++) {
        if (group_of(step, 0, group, groups, n, &lo, &hi)) {
            if (key)
                bl_key_digest_many(key + lo, len + lo, out + lo, hi - lo);
            for (size_t i = lo; i < hi; i++)
                bl_ix_hash(digests + 16 * i, ix->nbuckets, &tag[i], &b1[i], &b2[i]);
        }
        if (step) {
            int buckets = BL_STEP(INDEX_BUCKET_MFENCE), headers = BL_STEP(BLOCK_HEADER_MFENCE);
            if (buckets & headers) /* one fence serves both kinds of line */
                m->ops->mfence(m);
        }
        if (group_of(step, 1, group, groups, n, &lo, &hi))
            for (size_t i = lo; i < hi; i++)
                m->ops->prefetch(m, ix->index_off + b1[i] * BL_LINE, BL_LINE);
        if (group_of(step, 2, group, groups, n, &lo, &hi)) {
            for (size_t i = lo; i < hi; i++) {
                m->ops->load(m, ix->index_off + b1[i] * BL_LINE, &first[i], BL_LINE);
                r[i] = BL_MISS_KEY;
                block[i] = candidate(ix, &first[i], tag[i], &h[i].version);
            }
            header_lines(m, ix, block, lo, hi, 1);
        }
        if (group_of(step, 3, group, groups, n, &lo, &hi))
            header_lines(m, ix, block, lo, hi, 0);
        if (group_of(step, 4, group, groups, n, &lo, &hi))
            confirm_group(m, ix, digests, block, h, lo, hi, r, alone);
        if (group_of(step, 0, group, groups, n, &lo, &hi) && BL_STEP(INDEX_BUCKET_INVALIDATE))
            for (size_t i = lo; i < hi; i++)
                m->ops->invalidate(m, ix->index_off + b1[i] * BL_LINE, BL_LINE);
    }
    /* The keys the pipeline left open, in rounds over keys [lo, hi): every key at once, or
     * for a prefix PROBE_GROUP open keys a round, until a round ends in a miss (the keys
     * after it are never looked at: a prefix ends there). */
    for (size_t lo = 0, hi; lo < n; lo = hi) {
        size_t k = 0, missed = 0;
        for (hi = lo; hi < n && (!prefix || k < PROBE_GROUP); hi++) /* no first-bucket candidate */
            if (block[hi] == UINT32_MAX && !alone[hi])
                at[k] = b2[hi], which[k++] = hi;
        load_lines(m, ix, at, k, second); /* their second buckets */
        size_t absent = 0, found = 0;
        for (size_t j = 0; j < k; j++) {
            size_t i = which[j];
            block[i] = candidate(ix, &second[j], tag[i], &h[i].version);
            if (block[i] != UINT32_MAX)
                found++;
            else if (bl_ix_bucket_ok(&first[i]) && bl_ix_bucket_ok(&second[j])) /* a miss if */
                at[absent] = b1[i], which[absent++] = i, alone[i] = 2;       /* round 4 agrees */
            else
                alone[i] = 1; /* a torn line */
        }
        if (found) { /* the headers of the candidates found in second buckets */
            if (BL_STEP(BLOCK_HEADER_INVALIDATE))
                for (size_t i = lo; i < hi; i++)
                    if (block[i] != UINT32_MAX && r[i] == BL_MISS_KEY && !alone[i])
                        m->ops->invalidate(m, ix->headers_off + (size_t)block[i] * BL_LINE,
                                           BL_LINE);
            if (BL_STEP(BLOCK_HEADER_MFENCE))
                m->ops->mfence(m);
            for (size_t i = lo; i < hi; i++)
                if (block[i] != UINT32_MAX && r[i] == BL_MISS_KEY && !alone[i] &&
                    (r[i] = confirm(m, ix, digests + 16 * i, block[i], &h[i])) < 0)
                    alone[i] = 1;
        }
        load_lines(m, ix, at, absent, second); /* round 4: first buckets again */
        for (size_t j = 0; j < absent; j++) {
            size_t i = which[j];
            if (bl_ix_bucket_ok(&second[j]) && second[j].seq == first[i].seq)
                alone[i] = 0, r[i] = BL_MISS_KEY, block[i] = UINT32_MAX; /* settled: a miss */
            else
                alone[i] = 1;
        }
        for (size_t i = lo; i < hi; i++) {
            if (alone[i])
                r[i] = bl_ix_lookup(m, ix, digests + 16 * i, &block[i], &h[i]);
            missed |= r[i] < 0;
        }
        if (prefix && missed) {
            for (size_t i = hi; i < n; i++) /* not looked at: only a prefix's end lies here */
                r[i] = BL_MISS_KEY, block[i] = UINT32_MAX;
            break;
        }
    }
out:
    free(b1);
    free(b2);
    free(at);
    free(tag);
    free(which);
    free(out);
    free(alone);
    free(first);
    free(second);
}

/* Look many digests up at once (lookup_batch, the whole batch one group). */
void bl_ix_lookup_many(bl_mem *m, const bl_ix *ix, const uint8_t *digests, size_t n,
                       uint32_t *block, bl_header *h, int64_t *r)
{
    lookup_batch(m, ix, NULL, NULL, (uint8_t *)digests, n, block, h, r, 0);
}

/* Digest keys and look them up at once, the reloads overlapping the digests (lookup_batch);
 * each key 1..BL_MAX_KEY bytes, digests[16 * i] its digest on return.  prefix: only the
 * keys up to the first miss are answered (those after it read as misses, unlooked at). */
void bl_ix_lookup_keys(bl_mem *m, const bl_ix *ix, const uint8_t *const *key, const size_t *len,
                       size_t n, uint8_t *digests, uint32_t *block, bl_header *h, int64_t *r,
                       int prefix)
{
    lookup_batch(m, ix, key, len, digests, n, block, h, r, prefix);
}

/* ---- reads ----------------------------------------------------------------------------------- */

/* Whether a race (the key replaced, evicted or torn under us) is worth one more probe. */
int bl_ix_is_race(int64_t r)
{
    return r == BL_MISS_KEY || r == BL_MISS_VERSION || r == BL_MISS_STATE || r == BL_MISS_CHANGED ||
           r == BL_MISS_MAGIC || r == BL_MISS_CHECKSUM;
}

/* One value into out[0..cap): its length, or a miss code (BL_TOO_SMALL: out is too short). */
int64_t bl_ix_read_into(bl_mem *m, const bl_ix *ix, const uint8_t digest[16], uint8_t *out,
                        size_t cap, uint32_t *block, bl_header *h)
{
    int64_t r = BL_MISS_KEY;
    for (int attempt = 0; attempt < 2; attempt++) {
        r = bl_ix_lookup(m, ix, digest, block, h);
        if (r < 0)
            return r;
        if ((uint64_t)r > cap)
            return BL_TOO_SMALL;
        r = bl_read_checked(m, ix->headers_off + (size_t)*block * BL_LINE,
                            ix->payloads_off + (size_t)*block * ix->block_size, h, out);
        if (r >= 0 || !bl_ix_is_race(r))
            return r;
    }
    return r;
}

/*
 * Many values into their buffers (bufs[i] of lens[i] bytes): one batched
 * lookup, then one bl_read_blocks over every found value (its fences shared
 * by the batch, its CRC fused into the copy, the lookup's confirmed headers
 * its first look at each block); a value that lost a race there
 * is read again alone.  got[i]: length or a miss code; versions[i]: the
 * version read (the value's length for BL_TOO_SMALL).
 */
void bl_ix_read_many(bl_mem *m, const bl_ix *ix, const uint8_t *d, size_t n,
                     uint8_t *const *bufs, const size_t *lens, int64_t *got, uint32_t *blocks,
                     uint64_t *versions)
{
    bl_header *h = calloc(n + 1, sizeof(bl_header));
    bl_blockio *io = calloc(n + 1, sizeof(bl_blockio));
    uint64_t *rows = calloc(4 * n + 4, sizeof(uint64_t));
    size_t *which = calloc(n + 1, sizeof(size_t));
    bl_header *seen = calloc(n + 1, sizeof(bl_header));
    const char *why = NULL;
    size_t k = 0;
    if (!h || !io || !rows || !which || !seen)
        goto alone;
    bl_ix_lookup_many(m, ix, d, n, blocks, h, got);
    for (size_t i = 0; i < n; i++) {
        versions[i] = h[i].version;
        if (got[i] < 0)
            continue;
        if ((uint64_t)got[i] > (uint64_t)lens[i]) {
            versions[i] = (uint64_t)got[i];
            got[i] = BL_TOO_SMALL;
            continue;
        }
        size_t extent = (size_t)(ix->nblocks - blocks[i]) * ix->block_size;
        size_t need = ((size_t)got[i] + ix->block_size - 1) / ix->block_size * ix->block_size;
        io[k] = (bl_blockio){.hdr_off = ix->headers_off + (size_t)blocks[i] * BL_LINE,
                             .payload_off = ix->payloads_off + (size_t)blocks[i] * ix->block_size,
                             .cap = need && need < extent ? need : extent,
                             .digest = d + 16 * i,
                             .version = h[i].version};
        uint64_t row[4] = {i, 0, io[k].payload_off, (uint64_t)got[i]};
        memcpy(&rows[4 * k], row, sizeof(row));
        seen[k] = h[i]; /* confirmed by the probe: the read's first look (see bl_read_blocks) */
        which[k++] = i;
    }
    if (k && bl_read_blocks(m, io, k, rows, k, bufs, seen, &why) == 0) {
        for (size_t j = 0; j < k; j++) {
            size_t i = which[j];
            if (io[j].result == got[i])
                continue;
            bl_header again = {0};
            got[i] = bl_ix_read_into(m, ix, d + 16 * i, bufs[i], lens[i], &blocks[i],
                                     &again); /* lost a race in the batch: alone, once more */
            versions[i] = got[i] == BL_TOO_SMALL ? again.length : again.version;
        }
        goto out;
    }
    if (!k)
        goto out;
alone: /* no memory, or the batch named one block twice (a key repeated) */
    for (size_t i = 0; i < n; i++) {
        bl_header one = {0};
        got[i] = bl_ix_read_into(m, ix, d + 16 * i, bufs[i], lens[i], &blocks[i], &one);
        versions[i] = got[i] == BL_TOO_SMALL ? one.length : one.version;
    }
out:
    free(h);
    free(io);
    free(rows);
    free(which);
    free(seen);
}

/* ---- hints ----------------------------------------------------------------------------------- */

/* Bumped in every forked child: hints made before the fork stop being written there
 * (they belong to the parent's host id; reads stay correct without them). */
static volatile unsigned fork_gen;

/* pthread_atfork child handler. */
static void after_fork_in_child(void) { fork_gen++; }

/* Count forks from now on (once per process); 0, or -1 when it cannot. */
int bl_ix_watch_forks(void)
{
    static int watching;
    if (!watching && pthread_atfork(NULL, NULL, after_fork_in_child))
        return -1;
    watching = 1;
    return 0;
}

/* One hint as the ring holds it: the block, and the low 32 bits of its version above it. */
uint64_t bl_ix_hint(uint32_t block, uint64_t version) { return (uint64_t)block | (version << 32); }

/* A hint's block and the low 32 bits of its version. */
void bl_ix_hint_split(uint64_t hint, uint32_t *block, uint32_t *version_low)
{
    *block = (uint32_t)hint;
    *version_low = (uint32_t)(hint >> 32);
}

/* Start counting for the host whose lines begin at hint_off (-1: count, never store). */
void bl_ix_hints_init(bl_ix_hints *r, long long hint_off, uint64_t owner)
{
    memset(r, 0, sizeof(*r));
    r->hint_off = hint_off;
    r->owner = owner;
    r->fork_gen = fork_gen;
}

/* Record one probe: a hit's block and version go to the ring.  1 when the lines are due
 * to be stored (bl_ix_flush_hints). */
int bl_ix_note(bl_ix_hints *r, int hit, uint32_t block, uint64_t version)
{
    if (hit) {
        r->ring[r->seq % BL_IX_HINT_RING] = bl_ix_hint(block, version);
        r->seq++;
        r->hits++;
    } else
        r->misses++;
    return ++r->unflushed >= FLUSH_EVERY;
}

/* Add what the cross-pod tier served (stored with the hints). */
void bl_ix_note_tier(bl_ix_hints *r, uint64_t hits, uint64_t promotions)
{
    r->tier_hits += hits;
    r->promotions += promotions;
    r->unflushed += hits + promotions;
}

/* Store the buffered hints, then the counts line that announces them (m attached). */
void bl_ix_flush_hints(bl_mem *m, bl_ix_hints *r)
{
    if (r->hint_off < 0 || r->fork_gen != fork_gen)
        return;
    const uint64_t per_line = BL_LINE / 8, lines = BL_IX_HINT_RING / per_line;
    uint64_t from = r->flushed_seq;
    if (r->seq - from > BL_IX_HINT_RING)
        from = r->seq - BL_IX_HINT_RING;
    for (uint64_t line = from / per_line; line * per_line < r->seq; line++) {
        uint64_t at = line % lines;
        m->ops->nt_store(m, (size_t)r->hint_off + (1 + at) * BL_LINE, &r->ring[at * per_line],
                         BL_LINE);
    }
    bl_ix_counts c;
    memset(&c, 0, sizeof(c));
    c.seq = r->seq, c.hits = r->hits, c.misses = r->misses, c.owner = r->owner;
    c.tier_hits = r->tier_hits, c.promotions = r->promotions;
    bl_record_seal(&c, sizeof(c));
    m->ops->sfence(m); /* hints before the count that announces them (LRU hints only) */
    m->ops->nt_store(m, (size_t)r->hint_off, &c, sizeof(c));
    m->ops->sfence(m);
    r->flushed_seq = r->seq;
    r->unflushed = 0;
}
