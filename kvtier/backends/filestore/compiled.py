"""The file backends' compiled per-page loop (``_pageio``), and what its codes mean here.

``_pageio`` is a small C extension, compiled from ``_pageio_src/`` with the package where
a C compiler and Python's headers are there, and loaded by
:mod:`~kvtier.backends.filestore.extension`. One call
moves one I/O thread's slice of a batch with the GIL released: open,
``preadv``/``pwritev`` straight between the file and the page's regions, the payload
checksum while the bytes are in cache, the envelope check or write, close, and for a put
the publish protocol of :mod:`~kvtier.backends.filestore.publish`. Python keeps the
index, the counters and every rare case (debris, errors), which this module turns the
codes into. The envelope code is the core's (``kvtier/_csrc/envelope.c``, compiled into
both extensions). Without the extension, or with one built for another envelope layout
than :mod:`kvtier.core.envelope_layout` declares, the backend runs its own loop: same
files, same answers, more microseconds per page.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.backends.filestore import extension, paths
from kvtier.backends.filestore import publish as protocol
from kvtier.backends.filestore.slices import copy_threads
from kvtier.backends.filestore.store import NOT_A_PAGE, FileStore
from kvtier.core.envelope import BatchEnvelope
from kvtier.core.storage import PageBuffers

__all__ = [
    "BLOCKED",
    "MISSING",
    "Spare",
    "Spares",
    "available",
    "drop_spare",
    "open_pages",
    "read_cached",
    "read_slice",
    "write_slice",
]

#: A replaced page's file kept for the next overwrite of that size, exclusively locked:
#: (descriptor, path, size, O_DIRECT). See ``write_slice``.
Spare = tuple[int, bytes, int, bool]

#: The compiled module, or None where it is not used (then MISSING says why).
_pageio: Any = extension.pageio
MISSING: str | None = extension.MISSING


#: ``write_pages`` codes of a page it published itself.
_PUBLISHED = (
    frozenset() if _pageio is None else {_pageio.OK, _pageio.IN_PLACE, _pageio.NOT_RECYCLED}
)


def available() -> bool:
    """Whether the compiled per-page loop was built and loads."""
    return _pageio is not None


def _nbytes(page: PageBuffers) -> int:
    total = 0
    for extent in page:
        total += extent.length
    return total


#: ``read_slice``'s size for a page left alone by a ``nowait`` pass (not in the page cache).
BLOCKED = -1


def read_slice(
    fs: FileStore,
    keys: Sequence[str],
    pages: Sequence[PageBuffers],
    which: Sequence[int],
    envelope: BatchEnvelope,
    on_filled: Callable[[int], object] | None,
    *,
    nowait: bool = False,
) -> list[int]:
    """Read pages ``which`` (keys already checked) and check their envelopes in C.

    Returns the bytes read per page (0: a counted miss or failure). A valid page's index
    goes into ``envelope.valid``; a filled page whose envelope did not check out is handed
    to ``on_filled`` (the core then says why it is rejected). ``nowait`` reads only
    what the page cache holds: a page that would wait for the disk is :data:`BLOCKED`,
    untouched and uncounted, for a blocking read on an I/O thread.
    """
    assert _pageio is not None
    chosen = [pages[i] for i in which]
    codes = _pageio.read_pages(
        fs.path_str,
        [keys[i] for i in which],
        chosen,
        _direct(fs, chosen),
        envelope.static,
        envelope.full,
        nowait,
    )
    sizes: list[int] = []
    valid = envelope.valid
    ok, would_block, unverified = _pageio.OK, _pageio.WOULD_BLOCK, _pageio.UNVERIFIED
    for j, code in enumerate(codes):
        i = which[j]
        if code == ok:
            valid.append(i)
            sizes.append(_nbytes(chosen[j]))
        elif code == would_block:
            sizes.append(BLOCKED)
        elif code == unverified:
            if on_filled is not None:
                on_filled(i)
            sizes.append(_nbytes(chosen[j]))
        else:
            _read_failed(fs, keys[i], paths.page_path_unchecked(fs.path_str, keys[i]), code)
            sizes.append(0)
    return sizes


def open_pages(
    fs: FileStore, keys: Sequence[str], pages: Sequence[PageBuffers], direct: list[bool]
) -> list[int]:
    """Open the pages of ``keys`` (already checked) for reads elsewhere, in one C call.

    Each descriptor holds the readers' shared lock on a regular file of its page's size,
    ``O_NONBLOCK`` cleared (an io_uring honours it), opened with ``O_DIRECT`` where
    ``direct`` says; -1 for a page that is not there or cannot be read, counted (and
    repaired) as :func:`read_slice` counts it. The caller closes the descriptors.
    """
    assert _pageio is not None
    sizes = [_nbytes(page) for page in pages]
    fds, codes = _pageio.open_pages(fs.path_str, list(keys), sizes, direct)
    for key, code in zip(keys, codes, strict=True):
        if code != _pageio.OK:
            _read_failed(fs, key, paths.page_path_unchecked(fs.path_str, key), code)
    return list(fds)


def read_cached(
    spread: Callable[[Callable[[int, int], list[int]], int, int], list[int]],
    fs: FileStore,
    keys: Sequence[str],
    pages: Sequence[PageBuffers],
    envelope: BatchEnvelope,
    on_filled: Callable[[int], object] | None,
) -> list[int]:
    """The page-cache pass over a whole batch: :func:`read_slice` with ``nowait`` on the
    slices ``spread`` hands out, at most :func:`~kvtier.backends.filestore.slices.copy_threads`
    of them. Pages that would wait for the disk come back :data:`BLOCKED`; the pass has
    started their readahead, so a blocking read that follows finds the I/O under way."""
    return spread(
        lambda lo, hi: read_slice(fs, keys, pages, range(lo, hi), envelope, on_filled, nowait=True),
        len(keys),
        copy_threads(pages),
    )


def _direct(fs: FileStore, pages: list[PageBuffers]) -> bool | list[bool]:
    """The compiled loop's O_DIRECT flags: one for all pages, or one per page."""
    if not fs.o_direct:
        return False
    return [fs.direct_for(page) for page in pages]


