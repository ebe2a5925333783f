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
 * x86-64 choices, made once in bl_cpu_init() from CPUID:
 *   flush       CLFLUSHOPT if present, else CLFLUSH (serialising, slower).
 *   write-back  CLWB if present, else the flush above.
 *   nt copy     AVX-512 streaming stores (64 B per instruction) if present,
 *               else SSE2 streaming stores; the unaligned head and tail of a
 *               copy are plain stores followed by a flush of their lines.
 *   crc32c      the SSE4.2 CRC32 instruction over three interleaved streams
 *               (its latency is three times its throughput), the partial
 *               CRCs joined with precomputed shift tables; else a table.
 * The chicken-bit variables BELUGA_FLUSH (clflushopt|clflush),
 * BELUGA_NT (avx512|sse2|store-flush) and BELUGA_CRC (hw|sw) force a choice
 * for testing; a choice the CPU cannot honour falls back to the best one it
 * can, and bl_selected() always tells what is really used.
 *
 * Other architectures get a portable build: plain copies, compiler fences and
 * a table CRC.  That is only correct on a coherent machine, which is exactly
 * where such a build runs today (CI, laptops).
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "beluga_native.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#define BL_X86 1
#else
#define BL_X86 0
#endif

#define CRC32C_POLY 0x82f63b78u /* reflected Castagnoli polynomial */

static uint32_t crc_table[256];
/* shift tables: x^(8n) mod P applied to a 32-bit CRC, one byte at a time */
typedef struct { uint32_t t[4][256]; } shift_table;
static shift_table shift_big1, shift_big2, shift_small1, shift_small2;
#define CRC_BIG 1024u  /* bytes per stream in the large interleaved step */
#define CRC_SMALL 128u /* bytes per stream in the small interleaved step */

static int has_clflushopt, has_clwb, has_avx512f, has_sse42;
static const char *sel_flush = "none", *sel_nt = "store-flush", *sel_crc = "sw";
static void (*flush_fn)(const void *, size_t);
static void (*writeback_fn)(const void *, size_t);
static void (*nt_copy_fn)(void *, const void *, size_t);
static uint32_t (*crc_fn)(uint32_t, const void *, size_t);

/* Multiply two polynomials modulo P in the reflected domain (bit 31 is x^0). */
static uint32_t gf_mul(uint32_t a, uint32_t b)
{
    uint32_t product = 0;
    for (uint32_t bit = 1u << 31; bit; bit >>= 1) {
        if (a & bit)
            product ^= b;
        b = (b & 1) ? (b >> 1) ^ CRC32C_POLY : b >> 1;
    }
    return product;
}

/* x^(8 * nbytes) mod P: the operator that appends nbytes zero bytes to a CRC. */
static uint32_t x_pow_bytes(uint64_t nbytes)
{
    uint32_t result = 1u << 31, square = 1u << 30;
    for (uint64_t e = 8 * nbytes; e; e >>= 1) {
        if (e & 1)
            result = gf_mul(result, square);
        square = gf_mul(square, square);
    }
    return result;
}

/* Fill a byte-wise table that shifts a CRC register past nbytes of zeros. */
static void shift_table_init(shift_table *st, uint64_t nbytes)
{
    uint32_t op = x_pow_bytes(nbytes);
    for (int k = 0; k < 4; k++)
        for (uint32_t b = 0; b < 256; b++)
            st->t[k][b] = gf_mul(op, b << (8 * k));
}

/* Apply a shift table to a raw CRC register. */
static inline uint32_t shift_apply(const shift_table *st, uint32_t c)
{
    return st->t[0][c & 0xff] ^ st->t[1][(c >> 8) & 0xff] ^ st->t[2][(c >> 16) & 0xff] ^
           st->t[3][c >> 24];
}

/* Raw CRC32C update, one byte at a time through a table (portable path). */
static uint32_t crc_sw(uint32_t c, const void *buf, size_t n)
{
    const uint8_t *p = buf;
    while (n--)
        c = crc_table[(c ^ *p++) & 0xff] ^ (c >> 8);
    return c;
}

