"""The chain of storage tiers behind one page memory, with the page store's API.

:func:`open_store` opens a plan's tiers, fastest first, each a
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
  its staging pages; they stay quarantined (:mod:`kvtier.cache.staging`, counted
  ``quarantined_pages``) until it returns, so a recycled page never carries another
  key's bytes into it.
- **delete / taint**: :meth:`StorageChain.delete` and :meth:`StorageChain.taint` cancel
  the queued cascades, write-backs and promotions of their keys, and a write of them
  still running (or timed out) deletes its copy once its call returned
  (:mod:`kvtier.cache.fences`, counted ``cancelled``).
- **pins** (:class:`~kvtier.cache.pins.PinSet`): no tier evicts a pinned page, neither
  the chain's own victim choices nor a backend's capacity (both go through the tier's
  :class:`ObservedEviction`). A running load (TieredCache's prefetch, until its handle is
  released) pins the pages it found.
- **write-back**: every eviction the chain makes out of a tier whose next tier is
  ``write: back`` (to make room for a put, a cascade or a promotion, or for a quota)
  hands the victim down first; one that cannot be handed down (no staging page, a full
  queue) is a counted drop of the tier below.
- **quotas**: a tenant (the tenant of the key's namespace, see ``tenants`` in the
  config) over its ``quota_bytes`` in a tier has its own pages evicted there first.

Every page entering or leaving a tier is an :class:`~kvtier.cache.events.Event`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.cache.events import Event, EventKind, EventStream
from kvtier.cache.fences import KeyFences, Ticket
from kvtier.cache.pins import PinSet, count_in, count_out
from kvtier.cache.staging import LateGuard, StagingPool
from kvtier.core.bounded import DEFAULT_CALL_TIMEOUT_S, DEFAULT_MAX_ABANDONED, Outcome
from kvtier.core.capabilities import ResolvedPlan, TierPlan, open_page_store
from kvtier.core.envelope import ENVELOPE_BYTES
from kvtier.core.errors import InvalidFieldError
from kvtier.core.extents import copy_extents
from kvtier.core.keys import NAMESPACE_ID_CHARS
from kvtier.core.metrics import counter_names, registered_counters
from kvtier.core.pagestore import BatchResult, PageMemory, PageStore
from kvtier.core.policy import EvictionPolicy, PageInfo, never_pinned
from kvtier.core.saveguard import SaveGuard
from kvtier.core.storage import Counters, StorageBackend

__all__ = ["ObservedEviction", "StorageChain", "Tier", "open_store"]

log = logging.getLogger("kvtier.cache")

#: Pages the cascade queue holds before it drops (a slow lower tier never blocks).
DEFAULT_QUEUE_PAGES = 1024
#: A tier's chain counters (kvtier.core.metrics.COUNTERS), reported as 0 until they move.
TIER_COUNTERS = tuple(counter_names("storage_tier"))
#: Keys a tier's admission refused that a later hit may offer again, per tier.
_REFUSED_KEEP = 1 << 16
#: Descriptions the chain gave a tier's policy, kept until the page's insert.
_DESCRIBED_KEEP = 1 << 14


class ObservedEviction(EvictionPolicy):
    """A tier's eviction policy, watched: removals right after a victim choice are
    evictions (an :class:`Event` and a count), other removals are removals.

    It also adds what the chain knows to every call the tier's backend makes: a pinned
    key (``pins``) is never a victim, and a page inserted without the chain describing it
    (the backend rebuilt its index at start-up, or adopted a page another process wrote)
    is described with the tenant of its key's namespace (``tenant_of``), so quotas count
    pages stored before a restart.
    """

    def __init__(
        self,
        inner: EvictionPolicy,
        on_removed: Callable[[str, bool], None],
        *,
        pins: PinSet | None = None,
        tenant_of: Callable[[str], str | None] | None = None,
        tokens: int = 0,
    ) -> None:
        self.inner = inner
        self._on_removed = on_removed
        self._pins = pins
        self._tenant_of = tenant_of
        self._tokens = tokens
        self._chosen: set[str] = set()
        self._described: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def describe(self, key: str, info: PageInfo) -> None:
        if self._tenant_of is not None:
            with self._lock:
                described = self._described
                described[key] = None
                described.move_to_end(key)
                if len(described) > _DESCRIBED_KEEP:
                    described.popitem(last=False)
        self.inner.describe(key, info)

    def record_insert(self, key: str, nbytes: int) -> None:
        tenant_of = self._tenant_of
        if tenant_of is not None:
            with self._lock:
                told = key in self._described
                if told:
                    del self._described[key]
            if not told:
                tenant = tenant_of(key)
                if tenant is not None and key not in self.inner:
                    self.inner.describe(key, PageInfo(tokens=self._tokens, tenant=tenant))
        self.inner.record_insert(key, nbytes)

    def record_access(self, key: str) -> None:
        self.inner.record_access(key)

    def record_remove(self, key: str) -> None:
        with self._lock:
            evicted = key in self._chosen
            self._chosen.discard(key)
        known = key in self.inner
        self.inner.record_remove(key)
        if known:
            self._on_removed(key, evicted)

    def choose_victims(
        self,
        nbytes: int,
        *,
        pinned: Callable[[str], bool] = never_pinned,
        tenant: str | None = None,
    ) -> list[str]:
        pins = self._pins
        check = pinned
        if pins is not None and len(pins):

            def check(key: str) -> bool:
                return key in pins or pinned(key)

        victims = self.inner.choose_victims(nbytes, pinned=check, tenant=tenant)
        with self._lock:
            self._chosen.update(victims)
        return victims

    def forget_choice(self, keys: Iterable[str]) -> None:
        """Victims that were chosen but stay (a later removal of them is no eviction)."""
        with self._lock:
            self._chosen.difference_update(keys)

    def __contains__(self, key: object) -> bool:
        return key in self.inner

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def tenant_bytes(self, tenant: str | None) -> int:
        return self.inner.tenant_bytes(tenant)


@dataclass(eq=False)
class Tier:
    """One tier of a chain: its plan, its page store, its policies and counters."""

    plan: TierPlan
    store: PageStore
    eviction: ObservedEviction | None
    admission: Any  # AdmissionPolicy | None
    #: The chain's counters of this tier (``storage_tier`` in kvtier.core.metrics.COUNTERS).
    counters: Counters = field(default_factory=lambda: registered_counters("storage_tier"))

    @property
    def index(self) -> int:
        return self.plan.index

    @property
    def name(self) -> str:
        return self.plan.name


@dataclass(eq=False)
class _Job:
    """Pages to write into lower or upper tiers, from staging pages (or the tier above)."""

    keys: list[str]
    targets: list[int]  # tier indices, in order
    source: int  # tier the bytes came from (read back from it when ``staged`` is None)
    kind: EventKind  # STORED (a cascade or write-back) or PROMOTED
    staged: list[int] | None = None
    done: threading.Event | None = None  # a flush marker's, set when the worker reaches it
    #: Targets whose admission already said yes (a page offered again after hits).
    admitted: tuple[int, ...] = ()
    #: Pages the queue counts for this job, and the targets not written yet.
    queued: int = 0
    waiting: list[int] = field(default_factory=list)
    #: Its keys in the chain's fences, from the queue until it is over.
    ticket: Ticket | None = None


class _LateWrite:
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
        undo: Callable[[Tier, list[str], Sequence[bool] | None, Ticket], object],
        tier: Tier,
        keys: list[str],
        staged: list[int] | None,
        ticket: Ticket,
        then: Callable[[Any], None] | None,
    ) -> None:
        self._fences = fences
        self._staging = staging
        self._undo = undo
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
            self._undo(self._tier, self._keys, written, held or self._ticket)
        finally:
            if held is not None:
                self._fences.leave(held)
            if self._then is not None:
                self._then(result)


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
        self.events = events or EventStream()
        #: A chain of several tiers counts its prefix lookups here (a page store's names).
        self.counters = registered_counters("page_store")
        self._quota_evictions: dict[str, int] = {}
        #: Keys no tier may evict now (see :meth:`pin`).
        self.pins = pins if pins is not None else PinSet()
        #: Most pages the cascade queue holds (beyond it, jobs are cut and counted drops).
        self.queue_pages = queue_pages
        self._tenants = dict(plan.tenants)
        #: What one page takes in a tier: its envelope slot and its payload.
        self._page_bytes = plan.geometry.bytes_per_page + ENVELOPE_BYTES
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._queued = 0
        self._queued_by_tier = [0] * len(tiers)
        self._promoting: dict[str, int] = {}
        self._refused: list[OrderedDict[str, None]] = [OrderedDict() for _ in tiers]
        #: Keys the chain is removing from a tier after it handed them down.
        self._evicting: set[str] = set()
        self._lost_warned = False
        self._lock = threading.Lock()
        #: Per tier: one make-room-then-put at a time (above a write-back tier), so two
        #: writers never both count the same free room.
        self._room_locks = [threading.Lock() for _ in tiers]
        #: Staging pages of cascades, write-backs and promotions; a page a timed-out call
        #: still uses stays quarantined there until the call returns.
        self._staging = StagingPool(plan, self._page_bytes)
        self._staging_stores: dict[int, PageStore] = {}
        #: Keys with writes in flight, and those deleted or tainted meanwhile.
        self._fences = KeyFences()
        self._worker: threading.Thread | None = None
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
    def staging(self) -> StagingPool:
        """The staging pages of cascades, write-backs and promotions (their free and
        quarantined counts)."""
        return self._staging

    def exists(self, keys: Sequence[str]) -> BatchResult:
        """Whether any tier holds each key (one batched call per tier, for the rest)."""
        keys = list(keys)
        found = [False] * len(keys)
        todo = list(range(len(keys)))
        for tier in self.tiers:
            if not todo:
                break
            answer = tier.store.exists([keys[i] for i in todo])
            if answer.outcome is not Outcome.OK:
                tier.counters.add("failures")
                if len(self.tiers) == 1:
                    return answer
                continue
            rest = []
            for i, ok in zip(todo, answer, strict=True):
                if ok:
                    found[i] = True
                else:
                    rest.append(i)
            todo = rest
        return BatchResult(found)

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
        ticket = self._fences.enter(keys)
        try:
            return self._get_chained(keys, pages, on_late, verdicts, ticket)
        finally:
            self._fences.leave(ticket)

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
        self._promote(keys, pages, source, ticket)
        self._record_hits(keys, pages, source, ticket)
        return BatchResult(results)

    def put(
        self,
        keys: Sequence[str],
        pages: Sequence[int],
        *,
        on_late: Callable[[Any], None] | None = None,
        guards: Sequence[SaveGuard | None] | None = None,
    ) -> BatchResult:
        """Store into the first tier now; cascade down (write-through) on the worker.

        ``on_late``, ``guards`` and the result's ``outcome`` are the first tier's (see
        :meth:`PageStore.put`); a put that timed out cascades nothing. A key deleted or
        tainted (:meth:`delete`, :meth:`taint`) while this put ran is not kept: its copy
        is deleted once the call returned, and its result is False.
        """
        keys, pages = list(keys), list(pages)
        first = self.tiers[0]
        self._describe(first, keys)
        self._enforce_quota(first, keys)
        ticket = self._fences.enter(keys)
        try:

            def late(names: list[str], _pages: list[int]) -> _LateWrite:
                return self._late_write(first, names, None, ticket, on_late)

            results, _ = self._put_into(
                first, first.store, keys, pages, late=late, must=True, guards=guards
            )
            undone = self._undo_revoked(first, keys, results, ticket)
            for i, key in enumerate(keys):
                if key in undone:
                    results[i] = False
            stored = [key for key, ok in zip(keys, results, strict=True) if ok]
            self._emit(EventKind.STORED, first, stored)
            targets = self._through_below(0)
            if stored and targets:
                self._submit(_Job(stored, targets, 0, EventKind.STORED), since=ticket)
        finally:
            self._fences.leave(ticket)
        return results

    def delete(self, keys: Sequence[str]) -> BatchResult:
        """Remove each key from every tier; True where some tier removed it.

        Queued cascades, write-backs and promotions of the keys are cancelled, and one
        running now (or a put that timed out and may still land) deletes its copy once
        its call returned, so no tier keeps a key deleted here.
        """
        keys = list(keys)
        self._fences.revoke(keys)
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
        in_flight = self._fences.revoke(keys)
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
        self._fences.revoke_all()
        return all([tier.store.clear() for tier in self.tiers])

    def backend_stats(self, timeout: float | None = None) -> dict[str, Any]:
        """The first tier's backend stats, and each further tier's as ``tier<i>.<name>``."""
        out: dict[str, Any] = {}
        for tier in self.tiers:
            values = (
                tier.store.backend_stats() if timeout is None else tier.store.backend_stats(timeout)
            )
            if tier.index == 0:
                out.update(values)
            else:
                out.update({f"tier{tier.index}.{k}": v for k, v in values.items()})
        return out

    def stats(self) -> dict[str, int | float]:
        """The page stores' counters summed over the tiers (a page store's names; each
        tier's own, and the chain's, are in :meth:`tier_stats`)."""
        if len(self.tiers) == 1:
            return self.tiers[0].store.stats()
        merged: dict[str, int | float] = {}
        for tier in self.tiers:
            for key, value in tier.store.stats().items():
                merged[key] = merged.get(key, 0) + value
        chain = self.counters.snapshot()
        for name in ("prefix_queries", "prefix_pages"):
            merged[name] = merged.get(name, 0) + chain.get(name, 0)
        return merged

    def tier_stats(self) -> list[dict[str, Any]]:
        """Each tier: its name, backend, page store counters, chain counters, occupancy,
        and the pages queued to be written into it."""
        out = []
        with self._lock:
            depths = list(self._queued_by_tier)
        for tier in self.tiers:
            staging = self._staging_stores.get(tier.index)
            moved = staging.stats() if staging is not None else {}
            store = tier.store.stats()
            entry: dict[str, Any] = {
                "tier": tier.index,
                "name": tier.name,
                "backend": tier.plan.backend.name,
                "write": tier.plan.write,
                "promote": tier.plan.promote,
                "capacity_bytes": tier.plan.capacity_bytes,
                "occupancy_bytes": tier.eviction.nbytes if tier.eviction is not None else None,
                "queue_depth": depths[tier.index],
                "store": store,
            }
            counts: dict[str, int | float] = dict.fromkeys(TIER_COUNTERS, 0)
            counts.update(tier.counters.snapshot())
            # every byte in and out of the tier: the engine's and the chain's moves
            counts["read_bytes"] = store["bytes_read"] + moved.get("bytes_read", 0)
            counts["written_bytes"] = store["bytes_written"] + moved.get("bytes_written", 0)
            entry.update(counts)
            out.append(entry)
        return out

    def tenant_stats(self) -> dict[str, dict[str, Any]]:
        """Per configured tenant: bytes per tier and quota evictions."""
        out: dict[str, dict[str, Any]] = {}
        for name, quota in self._tenants.values():
            out[name] = {
                "quota_bytes": quota,
                "bytes": [
                    tier.eviction.tenant_bytes(name) if tier.eviction is not None else 0
                    for tier in self.tiers
                ],
                "quota_evictions": self._quota_evictions.get(name, 0),
            }
        return out

    def call_counts(self) -> dict[str, Any]:
        """The bounded calls of every tier, summed."""
        merged: dict[str, Any] = {"timed_out_by_operation": {}}
        for tier in self.tiers:
            for key, value in tier.store.call_counts().items():
                if key == "timed_out_by_operation":
                    for op, n in value.items():
                        merged[key][op] = merged[key].get(op, 0) + n
                else:
                    merged[key] = merged.get(key, 0) + value
        return merged

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
        with self._lock:
            promoting = self._promoting
            return [key in promoting for key in keys]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job queued before now was written, and the write-backs those
        jobs queued in turn (one round per tier); False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for _ in range(len(self.tiers) + 1):
            with self._lock:
                if self._worker is None or self._queued == 0:
                    return True
                if self._closed:  # the worker ended: what is left is never written
                    return False
            done = threading.Event()
            self._queue.put(_Job([], [], -1, EventKind.STORED, staged=[], done=done))
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not done.wait(left):
                return False
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Stop the worker (after the queued jobs, within ``timeout``) and close every tier."""
        with self._lock:
            if self._closed:
                return True
            self._closed = True
            worker = self._worker
        if worker is not None:
            self._queue.put(None)
            worker.join(timeout if timeout is not None else 10.0)
        for store in self._staging_stores.values():
            store.close()
        closed = [tier.store.close(timeout) for tier in reversed(self.tiers)]
        return all(closed) and (worker is None or not worker.is_alive())

    # --- internals: tenants and policies ----------------------------------------------------

    def tenant_of(self, key: str) -> str | None:
        """The configured tenant whose namespace the key is in (None: no configured one)."""
        entry = self._tenants.get(key[:NAMESPACE_ID_CHARS])
        return entry[0] if entry is not None else None

    def _quota_of(self, key: str) -> tuple[str, int] | None:
        entry = self._tenants.get(key[:NAMESPACE_ID_CHARS])
        if entry is None or entry[1] is None:
            return None
        return entry[0], entry[1]

    def _describe(self, tier: Tier, keys: list[str]) -> None:
        if tier.eviction is None and tier.admission is None:
            return
        parent: str | None = None
        for key in keys:
            info = PageInfo(
                parent=parent, tokens=self.plan.geometry.page_size, tenant=self.tenant_of(key)
            )
            if tier.eviction is not None:
                tier.eviction.describe(key, info)
            if tier.admission is not None:
                tier.admission.describe(key, info)
            parent = key

    def _enforce_quota(self, tier: Tier, keys: list[str]) -> None:
        """Evict a tenant's own pages from ``tier`` before it goes over its quota."""
        if tier.eviction is None or not self._tenants:
            return
        incoming: dict[str, int] = {}
        quotas: dict[str, int] = {}
        for key in keys:
            chosen = self._quota_of(key)
            if chosen is not None and key not in tier.eviction:
                incoming[chosen[0]] = incoming.get(chosen[0], 0) + self._page_bytes
                quotas[chosen[0]] = chosen[1]
        mine = set(keys)
        for tenant, nbytes in incoming.items():
            excess = tier.eviction.tenant_bytes(tenant) + nbytes - quotas[tenant]
            if excess <= 0:
                continue
            victims = tier.eviction.choose_victims(excess, pinned=mine.__contains__, tenant=tenant)
            if victims:
                self._evict(tier, victims, force=True)
                tier.counters.add("quota_evictions", len(victims))
                with self._lock:
                    count = self._quota_evictions.get(tenant, 0) + len(victims)
                    self._quota_evictions[tenant] = count

    def _admits(self, tier: Tier, key: str) -> bool:
        admission = tier.admission
        if admission is None:
            return True
        admission.record_access(key)
        if admission.admit(key, self._page_bytes):
            return True
        tier.counters.add("admission_refused")
        if tier.plan.write == "through":  # a later hit may offer it again
            refused = self._refused[tier.index]
            with self._lock:
                refused[key] = None
                if len(refused) > _REFUSED_KEEP:
                    refused.popitem(last=False)
        return False

    # --- internals: writing into a tier, evicting out of it -----------------------------------

    def _back_below(self, tier: Tier) -> Tier | None:
        """The tier below ``tier`` when it is ``write: back`` (its evictions go there)."""
        below = tier.index + 1
        if below < len(self.tiers) and self.tiers[below].plan.write == "back":
            return self.tiers[below]
        return None

    def _put_into(
        self,
        tier: Tier,
        store: PageStore,
        keys: list[str],
        pages: list[int],
        *,
        late: Callable[[list[str], list[int]], _LateWrite],
        must: bool,
        guards: Sequence[SaveGuard | None] | None = None,
    ) -> tuple[BatchResult, int]:
        """Put into ``tier`` (through ``store``, the tier's page store or its staging
        sibling); above a write-back tier, in parts that fit its capacity, each after its
        victims were handed down. ``must``: the caller's pages, stored whatever happens to
        victims that could not be handed down (they are lost, counted); otherwise pages
        that would evict such a victim are not written (counted drops of this tier, the
        copy they came from is still in its own tier). Returns the results and the drops.

        ``late(keys, pages)`` makes the late side of each backend call (a call that times
        out keeps its pages and keys fenced until it returns, see :class:`_LateWrite`).
        """
        capacity = tier.plan.capacity_bytes
        if self._back_below(tier) is None or capacity is None or tier.eviction is None:
            return self._put_call(store, keys, pages, late, guards), 0
        step = max(1, capacity // self._page_bytes)
        results: list[bool] = []
        dropped = 0
        for start in range(0, len(keys), step):
            part = keys[start : start + step]
            with self._room_locks[tier.index]:
                fit = self._make_room(tier, part, force=must)
                if fit < len(part):
                    dropped += len(part) - fit
                    tier.counters.add("drops", len(part) - fit)
                answer = self._put_call(
                    store,
                    part[:fit],
                    pages[start : start + fit],
                    late,
                    None if guards is None else guards[start : start + fit],
                )
            results += answer
            results += [False] * (len(part) - fit)
            if answer.outcome is not Outcome.OK:
                results += [False] * (len(keys) - len(results))
                return BatchResult(results, answer.outcome), dropped
        return BatchResult(results), dropped

    @staticmethod
    def _put_call(
        store: PageStore,
        keys: list[str],
        pages: list[int],
        late: Callable[[list[str], list[int]], _LateWrite],
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

    def _make_room(self, tier: Tier, keys: list[str], *, force: bool) -> int:
        """Before ``keys`` enter ``tier`` (above a write-back tier), hand down the victims
        that make room for them; how many of ``keys`` fit (all with ``force``)."""
        eviction, capacity = tier.eviction, tier.plan.capacity_bytes
        assert eviction is not None and capacity is not None
        incoming = sum(self._page_bytes for key in keys if key not in eviction)
        excess = eviction.nbytes + incoming - capacity
        if excess <= 0:
            return len(keys)
        mine = set(keys)
        victims = eviction.choose_victims(excess, pinned=mine.__contains__)
        removed = self._evict(tier, victims, force=force)
        if force:
            return len(keys)
        short = excess - self._page_bytes * len(removed)
        if short <= 0:
            return len(keys)
        return max(0, len(keys) - -(-short // self._page_bytes))

    def _evict(self, tier: Tier, victims: list[str], *, force: bool) -> list[str]:
        """Remove ``victims`` from ``tier``; above a write-back tier, each is handed down
        first (read into staging, queued for the tier below). One that cannot be handed
        down is removed anyway with ``force`` (a counted drop of the tier below), else it
        stays. Returns the victims removed."""
        if not victims:
            return []
        below = self._back_below(tier)
        moved: list[str] = []
        if below is not None:
            ticket = self._fences.enter(victims)  # a delete from now on cancels the hand-down
            try:
                staged = self._stage_from(tier, victims)
                keys = [key for key, page in zip(victims, staged, strict=True) if page is not None]
                pages = [page for page in staged if page is not None]
                if keys:
                    targets = [below.index, *self._through_below(below.index)]
                    accepted = self._submit(
                        _Job(keys, targets, tier.index, EventKind.STORED, staged=pages),
                        since=ticket,
                    )
                    moved = keys[:accepted]
            finally:
                self._fences.leave(ticket)
            gone = set(moved)
            stay = [key for key in victims if key not in gone]
            if stay and not force:
                assert tier.eviction is not None
                tier.eviction.forget_choice(stay)
                victims = moved
            elif stay:
                below.counters.add("drops", len(stay))  # lost: counted where it was owed
        if not victims:
            return []
        with self._lock:
            self._evicting.update(victims)
        try:
            tier.store.delete(victims)
        finally:
            with self._lock:
                self._evicting.difference_update(victims)
        return victims

    def _through_below(self, index: int) -> list[int]:
        """The write-through tiers a page stored in tier ``index`` cascades into."""
        out = []
        for tier in self.tiers[index + 1 :]:
            if tier.plan.write != "through":
                break
            out.append(tier.index)
        return out

    # --- internals: promotions and re-offers ---------------------------------------------------

    def _promote(
        self, keys: list[str], pages: list[int], source: dict[int, int], ticket: Ticket
    ) -> None:
        """Copy the pages a lower tier served into staging, to write them up."""
        by_tier: dict[int, list[int]] = {}
        for i, tier_index in source.items():
            if tier_index > 0 and self.tiers[tier_index].plan.promote:
                by_tier.setdefault(tier_index, []).append(i)
        for tier_index, positions in by_tier.items():
            self._offer(
                keys,
                pages,
                positions,
                list(range(tier_index)),
                tier_index,
                EventKind.PROMOTED,
                ticket,
            )

    def _record_hits(
        self, keys: list[str], pages: list[int], source: dict[int, int], ticket: Ticket
    ) -> None:
        """Tell the admission policies below the tier that served each page of the hit;
        a page one of them refused before and admits now is offered to it again."""
        offers: dict[int, list[int]] = {}
        for i, served in source.items():
            for tier in self.tiers[served + 1 :]:
                admission = tier.admission
                if admission is None:
                    continue
                admission.record_access(keys[i])
                refused = self._refused[tier.index]
                if keys[i] in refused and admission.admit(keys[i], self._page_bytes):
                    with self._lock:
                        refused.pop(keys[i], None)
                    offers.setdefault(tier.index, []).append(i)
        for target, positions in offers.items():
            targets = [target, *self._through_below(target)]
            self._offer(
                keys,
                pages,
                positions,
                targets,
                source[positions[0]],
                EventKind.STORED,
                ticket,
                target,
            )

    def _offer(
        self,
        keys: list[str],
        pages: list[int],
        positions: list[int],
        targets: list[int],
        source: int,
        kind: EventKind,
        ticket: Ticket,
        admitted: int | None = None,
    ) -> None:
        """Copy the caller's pages at ``positions`` into staging and queue them for
        ``targets``; a full staging pool drops the rest (counted on the first target).
        ``ticket``: the read's, live, so a delete since the read cancels the job."""
        staged = self._staging.take(len(positions))
        if len(staged) < len(positions):
            self.tiers[targets[0]].counters.add("drops", len(positions) - len(staged))
        if not staged:
            return
        chosen = positions[: len(staged)]
        staging = self._staging.pool
        for position, page in zip(chosen, staged, strict=True):
            copy_extents(self.pool.page_buffers(pages[position]), staging.page_buffers(page))
        self._submit(
            _Job(
                [keys[i] for i in chosen],
                targets,
                source,
                kind,
                staged,
                admitted=() if admitted is None else (admitted,),
            ),
            since=ticket,
        )

    # --- internals: staging memory ----------------------------------------------------------

    def _staging_store(self, tier: Tier) -> PageStore:
        store = self._staging_stores.get(tier.index)
        if store is None:
            store = self._staging_stores[tier.index] = tier.store.sibling(self._staging.pool)
        return store

    def _stage_from(self, tier: Tier, keys: list[str]) -> list[int | None]:
        """Read ``keys`` from ``tier`` into staging pages (None where none was free or the
        read failed). Pages of a read that timed out stay quarantined until it returns."""
        pages = self._staging.take(len(keys))
        out: list[int | None] = [None] * len(keys)
        if not pages:
            return out
        guard = LateGuard(self._staging, pages)
        read = self._staging_store(tier).get(keys[: len(pages)], pages, on_late=guard.returned)
        if read.outcome is Outcome.TIMED_OUT:
            tier.counters.add("quarantined_pages", guard.timed_out())
        unused = []
        for i, (page, ok) in enumerate(zip(pages, read, strict=True)):
            if ok:
                out[i] = page
            else:
                unused.append(page)
        self._staging.release(unused)
        return out

    # --- internals: the queue and its worker ---------------------------------------------------

    def _submit(self, job: _Job, *, since: Ticket | None = None) -> int:
        """Queue a job for the worker; the pages beyond ``queue_pages`` are cut off and
        dropped (counted on its first target). Returns the pages queued.

        ``since``: the live ticket of what the job continues (the put, read or eviction
        its pages came from): a delete since then cancels the job's keys too."""
        with self._lock:
            take = 0 if self._closed else min(len(job.keys), self.queue_pages - self._queued)
            take = max(0, take)
            if take and self._worker is None:
                self._worker = threading.Thread(target=self._run, name="kvtier-chain", daemon=True)
                self._worker.start()
            if take:
                self._queued += take
                for target in job.targets:
                    self._queued_by_tier[target] += take
                if job.kind is EventKind.PROMOTED:
                    count_in(self._promoting, job.keys[:take])
        cut = len(job.keys) - take
        if cut:
            self.tiers[job.targets[0]].counters.add("drops", cut)
            if job.staged:
                self._staging.release(job.staged[take:])
        if take:
            job.keys = job.keys[:take]
            if job.staged is not None:
                job.staged = job.staged[:take]
            job.queued, job.waiting = take, list(job.targets)
            fences = self._fences
            job.ticket = fences.enter(job.keys) if since is None else fences.carry(since, job.keys)
            self._queue.put(job)
        return take

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.done is not None:  # a flush marker: every job before it is written
                job.done.set()
                continue
            try:
                self._write(job)
            except Exception as exc:  # a bug must not stop the worker
                for target in job.waiting[:1]:  # its pages were not written there
                    self.tiers[target].counters.add("failures", len(job.keys))
                log.warning("kvtier: the storage chain's worker failed a job: %r", exc)
            finally:
                self._finish(job)

    def _target_done(self, job: _Job, target: int) -> None:
        with self._lock:
            if target in job.waiting:
                job.waiting.remove(target)
                self._queued_by_tier[target] -= job.queued

    def _finish(self, job: _Job) -> None:
        """The job left the queue: its pages no longer count, its staging is free."""
        with self._lock:
            for target in job.waiting:
                self._queued_by_tier[target] -= job.queued
            job.waiting = []
            self._queued -= job.queued
            if job.kind is EventKind.PROMOTED:
                count_out(self._promoting, job.keys)
        if job.staged:
            self._staging.release(job.staged)  # a page a late call still uses stays held
            job.staged = []
        if job.ticket is not None:
            self._fences.leave(job.ticket)
            job.ticket = None

    def _write(self, job: _Job) -> None:
        """Write one job's pages into its target tiers (from staging, or read back); the
        keys deleted or tainted since the job was queued are not written (``cancelled``)."""
        keys, staged = job.keys, job.staged
        ticket = job.ticket
        if staged is None:
            revoked = self._fences.revoked(ticket) if ticket is not None else set()
            if revoked and job.targets:
                self.tiers[job.targets[0]].counters.add("cancelled", len(revoked))
                keys = [key for key in keys if key not in revoked]
            got = self._stage_from(self.tiers[job.source], keys)
            read = [key for key, page in zip(keys, got, strict=True) if page is not None]
            staged = job.staged = [page for page in got if page is not None]
            if len(read) < len(keys) and job.targets:
                self.tiers[job.targets[0]].counters.add("drops", len(keys) - len(read))
            keys = read
        for target in job.targets:  # (the staged copies are the worker's: nothing to pin)
            tier = self.tiers[target]
            revoked = self._fences.revoked(ticket, keys) if ticket is not None else set()
            if revoked:
                tier.counters.add("cancelled", len(revoked))
                kept = [(key, page) for key, page in zip(keys, staged, strict=True)]
                keys = [key for key, _ in kept if key not in revoked]
                staged = [page for key, page in kept if key not in revoked]
            self._write_one(job, tier, keys, staged)
            self._target_done(job, target)

    def _write_one(self, job: _Job, tier: Tier, keys: list[str], staged: list[int]) -> None:
        """Write staged pages into one target tier, through its admission."""
        chosen = [
            (key, page)
            for key, page in zip(keys, staged, strict=True)
            if tier.index in job.admitted or self._admits(tier, key)
        ]
        if not chosen:
            return
        names = [key for key, _ in chosen]
        self._describe(tier, names)
        self._enforce_quota(tier, names)
        ticket = job.ticket
        assert ticket is not None  # queued jobs have one until they finish

        def late(part: list[str], pages: list[int]) -> _LateWrite:
            return self._late_write(tier, part, pages, ticket, None)

        results, dropped = self._put_into(
            tier,
            self._staging_store(tier),
            names,
            [page for _, page in chosen],
            late=late,
            must=False,
        )
        undone = self._undo_revoked(tier, names, results, ticket)
        if undone:
            for i, key in enumerate(names):
                if key in undone:
                    results[i] = False
            dropped += len(undone)  # not a failure: cancelled, counted as such
        written = [key for key, ok in zip(names, results, strict=True) if ok]
        tier.counters.add(
            "promotions" if job.kind is EventKind.PROMOTED else "cascades", len(written)
        )
        if len(written) + dropped < len(names):
            tier.counters.add("failures", len(names) - len(written) - dropped)
        refused = self._refused[tier.index]
        if refused and written:
            with self._lock:
                for key in written:
                    refused.pop(key, None)
        self._emit(job.kind, tier, written)

    def _late_write(
        self,
        tier: Tier,
        keys: list[str],
        staged: list[int] | None,
        ticket: Ticket,
        then: Callable[[Any], None] | None,
    ) -> _LateWrite:
        return _LateWrite(
            self._fences, self._staging, self._undo_revoked, tier, keys, staged, ticket, then
        )

    def _undo_revoked(
        self, tier: Tier, keys: list[str], results: Sequence[bool] | None, ticket: Ticket
    ) -> set[str]:
        """Delete from ``tier`` the keys a put wrote (``results``; None: unknown, maybe
        all) that were deleted or tainted since ``ticket`` entered; returns them."""
        revoked = self._fences.revoked(ticket, keys)
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

    def bypassed(self, tier: Tier) -> bool:
        """Whether lookups skip ``tier`` now: a call to it is stuck past its bound (it
        timed out and has not returned), and another tier may answer instead. The tier
        is asked again once its stuck calls returned."""
        return len(self.tiers) > 1 and tier.store.call_counts()["stuck"] > 0

    # --- internals: events ---------------------------------------------------------------------

    def _emit(self, kind: EventKind, tier: Tier, keys: Iterable[str]) -> None:
        self.events.emit(
            Event(kind, tier.index, tier.name, key, self.tenant_of(key), self._page_bytes)
            for key in keys
        )

    def removed(self, tier_index: int, key: str, evicted: bool) -> None:
        """A page left tier ``tier_index`` (evicted: to make room): count it, emit it.

        A page the tier's backend evicted on its own (not through the chain: its disk
        filled, or the chain's room estimate was short) above a write-back tier was not
        written back: a counted drop of the tier below.
        """
        tier = self.tiers[tier_index]
        if evicted:
            tier.counters.add("evictions")
            below = self._back_below(tier)
            if below is not None and key not in self._evicting:
                below.counters.add("drops")
                with self._lock:
                    first, self._lost_warned = not self._lost_warned, True
                if first:
                    log.warning(
                        "kvtier: tier %s evicted a page on its own (its backend's capacity or "
                        "free-space guard) that write-back tier %s never received; later such "
                        "pages are counted in that tier's drops only",
                        tier.name,
                        below.name,
                    )
        self._emit(EventKind.EVICTED if evicted else EventKind.REMOVED, tier, [key])


def open_store(
    plan: ResolvedPlan,
    pool: PageMemory,
    *,
    checksum_workers: int = 1,
    call_timeout_s: float | None = DEFAULT_CALL_TIMEOUT_S,
    max_abandoned_calls: int = DEFAULT_MAX_ABANDONED,
    queue_pages: int = DEFAULT_QUEUE_PAGES,
) -> StorageChain:
    """Open every storage tier of ``plan`` over ``pool`` and the chain in front of them.

    Each tier's eviction policy is built here and handed to its backend (its capacity
    goes through it, and through the chain's pins); a tier that fails to open closes the
    ones opened before it. ``queue_pages`` bounds the pages waiting to cascade or promote.
    """
    tiers: list[Tier] = []
    chain_box: list[StorageChain] = []
    pins = PinSet()
    tenants = dict(plan.tenants)

    def tenant_of(key: str) -> str | None:
        entry = tenants.get(key[:NAMESPACE_ID_CHARS])
        return entry[0] if entry is not None else None

    def removed(index: int) -> Callable[[str, bool], None]:
        def forward(key: str, evicted: bool) -> None:
            if chain_box:
                chain_box[0].removed(index, key, evicted)

        return forward

    try:
        for tier_plan in plan.storage_tiers():
            eviction = None
            if tier_plan.eviction is not None:
                eviction = ObservedEviction(
                    tier_plan.eviction.build(),
                    removed(tier_plan.index),
                    pins=pins,
                    tenant_of=tenant_of if tenants else None,
                    tokens=plan.geometry.page_size,
                )
            store = open_page_store(
                plan,
                pool,
                checksum_workers=checksum_workers,
                call_timeout_s=call_timeout_s,
                max_abandoned_calls=max_abandoned_calls,
                tier=tier_plan.index,
                eviction=eviction,
            )
            admission = tier_plan.admission.build() if tier_plan.admission is not None else None
            tiers.append(Tier(tier_plan, store, eviction, admission))
        chain = StorageChain(plan, tiers, pool, queue_pages=queue_pages, pins=pins)
    except BaseException:
        for tier in reversed(tiers):
            tier.store.close()
        raise
    chain_box.append(chain)
    return chain
