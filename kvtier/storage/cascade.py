"""The chain's cascade: a bounded queue of jobs, the worker that writes them into lower
tiers (write-through and write-back) or upper ones (promotions), and the staging pages
they are written from.

The queue is bounded in pages: a slow or full tier drops pages (counted), it never blocks
the tier above. A job's keys stay fenced from the queue until it is over, so a delete or
taint meanwhile cancels them (counted ``cancelled``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.core.bounded import Outcome
from kvtier.core.extents import copy_extents
from kvtier.core.pagestore import PageStore
from kvtier.storage.events import EventKind
from kvtier.storage.fences import Ticket
from kvtier.storage.pins import count_in, count_out
from kvtier.storage.staging import LateGuard
from kvtier.storage.tiers import ChainParts, Tier

__all__ = ["DEFAULT_QUEUE_PAGES", "Cascade", "Job"]

log = logging.getLogger("kvtier.cache")

#: Pages the cascade queue holds before it drops (a slow lower tier never blocks).
DEFAULT_QUEUE_PAGES = 1024


@dataclass(eq=False)
class Job:
    """Pages to write into lower or upper tiers, from staging pages (or the tier above)."""

    keys: list[str]
    targets: list[int]  # tier indices, in order
    source: int  # tier the bytes came from (read back from it when ``staged`` is None)
    kind: EventKind  # STORED (a cascade or write-back) or PROMOTED
    staged: list[int] | None = None
    done: threading.Event | None = None  # a flush marker's, set when the worker reaches it
    #: Targets whose admission already said yes (a page offered again after hits).
    admitted: tuple[int, ...] = ()
    #: Pages the queue counts for this job, and the targets not written yet.
    queued: int = 0
    waiting: list[int] = field(default_factory=list)
    #: Its keys in the chain's fences, from the queue until it is over.
    ticket: Ticket | None = None
    #: Each key's real parent (the page before it in its sequence), for the target tiers'
    #: policies; None: the key before it in the job (one sequence's consecutive pages).
    parents: dict[str, str | None] | None = None

    def parents_of(self, keys: Sequence[str]) -> list[str | None] | None:
        """The parents of ``keys`` (some of the job's), or None where the job has none."""
        parents = self.parents
        return None if parents is None else [parents.get(key) for key in keys]


class Cascade:
    """The queue of jobs, its worker and the staging reads and writes it makes."""

    #: Writes a job's staged pages into one target tier (the chain's placement: through
    #: the tier's admission, quotas and room); set by the chain.
    write_staged: Callable[[Job, Tier, list[str], list[int]], list[str]]

    def __init__(self, parts: ChainParts, queue_pages: int) -> None:
        self.parts = parts
        #: Most pages the queue holds (beyond it, jobs are cut and counted drops).
        self.queue_pages = queue_pages
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._queued = 0
        self._queued_by_tier = [0] * len(parts.tiers)
        self._promoting: dict[str, int] = {}
        self._staging_stores: dict[int, PageStore] = {}
        self._worker: threading.Thread | None = None
        self._closed = False

    # --- what the chain asks -----------------------------------------------------------

    def depths(self) -> list[int]:
        """Per tier: the pages queued to be written into it."""
        with self.parts.lock:
            return list(self._queued_by_tier)

    def staging_stats(self, tier: Tier) -> dict[str, int | float]:
        """The counters of the cascade's reads and writes of ``tier`` (staging pages)."""
        store = self._staging_stores.get(tier.index)
        return store.stats() if store is not None else {}

    def pending(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key has a promotion queued or being written."""
        with self.parts.lock:
            promoting = self._promoting
            return [key in promoting for key in keys]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job queued before now was written, and the write-backs those
        jobs queued in turn (one round per tier); False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for _ in range(len(self.parts.tiers) + 1):
            with self.parts.lock:
                if self._worker is None or self._queued == 0:
                    return True
                if self._closed:  # the worker ended: what is left is never written
                    return False
            done = threading.Event()
            self._queue.put(Job([], [], -1, EventKind.STORED, staged=[], done=done))
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not done.wait(left):
                return False
        return True

    def close(self, timeout: float | None) -> bool:
        """Stop the worker after the queued jobs (within ``timeout``); False if it is
        still running."""
        with self.parts.lock:
            self._closed = True
            worker = self._worker
        if worker is not None:
            self._queue.put(None)
            worker.join(timeout if timeout is not None else 10.0)
        for store in self._staging_stores.values():
            store.close()
        return worker is None or not worker.is_alive()

    # --- staging --------------------------------------------------------------------------

    def staging_store(self, tier: Tier) -> PageStore:
        """``tier``'s page store over the staging pages (its own guards and counters)."""
        store = self._staging_stores.get(tier.index)
        if store is None:
            store = tier.store.sibling(self.parts.staging.pool)
            self._staging_stores[tier.index] = store
        return store

    def stage_from(self, tier: Tier, keys: list[str]) -> list[int | None]:
        """Read ``keys`` from ``tier`` into staging pages (None where none was free or the
        read failed). Pages of a read that timed out stay quarantined until it returns."""
        staging = self.parts.staging
        pages = staging.take(len(keys))
        out: list[int | None] = [None] * len(keys)
        if not pages:
            return out
        guard = LateGuard(staging, pages)
        read = self.staging_store(tier).get(keys[: len(pages)], pages, on_late=guard.returned)
        if read.outcome is Outcome.TIMED_OUT:
            tier.counters.add("quarantined_pages", guard.timed_out())
        unused = []
        for i, (page, ok) in enumerate(zip(pages, read, strict=True)):
            if ok:
                out[i] = page
            else:
                unused.append(page)
        staging.release(unused)
        return out

    def offer(
        self,
        keys: list[str],
        pages: list[int],
        positions: list[int],
        targets: list[int],
        source: int,
        kind: EventKind,
        ticket: Ticket,
        admitted: int | None = None,
        *,
        parents: Sequence[str | None] | None = None,
    ) -> None:
        """Copy the caller's pages at ``positions`` into staging and queue them for
        ``targets``; a full staging pool drops the rest (counted on the first target).
        ``ticket``: the read's, live, so a delete since the read cancels the job;
        ``parents``: the real parents of the pages at ``positions``, in that order."""
        parts = self.parts
        staged = parts.staging.take(len(positions))
        parts.drop(targets[0], len(positions) - len(staged))
        if not staged:
            return
        chosen = positions[: len(staged)]
        staging = parts.staging.pool
        for position, page in zip(chosen, staged, strict=True):
            copy_extents(parts.pool.page_buffers(pages[position]), staging.page_buffers(page))
        job = Job(
            [keys[i] for i in chosen],
            targets,
            source,
            kind,
            staged,
            admitted=() if admitted is None else (admitted,),
        )
        if parents is not None:
            job.parents = dict(zip(job.keys, parents, strict=False))
        self.submit(job, since=ticket)

    # --- the queue --------------------------------------------------------------------------

    def submit(self, job: Job, *, since: Ticket | None = None) -> int:
        """Queue a job for the worker; the pages beyond ``queue_pages`` are cut off and
        dropped (counted on its first target). Returns the pages queued.

        ``since``: the live ticket of what the job continues (the put, read or eviction
        its pages came from): a delete since then cancels the job's keys too."""
        parts = self.parts
        with parts.lock:
            take = 0 if self._closed else min(len(job.keys), self.queue_pages - self._queued)
            take = max(0, take)
            if take and self._worker is None:
                self._worker = threading.Thread(target=self._run, name="kvtier-chain", daemon=True)
                self._worker.start()
            if take:
                self._queued += take
                for target in job.targets:
                    self._queued_by_tier[target] += take
                if job.kind is EventKind.PROMOTED:
                    count_in(self._promoting, job.keys[:take])
        cut = len(job.keys) - take
        if cut:
            parts.drop(job.targets[0], cut)
            if job.staged:
                parts.staging.release(job.staged[take:])
        if take:
            job.keys = job.keys[:take]
            if job.staged is not None:
                job.staged = job.staged[:take]
            job.queued, job.waiting = take, list(job.targets)
            fences = parts.fences
            job.ticket = fences.enter(job.keys) if since is None else fences.carry(since, job.keys)
            self._queue.put(job)
        return take

    def write_now(self, job: Job) -> list[str]:
        """Write a job's staged pages in this thread, not queued (a reclaim's hand-down
        that staging cannot hold at once); its staging is free after. The caller holds
        and leaves its ``ticket``. Returns the keys settled in its first target (see
        ``write_staged``)."""
        try:
            return self._write(job)
        finally:
            if job.staged:
                self.parts.staging.release(job.staged)
                job.staged = []

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.done is not None:  # a flush marker: every job before it is written
                job.done.set()
                continue
            try:
                self._write(job)
            except Exception as exc:  # a bug must not stop the worker
                for target in job.waiting[:1]:  # its pages were not written there
                    self.parts.tiers[target].counters.add("failures", len(job.keys))
                log.warning("kvtier: the storage chain's worker failed a job: %r", exc)
            finally:
                self._finish(job)

    def _target_done(self, job: Job, target: int) -> None:
        with self.parts.lock:
            if target in job.waiting:
                job.waiting.remove(target)
                self._queued_by_tier[target] -= job.queued

    def _finish(self, job: Job) -> None:
        """The job left the queue: its pages no longer count, its staging is free."""
        parts = self.parts
        with parts.lock:
            for target in job.waiting:
                self._queued_by_tier[target] -= job.queued
            job.waiting = []
            self._queued -= job.queued
            if job.kind is EventKind.PROMOTED:
                count_out(self._promoting, job.keys)
        if job.staged:
            parts.staging.release(job.staged)  # a page a late call still uses stays held
            job.staged = []
        if job.ticket is not None:
            parts.fences.leave(job.ticket)
            job.ticket = None

    # --- the worker's writes -------------------------------------------------------------

    def _write(self, job: Job) -> list[str]:
        """Write one job's pages into its target tiers (from staging, or read back); the
        keys deleted or tainted since the job was queued are not written (``cancelled``).
        Returns the keys settled in the first target (see ``write_staged``)."""
        parts = self.parts
        keys, staged = job.keys, job.staged
        ticket = job.ticket
        if staged is None:
            revoked = parts.fences.revoked(ticket) if ticket is not None else set()
            if revoked and job.targets:
                parts.tiers[job.targets[0]].counters.add("cancelled", len(revoked))
                keys = [key for key in keys if key not in revoked]
            got = self.stage_from(parts.tiers[job.source], keys)
            read = [key for key, page in zip(keys, got, strict=True) if page is not None]
            staged = job.staged = [page for page in got if page is not None]
            if job.targets:
                parts.drop(job.targets[0], len(keys) - len(read))
            keys = read
        settled: list[str] | None = None
        for target in job.targets:  # (the staged copies are the worker's: nothing to pin)
            tier = parts.tiers[target]
            revoked = parts.fences.revoked(ticket, keys) if ticket is not None else set()
            if revoked:
                tier.counters.add("cancelled", len(revoked))
                kept = list(zip(keys, staged, strict=True))
                keys = [key for key, _ in kept if key not in revoked]
                staged = [page for key, page in kept if key not in revoked]
            done = self.write_staged(job, tier, keys, staged)
            if settled is None:
                settled = list(revoked) + done
            self._target_done(job, target)
        return settled or []
