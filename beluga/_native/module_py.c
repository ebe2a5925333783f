/*
 * module_py.c - the module beluga._native._core: its functions, constants and init.
 *
 * Module init picks every instruction once (memops.c, crc32c.c), then adds
 * the types of the other binding files (memory_py.c, index_py.c, rpc_py.c)
 * and the tables the C core owns, so that Python never restates a format:
 * block states and miss codes, the sabotage points, the sealed-record codec,
 * header parsing.  The functions here are thin: argument checks, then one
 * core call.
 */
#include "beluga_py.h"

#define fail(...) bl_fail(bl_coherence_error, __VA_ARGS__)

/* crc32c(data, crc=0) -> int: CRC32C, chainable like zlib.crc32. */
static PyObject *mod_crc32c(PyObject *mod, PyObject *args)
{
    Py_buffer b;
    unsigned int crc = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &b, &crc))
        return NULL;
    uint32_t r = ~bl_crc32c(~crc, b.buf, (size_t)b.len); /* chained from a finished CRC */
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

/* crc32c_mul(a, b) -> a * b in GF(2)[x] mod the CRC32C polynomial (reflected). */
static PyObject *mod_crc32c_mul(PyObject *mod, PyObject *args)
{
    unsigned int a, b;
    if (!PyArg_ParseTuple(args, "II", &a, &b))
        return NULL;
    return PyLong_FromUnsignedLong(bl_crc32c_mul(a, b));
}

/* crc32c_x8n(n) -> x^(8n) mod the polynomial: moves a CRC register past n zero bytes. */
static PyObject *mod_crc32c_x8n(PyObject *mod, PyObject *args)
{
    unsigned long long n;
    if (!PyArg_ParseTuple(args, "K", &n))
        return NULL;
    return PyLong_FromUnsignedLong(bl_crc32c_x8n(n));
}

/* seal_record(body, size=LINE) -> body zero-padded to size - 4 bytes, then their CRC32C. */
static PyObject *mod_seal_record(PyObject *mod, PyObject *args)
{
    Py_buffer b;
    Py_ssize_t size = BL_LINE;
    if (!PyArg_ParseTuple(args, "y*|n", &b, &size))
        return NULL;
    if (size < (Py_ssize_t)BL_SEAL_BYTES) {
        PyBuffer_Release(&b);
        return bl_fail(PyExc_ValueError, "a sealed record is at least %u bytes, not %zd",
                       BL_SEAL_BYTES, size);
    }
    if (b.len > size - (Py_ssize_t)BL_SEAL_BYTES) {
        PyBuffer_Release(&b);
        return bl_fail(PyExc_ValueError,
                       "a sealed record of %zd bytes has room for %zd bytes before its "
                       "checksum, not %zd",
                       size, size - (Py_ssize_t)BL_SEAL_BYTES, b.len);
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, size);
    if (out) {
        char *rec = PyBytes_AS_STRING(out);
        memset(rec, 0, (size_t)size);
        memcpy(rec, b.buf, (size_t)b.len);
        bl_record_seal(rec, (size_t)size);
    }
    PyBuffer_Release(&b);
    return out;
}

/* unseal_record(record) -> the bytes before its checksum, or None when they do not match it. */
static PyObject *mod_unseal_record(PyObject *mod, PyObject *args)
{
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "y*", &b))
        return NULL;
    PyObject *out;
    if (b.len < (Py_ssize_t)BL_SEAL_BYTES)
        out = bl_fail(PyExc_ValueError, "a sealed record is at least %u bytes, not %zd",
                      BL_SEAL_BYTES, b.len);
    else if (!bl_record_sealed(b.buf, (size_t)b.len))
        out = Py_NewRef(Py_None);
    else
        out = PyBytes_FromStringAndSize(b.buf, b.len - (Py_ssize_t)BL_SEAL_BYTES);
    PyBuffer_Release(&b);
    return out;
}

/* A valid header's fields, as parse_header returns them. */
static PyObject *header_fields(const bl_header *h)
{
    return Py_BuildValue("(HKy#KIHIKI)", h->state, (unsigned long long)h->version, h->digest,
                         (Py_ssize_t)16, (unsigned long long)h->length, h->payload_crc,
                         h->key_len, h->writer, (unsigned long long)h->stamp, h->writer_gen);
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
    return header_fields(&h);
}

/* parse_headers(table) -> [(block, fields)] for every valid header of a table of header
 * lines (magic and checksum, as parse_header): the scan recovery and the chaos tools run. */
static PyObject *mod_parse_headers(PyObject *mod, PyObject *args)
{
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "y*", &b))
        return NULL;
    if (b.len % BL_LINE) {
        PyBuffer_Release(&b);
        return fail("a header table is whole %u-byte lines, not %zd bytes", BL_LINE, b.len);
    }
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out && i < b.len / BL_LINE; i++) {
        bl_header h;
        memcpy(&h, (const char *)b.buf + i * BL_LINE, sizeof(h));
        if (!bl_header_check(&h))
            continue;
        PyObject *row = Py_BuildValue("(nN)", i, header_fields(&h));
        if (!row || PyList_Append(out, row) < 0)
            Py_CLEAR(out);
        Py_XDECREF(row);
    }
    PyBuffer_Release(&b);
    return out;
}

