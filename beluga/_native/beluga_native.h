/*
 * beluga_native.h - the interface of Beluga's C core: plain C, no Python.
 *
 * A bl_mem is one attachment ("host view") of a shared mapping.  Every access
 * to shared memory goes through its bl_memops table, which is chosen once, when
 * the attachment is made: the native table issues real instructions, the model
 * table runs the same requests through a simulated non-coherent cache
 * (model.c).  Protocol code (publish / read_validated, the scatter-gather
 * executor, the RPC polling loop) only ever calls through the table, so it is
 * the same code in both modes.
 *
 * The core files (cpu, crc32c, blake3, memops, model, sabotage, block,
 * blockio, sg, index, mirror, keytable, rpc) include only this header and the C
 * library; the Python bindings (*_py.c, beluga_py.h) sit on top.  Between two files calls
 * go one way only (tests/test_native.py checks it):
 *
 *   crc32c, blake3, memops         ->  cpu
 *   block, blockio, index, rpc     ->  crc32c
 *   blockio, index  ->  block;     index  ->  blockio, blake3
 *   mirror  ->  index, block
 *   every BL_STEP of a sabotage build  ->  sabotage
 */
#ifndef BELUGA_NATIVE_H
#define BELUGA_NATIVE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define BL_LINE 64u

/* x86-64 instructions are used where the CPU has them.  -DBL_PORTABLE builds the portable
 * core on x86-64 too, as on any other architecture (tests/test_native.py checks it). */
#if defined(__x86_64__) && !defined(BL_PORTABLE)
#define BL_X86 1
#else
#define BL_X86 0
#endif

/*
 * Sabotage points (sabotage.c): every fence, flush, invalidate and ordering
 * step a protocol needs on non-coherent hardware, named once here.  Each is
 * X(NAME, where, step, why): the step the point removes and why hardware
 * needs it.  The C core guards a step with BL_STEP(NAME); the Python layers
 * guard theirs through beluga._native.step("NAME", op).  In the production
 * build BL_STEP is the constant 1 (no branch, no table lookup); only a
 * separate build with -DBL_SABOTAGE (beluga._native._core_sabotage, made by
 * the mutation harness, never installed) can skip one.
 */
