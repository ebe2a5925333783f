/*
 * index.c - the pool-resident hash index, and reads that need no server.
 *
 * The metadata server is the index's only writer; every host reads it with
 * loads.  A bucket is one cache line (bl_ix_bucket): a sequence number, three
 * slots of (tag, first block, version) and a CRC32C of the line.  A key's
 * 16-byte digest names two buckets (bl_ix_hash: bytes 4..7 and 8..11 of the
 * digest, masked to the power-of-two bucket count) and a 32-bit tag (bytes
 * 0..3).  The server (beluga/kv/index.py) keeps a mirror, rewrites a whole
 * bucket line with one non-temporal store, and moves entries between a key's
 * two buckets cuckoo-style, always writing the entry's new bucket (fenced)
 * before the old one: at every instant a key sits in at least one bucket.
 *
 *   probe   invalidate both bucket lines ; MFENCE ; load them ; a line whose
 *           CRC fails is torn (a rewrite in flight, or hostile bytes): load
 *           again, a bounded number of times, then count it as empty.  Every
 *           slot with the key's tag is a candidate.  With no candidate, the
 *           first bucket is loaded again: a changed sequence means a move
 *           raced the probe (its new bucket was read before the entry
 *           arrived, its old one after it left), so the probe is redone.
 *   confirm a candidate counts only if its block's header (block.c) is
 *           PUBLISHED with the key's full digest and the slot's version.
 *   read    bl_read_checked (block.c), right after the confirm: payload
 *           invalidated, copied with the CRC32C fused into the copy, header
 *           loaded again and compared whole with the confirmed one.
 *
 * Why no read lease is needed (the reuse rule, kv/service.py): versions never
 * repeat; an extent goes back to the allocator only after the server has
 * cleared (and fenced) the header at its first block; a new writer publishes
 * WRITING (fenced) before its first payload store.  So a reader whose copy saw
 * any byte stored after the reuse loads a changed header at its re-check, and
 * the read is a miss.  The index entry is only a hint: a stale or hostile
 * entry costs a miss, never other bytes.
 *
 * Hits and misses are counted where only the reading host writes: after the
 * buckets, each host id owns a counts line and a ring of 64 hints (block and
 * the low 32 bits of its version).  The Index object buffers them (under the
 * GIL) and stores them every 64 probes (a ring's worth) with non-temporal stores; the server
 * folds them into its LRU order and its statistics on its own schedule.
 *
 * The Python type Index runs a whole get / get_into / batch in one call: key
 * digest (BLAKE2b-128, equal to hashlib.blake2b(key, digest_size=16)), probe,
 * confirm, copy, checksum, re-check; the GIL is dropped for large copies.
 * Thread-safe (state that changes is touched only with the GIL held); the
 * Memory's section count keeps release() from unmapping under a copy.  An
 * Index inherited by a forked child still reads correctly but stops writing
 * hint lines (they are its parent's host id's).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "beluga_native.h"

#define MAX_KEY 256
#define TORN_RETRIES 8     /* loads of a torn bucket before it counts as empty */
#define MOVE_RETRIES 4     /* probes redone because a move raced them */
#define MAX_CANDIDATES (2 * BL_IX_SLOTS)
#define FLUSH_EVERY 64u           /* probes between two stores of the hint lines (a ring) */
#define PROBE_CHUNK 64            /* keys looked up together by locate / exists */

/* ---- BLAKE2b-128 (RFC 7693), unkeyed, for key digests ------------------------------------ */

static const uint64_t b2_iv[8] = {
    0x6a09e667f3bcc908ull, 0xbb67ae8584caa73bull, 0x3c6ef372fe94f82bull, 0xa54ff53a5f1d36f1ull,
    0x510e527fade682d1ull, 0x9b05688c2b3e6c1full, 0x1f83d9abfb41bd6bull, 0x5be0cd19137e2179ull};

static const uint8_t b2_sigma[10][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
};

/* Rotate right. */
static inline uint64_t rotr64(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

/* Little-endian u64 from bytes. */
static inline uint64_t le64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8); /* x86 and every target we build for are little-endian */
    return v;
}

#define B2_G(a, b, c, d, x, y)                                                                     \
    do {                                                                                           \
        a = a + b + (x);                                                                           \
        d = rotr64(d ^ a, 32);                                                                     \
        c = c + d;                                                                                 \
        b = rotr64(b ^ c, 24);                                                                     \
        a = a + b + (y);                                                                           \
        d = rotr64(d ^ a, 16);                                                                     \
        c = c + d;                                                                                 \
        b = rotr64(b ^ c, 63);                                                                     \
    } while (0)

/* One compression of a 128-byte block; t: bytes hashed so far, last: the final block. */
static void b2_compress(uint64_t h[8], const uint8_t block[128], uint64_t t, int last)
{
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++)
        m[i] = le64(block + 8 * i);
    for (int i = 0; i < 8; i++)
        v[i] = h[i], v[i + 8] = b2_iv[i];
    v[12] ^= t; /* keys are short: the high word of the counter stays 0 */
    if (last)
        v[14] = ~v[14];
#pragma GCC unroll 12 /* constant message indexes: about twice as fast as the loop */
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = b2_sigma[r % 10];
        B2_G(v[0], v[4], v[8], v[12], m[s[0]], m[s[1]]);
        B2_G(v[1], v[5], v[9], v[13], m[s[2]], m[s[3]]);
        B2_G(v[2], v[6], v[10], v[14], m[s[4]], m[s[5]]);
        B2_G(v[3], v[7], v[11], v[15], m[s[6]], m[s[7]]);
        B2_G(v[0], v[5], v[10], v[15], m[s[8]], m[s[9]]);
        B2_G(v[1], v[6], v[11], v[12], m[s[10]], m[s[11]]);
        B2_G(v[2], v[7], v[8], v[13], m[s[12]], m[s[13]]);
        B2_G(v[3], v[4], v[9], v[14], m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++)
        h[i] ^= v[i] ^ v[i + 8];
}

