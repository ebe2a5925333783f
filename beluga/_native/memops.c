/*
 * memops.c - the instructions Python cannot issue, chosen once per process.
 *
 * DESIGN
 * A CXL 2.0 pool shared by several hosts has no hardware coherence between
 * them, so every access to a shared structure is one of a few explicit steps:
 *
 *   write side   payload with non-temporal stores (they bypass the cache and
 *                land in memory), or plain stores followed by a flush of each
 *                line; then SFENCE so the payload is globally visible before
 *                the header that announces it is written.
 *   read side    flush (CLFLUSHOPT: write back if dirty, then drop) every line
 *                about to be read, MFENCE so the loads cannot be satisfied
 *                before the flushes complete, then plain loads.  CLWB is not
 *                enough for a reader: it keeps the (possibly stale) line.
 *
 * x86-64 choices, made once in bl_memops_init() from CPUID (cpu.c):
 *   flush       CLFLUSHOPT if present, else CLFLUSH (serialising, slower).
 *   write-back  CLWB if present, else the flush above.
 *   nt copy     AVX-512 streaming stores (64 B per instruction) if present,
 *               else SSE2 streaming stores; the unaligned head and tail of a
 *               copy are plain stores followed by a flush of their lines.
 *   copy        the plain copy behind load and store: AVX-512 (64 B vectors)
 *               if present, else AVX2 (32 B), else SSE2 (16 B); never libc's
 *               memcpy above COPY_SHORT bytes (see COPY SHAPE below).
 * (The checksum's instructions are crc32c.c's.)  The chicken-bit variables
 * BELUGA_FLUSH (clflushopt|clflush), BELUGA_NT (avx512|sse2|store-flush) and
 * BELUGA_COPY (avx512|avx2|sse2|libc) force a choice for testing; a choice
 * the CPU cannot honour falls back to the best one it can, and bl_selected()
 * always tells what is really used.
 *
 * COPY SHAPE
 * Every read of a payload (get, get_into, batch_get_into, read_blocks,
 * scatter-read, the checksum pass of a seal) is a load from the pool into
 * the caller's memory: load, or load_crc (crc32c.c's bl_crc32c_copy, which
 * folds the CRC32C from the loaded vectors, or else this copy a piece at a
 * time with the CRC taken from L1).  Pool payloads start on a page; callers'
 * buffers start where malloc puts them, 16 bytes past a page (numpy,
 * bytearray, bytes).  Measured on 2026-12-02 (AMD EPYC, Zen 3, FSRM; no perf
 * counters in the VM, so by sweeping the destination's offset from a page,
 * source page aligned, median of 400 copies):
 *
 *   16 KiB, source in cache      dst +0   +8   +16  +32..+4080  +7   +1
 *     glibc memcpy (REP MOVSB)   0.2     5.6  5.5  0.2-0.3      5.6  5.8 us
 *     REP MOVSB itself           0.2     5.6  5.5  0.2-0.4      5.6  5.9
 *     32 B vector loop, stores   0.2     0.2  0.2  0.2          0.2  0.2
 *     destination-aligned
 *   2 MiB, source flushed        REP MOVSB 740-790 us at +1..+16, 135-200
 *                                elsewhere; the vector loop 138-213 at every
 *                                offset, memcpy's own (non-REP) path alike.
 *
 * The cause is REP MOVSB: glibc uses it from 2-4 KiB up to its non-temporal
 * threshold, so every 8 KiB read chunk took it, and it runs 25x slower (in
 * cache) when the destination is 1..31 bytes past the source modulo 4 KiB,
 * where each store lands on the low 12 address bits of a load just behind it
 * (4 KiB aliasing; the microcode's own loop does not get past it).  A
 * destination behind its source (+4080, +4095), or 32 bytes or more ahead,
 * is fast.  So the copy is ours, and the sweep above shows it flat: plain
 * vector loads at any alignment; the first vector stored unaligned, the
 * rest on destination vector boundaries (no store splits a cache line); four
 * loads issued before their four stores, so a block's loads never sit
 * behind its own stores; the last vector stored unaligned, overlapping, for
 * the tail.  Short copies (under COPY_SHORT) stay libc's: it uses
 * overlapping vector moves there, never REP MOVSB.  Writes to the pool were
 * already ours (the streaming copies above: unaligned loads, line-aligned
 * stores) and measured flat from sources at any offset.
 *
 * Other architectures (and a build with -DBL_PORTABLE) have no native table:
 * their cache-line instructions (AArch64: DC CIVAC, DSB) are not written
 * yet, and plain copies with compiler fences would pass for coherence on a
 * coherent machine while losing data on a real pool.  So native mode is
 * refused there (bl_native_ops says why) and only the model runs.
 *
 * SELF-CHECK
 * The model replaces this table, so it cannot see a mistake here.
 * bl_memops_selfcheck() watches the table itself instead: flush_fn and
 * writeback_fn are swapped for recorders (costing nothing outside a check)
 * while it runs each non-temporal copy the CPU can do
 * into unaligned destinations (every byte outside a whole streaming granule
 * is a plain store and must be flushed) and an invalidate (it must flush,
 * never CLWB, which keeps a stale line).  Both steps are sabotage points.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "beluga_native.h"

#if BL_X86
#include <immintrin.h>
#endif

/* Append a problem (NUL-terminated) to out if it fits; returns the new count. */
static int problem(char *out, size_t cap, size_t *used, int count, const char *text)
{
    size_t n = strlen(text) + 1;
    if (*used + n > cap)
        return count;
    memcpy(out + *used, text, n);
    *used += n;
    return count + 1;
}

