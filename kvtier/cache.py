"""TieredCache: the object an engine embeds to back KV pages up and bring prefixes back.

The engine keeps KV on its device (L1). The cache keeps a host pool (L2, a keyed LRU with
pins) and one storage backend (L3), and moves pages between the three without stalling
the forward pass:

- :meth:`TieredCache.backup` copies device pages into the host pool on a worker, then
  writes them to storage according to the write policy (``write_through``,
  ``write_through_selective`` after N hits, or ``write_back`` on eviction).
- :meth:`TieredCache.prefetch` finds the longest stored prefix (host, then storage),
  allocates host pages and reads the missing ones on workers; the returned
  :class:`PrefetchHandle` says how many leading pages are ready and can be cancelled.
- :meth:`TieredCache.load` copies a handle's ready prefix (per the prefetch policy) into
  device slots, all layers at once or one layer at a time to overlap with compute.

:meth:`TieredCache.open` resolves the whole configuration before it allocates anything.
Backend failures never reach the engine: they fail that operation's pages, are counted in
:meth:`TieredCache.stats` by cause, and are logged once per cause.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from kvtier._cache_index import Entry, EntryState, HostIndex
from kvtier._cache_stats import CacheStats, prometheus_collector
from kvtier._cache_workers import Job, WorkerGroup
from kvtier.core.capabilities import ResolvedPlan, resolve
from kvtier.core.config import EngineConfig, load_engine_config, validate_model
from kvtier.core.errors import (
    CacheClosedError,
    InvalidFieldError,
    KvtierError,
    PoolExhaustedError,
    PrometheusMissingError,
    TransferError,
)
from kvtier.core.geometry import AttentionKind, KVGeometry
from kvtier.core.host_pool import HostPool
from kvtier.core.keys import Namespace, PageKeyer, validate_key
from kvtier.core.pagestore import PageStore
from kvtier.core.storage import StorageBackend

if TYPE_CHECKING:
    from kvtier.core.device_pool import DevicePool
    from kvtier.core.io import IOBackend
    from kvtier.plugins.registry import Registry

__all__ = [
    "BackupHandle",
    "CacheClosedError",
    "CacheOptions",
    "PrefetchHandle",
    "TieredCache",
    "open_cache",
]

log = logging.getLogger("kvtier.cache")

WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]

#: Host-pool size when the engine config gives neither ``host_pages`` nor ``host_bytes``.
DEFAULT_HOST_BYTES = 1 << 30


class CacheOptions(BaseModel):
    """How a TieredCache schedules work: write and prefetch policies, workers, bounds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    write_policy: WritePolicy = Field(
        default="write_through",
        description="`write_through`: every backed-up page goes to storage; "
        "`write_through_selective`: a page goes to storage once hit `write_threshold` "
        "times; `write_back`: a page goes to storage when evicted from the host pool.",
    )
    write_threshold: int = Field(
        default=2, ge=1, description="Hits before write_through_selective writes a page to storage."
    )
    prefetch_policy: PrefetchPolicy = Field(
        default="best_effort",
        description="What `load` waits for: `best_effort` loads the pages ready now; "
        "`wait_complete` waits for the whole prefetch; `timeout` waits at most "
        "`timeout_base_s + timeout_per_page_s x pages read from storage`.",
    )
    timeout_base_s: float = Field(
        default=0.05, ge=0, description="Fixed part of the timeout budget."
    )
    timeout_per_page_s: float = Field(
        default=0.002, ge=0, description="Budget per page read from storage (timeout policy)."
    )
    io_workers: int = Field(default=2, ge=1, le=64, description="Threads reading from storage.")
    write_workers: int = Field(default=1, ge=1, le=64, description="Threads writing to storage.")
    queue_size: int = Field(
        default=256, ge=1, description="Bound of each work queue; a full queue fails the operation."
    )
    batch_pages: int = Field(default=32, ge=1, description="Pages per storage get/put call.")
    alloc_wait_s: float = Field(
        default=0.5,
        ge=0,
        description="How long a backup waits for host pages held by in-flight work "
        "before it fails with host_exhausted.",
    )
    max_load_wait_s: float = Field(
        default=60.0,
        gt=0,
        description="Upper bound on any wait inside load (wait_complete, or load(keys)); "
        "after it, load takes the pages that are ready, so a stuck backend cannot hang it.",
    )
    close_timeout_s: float = Field(
        default=10.0, gt=0, description="Bound on close(): drain this long, then cancel."
    )


