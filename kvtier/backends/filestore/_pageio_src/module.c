/* The module functions of kvtier.backends.filestore._pageio: arguments in, codes out
 * (with the glue both modules share, kvtier/_csrc/glue.c).
 *
 * Every function checks and copies its arguments with the GIL held (keys must be checked
 * page keys, never made a path otherwise), then releases the GIL for the whole slice of
 * pages, which the other files move (see pageio.h for which does what). */
#include "pageio.h"

#define MODULE "_pageio"

/* --- argument handling ------------------------------------------------------------- */

static void
free_pages(Page *pages, Py_ssize_t count)
{
    if (pages == NULL) return;
    for (Py_ssize_t p = 0; p < count; p++) {
        for (Py_ssize_t i = 0; i < pages[p].count; i++) PyBuffer_Release(&pages[p].buffers[i]);
        PyMem_Free(pages[p].buffers);
        PyMem_Free(pages[p].path);
        PyMem_Free(pages[p].final);
    }
    PyMem_Free(pages);
}

/* Where a call's pages live: the store directory, and for a put the temp names' stem
 * ("." pid "." tid ".") and first sequence number (see paths.temp_paths). */
typedef struct {
    const char *store;
    size_t store_length;
    const char *stem; /* NULL: a get, no temp names */
    unsigned long long seq;
} Names;

/* A key as the caller checked it (kvtier.core.keys: [a-z0-9_-], a letter or digit first,
 * at most MAX_KEY_LENGTH), as bytes; anything else is refused, never made a path. */
static const char *
key_arg(PyObject *key, Py_ssize_t *length)
{
    const char *text = NULL;
    if (PyUnicode_Check(key) && PyUnicode_IS_ASCII(key)) {
        text = PyUnicode_AsUTF8AndSize(key, length);
        if (text == NULL) return NULL;
    }
    int valid = text != NULL && *length > 0 && *length <= MAX_KEY_LENGTH && text[0] != '_' &&
                text[0] != '-';
    for (Py_ssize_t i = 0; valid && i < *length; i++) {
        char c = text[i];
        valid = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
    }
    if (valid) return text;
    PyErr_Format(PyExc_ValueError, "_pageio: %R is not a checked page key", key);
    return NULL;
}

static char *
copy_text(const char *text, size_t length)
{
    char *copy = PyMem_Malloc(length + 1);
    if (copy == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(copy, text, length);
    copy[length] = '\0';
    return copy;
}

/* The key's envelope digest only: a segment page has no file of its own. */
static int
digest_page(Page *page, PyObject *key)
{
    Py_ssize_t length;
    const char *text = key_arg(key, &length);
    if (text == NULL) return 0;
    blake2b(page->key_digest, KEY_DIGEST_BYTES, (const unsigned char *)text, (size_t)length);
    return 1;
}

/* The page's file name (and, for a put, its temp name) from its key. */
static int
name_page(Page *page, const Names *names, PyObject *key, Py_ssize_t index)
{
    Py_ssize_t length;
    const char *text = key_arg(key, &length);
    if (text == NULL) return 0;
    char name[PATH_MAX];
    long size = page_name(name, names->store, names->store_length, text, (size_t)length);
    if (size < 0) {
        PyErr_SetString(PyExc_ValueError, "_pageio: a page's path is longer than PATH_MAX");
        return 0;
    }
    blake2b(page->key_digest, KEY_DIGEST_BYTES, (const unsigned char *)text, (size_t)length);
    if (names->stem == NULL) {
        page->path = copy_text(name, (size_t)size);
        return page->path != NULL;
    }
    page->final = copy_text(name, (size_t)size);
    if (page->final == NULL) return 0;
    char temp[PATH_MAX];
    size_t dir = names->store_length + 6; /* STORE/xx/yy */
    long written = temp_name(temp, name, dir, names->stem, names->seq + (unsigned long long)index);
    if (written < 0) {
        PyErr_SetString(PyExc_ValueError, "_pageio: a temp path is longer than PATH_MAX");
        return 0;
    }
    page->path = copy_text(temp, (size_t)written);
    return page->path != NULL;
}

/* One page's regions: a list of memoryviews or of kvtier Extents (whose first field is
 * the view), header slot first. */
static int
load_regions(Page *page, PyObject *views)
{
    if (!PyList_Check(views) || PyList_GET_SIZE(views) < 2) {
        PyErr_SetString(PyExc_TypeError, "_pageio: each page is a list of its header slot and payload regions");
        return 0;
    }
    Py_ssize_t n = PyList_GET_SIZE(views);
    page->buffers = PyMem_Calloc((size_t)n, sizeof(Py_buffer));
    if (page->buffers == NULL) {
        PyErr_NoMemory();
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!glue_region(PyList_GET_ITEM(views, i), 1, &page->buffers[i])) return 0;
        page->count = i + 1;
    }
    if (page->buffers[0].len < HEADER_BYTES) {
        PyErr_SetString(PyExc_ValueError, "_pageio: a header slot is smaller than the envelope header");
        return 0;
    }
    return 1;
}

