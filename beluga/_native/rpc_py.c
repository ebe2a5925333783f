/*
 * rpc_py.c - the Python face of the RPC: the RingClient and RingServer types.
 *
 * rpc.c holds the transport (line format, slot rings, waiting, the loops);
 * this file parses and checks every argument before the core touches the
 * ring, builds Python objects from what the core returns, and runs every
 * loop inside a section of the Memory (helpers_py.c): loops that wait let go
 * of the GIL and end early when the pool is being closed.
 *
 * The module functions give tests and tools the formats rpc.c owns: a sealed
 * line, a ring's buffer size, a slot's line and buffer offsets.
 */
#include "beluga_py.h"

static const char CLIENT_CLOSED[] =
    "the pool this RPC client uses was closed (Pool.close()) while it waited; the request may or "
    "may not have been served: attach the pool and connect again";
static const char SERVER_CLOSED[] =
    "the pool was closed (Pool.close()) while this server polled it; close the RpcServer "
    "before its pool";

/* Seconds (from Python) to ns, 0 for negatives. */
static uint64_t ns_of(double s) { return s > 0 ? (uint64_t)(s * 1e9) : 0; }

/* Set a duration attribute from seconds within [lo, hi]; else raise ValueError(msg). */
static int set_seconds(uint64_t *dst, PyObject *v, double lo, double hi, const char *msg)
{
    double s = v ? PyFloat_AsDouble(v) : -1.0;
    if (s == -1.0 && PyErr_Occurred())
        return -1;
    if (!v || !(s >= lo && s <= hi)) {
        PyErr_SetString(PyExc_ValueError, msg);
        return -1;
    }
    *dst = ns_of(s);
    return 0;
}

/* A wait's counters as a dict. */
static PyObject *stats_dict(bl_rpc_wait_stats *st)
{
    return Py_BuildValue("{sKsKsKsKsKsKsKsK}", "yields", (unsigned long long)st->yields, "naps",
                         (unsigned long long)st->naps, "sleeps", (unsigned long long)st->sleeps,
                         "woken", (unsigned long long)st->woken, "timeouts",
                         (unsigned long long)st->timeouts, "wakes", (unsigned long long)st->wakes,
                         "futex_errors", (unsigned long long)st->futex_errors, "stalled",
                         (unsigned long long)st->stalled);
}

/* A message's payload as a new bytes object; NULL with no error set if it is torn.  An
 * out-of-line payload is loaded by load(end, item, out): item is the line's request (server)
 * or the line itself (client). */
static PyObject *payload_of(const bl_rpc_line *ln, int (*load)(void *, const void *, void *),
                            void *end, const void *item)
{
    if (!(ln->flags & BL_RPC_OOL))
        return PyBytes_FromStringAndSize((const char *)ln->data, ln->len);
    PyObject *b = PyBytes_FromStringAndSize(NULL, ln->len);
    if (b && load(end, item, PyBytes_AS_STRING(b)) < 0)
        Py_CLEAR(b);
    return b;
}

/* Check that a ring of depth slots lies inside the mapping; 0 with RpcError raised if not. */
static int ring_fits(MemoryObject *mem, size_t base, size_t ring_bytes, uint32_t depth)
{
    if (!mem->has_view)
        return !!bl_fail(bl_rpc_error, "the pool's Memory was released");
    int why = bl_rpc_ring_check(mem->mem.size, base, ring_bytes, depth);
    if (why == BL_RPC_BAD_DEPTH)
        return !!bl_fail(bl_rpc_error, "ring depth must be 1..%u, not %u", BL_RPC_MAX_DEPTH, depth);
    if (why)
        return !!bl_fail(bl_rpc_error, "a %u-slot ring does not fit [%zu, +%zu) of the pool", depth,
                         base, ring_bytes);
    return 1;
}

/* ---------------------------------------------------------------- client */

typedef struct {
    PyObject_HEAD
    MemoryObject *mem;
    bl_rpc_client c;
} ClientObject;

