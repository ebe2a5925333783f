/*
 * crc32c.c - CRC32C (Castagnoli), the one checksum of every pool format.
 *
 * Block headers and payloads, index buckets and hint counts, RPC lines and
 * payloads, host-table lines, ring control lines and the superblock are all
 * checked with it.  A *sealed record* is the common shape: a record of
 * `size` bytes whose last four hold the CRC32C (little-endian) of the bytes
 * before them; bl_record_seal / bl_record_sealed are its one codec, in C and
 * (through _core.seal_record / unseal_record) in Python.
 *
 * The maths, in GF(2)[x] modulo the polynomial P in the reflected bit order
 * (bit 31 is x^0): gf_mul multiplies, x_pow(bits) is the operator that
 * appends `bits` zero bits to a CRC.  Everything else is built from them:
 *
 *   table       one byte at a time (the portable path);
 *   shift       tables that move a partial CRC past n zero bytes, to join the
 *               CRCs of streams computed side by side;
 *   fold        residues x^k mod P that move a 128-bit lane down the message;
 *   combine     crc(A || B) = crc(A) * x^(8 |B|) + crc(B).
 *
 * x86-64 choices, made once in bl_crc32c_init() from CPUID (cpu.c):
 * VPCLMULQDQ folding (carry-less multiplies, 256 bytes per step in four zmm
 * accumulators, finished by the CRC32 instruction) if AVX-512 and VPCLMULQDQ
 * are present and the OS saves zmm state; else, and below 256 bytes, the
 * SSE4.2 CRC32 instruction over three interleaved streams (its latency is
 * three times its throughput), the partial CRCs joined with shift tables;
 * else the table.  BELUGA_CRC=vpclmulqdq|hw|sw forces a choice for testing.
 * A sealed line (64 bytes: every header, bucket, RPC and host line) is
 * checked on every probe, so unless the table is chosen it goes the short
 * way: 7 + 1 CRC32 steps with no indirect call (crc_line_hw), and in a batch
 * four lines' chains interleaved (bl_lines_sealed).  Loading and checking a
 * cached header line (C loop): 27-30 ns through crc_fn, 17 ns this way.
 *
 * COPY + CRC
 * A validated read copies a payload out of the pool and checksums it.  Done
 * one after the other (copy 4 KiB, then CRC it from L1) the two add up: on
 * this machine kind (Zen 3) a 2 MiB copy from memory took ~130 us and its
 * CRC ~95 us, the read ~300 us beside ~200 us for invalidate + load.  The
 * copy waits on memory and the CRC on the ALUs, so bl_crc32c_copy folds each
 * vector from the register it was loaded into, right after storing it: one
 * pass, loads and folds overlapping (copy_fold_ymm, chosen where AVX2 and
 * VPCLMULQDQ exist; BELUGA_COPY_CRC=copy+crc forces the two-pass form,
 * which also serves CPUs without them and BELUGA_CRC=hw|sw).  The folds
 * hold the core's schedulers while their loads wait, so fewer misses are in
 * flight than in a plain copy, whose issue runs ahead: from flushed lines the
 * fused pass took 1.33-1.40x a plain copy's time (1 MiB as 64 x 16 KiB, Zen 3).
 * So it prefetches COPY_FOLD_AHEAD bytes ahead, inside the source only:
 * 1.14-1.23x.  (A plain copy gets nothing from it: measured slower, it has
 * none.)  Coherence: a prefetch after the reader's fence is an early load of
 * a line the reader loads anyway, so it sees nothing older than the load.
 */
#include <string.h>

#include "beluga_native.h"

#if BL_X86
#include <immintrin.h>
#endif


static uint32_t crc_table[256];
static const char *sel_crc = "sw", *sel_copy_crc = "copy+crc";
static uint32_t (*crc_fn)(uint32_t, const void *, size_t);
#if BL_X86
static int line_hw; /* sealed lines by crc_line_hw (the CRC32 instruction is chosen) */
#endif
#define COPY_CRC_PIECE 4096u /* the unfused copy + CRC: bytes copied, then checksummed from L1 */
/* libc's memcpy, until memops.c hands over its kernel (bl_crc32c_set_copy). */
static void copy_memcpy(void *dst, const void *src, size_t n) { memcpy(dst, src, n); }
static void (*copy_piece_fn)(void *, const void *, size_t) = copy_memcpy;
static uint32_t copy_then_crc(uint32_t c, void *dst, const void *src, size_t n);
static uint32_t (*copy_crc_fn)(uint32_t, void *, const void *, size_t) = copy_then_crc;

