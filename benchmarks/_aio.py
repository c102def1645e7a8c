"""Raw POSIX AIO through glibc (``lio_listio``), the benchmarks' strongest raw side.

NVIDIA NIXL's POSIX backend moves pages with POSIX AIO: glibc runs each request on a
pool of its own threads (``aio_init``'s ``aio_threads``), one ``pread``/``pwrite`` each,
with no GIL and no Python between requests. :class:`PosixAio` does the same for a batch
of one-file-per-page pages: every region of every page is one request, the whole batch
one ``lio_listio(LIO_WAIT)``. Only the open and close of each file are Python's (as they
are the caller's with NIXL, which takes descriptors).

Linux with glibc on a 64-bit ABI only (``struct aiocb`` is laid out here by hand);
:func:`available` says whether it loads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Sequence

__all__ = ["PosixAio", "available"]

_LIO_READ, _LIO_WRITE, _LIO_WAIT, _SIGEV_NONE = 0, 1, 0, 1


class _Aiocb(ctypes.Structure):
    """glibc's ``struct aiocb`` (= ``aiocb64`` on 64-bit ABIs): 168 bytes."""

    _fields_ = (
        ("aio_fildes", ctypes.c_int),
        ("aio_lio_opcode", ctypes.c_int),
        ("aio_reqprio", ctypes.c_int),
        ("_pad", ctypes.c_int),
        ("aio_buf", ctypes.c_void_p),
        ("aio_nbytes", ctypes.c_size_t),
        ("_sigev_value", ctypes.c_void_p),
        ("_sigev_signo", ctypes.c_int),
        ("sigev_notify", ctypes.c_int),
        ("_sigev_rest", ctypes.c_byte * 48),
        ("_internal", ctypes.c_byte * 32),
        ("aio_offset", ctypes.c_int64),
        ("_reserved", ctypes.c_byte * 32),
    )


class _Aioinit(ctypes.Structure):
    _fields_ = tuple((name, ctypes.c_int) for name in (
        "aio_threads", "aio_num", "aio_locks", "aio_usedba", "aio_debug", "aio_numusers",
        "aio_idle_time", "aio_reserved",
    ))  # fmt: skip


def _library() -> ctypes.CDLL | None:
    if ctypes.sizeof(_Aiocb) != 168 or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    for name in ("libc.so.6", ctypes.util.find_library("rt")):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError:
            continue
        if hasattr(lib, "lio_listio64") and hasattr(lib, "aio_init"):
            return lib
    return None


_LIB = _library()
if _LIB is not None:
    _LIB.lio_listio64.restype = ctypes.c_int
    _LIB.aio_return64.restype = ctypes.c_ssize_t


def available() -> bool:
    """Whether glibc's POSIX AIO loads here (Linux, glibc, 64-bit)."""
    return _LIB is not None


class PosixAio:
    """Batches of pages moved by glibc's AIO threads, ``threads`` of them at most.

    ``pages`` are the pages' regions (header slot first); page ``i`` of a call goes to or
    comes from its own file, its regions back to back from offset 0.
    """

    def __init__(self, pages: Sequence[Sequence[memoryview]], threads: int) -> None:
        assert _LIB is not None, "POSIX AIO is not available here"
        init = _Aioinit(aio_threads=threads, aio_num=64, aio_idle_time=1)
        _LIB.aio_init(ctypes.byref(init))
        #: per page: (buffer address, length, file offset) of each region
        self._regions: list[list[tuple[int, int, int]]] = []
        self._keep: list[object] = []  # the ctypes views that pin the buffers' addresses
        for page in pages:
            at = 0
            regions = []
            for view in page:
                buffer = (ctypes.c_char * view.nbytes).from_buffer(view)
                self._keep.append(buffer)
                regions.append((ctypes.addressof(buffer), view.nbytes, at))
                at += view.nbytes
            self._regions.append(regions)

    def move(self, paths: Sequence[str], which: Sequence[int], *, write: bool) -> None:
        """Write (``O_CREAT``, in place if the file is there) or read the pages ``which``
        to or from ``paths`` (one per page), all in one ``lio_listio``."""
        assert _LIB is not None
        flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
        fds = [os.open(paths[i], flags | os.O_CLOEXEC, 0o600) for i in which]
        try:
            blocks = [
                _Aiocb(
                    aio_fildes=fd,
                    aio_lio_opcode=_LIO_WRITE if write else _LIO_READ,
                    aio_buf=address,
                    aio_nbytes=length,
                    sigev_notify=_SIGEV_NONE,
                    aio_offset=offset,
                )
                for fd, i in zip(fds, which, strict=True)
                for address, length, offset in self._regions[i]
            ]
            array = (ctypes.POINTER(_Aiocb) * len(blocks))(*(ctypes.pointer(b) for b in blocks))
            if _LIB.lio_listio64(_LIO_WAIT, array, len(blocks), None) != 0:
                errno = ctypes.get_errno()
                raise SystemExit(f"lio_listio failed: {os.strerror(errno)}")
            for block in blocks:
                done = _LIB.aio_return64(ctypes.byref(block))
                if done != block.aio_nbytes:
                    raise SystemExit(f"POSIX AIO moved {done} of {block.aio_nbytes} bytes")
        finally:
            for fd in fds:
                os.close(fd)
