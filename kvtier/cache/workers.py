"""Worker threads with bounded queues for TieredCache.

A :class:`WorkerGroup` runs jobs from one bounded queue on a few daemon threads. A job
that raises is reported (counted and logged once per exception type by the cache) and the
worker goes on; submitting to a full or closed queue returns False at once instead of
blocking. ``close`` drains or cancels within a bound and joins every thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

__all__ = ["Job", "WorkerGroup"]

log = logging.getLogger("kvtier.cache")


class Job:
    """A unit of work: ``run()`` on a worker, or ``cancel()`` if it never gets to run.

    ``run`` must release what it holds even when it raises; ``cancel`` is called only for
    jobs that never started.
    """

    def __init__(self, run: Callable[[], None], cancel: Callable[[], None]) -> None:
        self._run = run
        self._cancel = cancel

    def run(self) -> None:
        self._run()

    def cancel(self) -> None:
        self._cancel()


_STOP = object()


class WorkerGroup:
    """``threads`` daemon workers serving one queue of at most ``maxsize`` jobs."""

    def __init__(
        self,
        name: str,
        threads: int,
        maxsize: int,
        on_error: Callable[[str, BaseException], None],
    ) -> None:
        self.name = name
        self._queue: queue.Queue[object] = queue.Queue(maxsize=maxsize)
        self._on_error = on_error
        self._closed = False
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._loop, name=f"kvtier-{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job: Job) -> bool:
        """Queue a job; False (never blocking) when the queue is full or closed."""
        with self._lock:
            if self._closed:
                return False
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                return False
            return True

    def depth(self) -> int:
        """Jobs waiting (not counting running ones)."""
        return self._queue.qsize()

    def idle(self) -> bool:
        """Whether no job is queued or running."""
        return self._queue.unfinished_tasks == 0

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                assert isinstance(item, Job)
                try:
                    item.run()  # a job cleans up after itself, even when it raises
                except BaseException as exc:  # a worker never dies of a job
                    self._on_error(self.name, exc)
            finally:
                self._queue.task_done()

    def _cancel_queued(self) -> int:
        cancelled = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return cancelled
            try:
                if isinstance(item, Job):
                    cancelled += 1
                    try:
                        item.cancel()
                    except BaseException as exc:
                        self._on_error(self.name, exc)
            finally:
                self._queue.task_done()

    def close(self, *, drain: bool, deadline: float, warn: bool = True) -> bool:
        """Stop the workers: run (``drain``) or cancel what is queued; True if all joined.

        ``warn`` logs the workers still busy at the deadline.

        ``deadline`` is a ``time.monotonic()`` value; queued jobs still waiting when it
        passes are cancelled, so close never waits on more than what is already running.
        """
        with self._lock:
            self._closed = True
        if drain:
            while self._queue.unfinished_tasks and time.monotonic() < deadline:
                time.sleep(0.002)
        self._cancel_queued()
        for _ in self._threads:
            while True:
                try:
                    self._queue.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
                    break
                except queue.Full:
                    if time.monotonic() >= deadline:
                        break
                    self._cancel_queued()
        return self.join(deadline, warn=warn)

    def join(self, deadline: float, *, warn: bool = False) -> bool:
        """Wait (until ``deadline``, a ``time.monotonic()`` value) for every worker to end."""
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive and warn:
            log.warning(
                "kvtier cache: %d %s worker(s) still busy after close's bound: %s",
                len(alive),
                self.name,
                ", ".join(alive),
            )
        return not alive