/* The 16-byte BLAKE2b digest of a key: the identity block headers and the index keep. */
void bl_blake2b_128(const void *key, size_t n, uint8_t out[16])
{
    const uint8_t *p = key;
    uint64_t h[8];
    uint8_t last[128];
    memcpy(h, b2_iv, sizeof(h));
    h[0] ^= 0x01010000ull ^ 16u; /* depth 1, fanout 1, no key, 16-byte output */
    size_t done = 0;
    while (n - done > 128) {
        b2_compress(h, p + done, done + 128, 0);
        done += 128;
    }
    memset(last, 0, sizeof(last));
    memcpy(last, p + done, n - done);
    b2_compress(h, last, n, 1);
    memcpy(out, h, 16);
}

#if defined(__x86_64__)
#include <immintrin.h>
#define B2_X8 1

#define B2_G8(a, b, c, d, x, y)                                                                    \
    do {                                                                                           \
        a = _mm512_add_epi64(_mm512_add_epi64(a, b), x);                                           \
        d = _mm512_ror_epi64(_mm512_xor_si512(d, a), 32);                                          \
        c = _mm512_add_epi64(c, d);                                                                \
        b = _mm512_ror_epi64(_mm512_xor_si512(b, c), 24);                                          \
        a = _mm512_add_epi64(_mm512_add_epi64(a, b), y);                                           \
        d = _mm512_ror_epi64(_mm512_xor_si512(d, a), 16);                                          \
        c = _mm512_add_epi64(c, d);                                                                \
        b = _mm512_ror_epi64(_mm512_xor_si512(b, c), 63);                                          \
    } while (0)

/*
 * Eight BLAKE2b-128 digests at once, one per 64-bit lane of AVX-512 registers,
 * for keys of at most one block (128 bytes): the keys of a prefix chain.
 */
__attribute__((target("avx512f"))) static void b2_x8(const uint8_t *const key[8],
                                                     const size_t len[8], uint8_t *const out[8])
{
    uint64_t w[16][8], t[8], h0[8];
    for (int i = 0; i < 8; i++) {
        uint8_t block[128] = {0};
        memcpy(block, key[i], len[i]);
        for (int j = 0; j < 16; j++)
            w[j][i] = le64(block + 8 * j);
        t[i] = len[i];
    }
    memcpy(h0, b2_iv, sizeof(h0));
    h0[0] ^= 0x01010000ull ^ 16u;
    __m512i m[16], v[16];
    for (int j = 0; j < 16; j++)
        m[j] = _mm512_loadu_si512(w[j]);
    for (int k = 0; k < 8; k++) {
        v[k] = _mm512_set1_epi64((long long)h0[k]);
        v[k + 8] = _mm512_set1_epi64((long long)b2_iv[k]);
    }
    v[12] = _mm512_xor_si512(v[12], _mm512_loadu_si512(t));
    v[14] = _mm512_xor_si512(v[14], _mm512_set1_epi64(-1)); /* the last (and only) block */
#pragma GCC unroll 12
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = b2_sigma[r % 10];
        B2_G8(v[0], v[4], v[8], v[12], m[s[0]], m[s[1]]);
        B2_G8(v[1], v[5], v[9], v[13], m[s[2]], m[s[3]]);
        B2_G8(v[2], v[6], v[10], v[14], m[s[4]], m[s[5]]);
        B2_G8(v[3], v[7], v[11], v[15], m[s[6]], m[s[7]]);
        B2_G8(v[0], v[5], v[10], v[15], m[s[8]], m[s[9]]);
        B2_G8(v[1], v[6], v[11], v[12], m[s[10]], m[s[11]]);
        B2_G8(v[2], v[7], v[8], v[13], m[s[12]], m[s[13]]);
        B2_G8(v[3], v[4], v[9], v[14], m[s[14]], m[s[15]]);
    }
    uint64_t h[2][8];
    for (int k = 0; k < 2; k++)
        _mm512_storeu_si512(h[k], _mm512_xor_si512(_mm512_set1_epi64((long long)h0[k]),
                                                   _mm512_xor_si512(v[k], v[k + 8])));
    for (int i = 0; i < 8; i++) {
        memcpy(out[i], &h[0][i], 8);
        memcpy(out[i] + 8, &h[1][i], 8);
    }
}
#endif

/* Digests of n keys of at most 128 bytes each: eight at a time where the CPU allows. */
static void blake2b_128_many(const uint8_t *const *key, const size_t *len, uint8_t *const *out,
                             size_t n)
{
    size_t i = 0;
#ifdef B2_X8
    static int x8 = -1;
    if (x8 < 0)
        x8 = bl_cpu_has("avx512f") && !getenv("BELUGA_NO_BLAKE2B_X8");
    for (; x8 && i + 8 <= n; i += 8)
        b2_x8(key + i, len + i, out + i);
#endif
    for (; i < n; i++)
        bl_blake2b_128(key[i], len[i], out[i]);
}

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
void bl_ix_seal(bl_ix_bucket *b) { b->crc = ~bl_crc32c(~0u, b, offsetof(bl_ix_bucket, crc)); }

/* 1 when a loaded line is a whole bucket: its CRC matches, or it is all zeros (never written). */
int bl_ix_bucket_ok(const bl_ix_bucket *b)
{
    static const bl_ix_bucket zero;
    return b->crc == ~bl_crc32c(~0u, b, offsetof(bl_ix_bucket, crc)) || !memcmp(b, &zero, sizeof(zero));
}

/* Set a hint counts line's CRC. */
static void counts_seal(bl_ix_counts *c) { c->crc = ~bl_crc32c(~0u, c, offsetof(bl_ix_counts, crc)); }

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