#define BL_SABOTAGE_POINTS(X)                                                                     \
    X(BLOCK_WRITING_FENCE, "block.c bl_begin_write",                                              \
      "SFENCE after the WRITING header, before any payload store",                                \
      "payload stores can land before WRITING: a reader that checked the old PUBLISHED header "   \
      "copies new bytes and finds the header unchanged")                                          \
    X(BLOCK_PAYLOAD_FENCE, "block.c bl_publish",                                                  \
      "SFENCE between the payload's non-temporal stores and the PUBLISHED header",                \
      "write-combining buffers drain in any order: PUBLISHED can land over a payload still in "   \
      "flight, and a reader takes the old bytes for the new version")                             \
    X(BLOCK_PUBLISHED_FENCE, "block.c bl_seal",                                                   \
      "SFENCE after the PUBLISHED header",                                                        \
      "the header stays in a write-combining buffer after publish returns: a host told by other " \
      "means (a reply, a system call) finds no block")                                            \
    X(BLOCK_HEADER_INVALIDATE, "block.c bl_get_header",                                           \
      "invalidate the header line before each look (check and re-check)",                         \
      "a cached header stays stale: the reader checks a version that is gone")                    \
    X(BLOCK_HEADER_MFENCE, "block.c bl_get_header",                                               \
      "MFENCE between invalidating the header and loading it",                                    \
      "the load can pass the invalidation and hit the old line")                                  \
    X(BLOCK_PAYLOAD_INVALIDATE, "block.c bl_read_validated",                                      \
      "invalidate the payload before copying it",                                                 \
      "cached lines of an older version are copied")                                              \
    X(BLOCK_PAYLOAD_MFENCE, "block.c bl_read_validated",                                          \
      "MFENCE between invalidating the payload and copying it",                                   \
      "the copy's loads can pass the invalidation and hit old lines")                             \
    X(BLOCK_CHECKSUM_INVALIDATE, "block.c bl_payload_crc (seal)",                                 \
      "invalidate a payload before checksumming it from the pool",                                \
      "a payload another agent wrote (the GPU's kernel) is checksummed from this host's stale "   \
      "lines: the sealed CRC matches nothing and the block never reads back")                     \
    X(BLOCK_CHECKSUM_MFENCE, "block.c bl_payload_crc (seal)",                                     \
      "MFENCE before checksumming the payload from the pool",                                     \
      "loads can pass the invalidation; and it drains this host's own payload stores before "     \
      "PUBLISHED is queued behind them")                                                          \
    X(BLOCKIO_WRITE_FENCE, "blockio.c bl_write_blocks",                                           \
      "SFENCE between the rows' non-temporal stores and the PUBLISHED headers",                   \
      "a header can land over rows still in flight: a reader takes old bytes for the new "        \
      "version")                                                                                  \
    X(BLOCKIO_HEADER_INVALIDATE, "blockio.c load_headers",                                        \
      "invalidate every header before each look", "a cached header stays stale")                  \
    X(BLOCKIO_HEADER_MFENCE, "blockio.c load_headers",                                            \
      "MFENCE between invalidating the headers and loading them",                                 \
      "the loads can pass the invalidations")                                                     \
    X(BLOCKIO_PAYLOAD_INVALIDATE, "blockio.c bl_read_blocks",                                     \
      "invalidate every row's pool range before copying", "cached lines of an older version "     \
      "are copied")                                                                               \
    X(BLOCKIO_PAYLOAD_MFENCE, "blockio.c bl_read_blocks",                                         \
      "MFENCE between invalidating the rows and copying them",                                    \
      "the copy's loads can pass the invalidations")                                              \
    X(GATHER_FENCE, "sg.c bl_sg_run (gather_write)", "SFENCE after the rows",                     \
      "the rows stay in write-combining buffers after gather_write returns: the host that is "    \
      "told next reads old bytes")                                                                \
    X(SCATTER_INVALIDATE, "sg.c bl_sg_run (scatter_read)",                                        \
      "invalidate every row's pool range before copying", "cached lines are copied")              \
    X(SCATTER_MFENCE, "sg.c bl_sg_run (scatter_read)",                                            \
      "MFENCE between invalidating the rows and copying them",                                    \
      "the copy's loads can pass the invalidations")                                              \
    X(DEVICE_READ_INVALIDATE, "record.c bl_invalidate_stale",                                     \
      "invalidate the granules of a device read that this host may hold stale lines of",          \
      "a GPU's read of the pool is snooped by this host's caches: it copies a stale line that "   \
      "a CPU path cached before another host rewrote the block")                                  \
    X(DEVICE_READ_MFENCE, "record.c bl_invalidate_stale",                                         \
      "MFENCE between those invalidations and the device's read",                                 \
      "an invalidation completes only at the fence: the device's read snoops the old line")       \
    X(RPC_REQUEST_PAYLOAD_FENCE, "rpc.c emit (client)",                                           \
      "SFENCE between an out-of-line request payload and the request lines",                      \
      "the request line can land before its payload: the server reads a torn payload")            \
    X(RPC_RESPONSE_PAYLOAD_FENCE, "rpc.c emit (server)",                                          \
      "SFENCE between an out-of-line response payload and the response lines",                    \
      "the response line can land before its payload: the client reads a torn payload")           \
    X(RPC_REQUEST_INVALIDATE, "rpc.c scan_window (server)",                                       \
      "invalidate the window of request lines before each scan",                                  \
      "the server polls its cached copy of a request line and never sees the request")            \
    X(RPC_REQUEST_MFENCE, "rpc.c scan_window (server)",                                           \
      "MFENCE between invalidating the request lines and loading them",                           \
      "the loads can pass the invalidations and hit old lines")                                   \
    X(RPC_REQUEST_BUFFER_INVALIDATE, "rpc.c payload_in (server)",                                 \
      "invalidate a slot's request buffer before loading it",                                     \
      "a reused slot's buffer is cached from the request before: the server reads a stale "       \
      "payload")                                                                                  \
    X(RPC_REQUEST_BUFFER_MFENCE, "rpc.c payload_in (server)",                                     \
      "MFENCE between invalidating a request buffer and loading it",                              \
      "the loads can pass the invalidation and hit the old payload")                              \
    X(RPC_RESPONSE_INVALIDATE, "rpc.c fetch_responses (client)",                                  \
      "invalidate the response lines before each look",                                           \
      "the client polls its cached copy of a response line and never sees the answer")            \
    X(RPC_RESPONSE_MFENCE, "rpc.c fetch_responses (client)",                                      \
      "MFENCE between invalidating the response lines and loading them",                          \
      "the loads can pass the invalidations and hit old lines")                                   \
    X(RPC_RESPONSE_BUFFER_INVALIDATE, "rpc.c payload_in (client)",                                \
      "invalidate a slot's response buffer before loading it",                                    \
      "a reused slot's buffer is cached from the response before: the client reads a stale "      \
      "payload")                                                                                  \
    X(RPC_RESPONSE_BUFFER_MFENCE, "rpc.c payload_in (client)",                                    \
      "MFENCE between invalidating a response buffer and loading it",                             \
      "the loads can pass the invalidation and hit the old payload")                              \
    X(MEMOPS_NT_EDGE_FLUSH, "memops.c nt_copy_avx512 / nt_copy_sse2",                             \
      "flush the unaligned head and tail that a non-temporal copy writes with plain stores",      \
      "those bytes stay in this CPU's cache: other hosts never see them")                         \
    X(MEMOPS_INVALIDATE_FLUSHES, "memops.c native table",                                         \
      "invalidate with CLFLUSHOPT or CLFLUSH, never CLWB",                                        \
      "CLWB keeps the (possibly stale) line cached: the next load hits it")                       \
    X(HOSTS_SERVER_READ_INVALIDATE, "pool/hosts.py (host lines, lobby, seat)",                    \
      "invalidate a host-table line another host writes before the server reads it",             \
      "the server judges a remote holder by its cached heartbeat, which never moves: a live "     \
      "host is taken for dead and its id given away")                                             \
    X(HOSTS_SERVER_READ_MFENCE, "pool/hosts.py (host lines, lobby, seat)",                        \
      "MFENCE between invalidating those lines and loading them",                                 \
      "the loads can pass the invalidations and hit old lines")                                   \
    X(HOSTS_HOLDER_READ_INVALIDATE, "pool/hosts.py (answers, grants)",                            \
      "invalidate the answer and grant lines the server writes before a claimant reads them",     \
      "a holder taken for dead reads its cached grant and keeps writing a line that is now "      \
      "another holder's")                                                                         \
    X(HOSTS_HOLDER_READ_MFENCE, "pool/hosts.py (answers, grants)",                                \
      "MFENCE between invalidating those lines and loading them",                                 \
      "the loads can pass the invalidations and hit old lines")                                   \
    X(HOSTS_GRANT_FENCE, "pool/hosts.py HostRegistry._answer",                                    \
      "SFENCE between the grant line and the answer line",                                        \
      "the answer can land first: a claimant confirms an id whose grant is not there")            \
    X(FORMAT_CLEAR_FENCE, "pool/pool.py format_pool",                                             \
      "SFENCE between clearing the old superblock and regions and writing the new superblock",    \
      "the new superblock can land over the old pool's host table, rings and block headers: "     \
      "ghost hosts and blocks in a new pool")                                                     \
    X(FORMAT_FENCE, "pool/pool.py format_pool", "SFENCE after the new superblock",                \
      "create returns while the superblock is in flight: another host finds no pool")             \
    X(SERVICE_RECOVER_INVALIDATE, "server/recovery.py recover",                                   \
      "invalidate the header table, commit table and service line before the recovery scan",     \
      "a server restarted on a host that cached them rebuilds its index from stale lines: "       \
      "acknowledged values are lost")                                                             \
    X(SERVICE_RECOVER_MFENCE, "server/recovery.py recover",                                       \
      "MFENCE between invalidating those tables and loading them",                                \
      "the loads can pass the invalidations and hit old lines")                                   \
    X(SERVICE_COMMIT_FENCE, "server/service.py op_commit",                                        \
      "SFENCE after the pool index's slots and the clears, before the answer",                    \
      "the answer can land before a slot: a reader told of the commit misses the value")          \
    X(SERVICE_COMMIT_WORD_FENCE, "server/service.py op_commit",                                   \
      "SFENCE after the commit words, before the pool index names their copies",                 \
      "a slot can land before its commit word: a server's host that dies between them leaves "    \
      "readers a copy a successor frees as a write in flight, the value it replaced unnamed")     \
    X(INDEX_BUCKET_INVALIDATE, "index.c load_buckets",                                            \
      "invalidate a key's bucket lines before each probe",                                        \
      "a cached bucket stays stale: a reader never sees a committed key, or follows an entry "    \
      "the server has moved or dropped")                                                          \
    X(INDEX_BUCKET_MFENCE, "index.c load_buckets",                                                \
      "MFENCE between invalidating the bucket lines and loading them",                            \
      "the loads can pass the invalidations and hit old lines")                                   \
    X(INDEX_MOVE_FENCE, "mirror.c bl_ixm_put",                                                    \
      "SFENCE between a moved entry's new bucket and its old one",                                \
      "the old bucket can land first: a reader finds the key in neither bucket and misses a "     \
      "committed value")                                                                          \
    X(SERVICE_CLEAR_FENCE, "server/extents.py _clear_header",                                     \
      "SFENCE after clearing a retired or freed block's header (and its commit word)",            \
      "a REMOVE is answered while the clears are in flight: a crash brings the removed key back")

