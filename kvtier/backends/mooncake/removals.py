"""Deletes that Mooncake refused while a reader's lease was on the object.

A get protects an object from removal for the master's ``default_kv_lease_ttl``, so a
key deleted right after it was read stays in the store for a while. A deleted key must
not be served meanwhile (the chain deletes a tainted key, and a key whose cascade it
cancelled, expecting it gone), so this client keeps such keys here: it answers them as
missing, refuses to put them over the stale object, and retries the removal on its next
calls until Mooncake removes the object or finds it gone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence

from kvtier.backends.mooncake.codes import OBJECT_NOT_FOUND

__all__ = ["DeferredRemovals"]


class DeferredRemovals:
    """Object keys whose removal Mooncake refused, hidden until a retry removes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: set[str] = set()

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, okeys: Iterable[str]) -> None:
        """Hide ``okeys`` until their removal succeeds."""
        with self._lock:
            self._pending.update(okeys)

    def hidden(self, okeys: Sequence[str]) -> list[bool]:
        """Whether each object key still awaits its removal (answer it as missing)."""
        if not self._pending:
            return [False] * len(okeys)
        with self._lock:
            return [k in self._pending for k in okeys]

    def retry(self, remove: Callable[[list[str]], Sequence[int]]) -> int:
        """Try the pending removals again with ``remove`` (Mooncake's ``batch_remove``);
        forget the keys removed or already gone. Returns how many were."""
        if not self._pending:
            return 0
        with self._lock:
            keys = sorted(self._pending)
        codes = remove(keys)
        done = [
            k for k, code in zip(keys, codes, strict=True) if code >= 0 or code == OBJECT_NOT_FOUND
        ]
        with self._lock:
            self._pending.difference_update(done)
        return len(done)

    def clear(self) -> int:
        """Forget every pending key (the store was cleared); how many there were."""
        with self._lock:
            count = len(self._pending)
            self._pending.clear()
        return count