def _read_failed(fs: FileStore, key: str, path: str, code: int) -> None:
    """Count (and where needed repair) one page the compiled loop could not read."""
    assert _pageio is not None
    if code == _pageio.ABSENT:
        fs.page_gone(key)
    elif code == _pageio.NOT_REGULAR:
        fs.not_a_page(key, path)
    elif code == _pageio.SIZE_MISMATCH:
        fs.counters.add("get_size_mismatch")
    elif code == _pageio.SHORT_READ:
        fs.counters.add("get_short_reads")
    elif code == _pageio.BUSY:
        fs.counters.add("get_busy")  # a writer held it twice in a row: recycling it
    elif code == _pageio.REPLACED:
        fs.counters.add("get_replaced")  # recycled for another page while being opened
    elif -code in NOT_A_PAGE and fs.not_a_page(key, path):
        pass
    else:
        fs.warn_once(
            "get_errors", "%s backend: reading %s: %s", fs.backend, path, os.strerror(-code)
        )


def write_slice(
    fs: FileStore,
    keys: Sequence[str],
    pages: Sequence[PageBuffers],
    lo: int,
    hi: int,
    envelope: BatchEnvelope,
    *,
    datasync: bool,
    publish: Callable[[int, str, str, int], bool],
    fallback: Callable[[int], bool],
    spares: Spares,
) -> list[bool]:
    """Write and publish pages ``lo..hi`` (keys already checked), envelopes written in C.

    ``publish(i, tmp, final, nbytes)`` publishes a page the compiled loop wrote but left
    under its temp name (something other than a page held the name); ``fallback(i)``
    puts page ``i`` through the Python loop after the compiled one failed before
    publishing (it repairs what it can: debris shard directories, stale temp names).

    Without ``datasync``, an overwrite of an indexed page of the same size goes into the
    page's own file, in place, under an exclusive lock (readers take a shared one), its
    header invalidated first and written last (counted ``puts_in_place``). Otherwise, and
    when a reader holds the file, overwrites recycle: the file a replaced page leaves
    (after the exchange) is kept, exclusively locked, and the next page of its size is
    written into it in place and exchanged in turn, so an overwrite reuses page cache
    instead of allocating a new file. A file a reader holds is unlinked instead, so the
    reader keeps the whole old page. The spare left is kept in ``spares`` for this
    thread's next call.
    """
    assert _pageio is not None
    results = [False] * (hi - lo)
    todo: list[int] = []
    sizes: list[int] = []
    index = fs.index
    wanted = [(keys[i], _nbytes(pages[i])) for i in range(lo, hi)]
    for i, (_key, nbytes), refused in zip(
        range(lo, hi), wanted, index.reserve_many(wanted), strict=True
    ):
        if refused is not None:
            fs.counters.add(f"put_failed_{refused}")
            continue
        todo.append(i)
        sizes.append(nbytes)
    if not todo:
        return results
    chosen = [pages[i] for i in todo]
    chosen_keys = [keys[i] for i in todo]
    stem, first = paths.temp_names(len(todo))
    spare = spares.take()
    try:
        codes, spare = _pageio.write_pages(
            fs.path_str,
            chosen_keys,
            stem,
            first,
            chosen,
            _direct(fs, chosen),
            envelope.static,
            datasync,
            protocol.exchange_supported(),
            spare,
            index.indexed(chosen_keys),
        )
    except BaseException:
        for nbytes in sizes:
            index.release(nbytes)
        drop_spare(spare)
        raise
    spares.keep(spare)
    in_place = not_recycled = 0
    published: list[tuple[str, int]] = []
    rest: list[int] = []  # pages the compiled loop did not publish itself
    for j, code in enumerate(codes):
        if code in _PUBLISHED:
            in_place += code == _pageio.IN_PLACE
            not_recycled += code == _pageio.NOT_RECYCLED
            published.append((keys[todo[j]], sizes[j]))
            results[todo[j] - lo] = True
        else:
            rest.append(j)
    index.commit_many(published)
    fs.counters.add("puts_in_place", in_place)
    if not_recycled:
        fs.counters.add("recycle_refused", not_recycled)
    fs.counters.add("puts", len(published))
    fs.counters.add("bytes_written", sum(nbytes for _key, nbytes in published))
    for j in rest:
        i, nbytes, code = todo[j], sizes[j], codes[j]
        final = paths.page_path_unchecked(fs.path_str, keys[i])
        tmp = f"{os.path.dirname(final)}/{stem}{first + j}{paths.TEMP_SUFFIX}"
        if code == _pageio.REPLACED_DEBRIS:  # published; the exchange moved a non-page out
            protocol.drop_replaced(tmp, fs.debris)  # (steps 5 and 6 of the protocol)
            fs.committed(keys[i], nbytes)
            results[i - lo] = True
        elif code == _pageio.UNPUBLISHED:
            results[i - lo] = publish(i, tmp, final, nbytes)
        else:  # nothing was published and the temp file is gone: the Python loop retries
            if code == _pageio.TEMP_TAKEN:  # another entry took the temp name (debris)
                fs.temp_taken(nbytes)
            else:
                index.release(nbytes)
            results[i - lo] = fallback(i)
    return results


