/*
 * rpc.c - an RPC made of shared-memory slots, polled in user space.
 *
 * DESIGN
 * Each client host owns one ring in the pool's RPC area:
 *
 *   line 0          ring control (client-written; parsed in Python)
 *   line 1          server status (server-written; parsed in Python)
 *   depth lines     request lines, one per slot, written only by the client
 *   depth lines     response lines, one per slot, written only by the server
 *   depth buffers   request payloads that do not fit a line (client-written)
 *   depth buffers   response payloads that do not fit a line (server-written)
 *
 * One writer per cache line, always.  Request number `seq` (1, 2, ...) goes in
 * slot (seq - 1) % depth; the server consumes the ring in order, so it only
 * ever looks at a window of lines after the next sequence number it expects.
 *
 * A line is a message: sequence number (the doorbell), op or status, flags,
 * length, ring generation, 40 inline payload bytes, the payload's CRC32C when
 * it lives out of line, and the line's own CRC32C.  A stale line has the wrong
 * sequence or generation; a torn line fails its CRC.  A payload that does not
 * fit inline is written (non-temporally) to the slot's buffer and fenced
 * before the line that announces it.
 *
 * Writers stage every line of a batch, then store them non-temporally with one
 * SFENCE (two when a payload went out of line).  Readers invalidate a window
 * of lines, MFENCE once, then load.  All of it goes through the Memory's
 * memops table, so the model mode exercises exactly this code.
 *
 * The server loop (poll) runs without the GIL and returns a batch to Python;
 * serve_echo answers every request in C, to measure the transport alone.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <time.h>

#include "beluga_native.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() __asm__ __volatile__("" ::: "memory")
#endif

typedef struct {
    uint32_t seq;
    uint16_t code; /* request: op; response: status */
    uint16_t flags;
    uint32_t len;
    uint32_t gen;
    uint8_t data[BL_RPC_INLINE];
    uint32_t payload_crc;
    uint32_t crc;
} rpc_line;

_Static_assert(sizeof(rpc_line) == BL_LINE, "an RPC message is one cache line");

#define RPC_OOL 1u
#define ST_BAD_LENGTH 0xfff0
#define ST_CORRUPT 0xfff1
#define SCAN_WINDOW 32u
#define BAD_LIMIT 4096u   /* polls of a torn line before it is answered as corrupt */
#define SPIN_WITH_GIL 512 /* polls before a waiter lets other threads run */

typedef struct {
    size_t base;
    uint32_t depth;
    size_t buf;
} ring_geo;

/* Bytes of each slot buffer for a ring of ring_bytes with depth slots (0: none fit). */
size_t bl_rpc_buf_size(size_t ring_bytes, uint32_t depth)
{
    size_t fixed = BL_RPC_HEAD + 2 * (size_t)depth * BL_LINE;
    if (!depth || ring_bytes < fixed)
        return 0;
    return ((ring_bytes - fixed) / (2 * (size_t)depth)) & ~(size_t)(BL_LINE - 1);
}

/* Offsets of a slot's request line, response line, request and response buffers. */
static size_t req_line(const ring_geo *g, uint32_t slot) { return g->base + BL_RPC_HEAD + (size_t)slot * BL_LINE; }
static size_t resp_line(const ring_geo *g, uint32_t slot)
{
    return g->base + BL_RPC_HEAD + ((size_t)g->depth + slot) * BL_LINE;
}
static size_t req_buf(const ring_geo *g, uint32_t slot)
{
    return g->base + BL_RPC_HEAD + 2 * (size_t)g->depth * BL_LINE + (size_t)slot * g->buf;
}
static size_t resp_buf(const ring_geo *g, uint32_t slot) { return req_buf(g, g->depth) + (size_t)slot * g->buf; }

/* Monotonic clock in ns. */
static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* CRC32C of a line's first 60 bytes. */
static uint32_t line_crc(const rpc_line *ln) { return ~bl_crc32c(~0u, ln, offsetof(rpc_line, crc)); }

/* Fill a line; a payload too long for it goes to buf_off first (no fence here). */
static int stage(bl_mem *m, rpc_line *ln, size_t buf_off, size_t buf_size, uint32_t seq, uint32_t gen,
                 uint16_t code, const void *p, size_t n)
{
    memset(ln, 0, sizeof(*ln));
    ln->seq = seq, ln->gen = gen, ln->code = code, ln->len = (uint32_t)n;
    if (n > BL_RPC_INLINE) {
        if (n > buf_size)
            return -1;
        m->ops->nt_store(m, buf_off, p, n);
        ln->flags = RPC_OOL;
        ln->payload_crc = ~bl_crc32c(~0u, p, n);
    } else if (n) {
        memcpy(ln->data, p, n);
    }
    ln->crc = line_crc(ln);
    return ln->flags & RPC_OOL;
}

