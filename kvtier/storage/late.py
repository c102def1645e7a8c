"""Puts the chain makes into a tier, and their late side.

A bounded put that times out may still be writing: the pages it was given stay
quarantined and its keys fenced until it returns; what it wrote of a key deleted or
tainted meanwhile is then deleted (:func:`undo_revoked`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.core.bounded import Outcome
from kvtier.core.pagestore import BatchResult, PageStore
from kvtier.core.saveguard import SaveGuard
from kvtier.storage.fences import KeyFences, Ticket
from kvtier.storage.staging import StagingPool
from kvtier.storage.tiers import Tier

__all__ = ["LateWrite", "MakeLate", "put_call", "undo_revoked"]

log = logging.getLogger("kvtier.cache")


def undo_revoked(
    fences: KeyFences, tier: Tier, keys: list[str], results: Sequence[bool] | None, ticket: Ticket
) -> set[str]:
    """Delete from ``tier`` the keys a put wrote (``results``; None: unknown, maybe all)
    that were deleted or tainted since ``ticket`` entered; returns them."""
    revoked = fences.revoked(ticket, keys)
    if not revoked:
        return set()
    if results is not None and len(results) == len(keys):
        gone = [key for key, ok in zip(keys, results, strict=True) if ok and key in revoked]
    else:
        gone = [key for key in keys if key in revoked]
    if gone:
        tier.counters.add("cancelled", len(gone))
        try:
            answer = tier.store.delete(gone)
        except Exception as exc:  # a closed store: nothing is served from it any more
            log.warning("kvtier: removing %d revoked pages raised %r", len(gone), exc)
        else:
            if not all(answer):
                tier.counters.add("failures")
                log.warning(
                    "kvtier: tier %s did not remove %d pages deleted or tainted while "
                    "they were being written (its delete failed)",
                    tier.name,
                    len(answer) - sum(answer),
                )
    return set(gone)


class LateWrite:
    """The late side of one put the chain makes: if the call times out, the staging pages
    it was given (``staged``; None: the caller's pages, the caller holds them) stay
    quarantined and its keys fenced until it returns; then what it wrote of a key deleted
    or tainted meanwhile is deleted, and ``then(result)`` (the caller's ``on_late``) runs.

    ``timed_out`` (the caller saw the timeout) and ``returned`` (the call's ``on_late``)
    may come in either order.
    """

    def __init__(
        self,
        fences: KeyFences,
        staging: StagingPool,
        tier: Tier,
        keys: list[str],
        staged: list[int] | None,
        ticket: Ticket,
        then: Callable[[Any], None] | None,
    ) -> None:
        self._fences = fences
        self._staging = staging
        self._tier = tier
        self._keys = keys
        self._staged = staged
        self._ticket = ticket
        self._then = then
        self._lock = threading.Lock()
        self._returned = False
        self._held: Ticket | None = None

    def timed_out(self) -> None:
        """The put reported ``TIMED_OUT``: hold what it still uses until it returns."""
        with self._lock:
            if self._returned:  # it returned between the timeout and now: nothing held
                return
            # the caller's ticket is still live here, so no revocation is missed
            self._held = self._fences.carry(self._ticket, self._keys)
            if self._staged is not None:
                count = self._staging.quarantine(self._staged)
                self._tier.counters.add("quarantined_pages", count)

    def returned(self, result: Any) -> None:
        """The put's ``on_late``: it returned at last."""
        with self._lock:
            self._returned = True
            held, self._held = self._held, None
        try:
            if held is not None and self._staged is not None:
                self._staging.unquarantine(self._staged)
            written = result if isinstance(result, list) else None
            undo_revoked(self._fences, self._tier, self._keys, written, held or self._ticket)
        finally:
            if held is not None:
                self._fences.leave(held)
            if self._then is not None:
                self._then(result)


#: Makes the late side of one backend call of a put, for its keys and pages.
MakeLate = Callable[[list[str], list[int]], LateWrite]


def put_call(
    store: PageStore,
    keys: list[str],
    pages: list[int],
    late: MakeLate,
    guards: Sequence[SaveGuard | None] | None,
) -> BatchResult:
    """One bounded put; if it times out, its late side holds what it still uses."""
    if not keys:
        return BatchResult()
    side = late(keys, pages)
    answer = store.put(keys, pages, on_late=side.returned, guards=guards)
    if answer.outcome is Outcome.TIMED_OUT:
        side.timed_out()
    return answer
