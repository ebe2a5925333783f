/*
 * memory_py.c - the Python Memory type: one host's view of a shared mapping.
 *
 * A Memory wraps one writable buffer (an mmap of the pool) and the memops
 * table picked for it at construction: "native" or "model".  Every offset
 * and length is checked against the mapping before anything is touched, so
 * misuse from Python raises (the error class is registered by the Python
 * package) instead of crashing; then the core (block.c, blockio.c, sg.c, the
 * table itself) does the work.
 *
 * Long copies run without the GIL inside a *section* (helpers_py.c), as do
 * the RPC loops (rpc_py.c).  release() marks the Memory closing, then waits,
 * with the GIL released, up to its timeout for sections to end: copies are
 * bounded, and RPC loops poll the closing mark and return at once.  If
 * sections are still running at the timeout, release() raises and leaves the
 * mapping attached, so a caller never unmaps memory a loop still reads.
 */
#include <sched.h>
#include <time.h>

#include "beluga_py.h"

#define RELEASE_WAIT_S 2.0 /* default wait of release() for running sections */

#define fail(...) bl_fail(bl_coherence_error, __VA_ARGS__)

/* Check that the Memory is still attached. */
static int attached(MemoryObject *self)
{
    if (self->has_view)
        return 1;
    fail("this Memory was released; attach the pool again");
    return 0;
}

/* Check that [off, off + n) lies inside the mapping. */
static int in_range(MemoryObject *self, unsigned long long off, unsigned long long n)
{
    if (!attached(self))
        return 0;
    if (off > self->mem.size || n > self->mem.size - off) {
        fail("range [%llu, +%llu) is outside the %zu-byte mapping", off, n, self->mem.size);
        return 0;
    }
    return 1;
}

/* Enter a section for a copy of n bytes in rows pieces, without the GIL when it is long. */
static int enter_copy(bl_section *s, MemoryObject *self, size_t n, size_t rows)
{
    return bl_section_enter(s, self, n >= BL_NOGIL_BYTES || rows >= BL_NOGIL_ROWS, NULL, NULL);
}

/* Wait (GIL released by the caller) until no section runs or timeout_s passes; 1 if idle. */
static int wait_idle(MemoryObject *self, double timeout_s)
{
    struct timespec t0, t, nap = {0, 100000};
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; atomic_load(&self->busy); i++) {
        clock_gettime(CLOCK_MONOTONIC, &t);
        if ((double)(t.tv_sec - t0.tv_sec) + 1e-9 * (double)(t.tv_nsec - t0.tv_nsec) >= timeout_s)
            return 0;
        if (i < 16)
            sched_yield();
        else
            nanosleep(&nap, NULL);
    }
    return 1;
}

/* Memory(buffer, mode="native", *, cache_lines=4096, evict_rate=0.0, drain_rate=0.25,
 *        refill_rate=0.5, seed=0): the keywords tune the model (model.c) */
