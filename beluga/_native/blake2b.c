/*
 * blake2b.c - BLAKE2b-128 (RFC 7693, unkeyed, 16-byte output): the key digest.
 *
 * A key's 16-byte digest is its identity everywhere in the pool: block
 * headers hold it, the index hashes it into a tag and two buckets, the
 * metadata server keys its tables by it.  It is hashlib.blake2b(key,
 * digest_size=16), computed here once for every caller (the write path
 * through beluga.coherence.digest, the read path inside Index), so the two
 * can never disagree; tests compare it with hashlib as an independent check.
 *
 * Keys are short (1..256 bytes), so the counter's high word stays 0.  A
 * batch of keys that each fit one 128-byte block (the keys of a prefix chain)
 * is hashed eight at a time, one key per 64-bit lane of AVX-512 registers,
 * where the CPU has them, else four at a time in AVX2 registers (setting
 * BELUGA_NO_BLAKE2B_X8 / BELUGA_NO_BLAKE2B_X4 turns each off).
 */
#include <stdlib.h>
#include <string.h>

#include "beluga_native.h"


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

#if BL_X86
#include <immintrin.h>

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

/* ror by 24 and 16 as byte shuffles inside each 64-bit lane; ror 63 as add-and-shift */
#define B2_ROR32_4(x) _mm256_shuffle_epi32(x, _MM_SHUFFLE(2, 3, 0, 1))
#define B2_ROR63_4(x) _mm256_or_si256(_mm256_add_epi64(x, x), _mm256_srli_epi64(x, 63))
#define B2_G4(a, b, c, d, x, y)                                                                    \
    do {                                                                                           \
        a = _mm256_add_epi64(_mm256_add_epi64(a, b), x);                                           \
        d = B2_ROR32_4(_mm256_xor_si256(d, a));                                                    \
        c = _mm256_add_epi64(c, d);                                                                \
        b = _mm256_shuffle_epi8(_mm256_xor_si256(b, c), r24);                                      \
        a = _mm256_add_epi64(_mm256_add_epi64(a, b), y);                                           \
        d = _mm256_shuffle_epi8(_mm256_xor_si256(d, a), r16);                                      \
        c = _mm256_add_epi64(c, d);                                                                \
        b = B2_ROR63_4(_mm256_xor_si256(b, c));                                                    \
    } while (0)

/*
 * Four BLAKE2b-128 digests at once, one per 64-bit lane of AVX2 registers
 * (b2_x8's scheme for CPUs without AVX-512: a 256-key prefix chain's digests
 * were 64 of lookup_prefix's 85 us one key at a time on Zen 3).
 */
__attribute__((target("avx2"))) static void b2_x4(const uint8_t *const key[4],
                                                  const size_t len[4], uint8_t *const out[4])
{
    uint64_t w[16][4], t[4], h0[8];
    for (int i = 0; i < 4; i++) {
        uint8_t block[128] = {0};
        memcpy(block, key[i], len[i]);
        for (int j = 0; j < 16; j++)
            w[j][i] = le64(block + 8 * j);
        t[i] = len[i];
    }
    memcpy(h0, b2_iv, sizeof(h0));
    h0[0] ^= 0x01010000ull ^ 16u;
    const __m256i r24 = _mm256_setr_epi8(3, 4, 5, 6, 7, 0, 1, 2, 11, 12, 13, 14, 15, 8, 9, 10, 3,
                                         4, 5, 6, 7, 0, 1, 2, 11, 12, 13, 14, 15, 8, 9, 10);
    const __m256i r16 = _mm256_setr_epi8(2, 3, 4, 5, 6, 7, 0, 1, 10, 11, 12, 13, 14, 15, 8, 9, 2,
                                         3, 4, 5, 6, 7, 0, 1, 10, 11, 12, 13, 14, 15, 8, 9);
    __m256i m[16], v[16];
    for (int j = 0; j < 16; j++)
        m[j] = _mm256_loadu_si256((const void *)w[j]);
    for (int k = 0; k < 8; k++) {
        v[k] = _mm256_set1_epi64x((long long)h0[k]);
        v[k + 8] = _mm256_set1_epi64x((long long)b2_iv[k]);
    }
    v[12] = _mm256_xor_si256(v[12], _mm256_loadu_si256((const void *)t));
    v[14] = _mm256_xor_si256(v[14], _mm256_set1_epi64x(-1)); /* the last (and only) block */
#pragma GCC unroll 12
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = b2_sigma[r % 10];
        B2_G4(v[0], v[4], v[8], v[12], m[s[0]], m[s[1]]);
        B2_G4(v[1], v[5], v[9], v[13], m[s[2]], m[s[3]]);
        B2_G4(v[2], v[6], v[10], v[14], m[s[4]], m[s[5]]);
        B2_G4(v[3], v[7], v[11], v[15], m[s[6]], m[s[7]]);
        B2_G4(v[0], v[5], v[10], v[15], m[s[8]], m[s[9]]);
        B2_G4(v[1], v[6], v[11], v[12], m[s[10]], m[s[11]]);
        B2_G4(v[2], v[7], v[8], v[13], m[s[12]], m[s[13]]);
        B2_G4(v[3], v[4], v[9], v[14], m[s[14]], m[s[15]]);
    }
    uint64_t h[2][4];
    for (int k = 0; k < 2; k++)
        _mm256_storeu_si256((void *)h[k], _mm256_xor_si256(_mm256_set1_epi64x((long long)h0[k]),
                                                           _mm256_xor_si256(v[k], v[k + 8])));
    for (int i = 0; i < 4; i++) {
        memcpy(out[i], &h[0][i], 8);
        memcpy(out[i] + 8, &h[1][i], 8);
    }
}
#endif

/* Digests of n keys of at most 128 bytes each: eight or four at a time where the CPU allows. */
void bl_blake2b_128_many(const uint8_t *const *key, const size_t *len, uint8_t *const *out,
                         size_t n)
{
    size_t i = 0;
#if BL_X86
    static int x8 = -1, x4 = -1;
    if (x8 < 0) {
        x4 = bl_cpu_has("avx2") && !getenv("BELUGA_NO_BLAKE2B_X4");
        x8 = bl_cpu_has("avx512f") && !getenv("BELUGA_NO_BLAKE2B_X8");
    }
    for (; x8 && i + 8 <= n; i += 8)
        b2_x8(key + i, len + i, out + i);
    for (; x4 && i + 4 <= n; i += 4)
        b2_x4(key + i, len + i, out + i);
#endif
    for (; i < n; i++)
        bl_blake2b_128(key[i], len[i], out[i]);
}
