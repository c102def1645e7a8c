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

This is the facade: it checks each call once and hands it to its part (``opening``,
``backup``, ``writes``, ``prefetch``, ``load``; they share one ``context.CacheContext``).
The cache runs only the operations the config declared (start-up checked exactly those).
Backend failures never reach the engine: they fail that operation's pages, are counted
in :meth:`TieredCache.stats` by cause, and are logged once per cause.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvtier.cache.backup import Backups
from kvtier.cache.context import CacheContext
from kvtier.cache.handles import BackupHandle, PrefetchHandle
from kvtier.cache.load import Loader
from kvtier.cache.metrics import identity_of, prometheus_collector, prometheus_text
from kvtier.cache.opening import open_parts
from kvtier.cache.options import CacheOptions, cache_options
from kvtier.cache.prefetch import Prefetcher
from kvtier.cache.writes import StorageWriter
from kvtier.core.capabilities import ResolvedPlan
from kvtier.core.config import EngineConfig
from kvtier.core.errors import CacheClosedError, InvalidFieldError, OperationNotDeclaredError
from kvtier.core.geometry import AttentionKind, KVGeometry
from kvtier.core.host_pool import HostPool
from kvtier.core.io import IOBackend, check_device_slots, check_layer
from kvtier.core.keys import PageKeyer, layout_namespace, validate_key
from kvtier.core.metrics import Cause
from kvtier.core.specs import Operation
from kvtier.core.storage import StorageBackend
from kvtier.core.streams import current_fence
from kvtier.storage import StorageChain

if TYPE_CHECKING:
    from kvtier.core.device_pool import DevicePool
    from kvtier.plugins.registry import Registry

__all__ = ["TieredCache", "open_cache"]

log = logging.getLogger("kvtier.cache")