static int Memory_init(MemoryObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"buffer",      "mode", "cache_lines", "evict_rate", "drain_rate",
                             "refill_rate", "seed", NULL};
    PyObject *buffer;
    const char *mode = "native";
    unsigned int cache_lines = 4096;
    double evict_rate = 0.0, drain_rate = 0.25, refill_rate = 0.5;
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|s$IdddK", kwlist, &buffer, &mode, &cache_lines,
                                     &evict_rate, &drain_rate, &refill_rate, &seed))
        return -1;
    if (self->has_view) {
        fail("Memory is already initialised");
        return -1;
    }
    int model = strcmp(mode, "model") == 0;
    if (!model && strcmp(mode, "native") != 0) {
        PyErr_Format(PyExc_ValueError, "mode must be 'native' or 'model', not '%s'", mode);
        return -1;
    }
    if (!model && bl_sabotage_armed() >= 0) { /* see sabotage.c: never a real mapping */
        fail("this is a sabotaged C core (point %s armed): it runs under the model only",
             bl_points[bl_sabotage_armed()].name);
        return -1;
    }
    const char *no_native = NULL;
    const bl_memops *ops = model ? bl_model_ops() : bl_native_ops(&no_native);
    if (!ops) {
        fail("%s", no_native);
        return -1;
    }
    if (model && (cache_lines < 1 || !(evict_rate >= 0.0 && evict_rate <= 1.0) ||
                  !(drain_rate >= 0.0 && drain_rate <= 1.0) ||
                  !(refill_rate >= 0.0 && refill_rate <= 1.0))) {
        PyErr_SetString(PyExc_ValueError, "model needs cache_lines >= 1 and evict_rate, "
                                          "drain_rate and refill_rate in [0, 1]");
        return -1;
    }
    if (PyObject_GetBuffer(buffer, &self->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    self->has_view = 1;
    self->mem.base = self->view.buf;
    self->mem.size = (size_t)self->view.len;
    self->mem.ops = ops;
    if (model && self->mem.size % BL_LINE) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
        PyErr_Format(PyExc_ValueError, "model mode needs whole %u-byte lines, got %zu bytes",
                     BL_LINE, self->mem.size);
        return -1;
    }
    if (model) {
        self->mem.model = bl_model_new(cache_lines, evict_rate, drain_rate, refill_rate, seed);
        if (!self->mem.model) {
            PyBuffer_Release(&self->view);
            self->has_view = 0;
            PyErr_NoMemory();
            return -1;
        }
    }
    /* the read record (record.c): a model host starts with an empty cache, a real one
     * may hold lines from before this attachment */
    if (bl_record_init(&self->mem, model) < 0) {
        bl_model_free(self->mem.model);
        self->mem.model = NULL;
        PyBuffer_Release(&self->view);
        self->has_view = 0;
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* release(timeout_s=2.0): end running sections, then detach (model cache and view). */
static PyObject *Memory_release(MemoryObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"timeout_s", NULL};
    double timeout = RELEASE_WAIT_S;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|d", kwlist, &timeout))
        return NULL;
    if (!(timeout >= 0 && timeout <= 3600))
        return bl_fail(PyExc_ValueError, "timeout_s must be 0..3600 s");
    if (!self->has_view)
        Py_RETURN_NONE;
    atomic_fetch_add(&self->closing, 1); /* new sections are refused from here on */
    int idle = !atomic_load(&self->busy);
    if (!idle) {
        Py_BEGIN_ALLOW_THREADS
        idle = wait_idle(self, timeout);
        Py_END_ALLOW_THREADS
    }
    if (!idle) {
        int busy = atomic_load(&self->busy);
        atomic_fetch_sub(&self->closing, 1);
        return fail("cannot release this Memory: %d call(s) still run over it after %.1f s "
                    "(a long copy, or an RPC loop that did not stop); stop them first "
                    "(RpcServer.close(), RpcClient.close(), or let the copy finish), then close "
                    "the pool again: it is still attached",
                    busy, timeout);
    }
    if (self->has_view) { /* another release() may have finished meanwhile */
        bl_record_free(&self->mem);
        bl_model_free(self->mem.model);
        self->mem.model = NULL;
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
    atomic_fetch_sub(&self->closing, 1);
    Py_RETURN_NONE;
}

/* Dealloc: release, then free. */
static void Memory_dealloc(MemoryObject *self)
{
    if (self->has_view) {
        bl_record_free(&self->mem);
        bl_model_free(self->mem.model);
        PyBuffer_Release(&self->view);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* load(off, n) -> bytes */
static PyObject *Memory_load(MemoryObject *self, PyObject *args)
{
    unsigned long long off, n;
    if (!PyArg_ParseTuple(args, "KK", &off, &n) || !in_range(self, off, n))
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)n);
    if (out)
        self->mem.ops->load(&self->mem, off, PyBytes_AS_STRING(out), n);
    return out;
}

/* Run a copy between the mapping and a caller buffer, without the GIL when long. */
static void copy_io(MemoryObject *self, int write, int nt, size_t off, void *buf, size_t n)
{
    bl_mem *m = &self->mem;
    bl_section s;
    if (enter_copy(&s, self, n, 1) < 0)
        return;
    if (!write)
        m->ops->load(m, off, buf, n);
    else if (nt)
        m->ops->nt_store(m, off, buf, n);
    else
        m->ops->store(m, off, buf, n);
    bl_section_leave(&s);
}

/* load_into(off, buffer): fill a writable buffer from the mapping. */
static PyObject *Memory_load_into(MemoryObject *self, PyObject *args)
{
    unsigned long long off;
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "Kw*", &off, &b))
        return NULL;
    if (in_range(self, off, (unsigned long long)b.len))
        copy_io(self, 0, 0, off, b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* Shared body of store() and nt_store(). */
static PyObject *store_common(MemoryObject *self, PyObject *args, int nt)
{
    unsigned long long off;
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "Ky*", &off, &b))
        return NULL;
    if (in_range(self, off, (unsigned long long)b.len))
        copy_io(self, 1, nt, off, b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* store(off, data): plain stores (they stay in this host's cache). */
static PyObject *Memory_store(MemoryObject *self, PyObject *args) { return store_common(self, args, 0); }

/* nt_store(off, data): non-temporal stores (they go to memory). */
static PyObject *Memory_nt_store(MemoryObject *self, PyObject *args)
{
    return store_common(self, args, 1);
}

/* Shared body of flush(), writeback() and invalidate(). */
static PyObject *range_op(MemoryObject *self, PyObject *args,
                          void (*op)(bl_mem *, size_t, size_t))
{
    unsigned long long off, n;
    if (!PyArg_ParseTuple(args, "KK", &off, &n) || !in_range(self, off, n))
        return NULL;
    op(&self->mem, off, n);
    Py_RETURN_NONE;
}

/* flush(off, n): write back and drop the lines. */
static PyObject *Memory_flush(MemoryObject *self, PyObject *args)
{
    return range_op(self, args, self->mem.ops ? self->mem.ops->flush : NULL);
}

/* writeback(off, n): write back, keep the lines. */
static PyObject *Memory_writeback(MemoryObject *self, PyObject *args)
{
    return range_op(self, args, self->mem.ops ? self->mem.ops->writeback : NULL);
}

/* invalidate(off, n): drop the lines before reading what another host wrote. */
static PyObject *Memory_invalidate(MemoryObject *self, PyObject *args)
{
    return range_op(self, args, self->mem.ops ? self->mem.ops->invalidate : NULL);
}

/* sfence(): order earlier stores before later ones. */
static PyObject *Memory_sfence(MemoryObject *self, PyObject *unused)
{
    if (!attached(self))
        return NULL;
    self->mem.ops->sfence(&self->mem);
    Py_RETURN_NONE;
}

/* mfence(): order everything, loads included. */
static PyObject *Memory_mfence(MemoryObject *self, PyObject *unused)
{
    if (!attached(self))
        return NULL;
    self->mem.ops->mfence(&self->mem);
    Py_RETURN_NONE;
}

/* Check an 8-byte aligned word offset. */
static int word_ok(MemoryObject *self, unsigned long long off)
{
    if (!in_range(self, off, 8))
        return 0;
    if (off % 8) {
        fail("word offset %llu is not 8-byte aligned", off);
        return 0;
    }
    return 1;
}

/* load_u64(off) -> int */
static PyObject *Memory_load_u64(MemoryObject *self, PyObject *args)
{
    unsigned long long off;
    uint64_t v;
    if (!PyArg_ParseTuple(args, "K", &off) || !word_ok(self, off))
        return NULL;
    self->mem.ops->load(&self->mem, off, &v, 8);
    return PyLong_FromUnsignedLongLong(v);
}

/* store_u64(off, value) */
static PyObject *Memory_store_u64(MemoryObject *self, PyObject *args)
{
    unsigned long long off, v;
    if (!PyArg_ParseTuple(args, "KK", &off, &v) || !word_ok(self, off))
        return NULL;
    uint64_t w = v;
    self->mem.ops->store(&self->mem, off, &w, 8);
    Py_RETURN_NONE;
}

/* Check a block's header and payload placement. */
static int block_ok(MemoryObject *self, unsigned long long hdr_off, unsigned long long payload_off,
                    Py_buffer *digest)
{
    if (digest->len != 16) {
        fail("a block key digest is 16 bytes, got %zd", digest->len);
        return 0;
    }
    if (hdr_off % BL_LINE) {
        fail("header offset %llu is not on a %u-byte line", hdr_off, BL_LINE);
        return 0;
    }
    return in_range(self, hdr_off, BL_LINE) && in_range(self, payload_off, 0);
}

/* Validate a block's placement and fill the fields every header of it carries. */
static int block_proto(MemoryObject *self, unsigned long long hdr_off,
                       unsigned long long payload_off, Py_buffer *digest,
                       unsigned long long version, unsigned long long length, unsigned int key_len,
                       unsigned int writer, unsigned int writer_gen, unsigned long long stamp,
                       bl_header *h)
{
    if (!block_ok(self, hdr_off, payload_off, digest) || !in_range(self, payload_off, length))
        return 0;
    if (hdr_off < payload_off + length && payload_off < hdr_off + BL_LINE)
        return !!fail("header [%llu, +64) overlaps the payload", hdr_off);
    if (version == 0)
        return !!fail("version 0 is reserved for 'any version'; versions start at 1");
    if (key_len > 0xffff)
        return !!fail("key_len %u does not fit the header", key_len);
    memset(h, 0, sizeof(*h));
    memcpy(h->digest, digest->buf, 16);
    h->version = version;
    h->key_len = (uint16_t)key_len;
    h->writer = writer;
    h->writer_gen = writer_gen;
    h->stamp = stamp;
    return 1;
}

/* publish(hdr_off, payload_off, digest, version, data, key_len=0, writer=0, stamp=0,
 *         writer_gen=0) */
static PyObject *Memory_publish(MemoryObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"hdr_off", "payload_off", "digest", "version", "data",
                             "key_len", "writer", "stamp", "writer_gen", NULL};
    unsigned long long hdr_off, payload_off, version, stamp = 0;
    unsigned int key_len = 0, writer = 0, writer_gen = 0;
    Py_buffer digest, data;
    bl_header h;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KKy*Ky*|IIKI", kwlist, &hdr_off, &payload_off,
                                     &digest, &version, &data, &key_len, &writer, &stamp,
                                     &writer_gen))
        return NULL;
    bl_section s;
    if (block_proto(self, hdr_off, payload_off, &digest, version, (unsigned long long)data.len,
                    key_len, writer, writer_gen, stamp, &h) &&
        enter_copy(&s, self, (size_t)data.len, 1) == 0) {
        bl_publish(&self->mem, hdr_off, payload_off, &h, data.buf, (size_t)data.len);
        bl_section_leave(&s);
    }
    PyBuffer_Release(&digest);
    PyBuffer_Release(&data);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* Shared body of begin_write() and seal(): a header for a payload written in place. */
static PyObject *in_place(MemoryObject *self, PyObject *args, PyObject *kw, int sealing)
{
    static char *kwlist[] = {"hdr_off", "payload_off", "digest", "version", "length",
                             "key_len", "writer", "stamp", "writer_gen", "crc", NULL};
    unsigned long long hdr_off, payload_off, version, length, stamp = 0;
    unsigned int key_len = 0, writer = 0, writer_gen = 0;
    PyObject *crc_obj = Py_None;
    Py_buffer digest;
    bl_header h;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KKy*KK|IIKIO", kwlist, &hdr_off, &payload_off,
                                     &digest, &version, &length, &key_len, &writer, &stamp,
                                     &writer_gen, &crc_obj))
        return NULL;
    unsigned long given = 0;
    if (crc_obj != Py_None) {
        given = PyLong_AsUnsignedLong(crc_obj);
        if ((given == (unsigned long)-1 && PyErr_Occurred()) || given > 0xffffffffUL) {
            PyErr_Clear();
            PyBuffer_Release(&digest);
            return bl_fail(PyExc_ValueError, "crc is the payload's CRC32C: an int in 0..2^32-1");
        }
        if (!sealing) {
            PyBuffer_Release(&digest);
            return bl_fail(PyExc_ValueError, "begin_write takes no crc");
        }
    }
    if (block_proto(self, hdr_off, payload_off, &digest, version, length, key_len, writer,
                    writer_gen, stamp, &h)) {
        bl_mem *m = &self->mem;
        bl_section s;
        if (!sealing) {
            bl_begin_write(m, hdr_off, &h, length);
        } else if (crc_obj != Py_None) {
            /* the CRC of the bytes as their writer put them (a GPU's, taken from its
             * source): the payload is not read back */
            bl_seal(m, hdr_off, &h, length, (uint32_t)given);
        } else if (bl_section_enter(&s, self, 1, NULL, NULL) == 0) {
            /* the checksum's MFENCE drains the caller's own payload stores first */
            bl_seal(m, hdr_off, &h, length, bl_payload_crc(m, payload_off, length));
            bl_section_leave(&s);
        }
    }
    PyBuffer_Release(&digest);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* begin_write(hdr_off, payload_off, digest, version, length, ...): header WRITING, fenced. */
