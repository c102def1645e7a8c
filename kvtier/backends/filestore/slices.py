"""A batch cut into one contiguous slice per thread: how the file backends spread work.

One hand-off per thread, not per page: a hand-off costs tens of microseconds here, more
than a small page's copy. The calling thread works the first slice itself.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

from kvtier.core.storage import PageBuffers

__all__ = ["CPUS", "MIN_SLICE_BYTES", "Slices", "copy_threads"]

_T = TypeVar("_T")

#: CPUs this process may run on: warm copies scale with these, not with more threads.
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
#: Least bytes of warm pages worth a hand-off to another thread (about 50 µs here).
MIN_SLICE_BYTES = 1 << 20


def copy_threads(pages: Sequence[PageBuffers]) -> int:
    """Threads for a batch that only copies (page-cache reads, in-place overwrites): at
    most one per CPU and per :data:`MIN_SLICE_BYTES`. Nothing waits, so more threads
    only take turns on the CPUs, and a hand-off costs more than a small page's copy."""
    page_bytes = sum(e.length for e in pages[0]) if pages else 0
    return min(CPUS, max(1, len(pages) * page_bytes // MIN_SLICE_BYTES))


class Slices:
    """Up to ``threads`` threads for a batch: the caller's and a pool started on first use."""

    def __init__(self, threads: int, name: str) -> None:
        self.threads = threads
        self._name = name
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def spread(
        self, run: Callable[[int, int], list[_T]], count: int, most: int | None = None
    ) -> list[_T]:
        """``run(lo, hi)`` for consecutive slices of ``range(count)``, one per thread.

        Every slice is finished before this returns or raises; the results are
        concatenated in order. ``most`` caps the threads used.
        """
        threads = min(self.threads, count, most or count)
        if threads <= 1:
            return run(0, count)
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    self.threads - 1 or 1, thread_name_prefix=self._name
                )
            executor = self._executor
        bounds = [count * t // threads for t in range(threads + 1)]
        futures = [executor.submit(run, bounds[t], bounds[t + 1]) for t in range(1, threads)]
        try:
            results = run(bounds[0], bounds[1])
        finally:
            wait(futures)
        for future in futures:
            results.extend(future.result())
        return results

    def close(self) -> None:
        """Stop the pool once its slices are done (a later ``spread`` starts a new one)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