#define BL_POINT_ENUM(name, where, step, why) BL_P_##name,
enum { BL_SABOTAGE_POINTS(BL_POINT_ENUM) BL_NPOINTS };
#undef BL_POINT_ENUM

typedef struct {
    const char *name, *where, *step, *why;
} bl_point;
extern const bl_point bl_points[BL_NPOINTS];

#ifdef BL_SABOTAGE
#define BL_SABOTAGE_BUILD 1
int bl_step_runs(int point); /* 0 when `point` is armed (and records that it fired) */
#define BL_STEP(name) bl_step_runs(BL_P_##name)
#define BL_STEP_ID(id) bl_step_runs(id)
#else
#define BL_SABOTAGE_BUILD 0
#define BL_STEP(name) 1
#define BL_STEP_ID(id) 1
#endif
int bl_sabotage_arm(const char *name); /* sabotage build only: 0, or -1 for an unknown name */
int bl_sabotage_armed(void);           /* the armed point, or -1 */
void bl_sabotage_fired(int point);     /* record that a point skipped its step */

typedef struct bl_mem bl_mem;
typedef struct bl_model bl_model;

/* The coherence operations; offsets are relative to the mapping's base. */
typedef struct bl_memops {
    const char *name;
    void (*load)(bl_mem *m, size_t off, void *dst, size_t n);
    /* load, and return the raw CRC32C `crc` extended over the bytes loaded */
    uint32_t (*load_crc)(bl_mem *m, size_t off, void *dst, size_t n, uint32_t crc);
    void (*store)(bl_mem *m, size_t off, const void *src, size_t n);
    void (*nt_store)(bl_mem *m, size_t off, const void *src, size_t n);
    void (*flush)(bl_mem *m, size_t off, size_t n);      /* write back and drop */
    void (*writeback)(bl_mem *m, size_t off, size_t n);  /* write back, keep */
    void (*invalidate)(bl_mem *m, size_t off, size_t n); /* drop before a read */
    /* a hint that [off, off+n) will be loaded soon: nothing a protocol relies on (the model
     * ignores it); issued after the invalidate's MFENCE it starts the reload early */
    void (*prefetch)(bl_mem *m, size_t off, size_t n);
    void (*sfence)(bl_mem *m);
    void (*mfence)(bl_mem *m);
    /* what a device's DMA (a GPU's copy engine or kernel) reads and writes through this
     * host: native, the memory itself (the root complex snoops the CPU caches, which
     * hardware does); model, a read is served by this host's cached line if it holds one,
     * however stale, else by memory, and a write drops this host's cached copies (a dirty
     * one written back first).  Neither fills a line.  Only CPU stand-ins of a GPU call
     * them (tests); a real GPU's accesses never pass through the table. */
    void (*dma_load)(bl_mem *m, size_t off, void *dst, size_t n);
    void (*dma_store)(bl_mem *m, size_t off, const void *src, size_t n);
} bl_memops;