/* Store staged lines with non-temporal stores, fencing out-of-line payloads first. */
static void emit(bl_mem *m, const rpc_line *lines, const size_t *offs, size_t n, int any_ool)
{
    if (any_ool)
        m->ops->sfence(m);
    for (size_t i = 0; i < n; i++)
        m->ops->nt_store(m, offs[i], &lines[i], BL_LINE);
    m->ops->sfence(m);
}

/* Load a message's payload into a new bytes object; NULL with no error set if corrupt. */
static PyObject *payload_of(bl_mem *m, const rpc_line *ln, size_t buf_off)
{
    if (!(ln->flags & RPC_OOL))
        return PyBytes_FromStringAndSize((const char *)ln->data, ln->len);
    PyObject *b = PyBytes_FromStringAndSize(NULL, ln->len);
    if (!b)
        return NULL;
    m->ops->invalidate(m, buf_off, ln->len);
    m->ops->mfence(m);
    m->ops->load(m, buf_off, PyBytes_AS_STRING(b), ln->len);
    if (~bl_crc32c(~0u, PyBytes_AS_STRING(b), ln->len) != ln->payload_crc) {
        Py_DECREF(b);
        return NULL;
    }
    return b;
}

/* Check that a ring of depth slots lies inside the mapping. */
static int ring_fits(MemoryObject *mem, size_t base, size_t ring_bytes, uint32_t depth)
{
    if (!mem->has_view)
        return !!bl_fail(bl_rpc_error, "the pool's Memory was released");
    if (!depth || depth > BL_RPC_MAX_DEPTH)
        return !!bl_fail(bl_rpc_error, "ring depth must be 1..%u, not %u", BL_RPC_MAX_DEPTH, depth);
    if (ring_bytes < BL_RPC_HEAD + 2 * (size_t)depth * BL_LINE || base % BL_LINE ||
        base > mem->mem.size || ring_bytes > mem->mem.size - base)
        return !!bl_fail(bl_rpc_error, "a %u-slot ring does not fit [%zu, +%zu) of the pool", depth,
                         base, ring_bytes);
    return 1;
}

/* ---------------------------------------------------------------- client */

typedef struct {
    PyObject_HEAD
    MemoryObject *mem;
    ring_geo g;
    uint32_t gen;
    uint32_t next_seq; /* sequence number of the next submit */
    uint32_t done_seq; /* oldest sequence number not yet completed */
} ClientObject;

/* RingClient(memory, ring_offset, ring_bytes, depth, gen, first_seq=1) */
static int Client_init(ClientObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"memory", "ring_offset", "ring_bytes", "depth", "gen", "first_seq", NULL};
    PyObject *mem;
    unsigned long long base, ring_bytes;
    unsigned int depth, gen, first = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!KKII|I", kwlist, &BlMemoryType, &mem, &base,
                                     &ring_bytes, &depth, &gen, &first))
        return -1;
    if (!ring_fits((MemoryObject *)mem, base, ring_bytes, depth))
        return -1;
    Py_INCREF(mem);
    Py_XSETREF(self->mem, (MemoryObject *)mem);
    self->g = (ring_geo){base, depth, bl_rpc_buf_size(ring_bytes, depth)};
    self->gen = gen;
    self->next_seq = self->done_seq = first ? first : 1;
    return 0;
}

