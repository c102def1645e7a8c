/* kvtier.backends.filestore._pageio: the file backends' per-page loop in compiled code.
 *
 * One call moves a slice of a batch: for every page it opens the file, moves the bytes
 * with preadv/pwritev straight between the file and the page's regions, checksums the
 * payload (xxh3-128) while it is in cache, and checks or writes the envelope header; a
 * put then publishes the page. The GIL is released for the whole slice, so the I/O
 * threads of a batch run in parallel; Python keeps everything that is not per-page
 * arithmetic (the index, counters, debris, every rare error), driven by the codes below.
 *
 * This header is what the module's C files share; each file does one job:
 *   names.c     a page's file name and temp name, from its key
 *   io.c        vectored I/O: moving a page's regions (whole, or in hashed pieces)
 *   read.c      reading one page under the readers' lock
 *   publish.c   writing one page and publishing it: the publish protocol of
 *               kvtier/backends/filestore/publish.py (steps 2-5 for every writer where
 *               this module is built), and the spare files it recycles
 *   segment.c   the segment backend's data path: a record's pages written at one
 *               offset, pages read from segment files in coalesced runs
 *   module.c    the module's functions: arguments in, codes out
 * and, shared with kvtier.core._envelope (one copy of each, in kvtier/_csrc/):
 *   envelope.c  the envelope: writing a page's, and the verdict on one (envelope.h; its
 *               layout in envelope_layout.h)
 *   blake2b.c   BLAKE2b (RFC 7693), for page names and the keys' envelope digests
 *   xxh.c       the xxHash functions, bound at import to a loaded copy of the library
 *               (both declared in kvhash.h)
 *   glue.c      the Python glue both modules need (binding xxHash, the static fields and
 *               regions arguments, lists of codes, the module object; glue.h)
 * hatch_build.py compiles them all into the one extension module.
 */
#ifndef KVTIER_PAGEIO_H
#define KVTIER_PAGEIO_H

#define _GNU_SOURCE
/* The Python glue (and Python.h, first), shared with the core's envelope module. */
#include "glue.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* The envelope (its layout, writing and checking one), xxHash (bound at import), BLAKE2b
 * and the little-endian helpers, shared with the core's envelope module: kvtier/_csrc/
 * (on the include path of both builds). */
#include "envelope.h"

/* --- sizes and limits ------------------------------------------------------------- */
/* Large pages are hashed piece by piece as they land, while each piece is in cache. */
#define PIECE (256 * 1024)
#define MAX_REGIONS 1024 /* IOV_MAX */
#define MAX_KEY_LENGTH 160 /* kvtier.core.keys.MAX_KEY_LENGTH */
/* How long a reader waits out a page being overwritten in place (a write of microseconds
 * to a few milliseconds), polling its lock; then the page is a counted busy miss. */
#define WRITER_WAIT_NS (20L * 1000 * 1000)
#define WRITER_POLL_NS (50L * 1000)

/* Per-page outcomes (module constants of the same names). */
enum {
    OK = 0,           /* read (and verified, when asked) / written and published */
    ABSENT = 1,       /* get: no file under the name */
    NOT_REGULAR = 2,  /* get: something other than a regular file holds the name */
    SIZE_MISMATCH = 3, /* get: the file has another size than the page */
    SHORT_READ = 4,   /* get: end of file before the page was full */
    UNVERIFIED = 5,   /* get: filled, but the envelope check failed: the caller explains */
    UNPUBLISHED = 6,  /* put: written and closed under its temp name, not yet published */
    REPLACED_DEBRIS = 7, /* put: published; a non-file the exchange moved out is at tmp */
    WOULD_BLOCK = 8,  /* get with nowait: not (all) in the page cache; nothing was checked */
    BUSY = 9,         /* get: a writer holds the file (being recycled) twice in a row */
    REPLACED = 10,    /* get: the file was recycled for another page while being opened */
    IN_PLACE = 11,    /* put: published by overwriting the page's own file under its lock */
    NOT_RECYCLED = 12, /* put: published; the file it replaced (or the spare) had another
                        * link or owner, so it was neither written into nor kept */
    TEMP_TAKEN = 13,  /* put: nothing of ours published; another entry took its temp name
                        * before the move (or during it: an exchange was undone) */
    IN_THE_WAY = 14,  /* publish_one: a non-file holds the page's name; nothing moved (the
                        * caller removes it as debris and calls again) */
    NO_EXCHANGE = 15, /* publish_one: this kernel or filesystem cannot exchange names;
                        * nothing moved (the caller calls again without exchange) */
};
/* Any other (negative) result is -errno of the step that failed; put removed its temp. */

typedef struct {
    Py_buffer *buffers; /* the page's regions: header slot first, then the payload */
    Py_ssize_t count;
    char *path;         /* owned copies (the GIL is released while they are used) */
    char *final;
    int direct;
    unsigned char key_digest[KEY_DIGEST_BYTES]; /* blake2b-128 of the key (envelopes only) */
    int existing;       /* put: the index holds the key (its file may be overwritten) */
    int refused;        /* put: a file it would have written into was not ours alone */
    long result;
} Page;

/* The bytes of the page's payload: every region after the header slot. */
static inline uint64_t
payload_length(const Page *page)
{
    return glue_payload_length(page->buffers, page->count);
}

