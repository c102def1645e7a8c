"""Backup: device pages into the host pool on the transfer worker, then to the write policy.

A per-layer backup (layer-sharded pools) copies one layer per call; a page is assembled
here until its last layer has arrived, stays pinned meanwhile, and only then becomes
ready and goes to the write policy. Pages whose layers never all arrive are dropped at
close.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvtier.cache.context import CacheContext
from kvtier.cache.handles import BackupHandle
from kvtier.cache.index import Entry
from kvtier.cache.workers import Job
from kvtier.cache.writes import StorageWriter
from kvtier.core.errors import CacheClosedError, KvtierError
from kvtier.core.metrics import Cause
from kvtier.core.streams import Fence
from kvtier.storage.parents import batch_parents

__all__ = ["Backups"]


@dataclass(eq=False, slots=True)
class _Layered:
    """A page being backed up layer by layer: its entry and the layers copied so far."""

    entry: Entry
    layers: set[int] = field(default_factory=set)


class Backups:
    """Runs backups (all layers, or one) and assembles per-layer ones into whole pages."""

    def __init__(self, ctx: CacheContext, writer: StorageWriter) -> None:
        self.ctx = ctx
        self.writer = writer
        #: pages of per-layer backups still waiting for layers; the transfer worker's alone
        self._layered: dict[str, _Layered] = {}

    def start(
        self, keys: list[str], slots: torch.Tensor, layer: int | None, after: Fence
    ) -> BackupHandle:
        """Queue the backup of checked ``keys`` from checked, private ``slots``, to be
        copied once ``after`` (the caller's stream when it asked) has passed."""
        handle = BackupHandle(keys)
        if not keys:
            handle.finish()
            return handle
        started = time.monotonic()
        job = Job(
            lambda: self._run(handle, keys, slots, started, layer, after),
            lambda: self._cancel(handle, len(keys)),
        )
        ctx = self.ctx
        if not ctx.transfer.submit(job):
            if ctx.closed:
                self._cancel(handle, len(keys))
            else:
                ctx.fail(Cause.QUEUE_FULL, len(keys), "the transfer queue is full")
                handle.record_failure(len(keys), _busy("transfer", ctx.options.queue_size))
                handle.finish()
        return handle

    def drop_layered(self) -> None:
        """Give up the pages whose layers never all arrived (at close, workers ended)."""
        entries = [state.entry for state in self._layered.values()]
        self._layered.clear()
        if entries:
            self.ctx.stats.add("pages_cancelled", len(entries))
            self.ctx.index.mark_failed(entries)
            self.ctx.index.release(entries)

    # --- on the transfer worker -----------------------------------------------------------

    def _run(
        self,
        handle: BackupHandle,
        keys: list[str],
        slots: torch.Tensor,
        started: float,
        layer: int | None,
        after: Fence,
    ) -> None:
        try:
            self._copy(handle, keys, slots, layer, after)
        except BaseException as exc:
            if not handle.host_done.is_set():
                handle.record_failure(len(keys) - handle.pages_copied - handle.pages_cached, exc)
                handle.host_ended()
            raise
        self.ctx.stats.latency["backup"].observe(time.monotonic() - started)
        handle.host_ended()

    def _place(
        self, handle: BackupHandle, keys: list[str], parents: list[str | None]
    ) -> list[tuple[Entry, bool]]:
        """Host entries for ``keys`` (new ones pinned once, with their ``parents``); a
        shortfall fails the rest."""
        ctx = self.ctx
        placed = ctx.index.insert(
            keys,
            pins=1,
            wait_s=ctx.options.alloc_wait_s,
            on_victims=self.writer.write_victims,
            parents=parents,
        )
        if len(placed) < len(keys):
            missing = len(keys) - len(placed)
            handle.record_failure(missing, ctx.fail_exhausted(missing))
        return placed

    def _layer_targets(
        self, handle: BackupHandle, keys: list[str]
    ) -> tuple[list[tuple[int, Entry]], list[Entry]]:
        """A per-layer backup's (position, entry) to copy into, and the pages already cached.

        Keys seen for the first time get a pending entry that waits for all layers.
        """
        parent_of = dict(zip(keys, batch_parents(keys), strict=True))
        fresh = [key for key in dict.fromkeys(keys) if key not in self._layered]
        parents = [parent_of[key] for key in fresh]
        existing: list[Entry] = []
        for entry, new in self._place(handle, fresh, parents) if fresh else []:
            if new:
                self._layered[entry.key] = _Layered(entry)
            else:
                existing.append(entry)
        layered = self._layered
        targets = [(i, layered[key].entry) for i, key in enumerate(keys) if key in layered]
        return targets, existing

    def _copy(
        self,
        handle: BackupHandle,
        keys: list[str],
        slots: torch.Tensor,
        layer: int | None,
        after: Fence,
    ) -> None:
        """Place the pages, copy the new ones batch by batch, hand whole pages on.

        On a CUDA pool each batch is queued on the save stream after ``after``, and this
        worker (never the model's thread) waits for it before the pages go on."""
        ctx = self.ctx
        ps = ctx.geometry.page_size
        if layer is None:
            placed = self._place(handle, keys, batch_parents(keys))
            targets = [(i, entry) for i, (entry, new) in enumerate(placed) if new]
            existing = [entry for entry, new in placed if not new]
        else:
            targets, existing = self._layer_targets(handle, keys)
        handle.pages_cached = len(existing)
        ctx.stats.add("pages_backup_already_cached", len(existing))
        batch_pages = ctx.options.batch_pages
        # Copy in batches, so write_through's storage writes of one batch overlap with
        # the device -> host copy of the next.
        for start in range(0, len(targets), batch_pages):
            batch = targets[start : start + batch_pages]
            entries = [entry for _, entry in batch]
            first, last = batch[0][0], batch[-1][0]
            if last - first + 1 == len(batch):
                source = slots[first * ps : (last + 1) * ps]
            else:  # only the pages not cached yet: their slots, page by page
                positions = torch.tensor([i for i, _ in batch], dtype=torch.int64)
                source = slots.view(-1, ps)[positions].reshape(-1)
            t0 = time.monotonic()
            try:
                copied = ctx.io_backend.backup(
                    ctx.device_pool,
                    ctx.host_pool,
                    source,
                    [e.page for e in entries],
                    layer=layer,
                    checked=True,  # the facade checked the slots and the layer
                    stream=ctx.save_stream,
                    after=after,
                )
                if isinstance(copied, Fence):  # a plugin's own backup() may return None
                    copied.synchronize()
            except Exception as exc:
                rest = list(dict.fromkeys(entry for _, entry in targets[start:]))
                for entry in rest:
                    self._layered.pop(entry.key, None)
                ctx.index.mark_failed(rest)
                ctx.index.release(rest)
                ctx.fail(Cause.DEVICE_TO_HOST, len(rest), repr(exc))
                handle.record_failure(len(rest), exc)
                break
            elapsed = time.monotonic() - t0
            ctx.stats.latency["device_to_host"].observe(elapsed)
            ctx.stats.busy("device_to_host", elapsed, ctx.bytes_moved(len(entries), layer))
            handle.pages_copied += len(entries)
            if layer is not None:
                entries = self._layers_arrived(entries, layer)
            self.writer.pages_ready(handle, entries)
        self.writer.pages_hit(existing)

    def _layers_arrived(self, entries: list[Entry], layer: int) -> list[Entry]:
        """Record ``layer`` for each entry; return those that now hold every layer."""
        complete = []
        for entry in dict.fromkeys(entries):
            state = self._layered.get(entry.key)
            if state is None or state.entry is not entry:
                continue
            state.layers.add(layer)
            if len(state.layers) == self.ctx.geometry.num_layers:
                del self._layered[entry.key]
                complete.append(entry)
        return complete

    def _cancel(self, handle: BackupHandle, pages: int) -> None:
        if not handle.host_done.is_set():
            self.ctx.stats.add("pages_cancelled", pages)
            handle.record_failure(
                pages, CacheClosedError("the cache closed before this backup ran")
            )
        handle.finish()


def _busy(queue: str, size: int) -> KvtierError:
    return KvtierError(
        f"the {queue} queue is full ({size} operations); the operation was dropped. "
        "Raise CacheOptions.queue_size or back up less often",
        value=size,
    )