/* Dealloc: drop the Memory reference. */
static void Client_dealloc(ClientObject *self)
{
    Py_XDECREF(self->mem);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Check the memory is attached before touching the ring. */
static int client_ok(ClientObject *self)
{
    if (self->mem && self->mem->has_view)
        return 1;
    bl_fail(bl_rpc_error, "the pool this RPC client used was closed; connect again");
    return 0;
}

/* submit_many([(op, payload), ...]) -> first sequence number; one doorbell batch. */
static PyObject *Client_submit_many(ClientObject *self, PyObject *list)
{
    if (!client_ok(self))
        return NULL;
    PyObject *seq = PySequence_Fast(list, "submit_many takes a sequence of (op, payload)");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    uint32_t inflight = self->next_seq - self->done_seq;
    if ((size_t)n > self->g.depth - inflight) {
        Py_DECREF(seq);
        return bl_fail(bl_rpc_error, "%zd requests do not fit: %u of %u slots are in flight", n,
                       inflight, self->g.depth);
    }
    rpc_line *lines = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(rpc_line));
    size_t *offs = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(size_t));
    bl_mem *m = &self->mem->mem;
    int any_ool = 0;
    PyObject *result = NULL;
    if (!lines || !offs) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned int op;
        Py_buffer p;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "Iy*", &op, &p))
            goto done;
        uint32_t s = self->next_seq + (uint32_t)i, slot = (s - 1) % self->g.depth;
        int r = op > 0xffff ? -2
                            : stage(m, &lines[i], req_buf(&self->g, slot), self->g.buf, s, self->gen,
                                    (uint16_t)op, p.buf, (size_t)p.len);
        Py_ssize_t len = p.len;
        PyBuffer_Release(&p);
        if (r == -2) {
            bl_fail(PyExc_ValueError, "op %u does not fit 16 bits", op);
            goto done;
        }
        if (r < 0) {
            bl_fail(bl_rpc_error, "a %zd-byte request exceeds this ring's %zu-byte slot buffer; "
                    "send less per call or connect with a smaller depth", len, self->g.buf);
            goto done;
        }
        any_ool |= r;
        offs[i] = req_line(&self->g, slot);
    }
    emit(m, lines, offs, (size_t)n, any_ool);
    result = PyLong_FromUnsignedLong(self->next_seq);
    self->next_seq += (uint32_t)n;
done:
    PyMem_Free(lines);
    PyMem_Free(offs);
    Py_DECREF(seq);
    return result;
}

/* Whether a loaded response line answers request s. */
static int answers(const ClientObject *self, const rpc_line *ln, uint32_t s)
{
    return ln->seq == s && ln->gen == self->gen && ln->crc == line_crc(ln);
}

/* Load the response lines of requests s.. s+n-1 after one invalidate pass and one fence. */
static void fetch_responses(ClientObject *self, uint32_t s, uint32_t n, rpc_line *out)
{
    bl_mem *m = &self->mem->mem;
    uint32_t first = (s - 1) % self->g.depth, run = self->g.depth - first < n ? self->g.depth - first : n;
    m->ops->invalidate(m, resp_line(&self->g, first), (size_t)run * BL_LINE);
    if (n > run)
        m->ops->invalidate(m, resp_line(&self->g, 0), (size_t)(n - run) * BL_LINE);
    m->ops->mfence(m);
    for (uint32_t i = 0; i < n; i++)
        m->ops->load(m, resp_line(&self->g, (first + i) % self->g.depth), &out[i], BL_LINE);
}

