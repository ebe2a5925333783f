/*
 * blake3.c - the key digest: BLAKE3 (unkeyed), its first 16 output bytes.
 *
 * A key's 16-byte digest is its identity everywhere in the pool: block
 * headers hold it, the index hashes it into a tag and two buckets, the
 * metadata server keys its tables by it.  It is computed here once for every
 * caller (the write path through beluga.coherence.digest, the read path
 * inside Index), so the two can never disagree; the tests compare it with the
 * `blake3` package as an independent check.
 *
 * WHY BLAKE3.  The digest must resist chosen keys (a forged collision would
 * let one key's bytes answer for another's), and it is on the read path of
 * every probe: lookup_prefix(256) digests 256 keys.  Layout 3 used
 * BLAKE2b-128: 12 rounds on 64-bit words, so AVX2 holds four keys a
 * register; on Zen 3 that cost ~69 ns a key (256 keys: 17.6 us of a ~47 us
 * lookup_prefix).  BLAKE3 has 7 rounds on 32-bit words and 64-byte blocks, so
 * an AVX2 register holds eight keys and a key of up to 64 bytes is one
 * compression: about a third of the vector work a key.
 *
 * Keys are 1..BL_MAX_KEY (256) bytes, so a key is always one chunk (1024
 * bytes): one to four blocks chained with the chunk counter 0, the first
 * flagged CHUNK_START, the last CHUNK_END | ROOT; the digest is words 0..3 of
 * the last block's output.  No tree, no parent nodes, no counter above 0.
 *
 * bl_key_digest_many hashes eight keys at a time, one key per 32-bit lane of
 * AVX2 registers (every flag, length and counter word is a vector too, so the
 * lanes' keys may differ in length; a lane whose key has fewer blocks keeps
 * its chaining value while the others go on).  Setting BELUGA_NO_BLAKE3_X8
 * turns the lanes off (the tests compare both paths).
 */
#include <stdlib.h>
#include <string.h>

#include "beluga_native.h"

#define B3_CHUNK_START 1u
#define B3_CHUNK_END 2u
#define B3_ROOT 8u

static const uint32_t b3_iv[8] = {0x6A09E667u, 0xBB67AE85u, 0x3C6EF372u, 0xA54FF53Au,
                                  0x510E527Fu, 0x9B05688Cu, 0x1F83D9ABu, 0x5BE0CD19u};

/* The message word each round takes at each position: round r is the permutation
 * [2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8] applied r times. */
static const uint8_t b3_sched[7][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8},
    {3, 4, 10, 12, 13, 2, 7, 14, 6, 5, 9, 0, 11, 15, 8, 1},
    {10, 7, 12, 9, 14, 3, 13, 15, 4, 0, 11, 2, 5, 8, 1, 6},
    {12, 13, 9, 11, 15, 10, 14, 8, 7, 2, 5, 3, 0, 1, 6, 4},
    {9, 14, 11, 5, 8, 12, 15, 1, 13, 3, 0, 10, 2, 6, 4, 7},
    {11, 15, 5, 0, 1, 9, 8, 6, 14, 10, 2, 12, 3, 4, 7, 13},
};

