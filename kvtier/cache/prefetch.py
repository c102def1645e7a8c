"""Prefetch: find the longest cached prefix (host, then storage) and read it on the workers.

Host hits are pinned at once; the storage part is found with one batched ``exists`` and
read in batches by the fetch job, each a bounded page-store get. Keys are chained, so a
missing or corrupt page ends the prefix: the pages after it are given back unread.

The storage part is also pinned in the storage chain (before its ``exists``, until the
handle is released): no tier evicts a page a running load found there, not even to make
room for a promotion.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial

from kvtier.cache.context import CacheContext
from kvtier.cache.handles import PrefetchHandle
from kvtier.cache.index import Entry
from kvtier.cache.workers import Job
from kvtier.cache.writes import StorageWriter
from kvtier.core.bounded import Outcome
from kvtier.core.keys import validate_key
from kvtier.core.metrics import Cause

__all__ = ["Prefetcher"]


class Prefetcher:
    """Starts prefetches and runs their fetch jobs on the read workers."""

    def __init__(self, ctx: CacheContext, writer: StorageWriter) -> None:
        self.ctx = ctx
        self.writer = writer

    def start(self, keys: Sequence[str]) -> PrefetchHandle:
        """Pin the host prefix of ``keys``, place the storage prefix, queue its reads."""
        ctx = self.ctx
        started = time.monotonic()
        keys = list(keys)
        for key in keys:
            if not isinstance(key, str):
                validate_key(key)  # raises InvalidKeyError naming the bad key
        # The charset is checked where a bad key could do harm: the index only holds keys
        # that backup validated, and page_store.exists validates every key it is asked
        # about (raising InvalidKeyError here, in the caller, pins given back first).
        host = ctx.index.acquire_prefix(keys)
        self.writer.pages_hit(host)
        entries = list(host)
        fresh: list[Entry] = []
        rest = keys[len(host) :]
        pins = ctx.page_store.pins
        if rest:
            pins.pin(rest)  # before the lookup: nothing it finds may leave before it is read
            try:
                placed = self._place_stored(rest, host)
            except BaseException:
                pins.unpin(rest)
                raise
            entries += [entry for entry, _ in placed]
            fresh = [entry for entry, new in placed if new]
            pinned = {entry.key for entry in fresh}
            pins.unpin([key for key in rest if key not in pinned])
        stored = [entry.key for entry in fresh]
        from_host = len(entries) - len(fresh)
        ctx.stats.add("host_hits", from_host)
        ctx.stats.add("host_misses", len(keys) - from_host)
        ctx.stats.add("storage_hits", len(fresh))
        ctx.stats.add("storage_misses", len(keys) - len(entries))
        handle = PrefetchHandle(
            ctx.index,
            ctx.options,
            keys,
            entries,
            from_host,
            started,
            on_release=(lambda: pins.unpin(stored)) if stored else None,
        )
        if not fresh:
            handle.finished.set()
            ctx.stats.latency["prefetch"].observe(time.monotonic() - started)
            return handle
        job = Job(
            lambda: self._fetch(handle, fresh),
            lambda: self._abandon(handle, fresh),
        )
        if not ctx.reads.submit(job):
            if not ctx.closed:
                ctx.fail(Cause.QUEUE_FULL, len(fresh), "the read queue is full")
            self._abandon(handle, fresh)
        return handle

    def _place_stored(self, rest: list[str], host: list[Entry]) -> list[tuple[Entry, bool]]:
        """Host entries for the leading keys of ``rest`` found in storage (or on the host)."""
        ctx = self.ctx
        # Walk host and storage together: write_back keeps the newest pages of a
        # prefix only on the host while older ones were evicted to storage.
        try:
            in_storage = ctx.page_store.exists(rest)
        except BaseException:
            ctx.index.release(host)
            raise
        if in_storage.outcome is not Outcome.OK:
            ctx.call_failed(in_storage.outcome, "exists", len(rest))
        found = 0
        for key, stored in zip(rest, in_storage, strict=True):
            if not (stored or ctx.index.contains(key)):
                break
            found += 1
        if not found:
            return []
        placed = ctx.index.insert(
            rest[:found],
            pins=2,
            pin_existing=True,
            wait_s=ctx.options.alloc_wait_s,
            wait_on_pins=False,  # the caller's thread waits for write-backs only
            on_victims=self.writer.write_victims,
        )
        if len(placed) < found:
            ctx.fail_exhausted(found - len(placed))
        return placed

    # --- on a read worker -----------------------------------------------------------------

    def _fetch(self, handle: PrefetchHandle, entries: list[Entry]) -> None:
        ctx = self.ctx
        stats, index = ctx.stats, ctx.index
        batch = ctx.options.batch_pages
        done = 0
        failed = False
        try:
            while done < len(entries):
                if handle.cancelled or ctx.stopping():
                    break
                chunk = entries[done : done + batch]
                t0 = time.monotonic()
                results = ctx.page_store.get(
                    [e.key for e in chunk],
                    [e.page for e in chunk],
                    on_late=partial(self._late_get, chunk),
                )
                outcome = results.outcome
                if outcome is not Outcome.OK:
                    failed = True
                    ctx.call_failed(outcome, "get", len(entries) - done)
                    if outcome is Outcome.TIMED_OUT:
                        # Readers see the failure now; the pages stay pinned until the
                        # call returns (the backend may still write into them).
                        stats.add("pages_quarantined", len(chunk))
                        index.mark_failed(chunk)
                        done += len(chunk)
                    break
                elapsed = time.monotonic() - t0
                good = 0
                while good < len(chunk) and results[good]:
                    good += 1
                stats.latency["storage_get"].observe(elapsed)
                stats.busy("storage_read", elapsed, good * ctx.geometry.bytes_per_page)
                stats.add("storage_pages_read", good)
                stats.add("pages_prefetched", good)
                index.mark_ready(chunk[:good], stored=True)
                index.release(chunk[:good])
                done += good
                if good < len(chunk):
                    ctx.fail(Cause.STORAGE_GET, 1, "a page was missing or failed verification")
                    break  # keys are chained: pages after a hole are of no use to this prefix
        finally:
            rest = entries[done:]
            if rest:
                self._abandon(handle, rest)
            else:
                handle.finished.set()
                if not failed:
                    stats.latency["prefetch"].observe(time.monotonic() - handle.started)

    def _late_get(self, chunk: list[Entry], _results: object) -> None:
        """A timed-out get returned at last: its pages may now be reused."""
        self.ctx.index.release(chunk)

    def _abandon(self, handle: PrefetchHandle, entries: list[Entry]) -> None:
        """Drop pages a fetch will not read (cancelled, closed, or after a failed page)."""
        self.ctx.stats.add("pages_cancelled", len(entries))
        self.ctx.index.mark_failed(entries)
        self.ctx.index.release(entries)
        handle.finished.set()
