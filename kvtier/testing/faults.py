"""A fault-injecting wrapper around any storage backend, for conformance and chaos tests.

:class:`FaultyBackend` forwards every call to an inner backend and, with seeded
probabilities, makes a key's operation fail, raises from a whole call, delays calls,
flips a bit in a page that was read, or stores a truncated page. Everything it breaks is
something a real disk, network or buggy backend does; the core's envelope and error
boundary must turn each into a counted miss, never into bad data.

:class:`CallGate` holds a backend's put or get past the call bound and then lets it
complete on the pages it was given (a stalled disk or network that recovers), and
:class:`OSFaults` fails (or holds) the Nth ``os`` write call of the process with ENOSPC or
EIO: the conformance kit's fault campaign is built on them.
"""

from __future__ import annotations

import errno as errno_codes
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from kvtier.core.envelope import HEADER
from kvtier.core.errors import InjectedFault, InvalidFieldError
from kvtier.core.extents import Extent, extent_of_view
from kvtier.core.storage import PageBuffers, StorageBackend

if TYPE_CHECKING:
    from kvtier.core.host_pool import HostPool

__all__ = ["WRITE_CALLS", "CallGate", "FaultyBackend", "InjectedFault", "OSFaults"]

FlipWhere = Literal["any", "header", "payload"]


