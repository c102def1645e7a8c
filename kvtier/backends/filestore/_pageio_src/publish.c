/* Writing one page and publishing it, with the GIL released; and the publish protocol's
 * steps for every writer of pages where this module is built.
 *
 * The publish protocol is described once, in kvtier/backends/filestore/publish.py, and
 * its steps 2-5 are written here once, numbered as there (1 write, 2 check the temp
 * name, 3 move, 4 check the page's name, 5 drop or recycle the replaced file; step 6,
 * reporting, is Python's, from the codes): the compiled loop runs them for the pages it
 * writes (put_one), and publish_one for a page a backend's own loop wrote (the file
 * backend's Python loop, the io_uring ring). Python runs its own copy of the steps only
 * where this module is not built (or compiled_io is off). Besides a fresh temp file,
 * step 1 may write into a spare (a replaced page's file, recycled) or, without fsync,
 * into the page's own file in place under its exclusive lock. It never writes into a
 * file another name can reach. */
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

/* The leading bytes (at most SAME_PAGE_PREFIX) of the open file fd into out: how many,
 * or -1. */
static ssize_t
read_prefix(int fd, unsigned char *out)
{
    return pread(fd, out, SAME_PAGE_PREFIX, 0);
}

/* The file written, as step 4 needs it: its identity and its leading bytes, held in
 * memory (the compiled loop's header slot) or read, only when needed, from a descriptor
 * open on it. */
typedef struct {
    const struct stat *file;
    const unsigned char *prefix; /* SAME_PAGE_PREFIX bytes, or NULL: read them from fd */
    int fd;
} Written;

/* Whether path holds a page of the key that another writer published: a regular file
 * whose leading bytes (SAME_PAGE_PREFIX, or all of a shorter file) are the ones written:
 * with envelopes, this store's static fields, the key's digest and the payload's length. */
static int
page_of_key(const char *path, const Written *mine)
{
    unsigned char ours[SAME_PAGE_PREFIX], theirs[SAME_PAGE_PREFIX];
    ssize_t our_length = SAME_PAGE_PREFIX;
    const unsigned char *prefix = mine->prefix;
    if (prefix == NULL) {
        our_length = read_prefix(mine->fd, ours);
        if (our_length < 0) return 0;
        prefix = ours;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) return 0;
    struct stat info;
    int same = fstat(fd, &info) == 0 && S_ISREG(info.st_mode) &&
               read_prefix(fd, theirs) == our_length &&
               memcmp(theirs, prefix, (size_t)our_length) == 0;
    close(fd);
    return same;
}

/* Step 4: whether the page's name holds the file written, or a page of the key another
 * writer published over it in the moment since the move, or nothing (removed since, by
 * a delete or an eviction): then ours was published, no failure. */
static int
moved_in(const char *final, const Written *mine)
{
    struct stat now;
    if (lstat(final, &now) != 0) return 1;
    if (now.st_dev == mine->file->st_dev && now.st_ino == mine->file->st_ino) return 1;
    return S_ISREG(now.st_mode) && page_of_key(final, mine);
}

/* Steps 3 and 4 for the file written, complete under at: exchange it with what holds
 * the page's name (exchange set), or, where nothing is there (or exchange is not set),
 * rename it there; then check the page's name. OK, *exchanged set when the replaced entry
 * is now under at; TEMP_TAKEN (another entry was moved: an exchange is undone, after a
 * rename the entry is left, as publish.py explains); or, with nothing moved, IN_THE_WAY
 * (a non-file holds the page's name, for a rename), NO_EXCHANGE (this kernel or
 * filesystem cannot exchange) or -errno. */
static long
move_checked(const char *at, const char *final, const Written *mine, int exchange, int *exchanged)
{
    *exchanged = 0;
    if (exchange) {
        if (exchange_names(at, final) == 0) {
            if (!moved_in(final, mine)) {
                exchange_names(at, final); /* undone: what was there is back */
                return TEMP_TAKEN;
            }
            *exchanged = 1;
            return OK;
        }
        if (errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP) return NO_EXCHANGE;
        if (errno != ENOENT) return -errno;
    }
    /* a rename replaces a symlink or FIFO silently and fails on a directory: whatever
     * non-file holds the name is the caller's to remove (and count) first */
    struct stat there;
    if (lstat(final, &there) == 0 && !S_ISREG(there.st_mode)) return IN_THE_WAY;
    if (rename(at, final) != 0)
        return errno == EISDIR || errno == ENOTEMPTY || errno == EEXIST ? IN_THE_WAY : -errno;
    return moved_in(final, mine) ? OK : TEMP_TAKEN;
}

