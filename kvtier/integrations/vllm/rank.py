"""What both worker strategies of the vLLM connector keep for one tensor-parallel rank.

The CPU strategy (:mod:`.worker`, pages in place in vLLM's blocks) and the accelerator
strategy (:mod:`.device_worker`, a TieredCache over vLLM's device tensors) differ in how
pages move, not in what they tell vLLM and the scheduler: this rank's storage keys, the
blocks whose page was missing or invalid (vLLM recomputes them), the report of stored
and failed pages, and the events of its storage chain (what each tier stored, promoted,
evicted or removed), which the scheduler learns from. That bookkeeping lives here once.
A page is deleted from storage only where it is proven bad (its envelope failed
verification), never for a miss, a timeout or an error: on a shared store a delete
removes it for every engine. Nothing here imports vLLM.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from kvtier.core.capabilities import ResolvedPlan
from kvtier.core.envelope import Rejection
from kvtier.core.errors import StorageError
from kvtier.core.metrics import registered_counters
from kvtier.integrations.kv_events import TierEventFeed
from kvtier.integrations.vllm.messages import PageOp, Report
from kvtier.integrations.vllm.settings import DOCS, VLLMSection
from kvtier.storage.events import EventStream

__all__ = ["NOT_PROOF", "Deleter", "RankWorker", "no_pages_yet", "proves_bad"]

log = logging.getLogger("kvtier.vllm")

#: Envelope verdicts that do not prove a stored page bad: a page of a newer format
#: version or checksum (another engine on a shared store may run a newer kvtier).
NOT_PROOF = frozenset({Rejection.UNSUPPORTED_VERSION.value, Rejection.UNKNOWN_CHECKSUM.value})


class Deleter(Protocol):
    """What a rank deletes pages through: its page store (or a cache's storage chain)."""

    def delete(self, keys: Sequence[str]) -> Sequence[bool]: ...


def proves_bad(reason: str | None) -> bool:
    """Whether an envelope verdict proves the stored page bad (so it may be deleted)."""
    return reason is not None and reason not in NOT_PROOF


def no_pages_yet() -> StorageError:
    """The error for a step that comes before vLLM handed over its KV caches."""
    return StorageError(
        "the kvtier connector has no KV pages: vLLM calls register_kv_caches() at "
        f"start-up, before any step ({DOCS})",
        value=None,
    )


class RankWorker(ABC):
    """Keys, counters, load errors and the scheduler's report of one worker rank."""

    def __init__(self, plan: ResolvedPlan, settings: VLLMSection, *, groups: int = 1) -> None:
        self.plan = plan
        self.settings = settings
        #: This rank's key suffix (``_r<rank>of<size>`` under tensor parallelism).
        self.suffix = plan.rank_suffix
        #: KV cache groups: with more than one, vLLM takes failed loads per request only.
        self.groups = groups
        #: This rank's counters: the ``vllm_worker`` ones of kvtier's registry only.
        self.counters = registered_counters("vllm_worker")
        self._lock = threading.Lock()
        self._load_errors: set[int] = set()
        self._saving: set[str] = set()
        self._finishing: set[str] = set()
        self._report = Report()
        self._feed: TierEventFeed | None = None

    def watch(self, events: EventStream) -> None:
        """Report the events of this rank's storage chain (``events``) from now on, as
        base keys; at most ``events_buffer`` wait between two reports."""
        suffix = self.suffix

        def base_key(name: str) -> str | None:
            if not suffix:
                return name
            return name[: -len(suffix)] if name.endswith(suffix) else None

        self._feed = TierEventFeed(
            events,
            base_key,
            capacity=self.settings.events_buffer,
            counters=self.counters,
            dropped_counter="tier_events_dropped",
        )

    def stop_watching(self) -> None:
        """Stop receiving the chain's events (idempotent)."""
        feed, self._feed = self._feed, None
        if feed is not None:
            feed.close()

    def names(self, keys: Iterable[str]) -> list[str]:
        """This rank's storage keys for base keys."""
        return [key + self.suffix for key in keys]

    def _base_keys(self, names: Iterable[str]) -> list[str]:
        """The base keys of this rank's storage keys."""
        cut = len(self.suffix)
        return [name[:-cut] if cut else name for name in names]

    @abstractmethod
    def _page_store(self) -> Deleter:
        """The store this rank's pages are verified and deleted through."""

    @abstractmethod
    def prometheus_collector(self) -> Any:
        """A prometheus_client collector of this rank's storage tier (``kvtier_*``)."""

    @property
    @abstractmethod
    def loading(self) -> bool:
        """Whether loads were started that :meth:`finish_loads` has not settled."""

    @abstractmethod
    def finish_loads(self) -> None:
        """Wait for the started loads and record which pages failed."""

    def _failed(self, op: PageOp, bad: list[int]) -> None:
        """Record pages ``bad`` of ``op`` as failed, for vLLM and the scheduler.

        Their blocks go back to vLLM (by block where it takes them: one KV cache group);
        the scheduler distrusts the pages until stored again and re-plans the request's
        stores from the first of them. Nothing is deleted here (see :func:`proves_bad`).
        """
        self.counters.add("load_failed_pages", len(bad))
        failed = [op.keys[i] for i in bad]
        with self._lock:
            if self.groups == 1:
                self._load_errors.update(op.blocks[i] for i in bad)
            for key in failed:
                self._report.failed[key] = self._report.failed.get(key, 0) + 1
            first = op.first + bad[0]
            self._report.failed_from[op.req_id] = min(
                first, self._report.failed_from.get(op.req_id, first)
            )
        log.info(
            "kvtier: %d of %d pages of request %s were missing or invalid; vLLM recomputes them",
            len(bad),
            len(op.keys),
            op.req_id,
        )

    def take_load_errors(self) -> set[int]:
        """vLLM blocks whose page was missing or failed verification (finishes loads)."""
        if self.loading:
            self.finish_loads()
        return self.pop_load_errors()

    def pop_load_errors(self) -> set[int]:
        """The load errors recorded so far, without waiting for loads in flight."""
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def take_report(self) -> Report:
        """What this rank stored and failed to load since the last call, and its storage
        chain's events since then (in the order the chain emitted them)."""
        with self._lock:
            report, self._report = self._report, Report()
        if self._feed is not None:
            rank = int(self.plan.context.tp_rank)
            report.events = [(rank, held, tier, key) for held, tier, key in self._feed.take()]
        return report
