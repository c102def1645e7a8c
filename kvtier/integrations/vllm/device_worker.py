"""The worker side of kvtier's vLLM connector for KV caches on an accelerator.

:class:`DeviceWorkerSide` makes vLLM's paged KV tensors kvtier's device pool
(:class:`.paged.VLLMPagedPool`, views, no copy) and opens a
:class:`~kvtier.cache.TieredCache` over it through kvtier's one construction path, so
pages move device <-> host pool (L2) through the plan's IO backend and host pool <->
storage (L3) on the cache's threads. Per step, as vLLM calls it:

- ``start_load_kv``: :meth:`start_loads` starts one prefetch per request (storage reads
  run while vLLM prepares the step);
- ``wait_for_layer_load(layer)``: :meth:`wait_layer` has that layer of every request in
  place (``load_layer``); on CUDA the first call queues every layer's copy on the cache's
  load stream and each call orders the model's stream after its own layer only, so later
  layers' copies overlap earlier layers' compute; without ``load_layer`` the first call
  loads all layers;
- or, with ``device_loads`` "async" (hybrid models by default), loads run between steps
  as vLLM's ``load_async``: :meth:`poll_loads` (``get_finished``) reports a request once
  its pages are on the device, and failed requests, which vLLM recomputes;
- ``save_kv_layer(layer)``: :meth:`save_layer` backs that layer of the step's new full
  blocks up (``backup_layer``); :meth:`end_step` (``wait_for_save``) completes missing
  layers, or backs every layer up without ``backup_layer``;
- ``get_finished``: :meth:`finished` lets vLLM free a request's blocks once their
  device -> host copies are done (the storage write may still run).

A page that is missing or fails verification goes back to vLLM (:meth:`take_load_errors`)
to be recomputed, is counted, and is reported to the scheduler, as on the CPU path
(:mod:`.worker`); the pages after it are recomputed too (chained keys) but kept, and
nothing is deleted (the cache gives no per-page verdict; the recomputed page is written
over a bad one). Keys are the scheduler's chained keys plus this rank's suffix.

The page kinds of the CPU path are stored here too:

- **MLA**: the pool is a latent view of vLLM's tensors; every rank holds the same latent,
  so rank 0 alone writes storage (the cache's ``writes_storage``) and reports pages
  stored, while every rank backs its pages up into its own host pool and loads.
- **hybrid** (vLLM's hybrid allocator, several KV cache groups): one pool over the
  distinct layer positions (groups overlay one memory; a page is a block across every
  position and only its key names the group); each op carries its group's keys and
  blocks. A layer's backup copies that position of its own group's blocks only (another
  group's layer at the position may not have run yet). A sliding-window group's blocks,
  which vLLM frees while the request runs, are host-copied before :meth:`end_step`
  returns (at most ``preempt_wait_s``, else tainted as a preemption's). vLLM takes no
  block errors with several groups, so failed loads go back per request in the report
  (``failed_from``: the scheduler distrusts the page and re-plans the stores). vLLM
  fails a load per request only while the request waits for an asynchronous load, so
  these models load asynchronously (``device_loads`` "layerwise" is refused for them).

Nothing here imports vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.cache.handles import BackupHandle, PrefetchHandle
from kvtier.cache.tiered import TieredCache
from kvtier.core.capabilities import ResolvedPlan
from kvtier.core.errors import KvtierError
from kvtier.core.geometry import AttentionKind
from kvtier.core.metrics import zeroed
from kvtier.core.specs import Operation
from kvtier.core.streams import is_cuda
from kvtier.integrations.vllm.blocks import order_layers, refuse
from kvtier.integrations.vllm.messages import PageOp, Report
from kvtier.integrations.vllm.paged import (
    DEVICE_SUPPORTED,
    VLLMPagedPool,
    block_slots,
    positions_of,
    strategy_of,
)
from kvtier.integrations.vllm.plan import KVGroup, reader_plan
from kvtier.integrations.vllm.rank import Deleter, RankWorker, no_pages_yet
from kvtier.integrations.vllm.settings import VLLMSection

__all__ = ["CACHE_OPTIONS", "DeviceWorkerSide"]

log = logging.getLogger("kvtier.vllm")

#: The cache's options: vLLM was promised every page the scheduler counted as a hit, so a
#: load waits for the whole prefetch (bounded by ``max_load_wait_s``); the rest recomputes.
CACHE_OPTIONS: dict[str, Any] = {"prefetch_policy": "wait_complete"}


@dataclass(eq=False)
class _Load:
    """One request's load in this step: its prefetch, and the layers loaded so far."""

    op: PageOp
    slots: torch.Tensor
    handle: PrefetchHandle | None
    loaded: int | None = None
    layers: set[int] = field(default_factory=set)
    failed: bool = False