/* Page p's O_DIRECT flag: direct is one flag for every page or a list of one per page
 * (its length checked by the caller); -1, an exception set, when it has no truth value. */
static int
direct_of(PyObject *direct, Py_ssize_t p)
{
    return PyObject_IsTrue(PyList_Check(direct) ? PyList_GET_ITEM(direct, p) : direct);
}

/* Build the page table from the Python arguments: keys and regions of one length, and
 * direct either one flag for every page or a list of one per page. Without names (a
 * segment call), each page gets its key's digest only. */
static Page *
load_pages(const Names *names, PyObject *keys, PyObject *regions, PyObject *direct,
           Py_ssize_t *count_out)
{
    Py_ssize_t count = PyList_Size(regions);
    if (count < 0) return NULL;
    if (PyList_Size(keys) != count || (PyList_Check(direct) && PyList_GET_SIZE(direct) != count)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "_pageio: the per-page lists differ in length");
        return NULL;
    }
    Page *pages = PyMem_Calloc((size_t)(count ? count : 1), sizeof(Page));
    if (pages == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t p = 0; p < count; p++) {
        Page *page = &pages[p];
        if (!load_regions(page, PyList_GET_ITEM(regions, p))) goto fail;
        PyObject *key = PyList_GET_ITEM(keys, p);
        if (names == NULL ? !digest_page(page, key) : !name_page(page, names, key, p)) goto fail;
        page->direct = direct_of(direct, p);
        if (page->direct < 0) goto fail;
    }
    *count_out = count;
    return pages;
fail:
    free_pages(pages, count);
    return NULL;
}

static long
result_at(const void *pages, Py_ssize_t p)
{
    return ((const Page *)pages)[p].result;
}

static long
fd_at(const void *fds, Py_ssize_t p)
{
    return ((const int *)fds)[p];
}

/* What every call starts with: xxHash bound, the static fields (56 bytes, or None: no
 * envelopes), the page table named from the store and keys (store NULL: a segment call,
 * digests only), and a hash state. NULL, with an exception set, when one is missing or
 * malformed. */
static Page *
begin_call(PyObject *store, const char *stem, unsigned long long seq, PyObject *keys,
           PyObject *regions, PyObject *direct, PyObject *static_obj,
           const unsigned char **static_fields, Py_ssize_t *count, XXH3_state_t **state)
{
    if (!glue_bound(MODULE) || !glue_static_fields(static_obj, 1, MODULE, static_fields))
        return NULL;
    Page *pages;
    if (store == NULL) {
        pages = load_pages(NULL, keys, regions, direct, count);
    } else {
        PyObject *encoded = NULL;
        if (!PyUnicode_FSConverter(store, &encoded)) return NULL;
        Names names = {PyBytes_AS_STRING(encoded), (size_t)PyBytes_GET_SIZE(encoded), stem, seq};
        pages = load_pages(&names, keys, regions, direct, count);
        Py_DECREF(encoded);
    }
    if (pages == NULL) return NULL;
    *state = XXH3_createState();
    if (*state == NULL) {
        free_pages(pages, *count);
        PyErr_NoMemory();
        return NULL;
    }
    return pages;
}

/* The table and state of a call, freed. */
static void
free_call(Page *pages, Py_ssize_t count, XXH3_state_t *state)
{
    XXH3_freeState(state);
    free_pages(pages, count);
}

/* What every call with per-page codes ends with: the codes as a list; then free_call. */
static PyObject *
end_call(Page *pages, Py_ssize_t count, XXH3_state_t *state)
{
    PyObject *codes = glue_int_list(count, result_at, pages);
    free_call(pages, count, state);
    return codes;
}

