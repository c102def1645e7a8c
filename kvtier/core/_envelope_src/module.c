/* kvtier.core._envelope: the core's per-page envelope work in compiled code.
 *
 * PageStore writes every page's envelope on put and verifies it on get
 * (kvtier/core/envelope.py, docs/integrity.md). For a backend without a compiled loop of
 * its own (memory, mooncake, segment, third-party plugins) that work is the core's
 * cost per page; here one call does it for a batch (or one checksum thread's slice of
 * one) with the GIL released: the key digests (BLAKE2b-128), the payload xxh3-128
 * streamed over the page's regions in place, the header's xxh3-64, and for a get one
 * verdict per page that is exactly the one kvtier.core.envelope.verify_envelope decides.
 *
 * This file is the module's functions: arguments in, verdicts out. The envelope itself
 * (writing one, the verdict on one: envelope.c, envelope.h, envelope_layout.h), the
 * hashing (blake2b.c, xxh.c: kvhash.h) and the Python glue (glue.c, glue.h) are the
 * one copy in kvtier/_csrc/ that the file backends' _pageio compiles too;
 * hatch_build.py compiles them into the one module.
 *
 * Each batch function takes its arguments with the GIL held (the pages' buffers, the
 * keys, held for the call), then releases the GIL for the whole batch. */
#include "envelope.h"

#include <string.h>

#define MODULE "_envelope"

/* --- argument handling ------------------------------------------------------------- */

/* One page of a call: its regions (header slot first, then the payload), its key's
 * UTF-8 bytes (the key object is held for the call) and, once computed, the key digest
 * and the page's verdict. */
typedef struct {
    Py_buffer *regions;
    Py_ssize_t count;
    PyObject *key;
    const char *text;
    Py_ssize_t length;
    unsigned char digest[KEY_DIGEST_BYTES];
    int verdict;
} EnvPage;

/* A call's pages: the table, one array of every page's buffers, and how much of each
 * was filled in (so that a failure half-way releases exactly what was taken). */
typedef struct {
    EnvPage *pages;
    Py_ssize_t count;
    Py_buffer *buffers;
    Py_ssize_t taken; /* buffers acquired, in order */
} Batch;

static void
release(Batch *batch)
{
    for (Py_ssize_t i = 0; i < batch->taken; i++) PyBuffer_Release(&batch->buffers[i]);
    if (batch->pages != NULL)
        for (Py_ssize_t p = 0; p < batch->count; p++) Py_XDECREF(batch->pages[p].key);
    PyMem_Free(batch->buffers);
    PyMem_Free(batch->pages);
    memset(batch, 0, sizeof *batch);
}

/* One region into the batch's next buffer (glue_region). */
static int
take_region(Batch *batch, PyObject *region, int writable)
{
    if (!glue_region(region, writable, &batch->buffers[batch->taken])) return 0;
    batch->taken++;
    return 1;
}

/* The page table from keys (str, one per page) and pages (each a list or tuple of its
 * regions, header slot first); with writable, every header slot must be writable. */
