/*
 * module.c - the Python face of the C core: the Memory type and helpers.
 *
 * A Memory wraps one writable buffer (an mmap of the pool) and the memops
 * table picked for it at construction: "native" or "model".  Every offset
 * and length is checked against the mapping before anything is touched, so
 * misuse from Python raises (the error class is registered by the Python
 * package) instead of crashing.
 *
 * Long copies here, and the RPC loops in rpc.c, run without the GIL inside a
 * *section* (bl_section_enter / bl_section_leave).  A section counts itself
 * busy before it checks that the Memory is attached and not closing;
 * release() marks the Memory closing before it looks at the busy count (the
 * two orders make a Dekker pair: one side always sees the other).  release()
 * then waits, with the GIL released, up to its timeout for sections to end:
 * copies are bounded, and RPC loops poll the closing mark and return at once.
 * If sections are still running at the timeout, release() raises and leaves
 * the mapping attached, so a caller never unmaps memory a loop still reads.
 */
#include <sched.h>
#include <time.h>
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "beluga_native.h"

/* beluga.errors.CoherenceError and RpcError, once the package registers them */
PyObject *bl_coherence_error, *bl_rpc_error;
#define RELEASE_WAIT_S 2.0 /* default wait of release() for running sections */

/* Raise cls (ValueError until the package registers its classes); returns NULL. */
PyObject *bl_fail(PyObject *cls, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    PyObject *msg = PyUnicode_FromFormatV(fmt, ap);
    va_end(ap);
    if (msg) {
        PyErr_SetObject(cls ? cls : PyExc_ValueError, msg);
        Py_DECREF(msg);
    }
    return NULL;
}

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

/* Enter a section over mem (drop the GIL if asked); -1 with cls raised if released or closing. */
int bl_section_enter(bl_section *s, MemoryObject *mem, int drop_gil, PyObject *cls,
                     const char *why)
{
    s->mem = mem, s->ts = NULL;
    atomic_fetch_add(&mem->busy, 1);
    if (!mem->has_view || atomic_load(&mem->closing)) {
        atomic_fetch_sub(&mem->busy, 1);
        bl_fail(cls ? cls : bl_coherence_error, "%s",
                why ? why : "this Memory was released (or is being released); attach the pool again");
        return -1;
    }
    if (drop_gil)
        s->ts = PyEval_SaveThread();
    return 0;
}

/* Inside a section: drop the GIL (drop=1) or take it back (drop=0); idempotent. */
void bl_section_gil(bl_section *s, int drop)
{
    if (drop && !s->ts)
        s->ts = PyEval_SaveThread();
    else if (!drop && s->ts) {
        PyEval_RestoreThread(s->ts);
        s->ts = NULL;
    }
}

/* Leave a section: take the GIL back first, then stop counting busy. */
void bl_section_leave(bl_section *s)
{
    bl_section_gil(s, 0);
    atomic_fetch_sub(&s->mem->busy, 1);
}