/* Load both buckets until each is whole (a torn one, after TORN_RETRIES, reads as empty). */
static void load_whole(bl_mem *m, const bl_ix *ix, uint64_t b1, uint64_t b2, bl_ix_bucket out[2])
{
    for (int i = 0;; i++) {
        load_buckets(m, ix, b1, b2, out);
        int ok0 = bl_ix_bucket_ok(&out[0]), ok1 = bl_ix_bucket_ok(&out[1]);
        if ((ok0 && ok1) || i == TORN_RETRIES) {
            if (!ok0)
                memset(&out[0], 0, sizeof(out[0]));
            if (!ok1)
                memset(&out[1], 0, sizeof(out[1]));
            return;
        }
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

/*
 * Look many digests up at once: every bucket line invalidated, one MFENCE,
 * all loaded; then every candidate's header invalidated, one MFENCE, all
 * loaded and checked.  A key whose buckets were torn, whose first candidate
 * did not confirm, or that was not found goes through bl_ix_lookup alone
 * (torn-line retries, the other candidates, the race with a move).
 * r[i]: the length, or a BL_MISS_* code; block[i], h[i] as bl_ix_lookup.
 */
void bl_ix_lookup_many(bl_mem *m, const bl_ix *ix, const uint8_t *digests, size_t n,
                       uint32_t *block, bl_header *h, int64_t *r)
{
    uint64_t *pair = malloc((2 * n + 1) * sizeof(uint64_t));
    uint32_t *tag = malloc((n + 1) * sizeof(uint32_t));
    bl_ix_bucket *b = malloc((2 * n + 1) * sizeof(bl_ix_bucket));
    if (!pair || !tag || !b) { /* no room to batch: one at a time */
        for (size_t i = 0; i < n; i++)
            r[i] = bl_ix_lookup(m, ix, digests + 16 * i, &block[i], &h[i]);
        goto out;
    }
    for (size_t i = 0; i < n; i++)
        bl_ix_hash(digests + 16 * i, ix->nbuckets, &tag[i], &pair[2 * i], &pair[2 * i + 1]);
    if (BL_STEP(INDEX_BUCKET_INVALIDATE))
        for (size_t i = 0; i < 2 * n; i++)
            m->ops->invalidate(m, ix->index_off + pair[i] * BL_LINE, BL_LINE);
    if (BL_STEP(INDEX_BUCKET_MFENCE))
        m->ops->mfence(m);
    for (size_t i = 0; i < 2 * n; i++)
        m->ops->load(m, ix->index_off + pair[i] * BL_LINE, &b[i], BL_LINE);
    for (size_t i = 0; i < n; i++) { /* the first candidate of each key, or a miss to redo */
        r[i] = BL_MISS_KEY;
        block[i] = UINT32_MAX;
        if (!bl_ix_bucket_ok(&b[2 * i]) || !bl_ix_bucket_ok(&b[2 * i + 1]))
            continue;
        for (int k = 0; k < 2 * BL_IX_SLOTS && block[i] == UINT32_MAX; k++) {
            const bl_ix_slot *e = &b[2 * i + k / BL_IX_SLOTS].slot[k % BL_IX_SLOTS];
            if (e->tag == tag[i] && e->block < ix->nblocks && e->version) {
                block[i] = e->block;
                h[i].version = e->version;
            }
        }
    }
    if (BL_STEP(BLOCK_HEADER_INVALIDATE))
        for (size_t i = 0; i < n; i++)
            if (block[i] != UINT32_MAX)
                m->ops->invalidate(m, ix->headers_off + (size_t)block[i] * BL_LINE, BL_LINE);
    if (BL_STEP(BLOCK_HEADER_MFENCE))
        m->ops->mfence(m);
    for (size_t i = 0; i < n; i++) {
        if (block[i] != UINT32_MAX) {
            uint64_t version = h[i].version;
            m->ops->load(m, ix->headers_off + (size_t)block[i] * BL_LINE, &h[i], BL_LINE);
            const bl_header *x = &h[i];
            size_t cap = (size_t)(ix->nblocks - block[i]) * ix->block_size;
            if (bl_header_check(x) && x->state == BL_PUBLISHED && x->version == version &&
                !memcmp(x->digest, digests + 16 * i, 16) && x->length <= cap &&
                x->length <= m->size - (ix->payloads_off + (size_t)block[i] * ix->block_size)) {
                r[i] = (int64_t)x->length;
                continue;
            }
        }
        r[i] = bl_ix_lookup(m, ix, digests + 16 * i, &block[i], &h[i]);
    }
out:
    free(pair);
    free(tag);
    free(b);
}

/* ---- the Python type ----------------------------------------------------------------------- */

/* Bumped in every forked child: an Index made before the fork stops writing hint lines
 * there (they belong to the parent's host id; reads stay correct without them). */
static volatile unsigned fork_gen;

/* pthread_atfork child handler. */
static void after_fork_in_child(void) { fork_gen++; }

typedef struct {
    PyObject_HEAD
    MemoryObject *mem;
    bl_ix ix;
    long long hint_off; /* this host's counts line, or -1: no hints */
    uint64_t owner;
    uint64_t seq, hits, misses, flushed_seq, unflushed, tier_hits, promotions;
    uint64_t ring[BL_IX_HINT_RING];
    unsigned fork_gen; /* fork_gen when made */
} IndexObject;

/* Whether a race (the key replaced, evicted or torn under us) is worth one more probe. */
static int is_race(int64_t r)
{
    return r == BL_MISS_KEY || r == BL_MISS_VERSION || r == BL_MISS_STATE || r == BL_MISS_CHANGED ||
           r == BL_MISS_MAGIC || r == BL_MISS_CHECKSUM;
}

/* Store the buffered hints and the counts line (GIL held, Memory attached). */
static void flush_hints(IndexObject *self)
{
    if (self->hint_off < 0 || !self->mem->has_view || self->fork_gen != fork_gen)
        return;
    bl_mem *m = &self->mem->mem;
    const uint64_t per_line = BL_LINE / 8, lines = BL_IX_HINT_RING / per_line;
    uint64_t from = self->flushed_seq;
    if (self->seq - from > BL_IX_HINT_RING)
        from = self->seq - BL_IX_HINT_RING;
    for (uint64_t line = from / per_line; line * per_line < self->seq; line++) {
        uint64_t at = line % lines;
        m->ops->nt_store(m, (size_t)self->hint_off + (1 + at) * BL_LINE, &self->ring[at * per_line],
                         BL_LINE);
    }
    bl_ix_counts c;
    memset(&c, 0, sizeof(c));
    c.seq = self->seq, c.hits = self->hits, c.misses = self->misses, c.owner = self->owner;
    c.tier_hits = self->tier_hits, c.promotions = self->promotions;
    counts_seal(&c);
    m->ops->sfence(m); /* hints before the count that announces them (LRU hints only) */
    m->ops->nt_store(m, (size_t)self->hint_off, &c, sizeof(c));
    m->ops->sfence(m);
    self->flushed_seq = self->seq;
    self->unflushed = 0;
}

/* Record one probe (GIL held): a hit's block and version go to the ring. */
static void record(IndexObject *self, int hit, uint32_t block, uint64_t version)
{
    if (hit) {
        self->ring[self->seq % BL_IX_HINT_RING] = (uint64_t)block | (version << 32);
        self->seq++;
        self->hits++;
    } else
        self->misses++;
    if (++self->unflushed >= FLUSH_EVERY)
        flush_hints(self);
}

/* A key (str or bytes-like, 1..256 bytes) to its digest; 0 with ValueError raised otherwise. */
static int key_digest(PyObject *key, uint8_t out[16])
{
    if (PyUnicode_Check(key)) {
        Py_ssize_t n;
        const char *s = PyUnicode_AsUTF8AndSize(key, &n);
        if (!s)
            return 0;
        if (n < 1 || n > MAX_KEY) {
            PyErr_Format(PyExc_ValueError,
                         "a key is 1..%d bytes, not %zd; hash longer keys (e.g. "
                         "hashlib.sha256(key).digest())",
                         MAX_KEY, n);
            return 0;
        }
        bl_blake2b_128(s, (size_t)n, out);
        return 1;
    }
    Py_buffer v;
    if (PyObject_GetBuffer(key, &v, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "a key is str or bytes, not %s", Py_TYPE(key)->tp_name);
        return 0;
    }
    int ok = v.len >= 1 && v.len <= MAX_KEY;
    if (ok)
        bl_blake2b_128(v.buf, (size_t)v.len, out);
    else
        PyErr_Format(PyExc_ValueError,
                     "a key is 1..%d bytes, not %zd; hash longer keys (e.g. "
                     "hashlib.sha256(key).digest())",
                     MAX_KEY, v.len);
    PyBuffer_Release(&v);
    return ok;
}

/* Index(memory, index_off, nbuckets, headers_off, payloads_off, block_size, nblocks,
 *       hint_off=-1, owner=0) */
static int Index_init(IndexObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"memory",     "index_off", "nbuckets", "headers_off", "payloads_off",
                             "block_size", "nblocks",   "hint_off", "owner",       NULL};
    PyObject *mem;
    unsigned long long index_off, nbuckets, headers_off, payloads_off, block_size, nblocks;
    unsigned long long owner = 0;
    long long hint_off = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!KKKKKK|LK", kwlist, &BlMemoryType, &mem,
                                     &index_off, &nbuckets, &headers_off, &payloads_off,
                                     &block_size, &nblocks, &hint_off, &owner))
        return -1;
    MemoryObject *mo = (MemoryObject *)mem;
    if (!mo->has_view) {
        bl_fail(bl_coherence_error, "this Memory was released; attach the pool again");
        return -1;
    }
    size_t size = mo->mem.size;
    if (!nbuckets || (nbuckets & (nbuckets - 1)) || index_off % BL_LINE ||
        nbuckets > (size - index_off) / BL_LINE || index_off > size || !block_size || !nblocks ||
        headers_off % BL_LINE || headers_off > size || nblocks > (size - headers_off) / BL_LINE ||
        payloads_off > size || nblocks > (size - payloads_off) / block_size ||
        (hint_off >= 0 &&
         ((unsigned long long)hint_off % BL_LINE ||
          (unsigned long long)hint_off + BL_IX_HINT_LINES * BL_LINE > size))) {
        bl_fail(bl_coherence_error,
                "index geometry does not fit the %zu-byte mapping (or nbuckets is not a power "
                "of two); attach through beluga.pool.Pool, which reads it from the superblock",
                size);
        return -1;
    }
    Py_XSETREF(self->mem, (MemoryObject *)Py_NewRef(mem));
    self->ix = (bl_ix){index_off, nbuckets, headers_off, payloads_off, block_size, nblocks};
    self->hint_off = hint_off;
    self->owner = owner;
    self->seq = self->hits = self->misses = self->flushed_seq = self->unflushed = 0;
    self->tier_hits = self->promotions = 0;
    self->fork_gen = fork_gen;
    return 0;
}

