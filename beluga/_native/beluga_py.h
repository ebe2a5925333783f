/*
 * beluga_py.h - what the Python bindings (*_py.c) share: the Memory object,
 * sections, errors, and each binding file's module init.
 *
 * Only binding files include it; the core (beluga_native.h) never sees
 * Python.  helpers_py.c holds the helpers declared here; memory_py.c the
 * Memory type; index_py.c and rpc_py.c add their types and functions to the
 * module that module_py.c creates.
 */
#ifndef BELUGA_PY_H
#define BELUGA_PY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdatomic.h>

#include "beluga_native.h"

/* Type names say which build they come from (the sabotage build is a separate module). */
#if BL_SABOTAGE_BUILD
#define BL_TYPE_PREFIX "beluga._native._core_sabotage."
#else
#define BL_TYPE_PREFIX "beluga._native._core."
#endif

/* The Python Memory object (memory_py.c): one attachment, and the sections running over it. */
typedef struct {
    PyObject_HEAD
    bl_mem mem;
    Py_buffer view;
    int has_view;
    atomic_int busy;    /* sections running over the mapping (bl_section_enter) */
    atomic_int closing; /* release() calls waiting for those sections to end */
} MemoryObject;

extern PyTypeObject BlMemoryType;

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

/* Copies at least this long run without the GIL (dropping and taking it back costs
 * more than a shorter copy), as do scatter-gather tables of BL_NOGIL_ROWS rows. */
#define BL_NOGIL_BYTES (64u * 1024u)
#define BL_NOGIL_ROWS 256u

int bl_section_enter(bl_section *s, MemoryObject *mem, int drop_gil, PyObject *cls,
                     const char *why);
void bl_section_gil(bl_section *s, int drop);
void bl_section_leave(bl_section *s);
int bl_section_closing(const bl_section *s);
bl_rpc_hooks bl_section_hooks(bl_section *s);

/* beluga.errors.CoherenceError and RpcError, once the package registers them. */
extern PyObject *bl_coherence_error, *bl_rpc_error;
PyObject *bl_fail(PyObject *cls, const char *fmt, ...);
int bl_digest_arg(PyObject *o, uint8_t d[16]);
int bl_digests_arg(PyObject *o, Py_buffer *v, Py_ssize_t *n);
PyObject *bl_digests_test(PyObject *o, int (*has)(const void *ctx, const uint8_t d[16]),
                          const void *ctx);

int bl_memory_init(PyObject *module);
int bl_index_init(PyObject *module);
int bl_mirror_init(PyObject *module);
int bl_keytable_init(PyObject *module);
int bl_rpc_init(PyObject *module);

#endif
