/*
 * index_py.c - the Python face of the pool index: the Index type and the format helpers.
 *
 * Index runs a whole get / get_into / batch in one call: key digest
 * (blake3.c), probe, confirm, copy, checksum, re-check (index.c); the GIL is
 * dropped for large copies.  Thread-safe (state that changes, the hint
 * buffer, is touched only with the GIL held); the Memory's section count
 * keeps release() from unmapping under a copy.  An Index inherited by a
 * forked child still reads correctly but stops writing hint lines (they are
 * its parent's host id's).
 *
 * The module functions give the server's writer (beluga/server/index.py) and the
 * tests the formats index.c owns: key digests, a digest's buckets, a bucket
 * line, a counts line, the hints of a ring.
 */
#include "beluga_py.h"

#define PROBE_CHUNK 256 /* keys looked up together by locate / exists */
#define PREFIX_FIRST 32  /* a prefix's first chunk: a chain that misses early stops there */

typedef struct {
    PyObject_HEAD
    MemoryObject *mem;
    bl_ix ix;
    bl_ix_hints hints;
} IndexObject;

/* Record one probe (GIL held); store the hint lines when due and the Memory is attached. */
static void record(IndexObject *self, int hit, uint32_t block, uint64_t version)
{
    if (bl_ix_note(&self->hints, hit, block, version) && self->mem->has_view)
        bl_ix_flush_hints(&self->mem->mem, &self->hints);
}

/* A str key's UTF-8 bytes: an ASCII string's own characters (the same bytes, no call), else
 * PyUnicode_AsUTF8AndSize's; NULL with an error raised. */
static const char *str_bytes(PyObject *key, Py_ssize_t *n)
{
#if PY_VERSION_HEX < 0x030C0000
    if (!PyUnicode_IS_READY(key))
        return PyUnicode_AsUTF8AndSize(key, n);
#endif
    if (PyUnicode_IS_ASCII(key)) {
        *n = PyUnicode_GET_LENGTH(key);
        return (const char *)PyUnicode_DATA(key);
    }
    return PyUnicode_AsUTF8AndSize(key, n);
}

/* A key (str or bytes-like, 1..256 bytes) to its digest; 0 with ValueError raised otherwise. */
static int key_digest(PyObject *key, uint8_t out[16])
{
    if (PyUnicode_Check(key)) {
        Py_ssize_t n;
        const char *s = str_bytes(key, &n);
        if (!s)
            return 0;
        if (n < 1 || (size_t)n > BL_MAX_KEY) {
            PyErr_Format(PyExc_ValueError,
                         "a key is 1..%d bytes, not %zd; hash longer keys (e.g. "
                         "hashlib.sha256(key).digest())",
                         (int)BL_MAX_KEY, n);
            return 0;
        }
        bl_key_digest(s, (size_t)n, out);
        return 1;
    }
    Py_buffer v;
    if (PyObject_GetBuffer(key, &v, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "a key is str or bytes, not %s", Py_TYPE(key)->tp_name);
        return 0;
    }
    int ok = v.len >= 1 && (size_t)v.len <= BL_MAX_KEY;
    if (ok)
        bl_key_digest(v.buf, (size_t)v.len, out);
    else
        PyErr_Format(PyExc_ValueError,
                     "a key is 1..%d bytes, not %zd; hash longer keys (e.g. "
                     "hashlib.sha256(key).digest())",
                     (int)BL_MAX_KEY, v.len);
    PyBuffer_Release(&v);
    return ok;
}

/* Index(memory, index_off, nbuckets, headers_off, payloads_off, block_size, nblocks,
 *       hint_off=-1, owner=0) */
static int Index_init(IndexObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"memory",     "index_off", "nbuckets", "headers_off", "payloads_off",
                             "block_size", "nblocks",   "hint_off", "owner",       NULL};
    PyObject *mem;
    unsigned long long index_off, nbuckets, headers_off, payloads_off, block_size, nblocks;
    unsigned long long owner = 0;
    long long hint_off = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!KKKKKK|LK", kwlist, &BlMemoryType, &mem,
                                     &index_off, &nbuckets, &headers_off, &payloads_off,
                                     &block_size, &nblocks, &hint_off, &owner))
        return -1;
    MemoryObject *mo = (MemoryObject *)mem;
    if (!mo->has_view) {
        bl_fail(bl_coherence_error, "this Memory was released; attach the pool again");
        return -1;
    }
    bl_ix ix = {index_off, nbuckets, headers_off, payloads_off, block_size, nblocks};
    if (!bl_ix_geometry_ok(mo->mem.size, &ix, hint_off)) {
        bl_fail(bl_coherence_error,
                "index geometry does not fit the %zu-byte mapping (or nbuckets is not a power "
                "of two); attach through beluga.pool.Pool, which reads it from the superblock",
                mo->mem.size);
        return -1;
    }
    Py_XSETREF(self->mem, (MemoryObject *)Py_NewRef(mem));
    self->ix = ix;
    bl_ix_hints_init(&self->hints, hint_off, owner);
    return 0;
}

