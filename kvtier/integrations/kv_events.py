"""What engine adapters share to turn kvtier's tier events into their engines' KV events.

A :class:`~kvtier.storage.StorageChain` emits an :class:`~kvtier.storage.events.Event`
for every page entering or leaving one of its tiers. An engine adapter that tells its
engine (and a KV-aware router behind it) what kvtier's tiers hold needs the same three
things, whatever the engine's event classes:

- which events mean "the tier holds the page now" (:func:`holds`): stored and promoted,
  against evicted and removed;
- a bounded, thread-safe log (:class:`BoundedLog`): events arrive on the chain's threads
  and must be quick; the adapter takes them when its engine asks, and an event beyond the
  bound is dropped and counted rather than held without limit. SGLang's
  :class:`~kvtier.integrations.sglang.events.KVEventLog` and vLLM's scheduler keep their
  events in one; :class:`TierEventFeed` keeps a chain's events in the adapter's own key
  space in one (vLLM's workers);
- where a tier's pages live, by what its backend declares (:func:`tier_locality`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, Literal, TypeVar

from kvtier.core.specs import Feature
from kvtier.core.storage import Counters
from kvtier.storage.events import Event, EventKind, EventStream, Subscription

__all__ = ["BoundedLog", "TierEvent", "TierEventFeed", "holds", "tier_locality"]

#: One page event as an adapter keeps it: (the tier holds it now, tier index, key).
TierEvent = tuple[bool, int, str]
Locality = Literal["host", "disk", "remote"]
Row = TypeVar("Row")


def holds(kind: EventKind) -> bool:
    """Whether an event of ``kind`` leaves the page in its tier (stored or promoted),
    rather than out of it (evicted or removed)."""
    return kind in (EventKind.STORED, EventKind.PROMOTED)


def tier_locality(features: frozenset[Feature]) -> Locality:
    """Where a tier whose backend declares ``features`` keeps its pages: ``remote`` for a
    store other hosts share (``shared_nodes``, Mooncake), ``disk`` for a persistent local
    one (file, uring, segment), else ``host`` (this process's memory)."""
    if Feature.SHARED_NODES in features:
        return "remote"
    if Feature.PERSISTENT in features:
        return "disk"
    return "host"


class BoundedLog(Generic[Row]):
    """Rows kept until taken, at most ``capacity`` (at least one) between two
    :meth:`take` calls: beyond it the oldest are dropped and counted as
    ``dropped_counter`` in ``counters``. Thread-safe, and quick to add to (writers are
    the chain's threads)."""

    def __init__(self, capacity: int, counters: Counters, dropped_counter: str) -> None:
        self.capacity = max(1, capacity)
        self._counters = counters
        self._dropped = dropped_counter
        self._lock = threading.Lock()
        self._rows: deque[Row] = deque(maxlen=self.capacity)

    def extend(self, rows: Sequence[Row]) -> None:
        """Keep ``rows`` after the ones kept, dropping (and counting) the oldest over the bound."""
        if not rows:
            return
        with self._lock:
            over = len(self._rows) + len(rows) - self.capacity
            self._rows.extend(rows)
        if over > 0:
            self._counters.add(self._dropped, over)

    def take(self) -> list[Row]:
        """The rows since the last call, oldest first."""
        with self._lock:
            rows = list(self._rows)
            self._rows.clear()
        return rows


class TierEventFeed:
    """A chain's page events, mapped to the adapter's keys, kept until taken.

    ``key_of`` maps a storage key to the adapter's key (a vLLM base key without this
    rank's suffix, say), or None for a key that is not the adapter's (such events are
    left out). At most ``capacity`` events wait between two :meth:`take` calls; beyond
    it the oldest are dropped and counted as ``dropped_counter`` in ``counters``.
    """

    def __init__(
        self,
        events: EventStream,
        key_of: Callable[[str], str | None],
        *,
        capacity: int,
        counters: Counters,
        dropped_counter: str = "kv_events_dropped",
    ) -> None:
        self.capacity = max(0, capacity)
        self._key_of = key_of
        self._log: BoundedLog[TierEvent] = BoundedLog(capacity, counters, dropped_counter)
        self._subscription: Subscription | None = (
            events.subscribe(self._record) if self.capacity else None
        )

    def _record(self, events: list[Event]) -> None:
        """Keep ``events`` (on the chain's thread that emitted them: quick)."""
        rows: list[TierEvent] = []
        for event in events:
            key = self._key_of(event.key)
            if key is not None:
                rows.append((holds(event.kind), event.tier, key))
        self._log.extend(rows)

    def take(self) -> list[TierEvent]:
        """The events since the last call, oldest first."""
        return self._log.take()

    def close(self) -> None:
        """Stop receiving events (idempotent)."""
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            subscription.close()