class Spares:
    """The spare file of each writing thread (see :func:`write_slice`), until ``close``.

    Spares belong to the process that made them: a forked child inherits the descriptors
    (and so the locks) but must never write into its parent's spares, so it starts with
    none and leaves the parent's alone.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_thread: dict[int, Spare] = {}
        self._closed = False
        self._pid = os.getpid()

    def take(self) -> Spare | None:
        """This thread's spare, now the caller's (None when it has none)."""
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's spares are not ours
                self._by_thread, self._pid = {}, os.getpid()
            return self._by_thread.pop(threading.get_ident(), None)

    def keep(self, spare: Spare | None) -> None:
        """Keep ``spare`` for this thread's next call (dropped once closed)."""
        if spare is None:
            return
        with self._lock:
            if not self._closed:
                self._by_thread[threading.get_ident()] = spare
                return
        drop_spare(spare)

    def close(self) -> None:
        """Unlink and close every spare; later ones are dropped as they come back."""
        with self._lock:
            self._closed = True
            left, self._by_thread = list(self._by_thread.values()), {}
            if self._pid != os.getpid():  # a forked child: only close its copies
                left = [(fd, b"", size, direct) for fd, _path, size, direct in left]
        for spare in left:
            drop_spare(spare)


def drop_spare(spare: Spare | None) -> None:
    """Unlink and close a spare file (nothing when ``spare`` is None)."""
    if spare is None:
        return
    fd, path, _size, _direct = spare
    if path:
        with contextlib.suppress(OSError):
            os.unlink(path)
    with contextlib.suppress(OSError):
        os.close(fd)