struct bl_mem {
    uint8_t *base;
    size_t size;
    const bl_memops *ops;
    bl_model *model; /* NULL in native mode */
    /* record.c: with a read record, ops is its recording table and inner the table it
     * wraps (native or model); rec holds one state per granule of 2^rec_shift bytes */
    const bl_memops *inner;
    _Atomic uint64_t *rec;
    size_t rec_count;
    unsigned rec_shift;
};

/* record.c: which granules of the mapping this host may hold stale lines of (the rule is
 * argued at the top of record.c).  A granule's state is START (unknown since the record
 * began: lines may be cached from before), CLEAN (no line this host may hold), TOUCHED (a
 * CPU path of this host loaded, stored, prefetched, flushed or invalidated there: lines
 * of any content may be cached) or a block version v (lines may be cached, holding v's
 * committed bytes only). */
#define BL_REC_START 0ull
#define BL_REC_CLEAN (UINT64_MAX - 1)
#define BL_REC_TOUCHED UINT64_MAX
#define BL_REC_MAX_GRANULES (1u << 20)
int bl_record_init(bl_mem *m, int clean);
void bl_record_free(bl_mem *m);
uint64_t bl_record_state(const bl_mem *m, size_t off);
size_t bl_invalidate_stale(bl_mem *m, const uint64_t *ranges, size_t n);

/* cpu.c: what this CPU can do (CPUID, read once), and the chicken bits. */
int bl_cpu_has(const char *feature);
int bl_forced(const char *name, const char *value);

/* crc32c.c: CRC32C, and the sealed record every pool format uses (last 4 bytes: the
 * CRC32C of the rest, little-endian).  bl_crc32c_init must run before any CRC. */
#define BL_SEAL_BYTES 4u
#define BL_CRC32C_POLY 0x82f63b78u /* the reflected Castagnoli polynomial: the one definition */
void bl_crc32c_init(void);
uint32_t bl_crc32c_mul(uint32_t a, uint32_t b);
uint32_t bl_crc32c_x8n(uint64_t n);
const char *bl_crc32c_selected(void);
uint32_t bl_crc32c(uint32_t crc, const void *buf, size_t n);
uint32_t bl_crc32c_of(const void *buf, size_t n);
uint32_t bl_crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);
uint32_t bl_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t n);
const char *bl_crc32c_copy_selected(void);
void bl_crc32c_set_copy(void (*copy)(void *, const void *, size_t));
void bl_record_seal(void *rec, size_t size);
int bl_record_sealed(const void *rec, size_t size);
void bl_lines_sealed(const void *const *lines, size_t n, uint8_t *ok);

/* blake3.c: the 16-byte key digest (BLAKE3's first 16 bytes, as blake3.blake3(key).digest(16)). */
#define BL_MAX_KEY 256u /* bytes of a key, at most (one BLAKE3 chunk is 1024) */
void bl_key_digest(const void *key, size_t n, uint8_t out[16]);
void bl_key_digest_many(const uint8_t *const *key, const size_t *len, uint8_t *const *out,
                        size_t n);

/* memops.c: instruction selection and the native table (NULL, and why, where there is none). */
void bl_memops_init(void);
const bl_memops *bl_native_ops(const char **why);
const char *bl_selected(const char *what);
#define BL_SELFCHECK_BYTES 4096
int bl_memops_selfcheck(char *out, size_t cap);

/* model.c: the simulated non-coherent host; its counters, in model_stats() order. */
enum {
    BL_MS_HITS,
    BL_MS_MISSES,
    BL_MS_WRITEBACKS,
    BL_MS_EVICTIONS,
    BL_MS_DISCARDED,
    BL_MS_EARLY_DRAINS,
    BL_MS_REFILLS,
    BL_MS_DIRTY_DROPPED,
    BL_MS_LANDED, /* writes (lines or pieces of lines) that reached memory */
    BL_MODEL_NSTATS
};
bl_model *bl_model_new(uint32_t cache_lines, double evict_rate, double drain_rate,
                       double refill_rate, uint64_t seed);
void bl_model_free(bl_model *model);
const bl_memops *bl_model_ops(void);
void bl_model_discard(bl_model *model);
void bl_model_stats(bl_model *model, uint64_t out[BL_MODEL_NSTATS]);
void bl_model_crash_after(bl_model *model, uint64_t lines);
int bl_model_crashed(bl_model *model);

/* block.c: the block header and the publish / read_validated protocol. */
#define BL_HDR_MAGIC 0x484b4c42u /* "BLKH" */

/* A header's state, X(NAME, value); Python builds beluga.coherence.BlockState from it. */
#define BL_BLOCK_STATES(X) X(FREE, 0) X(WRITING, 1) X(PUBLISHED, 2)
#define BL_STATE_ENUM(name, value) BL_##name = value,
enum { BL_BLOCK_STATES(BL_STATE_ENUM) };
#undef BL_STATE_ENUM