/* complete(n, timeout_s) -> [(status, payload), ...] for up to n oldest requests. */
static PyObject *Client_complete(ClientObject *self, PyObject *args)
{
    unsigned int want;
    double timeout;
    if (!PyArg_ParseTuple(args, "Id", &want, &timeout) || !client_ok(self))
        return NULL;
    uint32_t inflight = self->next_seq - self->done_seq;
    if (want > inflight)
        return bl_fail(bl_rpc_error, "asked to complete %u requests but %u are in flight", want,
                       inflight);
    PyObject *out = PyList_New(0);
    if (!out)
        return NULL;
    uint64_t deadline = now_ns() + (uint64_t)(timeout > 0 ? timeout * 1e9 : 0);
    rpc_line lines[SCAN_WINDOW];
    int spins = 0;
    PyThreadState *ts = NULL;
    while (PyList_GET_SIZE(out) < (Py_ssize_t)want) {
        uint32_t left = want - (uint32_t)PyList_GET_SIZE(out);
        uint32_t n = left < SCAN_WINDOW ? left : SCAN_WINDOW, ready = 0;
        fetch_responses(self, self->done_seq, n, lines);
        while (ready < n && answers(self, &lines[ready], self->done_seq + ready))
            ready++;
        if (!ready) {
            if (++spins == SPIN_WITH_GIL)
                ts = PyEval_SaveThread();
            if (spins % 64 == 0 && now_ns() > deadline)
                break;
            cpu_relax();
            continue;
        }
        if (ts) {
            PyEval_RestoreThread(ts);
            ts = NULL;
        }
        spins = 0;
        for (uint32_t i = 0; i < ready; i++, self->done_seq++) {
            rpc_line *ln = &lines[i];
            PyObject *payload =
                payload_of(&self->mem->mem, ln, resp_buf(&self->g, (self->done_seq - 1) % self->g.depth));
            if (!payload && PyErr_Occurred()) {
                Py_DECREF(out);
                return NULL;
            }
            PyObject *item = payload ? Py_BuildValue("(IN)", (unsigned)ln->code, payload)
                                     : Py_BuildValue("(Iy)", (unsigned)ST_CORRUPT, "response payload corrupt");
            if (!item || PyList_Append(out, item) < 0) {
                Py_XDECREF(item);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(item);
        }
    }
    if (ts)
        PyEval_RestoreThread(ts);
    return out;
}

/* pump(op, payload, depth, duration_s) -> requests completed: keep depth in flight, in C. */
static PyObject *Client_pump(ClientObject *self, PyObject *args)
{
    unsigned int op, depth;
    Py_buffer p;
    double duration;
    if (!PyArg_ParseTuple(args, "Iy*Id", &op, &p, &depth, &duration))
        return NULL;
    if (!client_ok(self) || op > 0xffff || p.len > BL_RPC_INLINE || !depth ||
        depth > self->g.depth || self->next_seq != self->done_seq) {
        if (!PyErr_Occurred())
            bl_fail(PyExc_ValueError, "pump needs an idle ring, an inline payload (<= %u bytes) "
                    "and 1 <= depth <= %u", BL_RPC_INLINE, self->g.depth);
        PyBuffer_Release(&p);
        return NULL;
    }
    bl_mem *m = &self->mem->mem;
    rpc_line lines[BL_RPC_MAX_DEPTH], resp[SCAN_WINDOW];
    size_t offs[BL_RPC_MAX_DEPTH];
    uint64_t done = 0;
    Py_BEGIN_ALLOW_THREADS
    uint64_t end = now_ns() + (uint64_t)(duration * 1e9), last_progress = now_ns();
    while (1) {
        uint64_t t = now_ns();
        uint32_t k = 0, room = t < end ? depth - (self->next_seq - self->done_seq) : 0;
        for (; k < room; k++) {
            uint32_t s = self->next_seq + k;
            stage(m, &lines[k], 0, 0, s, self->gen, (uint16_t)op, p.buf, (size_t)p.len);
            offs[k] = req_line(&self->g, (s - 1) % self->g.depth);
        }
        if (k)
            emit(m, lines, offs, k, 0);
        self->next_seq += k;
        uint32_t inflight = self->next_seq - self->done_seq;
        uint32_t n = inflight < SCAN_WINDOW ? inflight : SCAN_WINDOW, ready = 0;
        fetch_responses(self, self->done_seq, n, resp);
        while (ready < n && answers(self, &resp[ready], self->done_seq + ready))
            ready++;
        self->done_seq += ready;
        done += ready;
        if (ready)
            last_progress = t;
        else if (t - last_progress > 1000000000ull)
            break; /* the server stopped answering: give up after a second */
        if (t >= end && self->next_seq == self->done_seq)
            break;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&p);
    if (self->next_seq != self->done_seq)
        return bl_fail(bl_rpc_error, "the server stopped answering during pump (%u in flight)",
                       self->next_seq - self->done_seq);
    return PyLong_FromUnsignedLongLong(done);
}

/* call(op, payload, timeout_s) -> (status, payload) or None if not answered in time. */
static PyObject *Client_call(ClientObject *self, PyObject *args)
{
    unsigned int op;
    Py_buffer p;
    double timeout;
    if (!PyArg_ParseTuple(args, "Iy*d", &op, &p, &timeout))
        return NULL;
    PyObject *req = Py_BuildValue("((Iy#))", op, p.buf, p.len);
    PyBuffer_Release(&p);
    if (!req)
        return NULL;
    PyObject *first = Client_submit_many(self, req);
    Py_DECREF(req);
    if (!first)
        return NULL;
    Py_DECREF(first);
    PyObject *args2 = Py_BuildValue("(Id)", 1u, timeout);
    PyObject *done = args2 ? Client_complete(self, args2) : NULL;
    Py_XDECREF(args2);
    if (!done)
        return NULL;
    PyObject *r = PyList_GET_SIZE(done) ? PyList_GET_ITEM(done, 0) : Py_None;
    Py_INCREF(r);
    Py_DECREF(done);
    return r;
}

/* Properties: next sequence number, slot buffer size, depth. */
static PyObject *Client_get_next_seq(ClientObject *self, void *c)
{
    return PyLong_FromUnsignedLong(self->next_seq);
}
static PyObject *Client_get_buf_size(ClientObject *self, void *c) { return PyLong_FromSize_t(self->g.buf); }
static PyObject *Client_get_depth(ClientObject *self, void *c) { return PyLong_FromUnsignedLong(self->g.depth); }

static PyMethodDef Client_methods[] = {
    {"submit_many", (PyCFunction)Client_submit_many, METH_O,
     "submit_many([(op, payload), ...]) -> first seq"},
    {"complete", (PyCFunction)Client_complete, METH_VARARGS,
     "complete(n, timeout_s) -> [(status, payload)] (fewer on timeout)"},
    {"call", (PyCFunction)Client_call, METH_VARARGS,
     "call(op, payload, timeout_s) -> (status, payload) | None"},
    {"pump", (PyCFunction)Client_pump, METH_VARARGS,
     "pump(op, payload, depth, duration_s) -> completed (transport benchmark)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Client_getset[] = {
    {"next_seq", (getter)Client_get_next_seq, NULL, "sequence number of the next request", NULL},
    {"buf_size", (getter)Client_get_buf_size, NULL, "largest payload per request", NULL},
    {"depth", (getter)Client_get_depth, NULL, "slots in the ring", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ClientType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "beluga._native._core.RingClient",
    .tp_basicsize = sizeof(ClientObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The client end of one RPC ring.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Client_init,
    .tp_dealloc = (destructor)Client_dealloc,
    .tp_methods = Client_methods,
    .tp_getset = Client_getset,
};

/* ---------------------------------------------------------------- server */

typedef struct {
    ring_geo g;
    uint32_t active, gen;
    uint32_t head; /* next sequence number expected */
    uint32_t bad;  /* consecutive polls of a torn line at head */
} ring_state;

typedef struct {
    uint32_t ring, seq;
    rpc_line line;
} request;

typedef struct {
    PyObject_HEAD
    MemoryObject *mem;
    size_t area_off, ring_bytes;
    uint32_t nrings;
    ring_state *rings;
    atomic_int stop, polling;
    uint64_t served, rejected;
} ServerObject;

/* RingServer(memory, area_offset, ring_bytes, nrings) */
static int Server_init(ServerObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"memory", "area_offset", "ring_bytes", "nrings", NULL};
    PyObject *mem;
    unsigned long long off, ring_bytes;
    unsigned int n;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!KKI", kwlist, &BlMemoryType, &mem, &off,
                                     &ring_bytes, &n))
        return -1;
    if (!n || !ring_fits((MemoryObject *)mem, off, ring_bytes * n, 1))
        return n ? -1 : !!bl_fail(bl_rpc_error, "a server needs at least one ring") - 1;
    ring_state *rings = PyMem_Calloc(n, sizeof(ring_state));
    if (!rings) {
        PyErr_NoMemory();
        return -1;
    }
    PyMem_Free(self->rings);
    self->rings = rings;
    Py_INCREF(mem);
    Py_XSETREF(self->mem, (MemoryObject *)mem);
    self->area_off = off, self->ring_bytes = ring_bytes, self->nrings = n;
    return 0;
}

/* Dealloc: drop the Memory reference and the ring table. */
static void Server_dealloc(ServerObject *self)
{
    Py_XDECREF(self->mem);
    PyMem_Free(self->rings);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Check a ring index and that no poll is running in another thread. */
static ring_state *ring_arg(ServerObject *self, unsigned int idx)
{
    if (!self->rings || !self->mem->has_view)
        return bl_fail(bl_rpc_error, "the server's pool was closed"), NULL;
    if (idx >= self->nrings)
        return bl_fail(bl_rpc_error, "ring %u does not exist (the pool has %u)", idx, self->nrings), NULL;
    return &self->rings[idx];
}

/* set_ring(idx, gen, depth, head): start serving a client's ring. */
static PyObject *Server_set_ring(ServerObject *self, PyObject *args)
{
    unsigned int idx, gen, depth, head;
    if (!PyArg_ParseTuple(args, "IIII", &idx, &gen, &depth, &head))
        return NULL;
    ring_state *r = ring_arg(self, idx);
    if (!r)
        return NULL;
    if (atomic_load(&self->polling))
        return bl_fail(bl_rpc_error, "cannot change rings while poll() runs");
    size_t base = self->area_off + (size_t)idx * self->ring_bytes;
    if (!ring_fits(self->mem, base, self->ring_bytes, depth))
        return NULL;
    *r = (ring_state){{base, depth, bl_rpc_buf_size(self->ring_bytes, depth)}, 1, gen, head ? head : 1, 0};
    Py_RETURN_NONE;
}

/* clear_ring(idx): stop serving a ring (its client is gone). */
static PyObject *Server_clear_ring(ServerObject *self, PyObject *args)
{
    unsigned int idx;
    if (!PyArg_ParseTuple(args, "I", &idx))
        return NULL;
    ring_state *r = ring_arg(self, idx);
    if (!r)
        return NULL;
    if (atomic_load(&self->polling))
        return bl_fail(bl_rpc_error, "cannot change rings while poll() runs");
    r->active = 0;
    Py_RETURN_NONE;
}

/* Answer one request at once with a transport error status. */
static void reject(ServerObject *self, ring_state *r, uint32_t seq, uint16_t status, const char *why)
{
    bl_mem *m = &self->mem->mem;
    rpc_line ln;
    uint32_t slot = (seq - 1) % r->g.depth;
    stage(m, &ln, resp_buf(&r->g, slot), r->g.buf, seq, r->gen, status, why, strlen(why));
    size_t off = resp_line(&r->g, slot);
    emit(m, &ln, &off, 1, 0);
    self->rejected++;
}

/* Collect the consecutive new requests of one ring, up to room; no GIL needed. */
static int scan_ring(ServerObject *self, uint32_t idx, request *out, int room)
{
    ring_state *r = &self->rings[idx];
    bl_mem *m = &self->mem->mem;
    uint32_t depth = r->g.depth, window = depth < SCAN_WINDOW ? depth : SCAN_WINDOW;
    if (window > (uint32_t)room)
        window = (uint32_t)room;
    uint32_t first = (r->head - 1) % depth, run = depth - first < window ? depth - first : window;
    m->ops->invalidate(m, req_line(&r->g, first), (size_t)run * BL_LINE);
    if (window > run)
        m->ops->invalidate(m, req_line(&r->g, 0), (size_t)(window - run) * BL_LINE);
    m->ops->mfence(m);
    int got = 0;
    for (uint32_t i = 0; i < window; i++) {
        request *q = &out[got];
        uint32_t slot = (first + i) % depth;
        m->ops->load(m, req_line(&r->g, slot), &q->line, BL_LINE);
        if (q->line.seq != r->head || q->line.gen != r->gen)
            break;
        uint32_t seq = r->head;
        if (q->line.crc != line_crc(&q->line)) {
            if (++r->bad < BAD_LIMIT)
                break; /* maybe a line still being written: look again later */
            reject(self, r, seq, ST_CORRUPT, "request line corrupt");
        } else if (q->line.len > ((q->line.flags & RPC_OOL) ? r->g.buf : BL_RPC_INLINE)) {
            reject(self, r, seq, ST_BAD_LENGTH, "request length impossible for this ring");
        } else {
            q->ring = idx, q->seq = seq;
            got++;
        }
        r->bad = 0;
        r->head++;
    }
    return got;
}

/* Spin over all active rings until a batch arrives, stop() is called or time runs out. */
static int gather(ServerObject *self, request *batch, int max_batch, double timeout)
{
    uint64_t deadline = now_ns() + (uint64_t)(timeout > 0 ? timeout * 1e9 : 0);
    int got = 0;
    for (unsigned spins = 0;; spins++) {
        for (uint32_t i = 0; i < self->nrings && got < max_batch; i++)
            if (self->rings[i].active)
                got += scan_ring(self, i, batch + got, max_batch - got);
        if (got || atomic_load(&self->stop))
            return got;
        if (spins % 64 == 63 && now_ns() > deadline)
            return 0;
        cpu_relax();
    }
}

/* Start a polling call: parse limits, allocate the batch, mark polling. */
static request *begin_poll(ServerObject *self, unsigned int max_batch)
{
    if (!self->rings || !self->mem->has_view)
        return bl_fail(bl_rpc_error, "the server's pool was closed"), NULL;
    if (!max_batch || max_batch > 4096)
        return bl_fail(PyExc_ValueError, "max_batch must be 1..4096"), NULL;
    int expected = 0;
    if (!atomic_compare_exchange_strong(&self->polling, &expected, 1))
        return bl_fail(bl_rpc_error, "poll() is already running in another thread"), NULL;
    request *batch = PyMem_Malloc(max_batch * sizeof(request));
    if (!batch) {
        atomic_store(&self->polling, 0);
        PyErr_NoMemory();
    }
    return batch;
}

/* poll(max_batch, timeout_s) -> [(ring, seq, op, payload), ...] */
static PyObject *Server_poll(ServerObject *self, PyObject *args)
{
    unsigned int max_batch;
    double timeout;
    if (!PyArg_ParseTuple(args, "Id", &max_batch, &timeout))
        return NULL;
    request *batch = begin_poll(self, max_batch);
    if (!batch)
        return NULL;
    int got;
    Py_BEGIN_ALLOW_THREADS
    got = gather(self, batch, (int)max_batch, timeout);
    Py_END_ALLOW_THREADS
    atomic_store(&self->polling, 0);
    PyObject *out = PyList_New(0);
    for (int i = 0; out && i < got; i++) {
        request *q = &batch[i];
        ring_state *r = &self->rings[q->ring];
        PyObject *payload = payload_of(&self->mem->mem, &q->line, req_buf(&r->g, (q->seq - 1) % r->g.depth));
        if (!payload) {
            if (PyErr_Occurred()) {
                Py_CLEAR(out);
                break;
            }
            reject(self, r, q->seq, ST_CORRUPT, "request payload corrupt");
            continue;
        }
        PyObject *item = Py_BuildValue("(IIIN)", q->ring, q->seq, (unsigned)q->line.code, payload);
        if (!item || PyList_Append(out, item) < 0)
            Py_CLEAR(out);
        Py_XDECREF(item);
    }
    PyMem_Free(batch);
    return out;
}

/* respond([(ring, seq, status, payload), ...]): one batch of answers, one or two fences. */
static PyObject *Server_respond(ServerObject *self, PyObject *list)
{
    PyObject *seq = PySequence_Fast(list, "respond takes a sequence of (ring, seq, status, payload)");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    rpc_line *lines = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(rpc_line));
    size_t *offs = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(size_t));
    int any_ool = 0, ok = lines && offs;
    if (!ok)
        PyErr_NoMemory();
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        unsigned int idx, s, status;
        Py_buffer p;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "IIIy*", &idx, &s, &status, &p)) {
            ok = 0;
            break;
        }
        ring_state *r = ring_arg(self, idx);
        if (!r || !r->active || (uint32_t)(r->head - s) - 1 >= r->g.depth || status > 0xffff) {
            if (r)
                bl_fail(bl_rpc_error, "ring %u has no outstanding request %u", idx, s);
            ok = 0;
        } else {
            uint32_t slot = (s - 1) % r->g.depth;
            int st = stage(&self->mem->mem, &lines[i], resp_buf(&r->g, slot), r->g.buf, s, r->gen,
                           (uint16_t)status, p.buf, (size_t)p.len);
            if (st < 0) {
                bl_fail(bl_rpc_error, "a %zd-byte response exceeds ring %u's %zu-byte slot buffer",
                        p.len, idx, r->g.buf);
                ok = 0;
            }
            any_ool |= st > 0;
            offs[i] = resp_line(&r->g, slot);
        }
        PyBuffer_Release(&p);
    }
    if (ok) {
        emit(&self->mem->mem, lines, offs, (size_t)n, any_ool);
        self->served += (uint64_t)n;
    }
    PyMem_Free(lines);
    PyMem_Free(offs);
    Py_DECREF(seq);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