/* Multiply two polynomials modulo P in the reflected domain (bit 31 is x^0). */
static uint32_t gf_mul(uint32_t a, uint32_t b)
{
    uint32_t product = 0;
    for (uint32_t bit = 1u << 31; bit; bit >>= 1) {
        if (a & bit)
            product ^= b;
        b = (b & 1) ? (b >> 1) ^ BL_CRC32C_POLY : b >> 1;
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

/* Raw CRC32C update, one byte at a time through a table (portable path). */
static uint32_t crc_sw(uint32_t c, const void *buf, size_t n)
{
    const uint8_t *p = buf;
    while (n--)
        c = crc_table[(c ^ *p++) & 0xff] ^ (c >> 8);
    return c;
}

#if BL_X86
/* shift tables: x^(8n) mod P applied to a 32-bit CRC, one byte at a time */
typedef struct { uint32_t t[4][256]; } shift_table;
static shift_table shift_big1, shift_big2, shift_small1, shift_small2;
#define CRC_BIG 1024u  /* bytes per stream in the large interleaved step */
#define CRC_SMALL 128u /* bytes per stream in the small interleaved step */

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
    if (n >= 4) {
        uint32_t w;
        memcpy(&w, p, 4);
        c = _mm_crc32_u32((uint32_t)c, w);
        n -= 4, p += 4;
    }
    for (; n; n--)
        c = _mm_crc32_u8((uint32_t)c, *p++);
    return c;
}

/* The finished CRC32C of a line's first 60 bytes (a sealed line's body): seven 8-byte
 * steps and a 4-byte one, unrolled, with no call through crc_fn. */
__attribute__((target("sse4.2"))) static uint32_t crc_line_hw(const uint8_t *p)
{
    return ~(uint32_t)crc_hw_stream(~0u, p, BL_LINE - BL_SEAL_BYTES);
}

/* crc_line_hw of four lines, their chains interleaved: the CRC32 instruction's latency is
 * three times its throughput, so four chains run in about the time of one. */
__attribute__((target("sse4.2"))) static void crc_lines4_hw(const uint8_t *const *p,
                                                            uint32_t out[4])
{
    uint64_t c[4] = {~0u, ~0u, ~0u, ~0u}, w;
    for (size_t at = 0; at < BL_LINE - BL_SEAL_BYTES - 4; at += 8)
        for (int k = 0; k < 4; k++) {
            memcpy(&w, p[k] + at, 8);
            c[k] = _mm_crc32_u64(c[k], w);
        }
    for (int k = 0; k < 4; k++) {
        uint32_t tail;
        memcpy(&tail, p[k] + BL_LINE - BL_SEAL_BYTES - 4, 4);
        out[k] = ~_mm_crc32_u32((uint32_t)c[k], tail);
    }
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
#define COPY_FOLD_AHEAD 2048u /* copy_fold_ymm's software prefetch distance, bytes */
static uint64_t fold_2048[2], fold_1536[2], fold_1024[2], fold_768[2], fold_512[2],
    fold_256[2], fold_lanes[8];

/* The residues that move a 128-bit lane `bits` further down the message. */
static void fold_pair(uint64_t k[2], unsigned bits)
{
    k[0] = x_pow(bits + 31);
    k[1] = x_pow(bits - 33);
}

/* Fill every fold constant (once, from bl_crc32c_init). */
static void fold_init(void)
{
    fold_pair(fold_2048, 2048);
    fold_pair(fold_1536, 1536);
    fold_pair(fold_1024, 1024);
    fold_pair(fold_768, 768);
    fold_pair(fold_512, 512);
    fold_pair(fold_256, 256);
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

/* acc's two lanes moved ahead by k's distance, XORed with data (the ymm form of fold_zmm). */
__attribute__((target("avx2,vpclmulqdq"))) static inline __m256i fold_ymm(__m256i acc, __m256i k,
                                                                         __m256i data)
{
    return _mm256_xor_si256(_mm256_xor_si256(_mm256_clmulepi64_epi128(acc, k, 0x00),
                                             _mm256_clmulepi64_epi128(acc, k, 0x11)),
                            data);
}

/* A pair of fold residues in both lanes of a ymm. */
__attribute__((target("avx2"))) static inline __m256i fold_k_ymm(const uint64_t k[2])
{
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const void *)k));
}

/* Load 32 bytes of the source and store them to the destination: the copy half of a step. */
#define COPY_YMM(q, p, at)                                                                     \
    ({                                                                                         \
        __m256i v_ = _mm256_loadu_si256((const void *)((p) + (at)));                           \
        _mm256_storeu_si256((void *)((q) + (at)), v_);                                         \
        v_;                                                                                    \
    })

/*
 * Copy n bytes and return the raw CRC32C `c` extended over them, in one pass:
 * crc_fold's scheme on ymm registers (four accumulators of two lanes, 128
 * bytes per step), each vector stored to the destination as it is loaded and
 * folded from the register.  The folds (ALU) overlap the loads (memory), so a
 * validated read from the pool costs about its copy, not copy plus checksum.
 * AVX2 + VPCLMULQDQ, which every AVX-512 VPCLMULQDQ CPU also has.
 */