/* Plain stores then a flush of their lines: a copy that reaches memory. */
static void store_flush(void *dst, const void *src, size_t n)
{
    if (!n)
        return;
    memcpy(dst, src, n);
    flush_fn(dst, n);
}

#if BL_X86
/* Raw CRC32C of one stream with the CRC32 instruction. */
__attribute__((target("sse4.2"))) static inline uint64_t crc_hw_stream(uint64_t c,
                                                                       const uint8_t *p,
                                                                       size_t n)
{
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = _mm_crc32_u64(c, w);
    }
    for (; n; n--)
        c = _mm_crc32_u8((uint32_t)c, *p++);
    return c;
}

/* Three streams of len bytes in flight at once, joined by shift tables. */
__attribute__((target("sse4.2"))) static inline uint64_t crc_hw_3way(
    uint64_t c, const uint8_t *p, size_t len, const shift_table *s1, const shift_table *s2)
{
    uint64_t c1 = 0, c2 = 0;
    const uint8_t *q = p + len, *r = p + 2 * len;
    for (size_t i = 0; i < len; i += 8) {
        uint64_t a, b, d;
        memcpy(&a, p + i, 8);
        memcpy(&b, q + i, 8);
        memcpy(&d, r + i, 8);
        c = _mm_crc32_u64(c, a);
        c1 = _mm_crc32_u64(c1, b);
        c2 = _mm_crc32_u64(c2, d);
    }
    return shift_apply(s2, (uint32_t)c) ^ shift_apply(s1, (uint32_t)c1) ^ (uint32_t)c2;
}

/* Raw CRC32C with the CRC32 instruction, interleaved where the buffer allows. */
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t c, const void *buf, size_t n)
{
    const uint8_t *p = buf;
    uint64_t acc = c;
    for (; n >= 3 * CRC_BIG; n -= 3 * CRC_BIG, p += 3 * CRC_BIG)
        acc = crc_hw_3way(acc, p, CRC_BIG, &shift_big1, &shift_big2);
    for (; n >= 3 * CRC_SMALL; n -= 3 * CRC_SMALL, p += 3 * CRC_SMALL)
        acc = crc_hw_3way(acc, p, CRC_SMALL, &shift_small1, &shift_small2);
    return (uint32_t)crc_hw_stream(acc, p, n);
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
    store_flush(d, s, head);
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
    store_flush(d, s, n);
}

/* Streaming copy with SSE2 (16 B per store). */
static void nt_copy_sse2(void *dst, const void *src, size_t n)
{
    uint8_t *d = dst;
    const uint8_t *s = src;
    size_t head = (size_t)(-(uintptr_t)d & 15);
    if (head > n)
        head = n;
    store_flush(d, s, head);
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
    store_flush(d, s, n);
}