@dataclass(eq=False)
class _Fetch:
    """One request's asynchronous load: its prefetch, then its copy to the device."""

    op: PageOp
    slots: torch.Tensor
    handle: PrefetchHandle | None
    started: float
    #: Pages whose copy was queued (None: still prefetching).
    loaded: int | None = None


@dataclass(eq=False)
class _Save:
    """One request's backup in this step: a handle per backup call, the layers sent."""

    op: PageOp
    names: list[str]
    slots: torch.Tensor
    num_layers: int
    handles: list[BackupHandle] = field(default_factory=list)
    layers: set[int] = field(default_factory=set)
    failed: bool = False
    #: Preempted before its device -> host copy was done: never reported stored.
    tainted: bool = False

    def sent(self) -> bool:
        """Every layer was handed to the cache (or a call failed: nothing more comes)."""
        return self.failed or len(self.layers) == self.num_layers

    def host_done(self) -> bool:
        return self.sent() and all(handle.host_done.is_set() for handle in self.handles)

    def done(self) -> bool:
        return self.sent() and all(handle.finished.is_set() for handle in self.handles)

    def ok(self) -> bool:
        """Every page reached the host pool and every storage write it owed stored it."""
        return not self.failed and all(
            h.pages_failed == 0 and h.pages_unwritten == 0 for h in self.handles
        )