/*
 * Why a read returned no value, X(NAME, code, why): every one is a cache miss,
 * never other bytes.  Python builds beluga.coherence.Miss from this list.
 */
#define BL_MISS_CODES(X)                                                                     \
    X(MAGIC, -1, "not a header, or its own checksum fails")                                        \
    X(STATE, -2, "not published (free, or being written)")                                         \
    X(KEY, -3, "another key lives there now")                                                      \
    X(VERSION, -4, "the block was republished")                                                    \
    X(LENGTH, -5, "the header claims an impossible length")                                        \
    X(CHECKSUM, -6, "the payload does not match its checksum (torn or overwritten)")               \
    X(CHANGED, -7, "the header changed while the payload was copied")
#define BL_MISS_ENUM(name, code, why) BL_MISS_##name = code,
enum {
    BL_MISS_CODES(BL_MISS_ENUM)
    BL_TOO_SMALL = -8, /* no miss: the caller's buffer is shorter than the value */
};
#undef BL_MISS_ENUM

typedef struct bl_header {
    uint32_t magic;
    uint16_t state;
    uint16_t key_len;
    uint64_t version;
    uint8_t digest[16];
    uint64_t length;
    uint32_t payload_crc;
    uint32_t writer;
    uint64_t stamp; /* WRITING by the server (a grant): its request's RPC seq; else 0 */
    uint32_t writer_gen; /* generation of the writer's host id (recovery knows whose write it is) */
    uint32_t header_crc;
} bl_header;

_Static_assert(sizeof(bl_header) == BL_LINE, "a block header is one cache line");

void bl_header_seal(bl_header *h);
int bl_header_check(const bl_header *h);
void bl_headers_check(const bl_header *const *h, size_t n, uint8_t *ok);
void bl_publish(bl_mem *m, size_t hdr_off, size_t payload_off, const bl_header *proto,
                const void *data, size_t n);
void bl_begin_write(bl_mem *m, size_t hdr_off, const bl_header *proto, size_t n);
void bl_seal(bl_mem *m, size_t hdr_off, const bl_header *proto, size_t n, uint32_t crc);
uint32_t bl_payload_crc(bl_mem *m, size_t payload_off, size_t n);
void bl_get_header(bl_mem *m, size_t hdr_off, bl_header *h);
int64_t bl_check_header(bl_mem *m, size_t hdr_off, size_t payload_off, const uint8_t digest[16],
                        uint64_t version, size_t block_cap, bl_header *h);
int64_t bl_read_checked(bl_mem *m, size_t hdr_off, size_t payload_off, const bl_header *h,
                        void *out);
int64_t bl_read_validated(bl_mem *m, size_t hdr_off, size_t payload_off,
                          const uint8_t digest[16], uint64_t version, size_t block_cap,
                          void *out, size_t cap, bl_header *seen);

/* blockio.c: many whole blocks read or written in one call, checksummed as they move. */
typedef struct {
    size_t hdr_off, payload_off, cap; /* cap: bytes of the block's extent */
    const uint8_t *digest;            /* 16 bytes */
    uint64_t version;
    uint64_t length;  /* write: the value's length; read: set from the header */
    bl_header proto;  /* write: the header fields to seal with */
    int64_t result;   /* read: the length, or a BL_MISS_* code */
} bl_blockio;

int bl_read_blocks(bl_mem *m, bl_blockio *blocks, size_t nblocks, const uint64_t *rows,
                   size_t nrows, uint8_t *const *bufs, const bl_header *seen, const char **why);
void bl_check_headers(bl_mem *m, bl_blockio *blocks, size_t nblocks, bl_header *out);
int bl_write_blocks(bl_mem *m, bl_blockio *blocks, size_t nblocks, const uint64_t *rows,
                    size_t nrows, const uint8_t *const *bufs, const char **why);

/* sg.c: one scatter-gather table, rows of (buffer index, buffer offset, pool offset,
 * length) as uint64, checked whole before any byte moves, then run. */
#define BL_SG_WHY 192 /* bytes of the message bl_sg_check writes */
int bl_sg_check(const uint64_t *rows, size_t nrows, const size_t *buf_len, size_t nbufs,
                size_t mem_size, uint64_t *total, char why[BL_SG_WHY]);
void bl_sg_run(bl_mem *m, const uint64_t *rows, size_t nrows, uint8_t *const *bufs, int write);

/*
 * index.c: the pool-resident hash index (one writer: the metadata server; readers
 * probe it with loads).  A bucket is one line of BL_IX_SLOTS entries; a key may live
 * in either of its two buckets (bl_ix_hash).  Entries are hints that the block
 * header confirms: a reader trusts nothing it has not checked there.
 */
#define BL_IX_SLOTS 3
typedef struct {
    uint32_t tag;     /* digest bytes 0..3 as a u32, never 0 (0 is an empty slot) */
    uint32_t block;   /* first block of the value's extent */
    uint64_t version; /* the committed version (the block header must hold it) */
} bl_ix_slot;

typedef struct {
    uint64_t seq; /* bumped by every rewrite of the bucket */
    bl_ix_slot slot[BL_IX_SLOTS];
    uint32_t spare;
    uint32_t crc; /* CRC32C of bytes 0..59: a torn or hostile line is no bucket */
} bl_ix_bucket;
_Static_assert(sizeof(bl_ix_bucket) == BL_LINE, "an index bucket is one cache line");