static PyObject *Memory_begin_write(MemoryObject *self, PyObject *args, PyObject *kw)
{
    return in_place(self, args, kw, 0);
}

/* seal(hdr_off, payload_off, digest, version, length, ..., crc=None): header PUBLISHED with
 * the payload's CRC32C, taken in place from the pool or, given, from the writer's source. */
static PyObject *Memory_seal(MemoryObject *self, PyObject *args, PyObject *kw)
{
    return in_place(self, args, kw, 1);
}

/* check_header(hdr_off, payload_off, block_cap, digest, version) -> length or a Miss code */
static PyObject *Memory_check_header(MemoryObject *self, PyObject *args)
{
    unsigned long long hdr_off, payload_off, block_cap, version;
    Py_buffer digest;
    int64_t r = 0;
    if (!PyArg_ParseTuple(args, "KKKy*K", &hdr_off, &payload_off, &block_cap, &digest, &version))
        return NULL;
    if (block_ok(self, hdr_off, payload_off, &digest)) {
        bl_header h;
        r = bl_check_header(&self->mem, hdr_off, payload_off, digest.buf, version, block_cap, &h);
    }
    PyBuffer_Release(&digest);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromLongLong(r);
}

/* read_bytes(hdr_off, payload_off, block_cap, digest, version) -> bytes, or a Miss code */
static PyObject *Memory_read_bytes(MemoryObject *self, PyObject *args)
{
    unsigned long long hdr_off, payload_off, block_cap, version;
    Py_buffer digest;
    PyObject *out = NULL;
    if (!PyArg_ParseTuple(args, "KKKy*K", &hdr_off, &payload_off, &block_cap, &digest, &version))
        return NULL;
    if (block_ok(self, hdr_off, payload_off, &digest)) {
        bl_header h;
        int64_t r = bl_check_header(&self->mem, hdr_off, payload_off, digest.buf, version,
                                    block_cap, &h);
        if (r >= 0)
            out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)r);
        bl_section s;
        if (out && enter_copy(&s, self, (size_t)r, 1) < 0)
            Py_CLEAR(out);
        if (out) { /* the value, read exactly once, into the object returned */
            r = bl_read_validated(&self->mem, hdr_off, payload_off, digest.buf, version, block_cap,
                                  PyBytes_AS_STRING(out), (size_t)r, &h);
            bl_section_leave(&s);
            if (r < 0 || r != PyBytes_GET_SIZE(out))
                Py_CLEAR(out); /* changed under us: a miss */
        }
        if (!out && !PyErr_Occurred())
            out = PyLong_FromLongLong(r < 0 ? r : BL_MISS_CHANGED);
    }
    PyBuffer_Release(&digest);
    return out;
}

