/* Vectored I/O: moving a page's regions between its file and memory, whole or in
 * pieces hashed while they are in cache, and reading from the page cache alone. */
#include "pageio.h"

/* Move every byte of iov[0..count) at offset; resumes after short transfers. Returns the
 * bytes moved (fewer only at end of file for reads) or -errno. */
long
move_all(int fd, const struct iovec *regions, int count, off_t offset, int writing)
{
    struct iovec local[MAX_REGIONS];
    struct iovec *iov = local;
    long done = 0;
    if (count > MAX_REGIONS) return -E2BIG;
    memcpy(local, regions, (size_t)count * sizeof(struct iovec));
    while (count > 0) {
        ssize_t got = writing ? pwritev(fd, iov, count, offset) : preadv(fd, iov, count, offset);
        if (got < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (got == 0) return writing ? -EIO : done; /* a read stops at end of file */
        done += got;
        offset += got;
        while (count > 0 && (size_t)got >= iov->iov_len) { /* regions fully moved */
            got -= (ssize_t)iov->iov_len;
            iov++;
            count--;
        }
        if (count > 0 && got > 0) { /* resume inside a partly moved region */
            iov->iov_base = (char *)iov->iov_base + got;
            iov->iov_len -= (size_t)got;
        }
    }
    return done;
}

/* The next piece of at most PIECE payload bytes from ``at`` as iov[0..*n); moves ``at``
 * past it and returns its size. */
size_t
next_piece(const Page *page, Cursor *at, struct iovec *iov, int *n)
{
    size_t room = PIECE;
    *n = 0;
    while (at->region < page->count && room > 0 && *n < MAX_REGIONS) {
        size_t left = (size_t)page->buffers[at->region].len - at->inside;
        size_t take = left < room ? left : room;
        iov[*n].iov_base = (char *)page->buffers[at->region].buf + at->inside;
        iov[*n].iov_len = take;
        (*n)++;
        room -= take;
        if (take == left) {
            at->region++;
            at->inside = 0;
        } else {
            at->inside += take;
        }
    }
    return PIECE - room;
}

/* One read of want bytes at offset from the page cache alone (RWF_NOWAIT): OK when all
 * came, WOULD_BLOCK when some would wait for the disk, -errno on an error. */
static long
cached_read(int fd, struct iovec *iov, int count, off_t offset, uint64_t want)
{
    ssize_t got = preadv2(fd, iov, count, offset, RWF_NOWAIT);
    if (got < 0 && errno != EAGAIN && errno != EOPNOTSUPP && errno != EINTR) return -errno;
    return got >= 0 && (uint64_t)got == want ? OK : WOULD_BLOCK;
}

/* Move the whole page (every region, from offset 0) in calls of at most MAX_REGIONS
 * regions: OK, or for a read SHORT_READ at an early end of file and, with nowait,
 * WOULD_BLOCK when the page cache does not hold it all; else -errno. */
long
move_regions(int fd, const Page *page, int writing, int nowait)
{
    struct iovec iov[MAX_REGIONS];
    off_t offset = 0;
    for (Py_ssize_t first = 0; first < page->count; first += MAX_REGIONS) {
        int n = 0;
        uint64_t want = 0;
        for (Py_ssize_t i = first; i < page->count && n < MAX_REGIONS; i++, n++) {
            iov[n].iov_base = page->buffers[i].buf;
            iov[n].iov_len = (size_t)page->buffers[i].len;
            want += iov[n].iov_len;
        }
        if (nowait) {
            long cached = cached_read(fd, iov, n, offset, want);
            if (cached != OK) return cached;
        } else {
            long got = move_all(fd, iov, n, offset, writing);
            if (got < 0) return got;
            if ((uint64_t)got != want) return SHORT_READ; /* (a write never comes short) */
        }
        offset += (off_t)want;
    }
    return OK;
}

/* Read the page's file into its regions; the payload is hashed into state as it lands
 * (when state is not NULL). With nowait, a page read in one call is read only from the
 * page cache (RWF_NOWAIT): WOULD_BLOCK when it is not all there. Returns OK,
 * SHORT_READ, WOULD_BLOCK or -errno. */
long
read_regions(int fd, Page *page, XXH3_state_t *state, int nowait)
{
    struct iovec iov[MAX_REGIONS];
    uint64_t total = (uint64_t)page->buffers[0].len + payload_length(page);
    if (state == NULL || page->direct || total <= 2 * (uint64_t)PIECE) {
        long moved = move_regions(fd, page, 0, nowait && !page->direct);
        if (moved != OK) return moved; /* WOULD_BLOCK: a thread waits for the disk */
        if (state != NULL) envelope_hash_payload(state, page->buffers, page->count);
        return OK;
    }
    /* The header slot, then the payload in pieces of at most PIECE, each hashed at once
     * (with nowait, each piece from the page cache alone, else WOULD_BLOCK). */
    off_t offset = 0;
    struct iovec header = {page->buffers[0].buf, (size_t)page->buffers[0].len};
    long got;
    if (nowait && !page->direct) {
        got = cached_read(fd, &header, 1, 0, header.iov_len);
        if (got != OK) return got;
        got = (long)header.iov_len;
    } else {
        got = move_all(fd, &header, 1, 0, 0);
        if (got < 0) return got;
        if (got != page->buffers[0].len) return SHORT_READ;
    }
    offset = got;
    Cursor at = {1, 0};
    while (at.region < page->count) {
        int n;
        size_t want = next_piece(page, &at, iov, &n);
        if (nowait && !page->direct) {
            got = cached_read(fd, iov, n, offset, want);
            if (got != OK) return got;
            got = (long)want;
        } else {
            got = move_all(fd, iov, n, offset, 0);
            if (got < 0) return got;
            if ((size_t)got != want) return SHORT_READ;
        }
        for (int i = 0; i < n; i++) XXH3_128bits_update(state, iov[i].iov_base, iov[i].iov_len);
        offset += got;
    }
    return OK;
}

/* Write a large page piece by piece, each hashed just before it is written (while it is
 * in cache), then its header slot, now that the checksum is known: one pass over the
 * page's memory instead of two. Returns the bytes written or -errno. */
long
write_streamed(int fd, Page *page, XXH3_state_t *state, const unsigned char *static_fields)
{
    struct iovec iov[MAX_REGIONS];
    off_t offset = page->buffers[0].len;
    Cursor at = {1, 0};
    XXH3_128bits_reset(state);
    while (at.region < page->count) {
        int n;
        size_t want = next_piece(page, &at, iov, &n);
        for (int i = 0; i < n; i++) XXH3_128bits_update(state, iov[i].iov_base, iov[i].iov_len);
        long wrote = move_all(fd, iov, n, offset, 1);
        if (wrote < 0) return wrote;
        offset += (off_t)want;
    }
    envelope_fill(page->buffers, page->count, page->key_digest, state, static_fields);
    struct iovec header = {page->buffers[0].buf, (size_t)page->buffers[0].len};
    long wrote = move_all(fd, &header, 1, 0, 1);
    return wrote < 0 ? wrote : (long)offset;
}
