"""The chain of storage tiers behind one page memory, with the page store's API.

:func:`open_store` opens a plan's tiers, fastest first, each a
:class:`~kvtier.core.pagestore.PageStore` over the same page memory (its guards: bounded
calls, counters, envelope checks), and puts a :class:`StorageChain` in front of them. The
chain is what every engine path talks to (TieredCache, the vLLM and SGLang adapters), so
a chain of one behaves as its page store did, and more tiers change nothing upstream:

- **put** stores into the first tier, in the caller's call. Pages then cascade down on a
  worker, read back from the tier above into a staging pool: into each tier whose
  ``write`` is ``through`` (through its admission policy), and into a ``back`` tier only
  when the tier above evicts them to make room. The cascade queue is bounded: a slow or
  full lower tier drops pages (counted), it never blocks the tier above.
- **get** reads each page from the first tier that holds a valid copy: a page missing,
  or failing verification, in one tier is asked of the next. A page found in a lower tier
  whose ``promote`` is on is copied into staging and written up into the tiers above
  (through their admission) on the worker; a full staging pool drops the promotion.
- **exists** answers whether any tier holds the page. A tier that fails a call (a hung
  backend, a master gone) counts as not holding the pages and is counted; the others
  keep serving.
- **quotas**: a tenant (the tenant of the key's namespace, see ``tenants`` in the
  config) over its ``quota_bytes`` in a tier has its own pages evicted there first.

Every page entering or leaving a tier is an :class:`~kvtier.cache.events.Event`.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.cache.events import Event, EventKind, EventStream
from kvtier.core.bounded import DEFAULT_CALL_TIMEOUT_S, DEFAULT_MAX_ABANDONED, Outcome
from kvtier.core.capabilities import ResolvedPlan, TierPlan, build_host_pool, open_page_store
from kvtier.core.envelope import ENVELOPE_BYTES
from kvtier.core.extents import Extent
from kvtier.core.host_pool import HostPool
from kvtier.core.keys import NAMESPACE_ID_CHARS
from kvtier.core.pagestore import BatchResult, PageMemory, PageStore
from kvtier.core.policy import EvictionPolicy, PageInfo
from kvtier.core.storage import Counters, StorageBackend

__all__ = ["StorageChain", "Tier", "open_store"]

log = logging.getLogger("kvtier.cache")

#: Pages the cascade queue holds before it drops (a slow lower tier never blocks).
DEFAULT_QUEUE_PAGES = 1024
#: A tier's chain counters, reported as 0 until they move.
_TIER_COUNTERS = (
    "promotions",
    "cascades",
    "drops",
    "evictions",
    "quota_evictions",
    "failures",
    "admission_refused",
    "get_seconds",
    "get_calls",
)
#: Staging memory for cascades and promotions: at most this many bytes, or pages.
STAGING_BYTES = 256 << 20
STAGING_PAGES = 64


class ObservedEviction(EvictionPolicy):
    """A tier's eviction policy, watched: removals right after a victim choice are
    evictions (an :class:`Event` and a count), other removals are removals."""

    def __init__(self, inner: EvictionPolicy, on_removed: Callable[[str, bool], None]) -> None:
        self.inner = inner
        self._on_removed = on_removed
        self._chosen: set[str] = set()
        self._lock = threading.Lock()

    def describe(self, key: str, info: PageInfo) -> None:
        self.inner.describe(key, info)

    def record_insert(self, key: str, nbytes: int) -> None:
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
        pinned: Callable[[str], bool] = lambda key: False,
        tenant: str | None = None,
    ) -> list[str]:
        victims = self.inner.choose_victims(nbytes, pinned=pinned, tenant=tenant)
        with self._lock:
            self._chosen.update(victims)
        return victims

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
    counters: Counters = field(default_factory=Counters)

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


def _copy_page(source: Sequence[Extent], target: Sequence[Extent]) -> None:
    """Copy a page's bytes region to region (the two may cut it up differently)."""
    out = iter(target)
    dst = next(out).view
    at = 0
    for extent in source:
        src = extent.view
        done = 0
        while done < src.nbytes:
            if at == dst.nbytes:
                dst, at = next(out).view, 0
            n = min(src.nbytes - done, dst.nbytes - at)
            dst[at : at + n] = src[done : done + n]
            done += n
            at += n


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
    ) -> None:
        self.plan = plan
        self.tiers = tiers
        self.pool = pool
        self.events = events or EventStream()
        self.counters = Counters()
        self._tenants = dict(plan.tenants)
        #: What one page takes in a tier: its envelope slot and its payload.
        self._page_bytes = plan.geometry.bytes_per_page + ENVELOPE_BYTES
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=max(1, queue_pages))
        self._lock = threading.Lock()
        self._staging: HostPool | None = None
        self._staging_stores: dict[int, PageStore] = {}
        self._worker: threading.Thread | None = None
        self._closed = False
        self._in_flight: set[str] = set()

    # --- what a page store has --------------------------------------------------------

    @property
    def backend(self) -> StorageBackend:
        """The first tier's backend."""
        return self.tiers[0].store.backend

    @property
    def closed(self) -> bool:
        return self._closed

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
        """How many leading keys some tier holds."""
        hits = 0
        for present in self.exists(keys):
            if not present:
                break
            hits += 1
        return hits

    def get(
        self,
        keys: Sequence[str],
        pages: Sequence[int],
        *,
        on_late: Callable[[Any], None] | None = None,
    ) -> BatchResult:
        """Fill pages from the first tier holding a valid copy; promote lower-tier hits."""
        keys, pages = list(keys), list(pages)
        if len(self.tiers) == 1:
            first = self.tiers[0]
            started = time.perf_counter()
            result = first.store.get(keys, pages, on_late=on_late)
            first.counters.add("get_seconds", time.perf_counter() - started)
            first.counters.add("get_calls")
            return result
        results = [False] * len(keys)
        source: dict[int, int] = {}
        todo = list(range(len(keys)))
        for tier in self.tiers:
            if not todo:
                break
            started = time.perf_counter()
            answer = tier.store.get(
                [keys[i] for i in todo], [pages[i] for i in todo], on_late=on_late
            )
            tier.counters.add("get_seconds", time.perf_counter() - started)
            tier.counters.add("get_calls")
            if answer.outcome is Outcome.TIMED_OUT:
                # the backend may still write into these pages: no other tier may fill them
                tier.counters.add("failures")
                return BatchResult(results, Outcome.TIMED_OUT)
            if answer.outcome is not Outcome.OK:
                tier.counters.add("failures")
                continue
            rest = []
            for i, ok in zip(todo, answer, strict=True):
                if ok:
                    results[i] = True
                    source[i] = tier.index
                else:
                    rest.append(i)
            todo = rest
        self._promote(keys, pages, source)
        return BatchResult(results)

    def put(
        self,
        keys: Sequence[str],
        pages: Sequence[int],
        *,
        on_late: Callable[[Any], None] | None = None,
    ) -> BatchResult:
        """Store into the first tier now; cascade down (write-through) on the worker.

        ``on_late`` and the result's ``outcome`` are the first tier's (see
        :meth:`PageStore.put`); a put that timed out cascades nothing.
        """
        keys, pages = list(keys), list(pages)
        first = self.tiers[0]
        self._describe(first, keys)
        self._enforce_quota(first, keys)
        results = self._put_first(first, keys, pages, on_late)
        stored = [key for key, ok in zip(keys, results, strict=True) if ok]
        self._emit(EventKind.STORED, first, stored)
        targets = self._through_below(0)
        if stored and targets:
            self._submit(_Job(stored, targets, 0, EventKind.STORED))
        return results

    def _put_first(
        self,
        first: Tier,
        keys: list[str],
        pages: list[int],
        on_late: Callable[[Any], None] | None,
    ) -> BatchResult:
        """The first tier's put; above a write-back tier, in parts that fit its capacity,
        each after its victims moved down (so none is evicted without being written back)."""
        capacity = first.plan.capacity_bytes
        if len(self.tiers) < 2 or self.tiers[1].plan.write != "back" or capacity is None:
            return first.store.put(keys, pages, on_late=on_late)
        step = max(1, capacity // self._page_bytes)
        results: list[bool] = []
        for start in range(0, len(keys), step):
            part = keys[start : start + step]
            self._demote(first, self._page_bytes * len(part), part)
            answer = first.store.put(part, pages[start : start + step], on_late=on_late)
            results += answer
            if answer.outcome is not Outcome.OK:
                results += [False] * (len(keys) - len(results))
                return BatchResult(results, answer.outcome)
        return BatchResult(results)

    def delete(self, keys: Sequence[str]) -> BatchResult:
        """Remove each key from every tier; True where some tier removed it."""
        keys = list(keys)
        removed = [False] * len(keys)
        for tier in self.tiers:
            answer = tier.store.delete(keys)
            for i, ok in enumerate(answer):
                removed[i] = removed[i] or ok
        return BatchResult(removed)

    def clear(self) -> bool:
        """Clear every tier; False if one failed."""
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
        return merged

    def tier_stats(self) -> list[dict[str, Any]]:
        """Each tier: its name, backend, page store counters, chain counters, occupancy."""
        out = []
        depth = self._queue.qsize()
        for tier in self.tiers:
            entry: dict[str, Any] = {
                "tier": tier.index,
                "name": tier.name,
                "backend": tier.plan.backend.name,
                "write": tier.plan.write,
                "promote": tier.plan.promote,
                "capacity_bytes": tier.plan.capacity_bytes,
                "occupancy_bytes": tier.eviction.nbytes if tier.eviction is not None else None,
                "queue_depth": depth if tier.index > 0 else 0,
                "store": tier.store.stats(),
            }
            counts: dict[str, int | float] = dict.fromkeys(_TIER_COUNTERS, 0)
            counts.update(tier.counters.snapshot())
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
                "quota_evictions": self.counters.snapshot().get(f"quota_evictions.{name}", 0),
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

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job queued before now was written; False if ``timeout`` passed."""
        if self._worker is None:
            return True
        done = threading.Event()
        try:
            self._queue.put(
                _Job([], [], -1, EventKind.STORED, staged=[], done=done), timeout=timeout
            )
        except queue.Full:
            return False
        return done.wait(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Stop the worker (after the queued jobs, within ``timeout``) and close every tier."""
        with self._lock:
            if self._closed:
                return True
            self._closed = True
            worker = self._worker
        if worker is not None:
            with contextlib.suppress(queue.Full):
                self._queue.put(None, timeout=timeout if timeout is not None else 10.0)
            worker.join(timeout if timeout is not None else 10.0)
        for store in self._staging_stores.values():
            store.close()
        closed = [tier.store.close(timeout) for tier in reversed(self.tiers)]
        return all(closed) and (worker is None or not worker.is_alive())

    # --- internals ------------------------------------------------------------------------

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

        def pinned(key: str) -> bool:
            return key in mine or key in self._in_flight

        for tenant, nbytes in incoming.items():
            excess = tier.eviction.tenant_bytes(tenant) + nbytes - quotas[tenant]
            if excess <= 0:
                continue
            victims = tier.eviction.choose_victims(excess, pinned=pinned, tenant=tenant)
            if victims:
                tier.store.delete(victims)
                tier.counters.add("quota_evictions", len(victims))
                self.counters.add(f"quota_evictions.{tenant}", len(victims))

    def _demote(self, tier: Tier, incoming: int, keep: list[str]) -> None:
        """Before ``tier`` goes over capacity, move its victims to the write-back tier below."""
        capacity = tier.plan.capacity_bytes
        if capacity is None or tier.eviction is None:
            return
        excess = tier.eviction.nbytes + incoming - capacity
        if excess <= 0:
            return
        mine = set(keep)
        victims = tier.eviction.choose_victims(
            excess, pinned=lambda k: k in mine or k in self._in_flight
        )
        if not victims:
            return
        staged = self._stage_from(tier, victims)
        kept = [key for key, page in zip(victims, staged, strict=True) if page is not None]
        pages = [page for page in staged if page is not None]
        if len(kept) < len(victims):
            self.tiers[tier.index + 1].counters.add("drops", len(victims) - len(kept))
        tier.store.delete(victims)
        if kept:
            self._submit(_Job(kept, [tier.index + 1], tier.index, EventKind.STORED, staged=pages))

    def _through_below(self, index: int) -> list[int]:
        """The write-through tiers a page stored in tier ``index`` cascades into."""
        out = []
        for tier in self.tiers[index + 1 :]:
            if tier.plan.write != "through":
                break
            out.append(tier.index)
        return out

    def _promote(self, keys: list[str], pages: list[int], source: dict[int, int]) -> None:
        """Copy the pages a lower tier served into staging, to write them up."""
        by_tier: dict[int, list[int]] = {}
        for i, tier_index in source.items():
            if tier_index > 0 and self.tiers[tier_index].plan.promote:
                by_tier.setdefault(tier_index, []).append(i)
        for tier_index, positions in by_tier.items():
            staged = self._take_staging(len(positions))
            if len(staged) < len(positions):
                self.tiers[tier_index].counters.add("drops", len(positions) - len(staged))
            if not staged:
                continue
            chosen = positions[: len(staged)]
            staging = self._staging_pool()
            for position, page in zip(chosen, staged, strict=True):
                _copy_page(self.pool.page_buffers(pages[position]), staging.page_buffers(page))
            targets = list(range(tier_index))
            self._submit(
                _Job([keys[i] for i in chosen], targets, tier_index, EventKind.PROMOTED, staged)
            )

    def _staging_pool(self) -> HostPool:
        with self._lock:
            if self._staging is None:
                pages = max(4, min(STAGING_PAGES, STAGING_BYTES // max(1, self._page_bytes)))
                self._staging = build_host_pool(self.plan, num_pages=pages, pin_memory=False)
                self._staging_free = list(range(pages))
            return self._staging

    def _take_staging(self, count: int) -> list[int]:
        self._staging_pool()
        with self._lock:
            taken, self._staging_free = self._staging_free[:count], self._staging_free[count:]
        return taken

    def _give_staging(self, pages: Iterable[int]) -> None:
        with self._lock:
            self._staging_free.extend(pages)

    def _staging_store(self, tier: Tier) -> PageStore:
        store = self._staging_stores.get(tier.index)
        if store is None:
            store = self._staging_stores[tier.index] = tier.store.sibling(self._staging_pool())
        return store

    def _stage_from(self, tier: Tier, keys: list[str]) -> list[int | None]:
        """Read ``keys`` from ``tier`` into staging pages (None where none was free or the
        read failed)."""
        pages = self._take_staging(len(keys))
        out: list[int | None] = [None] * len(keys)
        if not pages:
            return out
        read = self._staging_store(tier).get(keys[: len(pages)], pages)
        unused = []
        for i, (page, ok) in enumerate(zip(pages, read, strict=True)):
            if ok:
                out[i] = page
            else:
                unused.append(page)
        self._give_staging(unused)
        return out

    def _submit(self, job: _Job) -> None:
        """Queue a job for the worker; a full queue drops it (counted on its targets)."""
        with self._lock:
            if self._closed:
                return
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="kvtier-chain", daemon=True)
                self._worker.start()
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            for target in job.targets[:1]:
                self.tiers[target].counters.add("drops", len(job.keys))
            if job.staged:
                self._give_staging(job.staged)

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
                self.counters.add("worker_errors")
                log.warning("kvtier: the storage chain's worker failed a job: %r", exc)
                if job.staged:
                    self._give_staging(job.staged)

    def _write(self, job: _Job) -> None:
        """Write one job's pages into its target tiers (from staging, or read back)."""
        keys, staged = job.keys, job.staged
        if staged is None:
            got = self._stage_from(self.tiers[job.source], keys)
            keys = [key for key, page in zip(keys, got, strict=True) if page is not None]
            staged = [page for page in got if page is not None]
            if len(keys) < len(job.keys) and job.targets:
                self.tiers[job.targets[0]].counters.add("drops", len(job.keys) - len(keys))
        try:
            with self._lock:
                self._in_flight.update(keys)
            for target_index in job.targets:
                tier = self.tiers[target_index]
                chosen = [
                    (k, p) for k, p in zip(keys, staged, strict=True) if self._admits(tier, k)
                ]
                if not chosen:
                    continue
                names = [k for k, _ in chosen]
                self._describe(tier, names)
                self._enforce_quota(tier, names)
                results = self._staging_store(tier).put(names, [p for _, p in chosen])
                written = [k for k, ok in zip(names, results, strict=True) if ok]
                tier.counters.add(
                    "promotions" if job.kind is EventKind.PROMOTED else "cascades", len(written)
                )
                if len(written) < len(names):
                    tier.counters.add("failures", len(names) - len(written))
                self._emit(job.kind, tier, written)
        finally:
            with self._lock:
                self._in_flight.difference_update(keys)
            self._give_staging(staged)

    def _admits(self, tier: Tier, key: str) -> bool:
        admission = tier.admission
        if admission is None:
            return True
        admission.record_access(key)
        if admission.admit(key, self._page_bytes):
            return True
        tier.counters.add("admission_refused")
        return False

    def _emit(self, kind: EventKind, tier: Tier, keys: Iterable[str]) -> None:
        self.events.emit(
            Event(kind, tier.index, tier.name, key, self.tenant_of(key), self._page_bytes)
            for key in keys
        )

    def removed(self, tier_index: int, key: str, evicted: bool) -> None:
        """A page left tier ``tier_index`` (evicted: to make room): count it, emit it."""
        tier = self.tiers[tier_index]
        if evicted:
            tier.counters.add("evictions")
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
    goes through it); a tier that fails to open closes the ones opened before it.
    """
    tiers: list[Tier] = []
    chain_box: list[StorageChain] = []

    def removed(index: int) -> Callable[[str, bool], None]:
        def forward(key: str, evicted: bool) -> None:
            if chain_box:
                chain_box[0].removed(index, key, evicted)

        return forward

    try:
        for tier_plan in plan.storage_tiers():
            eviction = None
            if tier_plan.eviction is not None:
                eviction = ObservedEviction(tier_plan.eviction.build(), removed(tier_plan.index))
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
    except BaseException:
        for tier in reversed(tiers):
            tier.store.close()
        raise
    chain = StorageChain(plan, tiers, pool, queue_pages=queue_pages)
    chain_box.append(chain)
    return chain