/* read_validated(hdr_off, payload_off, block_cap, digest, version, out) -> int */
static PyObject *Memory_read_validated(MemoryObject *self, PyObject *args)
{
    unsigned long long hdr_off, payload_off, block_cap, version;
    Py_buffer digest, out;
    int64_t r = 0;
    if (!PyArg_ParseTuple(args, "KKKy*Kw*", &hdr_off, &payload_off, &block_cap, &digest, &version,
                          &out))
        return NULL;
    bl_section s;
    if (block_ok(self, hdr_off, payload_off, &digest) &&
        enter_copy(&s, self, (size_t)out.len, 1) == 0) {
        bl_header seen;
        r = bl_read_validated(&self->mem, hdr_off, payload_off, digest.buf, version, block_cap,
                              out.buf, (size_t)out.len, &seen);
        bl_section_leave(&s);
        if (r == BL_TOO_SMALL)
            fail("the buffer holds %zd bytes but the value is %llu bytes; pass a buffer of at "
                 "least that size",
                 out.len, (unsigned long long)seen.length);
    }
    PyBuffer_Release(&digest);
    PyBuffer_Release(&out);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromLongLong(r);
}

/* A scatter-gather table and the buffers its rows name, held while it runs. */
typedef struct {
    Py_buffer table;
    Py_buffer *bufs;
    uint8_t **ptrs; /* bufs[i].buf */
    Py_ssize_t nbufs, nrows;
    const uint64_t *rows;
    uint64_t total;
} sg_job;