static int
load(Batch *batch, PyObject *keys_obj, PyObject *pages_obj, int writable)
{
    memset(batch, 0, sizeof *batch);
    PyObject *keys = PySequence_Fast(keys_obj, "_envelope: keys must be a list of str");
    if (keys == NULL) return 0;
    PyObject *pages = PySequence_Fast(pages_obj, "_envelope: pages must be a list");
    if (pages == NULL) {
        Py_DECREF(keys);
        return 0;
    }
    int ok = 0;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(pages);
    Py_ssize_t total = 0;
    if (PySequence_Fast_GET_SIZE(keys) != count) {
        PyErr_Format(PyExc_ValueError, "_envelope: %zd keys for %zd pages",
                     PySequence_Fast_GET_SIZE(keys), count);
        goto done;
    }
    for (Py_ssize_t p = 0; p < count; p++) {
        PyObject *page = PySequence_Fast_GET_ITEM(pages, p);
        if (!(PyList_Check(page) || PyTuple_Check(page)) || PySequence_Fast_GET_SIZE(page) < 1) {
            PyErr_SetString(PyExc_TypeError,
                            "_envelope: each page is a list of its header slot and payload regions");
            goto done;
        }
        total += PySequence_Fast_GET_SIZE(page);
    }
    batch->pages = PyMem_Calloc((size_t)(count ? count : 1), sizeof(EnvPage));
    batch->buffers = PyMem_Calloc((size_t)(total ? total : 1), sizeof(Py_buffer));
    if (batch->pages == NULL || batch->buffers == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    batch->count = count;
    for (Py_ssize_t p = 0; p < count; p++) {
        EnvPage *page = &batch->pages[p];
        PyObject *key = PySequence_Fast_GET_ITEM(keys, p);
        if (!PyUnicode_Check(key)) {
            PyErr_Format(PyExc_TypeError, "_envelope: a key must be a str, got %R", key);
            goto done;
        }
        page->text = PyUnicode_AsUTF8AndSize(key, &page->length);
        if (page->text == NULL) goto done;
        Py_INCREF(key);
        page->key = key;
        PyObject *regions = PySequence_Fast_GET_ITEM(pages, p);
        Py_ssize_t n = PySequence_Fast_GET_SIZE(regions);
        page->regions = &batch->buffers[batch->taken];
        for (Py_ssize_t i = 0; i < n; i++) {
            if (!take_region(batch, PySequence_Fast_GET_ITEM(regions, i), writable && i == 0))
                goto done;
            page->count = i + 1;
        }
        if (page->regions[0].len < HEADER_BYTES) {
            PyErr_SetString(PyExc_ValueError,
                            "_envelope: a header slot is smaller than the envelope header (104 bytes)");
            goto done;
        }
    }
    ok = 1;
done:
    Py_DECREF(keys);
    Py_DECREF(pages);
    if (!ok) release(batch);
    return ok;
}

/* Both batch functions: load the batch (see load; its header slots writable when
 * writing), then, with the GIL released, digest every page's key and write its envelope
 * (writing) or give its verdict (full: with the payload checksum). 1, the batch left for
 * the caller to release; 0, with an exception set and nothing held, when an argument is
 * missing or malformed. */
static int
run(PyObject *static_obj, PyObject *keys, PyObject *pages, int writing, int full, Batch *batch)
{
    const unsigned char *static_fields;
    if (!glue_bound(MODULE) || !glue_static_fields(static_obj, 0, MODULE, &static_fields))
        return 0;
    if (!load(batch, keys, pages, writing)) return 0;
    XXH3_state_t *state = XXH3_createState();
    if (state == NULL) {
        release(batch);
        PyErr_NoMemory();
        return 0;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t p = 0; p < batch->count; p++) {
        EnvPage *page = &batch->pages[p];
        blake2b(page->digest, KEY_DIGEST_BYTES, (const unsigned char *)page->text,
                (size_t)page->length);
        if (writing)
            envelope_write(page->regions, page->count, page->digest, state, static_fields);
        else
            page->verdict = envelope_verdict(page->regions, page->count, page->digest,
                                             static_fields, state,
                                             full ? PAYLOAD_HASH : PAYLOAD_UNCHECKED);
    }
    Py_END_ALLOW_THREADS
    XXH3_freeState(state);
    return 1;
}

static long
verdict_at(const void *pages, Py_ssize_t i)
{
    return ((const EnvPage *)pages)[i].verdict;
}

/* --- the module's functions --------------------------------------------------------- */

PyDoc_STRVAR(write_envelopes_doc,
"write_envelopes(static, keys, pages) -> None\n\n"
"Write each page's envelope into its header slot (pages[i][0], writable, 104 bytes or\n"
"more; the rest of the slot is zeroed) for the payload in pages[i][1:] stored under\n"
"keys[i]: static (the 56 bytes BatchEnvelope.static holds), the key's BLAKE2b-128, the\n"
"payload length and xxh3-128, the header's xxh3-64. The same bytes as\n"
"kvtier.core.envelope.write_envelope. Regions are buffers (memoryviews) or Extents. The\n"
"GIL is released for the whole batch.");

static PyObject *
write_envelopes(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *static_obj, *keys, *pages;
    if (!PyArg_ParseTuple(args, "OOO:write_envelopes", &static_obj, &keys, &pages)) return NULL;
    Batch batch;
    if (!run(static_obj, keys, pages, 1, 0, &batch)) return NULL;
    release(&batch);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(verify_envelopes_doc,
"verify_envelopes(static, keys, pages, full) -> list[int]\n\n"
"The verdict on each page (header slot pages[i][0], payload pages[i][1:], asked for under\n"
"keys[i]) against this store's static fields (56 bytes: magic, version, fingerprint,\n"
"layout...): VALID (0) or the code of the kvtier.core.envelope.Rejection of the same name,\n"
"exactly as verify_envelope decides, checked in its order. Without full the payload\n"
"checksum is not computed (verify=\"header\"). The GIL is released for the whole batch.");

static PyObject *
verify_envelopes(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *static_obj, *keys, *pages;
    int full;
    if (!PyArg_ParseTuple(args, "OOOp:verify_envelopes", &static_obj, &keys, &pages, &full))
        return NULL;
    Batch batch;
    if (!run(static_obj, keys, pages, 0, full, &batch)) return NULL;
    PyObject *out = glue_int_list(batch.count, verdict_at, batch.pages);
    release(&batch);
    return out;
}

PyDoc_STRVAR(key_digest_doc,
"key_digest(key) -> bytes\n\n"
"The 16-byte BLAKE2b of the key's UTF-8 bytes, as this module computes it for the\n"
"envelopes (the same as kvtier.core.envelope.key_digest).");

static PyObject *
key_digest(PyObject *self, PyObject *arg)
{
    (void)self;
    Py_ssize_t length;
    if (!PyUnicode_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "_envelope: a key must be a str, got %R", arg);
        return NULL;
    }
    const char *text = PyUnicode_AsUTF8AndSize(arg, &length);
    if (text == NULL) return NULL;
    unsigned char digest[KEY_DIGEST_BYTES];
    blake2b(digest, KEY_DIGEST_BYTES, (const unsigned char *)text, (size_t)length);
    return PyBytes_FromStringAndSize((const char *)digest, KEY_DIGEST_BYTES);
}

PyDoc_STRVAR(module_doc,
"The core's per-page envelope work (write, verify) in compiled code, a batch a call.");

PyDoc_STRVAR(bind_doc, GLUE_BIND_DOC);

static PyMethodDef methods[] = {
    {"bind", glue_bind, METH_O, bind_doc},
    {"key_digest", key_digest, METH_O, key_digest_doc},
    {"verify_envelopes", verify_envelopes, METH_VARARGS, verify_envelopes_doc},
    {"write_envelopes", write_envelopes, METH_VARARGS, write_envelopes_doc},
    {NULL, NULL, 0, NULL},
};

PyMODINIT_FUNC
PyInit__envelope(void)
{
    static const GlueConstant constants[] = {
        {"VALID", VALID}, {"BAD_MAGIC", BAD_MAGIC},
        {"UNSUPPORTED_VERSION", UNSUPPORTED_VERSION}, {"CORRUPT_HEADER", CORRUPT_HEADER},
        {"WRONG_GEOMETRY", WRONG_GEOMETRY}, {"LAYOUT_MISMATCH", LAYOUT_MISMATCH},
        {"WRONG_KEY", WRONG_KEY}, {"UNKNOWN_CHECKSUM", UNKNOWN_CHECKSUM},
        {"WRONG_LENGTH", WRONG_LENGTH}, {"CORRUPT_CHECKSUM", CORRUPT_CHECKSUM},
    };
    PyObject *module = glue_module(MODULE, module_doc, methods, constants,
                                   sizeof constants / sizeof constants[0]);
    if (module != NULL && envelope_export(module) != 0) Py_CLEAR(module);
    return module;
}
