/*
 * keytable.c - the metadata server's table of cold keys: 16-byte digest -> 64-bit id.
 *
 * Design.  After a takeover, recovery finds every committed value in the pool; most
 * of them are never touched again before they are evicted.  The server's key index
 * (beluga/server/keyindex.py) keeps those "cold" keys out of Python objects: their
 * fields sit in numpy columns, a region at a time, and this table maps each key's
 * digest to its row (an id the caller assigns).  It is plain process memory, never
 * shared, so it needs no memops table, no fences and no format.
 *
 *  - Open addressing with linear probing over a power-of-two array of 16-byte keys
 *    and 64-bit ids.  An id of BL_KT_EMPTY marks a free slot, BL_KT_GONE a removed
 *    one (a tombstone keeps later probes of the same run reachable).
 *  - The load, tombstones included, stays at most one half: an insert that would pass
 *    it rebuilds the array at twice the live count's need (which also drops every
 *    tombstone).  About 24 bytes a live key at the worst load of one quarter.
 *  - Digests are BLAKE3 output for honest clients but chosen by anyone in a pool's
 *    headers, so the probe start mixes both halves with a per-table random seed
 *    (splitmix64's finaliser): a client cannot aim its keys at one run.
 *  - Not thread-safe: the server's one thread owns the table.
 */
#include <stdlib.h>
#include <string.h>

#include "beluga_native.h"

#define BL_KT_EMPTY (-1)
#define BL_KT_GONE (-2)

/* splitmix64's finaliser: a 64-bit mix whose every output bit depends on every input bit. */
static uint64_t mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* The probe start of digest d in a table of mask + 1 slots. */
static uint64_t home(const bl_kt *t, const uint8_t d[16])
{
    uint64_t lo, hi;
    memcpy(&lo, d, 8);
    memcpy(&hi, d + 8, 8);
    return mix64(lo ^ t->seed) ^ mix64(hi + t->seed);
}

/* Allocate an empty array of cap slots (a power of two); 0, or -1 out of memory. */
static int alloc_slots(bl_kt *t, uint64_t cap)
{
    uint8_t(*keys)[16] = malloc(cap * 16);
    int64_t *ids = malloc(cap * sizeof(int64_t));
    if (!keys || !ids) {
        free(keys);
        free(ids);
        return -1;
    }
    for (uint64_t i = 0; i < cap; i++)
        ids[i] = BL_KT_EMPTY;
    t->keys = keys;
    t->ids = ids;
    t->mask = cap - 1;
    t->used = 0;
    return 0;
}

/* Make an empty table with room for about `hint` keys; 0, or -1 out of memory. */
int bl_kt_init(bl_kt *t, uint64_t hint, uint64_t seed)
{
    uint64_t cap = 16;
    while (cap < 2 * hint + 2)
        cap <<= 1;
    t->seed = seed;
    t->live = 0;
    return alloc_slots(t, cap);
}

/* Free the table's memory (the table may be freed twice). */
void bl_kt_free(bl_kt *t)
{
    free(t->keys);
    free(t->ids);
    t->keys = NULL;
    t->ids = NULL;
    t->live = t->used = 0;
    t->mask = 0;
}

/* The slot holding d, or -1. */
static int64_t slot_of(const bl_kt *t, const uint8_t d[16])
{
    if (!t->ids)
        return -1;
    for (uint64_t i = home(t, d) & t->mask;; i = (i + 1) & t->mask) {
        int64_t id = t->ids[i];
        if (id == BL_KT_EMPTY)
            return -1;
        if (id != BL_KT_GONE && memcmp(t->keys[i], d, 16) == 0)
            return (int64_t)i;
    }
}

/* The id of d, or -1 when the table does not hold it. */
int64_t bl_kt_get(const bl_kt *t, const uint8_t d[16])
{
    int64_t at = slot_of(t, d);
    return at < 0 ? -1 : t->ids[at];
}

/* Put d -> id in the first free slot of its run (d is known absent; id >= 0). */
static void place(bl_kt *t, const uint8_t d[16], int64_t id)
{
    uint64_t i = home(t, d) & t->mask;
    while (t->ids[i] >= 0)
        i = (i + 1) & t->mask;
    if (t->ids[i] == BL_KT_EMPTY)
        t->used++;
    memcpy(t->keys[i], d, 16);
    t->ids[i] = id;
}

/* Rebuild the array for `want` live keys, dropping tombstones; 0, or -1 out of memory
 * (the table unchanged). */
static int rebuild(bl_kt *t, uint64_t want)
{
    bl_kt old = *t;
    uint64_t cap = 16;
    while (cap < 2 * want + 2)
        cap <<= 1;
    if (alloc_slots(t, cap) < 0) {
        *t = old;
        return -1;
    }
    for (uint64_t i = 0; i <= old.mask; i++)
        if (old.ids[i] >= 0)
            place(t, old.keys[i], old.ids[i]);
    free(old.keys);
    free(old.ids);
    return 0;
}

/* Make room for n more keys; 0, or -1 out of memory (the table unchanged). */
int bl_kt_reserve(bl_kt *t, uint64_t n)
{
    if (2 * (t->used + n) + 2 <= t->mask + 1)
        return 0;
    return rebuild(t, 2 * (t->live + n));
}

/* Insert d -> id (id >= 0): 1 inserted, 0 d was already there (nothing changed),
 * -1 out of memory. */
int bl_kt_put(bl_kt *t, const uint8_t d[16], int64_t id)
{
    if (slot_of(t, d) >= 0)
        return 0;
    if (bl_kt_reserve(t, 1) < 0)
        return -1;
    place(t, d, id);
    t->live++;
    return 1;
}

/* Remove d: its id, or -1 when the table did not hold it. */
int64_t bl_kt_pop(bl_kt *t, const uint8_t d[16])
{
    int64_t at = slot_of(t, d);
    if (at < 0)
        return -1;
    int64_t id = t->ids[at];
    t->ids[at] = BL_KT_GONE;
    t->live--;
    return id;
}
