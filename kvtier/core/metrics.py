"""kvtier's one metrics vocabulary: every counter any part counts, with what it means.

Each counter is declared here once, by the part that counts it: the page store (every
engine path has one), a TieredCache (its failures by :class:`Cause`), the storage chain's
tiers, the vLLM connector's scheduler and worker sides, the SGLang adapter. The
declaration carries everything else that names it: its Prometheus family (with its label
and help; :mod:`kvtier.core.families` declares the families that are no counter), and,
by who counts it, its name in vLLM's metrics (:data:`VLLM_PREFIXES`). A new metric is
added here, then counted (a part counts through :func:`registered_counters`, which
cannot count a name missing here); the Prometheus exposition (:mod:`kvtier.cache.metrics`),
vLLM's metrics, the engines' stats and ``docs/operating.md`` are generated from it.
Names are plain ``[a-z0-9_]``, one per quantity; a family (``invalid_<reason>``) is one
entry whose members carry a suffix from a fixed list.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from kvtier.core.envelope import Rejection
from kvtier.core.errors import KvtierError, UnknownNameError
from kvtier.core.families import (
    OTHER_FAMILIES,
    PAGES,
    STORAGE_METRICS,
    TIER_READ_BYTES,
    TIER_WRITTEN_BYTES,
    Family,
)
from kvtier.core.storage import Counters

__all__ = [
    "BACKEND_CALLS",
    "COUNTERS",
    "DIRECTIONS",
    "FAMILIES",
    "READ_AT",
    "VLLM_PREFIXES",
    "Cause",
    "CounterSpec",
    "Family",
    "causes_markdown",
    "counter_names",
    "counters_markdown",
    "families_markdown",
    "family",
    "registered_counters",
    "series",
    "storage_metrics_markdown",
    "vllm_metrics",
    "zeroed",
]


class Cause(str, enum.Enum):
    """Why a TieredCache failed pages (``stats()["failures"][cause]``)."""

    QUEUE_FULL = "queue_full"
    HOST_EXHAUSTED = "host_exhausted"
    DEVICE_TO_HOST = "device_to_host"
    HOST_TO_DEVICE = "host_to_device"
    STORAGE_GET = "storage_get"
    STORAGE_PUT = "storage_put"
    BACKEND_TIMEOUT = "backend_timeout"
    BACKEND_REFUSED = "backend_refused"
    BACKEND_CLOSE = "backend_close"
    TRANSFER_WORKER_ERROR = "transfer_worker_error"
    READ_WORKER_ERROR = "read_worker_error"
    WRITE_WORKER_ERROR = "write_worker_error"

    @property
    def meaning(self) -> str:
        """What failed, for docs and logs."""
        return _CAUSE_MEANING[self]


_CAUSE_MEANING = {
    Cause.QUEUE_FULL: "a work queue was full (`queue_size`)",
    Cause.HOST_EXHAUSTED: "every host page was pinned (`alloc_wait_s` passed)",
    Cause.DEVICE_TO_HOST: "the IO backend's copy to the host pool raised",
    Cause.HOST_TO_DEVICE: "the IO backend's copy to the device raised",
    Cause.STORAGE_GET: "a page read from storage was missing or failed verification",
    Cause.STORAGE_PUT: "the backend refused a page (full, server error)",
    Cause.BACKEND_TIMEOUT: "a backend call did not return within `backend_call_timeout_s`",
    Cause.BACKEND_REFUSED: "`max_abandoned_calls` calls were stuck, so the call was not made",
    Cause.BACKEND_CLOSE: "the backend's `close()` raised, timed out or was refused",
    Cause.TRANSFER_WORKER_ERROR: "a bug raised in the transfer worker (pages of that job)",
    Cause.READ_WORKER_ERROR: "a bug raised in a read worker",
    Cause.WRITE_WORKER_ERROR: "a bug raised in a write worker",
}

#: The backend calls a page store makes, each bounded and counted by name.
BACKEND_CALLS = ("exists", "get", "put", "delete", "clear", "stats", "close")


@dataclass(frozen=True)
class CounterSpec:
    """One counter: its name, who counts it, what it counts; ``suffixes`` for a family;
    its Prometheus ``family`` (None: exposed only through its engine's metrics).

    A family counts ``name_<suffix>`` for each of ``suffixes``, and ``name`` in total
    unless ``total`` is False. In a Prometheus family with a label, each member is the
    series of its suffix; a counter without suffixes is the series ``value``; in one
    without a label, the counter (a family's total) is its one series.
    """

    name: str
    counted_by: str
    meaning: str
    suffixes: tuple[str, ...] = ()
    total: bool = True
    family: Family | None = None
    value: str | None = None

    def names(self) -> list[str]:
        """The counter's name (a family's total), and each member's for a family."""
        members = [f"{self.name}_{suffix}" for suffix in self.suffixes]
        return [self.name, *members] if self.total or not self.suffixes else members

    def series(self) -> list[tuple[str, str | None]]:
        """(counter name, label value) of each series it is in its Prometheus family."""
        if self.family is None:
            return []
        if self.family.label is None:
            return [(self.name, None)]
        if self.suffixes:
            return [(f"{self.name}_{suffix}", suffix) for suffix in self.suffixes]
        return [(self.name, self.value)]


#: A counter as the registry below writes it: (name, meaning), with its family (and its
#: label value there) where it has one, or a whole :class:`CounterSpec`.
_Declared = tuple[str, str] | tuple[str, str, Family] | tuple[str, str, Family, str] | CounterSpec


def _counters(counted_by: str, specs: Iterable[_Declared]) -> list[CounterSpec]:
    out = []
    for spec in specs:
        if isinstance(spec, CounterSpec):
            out.append(spec)
            continue
        name, meaning, *exposed = spec
        family = exposed[0] if exposed else None
        value = exposed[1] if len(exposed) > 1 else None
        out.append(CounterSpec(name, counted_by, meaning, family=family, value=value))  # type: ignore[arg-type]
    return out


def _tier(name: str) -> Family:
    """A per-tier counter's own family (``kvtier_tier_<name>``, label ``tier``)."""
    return Family(f"kvtier_tier_{name}", label="tier")


_REASONS = tuple(reason.value for reason in Rejection)
#: The directions a TieredCache moves bytes in (``stats()["bytes"]``).
DIRECTIONS = ("device_to_host", "host_to_device", "storage_read", "storage_write")
_STORE = "page_store"
_CACHE = "tiered_cache"
_TIER = "storage_tier"
_CHAIN = "storage_chain"
_VLLM_SCHEDULER = "vllm_scheduler"
_VLLM_WORKER = "vllm_worker"
_SGLANG = "sglang"

#: Every counter, by who counts it (``page_store``, ``tiered_cache``, ``storage_tier``,
#: ``storage_chain``, ``vllm_scheduler``, ``vllm_worker``, ``sglang``); :data:`READ_AT`
#: says where each part's are read.
COUNTERS: Mapping[str, tuple[CounterSpec, ...]] = {
    _STORE: tuple(
        _counters(
            _STORE,
            [
                ("hits", "Pages read and verified.", _tier("hits")),
                (
                    "misses",
                    "Pages asked for and not read (absent, or the call failed).",
                    _tier("misses"),
                ),
                CounterSpec(
                    "invalid",
                    _STORE,
                    "Pages read that failed envelope verification (a counted miss), by reason.",
                    _REASONS,
                    family=Family(
                        "kvtier_page_rejections",
                        help="Stored pages that failed envelope verification and were "
                        "served as misses, by reason (listed below).",
                        label="reason",
                    ),
                ),
                ("puts", "Pages the backend stored.", _tier("puts")),
                (
                    "put_failures",
                    "Pages the backend did not store (refused, or the call failed).",
                    _tier("put_failures"),
                ),
                (
                    "put_tainted",
                    "Of the pages not stored, those whose save guard tripped before the put "
                    "returned (their memory was taken back, as a preempted vLLM request's "
                    "blocks): any written after the trip has an envelope that never verifies.",
                    _tier("put_tainted"),
                ),
                (
                    "bytes_read",
                    "Bytes of pages read and verified (a tier's entry: summed over its "
                    "page stores, the chain's reads to cascade and hand down included).",
                    TIER_READ_BYTES,
                ),
                (
                    "bytes_written",
                    "Bytes of pages stored (a tier's entry: summed over its page stores, "
                    "cascades, write-backs and promotions included).",
                    TIER_WRITTEN_BYTES,
                ),
                (
                    "prefix_queries",
                    "Prefix lookups (`prefix_hits`).",
                    Family("kvtier_prefix_queries"),
                ),
                (
                    "prefix_pages",
                    "Leading pages those lookups found stored.",
                    Family("kvtier_prefix_pages"),
                ),
                CounterSpec(
                    "backend_errors",
                    _STORE,
                    "Backend calls that raised or answered malformed (the batch failed), by "
                    "operation.",
                    BACKEND_CALLS,
                    family=Family("kvtier_backend_errors", label="operation"),
                ),
                CounterSpec(
                    "backend_timeouts",
                    _STORE,
                    "Backend calls that did not return within `backend_call_timeout_s` (the "
                    "batch failed; the call's thread is abandoned), by operation.",
                    BACKEND_CALLS,
                    family=Family("kvtier_backend_call_timeouts", label="operation"),
                ),
                CounterSpec(
                    "backend_refused",
                    _STORE,
                    "Backend calls failed at once because `max_abandoned_calls` calls were "
                    "stuck, by operation.",
                    BACKEND_CALLS,
                    family=Family(
                        "kvtier_backend_calls_refused",
                        help="Backend calls failed at once because `max_abandoned_calls` "
                        "calls were already stuck.",
                    ),
                ),
            ],
        )
    ),
    _CACHE: tuple(
        _counters(
            _CACHE,
            [
                (
                    "host_hits",
                    "Pages a prefetch found in the host pool.",
                    Family("kvtier_host_hits"),
                ),
                (
                    "host_misses",
                    "Pages a prefetch did not find in the host pool.",
                    Family("kvtier_host_misses"),
                ),
                (
                    "host_evictions",
                    "Host-pool pages evicted, least recently used first.",
                    Family("kvtier_host_evictions"),
                ),
                (
                    "storage_hits",
                    "Pages a prefetch found in storage (after missing the host pool).",
                    Family("kvtier_storage_hits"),
                ),
                (
                    "storage_misses",
                    "Pages a prefetch found in neither tier.",
                    Family("kvtier_storage_misses"),
                ),
                (
                    "storage_pages_read",
                    "Pages read from storage into the host pool and verified.",
                    PAGES,
                    "storage_read",
                ),
                ("storage_pages_written", "Pages written to storage.", PAGES, "storage_write"),
                (
                    "storage_writes_skipped",
                    "Pages backed up but not written: this rank writes nothing (MLA ranks "
                    "other than 0).",
                    PAGES,
                    "storage_write_skipped",
                ),
                (
                    "storage_write_backs",
                    "Dirty pages `write_back` queued for writing (evicted from the host pool, "
                    "or at close).",
                    PAGES,
                    "write_back",
                ),
                (
                    "storage_writes_inline",
                    "Pages written by the thread that queued them, because the write queue "
                    "was full.",
                    PAGES,
                    "storage_write_inline",
                ),
                (
                    "storage_writes_cancelled",
                    "Pages whose storage write was given up at close (`drain=False`, or "
                    "`close_timeout_s` passed).",
                    PAGES,
                    "storage_write_cancelled",
                ),
                (
                    "pages_backed_up",
                    "Pages backed up whole into the host pool.",
                    PAGES,
                    "backed_up",
                ),
                (
                    "pages_backup_already_cached",
                    "Pages a backup skipped: the host pool held them already.",
                    PAGES,
                    "backup_already_cached",
                ),
                (
                    "pages_prefetched",
                    "Pages prefetches brought in from storage (the pages `storage_pages_read` "
                    "counts).",
                    PAGES,
                    "prefetched",
                ),
                ("pages_loaded", "Pages loaded into the device pool.", PAGES, "loaded"),
                (
                    "pages_cancelled",
                    "Pages of backups and prefetches given up before they were done (closed, "
                    "released, or after a failed page).",
                    PAGES,
                    "cancelled",
                ),
                (
                    "pages_quarantined",
                    "Host pages kept out of reuse because a storage call using them timed "
                    "out (a read may still fill them, a write still read them): freed only "
                    "once the call returns.",
                    PAGES,
                    "quarantined",
                ),
                CounterSpec(
                    "bytes",
                    _CACHE,
                    "Bytes moved, by direction.",
                    DIRECTIONS,
                    total=False,
                    family=Family("kvtier_transferred_bytes", label="direction"),
                ),
                CounterSpec(
                    "busy_seconds",
                    _CACHE,
                    "Seconds spent moving those bytes, by direction (summed over workers).",
                    DIRECTIONS,
                    total=False,
                    family=Family("kvtier_transfer_seconds", label="direction"),
                ),
                CounterSpec(
                    "failures",
                    _CACHE,
                    'Pages that failed, by cause (the causes above); `stats()["failures_total"]` '
                    "sums them.",
                    tuple(cause.value for cause in Cause),
                    total=False,
                    family=Family("kvtier_failures", label="cause"),
                ),
            ],
        )
    ),
    _TIER: tuple(
        _counters(
            _TIER,
            [
                (
                    "promotions",
                    "Pages copied up into a tier from a lower tier that served them.",
                    _tier("promotions"),
                ),
                (
                    "cascades",
                    "Pages written down into a tier from the tier above (write-through, "
                    "write-back).",
                    _tier("cascades"),
                ),
                (
                    "drops",
                    "Pages that would have entered a tier but were dropped: a full cascade "
                    "queue (`tier_queue_pages`) or staging pool, or a write-back victim that "
                    "could not be handed down (or that its backend evicted on its own).",
                    _tier("drops"),
                ),
                (
                    "evictions",
                    "Pages a tier evicted to make room (its capacity, a write-back, a "
                    "tenant's quota).",
                    _tier("evictions"),
                ),
                (
                    "evictions_external",
                    "Evictions a tier's space manager did not choose: the backend's own "
                    "capacity (a backend that does not report its space) or pages its shared "
                    "store reclaimed (a master's memory pressure); also counted in `evictions`.",
                    _tier("evictions_external"),
                ),
                (
                    "quota_evictions",
                    "Pages a tier evicted because their tenant was over its `quota_bytes`.",
                    _tier("quota_evictions"),
                ),
                (
                    "quota_refused",
                    "Pages a tier did not take because their tenant's `quota_bytes` could not "
                    "hold them even after its own older pages left (a put larger than the "
                    "quota keeps its first pages).",
                    _tier("quota_refused"),
                ),
                (
                    "failures",
                    "Calls to a tier that failed (the chain bypassed it), and pages a cascade "
                    "or promotion failed to write there.",
                    _tier("failures"),
                ),
                (
                    "admission_refused",
                    "Pages a tier's admission policy kept out.",
                    _tier("admission_refused"),
                ),
                (
                    "quarantined_pages",
                    "Staging pages kept out of reuse because a cascade, write-back or "
                    "promotion call into or out of a tier timed out while using them: each "
                    "is reused only once the call returns.",
                    _tier("quarantined_pages"),
                ),
                (
                    "cancelled",
                    "Pages of queued or running cascades, write-backs and promotions (and "
                    "puts) not kept in a tier because their key was deleted or tainted "
                    "meanwhile (a copy written anyway is deleted once its call returned).",
                    _tier("cancelled"),
                ),
                (
                    "bypasses",
                    "Lookups (`exists`, `get`) that skipped a tier because a call to it was "
                    "stuck past `backend_call_timeout_s`: the next tier answered.",
                    _tier("bypasses"),
                ),
                (
                    "get_seconds",
                    "Seconds spent in a tier's reads (with `get_calls`, its mean read latency).",
                    _tier("get_seconds"),
                ),
                ("get_calls", "Reads asked of a tier (one batched call each).", _tier("get_calls")),
            ],
        )
    ),
    _CHAIN: tuple(
        _counters(
            _CHAIN,
            [
                (
                    "tenant_quota_evictions",
                    "A tenant's own pages evicted because it was over its `quota_bytes`.",
                    Family("kvtier_tenant_quota_evictions", per_tenant=True),
                ),
                (
                    "events_emitted",
                    "Page events (stored, promoted, evicted, removed) handed to subscribers.",
                    Family("kvtier_events_emitted"),
                ),
                (
                    "events_subscriber_errors",
                    "Times an event subscriber raised (its events are dropped).",
                    Family("kvtier_events_subscriber_errors"),
                ),
            ],
        )
    ),
    _VLLM_SCHEDULER: tuple(
        _counters(
            _VLLM_SCHEDULER,
            [
                (
                    "requests_unkeyed",
                    "Requests served without kvtier: an input could not be keyed.",
                ),
                ("lookup_requests", "Requests looked up beyond vLLM's own prefix-cache hit."),
                ("lookup_pages", "Pages those lookups asked for."),
                ("lookup_hit_pages", "Pages found stored (promised to vLLM as cached)."),
                (
                    "lookup_deferred",
                    "Lookups answered 'ask again' (vLLM skips the request for a step) while "
                    "the backend's `exists` ran off the scheduler thread.",
                ),
                (
                    "lookup_timeouts",
                    "Lookups with no answer within `lookup_timeout_s`: the request goes on "
                    "without kvtier's pages (a miss).",
                ),
                (
                    "lookup_exists_keys",
                    "Keys asked of the backend's `exists` (a lookup stops at the first miss).",
                ),
                ("load_pages_planned", "Pages planned for loading into vLLM's blocks."),
                (
                    "load_requests_planned",
                    "Requests whose pages load asynchronously (vLLM holds them in "
                    "WAITING_FOR_REMOTE_KVS until the load ends).",
                ),
                ("save_pages_planned", "Pages planned for storing."),
                (
                    "requests_preempted",
                    "Requests vLLM preempted (their queued stores are dropped, one in "
                    "flight waited for, before vLLM reuses their blocks).",
                ),
                (
                    "known_forgotten",
                    "Pages the scheduler remembered stored and forgot because no tier holds "
                    "them any more (an eviction or removal the workers reported): never "
                    "promised to vLLM from memory.",
                ),
                (
                    "lookup_promoting",
                    "Lookups answered 'ask again' while a worker's load promoted their pages "
                    "into a faster tier (at most `lookup_timeout_s`).",
                ),
                (
                    "handoff_announced_pages",
                    "Leading pages a saving engine handed on with finished requests "
                    "(`kv_transfer_params` `kvtier_pages`): held or being stored.",
                ),
                (
                    "handoff_waits",
                    "Handed-off requests answered 'ask again' while pages their producer "
                    "announced were not found yet (at most `handoff_timeout_s`).",
                ),
                (
                    "handoff_timeouts",
                    "Handed-off requests still missing announced pages after "
                    "`handoff_timeout_s`: what was found is loaded, the rest recomputed.",
                ),
                (
                    "handoff_invalid",
                    "Requests whose `kvtier_pages` was not a non-negative int: served as if "
                    "not handed off.",
                ),
                (
                    "vllm_events_emitted",
                    "Storage-tier page events handed to vLLM as KV events (BlockStored / "
                    "BlockRemoved, one per page and tier).",
                ),
                (
                    "vllm_events_unmapped",
                    "Storage-tier page events left out of vLLM's KV events: the scheduler "
                    "never saw the page's vLLM block hash.",
                ),
                (
                    "vllm_events_dropped",
                    "Storage-tier page events dropped before vLLM took them (more than "
                    "`events_buffer` waiting).",
                ),
                (
                    "resets",
                    "Connector resets (vLLM's `reset_cache`): a new key epoch each time.",
                ),
            ],
        )
    ),
    _VLLM_WORKER: tuple(
        _counters(
            _VLLM_WORKER,
            [
                ("load_pages", "Pages this rank loaded or tried to."),
                ("load_hit_pages", "Pages loaded and verified into vLLM's blocks."),
                ("load_failed_pages", "Pages missing or invalid: their blocks recompute."),
                ("load_copied_pages", "Blocks filled by copying a page read once for the step."),
                ("load_requests", "Requests whose load ended (reported to vLLM as received)."),
                (
                    "load_failed_requests",
                    "Requests reported to vLLM as failed loads (a page missing or failing "
                    "verification): vLLM looks them up again and counts only what verified.",
                ),
                (
                    "load_deleted_pages",
                    "Pages deleted because they failed envelope verification (proven bad); "
                    "a missing page, a failed or timed-out call deletes nothing.",
                ),
                (
                    "load_late_pages",
                    "Pages whose read timed out: their blocks stay with the load until the "
                    "backend call returns (it may still write into them).",
                ),
                (
                    "load_skipped_pages",
                    "Accelerator path: pages after a failed one, not loaded (chained keys); "
                    "their blocks recompute and the pages are kept.",
                ),
                ("load_seconds", "Seconds from each load's start to its end, summed."),
                (
                    "load_overlap_seconds",
                    "Seconds during which a load was in flight while a model step ran "
                    "(asynchronous loads overlap compute).",
                ),
                (
                    "load_overlap_steps",
                    "Model steps that ran while a load was in flight (each one a step the "
                    "loading request did not hold up).",
                ),
                ("save_pages", "Pages this rank stored or tried to."),
                ("save_stored_pages", "Pages stored."),
                ("save_failed_pages", "Pages not stored."),
                (
                    "save_dropped_pages",
                    "Pages not stored, never waited for: the save queue (`max_save_pages`) or "
                    "the staging memory was full, or their request was preempted first.",
                ),
                (
                    "save_staged_pages",
                    "Sliding-window pages copied aside at the end of their step (vLLM frees "
                    "such blocks while the request runs).",
                ),
                (
                    "save_late_pages",
                    "Pages whose write timed out: their blocks stay held until the backend "
                    "call returns (it may still read them).",
                ),
                (
                    "save_tainted_pages",
                    "Pages whose write was still running when their request was preempted: "
                    "deleted once the call returns, never reported stored.",
                ),
                (
                    "save_skipped_not_writer",
                    "MLA pages this rank did not write: rank 0 writes the pages every rank shares.",
                ),
                ("preempt_waits", "Preemptions that waited for a store of the request in flight."),
                (
                    "preempt_wait_timeouts",
                    "Of those, waits that passed `preempt_wait_s` (the store is tainted).",
                ),
                (
                    "tier_events_dropped",
                    "Storage-chain events this rank dropped before its next report (more "
                    "than `events_buffer` waiting): the scheduler misses them.",
                ),
            ],
        )
    ),
    _SGLANG: tuple(
        _counters(
            _SGLANG,
            [
                ("generic_path_pages", "Pages moved through SGLang's generic (copying) path."),
                (
                    "scratch_pages_quarantined",
                    "Scratch pages (kvtier's own, or a generic-path caller's tensors) kept "
                    "out of reuse because a storage call using them timed out: freed only "
                    "once the call returns.",
                ),
                (
                    "pages_staged",
                    "Pages a get read into kvtier's scratch pages and copied into SGLang's "
                    "host pool (bounded calls never fill SGLang's pages in place).",
                ),
                ("skipped_not_writer", "Pages not written: another rank writes MLA pages."),
                ("metrics_fallback", "1 when SGLang's StorageMetrics class could not be imported."),
                ("state_pools_by_value", "Hybrid-model state pools served by value (copied)."),
                ("state_pages_copied", "State pages copied in or out of such pools."),
                ("v2_index_mismatch", "v2 calls whose host indices did not match their keys."),
                ("clear_failures", "Pools whose backend failed to clear."),
                (
                    "kv_events_emitted",
                    "Storage-tier page events handed out as SGLang KV events "
                    "(`take_kv_events()` or the publisher), one per page and tier.",
                ),
                (
                    "kv_events_dropped",
                    "Storage-tier page events dropped before anyone took them "
                    "(more than `kv_events_buffer` waiting).",
                ),
                (
                    "kv_events_unmapped",
                    "Storage-tier page events left out: their key holds no SGLang page hash.",
                ),
                (
                    "kv_events_publish_errors",
                    "Times handing KV events to the publisher (`kv_events_endpoint`) failed.",
                ),
            ],
        )
    ),
}


def counter_names(counted_by: str) -> list[str]:
    """Every counter name (families expanded) that ``counted_by`` reports."""
    return [name for spec in COUNTERS[counted_by] for name in spec.names()]


def zeroed(counted_by: str, *, families: bool = False) -> dict[str, int | float]:
    """``counted_by``'s counters at 0 (a family's total only, unless ``families`` or it
    has none), so a reader sees each from the start."""
    return {
        name: 0
        for spec in COUNTERS[counted_by]
        for name in (spec.names() if families or not spec.total else [spec.name])
    }


def registered_counters(counted_by: str) -> Counters:
    """Counters that count ``counted_by``'s registered names only: counting another name
    raises :class:`~kvtier.core.errors.UnknownNameError`, so an unregistered counter fails
    where it is counted, not in a review."""
    return Counters(counter_names(counted_by), kind=f"{counted_by} counter (see COUNTERS)")


#: The prefixes each part's counters carry in vLLM's KV-connector metrics, whose series
#: are ``vllm:kvtier_<prefix><name>_total``: the worker reports its page store's counters
#: as ``store_<name>``; the accelerator worker its TieredCache's as ``cache_<name>`` (the
#: cache's page store as ``cache_page_store_<name>``).
VLLM_PREFIXES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        _VLLM_SCHEDULER: ("",),
        _VLLM_WORKER: ("",),
        _STORE: ("store_", "cache_page_store_"),
        _CACHE: ("cache_",),
    }
)