#if BL_X86
static const char *sel_flush = "none", *sel_nt = "none", *sel_copy = "none";
static void (*flush_fn)(const void *, size_t);
static void (*copy_fn)(void *, const void *, size_t);
static void (*writeback_fn)(const void *, size_t);
static void (*nt_copy_fn)(void *, const void *, size_t);

/* The self-check's recorder: stands in for flush_fn / writeback_fn while a check runs. */
#define WATCH_MAX 64
static pthread_mutex_t selfcheck_lock = PTHREAD_MUTEX_INITIALIZER;
static void (*real_flush)(const void *, size_t), (*real_writeback)(const void *, size_t);
static __thread int watching, nwatched; /* only the checking thread records */
static __thread struct {
    uintptr_t lo, hi;
    int writeback;
} watched[WATCH_MAX];

/* Record [addr, addr + n) if this thread is checking. */
static void watch(const void *addr, size_t n, int writeback)
{
    if (watching && nwatched < WATCH_MAX) {
        watched[nwatched].lo = (uintptr_t)addr, watched[nwatched].hi = (uintptr_t)addr + n;
        watched[nwatched++].writeback = writeback;
    }
}

/* flush_fn during a self-check: record, then flush. */
static void flush_watched(const void *addr, size_t n)
{
    watch(addr, n, 0);
    real_flush(addr, n);
}

/* writeback_fn during a self-check: record, then write back. */
static void writeback_watched(const void *addr, size_t n)
{
    watch(addr, n, 1);
    real_writeback(addr, n);
}

#define COPY_SHORT 256u /* below this, libc's memcpy: overlapping vector moves, no REP MOVSB */

/* libc's memcpy (BELUGA_COPY=libc: the slow REP MOVSB at some alignments, for comparison). */
static void copy_libc(void *dst, const void *src, size_t n) { memcpy(dst, src, n); }

/*
 * One copy kernel per vector width W (bytes), shaped as COPY SHAPE says: the
 * first vector stored unaligned, the body on destination W-byte boundaries
 * four vectors at a time (all four loaded before any is stored), the last
 * vector stored unaligned over the tail.  Source and destination must not
 * overlap; n >= COPY_SHORT >= 4 W.
 */