/* RingClient(memory, ring_offset, ring_bytes, depth, gen, first_seq=1, *, wake=False) */
static int Client_init(ClientObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"memory", "ring_offset", "ring_bytes", "depth", "gen", "first_seq",
                             "wake", NULL};
    PyObject *mem;
    unsigned long long base, ring_bytes;
    unsigned int depth, gen, first = 1;
    int wake = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!KKII|I$p", kwlist, &BlMemoryType, &mem, &base,
                                     &ring_bytes, &depth, &gen, &first, &wake))
        return -1;
    MemoryObject *mo = (MemoryObject *)mem;
    if (!ring_fits(mo, base, ring_bytes, depth))
        return -1;
    Py_INCREF(mem);
    Py_XSETREF(self->mem, mo);
    bl_rpc_client_init(&self->c, &mo->mem, base, ring_bytes, depth, gen, first, wake);
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
    bl_rpc_client *c = &self->c;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), held = 0;
    uint32_t inflight = c->next_seq - c->done_seq;
    if ((size_t)n > c->g.depth - inflight) {
        Py_DECREF(seq);
        return bl_fail(bl_rpc_error, "%zd requests do not fit: %u of %u slots are in flight", n,
                       inflight, c->g.depth);
    }
    Py_buffer views[BL_RPC_MAX_DEPTH];
    bl_rpc_msg msgs[BL_RPC_MAX_DEPTH];
    PyObject *result = NULL;
    for (; held < n; held++) {
        unsigned int op;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, held), "Iy*", &op, &views[held]))
            goto done;
        Py_ssize_t len = views[held].len;
        if (op > 0xffff) {
            bl_fail(PyExc_ValueError, "op %u does not fit 16 bits", op);
            held++;
            goto done;
        }
        if (!bl_rpc_fits((size_t)len, c->g.buf)) {
            bl_fail(bl_rpc_error, "a %zd-byte request exceeds this ring's %zu-byte slot buffer; "
                    "send less per call or connect with a smaller depth", len, c->g.buf);
            held++;
            goto done;
        }
        msgs[held] = (bl_rpc_msg){(uint16_t)op, views[held].buf, (size_t)len};
    }
    result = PyLong_FromUnsignedLong(bl_rpc_client_submit(c, msgs, (uint32_t)n));
done:
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    Py_DECREF(seq);
    return result;
}

/* payload_of's loader for the client: the response buffer of the oldest request. */
static int client_load(void *c, const void *ln, void *out)
{
    return bl_rpc_client_payload(c, ln, out);
}

/* Append (status, payload) of a ready response line to out; -1 on a Python error. */
static int take_response(ClientObject *self, const bl_rpc_line *ln, PyObject *out)
{
    PyObject *payload = payload_of(ln, client_load, &self->c, ln);
    if (!payload && PyErr_Occurred())
        return -1;
    PyObject *item = payload ? Py_BuildValue("(IN)", (unsigned)ln->code, payload)
                             : Py_BuildValue("(Iy)", (unsigned)BL_RPC_CORRUPT,
                                             "response payload corrupt");
    int r = item ? PyList_Append(out, item) : -1;
    Py_XDECREF(item);
    return r;
}