# --- handles ----------------------------------------------------------------------------


class BackupHandle:
    """The state of one ``backup``: host copy done, storage write done, failures."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = list(keys)
        #: Set once the device slots may be reused (the pages are in the host pool or failed).
        self.host_done = threading.Event()
        #: Set once nothing more will happen (storage write finished where the policy writes).
        self.finished = threading.Event()
        self.pages_copied = 0
        self.pages_cached = 0
        self.pages_written = 0
        self.pages_failed = 0
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._writes_pending = 0

    @property
    def ok(self) -> bool:
        """True when every page reached the host pool (or was there already)."""
        return self.finished.is_set() and self.pages_failed == 0

    def wait_host(self, timeout: float | None = None) -> bool:
        """Wait until the device slots may be reused; False on timeout."""
        return self.host_done.wait(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the backup (and any storage write it owes) has finished."""
        return self.finished.wait(timeout)

    def _fail(self, pages: int, error: BaseException) -> None:
        with self._lock:
            self.pages_failed += pages
            if self.error is None:
                self.error = error

    def _finish(self) -> None:
        """Nothing more will happen (the backup failed or was cancelled before writes)."""
        self.host_done.set()
        self.finished.set()

    def _write_started(self) -> None:
        with self._lock:
            self._writes_pending += 1

    def _write_ended(self, written: int) -> None:
        with self._lock:
            self.pages_written += written
            self._writes_pending -= 1
            done = self._writes_pending == 0 and self.host_done.is_set()
        if done:
            self.finished.set()

    def _host_ended(self) -> None:
        """The device -> host part is over; finished once the owed writes are too."""
        with self._lock:
            self.host_done.set()
            done = self._writes_pending == 0
        if done:
            self.finished.set()

    def __repr__(self) -> str:
        return (
            f"BackupHandle(pages={len(self.keys)}, copied={self.pages_copied}, "
            f"cached={self.pages_cached}, written={self.pages_written}, "
            f"failed={self.pages_failed}, finished={self.finished.is_set()})"
        )


class PrefetchHandle:
    """A prefetch in flight: the leading pages ready so far, cancel, wait, release.

    The handle pins its host pages until it is loaded (all layers) or released, so they
    cannot be evicted in between. Use it as a context manager, or call :meth:`release`.
    """

    def __init__(
        self,
        cache: TieredCache,
        keys: Sequence[str],
        entries: list[Entry],
        host_hits: int,
        started: float,
    ) -> None:
        self._cache = cache
        self.keys = list(keys)
        self._entries = entries
        #: Pages found in the host pool when the prefetch started.
        self.host_hits = host_hits
        #: Pages the prefetch reads (or waits for) beyond the host hits.
        self.storage_hits = len(entries) - host_hits
        self.started = started
        self.cancelled = False
        self._released = False
        self._usable: int | None = None
        self._layers_loaded: set[int] = set()
        self._lock = threading.Lock()
        self.finished = threading.Event()  # set by the fetch job (or at once if none)

    @property
    def planned_pages(self) -> int:
        """Leading pages the prefetch found (host plus storage) and is bringing in."""
        return len(self._entries)

    @property
    def ready_pages(self) -> int:
        """Leading pages whose data is in the host pool now."""
        count = 0
        for entry in self._entries:
            if entry.state is not EntryState.READY:
                break
            count += 1
        return count

    @property
    def done(self) -> bool:
        """Whether every planned page is ready or has failed (nothing still in flight)."""
        return all(e.state is not EntryState.PENDING for e in self._entries)

    def budget_s(self) -> float:
        """The ``timeout`` policy's budget: a base plus a slice per page read from storage."""
        opts = self._cache.options
        return opts.timeout_base_s + opts.timeout_per_page_s * self.storage_hits

    def wait(self, timeout: float | None = None) -> int:
        """Wait until the prefetch is done or ``timeout`` passes; return the ready pages."""
        self._cache._index.wait_settled(list(self._entries), timeout)
        return self.ready_pages

    def cancel(self) -> int:
        """Stop reading pages that have not started; return the pages ready now."""
        self.cancelled = True
        return self.ready_pages

    def settle(self) -> int:
        """Fix the usable prefix per the cache's prefetch policy (first call decides)."""
        with self._lock:
            if self._released:
                raise InvalidFieldError(
                    "handle",
                    "this prefetch handle was already loaded (all layers) or released; "
                    "prefetch the keys again",
                    value=self,
                )
            if self._usable is not None:
                return self._usable
        opts = self._cache.options
        if opts.prefetch_policy == "wait_complete":
            self.wait(opts.max_load_wait_s)
        elif opts.prefetch_policy == "timeout":
            budget = self.started + self.budget_s() - time.monotonic()
            self.wait(min(max(0.0, budget), opts.max_load_wait_s))
        with self._lock:
            if self._usable is None:
                self._usable = self.ready_pages
                spare = self._entries[self._usable :]
                self._entries = self._entries[: self._usable]
                if spare:
                    self._cache._index.release(spare)
            return self._usable

    def host_pages(self) -> list[int]:
        """The host pages of the settled prefix (for engines that drive the IO backend)."""
        usable = self.settle()
        return [entry.page for entry in self._entries[:usable]]

    def release(self) -> None:
        """Unpin the handle's host pages; idempotent. Loading all layers does it for you."""
        with self._lock:
            if self._released:
                return
            self._released = True
            entries, self._entries = self._entries, []
            self._usable = 0 if self._usable is None else self._usable
        if entries:
            self._cache._index.release(entries)

    def __enter__(self) -> PrefetchHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return (
            f"PrefetchHandle(keys={len(self.keys)}, host_hits={self.host_hits}, "
            f"storage_hits={self.storage_hits}, ready={self.ready_pages}, "
            f"cancelled={self.cancelled}, released={self._released})"
        )