#define COPY_BODY(W, V, LOADU, STOREU, STORE)                                                 \
    uint8_t *d = dst;                                                                         \
    const uint8_t *s = src;                                                                   \
    if (n < COPY_SHORT) {                                                                     \
        memcpy(d, s, n);                                                                      \
        return;                                                                               \
    }                                                                                         \
    V last = LOADU(s + n - W);                                                                \
    STOREU(d, LOADU(s));                                                                      \
    size_t skip = W - ((uintptr_t)d & (W - 1)); /* 1..W: the first vector covered them */     \
    uint8_t *end = d + n - W;                                                                 \
    d += skip, s += skip, n -= skip;                                                          \
    for (; n >= 4 * W; n -= 4 * W, d += 4 * W, s += 4 * W) {                                  \
        V a = LOADU(s), b = LOADU(s + W), c = LOADU(s + 2 * W), e = LOADU(s + 3 * W);         \
        STORE(d, a);                                                                          \
        STORE(d + W, b);                                                                      \
        STORE(d + 2 * W, c);                                                                  \
        STORE(d + 3 * W, e);                                                                  \
    }                                                                                         \
    for (; n > W; n -= W, d += W, s += W)                                                     \
        STORE(d, LOADU(s));                                                                   \
    STOREU(end, last);

#define LOADU_512(p) _mm512_loadu_si512((const void *)(p))
#define STOREU_512(p, v) _mm512_storeu_si512((void *)(p), v)
#define STORE_512(p, v) _mm512_store_si512((void *)(p), v)
#define LOADU_256(p) _mm256_loadu_si256((const __m256i *)(p))
#define STOREU_256(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#define STORE_256(p, v) _mm256_store_si256((__m256i *)(p), v)
#define LOADU_128(p) _mm_loadu_si128((const __m128i *)(p))
#define STOREU_128(p, v) _mm_storeu_si128((__m128i *)(p), v)
#define STORE_128(p, v) _mm_store_si128((__m128i *)(p), v)

/* Plain copy, 64 B vectors, each body store one whole cache line. */
__attribute__((target("avx512f"))) static void copy_avx512(void *dst, const void *src, size_t n)
{
    COPY_BODY(64, __m512i, LOADU_512, STOREU_512, STORE_512)
}

/* Plain copy, 32 B vectors. */
__attribute__((target("avx2"))) static void copy_avx2(void *dst, const void *src, size_t n)
{
    COPY_BODY(32, __m256i, LOADU_256, STOREU_256, STORE_256)
}

/* Plain copy, 16 B vectors (baseline x86-64). */
static void copy_sse2(void *dst, const void *src, size_t n)
{
    COPY_BODY(16, __m128i, LOADU_128, STOREU_128, STORE_128)
}

/* Plain stores then a flush of their lines: a copy that reaches memory. */
static void store_flush(void *dst, const void *src, size_t n)
{
    if (!n)
        return;
    copy_fn(dst, src, n);
    flush_fn(dst, n);
}

/* The unaligned head or tail of a streaming copy: plain stores, flushed. */
static void edge_copy(void *dst, const void *src, size_t n)
{
    if (BL_STEP(MEMOPS_NT_EDGE_FLUSH))
        store_flush(dst, src, n);
    else
        memcpy(dst, src, n);
}

/* Flush each line with CLFLUSHOPT (weakly ordered; pair with a fence). */
__attribute__((target("clflushopt"))) static void flush_clflushopt(const void *addr, size_t n)
{
    uintptr_t p = (uintptr_t)addr & ~(uintptr_t)(BL_LINE - 1), end = (uintptr_t)addr + n;
    for (; p < end; p += BL_LINE)
        _mm_clflushopt((void *)p);
}

/* Flush each line with CLFLUSH (ordered, slower). */
static void flush_clflush(const void *addr, size_t n)
{
    uintptr_t p = (uintptr_t)addr & ~(uintptr_t)(BL_LINE - 1), end = (uintptr_t)addr + n;
    for (; p < end; p += BL_LINE)
        _mm_clflush((void *)p);
}