/* Flush what is buffered, then drop the Memory. */
static void Index_dealloc(IndexObject *self)
{
    bl_section s;
    if (self->mem && self->unflushed) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (bl_section_enter(&s, self->mem, 0, NULL, NULL) == 0) {
            flush_hints(self);
            bl_section_leave(&s);
        }
        PyErr_Restore(type, value, tb); /* a released Memory: nothing to flush into */
    }
    Py_CLEAR(self->mem);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Check that the Index was initialised; 0 with an error raised if not. */
static int ready(IndexObject *self)
{
    if (self->mem)
        return 1;
    bl_fail(bl_coherence_error, "Index was not initialised");
    return 0;
}

/* Look a digest up and confirm it (no copy); r: length or a miss code. */
static int64_t find(IndexObject *self, const uint8_t d[16], uint32_t *block, bl_header *h)
{
    return bl_ix_lookup(&self->mem->mem, &self->ix, d, block, h);
}

/* One value into out[0..cap): its length, or a miss code (BL_TOO_SMALL: out is too short). */
static int64_t read_into(IndexObject *self, const uint8_t d[16], uint8_t *out, size_t cap,
                         uint32_t *block, bl_header *h)
{
    int64_t r = BL_MISS_KEY;
    for (int attempt = 0; attempt < 2; attempt++) {
        r = find(self, d, block, h);
        if (r < 0)
            return r;
        if ((uint64_t)r > cap)
            return BL_TOO_SMALL;
        r = bl_read_checked(&self->mem->mem, self->ix.headers_off + (size_t)*block * BL_LINE,
                            self->ix.payloads_off + (size_t)*block * self->ix.block_size, h, out);
        if (r >= 0 || !is_race(r))
            return r;
    }
    return r;
}