/* serve_echo(duration_s) -> requests answered: the transport alone, all in C. */
static PyObject *Server_serve_echo(ServerObject *self, PyObject *args)
{
    double duration;
    if (!PyArg_ParseTuple(args, "d", &duration))
        return NULL;
    request *batch = begin_poll(self, SCAN_WINDOW * 4);
    if (!batch)
        return NULL;
    size_t max_buf = 0;
    for (uint32_t i = 0; i < self->nrings; i++)
        if (self->rings[i].g.buf > max_buf)
            max_buf = self->rings[i].g.buf;
    uint8_t *tmp = PyMem_Malloc(max_buf + 1);
    rpc_line lines[SCAN_WINDOW * 4];
    size_t offs[SCAN_WINDOW * 4];
    uint64_t answered = 0;
    bl_mem *m = &self->mem->mem;
    Py_BEGIN_ALLOW_THREADS
    uint64_t end = now_ns() + (uint64_t)(duration * 1e9);
    while (tmp && !atomic_load(&self->stop) && now_ns() < end) {
        int got = gather(self, batch, SCAN_WINDOW * 4, 0.01);
        int any_ool = 0, k = 0;
        for (int i = 0; i < got; i++) {
            request *q = &batch[i];
            ring_state *r = &self->rings[q->ring];
            uint32_t slot = (q->seq - 1) % r->g.depth;
            const void *p = q->line.data;
            if (q->line.flags & RPC_OOL) {
                m->ops->invalidate(m, req_buf(&r->g, slot), q->line.len);
                m->ops->mfence(m);
                m->ops->load(m, req_buf(&r->g, slot), tmp, q->line.len);
                p = tmp;
            }
            any_ool |= stage(m, &lines[k], resp_buf(&r->g, slot), r->g.buf, q->seq, r->gen, 0, p,
                             q->line.len) > 0;
            offs[k++] = resp_line(&r->g, slot);
        }
        if (k)
            emit(m, lines, offs, (size_t)k, any_ool);
        answered += (uint64_t)k;
    }
    Py_END_ALLOW_THREADS
    atomic_store(&self->polling, 0);
    PyMem_Free(batch);
    if (!tmp)
        return PyErr_NoMemory();
    PyMem_Free(tmp);
    self->served += answered;
    return PyLong_FromUnsignedLongLong(answered);
}

