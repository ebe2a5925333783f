// kernels.cu - the GPU data path's device code: a row copy for small pieces and the
// CRC32C of whole blocks where their bytes are in GPU memory.
//
// One source, two compilers.  NVRTC builds the kernels for the GPU at run time
// (beluga/transfer/gpu/kernels.py); g++ builds the same file as host C++ (the
// kernels drop out, the arithmetic stays) for the CPU tests and the stand-in
// runtime, so the CRC that runs on the GPU is the CRC that the CPU tests check
// against the C core at every length and alignment.  The polynomial comes from
// the C core at compile time (-DBL_CRC32C_POLY=beluga._native._core.CRC32C_POLY)
// and every shift constant from its crc32c_x8n; nothing here defines them.
//
// CRC OF A BLOCK, in pieces, in any order.  In the reflected domain a raw CRC
// register is linear: raw(c, A||B) = raw(c, A) * x^(8|B|) + raw(0, B) (mod P),
// and leading zero bytes leave raw(0, .) unchanged.  So a block's payload M,
// cut into pieces at offsets o_i with lengths n_i, has
//
//   crc32c(M) = ~( ~0 * x^(8|M|)  +  SUM_i raw(0, piece_i) * x^(8 (|M| - o_i - n_i)) )
//
// a sum (XOR) whose terms need no order: each warp takes one segment of a
// piece (at most 32 chunks of CH bytes, chunks aligned to the segment's end),
// each lane the raw CRC of one chunk (slice-by-8 tables in shared memory, built
// from the polynomial), shifted by its own distance to the segment's end; the
// warp XORs its lanes, shifts once more by the bytes after the segment in its
// block, and XORs that into the block's accumulator.  The warp that completes a
// block's byte count finishes it: the init term ~0 * x^(8|M|) comes from the
// host (the C core's crc32c_mul and crc32c_x8n), so a finished CRC is one XOR
// and one NOT.  A load compares it with the CRC the header carries and counts
// the blocks that differ in one status word; a save writes it out for the seal.
// x^(8k) for any k is a product of the 64 constants x^(8 * 2^j) (one GF(2)
// multiply per set bit of k).
#ifdef __CUDACC__
#define BL_HD __host__ __device__
#else
#define BL_HD
#endif

#ifndef BL_CRC32C_POLY
#error "compile with -DBL_CRC32C_POLY=<beluga._native._core.CRC32C_POLY>"
#endif

typedef unsigned char bl_u8;
typedef unsigned int bl_u32;
typedef unsigned long long bl_u64;

// One copy: source and destination addresses (device view), bytes.
struct bl_row {
    bl_u64 src, dst, len;
};

// One CRC segment: where its bytes are (device view), how many (at most 32 chunks), the
// bytes of its block after it, and its block.
struct bl_seg {
    bl_u64 addr, len, after, block;
};

// One block: the init term ~0 * x^(8 len) (host-computed), its length, the CRC expected.
struct bl_block {
    bl_u64 init, total, expect;
};

// A block's running sum and bytes done; zeroed before a launch.
struct bl_state {
    bl_u32 acc, pad;
    bl_u64 done;
};

#define BL_TABLE_WORDS (8 * 256)
#define BL_LANES 32

// Entry b of slice-by-8 table 0: the raw CRC of byte b alone.
BL_HD static inline bl_u32 bl_crc_byte(bl_u32 b)
{
    for (int k = 0; k < 8; k++)
        b = (b >> 1) ^ (BL_CRC32C_POLY & (0u - (b & 1u)));
    return b;
}

// Table k entry b from table k-1's (b followed by one more zero byte).
BL_HD static inline bl_u32 bl_crc_next(const bl_u32 *t, bl_u32 prev)
{
    return (prev >> 8) ^ t[prev & 0xff];
}

// Raw CRC32C register update over n bytes at p (slice-by-8 once p is 8-byte aligned).
BL_HD static inline bl_u32 bl_crc_raw(const bl_u32 *t, bl_u32 c, const bl_u8 *p, bl_u64 n)
{
    while (n && ((bl_u64)p & 7)) {
        c = t[(c ^ *p++) & 0xff] ^ (c >> 8);
        n--;
    }
    for (; n >= 8; n -= 8, p += 8) {
        bl_u64 w = *(const bl_u64 *)p;
        bl_u32 lo = (bl_u32)w ^ c, hi = (bl_u32)(w >> 32);
        c = t[7 * 256 + (lo & 0xff)] ^ t[6 * 256 + ((lo >> 8) & 0xff)] ^
            t[5 * 256 + ((lo >> 16) & 0xff)] ^ t[4 * 256 + (lo >> 24)] ^
            t[3 * 256 + (hi & 0xff)] ^ t[2 * 256 + ((hi >> 8) & 0xff)] ^
            t[1 * 256 + ((hi >> 16) & 0xff)] ^ t[hi >> 24];
    }
    while (n--)
        c = t[(c ^ *p++) & 0xff] ^ (c >> 8);
    return c;
}

