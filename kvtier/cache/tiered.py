"""TieredCache: the object an engine embeds to back KV pages up and bring prefixes back.

The engine keeps KV on its device (L1). The cache keeps a host pool (L2, a keyed LRU with
pins) and one storage backend (L3), and moves pages between the three without stalling
the forward pass:

- :meth:`TieredCache.backup` copies device pages into the host pool on a worker, then
  writes them to storage according to the write policy (``write_through``,
  ``write_through_selective`` after N hits, or ``write_back`` on eviction). Layer-sharded
  pools back a page up one layer at a time (``backup(keys, slots, layer=i)``); the page
  is ready, and written, once its last layer has arrived.
- :meth:`TieredCache.prefetch` finds the longest stored prefix (host, then storage),
  allocates host pages and reads the missing ones on workers; the returned
  :class:`PrefetchHandle` says how many leading pages are ready and can be cancelled.
- :meth:`TieredCache.load` copies a handle's ready prefix (per the prefetch policy) into
  device slots, all layers at once or one layer at a time to overlap with compute.

:meth:`TieredCache.open` resolves the whole configuration before it allocates anything,
through the one construction path (:mod:`kvtier.core.capabilities`), and the cache runs
only the operations the config declared: start-up checked exactly those. Backend failures
never reach the engine: they fail that operation's pages, are counted in
:meth:`TieredCache.stats` by cause, and are logged once per cause.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from kvtier.cache.bounded import BoundedCaller, Outcome
from kvtier.cache.handles import BackupHandle, PrefetchHandle
from kvtier.cache.index import Entry, HostIndex
from kvtier.cache.metrics import prometheus_collector, prometheus_text
from kvtier.cache.options import CacheOptions, cache_options
from kvtier.cache.stats import CacheStats
from kvtier.cache.workers import Job, WorkerGroup
from kvtier.core.capabilities import (
    ResolvedPlan,
    build_host_pool,
    build_io_backend,
    open_page_store,
    resolve,
)
from kvtier.core.config import EngineConfig, load_engine_config
from kvtier.core.errors import (
    CacheClosedError,
    InvalidFieldError,
    KvtierError,
    OperationNotDeclaredError,
    PoolExhaustedError,
    TransferError,
)
from kvtier.core.geometry import AttentionKind, KVGeometry
from kvtier.core.host_pool import HostPool
from kvtier.core.io import IOBackend, check_device_slots
from kvtier.core.keys import validate_key
from kvtier.core.pagestore import PageStore
from kvtier.core.specs import Operation
from kvtier.core.storage import StorageBackend

if TYPE_CHECKING:
    from kvtier.core.device_pool import DevicePool
    from kvtier.plugins.registry import Registry

__all__ = ["TieredCache", "open_cache"]

log = logging.getLogger("kvtier.cache")

#: Bound on one backend ``stats()`` call (a scrape must not wait a full call bound).
STATS_BOUND_S = 2.0
#: After close's bound, how long workers woken from abandoned calls get to end.
_WAKE_GRACE_S = 0.5


@dataclass(eq=False, slots=True)
class _Layered:
    """A page being backed up layer by layer: its entry and the layers copied so far."""

    entry: Entry
    layers: set[int] = field(default_factory=set)


class TieredCache:
    """Device (L1) <-> host pool (L2) <-> storage (L3), with asynchronous backup and prefetch.

    Build it with :meth:`open` (or :func:`open_cache`); the constructor takes parts that
    are already built and is meant for tests and advanced embedding.
    """

    def __init__(
        self,
        *,
        plan: ResolvedPlan,
        device_pool: DevicePool,
        host_pool: HostPool,
        io_backend: IOBackend,
        page_store: PageStore,
        options: CacheOptions | None = None,
    ) -> None:
        self.plan = plan
        self.config: EngineConfig = plan.config
        self.geometry: KVGeometry = plan.geometry
        self.options = options or CacheOptions()
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.io_backend = io_backend
        self.page_store = page_store
        cfg = self.config
        self.keyer = plan.keyer()
        #: MLA ranks hold the same latent: only rank 0 writes it to storage.
        self.writes_storage = not (
            self.geometry.attention is AttentionKind.MLA and cfg.tp_rank != 0
        )
        self._stats = CacheStats()
        self._index = HostIndex(
            host_pool,
            write_back=self.options.write_policy == "write_back",
            on_evicted=lambda n: self._stats.add("evictions", n),
        )
        self._logged: set[str] = set()
        self._log_lock = threading.Lock()
        self._closed = False
        #: running jobs stop between batches once time.monotonic() passes this (close)
        self._stop_at = float("inf")
        self._close_lock = threading.Lock()
        opts = self.options
        self._transfer = WorkerGroup("transfer", 1, opts.queue_size, self._worker_error)
        self._reads = WorkerGroup("read", opts.io_workers, opts.queue_size, self._worker_error)
        self._writes = WorkerGroup("write", opts.write_workers, opts.queue_size, self._worker_error)
        #: every backend call goes through here, bounded by backend_call_timeout_s
        self._calls = BoundedCaller(
            "backend", opts.backend_call_timeout_s, opts.max_abandoned_calls
        )
        #: pages of per-layer backups still waiting for layers; the transfer worker's alone
        self._layered: dict[str, _Layered] = {}

    @property
    def backend(self) -> StorageBackend:
        """The storage backend (L3) behind the page store."""
        return self.page_store.backend

    # --- construction -------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        config: EngineConfig | Mapping[str, Any] | str,
        device_pool: DevicePool,
        *,
        options: CacheOptions | Mapping[str, Any] | None = None,
        registry: Registry | None = None,
    ) -> TieredCache:
        """Resolve ``config`` against the plugins, then build host pool, IO and storage.

        Every config problem raises a :class:`~kvtier.core.errors.ConfigError` before any
        memory is allocated or any thread started. ``config`` is an EngineConfig, a
        mapping, or JSON text / ``@file``; ``options`` a CacheOptions or a mapping.
        """
        cfg = config if isinstance(config, EngineConfig) else load_engine_config(config)
        opts = cache_options(options)
        if registry is None:
            from kvtier.plugins.manager import default_registry

            registry = default_registry()
        plan = resolve(cfg, registry.backends, registry.io_backends)
        _check_device_pool(device_pool, plan)
        io_backend = build_io_backend(plan)
        host_pool = build_host_pool(plan)
        store = open_page_store(plan, host_pool)
        try:
            cache = cls(
                plan=plan,
                device_pool=device_pool,
                host_pool=host_pool,
                io_backend=io_backend,
                page_store=store,
                options=opts,
            )
        except BaseException:
            store.backend.close()
            raise
        log.info(
            "kvtier cache open: backend=%s io_backend=%s layout=%s host_pages=%d "
            "write_policy=%s prefetch_policy=%s",
            plan.backend.name,
            plan.io_backend.name,
            plan.layout.value,
            host_pool.num_pages,
            opts.write_policy,
            opts.prefetch_policy,
        )
        return cache

    # --- keys -----------------------------------------------------------------------------

    def keys(self, tokens: Any, *, parent: str | None = None) -> list[str]:
        """The chained page keys of ``tokens``' full pages in this cache's namespace."""
        return self.keyer.keys(tokens, parent=parent)

    # --- backup ---------------------------------------------------------------------------

    def backup(
        self, keys: Sequence[str], device_slots: torch.Tensor, *, layer: int | None = None
    ) -> BackupHandle:
        """Copy the pages at ``device_slots`` to the host pool, then storage, asynchronously.

        ``device_slots`` holds ``len(keys) * page_size`` token slots (page ``i`` is
        ``device_slots[i*ps:(i+1)*ps]``). Keep those slots unchanged until
        ``handle.wait_host()``. Keys already cached are not copied again. Failures are
        reported on the handle and in stats, never raised from a worker.

        ``layer`` copies one layer (``backup_layer``, for layer-sharded pools): call it
        once per layer for the same keys; a page becomes ready, and is written to storage,
        when its last layer has arrived, and stays pinned until then (or until close).
        """
        self._check_open()
        if layer is None:
            self._require(Operation.BACKUP_ALL, "backup()")
        else:
            self._require(Operation.BACKUP_LAYER, f"backup(layer={layer!r})")
            self._check_layer(layer)
        keys = [validate_key(k) for k in keys]
        slots = self._checked_slots(device_slots, len(keys))
        handle = BackupHandle(keys)
        if not keys:
            handle._finish()
            return handle
        started = time.monotonic()
        job = Job(
            lambda: self._run_backup(handle, keys, slots, started, layer),
            lambda: self._cancel_backup(handle, len(keys)),
        )
        if not self._transfer.submit(job):
            if self._closed:
                self._cancel_backup(handle, len(keys))
            else:
                self._fail("queue_full", len(keys), "the transfer queue is full")
                handle._fail(len(keys), _busy("transfer", self.options.queue_size))
                handle._finish()
        return handle

    def _checked_slots(self, device_slots: Any, pages: int) -> torch.Tensor:
        """The backup's slots, checked, as a private int64 copy (the job runs later)."""
        slots = check_device_slots(
            device_slots,
            page_size=self.geometry.page_size,
            pages=pages,
            num_slots=self.device_pool.num_slots,
        )
        return slots.detach().clone()

    def _run_backup(
        self,
        handle: BackupHandle,
        keys: list[str],
        slots: torch.Tensor,
        started: float,
        layer: int | None,
    ) -> None:
        try:
            self._backup_pages(handle, keys, slots, started, layer)
        except BaseException as exc:
            if not handle.host_done.is_set():
                handle._fail(len(keys) - handle.pages_copied - handle.pages_cached, exc)
                handle._host_ended()
            raise

    def _place(self, handle: BackupHandle, keys: list[str]) -> list[tuple[Entry, bool]]:
        """Host entries for ``keys`` (new ones pinned once); a shortfall fails the rest."""
        placed = self._index.insert(
            keys, pins=1, wait_s=self.options.alloc_wait_s, on_victims=self._write_victims
        )
        if len(placed) < len(keys):
            missing = len(keys) - len(placed)
            counts = self._index.counts()
            self._fail(
                "host_exhausted",
                missing,
                f"{counts['pinned']} of {counts['total']} host pages are pinned",
            )
            handle._fail(missing, self._exhausted(missing))
        return placed

    def _layer_targets(
        self, handle: BackupHandle, keys: list[str]
    ) -> tuple[list[tuple[int, Entry]], list[Entry]]:
        """A per-layer backup's (position, entry) to copy into, and the pages already cached.

        Keys seen for the first time get a pending entry that waits for all layers.
        """
        fresh = [key for key in dict.fromkeys(keys) if key not in self._layered]
        existing: list[Entry] = []
        for entry, new in self._place(handle, fresh) if fresh else []:
            if new:
                self._layered[entry.key] = _Layered(entry)
            else:
                existing.append(entry)
        layered = self._layered
        targets = [(i, layered[key].entry) for i, key in enumerate(keys) if key in layered]
        return targets, existing

    def _backup_pages(
        self,
        handle: BackupHandle,
        keys: list[str],
        slots: torch.Tensor,
        started: float,
        layer: int | None,
    ) -> None:
        opts = self.options
        ps = self.geometry.page_size
        if layer is None:
            placed = self._place(handle, keys)
            targets = [(i, entry) for i, (entry, new) in enumerate(placed) if new]
            existing = [entry for entry, new in placed if not new]
        else:
            targets, existing = self._layer_targets(handle, keys)
        handle.pages_cached = len(existing)
        self._stats.add("backup_already_cached", len(existing))
        page_bytes = self.geometry.bytes_per_page
        if layer is not None:
            page_bytes //= self.geometry.num_layers
        # Copy in batches, so write_through's storage writes of one batch overlap with
        # the device -> host copy of the next.
        for start in range(0, len(targets), opts.batch_pages):
            batch = targets[start : start + opts.batch_pages]
            entries = [entry for _, entry in batch]
            first, last = batch[0][0], batch[-1][0]
            if last - first + 1 == len(batch):
                source = slots[first * ps : (last + 1) * ps]
            else:  # only the pages not cached yet: their slots, page by page
                positions = torch.tensor([i for i, _ in batch], dtype=torch.int64)
                source = slots.view(-1, ps)[positions].reshape(-1)
            t0 = time.monotonic()
            try:
                self.io_backend.backup(
                    self.device_pool,
                    self.host_pool,
                    source,
                    [e.page for e in entries],
                    layer=layer,
                )
            except Exception as exc:
                rest = list(dict.fromkeys(entry for _, entry in targets[start:]))
                for entry in rest:
                    self._layered.pop(entry.key, None)
                self._index.mark_failed(rest)
                self._index.release(rest)
                self._fail("device_to_host", len(rest), repr(exc))
                handle._fail(len(rest), exc)
                break
            elapsed = time.monotonic() - t0
            self._stats.latency["device_to_host"].observe(elapsed)
            self._stats.busy("device_to_host", elapsed, len(entries) * page_bytes)
            handle.pages_copied += len(entries)
            if layer is not None:
                entries = self._layers_arrived(entries, layer)
            self._host_copy_done(handle, entries)
        if self.writes_storage and opts.write_policy == "write_through_selective":
            hot = [e for e in existing if e.hits >= opts.write_threshold]
            claimed = self._index.claim_writes(hot)
            if claimed:
                self._submit_write(claimed, None)
        self._stats.latency["backup"].observe(time.monotonic() - started)
        handle._host_ended()

    def _layers_arrived(self, entries: list[Entry], layer: int) -> list[Entry]:
        """Record ``layer`` for each entry; return those that now hold every layer."""
        complete = []
        for entry in dict.fromkeys(entries):
            state = self._layered.get(entry.key)
            if state is None or state.entry is not entry:
                continue
            state.layers.add(layer)
            if len(state.layers) == self.geometry.num_layers:
                del self._layered[entry.key]
                complete.append(entry)
        return complete

    def _host_copy_done(self, handle: BackupHandle | None, entries: list[Entry]) -> None:
        """Pages now whole in the host pool: make them ready, write them as the policy says."""
        if not entries:
            return
        self._index.mark_ready(entries)
        self._stats.add("pages_backed_up", len(entries))
        policy = self.options.write_policy
        if not self.writes_storage:
            self._stats.add("storage_writes_skipped", len(entries))
        elif policy == "write_through":
            claimed = self._index.claim_writes(entries)
            if claimed:
                if handle is not None:
                    handle._write_started()
                self._submit_write(claimed, handle)
        elif policy == "write_back":
            self._index.mark_dirty(entries)
        self._index.release(entries)

    def _drop_layered(self) -> None:
        """Give up the pages whose layers never all arrived (at close)."""
        entries = [state.entry for state in self._layered.values()]
        self._layered.clear()
        if entries:
            self._stats.add("pages_cancelled", len(entries))
            self._index.mark_failed(entries)
            self._index.release(entries)

    def _cancel_backup(self, handle: BackupHandle, pages: int) -> None:
        if not handle.host_done.is_set():
            self._stats.add("pages_cancelled", pages)
            handle._fail(pages, CacheClosedError("the cache closed before this backup ran"))
        handle._finish()

    # --- storage writes -------------------------------------------------------------------

    def _submit_write(self, entries: list[Entry], handle: BackupHandle | None) -> None:
        """Queue a claimed write; when the queue is full, write here rather than drop it."""
        job = Job(
            lambda: self._run_write(entries, handle),
            lambda: self._cancel_write(entries, handle),
        )
        if not self._writes.submit(job):
            self._stats.add("writes_inline")
            self._run_write(entries, handle)

    def _write_victims(self, victims: list[Entry]) -> None:
        if victims:
            self._stats.add("write_backs", len(victims))
            self._submit_write(victims, None)

    def _run_write(self, entries: list[Entry], handle: BackupHandle | None) -> None:
        batch = self.options.batch_pages
        chunk: list[Entry] = []
        written = 0
        try:
            while entries:
                if time.monotonic() >= self._stop_at:
                    self._stats.add("writes_cancelled", len(entries))
                    break
                chunk, entries = entries[:batch], entries[batch:]
                t0 = time.monotonic()
                try:
                    outcome, results = self._calls.call(
                        "put",
                        partial(
                            self.page_store.put, [e.key for e in chunk], [e.page for e in chunk]
                        ),
                        on_late=partial(self._late_put, chunk),
                    )
                except Exception as exc:  # bad keys cannot get here; stay safe anyway
                    outcome, results = Outcome.OK, [False] * len(chunk)
                    self._fail("storage_put", 0, repr(exc))
                if outcome is not Outcome.OK:
                    self._call_failed(outcome, "put", len(chunk) + len(entries))
                    if outcome is Outcome.TIMED_OUT:
                        chunk = []  # still being read by the call: _late_put gives it back
                    break
                elapsed = time.monotonic() - t0
                ok = sum(results)
                self._stats.latency["storage_put"].observe(elapsed)
                self._stats.busy("storage_write", elapsed, ok * self.geometry.bytes_per_page)
                self._stats.add("storage_pages_written", ok)
                if ok < len(chunk):
                    self._fail("storage_put", len(chunk) - ok, "the backend refused the page")
                written += ok
                self._index.finish_write(chunk, results)
                chunk = []
        finally:
            entries = chunk + entries
            if entries:  # an unexpected error mid-way: give the rest back unwritten
                self._index.finish_write(entries, [False] * len(entries))
            if handle is not None:
                handle._write_ended(written)

    def _late_put(self, chunk: list[Entry], results: object) -> None:
        """A timed-out put returned at last: record what it stored, unpin its pages."""
        ok = results if isinstance(results, list) and len(results) == len(chunk) else None
        self._index.finish_write(chunk, ok or [False] * len(chunk))

    def _cancel_write(self, entries: list[Entry], handle: BackupHandle | None) -> None:
        self._stats.add("writes_cancelled", len(entries))
        self._index.finish_write(entries, [False] * len(entries))
        if handle is not None:
            handle._write_ended(0)

    # --- prefetch -------------------------------------------------------------------------

    def prefetch(self, keys: Sequence[str]) -> PrefetchHandle:
        """Find the longest cached prefix of ``keys`` and start bringing it into the host pool.

        Host hits are pinned at once; the storage prefix is found with one batched
        ``exists`` and read on workers. The handle reports the ready prefix as it grows.
        """
        self._check_open()
        started = time.monotonic()
        keys = list(keys)
        for key in keys:
            if not isinstance(key, str):
                validate_key(key)  # raises InvalidKeyError naming the bad key
        # The charset is checked where a bad key could do harm: the index only holds keys
        # that backup validated, and page_store.exists validates every key it is asked
        # about (raising InvalidKeyError here, in the caller, pins given back first).
        host = self._index.acquire_prefix(keys)
        rest = keys[len(host) :]
        if self.writes_storage and self.options.write_policy == "write_through_selective":
            hot = [e for e in host if e.hits >= self.options.write_threshold]
            claimed = self._index.claim_writes(hot)
            if claimed:
                self._submit_write(claimed, None)
        entries = list(host)
        fresh: list[Entry] = []
        if rest:
            # Walk host and storage together: write_back keeps the newest pages of a
            # prefix only on the host while older ones were evicted to storage.
            try:
                outcome, in_storage = self._calls.call(
                    "exists", lambda: self.page_store.exists(rest)
                )
            except BaseException:
                self._index.release(host)
                raise
            if outcome is not Outcome.OK:
                self._call_failed(outcome, "exists", len(rest))
                in_storage = [False] * len(rest)
            found = 0
            for key, stored in zip(rest, in_storage, strict=True):
                if not (stored or self._index.contains(key)):
                    break
                found += 1
            if found:
                placed = self._index.insert(
                    rest[:found],
                    pins=2,
                    pin_existing=True,
                    wait_s=self.options.alloc_wait_s,
                    wait_on_pins=False,  # the caller's thread waits for write-backs only
                    on_victims=self._write_victims,
                )
                if len(placed) < found:
                    missing = found - len(placed)
                    counts = self._index.counts()
                    self._fail(
                        "host_exhausted",
                        missing,
                        f"{counts['pinned']} of {counts['total']} host pages are pinned",
                    )
                entries += [entry for entry, _ in placed]
                fresh = [entry for entry, new in placed if new]
        from_host = len(entries) - len(fresh)
        self._stats.add("host_hits", from_host)
        self._stats.add("host_misses", len(keys) - from_host)
        self._stats.add("storage_hits", len(fresh))
        self._stats.add("storage_misses", len(keys) - len(entries))
        handle = PrefetchHandle(self, keys, entries, from_host, started)
        if not fresh:
            handle.finished.set()
            self._stats.latency["prefetch"].observe(time.monotonic() - started)
            return handle
        job = Job(
            lambda: self._run_fetch(handle, fresh),
            lambda: self._abandon_fetch(handle, fresh),
        )
        if not self._reads.submit(job):
            if not self._closed:
                self._fail("queue_full", len(fresh), "the read queue is full")
            self._abandon_fetch(handle, fresh)
        return handle

    def _run_fetch(self, handle: PrefetchHandle, entries: list[Entry]) -> None:
        batch = self.options.batch_pages
        done = 0
        failed = False
        try:
            while done < len(entries):
                if handle.cancelled or time.monotonic() >= self._stop_at:
                    break
                chunk = entries[done : done + batch]
                t0 = time.monotonic()
                outcome, results = self._calls.call(
                    "get",
                    partial(self.page_store.get, [e.key for e in chunk], [e.page for e in chunk]),
                    on_late=partial(self._late_get, chunk),
                )
                if outcome is not Outcome.OK:
                    failed = True
                    self._call_failed(outcome, "get", len(entries) - done)
                    if outcome is Outcome.TIMED_OUT:
                        # Readers see the failure now; the pages stay pinned until the
                        # call returns (the backend may still write into them).
                        self._index.mark_failed(chunk)
                        done += len(chunk)
                    break
                elapsed = time.monotonic() - t0
                good = 0
                while good < len(chunk) and results[good]:
                    good += 1
                self._stats.latency["storage_get"].observe(elapsed)
                self._stats.busy("storage_read", elapsed, good * self.geometry.bytes_per_page)
                self._stats.add("storage_pages_read", good)
                self._stats.add("pages_prefetched", good)
                self._index.mark_ready(chunk[:good], stored=True)
                self._index.release(chunk[:good])
                done += good
                if good < len(chunk):
                    self._fail("storage_get", 1, "a page was missing or failed verification")
                    break  # keys are chained: pages after a hole are of no use to this prefix
        finally:
            rest = entries[done:]
            if rest:
                self._abandon_fetch(handle, rest)
            else:
                handle.finished.set()
                if not failed:
                    self._stats.latency["prefetch"].observe(time.monotonic() - handle.started)

    def _late_get(self, chunk: list[Entry], _results: object) -> None:
        """A timed-out get returned at last: its pages may now be reused."""
        self._index.release(chunk)

    def _abandon_fetch(self, handle: PrefetchHandle, entries: list[Entry]) -> None:
        """Drop pages a fetch will not read (cancelled, closed, or after a failed page)."""
        self._stats.add("pages_cancelled", len(entries))
        self._index.mark_failed(entries)
        self._index.release(entries)
        handle.finished.set()

    # --- load -----------------------------------------------------------------------------

    def load(
        self,
        handle: PrefetchHandle | Sequence[str],
        device_slots: torch.Tensor,
        *,
        layer: int | None = None,
    ) -> int:
        """Copy the prefetched prefix into ``device_slots``; return the pages loaded.

        ``handle`` is a :class:`PrefetchHandle` (its policy decides how long to wait) or
        a list of keys (prefetched and waited for here, up to ``max_load_wait_s``).
        ``device_slots`` holds token slots for at least the pages to load; extra slots
        are left alone. ``layer`` loads one layer; the handle stays pinned until every
        layer was loaded once.
        """
        self._check_open()
        if layer is None:
            self._require(Operation.LOAD_ALL, "load()")
        else:
            self._require(Operation.LOAD_LAYER, f"load(layer={layer!r})")
            self._check_layer(layer)
        own = not isinstance(handle, PrefetchHandle)
        if isinstance(handle, PrefetchHandle):
            prefetched = handle
            if prefetched._cache is not self:
                raise InvalidFieldError(
                    "handle", "this prefetch handle belongs to another TieredCache", value=handle
                )
        else:
            prefetched = self.prefetch(handle)
            prefetched.wait(self.options.max_load_wait_s)
        try:
            slots = check_device_slots(device_slots, page_size=self.geometry.page_size)
            usable = prefetched.settle()
            ps = self.geometry.page_size
            count = min(usable, slots.numel() // ps)
            pages = [entry.page for entry in prefetched._entries[:count]]
            if count:
                t0 = time.monotonic()
                try:
                    self.io_backend.load(
                        self.host_pool, self.device_pool, pages, slots[: count * ps], layer=layer
                    )
                except TransferError:
                    raise
                except Exception as exc:
                    self._fail("host_to_device", count, repr(exc))
                    raise
                elapsed = time.monotonic() - t0
                nbytes = count * self.geometry.bytes_per_page
                if layer is not None:
                    nbytes //= self.geometry.num_layers
                self._stats.latency["load"].observe(elapsed)
                self._stats.busy("host_to_device", elapsed, nbytes)
            if layer is None:
                self._stats.add("pages_loaded", count)
            else:
                prefetched._layers_loaded.add(layer)
                if len(prefetched._layers_loaded) == self.geometry.num_layers:
                    self._stats.add("pages_loaded", count)
            return count
        finally:
            if own or layer is None or len(prefetched._layers_loaded) == self.geometry.num_layers:
                prefetched.release()

    # --- stats ----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Hits and misses per tier, bytes, bandwidth, latency histograms, failures by cause."""
        snap = self._stats.snapshot()
        snap["host"]["pages"] = self._index.counts()
        snap["page_bytes"] = self.geometry.bytes_per_page
        snap["queues"] = {
            "transfer": self._transfer.depth(),
            "read": self._reads.depth(),
            "write": self._writes.depth(),
        }
        snap["page_store"] = self.page_store.stats()
        snap["backend"] = self._backend_stats()
        snap["backend_calls"] = self._calls.counts()
        snap["policies"] = {
            "write": self.options.write_policy,
            "prefetch": self.options.prefetch_policy,
            "writes_storage": self.writes_storage,
        }
        return snap

    def _backend_stats(self) -> dict[str, Any]:
        """The backend's own ``stats()``, bounded (STATS_BOUND_S) once the cache is open."""
        try:
            if self._closed:
                return dict(self.backend.stats())
            outcome, values = self._calls.call("stats", self.backend.stats, timeout=STATS_BOUND_S)
        except Exception as exc:
            return {"error": repr(exc)}
        if outcome is not Outcome.OK:
            return {"error": f"stats() {outcome.value}"}
        return dict(values)

    def prometheus_collector(self) -> Any:
        """A prometheus_client collector of this cache's ``kvtier_*`` metrics.

        Register it with ``prometheus_client.REGISTRY.register(...)``. Every series is
        labelled with ``model``, ``rank``, ``tenant`` and ``backend`` (see
        docs/operating.md). Needs the ``prometheus`` extra; raises ImportError naming it
        otherwise.
        """
        cfg = self.config
        identity = {
            "model": cfg.model,
            "rank": str(cfg.tp_rank),
            "tenant": cfg.tenant or "",
            "backend": self.plan.backend.name,
        }
        return prometheus_collector(self.stats, identity)

    def prometheus_text(self) -> str:
        """This cache's metrics in the Prometheus text exposition format."""
        return prometheus_text(self.prometheus_collector())

    # --- shutdown -------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until no queued or running work is left; False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        groups = (self._transfer, self._reads, self._writes)
        while True:
            if all(g.idle() for g in groups):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.001)

    def close(self, *, drain: bool = True, timeout: float | None = None) -> bool:
        """Stop the workers and release storage; True if every thread ended in time.

        ``drain`` finishes queued backups, prefetches and writes (write_back flushes its
        dirty pages) within ``timeout`` (default ``options.close_timeout_s``); what is
        left then, or everything with ``drain=False``, is cancelled. Idempotent.
        """
        with self._close_lock:
            if self._closed:
                return True
            self._closed = True
        bound = self.options.close_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + bound
        self._stop_at = deadline if drain else time.monotonic()
        groups = (self._transfer, self._reads, self._writes)
        joined = self._transfer.close(drain=drain, deadline=deadline, warn=False)
        if drain and self.options.write_policy == "write_back" and self.writes_storage:
            dirty = self._index.claim_dirty()
            if dirty:
                self._stats.add("write_backs", len(dirty))
                self._submit_write(dirty, None)
        joined = self._reads.close(drain=drain, deadline=deadline, warn=False) and joined
        joined = self._writes.close(drain=drain, deadline=deadline, warn=False) and joined
        if not joined:
            # Workers still waiting on a backend call at close's bound: those calls fail
            # now (their threads are abandoned) and the workers get a short grace to end.
            self._calls.abandon_in_flight()
            grace = time.monotonic() + _WAKE_GRACE_S
            joined = all([g.join(grace, warn=True) for g in groups])
        if joined:
            self._drop_layered()  # the transfer worker has ended: nothing else touches it
        self._index.drop_all()
        closed = self._close_backend(bound)
        stuck = self._calls.close(time.monotonic() + _WAKE_GRACE_S)
        if stuck:
            log.warning(
                "kvtier cache: close gave up on %d backend call(s) still running past their "
                "bound, left to daemon threads: %s",
                len(stuck),
                "; ".join(stuck),
            )
        return joined and closed and not stuck

    def _close_backend(self, bound: float) -> bool:
        """The backend's close(), bounded by ``bound``; False if it failed or hung."""
        try:
            outcome, _ = self._calls.call("close", self.backend.close, timeout=bound)
        except Exception as exc:
            self._fail("backend_close", 0, repr(exc))
            return False
        if outcome is not Outcome.OK:
            self._call_failed(outcome, "close", 0)
            return False
        return True

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"TieredCache(backend={self.plan.backend.name}, io={self.plan.io_backend.name}, "
            f"layout={self.plan.layout.value}, host_pages={self.host_pool.num_pages}, "
            f"closed={self._closed})"
        )

    # --- internals ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosedError("this TieredCache is closed; open a new one", value=self)

    def _require(self, operation: Operation, call: str) -> None:
        """Refuse an operation the config did not declare (start-up never checked it)."""
        if not self.plan.declares(operation):
            declared = [op.value for op in Operation if op in self.plan.operations]
            raise OperationNotDeclaredError(operation.value, call, declared)

    def _check_layer(self, layer: object) -> None:
        layers = self.geometry.num_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < layers:
            raise TransferError(
                f"layer {layer!r} is out of range: the geometry has layers 0..{layers - 1}",
                value=layer,
            )

    def _fail(self, cause: str, pages: int, detail: str) -> None:
        """Count a failure by cause and log it the first time that cause occurs."""
        self._stats.fail(cause, pages)
        with self._log_lock:
            first = cause not in self._logged
            self._logged.add(cause)
        if first:
            log.warning(
                "kvtier cache: %s (%s); later %s failures are counted in stats()['failures'] only",
                cause,
                detail,
                cause,
            )

    def _call_failed(self, outcome: Outcome, operation: str, pages: int) -> None:
        """A backend call that timed out or was refused: its operation's pages failed."""
        if outcome is Outcome.TIMED_OUT:
            bound = (
                f"close_timeout_s={self.options.close_timeout_s}"
                if operation == "close"
                else f"backend_call_timeout_s={self.options.backend_call_timeout_s}"
            )
            self._fail(
                "backend_timeout" if operation != "close" else "backend_close",
                pages,
                f"a backend {operation} call did not return within {bound}",
            )
        else:
            self._fail(
                "backend_refused",
                pages,
                f"a backend {operation} call was refused: max_abandoned_calls="
                f"{self.options.max_abandoned_calls} calls are still stuck",
            )

    def _worker_error(self, group: str, exc: BaseException) -> None:
        self._fail(f"{group}_worker_error", 1, f"{type(exc).__name__}: {exc}")

    def _exhausted(self, pages: int) -> PoolExhaustedError:
        counts = self._index.counts()
        return PoolExhaustedError(
            f"host pool exhausted: no page for {pages} page(s); {counts['pinned']} of "
            f"{counts['total']} pages are pinned by prefetch handles or in-flight transfers. "
            "Load or release prefetch handles sooner, or grow host_pages / host_bytes",
            value=pages,
        )