/* Write back each line with CLWB, keeping it cached. */
__attribute__((target("clwb"))) static void writeback_clwb(const void *addr, size_t n)
{
    uintptr_t p = (uintptr_t)addr & ~(uintptr_t)(BL_LINE - 1), end = (uintptr_t)addr + n;
    for (; p < end; p += BL_LINE)
        _mm_clwb((void *)p);
}

/* Streaming copy with AVX-512 (64 B per store, 4 in flight). */
__attribute__((target("avx512f"))) static void nt_copy_avx512(void *dst, const void *src,
                                                              size_t n)
{
    uint8_t *d = dst;
    const uint8_t *s = src;
    size_t head = (size_t)(-(uintptr_t)d & (BL_LINE - 1));
    if (head > n)
        head = n;
    edge_copy(d, s, head);
    d += head, s += head, n -= head;
    for (; n >= 256; n -= 256, d += 256, s += 256) {
        __m512i a = _mm512_loadu_si512(s), b = _mm512_loadu_si512(s + 64);
        __m512i c = _mm512_loadu_si512(s + 128), e = _mm512_loadu_si512(s + 192);
        _mm512_stream_si512((void *)d, a);
        _mm512_stream_si512((void *)(d + 64), b);
        _mm512_stream_si512((void *)(d + 128), c);
        _mm512_stream_si512((void *)(d + 192), e);
    }
    for (; n >= 64; n -= 64, d += 64, s += 64)
        _mm512_stream_si512((void *)d, _mm512_loadu_si512(s));
    edge_copy(d, s, n);
}

/* Streaming copy with SSE2 (16 B per store). */
static void nt_copy_sse2(void *dst, const void *src, size_t n)
{
    uint8_t *d = dst;
    const uint8_t *s = src;
    size_t head = (size_t)(-(uintptr_t)d & 15);
    if (head > n)
        head = n;
    edge_copy(d, s, head);
    d += head, s += head, n -= head;
    for (; n >= 64; n -= 64, d += 64, s += 64) {
        __m128i a = _mm_loadu_si128((const void *)s), b = _mm_loadu_si128((const void *)(s + 16));
        __m128i c = _mm_loadu_si128((const void *)(s + 32));
        __m128i e = _mm_loadu_si128((const void *)(s + 48));
        _mm_stream_si128((void *)d, a);
        _mm_stream_si128((void *)(d + 16), b);
        _mm_stream_si128((void *)(d + 32), c);
        _mm_stream_si128((void *)(d + 48), e);
    }
    for (; n >= 16; n -= 16, d += 16, s += 16)
        _mm_stream_si128((void *)d, _mm_loadu_si128((const void *)s));
    edge_copy(d, s, n);
}

/* Store fence: earlier stores (non-temporal ones too) complete before later ones. */
static void fence_store(void) { _mm_sfence(); }
/* Full fence: also orders loads after earlier flushes. */
static void fence_full(void) { _mm_mfence(); }
/* Native table: plain loads from the mapping (one line, the probes' unit, inline). */
static void native_load(bl_mem *m, size_t off, void *dst, size_t n)
{
    if (n == BL_LINE)
        memcpy(dst, m->base + off, BL_LINE);
    else
        copy_fn(dst, m->base + off, n);
}

/* Native table: load and checksum in one pass (crc32c.c's COPY + CRC). */
static uint32_t native_load_crc(bl_mem *m, size_t off, void *dst, size_t n, uint32_t crc)
{
    return bl_crc32c_copy(crc, dst, m->base + off, n);
}

/* Native table: plain stores into the mapping (they stay in this CPU's cache). */
static void native_store(bl_mem *m, size_t off, const void *src, size_t n)
{
    copy_fn(m->base + off, src, n);
}

/* Native table: non-temporal stores. */
static void native_nt_store(bl_mem *m, size_t off, const void *src, size_t n)
{
    nt_copy_fn(m->base + off, src, n);
}