PyDoc_STRVAR(read_pages_doc,
"read_pages(store, keys, pages, direct, static, full, nowait=False) -> list[int]\n\n"
"Read each key's file under store into its page's regions (header slot first); one\n"
"code per page. With static (56 bytes) the envelope is checked: OK means valid\n"
"(payload checksum included when full), UNVERIFIED that the caller must explain the\n"
"rejection. With nowait, pages not all in the page cache are left alone (WOULD_BLOCK).\n"
"direct is one flag for all pages or a list. The GIL is released for the whole call.");

static PyObject *
read_pages(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *store, *keys, *regions, *direct, *static_obj;
    int full, nowait = 0;
    if (!PyArg_ParseTuple(args, "UO!O!OOp|p:read_pages", &store, &PyList_Type, &keys,
                          &PyList_Type, &regions, &direct, &static_obj, &full, &nowait))
        return NULL;
    const unsigned char *static_fields;
    Py_ssize_t count = 0;
    XXH3_state_t *state;
    Page *pages = begin_call(store, NULL, 0, keys, regions, direct, static_obj, &static_fields,
                             &count, &state);
    if (pages == NULL) return NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t p = 0; p < count; p++) pages[p].result = get_one(&pages[p], state, static_fields, full, nowait);
    Py_END_ALLOW_THREADS
    return end_call(pages, count, state);
}

PyDoc_STRVAR(write_pages_doc,
"write_pages(store, keys, stem, seq, pages, direct, static, datasync, exchange, spare=None,\n"
"            existing=None)\n"
"    -> (list[int], spare)\n\n"
"Write each page into a temp file (STORE/xx/yy/<stem><seq + i>.tmp) and publish it over\n"
"its key's file (by exchange where possible, else rename); one code per page. With\n"
"static the envelope is first written into each page's header slot. A page replaced by\n"
"exchange leaves its file, exclusively locked, as the spare (fd, path, size, direct)\n"
"that the next page of that size is written into in place; the caller keeps the\n"
"returned spare for its next call (or unlinks and closes it). Without datasync, a page\n"
"whose existing (a list of flags: the index holds its key) file has its size is\n"
"overwritten in place under an exclusive lock (IN_PLACE). The GIL is released.");

static PyObject *
write_pages(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *store, *keys, *regions, *direct, *static_obj, *spare_in = Py_None;
    PyObject *existing = Py_None;
    const char *stem;
    unsigned long long seq;
    int datasync, exchange;
    if (!PyArg_ParseTuple(args, "UO!sKO!OOpp|OO:write_pages", &store, &PyList_Type, &keys, &stem,
                          &seq, &PyList_Type, &regions, &direct, &static_obj, &datasync,
                          &exchange, &spare_in, &existing))
        return NULL;
    if (stem[0] != '.' || strchr(stem, '/') != NULL) { /* temp names are hidden, in place */
        PyErr_Format(PyExc_ValueError, "_pageio: %s is not a temp name stem (.<pid>.<tid>.)", stem);
        return NULL;
    }
    if (existing != Py_None) {
        if (!PyList_Check(existing) || PyList_GET_SIZE(existing) != PyList_Size(keys)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "_pageio: the per-page lists differ in length");
            return NULL;
        }
        for (Py_ssize_t p = 0; p < PyList_GET_SIZE(existing); p++) {
            if (!PyBool_Check(PyList_GET_ITEM(existing, p))) {
                PyErr_SetString(PyExc_TypeError, "_pageio: existing is a list of bools");
                return NULL;
            }
        }
    }
    Spare spare = {.fd = -1};
    if (spare_in != Py_None) {
        const char *path;
        Py_ssize_t length;
        unsigned long long size;
        if (!PyArg_ParseTuple(spare_in, "iy#Kp:spare", &spare.fd, &path, &length, &size,
                              &spare.direct))
            return NULL;
        if ((size_t)length >= sizeof spare.path) {
            PyErr_SetString(PyExc_ValueError, "_pageio: the spare's path is too long");
            return NULL;
        }
        memcpy(spare.path, path, (size_t)length);
        spare.path[length] = '\0';
        spare.size = size;
    }
    const unsigned char *static_fields;
    Py_ssize_t count = 0;
    XXH3_state_t *state;
    Page *pages = begin_call(store, stem, seq, keys, regions, direct, static_obj,
                             &static_fields, &count, &state);
    if (pages == NULL) return NULL;
    for (Py_ssize_t p = 0; existing != Py_None && p < count; p++)
        pages[p].existing = PyList_GET_ITEM(existing, p) == Py_True;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t p = 0; p < count; p++)
        pages[p].result = put_one(&pages[p], state, static_fields, datasync, exchange, &spare);
    Py_END_ALLOW_THREADS
    PyObject *codes = end_call(pages, count, state);
    if (codes == NULL) {
        drop_spare(&spare);
        return NULL;
    }
    if (spare.fd < 0) return Py_BuildValue("(NO)", codes, Py_None);
    return Py_BuildValue("(N(iy#Ki))", codes, spare.fd, spare.path, (Py_ssize_t)strlen(spare.path),
                         (unsigned long long)spare.size, spare.direct);
}