/* Rotate right. */
static inline uint32_t rotr32(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

#define B3_G(a, b, c, d, x, y)                                                                     \
    do {                                                                                           \
        a = a + b + (x);                                                                           \
        d = rotr32(d ^ a, 16);                                                                     \
        c = c + d;                                                                                 \
        b = rotr32(b ^ c, 12);                                                                     \
        a = a + b + (y);                                                                           \
        d = rotr32(d ^ a, 8);                                                                      \
        c = c + d;                                                                                 \
        b = rotr32(b ^ c, 7);                                                                      \
    } while (0)

/* One compression of a 64-byte block into the chaining value cv (chunk counter 0). */
static void b3_compress(uint32_t cv[8], const uint8_t block[64], uint32_t len, uint32_t flags)
{
    uint32_t m[16], v[16];
    memcpy(m, block, 64); /* little-endian words: x86 and every target we build for */
    for (int i = 0; i < 8; i++)
        v[i] = cv[i];
    for (int i = 0; i < 4; i++)
        v[8 + i] = b3_iv[i];
    v[12] = 0, v[13] = 0, v[14] = len, v[15] = flags;
#pragma GCC unroll 7 /* constant message indexes */
    for (int r = 0; r < 7; r++) {
        const uint8_t *s = b3_sched[r];
        B3_G(v[0], v[4], v[8], v[12], m[s[0]], m[s[1]]);
        B3_G(v[1], v[5], v[9], v[13], m[s[2]], m[s[3]]);
        B3_G(v[2], v[6], v[10], v[14], m[s[4]], m[s[5]]);
        B3_G(v[3], v[7], v[11], v[15], m[s[6]], m[s[7]]);
        B3_G(v[0], v[5], v[10], v[15], m[s[8]], m[s[9]]);
        B3_G(v[1], v[6], v[11], v[12], m[s[10]], m[s[11]]);
        B3_G(v[2], v[7], v[8], v[13], m[s[12]], m[s[13]]);
        B3_G(v[3], v[4], v[9], v[14], m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++)
        cv[i] = v[i] ^ v[i + 8];
}

/* Blocks of a key of n (1..BL_MAX_KEY) bytes, and block j's length. */
static inline size_t b3_blocks(size_t n) { return (n + 63) / 64; }
static inline uint32_t b3_block_len(size_t n, size_t j)
{
    return (uint32_t)(n - 64 * j < 64 ? n - 64 * j : 64);
}
static inline uint32_t b3_flags(size_t j, size_t blocks)
{
    return (j == 0 ? B3_CHUNK_START : 0) | (j + 1 == blocks ? B3_CHUNK_END | B3_ROOT : 0);
}

/* The 16-byte digest of a key of n (1..BL_MAX_KEY) bytes: what headers and the index keep. */
void bl_key_digest(const void *key, size_t n, uint8_t out[16])
{
    const uint8_t *p = key;
    uint32_t cv[8];
    memcpy(cv, b3_iv, sizeof(cv));
    size_t blocks = b3_blocks(n);
    for (size_t j = 0; j < blocks; j++) {
        uint8_t block[64] = {0};
        uint32_t len = b3_block_len(n, j);
        memcpy(block, p + 64 * j, len);
        b3_compress(cv, block, len, b3_flags(j, blocks));
    }
    memcpy(out, cv, 16);
}

#if BL_X86
#include <immintrin.h>

/* rotations right by 16 and 8 as byte shuffles inside each 32-bit lane; 12 and 7 as shifts */
#define B3_ROR_S8(x, r) _mm256_shuffle_epi8(x, r)
#define B3_ROR_SH8(x, n) _mm256_or_si256(_mm256_srli_epi32(x, n), _mm256_slli_epi32(x, 32 - (n)))
#define B3_G8(a, b, c, d, x, y)                                                                    \
    do {                                                                                           \
        a = _mm256_add_epi32(_mm256_add_epi32(a, b), x);                                           \
        d = B3_ROR_S8(_mm256_xor_si256(d, a), r16);                                                \
        c = _mm256_add_epi32(c, d);                                                                \
        b = B3_ROR_SH8(_mm256_xor_si256(b, c), 12);                                                \
        a = _mm256_add_epi32(_mm256_add_epi32(a, b), y);                                           \
        d = B3_ROR_S8(_mm256_xor_si256(d, a), r8);                                                 \
        c = _mm256_add_epi32(c, d);                                                                \
        b = B3_ROR_SH8(_mm256_xor_si256(b, c), 7);                                                 \
    } while (0)

/* Turn rows (row i: eight words of lane i) into columns (column j: word j of every lane). */
__attribute__((target("avx2"))) static void b3_transpose8(__m256i r[8])
{
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x20);
        r[j + 4] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x31);
    }
}

/*
 * A block of n (0..64) bytes at p as two vectors of words, zero past n.  A
 * whole block is two loads; a short one is read with masked loads (masked
 * words are never touched, so nothing past the key is read), its last 1..3
 * bytes put in by hand.  Copying a short block into a zeroed buffer instead
 * cost a failed store-to-load forward for every vector loaded from it.
 */
__attribute__((target("avx2"))) static void b3_load_block(const uint8_t *p, uint32_t n,
                                                          __m256i *lo, __m256i *hi)
{
    if (n == 64) {
        *lo = _mm256_loadu_si256((const void *)p);
        *hi = _mm256_loadu_si256((const void *)(p + 32));
        return;
    }
    const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i whole = _mm256_set1_epi32((int)(n / 4)); /* words wholly inside */
    __m256i in_lo = _mm256_cmpgt_epi32(whole, index);
    __m256i in_hi = _mm256_cmpgt_epi32(whole, _mm256_add_epi32(index, _mm256_set1_epi32(8)));
    *lo = n >= 4 ? _mm256_maskload_epi32((const int *)p, in_lo) : _mm256_setzero_si256();
    *hi = n >= 36 ? _mm256_maskload_epi32((const int *)(p + 32), in_hi) : _mm256_setzero_si256();
    uint32_t rest = n % 4, last = 0, w = n / 4;
    if (!rest)
        return;
    for (uint32_t b = 0; b < rest; b++)
        last |= (uint32_t)p[4 * w + b] << (8 * b);
    __m256i at = _mm256_cmpeq_epi32(_mm256_set1_epi32((int)(w % 8)), index);
    __m256i put = _mm256_and_si256(at, _mm256_set1_epi32((int)last));
    if (w < 8)
        *lo = _mm256_or_si256(*lo, put);
    else
        *hi = _mm256_or_si256(*hi, put);
}