/* Native table: flush (write back and drop). */
static void native_flush(bl_mem *m, size_t off, size_t n) { flush_fn(m->base + off, n); }

/* Native table: write back, keep the line. */
static void native_writeback(bl_mem *m, size_t off, size_t n) { writeback_fn(m->base + off, n); }

/* Native table: drop lines before a read.  x86 has no user-mode drop without write-back,
 * so this is a flush; never CLWB, which would keep the stale line. */
static void native_invalidate(bl_mem *m, size_t off, size_t n)
{
    (BL_STEP(MEMOPS_INVALIDATE_FLUSHES) ? flush_fn : writeback_fn)(m->base + off, n);
}

/* Native table: start loading each line into this CPU's caches (PREFETCHT0, a hint). */
static void native_prefetch(bl_mem *m, size_t off, size_t n)
{
    uintptr_t p = (uintptr_t)(m->base + off) & ~(uintptr_t)(BL_LINE - 1);
    for (uintptr_t end = (uintptr_t)(m->base + off) + n; p < end; p += BL_LINE)
        _mm_prefetch((const char *)p, _MM_HINT_T0);
}

/* Native table: store fence. */
static void native_sfence(bl_mem *m) { fence_store(); }

/* Native table: full fence. */
static void native_mfence(bl_mem *m) { fence_full(); }

/* Native table: a device's read, as a CPU stand-in does it (the memory itself). */
static void native_dma_load(bl_mem *m, size_t off, void *dst, size_t n)
{
    memcpy(dst, m->base + off, n);
}

/* Native table: a device's write, as a CPU stand-in does it (the memory itself). */
static void native_dma_store(bl_mem *m, size_t off, const void *src, size_t n)
{
    memcpy(m->base + off, src, n);
}

static const bl_memops native_ops = {
    .name = "native",
    .load = native_load,
    .load_crc = native_load_crc,
    .store = native_store,
    .nt_store = native_nt_store,
    .flush = native_flush,
    .writeback = native_writeback,
    .invalidate = native_invalidate,
    .prefetch = native_prefetch,
    .sfence = native_sfence,
    .mfence = native_mfence,
    .dma_load = native_dma_load,
    .dma_store = native_dma_store,
};

/* Whether the watched flushes (not write-backs) cover every byte of [lo, hi). */
static int flushed(uintptr_t lo, uintptr_t hi)
{
    for (uintptr_t p = lo; p < hi; p++) {
        int hit = 0;
        for (int i = 0; i < nwatched && !hit; i++)
            hit = !watched[i].writeback && watched[i].lo <= p && p < watched[i].hi;
        if (!hit)
            return 0;
    }
    return 1;
}

/* Pick the flush, write-back and non-temporal copy once, from CPUID and the chicken bits. */
void bl_memops_init(void)
{
    static int done;
    if (done)
        return;
    done = 1;
    if (bl_cpu_has("clflushopt") && !bl_forced("BELUGA_FLUSH", "clflush"))
        flush_fn = flush_clflushopt, sel_flush = "clflushopt";
    else
        flush_fn = flush_clflush, sel_flush = "clflush";
    writeback_fn = bl_cpu_has("clwb") ? writeback_clwb : flush_fn;
    if (bl_cpu_has("avx512f") && !bl_forced("BELUGA_NT", "sse2") &&
        !bl_forced("BELUGA_NT", "store-flush"))
        nt_copy_fn = nt_copy_avx512, sel_nt = "avx512";
    else if (!bl_forced("BELUGA_NT", "store-flush"))
        nt_copy_fn = nt_copy_sse2, sel_nt = "sse2";
    else
        nt_copy_fn = store_flush, sel_nt = "store-flush";
    if (bl_forced("BELUGA_COPY", "libc"))
        copy_fn = copy_libc, sel_copy = "libc";
    else if (bl_cpu_has("avx512f") && !bl_forced("BELUGA_COPY", "avx2") &&
             !bl_forced("BELUGA_COPY", "sse2"))
        copy_fn = copy_avx512, sel_copy = "avx512";
    else if (bl_cpu_has("avx2") && !bl_forced("BELUGA_COPY", "sse2"))
        copy_fn = copy_avx2, sel_copy = "avx2";
    else
        copy_fn = copy_sse2, sel_copy = "sse2";
    bl_crc32c_set_copy(copy_fn);
}