/* Flush what is buffered, then drop the Memory. */
static void Index_dealloc(IndexObject *self)
{
    bl_section s;
    if (self->mem && self->hints.unflushed) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (bl_section_enter(&s, self->mem, 0, NULL, NULL) == 0) {
            bl_ix_flush_hints(&self->mem->mem, &self->hints);
            bl_section_leave(&s);
        }
        PyErr_Restore(type, value, tb); /* a released Memory: nothing to flush into */
    }
    Py_CLEAR(self->mem);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Check that the Index was initialised; 0 with an error raised if not. */
static int ready(IndexObject *self)
{
    if (self->mem)
        return 1;
    bl_fail(bl_coherence_error, "Index was not initialised");
    return 0;
}

/* Raise the too-small error for a buffer of `have` bytes and a value of `need`. */
static PyObject *too_small(Py_ssize_t have, unsigned long long need)
{
    return PyErr_Format(PyExc_ValueError,
                        "the buffer holds %zd bytes but the value is %llu bytes; pass a buffer "
                        "of at least that size",
                        have, need);
}

/* get(key) -> bytes | None */
static PyObject *Index_get(IndexObject *self, PyObject *key)
{
    uint8_t d[16];
    if (!ready(self) || !key_digest(key, d))
        return NULL;
    for (int attempt = 0; attempt < 2; attempt++) {
        bl_section s;
        bl_header h;
        uint32_t block = 0;
        if (bl_section_enter(&s, self->mem, 0, NULL, NULL) < 0)
            return NULL;
        int64_t r = bl_ix_lookup(&self->mem->mem, &self->ix, d, &block, &h);
        if (r < 0) {
            bl_section_leave(&s);
            if (!bl_ix_is_race(r) || attempt)
                break;
            continue;
        }
        PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)r);
        if (!out) {
            bl_section_leave(&s);
            return NULL;
        }
        bl_section_gil(&s, (size_t)r >= BL_NOGIL_BYTES);
        int64_t got = bl_read_checked(&self->mem->mem, self->ix.headers_off + (size_t)block * BL_LINE,
                                      self->ix.payloads_off + (size_t)block * self->ix.block_size,
                                      &h, PyBytes_AS_STRING(out));
        bl_section_leave(&s);
        if (got == r) {
            record(self, 1, block, h.version);
            return out;
        }
        Py_DECREF(out);
        if (!bl_ix_is_race(got) && got != BL_TOO_SMALL)
            break;
    }
    record(self, 0, 0, 0);
    Py_RETURN_NONE;
}

/* get_into(key, buffer) -> the value's length, or -1 on a miss */
static PyObject *Index_get_into(IndexObject *self, PyObject *args)
{
    PyObject *key;
    Py_buffer out;
    uint8_t d[16];
    if (!ready(self) || !PyArg_ParseTuple(args, "Ow*", &key, &out))
        return NULL;
    if (!key_digest(key, d)) {
        PyBuffer_Release(&out);
        return NULL;
    }
    bl_section s;
    bl_header h = {0};
    uint32_t block = 0;
    int64_t r = 0;
    if (bl_section_enter(&s, self->mem, (size_t)out.len >= BL_NOGIL_BYTES, NULL, NULL) == 0) {
        r = bl_ix_read_into(&self->mem->mem, &self->ix, d, out.buf, (size_t)out.len, &block, &h);
        bl_section_leave(&s);
    }
    PyBuffer_Release(&out);
    if (PyErr_Occurred())
        return NULL;
    if (r == BL_TOO_SMALL)
        return too_small(out.len, (unsigned long long)h.length);
    record(self, r >= 0, block, h.version);
    return PyLong_FromLongLong(r >= 0 ? r : -1);
}

/* The bytes of the keys of a sequence: str as UTF-8, bytes, or any buffer (held until
 * keys_release). */
typedef struct {
    const uint8_t **key;
    size_t *len;
    Py_buffer *views;
    size_t held;
} key_list;

