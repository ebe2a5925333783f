/*
 * keytable_py.c - the Python face of the cold keys' table (keytable.c): KeyTable.
 *
 * beluga/server/keyindex.py's KeyIndex holds one: digest -> the row of a cold key in
 * its columns.  Batch calls (add, contains) take the digests as one buffer of 16-byte
 * records, as numpy's "V16" columns hand them over.  Not thread-safe (the server's one
 * thread uses it, under the GIL); a forked child gets its own copy of the memory.
 */
#include "beluga_py.h"

typedef struct {
    PyObject_HEAD
    bl_kt t;
    int ready;
} KeyTableObject;

/* KeyTable(seed, hint=0) */
static int KeyTable_init(KeyTableObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"seed", "hint", NULL};
    unsigned long long seed, hint = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "K|K", kwlist, &seed, &hint))
        return -1;
    if (hint > (1ull << 40)) {
        PyErr_Format(PyExc_ValueError, "a KeyTable holds at most 2**40 keys, not %llu", hint);
        return -1;
    }
    bl_kt_free(&self->t);
    self->ready = 0;
    if (bl_kt_init(&self->t, hint, seed) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    self->ready = 1;
    return 0;
}

static void KeyTable_dealloc(KeyTableObject *self)
{
    bl_kt_free(&self->t);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* 0 when the table can be used, else -1 with an error set. */
static int ready(KeyTableObject *self)
{
    if (self->ready)
        return 0;
    PyErr_SetString(PyExc_ValueError, "KeyTable was not initialised");
    return -1;
}

/* A buffer of 16-byte digests into v (n records); 0, or -1 with ValueError. */
/* add(digests, first) -> None: digest i gets id first + i; none may be there already
 * (ValueError, and the table is as before) */
static PyObject *KeyTable_add(KeyTableObject *self, PyObject *args)
{
    PyObject *o;
    long long first;
    Py_buffer v;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OL", &o, &first) || ready(self) < 0)
        return NULL;
    if (first < 0 || first > (1ll << 62))
        return PyErr_Format(PyExc_ValueError, "ids start at 0 and stay below 2**62, not %lld", first);
    if (bl_digests_arg(o, &v, &n) < 0)
        return NULL;
    const uint8_t(*d)[16] = v.buf;
    if (bl_kt_reserve(&self->t, (uint64_t)n) < 0) {
        PyBuffer_Release(&v);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (bl_kt_put(&self->t, d[i], first + i) == 1)
            continue;
        for (Py_ssize_t j = 0; j < i; j++) /* undo this call's inserts */
            bl_kt_pop(&self->t, d[j]);
        PyBuffer_Release(&v);
        return PyErr_Format(PyExc_ValueError,
                            "digest %zd of the batch is already in the table (or twice in the "
                            "batch); nothing was added",
                            i);
    }
    PyBuffer_Release(&v);
    Py_RETURN_NONE;
}

/* Whether table t holds digest d (contains's test). */
static int holds(const void *t, const uint8_t d[16]) { return bl_kt_get(t, d) >= 0; }

/* contains(digests) -> bytes: one byte a digest, 1 when the table holds it */
static PyObject *KeyTable_contains(KeyTableObject *self, PyObject *o)
{
    if (ready(self) < 0)
        return NULL;
    return bl_digests_test(o, holds, &self->t);
}

/* get(digest) -> id, or -1 when absent */
static PyObject *KeyTable_get(KeyTableObject *self, PyObject *o)
{
    uint8_t d[16];
    if (ready(self) < 0 || !bl_digest_arg(o, d))
        return NULL;
    return PyLong_FromLongLong(bl_kt_get(&self->t, d));
}

/* pop(digest) -> id, or -1 when absent */
static PyObject *KeyTable_pop(KeyTableObject *self, PyObject *o)
{
    uint8_t d[16];
    if (ready(self) < 0 || !bl_digest_arg(o, d))
        return NULL;
    return PyLong_FromLongLong(bl_kt_pop(&self->t, d));
}

/* len(table): the keys it holds */
static Py_ssize_t KeyTable_len(KeyTableObject *self)
{
    return self->ready ? (Py_ssize_t)self->t.live : 0;
}

/* nbytes: the memory its arrays take */
static PyObject *KeyTable_nbytes(KeyTableObject *self, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLongLong(self->ready ? (self->t.mask + 1) * 24 : 0);
}

static PyMethodDef KeyTable_methods[] = {
    {"add", (PyCFunction)KeyTable_add, METH_VARARGS,
     "add(digests, first): digest i (16-byte records) gets id first + i; refuses any already there"},
    {"contains", (PyCFunction)KeyTable_contains, METH_O,
     "contains(digests) -> bytes: 1 for each digest the table holds, else 0"},
    {"get", (PyCFunction)KeyTable_get, METH_O, "get(digest) -> its id, or -1"},
    {"pop", (PyCFunction)KeyTable_pop, METH_O, "pop(digest) -> its id (now removed), or -1"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef KeyTable_getset[] = {
    {"nbytes", (getter)KeyTable_nbytes, NULL, "bytes of memory the table's arrays take", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods KeyTable_as_sequence = {
    .sq_length = (lenfunc)KeyTable_len,
};

static PyTypeObject KeyTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "beluga._native._core.KeyTable",
    .tp_basicsize = sizeof(KeyTableObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "digest -> id for the server's cold keys (keytable.c); not thread-safe",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)KeyTable_init,
    .tp_dealloc = (destructor)KeyTable_dealloc,
    .tp_methods = KeyTable_methods,
    .tp_getset = KeyTable_getset,
    .tp_as_sequence = &KeyTable_as_sequence,
};

/* Register KeyTable in the module; 0, or -1 with an error set. */
int bl_keytable_init(PyObject *module)
{
    if (PyType_Ready(&KeyTableType) < 0)
        return -1;
    Py_INCREF(&KeyTableType);
    return PyModule_AddObject(module, "KeyTable", (PyObject *)&KeyTableType);
}
