"""kvtier's storage tiers in SGLang's KV-event form: what SGLang's L3 holds, for routers.

SGLang publishes KV events (``sglang.srt.disaggregation.kv_events``) for its GPU cache (L1)
and its host pool (L2); its storage tier (L3) has none. kvtier's storage chain emits an
:class:`~kvtier.storage.events.Event` for every page entering or leaving one of its tiers;
:class:`KVEventLog` keeps those of SGLang's KV pool and hands them out as SGLang's own
event classes, one medium per tier:

- ``stored`` or ``promoted`` in tier *t* -> ``BlockStored(block_hashes=[h],
  parent_block_hash=p, token_ids=[], block_size=page_size, lora_id=None, medium=m(t))``;
- ``evicted`` or ``removed`` from tier *t* -> ``BlockRemoved(block_hashes=[h],
  medium=m(t))``.

``h`` is ``hash_str_to_int64`` of SGLang's page hash string, the part of the kvtier key
between the namespace and the rank suffix (:meth:`AttachedPool.raw_of`): the id SGLang's
own L1/L2 events give the same page (for requests without ``extra_key`` or
``cache_salt``, whose L1/L2 events SGLang hashes on another chain). ``m(t)`` is
``EXTERNAL`` where tier *t*'s backend declares :attr:`Feature.SHARED_NODES` (Mooncake:
other hosts see the page), else ``DISK`` (a local tier: file, uring, memory). ``p`` is the
page before ``h`` in SGLang's hash chain, learned from SGLang's own backups (in a
``batch_set`` SGLang passes a node's pages in chain order, the first one's parent as the
last of ``prefix_keys`` when it passes them) and kept for the last
:data:`PARENTS_KEPT` pages; None where unknown. ``token_ids`` is empty: storage sees page
hashes, never tokens, and an empty list is what a storage-level event can honestly carry
(Dynamo's indexers hash a block's tokens, so they skip such a store, and apply removals,
which need only the hash). As SGLang's own recorder does, consecutive stores of one medium
that extend one chain become one ``BlockStored``, and consecutive removals of one medium one
``BlockRemoved``.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
import types
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvtier.core.errors import StorageError
from kvtier.core.specs import Feature
from kvtier.core.storage import Counters
from kvtier.integrations.kv_events import BoundedLog, holds
from kvtier.integrations.sglang.pools import AttachedPool
from kvtier.integrations.sglang.settings import DOCS
from kvtier.storage.events import Event, Subscription

__all__ = [
    "PARENTS_KEPT",
    "KVEventLog",
    "KVEventPublishing",
    "hash_to_int64",
    "medium_of",
    "sglang_kv_events",
]

log = logging.getLogger(__name__)

#: How many pages' parents (the page before them in SGLang's chain) are remembered.
PARENTS_KEPT = 32768
#: How often the publishing thread hands the new events to SGLang's publisher.
PUBLISH_INTERVAL_S = 0.05
#: SGLang's page hashes are hex digests; anything else maps to no event.
_HEX = re.compile(r"[0-9a-f]+")


@functools.lru_cache(maxsize=1)
def sglang_kv_events() -> types.ModuleType:
    """SGLang's ``sglang.srt.disaggregation.kv_events`` (it needs ``msgspec`` and ``pyzmq``,
    which SGLang's install and ``scripts/install-sglang.sh`` bring)."""
    import importlib

    try:
        return importlib.import_module("sglang.srt.disaggregation.kv_events")
    except ImportError as exc:
        raise StorageError(
            f"kvtier's KV events are SGLang's classes, and sglang.srt.disaggregation."
            f"kv_events failed to import ({exc}); install SGLang's msgspec and pyzmq "
            f"(scripts/install-sglang.sh does), or set kvtier.kv_events_buffer to 0 ({DOCS})",
            value=str(exc),
        ) from exc


def hash_to_int64(page_hash: str) -> int | None:
    """SGLang's event id of a page hash: ``hash_str_to_int64`` of
    ``sglang/srt/mem_cache/utils.py`` (its first 16 hex digits as a signed 64-bit int),
    written out here because that module imports most of SGLang (seconds); a test checks
    the two agree. None for a string that is not hex (not one of SGLang's page hashes)."""
    if not _HEX.fullmatch(page_hash):
        return None
    value = int(page_hash[:16], 16)
    return value - (1 << 64) if value >= 1 << 63 else value


def medium_of(features: frozenset[Feature]) -> str:
    """The ``StorageMedium`` value of a tier whose backend declares ``features``:
    ``EXTERNAL`` for a store other hosts share (``shared_nodes``), else ``DISK``."""
    return "EXTERNAL" if Feature.SHARED_NODES in features else "DISK"