def _rate(name: str, value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise InvalidFieldError(
            name, f"must be a probability in [0, 1], got {value!r}", value=value
        )
    return value


class FaultyBackend(StorageBackend):
    """Wraps ``inner`` and injects faults with the given per-key (or per-call) probabilities.

    - ``fail_rate``: a key's get / put reports False (a put then stores nothing);
    - ``error_rate``: a whole call raises :class:`InjectedFault` (a backend bug);
    - ``delay``: seconds slept before every call (a slow disk or network);
    - ``bit_flip_rate``: a page read successfully gets one bit flipped, in the envelope
      header (the first region's header bytes), the payload, or either (``flip_in``);
    - ``truncate_rate``: a put stores only a prefix of the page (a short object), which a
      later get must report as a miss or the envelope must reject.

    Faults are drawn from ``random.Random(seed)``, so a failing run can be replayed.
    ``injected`` counts what fired, by kind.
    """

    def __init__(
        self,
        inner: StorageBackend,
        *,
        seed: int = 0,
        fail_rate: float = 0.0,
        error_rate: float = 0.0,
        delay: float = 0.0,
        bit_flip_rate: float = 0.0,
        truncate_rate: float = 0.0,
        flip_in: FlipWhere = "any",
    ) -> None:
        self.inner = inner
        self.fail_rate = _rate("fail_rate", fail_rate)
        self.error_rate = _rate("error_rate", error_rate)
        self.bit_flip_rate = _rate("bit_flip_rate", bit_flip_rate)
        self.truncate_rate = _rate("truncate_rate", truncate_rate)
        if delay < 0:
            raise InvalidFieldError("delay", f"must be >= 0 seconds, got {delay!r}", value=delay)
        if flip_in not in ("any", "header", "payload"):
            raise InvalidFieldError(
                "flip_in", f"must be 'any', 'header' or 'payload', got {flip_in!r}", value=flip_in
            )
        self.delay = delay
        self.flip_in: FlipWhere = flip_in
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self.injected: dict[str, int] = {}

    # --- drawing faults ----------------------------------------------------------------

    def _hit(self, rate: float, kind: str) -> bool:
        if rate <= 0.0:
            return False
        with self._lock:
            fired = self._random.random() < rate
            if fired:
                self.injected[kind] = self.injected.get(kind, 0) + 1
        return fired

    def _randrange(self, n: int) -> int:
        with self._lock:
            return self._random.randrange(n)

    def _before_call(self, op: str) -> None:
        if self.delay:
            time.sleep(self.delay)
        if self._hit(self.error_rate, "errors"):
            raise InjectedFault(f"injected failure of {op}()", value=op)

    def _flip(self, page: PageBuffers) -> None:
        # the envelope header proper (not the slot's zero padding, where a flip is harmless)
        header = [page[0].view[: min(HEADER.size, page[0].length)]] if page else []
        payload = [e.view for e in page[1:]]
        if self.flip_in == "header":
            regions = header
        elif self.flip_in == "payload":
            regions = payload
        else:
            regions = header + payload
        regions = [r for r in regions if r.nbytes]
        if not regions:
            return
        total = sum(r.nbytes for r in regions)
        bit = self._randrange(total * 8)
        byte, shift = divmod(bit, 8)
        for region in regions:
            if byte < region.nbytes:
                region[byte] ^= 1 << shift
                return
            byte -= region.nbytes

    def _truncated(self, page: PageBuffers) -> list[Extent]:
        total = sum(e.length for e in page)
        keep = self._randrange(total) if total else 0
        out: list[Extent] = []
        for extent in page:
            if keep <= 0:
                break
            if extent.length <= keep:
                out.append(extent)
                keep -= extent.length
            else:
                out.append(extent_of_view(extent.view[:keep]))
                keep = 0
        return out

    # --- the contract ------------------------------------------------------------------

    def attach(self, pool: HostPool) -> None:
        self.inner.attach(pool)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._before_call("exists")
        return self.inner.exists(keys)

    def get(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        self._before_call("get")
        results = self.inner.get(keys, pages)
        for i, page in enumerate(pages):
            if not results[i]:
                continue
            if self._hit(self.fail_rate, "get_failures"):
                results[i] = False
            elif self._hit(self.bit_flip_rate, "bit_flips"):
                self._flip(page)
        return results

    def put(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        self._before_call("put")
        chosen: list[int] = []
        sent: list[PageBuffers] = []
        for i, page in enumerate(pages):
            if self._hit(self.fail_rate, "put_failures"):
                continue
            chosen.append(i)
            sent.append(
                self._truncated(page) if self._hit(self.truncate_rate, "truncations") else page
            )
        results = [False] * len(keys)
        if chosen:
            stored = self.inner.put([keys[i] for i in chosen], sent)
            for i, ok in zip(chosen, stored, strict=True):
                results[i] = ok
        return results

    def delete(self, keys: Sequence[str]) -> list[bool]:
        self._before_call("delete")
        return self.inner.delete(keys)

    def clear(self) -> None:
        self.inner.clear()

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            injected = {f"injected_{kind}": n for kind, n in self.injected.items()}
        return {**self.inner.stats(), **injected}

    def close(self) -> None:
        self.inner.close()


# --- a call that stalls past the bound, then completes ----------------------------------


class CallGate:
    """Holds a backend's ``put`` (or ``get``) calls at the door until :meth:`release`.

    Installed on the backend *instance* (``put`` and ``put_with``, or ``get`` and
    ``get_with``, whichever it has), so a :class:`~kvtier.core.pagestore.PageStore` or a
    chain tier already built over it keeps its per-page hooks and calls through the gate:
    the first ``stalls`` calls wait, then run the real call with the very pages they were
    given, whatever those pages hold by then. That is a call stalled past the bound that
    completes late. Later calls pass straight through. :meth:`remove` (or leaving the
    ``with`` block) releases and uninstalls it.
    """

    def __init__(
        self, backend: object, op: Literal["put", "get"], *, stalls: int = 1, limit_s: float = 60.0
    ) -> None:
        if op not in ("put", "get"):
            raise InvalidFieldError("op", f"must be 'put' or 'get', got {op!r}", value=op)
        self.backend = backend
        self.op = op
        self.limit_s = limit_s
        self._left = stalls
        self._lock = threading.Lock()
        self._open = threading.Event()
        self._entered = threading.Event()
        self._returned = threading.Event()
        self._stalled = 0
        self._finished = 0
        self._names: list[str] = []

    def install(self) -> CallGate:
        """Put the gate on the backend's call methods; returns itself."""
        for name in (self.op, f"{self.op}_with"):
            original = getattr(self.backend, name, None)
            if callable(original):
                setattr(self.backend, name, self._wrap(original))
                self._names.append(name)
        if not self._names:
            raise InvalidFieldError(
                "backend", f"{type(self.backend).__name__} has no {self.op}()", value=self.backend
            )
        return self

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def gated(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                stall = self._left > 0
                if stall:
                    self._left -= 1
                    self._stalled += 1
            if not stall:
                return original(*args, **kwargs)
            self._entered.set()
            self._open.wait(self.limit_s)
            try:
                return original(*args, **kwargs)
            finally:
                with self._lock:
                    self._finished += 1
                    if self._finished == self._stalled:
                        self._returned.set()

        return gated

    @property
    def stalled(self) -> int:
        """How many calls the gate held."""
        with self._lock:
            return self._stalled

    def wait_stalled(self, timeout: float) -> bool:
        """Whether a call reached the gate within ``timeout`` seconds."""
        return self._entered.wait(timeout)

    def release(self) -> None:
        """Let the held calls run (each completes late, on the pages it was given)."""
        self._open.set()

    def wait_returned(self, timeout: float) -> bool:
        """Whether every held call has returned, within ``timeout`` seconds."""
        if not self.stalled:
            return True
        return self._returned.wait(timeout)

    def remove(self) -> None:
        """Release the held calls and take the gate off the backend."""
        self.release()
        for name in self._names:
            if name in vars(self.backend):
                delattr(self.backend, name)
        self._names.clear()

    def __enter__(self) -> CallGate:
        return self.install()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()


# --- a full disk or a failing device at one OS call -------------------------------------

#: The ``os`` functions a put writes through; :class:`OSFaults` fails one of them.
WRITE_CALLS: tuple[str, ...] = (
    "open",
    "write",
    "pwrite",
    "pwritev",
    "fsync",
    "fdatasync",
    "rename",
    "replace",
    "link",
    "mkdir",
    "ftruncate",
    "posix_fallocate",
    "copy_file_range",
)


class OSFaults:
    """Counts the process's calls of :data:`WRITE_CALLS` and fails the ``fail_at``-th.

    While installed (a ``with`` block), each of those ``os`` functions is replaced by one
    that counts the call (in every thread) and, on the ``fail_at``-th call (1-based; 0:
    never), raises ``OSError(errno)`` instead of calling it: ENOSPC or EIO at that step,
    once. ``calls`` lists the names called, in order, so a dry run (``fail_at=0``) gives
    the steps of one put. With ``stall_s``, that call is held for up to ``stall_s``
    seconds instead (a write caught mid-put, for a kill to land on), then made.
    A backend whose I/O is compiled code or a network client makes
    no such calls: inject at the backend boundary (:class:`FaultyBackend`) instead.
    """

    def __init__(
        self, fail_at: int = 0, errno: int = errno_codes.ENOSPC, *, stall_s: float = 0.0
    ) -> None:
        self.fail_at = fail_at
        self.errno = errno
        self.stall_s = stall_s
        self.calls: list[str] = []
        self.failed: str | None = None
        #: Set when the ``fail_at``-th call came (and failed, or is being held).
        self.reached = threading.Event()
        self._lock = threading.Lock()
        self._saved: dict[str, Callable[..., Any]] = {}

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.calls.append(name)
                fail = len(self.calls) == self.fail_at
                if fail:
                    self.failed = name
            if fail:
                self.reached.set()
                if self.stall_s:
                    time.sleep(self.stall_s)
                else:
                    raise OSError(self.errno, f"{os.strerror(self.errno)} (injected at {name})")
            return original(*args, **kwargs)

        return counted

    def __enter__(self) -> OSFaults:
        for name in WRITE_CALLS:
            original = getattr(os, name, None)
            if original is not None:
                self._saved[name] = original
                setattr(os, name, self._wrap(name, original))
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for name, original in self._saved.items():
            setattr(os, name, original)
        self._saved.clear()