/* Raise the too-small error for a buffer of `have` bytes and a value of `need`. */
static PyObject *too_small(Py_ssize_t have, unsigned long long need)
{
    return PyErr_Format(PyExc_ValueError,
                        "the buffer holds %zd bytes but the value is %llu bytes; pass a buffer "
                        "of at least that size",
                        have, need);
}

/* get(key) -> bytes | None */
static PyObject *Index_get(IndexObject *self, PyObject *key)
{
    uint8_t d[16];
    if (!ready(self) || !key_digest(key, d))
        return NULL;
    for (int attempt = 0; attempt < 2; attempt++) {
        bl_section s;
        bl_header h;
        uint32_t block = 0;
        if (bl_section_enter(&s, self->mem, 0, NULL, NULL) < 0)
            return NULL;
        int64_t r = find(self, d, &block, &h);
        if (r < 0) {
            bl_section_leave(&s);
            if (!is_race(r) || attempt)
                break;
            continue;
        }
        PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)r);
        if (!out) {
            bl_section_leave(&s);
            return NULL;
        }
        bl_section_gil(&s, (size_t)r >= BL_NOGIL_BYTES);
        int64_t got = bl_read_checked(&self->mem->mem, self->ix.headers_off + (size_t)block * BL_LINE,
                                      self->ix.payloads_off + (size_t)block * self->ix.block_size,
                                      &h, PyBytes_AS_STRING(out));
        bl_section_leave(&s);
        if (got == r) {
            record(self, 1, block, h.version);
            return out;
        }
        Py_DECREF(out);
        if (!is_race(got) && got != BL_TOO_SMALL)
            break;
    }
    record(self, 0, 0, 0);
    Py_RETURN_NONE;
}

/* get_into(key, buffer) -> the value's length, or -1 on a miss */
static PyObject *Index_get_into(IndexObject *self, PyObject *args)
{
    PyObject *key;
    Py_buffer out;
    uint8_t d[16];
    if (!ready(self) || !PyArg_ParseTuple(args, "Ow*", &key, &out))
        return NULL;
    if (!key_digest(key, d)) {
        PyBuffer_Release(&out);
        return NULL;
    }
    bl_section s;
    bl_header h = {0};
    uint32_t block = 0;
    int64_t r = 0;
    if (bl_section_enter(&s, self->mem, (size_t)out.len >= BL_NOGIL_BYTES, NULL, NULL) == 0) {
        r = read_into(self, d, out.buf, (size_t)out.len, &block, &h);
        bl_section_leave(&s);
    }
    PyBuffer_Release(&out);
    if (PyErr_Occurred())
        return NULL;
    if (r == BL_TOO_SMALL)
        return too_small(out.len, (unsigned long long)h.length);
    record(self, r >= 0, block, h.version);
    return PyLong_FromLongLong(r >= 0 ? r : -1);
}

/* Digests of a sequence of keys into a new array (PyMem); NULL with an error raised.
 * str and bytes keys of up to 128 bytes are digested eight at a time. */
static uint8_t *digests_of(PyObject *seq, Py_ssize_t *n)
{
    *n = PySequence_Fast_GET_SIZE(seq);
    size_t cap = (size_t)(*n ? *n : 1);
    uint8_t *d = PyMem_Malloc(cap * 16);
    const uint8_t **key = PyMem_Malloc(cap * sizeof(*key));
    size_t *len = PyMem_Malloc(cap * sizeof(*len));
    uint8_t **out = PyMem_Malloc(cap * sizeof(*out));
    size_t short_keys = 0;
    if (!d || !key || !len || !out) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        PyObject *k = PySequence_Fast_GET_ITEM(seq, i);
        const char *p = NULL;
        Py_ssize_t size = 0;
        if (PyBytes_CheckExact(k)) {
            p = PyBytes_AS_STRING(k);
            size = PyBytes_GET_SIZE(k);
        } else if (PyUnicode_Check(k)) {
            p = PyUnicode_AsUTF8AndSize(k, &size);
            if (!p)
                goto fail;
        }
        if (p && size >= 1 && size <= 128) { /* the common key: batched below */
            key[short_keys] = (const uint8_t *)p;
            len[short_keys] = (size_t)size;
            out[short_keys++] = d + 16 * i;
        } else if (!key_digest(k, d + 16 * i)) /* longer, other buffers, or bad: one by one */
            goto fail;
    }
    blake2b_128_many(key, len, out, short_keys);
    PyMem_Free(key);
    PyMem_Free(len);
    PyMem_Free(out);
    return d;
fail:
    PyMem_Free(d);
    PyMem_Free(key);
    PyMem_Free(len);
    PyMem_Free(out);
    return NULL;
}

/*
 * Many values into their buffers (GIL dropped or not, inside a section):
 * one batched lookup, then one bl_read_blocks over every found value (its
 * fences shared by the batch, its CRC fused into the copy); a value that
 * lost a race there is read again alone.  got[i]: length or a miss code;
 * versions[i]: the version read (the value's length for BL_TOO_SMALL).
 */
