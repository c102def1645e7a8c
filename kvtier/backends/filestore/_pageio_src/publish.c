/* Writing one page and publishing it, with the GIL released.
 *
 * The publish protocol is described once, in kvtier/backends/filestore/publish.py; the
 * Python loop and the io_uring ring run it with the Python steps there, and this file
 * runs the same steps in C, numbered as there (1 write, 2 check the temp name, 3 move,
 * 4 check the page's name, 5 drop or recycle the replaced file; step 6, reporting, is
 * Python's, from the codes). Besides a fresh temp file, step 1 may write into a spare
 * (a replaced page's file, recycled) or, without fsync, into the page's own file in
 * place under its exclusive lock. It never writes into a file another name can reach. */
#include "pageio.h"

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

/* Close the spare, unlinking its temp name only while that still names the spare's file
 * (an entry someone put under the name is left to the sweep, never removed blindly). */
void
drop_spare(Spare *spare)
{
    if (spare->fd < 0) return;
    struct stat info;
    if (fstat(spare->fd, &info) == 0 && names_file(spare->path, &info)) unlink(spare->path);
    close(spare->fd);
    spare->fd = -1;
}

/* Step 5 for a replaced page file: keep the file an exchange just moved to ``path`` as the
 * spare, if no reader holds it (readers take a shared lock, so a reader that has it open
 * keeps the old page whole) and it is ours alone; otherwise unlink the name, as without
 * recycling. 1 when kept, -1 when refused for another link or owner (the caller counts
 * it), 0 otherwise. */
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

/* Swap the two names atomically: renameat2(RENAME_EXCHANGE), through glibc's wrapper
 * where it has one (2.28 and later: the same call an interposed renameat2 sees), else
 * the system call. 0, or -1 with errno. */
static int
exchange_names(const char *one, const char *other)
{
#ifdef RENAME_EXCHANGE
    return renameat2(AT_FDCWD, one, AT_FDCWD, other, RENAME_EXCHANGE);
#else
    return (int)syscall(SYS_renameat2, AT_FDCWD, one, AT_FDCWD, other, 2 /* RENAME_EXCHANGE */);
#endif
}

/* Whether path holds a page of this key that another writer published: a regular file
 * whose envelope starts as the one written into the page's header slot (this store's
 * static fields, the key's digest, the payload's length). Only with envelopes. */
static int
page_of_key(const char *path, const Page *page, int enveloped)
{
    if (!enveloped) return 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) return 0;
    unsigned char head[PAYLOAD_CHECKSUM_AT];
    struct stat info;
    int same = fstat(fd, &info) == 0 && S_ISREG(info.st_mode) &&
               pread(fd, head, sizeof head, 0) == (ssize_t)sizeof head &&
               memcmp(head, page->buffers[0].buf, sizeof head) == 0;
    close(fd);
    return same;
}

/* Step 4: whether the page's name holds the file written (mine), or a page of the key
 * another writer published over it in the moment since the move, or nothing (removed
 * since, by a delete or an eviction): then ours was published, no failure. */
static int
moved_in(const Page *page, const struct stat *mine, int enveloped)
{
    struct stat now;
    if (lstat(page->final, &now) != 0) return 1;
    if (now.st_dev == mine->st_dev && now.st_ino == mine->st_ino) return 1;
    return S_ISREG(now.st_mode) && page_of_key(page->final, page, enveloped);
}

/* Steps 2-5 of the protocol (kvtier/backends/filestore/publish.py) for the complete page
 * under ``at`` (the file ``mine`` describes): by exchange where a page is there (the
 * replaced file then becomes the spare), else by rename. Only ``mine`` is published:
 * TEMP_TAKEN, with nothing of ours published, when another entry holds the temp name
 * before the move (step 2), or when after it the page's name holds neither ``mine`` nor
 * another writer's page of the key (step 4: another entry took the temp name between
 * the check and the move; an exchange is then undone, and after a rename the entry is
 * left under the page's name, as publish.py explains). A page this loop does not publish
 * (a non-file under the final name, which Python removes as debris) goes back to its own
 * temp name: UNPUBLISHED, for FileStore.publish_page to run the same steps in Python. */
static long
publish_page(Page *page, const char *at, const struct stat *mine, int exchange, int enveloped,
             Spare *spare)
{
    if (!names_file(at, mine)) return TEMP_TAKEN; /* step 2 */
    if (exchange && exchange_names(at, page->final) == 0) { /* step 3: the exchange */
        if (!moved_in(page, mine, enveloped)) { /* step 4: taken before the exchange */
            exchange_names(at, page->final); /* undone: the old page is back */
            return TEMP_TAKEN;
        }
        struct stat old; /* step 5: what the exchange moved under the temp name */
        if (lstat(at, &old) != 0) return OK;
        if (!S_ISREG(old.st_mode)) {
            if (at != page->path && rename(at, page->path) != 0) return OK; /* left as a temp */
            return REPLACED_DEBRIS; /* Python removes it as debris */
        }
        if (keep_spare(spare, at, page->direct) < 0) page->refused = 1; /* the replaced file */
        return OK;
    }
    if (!exchange || errno == ENOENT) { /* step 3: a rename, where no non-file is in the way */
        struct stat there;
        if (!(lstat(page->final, &there) == 0 && !S_ISREG(there.st_mode)) && rename(at, page->final) == 0)
            return moved_in(page, mine, enveloped) ? OK : TEMP_TAKEN; /* step 4 */
    }
    /* not published: the bytes go to the page's own temp name, for Python's path */
    if (at != page->path && rename(at, page->path) != 0) {
        unlink(at);
        return -EIO;
    }
    return UNPUBLISHED;
}

/* Write one page and publish it: a code (OK, IN_PLACE, NOT_RECYCLED, REPLACED_DEBRIS,
 * UNPUBLISHED, TEMP_TAKEN) or -errno of the step that failed, its temp file removed. */
long
put_one(Page *page, XXH3_state_t *state, const unsigned char *static_fields, int datasync,
        int exchange, Spare *spare)
{
    uint64_t total = (uint64_t)page->buffers[0].len + payload_length(page);
    if (page->existing && static_fields != NULL && !datasync && !page->direct) {
        long result = overwrite_in_place(page, state, static_fields, total);
        if (result != ABSENT) return result;
    }
    /* Step 1: write the page under a temp name, into the spare or a fresh file. */
    int streamed = static_fields != NULL && !page->direct && total > 2 * (uint64_t)PIECE;
    if (static_fields != NULL && !streamed)
        envelope_write(page->buffers, page->count, page->key_digest, state, static_fields);
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
    /* From here the bytes are complete under ``at`` (steps 2-5 follow); a recycled file is
     * published while still locked, and unlocked (closed) once its name is the page's. */
    long result = publish_page(page, at, &mine, exchange, static_fields != NULL, spare);
    if (recycled) close(fd);
    if (result == OK && page->refused) return NOT_RECYCLED;
    return result;
}
