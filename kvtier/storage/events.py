"""One event stream of what the storage tiers hold: stored, removed, promoted, evicted.

A :class:`~kvtier.storage.StorageChain` emits an :class:`Event` for every page that
enters or leaves one of its tiers; engine adapters subscribe to map them onto their
engines' KV events (so a cache-aware router sees kvtier's tiers), operators to watch
them. Subscribers run in the thread that emitted, right away, and must be quick; one
that raises is logged once and counted, never breaks the cache. :meth:`EventStream.recent`
keeps the last events for a subscriber that polls instead.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["Event", "EventKind", "EventStream", "Subscription"]

log = logging.getLogger("kvtier.cache")


class EventKind(str, enum.Enum):
    """What happened to a page in a tier."""

    STORED = "stored"  # written into the tier (by a put or a cascade)
    PROMOTED = "promoted"  # copied into the tier from a lower one that served a hit
    EVICTED = "evicted"  # removed to make room (capacity, a tenant's quota, a write-back)
    REMOVED = "removed"  # removed for another reason (deleted, found invalid, cleared)


@dataclass(frozen=True, slots=True)
class Event:
    """One page entering or leaving one tier."""

    kind: EventKind
    tier: int
    tier_name: str
    key: str
    tenant: str | None
    nbytes: int


class Subscription:
    """A subscriber's handle: :meth:`close` stops its events."""

    def __init__(self, stream: EventStream, callback: Callable[[list[Event]], object]) -> None:
        self._stream = stream
        self.callback = callback

    def close(self) -> None:
        """Stop receiving events (idempotent)."""
        self._stream.unsubscribe(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EventStream:
    """Fans events out to subscribers and keeps the last ``keep`` of them."""

    def __init__(self, keep: int = 4096) -> None:
        self._lock = threading.Lock()
        self._subscribers: list[Subscription] = []
        self._recent: deque[Event] = deque(maxlen=keep)
        self.emitted = 0
        self.subscriber_errors = 0
        self._warned = False

    def subscribe(self, callback: Callable[[list[Event]], object]) -> Subscription:
        """Call ``callback(events)`` with each batch of events from now on."""
        subscription = Subscription(self, callback)
        with self._lock:
            self._subscribers.append(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        with self._lock:
            if subscription in self._subscribers:
                self._subscribers.remove(subscription)

    def emit(self, events: Iterable[Event]) -> None:
        """Deliver a batch of events to every subscriber (in this thread)."""
        batch = list(events)
        if not batch:
            return
        with self._lock:
            self._recent.extend(batch)
            self.emitted += len(batch)
            subscribers = list(self._subscribers)
        for subscription in subscribers:
            try:
                subscription.callback(batch)
            except Exception as exc:  # a subscriber's bug never breaks the cache
                with self._lock:
                    self.subscriber_errors += 1
                    first, self._warned = not self._warned, True
                if first:
                    log.warning(
                        "kvtier: an event subscriber raised %r; its events are dropped "
                        "(counted as event_subscriber_errors)",
                        exc,
                    )

    def counts(self) -> dict[str, int]:
        """Events emitted, subscribers now, subscriber errors."""
        with self._lock:
            return {
                "emitted": self.emitted,
                "subscribers": len(self._subscribers),
                "subscriber_errors": self.subscriber_errors,
            }

    def recent(self) -> list[Event]:
        """The last events kept (oldest first)."""
        with self._lock:
            return list(self._recent)