/* Release what keys_of took. */
static void keys_release(key_list *k)
{
    for (size_t i = 0; i < k->held; i++)
        PyBuffer_Release(&k->views[i]);
    PyMem_Free(k->views);
    PyMem_Free(k->key);
    PyMem_Free(k->len);
    memset(k, 0, sizeof(*k));
}

/* Each key's bytes (1..BL_MAX_KEY of them); 0 with an error raised (and nothing held). */
static int keys_of(PyObject *seq, Py_ssize_t n, key_list *k)
{
    size_t cap = (size_t)(n ? n : 1);
    memset(k, 0, sizeof(*k));
    k->key = PyMem_Malloc(cap * sizeof(*k->key));
    k->len = PyMem_Malloc(cap * sizeof(*k->len));
    if (!k->key || !k->len) {
        PyErr_NoMemory();
        goto fail;
    }
    uint8_t scratch[16];
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(seq, i);
        const char *p = NULL;
        Py_ssize_t size = 0;
        if (PyBytes_CheckExact(o)) {
            p = PyBytes_AS_STRING(o);
            size = PyBytes_GET_SIZE(o);
        } else if (PyUnicode_Check(o)) {
            if (!(p = str_bytes(o, &size)))
                goto fail;
        } else if (PyObject_CheckBuffer(o)) {
            if (!k->views && !(k->views = PyMem_Calloc(cap, sizeof(*k->views)))) {
                PyErr_NoMemory();
                goto fail;
            }
            if (PyObject_GetBuffer(o, &k->views[k->held], PyBUF_SIMPLE) < 0) {
                PyErr_Clear();
                key_digest(o, scratch); /* raises what a bad key gets */
                goto fail;
            }
            p = k->views[k->held].buf, size = k->views[k->held++].len;
        }
        if (!p || size < 1 || (size_t)size > BL_MAX_KEY) {
            key_digest(o, scratch); /* raises what a bad key gets */
            goto fail;
        }
        k->key[i] = (const uint8_t *)p, k->len[i] = (size_t)size;
    }
    return 1;
fail:
    keys_release(k);
    return 0;
}

/* Digests of a sequence of keys into a new array (PyMem); NULL with an error raised.
 * Eight at a time (bl_key_digest_many). */
static uint8_t *digests_of(PyObject *seq, Py_ssize_t *n)
{
    *n = PySequence_Fast_GET_SIZE(seq);
    key_list k;
    uint8_t *d = PyMem_Malloc((size_t)(*n ? *n : 1) * 16);
    uint8_t **out = PyMem_Malloc((size_t)(*n ? *n : 1) * sizeof(*out));
    if (!d || !out) {
        PyMem_Free(d);
        PyMem_Free(out);
        PyErr_NoMemory();
        return NULL;
    }
    if (!keys_of(seq, *n, &k)) {
        PyMem_Free(d);
        PyMem_Free(out);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < *n; i++)
        out[i] = d + 16 * i;
    bl_key_digest_many(k.key, k.len, out, (size_t)*n);
    keys_release(&k);
    PyMem_Free(out);
    return d;
}

/* get_many_into(keys, buffers) -> [length or -1 per key], all copies in one section */
static PyObject *Index_get_many_into(IndexObject *self, PyObject *args)
{
    PyObject *keys, *bufs, *kseq = NULL, *bseq = NULL, *result = NULL;
    if (!ready(self) || !PyArg_ParseTuple(args, "OO", &keys, &bufs))
        return NULL;
    kseq = PySequence_Fast(keys, "keys must be a sequence");
    bseq = kseq ? PySequence_Fast(bufs, "buffers must be a sequence") : NULL;
    if (!bseq)
        goto done;
    Py_ssize_t n, nb = PySequence_Fast_GET_SIZE(bseq);
    uint8_t *d = digests_of(kseq, &n);
    if (!d)
        goto done;
    if (n != nb) {
        PyErr_Format(PyExc_ValueError, "%zd keys but %zd buffers", n, nb);
        PyMem_Free(d);
        goto done;
    }
    Py_buffer *views = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    uint8_t **ptrs = PyMem_Calloc((size_t)(n ? n : 1), sizeof(uint8_t *));
    size_t *lens = PyMem_Calloc((size_t)(n ? n : 1), sizeof(size_t));
    int64_t *got = PyMem_Calloc((size_t)(n ? n : 1), sizeof(int64_t));
    uint32_t *blocks = PyMem_Calloc((size_t)(n ? n : 1), sizeof(uint32_t));
    uint64_t *versions = PyMem_Calloc((size_t)(n ? n : 1), sizeof(uint64_t));
    Py_ssize_t held = 0;
    size_t total = 0;
    if (!views || !ptrs || !lens || !got || !blocks || !versions) {
        PyErr_NoMemory();
        goto free;
    }
    for (; held < n; held++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(bseq, held), &views[held],
                               PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError,
                         "buffer %zd is not a writable C-contiguous buffer; get_into needs one",
                         held);
            goto free;
        }
        ptrs[held] = views[held].buf;
        lens[held] = (size_t)views[held].len;
        total += lens[held];
    }
    bl_section s;
    if (bl_section_enter(&s, self->mem, total >= BL_NOGIL_BYTES, NULL, NULL) < 0)
        goto free;
    bl_ix_read_many(&self->mem->mem, &self->ix, d, (size_t)n, ptrs, lens, got, blocks, versions);
    bl_section_leave(&s);
    result = PyList_New(n);
    for (Py_ssize_t i = 0; result && i < n; i++) {
        if (got[i] == BL_TOO_SMALL) {
            Py_CLEAR(result);
            too_small(views[i].len, (unsigned long long)versions[i]);
            break;
        }
        record(self, got[i] >= 0, blocks[i], versions[i]);
        PyObject *v = PyLong_FromLongLong(got[i] >= 0 ? got[i] : -1);
        if (!v) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, v);
    }
