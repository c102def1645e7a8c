"""A publish gate for pages written straight from memory their owner may take back.

An engine that stores pages zero-copy from its own blocks (vLLM's CPU engine) may have to
take the blocks back while the write still runs: a preempted request's blocks are reused
after a bounded wait. From then on the bytes under the write may be another key's. A
:class:`SaveGuard` is handed to :meth:`~kvtier.core.pagestore.PageStore.put` with such
pages; the owner calls :meth:`SaveGuard.trip` before it reuses them. The page store
checksums a guarded page only inside :meth:`SaveGuard.sealing`, and once the guard is
tripped it writes an envelope that never verifies instead (``docs/integrity.md``): so
after ``trip()`` returns no checksum over reusable bytes is being computed, and none will
be. A page checksummed before the trip carries its original bytes' checksum; if its
payload changed under the write, full verification rejects it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["SaveGuard"]


class SaveGuard:
    """Whether the memory of a save is still its owner's to publish (see the module)."""

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._tripped = False
        self._sealing = 0

    @property
    def tripped(self) -> bool:
        """Whether :meth:`trip` was called."""
        return self._tripped

    def trip(self) -> None:
        """The owner takes the memory back: every later seal fails. Returns once no seal
        begun before is still running (a checksum of one page in memory: brief)."""
        with self._cv:
            self._tripped = True
            while self._sealing:
                self._cv.wait()

    def sealing(self, seal: Callable[[], None], refuse: Callable[[], None]) -> bool:
        """Run ``seal`` (write a page's envelope from the guarded memory) unless the guard
        is tripped, else ``refuse`` (write one that never verifies); True if sealed.

        Seals run concurrently with each other; :meth:`trip` waits for those running."""
        with self._cv:
            if self._tripped:
                refuse()
                return False
            self._sealing += 1
        try:
            seal()
        finally:
            with self._cv:
                self._sealing -= 1
                if not self._sealing:
                    self._cv.notify_all()
        return True