/* Per host, after the buckets: a counts line and a ring of hints, written only by that host. */
#define BL_IX_HINT_RING 64u                                  /* hints (u64) per host */
#define BL_IX_HINT_LINES (1u + BL_IX_HINT_RING * 8u / BL_LINE) /* lines per host */
typedef struct {
    uint64_t seq;    /* hints recorded so far (ring slot = seq % BL_IX_HINT_RING) */
    uint64_t hits;   /* probes that found a key */
    uint64_t misses; /* probes that did not */
    uint64_t owner;  /* the host id's generation that wrote this line */
    uint64_t tier_hits;  /* misses of the pool that the cross-pod tier served */
    uint64_t promotions; /* values this host copied from that tier into the pool */
    uint8_t spare[12];
    uint32_t crc;
} bl_ix_counts;
_Static_assert(sizeof(bl_ix_counts) == BL_LINE, "a hint counts line is one cache line");

typedef struct {
    size_t index_off;    /* first bucket */
    uint64_t nbuckets;   /* a power of two */
    size_t headers_off, payloads_off, block_size;
    uint64_t nblocks;
} bl_ix;

void bl_ix_hash(const uint8_t digest[16], uint64_t nbuckets, uint32_t *tag, uint64_t *b1,
                uint64_t *b2);
void bl_ix_seal(bl_ix_bucket *b);
int bl_ix_bucket_ok(const bl_ix_bucket *b);
int64_t bl_ix_lookup(bl_mem *m, const bl_ix *ix, const uint8_t digest[16], uint32_t *block,
                     bl_header *h);
void bl_ix_lookup_many(bl_mem *m, const bl_ix *ix, const uint8_t *digests, size_t n,
                       uint32_t *block, bl_header *h, int64_t *r);
void bl_ix_lookup_keys(bl_mem *m, const bl_ix *ix, const uint8_t *const *key, const size_t *len,
                       size_t n, uint8_t *digests, uint32_t *block, bl_header *h, int64_t *r,
                       int prefix);
int bl_ix_geometry_ok(size_t mem_size, const bl_ix *ix, long long hint_off);
int bl_ix_is_race(int64_t r);
int64_t bl_ix_read_into(bl_mem *m, const bl_ix *ix, const uint8_t digest[16], uint8_t *out,
                        size_t cap, uint32_t *block, bl_header *h);
void bl_ix_read_many(bl_mem *m, const bl_ix *ix, const uint8_t *digests, size_t n,
                     uint8_t *const *bufs, const size_t *lens, int64_t *got, uint32_t *blocks,
                     uint64_t *versions);
int bl_ix_counts_ok(const bl_ix_counts *c);
uint64_t bl_ix_hint(uint32_t block, uint64_t version);
void bl_ix_hint_split(uint64_t hint, uint32_t *block, uint32_t *version_low);

/* A reader's hits, misses and hints, buffered and stored in its host's lines every
 * BL_IX_HINT_RING probes (one writer: the caller serialises, e.g. under the GIL). */
typedef struct {
    long long hint_off; /* this host's counts line, or -1: no hints */
    uint64_t owner;     /* the host id's generation */
    uint64_t seq, hits, misses, flushed_seq, unflushed, tier_hits, promotions;
    uint64_t ring[BL_IX_HINT_RING];
    unsigned fork_gen; /* bl_ix_forks() when made */
} bl_ix_hints;

int bl_ix_watch_forks(void);
void bl_ix_hints_init(bl_ix_hints *r, long long hint_off, uint64_t owner);
int bl_ix_note(bl_ix_hints *r, int hit, uint32_t block, uint64_t version);
void bl_ix_note_tier(bl_ix_hints *r, uint64_t hits, uint64_t promotions);
void bl_ix_flush_hints(bl_mem *m, bl_ix_hints *r);

/* mirror.c: the metadata server's mirror of the index and its writes (the only writer).
 * Flat arrays, a few bytes a slot: seq and loaded a bucket; the line's slot, a state
 * (empty / unresolved / resolved) and the resolved key's digest a slot.  One thread: the
 * caller serialises (the server's, under the GIL). */
typedef struct {
    bl_ix ix;
    size_t commits_off;      /* the commit table: a u64 version a block */
    uint64_t *seq;           /* per bucket: its line's sequence, as last read or written */
    uint8_t *loaded;         /* per bucket: the mirror holds it */
    int all_loaded;          /* every bucket reconciled: loaded is no longer read */
    bl_ix_slot *slot;        /* per slot: as the line holds it (zeros when empty) */
    uint8_t *state;          /* per slot: 0 empty, 1 unresolved, 2 resolved */
    uint8_t (*digest)[16];   /* per slot: the key, when resolved */
    uint64_t resolved;       /* resolved slots (= keys placed) */
    uint64_t moves, failed, scrubbed, unconfirmed, scrub_at;
} bl_ixm;

int bl_ixm_init(bl_ixm *x, const bl_ix *ix, size_t commits_off);
void bl_ixm_free(bl_ixm *x);
void bl_ixm_reset(bl_ixm *x);
int64_t bl_ixm_slot_of(const bl_ixm *x, const uint8_t digest[16]);
int bl_ixm_find(bl_mem *m, bl_ixm *x, const uint8_t digest[16], uint32_t *block,
                uint64_t *version);
