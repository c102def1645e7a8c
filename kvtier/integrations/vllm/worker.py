"""The worker side of kvtier's vLLM connector on vLLM's CPU engine: pages in vLLM's blocks.

:class:`WorkerSide` opens the plan's storage chain (one page store per tier, a chain of
one for one backend) over vLLM's KV tensors (:mod:`.blocks`), reports the chain's events
to the scheduler, and keeps every backend call off the model's path:

- **loads** are asynchronous: a step's loads are one batched ``get`` on a reader thread,
  straight into the blocks vLLM allocated for them, while vLLM holds the requests in
  ``WAITING_FOR_REMOTE_KVS`` and computes others. :meth:`WorkerSide.poll_loads` reports the
  requests whose load ended (failed ones too) and records the blocks of the pages that did
  not verify, in the same pass. A read that timed out keeps its request waiting until the
  backend call returns, since the backend may still write into the blocks.
- **stores** are queued for a writer thread, at most ``max_save_pages`` pages: a save
  beyond it is dropped and counted, never waited for. The writer merges several requests'
  stores into one ``put`` and passes each page's real parent with it (the page before it
  in its own request, :attr:`PageOp.parent` for an op's first page), so the tiers'
  policies never link one request's page to another's. A finished request's blocks stay
  with vLLM until its stores ran; a preempted request's queued stores are dropped and a
  store in flight is waited for (``preempt_wait_s``) before vLLM reuses the blocks, or
  else tainted: its :class:`~kvtier.core.saveguard.SaveGuard` is tripped (every page not
  checksummed yet gets an envelope that never verifies, and the put reports each page
  False), and its pages are deleted (tainted in the chain) once its call returns, never
  reported stored. Hence ``verify: "header"`` is refused here: a page checksummed before
  the trip whose bytes changed under the write is caught by full verification only. A
  sliding-window group's blocks, which vLLM frees while the request runs, are copied to
  staging pages at the end of their step and stored from there.
- a page is deleted only when it is proven bad (its envelope failed verification); a
  missing page, a failed or timed-out call deletes nothing.

It imports nothing from vLLM.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from kvtier.cache.metrics import identity_of, store_collector
from kvtier.core.bounded import Outcome
from kvtier.core.capabilities import ResolvedPlan
from kvtier.core.errors import KvtierError, UnsupportedCombinationError
from kvtier.core.geometry import AttentionKind
from kvtier.core.metrics import zeroed
from kvtier.core.pagestore import BatchResult
from kvtier.core.saveguard import SaveGuard
from kvtier.integrations.vllm.blocks import VLLMBlocks, layer_positions, order_layers
from kvtier.integrations.vllm.messages import PageOp
from kvtier.integrations.vllm.plan import reader_plan
from kvtier.integrations.vllm.rank import RankWorker, no_pages_yet, proves_bad
from kvtier.integrations.vllm.settings import VLLMSection
from kvtier.storage import StorageChain, open_store

__all__ = ["WorkerSide", "header_verify_refused"]

log = logging.getLogger("kvtier.vllm")

#: What a wait for loads or stores adds to the backend call bound (verification, copies).
WAIT_SLACK_S = 10.0
#: Pages of queued stores the writer hands the backend in one ``put`` at most.
WRITE_BATCH_PAGES = 128


@dataclass(eq=False)
class _LoadBatch:
    """One step's loads: one batched read of its distinct pages."""

    ops: list[PageOp]
    future: Future[dict[str, bool]]
    started: float
    ended: float | None = None
    #: Set once the backend is done with the blocks (at once, unless the read timed out).
    released: threading.Event = field(default_factory=threading.Event)
    late: bool = False


@dataclass(eq=False)
class _Held:
    """Requests whose load is settled but whose blocks a timed-out read may still fill."""

    req_ids: set[str]
    released: threading.Event