PyDoc_STRVAR(publish_file_doc,
"publish_file(tmp, final, written, exchange) -> int\n\n"
"Steps 2-5 of the publish protocol (kvtier/backends/filestore/publish.py) for a page\n"
"file written elsewhere under tmp, in final's directory: check that tmp still holds the\n"
"file written (written: its (st_dev, st_ino), or None for the regular file found), move\n"
"it over final (by exchange where exchange is set and a page is there, else rename),\n"
"check final, and unlink the page it replaced. OK; REPLACED_DEBRIS (published, and a\n"
"non-file the exchange moved out is under tmp); TEMP_TAKEN (nothing of ours published);\n"
"with nothing moved, IN_THE_WAY (a non-file holds final), NO_EXCHANGE (no exchange\n"
"here) or -errno. The GIL is released.");

static PyObject *
publish_file(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *tmp = NULL, *final = NULL, *written_obj;
    int exchange;
    if (!PyArg_ParseTuple(args, "O&O&Op:publish_file", PyUnicode_FSConverter, &tmp,
                          PyUnicode_FSConverter, &final, &written_obj, &exchange)) {
        Py_XDECREF(tmp);
        Py_XDECREF(final);
        return NULL;
    }
    struct stat written = {0};
    int known = written_obj != Py_None;
    if (known) {
        unsigned long long dev, ino;
        if (!PyArg_ParseTuple(written_obj, "KK:written", &dev, &ino)) {
            Py_DECREF(tmp);
            Py_DECREF(final);
            return NULL;
        }
        written.st_dev = (dev_t)dev;
        written.st_ino = (ino_t)ino;
    }
    long code;
    Py_BEGIN_ALLOW_THREADS
    code = publish_one(PyBytes_AS_STRING(tmp), PyBytes_AS_STRING(final), known ? &written : NULL,
                        exchange);
    Py_END_ALLOW_THREADS
    Py_DECREF(tmp);
    Py_DECREF(final);
    return PyLong_FromLong(code);
}

PyDoc_STRVAR(open_pages_doc,
"open_pages(store, keys, sizes, direct) -> (list[int], list[int])\n\n"
"Open each key's page file under store for a read elsewhere (an io_uring): under the\n"
"readers' shared lock, a regular file of its size in sizes (bytes), O_NONBLOCK\n"
"cleared. Returns the descriptors (-1 where none) and one code per page (OK, or why\n"
"not, as read_pages reports it). direct is one flag for all pages or a list. The\n"
"caller closes the descriptors. The GIL is released for the call.");

static PyObject *
open_pages(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *store, *keys, *sizes_obj, *direct;
    if (!PyArg_ParseTuple(args, "UO!O!O:open_pages", &store, &PyList_Type, &keys, &PyList_Type,
                          &sizes_obj, &direct))
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(keys);
    if (PyList_GET_SIZE(sizes_obj) != count || (PyList_Check(direct) && PyList_GET_SIZE(direct) != count)) {
        PyErr_SetString(PyExc_ValueError, "_pageio: the per-page lists differ in length");
        return NULL;
    }
    PyObject *encoded = NULL;
    if (!PyUnicode_FSConverter(store, &encoded)) return NULL;
    Names names = {PyBytes_AS_STRING(encoded), (size_t)PyBytes_GET_SIZE(encoded), NULL, 0};
    Page *pages = PyMem_Calloc((size_t)(count ? count : 1), sizeof(Page));
    unsigned long long *sizes = PyMem_Calloc((size_t)(count ? count : 1), sizeof *sizes);
    int *fds = PyMem_Calloc((size_t)(count ? count : 1), sizeof(int));
    int loaded = pages != NULL && sizes != NULL && fds != NULL;
    if (!loaded) PyErr_NoMemory();
    for (Py_ssize_t p = 0; loaded && p < count; p++) {
        sizes[p] = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(sizes_obj, p));
        pages[p].direct = direct_of(direct, p);
        loaded = !PyErr_Occurred() && pages[p].direct >= 0 &&
                 name_page(&pages[p], &names, PyList_GET_ITEM(keys, p), p);
    }
    Py_DECREF(encoded);
    PyObject *out = NULL, *codes = NULL;
    if (loaded) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t p = 0; p < count; p++) pages[p].result = open_one(&pages[p], sizes[p], &fds[p]);
        Py_END_ALLOW_THREADS
        codes = glue_int_list(count, result_at, pages);
        out = codes == NULL ? NULL : glue_int_list(count, fd_at, fds);
        if (out == NULL)
            for (Py_ssize_t p = 0; p < count; p++)
                if (fds[p] >= 0) close(fds[p]);
    }
    if (pages != NULL)
        for (Py_ssize_t p = 0; p < count; p++) PyMem_Free(pages[p].path);
    PyMem_Free(pages);
    PyMem_Free(sizes);
    PyMem_Free(fds);
    if (out == NULL) {
        Py_XDECREF(codes);
        return NULL;
    }
    return Py_BuildValue("(NN)", out, codes);
}