// a * b in GF(2)[x] mod P, reflected (bit 31 is x^0), without branches.
BL_HD static inline bl_u32 bl_gf_mul(bl_u32 a, bl_u32 b)
{
    bl_u32 p = 0;
    for (bl_u32 bit = 1u << 31; bit; bit >>= 1) {
        p ^= b & (0u - (bl_u32)((a & bit) != 0));
        b = (b >> 1) ^ (BL_CRC32C_POLY & (0u - (b & 1u)));
    }
    return p;
}

// c * x^(8k): a raw register moved past k zero bytes (pow8[j] = x^(8 * 2^j) mod P).
BL_HD static inline bl_u32 bl_shift(const bl_u32 *pow8, bl_u32 c, bl_u64 k)
{
    for (int j = 0; k; j++, k >>= 1)
        if (k & 1)
            c = bl_gf_mul(c, pow8[j]);
    return c;
}

// Lane `lane`'s term of a segment: the raw CRC of its chunk (chunks of ch bytes, aligned to
// the segment's end, lane 31 last), moved to the segment's end; 0 past the segment's start.
BL_HD static inline bl_u32 bl_lane_term(const bl_u32 *t, const bl_u32 *pow8, const bl_seg *s,
                                        bl_u32 lane, bl_u64 ch)
{
    bl_u64 back = (bl_u64)(BL_LANES - 1 - lane) * ch;
    if (back >= s->len)
        return 0;
    bl_u64 end = s->len - back, start = end > ch ? end - ch : 0;
    bl_u32 r = bl_crc_raw(t, 0, (const bl_u8 *)(s->addr + start), end - start);
    return bl_shift(pow8, r, back);
}

// A segment's term in its block's sum: its lanes' XOR moved past the bytes after it.
BL_HD static inline bl_u32 bl_seg_term(const bl_u32 *pow8, const bl_seg *s, bl_u32 lanes_xor)
{
    return bl_shift(pow8, lanes_xor, s->after);
}

// A block's finished CRC32C from its accumulated sum.
BL_HD static inline bl_u32 bl_block_crc(const bl_block *b, bl_u32 acc)
{
    return ~((bl_u32)b->init ^ acc);
}

#ifdef __CUDACC__

// Copy rows (source, destination, bytes), one warp per row at a time (grid-stride over
// rows): 16-byte accesses with four loads in flight per lane before their stores (2 KiB per
// warp, 64 KiB per SM at 32 warps) when the row is 16-byte aligned, bytes otherwise.  For
// pieces below the copy engines' crossover, where a DMA descriptor per piece costs more
// than the piece; reads of host memory over PCIe are latency-bound, so what sets its speed
// is the bytes in flight, which the launch sizes by the warps it starts.
extern "C" __global__ void beluga_copy_rows(const bl_row *rows, bl_u64 nrows)
{
    const bl_u64 lane = threadIdx.x % BL_LANES, step = BL_LANES;
    const bl_u64 warps = (bl_u64)gridDim.x * blockDim.x / BL_LANES;
    for (bl_u64 r = ((bl_u64)blockIdx.x * blockDim.x + threadIdx.x) / BL_LANES; r < nrows;
         r += warps) {
        const bl_u64 src = rows[r].src, dst = rows[r].dst, n = rows[r].len;
        if (((src | dst | n) & 15) == 0) {
            const uint4 *s = (const uint4 *)src;
            uint4 *d = (uint4 *)dst;
            const bl_u64 n16 = n / 16;
            bl_u64 i = lane;
            for (; i + 3 * step < n16; i += 4 * step) {
                uint4 a = s[i], b = s[i + step], c = s[i + 2 * step], e = s[i + 3 * step];
                d[i] = a;
                d[i + step] = b;
                d[i + 2 * step] = c;
                d[i + 3 * step] = e;
            }
            for (; i < n16; i += step)
                d[i] = s[i];
        } else {
            const bl_u8 *s = (const bl_u8 *)src;
            bl_u8 *d = (bl_u8 *)dst;
            for (bl_u64 i = lane; i < n; i += step)
                d[i] = s[i];
        }
    }
}

