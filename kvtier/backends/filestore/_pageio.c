/* kvtier.backends.filestore._pageio: the file backend's per-page loop in compiled code.
 *
 * One call moves a slice of a batch: for every page it opens the file, moves the bytes
 * with preadv/pwritev straight between the file and the page's regions, checksums the
 * payload (xxh3-128) while it is in cache, and checks or
 * writes the envelope header. The GIL is released for the whole slice, so the I/O
 * threads of a batch run in parallel; Python keeps everything that is not per-page
 * arithmetic (the index, counters, debris, every rare error), driven by the codes below.
 *
 * Envelope layout (kvtier/core/envelope.py, docs/integrity.md), little-endian:
 *   [0, 56)   the fields every page of a store shares ("static")
 *   [56, 72)  key digest          [72, 80) payload length (u64)
 *   [80, 96)  payload xxh3-128, canonical (big-endian high64 then low64)
 *   [96, 104) xxh3-64 of [0, 96)  then zeros to the end of the slot.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

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
#include <dlfcn.h>

/* The part of xxHash's public, stable API (0.8 and later) this module calls. It is bound
 * at import (bind()) to a loaded copy of the library: the one inside the xxhash Python
 * package, whose SIMD-dispatching entry points are about 3x faster here than a distro's
 * SSE2 build, or else the system's libxxhash. No link-time dependency. */
typedef struct XXH3_state_s XXH3_state_t;
typedef struct {
    uint64_t low64;
    uint64_t high64;
} XXH128_hash_t;
static struct {
    XXH3_state_t *(*create_state)(void);
    int (*free_state)(XXH3_state_t *state);
    int (*reset)(XXH3_state_t *state);
    int (*update)(XXH3_state_t *state, const void *input, size_t length);
    XXH128_hash_t (*digest)(const XXH3_state_t *state);
    uint64_t (*hash64)(const void *input, size_t length);
} xxh;
#define XXH3_createState() xxh.create_state()
#define XXH3_freeState(s) xxh.free_state(s)
#define XXH3_128bits_reset(s) xxh.reset(s)
#define XXH3_128bits_update(s, p, n) xxh.update((s), (p), (n))
#define XXH3_128bits_digest(s) xxh.digest(s)
#define XXH3_64bits(p, n) xxh.hash64((p), (n))

#define STATIC_BYTES 56
#define DIGEST_AT 56
#define LENGTH_AT 72
#define CHECKSUM_AT 80
#define BODY_BYTES 96
#define HEADER_BYTES 104
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
    TEMP_TAKEN = 13,  /* put: not published; its temp name no longer held the file written
                        * under it (another entry took the name); nothing is left to undo */
};
/* Any other (negative) result is -errno of the step that failed; put removed its temp. */

typedef struct {
    Py_buffer *buffers; /* the page's regions: header slot first, then the payload */
    Py_ssize_t count;
    char *path;         /* owned copies (the GIL is released while they are used) */
    char *final;
    int direct;
    unsigned char key_digest[16]; /* blake2b-128 of the key (envelopes only) */
    int existing;       /* put: the index holds the key (its file may be overwritten) */
    int refused;        /* put: a file it would have written into was not ours alone */
    long result;
} Page;

/* --- page names ---------------------------------------------------------------------
 * A page of key K lives at STORE/xx/yy/K.kv, xxyy the hex of K's 2-byte blake2b, and its
 * envelope carries K's 16-byte blake2b (kvtier/backends/filestore/paths.py,
 * kvtier/core/envelope.py). Both digests are computed here, so a batch's names cost no
 * Python per page. BLAKE2b as RFC 7693 specifies it, unkeyed, one message at a time. */

static const uint64_t B2_IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t B2_SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t
rotr64(uint64_t x, int n)
{
    return (x >> n) | (x << (64 - n));
}

static uint64_t
get_le64(const unsigned char *in)
{
    uint64_t value = 0;
    for (int i = 7; i >= 0; i--) value = (value << 8) | in[i];
    return value;
}