static void read_many(IndexObject *self, const uint8_t *d, size_t n, Py_buffer *views,
                      int64_t *got, uint32_t *blocks, uint64_t *versions)
{
    bl_mem *m = &self->mem->mem;
    const bl_ix *ix = &self->ix;
    bl_header *h = calloc(n + 1, sizeof(bl_header));
    bl_blockio *io = calloc(n + 1, sizeof(bl_blockio));
    uint64_t *rows = calloc(4 * n + 4, sizeof(uint64_t));
    uint8_t **bufs = calloc(n + 1, sizeof(uint8_t *));
    size_t *which = calloc(n + 1, sizeof(size_t));
    const char *why = NULL;
    size_t k = 0;
    if (!h || !io || !rows || !bufs || !which)
        goto alone;
    bl_ix_lookup_many(m, ix, d, n, blocks, h, got);
    for (size_t i = 0; i < n; i++) {
        bufs[i] = views[i].buf;
        versions[i] = h[i].version;
        if (got[i] < 0)
            continue;
        if ((uint64_t)got[i] > (uint64_t)views[i].len) {
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
        which[k++] = i;
    }
    if (k && bl_read_blocks(m, io, k, rows, k, bufs, &why) == 0) {
        for (size_t j = 0; j < k; j++) {
            size_t i = which[j];
            if (io[j].result == got[i])
                continue;
            bl_header again = {0};
            got[i] = read_into(self, d + 16 * i, views[i].buf, (size_t)views[i].len, &blocks[i],
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
        got[i] = read_into(self, d + 16 * i, views[i].buf, (size_t)views[i].len, &blocks[i], &one);
        versions[i] = got[i] == BL_TOO_SMALL ? one.length : one.version;
    }
out:
    free(h);
    free(io);
    free(rows);
    free(bufs);
    free(which);
}

/* get_many_into(keys, buffers) -> [length or -1 per key], all copies in one section */
static PyObject *Index_get_many_into(IndexObject *self, PyObject *args)
{
    PyObject *keys, *bufs, *kseq = NULL, *bseq = NULL, *result = NULL;
    if (!ready(self) || !PyArg_ParseTuple(args, "OO", &keys, &bufs))
        return NULL;
    kseq = PySequence_Fast(keys, "keys must be a sequence");
    bseq = kseq ? PySequence_Fast(bufs, "buffers must be a sequence") : NULL;
    if (!bseq)
        goto done;
    Py_ssize_t n, nb = PySequence_Fast_GET_SIZE(bseq);
    uint8_t *d = digests_of(kseq, &n);
    if (!d)
        goto done;
    if (n != nb) {
        PyErr_Format(PyExc_ValueError, "%zd keys but %zd buffers", n, nb);
        PyMem_Free(d);
        goto done;
    }
    Py_buffer *views = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    int64_t *got = PyMem_Calloc((size_t)(n ? n : 1), sizeof(int64_t));
    uint32_t *blocks = PyMem_Calloc((size_t)(n ? n : 1), sizeof(uint32_t));
    uint64_t *versions = PyMem_Calloc((size_t)(n ? n : 1), sizeof(uint64_t));
    Py_ssize_t held = 0;
    size_t total = 0;
    if (!views || !got || !blocks || !versions) {
        PyErr_NoMemory();
        goto free;
    }
    for (; held < n; held++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(bseq, held), &views[held],
                               PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError,
                         "buffer %zd is not a writable C-contiguous buffer; get_into needs one",
                         held);
            goto free;
        }
        total += (size_t)views[held].len;
    }
    bl_section s;
    if (bl_section_enter(&s, self->mem, total >= BL_NOGIL_BYTES, NULL, NULL) < 0)
        goto free;
    read_many(self, d, (size_t)n, views, got, blocks, versions);
    bl_section_leave(&s);
    result = PyList_New(n);
    for (Py_ssize_t i = 0; result && i < n; i++) {
        if (got[i] == BL_TOO_SMALL) {
            Py_CLEAR(result);
            too_small(views[i].len, (unsigned long long)versions[i]);
            break;
        }
        record(self, got[i] >= 0, blocks[i], versions[i]);
        PyObject *v = PyLong_FromLongLong(got[i] >= 0 ? got[i] : -1);
        if (!v) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, v);
    }
free:
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(got);
    PyMem_Free(blocks);
    PyMem_Free(versions);
    PyMem_Free(d);
done:
    Py_XDECREF(kseq);
    Py_XDECREF(bseq);
    return result;
}

/* get_many(keys) -> [bytes or None per key] */
static PyObject *Index_get_many(IndexObject *self, PyObject *keys)
{
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *v = Index_get(self, PySequence_Fast_GET_ITEM(seq, i));
        if (!v)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, v);
    }
    Py_DECREF(seq);
    return out;
}