class DeviceWorkerSide(RankWorker):
    """Loads and stores of one vLLM worker whose KV cache is on an accelerator."""

    def __init__(
        self,
        plan: ResolvedPlan,
        settings: VLLMSection,
        *,
        groups: int = 1,
        kv_groups: Sequence[KVGroup] = (),
    ) -> None:
        """``groups``: vLLM's KV cache groups; ``kv_groups``: those groups, whose layer
        names let a layer's backup copy its own group's blocks (without them, a model of
        several groups backs every position up at the step's end)."""
        mla = plan.geometry.attention is AttentionKind.MLA
        if mla and groups > 1:
            raise refuse(
                f"vLLM KV cache: an MLA model with {groups} KV cache groups (MLA beside other "
                "attention, or sliding-window MLA); kvtier stores one group of MLA",
                groups,
                DEVICE_SUPPORTED,
            )
        if kv_groups and len(kv_groups) != groups:
            raise refuse(
                f"vLLM KV cache: {len(kv_groups)} KV cache groups given for a model of "
                f"{groups}; pass kv_groups(kv_cache_config) from kvtier.integrations.vllm.plan",
                len(kv_groups),
                DEVICE_SUPPORTED,
            )
        super().__init__(plan, settings, groups=groups)
        self.cache: TieredCache | None = None
        self.pool: VLLMPagedPool | None = None
        #: vLLM's layer name -> kvtier layer index (its position, in model order; layers
        #: of several groups that alias one tensor share it).
        self.layers: dict[str, int] = {}
        #: Distinct layer positions (the pool's layers).
        self.positions = 0
        #: vLLM's layer name -> its KV cache group (several groups only).
        self.group_of: dict[str, int] = (
            {name: group.index for group in kv_groups for name in group.layer_names}
            if groups > 1
            else {}
        )
        #: MLA pages are the same on every rank: rank 0 writes and reports them.
        self.writes_pages = not mla or int(plan.context.tp_rank) == 0
        self.per_layer_load = plan.declares(Operation.LOAD_LAYER)
        self.per_layer_save = plan.declares(Operation.BACKUP_LAYER)
        #: Loads between steps (vLLM's ``load_async``) rather than inside them.
        self.async_loads = settings.async_device_loads(groups)
        self._loads: list[_Load] = []
        self._fetches: list[_Fetch] = []
        self._queue_ahead = False
        #: Requests of which an asynchronous load failed, until all their loads ended.
        self._fetch_failed: set[str] = set()
        self._current: list[_Save] | None = None
        self._in_flight: dict[str, list[_Save]] = {}

    def register(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        layer_index: dict[str, int],
        num_blocks: int,
    ) -> None:
        """Take vLLM's KV tensors as a device pool and open the tiered cache over them.

        Host-memory blocks in the CPU backend's layout are refused: this strategy follows
        vLLM's device, and such blocks would be keyed and ordered as the CPU strategy's.
        """
        layers = order_layers(kv_caches, layer_index)
        if strategy_of([tensor for _, tensor in layers]) == "host":
            raise refuse(
                "vLLM KV cache: the engine runs on an accelerator, but its KV caches are "
                "host-memory blocks in the CPU backend's layout [num_blocks, num_kv_heads, "
                "block_size, 2 * head_size] (LBHNC); the worker strategy follows vLLM's device",
                str(layers[0][1].device) if layers else None,
                DEVICE_SUPPORTED,
            )
        positions, where = positions_of(layers)
        pool = VLLMPagedPool(positions, num_blocks=num_blocks, geometry=self.plan.geometry)
        bounds = self.settings.page_store_options()
        options = {
            **CACHE_OPTIONS,
            "backend_call_timeout_s": bounds["backend_call_timeout_s"],
            "max_abandoned_calls": bounds["max_abandoned_calls"],
        }
        # the connector's plan; an MLA rank that writes nothing promotes nothing either:
        # the writer, reading the same shared pages, promotes them once
        plan = self.plan if self.writes_pages else reader_plan(self.plan)
        cache = TieredCache.open(plan, pool, options=options)
        self.pool, self.cache = pool, cache
        self.layers, self.positions = where, len(positions)
        #: Queue every layer's copy at the step's first layer (CUDA: copies are async).
        self._queue_ahead = is_cuda(pool.device)
        self.watch(cache.page_store.events)

    def _require(self) -> TieredCache:
        if self.cache is None:
            raise no_pages_yet()
        return self.cache

    def _page_store(self) -> Deleter:
        return self._require().page_store

    def prometheus_collector(self) -> Any:
        """The tiered cache's prometheus_client collector (docs/operating.md)."""
        return self._require().prometheus_collector()

    # --- loads --------------------------------------------------------------------------

    def start_loads(self, loads: Sequence[PageOp]) -> None:
        """Start the prefetch of each request's pages; storage reads run on the cache's
        workers. Asynchronous loads go on across steps (:meth:`poll_loads`); in-step ones
        are loaded by :meth:`wait_layer`."""
        if not loads:
            return
        cache = self._require()
        if self._loads:
            self.finish_loads()
        ps = self.plan.geometry.page_size
        now = time.monotonic()
        for op in loads:
            handle: PrefetchHandle | None = None
            try:
                handle = cache.prefetch(self.names(op.keys))
            except KvtierError as exc:
                log.warning(
                    "kvtier: a prefetch raised %s; its %d pages recompute", exc, len(op.keys)
                )
            slots = block_slots(op.blocks, ps)
            if self.async_loads:
                self._fetches.append(_Fetch(op, slots, handle, now))
            else:
                self._loads.append(_Load(op, slots, handle))
        if self.async_loads:
            self._queue_copies()  # host hits go to the device at once

    @property
    def loading(self) -> bool:
        return bool(self._loads or self._fetches)

    # --- loads between steps (vLLM's load_async) ------------------------------------------

    def _queue_copies(self) -> None:
        """Queue the device copy of every fetch whose prefetch is done, or has run out of
        ``max_load_wait_s`` (the pages ready by then load, the rest recompute). On CUDA
        the copy runs on the cache's load stream; the model's stream never waits for it:
        vLLM schedules the request once :meth:`poll_loads` reports the copy done."""
        cache = self._require()
        bound = cache.options.max_load_wait_s
        layers: list[int | None] = (
            [None] if self.plan.declares(Operation.LOAD_ALL) else list(range(self.positions))
        )
        for item in self._fetches:
            if item.loaded is not None or item.handle is None:
                continue
            if not item.handle.done and time.monotonic() - item.started < bound:
                continue
            try:
                counts = [
                    cache.load(item.handle, item.slots, layer=layer, ordered=False)
                    for layer in layers
                ]
            except KvtierError as exc:
                log.warning(
                    "kvtier: a load raised %s; its %d pages recompute", exc, len(item.op.keys)
                )
                counts = [0]
            item.loaded = min(counts)

    def poll_loads(self, wait_s: float = 0.0) -> tuple[set[str], set[str]]:
        """Requests whose asynchronous load ended since the last call (their pages are on
        the device, or failed), and those of them vLLM should take as failed per request
        (several KV cache groups: vLLM takes no block errors there). Waits ``wait_s`` at
        most for one to end (the connector passes a wait only in a step without a
        forward, when the engine has nothing but loads to wait for)."""
        if not self._fetches:
            return set(), set()
        deadline = time.monotonic() + wait_s
        while True:
            self._queue_copies()
            ended, failed = self._ended_fetches()
            if ended or not self._fetches or time.monotonic() >= deadline:
                return ended, failed
            time.sleep(0.0005)

    def _ended_fetches(self) -> tuple[set[str], set[str]]:
        """Settle the fetches whose copies are done; a request ends with its last one."""
        keep: list[_Fetch] = []
        settled: set[str] = set()
        for item in self._fetches:
            handle = item.handle
            if handle is not None and (item.loaded is None or not handle.copies_done):
                keep.append(item)
                continue
            if handle is not None:
                handle.release()  # the copies are done: returns at once
            settled.add(item.op.req_id)
            if self._account(item.op, item.loaded or 0):
                self._fetch_failed.add(item.op.req_id)
        self._fetches = keep
        ended = settled - {item.op.req_id for item in keep}
        failed = ended & self._fetch_failed
        self._fetch_failed -= ended
        if self.groups == 1:
            failed = set()  # the failed blocks went back as block errors
        else:
            self.counters.add("load_failed_requests", len(failed))
        return ended, failed

    # --- loads inside the step ------------------------------------------------------------

    def wait_layer(self, layer_name: str) -> None:
        """Have layer ``layer_name`` of this step's pages in place before it runs (all
        layers without ``load_layer``).

        On CUDA the first call queues every layer's copy on the cache's load stream, and
        each call makes the model's stream wait for its own layer only: layer i's copy
        runs while the layers before it compute, and the host waits for none of it (the
        step's end releases the pages once the copies are done). Elsewhere each call
        copies its layer."""
        if not self._loads:
            return
        layer = self.layers.get(layer_name)
        if layer is None or not self.per_layer_load:
            self.finish_loads()
            return
        if self._queue_ahead:
            for item in self._loads:
                for position in range(self.positions):
                    self._load_layer(item, position, ordered=False)
                if item.handle is not None and not item.failed:
                    item.handle.order(layer)
            return
        for item in self._loads:
            self._load_layer(item, layer)
        if all(item.failed or len(item.layers) == self.positions for item in self._loads):
            self._settle()

    def _load_layer(self, item: _Load, layer: int | None, *, ordered: bool = True) -> None:
        if item.failed or (layer is not None and layer in item.layers):
            return
        if item.handle is None:
            item.failed = True
            return
        try:
            count = self._require().load(item.handle, item.slots, layer=layer, ordered=ordered)
        except KvtierError as exc:
            log.warning("kvtier: a load raised %s; its %d pages recompute", exc, len(item.op.keys))
            item.failed = True
            item.handle.release()
            return
        item.loaded = count if item.loaded is None else min(item.loaded, count)
        item.layers.update(range(self.positions) if layer is None else (layer,))

    def finish_loads(self) -> None:
        """Load every layer not loaded yet, then record the blocks whose page did not load."""
        for item in self._loads:
            if self.per_layer_load:
                for layer in range(self.positions):
                    self._load_layer(item, layer)
            else:
                self._load_layer(item, None)
        self._settle()

    def _settle(self) -> None:
        """Account the step's loads. The cache loads the leading pages that are ready, so
        the first one missing is the failed page; those after it were not read (chained
        keys: of no use past a hole) and are neither failed nor distrusted, only recomputed.
        Nothing is deleted: the cache gives no per-page verdict, and a recomputed page is
        written over a bad one. (Only models of one KV cache group load in the step: see
        ``device_loads``.)"""
        loads, self._loads = self._loads, []
        for item in loads:
            if item.handle is not None:
                item.handle.release()
            self._account(item.op, 0 if item.failed else (item.loaded or 0))

    def _account(self, op: PageOp, loaded: int) -> bool:
        """Count one request's load of which the first ``loaded`` pages arrived; record
        the rest (block errors with one group); True if a page failed."""
        count = len(op.keys)
        good = min(loaded, count)
        self.counters.add("load_pages", count)
        self.counters.add("load_hit_pages", good)
        if good >= count:
            return False
        self._failed(op, [good])
        skipped = op.blocks[good + 1 :]
        self.counters.add("load_skipped_pages", len(skipped))
        if self.groups == 1:
            with self._lock:
                self._load_errors.update(skipped)
        return True

    # --- saves --------------------------------------------------------------------------

    def _records(self, saves: Sequence[PageOp]) -> list[_Save]:
        """This step's backups, one per op, made at the step's first save call."""
        if self._current is None:
            ps, layers = self.plan.geometry.page_size, self.positions
            self._current = [
                _Save(op, self.names(op.keys), block_slots(op.blocks, ps), layers) for op in saves
            ]
            with self._lock:  # held from now: get_finished waits for every layer's copy
                for record in self._current:
                    self._in_flight.setdefault(record.op.req_id, []).append(record)
                    self._saving.add(record.op.req_id)
        return self._current

    def _backup(self, record: _Save, layer: int | None) -> None:
        if record.failed or (layer is not None and layer in record.layers):
            return
        try:
            record.handles.append(self._require().backup(record.names, record.slots, layer=layer))
        except KvtierError as exc:
            log.warning(
                "kvtier: a backup raised %s; its %d pages are not kept", exc, len(record.names)
            )
            record.failed = True
            return
        record.layers.update(range(self.positions) if layer is None else (layer,))

    def save_layer(self, layer_name: str, saves: Sequence[PageOp]) -> None:
        """Back layer ``layer_name`` of the step's new full blocks up (``backup_layer``).

        With several KV cache groups only the layer's own group's blocks: another group's
        layer at the same position (the same memory) may not have run yet, so its blocks
        there are backed up at that layer's call, or at the step's end."""
        layer = self.layers.get(layer_name)
        if not saves or not self.per_layer_save or layer is None:
            return
        group = self.group_of.get(layer_name) if self.groups > 1 else None
        if self.groups > 1 and group is None:
            return  # a layer of no known group: end_step backs its position up
        for record in self._records(saves):
            if group is None or record.op.group == group:
                self._backup(record, layer)

    def end_step(self, saves: Sequence[PageOp]) -> None:
        """Finish the step: loads done, every layer of its new full blocks backed up, and
        the device -> host copies of blocks vLLM frees while the request runs (a
        sliding-window group's, ``stage``) done before this returns."""
        if self._loads:
            self.finish_loads()
        records = self._records(saves) if saves else (self._current or [])
        self._current = None
        for record in records:
            if self.per_layer_save:
                for layer in range(self.positions):
                    self._backup(record, layer)
            else:
                self._backup(record, None)
        volatile = [record for record in records if record.op.stage]
        if volatile:
            self._wait_host(volatile, "sliding-window blocks vLLM frees after this step")

    def _wait_host(self, records: Sequence[_Save], why: str) -> bool:
        """Wait for ``records``' device -> host copies, at most ``preempt_wait_s`` in all,
        before vLLM reuses their blocks (``why``); taint the copies still running then.
        True if every copy was done in time."""
        cache = self._require()
        deadline = time.monotonic() + self.settings.preempt_wait_s
        late = False
        for record in records:
            for handle in record.handles:
                if not handle.wait_host(max(0.0, deadline - time.monotonic())):
                    late = True
                    self._taint(cache, record)
        if late:
            log.warning(
                "kvtier: device -> host copies of %s still run after %.1f s; vLLM reuses the "
                "blocks now, so their pages are dropped",
                why,
                self.settings.preempt_wait_s,
            )
        return not late

    def _taint(self, cache: TieredCache, record: _Save) -> None:
        """``record``'s copy may read blocks vLLM reuses now: out of the host pool at once
        (no later load serves it, it is never written from there); once the backup
        finished, out of both again (:meth:`_poll`); never reported stored."""
        if not record.tainted:
            record.tainted = True
            self.counters.add("save_tainted_pages", len(record.names))
            cache.discard(record.names)

    def _poll(self) -> None:
        """Account the backups that finished (host copy and storage write)."""
        tainted: list[_Save] = []
        with self._lock:
            for req_id, records in list(self._in_flight.items()):
                keep = []
                for record in records:
                    if not record.done():
                        keep.append(record)
                        continue
                    count = len(record.op.keys)
                    if record.tainted:
                        tainted.append(record)
                    if not self.writes_pages:
                        # an MLA rank other than 0: its copy is in its own host pool, and
                        # rank 0 writes (and reports) the pages every rank shares
                        self.counters.add("save_skipped_not_writer", count)
                        continue
                    stored = count if record.ok() and not record.tainted else 0
                    if stored:
                        for key in record.op.keys:
                            self._report.stored[key] = self._report.stored.get(key, 0) + 1
                    self.counters.add("save_pages", count)
                    self.counters.add("save_stored_pages", stored)
                    self.counters.add("save_failed_pages", count - stored)
                if keep:
                    self._in_flight[req_id] = keep
                else:
                    del self._in_flight[req_id]
        for record in tainted:  # written from blocks vLLM may have reused meanwhile
            try:
                # a backup that ran after the preemption put its pages in the host pool
                # after they were dropped there: out again, and out of storage (where this
                # rank writes: a reader's pages in storage are the writer's)
                self._require().discard(record.names)
                if self.writes_pages:
                    self._page_store().delete(record.names)
            except KvtierError as exc:
                log.warning("kvtier: deleting %d tainted pages raised %s", len(record.names), exc)

    def _host_done(self, req_id: str) -> bool:
        return all(record.host_done() for record in self._in_flight.get(req_id, ()))

    def preempted(self, req_ids: Iterable[str]) -> None:
        """Wait for the device -> host copies of preempted requests before vLLM reuses
        their blocks, at most ``preempt_wait_s``; a copy still running past it is tainted:
        its pages leave the host pool at once (:meth:`TieredCache.discard`), are deleted
        from storage once written, and are never reported stored."""
        if self.cache is None:
            return
        gone = set(req_ids)
        with self._lock:
            records = [r for req_id in gone for r in self._in_flight.get(req_id, ())]
        if not records:
            return
        self.counters.add("preempt_waits")
        if not self._wait_host(records, f"preempted requests {sorted(gone)}"):
            self.counters.add("preempt_wait_timeouts")
        with self._lock:
            for req_id in gone:
                self._saving.discard(req_id)
                self._finishing.discard(req_id)

    def finished(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Of the finished requests with backups, those whose device -> host copies are done."""
        self._poll()
        with self._lock:
            self._finishing.update(set(finished_req_ids) & self._saving)
            done = {r for r in self._finishing if self._host_done(r)}
            self._finishing -= done
            self._saving -= done
        return done

    def take_report(self) -> Report:
        """What this rank stored and failed to load since the last call (polls backups)."""
        self._poll()
        return super().take_report()

    # --- housekeeping -------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every backup so far has finished (host copy and storage write)."""
        cache = self._require()
        with self._lock:
            handles = [
                h for records in self._in_flight.values() for r in records for h in r.handles
            ]
        ok = all(handle.wait(timeout) for handle in handles)
        return cache.flush(timeout) and ok

    def stats(self) -> dict[str, Any]:
        """Cumulative counters: the worker's and the tiered cache's (``cache_*``)."""
        self._poll()
        stats: dict[str, Any] = zeroed("vllm_worker")
        stats.update(self.counters.snapshot())
        if self.cache is not None:
            for key, value in self.cache.stats().items():
                if isinstance(value, dict):
                    for sub, number in value.items():
                        if isinstance(number, (int, float)) and not isinstance(number, bool):
                            stats[f"cache_{key}_{sub}"] = number
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    stats[f"cache_{key}"] = value
        return stats

    def close(self) -> None:
        """Release loads in flight, then close the cache (drains its writes). Idempotent."""
        for handle in [i.handle for i in self._loads] + [f.handle for f in self._fetches]:
            if handle is not None:
                handle.release()
        self._loads, self._fetches = [], []
        self.stop_watching()
        cache, self.cache = self.cache, None
        if cache is not None:
            cache.close()