/* complete(n, timeout_s) -> [(status, payload), ...] for up to n oldest requests. */
static PyObject *Client_complete(ClientObject *self, PyObject *args)
{
    unsigned int want;
    double timeout;
    if (!PyArg_ParseTuple(args, "Id", &want, &timeout) || !client_ok(self))
        return NULL;
    bl_rpc_client *c = &self->c;
    uint32_t inflight = c->next_seq - c->done_seq;
    if (want > inflight)
        return bl_fail(bl_rpc_error, "asked to complete %u requests but %u are in flight", want,
                       inflight);
    PyObject *out = PyList_New(0);
    bl_section sec;
    if (!out || bl_section_enter(&sec, self->mem, 0, bl_rpc_error, CLIENT_CLOSED) < 0) {
        Py_XDECREF(out);
        return NULL;
    }
    bl_rpc_hooks hooks = bl_section_hooks(&sec);
    uint64_t deadline = bl_rpc_now_ns() + ns_of(timeout);
    bl_rpc_line lines[BL_RPC_WINDOW];
    int failed = 0, ready = 0;
    while (PyList_GET_SIZE(out) < (Py_ssize_t)want) {
        ready = bl_rpc_client_wait(c, want - (uint32_t)PyList_GET_SIZE(out), lines, deadline,
                                   &hooks);
        if (ready <= 0)
            break;
        bl_section_gil(&sec, 0);
        for (int i = 0; i < ready && !failed; i++) {
            failed = take_response(self, &lines[i], out) < 0;
            c->done_seq += !failed;
        }
        if (failed)
            break;
    }
    bl_section_leave(&sec);
    if (failed || ready < 0) {
        Py_DECREF(out);
        return ready < 0 ? bl_fail(bl_rpc_error, "%s", CLIENT_CLOSED) : NULL;
    }
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
    bl_rpc_client *c = &self->c;
    if (!client_ok(self) || op > 0xffff || p.len > BL_RPC_INLINE || !depth ||
        depth > c->g.depth || c->next_seq != c->done_seq) {
        if (!PyErr_Occurred())
            bl_fail(PyExc_ValueError, "pump needs an idle ring, an inline payload (<= %u bytes) "
                    "and 1 <= depth <= %u", BL_RPC_INLINE, c->g.depth);
        PyBuffer_Release(&p);
        return NULL;
    }
    bl_section sec;
    if (bl_section_enter(&sec, self->mem, 1, bl_rpc_error, CLIENT_CLOSED) < 0) {
        PyBuffer_Release(&p);
        return NULL;
    }
    bl_rpc_hooks hooks = bl_section_hooks(&sec);
    int64_t done =
        bl_rpc_client_pump(c, (uint16_t)op, p.buf, (size_t)p.len, depth, ns_of(duration), &hooks);
    bl_section_leave(&sec);
    PyBuffer_Release(&p);
    if (done < 0)
        return bl_fail(bl_rpc_error, "%s", CLIENT_CLOSED);
    if (c->next_seq != c->done_seq)
        return bl_fail(bl_rpc_error, "the server stopped answering during pump (%u in flight)",
                       c->next_seq - c->done_seq);
    return PyLong_FromUnsignedLongLong((unsigned long long)done);
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

/* next_seq: the sequence number of the next request. */
static PyObject *Client_get_next_seq(ClientObject *self, void *c)
{
    return PyLong_FromUnsignedLong(self->c.next_seq);
}

/* buf_size: the largest payload one request carries. */
static PyObject *Client_get_buf_size(ClientObject *self, void *c)
{
    return PyLong_FromSize_t(self->c.g.buf);
}

/* depth: slots in the ring. */
static PyObject *Client_get_depth(ClientObject *self, void *c)
{
    return PyLong_FromUnsignedLong(self->c.g.depth);
}

/* wake: whether waits use the wake lines (the server shares this kernel). */
static PyObject *Client_get_wake(ClientObject *self, void *c)
{
    return PyBool_FromLong(self->c.wait.wake);
}

/* Set wake (not deletable). */
static int Client_set_wake(ClientObject *self, PyObject *v, void *c)
{
    int on = v ? PyObject_IsTrue(v) : -1;
    if (on < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_AttributeError, "wake cannot be deleted");
        return -1;
    }
    self->c.wait.wake = on;
    return 0;
}

/* spin_s: how long a wait spins before backing off. */
static PyObject *Client_get_spin(ClientObject *self, void *c)
{
    return PyFloat_FromDouble(1e-9 * (double)self->c.wait.spin_ns);
}

/* Set spin_s (0..10 s). */
static int Client_set_spin(ClientObject *self, PyObject *v, void *c)
{
    return set_seconds(&self->c.wait.spin_ns, v, 0, 10, "spin_s must be 0..10 s");
}

/* sleep_s: the longest futex sleep before polling again. */
static PyObject *Client_get_sleep(ClientObject *self, void *c)
{
    return PyFloat_FromDouble(1e-9 * (double)self->c.wait.sleep_ns);
}

/* Set sleep_s (1e-6..10 s). */
static int Client_set_sleep(ClientObject *self, PyObject *v, void *c)
{
    return set_seconds(&self->c.wait.sleep_ns, v, 1e-6, 10, "sleep_s must be 1e-6..10 s");
}