#define B2_G(a, b, c, d, x, y)                                                                 \
    do {                                                                                       \
        v[a] += v[b] + (x);                                                                    \
        v[d] = rotr64(v[d] ^ v[a], 32);                                                        \
        v[c] += v[d];                                                                          \
        v[b] = rotr64(v[b] ^ v[c], 24);                                                        \
        v[a] += v[b] + (y);                                                                    \
        v[d] = rotr64(v[d] ^ v[a], 16);                                                        \
        v[c] += v[d];                                                                          \
        v[b] = rotr64(v[b] ^ v[c], 63);                                                        \
    } while (0)

/* Mix one 128-byte block into h; `count` is the bytes hashed so far, this block included. */
static void
b2_compress(uint64_t h[8], const unsigned char block[128], uint64_t count, int last)
{
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = get_le64(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = B2_IV[i];
    }
    v[12] ^= count; /* messages here are far below 2**64 bytes: the high word stays 0 */
    if (last) v[14] = ~v[14];
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = B2_SIGMA[r];
        B2_G(0, 4, 8, 12, m[s[0]], m[s[1]]);
        B2_G(1, 5, 9, 13, m[s[2]], m[s[3]]);
        B2_G(2, 6, 10, 14, m[s[4]], m[s[5]]);
        B2_G(3, 7, 11, 15, m[s[6]], m[s[7]]);
        B2_G(0, 5, 10, 15, m[s[8]], m[s[9]]);
        B2_G(1, 6, 11, 12, m[s[10]], m[s[11]]);
        B2_G(2, 7, 8, 13, m[s[12]], m[s[13]]);
        B2_G(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* The unkeyed BLAKE2b digest of `length` bytes, `size` (1..64) bytes long, into out. */
static void
blake2b(unsigned char *out, size_t size, const unsigned char *in, size_t length)
{
    uint64_t h[8];
    unsigned char block[128];
    memcpy(h, B2_IV, sizeof h);
    h[0] ^= 0x01010000ULL ^ (uint64_t)size; /* depth 1, fanout 1, no key, `size` bytes */
    size_t done = 0;
    while (length - done > 128) {
        b2_compress(h, in + done, done + 128, 0);
        done += 128;
    }
    memset(block, 0, sizeof block);
    memcpy(block, in + done, length - done);
    b2_compress(h, block, length, 1);
    for (size_t i = 0; i < size; i++) out[i] = (unsigned char)(h[i / 8] >> (8 * (i % 8)));
}

/* STORE/xx/yy/KEY.kv into out (capacity PATH_MAX); the length, or -1 if it does not fit. */
static long
page_name(char *out, const char *store, size_t store_length, const char *key, size_t length)
{
    static const char hex[] = "0123456789abcdef";
    unsigned char shard[2];
    if (store_length + length + 11 >= PATH_MAX) return -1;
    blake2b(shard, 2, (const unsigned char *)key, length);
    char *at = out;
    memcpy(at, store, store_length);
    at += store_length;
    *at++ = '/';
    *at++ = hex[shard[0] >> 4];
    *at++ = hex[shard[0] & 15];
    *at++ = '/';
    *at++ = hex[shard[1] >> 4];
    *at++ = hex[shard[1] & 15];
    *at++ = '/';
    memcpy(at, key, length);
    at += length;
    memcpy(at, ".kv", 4);
    return (long)(at + 3 - out);
}

static void
put_le64(unsigned char *out, uint64_t value)
{
    for (int i = 0; i < 8; i++) out[i] = (unsigned char)(value >> (8 * i));
}

static void
canonical128(XXH128_hash_t hash, unsigned char *out)
{
    for (int i = 0; i < 8; i++) out[i] = (unsigned char)(hash.high64 >> (56 - 8 * i));
    for (int i = 0; i < 8; i++) out[8 + i] = (unsigned char)(hash.low64 >> (56 - 8 * i));
}

/* Move every byte of iov[0..count) at offset; resumes after short transfers. Returns the
 * bytes moved (fewer only at end of file for reads) or -errno. */
static long
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

static void
hash_regions(XXH3_state_t *state, const Py_buffer *buffers, Py_ssize_t from, Py_ssize_t to)
{
    for (Py_ssize_t i = from; i < to; i++) XXH3_128bits_update(state, buffers[i].buf, (size_t)buffers[i].len);
}

static uint64_t
payload_length(const Page *page)
{
    uint64_t total = 0;
    for (Py_ssize_t i = 1; i < page->count; i++) total += (uint64_t)page->buffers[i].len;
    return total;
}

/* Where a walk over a page's payload in pieces stands: a region, and bytes into it. */
typedef struct {
    Py_ssize_t region;
    size_t inside;
} Cursor;

/* The next piece of at most PIECE payload bytes from ``at`` as iov[0..*n); moves ``at``
 * past it and returns its size. */
static size_t
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
static long
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
static long
read_regions(int fd, Page *page, XXH3_state_t *state, int nowait)
{
    struct iovec iov[MAX_REGIONS];
    uint64_t total = (uint64_t)page->buffers[0].len + payload_length(page);
    if (state == NULL || page->direct || total <= 2 * (uint64_t)PIECE) {
        long moved = move_regions(fd, page, 0, nowait && !page->direct);
        if (moved != OK) return moved; /* WOULD_BLOCK: a thread waits for the disk */
        if (state != NULL) hash_regions(state, page->buffers, 1, page->count);
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

/* Whether the header in the page's slot is this store's envelope for the key and payload
 * (and, when digest is not NULL, whether the payload's checksum matches it). */
static int
header_valid(const Page *page, const unsigned char *static_fields, const unsigned char *digest)
{
    const unsigned char *slot = page->buffers[0].buf;
    if (page->buffers[0].len < HEADER_BYTES) return 0;
    if (memcmp(slot, static_fields, STATIC_BYTES) != 0) return 0;
    if (memcmp(slot + DIGEST_AT, page->key_digest, 16) != 0) return 0;
    if (get_le64(slot + LENGTH_AT) != payload_length(page)) return 0;
    if (XXH3_64bits(slot, BODY_BYTES) != get_le64(slot + BODY_BYTES)) return 0;
    if (digest != NULL && memcmp(slot + CHECKSUM_AT, digest, 16) != 0) return 0;
    return 1;
}

/* Open a page file for reading and take the readers' shared lock on it (flock): a writer
 * overwrites a page's file in place, or recycles a replaced page's file, only under an
 * exclusive lock, so a locked file does not change while it is read. Sets *fd and *info;
 * returns OK, ABSENT, NOT_REGULAR, BUSY or -errno. A file held by a writer was either
 * just replaced under its name (opened again, the name then holds the new page) or, when
 * the name still holds the same file, is being overwritten in place: that write is
 * waited out, for at most WRITER_WAIT_NS. */
static long
open_locked(const char *path, int flags, int *fd, struct stat *info)
{
    ino_t held = 0;
    for (int attempt = 0; attempt < 2; attempt++) {
        *fd = open(path, flags);
        if (*fd < 0) return (errno == ENOENT || errno == ENOTDIR) ? ABSENT : -errno;
        if (fstat(*fd, info) != 0) {
            long failed = -errno;
            close(*fd);
            return failed;
        }
        if (!S_ISREG(info->st_mode)) {
            close(*fd);
            return NOT_REGULAR;
        }
        if (flock(*fd, LOCK_SH | LOCK_NB) == 0 || errno != EWOULDBLOCK) return OK;
        if (attempt == 1 && info->st_ino == held) {
            for (long waited = 0; waited < WRITER_WAIT_NS; waited += WRITER_POLL_NS) {
                struct timespec pause = {0, WRITER_POLL_NS};
                nanosleep(&pause, NULL);
                if (flock(*fd, LOCK_SH | LOCK_NB) == 0 || errno != EWOULDBLOCK) return OK;
            }
        }
        held = info->st_ino;
        close(*fd); /* no locks on this filesystem: nothing there recycles either */
    }
    return BUSY;
}

static long
get_one(Page *page, XXH3_state_t *state, const unsigned char *static_fields, int full, int nowait)
{
    int flags = O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK;
    if (page->direct) flags |= O_DIRECT;
    int fd;
    struct stat info;
    long result = open_locked(page->path, flags, &fd, &info);
    if (result != OK) return result;
    if ((uint64_t)info.st_size != (uint64_t)page->buffers[0].len + payload_length(page)) {
        result = SIZE_MISMATCH;
    } else {
        int hashing = static_fields != NULL && full;
        if (hashing) XXH3_128bits_reset(state);
        result = read_regions(fd, page, hashing ? state : NULL, nowait);
        if (result == OK && static_fields != NULL) {
            unsigned char digest[16];
            if (hashing) canonical128(XXH3_128bits_digest(state), digest);
            if (!header_valid(page, static_fields, hashing ? digest : NULL)) {
                /* another page's bytes: was the file recycled before our lock was taken? */
                struct stat now;
                int moved = stat(page->path, &now) == 0 && now.st_ino != info.st_ino;
                result = moved ? REPLACED : UNVERIFIED;
            }
        }
    }
    close(fd);
    return result;
}

/* Write the envelope into the page's header slot, from the payload's hash in state. */
static void
fill_header(Page *page, XXH3_state_t *state, const unsigned char *static_fields)
{
    unsigned char *slot = page->buffers[0].buf;
    memcpy(slot, static_fields, STATIC_BYTES);
    memcpy(slot + DIGEST_AT, page->key_digest, 16);
    put_le64(slot + LENGTH_AT, payload_length(page));
    canonical128(XXH3_128bits_digest(state), slot + CHECKSUM_AT);
    put_le64(slot + BODY_BYTES, XXH3_64bits(slot, BODY_BYTES));
    memset(slot + HEADER_BYTES, 0, (size_t)page->buffers[0].len - HEADER_BYTES);
}

static void
write_header(Page *page, XXH3_state_t *state, const unsigned char *static_fields)
{
    XXH3_128bits_reset(state);
    hash_regions(state, page->buffers, 1, page->count);
    fill_header(page, state, static_fields);
}

/* Write a large page piece by piece, each hashed just before it is written (while it is
 * in cache), then its header slot, now that the checksum is known: one pass over the
 * page's memory instead of two. Returns the bytes written or -errno. */
static long
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
    fill_header(page, state, static_fields);
    struct iovec header = {page->buffers[0].buf, (size_t)page->buffers[0].len};
    long wrote = move_all(fd, &header, 1, 0, 1);
    return wrote < 0 ? wrote : (long)offset;
}

/* Create the two shard directories above path (0700) where they are missing; 0 when one
 * cannot be made (debris in the way: the caller's Python path repairs it). */
static int
make_shard_dirs(const char *path)
{
    char dir[PATH_MAX];
    size_t length = strlen(path);
    if (length >= sizeof dir) return 0;
    memcpy(dir, path, length + 1);
    char *leaf = strrchr(dir, '/');
    if (leaf == NULL) return 0;
    *leaf = '\0';
    char *top = strrchr(dir, '/');
    if (top == NULL) return 0;
    *top = '\0';
    if (mkdir(dir, 0700) != 0 && errno != EEXIST) return 0;
    *top = '/';
    if (mkdir(dir, 0700) != 0 && errno != EEXIST) return 0;
    return 1;
}

/* Whether kvtier may write into the file info describes: a regular file of this user's
 * with no other name. A second link (made by hand, or by a tool in the root) would carry
 * the next page's bytes to a name outside the store. */
static int
ours_alone(const struct stat *info)
{
    return S_ISREG(info->st_mode) && info->st_nlink == 1 && info->st_uid == geteuid();
}

/* Whether path (not followed) still names the file info describes. */
static int
names_file(const char *path, const struct stat *info)
{
    struct stat now;
    return lstat(path, &now) == 0 && now.st_dev == info->st_dev && now.st_ino == info->st_ino;
}

/* A replaced page's file, kept (under its temp name, exclusively locked) to be written
 * over in place by the next page of the same size: an overwrite then reuses the file's
 * page cache instead of allocating a new file's worth and freeing the old. */
typedef struct {
    int fd; /* -1: none */
    int direct;
    uint64_t size;
    char path[PATH_MAX];
} Spare;

/* Close the spare, unlinking its temp name only while that still names the spare's file
 * (an entry someone put under the name is left to the sweep, never removed blindly). */
static void
drop_spare(Spare *spare)
{
    if (spare->fd < 0) return;
    struct stat info;
    if (fstat(spare->fd, &info) == 0 && names_file(spare->path, &info)) unlink(spare->path);
    close(spare->fd);
    spare->fd = -1;
}

/* Keep the file an exchange just moved to ``path`` as the spare, if no reader holds it
 * (readers take a shared lock, so a reader that has it open keeps the old page whole) and
 * it is ours alone; otherwise unlink the name, as before recycling. 1 when kept, -1 when
 * refused for another link or owner (the caller counts it), 0 otherwise. */
static int
keep_spare(Spare *spare, const char *path, int direct)
{
    int flags = O_WRONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | (direct ? O_DIRECT : 0);
    int fd = open(path, flags);
    struct stat info;
    size_t length = strlen(path);
    int kept = 0;
    if (fd >= 0 && fstat(fd, &info) == 0 && !ours_alone(&info)) {
        kept = -1;
    } else if (fd >= 0 && length < sizeof spare->path && flock(fd, LOCK_EX | LOCK_NB) == 0 &&
               futimens(fd, NULL) == 0) {
        /* (its time is now's: a sweep must not take a live spare for a stale temp file) */
        drop_spare(spare);
        spare->fd = fd;
        spare->direct = direct;
        spare->size = (uint64_t)info.st_size;
        memcpy(spare->path, path, length + 1);
        return 1;
    }
    if (fd >= 0) close(fd);
    unlink(path);
    return kept;
}

/* The spare, if the next page may be written into it: of the page's size and kind, and
 * still ours alone (no link made since it was kept). A spare that is not is dropped:
 * page->refused set for another link or owner, nothing for a name that was removed.
 * Fills info on success. (Whether its temp name still names it is checked when it is
 * published.) */
static int
take_spare(Spare *spare, Page *page, uint64_t total, struct stat *info)
{
    if (spare->fd < 0 || spare->size != total || spare->direct != page->direct) return 0;
    int known = fstat(spare->fd, info) == 0;
    if (known && ours_alone(info)) return 1;
    if (known && info->st_nlink != 0) page->refused = 1;
    drop_spare(spare);
    return 0;
}

/* Overwrite a page's own file in place, without fsync: exclusively locked, so no reader
 * (readers take a shared lock first) sees a mix of the old and the new page, and with
 * its header first invalidated and written last, so a writer killed half-way leaves a
 * page every reader refuses, never a torn one that looks whole. IN_PLACE, or ABSENT when
 * there is no file of this size that is ours alone to overwrite or someone holds it (the
 * caller then publishes a new file, which leaves a reader its old one); -errno on a
 * failed write. */
static long
overwrite_in_place(Page *page, XXH3_state_t *state, const unsigned char *static_fields,
                   uint64_t total)
{
    int fd = open(page->final, O_WRONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) return ABSENT;
    struct stat info;
    static const unsigned char invalid[8] = {0}; /* no magic: refused by every reader */
    if (fstat(fd, &info) != 0) {
        close(fd);
        return ABSENT;
    }
    if (!ours_alone(&info) || flock(fd, LOCK_EX | LOCK_NB) != 0 || (uint64_t)info.st_size != total) {
        if (S_ISREG(info.st_mode) && !ours_alone(&info)) page->refused = 1;
        close(fd);
        return ABSENT;
    }
    long result = pwrite(fd, invalid, sizeof invalid, 0) == (ssize_t)sizeof invalid ? OK : -EIO;
    if (result == OK) {
        long wrote = write_streamed(fd, page, state, static_fields); /* header last */
        if (wrote < 0) result = wrote;
    }
    if (close(fd) != 0 && result == OK) result = -errno;
    return result == OK ? IN_PLACE : result;
}

/* Whether something other than a regular file holds path (no writer of pages puts one
 * there: after a rename of ours, it means another entry took our temp name). */
static int
not_a_file(const char *path)
{
    struct stat info;
    return lstat(path, &info) == 0 && !S_ISREG(info.st_mode);
}

/* Move the complete page under ``at`` (the file ``mine`` describes) to its final name:
 * by exchange where a page is there (the replaced file then becomes the spare), else by
 * rename. Only ``mine`` is published: TEMP_TAKEN, with nothing published, when another
 * entry holds the temp name before the move, or (taken in the moment between) when a
 * non-file holds the final name after it (an exchange is then undone). A regular file
 * slipped in within that moment would be published, and refused by its envelope. (After
 * the move the final name may hold another writer's newer page: that is no failure.) */
static long
publish_page(Page *page, const char *at, const struct stat *mine, int exchange, Spare *spare)
{
    if (!names_file(at, mine)) return TEMP_TAKEN;
    if (exchange &&
        syscall(SYS_renameat2, AT_FDCWD, at, AT_FDCWD, page->final, 2 /* RENAME_EXCHANGE */) == 0) {
        if (not_a_file(page->final)) { /* taken between the check and the exchange: undo */
            syscall(SYS_renameat2, AT_FDCWD, at, AT_FDCWD, page->final, 2);
            return TEMP_TAKEN;
        }
        struct stat old;
        if (lstat(at, &old) != 0) return OK;
        if (!S_ISREG(old.st_mode)) {
            if (at != page->path && rename(at, page->path) != 0) return OK; /* left as a temp */
            return REPLACED_DEBRIS;
        }
        if (keep_spare(spare, at, page->direct) < 0) page->refused = 1; /* the replaced file */
        return OK;
    }
    if (!exchange || errno == ENOENT) {
        struct stat there;
        if (!(lstat(page->final, &there) == 0 && !S_ISREG(there.st_mode)) && rename(at, page->final) == 0)
            return not_a_file(page->final) ? TEMP_TAKEN : OK;
    }
    /* not published: the bytes go to the page's own temp name, for Python's path */
    if (at != page->path && rename(at, page->path) != 0) {
        unlink(at);
        return -EIO;
    }
    return UNPUBLISHED;
}

static long
put_one(Page *page, XXH3_state_t *state, const unsigned char *static_fields, int datasync,
        int exchange, Spare *spare)
{
    uint64_t total = (uint64_t)page->buffers[0].len + payload_length(page);
    if (page->existing && static_fields != NULL && !datasync && !page->direct) {
        long result = overwrite_in_place(page, state, static_fields, total);
        if (result != ABSENT) return result;
    }
    int streamed = static_fields != NULL && !page->direct && total > 2 * (uint64_t)PIECE;
    if (static_fields != NULL && !streamed) write_header(page, state, static_fields);
    int fd;
    const char *at; /* where the bytes are written: the spare, or a fresh temp file */
    struct stat mine; /* the file written: only it may be published */
    int recycled = take_spare(spare, page, total, &mine);
    char spare_path[PATH_MAX];
    if (recycled) {
        fd = spare->fd; /* exclusively locked: no reader can be reading it */
        memcpy(spare_path, spare->path, sizeof spare_path);
        at = spare_path;
        spare->fd = -1;
    } else {
        int flags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC;
        if (page->direct) flags |= O_DIRECT;
        fd = open(page->path, flags, 0600);
        if (fd < 0 && errno == ENOENT && make_shard_dirs(page->path)) fd = open(page->path, flags, 0600);
        if (fd < 0) return -errno;
        if (fstat(fd, &mine) != 0) {
            long failed = -errno;
            close(fd);
            unlink(page->path);
            return failed;
        }
        at = page->path;
    }
    long wrote = streamed ? write_streamed(fd, page, state, static_fields)
                          : move_regions(fd, page, 1, 0);
    long failed = wrote < 0 ? wrote : 0;
    if (failed == 0 && datasync && fdatasync(fd) != 0) failed = -errno;
    if (!recycled && close(fd) != 0 && failed == 0) failed = -errno;
    if (failed != 0) {
        if (names_file(at, &mine)) unlink(at);
        if (recycled) close(fd);
        return failed;
    }
    /* From here the bytes are complete under ``at``; a recycled file is published while
     * still locked, and unlocked (closed) once its name is the page's. */
    long result = publish_page(page, at, &mine, exchange, spare);
    if (recycled) close(fd);
    if (result == OK && page->refused) return NOT_RECYCLED;
    return result;
}

/* The address of symbol name (preferring name + "_dispatch") in the library handle. */
static void *
find(void *library, const char *name)
{
    char dispatch[64];
    snprintf(dispatch, sizeof dispatch, "%s_dispatch", name);
    void *address = dlsym(library, dispatch);
    return address != NULL ? address : dlsym(library, name);
}

PyDoc_STRVAR(bind_doc,
"bind(path) -> bool\n\n"
"Take xxHash's functions from the shared object at path (already loaded or loadable).\n"
"False when it does not export them; read_pages/write_pages need a successful bind.");

static PyObject *
bind(PyObject *self, PyObject *arg)
{
    (void)self;
    PyObject *encoded = NULL;
    if (!PyUnicode_FSConverter(arg, &encoded)) return NULL;
    void *library = dlopen(PyBytes_AS_STRING(encoded), RTLD_NOW | RTLD_LOCAL);
    Py_DECREF(encoded);
    if (library == NULL) Py_RETURN_FALSE;
    void *create = dlsym(library, "XXH3_createState");
    void *free_state = dlsym(library, "XXH3_freeState");
    void *reset = dlsym(library, "XXH3_128bits_reset");
    void *update = find(library, "XXH3_128bits_update");
    void *digest = dlsym(library, "XXH3_128bits_digest");
    void *hash64 = find(library, "XXH3_64bits");
    if (!create || !free_state || !reset || !update || !digest || !hash64) {
        dlclose(library);
        Py_RETURN_FALSE;
    }
    /* the library stays loaded for the life of the process (its functions are kept) */
    *(void **)&xxh.create_state = create;
    *(void **)&xxh.free_state = free_state;
    *(void **)&xxh.reset = reset;
    *(void **)&xxh.update = update;
    *(void **)&xxh.digest = digest;
    *(void **)&xxh.hash64 = hash64;
    Py_RETURN_TRUE;
}

static int
bound(void)
{
    if (xxh.update != NULL) return 1;
    PyErr_SetString(PyExc_RuntimeError, "_pageio: call bind() with an xxHash library first");
    return 0;
}

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
    blake2b(page->key_digest, 16, (const unsigned char *)text, (size_t)length);
    if (names->stem == NULL) {
        page->path = copy_text(name, (size_t)size);
        return page->path != NULL;
    }
    page->final = copy_text(name, (size_t)size);
    if (page->final == NULL) return 0;
    char temp[PATH_MAX];
    size_t dir = names->store_length + 6; /* STORE/xx/yy */
    int written = snprintf(temp, sizeof temp, "%.*s/%s%llu.tmp", (int)dir, name, names->stem,
                           names->seq + (unsigned long long)index);
    if (written < 0 || (size_t)written >= sizeof temp) {
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
        PyObject *region = PyList_GET_ITEM(views, i);
        if (PyTuple_Check(region) && PyTuple_GET_SIZE(region) > 0) region = PyTuple_GET_ITEM(region, 0);
        if (PyObject_GetBuffer(region, &page->buffers[i], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0)
            return 0;
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
 * direct either one flag for every page or a list of one per page. */
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
        if (!name_page(page, names, PyList_GET_ITEM(keys, p), p)) goto fail;
        page->direct = direct_of(direct, p);
        if (page->direct < 0) goto fail;
    }
    *count_out = count;
    return pages;
fail:
    free_pages(pages, count);
    return NULL;
}

static int
static_arg(PyObject *value, const unsigned char **out)
{
    if (value == Py_None) {
        *out = NULL;
        return 1;
    }
    if (!PyBytes_Check(value) || PyBytes_GET_SIZE(value) != STATIC_BYTES) {
        PyErr_SetString(PyExc_TypeError, "_pageio: the static envelope fields are 56 bytes");
        return 0;
    }
    *out = (const unsigned char *)PyBytes_AS_STRING(value);
    return 1;
}

static PyObject *
results_list(const Page *pages, Py_ssize_t count)
{
    PyObject *out = PyList_New(count);
    if (out == NULL) return NULL;
    for (Py_ssize_t p = 0; p < count; p++) {
        PyObject *code = PyLong_FromLong(pages[p].result);
        if (code == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, p, code);
    }
    return out;
}

/* What both calls start with: xxHash bound, the static fields (56 bytes, or None: no
 * envelopes), the page table named from the store and keys, and a hash state. NULL,
 * with an exception set, when one is missing or malformed. */
static Page *
begin_call(PyObject *store, const char *stem, unsigned long long seq, PyObject *keys,
           PyObject *regions, PyObject *direct, PyObject *static_obj,
           const unsigned char **static_fields, Py_ssize_t *count, XXH3_state_t **state)
{
    if (!bound() || !static_arg(static_obj, static_fields)) return NULL;
    PyObject *encoded = NULL;
    if (!PyUnicode_FSConverter(store, &encoded)) return NULL;
    Names names = {PyBytes_AS_STRING(encoded), (size_t)PyBytes_GET_SIZE(encoded), stem, seq};
    Page *pages = load_pages(&names, keys, regions, direct, count);
    Py_DECREF(encoded);
    if (pages == NULL) return NULL;
    *state = XXH3_createState();
    if (*state == NULL) {
        free_pages(pages, *count);
        PyErr_NoMemory();
        return NULL;
    }
    return pages;
}

/* What both calls end with: the per-page codes as a list; the table and state freed. */
static PyObject *
end_call(Page *pages, Py_ssize_t count, XXH3_state_t *state)
{
    XXH3_freeState(state);
    PyObject *codes = results_list(pages, count);
    free_pages(pages, count);
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
        for (Py_ssize_t p = 0; p < count; p++) {
            Page *page = &pages[p];
            int flags = O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | (page->direct ? O_DIRECT : 0);
            struct stat info;
            page->result = open_locked(page->path, flags, &fds[p], &info);
            if (page->result != OK) {
                fds[p] = -1;
                continue;
            }
            if ((unsigned long long)info.st_size != sizes[p])
                page->result = SIZE_MISMATCH;
            else if (fcntl(fds[p], F_SETFL, page->direct ? O_DIRECT : 0) != 0)
                page->result = -errno; /* io_uring would honour O_NONBLOCK: EAGAIN, not a wait */
            if (page->result != OK) {
                close(fds[p]);
                fds[p] = -1;
            }
        }
        Py_END_ALLOW_THREADS
        codes = results_list(pages, count);
        out = codes == NULL ? NULL : PyList_New(count);
        for (Py_ssize_t p = 0; out != NULL && p < count; p++) {
            PyObject *fd = PyLong_FromLong(fds[p]);
            if (fd == NULL) {
                Py_CLEAR(out);
                break;
            }
            PyList_SET_ITEM(out, p, fd);
        }
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
    PyObject *out = named ? Py_BuildValue("(sy#)", page.path, page.key_digest, (Py_ssize_t)16) : NULL;
    PyMem_Free(page.path);
    return out;
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_O, bind_doc},
    {"name", name, METH_VARARGS, name_doc},
    {"open_pages", open_pages, METH_VARARGS, open_pages_doc},
    {"read_pages", read_pages, METH_VARARGS, read_pages_doc},
    {"write_pages", write_pages, METH_VARARGS, write_pages_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pageio",
    "The file backend's per-page loop (open, move, checksum, envelope) in compiled code.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__pageio(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    struct { const char *name; long value; } constants[] = {
        {"OK", OK}, {"ABSENT", ABSENT}, {"NOT_REGULAR", NOT_REGULAR},
        {"SIZE_MISMATCH", SIZE_MISMATCH}, {"SHORT_READ", SHORT_READ},
        {"UNVERIFIED", UNVERIFIED}, {"UNPUBLISHED", UNPUBLISHED},
        {"REPLACED_DEBRIS", REPLACED_DEBRIS}, {"WOULD_BLOCK", WOULD_BLOCK},
        {"BUSY", BUSY}, {"REPLACED", REPLACED}, {"IN_PLACE", IN_PLACE},
        {"NOT_RECYCLED", NOT_RECYCLED}, {"TEMP_TAKEN", TEMP_TAKEN},
        {"STATIC_BYTES", STATIC_BYTES},
        {"BODY_BYTES", BODY_BYTES}, {"HEADER_BYTES", HEADER_BYTES}, {"PIECE", PIECE},
        {"MAX_KEY_LENGTH", MAX_KEY_LENGTH}, {"WRITER_WAIT_NS", WRITER_WAIT_NS},
    };
    for (size_t i = 0; i < sizeof constants / sizeof constants[0]; i++) {
        if (PyModule_AddIntConstant(m, constants[i].name, constants[i].value) != 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
