/* Reading one page: opened without following a symlink or blocking on a FIFO, under the
 * readers' shared lock, sized, read into its regions and its envelope checked. */
#include "pageio.h"

/* Open a page file for reading and take the readers' shared lock on it (flock): a writer
 * overwrites a page's file in place, or recycles a replaced page's file, only under an
 * exclusive lock, so a locked file does not change while it is read. Sets *fd and *info;
 * returns OK, ABSENT, NOT_REGULAR, BUSY or -errno. A file held by a writer was either
 * just replaced under its name (opened again, the name then holds the new page) or, when
 * the name still holds the same file, is being overwritten in place: that write is
 * waited out, for at most WRITER_WAIT_NS. */
long
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

/* Read one page's file into its regions; with static_fields, check its envelope (the
 * payload's checksum too when full). OK, UNVERIFIED, REPLACED, or why it was not read. */
long
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
            PayloadCheck payload = hashing ? PAYLOAD_HASHED : PAYLOAD_UNCHECKED;
            if (envelope_verdict(page->buffers, page->count, page->key_digest, static_fields,
                                 state, payload) != VALID) {
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

/* Open a page for a read elsewhere (an io_uring, which would honour O_NONBLOCK: EAGAIN,
 * not a wait): locked, of size bytes, O_NONBLOCK cleared. OK with *fd open, or why not
 * with *fd -1. */
long
open_one(Page *page, unsigned long long size, int *fd)
{
    int flags = O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | (page->direct ? O_DIRECT : 0);
    struct stat info;
    long result = open_locked(page->path, flags, fd, &info);
    if (result != OK) {
        *fd = -1;
        return result;
    }
    if ((unsigned long long)info.st_size != size)
        result = SIZE_MISMATCH;
    else if (fcntl(*fd, F_SETFL, page->direct ? O_DIRECT : 0) != 0)
        result = -errno;
    if (result != OK) {
        close(*fd);
        *fd = -1;
    }
    return result;
}