int bl_ixm_put(bl_mem *m, bl_ixm *x, const uint8_t digest[16], uint32_t block, uint64_t version);
int bl_ixm_crowd(bl_mem *m, bl_ixm *x, const uint8_t digest[16], uint8_t out[][16]);
void bl_ixm_drop(bl_mem *m, bl_ixm *x, const uint8_t digest[16]);
uint64_t bl_ixm_scrub(bl_mem *m, bl_ixm *x, uint64_t n);
int bl_ixm_reconcile(bl_mem *m, bl_ixm *x, uint64_t lo, uint64_t hi, const bl_ix_bucket *lines,
                     const int64_t *keep, const uint8_t (*digests)[16], size_t n,
                     uint64_t *kept, uint64_t *dropped);
void bl_ixm_loaded_all(bl_ixm *x);

/* keytable.c: the server's table of cold keys, digest -> id (plain process memory, one
 * thread).  Open addressing; ids >= 0, the negative ones mark free and removed slots. */
typedef struct {
    uint8_t (*keys)[16];
    int64_t *ids;
    uint64_t mask;           /* slots - 1 (a power of two less one) */
    uint64_t live, used;     /* keys held; slots not free (keys and tombstones) */
    uint64_t seed;           /* mixed into every probe start */
} bl_kt;

int bl_kt_init(bl_kt *t, uint64_t hint, uint64_t seed);
void bl_kt_free(bl_kt *t);
int64_t bl_kt_get(const bl_kt *t, const uint8_t d[16]);
int bl_kt_reserve(bl_kt *t, uint64_t n);
int bl_kt_put(bl_kt *t, const uint8_t d[16], int64_t id);
int64_t bl_kt_pop(bl_kt *t, const uint8_t d[16]);

/* rpc.c: slot rings; the geometry both sides derive from (bytes per ring, depth).
 *
 * A ring opens with four lines, one writer each:
 *   BL_RPC_CONTROL      ring control (client; parsed in Python)
 *   BL_RPC_STATUS       server status (server; parsed in Python)
 *   BL_RPC_CLIENT_WAKE  the client's wake line: "I am asleep" (a hint, see rpc.c)
 *   BL_RPC_SERVER_WAKE  the server's wake line: a response counter the client sleeps on
 * The server's doorbell lives in region 0, after the 4 KiB superblock: a line the
 * server alone writes ("I am asleep") and a request counter every same-kernel
 * client bumps atomically.  Wake lines are hints for peers on one kernel only;
 * the protocol never depends on them.
 */
#define BL_RPC_CONTROL 0u
#define BL_RPC_STATUS (1 * BL_LINE)
#define BL_RPC_CLIENT_WAKE (2 * BL_LINE)
#define BL_RPC_SERVER_WAKE (3 * BL_LINE)
#define BL_RPC_HEAD (4 * BL_LINE)
#define BL_RPC_DOORBELL 4096u                      /* server's "asleep" line */
#define BL_RPC_DOORBELL_COUNT (BL_RPC_DOORBELL + BL_LINE) /* clients' request counter */
#define BL_RPC_INLINE 40u
#define BL_RPC_MAX_DEPTH 128u
#define BL_RPC_WINDOW 32u        /* lines a reader looks at per pass */
#define BL_RPC_OOL 1u            /* a line's flag: its payload is in the slot's buffer */
#define BL_RPC_BAD_LENGTH 0xfff0 /* transport statuses: an impossible length, */
#define BL_RPC_CORRUPT 0xfff1    /* a torn or garbage line or payload, */
#define BL_RPC_RESTARTED 0xfff2  /* sent to a server that is gone: not run, send it again */

/* A message: one line, written by one side (the request by the client, the response by
 * the server), sealed with its own CRC32C (bl_record_seal). */
typedef struct {
    uint32_t seq;
    uint16_t code; /* request: op; response: status */
    uint16_t flags;
    uint32_t len;
    uint32_t gen;
    uint8_t data[BL_RPC_INLINE];
    uint32_t payload_crc;
    uint32_t crc;
} bl_rpc_line;
_Static_assert(sizeof(bl_rpc_line) == BL_LINE, "an RPC message is one cache line");

typedef struct {
    size_t base;   /* the ring's offset in the mapping */
    uint32_t depth; /* slots */
    size_t buf;    /* bytes of each slot buffer */
} bl_rpc_ring;

enum { BL_RPC_BAD_DEPTH = 1, BL_RPC_NO_ROOM = 2 }; /* why bl_rpc_ring_check refused */
size_t bl_rpc_buf_size(size_t ring_bytes, uint32_t depth);
bl_rpc_ring bl_rpc_ring_at(size_t base, size_t ring_bytes, uint32_t depth);
int bl_rpc_ring_check(size_t mem_size, size_t base, size_t ring_bytes, uint32_t depth);
size_t bl_rpc_req_line(const bl_rpc_ring *g, uint32_t slot);
size_t bl_rpc_resp_line(const bl_rpc_ring *g, uint32_t slot);
size_t bl_rpc_req_buf(const bl_rpc_ring *g, uint32_t slot);
size_t bl_rpc_resp_buf(const bl_rpc_ring *g, uint32_t slot);
int bl_rpc_fits(size_t n, size_t buf);
uint64_t bl_rpc_now_ns(void);