__attribute__((target("avx2,vpclmulqdq,sse4.2"))) static uint32_t copy_fold_ymm(uint32_t c,
                                                                                void *dst,
                                                                                const void *src,
                                                                                size_t n)
{
    uint8_t *q = dst;
    const uint8_t *p = src;
    if (n < CRC_FOLD_MIN) {
        memcpy(q, p, n);
        return crc_hw(c, q, n);
    }
    const uint8_t *ahead_end = p + n; /* prefetches stay inside the source */
    __m256i k = fold_k_ymm(fold_1024);
    __m256i a0 = _mm256_xor_si256(COPY_YMM(q, p, 0), _mm256_set_epi32(0, 0, 0, 0, 0, 0, 0, (int)c));
    __m256i a1 = COPY_YMM(q, p, 32), a2 = COPY_YMM(q, p, 64), a3 = COPY_YMM(q, p, 96);
    for (p += 128, q += 128, n -= 128; n >= 128; n -= 128, p += 128, q += 128) {
        if (p + COPY_FOLD_AHEAD + 128 <= ahead_end) {
            _mm_prefetch((const char *)p + COPY_FOLD_AHEAD, _MM_HINT_T0);
            _mm_prefetch((const char *)p + COPY_FOLD_AHEAD + 64, _MM_HINT_T0);
        }
        __m256i x0 = COPY_YMM(q, p, 0), x1 = COPY_YMM(q, p, 32);
        __m256i x2 = COPY_YMM(q, p, 64), x3 = COPY_YMM(q, p, 96);
        a0 = fold_ymm(a0, k, x0);
        a1 = fold_ymm(a1, k, x1);
        a2 = fold_ymm(a2, k, x2);
        a3 = fold_ymm(a3, k, x3);
    }
    k = fold_k_ymm(fold_256);
    a3 = fold_ymm(a0, fold_k_ymm(fold_768), a3);
    a3 = fold_ymm(a1, fold_k_ymm(fold_512), a3);
    a3 = fold_ymm(a2, k, a3);
    for (; n >= 32; n -= 32, p += 32, q += 32)
        a3 = fold_ymm(a3, k, COPY_YMM(q, p, 0));
    /* lane 0 moves ahead by 16 bytes onto lane 1, which stays (its residues are zero) */
    a3 = fold_ymm(a3, _mm256_loadu_si256((const void *)(fold_lanes + 4)),
                  _mm256_blend_epi32(_mm256_setzero_si256(), a3, 0xf0));
    __m128i x = _mm_xor_si128(_mm256_castsi256_si128(a3), _mm256_extracti128_si256(a3, 1));
    uint64_t lane[2];
    _mm_storeu_si128((void *)lane, x);
    memcpy(q, p, n);
    return (uint32_t)crc_hw_stream(_mm_crc32_u64(_mm_crc32_u64(0, lane[0]), lane[1]), q, n);
}
#endif

/* Copy then checksum from the destination (L1), a piece at a time: the unfused fallback. */
static uint32_t copy_then_crc(uint32_t c, void *dst, const void *src, size_t n)
{
    for (size_t done = 0; done < n; done += COPY_CRC_PIECE) {
        size_t k = n - done < COPY_CRC_PIECE ? n - done : COPY_CRC_PIECE;
        copy_piece_fn((uint8_t *)dst + done, (const uint8_t *)src + done, k);
        c = crc_fn(c, (uint8_t *)dst + done, k);
    }
    return c;
}

/* Build the tables and pick the CRC32C code once, from CPUID and BELUGA_CRC. */
void bl_crc32c_init(void)
{
    static int done;
    if (done)
        return;
    done = 1;
    uint32_t x8 = x_pow(8); /* a byte through the register: (crc ^ byte) * x^8 */
    for (uint32_t b = 0; b < 256; b++)
        crc_table[b] = gf_mul(x8, b);
    crc_fn = crc_sw;
#if BL_X86
    shift_table_init(&shift_big1, CRC_BIG);
    shift_table_init(&shift_big2, 2 * CRC_BIG);
    shift_table_init(&shift_small1, CRC_SMALL);
    shift_table_init(&shift_small2, 2 * CRC_SMALL);
    fold_init();
    int sse42 = bl_cpu_has("sse4.2");
    int can_fold = bl_cpu_has("vpclmulqdq") && bl_cpu_has("avx512f") && sse42;
    if (can_fold && !bl_forced("BELUGA_CRC", "hw") && !bl_forced("BELUGA_CRC", "sw"))
        crc_fn = crc_fold, sel_crc = "vpclmulqdq";
    else if (sse42 && !bl_forced("BELUGA_CRC", "sw"))
        crc_fn = crc_hw, sel_crc = "hw";
    line_hw = strcmp(sel_crc, "sw") != 0; /* below 256 bytes the fold is crc_hw too */
    int can_fold_ymm = bl_cpu_has("vpclmulqdq") && bl_cpu_has("avx2") && sse42;
    if (can_fold_ymm && strcmp(sel_crc, "sw") && !bl_forced("BELUGA_CRC", "hw") &&
        !bl_forced("BELUGA_COPY_CRC", "copy+crc"))
        copy_crc_fn = copy_fold_ymm, sel_copy_crc = "fold-ymm";
#endif
}

