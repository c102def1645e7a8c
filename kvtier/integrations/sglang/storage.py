"""The HiCache storage class SGLang loads: its v1, v2 and generic calls, over kvtier pools.

SGLang calls this class; it keeps only what SGLang's calls need (which pool, which keys,
whether this rank writes) and delegates the rest: the section to
:mod:`~kvtier.integrations.sglang.settings`, plans and storage chains to
:mod:`~kvtier.integrations.sglang.plan`, the pools' pages to
:mod:`~kvtier.integrations.sglang.pools`, what it reports to
:mod:`~kvtier.integrations.sglang.metrics`, the tiers' KV events to
:mod:`~kvtier.integrations.sglang.events`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch

from kvtier.cache.metrics import identity_of, store_collector
from kvtier.core.errors import StorageError, TransferError, UnsupportedCombinationError
from kvtier.core.metrics import registered_counters
from kvtier.integrations.sglang.events import KVEventLog, KVEventPublishing, sglang_kv_events
from kvtier.integrations.sglang.metrics import TransferWindows, kvtier_stats
from kvtier.integrations.sglang.pages import SGLangPages, flat_page
from kvtier.integrations.sglang.plan import SGLangSetup
from kvtier.integrations.sglang.pools import (
    AttachedPool,
    chain_parents,
    first_slots,
    late_safe_call,
    leading_run,
    restorable_prefixes,
)
from kvtier.integrations.sglang.settings import DOCS, read_section
from kvtier.plugins.manager import default_registry

try:
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        HiCacheStorageConfig,
        PoolTransferResult,
    )
except ImportError as exc:  # pragma: no cover - exercised only without SGLang
    raise ImportError(
        "kvtier.integrations.sglang needs SGLang's HiCache storage module "
        f"(sglang.srt.mem_cache.hicache_storage), which failed to import: {exc}. "
        "Install the extra with `pip install 'kvtier[sglang]'`, or load this class from "
        "inside the SGLang server (--hicache-storage-backend dynamic)"
    ) from exc

__all__ = ["KvtierHiCacheStorage"]

log = logging.getLogger(__name__)


class KvtierHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang HiCache storage on a kvtier backend; load it with the ``dynamic`` backend."""

    def __init__(
        self,
        storage_config: HiCacheStorageConfig,
        kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.storage_config = storage_config
        extra = storage_config.extra_config
        registry = default_registry()
        self.settings = read_section(extra, registry)
        self.setup = SGLangSetup.for_rank(storage_config, self.settings, registry)
        self.spec = self.setup.spec
        writer = getattr(storage_config, "is_storage_writer", None)
        #: Whether this rank writes: every MHA rank, one rank for MLA (SGLang decides).
        self.is_writer = bool(
            writer
            if writer is not None
            else not storage_config.is_mla_model or storage_config.tp_rank == 0
        )
        self.zero_copy = bool((extra or {}).get("interface_v1"))
        if not self.zero_copy:
            log.warning(
                'kvtier: the SGLang extra-config has no "interface_v1": 1, so SGLang uses '
                "its generic path (a fresh tensor per page and copies in and out of the "
                'host pool); add "interface_v1": 1 for the zero-copy path (%s). Pages '
                "moved this way are counted as generic_path_pages.",
                DOCS,
            )
        self._counters = registered_counters("sglang")
        self._windows = TransferWindows(bool(storage_config.enable_storage_metrics))
        self._lock = threading.Lock()
        #: The KV pool's page stores: one, or one per head slice (SGLang's tp_lcm_size).
        self._shards: list[AttachedPool[SGLangPages]] = []
        #: The first of them: the KV pool's plan and pages.
        self._state: AttachedPool[SGLangPages] | None = None
        #: The extra host pools of a hybrid model, by SGLang's pool name (v2 interface).
        self._extra: dict[str, AttachedPool[Any]] = {}
        self._warned: set[str] = set()
        #: The KV pool's storage events as SGLang's KV events (None: kv_events_buffer 0).
        self._events: KVEventLog | None = None
        #: The thread publishing them (kv_events_endpoint, on the publishing rank).
        self._publishing: KVEventPublishing | None = None
        #: The backends of the tiers, fastest first, as logs name them.
        self._backends = " over ".join(repr(spec.name) for spec in self.setup.specs)

    # --- set-up ---------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Check SGLang's host pool against every tier's backend, then build the tiers over
        it; start watching (and, where configured, publishing) their KV events."""
        super().register_mem_pool_host(mem_pool_host)
        shards = self.setup.kv_slices(mem_pool_host, writes=self.is_writer)
        with self._lock:
            old, self._shards = self._shards, shards
            self._state = shards[0]
        for pool in old:
            pool.close()
        try:
            self._watch_events(shards[0], int(mem_pool_host.page_size))
        except BaseException:
            self.close()  # the server stops at start-up: nothing left open behind it
            raise
        plan = shards[0].plan
        log.info(
            "kvtier: SGLang HiCache storage on backend %s, layout %s, %s, namespace %s, "
            "%s, zero-copy %s%s",
            self._backends,
            plan.layout.value,
            plan.geometry.describe(),
            ", ".join(shard.plan.context.namespace for shard in shards),
            "writer" if self.is_writer else "reader (another rank writes)",
            "on" if self.zero_copy else "off",
            f", each page as {len(shards)} head slices (tp_lcm_size)" if len(shards) > 1 else "",
        )

    def _watch_events(self, pool: AttachedPool[SGLangPages], page_size: int) -> None:
        """Keep the KV pool's storage events (where heads are split, the first slice's
        stand for the page), and start publishing them where the section says so."""
        settings = self.settings
        old, self._events = self._events, None
        if old is not None:
            old.close()
        if settings.kv_events_buffer == 0:
            return
        events = KVEventLog(page_size, settings.kv_events_buffer, self._counters)
        events.watch(pool)
        self._events = events
        if self._publishing is not None:
            self._publishing.events = events
            return
        endpoint = settings.kv_events_endpoint
        config = self.storage_config
        if endpoint is None:
            return
        if (int(config.tp_rank), int(config.pp_rank), int(config.attn_cp_rank)) != (0, 0, 0):
            log.info(
                "kvtier: KV events are published from TP, PP and CP rank 0 (as SGLang's own); "
                "this rank keeps them for take_kv_events()"
            )
            return
        try:
            publisher = sglang_kv_events().ZmqEventPublisher(
                attn_dp_rank=int(getattr(config, "dp_rank", 0) or 0),
                endpoint=endpoint,
                replay_endpoint=settings.kv_events_replay_endpoint,
                topic=settings.kv_events_topic,
            )
        except Exception as exc:
            raise StorageError(
                f"kvtier.kv_events_endpoint {endpoint!r}: SGLang's ZmqEventPublisher could "
                f"not open it ({exc!r}); give an endpoint this host can bind, apart from "
                f"SGLang's own --kv-events-config one (see {DOCS})",
                value=endpoint,
            ) from exc
        self._publishing = KVEventPublishing(events, publisher, self._counters)
        log.info(
            "kvtier: publishing the storage tiers' KV events at %s (topic %r)",
            endpoint,
            settings.kv_events_topic,
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Accept the KV pool again under its v2 name; build an extra pool's own store.

        A hybrid model's extra pool (Mamba state, SWA KV) gets a plan of its own, resolved
        as the KV pool's is (:meth:`SGLangSetup.extra_pool`): its namespace names the pool,
        its geometry describes its pages, and its pages carry the same verified envelope.
        """
        name = str(host_pool_name)
        state = self._state
        same_pool = state is not None and host_pool is state.pages.host_pool
        if name == "kv" or same_pool:
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            return
        if state is None or state.closed:
            raise StorageError(
                f"SGLang registered the extra host pool {name!r} before the KV pool: "
                "register_mem_pool_host(kv_pool) comes first (SGLang's controller does so)",
                value=name,
            )
        if len(self._shards) > 1:
            raise UnsupportedCombinationError(
                f"SGLang registered the extra host pool {name!r} while it splits KV heads "
                "across heterogeneous TP sizes (tp_lcm_size); kvtier splits the KV pool's "
                "pages only",
                value=name,
                supported=["tp_lcm_size with a KV-only model", "no tp_lcm_size"],
            )
        extra = self.setup.extra_pool(
            name, host_pool, writer=self.is_writer, counters=self._counters
        )
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        with self._lock:
            old, self._extra[name] = self._extra.get(name), extra
        if old is not None:
            old.close()
        log.info(
            "kvtier: SGLang extra host pool %r (%s) on backend %s, %s, %s, namespace %s",
            name,
            type(host_pool).__name__,
            self._backends,
            "in place" if extra.in_place else "by value (copied through SGLang's page calls)",
            extra.plan.geometry.describe(),
            extra.plan.context.namespace,
        )

    def _pool(self, name: Any) -> AttachedPool[Any]:
        found = self._extra.get(str(name))
        if found is None or found.closed:
            raise StorageError(
                f"SGLang asked for host pool {str(name)!r}, which was never registered "
                f"(registered: 'kv'{''.join(', ' + repr(n) for n in self._extra)}); "
                "SGLang registers each pool with register_mem_host_pool_v2 first",
                value=str(name),
            )
        return found

    def _require(self) -> AttachedPool[SGLangPages]:
        state = self._state
        if state is None or state.closed:
            raise StorageError(
                "kvtier SGLang storage has no host pool: SGLang calls "
                "register_mem_pool_host(pool) right after construction; call it before any "
                "transfer (and do not use the object after close())",
                value=None,
            )
        return state

    def _keys(self, state: AttachedPool[Any], keys: Sequence[str]) -> list[str]:
        return state.keys(keys)

    def _kv(self) -> list[AttachedPool[SGLangPages]]:
        """The KV pool's page stores (several where heads are split), once registered."""
        self._require()
        return self._shards

    def _kv_prefix(self, keys: Sequence[str]) -> int:
        """How many leading KV pages are stored (every head slice of each)."""
        return min(shard.store.prefix_hits(shard.keys(keys)) for shard in self._kv())

    @staticmethod
    def _every(results: Sequence[list[bool]]) -> list[bool]:
        """Per page: whether every head slice's transfer succeeded."""
        return [all(column) for column in zip(*results, strict=True)]

    # --- zero-copy (v1) path ----------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading keys are stored (SGLang's prefix-hit query)."""
        return self._kv_prefix(keys)

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Fill the host pages at ``host_indices`` in place; False for a miss or a bad page."""
        return self._v1("get", keys, host_indices, extra_info)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Store the host pages at ``host_indices`` from their memory; True where stored."""
        return self._v1("put", keys, host_indices, extra_info)

    def _v1(
        self, op: str, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        shards = self._kv()
        names = [shard.keys(keys) for shard in shards]
        state = shards[0]
        pages = state.pages.pages_of(host_indices, len(keys))
        if not keys:
            return []
        if op == "put" and not self.is_writer:
            self._counters.add("skipped_not_writer", len(keys))
            return [True] * len(keys)
        parents: list[str | None] | None = None
        if op == "put":
            self._learn(keys, extra_info)
            parents = chain_parents(keys, getattr(extra_info, "prefix_keys", None))
        start = time.perf_counter()
        results = self._every(
            [
                shard.transfer(
                    op, n, pages, None if parents is None else shard.parent_names(parents)
                )
                for shard, n in zip(shards, names, strict=True)
            ]
        )
        moved = sum(results)
        self._windows.record(
            "prefetch" if op == "get" else "backup",
            moved,
            moved * state.pages.page_bytes,
            time.perf_counter() - start,
        )
        return results

    # --- v2 (hybrid models: KV plus extra pools) ------------------------------------------

    def batch_exists_v2(
        self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None
    ) -> Any:
        """The usable prefix: KV pages, cut where a needed pool's pages are missing.

        Each transfer's pool is checked over the KV hit by its hit policy (``all_pages``:
        every page; ``trailing_pages``: the last ``len(transfer.keys)``); a prefix length
        counts only when every pool allows it.
        """
        kv_pages = self._kv_prefix(keys)
        hits: dict[Any, int] = {"kv": kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if str(transfer.name) == "kv":
                continue
            pool = self._pool(transfer.name)
            wanted = keys[:kv_pages] if restorable else []
            present = pool.store.exists(pool.keys(wanted)) if wanted else []
            policy = getattr(transfer.hit_policy, "value", transfer.hit_policy)
            allowed, boundary = restorable_prefixes(present, str(policy), len(transfer.keys or []))
            if boundary:
                hits[transfer.name] = boundary
            restorable &= allowed
        lengths = sorted(restorable)
        return PoolTransferResult(lengths[-1] if lengths else 0, hits, lengths)

    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        """Fill each transfer's host pages; a missing or invalid page ends its pool's run."""
        return {t.name: leading_run(self._v2("get", t, extra_info)) for t in transfers}

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        """Store each transfer's host pages under its pool's keys; True where stored."""
        return {t.name: self._v2("put", t, extra_info) for t in transfers}

    def _v2(self, op: str, transfer: Any, extra_info: Any) -> list[bool]:
        """One pool's transfer: the KV pool's through v1, an extra pool's through its store."""
        keys = list(transfer.keys or [])
        if str(transfer.name) == "kv":
            return self._v1(op, keys, transfer.host_indices, extra_info)
        pool = self._pool(transfer.name)
        firsts = first_slots(pool.pages.page_size, transfer.host_indices, len(keys))
        if firsts is None:
            self._index_mismatch(pool, transfer.host_indices, len(keys))
            return [False] * len(keys)
        if op == "put" and not pool.writes:
            self._counters.add("skipped_not_writer", len(keys))
            return [True] * len(keys)
        parents = None
        if op == "put":
            parents = chain_parents(keys, getattr(extra_info, "prefix_keys", None))
        results = pool.move(op, keys, transfer.host_indices, firsts, parents)
        if keys and not pool.in_place:
            self._counters.add("state_pages_copied", len(keys) if op == "put" else sum(results))
        return results

    def _index_mismatch(self, pool: AttachedPool[Any], indices: Any, count: int) -> None:
        """Count (and once, log) a v2 transfer whose indices are not whole pages."""
        self._counters.add("v2_index_mismatch")
        if "v2_index_mismatch" in self._warned:
            return
        self._warned.add("v2_index_mismatch")
        log.warning(
            "kvtier: SGLang passed %d host indices for %d %r pages of page_size %d; "
            "those pages are reported not moved (SGLang's v2 contract; counted as "
            "v2_index_mismatch)",
            0 if indices is None else int(torch.as_tensor(indices).numel()),
            count,
            pool.name,
            pool.pages.page_size,
        )

    # --- legacy (generic) path --------------------------------------------------------------

    def exists(self, key: str) -> bool:
        """Whether one key is stored (every head slice of it)."""
        return all(shard.store.exists(shard.keys([key]))[0] for shard in self._kv())

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        """Read one page into ``target_location`` (a flat page tensor); None on a miss."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Read pages into the given flat page tensors; None for a miss or a bad page."""
        state, _ = self._legacy_batch(
            keys,
            target_locations,
            "kvtier's legacy get reads into the caller's tensors: pass one flat page "
            "tensor per key (SGLang passes host_pool.get_dummy_flat_data_page())",
        )
        tensors = [flat_page(t, state.pages, writable=True) for t in target_locations]
        results = self._generic("get", keys, tensors)
        return [t if ok else None for t, ok in zip(target_locations, results, strict=True)]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store one flat page tensor."""
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store flat page tensors; True only if every page was stored."""
        state, names = self._legacy_batch(
            keys,
            values,
            "kvtier's legacy set stores the given tensors: pass one flat page tensor "
            "per key (SGLang passes host_pool.get_data_page(index))",
        )
        if not self.is_writer:
            self._counters.add("skipped_not_writer", len(names))
            return True
        tensors = [flat_page(v, state.pages, writable=False) for v in values]
        self._learn(keys, None)
        return all(self._generic("put", keys, tensors))

    def _legacy_batch(
        self, keys: list[str], tensors: Any, why: str
    ) -> tuple[AttachedPool[SGLangPages], list[str]]:
        """The attached pool and ``keys``' storage names for a legacy batch call, once the
        keys are checked (before anything else) and ``tensors`` holds one tensor per key;
        a :class:`TransferError` saying ``why`` otherwise."""
        state = self._require()
        names = state.keys(keys)
        if tensors is None or len(tensors) != len(names):
            raise TransferError(why, value=None if tensors is None else len(tensors))
        return state, names

    def _generic(self, op: str, keys: list[str], tensors: list[torch.Tensor]) -> list[bool]:
        """Move caller tensors (one flat page each) as scratch pages of each KV page store.

        A call that times out keeps its scratch pages, and so the tensors, until it
        returns (``scratch_pages_quarantined``): SGLang drops a get's fresh tensors at once, and
        their memory must not be reused under the late read. A put's tensor may be a
        view of SGLang's host pool, so a bounded put is guarded as an in-place one is.
        """
        self._counters.add("generic_path_pages", len(keys))
        results = []
        # one legacy set stores consecutive pages of one sequence (SGLang's backup)
        parents = chain_parents(keys, None) if op == "put" else None
        for shard in self._kv():
            names = shard.keys(keys)
            pages = shard.pages
            ids = pages.add_scratch(tensors)
            held = False
            try:
                answer, held = late_safe_call(
                    shard.store,
                    op,
                    names,
                    ids,
                    shard.counters,
                    release=partial(pages.drop_scratch, ids),
                    guard=shard.bounded,
                    parents=None if parents is None else shard.parent_names(parents),
                )
                results.append(answer)
            finally:
                if not held:  # else dropped when the late call returns
                    pages.drop_scratch(ids)
        return self._every(results)

    # --- the storage tiers' KV events ---------------------------------------------------

    def _learn(self, keys: Sequence[str], extra_info: Any) -> None:
        """Tell the event log the chain order of the pages SGLang backs up."""
        events = self._events
        if events is not None:
            events.learn(keys, getattr(extra_info, "prefix_keys", None))

    def take_kv_events(self) -> list[Any]:
        """The storage tiers' KV events since the last call, as SGLang's ``BlockStored``
        and ``BlockRemoved`` (``sglang.srt.disaggregation.kv_events``), medium ``DISK``
        or ``EXTERNAL`` per tier; [] with ``kv_events_buffer`` 0 or before the host pool
        is registered. The mapping is in :mod:`kvtier.integrations.sglang.events`."""
        events = self._events
        return events.take() if events is not None else []

    def publish_kv_events(self, publisher: Any) -> int:
        """Hand the events since the last take to an SGLang ``EventPublisher`` (a
        ``ZmqEventPublisher``, say) as one ``KVEventBatch``; returns how many events."""
        events = self._events
        return events.publish(publisher) if events is not None else 0

    # --- housekeeping -----------------------------------------------------------------------

    def flush_tiers(self, timeout: float | None = None) -> bool:
        """Wait until every page queued to move between tiers (cascades, write-backs,
        promotions) has moved; False if ``timeout`` passed first."""
        with self._lock:
            pools = [*self._shards, *self._extra.values()]
        return all([pool.store.flush(timeout) for pool in pools if not pool.closed])

    def tier_stats(self) -> dict[str, list[dict[str, Any]]]:
        """Each pool's tiers (``kv`` and each extra pool): name, backend, write policy,
        counters (promotions, cascades, drops, evictions, ...), occupancy, queue depth;
        for the KV pool, its first head slice's where heads are split."""
        with self._lock:
            pools = [*self._shards[:1], *self._extra.values()]
        return {pool.name: pool.store.tier_stats() for pool in pools}

    def tenant_stats(self) -> dict[str, dict[str, Any]]:
        """The KV pool's configured tenants: bytes in each tier, quota evictions."""
        return self._require().store.tenant_stats()

    def clear(self) -> None:
        """Remove this model's (and, for MHA, this rank's) pages; MLA: the writer only."""
        state = self._state
        if state is None or state.closed:
            return
        pools = list(self._shards) if self.is_writer else []
        pools += [p for p in self._extra.values() if p.writes and not p.closed]
        if not self.is_writer:
            log.info("kvtier: clear() left to the storage writer rank (MLA pages are shared)")
        for pool in pools:
            if not pool.store.clear():  # counted and logged by the page store
                self._counters.add("clear_failures")
                log.warning("kvtier: backend %r failed to clear pool %r", self.spec.name, pool.name)

    def get_stats(self) -> Any:
        """Pages and GB/s per transfer since the last call, as SGLang's StorageMetrics."""
        return self._windows.take()

    def kvtier_stats(self) -> dict[str, int | float]:
        """kvtier's counters: the page store's, the backend's (``backend_*``) and ours.

        An extra pool's counters carry its name: ``mamba_invalid``, ``mamba_backend_puts``.
        """
        return kvtier_stats(self._counters, list(self._shards), list(self._extra.values()))

    def prometheus_collector(self) -> Any:
        """A prometheus_client collector of this storage's page stores (``kvtier_*``
        families, the names and labels a TieredCache's storage tier has; docs/operating.md:
        the tiers' counters summed, as ``kvtier_stats()``); where heads are split, the first
        head slice's store."""
        state = self._require()
        # the chain reads as a page store here: stats(), call_counts(), backend_stats()
        return store_collector(state.store, identity_of(state.plan))

    def close(self) -> None:
        """Close every pool's storage chain (its queued moves first, then each tier's
        backend), publish the KV events left and stop publishing. Idempotent."""
        with self._lock:
            shards = list(self._shards)
            extra = list(self._extra.values())
        for pool in [*extra, *shards]:
            pool.close()
        publishing, self._publishing = self._publishing, None
        if publishing is not None:
            publishing.close()
        if self._events is not None:
            self._events.close()
