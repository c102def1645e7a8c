"""The segment backend's compiled data path: ``_pageio.segment_write`` and ``segment_read``.

One call writes a record's pages back to back with their envelopes, each page hashed
just before its bytes are copied; one call reads a slice of a batch, pages that lie
close together in a segment (a record header apart at most) in one ``preadv``, each
page's envelope checked right after it lands. Both release the GIL. The module is the
file backends' (:mod:`~kvtier.backends.filestore.extension`); without it, or with
``compiled_io`` off, the backend moves the same bytes in Python.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.backends.filestore import extension
from kvtier.core.envelope import BatchEnvelope

__all__ = [
    "OK",
    "SHORT_READ",
    "UNVERIFIED",
    "WOULD_BLOCK",
    "BatchRead",
    "available",
    "read",
    "write",
]

_pageio: Any = extension.pageio if hasattr(extension.pageio, "segment_write") else None

#: ``read`` codes: the envelope is valid; filled, but the core must explain its verdict;
#: the file ended before the page did; not (all) in the page cache (``nowait``).
OK, UNVERIFIED, SHORT_READ, WOULD_BLOCK = (
    (0, 5, 4, 8)
    if _pageio is None
    else (_pageio.OK, _pageio.UNVERIFIED, _pageio.SHORT_READ, _pageio.WOULD_BLOCK)
)


_NO_NOWAIT = -errno.EOPNOTSUPP
_NOT_READ = (WOULD_BLOCK, _NO_NOWAIT)


def available() -> bool:
    """Whether the compiled data path was built and loads."""
    return _pageio is not None


def write(
    fd: int, offset: int, keys: Sequence[str], pages: list[list[memoryview]], static: bytes
) -> None:
    """Write ``pages`` back to back from ``offset``, each with its key's envelope; raise
    the ``OSError`` of a failed write (the record is then not published)."""
    wrote = _pageio.segment_write(fd, offset, list(keys), pages, static)
    if wrote < 0:
        raise OSError(-wrote, os.strerror(-wrote))


def read(
    fds: list[int],
    offsets: list[int],
    keys: list[str],
    pages: list[list[memoryview]],
    static: bytes,
    *,
    full: bool,
    nowait: bool,
) -> tuple[list[int], int]:
    """Read page ``i`` from ``fds[i]`` at ``offsets[i]`` (in file order) and check its
    envelope: one code per page (the constants above, or ``-errno``), and the reads made."""
    codes, reads = _pageio.segment_read(fds, offsets, keys, pages, static, full, nowait)
    return codes, reads


class BatchRead:
    """One get's located pages through :func:`read`: ordered by segment and offset, a
    page-cache pass on a few threads, then what would wait for the disk on every thread.

    ``fds``, ``offsets`` and ``which`` (the batch index of each page) are in file order;
    ``codes`` ends with one :func:`read` code per page, ``reads`` with the reads made.
    """

    def __init__(
        self,
        keys: Sequence[str],
        views: list[list[memoryview]],
        located: list[tuple[int, int, int]],
        envelope: BatchEnvelope,
    ) -> None:
        located.sort(key=lambda item: (item[1], item[2]))
        self.which = [i for i, _fd, _offset in located]
        self.fds = [fd for _i, fd, _offset in located]
        self.offsets = [offset for _i, _fd, offset in located]
        self.keys = [keys[i] for i in self.which]
        self.views = [views[i] for i in self.which]
        self.envelope = envelope
        self.codes = [WOULD_BLOCK] * len(located)
        self._reads: list[int] = []

    @property
    def reads(self) -> int:
        """The reads made so far."""
        return sum(self._reads)

    def run(
        self,
        spread: Callable[[Callable[[int, int], list[int]], int, int], list[int]],
        threads: int,
        nowait: bool,
        only: list[int] | None = None,
    ) -> None:
        """Read the pages (``only``: these positions) in slices over ``threads``."""
        chosen = list(range(len(self.which))) if only is None else only
        static, full = self.envelope.static, self.envelope.full

        def work(lo: int, hi: int) -> list[int]:
            part = chosen[lo:hi]
            codes, reads = read(
                [self.fds[j] for j in part],
                [self.offsets[j] for j in part],
                [self.keys[j] for j in part],
                [self.views[j] for j in part],
                static,
                full=full,
                nowait=nowait,
            )
            for j, code in zip(part, codes, strict=True):
                self.codes[j] = code
            self._reads.append(reads)
            return []

        spread(work, len(chosen), threads)

    def blocked(self) -> list[int]:
        """Positions the page-cache pass left for a blocking read (those it could not
        try, where the filesystem has no page-cache-only reads, too)."""
        return [j for j, code in enumerate(self.codes) if code in _NOT_READ]

    def nowait_refused(self) -> bool:
        """Whether the filesystem refused a page-cache-only read (``RWF_NOWAIT``)."""
        return _NO_NOWAIT in self.codes
