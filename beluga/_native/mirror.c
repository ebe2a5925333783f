/*
 * mirror.c - the metadata server's mirror of the pool index, and its writes.
 *
 * The server is the index's only writer (index.c owns the bucket format and
 * the readers' probe).  It keeps a mirror of the bucket table in flat arrays,
 * a few bytes a slot and no object a key, and rewrites a bucket as one sealed
 * line with a non-temporal store; its callers fence (the commit fence before
 * COMMIT's answer, the clear fence before REMOVE's).  Every access to the
 * pool goes through the mapping's bl_memops table, so model mode runs this
 * same code.
 *
 *   per bucket  seq (what the line last written holds), loaded (the mirror
 *               holds it)
 *   per slot    tag, block, version (the line's bytes), state (empty,
 *               unresolved: a hint as the pool held it, resolved: its key is
 *               known) and, resolved, the key's 16-byte digest
 *
 * The mirror starts empty and lazy: a new server holds no bucket, readers
 * keep using the pool's lines, and a bucket comes in when first touched
 * (ixm_load), its slots unresolved.  A line that is not whole (torn by a
 * server killed mid-rewrite, or hostile bytes) is salvaged field by field
 * and rewritten whole.  A slot is resolved when its key matters: its block's
 * header must be PUBLISHED with the slot's version, its commit word must hold
 * that version (a slot can land before its commit word when a server's host
 * dies mid-COMMIT), and the slot must lie in a bucket of the header's digest
 * with the right tag; otherwise it names nothing a reader could get and is
 * dropped.  A digest has at most one resolved slot, and only ever in one of
 * its two buckets, so "where is this key" is a scan of six slots: no
 * digest -> slot table.
 *
 * Placement is two-choice cuckoo hashing.  When both of a key's buckets are
 * full, a breadth-first search (at most MAX_VISIT buckets, paths of at most
 * MAX_PATH moves) finds a chain of entries to move to their other bucket; the
 * chain moves last entry first, each move writing the entry's new bucket,
 * fencing (sabotage point INDEX_MOVE_FENCE), and only then letting the next
 * entry overwrite its old slot.  A key placed again gets a new slot if one of
 * its buckets has one (written and fenced before the old slot is cleared);
 * only with both full is the slot rewritten in place.  So at every instant a
 * key sits whole in at least one of its buckets.
 *
 * Recovery (bl_ixm_reconcile) takes a range of buckets, the pool's lines for
 * it and the slots the caller confirmed against the recovered entries, and
 * makes the range hold exactly those, rewriting only the lines that change.
 *
 * This file has no Python in it; index_py.c gives it its Python face
 * (_core.IndexMirror) and beluga/server/index.py its callers.
 */
#include <stdlib.h>
#include <string.h>

#include "beluga_native.h"

#define MAX_PATH 5   /* cuckoo moves per insertion */
#define MAX_VISIT 256 /* buckets a move search looks at */

enum { EMPTY = 0, UNRESOLVED = 1, RESOLVED = 2 };

/* Set up an empty mirror of an index of this geometry; -1 when memory runs out. */
int bl_ixm_init(bl_ixm *x, const bl_ix *ix, size_t commits_off)
{
    memset(x, 0, sizeof(*x));
    x->ix = *ix;
    x->commits_off = commits_off;
    uint64_t nslots = ix->nbuckets * BL_IX_SLOTS;
    x->seq = calloc(ix->nbuckets, sizeof(*x->seq));
    x->loaded = calloc(ix->nbuckets, 1);
    x->slot = calloc(nslots, sizeof(*x->slot));
    x->state = calloc(nslots, 1);
    x->digest = calloc(nslots, 16);
    if (!x->seq || !x->loaded || !x->slot || !x->state || !x->digest) {
        bl_ixm_free(x);
        return -1;
    }
    return 0;
}

/* Free a mirror's arrays (safe on a zeroed or half-built one). */
void bl_ixm_free(bl_ixm *x)
{
    free(x->seq);
    free(x->loaded);
    free(x->slot);
    free(x->state);
    free(x->digest);
    x->seq = NULL;
    x->loaded = x->state = NULL;
    x->slot = NULL;
    x->digest = NULL;
}

/* Forget every bucket (the counters stay): the mirror starts again, empty and lazy. */
void bl_ixm_reset(bl_ixm *x)
{
    uint64_t nslots = x->ix.nbuckets * BL_IX_SLOTS;
    memset(x->loaded, 0, x->ix.nbuckets);
    memset(x->slot, 0, nslots * sizeof(*x->slot));
    memset(x->state, 0, nslots);
    x->all_loaded = 0;
    x->resolved = 0;
}