/* wait_stats: how waits backed off (yields, naps, futex sleeps and how they ended, wakes sent). */
static PyObject *Client_get_stats(ClientObject *self, void *c) { return stats_dict(&self->c.stats); }

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
    {"wake", (getter)Client_get_wake, (setter)Client_set_wake,
     "use the wake lines (only when the server shares this kernel)", NULL},
    {"spin_s", (getter)Client_get_spin, (setter)Client_set_spin, "spin before backing off", NULL},
    {"sleep_s", (getter)Client_get_sleep, (setter)Client_set_sleep, "longest futex sleep", NULL},
    {"wait_stats", (getter)Client_get_stats, NULL, "how waits backed off", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ClientType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = BL_TYPE_PREFIX "RingClient",
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
    PyObject_HEAD
    MemoryObject *mem;
    bl_rpc_server s;
    atomic_int polling; /* a poll runs (without the GIL): the ring table is not to change */
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
    MemoryObject *mo = (MemoryObject *)mem;
    if (!n || !ring_fits(mo, off, ring_bytes * n, 1))
        return n ? -1 : !!bl_fail(bl_rpc_error, "a server needs at least one ring") - 1;
    if (bl_rpc_server_init(&self->s, &mo->mem, off, ring_bytes, n) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    Py_INCREF(mem);
    Py_XSETREF(self->mem, mo);
    return 0;
}

/* Dealloc: drop the Memory reference and the ring table. */
static void Server_dealloc(ServerObject *self)
{
    Py_XDECREF(self->mem);
    bl_rpc_server_free(&self->s);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Check a ring index and that the pool is still attached (see ring_idle for a running poll). */
static bl_rpc_ring_state *ring_arg(ServerObject *self, unsigned int idx)
{
    if (!self->s.rings || !self->mem->has_view)
        return bl_fail(bl_rpc_error, "the server's pool was closed"), NULL;
    if (idx >= self->s.nrings)
        return bl_fail(bl_rpc_error, "ring %u does not exist (the pool has %u)", idx,
                       self->s.nrings), NULL;
    return &self->s.rings[idx];
}

/* ring_arg, and no poll running in another thread (it reads the ring table without the GIL). */
static bl_rpc_ring_state *ring_idle(ServerObject *self, unsigned int idx)
{
    bl_rpc_ring_state *r = ring_arg(self, idx);
    if (r && atomic_load(&self->polling))
        return bl_fail(bl_rpc_error, "cannot change or read rings while poll() runs"), NULL;
    return r;
}

/* set_ring(idx, gen, depth, head, wake=False): start serving a client's ring. */
static PyObject *Server_set_ring(ServerObject *self, PyObject *args)
{
    unsigned int idx, gen, depth, head;
    int wake = 0;
    if (!PyArg_ParseTuple(args, "IIII|p", &idx, &gen, &depth, &head, &wake))
        return NULL;
    if (!ring_idle(self, idx) ||
        !ring_fits(self->mem, bl_rpc_server_ring_base(&self->s, idx), self->s.ring_bytes, depth))
        return NULL;
    bl_rpc_server_set_ring(&self->s, idx, gen, depth, head, wake);
    Py_RETURN_NONE;
}

/* clear_ring(idx): stop serving a ring (its client is gone). */
static PyObject *Server_clear_ring(ServerObject *self, PyObject *args)
{
    unsigned int idx;
    if (!PyArg_ParseTuple(args, "I", &idx))
        return NULL;
    if (!ring_idle(self, idx))
        return NULL;
    bl_rpc_server_clear_ring(&self->s, idx);
    Py_RETURN_NONE;
}

/* recover_head(idx, gen, depth, first_seq) -> the sequence number to serve next on a ring
 * found in the pool (a restarted server; see bl_rpc_server_recover_head). */
static PyObject *Server_recover_head(ServerObject *self, PyObject *args)
{
    unsigned int idx, gen, depth, first;
    if (!PyArg_ParseTuple(args, "IIII", &idx, &gen, &depth, &first))
        return NULL;
    if (!ring_idle(self, idx) ||
        !ring_fits(self->mem, bl_rpc_server_ring_base(&self->s, idx), self->s.ring_bytes, depth))
        return NULL;
    return PyLong_FromUnsignedLongLong(
        bl_rpc_server_recover_head(&self->s, idx, gen, depth, first));
}

/* refuse_pending(idx) -> how many requests found in a ring just adopted were answered
 * RESTARTED, not run (bl_rpc_server_refuse_pending). */
static PyObject *Server_refuse_pending(ServerObject *self, PyObject *args)
{
    unsigned int idx;
    if (!PyArg_ParseTuple(args, "I", &idx))
        return NULL;
    if (!ring_idle(self, idx))
        return NULL;
    if (!self->s.rings[idx].active) {
        PyErr_Format(PyExc_ValueError, "ring %u is not served: set_ring it first", idx);
        return NULL;
    }
    return PyLong_FromUnsignedLong(bl_rpc_server_refuse_pending(&self->s, idx));
}

/* unanswered(idx, seq) -> whether request seq of an adopted ring has no answer, or only
 * RESTARTED (bl_rpc_server_unanswered): a grant made for it reached nobody. */
static PyObject *Server_unanswered(ServerObject *self, PyObject *args)
{
    unsigned int idx, seq;
    if (!PyArg_ParseTuple(args, "II", &idx, &seq))
        return NULL;
    if (!ring_idle(self, idx))
        return NULL;
    if (!self->s.rings[idx].active) {
        PyErr_Format(PyExc_ValueError, "ring %u is not served: set_ring it first", idx);
        return NULL;
    }
    return PyBool_FromLong(bl_rpc_server_unanswered(&self->s, idx, seq));
}

/* Start a polling call: check the pool (and max_batch, allocating *batch, when batch is
 * given), mark polling, enter the section (GIL dropped); -1 with an error raised if not. */
static int begin_poll(ServerObject *self, unsigned int max_batch, bl_rpc_request **batch,
                      bl_section *sec)
{
    if (!self->s.rings || !self->mem->has_view)
        return !!bl_fail(bl_rpc_error, "the server's pool was closed") - 1;
    if (batch && (!max_batch || max_batch > 4096))
        return !!bl_fail(PyExc_ValueError, "max_batch must be 1..4096") - 1;
    int expected = 0;
    if (!atomic_compare_exchange_strong(&self->polling, &expected, 1))
        return !!bl_fail(bl_rpc_error, "poll() is already running in another thread") - 1;
    if (batch && !(*batch = PyMem_Malloc(max_batch * sizeof(bl_rpc_request))))
        PyErr_NoMemory();
    else if (bl_section_enter(sec, self->mem, 1, bl_rpc_error, SERVER_CLOSED) == 0)
        return 0;
    if (batch)
        PyMem_Free(*batch);
    atomic_store(&self->polling, 0);
    return -1;
}

/* End a polling call: leave the section, unmark polling; 0, or -1 raised if the pool closed. */
static int end_poll(ServerObject *self, bl_section *sec)
{
    int closed = bl_section_closing(sec);
    bl_section_leave(sec);
    atomic_store(&self->polling, 0);
    if (!closed)
        return 0;
    bl_fail(bl_rpc_error, "%s", SERVER_CLOSED);
    return -1;
}

/* payload_of's loader for the server: a gathered request's buffer. */
static int server_load(void *s, const void *q, void *out) { return bl_rpc_server_payload(s, q, out); }

/* poll(max_batch, timeout_s) -> [(ring, seq, op, payload), ...] */
static PyObject *Server_poll(ServerObject *self, PyObject *args)
{
    unsigned int max_batch;
    double timeout;
    bl_section sec;
    bl_rpc_request *batch = NULL;
    if (!PyArg_ParseTuple(args, "Id", &max_batch, &timeout) ||
        begin_poll(self, max_batch, &batch, &sec) < 0)
        return NULL;
    bl_rpc_hooks hooks = bl_section_hooks(&sec);
    int got = bl_rpc_server_gather(&self->s, batch, (int)max_batch, ns_of(timeout), &hooks);
    PyObject *out = end_poll(self, &sec) < 0 ? NULL : PyList_New(0);
    for (int i = 0; out && i < got; i++) {
        bl_rpc_request *q = &batch[i];
        PyObject *payload = payload_of(&q->line, server_load, &self->s, q);
        if (!payload) {
            if (PyErr_Occurred()) {
                Py_CLEAR(out);
                break;
            }
            bl_rpc_server_reject(&self->s, q->ring, q->seq, BL_RPC_CORRUPT,
                                 "request payload corrupt");
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
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), held = 0;
    Py_buffer *views = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    bl_rpc_reply *replies = PyMem_Calloc((size_t)(n ? n : 1), sizeof(bl_rpc_reply));
    int ok = views && replies;
    if (!ok)
        PyErr_NoMemory();
    for (; ok && held < n; held++) {
        unsigned int idx, s, status;
        Py_buffer *p = &views[held];
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, held), "IIIy*", &idx, &s, &status, p)) {
            ok = 0;
            break;
        }
        bl_rpc_ring_state *r = ring_arg(self, idx);
        if (!r || !r->active || (uint32_t)(r->head - s) - 1 >= r->g.depth || status > 0xffff) {
            if (r)
                bl_fail(bl_rpc_error, "ring %u has no outstanding request %u", idx, s);
            ok = 0;
        } else if (!bl_rpc_fits((size_t)p->len, r->g.buf)) {
            bl_fail(bl_rpc_error, "a %zd-byte response exceeds ring %u's %zu-byte slot buffer",
                    p->len, idx, r->g.buf);
            ok = 0;
        }
        replies[held] = (bl_rpc_reply){idx, s, (uint16_t)status, p->buf, (size_t)p->len};
    }
    if (ok && bl_rpc_server_respond(&self->s, replies, (size_t)n) < 0) {
        PyErr_NoMemory();
        ok = 0;
    }
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(replies);
    Py_DECREF(seq);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

/* serve_echo(duration_s) -> requests answered: the transport alone, all in C. */
static PyObject *Server_serve_echo(ServerObject *self, PyObject *args)
{
    double duration;
    bl_section sec;
    if (!PyArg_ParseTuple(args, "d", &duration))
        return NULL;
    if (begin_poll(self, 0, NULL, &sec) < 0)
        return NULL;
    bl_rpc_hooks hooks = bl_section_hooks(&sec);
    int64_t answered = bl_rpc_server_serve_echo(&self->s, ns_of(duration), &hooks);
    if (end_poll(self, &sec) < 0)
        return NULL;
    if (answered < 0)
        return PyErr_NoMemory();
    return PyLong_FromUnsignedLongLong((unsigned long long)answered);
}

/* stop(): make a running poll or serve_echo return promptly, waking it (thread-safe). */
static PyObject *Server_stop(ServerObject *self, PyObject *unused)
{
    bl_rpc_server_stop(&self->s, self->mem && self->mem->has_view);
    Py_RETURN_NONE;
}

/* served: responses written. */
static PyObject *Server_get_served(ServerObject *self, void *c)
{
    return PyLong_FromUnsignedLongLong(self->s.served);
}

/* rejected: malformed requests answered with an error. */
static PyObject *Server_get_rejected(ServerObject *self, void *c)
{
    return PyLong_FromUnsignedLongLong(self->s.rejected);
}

/* spin_s: how long the server spins after its last request. */
static PyObject *Server_get_spin(ServerObject *self, void *c)
{
    return PyFloat_FromDouble(1e-9 * (double)self->s.wait.spin_ns);
}

/* Set spin_s (0..3600 s). */
static int Server_set_spin(ServerObject *self, PyObject *v, void *c)
{
    return set_seconds(&self->s.wait.spin_ns, v, 0, 3600, "spin_s must be 0..3600 s");
}

/* torn_patience_s: how long a torn request line at a ring's head is waited for. */
static PyObject *Server_get_torn(ServerObject *self, void *c)
{
    return PyFloat_FromDouble(1e-9 * (double)self->s.torn_ns);
}

/* Set torn_patience_s (1e-3..3600 s). */
static int Server_set_torn(ServerObject *self, PyObject *v, void *c)
{
    return set_seconds(&self->s.torn_ns, v, 1e-3, 3600, "torn_patience_s must be 1e-3..3600 s");
}

/* sleep_s: the longest futex sleep before polling again. */
static PyObject *Server_get_sleep(ServerObject *self, void *c)
{
    return PyFloat_FromDouble(1e-9 * (double)self->s.wait.sleep_ns);
}

/* Set sleep_s (1e-6..10 s). */
static int Server_set_sleep(ServerObject *self, PyObject *v, void *c)
{
    return set_seconds(&self->s.wait.sleep_ns, v, 1e-6, 10, "sleep_s must be 1e-6..10 s");
}

/* wait_stats: how polls backed off (yields, naps, futex sleeps and how they ended, wakes sent). */
static PyObject *Server_get_stats(ServerObject *self, void *c) { return stats_dict(&self->s.stats); }

static PyMethodDef Server_methods[] = {
    {"set_ring", (PyCFunction)Server_set_ring, METH_VARARGS, "set_ring(idx, gen, depth, head, wake=False)"},
    {"clear_ring", (PyCFunction)Server_clear_ring, METH_VARARGS, "clear_ring(idx)"},
    {"recover_head", (PyCFunction)Server_recover_head, METH_VARARGS,
     "recover_head(idx, gen, depth, first_seq) -> next seq: the oldest request left unanswered"},
    {"refuse_pending", (PyCFunction)Server_refuse_pending, METH_VARARGS,
     "refuse_pending(idx) -> how many requests left by a gone server were answered RESTARTED"},
    {"unanswered", (PyCFunction)Server_unanswered, METH_VARARGS,
     "unanswered(idx, seq) -> whether request seq has no answer, or only RESTARTED"},
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
    {"spin_s", (getter)Server_get_spin, (setter)Server_set_spin, "spin after the last request", NULL},
    {"sleep_s", (getter)Server_get_sleep, (setter)Server_set_sleep, "longest futex sleep", NULL},
    {"torn_patience_s", (getter)Server_get_torn, (setter)Server_set_torn,
     "how long a torn request line at head is waited for before it is answered corrupt", NULL},
    {"wait_stats", (getter)Server_get_stats, NULL, "how polls backed off", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ServerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = BL_TYPE_PREFIX "RingServer",
    .tp_basicsize = sizeof(ServerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The server end of every RPC ring of a pool.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Server_init,
    .tp_dealloc = (destructor)Server_dealloc,
    .tp_methods = Server_methods,
    .tp_getset = Server_getset,
};

/* ---------------------------------------------------------------- the format */

/* rpc_buf_size(ring_bytes, depth) -> slot buffer bytes (shared geometry). */
static PyObject *mod_rpc_buf_size(PyObject *mod, PyObject *args)
{
    unsigned long long ring_bytes;
    unsigned int depth;
    if (!PyArg_ParseTuple(args, "KI", &ring_bytes, &depth))
        return NULL;
    return PyLong_FromSize_t(bl_rpc_buf_size(ring_bytes, depth));
}

/* rpc_slot_lines(depth, slot) -> (request line, response line) offsets inside a ring. */
static PyObject *mod_rpc_slot_lines(PyObject *mod, PyObject *args)
{
    unsigned int depth, slot;
    if (!PyArg_ParseTuple(args, "II", &depth, &slot))
        return NULL;
    if (!depth || depth > BL_RPC_MAX_DEPTH || slot >= depth)
        return bl_fail(PyExc_ValueError, "need 1 <= depth <= %u and slot < depth", BL_RPC_MAX_DEPTH);
    bl_rpc_ring g = {0, depth, 0};
    return Py_BuildValue("(nn)", (Py_ssize_t)bl_rpc_req_line(&g, slot),
                         (Py_ssize_t)bl_rpc_resp_line(&g, slot));
}

/* rpc_slot_buffers(ring_bytes, depth, slot) -> (request buffer, response buffer) offsets
 * inside a ring: where a slot's out-of-line payloads go. */
static PyObject *mod_rpc_slot_buffers(PyObject *mod, PyObject *args)
{
    unsigned long long ring_bytes;
    unsigned int depth, slot;
    if (!PyArg_ParseTuple(args, "KII", &ring_bytes, &depth, &slot))
        return NULL;
    if (bl_rpc_ring_check(SIZE_MAX, 0, ring_bytes, depth) || slot >= depth)
        return bl_fail(PyExc_ValueError,
                       "need 1 <= depth <= %u, slot < depth and a ring of at least the "
                       "head and 2 * depth lines",
                       BL_RPC_MAX_DEPTH);
    bl_rpc_ring g = bl_rpc_ring_at(0, ring_bytes, depth);
    return Py_BuildValue("(nn)", (Py_ssize_t)bl_rpc_req_buf(&g, slot),
                         (Py_ssize_t)bl_rpc_resp_buf(&g, slot));
}

/* rpc_pack_line(seq, code, flags, length, gen, inline, payload_crc) -> one sealed line. */
static PyObject *mod_rpc_pack_line(PyObject *mod, PyObject *args)
{
    unsigned int seq, code, flags, len, gen, payload_crc;
    const char *data;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "IIIIIy#I", &seq, &code, &flags, &len, &gen, &data, &n,
                          &payload_crc))
        return NULL;
    if (code > 0xffff || flags > 0xffff || n > BL_RPC_INLINE)
        return bl_fail(PyExc_ValueError, "code and flags are 16 bits, inline at most %u bytes",
                       BL_RPC_INLINE);
    bl_rpc_line ln = {.seq = seq, .code = (uint16_t)code, .flags = (uint16_t)flags, .len = len,
                      .gen = gen, .payload_crc = payload_crc};
    memcpy(ln.data, data, (size_t)n);
    bl_record_seal(&ln, sizeof(ln));
    return PyBytes_FromStringAndSize((const char *)&ln, sizeof(ln));
}

/* rpc_parse_line(line) -> (seq, code, flags, length, gen, inline, payload_crc), or None if torn. */
static PyObject *mod_rpc_parse_line(PyObject *mod, PyObject *args)
{
    Py_buffer b;
    bl_rpc_line ln;
    if (!PyArg_ParseTuple(args, "y*", &b))
        return NULL;
    if (b.len != (Py_ssize_t)sizeof(ln)) {
        PyBuffer_Release(&b);
        return bl_fail(PyExc_ValueError, "an RPC line is %u bytes, got %zd", BL_LINE, b.len);
    }
    memcpy(&ln, b.buf, sizeof(ln));
    PyBuffer_Release(&b);
    if (!bl_record_sealed(&ln, sizeof(ln)))
        Py_RETURN_NONE;
    return Py_BuildValue("(IIIIIy#I)", ln.seq, (unsigned)ln.code, (unsigned)ln.flags, ln.len, ln.gen,
                         (const char *)ln.data, (Py_ssize_t)BL_RPC_INLINE, ln.payload_crc);
}

static PyMethodDef rpc_functions[] = {
    {"rpc_pack_line", mod_rpc_pack_line, METH_VARARGS,
     "rpc_pack_line(seq, code, flags, length, gen, inline, payload_crc) -> bytes"},
    {"rpc_parse_line", mod_rpc_parse_line, METH_VARARGS,
     "rpc_parse_line(line) -> (seq, code, flags, length, gen, inline, payload_crc) | None"},
    {"rpc_buf_size", mod_rpc_buf_size, METH_VARARGS, "rpc_buf_size(ring_bytes, depth) -> int"},
    {"rpc_slot_lines", mod_rpc_slot_lines, METH_VARARGS,
     "rpc_slot_lines(depth, slot) -> (request line offset, response line offset)"},
    {"rpc_slot_buffers", mod_rpc_slot_buffers, METH_VARARGS,
     "rpc_slot_buffers(ring_bytes, depth, slot) -> (request buffer offset, response buffer "
     "offset)"},
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
        PyModule_AddIntConstant(module, "RPC_CONTROL", BL_RPC_CONTROL) < 0 ||
        PyModule_AddIntConstant(module, "RPC_STATUS", BL_RPC_STATUS) < 0 ||
        PyModule_AddIntConstant(module, "RPC_CLIENT_WAKE", BL_RPC_CLIENT_WAKE) < 0 ||
        PyModule_AddIntConstant(module, "RPC_SERVER_WAKE", BL_RPC_SERVER_WAKE) < 0 ||
        PyModule_AddIntConstant(module, "RPC_HEAD", BL_RPC_HEAD) < 0 ||
        PyModule_AddIntConstant(module, "RPC_DOORBELL", BL_RPC_DOORBELL) < 0 ||
        PyModule_AddIntConstant(module, "RPC_DOORBELL_COUNT", BL_RPC_DOORBELL_COUNT) < 0 ||
        PyModule_AddIntConstant(module, "RPC_MAX_DEPTH", BL_RPC_MAX_DEPTH) < 0 ||
        PyModule_AddIntConstant(module, "RPC_OOL", BL_RPC_OOL) < 0 ||
        PyModule_AddIntConstant(module, "ST_BAD_LENGTH", BL_RPC_BAD_LENGTH) < 0 ||
        PyModule_AddIntConstant(module, "ST_CORRUPT", BL_RPC_CORRUPT) < 0 ||
        PyModule_AddIntConstant(module, "ST_RESTARTED", BL_RPC_RESTARTED) < 0)
        return -1;
    return 0;
}
