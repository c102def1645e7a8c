/* The Python glue kvtier's compiled modules share (glue.c): binding xxHash, the
 * arguments both take (the static envelope fields, a page's regions), and their results
 * and module objects. Each module passes its name, for its errors. */
#ifndef KVTIER_GLUE_H
#define KVTIER_GLUE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

/* The docstring of every module's bind (glue_bind). */
#define GLUE_BIND_DOC                                                                        \
    "bind(path) -> bool\n\n"                                                             \
    "Take xxHash's functions from the shared object at path (already loaded or loadable).\n" \
    "False when it does not export them; the module's other functions need a successful\n"  \
    "bind."

/* bind(path) -> bool, a module's METH_O function: take xxHash's functions from the
 * shared object at path (xxh_bind). */
PyObject *glue_bind(PyObject *self, PyObject *path);
/* 1 when xxHash is bound; else 0, with a RuntimeError naming module. */
int glue_bound(const char *module);
/* The static envelope fields (STATIC_BYTES of bytes) into *out: 1, or 0 with a TypeError
 * naming module. None gives NULL (no envelopes) where none_allowed. */
int glue_static_fields(PyObject *value, int none_allowed, const char *module,
                       const unsigned char **out);
/* Take one region of a page into view: a buffer (a memoryview) or a tuple whose first
 * item is one (an Extent), C-contiguous, writable if asked; 0, an exception set, if not. */
int glue_region(PyObject *region, int writable, Py_buffer *view);
/* A list of count ints, the i-th at(items, i); NULL, an exception set, on failure. */
PyObject *glue_int_list(Py_ssize_t count, long (*at)(const void *items, Py_ssize_t i),
                        const void *items);

/* One int constant of a module. */
typedef struct {
    const char *name;
    long value;
} GlueConstant;
/* The module (name, doc, methods: a single-phase one, as each module is built once per
 * process), with its int constants added; NULL, an exception set, on failure. Each
 * module has its own copy of glue.c, so its own definition. */
PyObject *glue_module(const char *name, const char *doc, PyMethodDef *methods,
                      const GlueConstant *constants, size_t count);

/* The bytes of a page's payload: every region after the header slot, regions[1..count). */
static inline uint64_t
glue_payload_length(const Py_buffer *regions, Py_ssize_t count)
{
    uint64_t total = 0;
    for (Py_ssize_t i = 1; i < count; i++) total += (uint64_t)regions[i].len;
    return total;
}

#endif /* KVTIER_GLUE_H */