/*
 * The digests of `count` (1..8) keys at once, one per 32-bit lane.  Each
 * block round compresses every lane; a lane past its key's last block keeps
 * its chaining value (blend), so at the end every lane holds its key's root
 * output.
 */
__attribute__((target("avx2"))) static void b3_x8(const uint8_t *const *key, const size_t *len,
                                                  uint8_t *const *out, size_t count)
{
    const __m256i r16 = _mm256_setr_epi8(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13, 2,
                                         3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    const __m256i r8 = _mm256_setr_epi8(1, 2, 3, 0, 5, 6, 7, 4, 9, 10, 11, 8, 13, 14, 15, 12, 1, 2,
                                        3, 0, 5, 6, 7, 4, 9, 10, 11, 8, 13, 14, 15, 12);
    uint32_t nb[8] = {0};
    size_t most = 0;
    for (size_t i = 0; i < count; i++) {
        nb[i] = (uint32_t)b3_blocks(len[i]);
        most = nb[i] > most ? nb[i] : most;
    }
    const __m256i nblocks = _mm256_loadu_si256((const void *)nb);
    __m256i cv[8];
    for (int k = 0; k < 8; k++)
        cv[k] = _mm256_set1_epi32((int)b3_iv[k]);
    for (size_t j = 0; j < most; j++) {
        uint32_t blen[8] = {0}, flags[8] = {0};
        __m256i m[16];
        for (size_t i = 0; i < 8; i++) {
            if (i < count && j < nb[i]) {
                blen[i] = b3_block_len(len[i], j);
                flags[i] = b3_flags(j, nb[i]);
            }
            b3_load_block(i < count ? key[i] + 64 * j : NULL, blen[i], &m[i], &m[i + 8]);
        }
        b3_transpose8(m);     /* words 0..7 of every lane */
        b3_transpose8(m + 8); /* words 8..15 */
        __m256i v[16];
        for (int k = 0; k < 8; k++)
            v[k] = cv[k];
        for (int k = 0; k < 4; k++)
            v[8 + k] = _mm256_set1_epi32((int)b3_iv[k]);
        v[12] = _mm256_setzero_si256();
        v[13] = _mm256_setzero_si256();
        v[14] = _mm256_loadu_si256((const void *)blen);
        v[15] = _mm256_loadu_si256((const void *)flags);
#pragma GCC unroll 7
        for (int r = 0; r < 7; r++) {
            const uint8_t *s = b3_sched[r];
            B3_G8(v[0], v[4], v[8], v[12], m[s[0]], m[s[1]]);
            B3_G8(v[1], v[5], v[9], v[13], m[s[2]], m[s[3]]);
            B3_G8(v[2], v[6], v[10], v[14], m[s[4]], m[s[5]]);
            B3_G8(v[3], v[7], v[11], v[15], m[s[6]], m[s[7]]);
            B3_G8(v[0], v[5], v[10], v[15], m[s[8]], m[s[9]]);
            B3_G8(v[1], v[6], v[11], v[12], m[s[10]], m[s[11]]);
            B3_G8(v[2], v[7], v[8], v[13], m[s[12]], m[s[13]]);
            B3_G8(v[3], v[4], v[9], v[14], m[s[14]], m[s[15]]);
        }
        /* lanes still in their key take the new chaining value */
        __m256i live = _mm256_cmpgt_epi32(nblocks, _mm256_set1_epi32((int)j));
        for (int k = 0; k < 8; k++)
            cv[k] = _mm256_blendv_epi8(cv[k], _mm256_xor_si256(v[k], v[k + 8]), live);
    }
    uint32_t h[4][8];
    for (int k = 0; k < 4; k++)
        _mm256_storeu_si256((void *)h[k], cv[k]);
    for (size_t i = 0; i < count; i++)
        for (int k = 0; k < 4; k++)
            memcpy(out[i] + 4 * k, &h[k][i], 4);
}
#endif

/* Digests of n keys (each 1..BL_MAX_KEY bytes): eight at a time where the CPU has AVX2. */
void bl_key_digest_many(const uint8_t *const *key, const size_t *len, uint8_t *const *out,
                        size_t n)
{
    size_t i = 0;
#if BL_X86
    static int x8 = -1;
    if (x8 < 0)
        x8 = bl_cpu_has("avx2") && !getenv("BELUGA_NO_BLAKE3_X8");
    for (; x8 && i + 2 <= n; i += 8) /* two keys or more: the lanes beat one at a time */
        b3_x8(key + i, len + i, out + i, n - i < 8 ? n - i : 8);
    if (i > n)
        i = n;
#endif
    for (; i < n; i++)
        bl_key_digest(key[i], len[i], out[i]);
}