// The CRC32C of whole blocks from their segments (see the top of the file).  mode 0 (a
// load): status[b] = 1 where block b's CRC differs from blocks[b].expect, and *bad counts
// them; mode 1 (a save): status[b] = the CRC.  Blocks of length 0 are the host's.
extern "C" __global__ void beluga_crc_blocks(const bl_seg *segs, bl_u64 nsegs,
                                             const bl_block *blocks, bl_state *state,
                                             bl_u32 *status, bl_u32 *bad, const bl_u32 *pow8,
                                             bl_u64 ch, int mode)
{
    __shared__ bl_u32 t[BL_TABLE_WORDS];
    for (bl_u32 b = threadIdx.x; b < 256; b += blockDim.x)
        t[b] = bl_crc_byte(b);
    __syncthreads();
    for (int k = 1; k < 8; k++) {
        for (bl_u32 b = threadIdx.x; b < 256; b += blockDim.x)
            t[k * 256 + b] = bl_crc_next(t, t[(k - 1) * 256 + b]);
        __syncthreads();
    }
    const bl_u32 lane = threadIdx.x % BL_LANES;
    const bl_u64 warps = (bl_u64)gridDim.x * blockDim.x / BL_LANES;
    for (bl_u64 w = ((bl_u64)blockIdx.x * blockDim.x + threadIdx.x) / BL_LANES; w < nsegs;
         w += warps) {
        const bl_seg *s = &segs[w];
        bl_u32 term = bl_lane_term(t, pow8, s, lane, ch);
        for (int o = BL_LANES / 2; o; o >>= 1)
            term ^= __shfl_xor_sync(0xffffffffu, term, o);
        if (lane == 0) {
            bl_state *st = &state[s->block];
            const bl_block *b = &blocks[s->block];
            atomicXor(&st->acc, bl_seg_term(pow8, s, term));
            __threadfence();
            if (atomicAdd(&st->done, s->len) + s->len == b->total) {
                __threadfence();
                const bl_u32 crc = bl_block_crc(b, atomicXor(&st->acc, 0u));
                if (mode == 0) {
                    const bl_u32 differs = crc != (bl_u32)b->expect;
                    status[s->block] = differs;
                    if (differs)
                        atomicAdd(bad, 1u);
                } else {
                    status[s->block] = crc;
                }
            }
        }
    }
}

#else

// The host build: what beluga_crc_blocks computes, through the same functions, for the
// CPU tests and the stand-in runtime (lanes and warps become loops; the sum is the same
// XOR in another order).  Returns the number of blocks whose CRC differs (mode 0).
extern "C" bl_u32 beluga_crc_blocks_host(const bl_seg *segs, bl_u64 nsegs,
                                         const bl_block *blocks, bl_state *state,
                                         bl_u32 *status, const bl_u32 *pow8, bl_u64 ch,
                                         int mode)
{
    static bl_u32 t[BL_TABLE_WORDS];
    for (bl_u32 b = 0; b < 256; b++)
        t[b] = bl_crc_byte(b);
    for (int k = 1; k < 8; k++)
        for (bl_u32 b = 0; b < 256; b++)
            t[k * 256 + b] = bl_crc_next(t, t[(k - 1) * 256 + b]);
    bl_u32 bad = 0;
    for (bl_u64 w = 0; w < nsegs; w++) {
        const bl_seg *s = &segs[w];
        bl_u32 term = 0;
        for (bl_u32 lane = 0; lane < BL_LANES; lane++)
            term ^= bl_lane_term(t, pow8, s, lane, ch);
        bl_state *st = &state[s->block];
        const bl_block *b = &blocks[s->block];
        st->acc ^= bl_seg_term(pow8, s, term);
        st->done += s->len;
        if (st->done == b->total) {
            const bl_u32 crc = bl_block_crc(b, st->acc);
            if (mode == 0) {
                status[s->block] = crc != (bl_u32)b->expect;
                bad += status[s->block];
            } else {
                status[s->block] = crc;
            }
        }
    }
    return bad;
}

// The raw CRC32C register update of the device code, alone (the tests' way in).
extern "C" bl_u32 beluga_crc_raw_host(bl_u32 c, const bl_u8 *p, bl_u64 n)
{
    static bl_u32 t[BL_TABLE_WORDS];
    for (bl_u32 b = 0; b < 256; b++)
        t[b] = bl_crc_byte(b);
    for (int k = 1; k < 8; k++)
        for (bl_u32 b = 0; b < 256; b++)
            t[k * 256 + b] = bl_crc_next(t, t[(k - 1) * 256 + b]);
    return bl_crc_raw(t, c, p, n);
}

#endif
