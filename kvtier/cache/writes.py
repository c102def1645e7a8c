"""Write policies and the storage write path: which host pages reach storage, and when.

``write_through`` writes a page once it is whole in the host pool, ``write_through_selective``
once it was hit ``write_threshold`` times, ``write_back`` when the host pool evicts it (and
at close). Writes run on the write workers in batches, each one bounded page-store put,
which tells the storage tiers' policies each page's parent (:attr:`Entry.parent`: the key
before it in its backup call, whose keys are one sequence's consecutive pages), whatever
pages a batch gathers (write-back victims, say).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial

from kvtier.cache.context import CacheContext
from kvtier.cache.handles import BackupHandle
from kvtier.cache.index import Entry
from kvtier.cache.workers import Job
from kvtier.core.bounded import Outcome
from kvtier.core.metrics import Cause
from kvtier.core.pagestore import BatchResult

__all__ = ["StorageWriter"]


class StorageWriter:
    """Applies the write policy and writes claimed host pages to storage."""

    def __init__(self, ctx: CacheContext) -> None:
        self.ctx = ctx

    # --- the policies ---------------------------------------------------------------------

    def pages_ready(self, handle: BackupHandle | None, entries: list[Entry]) -> None:
        """Pages now whole in the host pool: make them ready, write them as the policy says."""
        if not entries:
            return
        ctx = self.ctx
        ctx.index.mark_ready(entries)
        ctx.stats.add("pages_backed_up", len(entries))
        policy = ctx.options.write_policy
        if not ctx.writes_storage:
            ctx.stats.add("storage_writes_skipped", len(entries))
        elif policy == "write_through":
            claimed = ctx.index.claim_writes(entries)
            if claimed:
                if handle is not None:
                    handle.write_started()
                self.submit(claimed, handle)
        elif policy == "write_back":
            ctx.index.mark_dirty(entries)
        ctx.index.release(entries)

    def pages_hit(self, entries: Sequence[Entry]) -> None:
        """``write_through_selective``: write the hit pages that reached the threshold."""
        opts = self.ctx.options
        if not (self.ctx.writes_storage and opts.write_policy == "write_through_selective"):
            return
        hot = [e for e in entries if e.hits >= opts.write_threshold]
        claimed = self.ctx.index.claim_writes(hot)
        if claimed:
            self.submit(claimed, None)

    def write_victims(self, victims: list[Entry]) -> None:
        """``write_back``: dirty pages the host index evicts go to storage first."""
        if victims:
            self.ctx.stats.add("storage_write_backs", len(victims))
            self.submit(victims, None)

    def flush_dirty(self) -> None:
        """``write_back`` at close: queue every dirty page for writing."""
        ctx = self.ctx
        if ctx.options.write_policy == "write_back" and ctx.writes_storage:
            dirty = ctx.index.claim_dirty()
            if dirty:
                ctx.stats.add("storage_write_backs", len(dirty))
                self.submit(dirty, None)

    # --- the write path -------------------------------------------------------------------

    def submit(self, entries: list[Entry], handle: BackupHandle | None) -> None:
        """Queue a claimed write; when the queue is full, write here rather than drop it."""
        job = Job(
            lambda: self._run(entries, handle),
            lambda: self._cancel(entries, handle),
        )
        if not self.ctx.writes.submit(job):
            self.ctx.stats.add("storage_writes_inline", len(entries))
            self._run(entries, handle)

    def _run(self, entries: list[Entry], handle: BackupHandle | None) -> None:
        ctx = self.ctx
        stats, index = ctx.stats, ctx.index
        batch = ctx.options.batch_pages
        chunk: list[Entry] = []
        owed, written = len(entries), 0
        try:
            while entries:
                if ctx.stopping():
                    stats.add("storage_writes_cancelled", len(entries))
                    break
                chunk, entries = entries[:batch], entries[batch:]
                t0 = time.monotonic()
                try:
                    results = ctx.page_store.put(
                        [e.key for e in chunk],
                        [e.page for e in chunk],
                        on_late=partial(self._late_put, chunk),
                        parents=[e.parent for e in chunk],
                    )
                    outcome = results.outcome
                except Exception as exc:  # bad keys cannot get here; stay safe anyway
                    outcome, results = Outcome.OK, BatchResult([False] * len(chunk))
                    ctx.fail(Cause.STORAGE_PUT, 0, repr(exc))
                if outcome is not Outcome.OK:
                    ctx.call_failed(outcome, "put", len(chunk) + len(entries))
                    if outcome is Outcome.TIMED_OUT:
                        stats.add("pages_quarantined", len(chunk))
                        chunk = []  # still being read by the call: _late_put gives it back
                    break
                elapsed = time.monotonic() - t0
                ok = sum(results)
                stats.latency["storage_put"].observe(elapsed)
                stats.busy("storage_write", elapsed, ok * ctx.geometry.bytes_per_page)
                stats.add("storage_pages_written", ok)
                if ok < len(chunk):
                    ctx.fail(Cause.STORAGE_PUT, len(chunk) - ok, "the backend refused the page")
                written += ok
                index.finish_write(chunk, results)
                chunk = []
        finally:
            entries = chunk + entries
            if entries:  # an unexpected error mid-way: give the rest back unwritten
                index.finish_write(entries, [False] * len(entries))
            if handle is not None:
                handle.write_ended(written, owed - written)

    def _late_put(self, chunk: list[Entry], results: object) -> None:
        """A timed-out put returned at last: record what it stored, unpin its pages."""
        ok = results if isinstance(results, list) and len(results) == len(chunk) else None
        self.ctx.index.finish_write(chunk, ok or [False] * len(chunk))

    def _cancel(self, entries: list[Entry], handle: BackupHandle | None) -> None:
        self.ctx.stats.add("storage_writes_cancelled", len(entries))
        self.ctx.index.finish_write(entries, [False] * len(entries))
        if handle is not None:
            handle.write_ended(0, len(entries))