/* Steps 2-5 of the protocol (kvtier/backends/filestore/publish.py) for the compiled
 * loop's complete page under at (the file mine describes; the page's header slot holds
 * its leading bytes): only mine is published (TEMP_TAKEN otherwise). After an exchange,
 * the replaced page's file becomes the spare; a non-file the exchange moved out goes to
 * the page's temp name (REPLACED_DEBRIS, for Python to remove as debris). A page this
 * loop does not publish (a non-file in the way of a rename, no exchange here, a failed
 * move) goes back to its own temp name: UNPUBLISHED, for FileStore.publish_page, which
 * removes the debris and runs the same steps (publish_one). */
static long
publish_page(Page *page, const char *at, const struct stat *mine, int exchange, Spare *spare)
{
    if (!names_file(at, mine)) return TEMP_TAKEN; /* step 2 */
    Written written = {mine, page->buffers[0].buf, -1};
    int exchanged;
    long moved = move_checked(at, page->final, &written, exchange, &exchanged); /* steps 3-4 */
    if (moved == OK && exchanged) {
        struct stat old; /* step 5: what the exchange moved under the temp name */
        if (lstat(at, &old) != 0) return OK;
        if (!S_ISREG(old.st_mode)) {
            if (at != page->path && rename(at, page->path) != 0) return OK; /* left as a temp */
            return REPLACED_DEBRIS; /* Python removes it as debris */
        }
        if (keep_spare(spare, at, page->direct) < 0) page->refused = 1; /* the replaced file */
        return OK;
    }
    if (moved == OK || moved == TEMP_TAKEN) return moved;
    /* not published: the bytes go to the page's own temp name, for Python's path */
    if (at != page->path && rename(at, page->path) != 0) {
        unlink(at);
        return -EIO;
    }
    return UNPUBLISHED;
}

/* Steps 2-5 for a page file a backend's own loop wrote under tmp (written: its identity
 * from step 1, or NULL to publish the regular file found there). Step 2 opens the temp
 * name (not followed, never blocking), so step 4 can read the leading bytes of the file
 * written even once another writer has replaced it. After an exchange the replaced page
 * file is unlinked (a non-file: REPLACED_DEBRIS, left under tmp for the caller to remove
 * as debris). The codes of move_checked, or REPLACED_DEBRIS. */
long
publish_one(const char *tmp, const char *final, const struct stat *written, int exchange)
{
    struct stat mine;
    int fd = open(tmp, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) { /* (a file of ours that cannot be opened is a failure, not a taken name) */
        int failed = errno;
        int ours = lstat(tmp, &mine) == 0 && S_ISREG(mine.st_mode) &&
                   (written == NULL ||
                    (mine.st_dev == written->st_dev && mine.st_ino == written->st_ino));
        return ours ? -failed : TEMP_TAKEN;
    }
    if (fstat(fd, &mine) != 0) {
        long failed = -errno;
        close(fd);
        return failed;
    }
    if (!S_ISREG(mine.st_mode) ||
        (written != NULL && (mine.st_dev != written->st_dev || mine.st_ino != written->st_ino))) {
        close(fd); /* step 2: another entry holds the temp name; left to the sweep */
        return TEMP_TAKEN;
    }
    Written found = {&mine, NULL, fd};
    int exchanged;
    long moved = move_checked(tmp, final, &found, exchange, &exchanged); /* steps 3-4 */
    close(fd);
    if (moved != OK || !exchanged) return moved;
    struct stat old; /* step 5: what the exchange moved under the temp name */
    if (lstat(tmp, &old) != 0) return OK;
    if (!S_ISREG(old.st_mode)) return REPLACED_DEBRIS;
    unlink(tmp);
    return OK;
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
    /* Step 1: write the page under a temp name, into the spare or a fresh file: its
     * envelope first (the payload hashed in one pass, which leaves it in cache), then
     * every region in one call from offset 0, so the page cache holds the file in large
     * folios (written piece by piece at the header's offset it would hold small ones,
     * and every read of the page would cost more). */
    if (static_fields != NULL)
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
    long wrote = move_regions(fd, page, 1, 0);
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
    long result = publish_page(page, at, &mine, exchange, spare);
    if (recycled) close(fd);
    if (result == OK && page->refused) return NOT_RECYCLED;
    return result;
}