def vllm_metrics() -> dict[str, str]:
    """Every counter kvtier hands vLLM's metrics (``kvtier_<prefix><name>``), with its
    help: generated from the registry, so vLLM carries no name that is not declared."""
    return {
        f"kvtier_{prefix}{name}": f"kvtier: {spec.meaning}"
        for counted_by, prefixes in VLLM_PREFIXES.items()
        for prefix in prefixes
        for spec in COUNTERS[counted_by]
        for name in spec.names()
    }


def _families() -> Mapping[str, Family]:
    """Every Prometheus family by name: the counters' (help from the counter where the
    family declares none), then :data:`~kvtier.core.families.OTHER_FAMILIES`."""
    out: dict[str, Family] = {}
    for specs in COUNTERS.values():
        for spec in specs:
            declared = spec.family
            if declared is None:
                continue
            resolved = declared if declared.help else replace(declared, help=spec.meaning)
            if out.setdefault(declared.name, resolved) != resolved:
                raise KvtierError(
                    f"Prometheus family {declared.name!r} is declared twice, differently "
                    f"(at counter {spec.name!r}): declare it once and share the object",
                    value=declared.name,
                )
    for other in OTHER_FAMILIES:
        if out.setdefault(other.name, other) != other:
            raise KvtierError(
                f"Prometheus family {other.name!r} is declared twice, differently: in "
                "kvtier.core.families.OTHER_FAMILIES and on a counter",
                value=other.name,
            )
    return MappingProxyType(out)


