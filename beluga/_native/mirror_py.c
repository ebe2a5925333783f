/*
 * mirror_py.c - the Python face of the server's index mirror (mirror.c): IndexMirror.
 *
 * beluga/server/index.py's PoolIndex holds one and calls it for every write of the
 * pool index; each method is one call into mirror.c over the Memory's bl_memops
 * table, inside a section (so release() cannot unmap under it), with the GIL held
 * (the calls are short).  Not thread-safe (the server's one thread uses it) and not
 * fork-safe (a child must not write the parent's index).
 */
#include <stddef.h>

#include "beluga_py.h"
#include "structmember.h"

typedef struct {
    PyObject_HEAD
    MemoryObject *mem;
    bl_ixm x;
    int ready;
} MirrorObject;

/* IndexMirror(memory, index_off, nbuckets, headers_off, payloads_off, block_size, nblocks,
 *             commits_off) */
static int Mirror_init(MirrorObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"memory",     "index_off", "nbuckets",    "headers_off", "payloads_off",
                             "block_size", "nblocks",   "commits_off", NULL};
    PyObject *mem;
    unsigned long long index_off, nbuckets, headers_off, payloads_off, block_size, nblocks,
        commits_off;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!KKKKKKK", kwlist, &BlMemoryType, &mem,
                                     &index_off, &nbuckets, &headers_off, &payloads_off,
                                     &block_size, &nblocks, &commits_off))
        return -1;
    MemoryObject *mo = (MemoryObject *)mem;
    if (!mo->has_view) {
        bl_fail(bl_coherence_error, "this Memory was released; attach the pool again");
        return -1;
    }
    bl_ix ix = {index_off, nbuckets, headers_off, payloads_off, block_size, nblocks};
    if (self->ready) {
        bl_fail(bl_coherence_error, "this IndexMirror is in use; make a new one");
        return -1;
    }
    if (!bl_ix_geometry_ok(mo->mem.size, &ix, -1) || nblocks > UINT32_MAX ||
        commits_off % 8 || commits_off > mo->mem.size || nblocks > (mo->mem.size - commits_off) / 8) {
        bl_fail(bl_coherence_error,
                "index geometry does not fit the %zu-byte mapping (or nbuckets is not a power "
                "of two); make the mirror through beluga.server.index.PoolIndex, which reads it "
                "from the superblock",
                mo->mem.size);
        return -1;
    }
    if (bl_ixm_init(&self->x, &ix, commits_off) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    Py_XSETREF(self->mem, (MemoryObject *)Py_NewRef(mem));
    self->ready = 1;
    return 0;
}

static void Mirror_dealloc(MirrorObject *self)
{
    bl_ixm_free(&self->x);
    Py_CLEAR(self->mem);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Enter a section over the mirror's Memory; 0, or -1 with an error set. */
static int enter(MirrorObject *self, bl_section *s)
{
    if (!self->ready) {
        bl_fail(bl_coherence_error, "IndexMirror was not initialised");
        return -1;
    }
    return bl_section_enter(s, self->mem, 0, NULL, NULL);
}

/* find(digest) -> (block, version) | None: its buckets loaded and resolved as needed */
static PyObject *Mirror_find(MirrorObject *self, PyObject *digest)
{
    uint8_t d[16];
    uint32_t block;
    uint64_t version;
    bl_section s;
    if (!bl_digest_arg(digest, d) || enter(self, &s) < 0)
        return NULL;
    int got = bl_ixm_find(&self->mem->mem, &self->x, d, &block, &version);
    bl_section_leave(&s);
    if (!got)
        Py_RETURN_NONE;
    return Py_BuildValue("(IK)", block, (unsigned long long)version);
}

/* slot_of(digest) -> slot number | None: the mirror alone (nothing loaded or resolved) */
static PyObject *Mirror_slot_of(MirrorObject *self, PyObject *digest)
{
    uint8_t d[16];
    if (!bl_digest_arg(digest, d))
        return NULL;
    if (!self->ready)
        return bl_fail(bl_coherence_error, "IndexMirror was not initialised");
    int64_t at = bl_ixm_slot_of(&self->x, d);
    if (at < 0)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(at);
}

/* Whether mirror x has digest d resolved in a slot (placed's test). */
static int resolved(const void *x, const uint8_t d[16]) { return bl_ixm_slot_of(x, d) >= 0; }

/* placed(digests) -> bytes: one byte a digest (16-byte records), 1 when the mirror has
 * it resolved in a slot (slot_of for each, nothing loaded or resolved) */
static PyObject *Mirror_placed(MirrorObject *self, PyObject *o)
{
    if (!self->ready)
        return bl_fail(bl_coherence_error, "IndexMirror was not initialised");
    return bl_digests_test(o, resolved, &self->x);
}

/* put(digest, block, version) -> bool (False: no slot could be made free) */
static PyObject *Mirror_put(MirrorObject *self, PyObject *args)
{
    PyObject *digest;
    unsigned long long block, version;
    uint8_t d[16];
    bl_section s;
    if (!PyArg_ParseTuple(args, "OKK", &digest, &block, &version) || !bl_digest_arg(digest, d))
        return NULL;
    if (block > UINT32_MAX)
        return PyErr_Format(PyExc_ValueError, "a block number fits 32 bits, not %llu", block);
    if (enter(self, &s) < 0)
        return NULL;
    int ok = bl_ixm_put(&self->mem->mem, &self->x, d, (uint32_t)block, version);
    bl_section_leave(&s);
    return PyBool_FromLong(ok);
}

/* crowd(digest) -> [digest]: the keys in its two buckets, resolved */
static PyObject *Mirror_crowd(MirrorObject *self, PyObject *digest)
{
    uint8_t d[16], out[2 * BL_IX_SLOTS][16];
    bl_section s;
    if (!bl_digest_arg(digest, d) || enter(self, &s) < 0)
        return NULL;
    int n = bl_ixm_crowd(&self->mem->mem, &self->x, d, out);
    bl_section_leave(&s);
    PyObject *list = PyList_New(n);
    for (int i = 0; list && i < n; i++) {
        PyObject *b = PyBytes_FromStringAndSize((const char *)out[i], 16);
        if (!b)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, i, b);
    }
    return list;
}