/* Whether a release() is waiting for this section to end. */
int bl_section_closing(const bl_section *s)
{
    return atomic_load_explicit(&s->mem->closing, memory_order_relaxed) != 0;
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
    self->mem.ops = model ? bl_model_ops() : bl_native_ops();
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
                             "key_len", "writer", "stamp", "writer_gen", NULL};
    unsigned long long hdr_off, payload_off, version, length, stamp = 0;
    unsigned int key_len = 0, writer = 0, writer_gen = 0;
    Py_buffer digest;
    bl_header h;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KKy*KK|IIKI", kwlist, &hdr_off, &payload_off,
                                     &digest, &version, &length, &key_len, &writer, &stamp,
                                     &writer_gen))
        return NULL;
    if (block_proto(self, hdr_off, payload_off, &digest, version, length, key_len, writer,
                    writer_gen, stamp, &h)) {
        bl_mem *m = &self->mem;
        bl_section s;
        if (!sealing) {
            bl_begin_write(m, hdr_off, &h, length);
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

/* seal(hdr_off, payload_off, digest, version, length, ...): checksum in place, header PUBLISHED. */
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

/* An scatter-gather table: rows of (buffer index, buffer offset, pool offset, length). */
typedef struct {
    Py_buffer table;
    Py_buffer *bufs;
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
    if (job->table.obj)
        PyBuffer_Release(&job->table);
}

/* Acquire the buffers and check every row before any byte moves. */
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
    job->bufs = PyMem_Calloc(job->nbufs ? (size_t)job->nbufs : 1, sizeof(Py_buffer));
    if (!job->bufs) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    for (Py_ssize_t i = 0; i < job->nbufs; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &job->bufs[i], flags) < 0) {
            job->bufs[i].obj = NULL;
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    job->rows = job->table.buf;
    job->nrows = job->table.len / 32;
    for (Py_ssize_t r = 0; r < job->nrows; r++) {
        const uint64_t *row = job->rows + 4 * r;
        if (row[0] >= (uint64_t)job->nbufs) {
            fail("row %zd names buffer %llu but only %zd were given", r,
                 (unsigned long long)row[0], job->nbufs);
            return -1;
        }
        uint64_t blen = (uint64_t)job->bufs[row[0]].len;
        if (row[1] > blen || row[3] > blen - row[1]) {
            fail("row %zd: [%llu, +%llu) is outside buffer %llu (%llu bytes)", r,
                 (unsigned long long)row[1], (unsigned long long)row[3],
                 (unsigned long long)row[0], (unsigned long long)blen);
            return -1;
        }
        if (row[2] > self->mem.size || row[3] > self->mem.size - row[2]) {
            fail("row %zd: pool range [%llu, +%llu) is outside the %zu-byte mapping", r,
                 (unsigned long long)row[2], (unsigned long long)row[3], self->mem.size);
            return -1;
        }
        job->total += row[3];
    }
    return 0;
}

/* Execute a validated job: gather-write (non-temporal) or scatter-read (invalidating). */
static void sg_run(bl_mem *m, sg_job *job, int write)
{
    const uint64_t *row = job->rows;
    if (write) {
        for (Py_ssize_t r = 0; r < job->nrows; r++, row += 4)
            m->ops->nt_store(m, row[2], (uint8_t *)job->bufs[row[0]].buf + row[1], row[3]);
        if (BL_STEP(GATHER_FENCE))
            m->ops->sfence(m);
        return;
    }
    if (BL_STEP(SCATTER_INVALIDATE))
        for (Py_ssize_t r = 0; r < job->nrows; r++, row += 4)
            m->ops->invalidate(m, row[2], row[3]);
    if (BL_STEP(SCATTER_MFENCE))
        m->ops->mfence(m);
    row = job->rows;
    for (Py_ssize_t r = 0; r < job->nrows; r++, row += 4)
        m->ops->load(m, row[2], (uint8_t *)job->bufs[row[0]].buf + row[1], row[3]);
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
        sg_run(&self->mem, &job, write);
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
    uint8_t **ptrs = NULL;
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
    ptrs = PyMem_Calloc(job.nbufs ? (size_t)job.nbufs : 1, sizeof(uint8_t *));
    if (!ptrs) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < job.nbufs; i++)
        ptrs[i] = job.bufs[i].buf;
    bl_section s;
    if (enter_copy(&s, self, job.total, (size_t)job.nrows) < 0)
        goto done;
    const char *why = NULL;
    int rc = write ? bl_write_blocks(&self->mem, bio, (size_t)n, job.rows, (size_t)job.nrows,
                                     (const uint8_t *const *)ptrs, &why)
                   : bl_read_blocks(&self->mem, bio, (size_t)n, job.rows, (size_t)job.nrows,
                                    ptrs, &why);
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
    PyMem_Free(ptrs);
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
    return PyUnicode_FromString(self->mem.ops ? self->mem.ops->name : "unattached");
}

/* size: bytes mapped (0 once released). */
static PyObject *Memory_get_size(MemoryObject *self, void *c)
{
    return PyLong_FromSize_t(self->has_view ? self->mem.size : 0);
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

/* crc32c(data, crc=0) -> int: CRC32C, chainable like zlib.crc32. */
static PyObject *mod_crc32c(PyObject *mod, PyObject *args)
{
    Py_buffer b;
    unsigned int crc = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &b, &crc))
        return NULL;
    uint32_t r = ~bl_crc32c(~crc, b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(r);
}

/* crc32c_combine(crc_a, crc_b, len_b) -> the CRC32C of A || B. */
static PyObject *mod_crc32c_combine(PyObject *mod, PyObject *args)
{
    unsigned int a, b;
    unsigned long long len_b;
    if (!PyArg_ParseTuple(args, "IIK", &a, &b, &len_b))
        return NULL;
    return PyLong_FromUnsignedLong(bl_crc32c_combine(a, b, len_b));
}