class KVEventLog:
    """The KV pool's storage events, kept until taken, as SGLang's KV events.

    At most ``capacity`` page events are kept between two :meth:`take` calls; beyond it the
    oldest are dropped (counted as ``kv_events_dropped`` in ``counters``). Events of keys
    that hold no SGLang page hash are counted as ``kv_events_unmapped`` and left out.
    """

    def __init__(self, page_size: int, capacity: int, counters: Counters) -> None:
        self.page_size = page_size
        self.capacity = capacity
        self.counters = counters
        #: (stored, medium, block hash) of each page event, oldest first.
        self._pending: BoundedLog[tuple[bool, str, int]] = BoundedLog(
            capacity, counters, "kv_events_dropped"
        )
        #: Guards ``_parents`` (learned on SGLang's threads, read by :meth:`take`).
        self._lock = threading.Lock()
        self._parents: OrderedDict[int, int] = OrderedDict()
        self._subscriptions: list[Subscription] = []

    def watch(self, pool: AttachedPool[Any]) -> None:
        """Receive the events of ``pool``'s storage chain from now on."""
        media = [medium_of(tier.backend.features) for tier in pool.plan.storage_tiers()]

        def on_events(events: list[Event]) -> None:
            self._record(pool, media, events)

        self._subscriptions.append(pool.store.events.subscribe(on_events))

    def _record(self, pool: AttachedPool[Any], media: list[str], events: list[Event]) -> None:
        """Keep ``events`` (called in the chain's thread that emitted them: quick)."""
        rows = []
        unmapped = 0
        for event in events:
            raw = pool.raw_of(event.key)
            block = hash_to_int64(raw) if raw is not None else None
            if block is None or not 0 <= event.tier < len(media):
                unmapped += 1
                continue
            rows.append((holds(event.kind), media[event.tier], block))
        if unmapped:
            self.counters.add("kv_events_unmapped", unmapped)
        self._pending.extend(rows)

    def learn(self, page_hashes: Sequence[str], prefix_keys: Sequence[str] | None) -> None:
        """Remember each page's parent from one of SGLang's backups: ``page_hashes`` in
        chain order, ``prefix_keys`` (SGLang's ``extra_info.prefix_keys``) the pages before."""
        previous = hash_to_int64(prefix_keys[-1]) if prefix_keys else None
        with self._lock:
            for page_hash in page_hashes:
                block = hash_to_int64(page_hash)
                if block is not None and previous is not None and block != previous:
                    self._parents[block] = previous
                    self._parents.move_to_end(block)
                    if len(self._parents) > PARENTS_KEPT:
                        self._parents.popitem(last=False)
                previous = block

    def take(self) -> list[Any]:
        """The events since the last call, oldest first, as SGLang's ``BlockStored`` and
        ``BlockRemoved`` (consecutive ones coalesced as SGLang's recorder coalesces)."""
        rows = self._pending.take()
        with self._lock:
            parents = {block: self._parents.get(block) for stored, _, block in rows if stored}
        if not rows:
            return []
        kv_events = sglang_kv_events()
        out: list[Any] = []
        for stored, medium_name, block in rows:
            medium = kv_events.StorageMedium(medium_name)
            tail = out[-1] if out else None
            if stored:
                parent = parents.get(block)
                if (
                    isinstance(tail, kv_events.BlockStored)
                    and tail.medium == medium
                    and parent is not None
                    and tail.block_hashes[-1] == parent
                ):
                    tail.block_hashes.append(block)
                    continue
                out.append(
                    kv_events.BlockStored(
                        block_hashes=[block],
                        parent_block_hash=parent,
                        token_ids=[],
                        block_size=self.page_size,
                        lora_id=None,
                        medium=medium,
                    )
                )
            elif isinstance(tail, kv_events.BlockRemoved) and tail.medium == medium:
                tail.block_hashes.append(block)
            else:
                out.append(kv_events.BlockRemoved(block_hashes=[block], medium=medium))
        self.counters.add("kv_events_emitted", len(rows))
        return out

    def publish(self, publisher: Any) -> int:
        """Hand the events since the last take to an SGLang ``EventPublisher`` as one
        ``KVEventBatch``; returns the number of events (0: nothing published)."""
        events = self.take()
        if events:
            batch = sglang_kv_events().KVEventBatch(ts=time.time(), events=events)
            publisher.publish(batch)
        return len(events)

    def close(self) -> None:
        """Stop receiving events (idempotent)."""
        subscriptions, self._subscriptions = self._subscriptions, []
        for subscription in subscriptions:
            subscription.close()


class KVEventPublishing:
    """A thread that hands :class:`KVEventLog`'s events to an SGLang publisher every
    :data:`PUBLISH_INTERVAL_S` seconds, and once more when closed."""

    def __init__(self, events: KVEventLog, publisher: Any, counters: Counters) -> None:
        self.events = events
        self.publisher = publisher
        self.counters = counters
        self._stop = threading.Event()
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="kvtier-kv-events", daemon=True)
        self._thread.start()

    def _publish(self) -> None:
        try:
            self.events.publish(self.publisher)
        except Exception as exc:  # a publisher's failure never reaches SGLang's threads
            self.counters.add("kv_events_publish_errors")
            if not self._warned:
                self._warned = True
                log.warning(
                    "kvtier: publishing KV events failed (%r); later failures are counted "
                    "as kv_events_publish_errors only",
                    exc,
                )

    def _run(self) -> None:
        while not self._stop.wait(PUBLISH_INTERVAL_S):
            self._publish()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread, publish what is left, and shut the publisher down (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout)
        self._publish()
        try:
            self.publisher.shutdown()
        except Exception as exc:  # closing must finish whatever the publisher does
            log.warning("kvtier: the KV event publisher's shutdown raised %r", exc)