# --- the cache --------------------------------------------------------------------------


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
        backend: StorageBackend,
        options: CacheOptions | None = None,
    ) -> None:
        self.plan = plan
        self.config: EngineConfig = plan.config
        self.geometry: KVGeometry = plan.geometry
        self.options = options or CacheOptions()
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.io_backend = io_backend
        self.backend = backend
        cfg = self.config
        self.keyer = PageKeyer(
            Namespace(cfg.model, self.geometry.fingerprint, cfg.tenant),
            self.geometry.page_size,
            self.geometry.attention,
            cfg.tp_rank,
            cfg.tp_size,
        )
        self.page_store = PageStore(
            backend, host_pool, fingerprint=self.geometry.fingerprint, verify=cfg.verify
        )
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
        opts = _options(options)
        if registry is None:
            from kvtier.plugins.manager import default_registry

            registry = default_registry()
        plan = resolve(cfg, registry.backends, registry.io_backends)
        _check_device_pool(device_pool, plan)
        io_config = validate_model(
            plan.io_backend.config_model, {}, where="io_backend", label="IO backend config"
        )
        io_factory = plan.io_backend.load_factory()
        backend_factory = plan.backend.load_factory()
        if cfg.host_pages is not None:
            host_pool = HostPool(plan.geometry, plan.layout, num_pages=cfg.host_pages)
        else:
            host_pool = HostPool(
                plan.geometry, plan.layout, size_bytes=cfg.host_bytes or DEFAULT_HOST_BYTES
            )
        io_backend = io_factory(io_config, plan.geometry, plan.layout)
        backend: StorageBackend = backend_factory(plan.backend_config, plan.context)
        try:
            backend.attach(host_pool)
            cache = cls(
                plan=plan,
                device_pool=device_pool,
                host_pool=host_pool,
                io_backend=io_backend,
                backend=backend,
                options=opts,
            )
        except BaseException:
            backend.close()
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

    def backup(self, keys: Sequence[str], device_slots: torch.Tensor) -> BackupHandle:
        """Copy the pages at ``device_slots`` to the host pool, then storage, asynchronously.

        ``device_slots`` holds ``len(keys) * page_size`` token slots (page ``i`` is
        ``device_slots[i*ps:(i+1)*ps]``). Keep those slots unchanged until
        ``handle.wait_host()``. Keys already cached are not copied again. Failures are
        reported on the handle and in stats, never raised from a worker.
        """
        self._check_open()
        keys = [validate_key(k) for k in keys]
        slots = self._checked_slots(device_slots, len(keys))
        handle = BackupHandle(keys)
        if not keys:
            handle._finish()
            return handle
        started = time.monotonic()
        job = Job(
            lambda: self._run_backup(handle, keys, slots, started),
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
        ps = self.geometry.page_size
        if not isinstance(device_slots, torch.Tensor) or device_slots.dim() != 1:
            raise TransferError(
                f"device_slots must be a 1-D integer torch.Tensor of token slots, got "
                f"{type(device_slots).__name__}"
                + (
                    f" of shape {tuple(device_slots.shape)}"
                    if hasattr(device_slots, "shape")
                    else ""
                ),
                value=device_slots,
            )
        if device_slots.dtype.is_floating_point or device_slots.dtype == torch.bool:
            raise TransferError(
                f"device_slots must hold integers, got {device_slots.dtype}",
                value=device_slots.dtype,
            )
        if device_slots.numel() != pages * ps:
            raise TransferError(
                f"{device_slots.numel()} device slots for {pages} pages; pass "
                f"{pages * ps} (= pages x page_size {ps})",
                value=device_slots.numel(),
            )
        slots = device_slots.detach().to(torch.int64).clone()
        if slots.numel():
            low, high = int(slots.min()), int(slots.max())
            if low < 0 or high >= self.device_pool.num_slots:
                raise TransferError(
                    f"device slot {low if low < 0 else high} is out of range: the device pool "
                    f"has slots 0..{self.device_pool.num_slots - 1}",
                    value=low if low < 0 else high,
                )
        return slots

    def _run_backup(
        self, handle: BackupHandle, keys: list[str], slots: torch.Tensor, started: float
    ) -> None:
        try:
            self._backup_pages(handle, keys, slots, started)
        except BaseException as exc:
            if not handle.host_done.is_set():
                handle._fail(len(keys) - handle.pages_copied - handle.pages_cached, exc)
                handle._host_ended()
            raise

    def _backup_pages(
        self, handle: BackupHandle, keys: list[str], slots: torch.Tensor, started: float
    ) -> None:
        opts = self.options
        ps = self.geometry.page_size
        placed = self._index.insert(
            keys, pins=1, wait_s=opts.alloc_wait_s, on_victims=self._write_victims
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
        fresh = [(i, entry) for i, (entry, new) in enumerate(placed) if new]
        existing = [entry for entry, new in placed if not new]
        handle.pages_cached = len(existing)
        self._stats.add("backup_already_cached", len(existing))
        policy = opts.write_policy
        # Copy in batches, so write_through's storage writes of one batch overlap with
        # the device -> host copy of the next.
        for start in range(0, len(fresh), opts.batch_pages):
            batch = fresh[start : start + opts.batch_pages]
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
                    self.device_pool, self.host_pool, source, [e.page for e in entries]
                )
            except Exception as exc:
                rest = [entry for _, entry in fresh[start:]]
                self._index.mark_failed(rest)
                self._index.release(rest)
                self._fail("device_to_host", len(rest), repr(exc))
                handle._fail(len(rest), exc)
                break
            elapsed = time.monotonic() - t0
            self._stats.latency["device_to_host"].observe(elapsed)
            self._stats.busy("device_to_host", elapsed, len(entries) * self.geometry.bytes_per_page)
            self._index.mark_ready(entries)
            handle.pages_copied += len(entries)
            self._stats.add("pages_backed_up", len(entries))
            if not self.writes_storage:
                self._stats.add("storage_writes_skipped", len(entries))
            elif policy == "write_through":
                claimed = self._index.claim_writes(entries)
                if claimed:
                    handle._write_started()
                    self._submit_write(claimed, handle)
            elif policy == "write_back":
                self._index.mark_dirty(entries)
            self._index.release(entries)
        if self.writes_storage and policy == "write_through_selective":
            hot = [e for e in existing if e.hits >= opts.write_threshold]
            claimed = self._index.claim_writes(hot)
            if claimed:
                self._submit_write(claimed, None)
        self._stats.latency["backup"].observe(time.monotonic() - started)
        handle._host_ended()

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
                    results = self.page_store.put([e.key for e in chunk], [e.page for e in chunk])
                except Exception as exc:  # bad keys cannot get here; stay safe anyway
                    results = [False] * len(chunk)
                    self._fail("storage_put", 0, repr(exc))
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
                in_storage = self.page_store.exists(rest)
            except BaseException:
                self._index.release(host)
                raise
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
        try:
            while done < len(entries):
                if handle.cancelled or time.monotonic() >= self._stop_at:
                    break
                chunk = entries[done : done + batch]
                t0 = time.monotonic()
                results = self.page_store.get([e.key for e in chunk], [e.page for e in chunk])
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
                self._stats.latency["prefetch"].observe(time.monotonic() - handle.started)

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
            slots = self._load_slots(device_slots)
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

    def _load_slots(self, device_slots: Any) -> torch.Tensor:
        if not isinstance(device_slots, torch.Tensor) or device_slots.dim() != 1:
            raise TransferError(
                "device_slots must be a 1-D integer torch.Tensor of token slots, got "
                f"{type(device_slots).__name__}",
                value=device_slots,
            )
        if device_slots.dtype.is_floating_point or device_slots.dtype == torch.bool:
            raise TransferError(
                f"device_slots must hold integers, got {device_slots.dtype}",
                value=device_slots.dtype,
            )
        return device_slots

    # --- stats ----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Hits and misses per tier, bytes, bandwidth, latency histograms, failures by cause."""
        snap = self._stats.snapshot()
        snap["host"]["pages"] = self._index.counts()
        snap["queues"] = {
            "transfer": self._transfer.depth(),
            "read": self._reads.depth(),
            "write": self._writes.depth(),
        }
        snap["page_store"] = self.page_store.stats()
        try:
            snap["backend"] = dict(self.backend.stats())
        except Exception as exc:
            snap["backend"] = {"error": repr(exc)}
        snap["policies"] = {
            "write": self.options.write_policy,
            "prefetch": self.options.prefetch_policy,
            "writes_storage": self.writes_storage,
        }
        return snap

    def prometheus_collector(self) -> Any:
        """A prometheus_client collector of this cache's ``kvtier_*`` metrics.

        Register it with ``prometheus_client.REGISTRY.register(...)``. Needs the
        ``prometheus`` extra; raises ImportError naming it otherwise.
        """

        def gauges() -> dict[str, dict[str, int]]:
            counts = self._index.counts()
            return {
                "host_pages": {k: counts[k] for k in ("total", "free", "cached", "pinned")},
                "queue_depth": {
                    "transfer": self._transfer.depth(),
                    "read": self._reads.depth(),
                    "write": self._writes.depth(),
                },
            }

        return prometheus_collector(self._stats.snapshot, gauges)

    def prometheus_text(self) -> str:
        """This cache's metrics in the Prometheus text exposition format."""
        try:
            from prometheus_client import CollectorRegistry, generate_latest
        except ImportError:
            raise PrometheusMissingError() from None
        registry = CollectorRegistry()
        registry.register(self.prometheus_collector())
        return generate_latest(registry).decode("utf-8")

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
        deadline = time.monotonic() + (self.options.close_timeout_s if timeout is None else timeout)
        self._stop_at = deadline if drain else time.monotonic()
        joined = self._transfer.close(drain=drain, deadline=deadline)
        if drain and self.options.write_policy == "write_back" and self.writes_storage:
            dirty = self._index.claim_dirty()
            if dirty:
                self._stats.add("write_backs", len(dirty))
                self._submit_write(dirty, None)
        joined = self._reads.close(drain=drain, deadline=deadline) and joined
        joined = self._writes.close(drain=drain, deadline=deadline) and joined
        self._index.drop_all()
        try:
            self.backend.close()
        except Exception as exc:
            self._fail("backend_close", 0, repr(exc))
        return joined

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


def _options(options: CacheOptions | Mapping[str, Any] | None) -> CacheOptions:
    if options is None:
        return CacheOptions()
    if isinstance(options, CacheOptions):
        return options
    return validate_model(CacheOptions, options, where="cache_options", label="cache options")


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