free:
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(ptrs);
    PyMem_Free(lens);
    PyMem_Free(got);
    PyMem_Free(blocks);
    PyMem_Free(versions);
    PyMem_Free(d);
done:
    Py_XDECREF(kseq);
    Py_XDECREF(bseq);
    return result;
}

/* get_many(keys) -> [bytes or None per key] */
static PyObject *Index_get_many(IndexObject *self, PyObject *keys)
{
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *v = Index_get(self, PySequence_Fast_GET_ITEM(seq, i));
        if (!v)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, v);
    }
    Py_DECREF(seq);
    return out;
}

/* Probe keys without copying; `mode` 0: locate (tuples), 1: exists (bools), 2: how many
 * leading keys are stored (an int; the first miss ends the probe). */
static PyObject *probe_common(IndexObject *self, PyObject *args, PyObject *kw, int mode)
{
    static char *kwlist[] = {"keys", "prefix", NULL};
    PyObject *keys, *seq, *out = NULL;
    int prefix = mode == 2;
    if (!ready(self) || !PyArg_ParseTupleAndKeywords(args, kw, "O|p", kwlist, &keys, &prefix))
        return NULL;
    prefix |= mode == 2;
    seq = PySequence_Fast(keys, "keys must be a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), stored = 0;
    key_list k;
    uint8_t *d = PyMem_Malloc((size_t)(n ? n : 1) * 16);
    if (!d) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    if (!keys_of(seq, n, &k)) { /* seq is kept until the keys' bytes are done with */
        Py_DECREF(seq);
        PyMem_Free(d);
        return NULL;
    }
    out = mode == 2 ? Py_NewRef(Py_None) : PyList_New(n);
    bl_section s;
    if (!out || bl_section_enter(&s, self->mem, 0, NULL, NULL) < 0) {
        Py_XDECREF(out);
        keys_release(&k);
        Py_DECREF(seq);
        PyMem_Free(d);
        return NULL;
    }
    bl_header *hs = PyMem_Calloc((size_t)PROBE_CHUNK, sizeof(bl_header));
    uint32_t blocks[PROBE_CHUNK];
    int64_t rs[PROBE_CHUNK];
    if (!hs) {
        PyErr_NoMemory();
        Py_CLEAR(out);
    }
    Py_ssize_t done = 0; /* items answered */
    for (Py_ssize_t at = 0, chunk = prefix ? PREFIX_FIRST : PROBE_CHUNK; out && at < n;
         at += chunk, chunk = PROBE_CHUNK) {
        size_t len = (size_t)(n - at < chunk ? n - at : chunk);
        bl_ix_lookup_keys(&self->mem->mem, &self->ix, k.key + at, k.len + at, len, d + 16 * at,
                          blocks, hs, rs, prefix);
        int stop = 0;
        for (size_t j = 0; j < len && !stop; j++) {
            int64_t r = rs[j];
            record(self, r >= 0, blocks[j], hs[j].version);
            stored += r >= 0;
            stop = r < 0 && prefix; /* the first miss ends a prefix (and is its last item) */
            if (mode == 2)
                continue;
            PyObject *v;
            if (mode)
                v = PyBool_FromLong(r >= 0);
            else if (r < 0)
                v = Py_NewRef(Py_None);
            else
                v = Py_BuildValue("(y#IKK)", (const char *)(d + 16 * (at + j)), (Py_ssize_t)16,
                                  blocks[j], (unsigned long long)hs[j].version,
                                  (unsigned long long)hs[j].length);
            if (!v) {
                Py_CLEAR(out);
                break;
            }
            PyList_SET_ITEM(out, done++, v);
        }
        if (stop)
            break;
    }
    PyMem_Free(hs);
    bl_section_leave(&s);
    keys_release(&k);
    Py_DECREF(seq);
    PyMem_Free(d);
    if (out && mode == 2)
        Py_SETREF(out, PyLong_FromSsize_t(stored));
    else if (out && done < n && PyList_SetSlice(out, done, n, NULL) < 0) /* a prefix ended */
        Py_CLEAR(out);
    return out;
}

/* locate(keys, prefix=False) -> [(digest, block, version, length) or None] */
static PyObject *Index_locate(IndexObject *self, PyObject *args, PyObject *kw)
{
    return probe_common(self, args, kw, 0);
}

/* exists(keys, prefix=False) -> [bool] */
static PyObject *Index_exists(IndexObject *self, PyObject *args, PyObject *kw)
{
    return probe_common(self, args, kw, 1);
}

/* prefix(keys) -> int: how many leading keys are stored (lookup_prefix, no list) */
static PyObject *Index_prefix(IndexObject *self, PyObject *args, PyObject *kw)
{
    return probe_common(self, args, kw, 2);
}

/* exists_one(key) -> bool: is_exist without building a list */
static PyObject *Index_exists_one(IndexObject *self, PyObject *key)
{
    uint8_t d[16];
    if (!ready(self) || !key_digest(key, d))
        return NULL;
    bl_section s;
    if (bl_section_enter(&s, self->mem, 0, NULL, NULL) < 0)
        return NULL;
    bl_header h = {0};
    uint32_t block = 0;
    int64_t r = bl_ix_lookup(&self->mem->mem, &self->ix, d, &block, &h);
    bl_section_leave(&s);
    record(self, r >= 0, block, h.version);
    return PyBool_FromLong(r >= 0);
}

/* flush_hints(): store buffered hints and counts now (before stats, at close) */
static PyObject *Index_flush_hints(IndexObject *self, PyObject *unused)
{
    if (!ready(self))
        return NULL;
    bl_section s;
    if (bl_section_enter(&s, self->mem, 0, NULL, NULL) < 0)
        return NULL;
    bl_ix_flush_hints(&self->mem->mem, &self->hints);
    bl_section_leave(&s);
    Py_RETURN_NONE;
}

/* count_tier(hits, promotions): add what the cross-pod tier served (stored with the hints) */
static PyObject *Index_count_tier(IndexObject *self, PyObject *args)
{
    unsigned long long hits, promotions;
    if (!ready(self) || !PyArg_ParseTuple(args, "KK", &hits, &promotions))
        return NULL;
    bl_ix_note_tier(&self->hints, hits, promotions);
    Py_RETURN_NONE;
}

/* counts -> (hints recorded, hits, misses) of this Index */
static PyObject *Index_get_counts(IndexObject *self, void *c)
{
    const bl_ix_hints *r = &self->hints;
    return Py_BuildValue("(KKK)", (unsigned long long)r->seq, (unsigned long long)r->hits,
                         (unsigned long long)r->misses);
}

static PyMethodDef Index_methods[] = {
    {"get", (PyCFunction)Index_get, METH_O, "get(key) -> bytes | None"},
    {"get_into", (PyCFunction)Index_get_into, METH_VARARGS,
     "get_into(key, buffer) -> length, or -1 on a miss"},
    {"get_many", (PyCFunction)Index_get_many, METH_O, "get_many(keys) -> [bytes | None]"},
    {"get_many_into", (PyCFunction)Index_get_many_into, METH_VARARGS,
     "get_many_into(keys, buffers) -> [length or -1]"},
    {"locate", (PyCFunction)(void (*)(void))Index_locate, METH_VARARGS | METH_KEYWORDS,
     "locate(keys, prefix=False) -> [(digest, block, version, length) | None]"},
    {"exists", (PyCFunction)(void (*)(void))Index_exists, METH_VARARGS | METH_KEYWORDS,
     "exists(keys, prefix=False) -> [bool]"},
    {"prefix", (PyCFunction)(void (*)(void))Index_prefix, METH_VARARGS | METH_KEYWORDS,
     "prefix(keys) -> how many leading keys are stored"},
    {"exists_one", (PyCFunction)Index_exists_one, METH_O, "exists_one(key) -> bool"},
    {"flush_hints", (PyCFunction)Index_flush_hints, METH_NOARGS, "store buffered hints now"},
    {"count_tier", (PyCFunction)Index_count_tier, METH_VARARGS,
     "count_tier(hits, promotions): the cross-pod tier's work, stored with the hints"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Index_getset[] = {
    {"counts", (getter)Index_get_counts, NULL, "(hints, hits, misses) recorded here", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = BL_TYPE_PREFIX "Index",
    .tp_basicsize = sizeof(IndexObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One-sided reads through the pool-resident index (index.c). Thread-safe.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Index_init,
    .tp_dealloc = (destructor)Index_dealloc,
    .tp_methods = Index_methods,
    .tp_getset = Index_getset,
};

/* ---- module helpers: the format, for the server's writer and for tests --------------------- */

/* key_digest(key) -> 16 bytes (BLAKE3's first 16, as beluga.coherence.digest) */
static PyObject *mod_key_digest(PyObject *mod, PyObject *key)
{
    uint8_t d[16];
    if (!key_digest(key, d))
        return NULL;
    return PyBytes_FromStringAndSize((const char *)d, 16);
}

/* key_digests(keys) -> [16-byte digest per key], batched as the read path does */
static PyObject *mod_key_digests(PyObject *mod, PyObject *keys)
{
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t n;
    uint8_t *d = digests_of(seq, &n);
    Py_DECREF(seq);
    if (!d)
        return NULL;
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *v = PyBytes_FromStringAndSize((const char *)d + 16 * i, 16);
        if (!v)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, v);
    }
    PyMem_Free(d);
    return out;
}

/* ix_hash(digest, nbuckets) -> (tag, bucket1, bucket2) */
static PyObject *mod_ix_hash(PyObject *mod, PyObject *args)
{
    Py_buffer d;
    unsigned long long nb;
    if (!PyArg_ParseTuple(args, "y*K", &d, &nb))
        return NULL;
    if (d.len != 16 || !nb || (nb & (nb - 1))) {
        PyBuffer_Release(&d);
        return bl_fail(bl_coherence_error, "ix_hash needs a 16-byte digest and a power of two");
    }
    uint32_t tag;
    uint64_t b1, b2;
    bl_ix_hash(d.buf, nb, &tag, &b1, &b2);
    PyBuffer_Release(&d);
    return Py_BuildValue("(IKK)", tag, (unsigned long long)b1, (unsigned long long)b2);
}

/* ix_hash_many(digests, nbuckets) -> (tags, b1, b2): ix_hash of 16-byte digests back to
 * back, as packed native-endian columns (uint32, uint64, uint64 a digest) for numpy */
static PyObject *mod_ix_hash_many(PyObject *mod, PyObject *args)
{
    Py_buffer d;
    unsigned long long nb;
    if (!PyArg_ParseTuple(args, "y*K", &d, &nb))
        return NULL;
    if (d.len % 16 || !nb || (nb & (nb - 1))) {
        PyBuffer_Release(&d);
        return bl_fail(bl_coherence_error,
                       "ix_hash_many needs 16-byte digests back to back and a power of two");
    }
    Py_ssize_t n = d.len / 16;
    PyObject *tags = PyBytes_FromStringAndSize(NULL, n * 4);
    PyObject *b1 = PyBytes_FromStringAndSize(NULL, n * 8);
    PyObject *b2 = PyBytes_FromStringAndSize(NULL, n * 8);
    if (!tags || !b1 || !b2) {
        PyBuffer_Release(&d);
        Py_XDECREF(tags);
        Py_XDECREF(b1);
        Py_XDECREF(b2);
        return NULL;
    }
    uint32_t *t = (uint32_t *)PyBytes_AS_STRING(tags);
    uint64_t *x = (uint64_t *)PyBytes_AS_STRING(b1), *y = (uint64_t *)PyBytes_AS_STRING(b2);
    for (Py_ssize_t i = 0; i < n; i++)
        bl_ix_hash((const uint8_t *)d.buf + 16 * i, nb, &t[i], &x[i], &y[i]);
    PyBuffer_Release(&d);
    return Py_BuildValue("(NNN)", tags, b1, b2);
}

/* ix_columns(table) -> (whole, seqs, tags, blocks, versions): a table of bucket lines unpacked
 * (as ix_unpack) into packed native-endian columns for numpy: whole one byte a bucket (1: sealed
 * and whole), seqs uint64 a bucket, tags and blocks uint32 and versions uint64, BL_IX_SLOTS a
 * bucket; a bucket that is not whole (torn, or hostile bytes) keeps the fields as read: its
 * slots are hints like any (index.c's probe), for the caller to confirm or drop */
static PyObject *mod_ix_columns(PyObject *mod, PyObject *args)
{
    Py_buffer v;
    if (!PyArg_ParseTuple(args, "y*", &v))
        return NULL;
    if (v.len % BL_LINE) {
        PyBuffer_Release(&v);
        return bl_fail(bl_coherence_error, "a bucket table is whole %u-byte lines, not %zd bytes",
                       BL_LINE, v.len);
    }
    Py_ssize_t n = v.len / BL_LINE, s = n * BL_IX_SLOTS;
    const Py_ssize_t sizes[5] = {n, n * 8, s * 4, s * 4, s * 8};
    PyObject *cols[5];
    int ok = 1;
    for (int c = 0; c < 5; c++)
        ok &= (cols[c] = PyBytes_FromStringAndSize(NULL, sizes[c])) != NULL;
    if (ok) {
        uint8_t *whole = (uint8_t *)PyBytes_AS_STRING(cols[0]);
        uint64_t *seqs = (uint64_t *)PyBytes_AS_STRING(cols[1]);
        uint32_t *tags = (uint32_t *)PyBytes_AS_STRING(cols[2]);
        uint32_t *blocks = (uint32_t *)PyBytes_AS_STRING(cols[3]);
        uint64_t *versions = (uint64_t *)PyBytes_AS_STRING(cols[4]);
        for (Py_ssize_t i = 0; i < n; i++) {
            bl_ix_bucket b;
            memcpy(&b, (const char *)v.buf + i * BL_LINE, sizeof(b));
            whole[i] = (uint8_t)bl_ix_bucket_ok(&b);
            seqs[i] = b.seq;
            for (int j = 0; j < BL_IX_SLOTS; j++) {
                tags[i * BL_IX_SLOTS + j] = b.slot[j].tag;
                blocks[i * BL_IX_SLOTS + j] = b.slot[j].block;
                versions[i * BL_IX_SLOTS + j] = b.slot[j].version;
            }
        }
    }
    PyBuffer_Release(&v);
    if (!ok) {
        for (int c = 0; c < 5; c++)
            Py_XDECREF(cols[c]);
        return NULL;
    }
    return Py_BuildValue("(NNNNN)", cols[0], cols[1], cols[2], cols[3], cols[4]);
}

/* ix_pack(seq, slots) -> one sealed bucket line; slots: BL_IX_SLOTS (tag, block, version) */
static PyObject *mod_ix_pack(PyObject *mod, PyObject *args)
{
    unsigned long long seq;
    PyObject *slots;
    if (!PyArg_ParseTuple(args, "KO", &seq, &slots))
        return NULL;
    PyObject *fast = PySequence_Fast(slots, "slots must be a sequence");
    if (!fast)
        return NULL;
    bl_ix_bucket b;
    memset(&b, 0, sizeof(b));
    b.seq = seq;
    int ok = PySequence_Fast_GET_SIZE(fast) == BL_IX_SLOTS;
    for (int i = 0; ok && i < BL_IX_SLOTS; i++) {
        unsigned int tag, block;
        unsigned long long version;
        ok = PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "IIK", &tag, &block, &version);
        b.slot[i] = (bl_ix_slot){tag, block, version};
    }
    Py_DECREF(fast);
    if (!ok) {
        if (!PyErr_Occurred())
            bl_fail(bl_coherence_error, "a bucket has %d slots of (tag, block, version)",
                    BL_IX_SLOTS);
        return NULL;
    }
    bl_ix_seal(&b);
    return PyBytes_FromStringAndSize((const char *)&b, sizeof(b));
}

/* ix_unpack(line) -> (seq, [(tag, block, version)] * BL_IX_SLOTS), or None if not whole */
static PyObject *mod_ix_unpack(PyObject *mod, PyObject *args)
{
    Py_buffer v;
    if (!PyArg_ParseTuple(args, "y*", &v))
        return NULL;
    bl_ix_bucket b;
    int whole = v.len == BL_LINE;
    if (whole)
        memcpy(&b, v.buf, sizeof(b));
    PyBuffer_Release(&v);
    if (!whole || !bl_ix_bucket_ok(&b))
        Py_RETURN_NONE;
    PyObject *slots = PyList_New(BL_IX_SLOTS);
    for (int i = 0; slots && i < BL_IX_SLOTS; i++) {
        PyObject *t = Py_BuildValue("(IIK)", b.slot[i].tag, b.slot[i].block,
                                    (unsigned long long)b.slot[i].version);
        if (!t)
            Py_CLEAR(slots);
        else
            PyList_SET_ITEM(slots, i, t);
    }
    return slots ? Py_BuildValue("(KN)", (unsigned long long)b.seq, slots) : NULL;
}

/* ix_counts(line) -> (seq, hits, misses, owner, tier_hits, promotions), or None if not whole */
static PyObject *mod_ix_counts(PyObject *mod, PyObject *args)
{
    Py_buffer v;
    if (!PyArg_ParseTuple(args, "y*", &v))
        return NULL;
    bl_ix_counts c;
    int whole = v.len == BL_LINE;
    if (whole)
        memcpy(&c, v.buf, sizeof(c));
    PyBuffer_Release(&v);
    if (!whole || !bl_ix_counts_ok(&c))
        Py_RETURN_NONE;
    return Py_BuildValue("(KKKKKK)", (unsigned long long)c.seq, (unsigned long long)c.hits,
                         (unsigned long long)c.misses, (unsigned long long)c.owner,
                         (unsigned long long)c.tier_hits, (unsigned long long)c.promotions);
}

/* ix_hints(ring, first, seq) -> [(block, version low 32 bits)]: hints first..seq-1 of a ring */
static PyObject *mod_ix_hints(PyObject *mod, PyObject *args)
{
    Py_buffer v;
    unsigned long long first, seq;
    if (!PyArg_ParseTuple(args, "y*KK", &v, &first, &seq))
        return NULL;
    uint64_t ring[BL_IX_HINT_RING];
    int ok = v.len == (Py_ssize_t)sizeof(ring) && first <= seq && seq - first <= BL_IX_HINT_RING;
    if (ok)
        memcpy(ring, v.buf, sizeof(ring));
    PyBuffer_Release(&v);
    if (!ok)
        return bl_fail(PyExc_ValueError,
                       "ix_hints takes a ring of %u hints (%zu bytes) and first <= seq, at most "
                       "a ring apart",
                       BL_IX_HINT_RING, sizeof(ring));
    PyObject *out = PyList_New((Py_ssize_t)(seq - first));
    for (unsigned long long i = first; out && i < seq; i++) {
        uint32_t block, version;
        bl_ix_hint_split(ring[i % BL_IX_HINT_RING], &block, &version);
        PyObject *t = Py_BuildValue("(II)", block, version);
        if (!t)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, (Py_ssize_t)(i - first), t);
    }
    return out;
}

static PyMethodDef index_functions[] = {
    {"key_digest", mod_key_digest, METH_O, "key_digest(key) -> 16-byte BLAKE3 digest"},
    {"key_digests", mod_key_digests, METH_O, "key_digests(keys) -> [digest] (batched)"},
    {"ix_hash", mod_ix_hash, METH_VARARGS, "ix_hash(digest, nbuckets) -> (tag, b1, b2)"},
    {"ix_hash_many", mod_ix_hash_many, METH_VARARGS,
     "ix_hash_many(digests, nbuckets) -> (tags, b1, b2) packed columns (for numpy)"},
    {"ix_pack", mod_ix_pack, METH_VARARGS, "ix_pack(seq, slots) -> bucket line"},
    {"ix_columns", mod_ix_columns, METH_VARARGS,
     "ix_columns(table) -> (whole, seqs, tags, blocks, versions) packed columns (for numpy)"},
    {"ix_unpack", mod_ix_unpack, METH_VARARGS, "ix_unpack(line) -> (seq, slots) | None"},
    {"ix_counts", mod_ix_counts, METH_VARARGS,
     "ix_counts(line) -> (seq, hits, misses, owner, tier_hits, promotions) | None"},
    {"ix_hints", mod_ix_hints, METH_VARARGS,
     "ix_hints(ring, first, seq) -> [(block, version low 32 bits)] of hints first..seq-1"},
    {NULL, NULL, 0, NULL},
};

/* Add the Index type, the format helpers and their constants to the module. */
int bl_index_init(PyObject *module)
{
    if (PyType_Ready(&IndexType) < 0 || bl_ix_watch_forks() < 0)
        return -1;
    Py_INCREF(&IndexType);
    if (PyModule_AddObject(module, "Index", (PyObject *)&IndexType) < 0 ||
        PyModule_AddFunctions(module, index_functions) < 0 ||
        PyModule_AddIntConstant(module, "IX_SLOTS", BL_IX_SLOTS) < 0 ||
        PyModule_AddIntConstant(module, "IX_HINT_RING", BL_IX_HINT_RING) < 0 ||
        PyModule_AddIntConstant(module, "IX_HINT_LINES", BL_IX_HINT_LINES) < 0)
        return -1;
    return 0;
}
