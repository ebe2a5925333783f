/*
 * beluga_native.h - the internal interface of Beluga's C core.
 *
 * A bl_mem is one attachment ("host view") of a shared mapping.  Every access
 * to shared memory goes through its bl_memops table, which is chosen once, when
 * the attachment is made: the native table issues real instructions, the model
 * table runs the same requests through a simulated non-coherent cache
 * (model.c).  Protocol code (publish / read_validated, the scatter-gather
 * executor, the RPC polling loop) only ever calls through the table, so it is
 * the same code in both modes.
 */
#ifndef BELUGA_NATIVE_H
#define BELUGA_NATIVE_H

#include <stddef.h>
#include <stdint.h>

#define BL_LINE 64u

typedef struct bl_mem bl_mem;
typedef struct bl_model bl_model;

/* The coherence operations; offsets are relative to the mapping's base. */
typedef struct bl_memops {
    const char *name;
    void (*load)(bl_mem *m, size_t off, void *dst, size_t n);
    void (*store)(bl_mem *m, size_t off, const void *src, size_t n);
    void (*nt_store)(bl_mem *m, size_t off, const void *src, size_t n);
    void (*flush)(bl_mem *m, size_t off, size_t n);      /* write back and drop */
    void (*writeback)(bl_mem *m, size_t off, size_t n);  /* write back, keep */
    void (*invalidate)(bl_mem *m, size_t off, size_t n); /* drop before a read */
    void (*sfence)(bl_mem *m);
    void (*mfence)(bl_mem *m);
} bl_memops;

struct bl_mem {
    uint8_t *base;
    size_t size;
    const bl_memops *ops;
    bl_model *model; /* NULL in native mode */
};

/* memops.c: instruction selection and the native table. */
void bl_cpu_init(void);
const bl_memops *bl_native_ops(void);
uint32_t bl_crc32c(uint32_t crc, const void *buf, size_t n);
void bl_nt_copy(void *dst, const void *src, size_t n);
void bl_flush_lines(const void *addr, size_t n);
const char *bl_selected(const char *what);
int bl_cpu_has(const char *feature);

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
    BL_MODEL_NSTATS
};
bl_model *bl_model_new(uint32_t cache_lines, double evict_rate, double drain_rate,
                       double refill_rate, uint64_t seed);
void bl_model_free(bl_model *model);
const bl_memops *bl_model_ops(void);
void bl_model_discard(bl_model *model);
void bl_model_stats(bl_model *model, uint64_t out[BL_MODEL_NSTATS]);

/* block.c: the block header and the publish / read_validated protocol. */
#define BL_HDR_MAGIC 0x484b4c42u /* "BLKH" */
enum { BL_FREE = 0, BL_WRITING = 1, BL_PUBLISHED = 2 };
enum {
    BL_MISS_MAGIC = -1,
    BL_MISS_STATE = -2,
    BL_MISS_KEY = -3,
    BL_MISS_VERSION = -4,
    BL_MISS_LENGTH = -5,
    BL_MISS_CHECKSUM = -6,
    BL_MISS_CHANGED = -7,
    BL_TOO_SMALL = -8,
};

typedef struct bl_header {
    uint32_t magic;
    uint16_t state;
    uint16_t key_len;
    uint64_t version;
    uint8_t digest[16];
    uint64_t length;
    uint32_t payload_crc;
    uint32_t writer;
    uint64_t stamp;
    uint32_t writer_gen; /* generation of the writer's host id (recovery knows whose write it is) */
    uint32_t header_crc;
} bl_header;

_Static_assert(sizeof(bl_header) == BL_LINE, "a block header is one cache line");

void bl_header_seal(bl_header *h);
int bl_header_check(const bl_header *h);
void bl_publish(bl_mem *m, size_t hdr_off, size_t payload_off, const bl_header *proto,
                const void *data, size_t n);
void bl_begin_write(bl_mem *m, size_t hdr_off, const bl_header *proto, size_t n);
void bl_seal(bl_mem *m, size_t hdr_off, const bl_header *proto, size_t n, uint32_t crc);
uint32_t bl_payload_crc(bl_mem *m, size_t payload_off, size_t n);
void bl_get_header(bl_mem *m, size_t hdr_off, bl_header *h);
int64_t bl_check_header(bl_mem *m, size_t hdr_off, size_t payload_off, const uint8_t digest[16],
                        uint64_t version, size_t block_cap, bl_header *h);
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

uint32_t bl_crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);
int bl_read_blocks(bl_mem *m, bl_blockio *blocks, size_t nblocks, const uint64_t *rows,
                   size_t nrows, uint8_t *const *bufs, const char **why);
int bl_write_blocks(bl_mem *m, bl_blockio *blocks, size_t nblocks, const uint64_t *rows,
                    size_t nrows, const uint8_t *const *bufs, const char **why);

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
size_t bl_rpc_buf_size(size_t ring_bytes, uint32_t depth);

#ifdef Py_PYTHON_H
/* The Python Memory object, shared by module.c and rpc.c. */
#include <stdatomic.h>
typedef struct {
    PyObject_HEAD
    bl_mem mem;
    Py_buffer view;
    int has_view;
    atomic_int busy;    /* sections running over the mapping (bl_section_enter) */
    atomic_int closing; /* release() calls waiting for those sections to end */
} MemoryObject;

/*
 * A section: code that touches the mapping and may run without the GIL.
 * Enter counts it busy *then* checks the Memory is attached and not closing,
 * so release() (which marks closing, then waits for busy to drain) can never
 * unmap under it.  Long loops poll bl_section_closing() and end early.
 */
typedef struct {
    MemoryObject *mem;
    PyThreadState *ts; /* non-NULL while the GIL is dropped */
} bl_section;

int bl_section_enter(bl_section *s, MemoryObject *mem, int drop_gil, PyObject *cls,
                     const char *why);
void bl_section_gil(bl_section *s, int drop);
void bl_section_leave(bl_section *s);
int bl_section_closing(const bl_section *s);

extern PyTypeObject BlMemoryType;
PyObject *bl_fail(PyObject *cls, const char *fmt, ...);
extern PyObject *bl_coherence_error, *bl_rpc_error;
int bl_rpc_init(PyObject *module);
#endif

#endif