/* drop(digest): take it out of the index (unfenced) */
static PyObject *Mirror_drop(MirrorObject *self, PyObject *digest)
{
    uint8_t d[16];
    bl_section s;
    if (!bl_digest_arg(digest, d) || enter(self, &s) < 0)
        return NULL;
    bl_ixm_drop(&self->mem->mem, &self->x, d);
    bl_section_leave(&s);
    Py_RETURN_NONE;
}

/* scrub(n) -> buckets rewritten among the next n */
static PyObject *Mirror_scrub(MirrorObject *self, PyObject *arg)
{
    long long n = PyLong_AsLongLong(arg);
    bl_section s;
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0)
        return PyErr_Format(PyExc_ValueError, "scrub takes a count of buckets >= 0, not %lld", n);
    if (enter(self, &s) < 0)
        return NULL;
    uint64_t fixed = bl_ixm_scrub(&self->mem->mem, &self->x, (uint64_t)n);
    bl_section_leave(&s);
    return PyLong_FromUnsignedLongLong(fixed);
}

/* reconcile(lo, hi, lines, keep, digests) -> (kept, dropped): lines the pool's lines of
 * buckets [lo, hi); keep int64 slot numbers relative to lo's first slot, confirmed to name
 * digests (16 bytes each, concatenated) */
static PyObject *Mirror_reconcile(MirrorObject *self, PyObject *args)
{
    unsigned long long lo, hi;
    Py_buffer lines, keep, digests;
    bl_section s;
    uint64_t kept = 0, dropped = 0;
    if (!PyArg_ParseTuple(args, "KKy*y*y*", &lo, &hi, &lines, &keep, &digests))
        return NULL;
    const char *bad = NULL;
    size_t n = (size_t)keep.len / sizeof(int64_t);
    if (!self->ready)
        bad = "IndexMirror was not initialised";
    else if (lo > hi || hi > self->x.ix.nbuckets)
        bad = "a range of buckets lies in [0, nbuckets]";
    else if ((size_t)lines.len != (hi - lo) * BL_LINE)
        bad = "reconcile takes the range's bucket lines, one 64-byte line a bucket";
    else if (keep.len % sizeof(int64_t) || (size_t)digests.len != n * 16)
        bad = "reconcile takes int64 slot numbers and a 16-byte digest for each";
    for (size_t i = 0; !bad && i < n; i++) {
        int64_t k;
        memcpy(&k, (const char *)keep.buf + i * sizeof(k), sizeof(k));
        if (k < 0 || (uint64_t)k >= (hi - lo) * BL_IX_SLOTS)
            bad = "reconcile's slot numbers lie in the range";
    }
    int r = 0;
    if (!bad && enter(self, &s) == 0) {
        /* copies: the buffers need not be aligned for the line and int64 views */
        bl_ix_bucket *l = PyMem_Malloc(lines.len ? (size_t)lines.len : 1);
        int64_t *k = PyMem_Malloc(keep.len ? (size_t)keep.len : 1);
        if (l && k) {
            memcpy(l, lines.buf, (size_t)lines.len);
            memcpy(k, keep.buf, (size_t)keep.len);
            r = bl_ixm_reconcile(&self->mem->mem, &self->x, lo, hi, l, k,
                                 (const uint8_t(*)[16])digests.buf, n, &kept, &dropped);
        } else {
            r = -1;
        }
        PyMem_Free(l);
        PyMem_Free(k);
        bl_section_leave(&s);
        if (r < 0)
            PyErr_NoMemory();
    }
    PyBuffer_Release(&lines);
    PyBuffer_Release(&keep);
    PyBuffer_Release(&digests);
    if (bad)
        return PyErr_Format(PyExc_ValueError, "%s", bad);
    if (PyErr_Occurred())
        return NULL;
    return Py_BuildValue("(KK)", (unsigned long long)kept, (unsigned long long)dropped);
}

