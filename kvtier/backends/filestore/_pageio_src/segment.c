/* The segment store's data path: a record's pages written back to back at one offset of
 * a segment file, each page's envelope computed while its bytes are in cache; and pages
 * read from segment files, adjacent ones (or ones a small gap apart) in one preadv, each
 * checked right after it lands. kvtier/backends/segment/ keeps the index, reservations,
 * record headers and every rare case; these loops only move bytes and check envelopes,
 * with the GIL released. */
#include "pageio.h"

/* Pages of a record are hashed and written in groups of about this many bytes: a group's
 * bytes are still in cache when the pwritev copies them. */
#define WRITE_GROUP (512 * 1024)

/* Write one page on its own, its payload piece by piece, each piece hashed just before it
 * is written (with static_fields), then its header slot (its envelope filled first), at
 * base: the bytes written or -errno. For a large page, and one of more regions than one
 * call takes. */
static long
write_large(int fd, Page *page, off_t base, XXH3_state_t *state, const unsigned char *static_fields)
{
    struct iovec iov[MAX_REGIONS];
    off_t offset = base + page->buffers[0].len;
    Cursor at = {1, 0};
    XXH3_128bits_reset(state);
    while (at.region < page->count) {
        int n;
        size_t want = next_piece(page, &at, iov, &n);
        if (static_fields != NULL)
            for (int i = 0; i < n; i++) XXH3_128bits_update(state, iov[i].iov_base, iov[i].iov_len);
        long wrote = move_all(fd, iov, n, offset, 1);
        if (wrote < 0) return wrote;
        offset += (off_t)want;
    }
    if (static_fields != NULL)
        envelope_fill(page->buffers, page->count, page->key_digest, state, static_fields);
    struct iovec header = {page->buffers[0].buf, (size_t)page->buffers[0].len};
    long wrote = move_all(fd, &header, 1, base, 1);
    return wrote < 0 ? wrote : (long)(offset - base);
}

static uint64_t
page_bytes(const Page *page)
{
    return (uint64_t)page->buffers[0].len + payload_length(page);
}

/* Whether a page moves on its own, in pieces: one of more regions than a call takes
 * with a gap before it, or, where its payload is hashed (hashing), a large one, each
 * piece hashed while it is in cache. */
static int
alone(const Page *page, int hashing)
{
    return page->count + 1 > MAX_REGIONS || (hashing && page_bytes(page) > 2 * (uint64_t)PIECE);
}

long
segment_write(int fd, off_t offset, Page *pages, Py_ssize_t count, XXH3_state_t *state,
              const unsigned char *static_fields)
{
    struct iovec iov[MAX_REGIONS];
    off_t start = offset;
    Py_ssize_t p = 0;
    while (p < count) {
        Page *page = &pages[p];
        uint64_t size = page_bytes(page);
        if (alone(page, static_fields != NULL)) {
            long wrote = write_large(fd, page, offset, state, static_fields);
            if (wrote < 0) return wrote;
            offset += (off_t)size;
            p++;
            continue;
        }
        /* a group of small pages: envelopes first, then one pwritev */
        int n = 0;
        uint64_t group = 0;
        off_t at = offset;
        while (p < count) {
            page = &pages[p];
            size = page_bytes(page);
            if (n > 0 && (group + size > WRITE_GROUP || n + page->count > MAX_REGIONS ||
                          alone(page, static_fields != NULL)))
                break;
            if (static_fields != NULL)
                envelope_write(page->buffers, page->count, page->key_digest, state, static_fields);
            for (Py_ssize_t i = 0; i < page->count; i++) {
                iov[n].iov_base = page->buffers[i].buf;
                iov[n].iov_len = (size_t)page->buffers[i].len;
                n++;
            }
            group += size;
            p++;
        }
        long wrote = move_all(fd, iov, n, at, 1);
        if (wrote < 0) return wrote;
        offset += (off_t)group;
    }
    return (long)(offset - start);
}

/* Read one page on its own (alone()), piece by piece at base, hashing each piece as it
 * lands; with nowait from the page cache alone. OK, SHORT_READ, WOULD_BLOCK or -errno. */
static long
read_large(int fd, Page *page, off_t base, XXH3_state_t *state, int nowait)
{
    struct iovec iov[MAX_REGIONS];
    struct iovec header = {page->buffers[0].buf, (size_t)page->buffers[0].len};
    long got;
    if (nowait) {
        got = preadv2(fd, &header, 1, base, RWF_NOWAIT);
        if (got < 0 && errno != EAGAIN && errno != EINTR) return -errno;
        if (got < 0 || (size_t)got != header.iov_len) return WOULD_BLOCK;
    } else {
        got = move_all(fd, &header, 1, base, 0);
        if (got < 0) return got;
        if ((size_t)got != header.iov_len) return SHORT_READ;
    }
    off_t offset = base + got;
    Cursor at = {1, 0};
    XXH3_128bits_reset(state);
    while (at.region < page->count) {
        int n;
        size_t want = next_piece(page, &at, iov, &n);
        long moved;
        if (nowait) {
            moved = preadv2(fd, iov, n, offset, RWF_NOWAIT);
            if (moved < 0 && errno != EAGAIN && errno != EINTR) return -errno;
            if (moved < 0 || (size_t)moved != want) return WOULD_BLOCK;
        } else {
            moved = move_all(fd, iov, n, offset, 0);
            if (moved < 0) return moved;
            if ((size_t)moved != want) return SHORT_READ;
        }
        for (int i = 0; i < n; i++) XXH3_128bits_update(state, iov[i].iov_base, iov[i].iov_len);
        offset += (off_t)want;
    }
    return OK;
}