/* Release whatever an sg_job holds. */
static void sg_release(sg_job *job)
{
    for (Py_ssize_t i = 0; i < job->nbufs; i++)
        if (job->bufs[i].obj)
            PyBuffer_Release(&job->bufs[i]);
    PyMem_Free(job->bufs);
    PyMem_Free(job->ptrs);
    if (job->table.obj)
        PyBuffer_Release(&job->table);
}

/* Acquire the buffers and check every row (bl_sg_check) before any byte moves. */
static int sg_prepare(MemoryObject *self, PyObject *bufs, PyObject *table, int writable,
                      sg_job *job)
{
    memset(job, 0, sizeof(*job));
    if (!attached(self))
        return -1;
    if (PyObject_GetBuffer(table, &job->table, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (job->table.itemsize != 8 || job->table.len % 32) {
        fail("the scatter-gather table must be uint64 rows of 4 "
             "(buffer index, buffer offset, pool offset, length)");
        return -1;
    }
    PyObject *seq = PySequence_Fast(bufs, "buffers must be a sequence of buffer objects");
    if (!seq)
        return -1;
    job->nbufs = PySequence_Fast_GET_SIZE(seq);
    size_t slots = job->nbufs ? (size_t)job->nbufs : 1;
    job->bufs = PyMem_Calloc(slots, sizeof(Py_buffer));
    job->ptrs = PyMem_Calloc(slots, sizeof(uint8_t *));
    size_t *lens = PyMem_Calloc(slots, sizeof(size_t));
    if (!job->bufs || !job->ptrs || !lens) {
        Py_DECREF(seq);
        PyMem_Free(lens);
        PyErr_NoMemory();
        return -1;
    }
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    for (Py_ssize_t i = 0; i < job->nbufs; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &job->bufs[i], flags) < 0) {
            job->bufs[i].obj = NULL;
            Py_DECREF(seq);
            PyMem_Free(lens);
            return -1;
        }
        job->ptrs[i] = job->bufs[i].buf;
        lens[i] = (size_t)job->bufs[i].len;
    }
    Py_DECREF(seq);
    job->rows = job->table.buf;
    job->nrows = job->table.len / 32;
    char why[BL_SG_WHY];
    int rc = bl_sg_check(job->rows, (size_t)job->nrows, lens, (size_t)job->nbufs, self->mem.size,
                         &job->total, why);
    PyMem_Free(lens);
    if (rc < 0)
        fail("%s", why);
    return rc;
}

/* Shared body of gather_write() and scatter_read(). */
static PyObject *sg_common(MemoryObject *self, PyObject *args, int write)
{
    PyObject *bufs, *table;
    sg_job job;
    if (!PyArg_ParseTuple(args, "OO", &bufs, &table))
        return NULL;
    bl_section s;
    if (sg_prepare(self, bufs, table, !write, &job) == 0 &&
        enter_copy(&s, self, job.total, (size_t)job.nrows) == 0) {
        bl_sg_run(&self->mem, job.rows, (size_t)job.nrows, job.ptrs, write);
        bl_section_leave(&s);
    }
    sg_release(&job);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromUnsignedLongLong(job.total);
}

/* Parse read_blocks' block tuples (hdr_off, payload_off, cap, digest, version); 0 or -1. */
static int parse_read_blocks(MemoryObject *self, PyObject *seq, bl_blockio *out, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long hdr, payload, cap, version;
        const char *digest;
        Py_ssize_t dlen;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KKKy#K;a block is (hdr_off, "
                              "payload_off, cap, digest, version)", &hdr, &payload, &cap, &digest,
                              &dlen, &version))
            return -1;
        if (dlen != 16)
            return !!fail("a block key digest is 16 bytes, got %zd", dlen) - 1;
        if (hdr % BL_LINE || !in_range(self, hdr, BL_LINE) || !in_range(self, payload, cap))
            return !!fail("block %zd: header %llu or extent [%llu, +%llu) is not a place in "
                          "this pool", i, hdr, payload, cap) - 1;
        out[i] = (bl_blockio){.hdr_off = hdr, .payload_off = payload, .cap = cap,
                              .digest = (const uint8_t *)digest, .version = version};
    }
    return 0;
}

/* Parse write_blocks' block tuples (hdr_off, payload_off, digest, version, length, key_len,
 * writer, writer_gen); 0 or -1. */
static int parse_write_blocks(MemoryObject *self, PyObject *seq, bl_blockio *out, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long hdr, payload, version, length;
        unsigned int key_len, writer, writer_gen;
        Py_buffer digest;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KKy*KKIII;a block is (hdr_off, "
                              "payload_off, digest, version, length, key_len, writer, writer_gen)",
                              &hdr, &payload, &digest, &version, &length, &key_len, &writer,
                              &writer_gen))
            return -1;
        bl_blockio *b = &out[i];
        *b = (bl_blockio){.hdr_off = hdr, .payload_off = payload, .cap = length,
                          .version = version, .length = length};
        int ok = block_proto(self, hdr, payload, &digest, version, length, key_len, writer,
                             writer_gen, 0, &b->proto);
        PyBuffer_Release(&digest);
        if (!ok)
            return -1;
        b->digest = b->proto.digest;
    }
    return 0;
}