/* --- names (names.c; blake2b() from kvtier/_csrc/blake2b.c) ------------------------ */

/* STORE/xx/yy/KEY.kv into out (capacity PATH_MAX); the length, or -1 if it does not fit. */
long page_name(char *out, const char *store, size_t store_length, const char *key,
               size_t length);
/* The temp name <dir>/<stem><seq>.tmp of a page whose name is page (its directory the
 * first dir_length bytes) into out (capacity PATH_MAX); the length, or -1. */
long temp_name(char *out, const char *page, size_t dir_length, const char *stem,
               unsigned long long seq);

/* --- vectored I/O (io.c) ------------------------------------------------------------ */

/* Where a walk over a page's payload in pieces stands: a region, and bytes into it. */
typedef struct {
    Py_ssize_t region;
    size_t inside;
} Cursor;

/* Move every byte of regions[0..count) at offset, resuming after short transfers: the
 * bytes moved (fewer only at end of file for reads) or -errno. */
long move_all(int fd, const struct iovec *regions, int count, off_t offset, int writing);
/* The next piece of at most PIECE payload bytes from at, as iov[0..*n); its size. */
size_t next_piece(const Page *page, Cursor *at, struct iovec *iov, int *n);
/* Move the whole page from offset 0: OK, SHORT_READ, WOULD_BLOCK (nowait) or -errno. */
long move_regions(int fd, const Page *page, int writing, int nowait);
/* Read the page into its regions, hashing the payload into state (when not NULL) as it
 * lands: OK, SHORT_READ, WOULD_BLOCK (nowait) or -errno. */
long read_regions(int fd, Page *page, XXH3_state_t *state, int nowait);
/* Write a large page piece by piece, each hashed just before it is written, then its
 * header: the bytes written or -errno. */
long write_streamed(int fd, Page *page, XXH3_state_t *state, const unsigned char *static_fields);

/* --- reads (read.c) ------------------------------------------------------------------ */

/* Open path under the readers' shared lock: OK, ABSENT, NOT_REGULAR, BUSY or -errno. */
long open_locked(const char *path, int flags, int *fd, struct stat *info);
/* Read one page (and check its envelope with static_fields): a code. */
long get_one(Page *page, XXH3_state_t *state, const unsigned char *static_fields, int full,
             int nowait);
/* Open one page of size bytes for a read elsewhere, O_NONBLOCK cleared: a code, *fd set
 * (-1 unless OK). */
long open_one(Page *page, unsigned long long size, int *fd);

/* --- writes and the publish protocol (publish.c) ------------------------------------ */

/* A replaced page's file, kept (under its temp name, exclusively locked) to be written
 * over in place by the next page of the same size: an overwrite then reuses the file's
 * page cache instead of allocating a new file's worth and freeing the old. */
typedef struct {
    int fd; /* -1: none */
    int direct;
    uint64_t size;
    char path[PATH_MAX];
} Spare;

/* Close the spare, unlinking its temp name only while that still names its file. */
void drop_spare(Spare *spare);
/* Write one page and publish it (kvtier/backends/filestore/publish.py): a code. */
long put_one(Page *page, XXH3_state_t *state, const unsigned char *static_fields, int datasync,
             int exchange, Spare *spare);
/* Steps 2-5 for a page file written elsewhere (a backend's own loop) under tmp: OK,
 * REPLACED_DEBRIS, TEMP_TAKEN, IN_THE_WAY, NO_EXCHANGE or -errno. written: the file
 * step 1 wrote (NULL: the regular file found under tmp). */
long publish_one(const char *tmp, const char *final, const struct stat *written, int exchange);

/* Step 4 compares this many leading bytes of a file under the page's name with the file
 * written: the envelope up to its payload checksum (this store's static fields, the key's
 * digest, the payload's length), so a page of the key another writer published is told
 * from a foreign file (publish.py, step 4). */
#define SAME_PAGE_PREFIX PAYLOAD_CHECKSUM_AT

/* --- the segment backend's data path (segment.c) ----------------------------------- */

/* Pages of a segment read in one preadv may lie this far apart (a record header and its
 * alignment between two records): the gap is read into scratch memory. */
#define SEGMENT_GAP (64 * 1024)
/* Most bytes of one such read: its pages are verified right after it, still in cache. */
#define SEGMENT_RUN (1024 * 1024)

/* Write pages[0..count) back to back from offset of fd, each page's envelope written
 * into its header slot first (static_fields NULL: none), hashed while in cache: the
 * bytes written, or -errno. */
long segment_write(int fd, off_t offset, Page *pages, Py_ssize_t count, XXH3_state_t *state,
                   const unsigned char *static_fields);
/* Read page p from fds[p] at offsets[p] (pages in file order: runs of nearby pages are
 * one read), checking each envelope when static_fields is set (the payload checksum too
 * when full); each page's code in its result: OK, UNVERIFIED, SHORT_READ, WOULD_BLOCK
 * (nowait: not all in the page cache) or -errno (-EOPNOTSUPP with nowait: the
 * filesystem cannot read from the page cache alone). The reads made, or -ENOMEM. */
int segment_read(const int *fds, const off_t *offsets, Page *pages, Py_ssize_t count,
                 XXH3_state_t *state, const unsigned char *static_fields, int full, int nowait);

#endif /* KVTIER_PAGEIO_H */