/* parse_header(line) -> tuple of fields, or None when not a valid header. */
static PyObject *mod_parse_header(PyObject *mod, PyObject *args)
{
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "y*", &b))
        return NULL;
    if (b.len != BL_LINE) {
        PyBuffer_Release(&b);
        return fail("a block header is %u bytes, got %zd", BL_LINE, b.len);
    }
    bl_header h;
    memcpy(&h, b.buf, sizeof(h));
    PyBuffer_Release(&b);
    if (!bl_header_check(&h))
        Py_RETURN_NONE;
    return Py_BuildValue("(HKy#KIHIKI)", h.state, (unsigned long long)h.version, h.digest,
                         (Py_ssize_t)16, (unsigned long long)h.length, h.payload_crc, h.key_len,
                         h.writer, (unsigned long long)h.stamp, h.writer_gen);
}

/* selected() -> dict: the instruction chosen for each operation. */
static PyObject *mod_selected(PyObject *mod, PyObject *unused)
{
    return Py_BuildValue("{ssssssssss}", "flush", bl_selected("flush"), "writeback",
                         bl_selected("writeback"), "invalidate", bl_selected("invalidate"), "nt",
                         bl_selected("nt"), "crc", bl_selected("crc"));
}

/* memops_selfcheck() -> [problem, ...]: what the native table does, watched (memops.c). */
static PyObject *mod_memops_selfcheck(PyObject *mod, PyObject *unused)
{
    char problems[BL_SELFCHECK_BYTES];
    int n;
    Py_BEGIN_ALLOW_THREADS
    n = bl_memops_selfcheck(problems, sizeof(problems));
    Py_END_ALLOW_THREADS
    PyObject *out = PyList_New(0);
    for (const char *p = problems; out && n-- > 0; p += strlen(p) + 1) {
        PyObject *text = PyUnicode_FromString(p);
        if (!text || PyList_Append(out, text) < 0)
            Py_CLEAR(out);
        Py_XDECREF(text);
    }
    return out;
}

/* The sabotage table as a tuple of (name, where, step, why). */
static PyObject *points_table(void)
{
    PyObject *t = PyTuple_New(BL_NPOINTS);
    for (int i = 0; t && i < BL_NPOINTS; i++) {
        const bl_point *p = &bl_points[i];
        PyObject *row = Py_BuildValue("(ssss)", p->name, p->where, p->step, p->why);
        if (!row)
            Py_CLEAR(t);
        else
            PyTuple_SET_ITEM(t, i, row);
    }
    return t;
}

/* A named integer constant of the C core, as exported to Python (why: NULL or its meaning). */
typedef struct {
    const char *name;
    long value;
    const char *why;
} named_int;

#define BL_STATE_ROW(name, value) {#name, value, NULL},
#define BL_MISS_ROW(name, code, why) {#name, code, why},
static const named_int block_states[] = {BL_BLOCK_STATES(BL_STATE_ROW)};
static const named_int miss_codes[] = {BL_MISS_CODES(BL_MISS_ROW)};
#undef BL_STATE_ROW
#undef BL_MISS_ROW

/* A table of named constants as a tuple of (name, value) or (name, value, why), in order. */
static PyObject *named_ints(const named_int *table, size_t n)
{
    PyObject *t = PyTuple_New((Py_ssize_t)n);
    for (size_t i = 0; t && i < n; i++) {
        const named_int *c = &table[i];
        PyObject *row = c->why ? Py_BuildValue("(sls)", c->name, c->value, c->why)
                               : Py_BuildValue("(sl)", c->name, c->value);
        if (!row)
            Py_CLEAR(t);
        else
            PyTuple_SET_ITEM(t, (Py_ssize_t)i, row);
    }
    return t;
}

/* _arm(name): sabotage build only: skip the named step from now on. */
static PyObject *mod_arm(PyObject *mod, PyObject *args)
{
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name))
        return NULL;
    if (bl_sabotage_arm(name) < 0)
        return bl_fail(PyExc_ValueError, "cannot arm %s: %s", name,
                       BL_SABOTAGE_BUILD ? "no such sabotage point"
                                         : "the production core has no sabotage points");
    Py_RETURN_NONE;
}

/* armed() -> the armed point's name, or None. */
static PyObject *mod_armed(PyObject *mod, PyObject *unused)
{
    int p = bl_sabotage_armed();
    if (p < 0)
        Py_RETURN_NONE;
    return PyUnicode_FromString(bl_points[p].name);
}