/* Shared body of read_blocks() and write_blocks(): buffers, table and blocks in, C core run. */
static PyObject *blocks_common(MemoryObject *self, PyObject *args, int write)
{
    PyObject *bufs, *table, *blocks;
    if (!PyArg_ParseTuple(args, "OOO", &bufs, &table, &blocks))
        return NULL;
    PyObject *seq = PySequence_Fast(blocks, "blocks must be a sequence of tuples");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    bl_blockio *bio = PyMem_Calloc(n ? (size_t)n : 1, sizeof(bl_blockio));
    PyObject *out = NULL;
    sg_job job;
    memset(&job, 0, sizeof(job));
    if (!bio) {
        PyErr_NoMemory();
        goto done;
    }
    if ((write ? parse_write_blocks(self, seq, bio, n) : parse_read_blocks(self, seq, bio, n)) < 0)
        goto done;
    if (sg_prepare(self, bufs, table, !write, &job) < 0)
        goto done;
    bl_section s;
    if (enter_copy(&s, self, job.total, (size_t)job.nrows) < 0)
        goto done;
    const char *why = NULL;
    int rc = write ? bl_write_blocks(&self->mem, bio, (size_t)n, job.rows, (size_t)job.nrows,
                                     (const uint8_t *const *)job.ptrs, &why)
                   : bl_read_blocks(&self->mem, bio, (size_t)n, job.rows, (size_t)job.nrows,
                                    job.ptrs, NULL, &why);
    bl_section_leave(&s);
    if (rc < 0) {
        fail("%s", why);
        goto done;
    }
    if (write) {
        out = PyLong_FromUnsignedLongLong(job.total);
        goto done;
    }
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *r = PyLong_FromLongLong(bio[i].result);
        if (!r)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, r);
    }
done:
    sg_release(&job);
    PyMem_Free(bio);
    Py_DECREF(seq);
    return out;
}

/* read_blocks(buffers, table, blocks) -> [length or Miss code per block], validated. */
static PyObject *Memory_read_blocks(MemoryObject *self, PyObject *args)
{
    return blocks_common(self, args, 0);
}

/* write_blocks(buffers, table, blocks) -> bytes moved; every block sealed with its CRC. */
static PyObject *Memory_write_blocks(MemoryObject *self, PyObject *args)
{
    return blocks_common(self, args, 1);
}

/* gather_write(buffers, table) -> bytes moved: pieces of local buffers into the pool. */
static PyObject *Memory_gather_write(MemoryObject *self, PyObject *args)
{
    return sg_common(self, args, 1);
}

/* scatter_read(buffers, table) -> bytes moved: pool ranges into pieces of local buffers. */
static PyObject *Memory_scatter_read(MemoryObject *self, PyObject *args)
{
    return sg_common(self, args, 0);
}

/* check_headers(blocks) -> (results, crcs, lines): read_blocks' block tuples (hdr_off,
 * payload_off, cap, digest, version); per block its length or a Miss code and the payload
 * CRC32C its header carries, and the header lines as loaded (64 bytes each). */
static PyObject *Memory_check_headers(MemoryObject *self, PyObject *args)
{
    PyObject *blocks;
    if (!PyArg_ParseTuple(args, "O", &blocks) || !attached(self))
        return NULL;
    PyObject *seq = PySequence_Fast(blocks, "blocks must be a sequence of tuples");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    bl_blockio *bio = PyMem_Calloc(n ? (size_t)n : 1, sizeof(bl_blockio));
    PyObject *lines = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)BL_LINE);
    PyObject *results = PyList_New(n), *crcs = PyList_New(n), *out = NULL;
    if (!bio || !lines || !results || !crcs) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto done;
    }
    if (parse_read_blocks(self, seq, bio, n) < 0)
        goto done;
    bl_header *h = (bl_header *)PyBytes_AS_STRING(lines);
    bl_check_headers(&self->mem, bio, (size_t)n, h);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *r = PyLong_FromLongLong(bio[i].result);
        PyObject *c = PyLong_FromUnsignedLong(h[i].payload_crc);
        if (!r || !c) {
            Py_XDECREF(r);
            Py_XDECREF(c);
            goto done;
        }
        PyList_SET_ITEM(results, i, r);
        PyList_SET_ITEM(crcs, i, c);
    }
    out = PyTuple_Pack(3, results, crcs, lines);
done:
    Py_XDECREF(results);
    Py_XDECREF(crcs);
    Py_XDECREF(lines);
    PyMem_Free(bio);
    Py_DECREF(seq);
    return out;
}

/* invalidate_stale(ranges) -> bytes invalidated: ranges a device is about to read, a
 * C-contiguous uint64 array of rows (pool offset, length, block version or 0); see
 * record.c for which granules are invalidated, then one MFENCE. */
static PyObject *Memory_invalidate_stale(MemoryObject *self, PyObject *args)
{
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "y*", &b))
        return NULL;
    size_t n = (size_t)b.len / 24, bytes = 0;
    const uint64_t *r = b.buf;
    int ok = attached(self);
    if (ok && b.len % 24) {
        fail("ranges must be uint64 rows of 3 (pool offset, length, version)");
        ok = 0;
    }
    for (size_t i = 0; ok && i < n; i++)
        ok = in_range(self, r[3 * i], r[3 * i + 1]);
    if (ok)
        bytes = bl_invalidate_stale(&self->mem, r, n);
    PyBuffer_Release(&b);
    if (!ok)
        return NULL;
    return PyLong_FromSize_t(bytes);
}