/* Whether the mirror holds bucket b. */
static int held(const bl_ixm *x, uint64_t b) { return x->all_loaded || x->loaded[b]; }

/* Empty slot `at` in the mirror (not in the pool). */
static void clear(bl_ixm *x, uint64_t at)
{
    if (x->state[at] == RESOLVED)
        x->resolved--;
    x->state[at] = EMPTY;
    x->slot[at] = (bl_ix_slot){0, 0, 0};
}

/* Make slot `at` hold digest's entry, resolved. */
static void set_resolved(bl_ixm *x, uint64_t at, const uint8_t digest[16], uint32_t tag,
                         uint32_t block, uint64_t version)
{
    if (x->state[at] != RESOLVED)
        x->resolved++;
    x->state[at] = RESOLVED;
    x->slot[at] = (bl_ix_slot){tag, block, version};
    memcpy(x->digest[at], digest, 16);
}

/* Rewrite bucket b's line from the mirror, its sequence bumped (unfenced: callers fence). */
static void write_bucket(bl_mem *m, bl_ixm *x, uint64_t b)
{
    bl_ix_bucket line;
    memset(&line, 0, sizeof(line));
    line.seq = ++x->seq[b];
    memcpy(line.slot, &x->slot[b * BL_IX_SLOTS], sizeof(line.slot));
    bl_ix_seal(&line);
    m->ops->nt_store(m, x->ix.index_off + b * BL_LINE, &line, sizeof(line));
}

/* Bring buckets into the mirror as the pool holds them, their slots unresolved; a line
 * that is not whole is salvaged (its slots are hints like any) and rewritten whole. */
static void load(bl_mem *m, bl_ixm *x, const uint64_t *bs, int n)
{
    uint64_t todo[2];
    int k = 0;
    if (x->all_loaded)
        return;
    for (int i = 0; i < n; i++)
        if (!x->loaded[bs[i]] && !(k == 1 && todo[0] == bs[i]))
            todo[k++] = bs[i];
    if (!k)
        return;
    for (int i = 0; i < k; i++)
        m->ops->invalidate(m, x->ix.index_off + todo[i] * BL_LINE, BL_LINE);
    m->ops->mfence(m);
    for (int i = 0; i < k; i++) {
        uint64_t b = todo[i];
        bl_ix_bucket line;
        x->loaded[b] = 1;
        m->ops->load(m, x->ix.index_off + b * BL_LINE, &line, sizeof(line));
        x->seq[b] = line.seq;
        for (int j = 0; j < BL_IX_SLOTS; j++) {
            uint64_t at = b * BL_IX_SLOTS + j;
            clear(x, at);
            if (line.slot[j].tag) {
                x->slot[at] = line.slot[j];
                x->state[at] = UNRESOLVED;
            }
        }
        if (!bl_ix_bucket_ok(&line))
            write_bucket(m, x, b);
    }
}

/* The resolved slot of digest in the mirror (no bucket loaded, no slot resolved), or -1. */
int64_t bl_ixm_slot_of(const bl_ixm *x, const uint8_t digest[16])
{
    uint32_t tag;
    uint64_t b[2];
    bl_ix_hash(digest, x->ix.nbuckets, &tag, &b[0], &b[1]);
    for (int i = 0; i < 2; i++) {
        if (!held(x, b[i]))
            continue;
        for (uint64_t at = b[i] * BL_IX_SLOTS; at < (b[i] + 1) * BL_IX_SLOTS; at++)
            if (x->state[at] == RESOLVED && x->slot[at].tag == tag &&
                !memcmp(x->digest[at], digest, 16))
                return (int64_t)at;
    }
    return -1;
}

/* Resolve slot `at` by its block's header and commit word: 1 when they confirm it, else
 * the slot is dropped (and its bucket rewritten, unfenced) and 0 returned.  A second slot
 * of a key already resolved is dropped too. */