/* Store fence: earlier stores (non-temporal ones too) complete before later ones. */
static void fence_store(void) { _mm_sfence(); }
/* Full fence: also orders loads after earlier flushes. */
static void fence_full(void) { _mm_mfence(); }
#else
/* Portable build: a coherent machine needs no flush, only ordering. */
static void flush_none(const void *addr, size_t n) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
/* Portable store fence. */
static void fence_store(void) { __atomic_thread_fence(__ATOMIC_RELEASE); }
/* Portable full fence. */
static void fence_full(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
#endif

/* True when the chicken-bit variable `name` asks for `value`. */
static int forced(const char *name, const char *value)
{
    const char *v = getenv(name);
    return v && strcmp(v, value) == 0;
}

/* Pick every instruction once, from CPUID and the chicken bits. */
void bl_cpu_init(void)
{
    static int done;
    if (done)
        return;
    done = 1;
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t c = b;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ CRC32C_POLY : c >> 1;
        crc_table[b] = c;
    }
    shift_table_init(&shift_big1, CRC_BIG);
    shift_table_init(&shift_big2, 2 * CRC_BIG);
    shift_table_init(&shift_small1, CRC_SMALL);
    shift_table_init(&shift_small2, 2 * CRC_SMALL);
    crc_fn = crc_sw;
#if BL_X86
    unsigned a, b, c, d;
    if (__get_cpuid(1, &a, &b, &c, &d))
        has_sse42 = (c >> 20) & 1;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        has_avx512f = (b >> 16) & 1;
        has_clflushopt = (b >> 23) & 1;
        has_clwb = (b >> 24) & 1;
    }
    if (has_clflushopt && !forced("BELUGA_FLUSH", "clflush"))
        flush_fn = flush_clflushopt, sel_flush = "clflushopt";
    else
        flush_fn = flush_clflush, sel_flush = "clflush";
    if (has_clwb)
        writeback_fn = writeback_clwb;
    else
        writeback_fn = flush_fn;
    if (has_avx512f && !forced("BELUGA_NT", "sse2") && !forced("BELUGA_NT", "store-flush"))
        nt_copy_fn = nt_copy_avx512, sel_nt = "avx512";
    else if (!forced("BELUGA_NT", "store-flush"))
        nt_copy_fn = nt_copy_sse2, sel_nt = "sse2";
    else
        nt_copy_fn = store_flush, sel_nt = "store-flush";
    if (has_sse42 && !forced("BELUGA_CRC", "sw"))
        crc_fn = crc_hw, sel_crc = "hw";
#else
    flush_fn = writeback_fn = flush_none;
    nt_copy_fn = store_flush;
#endif
}

/* Which instruction is used for "flush", "writeback", "nt" or "crc". */
const char *bl_selected(const char *what)
{
    if (!strcmp(what, "flush"))
        return sel_flush;
    if (!strcmp(what, "writeback"))
#if BL_X86
        return has_clwb ? "clwb" : sel_flush;
#else
        return sel_flush;
#endif
    if (!strcmp(what, "nt"))
        return sel_nt;
    if (!strcmp(what, "crc"))
        return sel_crc;
    return NULL;
}

/* Whether the CPU reports a feature (sse4.2, avx512f, clflushopt, clwb). */
int bl_cpu_has(const char *feature)
{
    if (!strcmp(feature, "sse4.2"))
        return has_sse42;
    if (!strcmp(feature, "avx512f"))
        return has_avx512f;
    if (!strcmp(feature, "clflushopt"))
        return has_clflushopt;
    if (!strcmp(feature, "clwb"))
        return has_clwb;
    return 0;
}

/* Raw CRC32C register update (no pre- or post-inversion). */
uint32_t bl_crc32c(uint32_t crc, const void *buf, size_t n) { return crc_fn(crc, buf, n); }

/* Copy so that the bytes reach memory once the next store fence completes. */
void bl_nt_copy(void *dst, const void *src, size_t n) { nt_copy_fn(dst, src, n); }

/* Flush (write back and drop) every line of [addr, addr + n). */
void bl_flush_lines(const void *addr, size_t n) { flush_fn(addr, n); }

/* Native table: plain loads from the mapping. */
static void native_load(bl_mem *m, size_t off, void *dst, size_t n) { memcpy(dst, m->base + off, n); }

/* Native table: plain stores into the mapping (they stay in this CPU's cache). */
static void native_store(bl_mem *m, size_t off, const void *src, size_t n)
{
    memcpy(m->base + off, src, n);
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

/* Native table: store fence. */
static void native_sfence(bl_mem *m) { fence_store(); }

/* Native table: full fence. */
static void native_mfence(bl_mem *m) { fence_full(); }

static const bl_memops native_ops = {
    .name = "native",
    .load = native_load,
    .store = native_store,
    .nt_store = native_nt_store,
    .flush = native_flush,
    .writeback = native_writeback,
    .invalidate = native_flush, /* x86 has no user-mode drop without write-back */
    .sfence = native_sfence,
    .mfence = native_mfence,
};

/* The table of real instructions. */
const bl_memops *bl_native_ops(void) { return &native_ops; }