/* How one end waits (tunable from Python), and counters the tests read. */
typedef struct {
    uint64_t spin_ns;    /* spin this long before yielding and sleeping */
    uint64_t sleep_ns;   /* longest futex sleep before polling again */
    int wake;            /* (client) the server shares our kernel: use the wake lines */
    int futex_ok;        /* cleared at the first futex error: timed naps only */
    uint64_t calm_until; /* the core is contended: sleep at once until then */
    uint64_t calm_ns;    /* length of the next calm spell */
    uint64_t next_check; /* when to look at the thread's contention again */
    uint64_t checked;    /* when it last looked (0: not while spinning) */
    uint64_t stalled;    /* its time waiting for a core then */
    uint64_t turns;      /* its turns on a core then */
    long tid;            /* the thread that looked */
} bl_rpc_wait;

typedef struct {
    _Atomic uint64_t yields, naps, sleeps, woken, timeouts, wakes, futex_errors, stalled;
} bl_rpc_wait_stats;

/* What a loop that may wait long asks of its caller. */
typedef struct {
    void (*let_go)(void *ctx);  /* before it waits longer than a short spin (drop the GIL) */
    int (*stopping)(void *ctx); /* polled: nonzero ends the loop early (the pool is closing) */
    void *ctx;
} bl_rpc_hooks;

/* The client end of one ring. */
typedef struct {
    bl_mem *m;
    bl_rpc_ring g;
    uint32_t gen;
    uint32_t next_seq; /* sequence number of the next submit */
    uint32_t done_seq; /* oldest sequence number not yet completed */
    int doorbell;      /* the server's doorbell lies in this mapping */
    bl_rpc_wait wait;
    bl_rpc_wait_stats stats;
} bl_rpc_client;

typedef struct {
    uint16_t code; /* op */
    const void *p;
    size_t n;
} bl_rpc_msg;

void bl_rpc_client_init(bl_rpc_client *c, bl_mem *m, size_t base, size_t ring_bytes,
                        uint32_t depth, uint32_t gen, uint32_t first_seq, int wake);
uint32_t bl_rpc_client_submit(bl_rpc_client *c, const bl_rpc_msg *msgs, uint32_t n);
int bl_rpc_client_wait(bl_rpc_client *c, uint32_t n, bl_rpc_line *lines, uint64_t deadline,
                       const bl_rpc_hooks *h);
int bl_rpc_client_payload(bl_rpc_client *c, const bl_rpc_line *ln, void *out);
int64_t bl_rpc_client_pump(bl_rpc_client *c, uint16_t op, const void *p, size_t n,
                           uint32_t depth, uint64_t duration_ns, const bl_rpc_hooks *h);

/* The server end of every ring of a pool. */
typedef struct {
    bl_rpc_ring g;
    uint32_t active, gen;
    uint32_t head;      /* next sequence number expected */
    int wake;           /* the client shares our kernel: wake it through the wake lines */
    uint64_t bad_since; /* when a torn line at head was first seen (0: none) */
    uint64_t marked;    /* the respond batch that last looked at this client's wake line */
} bl_rpc_ring_state;

typedef struct {
    uint32_t ring, seq;
    bl_rpc_line line;
} bl_rpc_request;

typedef struct {
    uint32_t ring, seq;
    uint16_t status;
    const void *p;
    size_t n;
} bl_rpc_reply;

typedef struct {
    bl_mem *m;
    size_t area_off, ring_bytes;
    uint32_t nrings;
    uint32_t nactive, nwake; /* rings served, and those whose client shares our kernel */
    bl_rpc_ring_state *rings;
    atomic_int stop;
    int doorbell; /* the doorbell lines lie in this mapping, outside the rings */
    int idle;     /* the last gather found nothing: the next one skips spinning */
    uint64_t torn_ns; /* how long a torn request line at head is waited for (rpc.c TORN LINES) */
    uint64_t served, rejected, batches;
    bl_rpc_wait wait;
    bl_rpc_wait_stats stats;
} bl_rpc_server;

int bl_rpc_server_init(bl_rpc_server *s, bl_mem *m, size_t area_off, size_t ring_bytes,
                       uint32_t nrings);
void bl_rpc_server_free(bl_rpc_server *s);
size_t bl_rpc_server_ring_base(const bl_rpc_server *s, uint32_t idx);
void bl_rpc_server_set_ring(bl_rpc_server *s, uint32_t idx, uint32_t gen, uint32_t depth,
                            uint32_t head, int wake);
void bl_rpc_server_clear_ring(bl_rpc_server *s, uint32_t idx);
uint64_t bl_rpc_server_recover_head(bl_rpc_server *s, uint32_t idx, uint32_t gen, uint32_t depth,
                                    uint32_t first_seq);
uint32_t bl_rpc_server_refuse_pending(bl_rpc_server *s, uint32_t idx);
int bl_rpc_server_unanswered(bl_rpc_server *s, uint32_t idx, uint32_t seq);
int bl_rpc_server_gather(bl_rpc_server *s, bl_rpc_request *batch, int max_batch,
                         uint64_t timeout_ns, const bl_rpc_hooks *h);
int bl_rpc_server_payload(bl_rpc_server *s, const bl_rpc_request *q, void *out);
void bl_rpc_server_reject(bl_rpc_server *s, uint32_t idx, uint32_t seq, uint16_t status,
                          const char *why);
int bl_rpc_server_respond(bl_rpc_server *s, const bl_rpc_reply *replies, size_t n);
int64_t bl_rpc_server_serve_echo(bl_rpc_server *s, uint64_t duration_ns, const bl_rpc_hooks *h);
void bl_rpc_server_stop(bl_rpc_server *s, int wake);

#endif