@dataclass(eq=False)
class _Save:
    """One queued store: an op, and the pages it is written from (blocks or staging)."""

    op: PageOp
    names: list[str]
    pages: list[int]
    staging: list[int]
    #: Each page's parent, as a storage name of this rank (the page before it in its
    #: request; the op's ``parent`` for its first page).
    parents: list[str | None] = field(default_factory=list)
    #: Preempted while its call ran: deleted once the call returns, never reported stored.
    tainted: bool = False
    #: Tripped with ``tainted``: no page of it is checksummed from reused blocks after that.
    guard: SaveGuard = field(default_factory=SaveGuard)


def by_request(saves: list[_Save]) -> list[_Save]:
    """``saves`` grouped by request, each request's in their order, the requests in the
    order they first appear: one put's pages of one request lie side by side (a segment
    store writes a put as one record), so a later hit on that request's prefix is one
    read where its steps' saves would otherwise alternate with other requests'."""
    groups: dict[str, list[_Save]] = {}
    for save in saves:
        groups.setdefault(save.op.req_id, []).append(save)
    return [save for group in groups.values() for save in group]


def header_verify_refused(verify: str) -> UnsupportedCombinationError | None:
    """The error for ``verify: "header"`` on the CPU engine (None for ``full``).

    Pages are written straight from vLLM's blocks, and a preempted request's blocks are
    reused after ``preempt_wait_s`` even if its store still runs: a page checksummed
    before that whose bytes then changed under the write carries its original checksum,
    which only full verification compares.
    """
    if verify != "header":
        return None
    return UnsupportedCombinationError(
        'kvtier.verify: "header" is refused on vLLM\'s CPU engine: pages are written '
        "straight from vLLM's blocks, which a preemption hands back while a store may still "
        "read them, and only full verification rejects a page whose bytes changed under "
        'its write (docs/vllm.md, "Preemption"); set "verify": "full" (the default)',
        value=verify,
        supported=('verify "full" on the CPU engine', 'verify "header" on an accelerator'),
    )


