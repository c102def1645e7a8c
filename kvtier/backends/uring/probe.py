"""Whether io_uring works in this process: the ``uring`` backend's availability probe.

The probe runs a tiny ring end to end, so where io_uring is missing or forbidden (seccomp
in containers, ``kernel.io_uring_disabled``) the backend is listed as unavailable with the
reason, and choosing it fails with that reason; nothing falls back to the file backend.
liburing (and the ring engine, which imports it) is imported inside the probe, only when
it runs, so declaring the backend imports nothing optional.
"""

from __future__ import annotations

import errno
import functools
import os

__all__ = ["INSTALL_HINT", "probe_io_uring"]

#: How to get what the ``uring`` backend needs.
INSTALL_HINT = "pip install 'kvtier[uring]'"


def _sysctl_disabled() -> str | None:
    try:
        with open("/proc/sys/kernel/io_uring_disabled", encoding="ascii") as handle:
            value = handle.read().strip()
    except OSError:
        return None
    if value == "2":
        return "io_uring is disabled on this host (sysctl kernel.io_uring_disabled=2)"
    return None


def _probe_uncached() -> str | None:
    reason = _sysctl_disabled()
    if reason is not None:
        return reason
    try:
        import liburing
    except ImportError as exc:
        return f"cannot import liburing: {exc}"
    ring = liburing.Ring()
    try:
        liburing.io_uring_queue_init(2, ring)
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.EACCES):
            return (
                "io_uring_setup is forbidden here (EPERM): a seccomp profile, the container "
                "runtime or sysctl kernel.io_uring_disabled blocks it; allow io_uring or "
                "use the 'file' backend"
            )
        if exc.errno == errno.ENOSYS:
            return "this kernel has no io_uring (ENOSYS); use the 'file' backend"
        return f"io_uring_setup failed: {exc}"
    try:
        supported = liburing.probe()
        missing = [
            op
            for op in ("IORING_OP_READV", "IORING_OP_WRITEV", "IORING_OP_FSYNC")
            if not supported.get(op, False)
        ]
        if missing:
            return f"this kernel's io_uring lacks {', '.join(missing)}"
        from kvtier.backends.uring.ring import IORequest, Op, Ring

        probe_ring = Ring(1)
        try:
            buffer = bytearray(8)
            read_fd, write_fd = os.pipe()
            try:
                os.write(write_fd, b"kvtier-p")
                request = IORequest(Op.READ, read_fd, [memoryview(buffer)])
                probe_ring.run([request])
            finally:
                os.close(read_fd)
                os.close(write_fd)
        finally:
            probe_ring.close()
        if not request.ok or bytes(buffer) != b"kvtier-p":
            return f"an io_uring test read failed (errno {request.error})"
    except OSError as exc:
        return f"io_uring does not work here: {exc}"
    finally:
        liburing.io_uring_queue_exit(ring)
    return None


@functools.lru_cache(maxsize=1)
def probe_io_uring() -> str | None:
    """Why io_uring cannot be used in this process, or None; runs a tiny ring once."""
    try:
        return _probe_uncached()
    except Exception as exc:  # the probe must never break listing
        return f"io_uring probe failed: {exc!r}"
