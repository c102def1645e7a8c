"""The core's side of the storage contract: envelopes on put, verification on get, guards.

A :class:`PageStore` sits between host-pool pages and one storage backend, which it owns
(:meth:`PageStore.close` closes both). It validates every key before any I/O, writes each
page's envelope into its header slot, hands the backend the page's regions (header slot,
then payload extents: scatter-gather, no staging copy), verifies what comes back, and
turns every invalid page into a counted miss. Every backend call is bounded
(:mod:`kvtier.core.bounded`): one that does not return in time fails its batch. A
backend exception is caught here, logged once per exception type, counted, and reported
as ``False`` for the whole batch; it never reaches the engine. Every engine path
(TieredCache, the vLLM and SGLang adapters) talks to its backend through a page store,
so all have the same guards and the same counters.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, Protocol, TypeVar, cast, runtime_checkable

from kvtier.core import compiled_envelope
from kvtier.core.bounded import (
    DEFAULT_CALL_TIMEOUT_S,
    DEFAULT_MAX_ABANDONED,
    BoundedCaller,
    Outcome,
)
from kvtier.core.envelope import (
    HEADER,
    BatchEnvelope,
    EnvelopeFormat,
    validate_fingerprint,
)
from kvtier.core.errors import InvalidFieldError, PageError, StorageError
from kvtier.core.extents import Extent
from kvtier.core.host_pool import HostPool
from kvtier.core.keys import validate_keys
from kvtier.core.layout import Layout
from kvtier.core.metrics import registered_counters, zeroed
from kvtier.core.renames import renamed_keywords
from kvtier.core.saveguard import SaveGuard
from kvtier.core.storage import StorageBackend
from kvtier.core.verifying import BatchChecks

__all__ = [
    "STATS_BOUND_S",
    "BatchResult",
    "EnvelopeHooks",
    "PageMemory",
    "PageStore",
    "PerPageHooks",
    "VerifyMode",
]

logger = logging.getLogger(__name__)

#: Bound on one backend ``stats()`` call (a metrics scrape must not wait a full call bound).
STATS_BOUND_S = 2.0


class BatchResult(list[bool]):
    """One result per key, and how the backend call ended (:class:`~kvtier.core.bounded.Outcome`).

    ``TIMED_OUT``: the call did not return within its bound, every result is False, and
    the backend may still be using the pages (``on_late`` runs once it returns);
    ``REFUSED``: too many calls were stuck, so this one was never made.
    """

    __slots__ = ("outcome",)

    def __init__(self, results: Sequence[bool] = (), outcome: Outcome = Outcome.OK) -> None:
        super().__init__(results)
        self.outcome = outcome

    def leading(self) -> int:
        """How many leading results are True (the prefix a lookup found)."""
        count = 0
        for ok in self:
            if not ok:
                break
            count += 1
        return count


VerifyMode = Literal["full", "header"]
_VERIFY_MODES = ("full", "header")
_R = TypeVar("_R")
_ZERO_HEADER = bytes(HEADER.size)
#: After close's bound, how long the call threads of calls that returned get to end.
_WAKE_GRACE_S = 0.5


def _refuse(slot: memoryview) -> None:
    """An envelope that never verifies (a zero header: no magic), for a tainted page."""
    slot[: HEADER.size] = _ZERO_HEADER


def _name(backend: object) -> str:
    return type(backend).__name__


def _nbytes(views: Sequence[memoryview]) -> int:
    total = 0
    for view in views:
        total += view.nbytes
    return total


def _extent_bytes(page: Sequence[Extent]) -> int:
    total = 0
    for extent in page:
        total += extent.length
    return total


@runtime_checkable
class PerPageHooks(Protocol):
    """What a backend offers to run the core's per-page work in its own I/O threads.

    Optional (the file and io_uring backends have it). ``get_with`` is ``get`` that calls
    ``on_filled(i)`` once for every page ``i`` it filled, in the thread that filled it,
    right after the bytes landed (the result is the core's; the backend ignores it).
    A backend may also call ``on_payload(i, piece)`` with consecutive pieces of page
    ``i``'s payload (after its header region), in order, as each lands, before
    ``on_filled(i)``: the core then hashes each piece while it is still in cache instead
    of reading the whole page again (a backend that never calls it is fine).
    ``put_with`` is ``put`` that calls ``before_write(i)`` (which writes page ``i``'s
    envelope into its header slot) in the thread that then writes page ``i``, before any
    of its bytes are written. Neither callback raises.

    A backend may go further with :class:`EnvelopeHooks`.
    """

    def get_with(
        self,
        keys: Sequence[str],
        pages: Sequence[Sequence[Extent]],
        on_filled: Callable[[int], object],
        on_payload: Callable[[int, memoryview], object] | None = None,
    ) -> list[bool]: ...

    def put_with(
        self,
        keys: Sequence[str],
        pages: Sequence[Sequence[Extent]],
        before_write: Callable[[int], object],
    ) -> list[bool]: ...


class EnvelopeHooks(Protocol):
    """:class:`PerPageHooks` that also take ``envelope=``, for a backend that writes and
    checks envelopes in its own loop (the file backend's compiled one, GIL released).

    A backend says so with ``checks_envelopes = True``. Given a
    :class:`~kvtier.core.envelope.BatchEnvelope`, ``put_with`` writes each page's envelope
    itself (calling ``before_write(i)`` only for a page it leaves to Python), and
    ``get_with`` checks each page it filled: a valid page's index goes into
    ``envelope.valid``, any other filled page goes to ``on_filled(i)``.
    """

    checks_envelopes: bool

    def get_with(
        self,
        keys: Sequence[str],
        pages: Sequence[Sequence[Extent]],
        on_filled: Callable[[int], object],
        on_payload: Callable[[int, memoryview], object] | None = None,
        *,
        envelope: BatchEnvelope | None = None,
    ) -> list[bool]: ...

    def put_with(
        self,
        keys: Sequence[str],
        pages: Sequence[Sequence[Extent]],
        before_write: Callable[[int], object],
        *,
        envelope: BatchEnvelope | None = None,
    ) -> list[bool]: ...


class PageMemory(Protocol):
    """The memory of pages, as a PageStore needs it: each page's envelope slot and extents.

    ``kvtier.core.host_pool.HostPool`` has it; an engine adapter can serve the engine's own
    host pool through it (the SGLang adapter does).
    """

    @property
    def layout(self) -> Layout: ...

    def header_extent(self, page: int) -> Extent: ...

    def extents(self, page: int) -> list[Extent]: ...

    def page_buffers(self, page: int) -> list[Extent]: ...


class PageStore:
    """Puts host-pool pages into a storage backend it owns and gets them back, verified.

    ``backend_call_timeout_s`` bounds every backend call (None: unbounded, in the caller's
    thread); at most ``max_abandoned_calls`` calls may be stuck past it at once, then
    every call fails at once until one returns.
    """

    @renamed_keywords
    def __init__(
        self,
        backend: StorageBackend,
        pool: PageMemory,
        *,
        fingerprint: str,
        verify: VerifyMode = "full",
        checksum_workers: int = 1,
        backend_call_timeout_s: float | None = DEFAULT_CALL_TIMEOUT_S,
        max_abandoned_calls: int = DEFAULT_MAX_ABANDONED,
        caller: BoundedCaller | None = None,
        owns_backend: bool = True,
    ) -> None:
        if verify not in _VERIFY_MODES:
            raise InvalidFieldError(
                "verify",
                f"must be one of {', '.join(map(repr, _VERIFY_MODES))}, got {verify!r}",
                value=verify,
            )
        validate_fingerprint(fingerprint)
        if (
            isinstance(checksum_workers, bool)
            or not isinstance(checksum_workers, int)
            or checksum_workers < 1
        ):
            raise InvalidFieldError(
                "checksum_workers",
                f"must be a positive integer (1 checksums in the calling thread), "
                f"got {checksum_workers!r}",
                value=checksum_workers,
            )
        if backend_call_timeout_s is not None and not backend_call_timeout_s > 0:
            raise InvalidFieldError(
                "backend_call_timeout_s",
                "must be a positive number of seconds or None (unbounded), "
                f"got {backend_call_timeout_s!r}",
                value=backend_call_timeout_s,
            )
        if isinstance(max_abandoned_calls, bool) or not (
            isinstance(max_abandoned_calls, int) and max_abandoned_calls >= 1
        ):
            raise InvalidFieldError(
                "max_abandoned_calls",
                f"must be a positive integer, got {max_abandoned_calls!r}",
                value=max_abandoned_calls,
            )
        self.backend = backend
        self.pool = pool
        self.backend_call_timeout_s = backend_call_timeout_s
        self.max_abandoned_calls = max_abandoned_calls
        #: Every backend call goes through here, bounded by ``backend_call_timeout_s`` (or another
        #: store's ``caller``, shared with it).
        self._calls = caller or BoundedCaller(
            "backend", backend_call_timeout_s, max_abandoned_calls
        )
        #: a caller shared with another store is that store's to close
        self._owns_calls = caller is None
        self._owns_backend = owns_backend
        self._closed = False
        self._close_lock = threading.Lock()

        #: Threads that checksum the pages of one batch in parallel (xxhash releases the
        #: GIL); 1 checksums in the calling thread. Started on first use.
        self.checksum_workers = checksum_workers
        self._executor: ThreadPoolExecutor | None = None
        self.fingerprint = fingerprint
        self.verify: VerifyMode = verify
        self._counters = registered_counters("page_store")
        self._warned: set[type[BaseException]] = set()
        self._lock = threading.Lock()
        self._formats: dict[str, EnvelopeFormat] = {}
        #: Whether envelopes are written and verified in compiled code
        #: (:mod:`kvtier.core.compiled_envelope`); else by :class:`EnvelopeFormat`, in
        #: Python, with the same bytes and verdicts.
        self._compiled = compiled_envelope.available()
        #: The backend's per-page hooks, when it has them (verification in its threads).
        self._hooks: PerPageHooks | None = backend if isinstance(backend, PerPageHooks) else None
        #: The backend, when it writes and checks envelopes itself (``envelope=``).
        self._enveloped: EnvelopeHooks | None = (
            cast(EnvelopeHooks, backend)
            if self._hooks is not None and getattr(backend, "checks_envelopes", False) is True
            else None
        )

    # --- public API ---------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> BatchResult:
        """Whether each key is stored (one batched backend call); False on backend error."""
        keys = self._checked_keys(keys)
        if not keys:
            return BatchResult()
        return self._call("exists", len(keys), lambda: self.backend.exists(keys))

    def prefix_hits(self, keys: Sequence[str]) -> int:
        """How many leading keys are stored, from one batched ``exists`` call."""
        hits = self.exists(keys).leading()
        self._counters.add("prefix_queries")
        self._counters.add("prefix_pages", hits)
        return hits

    def put(
        self,
        keys: Sequence[str],
        pages: Sequence[int],
        *,
        on_late: Callable[[Any], None] | None = None,
        guards: Sequence[SaveGuard | None] | None = None,
        parents: Sequence[str | None] | None = None,
    ) -> BatchResult:
        """Envelope each page in its header slot and store it; True where the backend did.

        A backend with :class:`PerPageHooks` writes each envelope in the I/O thread that
        then writes the page (the checksum runs in parallel, while the bytes are in that
        core's cache); otherwise the envelopes are written here first. If the call times
        out (``result.outcome``), the backend may still read the pages: ``on_late(results)``
        runs once it returns, and the caller must not reuse them before.

        ``guards`` (one per page, or None) are the :class:`~kvtier.core.saveguard.SaveGuard`
        of pages whose memory its owner may take back during the call: a guarded page's
        envelope is written under its guard, and once the guard is tripped as an envelope
        that never verifies (the page is a counted miss for every reader, never a hit); a
        page whose guard tripped before the call returned is reported False (here and to
        ``on_late``) and counted ``put_tainted``. Guarded pages are enveloped by the core,
        never by a backend's own loop (``checks_envelopes``).

        ``parents`` (each page's real parent, see :meth:`kvtier.core.store.Store.put`) is
        accepted and not used: a single page store describes nothing to a policy (its
        backend's policy learns only inserts, accesses and removals); the chain in front of
        a plan's page stores is what tells its tiers' policies each page's parent.
        """
        keys = self._checked_keys(keys, pages)
        if not keys:
            return BatchResult()
        if guards is not None and len(guards) != len(keys):
            raise PageError(
                f"got {len(keys)} keys and {len(guards)} guards; pass one guard (or None) per key",
                value=len(guards),
            )
        guarded = guards if guards is not None and any(g is not None for g in guards) else None
        buffers = [self.pool.page_buffers(page) for page in pages]
        views = [[e.view for e in regions] for regions in buffers]
        write = self._format().write
        compiled = self._compiled
        static = self._format().batch(()).static
        write_compiled = compiled_envelope.write_envelopes

        def seal(i: int) -> None:
            if compiled:
                write_compiled(static, (keys[i],), (buffers[i],))
                return
            page = views[i]
            write(page[0], keys[i], page[1:])

        def envelope(i: int) -> None:
            guard = guarded[i] if guarded is not None else None
            if guard is None:
                seal(i)
            else:  # no checksum over memory its owner took back (saveguard.py)
                guard.sealing(lambda: seal(i), lambda: _refuse(views[i][0]))

        def envelopes(chunk: Sequence[int]) -> None:  # compiled: one call a slice
            write_compiled(static, [keys[i] for i in chunk], [buffers[i] for i in chunk])

        hooks = self._hooks
        enveloped = None if guarded is not None else self._enveloped
        if guarded is not None:
            on_late = self._tainting(guarded, on_late)
        if enveloped is not None:
            batch = self._format().batch(keys)
            call = lambda: enveloped.put_with(keys, buffers, envelope, envelope=batch)  # noqa: E731
        elif hooks is not None:
            call = lambda: hooks.put_with(keys, buffers, envelope)  # noqa: E731
        else:
            if compiled and guarded is None:
                self._slices(envelopes, range(len(keys)))
            else:
                self._each(envelope, range(len(keys)))
            call = lambda: self.backend.put(keys, buffers)  # noqa: E731
        results = self._call("put", len(keys), call, on_late)
        if guarded is not None and results.outcome is Outcome.OK:
            self._taint(guarded, results)
        stored = [i for i, ok in enumerate(results) if ok]
        self._counters.add("puts", len(stored))
        self._counters.add("bytes_written", sum(_nbytes(views[i]) for i in stored))
        self._counters.add("put_failures", len(keys) - len(stored))
        return results

    def get(
        self,
        keys: Sequence[str],
        pages: Sequence[int],
        *,
        on_late: Callable[[Any], None] | None = None,
        verdicts: dict[int, str] | None = None,
    ) -> BatchResult:
        """Fill pages from storage and verify them; an invalid page is a counted False.

        ``verdicts``, when given, receives the verdict of every page that was read and
        failed envelope verification: index -> :class:`~kvtier.core.envelope.Rejection`
        value (``corrupt_checksum``...). A False without an entry was not read (absent,
        or the call failed or timed out), so nothing is known against the stored page;
        only a page with an entry is proven bad.

        A backend with :class:`PerPageHooks` verifies each page in the I/O thread that
        read it, right after its bytes landed; otherwise the pages are verified here
        (on the checksum threads, if any) once the batch is in. If the call times out
        (``result.outcome``), the backend may still write into the pages:
        ``on_late(results)`` runs once it returns, and the caller must not reuse them
        before.
        """
        keys = self._checked_keys(keys, pages)
        if not keys:
            return BatchResult()
        buffers = [self.pool.page_buffers(page) for page in pages]
        for regions in buffers:
            # A backend that reports True without filling the slot must not leave a stale
            # (valid-looking) envelope from an earlier put behind.
            regions[0].view[: HEADER.size] = _ZERO_HEADER
        full = self.verify == "full"
        fmt = self._format()
        checks = BatchChecks(fmt, keys, buffers, full=full, compiled=self._compiled)
        enveloped, hooks = self._enveloped, self._hooks
        batch: BatchEnvelope | None = None
        if enveloped is not None:  # the backend's loop verifies
            batch = fmt.batch(keys, full=full)
            call = lambda: enveloped.get_with(keys, buffers, checks.check, envelope=batch)  # noqa: E731
        elif hooks is not None:  # each page verified in the I/O thread that read it
            on_payload = checks.feed if full else None
            call = lambda: hooks.get_with(keys, buffers, checks.check, on_payload)  # noqa: E731
        else:  # verified here once the batch is in
            call = lambda: self.backend.get(keys, buffers)  # noqa: E731
        results = self._call("get", len(keys), call, on_late)
        if results.outcome is not Outcome.OK:
            self._counters.add("misses", len(keys))
            return results
        if batch is not None:
            checks.passed(batch.valid)
        filled = [i for i, ok in enumerate(results) if ok]
        self._counters.add("misses", len(keys) - len(filled))
        checks.finish(filled, self._slices, self._each)
        reasons = checks.reasons
        hits = 0
        nbytes = 0
        for i in filled:
            reason = reasons[i]
            if reason is not None:
                results[i] = False
                if verdicts is not None:
                    verdicts[i] = reason.value
                self._counters.add("invalid")
                self._counters.add(f"invalid_{reason.value}")
                logger.debug("page %r rejected: %s", keys[i], reason.value)
                continue
            hits += 1
            nbytes += _extent_bytes(buffers[i])
        self._counters.add("hits", hits)
        self._counters.add("bytes_read", nbytes)
        return results

    def delete(self, keys: Sequence[str]) -> BatchResult:
        """Remove each key from the backend; False on backend error."""
        keys = self._checked_keys(keys)
        if not keys:
            return BatchResult()
        return self._call("delete", len(keys), lambda: self.backend.delete(keys))

    def clear(self) -> bool:
        """Remove every page of the backend's namespace (bounded); False if it failed."""
        self._checked_keys(())

        def clear() -> list[bool]:
            self.backend.clear()
            return [True]

        return self._call("clear", 1, clear)[0]

    def backend_stats(self, timeout: float = STATS_BOUND_S) -> dict[str, Any]:
        """The backend's own ``stats()``, bounded by ``timeout`` (``{"error": ...}`` if not)."""
        try:
            if self._closed:
                return dict(self.backend.stats())
            outcome, values = self._calls.call("stats", self.backend.stats, timeout=timeout)
        except Exception as exc:
            return {"error": repr(exc)}
        if outcome is not Outcome.OK:
            self._count_outcome(outcome, "stats")
            return {"error": f"stats() {outcome.value}"}
        return dict(values)

    def stats(self) -> dict[str, int | float]:
        """Counters: hits, misses, invalid (and ``invalid_<reason>``), bytes, backend errors,
        timed-out and refused calls (and ``_<operation>`` of each)."""
        return {**zeroed("page_store"), **self._counters.snapshot()}

    def sibling(self, pool: PageMemory) -> PageStore:
        """A page store over another page memory (a staging pool) in front of the same
        backend: the same bound and call threads, counters of its own (what it moves is
        not the engine's traffic); it does not own the backend
        (closing it closes neither). A kvtier :class:`HostPool` is attached to the backend
        first, as :func:`~kvtier.core.capabilities.open_page_store` does."""
        if isinstance(pool, HostPool):
            self.backend.attach(pool)
        return PageStore(
            self.backend,
            pool,
            fingerprint=self.fingerprint,
            verify=self.verify,
            caller=self._calls,  # the same bound and threads; counters of its own
            owns_backend=False,
        )

    def call_counts(self) -> dict[str, Any]:
        """The bounded calls: timed out (total and by operation), refused, late, stuck now."""
        return self._calls.counts()

    def abandon_in_flight(self) -> int:
        """Give up on every backend call still awaited (a caller's own bound passed)."""
        return self._calls.abandon_in_flight()

    def close(self, timeout: float | None = None) -> bool:
        """Stop the checksum threads and close the backend, once (idempotent).

        The backend's ``close()`` is bounded by ``timeout`` (default: the call bound);
        calls still stuck past their bound are given up, each named in one WARNING.
        True when everything closed in time. A store that does not own its backend (a
        sibling) leaves the backend, and a call thread it shares, to their owner; its own
        threads it stops.
        """
        with self._close_lock:
            if self._closed:
                return True
            self._closed = True
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        closed = True
        if self._owns_backend:
            closed = self._close_backend(timeout)
        if not self._owns_calls:
            return closed
        stuck = self._calls.close(time.monotonic() + _WAKE_GRACE_S)
        if stuck:
            logger.warning(
                "kvtier: close gave up on %d backend call(s) still running past their "
                "bound, left to daemon threads: %s",
                len(stuck),
                "; ".join(stuck),
            )
        return closed and not stuck

    def _close_backend(self, timeout: float | None) -> bool:
        """The backend's ``close()``, bounded and counted; True if it closed in time."""
        try:
            outcome, _ = self._calls.call("close", self.backend.close, timeout=timeout)
        except Exception as exc:
            self._counters.add("backend_errors")
            self._counters.add("backend_errors_close")
            logger.warning("storage backend %s raised in close: %r", _name(self.backend), exc)
            return False
        if outcome is not Outcome.OK:
            self._count_outcome(outcome, "close")
            return False
        return True

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    # --- internals ----------------------------------------------------------------------

    def _each(self, fn: Callable[[int], _R], items: Sequence[int]) -> list[_R]:
        """``[fn(i) for i in items]``, on the checksum threads when there are several."""
        if self.checksum_workers == 1 or len(items) < 2:
            return [fn(i) for i in items]
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    self.checksum_workers, thread_name_prefix="kvtier-checksum"
                )
            executor = self._executor
        try:
            return list(executor.map(fn, items))
        except RuntimeError:
            if self._executor is executor:
                raise
            # close() shut the threads down under us; both callers are idempotent.
            return [fn(i) for i in items]

    def _slices(self, fn: Callable[[Sequence[int]], object], items: Sequence[int]) -> None:
        """``fn`` over contiguous slices of ``items``: one slice per checksum thread (the
        compiled envelope calls release the GIL), or all of them in the calling thread."""
        count = min(self.checksum_workers, len(items))
        if count < 2:
            fn(items)
            return
        step = -(-len(items) // count)
        chunks = [items[at : at + step] for at in range(0, len(items), step)]
        self._each(lambda k: fn(chunks[k]), range(len(chunks)))

    def _format(self) -> EnvelopeFormat:
        """The envelope format of this store's fingerprint and the pool's layout."""
        layout = self.pool.layout
        fmt = self._formats.get(layout)
        if fmt is None:
            fmt = self._formats[layout] = EnvelopeFormat(self.fingerprint, layout)
        return fmt

    def _checked_keys(self, keys: Sequence[str], pages: Sequence[int] | None = None) -> list[str]:
        if self._closed:
            raise StorageError(
                f"this page store over {_name(self.backend)} is closed (its backend too); "
                "open a new one",
                value=_name(self.backend),
            )
        checked = validate_keys(keys)
        if pages is not None and len(pages) != len(checked):
            raise PageError(
                f"got {len(checked)} keys and {len(pages)} pages; pass one page per key",
                value=len(pages),
            )
        return checked

    def _taint(self, guards: Sequence[SaveGuard | None], results: list[bool]) -> None:
        """Report False each page whose guard tripped before its put returned (counted):
        its memory may have changed under the write, so it is not the key's own."""
        tainted = 0
        for i, guard in enumerate(guards):
            if guard is not None and guard.tripped:
                tainted += 1
                results[i] = False
        self._counters.add("put_tainted", tainted)

    def _tainting(
        self, guards: Sequence[SaveGuard | None], on_late: Callable[[Any], None] | None
    ) -> Callable[[Any], None] | None:
        """``on_late`` of a guarded put: the late results, tainted as :meth:`_taint` does."""
        if on_late is None:
            return None
        late = on_late

        def tainted(results: Any) -> None:
            if isinstance(results, list) and len(results) == len(guards):
                results = [bool(ok) for ok in results]
                self._taint(guards, results)
            late(results)

        return tainted

    def _count_outcome(self, outcome: Outcome, op: str) -> None:
        """Count a call that timed out or was refused, in total and by operation."""
        if outcome is Outcome.TIMED_OUT:
            self._counters.add("backend_timeouts")
            self._counters.add(f"backend_timeouts_{op}")
        else:
            self._counters.add("backend_refused")
            self._counters.add(f"backend_refused_{op}")

    def _call(
        self,
        op: str,
        count: int,
        call: Callable[[], list[bool]],
        on_late: Callable[[Any], None] | None = None,
    ) -> BatchResult:
        """Run one backend call within the bound; an exception, a malformed answer, a
        timeout or a refusal becomes all-False (the outcome says which of the last two)."""
        try:
            outcome, results = self._calls.call(op, call, on_late=on_late)
            if outcome is not Outcome.OK:
                self._count_outcome(outcome, op)
                return BatchResult([False] * count, outcome)
            if len(results) != count:
                raise StorageError(
                    f"backend {type(self.backend).__name__}.{op} returned {len(results)} "
                    f"results for {count} keys",
                    value=len(results),
                )
            return BatchResult([bool(r) for r in results])
        except Exception as exc:
            self._counters.add("backend_errors")
            self._counters.add(f"backend_errors_{op}")
            kind = type(exc)
            with self._lock:
                first = kind not in self._warned
                self._warned.add(kind)
            if first:
                logger.warning(
                    "storage backend %s raised %s in %s (%s); the batch of %d keys reports "
                    "False. Later %s errors are counted in stats()['backend_errors'] only.",
                    type(self.backend).__name__,
                    kind.__name__,
                    op,
                    exc,
                    count,
                    kind.__name__,
                )
            return BatchResult([False] * count)