/* loaded_all(): every bucket has been reconciled */
static PyObject *Mirror_loaded_all(MirrorObject *self, PyObject *unused)
{
    if (self->ready)
        bl_ixm_loaded_all(&self->x);
    Py_RETURN_NONE;
}

/* reset(): forget every bucket (the counters stay) */
static PyObject *Mirror_reset(MirrorObject *self, PyObject *unused)
{
    if (self->ready)
        bl_ixm_reset(&self->x);
    Py_RETURN_NONE;
}

/* digests() -> [digest]: every key the mirror has resolved, in slot order */
static PyObject *Mirror_digests(MirrorObject *self, PyObject *unused)
{
    PyObject *list = PyList_New(0);
    uint64_t nslots = self->ready ? self->x.ix.nbuckets * BL_IX_SLOTS : 0;
    for (uint64_t at = 0; list && at < nslots; at++) {
        if (self->x.state[at] != 2)
            continue;
        PyObject *b = PyBytes_FromStringAndSize((const char *)self->x.digest[at], 16);
        if (!b || PyList_Append(list, b) < 0)
            Py_CLEAR(list);
        Py_XDECREF(b);
    }
    return list;
}

/* loaded: bytes, one per bucket (1: the mirror holds it), or None once all are */
static PyObject *Mirror_get_loaded(MirrorObject *self, void *unused)
{
    if (!self->ready || self->x.all_loaded)
        Py_RETURN_NONE;
    return PyBytes_FromStringAndSize((const char *)self->x.loaded, (Py_ssize_t)self->x.ix.nbuckets);
}

static Py_ssize_t Mirror_len(MirrorObject *self) { return (Py_ssize_t)self->x.resolved; }

static PyMethodDef Mirror_methods[] = {
    {"find", (PyCFunction)Mirror_find, METH_O, "find(digest) -> (block, version) | None"},
    {"slot_of", (PyCFunction)Mirror_slot_of, METH_O, "slot_of(digest) -> slot | None"},
    {"placed", (PyCFunction)Mirror_placed, METH_O,
     "placed(digests) -> bytes: 1 for each digest (16-byte records) slot_of finds, else 0"},
    {"put", (PyCFunction)Mirror_put, METH_VARARGS, "put(digest, block, version) -> bool"},
    {"crowd", (PyCFunction)Mirror_crowd, METH_O, "crowd(digest) -> [digest]"},
    {"drop", (PyCFunction)Mirror_drop, METH_O, "drop(digest)"},
    {"scrub", (PyCFunction)Mirror_scrub, METH_O, "scrub(n) -> buckets rewritten"},
    {"reconcile", (PyCFunction)Mirror_reconcile, METH_VARARGS,
     "reconcile(lo, hi, lines, keep, digests) -> (kept, dropped)"},
    {"loaded_all", (PyCFunction)Mirror_loaded_all, METH_NOARGS, "loaded_all()"},
    {"reset", (PyCFunction)Mirror_reset, METH_NOARGS, "reset(): forget every bucket"},
    {"digests", (PyCFunction)Mirror_digests, METH_NOARGS, "digests() -> [digest]"},
    {NULL},
};

static PyMemberDef Mirror_members[] = {
    {"moves", T_ULONGLONG, offsetof(MirrorObject, x.moves), READONLY, "entries moved"},
    {"failed", T_ULONGLONG, offsetof(MirrorObject, x.failed), READONLY, "puts with no slot"},
    {"scrubbed", T_ULONGLONG, offsetof(MirrorObject, x.scrubbed), READONLY,
     "buckets the scrub found damaged and rewrote"},
    {"unconfirmed", T_ULONGLONG, offsetof(MirrorObject, x.unconfirmed), READONLY,
     "slots dropped because their block's header did not name them"},
    {"scrub_at", T_ULONGLONG, offsetof(MirrorObject, x.scrub_at), 0,
     "the bucket the next scrub starts at (taken modulo nbuckets)"},
    {NULL},
};

static PyGetSetDef Mirror_getset[] = {
    {"loaded", (getter)Mirror_get_loaded, NULL, "per bucket: held (bytes), or None: all", NULL},
    {NULL},
};

static PySequenceMethods Mirror_as_sequence = {.sq_length = (lenfunc)Mirror_len};

static PyTypeObject MirrorType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "beluga._native._core.IndexMirror",
    .tp_basicsize = sizeof(MirrorObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The metadata server's mirror of the pool index and its writes (mirror.c). "
              "Not thread-safe, not fork-safe: the server's one thread owns it.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Mirror_init,
    .tp_dealloc = (destructor)Mirror_dealloc,
    .tp_methods = Mirror_methods,
    .tp_members = Mirror_members,
    .tp_getset = Mirror_getset,
    .tp_as_sequence = &Mirror_as_sequence,
};

/* Add the IndexMirror type to the module. */
int bl_mirror_init(PyObject *module)
{
    if (PyType_Ready(&MirrorType) < 0)
        return -1;
    Py_INCREF(&MirrorType);
    return PyModule_AddObject(module, "IndexMirror", (PyObject *)&MirrorType);
}
