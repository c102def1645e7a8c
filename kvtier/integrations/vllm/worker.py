"""The worker side of kvtier's vLLM connector: pages in and out of vLLM's KV blocks.

:class:`WorkerSide` opens the plan's page store over vLLM's KV tensors (:mod:`.blocks`),
reads a step's loads on a reader thread straight into the blocks, stores a step's new
full blocks on a writer thread, and keeps what the scheduler must learn: the pages stored,
the pages that failed to load (their blocks go back to vLLM to recompute, and the bad
page is deleted so the recomputed one takes its place) and which finished requests no
longer need their blocks. It imports nothing from vLLM.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvtier.cache.metrics import identity_of, store_collector
from kvtier.core.capabilities import ResolvedPlan, open_page_store
from kvtier.core.errors import KvtierError
from kvtier.core.metrics import zeroed
from kvtier.core.pagestore import PageStore
from kvtier.integrations.vllm.blocks import VLLMBlocks, order_layers
from kvtier.integrations.vllm.messages import PageOp
from kvtier.integrations.vllm.rank import RankWorker, no_pages_yet
from kvtier.integrations.vllm.settings import VLLMSection

__all__ = ["WorkerSide"]

log = logging.getLogger("kvtier.vllm")


class WorkerSide(RankWorker):
    """Loads and stores of one vLLM worker (one tensor-parallel rank)."""

    def __init__(self, plan: ResolvedPlan, settings: VLLMSection) -> None:
        super().__init__(plan, settings)
        self.store: PageStore | None = None
        self.pages: VLLMBlocks | None = None
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kvtier-vllm-load")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvtier-vllm-save")
        self._loading: list[tuple[list[PageOp], Future[list[bool]]]] = []
        self._pending: dict[str, int] = {}

    def register(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        layer_index: dict[str, int],
        num_blocks: int,
    ) -> None:
        """Take vLLM's KV tensors as kvtier pages and open the store over them."""
        pages = VLLMBlocks(
            order_layers(kv_caches, layer_index),
            num_blocks=num_blocks,
            geometry=self.plan.geometry,
            layout=self.plan.layout,
        )
        pages.extents(0)  # the memory matches the geometry: checked now, not later
        self.pages = pages
        self.store = open_page_store(self.plan, pages, **self.settings.page_store_options())

    def _require_store(self) -> PageStore:
        if self.store is None:
            raise no_pages_yet()
        return self.store

    def _page_store(self) -> PageStore:
        return self._require_store()

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
        names = [name for op in loads for name in self.names(op.keys)]
        blocks = [block for op in loads for block in op.blocks]
        self._loading.append((list(loads), self._reader.submit(self._read, names, blocks)))

    def _read(self, names: list[str], blocks: list[int]) -> list[bool]:
        store, pages = self._require_store(), self.pages
        first: dict[str, int] = {}
        for i, name in enumerate(names):
            first.setdefault(name, i)
        unique = list(first.values())
        found = store.get([names[i] for i in unique], [blocks[i] for i in unique])
        ok = dict(zip(first, found, strict=True))
        copies = [(first[n], i) for i, n in enumerate(names) if first[n] != i and ok[n]]
        if copies and pages is not None:
            for source, target in copies:
                pages.copy_block(blocks[source], blocks[target])
            self.counters.add("load_copied_pages", len(copies))
        return [ok[name] for name in names]

    @property
    def loading(self) -> bool:
        return bool(self._loading)

    def finish_loads(self) -> None:
        """Wait for the loads in flight; record the blocks whose page did not load."""
        loading, self._loading = self._loading, []
        for ops, future in loading:
            count = sum(len(op.keys) for op in ops)
            try:
                results = future.result()
            except KvtierError as exc:  # bad keys or pages; backend errors are False
                log.warning("kvtier: a load raised %s; its %d pages recompute", exc, count)
                results = [False] * count
            self.counters.add("load_pages", count)
            self.counters.add("load_hit_pages", sum(results))
            start = 0
            for op in ops:
                mine = results[start : start + len(op.keys)]
                start += len(op.keys)
                bad = [i for i, good in enumerate(mine) if not good]
                if bad:
                    self._failed(op, bad)

    # --- stores -------------------------------------------------------------------------

    def submit_saves(self, saves: Sequence[PageOp]) -> None:
        """Queue pages for storage; the writer thread runs while the model computes."""
        if not saves:
            return
        store = self._require_store()
        for op in saves:
            with self._lock:
                self._pending[op.req_id] = self._pending.get(op.req_id, 0) + 1
                self._saving.add(op.req_id)
            future = self._writer.submit(store.put, self.names(op.keys), op.blocks)
            future.add_done_callback(functools.partial(self._saved, op))

    def _saved(self, op: PageOp, future: Future[list[bool]]) -> None:
        try:
            results = future.result()
        except KvtierError as exc:  # bad keys or pages; backend errors are False
            log.warning("kvtier: a store raised %s; its %d pages are not kept", exc, len(op.keys))
            results = [False] * len(op.keys)
        stored = sum(results)
        with self._lock:
            self._pending[op.req_id] -= 1
            for key, ok in zip(op.keys, results, strict=True):
                if ok:
                    self._report.stored[key] = self._report.stored.get(key, 0) + 1
        self.counters.add("save_pages", len(results))
        self.counters.add("save_stored_pages", stored)
        self.counters.add("save_failed_pages", len(results) - stored)

    def flush(self) -> None:
        """Wait until every queued store has run (one writer: first in, first out)."""
        self._writer.submit(lambda: None).result()

    def preempted(self, req_ids: Iterable[str]) -> None:
        """Finish the stores of preempted requests before vLLM reuses their blocks."""
        with self._lock:
            busy = any(self._pending.get(req_id, 0) for req_id in req_ids)
        if busy:
            self.flush()

    def finished(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Of the finished requests with stores, those whose stores are all done."""
        with self._lock:
            self._finishing.update(set(finished_req_ids) & self._saving)
            done = {r for r in self._finishing if self._pending.get(r, 0) == 0}
            for req_id in done:
                self._finishing.discard(req_id)
                self._saving.discard(req_id)
                self._pending.pop(req_id, None)
        return done

    # --- housekeeping -------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Cumulative counters: the worker's and the page store's (``store_*``)."""
        stats: dict[str, Any] = zeroed("vllm_worker")
        stats.update(self.counters.snapshot())
        if self.store is not None:
            stats.update({f"store_{k}": v for k, v in self.store.stats().items()})
        return stats

    def prometheus_collector(self) -> Any:
        """A prometheus_client collector of this rank's page store (docs/operating.md)."""
        return store_collector(self._require_store(), identity_of(self.plan))

    def close(self) -> None:
        """Finish queued loads and stores, then close the backend. Idempotent."""
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        store, self.store = self.store, None
        if store is not None:
            store.close()