/* The envelope verdict on a filled page: OK, or UNVERIFIED (the caller explains). */
static long
verdict(Page *page, XXH3_state_t *state, const unsigned char *static_fields, int full, int hashed)
{
    if (static_fields == NULL) return OK;
    PayloadCheck payload = !full ? PAYLOAD_UNCHECKED : hashed ? PAYLOAD_HASHED : PAYLOAD_HASH;
    return envelope_verdict(page->buffers, page->count, page->key_digest, static_fields, state,
                            payload) == VALID
               ? OK
               : UNVERIFIED;
}

/* The pages [first, last) of one run: each at its offset in fd, in file order, every gap
 * between two of them at most SEGMENT_GAP bytes. One preadv of the whole run (gaps into
 * scratch), then each page's verdict; codes into result. */
static void
read_run(int fd, Page *pages, const off_t *offsets, Py_ssize_t first, Py_ssize_t last,
         XXH3_state_t *state, const unsigned char *static_fields, int full, int nowait,
         unsigned char *scratch)
{
    struct iovec iov[MAX_REGIONS];
    int n = 0;
    uint64_t want = 0;
    off_t end = offsets[first];
    for (Py_ssize_t p = first; p < last; p++) {
        if (offsets[p] > end) {
            iov[n].iov_base = scratch;
            iov[n].iov_len = (size_t)(offsets[p] - end);
            want += iov[n].iov_len;
            n++;
        }
        for (Py_ssize_t i = 0; i < pages[p].count; i++) {
            iov[n].iov_base = pages[p].buffers[i].buf;
            iov[n].iov_len = (size_t)pages[p].buffers[i].len;
            want += iov[n].iov_len;
            n++;
        }
        end = offsets[p] + (off_t)page_bytes(&pages[p]);
    }
    long got;
    if (nowait) {
        got = preadv2(fd, iov, n, offsets[first], RWF_NOWAIT);
        if (got < 0 && errno != EAGAIN && errno != EINTR) {
            got = -errno;
        } else if (got < 0 || (uint64_t)got != want) {
            for (Py_ssize_t p = first; p < last; p++) pages[p].result = WOULD_BLOCK;
            return;
        }
    } else {
        got = move_all(fd, iov, n, offsets[first], 0);
    }
    for (Py_ssize_t p = first; p < last; p++) {
        if (got < 0) {
            pages[p].result = got;
        } else if (offsets[p] + (off_t)page_bytes(&pages[p]) > offsets[first] + got) {
            pages[p].result = SHORT_READ; /* the file ends early: truncated under us */
        } else {
            pages[p].result = verdict(&pages[p], state, static_fields, full, 0);
        }
    }
}

/* Where the run that starts at page first ends: pages of the same descriptor, each
 * starting at most SEGMENT_GAP bytes after the previous one ends, at most SEGMENT_RUN
 * bytes and MAX_REGIONS regions in all; a page that moves alone() is a run of its own. */
static Py_ssize_t
run_end(const int *fds, const Page *pages, const off_t *offsets, Py_ssize_t first, Py_ssize_t count,
        int streamed)
{
    uint64_t size = page_bytes(&pages[first]);
    if (alone(&pages[first], streamed)) return first + 1;
    off_t end = offsets[first] + (off_t)size;
    uint64_t total = size;
    int regions = (int)pages[first].count;
    Py_ssize_t p = first + 1;
    for (; p < count; p++) {
        size = page_bytes(&pages[p]);
        if (fds[p] != fds[first] || offsets[p] < end || offsets[p] - end > SEGMENT_GAP) break;
        if (alone(&pages[p], streamed)) break;
        if (total + size + (uint64_t)(offsets[p] - end) > SEGMENT_RUN) break;
        if (regions + pages[p].count + 1 > MAX_REGIONS) break;
        total += size + (uint64_t)(offsets[p] - end);
        regions += (int)pages[p].count + 1;
        end = offsets[p] + (off_t)size;
    }
    return p;
}

int
segment_read(const int *fds, const off_t *offsets, Page *pages, Py_ssize_t count,
             XXH3_state_t *state, const unsigned char *static_fields, int full, int nowait)
{
    unsigned char *scratch = malloc(SEGMENT_GAP);
    if (scratch == NULL) return -ENOMEM;
    int streamed = static_fields != NULL && full;
    int reads = 0;
    /* No POSIX_FADV_WILLNEED ahead of blocking reads: measured here it cut cold reads of
     * a segment's runs to less than half, where the kernel's own readahead of one
     * thread's sequential reads ran fastest. */
    for (Py_ssize_t p = 0; p < count;) {
        Py_ssize_t last = run_end(fds, pages, offsets, p, count, streamed);
        if (last == p + 1 && alone(&pages[p], streamed)) {
            long got = read_large(fds[p], &pages[p], offsets[p], state, nowait);
            pages[p].result = got == OK ? verdict(&pages[p], state, static_fields, full, 1) : got;
        } else {
            read_run(fds[p], pages, offsets, p, last, state, static_fields, full, nowait, scratch);
        }
        /* counted once, by the pass that read it */
        reads += !(nowait && (pages[p].result == WOULD_BLOCK || pages[p].result == -EOPNOTSUPP));
        p = last;
    }
    free(scratch);
    return reads;
}