static int resolve(bl_mem *m, bl_ixm *x, uint64_t at)
{
    bl_ix_slot s = x->slot[at];
    if (s.block < x->ix.nblocks) {
        size_t off = x->ix.headers_off + (size_t)s.block * BL_LINE;
        size_t word = x->commits_off + (size_t)s.block * 8;
        bl_header h;
        uint64_t committed;
        m->ops->invalidate(m, off, BL_LINE);
        m->ops->invalidate(m, word, 8);
        m->ops->mfence(m);
        m->ops->load(m, off, &h, sizeof(h));
        m->ops->load(m, word, &committed, sizeof(committed));
        if (bl_header_check(&h) && h.state == BL_PUBLISHED && h.version == s.version &&
            committed == s.version) {
            uint32_t tag;
            uint64_t b1, b2, b = at / BL_IX_SLOTS;
            bl_ix_hash(h.digest, x->ix.nbuckets, &tag, &b1, &b2);
            if (tag == s.tag && (b == b1 || b == b2) && bl_ixm_slot_of(x, h.digest) < 0) {
                set_resolved(x, at, h.digest, s.tag, s.block, s.version);
                return 1;
            }
        }
    }
    clear(x, at);
    write_bucket(m, x, at / BL_IX_SLOTS);
    x->unconfirmed++;
    return 0;
}

/* Resolve every unresolved slot of bucket b. */
static void resolve_bucket(bl_mem *m, bl_ixm *x, uint64_t b)
{
    for (uint64_t at = b * BL_IX_SLOTS; at < (b + 1) * BL_IX_SLOTS; at++)
        if (x->state[at] == UNRESOLVED)
            resolve(m, x, at);
}

/* The slot of digest, its buckets loaded and every unresolved slot with its tag resolved
 * first (a second slot of the key, left by a server that died between the two writes of a
 * replacement, is dropped before anything changes the key); -1 when it has none. */
static int64_t find_slot(bl_mem *m, bl_ixm *x, const uint8_t digest[16], uint32_t *tag,
                         uint64_t b[2])
{
    bl_ix_hash(digest, x->ix.nbuckets, tag, &b[0], &b[1]);
    load(m, x, b, 2);
    if (!x->all_loaded)
        for (int i = 0; i < 2; i++)
            for (uint64_t at = b[i] * BL_IX_SLOTS; at < (b[i] + 1) * BL_IX_SLOTS; at++)
                if (x->state[at] == UNRESOLVED && x->slot[at].tag == *tag)
                    resolve(m, x, at);
    return bl_ixm_slot_of(x, digest);
}

/* Where the index names digest: 1 and its (block, version), or 0. */
int bl_ixm_find(bl_mem *m, bl_ixm *x, const uint8_t digest[16], uint32_t *block,
                uint64_t *version)
{
    uint32_t tag;
    uint64_t b[2];
    int64_t at = find_slot(m, x, digest, &tag, b);
    if (at < 0)
        return 0;
    *block = x->slot[at].block;
    *version = x->slot[at].version;
    return 1;
}

/* The first empty slot of bucket b, or -1. */
static int64_t free_slot(const bl_ixm *x, uint64_t b)
{
    for (uint64_t at = b * BL_IX_SLOTS; at < (b + 1) * BL_IX_SLOTS; at++)
        if (x->state[at] == EMPTY)
            return (int64_t)at;
    return -1;
}

/* A breadth-first search from the two start buckets for a free slot: fills path with slot
 * numbers from a start bucket's slot to the free one, each entry movable into the next, and
 * returns its length; 0 when none was found within MAX_VISIT buckets and MAX_PATH moves. */
static int search_path(bl_mem *m, bl_ixm *x, const uint64_t start[2], uint64_t path[MAX_PATH + 1])
{
    enum { CAP = MAX_VISIT + 2 * BL_IX_SLOTS };
    uint64_t bucket[CAP];  /* the buckets seen, in the order found */
    int64_t came[CAP];     /* the slot number that leads into each (-1: a start bucket) */
    int depth[CAP];
    int seen = 0, head = 0;
    for (int i = 0; i < 2; i++) {
        if (seen == 1 && bucket[0] == start[i])
            continue;
        bucket[seen] = start[i], came[seen] = -1, depth[seen] = 0;
        seen++;
    }
    while (head < seen && seen < MAX_VISIT) {
        int at = head++;
        uint64_t b = bucket[at];
        if (!x->all_loaded) { /* a move needs the keys of the entries it moves */
            load(m, x, &b, 1);
            resolve_bucket(m, x, b);
        }
        int64_t free = free_slot(x, b);
        if (free >= 0) {
            int n = 0;
            path[n++] = (uint64_t)free;
            for (int i = at; came[i] >= 0;) {
                path[n++] = (uint64_t)came[i];
                uint64_t from = (uint64_t)came[i] / BL_IX_SLOTS;
                for (i = 0; bucket[i] != from; i++)
                    ;
            }
            for (int i = 0; i < n / 2; i++) { /* start bucket's slot first */
                uint64_t t = path[i];
                path[i] = path[n - 1 - i];
                path[n - 1 - i] = t;
            }
            return n;
        }
        if (depth[at] >= MAX_PATH)
            continue;
        for (uint64_t s = b * BL_IX_SLOTS; s < (b + 1) * BL_IX_SLOTS; s++) {
            uint32_t tag;
            uint64_t b1, b2;
            if (x->state[s] != RESOLVED) /* only a loaded_all() called early leaves one */
                continue;
            bl_ix_hash(x->digest[s], x->ix.nbuckets, &tag, &b1, &b2);
            uint64_t other = b == b1 ? b2 : b1;
            int known = 0;
            for (int i = 0; i < seen && !known; i++)
                known = bucket[i] == other;
            if (!known) {
                bucket[seen] = other, came[seen] = (int64_t)s, depth[seen] = depth[at] + 1;
                seen++;
            }
        }
    }
    return 0;
}