/* --- the segment backend's data path (segment.c) ----------------------------------- */

PyDoc_STRVAR(segment_write_doc,
"segment_write(fd, offset, keys, pages, static) -> int\n\n"
"Write the pages (each a list of its header slot and payload regions) back to back into\n"
"fd from offset, one record's data. With static (56 bytes) each page's envelope for its\n"
"key is first written into its header slot, the payload hashed just before it is\n"
"copied (None: the slots are written as they are). The bytes written, or -errno. The\n"
"GIL is released for the whole call.");

static PyObject *
segment_write_py(PyObject *self, PyObject *args)
{
    (void)self;
    int fd;
    long long offset;
    PyObject *keys, *regions, *static_obj;
    if (!PyArg_ParseTuple(args, "iLO!O!O:segment_write", &fd, &offset, &PyList_Type, &keys,
                          &PyList_Type, &regions, &static_obj))
        return NULL;
    const unsigned char *static_fields;
    Py_ssize_t count = 0;
    XXH3_state_t *state;
    Page *pages = begin_call(NULL, NULL, 0, keys, regions, Py_False, static_obj,
                             &static_fields, &count, &state);
    if (pages == NULL) return NULL;
    long wrote;
    Py_BEGIN_ALLOW_THREADS
    wrote = segment_write(fd, (off_t)offset, pages, count, state, static_fields);
    Py_END_ALLOW_THREADS
    free_call(pages, count, state);
    return PyLong_FromLong(wrote);
}

PyDoc_STRVAR(segment_read_doc,
"segment_read(fds, offsets, keys, pages, static, full, nowait=False) -> (list[int], int)\n\n"
"Read page i from fds[i] at offsets[i] into its regions (header slot first). Pages come\n"
"in file order: nearby pages of one descriptor (a record header apart at most) are read\n"
"in one preadv and checked right after it. One code per page: with static (56 bytes)\n"
"OK means the envelope is valid for the page's key (payload checksum included when\n"
"full) and UNVERIFIED that the caller must explain the rejection; SHORT_READ: the file\n"
"ended first; WOULD_BLOCK (nowait): not all in the page cache, nothing checked; or\n"
"-errno; and the reads made. The GIL is released for the whole call.");

static PyObject *
segment_read_py(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *fds_obj, *offsets_obj, *keys, *regions, *static_obj;
    int full, nowait = 0;
    if (!PyArg_ParseTuple(args, "O!O!O!O!Op|p:segment_read", &PyList_Type, &fds_obj,
                          &PyList_Type, &offsets_obj, &PyList_Type, &keys, &PyList_Type,
                          &regions, &static_obj, &full, &nowait))
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(regions);
    if (PyList_GET_SIZE(fds_obj) != count || PyList_GET_SIZE(offsets_obj) != count) {
        PyErr_SetString(PyExc_ValueError, "_pageio: the per-page lists differ in length");
        return NULL;
    }
    int *fds = PyMem_Calloc((size_t)(count ? count : 1), sizeof(int));
    off_t *offsets = PyMem_Calloc((size_t)(count ? count : 1), sizeof(off_t));
    if (fds == NULL || offsets == NULL) {
        PyMem_Free(fds);
        PyMem_Free(offsets);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t p = 0; p < count; p++) {
        fds[p] = (int)PyLong_AsLong(PyList_GET_ITEM(fds_obj, p));
        offsets[p] = (off_t)PyLong_AsLongLong(PyList_GET_ITEM(offsets_obj, p));
        if (PyErr_Occurred() || fds[p] < 0 || offsets[p] < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "_pageio: a descriptor or offset is negative");
            PyMem_Free(fds);
            PyMem_Free(offsets);
            return NULL;
        }
    }
    const unsigned char *static_fields;
    XXH3_state_t *state;
    Page *pages = begin_call(NULL, NULL, 0, keys, regions, Py_False, static_obj,
                             &static_fields, &count, &state);
    PyObject *out = NULL;
    if (pages != NULL) {
        int reads;
        Py_BEGIN_ALLOW_THREADS
        reads = segment_read(fds, offsets, pages, count, state, static_fields, full, nowait);
        Py_END_ALLOW_THREADS
        PyObject *codes = end_call(pages, count, state);
        if (codes != NULL && reads < 0) Py_SETREF(codes, PyErr_NoMemory());
        out = codes == NULL ? NULL : Py_BuildValue("(Ni)", codes, reads);
    }
    PyMem_Free(fds);
    PyMem_Free(offsets);
    return out;
}

