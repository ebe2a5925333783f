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
 *   crc32c      VPCLMULQDQ folding (carry-less multiplies, 256 bytes per step
 *               in four zmm accumulators, finished by the CRC32 instruction)
 *               if AVX-512 and VPCLMULQDQ are present and the OS saves zmm
 *               state; else, and below 256 bytes, the SSE4.2 CRC32
 *               instruction over three interleaved streams (its latency is
 *               three times its throughput), the partial CRCs joined with
 *               precomputed shift tables; else a table.
 * The chicken-bit variables BELUGA_FLUSH (clflushopt|clflush),
 * BELUGA_NT (avx512|sse2|store-flush) and BELUGA_CRC (vpclmulqdq|hw|sw) force a choice
 * for testing; a choice the CPU cannot honour falls back to the best one it
 * can, and bl_selected() always tells what is really used.
 *
 * Other architectures get a portable build: plain copies, compiler fences and
 * a table CRC.  That is only correct on a coherent machine, which is exactly
 * where such a build runs today (CI, laptops).
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

static int has_clflushopt, has_clwb, has_avx512f, has_sse42, has_vpclmulqdq;
static const char *sel_flush = "none", *sel_nt = "store-flush", *sel_crc = "sw";
static void (*flush_fn)(const void *, size_t);
static void (*writeback_fn)(const void *, size_t);
static void (*nt_copy_fn)(void *, const void *, size_t);
static uint32_t (*crc_fn)(uint32_t, const void *, size_t);

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

/* x^bits mod P: the operator that appends `bits` zero bits to a CRC. */
static uint32_t x_pow(uint64_t bits)
{
    uint32_t result = 1u << 31, square = 1u << 30;
    for (uint64_t e = bits; e; e >>= 1) {
        if (e & 1)
            result = gf_mul(result, square);
        square = gf_mul(square, square);
    }
    return result;
}

/* Fill a byte-wise table that shifts a CRC register past nbytes of zeros. */
static void shift_table_init(shift_table *st, uint64_t nbytes)
{
    uint32_t op = x_pow(8 * nbytes);
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

/* The unaligned head or tail of a streaming copy: plain stores, flushed. */
static void edge_copy(void *dst, const void *src, size_t n)
{
    if (BL_STEP(MEMOPS_NT_EDGE_FLUSH))
        store_flush(dst, src, n);
    else
        memcpy(dst, src, n);
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

/*
 * Folding with carry-less multiplies.  A 16-byte lane loaded little-endian
 * is a polynomial of degree < 128 in the reflected order (bit 0 is x^127):
 * its first 8 bytes H are the high half, its last 8 bytes L the low one.
 * Moving the lane D bits further down the message multiplies it by x^D, and
 * H * x^(64+D) + L * x^D stays congruent mod P when each power is replaced by
 * its 32-bit residue; each product (64 x 32 bits) fits back into 128 bits.
 * PCLMULQDQ on reflected operands yields the product times x, and a 32-bit
 * reflected constant in a qword is worth another x^32, hence the residues
 * {x^(D+31), x^(D-33)} mod P kept per distance (low qword for H, high for L).
 * Four zmm accumulators (16 lanes, 256 bytes) run independent chains; they
 * fold into one zmm, its four lanes into one, and the 16 bytes of that lane
 * (congruent to everything folded so far) plus the tail go through the CRC32
 * instruction, which replaces a Barrett reduction.  The initial CRC enters
 * by XOR into the first 4 bytes: crc(c, M) = crc(0, M ^ c).
 */
#define CRC_FOLD_MIN 256u /* below this the 3-stream CRC32 path is as fast */
static uint64_t fold_2048[2], fold_1536[2], fold_1024[2], fold_512[2], fold_lanes[8];

/* The residues that move a 128-bit lane `bits` further down the message. */
static void fold_pair(uint64_t k[2], unsigned bits)
{
    k[0] = x_pow(bits + 31);
    k[1] = x_pow(bits - 33);
}

/* Fill every fold constant (once, from bl_cpu_init). */
static void fold_init(void)
{
    fold_pair(fold_2048, 2048);
    fold_pair(fold_1536, 1536);
    fold_pair(fold_1024, 1024);
    fold_pair(fold_512, 512);
    fold_pair(fold_lanes, 384);
    fold_pair(fold_lanes + 2, 256);
    fold_pair(fold_lanes + 4, 128);
}

/* acc's four lanes moved ahead by k's distance, XORed with data. */
__attribute__((target("avx512f,vpclmulqdq"))) static inline __m512i fold_zmm(__m512i acc,
                                                                            __m512i k,
                                                                            __m512i data)
{
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(acc, k, 0x00),
                                     _mm512_clmulepi64_epi128(acc, k, 0x11), data, 0x96);
}

/* A pair of fold residues in every lane of a zmm. */
__attribute__((target("avx512f"))) static inline __m512i fold_k(const uint64_t k[2])
{
    return _mm512_broadcast_i32x4(_mm_loadu_si128((const void *)k));
}

/* Raw CRC32C by VPCLMULQDQ folding, 256 bytes per step; short buffers as crc_hw. */
__attribute__((target("avx512f,vpclmulqdq,sse4.2"))) static uint32_t crc_fold(uint32_t c,
                                                                              const void *buf,
                                                                              size_t n)
{
    if (n < CRC_FOLD_MIN)
        return crc_hw(c, buf, n);
    const uint8_t *p = buf;
    __m512i k = fold_k(fold_2048);
    __m512i a0 = _mm512_xor_si512(_mm512_loadu_si512(p),
                                  _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)c)));
    __m512i a1 = _mm512_loadu_si512(p + 64), a2 = _mm512_loadu_si512(p + 128);
    __m512i a3 = _mm512_loadu_si512(p + 192);
    for (p += 256, n -= 256; n >= 256; n -= 256, p += 256) {
        a0 = fold_zmm(a0, k, _mm512_loadu_si512(p));
        a1 = fold_zmm(a1, k, _mm512_loadu_si512(p + 64));
        a2 = fold_zmm(a2, k, _mm512_loadu_si512(p + 128));
        a3 = fold_zmm(a3, k, _mm512_loadu_si512(p + 192));
    }
    k = fold_k(fold_512);
    a3 = fold_zmm(a0, fold_k(fold_1536), a3);
    a3 = fold_zmm(a1, fold_k(fold_1024), a3);
    a3 = fold_zmm(a2, k, a3);
    for (; n >= 64; n -= 64, p += 64)
        a3 = fold_zmm(a3, k, _mm512_loadu_si512(p));
    /* lanes 0..2 move ahead by 48, 32, 16 bytes onto lane 3, which stays */
    a3 = fold_zmm(a3, _mm512_loadu_si512(fold_lanes), _mm512_maskz_mov_epi64(0xc0, a3));
    __m128i x = _mm_xor_si128(
        _mm_xor_si128(_mm512_castsi512_si128(a3), _mm512_extracti32x4_epi32(a3, 1)),
        _mm_xor_si128(_mm512_extracti32x4_epi32(a3, 2), _mm512_extracti32x4_epi32(a3, 3)));
    uint64_t lane[2];
    _mm_storeu_si128((void *)lane, x);
    return (uint32_t)crc_hw_stream(_mm_crc32_u64(_mm_crc32_u64(0, lane[0]), lane[1]), p, n);
}

