"""The chain of storage tiers behind one page memory: the routing of get, exists, put,
delete and taint across its tiers, with the page store's API (:class:`~kvtier.core.store.Store`).

:func:`~kvtier.storage.opening.open_store` opens a plan's tiers, fastest first, each a
:class:`~kvtier.core.pagestore.PageStore` over the same page memory (its guards: bounded
calls, counters, envelope checks), and puts a :class:`StorageChain` in front of them. The
chain is what every engine path talks to (TieredCache, the vLLM and SGLang adapters), so
a chain of one behaves as its page store did, and more tiers change nothing upstream:

- **put** stores into the first tier, in the caller's call. Pages then cascade down on a
  worker, read back from the tier above into a staging pool: into each tier whose
  ``write`` is ``through`` (through its admission policy), and into a ``back`` tier only
  when the tier above evicts them to make room. The cascade queue is bounded in pages: a
  slow or full lower tier drops pages (counted), it never blocks the tier above.
- **get** reads each page from the first tier that holds a valid copy: a page missing,
  or failing verification, in one tier is asked of the next. A page found in a lower tier
  whose ``promote`` is on is copied into staging and written up into the tiers above
  (through their admission) on the worker; a full staging pool drops the promotion.
  :meth:`StorageChain.pending` says which pages have a promotion queued or running.
- **exists** answers whether any tier holds the page. A tier that fails a call (a hung
  backend, a master gone) counts as not holding the pages and is counted; the others
  keep serving. A tier with a call stuck past its bound is not asked at all by
  ``exists`` and ``get`` until that call returns (:meth:`StorageChain.bypassed`).
- **late calls**: a cascade, write-back or promotion call that times out may still use
  its staging pages; they stay quarantined (:mod:`kvtier.storage.staging`, counted
  ``quarantined_pages``) until it returns, so a recycled page never carries another
  key's bytes into it.
- **delete / taint**: :meth:`StorageChain.delete` and :meth:`StorageChain.taint` cancel
  the queued cascades, write-backs and promotions of their keys, and a write of them
  still running (or timed out) deletes its copy once its call returned
  (:mod:`kvtier.storage.fences`, counted ``cancelled``).
- **space**: each tier's space manager (:mod:`~kvtier.storage.space`) decides what leaves it.
- **pins** (:class:`~kvtier.storage.pins.PinSet`): no tier evicts a pinned page (the
  space manager's choices and a backend's own both go through the tier's
  :class:`~kvtier.storage.observed.ObservedEviction`). A running load (TieredCache's
  prefetch, until its handle is released) pins the pages it found.
- **write-back**: every eviction the chain makes out of a tier whose next tier is
  ``write: back`` (to make room for a put, a cascade or a promotion, or for a quota)
  hands the victim down first; one that cannot be handed down (no staging page, a full
  queue) is a counted drop of the tier below.
- **quotas**: a tenant (the tenant of the key's namespace, see ``tenants`` in the
  config) over its ``quota_bytes`` in a tier has its own pages evicted there first.

Every page entering or leaving a tier is an :class:`~kvtier.storage.events.Event`.

The jobs are split: this module routes; :mod:`~kvtier.storage.cascade` queues and writes
the cascades, write-backs and promotions; :mod:`~kvtier.storage.placement` decides where
pages go and what leaves a tier; :mod:`~kvtier.storage.stats` merges the figures;
:mod:`~kvtier.storage.parents` gives the tiers' policies each page's parent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvtier.core.bounded import Outcome
from kvtier.core.capabilities import ResolvedPlan
from kvtier.core.errors import InvalidFieldError
from kvtier.core.metrics import registered_counters
from kvtier.core.pagestore import BatchResult, PageMemory
from kvtier.core.saveguard import SaveGuard
from kvtier.core.storage import StorageBackend
from kvtier.storage.cascade import DEFAULT_QUEUE_PAGES, Cascade, Job
from kvtier.storage.events import EventKind, EventStream
from kvtier.storage.fences import Ticket
from kvtier.storage.late import LateWrite, undo_revoked
from kvtier.storage.lookup import exists_across
from kvtier.storage.observed import Departure
from kvtier.storage.parents import checked_parents
from kvtier.storage.pins import PinSet
from kvtier.storage.placement import Placement
from kvtier.storage.staging import StagingPool
from kvtier.storage.stats import backend_stats, call_counts, store_stats, tier_stats
from kvtier.storage.tiers import ChainParts, Tier, keys_where

__all__ = ["StorageChain"]


class StorageChain:
    """The tiers of one plan behind one page memory (see the module docstring)."""

    def __init__(
        self,
        plan: ResolvedPlan,
        tiers: list[Tier],
        pool: PageMemory,
        *,
        queue_pages: int = DEFAULT_QUEUE_PAGES,
        events: EventStream | None = None,
        pins: PinSet | None = None,
    ) -> None:
        if isinstance(queue_pages, bool) or not isinstance(queue_pages, int) or queue_pages < 1:
            raise InvalidFieldError(
                "queue_pages",
                f"must be a positive number of pages, got {queue_pages!r}",
                value=queue_pages,
            )
        self.plan = plan
        self.tiers = tiers
        self.pool = pool
        #: Keys no tier may evict now (see :meth:`pin`).
        self.pins = pins if pins is not None else PinSet()
        self._parts = ChainParts(plan, tiers, pool, events or EventStream(), self.pins)
        self.events = self._parts.events
        #: A chain of several tiers counts its prefix lookups here (a page store's names).
        self.counters = registered_counters("page_store")
        self._cascade = Cascade(self._parts, queue_pages)
        self._placement = Placement(self._parts, self._cascade)
        self._cascade.write_staged = self._placement.write_staged
        self._closed = False

    # --- what a page store has --------------------------------------------------------

    @property
    def backend(self) -> StorageBackend:
        """The first tier's backend."""
        return self.tiers[0].store.backend

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def queue_pages(self) -> int:
        """Most pages the cascade queue holds (beyond it, jobs are cut and counted drops)."""
        return self._cascade.queue_pages

    @property
    def staging(self) -> StagingPool:
        """The staging pages of cascades, write-backs and promotions (their free and
        quarantined counts)."""
        return self._parts.staging

    def exists(self, keys: Sequence[str]) -> BatchResult:
        """Whether any tier holds each key (one batched call per tier, for the rest)."""
        tiers = self.tiers
        return exists_across(
            [tier.store for tier in tiers], keys, lambda i: tiers[i].counters.add("failures")
        )

    def prefix_hits(self, keys: Sequence[str]) -> int:
        """How many leading keys some tier holds (counted as a page store counts it)."""
        if len(self.tiers) == 1:
            return self.tiers[0].store.prefix_hits(keys)
        hits = self.exists(keys).leading()
        self.counters.add("prefix_queries")
        self.counters.add("prefix_pages", hits)
        return hits

    def get(
        self,
        keys: Sequence[str],
        pages: Sequence[int],
        *,
        on_late: Callable[[Any], None] | None = None,
        verdicts: dict[int, str] | None = None,
    ) -> BatchResult:
        """Fill pages from the first tier holding a valid copy; promote lower-tier hits.

        ``verdicts``, when given, receives the verdict of each page proven bad in the
        whole chain (as :meth:`PageStore.get` gives it): one that failed verification in a
        tier, was served by none, and that every tier asked answered for (a miss or
        another rejection). A page a tier could not answer for (its call failed) gets no
        entry: a good copy may still be there, so nothing is known against it.

        A tier with a call stuck past its bound (:meth:`bypassed`) is not asked: the next
        tier is, at once (counted ``bypasses``). A call that times out here fails the whole
        get (``TIMED_OUT``): the late call may still write into the caller's pages, so no
        other tier may fill them; the gets after it skip that tier until the call returns.
        """
        keys, pages = list(keys), list(pages)
        if len(self.tiers) == 1:
            first = self.tiers[0]
            started = time.perf_counter()
            result = first.store.get(keys, pages, on_late=on_late, verdicts=verdicts)
            first.counters.add("get_seconds", time.perf_counter() - started)
            first.counters.add("get_calls")
            return result
        # a page read here may be promoted: a delete or taint from now on cancels that
        ticket = self._parts.fences.enter(keys)
        try:
            return self._get_chained(keys, pages, on_late, verdicts, ticket)
        finally:
            self._parts.fences.leave(ticket)

    def _get_chained(
        self,
        keys: list[str],
        pages: list[int],
        on_late: Callable[[Any], None] | None,
        verdicts: dict[int, str] | None,
        ticket: Ticket,
    ) -> BatchResult:
        """:meth:`get` over several tiers."""
        results = [False] * len(keys)
        source: dict[int, int] = {}
        rejected: dict[int, str] = {}
        unanswered: set[int] = set()
        todo = list(range(len(keys)))
        for tier in self.tiers:
            if not todo:
                break
            if self.bypassed(tier):
                tier.counters.add("bypasses")
                unanswered.update(todo)
                continue
            started = time.perf_counter()
            found: dict[int, str] = {}
            answer = tier.store.get(
                [keys[i] for i in todo], [pages[i] for i in todo], on_late=on_late, verdicts=found
            )
            tier.counters.add("get_seconds", time.perf_counter() - started)
            tier.counters.add("get_calls")
            if answer.outcome is Outcome.TIMED_OUT:
                # the backend may still write into these pages: no other tier may fill them
                tier.counters.add("failures")
                return BatchResult(results, Outcome.TIMED_OUT)
            if answer.outcome is not Outcome.OK:
                tier.counters.add("failures")
                unanswered.update(todo)
                continue
            rest = []
            for at, (i, ok) in enumerate(zip(todo, answer, strict=True)):
                if ok:
                    results[i] = True
                    source[i] = tier.index
                else:
                    if at in found:
                        rejected[i] = found[at]
                    rest.append(i)
            todo = rest
        if verdicts is not None:
            for i, reason in rejected.items():
                if not results[i] and i not in unanswered:
                    verdicts[i] = reason
        self._placement.after_hit(keys, pages, source, ticket)
        return BatchResult(results)

    def put(
        self,
        keys: Sequence[str],
        pages: Sequence[int],
        *,
        on_late: Callable[[Any], None] | None = None,
        guards: Sequence[SaveGuard | None] | None = None,
        parents: Sequence[str | None] | None = None,
    ) -> BatchResult:
        """Store into the first tier now; cascade down (write-through) on the worker.

        ``on_late``, ``guards`` and the result's ``outcome`` are the first tier's (see
        :meth:`PageStore.put`); a put that timed out cascades nothing. A key deleted or
        tainted (:meth:`delete`, :meth:`taint`) while this put ran is not kept: its copy
        is deleted once the call returned, and its result is False.

        ``parents`` (one per key) is each page's real parent, which every tier's policies
        are told (here, and in the cascades, write-backs and promotions of the page); None
        takes the key before it in ``keys``, right only for one sequence's consecutive
        pages (see :meth:`kvtier.core.store.Store.put`).
        """
        keys, pages = list(keys), list(pages)
        parents = checked_parents(keys, parents)
        first = self.tiers[0]
        self._placement.describe(first, keys, parents)
        over = self._placement.enforce_quota(first, keys)
        if not over:
            return self._put_first(keys, pages, parents, on_late, guards)
        # pages a tenant's quota cannot take, even once its own older ones left: refused
        kept = [i for i, key in enumerate(keys) if key not in over]
        results = BatchResult([False] * len(keys))
        if kept:
            part = self._put_first(
                [keys[i] for i in kept],
                [pages[i] for i in kept],
                [parents[i] for i in kept],
                on_late,
                None if guards is None else [guards[i] for i in kept],
            )
            results.outcome = part.outcome
            for i, ok in zip(kept, part, strict=True):
                results[i] = ok
        return results

    def _put_first(
        self,
        keys: list[str],
        pages: list[int],
        parents: list[str | None],
        on_late: Callable[[Any], None] | None,
        guards: Sequence[SaveGuard | None] | None,
    ) -> BatchResult:
        """:meth:`put`'s pages that the first tier's quotas take, described there
        already: into the first tier now, then the write-through cascade."""
        first = self.tiers[0]
        placement, parts = self._placement, self._parts
        ticket = parts.fences.enter(keys)
        try:

            def late(names: list[str], _pages: list[int]) -> LateWrite:
                return LateWrite(parts.fences, parts.staging, first, names, None, ticket, on_late)

            results, _, arrived = placement.put_into(
                first, first.store, keys, pages, late=late, must=True, guards=guards
            )
            undone = undo_revoked(parts.fences, first, keys, results, ticket)
            for i, key in enumerate(keys):
                if key in undone:
                    results[i] = False
            stored = keys_where(keys, results, but=arrived)  # (arrived: evicted at once)
            parts.emit(EventKind.STORED, first, stored)
            targets = parts.through_below(0)
            if stored and targets:
                job = Job(stored, targets, 0, EventKind.STORED)
                job.parents = dict(zip(keys, parents, strict=True))
                self._cascade.submit(job, since=ticket)
        finally:
            parts.fences.leave(ticket)
        return results

    def delete(self, keys: Sequence[str]) -> BatchResult:
        """Remove each key from every tier; True where some tier removed it.

        Queued cascades, write-backs and promotions of the keys are cancelled, and one
        running now (or a put that timed out and may still land) deletes its copy once
        its call returned, so no tier keeps a key deleted here.
        """
        keys = list(keys)
        self._parts.fences.revoke(keys)
        return self._delete_everywhere(keys)

    def taint(self, keys: Sequence[str]) -> int:
        """The source of ``keys``' pages may have changed (a preempted request's blocks
        reused while its save ran): no copy of them may stay visible.

        Every tier's copy is deleted now; queued cascades, write-backs and promotions of
        the keys are cancelled; a put, cascade or promotion of them still running (or
        timed out, and still able to land) deletes what it wrote once its call returns
        (counted ``cancelled`` on the tier). Returns how many of the keys had such a
        write in flight (their copies go when those calls end).
        """
        keys = list(keys)
        in_flight = self._parts.fences.revoke(keys)
        self._delete_everywhere(keys)
        return in_flight

    def _delete_everywhere(self, keys: list[str]) -> BatchResult:
        removed = [False] * len(keys)
        for tier in self.tiers:
            answer = tier.store.delete(keys)
            for i, ok in enumerate(answer):
                removed[i] = removed[i] or ok
        return BatchResult(removed)

    def clear(self) -> bool:
        """Clear every tier; False if one failed. Every write in flight is void (as for
        :meth:`delete`)."""
        self._parts.fences.revoke_all()
        return all([tier.store.clear() for tier in self.tiers])

    def backend_stats(self, timeout: float | None = None) -> dict[str, Any]:
        """The first tier's backend stats, and each further tier's as ``tier<i>.<name>``."""
        return backend_stats(self.tiers, timeout)

    def stats(self) -> dict[str, int | float]:
        """The page stores' counters summed over the tiers (a page store's names; each
        tier's own, and the chain's, are in :meth:`tier_stats`)."""
        return store_stats([tier.store for tier in self.tiers], self.counters)

    def tier_stats(self) -> list[dict[str, Any]]:
        """Each tier: its name, backend, page store counters, chain counters, occupancy,
        and the pages queued to be written into it."""
        return tier_stats(self.tiers, self._cascade)

    def tenant_stats(self) -> dict[str, dict[str, Any]]:
        """Per configured tenant: bytes per tier and quota evictions."""
        return self._placement.tenant_stats()

    def call_counts(self) -> dict[str, Any]:
        """The bounded calls of every tier, summed."""
        return call_counts(tier.store for tier in self.tiers)

    def abandon_in_flight(self) -> int:
        return sum(tier.store.abandon_in_flight() for tier in self.tiers)

    # --- pins and promotions in flight ----------------------------------------------------

    def pin(self, keys: Iterable[str]) -> None:
        """Keep ``keys`` in every tier that holds them until :meth:`unpin`: no tier evicts
        a pinned page (a put that needs its room is refused instead). Counted: pin twice,
        unpin twice."""
        self.pins.pin(keys)

    def unpin(self, keys: Iterable[str]) -> None:
        """Drop one pin of each key (see :meth:`pin`)."""
        self.pins.unpin(keys)

    def pending(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key has a promotion queued or being written (a lookup may answer
        "ask again" for it instead of reading it from the lower tier now)."""
        return self._cascade.pending(keys)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job queued before now was written, and the write-backs those
        jobs queued in turn (one round per tier); False if ``timeout`` passed first."""
        return self._cascade.flush(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Stop the worker (after the queued jobs, within ``timeout``) and close every tier."""
        with self._parts.lock:
            if self._closed:
                return True
            self._closed = True
        stopped = self._cascade.close(timeout)
        closed = [tier.store.close(timeout) for tier in reversed(self.tiers)]
        return all(closed) and stopped

    def tenant_of(self, key: str) -> str | None:
        """The configured tenant whose namespace the key is in (None: no configured one)."""
        return self._parts.tenants.of(key)

    def bypassed(self, tier: Tier) -> bool:
        """Whether lookups skip ``tier`` now: a call to it is stuck past its bound (it
        timed out and has not returned), and another tier may answer instead. The tier
        is asked again once its stuck calls returned."""
        return len(self.tiers) > 1 and tier.store.call_counts()["stuck"] > 0

    def removed(self, tier_index: int, key: str, how: Departure) -> None:
        """A page left tier ``tier_index``: count it, emit it (see
        :meth:`~kvtier.storage.space.SpaceManager.removed`)."""
        self._placement.removed(tier_index, key, how)