/* _fired(name): a Python point skipped its step (recorded as for C points). */
static PyObject *mod_fired(PyObject *mod, PyObject *args)
{
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name))
        return NULL;
    for (int i = 0; i < BL_NPOINTS; i++)
        if (!strcmp(bl_points[i].name, name))
            bl_sabotage_fired(i);
    Py_RETURN_NONE;
}

/* cpu_features() -> dict of the CPUID bits the core looks at. */
static PyObject *mod_cpu_features(PyObject *mod, PyObject *unused)
{
    return Py_BuildValue("{sOsOsOsO}", "sse4.2", bl_cpu_has("sse4.2") ? Py_True : Py_False,
                         "avx512f", bl_cpu_has("avx512f") ? Py_True : Py_False, "clflushopt",
                         bl_cpu_has("clflushopt") ? Py_True : Py_False, "clwb",
                         bl_cpu_has("clwb") ? Py_True : Py_False);
}

/* _register_errors(coherence_cls, rpc_cls): the classes raised for misuse and RPC failures. */
static PyObject *mod_register_errors(PyObject *mod, PyObject *args)
{
    PyObject *coherence, *rpc;
    if (!PyArg_ParseTuple(args, "OO", &coherence, &rpc))
        return NULL;
    Py_INCREF(coherence);
    Py_XSETREF(bl_coherence_error, coherence);
    Py_INCREF(rpc);
    Py_XSETREF(bl_rpc_error, rpc);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"crc32c", mod_crc32c, METH_VARARGS, "crc32c(data, crc=0) -> int"},
    {"parse_header", mod_parse_header, METH_VARARGS, "parse_header(line) -> tuple | None"},
    {"crc32c_combine", mod_crc32c_combine, METH_VARARGS,
     "crc32c_combine(crc_a, crc_b, len_b) -> CRC32C of A || B"},
    {"selected", mod_selected, METH_NOARGS, "instructions in use"},
    {"cpu_features", mod_cpu_features, METH_NOARGS, "CPUID features"},
    {"memops_selfcheck", mod_memops_selfcheck, METH_NOARGS,
     "memops_selfcheck() -> [problem, ...]: the native table's flushes, watched"},
    {"_arm", mod_arm, METH_VARARGS, "_arm(name): sabotage build only"},
    {"armed", mod_armed, METH_NOARGS, "armed() -> the armed sabotage point, or None"},
    {"_fired", mod_fired, METH_VARARGS, "_fired(name): record that a point skipped its step"},
    {"_register_errors", mod_register_errors, METH_VARARGS, "set the error classes"},
    {NULL, NULL, 0, NULL},
};

#if BL_SABOTAGE_BUILD
#define BL_MODULE_NAME "_core_sabotage"
#define BL_MODULE_DOC "Beluga's C core, sabotage build (tests only: see sabotage.c)."
#define BL_MODULE_INIT PyInit__core_sabotage
#else
#define BL_MODULE_NAME "_core"
#define BL_MODULE_DOC "Beluga's C core."
#define BL_MODULE_INIT PyInit__core
#endif

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = BL_MODULE_NAME,
    .m_doc = BL_MODULE_DOC,
    .m_size = -1,
    .m_methods = module_methods,
};

/* Module init: pick instructions once, then publish the types and the sabotage table. */
PyMODINIT_FUNC BL_MODULE_INIT(void)
{
    bl_cpu_init();
    if (PyType_Ready(&BlMemoryType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&core_module);
    if (!m)
        return NULL;
    Py_INCREF(&BlMemoryType);
    if (PyModule_AddObject(m, "Memory", (PyObject *)&BlMemoryType) < 0 || bl_rpc_init(m) < 0 || bl_index_init(m) < 0 ||
        PyModule_AddIntConstant(m, "LINE", BL_LINE) < 0 ||
        PyModule_AddIntConstant(m, "HEADER_MAGIC", BL_HDR_MAGIC) < 0 ||
        PyModule_AddObject(m, "BLOCK_STATES",
                           named_ints(block_states, sizeof(block_states) / sizeof(*block_states))) < 0 ||
        PyModule_AddObject(m, "MISS_CODES",
                           named_ints(miss_codes, sizeof(miss_codes) / sizeof(*miss_codes))) < 0 ||
        PyModule_AddObject(m, "SABOTAGE_POINTS", points_table()) < 0 ||
        PyModule_AddIntConstant(m, "SABOTAGE_BUILD", BL_SABOTAGE_BUILD) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