/* Which instruction is used for "flush", "writeback", "invalidate", "nt" or "copy". */
const char *bl_selected(const char *what)
{
    if (!strcmp(what, "flush"))
        return sel_flush;
    if (!strcmp(what, "writeback"))
        return bl_cpu_has("clwb") ? "clwb" : sel_flush;
    if (!strcmp(what, "invalidate"))
        return BL_STEP(MEMOPS_INVALIDATE_FLUSHES) ? sel_flush : bl_selected("writeback");
    if (!strcmp(what, "nt"))
        return sel_nt;
    if (!strcmp(what, "copy"))
        return sel_copy;
    return NULL;
}

/* The table of real instructions (*why: NULL). */
const bl_memops *bl_native_ops(const char **why)
{
    *why = NULL;
    return &native_ops;
}

/*
 * Every plain copy kernel the CPU can run must move exactly [dst, dst + n):
 * each from every source and destination offset 0..63 (all relative
 * alignments), at lengths about its short cut-off and vector width, into
 * area with guard bytes either side.  Returns the new count of problems.
 */
static int check_copies(const uint8_t *src, uint8_t *area, size_t area_len, char *out,
                        size_t cap, size_t *used, int count)
{
    typedef struct {
        const char *name;
        void (*copy)(void *, const void *, size_t);
    } kernel;
    kernel kernels[3];
    int nk = 0;
    if (bl_cpu_has("avx512f"))
        kernels[nk++] = (kernel){"avx512", copy_avx512};
    if (bl_cpu_has("avx2"))
        kernels[nk++] = (kernel){"avx2", copy_avx2};
    kernels[nk++] = (kernel){"sse2", copy_sse2};
    static const size_t lengths[] = {0, 1, 63, 255, 256, 257, 300, 319, 320, 321, 700, 891};
    char text[160];
    for (int k = 0; k < nk; k++) {
        int bad = 0;
        for (size_t so = 0; so < 64 && !bad; so++)
            for (size_t d = 0; d < 64 && !bad; d++)
                for (size_t j = 0; j < sizeof(lengths) / sizeof(lengths[0]) && !bad; j++) {
                    size_t n = lengths[j];
                    memset(area, 0xa5, area_len);
                    kernels[k].copy(area + 64 + d, src + so, n);
                    bad = memcmp(area + 64 + d, src + so, n) != 0;
                    for (size_t i = 0; i < area_len && !bad; i++)
                        bad = (i < 64 + d || i >= 64 + d + n) && area[i] != 0xa5;
                    if (bad) {
                        snprintf(text, sizeof(text),
                                 "the %s copy of %zu bytes from offset %zu to offset %zu moves "
                                 "the wrong bytes",
                                 kernels[k].name, n, so, d);
                        count = problem(out, cap, used, count, text);
                    }
                }
    }
    return count;
}

/*
 * Run the native table's copy and invalidate with the recorder on and say what is
 * wrong: problems are NUL-separated in out; returns how many.  Watches this thread
 * only, so other threads may copy meanwhile.
 */