/* The copy that the unfused copy + CRC uses (memops.c's kernel, set once at its init). */
void bl_crc32c_set_copy(void (*copy)(void *, const void *, size_t)) { copy_piece_fn = copy; }

/* Which copy + CRC32C is used: "fold-ymm" (fused) or "copy+crc". */
const char *bl_crc32c_copy_selected(void) { return sel_copy_crc; }

/* Copy n bytes from src to dst (not overlapping); the raw CRC32C crc extended over them. */
uint32_t bl_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t n)
{
    return copy_crc_fn(crc, dst, src, n);
}

/* Which CRC32C code is used: "vpclmulqdq", "hw" or "sw". */
const char *bl_crc32c_selected(void) { return sel_crc; }

/* Raw CRC32C register update (no pre- or post-inversion). */
uint32_t bl_crc32c(uint32_t crc, const void *buf, size_t n) { return crc_fn(crc, buf, n); }

/* The finished CRC32C of one buffer (as zlib.crc32 finishes its CRC). */
uint32_t bl_crc32c_of(const void *buf, size_t n) { return ~crc_fn(~0u, buf, n); }

/* a * b in GF(2)[x] mod P, reflected (bit 31 is x^0): the product the combine rule uses. */
uint32_t bl_crc32c_mul(uint32_t a, uint32_t b) { return gf_mul(a, b); }

/* x^(8n) mod P: the operator that moves a CRC register past n zero bytes (the GPU's CRC
 * kernels take their shift constants from here, so the polynomial has one home). */
uint32_t bl_crc32c_x8n(uint64_t n) { return x_pow(8 * n); }

/* The CRC32C of A || B from crc(A), crc(B) and |B| (finished CRCs): crc(A) x^(8|B|) + crc(B). */
uint32_t bl_crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b)
{
    return gf_mul(x_pow(8 * len_b), crc_a) ^ crc_b;
}

/* The finished CRC32C of a record's body (all but its last 4 bytes); a line's the short way
 * (every header, bucket, RPC and host line is checked with it: it is on every probe). */
static uint32_t record_crc(const void *rec, size_t size)
{
#if BL_X86
    if (size == BL_LINE && line_hw)
        return crc_line_hw(rec);
#endif
    return bl_crc32c_of(rec, size - BL_SEAL_BYTES);
}

/* Seal a record of `size` bytes: its last 4 := the CRC32C of the rest, little-endian. */
void bl_record_seal(void *rec, size_t size)
{
    uint32_t c = record_crc(rec, size);
    uint8_t *p = (uint8_t *)rec + size - BL_SEAL_BYTES;
    for (unsigned i = 0; i < BL_SEAL_BYTES; i++)
        p[i] = (uint8_t)(c >> (8 * i));
}

/* The CRC a record of `size` bytes carries in its last 4 bytes (little-endian). */
static uint32_t record_seal_of(const void *rec, size_t size)
{
    const uint8_t *p = (const uint8_t *)rec + size - BL_SEAL_BYTES;
    uint32_t stored = 0;
    for (unsigned i = 0; i < BL_SEAL_BYTES; i++)
        stored |= (uint32_t)p[i] << (8 * i);
    return stored;
}

/* Whether a record of `size` bytes is whole: its last 4 bytes are the CRC32C of the rest. */
int bl_record_sealed(const void *rec, size_t size)
{
    return record_seal_of(rec, size) == record_crc(rec, size);
}

/* bl_record_sealed of n one-line records into ok[i] (1 or 0), four checked side by side. */
void bl_lines_sealed(const void *const *lines, size_t n, uint8_t *ok)
{
    size_t i = 0;
#if BL_X86
    for (; line_hw && i + 4 <= n; i += 4) {
        uint32_t c[4];
        crc_lines4_hw((const uint8_t *const *)lines + i, c);
        for (int k = 0; k < 4; k++)
            ok[i + k] = record_seal_of(lines[i + k], BL_LINE) == c[k];
    }
#endif
    for (; i < n; i++)
        ok[i] = (uint8_t)bl_record_sealed(lines[i], BL_LINE);
}
