"""Backend calls with a time bound: a call that never returns fails its operation, not a worker.

A :class:`BoundedCaller` runs each backend call on one of its own call threads and waits
for it at most ``timeout`` seconds. Past that, the caller gets ``TIMED_OUT`` and goes on
(its operation fails like any backend failure); the stuck call thread is *abandoned*:
it is left to finish on its own, and when (if ever) the call returns it runs the call's
``on_late`` clean-up (a cache releases the host pages the call was still using, so no
page is reused while a backend may still write into it) and rejoins the pool. At most
``max_abandoned`` calls may be stuck at once; past that every call is refused at once
(``REFUSED``) until one returns, so a hung backend costs a bounded number of threads.

Every :class:`~kvtier.core.pagestore.PageStore` makes its backend calls through one, so
every engine path (TieredCache, the vLLM and SGLang adapters) has the same bound.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["DEFAULT_CALL_TIMEOUT_S", "DEFAULT_MAX_ABANDONED", "BoundedCaller", "Outcome"]

log = logging.getLogger("kvtier.core.bounded")


#: The default bound on one backend call: one call moves one batch (32 pages: 256 MiB of
#: 8 MiB pages), which even a disk degraded to about 20 MB/s finishes in about 13 s.
DEFAULT_CALL_TIMEOUT_S = 30.0
#: The default number of backend calls that may be stuck past their bound at once.
DEFAULT_MAX_ABANDONED = 4


class Outcome(enum.Enum):
    """How a bounded call ended: returned, timed out (still running), refused (never ran)."""

    OK = "ok"
    TIMED_OUT = "timed_out"
    REFUSED = "refused"


class _Call:
    """One call handed to a call thread; ``finished`` and ``abandoned`` are guarded by ``lock``."""

    __slots__ = (
        "abandoned",
        "done",
        "error",
        "finished",
        "fn",
        "lock",
        "on_late",
        "operation",
        "result",
        "started",
        "worker",
    )

    def __init__(
        self,
        operation: str,
        fn: Callable[[], Any],
        on_late: Callable[[Any], None] | None,
        worker: _CallThread,
    ) -> None:
        self.operation = operation
        self.fn = fn
        self.on_late = on_late
        self.worker = worker
        self.lock = threading.Lock()
        self.done = threading.Lock()
        self.done.acquire()  # released by the call thread when the result is in
        self.finished = False
        self.abandoned = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.started = time.monotonic()


_STOP = object()


#: An idle call thread ends after this long without a call (a new one starts on demand),
#: so a page store that is never closed leaves no threads behind for long.
IDLE_S = 60.0


class _CallThread:
    """A daemon thread that runs the calls handed to it, one at a time."""

    def __init__(
        self,
        returned_late: Callable[[_CallThread, _Call], None],
        retire: Callable[[_CallThread], bool],
        name: str,
    ) -> None:
        #: called with (this thread, the call) when an abandoned call returns at last
        self.returned_late = returned_late
        #: called when idle for IDLE_S: True if the thread was still idle and may end
        self.retire = retire
        self.inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            try:
                item = self.inbox.get(timeout=IDLE_S)
            except queue.Empty:
                if self.retire(self):
                    return
                continue  # taken for a call just now: it is in the inbox
            if item is _STOP:
                return
            assert isinstance(item, _Call)
            try:
                item.result = item.fn()
            except BaseException as exc:  # handed back to the caller, never lost
                item.error = exc
            with item.lock:
                item.finished = True
                abandoned = item.abandoned
            if abandoned:
                self.returned_late(self, item)
            else:
                item.done.release()


class BoundedCaller:
    """Runs backend calls on call threads, each bounded by ``timeout`` seconds.

    ``timeout`` None (and no per-call bound) runs a call in the caller's thread, unbounded.
    """

    def __init__(self, name: str, timeout: float | None, max_abandoned: int) -> None:
        self.name = name
        self.timeout = timeout
        self.max_abandoned = max_abandoned
        self._lock = threading.Lock()
        self._idle: list[_CallThread] = []
        self._threads: list[_CallThread] = []
        self._in_flight: set[_Call] = set()
        self._stuck: set[_Call] = set()
        self._closed = False
        self._serial = 0
        self._counts = {"timed_out": 0, "refused": 0, "late_returns": 0}
        self._timeouts_by_op: dict[str, int] = {}
        self._warned_limit = False

    # --- the call ---------------------------------------------------------------------

    def call(
        self,
        operation: str,
        fn: Callable[[], Any],
        *,
        on_late: Callable[[Any], None] | None = None,
        timeout: float | None = None,
    ) -> tuple[Outcome, Any]:
        """Run ``fn()`` within the bound; ``(OK, result)`` or ``(TIMED_OUT | REFUSED, None)``.

        ``timeout`` narrows the caller's bound for this call. An exception from ``fn`` is
        raised here, as if it had run in this thread. After TIMED_OUT, ``on_late(result)``
        runs on the call thread once ``fn`` returns (None if it raised); it never runs
        after OK or REFUSED.
        """
        bound = self.timeout
        if timeout is not None:
            bound = timeout if bound is None else min(bound, timeout)
        if bound is None:
            return Outcome.OK, fn()
        worker = self._take()
        if worker is None:
            return Outcome.REFUSED, None
        call = _Call(operation, fn, on_late, worker)
        with self._lock:
            self._in_flight.add(call)
        worker.inbox.put(call)
        returned = call.done.acquire(timeout=bound)
        with call.lock:
            if not call.finished and not call.abandoned:
                self._mark_abandoned_locked(call)
            abandoned = call.abandoned
        if abandoned:
            self._log_abandoned(call)
            return Outcome.TIMED_OUT, None
        if not returned:  # it finished between the timeout and the check: use it
            call.done.acquire()
        with self._lock:
            self._in_flight.discard(call)
            keep = not self._closed
            if keep:
                self._idle.append(worker)
        if not keep:
            worker.inbox.put(_STOP)
        if call.error is not None:
            raise call.error
        return Outcome.OK, call.result

    def _take(self) -> _CallThread | None:
        """An idle call thread, a new one, or None when too many calls are stuck."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
            stuck = len(self._stuck)
            if stuck < self.max_abandoned and not self._closed:
                self._serial += 1
                worker = _CallThread(
                    self._late, self._retire, f"kvtier-{self.name}-call-{self._serial}"
                )
                self._threads.append(worker)
                return worker
            self._counts["refused"] += 1
            warn = not self._warned_limit and not self._closed
            self._warned_limit = self._warned_limit or warn
        if warn:
            log.warning(
                "kvtier: %d backend calls are still running past their bound "
                "(max_abandoned_calls=%d); every backend call fails at once until one of "
                "them returns (counted as backend_calls_refused)",
                stuck,
                self.max_abandoned,
            )
        return None

    def _mark_abandoned_locked(self, call: _Call) -> None:
        """Give up on a running call (``call.lock`` held): it is stuck until it returns."""
        call.abandoned = True
        with self._lock:
            self._in_flight.discard(call)
            self._stuck.add(call)
            self._counts["timed_out"] += 1
            op = call.operation
            self._timeouts_by_op[op] = self._timeouts_by_op.get(op, 0) + 1

    def _log_abandoned(self, call: _Call) -> None:
        log.warning(
            "kvtier: backend %s did not return within %.3g s; the operation failed "
            "and its call thread %s was abandoned (%d of at most %d abandoned now); "
            "it rejoins the pool if the call ever returns",
            call.operation,
            time.monotonic() - call.started,
            call.worker.thread.name,
            self.stuck(),
            self.max_abandoned,
        )

    def _retire(self, worker: _CallThread) -> bool:
        """An idle thread's timeout: forget it if it is still idle (it then ends)."""
        with self._lock:
            if worker not in self._idle:
                return False
            self._idle.remove(worker)
            self._threads.remove(worker)
            return True

    def _late(self, worker: _CallThread, call: _Call) -> None:
        """An abandoned call returned: run its clean-up, then serve again (or stop)."""
        if call.on_late is not None:
            try:
                call.on_late(None if call.error is not None else call.result)
            except Exception as exc:  # a clean-up must not kill the thread
                log.warning("kvtier: clean-up after a late %s failed: %r", call.operation, exc)
        with self._lock:
            self._stuck.discard(call)
            self._counts["late_returns"] += 1
            self._warned_limit = False
            keep = not self._closed
            if keep:
                self._idle.append(worker)
        if not keep:
            worker.inbox.put(_STOP)

    # --- shutdown and introspection -----------------------------------------------

    def abandon_in_flight(self) -> int:
        """Give up on every call still awaited (close's bound passed); wake their callers."""
        with self._lock:
            calls = list(self._in_flight)
        woken = 0
        for call in calls:
            with call.lock:
                if call.finished or call.abandoned:
                    continue
                self._mark_abandoned_locked(call)
            call.done.release()
            woken += 1
        return woken

    def close(self, deadline: float) -> list[str]:
        """Stop the call threads (calls in flight may end until ``deadline``).

        Returns a description of each call given up on: abandoned and still running.
        """
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            stuck = list(self._stuck)
            held = {call.worker for call in stuck}
            others = [w for w in self._threads if w not in held]
        for worker in idle:
            worker.inbox.put(_STOP)
        for worker in others:  # idle ones stop now; busy ones once their call returns
            worker.thread.join(max(0.0, deadline - time.monotonic()))
        now = time.monotonic()
        return sorted(
            f"{call.operation} on {call.worker.thread.name} (running {now - call.started:.1f} s)"
            for call in stuck
        )

    def stuck(self) -> int:
        """Calls past their bound that have not returned yet."""
        with self._lock:
            return len(self._stuck)

    def counts(self) -> dict[str, Any]:
        """Timed-out calls (total and by operation), refused calls, late returns, stuck now."""
        with self._lock:
            return {
                **self._counts,
                "timed_out_by_operation": dict(self._timeouts_by_op),
                "stuck": len(self._stuck),
                "max_abandoned": self.max_abandoned,
            }