#: Every Prometheus family kvtier exposes, by name, in the order docs list them.
FAMILIES: Mapping[str, Family] = _families()


def family(name: str) -> Family:
    """The declared family ``name``; an undeclared one raises
    :class:`~kvtier.core.errors.UnknownNameError`, so no family is exposed unnamed here."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise UnknownNameError(
            "Prometheus family (declare it in kvtier.core.metrics or kvtier.core.families)",
            name,
            FAMILIES,
        ) from None


def series(counted_by: str) -> dict[str, list[tuple[str, str | None]]]:
    """``counted_by``'s Prometheus families by name, each with its (counter name, label
    value) series: what the exposition emits of those counters."""
    out: dict[str, list[tuple[str, str | None]]] = {}
    for spec in COUNTERS[counted_by]:
        if spec.family is not None:
            out.setdefault(spec.family.name, []).extend(spec.series())
    return out


#: Where each part's counters are read.
READ_AT: Mapping[str, str] = {
    _STORE: '`PageStore.stats()`: a TieredCache\'s `stats()["page_store"]` (summed over '
    'the tiers), each tier\'s `stats()["tiers"][i]["store"][name]` (and `bytes_read`, '
    '`bytes_written` as `stats()["tiers"][i][name]`, summed over the tier\'s page stores), '
    "the vLLM worker's `store_<name>`, SGLang's `kvtier_stats()` (an extra pool's with its "
    "name first)",
    _CACHE: "`TieredCache.stats()`, a counter `<part>_<key>` as `stats()[part][key]` "
    '(`host_hits`: `stats()["host"]["hits"]`, `failures_queue_full`: '
    '`stats()["failures"]["queue_full"]`); the vLLM accelerator worker\'s `cache_<name>`',
    _TIER: 'Each tier\'s `TieredCache.stats()["tiers"][i][name]` (SGLang: '
    "`tier_stats()[pool][i][name]`)",
    _CHAIN: "`tenant_quota_evictions` as "
    '`TieredCache.stats()["tenants"][tenant]["quota_evictions"]`, `events_<key>` as '
    '`stats()["events"][key]`',
    _VLLM_SCHEDULER: "`KvtierConnector.kvtier_stats()` on the scheduler side",
    _VLLM_WORKER: "`KvtierConnector.kvtier_stats()` on each worker (vLLM's metrics sum "
    "the workers)",
    _SGLANG: "`KvtierHiCacheStorage.kvtier_stats()`",
}


def counters_markdown() -> str:
    """The registry as docs/operating.md lists it: one table row per counter, with its
    Prometheus family and its name in vLLM's metrics."""
    rows = [
        "| Counter | Counted by | Prometheus | vLLM | Meaning |",
        "|---|---|---|---|---|",
    ]
    for counted_by, specs in COUNTERS.items():
        vllm = VLLM_PREFIXES.get(counted_by, ())
        for spec in specs:
            members = f"`{spec.name}_<{'|'.join(spec.suffixes)}>`" if spec.suffixes else ""
            family = f" Per member: {members}." if members else ""
            exposed = _exposed(spec)
            engine = ", ".join(
                f"`vllm:kvtier_{prefix}{name}_total`" for prefix in vllm for name in _stems(spec)
            )
            rows.append(
                f"| `{spec.name}` | {counted_by} | {exposed} | {engine} | {spec.meaning}{family} |"
            )
    where = [f"- **{counted_by}**: {READ_AT[counted_by]}." for counted_by in COUNTERS]
    return "\n".join([*rows, "", *where])