def _busy(queue: str, size: int) -> KvtierError:
    return KvtierError(
        f"the {queue} queue is full ({size} operations); the operation was dropped. "
        "Raise CacheOptions.queue_size or back up less often",
        value=size,
    )


def _check_device_pool(device_pool: Any, plan: ResolvedPlan) -> None:
    """The engine's device pool must match the configured geometry (before allocation)."""
    geometry = getattr(device_pool, "geometry", None)
    if geometry is None or not hasattr(device_pool, "num_slots"):
        raise InvalidFieldError(
            "device_pool",
            f"{type(device_pool).__name__} is not a device pool: it needs geometry, num_slots "
            "and device (see kvtier.core.device_pool.DevicePool)",
            value=device_pool,
        )
    if geometry != plan.geometry:
        raise InvalidFieldError(
            "device_pool",
            f"the device pool's geometry ({geometry.describe()}) differs from the config's "
            f"({plan.geometry.describe()})",
            value=geometry,
        )


def open_cache(
    config: EngineConfig | Mapping[str, Any] | str,
    device_pool: DevicePool,
    registry: Registry | None = None,
    *,
    options: CacheOptions | Mapping[str, Any] | None = None,
) -> TieredCache:
    """Open a :class:`TieredCache`: same as :meth:`TieredCache.open`."""
    return TieredCache.open(config, device_pool, options=options, registry=registry)