/* Probe keys without copying; `mode` 0: locate (tuples), 1: exists (bools). */
static PyObject *probe_common(IndexObject *self, PyObject *args, PyObject *kw, int mode)
{
    static char *kwlist[] = {"keys", "prefix", NULL};
    PyObject *keys, *seq, *out = NULL;
    int prefix = 0;
    if (!ready(self) || !PyArg_ParseTupleAndKeywords(args, kw, "O|p", kwlist, &keys, &prefix))
        return NULL;
    seq = PySequence_Fast(keys, "keys must be a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t n;
    uint8_t *d = digests_of(seq, &n);
    Py_DECREF(seq);
    if (!d)
        return NULL;
    out = PyList_New(0);
    bl_section s;
    if (!out || bl_section_enter(&s, self->mem, 0, NULL, NULL) < 0) {
        Py_XDECREF(out);
        PyMem_Free(d);
        return NULL;
    }
    bl_header *hs = PyMem_Calloc((size_t)PROBE_CHUNK, sizeof(bl_header));
    uint32_t blocks[PROBE_CHUNK];
    int64_t rs[PROBE_CHUNK];
    if (!hs) {
        PyErr_NoMemory();
        Py_CLEAR(out);
    }
    for (Py_ssize_t at = 0; out && at < n; at += PROBE_CHUNK) {
        size_t len = (size_t)(n - at < PROBE_CHUNK ? n - at : PROBE_CHUNK);
        bl_ix_lookup_many(&self->mem->mem, &self->ix, d + 16 * at, len, blocks, hs, rs);
        int stop = 0;
        for (size_t j = 0; j < len && !stop; j++) {
            int64_t r = rs[j];
            record(self, r >= 0, blocks[j], hs[j].version);
            PyObject *v;
            if (mode)
                v = PyBool_FromLong(r >= 0);
            else if (r < 0)
                v = Py_NewRef(Py_None);
            else
                v = Py_BuildValue("(y#IKK)", (const char *)(d + 16 * (at + j)), (Py_ssize_t)16,
                                  blocks[j], (unsigned long long)hs[j].version,
                                  (unsigned long long)hs[j].length);
            if (!v || PyList_Append(out, v) < 0) {
                Py_XDECREF(v);
                Py_CLEAR(out);
                break;
            }
            Py_DECREF(v);
            stop = r < 0 && prefix; /* the first miss ends a prefix (and is its last item) */
        }
        if (stop)
            break;
    }
    PyMem_Free(hs);
    bl_section_leave(&s);
    PyMem_Free(d);
    return out;
}

/* locate(keys, prefix=False) -> [(digest, block, version, length) or None] */
static PyObject *Index_locate(IndexObject *self, PyObject *args, PyObject *kw)
{
    return probe_common(self, args, kw, 0);
}

/* exists(keys, prefix=False) -> [bool] */
static PyObject *Index_exists(IndexObject *self, PyObject *args, PyObject *kw)
{
    return probe_common(self, args, kw, 1);
}

/* exists_one(key) -> bool: is_exist without building a list */
static PyObject *Index_exists_one(IndexObject *self, PyObject *key)
{
    uint8_t d[16];
    if (!ready(self) || !key_digest(key, d))
        return NULL;
    bl_section s;
    if (bl_section_enter(&s, self->mem, 0, NULL, NULL) < 0)
        return NULL;
    bl_header h = {0};
    uint32_t block = 0;
    int64_t r = find(self, d, &block, &h);
    bl_section_leave(&s);
    record(self, r >= 0, block, h.version);
    return PyBool_FromLong(r >= 0);
}

/* flush_hints(): store buffered hints and counts now (before stats, at close) */
static PyObject *Index_flush_hints(IndexObject *self, PyObject *unused)
{
    if (!ready(self))
        return NULL;
    bl_section s;
    if (bl_section_enter(&s, self->mem, 0, NULL, NULL) < 0)
        return NULL;
    flush_hints(self);
    bl_section_leave(&s);
    Py_RETURN_NONE;
}

/* count_tier(hits, promotions): add what the cross-pod tier served (stored with the hints) */
static PyObject *Index_count_tier(IndexObject *self, PyObject *args)
{
    unsigned long long hits, promotions;
    if (!ready(self) || !PyArg_ParseTuple(args, "KK", &hits, &promotions))
        return NULL;
    self->tier_hits += hits;
    self->promotions += promotions;
    self->unflushed += hits + promotions;
    Py_RETURN_NONE;
}

/* counts -> (hints recorded, hits, misses) of this Index */
static PyObject *Index_get_counts(IndexObject *self, void *c)
{
    return Py_BuildValue("(KKK)", (unsigned long long)self->seq, (unsigned long long)self->hits,
                         (unsigned long long)self->misses);
}

static PyMethodDef Index_methods[] = {
    {"get", (PyCFunction)Index_get, METH_O, "get(key) -> bytes | None"},
    {"get_into", (PyCFunction)Index_get_into, METH_VARARGS,
     "get_into(key, buffer) -> length, or -1 on a miss"},
    {"get_many", (PyCFunction)Index_get_many, METH_O, "get_many(keys) -> [bytes | None]"},
    {"get_many_into", (PyCFunction)Index_get_many_into, METH_VARARGS,
     "get_many_into(keys, buffers) -> [length or -1]"},
    {"locate", (PyCFunction)(void (*)(void))Index_locate, METH_VARARGS | METH_KEYWORDS,
     "locate(keys, prefix=False) -> [(digest, block, version, length) | None]"},
    {"exists", (PyCFunction)(void (*)(void))Index_exists, METH_VARARGS | METH_KEYWORDS,
     "exists(keys, prefix=False) -> [bool]"},
    {"exists_one", (PyCFunction)Index_exists_one, METH_O, "exists_one(key) -> bool"},
    {"flush_hints", (PyCFunction)Index_flush_hints, METH_NOARGS, "store buffered hints now"},
    {"count_tier", (PyCFunction)Index_count_tier, METH_VARARGS,
     "count_tier(hits, promotions): the cross-pod tier's work, stored with the hints"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Index_getset[] = {
    {"counts", (getter)Index_get_counts, NULL, "(hints, hits, misses) recorded here", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = BL_TYPE_PREFIX "Index",
    .tp_basicsize = sizeof(IndexObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One-sided reads through the pool-resident index (index.c). Thread-safe.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Index_init,
    .tp_dealloc = (destructor)Index_dealloc,
    .tp_methods = Index_methods,
    .tp_getset = Index_getset,
};

/* ---- module helpers: the format, for the server's writer and for tests --------------------- */

/* key_digest(key) -> 16 bytes (BLAKE2b-128, as beluga.coherence.digest) */
static PyObject *mod_key_digest(PyObject *mod, PyObject *key)
{
    uint8_t d[16];
    if (!key_digest(key, d))
        return NULL;
    return PyBytes_FromStringAndSize((const char *)d, 16);
}

/* key_digests(keys) -> [16-byte digest per key], batched as the read path does */
static PyObject *mod_key_digests(PyObject *mod, PyObject *keys)
{
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t n;
    uint8_t *d = digests_of(seq, &n);
    Py_DECREF(seq);
    if (!d)
        return NULL;
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *v = PyBytes_FromStringAndSize((const char *)d + 16 * i, 16);
        if (!v)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, v);
    }
    PyMem_Free(d);
    return out;
}

/* ix_hash(digest, nbuckets) -> (tag, bucket1, bucket2) */
static PyObject *mod_ix_hash(PyObject *mod, PyObject *args)
{
    Py_buffer d;
    unsigned long long nb;
    if (!PyArg_ParseTuple(args, "y*K", &d, &nb))
        return NULL;
    if (d.len != 16 || !nb || (nb & (nb - 1))) {
        PyBuffer_Release(&d);
        return bl_fail(bl_coherence_error, "ix_hash needs a 16-byte digest and a power of two");
    }
    uint32_t tag;
    uint64_t b1, b2;
    bl_ix_hash(d.buf, nb, &tag, &b1, &b2);
    PyBuffer_Release(&d);
    return Py_BuildValue("(IKK)", tag, (unsigned long long)b1, (unsigned long long)b2);
}

/* ix_pack(seq, slots) -> one sealed bucket line; slots: BL_IX_SLOTS (tag, block, version) */
static PyObject *mod_ix_pack(PyObject *mod, PyObject *args)
{
    unsigned long long seq;
    PyObject *slots;
    if (!PyArg_ParseTuple(args, "KO", &seq, &slots))
        return NULL;
    PyObject *fast = PySequence_Fast(slots, "slots must be a sequence");
    if (!fast)
        return NULL;
    bl_ix_bucket b;
    memset(&b, 0, sizeof(b));
    b.seq = seq;
    int ok = PySequence_Fast_GET_SIZE(fast) == BL_IX_SLOTS;
    for (int i = 0; ok && i < BL_IX_SLOTS; i++) {
        unsigned int tag, block;
        unsigned long long version;
        ok = PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "IIK", &tag, &block, &version);
        b.slot[i] = (bl_ix_slot){tag, block, version};
    }
    Py_DECREF(fast);
    if (!ok) {
        if (!PyErr_Occurred())
            bl_fail(bl_coherence_error, "a bucket has %d slots of (tag, block, version)",
                    BL_IX_SLOTS);
        return NULL;
    }
    bl_ix_seal(&b);
    return PyBytes_FromStringAndSize((const char *)&b, sizeof(b));
}

/* ix_unpack(line) -> (seq, [(tag, block, version)] * BL_IX_SLOTS), or None if not whole */
static PyObject *mod_ix_unpack(PyObject *mod, PyObject *args)
{
    Py_buffer v;
    if (!PyArg_ParseTuple(args, "y*", &v))
        return NULL;
    bl_ix_bucket b;
    int whole = v.len == BL_LINE;
    if (whole)
        memcpy(&b, v.buf, sizeof(b));
    PyBuffer_Release(&v);
    if (!whole || !bl_ix_bucket_ok(&b))
        Py_RETURN_NONE;
    PyObject *slots = PyList_New(BL_IX_SLOTS);
    for (int i = 0; slots && i < BL_IX_SLOTS; i++) {
        PyObject *t = Py_BuildValue("(IIK)", b.slot[i].tag, b.slot[i].block,
                                    (unsigned long long)b.slot[i].version);
        if (!t)
            Py_CLEAR(slots);
        else
            PyList_SET_ITEM(slots, i, t);
    }
    return slots ? Py_BuildValue("(KN)", (unsigned long long)b.seq, slots) : NULL;
}

/* ix_counts(line) -> (seq, hits, misses, owner, tier_hits, promotions), or None if not whole */
static PyObject *mod_ix_counts(PyObject *mod, PyObject *args)
{
    Py_buffer v;
    if (!PyArg_ParseTuple(args, "y*", &v))
        return NULL;
    bl_ix_counts c;
    int whole = v.len == BL_LINE;
    if (whole)
        memcpy(&c, v.buf, sizeof(c));
    PyBuffer_Release(&v);
    static const bl_ix_counts zero;
    if (!whole || (c.crc != ~bl_crc32c(~0u, &c, offsetof(bl_ix_counts, crc)) &&
                   memcmp(&c, &zero, sizeof(c))))
        Py_RETURN_NONE;
    return Py_BuildValue("(KKKKKK)", (unsigned long long)c.seq, (unsigned long long)c.hits,
                         (unsigned long long)c.misses, (unsigned long long)c.owner,
                         (unsigned long long)c.tier_hits, (unsigned long long)c.promotions);
}

static PyMethodDef index_functions[] = {
    {"key_digest", mod_key_digest, METH_O, "key_digest(key) -> 16-byte BLAKE2b digest"},
    {"key_digests", mod_key_digests, METH_O, "key_digests(keys) -> [digest] (batched)"},
    {"ix_hash", mod_ix_hash, METH_VARARGS, "ix_hash(digest, nbuckets) -> (tag, b1, b2)"},
    {"ix_pack", mod_ix_pack, METH_VARARGS, "ix_pack(seq, slots) -> bucket line"},
    {"ix_unpack", mod_ix_unpack, METH_VARARGS, "ix_unpack(line) -> (seq, slots) | None"},
    {"ix_counts", mod_ix_counts, METH_VARARGS,
     "ix_counts(line) -> (seq, hits, misses, owner, tier_hits, promotions) | None"},
    {NULL, NULL, 0, NULL},
};

/* Add the Index type, the format helpers and their constants to the module. */
int bl_index_init(PyObject *module)
{
    if (PyType_Ready(&IndexType) < 0 || pthread_atfork(NULL, NULL, after_fork_in_child))
        return -1;
    Py_INCREF(&IndexType);
    if (PyModule_AddObject(module, "Index", (PyObject *)&IndexType) < 0 ||
        PyModule_AddFunctions(module, index_functions) < 0 ||
        PyModule_AddIntConstant(module, "IX_SLOTS", BL_IX_SLOTS) < 0 ||
        PyModule_AddIntConstant(module, "IX_HINT_RING", BL_IX_HINT_RING) < 0 ||
        PyModule_AddIntConstant(module, "IX_HINT_LINES", BL_IX_HINT_LINES) < 0)
        return -1;
    return 0;
}