PyDoc_STRVAR(name_doc,
"name(store, key) -> (path, digest)\n\n"
"The file a checked key's page has under store, and the key's 16-byte envelope digest,\n"
"as this module computes them (the same as paths.page_path_unchecked and\n"
"envelope.key_digest).");

static PyObject *
name(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *store, *key;
    if (!PyArg_ParseTuple(args, "UU:name", &store, &key)) return NULL;
    PyObject *encoded = NULL;
    if (!PyUnicode_FSConverter(store, &encoded)) return NULL;
    Names names = {PyBytes_AS_STRING(encoded), (size_t)PyBytes_GET_SIZE(encoded), NULL, 0};
    Page page = {0};
    int named = name_page(&page, &names, key, 0);
    Py_DECREF(encoded);
    PyObject *out = named ? Py_BuildValue("(sy#)", page.path, page.key_digest, (Py_ssize_t)KEY_DIGEST_BYTES) : NULL;
    PyMem_Free(page.path);
    return out;
}

PyDoc_STRVAR(module_doc,
"The file backend's per-page loop (open, move, checksum, envelope) and the publish\n"
"protocol's steps, in compiled code.");

PyDoc_STRVAR(bind_doc, GLUE_BIND_DOC);

static PyMethodDef methods[] = {
    {"bind", glue_bind, METH_O, bind_doc},
    {"name", name, METH_VARARGS, name_doc},
    {"open_pages", open_pages, METH_VARARGS, open_pages_doc},
    {"publish_file", publish_file, METH_VARARGS, publish_file_doc},
    {"read_pages", read_pages, METH_VARARGS, read_pages_doc},
    {"segment_read", segment_read_py, METH_VARARGS, segment_read_doc},
    {"segment_write", segment_write_py, METH_VARARGS, segment_write_doc},
    {"write_pages", write_pages, METH_VARARGS, write_pages_doc},
    {NULL, NULL, 0, NULL},
};

PyMODINIT_FUNC
PyInit__pageio(void)
{
    static const GlueConstant constants[] = {
        {"OK", OK}, {"ABSENT", ABSENT}, {"NOT_REGULAR", NOT_REGULAR},
        {"SIZE_MISMATCH", SIZE_MISMATCH}, {"SHORT_READ", SHORT_READ},
        {"UNVERIFIED", UNVERIFIED}, {"UNPUBLISHED", UNPUBLISHED},
        {"REPLACED_DEBRIS", REPLACED_DEBRIS}, {"WOULD_BLOCK", WOULD_BLOCK},
        {"BUSY", BUSY}, {"REPLACED", REPLACED}, {"IN_PLACE", IN_PLACE},
        {"NOT_RECYCLED", NOT_RECYCLED}, {"TEMP_TAKEN", TEMP_TAKEN},
        {"IN_THE_WAY", IN_THE_WAY}, {"NO_EXCHANGE", NO_EXCHANGE},
        {"SAME_PAGE_PREFIX", SAME_PAGE_PREFIX}, {"PIECE", PIECE},
        {"MAX_KEY_LENGTH", MAX_KEY_LENGTH}, {"WRITER_WAIT_NS", WRITER_WAIT_NS},
        {"SEGMENT_GAP", SEGMENT_GAP}, {"SEGMENT_RUN", SEGMENT_RUN},
    };
    PyObject *module = glue_module(MODULE, module_doc, methods, constants,
                                   sizeof constants / sizeof constants[0]);
    if (module != NULL && envelope_export(module) != 0) Py_CLEAR(module);
    return module;
}