/* Point a placed key's entry (slot at) at a new block and version: a free slot of its
 * buckets is written and fenced before the old one is cleared; with both full, in place. */
static void replace(bl_mem *m, bl_ixm *x, uint64_t at, const uint8_t digest[16], uint32_t tag,
                    uint32_t block, uint64_t version, const uint64_t b[2])
{
    int64_t free = free_slot(x, b[0]);
    if (free < 0)
        free = free_slot(x, b[1]);
    if (free < 0) { /* both buckets full (rare at a third full): in place, fenced */
        set_resolved(x, at, digest, tag, block, version);
        write_bucket(m, x, at / BL_IX_SLOTS);
        if (BL_STEP(INDEX_MOVE_FENCE))
            m->ops->sfence(m);
        return;
    }
    set_resolved(x, (uint64_t)free, digest, tag, block, version);
    write_bucket(m, x, (uint64_t)free / BL_IX_SLOTS);
    if (BL_STEP(INDEX_MOVE_FENCE)) /* the new slot is in the pool before the old one goes */
        m->ops->sfence(m);
    clear(x, at);
    write_bucket(m, x, at / BL_IX_SLOTS);
}

/* Point digest at (block, version): 1, or 0 when no slot could be made free. */
int bl_ixm_put(bl_mem *m, bl_ixm *x, const uint8_t digest[16], uint32_t block, uint64_t version)
{
    uint32_t tag;
    uint64_t b[2], path[MAX_PATH + 1];
    int64_t at = find_slot(m, x, digest, &tag, b);
    if (at >= 0) {
        if (x->slot[at].block != block || x->slot[at].version != version)
            replace(m, x, (uint64_t)at, digest, tag, block, version, b);
        return 1;
    }
    int n = search_path(m, x, b, path);
    if (!n) {
        x->failed++;
        return 0;
    }
    /* path[0] is a slot of b[0] or b[1]; each entry moves into the next slot, last first */
    for (int i = n - 1; i > 0; i--) {
        uint64_t src = path[i - 1], dst = path[i];
        set_resolved(x, dst, x->digest[src], x->slot[src].tag, x->slot[src].block,
                     x->slot[src].version);
        write_bucket(m, x, dst / BL_IX_SLOTS);
        if (BL_STEP(INDEX_MOVE_FENCE)) /* the new bucket holds it before the old one lets go */
            m->ops->sfence(m);
        x->moves++;
    }
    set_resolved(x, path[0], digest, tag, block, version);
    write_bucket(m, x, path[0] / BL_IX_SLOTS);
    return 1;
}

/* The keys in digest's two buckets, all resolved first, into out (at most 2 * BL_IX_SLOTS);
 * returns how many. */
int bl_ixm_crowd(bl_mem *m, bl_ixm *x, const uint8_t digest[16], uint8_t out[][16])
{
    uint32_t tag;
    uint64_t b[2];
    int n = 0;
    bl_ix_hash(digest, x->ix.nbuckets, &tag, &b[0], &b[1]);
    load(m, x, b, 2);
    for (int i = 0; i < 2; i++) {
        resolve_bucket(m, x, b[i]);
        for (uint64_t at = b[i] * BL_IX_SLOTS; at < (b[i] + 1) * BL_IX_SLOTS; at++)
            if (x->state[at] == RESOLVED)
                memcpy(out[n++], x->digest[at], 16);
    }
    return n;
}

/* Take digest out of the index (unfenced: callers fence). */
void bl_ixm_drop(bl_mem *m, bl_ixm *x, const uint8_t digest[16])
{
    uint32_t tag;
    uint64_t b[2];
    int64_t at = find_slot(m, x, digest, &tag, b);
    if (at >= 0) {
        clear(x, (uint64_t)at);
        write_bucket(m, x, (uint64_t)at / BL_IX_SLOTS);
    }
}