/* Whether the OS saves the opmask and zmm registers (XCR0 bits 1, 2, 5, 6, 7). */
__attribute__((target("xsave"))) static int os_saves_zmm(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) /* OSXSAVE */
        return 0;
    return (_xgetbv(0) & 0xe6) == 0xe6;
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
        has_vpclmulqdq = (c >> 10) & 1;
    }
    has_avx512f = has_avx512f && os_saves_zmm(); /* a VM may hide the zmm state */
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
    fold_init();
    int can_fold = has_vpclmulqdq && has_avx512f && has_sse42;
    if (can_fold && !forced("BELUGA_CRC", "hw") && !forced("BELUGA_CRC", "sw"))
        crc_fn = crc_fold, sel_crc = "vpclmulqdq";
    else if (has_sse42 && !forced("BELUGA_CRC", "sw"))
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
    if (!strcmp(what, "invalidate"))
        return BL_STEP(MEMOPS_INVALIDATE_FLUSHES) ? sel_flush : bl_selected("writeback");
    if (!strcmp(what, "nt"))
        return sel_nt;
    if (!strcmp(what, "crc"))
        return sel_crc;
    return NULL;
}

/* Whether the CPU reports a feature (sse4.2, avx512f, clflushopt, clwb, vpclmulqdq). */
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
    if (!strcmp(feature, "vpclmulqdq"))
        return has_vpclmulqdq;
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

/* Native table: drop lines before a read.  x86 has no user-mode drop without write-back,
 * so this is a flush; never CLWB, which would keep the stale line. */
static void native_invalidate(bl_mem *m, size_t off, size_t n)
{
    (BL_STEP(MEMOPS_INVALIDATE_FLUSHES) ? flush_fn : writeback_fn)(m->base + off, n);
}

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
    .invalidate = native_invalidate,
    .sfence = native_sfence,
    .mfence = native_mfence,
};

/* The table of real instructions. */
const bl_memops *bl_native_ops(void) { return &native_ops; }

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
#if BL_X86
    if (has_avx512f)
        copies[ncopies++] = (copier){"avx512", nt_copy_avx512, 64};
    copies[ncopies++] = (copier){"sse2", nt_copy_sse2, 16};
#endif
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