/* dma_read(off, buffer): fill a buffer as a device's read through this host sees the
 * mapping (a CPU stand-in of a GPU; the model serves this host's cached lines). */
static PyObject *Memory_dma_read(MemoryObject *self, PyObject *args)
{
    unsigned long long off;
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "Kw*", &off, &b))
        return NULL;
    if (in_range(self, off, (unsigned long long)b.len))
        self->mem.ops->dma_load(&self->mem, off, b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* dma_write(off, data): store as a device's write through this host does (the model drops
 * this host's cached copies of the lines). */
static PyObject *Memory_dma_write(MemoryObject *self, PyObject *args)
{
    unsigned long long off;
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "Ky*", &off, &b))
        return NULL;
    if (in_range(self, off, (unsigned long long)b.len))
        self->mem.ops->dma_store(&self->mem, off, b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* record_state(off) -> the read record's state of the granule holding off (record.c):
 * "start", "clean", "touched", or the block version whose bytes its lines may hold. */
static PyObject *Memory_record_state(MemoryObject *self, PyObject *args)
{
    unsigned long long off;
    if (!PyArg_ParseTuple(args, "K", &off) || !in_range(self, off, 1))
        return NULL;
    uint64_t st = bl_record_state(&self->mem, off);
    if (st == BL_REC_START)
        return PyUnicode_FromString("start");
    if (st == BL_REC_CLEAN)
        return PyUnicode_FromString("clean");
    if (st == BL_REC_TOUCHED)
        return PyUnicode_FromString("touched");
    return PyLong_FromUnsignedLongLong(st);
}

/* discard(): model mode only: forget unflushed lines, as a crashed host does. */
static PyObject *Memory_discard(MemoryObject *self, PyObject *unused)
{
    if (!attached(self))
        return NULL;
    if (self->mem.model)
        bl_model_discard(self->mem.model);
    Py_RETURN_NONE;
}

/* crash_after(lines): model mode only: the host dies once `lines` more writes land. */
static PyObject *Memory_crash_after(MemoryObject *self, PyObject *args)
{
    unsigned long long lines;
    if (!PyArg_ParseTuple(args, "K", &lines) || !attached(self))
        return NULL;
    if (!self->mem.model)
        return fail("crash_after() needs a model-mode Memory (a real host cannot be told to die)");
    bl_model_crash_after(self->mem.model, lines);
    Py_RETURN_NONE;
}

/* model_stats() -> dict, or None in native mode. */
static PyObject *Memory_model_stats(MemoryObject *self, PyObject *unused)
{
    if (!attached(self))
        return NULL;
    if (!self->mem.model)
        Py_RETURN_NONE;
    uint64_t s[BL_MODEL_NSTATS];
    bl_model_stats(self->mem.model, s);
    return Py_BuildValue("{sKsKsKsKsKsKsKsKsKsO}", "hits", s[BL_MS_HITS], "misses",
                         s[BL_MS_MISSES], "writebacks", s[BL_MS_WRITEBACKS], "evictions",
                         s[BL_MS_EVICTIONS], "discarded", s[BL_MS_DISCARDED], "early_drains",
                         s[BL_MS_EARLY_DRAINS], "refills", s[BL_MS_REFILLS], "dirty_dropped",
                         s[BL_MS_DIRTY_DROPPED], "landed", s[BL_MS_LANDED], "crashed",
                         bl_model_crashed(self->mem.model) ? Py_True : Py_False);
}

/* mode: "native" or "model". */
static PyObject *Memory_get_mode(MemoryObject *self, void *c)
{
    const bl_memops *t = self->mem.inner ? self->mem.inner : self->mem.ops;
    return PyUnicode_FromString(t && self->has_view ? t->name : "unattached");
}

/* size: bytes mapped (0 once released). */
static PyObject *Memory_get_size(MemoryObject *self, void *c)
{
    return PyLong_FromSize_t(self->has_view ? self->mem.size : 0);
}

/* record_granule: bytes per granule of the read record (record.c). */
static PyObject *Memory_get_record_granule(MemoryObject *self, void *c)
{
    return PyLong_FromSize_t(self->mem.rec ? (size_t)1 << self->mem.rec_shift : 0);
}

/* busy: sections running over the mapping now (copies without the GIL, RPC loops). */
static PyObject *Memory_get_busy(MemoryObject *self, void *c)
{
    return PyLong_FromLong(atomic_load(&self->busy));
}

/* released: whether release() ran. */
static PyObject *Memory_get_released(MemoryObject *self, void *c)
{
    return PyBool_FromLong(!self->has_view);
}

static PyMethodDef Memory_methods[] = {
    {"load", (PyCFunction)Memory_load, METH_VARARGS, "load(off, n) -> bytes"},
    {"load_into", (PyCFunction)Memory_load_into, METH_VARARGS, "load_into(off, buffer)"},
    {"store", (PyCFunction)Memory_store, METH_VARARGS, "store(off, data): plain stores"},
    {"nt_store", (PyCFunction)Memory_nt_store, METH_VARARGS, "nt_store(off, data)"},
    {"flush", (PyCFunction)Memory_flush, METH_VARARGS, "flush(off, n): write back and drop"},
    {"writeback", (PyCFunction)Memory_writeback, METH_VARARGS, "writeback(off, n): keep lines"},
    {"invalidate", (PyCFunction)Memory_invalidate, METH_VARARGS, "invalidate(off, n)"},
    {"sfence", (PyCFunction)Memory_sfence, METH_NOARGS, "store fence"},
    {"mfence", (PyCFunction)Memory_mfence, METH_NOARGS, "full fence"},
    {"load_u64", (PyCFunction)Memory_load_u64, METH_VARARGS, "load_u64(off) -> int"},
    {"store_u64", (PyCFunction)Memory_store_u64, METH_VARARGS, "store_u64(off, value)"},
    {"publish", (PyCFunction)(void (*)(void))Memory_publish, METH_VARARGS | METH_KEYWORDS,
     "publish(hdr_off, payload_off, digest, version, data, key_len=0, writer=0, stamp=0, "
     "writer_gen=0)"},
    {"begin_write", (PyCFunction)(void (*)(void))Memory_begin_write, METH_VARARGS | METH_KEYWORDS,
     "begin_write(hdr_off, payload_off, digest, version, length, key_len=0, writer=0, stamp=0, "
     "writer_gen=0)"},
    {"seal", (PyCFunction)(void (*)(void))Memory_seal, METH_VARARGS | METH_KEYWORDS,
     "seal(hdr_off, payload_off, digest, version, length, key_len=0, writer=0, stamp=0, "
     "writer_gen=0)"},
    {"check_header", (PyCFunction)Memory_check_header, METH_VARARGS,
     "check_header(hdr_off, payload_off, block_cap, digest, version) -> int"},
    {"read_bytes", (PyCFunction)Memory_read_bytes, METH_VARARGS,
     "read_bytes(hdr_off, payload_off, block_cap, digest, version) -> bytes | int"},
    {"read_validated", (PyCFunction)Memory_read_validated, METH_VARARGS,
     "read_validated(hdr_off, payload_off, block_cap, digest, version, out) -> int"},
    {"gather_write", (PyCFunction)Memory_gather_write, METH_VARARGS,
     "gather_write(buffers, table) -> bytes moved"},
    {"read_blocks", (PyCFunction)Memory_read_blocks, METH_VARARGS,
     "read_blocks(buffers, table, blocks) -> [length or Miss code]: whole blocks, each "
     "validated (header, CRC32C of the bytes as copied, header again)"},
    {"write_blocks", (PyCFunction)Memory_write_blocks, METH_VARARGS,
     "write_blocks(buffers, table, blocks) -> bytes moved: whole blocks, each sealed with "
     "the CRC32C of what was written"},
    {"scatter_read", (PyCFunction)Memory_scatter_read, METH_VARARGS,
     "scatter_read(buffers, table) -> bytes moved"},
    {"check_headers", (PyCFunction)Memory_check_headers, METH_VARARGS,
     "check_headers(blocks) -> (results, crcs, header lines): read_blocks' first and last "
     "steps, for a payload another agent moves"},
    {"invalidate_stale", (PyCFunction)Memory_invalidate_stale, METH_VARARGS,
     "invalidate_stale(ranges) -> bytes invalidated before a device reads (offset, length, "
     "version) rows: only granules this host may hold stale lines of"},
    {"dma_read", (PyCFunction)Memory_dma_read, METH_VARARGS,
     "dma_read(off, buffer): read as a device through this host sees the mapping"},
    {"dma_write", (PyCFunction)Memory_dma_write, METH_VARARGS,
     "dma_write(off, data): write as a device through this host does"},
    {"record_state", (PyCFunction)Memory_record_state, METH_VARARGS,
     "record_state(off) -> 'start', 'clean', 'touched' or a version (the read record)"},
    {"discard", (PyCFunction)Memory_discard, METH_NOARGS, "model: drop unflushed lines"},
    {"crash_after", (PyCFunction)Memory_crash_after, METH_VARARGS,
     "crash_after(lines): model: the host dies once `lines` more of its writes reach memory"},
    {"model_stats", (PyCFunction)Memory_model_stats, METH_NOARGS, "model cache counters"},
    {"release", (PyCFunction)(void (*)(void))Memory_release, METH_VARARGS | METH_KEYWORDS,
     "release(timeout_s=2.0): wait for running sections, then detach from the buffer"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Memory_getset[] = {
    {"mode", (getter)Memory_get_mode, NULL, "native or model", NULL},
    {"size", (getter)Memory_get_size, NULL, "bytes mapped", NULL},
    {"released", (getter)Memory_get_released, NULL, "True after release()", NULL},
    {"busy", (getter)Memory_get_busy, NULL, "sections running over the mapping", NULL},
    {"record_granule", (getter)Memory_get_record_granule, NULL,
     "bytes per granule of the read record", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject BlMemoryType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = BL_TYPE_PREFIX "Memory",
    .tp_basicsize = sizeof(MemoryObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One host's coherent-or-not view of a shared mapping.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Memory_init,
    .tp_dealloc = (destructor)Memory_dealloc,
    .tp_methods = Memory_methods,
    .tp_getset = Memory_getset,
};

/* Add the Memory type to the module. */
int bl_memory_init(PyObject *module)
{
    if (PyType_Ready(&BlMemoryType) < 0)
        return -1;
    Py_INCREF(&BlMemoryType);
    return PyModule_AddObject(module, "Memory", (PyObject *)&BlMemoryType);
}