def _stems(spec: CounterSpec) -> list[str]:
    """The counter's names as the counters table lists them (``<suffix>`` for members)."""
    if not spec.suffixes:
        return [spec.name]
    member = f"{spec.name}_<member>"
    return [spec.name, member] if spec.total else [member]


def _exposed(spec: CounterSpec) -> str:
    """The Prometheus series of ``spec`` as the counters table names them."""
    if spec.family is None:
        return ""
    name, label = spec.family.sample_name, spec.family.label
    if label is None:
        return f"`{name}`"
    if spec.suffixes or spec.value is None:  # by suffix, or by tier
        return f"`{name}{{{label}}}`"
    return f'`{name}{{{label}="{spec.value}"}}`'


def families_markdown() -> str:
    """Every Prometheus family as docs/operating.md lists it: one row each."""
    rows = ["| Metric | Type | Labels | Meaning |", "|---|---|---|---|"]
    for declared in FAMILIES.values():
        labels = ", ".join(f"`{label}`" for label in declared.labels)
        rows.append(f"| `{declared.sample_name}` | {declared.kind} | {labels} | {declared.help} |")
    return "\n".join(rows)


def storage_metrics_markdown() -> str:
    """SGLang's ``StorageMetrics`` fields as docs/operating.md lists them."""
    rows = ["| Field | Meaning |", "|---|---|"]
    rows += [f"| `{field.field}` | {field.meaning} |" for field in STORAGE_METRICS]
    return "\n".join(rows)


def causes_markdown() -> str:
    """The failure causes as docs/operating.md lists them."""
    rows = ["| Cause | Pages that failed because |", "|---|---|"]
    rows += [f"| `{cause.value}` | {cause.meaning} |" for cause in Cause]
    return "\n".join(rows)