/* stop(): make a running poll or serve_echo return promptly (thread-safe). */
static PyObject *Server_stop(ServerObject *self, PyObject *unused)
{
    atomic_store(&self->stop, 1);
    Py_RETURN_NONE;
}

/* Properties: responses written, malformed requests answered with an error. */
static PyObject *Server_get_served(ServerObject *self, void *c) { return PyLong_FromUnsignedLongLong(self->served); }
static PyObject *Server_get_rejected(ServerObject *self, void *c)
{
    return PyLong_FromUnsignedLongLong(self->rejected);
}

static PyMethodDef Server_methods[] = {
    {"set_ring", (PyCFunction)Server_set_ring, METH_VARARGS, "set_ring(idx, gen, depth, head)"},
    {"clear_ring", (PyCFunction)Server_clear_ring, METH_VARARGS, "clear_ring(idx)"},
    {"poll", (PyCFunction)Server_poll, METH_VARARGS,
     "poll(max_batch, timeout_s) -> [(ring, seq, op, payload)]"},
    {"respond", (PyCFunction)Server_respond, METH_O, "respond([(ring, seq, status, payload)])"},
    {"serve_echo", (PyCFunction)Server_serve_echo, METH_VARARGS,
     "serve_echo(duration_s) -> answered"},
    {"stop", (PyCFunction)Server_stop, METH_NOARGS, "end a running poll / serve_echo"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Server_getset[] = {
    {"served", (getter)Server_get_served, NULL, "responses written", NULL},
    {"rejected", (getter)Server_get_rejected, NULL, "malformed requests answered with an error", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ServerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "beluga._native._core.RingServer",
    .tp_basicsize = sizeof(ServerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The server end of every RPC ring of a pool.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Server_init,
    .tp_dealloc = (destructor)Server_dealloc,
    .tp_methods = Server_methods,
    .tp_getset = Server_getset,
};

/* rpc_buf_size(ring_bytes, depth) -> slot buffer bytes (shared geometry). */
static PyObject *mod_rpc_buf_size(PyObject *mod, PyObject *args)
{
    unsigned long long ring_bytes;
    unsigned int depth;
    if (!PyArg_ParseTuple(args, "KI", &ring_bytes, &depth))
        return NULL;
    return PyLong_FromSize_t(bl_rpc_buf_size(ring_bytes, depth));
}

static PyMethodDef rpc_functions[] = {
    {"rpc_buf_size", mod_rpc_buf_size, METH_VARARGS, "rpc_buf_size(ring_bytes, depth) -> int"},
    {NULL, NULL, 0, NULL},
};

/* Add the RPC types, functions and constants to the module. */
int bl_rpc_init(PyObject *module)
{
    if (PyType_Ready(&ClientType) < 0 || PyType_Ready(&ServerType) < 0)
        return -1;
    Py_INCREF(&ClientType);
    Py_INCREF(&ServerType);
    if (PyModule_AddObject(module, "RingClient", (PyObject *)&ClientType) < 0 ||
        PyModule_AddObject(module, "RingServer", (PyObject *)&ServerType) < 0 ||
        PyModule_AddFunctions(module, rpc_functions) < 0 ||
        PyModule_AddIntConstant(module, "RPC_INLINE", BL_RPC_INLINE) < 0 ||
        PyModule_AddIntConstant(module, "RPC_HEAD", BL_RPC_HEAD) < 0 ||
        PyModule_AddIntConstant(module, "RPC_MAX_DEPTH", BL_RPC_MAX_DEPTH) < 0 ||
        PyModule_AddIntConstant(module, "ST_BAD_LENGTH", ST_BAD_LENGTH) < 0 ||
        PyModule_AddIntConstant(module, "ST_CORRUPT", ST_CORRUPT) < 0)
        return -1;
    return 0;
}