#: After close's bound, how long workers woken from abandoned calls get to end.
_WAKE_GRACE_S = 0.5


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
        page_store: StorageChain,
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
        self.keyer = plan.keyer()
        self._tenant_keyers: dict[str, PageKeyer] = {}
        #: MLA ranks hold the same latent: only rank 0 writes it to storage.
        self.writes_storage = not (
            self.geometry.attention is AttentionKind.MLA and self.config.tp_rank != 0
        )
        ctx = self._ctx = CacheContext(
            geometry=self.geometry,
            options=self.options,
            device_pool=device_pool,
            host_pool=host_pool,
            io_backend=io_backend,
            page_store=page_store,
            writes_storage=self.writes_storage,
        )
        self._index = ctx.index
        self._close_lock = threading.Lock()
        self._writer = StorageWriter(ctx)
        self._backups = Backups(ctx, self._writer)
        self._prefetcher = Prefetcher(ctx, self._writer)
        self._loader = Loader(ctx)

    @property
    def backend(self) -> StorageBackend:
        """The storage backend (L3) behind the page store."""
        return self.page_store.backend

    @classmethod
    def open(
        cls,
        config: ResolvedPlan | EngineConfig | Mapping[str, Any] | str,
        device_pool: DevicePool,
        *,
        options: CacheOptions | Mapping[str, Any] | None = None,
        registry: Registry | None = None,
    ) -> TieredCache:
        """Build host pool, IO and storage from a resolved plan, or resolve ``config`` first.

        ``config`` is a :class:`~kvtier.core.capabilities.ResolvedPlan` (an engine adapter
        that resolved once hands its plan over: nothing is resolved twice), or an
        EngineConfig, a mapping, or JSON text / ``@file`` to resolve against the plugins
        (``registry``, default: the installed ones). Every config problem raises a
        :class:`~kvtier.core.errors.ConfigError` before any memory is allocated or any
        thread started. ``options`` is a CacheOptions or a mapping.
        """
        opts = cache_options(options)
        parts = open_parts(config, device_pool, opts, registry)
        plan, host_pool = parts.plan, parts.host_pool
        try:
            cache = cls(
                plan=plan,
                device_pool=device_pool,
                host_pool=host_pool,
                io_backend=parts.io_backend,
                page_store=parts.page_store,
                options=opts,
            )
        except BaseException:
            parts.page_store.close()
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

    def keys(
        self, tokens: Any, *, parent: str | None = None, tenant: str | None = None
    ) -> list[str]:
        """The chained page keys of ``tokens``' full pages in this cache's namespace, or in
        ``tenant``'s (a tenant the config names: its pages are keyed and quota'd apart)."""
        if tenant is None:
            return self.keyer.keys(tokens, parent=parent)
        keyer = self._tenant_keyers.get(tenant)
        if keyer is None:
            plan = self.plan
            namespace = layout_namespace(
                plan.config.model, plan.layout, plan.geometry.fingerprint, tenant
            )
            keyer = PageKeyer(
                namespace,
                plan.geometry.page_size,
                plan.geometry.attention,
                plan.context.tp_rank,
                plan.context.tp_size,
            )
            self._tenant_keyers[tenant] = keyer
        return keyer.keys(tokens, parent=parent)

    def backup(
        self, keys: Sequence[str], device_slots: torch.Tensor, *, layer: int | None = None
    ) -> BackupHandle:
        """Copy the pages at ``device_slots`` to the host pool, then storage, asynchronously.

        ``device_slots`` holds ``len(keys) * page_size`` token slots (page ``i`` is
        ``device_slots[i*ps:(i+1)*ps]``). Keep those slots unchanged until
        ``handle.wait_host()``. Keys already cached are not copied again. Failures are
        reported on the handle and in stats, never raised from a worker. One call's keys
        are taken as one sequence's consecutive pages: each page's parent, told to the
        storage tiers' policies, is the key before it (the first page has none).

        On a CUDA pool the copy runs on the cache's save stream after the work queued so
        far on the caller's current stream (the kernels that wrote these pages), so the
        call never waits for the device; the worker waits for the copy before it hands
        the pages on.

        ``layer`` copies one layer (``backup_layer``, for layer-sharded pools): call it
        once per layer for the same keys; a page becomes ready, and is written to storage,
        when its last layer has arrived, and stays pinned until then (or until close).
        """
        self._check_call(Operation.BACKUP_ALL, Operation.BACKUP_LAYER, "backup", layer)
        keys = [validate_key(k) for k in keys]
        slots = check_device_slots(
            device_slots,
            page_size=self.geometry.page_size,
            pages=len(keys),
            num_slots=self.device_pool.num_slots,
        )
        # a private copy: the job runs later, and the IO backend is told it was checked
        after = current_fence(self.device_pool.device)
        return self._backups.start(keys, slots.detach().clone(), layer, after)

    def prefetch(self, keys: Sequence[str]) -> PrefetchHandle:
        """Find the longest cached prefix of ``keys`` and start bringing it into the host pool.

        Host hits are pinned at once; the storage prefix is found with one batched
        ``exists`` and read on workers. The handle reports the ready prefix as it grows.
        """
        self._check_open()
        return self._prefetcher.start(keys)

    def load(
        self,
        handle: PrefetchHandle | Sequence[str],
        device_slots: torch.Tensor,
        *,
        layer: int | None = None,
        ordered: bool = True,
    ) -> int:
        """Copy the prefetched prefix into ``device_slots``; return the pages loaded.

        ``handle`` is a :class:`PrefetchHandle` (its policy decides how long to wait) or
        a list of keys (prefetched and waited for here, up to ``max_load_wait_s``).
        ``device_slots`` holds token slots for at least the pages to load; extra slots
        are left alone. ``layer`` loads one layer; the handle stays pinned until every
        layer was loaded once.

        On a CUDA pool the copy is queued on the cache's load stream, after the work
        queued so far on the caller's current stream, and the call returns without
        waiting for it. ``ordered=True`` makes the caller's current stream wait for it,
        so kernels queued next see the pages. ``ordered=False`` (a handle, not keys) is
        for a caller that queues every layer at once and waits per layer with
        ``handle.order(layer)``; such a handle is not released here, so release it once
        its layers are used (the release waits for the copies before the host pages
        are unpinned). Off CUDA the copy is done when the call returns either way.
        """
        self._check_call(Operation.LOAD_ALL, Operation.LOAD_LAYER, "load", layer)
        if isinstance(handle, PrefetchHandle):
            if handle.pins is not self._index:
                raise InvalidFieldError(
                    "handle", "this prefetch handle belongs to another TieredCache", value=handle
                )
            return self._loader.load(handle, device_slots, layer, own=False, ordered=ordered)
        prefetched = self.prefetch(handle)
        prefetched.wait(self.options.max_load_wait_s)
        return self._loader.load(prefetched, device_slots, layer, own=True, ordered=True)

    def discard(self, keys: Sequence[str]) -> int:
        """Drop ``keys``' pages from the host pool (L2) at once: no later prefetch serves
        them and they are not written to storage from there; a page in use is freed when
        its user lets go. Storage is not touched (delete there too where the page is bad).
        For pages known wrong, such as a backup whose device slots the engine reused
        before its copy ended. Returns how many the host pool held."""
        self._check_open()
        return self._index.discard([validate_key(k) for k in keys])

    def stats(self) -> dict[str, Any]:
        """Hits and misses per tier, bytes, bandwidth, latency histograms, failures by cause."""
        return self._ctx.snapshot()

    def prometheus_collector(self) -> Any:
        """A prometheus_client collector of this cache's ``kvtier_*`` metrics.

        Register it with ``prometheus_client.REGISTRY.register(...)``. Every series is
        labelled with ``model``, ``rank``, ``tenant`` and ``backend`` (see
        docs/operating.md). Needs the ``prometheus`` extra; raises ImportError naming it
        otherwise.
        """
        return prometheus_collector(self.stats, identity_of(self.plan))

    def prometheus_text(self) -> str:
        """This cache's metrics in the Prometheus text exposition format."""
        return prometheus_text(self.prometheus_collector())

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until no queued or running work is left; False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if all(g.idle() for g in self._ctx.groups):
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
        ctx = self._ctx
        with self._close_lock:
            if ctx.closed:
                return True
            ctx.closed = True
        bound = self.options.close_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + bound
        ctx.stop_at = deadline if drain else time.monotonic()
        joined = ctx.transfer.close(drain=drain, deadline=deadline, warn=False)
        if drain:
            self._writer.flush_dirty()
        joined = ctx.reads.close(drain=drain, deadline=deadline, warn=False) and joined
        joined = ctx.writes.close(drain=drain, deadline=deadline, warn=False) and joined
        if not joined:
            # Workers still waiting on a backend call at close's bound: those calls fail
            # now (their threads are abandoned) and the workers get a short grace to end.
            self.page_store.abandon_in_flight()
            grace = time.monotonic() + _WAKE_GRACE_S
            joined = all([g.join(grace, warn=True) for g in ctx.groups])
        if joined:
            self._backups.drop_layered()  # the transfer worker has ended: nothing else does
        self._index.drop_all()
        closed = self.page_store.close(timeout=bound)  # the backend too, bounded
        if not closed:
            ctx.fail(Cause.BACKEND_CLOSE, 0, "the page store could not close its backend in time")
        return joined and closed

    @property
    def closed(self) -> bool:
        return self._ctx.closed

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"TieredCache(backend={self.plan.backend.name}, io={self.plan.io_backend.name}, "
            f"layout={self.plan.layout.value}, host_pages={self.host_pool.num_pages}, "
            f"closed={self.closed})"
        )

    def _check_open(self) -> None:
        if self._ctx.closed:
            raise CacheClosedError("this TieredCache is closed; open a new one", value=self)

    def _check_call(
        self, every_layer: Operation, one_layer: Operation, call: str, layer: int | None
    ) -> None:
        """Open, declared (start-up checked only those), and ``layer`` in range: once."""
        self._check_open()
        if layer is None:
            operation, described = every_layer, f"{call}()"
        else:
            operation, described = one_layer, f"{call}(layer={layer!r})"
        if not self.plan.declares(operation):
            declared = [op.value for op in Operation if op in self.plan.operations]
            raise OperationNotDeclaredError(operation.value, described, declared)
        if layer is not None:
            check_layer(layer, self.geometry.num_layers)


def open_cache(
    config: EngineConfig | Mapping[str, Any] | str,
    device_pool: DevicePool,
    registry: Registry | None = None,
    *,
    options: CacheOptions | Mapping[str, Any] | None = None,
) -> TieredCache:
    """Open a :class:`TieredCache`: same as :meth:`TieredCache.open`."""
    return TieredCache.open(config, device_pool, options=options, registry=registry)
