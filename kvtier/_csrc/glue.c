/* The Python glue both compiled modules share (see glue.h). */
#include "glue.h"

#include "envelope_layout.h"
#include "kvhash.h"

PyObject *
glue_bind(PyObject *self, PyObject *path)
{
    (void)self;
    PyObject *encoded = NULL;
    if (!PyUnicode_FSConverter(path, &encoded)) return NULL;
    int bound_now = xxh_bind(PyBytes_AS_STRING(encoded));
    Py_DECREF(encoded);
    return PyBool_FromLong(bound_now);
}

int
glue_bound(const char *module)
{
    if (xxh_bound()) return 1;
    PyErr_Format(PyExc_RuntimeError, "%s: call bind() with an xxHash library first", module);
    return 0;
}

int
glue_static_fields(PyObject *value, int none_allowed, const char *module,
                   const unsigned char **out)
{
    if (value == Py_None && none_allowed) {
        *out = NULL;
        return 1;
    }
    if (!PyBytes_Check(value) || PyBytes_GET_SIZE(value) != STATIC_BYTES) {
        PyErr_Format(PyExc_TypeError,
                     "%s: the static envelope fields are %d bytes (BatchEnvelope.static)",
                     module, STATIC_BYTES);
        return 0;
    }
    *out = (const unsigned char *)PyBytes_AS_STRING(value);
    return 1;
}

int
glue_region(PyObject *region, int writable, Py_buffer *view)
{
    if (PyTuple_Check(region) && PyTuple_GET_SIZE(region) > 0) region = PyTuple_GET_ITEM(region, 0);
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    return PyObject_GetBuffer(region, view, flags) == 0;
}

PyObject *
glue_int_list(Py_ssize_t count, long (*at)(const void *items, Py_ssize_t i), const void *items)
{
    PyObject *out = PyList_New(count);
    for (Py_ssize_t i = 0; out != NULL && i < count; i++) {
        PyObject *value = PyLong_FromLong(at(items, i));
        if (value == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, value);
    }
    return out;
}

/* The module's definition, which must outlive it (one a module: see glue.h). */
static PyModuleDef definition = {
    PyModuleDef_HEAD_INIT, NULL, NULL, -1, NULL, NULL, NULL, NULL, NULL,
};

PyObject *
glue_module(const char *name, const char *doc, PyMethodDef *methods,
            const GlueConstant *constants, size_t count)
{
    definition.m_name = name;
    definition.m_doc = doc;
    definition.m_methods = methods;
    PyObject *module = PyModule_Create(&definition);
    for (size_t i = 0; module != NULL && i < count; i++) {
        if (PyModule_AddIntConstant(module, constants[i].name, constants[i].value) != 0)
            Py_CLEAR(module);
    }
    return module;
}
