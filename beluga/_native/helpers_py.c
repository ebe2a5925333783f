/*
 * helpers_py.c - the few helpers every binding file shares: errors, digest arguments
 * and sections.
 *
 * Errors: misuse raises the class the package registered (beluga.errors'
 * CoherenceError, or RpcError for the RPC), ValueError before that.
 *
 * Sections: code that touches a Memory's mapping, possibly without the GIL,
 * runs inside one (bl_section_enter / bl_section_leave).  A section counts
 * itself busy before it checks that the Memory is attached and not closing;
 * release() (memory_py.c) marks the Memory closing before it looks at the
 * busy count (the two orders make a Dekker pair: one side always sees the
 * other), then waits for sections to end.  Long loops of the core take the
 * section as bl_rpc_hooks: let go of the GIL, and stop when closing.
 */
#include "beluga_py.h"

PyObject *bl_coherence_error, *bl_rpc_error;

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

/* A 16-byte key digest argument into d: 1, or 0 with ValueError. */
int bl_digest_arg(PyObject *o, uint8_t d[16])
{
    Py_buffer v;
    if (PyObject_GetBuffer(o, &v, PyBUF_SIMPLE) < 0)
        return 0;
    int ok = v.len == 16;
    if (ok)
        memcpy(d, v.buf, 16);
    PyBuffer_Release(&v);
    if (!ok)
        PyErr_Format(PyExc_ValueError, "a key digest is 16 bytes (key_digest), not %zd", v.len);
    return ok;
}

/* A buffer of 16-byte digest records (numpy "V16") into v, n records: 0, or -1 with
 * ValueError (the buffer released).  The caller releases v. */
int bl_digests_arg(PyObject *o, Py_buffer *v, Py_ssize_t *n)
{
    if (PyObject_GetBuffer(o, v, PyBUF_SIMPLE) < 0)
        return -1;
    if (v->len % 16) {
        PyErr_Format(PyExc_ValueError,
                     "digests are 16-byte records; %zd bytes is not a whole number of them", v->len);
        PyBuffer_Release(v);
        return -1;
    }
    *n = v->len / 16;
    return 0;
}

/* A batch test over a buffer of 16-byte digest records: bytes, one a record, 1 where
 * has(ctx, digest) is true; NULL with ValueError for a bad buffer. */
PyObject *bl_digests_test(PyObject *o, int (*has)(const void *ctx, const uint8_t d[16]),
                          const void *ctx)
{
    Py_buffer v;
    Py_ssize_t n;
    if (bl_digests_arg(o, &v, &n) < 0)
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (out) {
        const uint8_t(*d)[16] = v.buf;
        char *w = PyBytes_AS_STRING(out);
        for (Py_ssize_t i = 0; i < n; i++)
            w[i] = has(ctx, d[i]) != 0;
    }
    PyBuffer_Release(&v);
    return out;
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

/* bl_rpc_hooks let_go: drop the GIL for the rest of the section. */
static void section_let_go(void *s) { bl_section_gil(s, 1); }

/* bl_rpc_hooks stopping: the Memory is being released. */
static int section_stopping(void *s) { return bl_section_closing(s); }

/* A section as the hooks of a core loop that may wait long. */
bl_rpc_hooks bl_section_hooks(bl_section *s)
{
    return (bl_rpc_hooks){section_let_go, section_stopping, s};
}