int bl_memops_selfcheck(char *out, size_t cap)
{
    static uint8_t src[1024], area[1024 + 2 * BL_LINE] __attribute__((aligned(64)));
    size_t used = 0;
    int count = 0;
    typedef struct {
        const char *name;
        void (*copy)(void *, const void *, size_t);
        size_t granule; /* bytes a streaming store writes; 0: every byte is a plain store */
    } copier;
    copier copies[3];
    int ncopies = 0;
    if (bl_cpu_has("avx512f"))
        copies[ncopies++] = (copier){"avx512", nt_copy_avx512, 64};
    copies[ncopies++] = (copier){"sse2", nt_copy_sse2, 16};
    copies[ncopies++] = (copier){"store-flush", store_flush, 0};
    pthread_mutex_lock(&selfcheck_lock);
    real_flush = flush_fn, real_writeback = writeback_fn;
    flush_fn = flush_watched, writeback_fn = writeback_watched;
    static const size_t offsets[] = {0, 1, 5, 16, 37, 63}, lengths[] = {1, 15, 64, 100, 300, 777};
    char text[160];
    for (int c = 0, bad = 0; c < ncopies; c++, bad = 0) /* one problem per copy at most */
        for (size_t i = 0; i < sizeof(offsets) / sizeof(offsets[0]) && !bad; i++)
            for (size_t j = 0; j < sizeof(lengths) / sizeof(lengths[0]) && !bad; j++) {
                uint8_t *d = area + offsets[i];
                size_t n = lengths[j], g = copies[c].granule;
                uintptr_t lo = (uintptr_t)d, hi = lo + n;
                uintptr_t body_lo = g ? (lo + g - 1) / g * g : hi, body_hi = g ? hi / g * g : hi;
                if (body_hi < body_lo)
                    body_lo = body_hi = hi;
                nwatched = 0, watching = 1;
                copies[c].copy(d, src, n);
                watching = 0;
                fence_store();
                if (!flushed(lo, body_lo) || !flushed(body_hi, hi)) {
                    bad = 1;
                    snprintf(text, sizeof(text),
                             "the %s non-temporal copy of %zu bytes at offset %zu leaves plain "
                             "stores of its head or tail unflushed",
                             copies[c].name, n, offsets[i]);
                    count = problem(out, cap, &used, count, text);
                }
            }
    for (size_t i = 0; i < sizeof(src); i++)
        src[i] = (uint8_t)(i * 131 + 7);
    count = check_copies(src, area, sizeof(area), out, cap, &used, count);
    bl_mem m = {.base = area, .size = sizeof(area), .ops = &native_ops, .model = NULL};
    nwatched = 0, watching = 1;
    native_ops.invalidate(&m, 3, 200);
    watching = 0;
    int clwb = 0;
    for (int i = 0; i < nwatched; i++)
        clwb |= watched[i].writeback;
    flush_fn = real_flush, writeback_fn = real_writeback;
    pthread_mutex_unlock(&selfcheck_lock);
    if (clwb || !flushed((uintptr_t)area + 3, (uintptr_t)area + 203))
        count = problem(out, cap, &used, count,
                        "invalidate does not flush every line (CLWB keeps a stale line cached)");
    return count;
}
#else
static const char NO_NATIVE[] =
    "native mode needs this CPU's cache-line instructions (x86-64: CLFLUSHOPT or CLFLUSH, "
    "non-temporal stores, SFENCE, MFENCE), and this build of the C core has none for its "
    "architecture; attach in model mode (mode='model', or BELUGA_COHERENCE=model)";

/* Portable build: nothing to pick. */
void bl_memops_init(void) {}

/* Portable build: "none" for every operation of the (missing) native table. */
const char *bl_selected(const char *what)
{
    int known = !strcmp(what, "flush") || !strcmp(what, "writeback") ||
                !strcmp(what, "invalidate") || !strcmp(what, "nt") || !strcmp(what, "copy");
    return known ? "none" : NULL;
}

/* Portable build: no table of real instructions; *why says what to do instead. */
const bl_memops *bl_native_ops(const char **why)
{
    *why = NO_NATIVE;
    return NULL;
}

/* Portable build: the one problem is that there is no native table to check. */
int bl_memops_selfcheck(char *out, size_t cap)
{
    size_t used = 0;
    return problem(out, cap, &used, 0, NO_NATIVE);
}
#endif
