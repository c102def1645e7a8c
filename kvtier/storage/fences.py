"""Which keys have writes in flight in the storage chain, and which were revoked meanwhile.

A write into a tier (the engine's put into the first tier, a queued or running cascade,
write-back or promotion, a call that timed out and may still land) *enters* its keys
here and *leaves* when it is over. :meth:`KeyFences.revoke` (the chain's ``delete``,
``taint`` and ``clear``) marks every key in flight: a queued write skips it, and a write
that was running undoes itself in the tier it wrote (the tier's copy is deleted once the
call returned). A write that enters after the revocation is not affected: a put that
starts after a delete is a new page.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from kvtier.storage.pins import count_in, count_out

__all__ = ["KeyFences", "Ticket"]


class Ticket:
    """One write's keys and the revocation count of each when it entered."""

    __slots__ = ("keys", "seen")

    def __init__(self, keys: list[str], seen: list[int]) -> None:
        self.keys = keys
        self.seen = seen


class KeyFences:
    """Keys with writes in flight, and a revocation count per such key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, int] = {}
        self._revoked: dict[str, int] = {}
        self._all = 0  # revocations of every key (clear)

    def enter(self, keys: Sequence[str]) -> Ticket:
        """A write of ``keys`` starts (or is queued)."""
        keys = list(keys)
        with self._lock:
            count_in(self._live, keys)
            revoked = self._revoked
            return Ticket(keys, [revoked.get(key, 0) + self._all for key in keys])

    def carry(self, ticket: Ticket, keys: Sequence[str]) -> Ticket:
        """Enter ``keys`` (some of ``ticket``'s, which must not have left yet) as a write
        that continues ``ticket``'s: a revocation since ``ticket`` entered voids it too."""
        keys = list(keys)
        seen = dict(zip(ticket.keys, ticket.seen, strict=True))
        with self._lock:
            count_in(self._live, keys)
        return Ticket(keys, [seen[key] for key in keys])

    def leave(self, ticket: Ticket) -> None:
        """The write is over (written, given up, or its late call returned)."""
        with self._lock:
            live = self._live
            for key in count_out(live, ticket.keys):
                self._revoked.pop(key, None)
            if not live:
                self._all = 0
                self._revoked.clear()

    def revoke(self, keys: Iterable[str]) -> int:
        """``keys`` were deleted or tainted: every write of them in flight now is void.
        Returns how many of them had writes in flight."""
        count = 0
        with self._lock:
            live, revoked = self._live, self._revoked
            for key in keys:
                if key in live:
                    revoked[key] = revoked.get(key, 0) + 1
                    count += 1
        return count

    def revoke_all(self) -> None:
        """Every key was removed (``clear``): every write in flight now is void."""
        with self._lock:
            if self._live:
                self._all += 1

    def revoked(self, ticket: Ticket, keys: Iterable[str] | None = None) -> set[str]:
        """Which of the ticket's keys (or of ``keys``, a subset) were revoked since it
        entered."""
        wanted = None if keys is None else set(keys)
        with self._lock:
            revoked, everything = self._revoked, self._all
            return {
                key
                for key, seen in zip(ticket.keys, ticket.seen, strict=True)
                if (wanted is None or key in wanted) and revoked.get(key, 0) + everything != seen
            }

    def in_flight(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key has a write in flight."""
        with self._lock:
            return [key in self._live for key in keys]