class WorkerSide(RankWorker):
    """Loads and stores of one vLLM worker (one tensor-parallel rank) on the CPU engine."""

    def __init__(self, plan: ResolvedPlan, settings: VLLMSection, *, groups: int = 1) -> None:
        refused = header_verify_refused(plan.config.verify)
        if refused is not None:
            raise refused
        super().__init__(plan, settings, groups=groups)
        #: The plan's storage chain over vLLM's blocks (a chain of one for one backend).
        self.store: StorageChain | None = None
        self.pages: VLLMBlocks | None = None
        #: MLA pages are the same on every rank: rank 0 writes them, every rank reads them.
        self.writes_pages = (
            plan.geometry.attention is not AttentionKind.MLA or int(plan.context.tp_rank) == 0
        )
        bound = settings.backend_call_timeout_s
        self._wait_s: float | None = None if bound is None else 2 * bound + WAIT_SLACK_S
        self._reader = ThreadPoolExecutor(
            1, thread_name_prefix="kvtier-vllm-load", initializer=self._lower_priority
        )
        self._loads: list[_LoadBatch] = []
        self._held: list[_Held] = []
        self._ended_loads: set[str] = set()
        self._failed_loads: set[str] = set()
        self._step_started: float | None = None
        # stores: one writer thread over a bounded queue, all under ``self._cv``
        self._cv = threading.Condition(self._lock)
        self._queue: deque[_Save] = deque()
        self._queued_pages = 0
        self._writing: list[_Save] = []
        self._late_saves: list[_Save] = []
        self._pending: dict[str, int] = {}
        self._free_staging: list[int] = []
        self._stopping = False
        self._writer: threading.Thread | None = None

    def register(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        layer_index: dict[str, int],
        num_blocks: int,
    ) -> None:
        """Take vLLM's KV tensors as kvtier pages and open the store over them."""
        pages = VLLMBlocks(
            layer_positions(order_layers(kv_caches, layer_index)),
            num_blocks=num_blocks,
            geometry=self.plan.geometry,
            layout=self.plan.layout,
            staging_pages=self.settings.staging_pages if self.groups > 1 else 0,
        )
        pages.extents(0)  # the memory matches the geometry: checked now, not later
        self.pages = pages
        self._free_staging = list(range(pages.num_blocks, pages.num_pages))
        # an MLA rank that writes nothing promotes nothing either: the writer, which reads
        # the same shared pages, promotes them once
        plan = self.plan if self.writes_pages else reader_plan(self.plan)
        self.store = open_store(plan, pages, **self.settings.page_store_options())
        self.watch(self.store.events)
        self._writer = threading.Thread(
            target=self._write_loop, name="kvtier-vllm-save", daemon=True
        )
        self._writer.start()

    def _require_store(self) -> StorageChain:
        if self.store is None:
            raise no_pages_yet()
        return self.store

    def _page_store(self) -> StorageChain:
        return self._require_store()

    def _store_get(
        self,
        names: list[str],
        pages: list[int],
        on_late: Any,
        verdicts: dict[int, str],
    ) -> BatchResult:
        """One bounded, verified ``get`` of ``names`` into ``pages``; ``verdicts`` receives
        the verdict of each page proven bad in every tier that holds it (the chain reads
        each page from the first tier with a valid copy, see ``StorageChain.get``)."""
        return self._require_store().get(names, pages, on_late=on_late, verdicts=verdicts)

    def _store_put(
        self,
        names: list[str],
        pages: list[int],
        on_late: Any,
        guards: Sequence[SaveGuard | None] | None = None,
        parents: Sequence[str | None] | None = None,
    ) -> BatchResult:
        """One bounded ``put`` into the chain's first tier (it cascades down on its own);
        ``guards``: each page's save guard (tripped if its request is preempted);
        ``parents``: each page's real parent (the put merges several requests' pages)."""
        return self._require_store().put(
            names, pages, on_late=on_late, guards=guards, parents=parents
        )

    # --- loads --------------------------------------------------------------------------

    def start_loads(self, loads: Sequence[PageOp]) -> None:
        """Start reading a step's pages into their vLLM blocks: one batch, reader thread.

        One batched ``get`` lets the backend overlap the reads (the file backend's
        threads, io_uring's queue depth). A page several requests of the step load (a
        shared prefix) is read and verified once, then copied block to block.
        """
        if not loads:
            return
        self._require_store()
        batch = _LoadBatch(list(loads), Future(), time.monotonic())
        batch.future = self._reader.submit(self._read, batch)
        self._loads.append(batch)

    def _read(self, batch: _LoadBatch) -> dict[str, bool]:
        """On the reader thread: read, verify, copy shared pages, delete proven-bad ones."""
        try:
            return self._read_batch(batch)
        finally:
            batch.ended = batch.ended or time.monotonic()
            if not batch.late:
                batch.released.set()

    def _read_batch(self, batch: _LoadBatch) -> dict[str, bool]:
        store, pages = self._require_store(), self.pages
        names = [name for op in batch.ops for name in self.names(op.keys)]
        blocks = [block for op in batch.ops for block in op.blocks]
        first: dict[str, int] = {}
        for i, name in enumerate(names):
            first.setdefault(name, i)
        unique = list(first)
        reasons: dict[int, str] = {}
        try:
            found = self._store_get(
                unique,
                [blocks[first[name]] for name in unique],
                lambda _results: batch.released.set(),
                reasons,
            )
        except KvtierError as exc:  # bad keys or pages; backend errors are False
            log.warning("kvtier: a load raised %s; its %d pages recompute", exc, len(unique))
            found = None
        batch.ended = time.monotonic()
        if found is not None and found.outcome is Outcome.TIMED_OUT:
            batch.late = True  # the backend may still write into the blocks
        if found is not None and len(store.tiers) > 1:
            # pages a lower tier served, being promoted: a lookup of them waits for that
            promoting = [n for n, busy in zip(unique, store.pending(unique), strict=True) if busy]
            if promoting:
                with self._lock:
                    self._report.promoting.extend(self._base_keys(promoting))
        ok = dict(zip(unique, found or [False] * len(unique), strict=True))
        copies = [(first[n], i) for i, n in enumerate(names) if first[n] != i and ok[n]]
        if copies and pages is not None:
            for source, target in copies:
                pages.copy_block(blocks[source], blocks[target])
            self.counters.add("load_copied_pages", len(copies))
        bad = [unique[i] for i, reason in sorted(reasons.items()) if proves_bad(reason)]
        if bad and self.writes_pages:
            # proven bad: removed, so no engine sharing the store reads it again and the
            # recomputed page takes its place (a delete that fails is only logged)
            deleted = store.delete(bad)
            self.counters.add("load_deleted_pages", sum(deleted))
        return ok

    @property
    def loading(self) -> bool:
        return bool(self._loads)

    def finish_loads(self, timeout: float | None = None) -> None:
        """Wait for the loads in flight (bounded), then settle them as :meth:`poll_loads`."""
        bound = self._wait_s if timeout is None else timeout
        deadline = None if bound is None else time.monotonic() + bound
        for batch in list(self._loads):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                batch.future.result(timeout=left)
            except FutureTimeout:
                log.warning("kvtier: a load is still running after %.1f s", bound or 0.0)
            except Exception:  # settled (and logged) in _settle
                pass
        self._settle()

    def poll_loads(self, wait_s: float = 0.0) -> tuple[set[str], set[str]]:
        """Requests whose load ended since the last call, and those of them that vLLM
        should take as failed (per request); waits ``wait_s`` at most for one to end (the
        connector passes a wait only in a step without a forward, when the engine has
        nothing but loads to wait for).

        The blocks of pages that did not verify are recorded by then
        (:meth:`pop_load_errors`), as vLLM wants them no later than the same pass. A
        request with a page that did not verify is also failed per request: vLLM looks it
        up again (the bad page is distrusted, and deleted when proven bad) and counts as
        cached only the pages before it, which it reads again; with several KV cache groups
        vLLM takes no block errors, so this is the only report there.
        """
        if wait_s > 0 and self._loads and not self._ended_loads:
            futures_wait([batch.future for batch in self._loads], wait_s, FIRST_COMPLETED)
        self._settle()
        ended: set[str] = set()
        still: list[_Held] = []
        for held in self._held:
            if held.released.is_set():
                ended |= held.req_ids
            else:
                still.append(held)
        self._held = still
        ended |= self._ended_loads
        failed = self._failed_loads & ended
        self._ended_loads -= ended
        self._failed_loads -= failed
        return ended, failed

    def _settle(self) -> None:
        """Account every load whose read returned; its requests end once released."""
        keep: list[_LoadBatch] = []
        for batch in self._loads:
            if not batch.future.done():
                keep.append(batch)
                continue
            try:
                ok = batch.future.result()
            except Exception as exc:  # a bug in the read: its pages recompute
                log.warning("kvtier: a load failed with %r; its pages recompute", exc)
                ok = {}
            self._settle_batch(batch, ok)
        self._loads = keep

    def _settle_batch(self, batch: _LoadBatch, ok: dict[str, bool]) -> None:
        requests: dict[str, list[tuple[PageOp, list[int]]]] = {}
        count = good = 0
        for op in batch.ops:
            mine = [ok.get(name, False) for name in self.names(op.keys)]
            count += len(mine)
            good += sum(mine)
            requests.setdefault(op.req_id, []).append(
                (op, [i for i, fine in enumerate(mine) if not fine])
            )
        self.counters.add("load_pages", count)
        self.counters.add("load_hit_pages", good)
        self.counters.add("load_requests", len(requests))
        self.counters.add("load_seconds", (batch.ended or time.monotonic()) - batch.started)
        if batch.late:
            self.counters.add("load_late_pages", count - good)
        for req_id, ops in requests.items():
            failed = [(op, bad) for op, bad in ops if bad]
            for op, bad in failed:
                self._failed(op, bad)
            if failed:  # vLLM looks it up again: only what verified counts as cached
                self._failed_loads.add(req_id)
                self.counters.add("load_failed_requests")
        if batch.released.is_set():
            self._ended_loads |= set(requests)
        else:
            self._held.append(_Held(set(requests), batch.released))

    def step_began(self) -> None:
        """A model step starts (vLLM's ``handle_preemptions``, before the forward)."""
        self._step_started = time.monotonic()

    def step_ended(self) -> None:
        """A step ends (``wait_for_save``): count the time loads ran while it computed."""
        began, self._step_started = self._step_started, None
        if began is None:
            return
        now = time.monotonic()
        spans = sorted(
            (max(began, batch.started), min(now, batch.ended or now)) for batch in self._loads
        )
        covered, reach = 0.0, began
        for lo, hi in spans:
            lo = max(lo, reach)
            if hi > lo:
                covered += hi - lo
                reach = hi
        if covered:
            self.counters.add("load_overlap_seconds", covered)
            self.counters.add("load_overlap_steps")

    # --- stores -------------------------------------------------------------------------

    def submit_saves(self, saves: Sequence[PageOp]) -> None:
        """Queue pages for storage; the writer thread runs while the model computes.

        A save that would take the queue past ``max_save_pages`` (or, for a sliding-window
        group, past the staging pages) is dropped and counted, never waited for.
        """
        if not saves:
            return
        self._require_store()
        for op in saves:
            count = len(op.keys)
            with self._cv:
                self._saving.add(op.req_id)
            if not self.writes_pages:
                self.counters.add("save_skipped_not_writer", count)
                continue
            with self._cv:
                full = self._queued_pages + count > self.settings.max_save_pages
                staging: list[int] = []
                if not full and op.stage:
                    full = len(self._free_staging) < count
                    if not full:
                        staging = [self._free_staging.pop() for _ in range(count)]
            if full:
                self.counters.add("save_dropped_pages", count)
                continue
            pages = list(op.blocks)
            if staging:
                assert self.pages is not None
                for block, slot in zip(op.blocks, staging, strict=True):
                    self.pages.copy_block(block, slot)
                self.counters.add("save_staged_pages", count)
                pages = staging
            names = self.names(op.keys)
            first = self.names([op.parent])[0] if op.parent is not None else None
            save = _Save(op, names, pages, staging, [first, *names[:-1]][: len(names)])
            with self._cv:
                self._queue.append(save)
                self._queued_pages += count
                self._pending[op.req_id] = self._pending.get(op.req_id, 0) + 1
                self._cv.notify_all()

    def _write_loop(self) -> None:
        """The writer thread: the queued stores, up to :data:`WRITE_BATCH_PAGES` pages per
        bounded ``put`` (one call lets the backend overlap the writes)."""
        self._lower_priority()
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if not self._queue:
                    return
                batch = [self._queue.popleft()]
                pages = len(batch[0].names)
                while self._queue and pages + len(self._queue[0].names) <= WRITE_BATCH_PAGES:
                    batch.append(self._queue.popleft())
                    pages += len(batch[-1].names)
                self._queued_pages -= pages
                batch = by_request(batch)
                self._writing = batch
            names = [name for save in batch for name in save.names]
            results = self._put(names, [page for save in batch for page in save.pages], batch)
            stored = sum(results) if results is not None else 0
            self.counters.add("save_pages", len(names))
            self.counters.add("save_stored_pages", stored)
            self.counters.add("save_failed_pages", len(names) - stored)
            late = results is not None and results.outcome is Outcome.TIMED_OUT
            tainted: list[_Save] = []
            with self._cv:
                at = 0
                for save in batch:
                    mine = list(results[at : at + len(save.names)]) if results is not None else []
                    at += len(save.names)
                    if late:  # the backend may still read the pages: held until it returns
                        self._late_saves.append(save)
                        continue
                    if save.tainted:
                        tainted.append(save)
                    else:
                        for key, ok in zip(save.op.keys, mine, strict=False):
                            if ok:
                                self._report.stored[key] = self._report.stored.get(key, 0) + 1
                    self._release(save)
                if late:
                    self.counters.add("save_late_pages", len(names))
                if not tainted:
                    self._writing = []
                self._cv.notify_all()
            if tainted:  # deleted before the batch counts as written (flush waits for it)
                for save in tainted:
                    self._delete_tainted(save)
                with self._cv:
                    self._writing = []
                    self._cv.notify_all()

    def _lower_priority(self) -> None:
        """Lower the calling thread's CPU priority by ``storage_nice`` (the reader's and
        the writer's; the backend threads they start inherit it, Linux's nice being per
        thread). The model's threads keep every core they can use: a step slowed by a
        store costs the engine more than the store's own time, since every model thread
        waits for the slowest. Where the system refuses, the priority stays."""
        step = self.settings.storage_nice
        if step <= 0 or not hasattr(os, "setpriority"):
            return
        try:
            tid = threading.get_native_id()
            now = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(19, now + step))
        except OSError as exc:  # pragma: no cover - a sandbox without setpriority
            log.debug("kvtier: storage threads keep their priority: %s", exc)

    def _put(self, names: list[str], pages: list[int], batch: list[_Save]) -> Any:
        """One bounded ``put`` of ``batch``'s pages; None if it raised (bad keys or pages)."""
        try:
            if self.store is None:
                raise KvtierError("the page store is closed", value=None)
            guards = [save.guard for save in batch for _ in save.names]
            parents = [parent for save in batch for parent in save.parents]
            return self._store_put(names, pages, partial(self._late, batch), guards, parents)
        except KvtierError as exc:  # backend errors are False, not raised
            log.warning("kvtier: a store raised %s; its %d pages are not kept", exc, len(names))
            return None

    def _release(self, save: _Save) -> None:
        """A store is over (its pages are free for vLLM). Called with ``_cv`` held."""
        self._free_staging.extend(save.staging)
        save.staging = []
        if not save.tainted:  # a tainted store's request was let go at preemption
            left = self._pending.get(save.op.req_id, 0) - 1
            if left > 0:
                self._pending[save.op.req_id] = left
            else:
                self._pending.pop(save.op.req_id, None)

    def _late(self, batch: list[_Save], results: Any) -> None:
        """A timed-out ``put`` returned at last (on its call thread): its pages are free."""
        tainted: list[_Save] = []
        with self._cv:
            for save in batch:
                if save in self._late_saves:
                    self._late_saves.remove(save)
                if save.tainted:
                    tainted.append(save)
                self._release(save)
            self._cv.notify_all()
        for save in tainted:
            self._delete_tainted(save)

    def _delete_tainted(self, save: _Save) -> None:
        """Remove every page a store wrote from blocks vLLM may have reused meanwhile.

        All of them, whatever the put said: it reports a tainted page False, yet
        it may have published it (with an envelope that never verifies, or its original
        bytes). Through the chain's ``taint`` where it has one (it also cancels the
        cascades and promotions of the keys), else a delete from every tier.
        """
        store = self.store
        if not save.names or store is None or store.closed:
            return
        taint = getattr(store, "taint", None)
        try:
            if callable(taint):
                taint(save.names)
            else:
                store.delete(save.names)
        except KvtierError as exc:
            log.warning("kvtier: deleting %d tainted pages raised %s", len(save.names), exc)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued store has run (a timed-out one counts as run), and the
        chain's cascades and promotions queued by then; False if ``timeout`` (default:
        twice the call bound, plus slack) passed first."""
        bound = self._wait_s if timeout is None else timeout
        deadline = None if bound is None else time.monotonic() + bound
        with self._cv:
            while self._queue or self._writing:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        store = self.store
        if store is None:
            return True
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return store.flush(left)

    def preempted(self, req_ids: Iterable[str]) -> None:
        """Before vLLM reuses preempted requests' blocks: drop their queued stores, wait
        for one in flight (``preempt_wait_s``), taint what still runs past that."""
        gone = set(req_ids)
        if not gone:
            return
        with self._cv:
            kept: deque[_Save] = deque()
            for save in self._queue:
                if save.op.req_id in gone:
                    self._queued_pages -= len(save.names)
                    self.counters.add("save_dropped_pages", len(save.names))
                    self._release(save)
                else:
                    kept.append(save)
            self._queue = kept
            writing = [save for save in self._writing if save.op.req_id in gone]
            if writing:
                self.counters.add("preempt_waits")
                deadline = time.monotonic() + self.settings.preempt_wait_s
                while (
                    any(save in self._writing for save in writing) and time.monotonic() < deadline
                ):
                    self._cv.wait(deadline - time.monotonic())
                still = [save for save in writing if save in self._writing]
                if still:
                    self.counters.add("preempt_wait_timeouts")
                    for save in still:
                        self._taint(save)
            for save in list(self._late_saves):
                if save.op.req_id in gone:
                    self._taint(save)
            for req_id in gone:
                self._saving.discard(req_id)
                self._finishing.discard(req_id)
                self._pending.pop(req_id, None)

    def _taint(self, save: _Save) -> None:
        """Called with ``_cv`` held: ``save``'s blocks are about to be reused under it.

        Its guard is tripped first: from then on no page of it is checksummed from the
        blocks (the envelope of any not yet written never verifies)."""
        if not save.tainted:
            save.guard.trip()
            save.tainted = True
            self.counters.add("save_tainted_pages", len(save.names))
            log.warning(
                "kvtier: a store of %d pages of preempted request %s is still running; "
                "vLLM reuses its blocks now, so no page of it is published as valid from "
                "them and the pages are deleted once it returns",
                len(save.names),
                save.op.req_id,
            )

    def finished(self, finished_req_ids: Iterable[str], wait_s: float = 0.0) -> set[str]:
        """Of the finished requests with stores, those whose stores are all done; waits
        ``wait_s`` at most for one to be done when none is yet.

        The connector passes a wait only in a step without a forward, when the engine has
        nothing left but to wait for these stores: it would otherwise spin through empty
        steps, each taking the interpreter lock from the writer whose work it waits for.
        """
        with self._cv:
            self._finishing.update(set(finished_req_ids) & self._saving)
            done = self._stores_done()
            if not done and self._finishing and wait_s > 0:
                deadline = time.monotonic() + wait_s
                while not done and (left := deadline - time.monotonic()) > 0:
                    self._cv.wait(left)
                    done = self._stores_done()
            for req_id in done:
                self._finishing.discard(req_id)
                self._saving.discard(req_id)
                self._pending.pop(req_id, None)
        return done

    def _stores_done(self) -> set[str]:
        """The finishing requests with no store queued or running. Called with ``_cv``."""
        return {r for r in self._finishing if self._pending.get(r, 0) == 0}

    # --- housekeeping -------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Cumulative counters: the worker's and the page store's (``store_*``)."""
        stats: dict[str, Any] = zeroed("vllm_worker")
        stats.update(self.counters.snapshot())
        if self.store is not None:
            stats.update({f"store_{k}": v for k, v in self.store.stats().items()})
        return stats

    def prometheus_collector(self) -> Any:
        """A prometheus_client collector of this rank's storage chain (docs/operating.md)."""
        return store_collector(self._require_store(), identity_of(self.plan))

    def close(self) -> None:
        """Finish queued loads and stores (each bounded), then close the backend. Idempotent."""
        self._reader.shutdown(wait=True)
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.join(self._wait_s)
        self.stop_watching()
        store, self.store = self.store, None
        if store is not None:
            store.close()