/* Compare the next n buckets (round robin) that the mirror holds with the pool's lines and
 * rewrite those that differ (unfenced); returns how many were rewritten. */
uint64_t bl_ixm_scrub(bl_mem *m, bl_ixm *x, uint64_t n)
{
    uint64_t nb = x->ix.nbuckets, first = x->scrub_at, fixed = 0;
    if (n > nb)
        n = nb;
    x->scrub_at = (first + n) % nb;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t b = (first + i) % nb;
        if (held(x, b))
            m->ops->invalidate(m, x->ix.index_off + b * BL_LINE, BL_LINE);
    }
    m->ops->mfence(m);
    for (uint64_t i = 0; i < n; i++) {
        uint64_t b = (first + i) % nb;
        bl_ix_bucket line;
        if (!held(x, b))
            continue;
        m->ops->load(m, x->ix.index_off + b * BL_LINE, &line, sizeof(line));
        if (!bl_ix_bucket_ok(&line) ||
            memcmp(line.slot, &x->slot[b * BL_IX_SLOTS], sizeof(line.slot))) {
            write_bucket(m, x, b);
            fixed++;
        }
    }
    x->scrubbed += fixed;
    return fixed;
}

/* Make buckets [lo, hi) hold exactly the confirmed slots (unfenced; the caller fences).
 * lines: the pool's lines of the range as loaded; keep[i] a slot number relative to lo's
 * first slot that the caller confirmed names digests[i] (its tag, version and bucket); n of
 * them.  A key named twice keeps its first slot when both name the same block and version,
 * else the later one.  Every other tagged slot is dropped; a line that loses a slot or was
 * not whole is rewritten.  Counts what was kept and dropped; -1 (nothing changed) when
 * memory runs out. */
int bl_ixm_reconcile(bl_mem *m, bl_ixm *x, uint64_t lo, uint64_t hi, const bl_ix_bucket *lines,
                     const int64_t *keep, const uint8_t (*digests)[16], size_t n,
                     uint64_t *kept, uint64_t *dropped)
{
    uint64_t first = lo * BL_IX_SLOTS, nslots = (hi - lo) * BL_IX_SLOTS;
    uint8_t *placed = calloc(nslots + 1, 1), *gone = calloc(hi - lo + 1, 1);
    if (!placed || !gone) {
        free(placed);
        free(gone);
        return -1;
    }
    *kept = 0;
    *dropped = 0;
    for (uint64_t b = lo; b < hi; b++) { /* the mirror of these buckets starts again */
        for (uint64_t at = b * BL_IX_SLOTS; at < (b + 1) * BL_IX_SLOTS; at++)
            clear(x, at);
        x->seq[b] = lines[b - lo].seq;
        if (!x->all_loaded)
            x->loaded[b] = 1;
    }
    for (size_t i = 0; i < n; i++) {
        uint64_t rel = (uint64_t)keep[i];
        const bl_ix_slot *s = &lines[rel / BL_IX_SLOTS].slot[rel % BL_IX_SLOTS];
        int64_t other = bl_ixm_slot_of(x, digests[i]);
        if (other >= 0) { /* a key named twice */
            if (x->slot[other].block == s->block && x->slot[other].version == s->version)
                continue;
            clear(x, (uint64_t)other);
            if ((uint64_t)other >= first && (uint64_t)other - first < nslots)
                placed[(uint64_t)other - first] = 0; /* dropped below, its line rewritten */
            else
                write_bucket(m, x, (uint64_t)other / BL_IX_SLOTS);
        }
        set_resolved(x, first + rel, digests[i], s->tag, s->block, s->version);
        placed[rel] = 1;
    }
    for (uint64_t rel = 0; rel < nslots; rel++) {
        *kept += placed[rel];
        if (lines[rel / BL_IX_SLOTS].slot[rel % BL_IX_SLOTS].tag && !placed[rel]) {
            (*dropped)++;
            gone[rel / BL_IX_SLOTS] = 1;
        }
    }
    for (uint64_t b = lo; b < hi; b++)
        if (gone[b - lo] || !bl_ix_bucket_ok(&lines[b - lo]))
            write_bucket(m, x, b);
    free(placed);
    free(gone);
    return 0;
}

/* Every bucket has been reconciled: the mirror holds the whole index from now on. */
void bl_ixm_loaded_all(bl_ixm *x) { x->all_loaded = 1; }