/* header_columns(table) -> (blocks, states, versions, digests, lengths, writers, writer_gens):
 * the valid headers of a table (as parse_headers) as packed native-endian columns for numpy
 * (int64, uint16, uint64, 16 bytes, uint64, uint32, uint32 a header): recovery's scan with no
 * Python object per block. */
static PyObject *mod_header_columns(PyObject *mod, PyObject *args)
{
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "y*", &b))
        return NULL;
    if (b.len % BL_LINE) {
        PyBuffer_Release(&b);
        return fail("a header table is whole %u-byte lines, not %zd bytes", BL_LINE, b.len);
    }
    Py_ssize_t lines = b.len / BL_LINE, n = 0;
    int64_t *valid = PyMem_Malloc((size_t)(lines ? lines : 1) * sizeof(int64_t));
    if (!valid) {
        PyBuffer_Release(&b);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < lines; i++) {
        bl_header h;
        memcpy(&h, (const char *)b.buf + i * BL_LINE, sizeof(h));
        if (bl_header_check(&h))
            valid[n++] = i;
    }
    static const size_t widths[7] = {8, 2, 8, 16, 8, 4, 4};
    PyObject *cols[7];
    int ok = 1;
    for (int c = 0; c < 7; c++)
        ok &= (cols[c] = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)widths[c])) != NULL;
    if (ok) {
        char *out[7];
        for (int c = 0; c < 7; c++)
            out[c] = PyBytes_AS_STRING(cols[c]);
        for (Py_ssize_t k = 0; k < n; k++) {
            bl_header h;
            memcpy(&h, (const char *)b.buf + valid[k] * BL_LINE, sizeof(h));
            memcpy(out[0] + k * 8, &valid[k], 8);
            memcpy(out[1] + k * 2, &h.state, 2);
            memcpy(out[2] + k * 8, &h.version, 8);
            memcpy(out[3] + k * 16, h.digest, 16);
            memcpy(out[4] + k * 8, &h.length, 8);
            memcpy(out[5] + k * 4, &h.writer, 4);
            memcpy(out[6] + k * 4, &h.writer_gen, 4);
        }
    }
    PyBuffer_Release(&b);
    PyMem_Free(valid);
    if (!ok) {
        for (int c = 0; c < 7; c++)
            Py_XDECREF(cols[c]);
        return NULL;
    }
    return Py_BuildValue("(NNNNNNN)", cols[0], cols[1], cols[2], cols[3], cols[4], cols[5],
                         cols[6]);
}

/* selected() -> dict: the instruction chosen for each operation. */
static PyObject *mod_selected(PyObject *mod, PyObject *unused)
{
    return Py_BuildValue("{ssssssssssssss}", "flush", bl_selected("flush"), "writeback",
                         bl_selected("writeback"), "invalidate", bl_selected("invalidate"), "nt",
                         bl_selected("nt"), "copy", bl_selected("copy"), "crc",
                         bl_crc32c_selected(), "copy_crc", bl_crc32c_copy_selected());
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
    return Py_BuildValue("{sOsOsOsOsO}", "sse4.2", bl_cpu_has("sse4.2") ? Py_True : Py_False,
                         "avx2", bl_cpu_has("avx2") ? Py_True : Py_False, "avx512f", bl_cpu_has("avx512f") ? Py_True : Py_False, "clflushopt",
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
    {"seal_record", mod_seal_record, METH_VARARGS,
     "seal_record(body, size=LINE) -> body padded to size - 4 bytes, then their CRC32C"},
    {"unseal_record", mod_unseal_record, METH_VARARGS,
     "unseal_record(record) -> the bytes before its CRC32C, or None when they do not match"},
    {"parse_header", mod_parse_header, METH_VARARGS, "parse_header(line) -> tuple | None"},
    {"parse_headers", mod_parse_headers, METH_VARARGS,
     "parse_headers(table) -> [(block, fields)] of every valid header line"},
    {"header_columns", mod_header_columns, METH_VARARGS,
     "header_columns(table) -> packed columns of every valid header line (for numpy)"},
    {"crc32c_mul", mod_crc32c_mul, METH_VARARGS,
     "crc32c_mul(a, b) -> a * b mod the CRC32C polynomial (reflected bit order)"},
    {"crc32c_x8n", mod_crc32c_x8n, METH_VARARGS,
     "crc32c_x8n(n) -> x^(8n) mod the CRC32C polynomial (a shift past n zero bytes)"},
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

/* Module init: pick instructions once, then publish the types and the core's tables. */
PyMODINIT_FUNC BL_MODULE_INIT(void)
{
    bl_memops_init();
    bl_crc32c_init();
    PyObject *m = PyModule_Create(&core_module);
    if (!m)
        return NULL;
    if (bl_memory_init(m) < 0 || bl_rpc_init(m) < 0 || bl_index_init(m) < 0 ||
        bl_mirror_init(m) < 0 || bl_keytable_init(m) < 0 ||
        PyModule_AddIntConstant(m, "LINE", BL_LINE) < 0 ||
        PyModule_AddObject(m, "CRC32C_POLY", PyLong_FromUnsignedLong(BL_CRC32C_POLY)) < 0 ||
        PyModule_AddIntConstant(m, "MAX_KEY_BYTES", BL_MAX_KEY) < 0 ||
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
