"""kvtier's one metrics vocabulary: every counter any part counts, with what it means.

Each counter is declared here once, by the part that counts it: the page store (every
engine path has one), a TieredCache (its failures by :class:`Cause`), the storage chain's
tiers, the vLLM connector's scheduler and worker sides, the SGLang adapter. A new metric
is added here, then counted (a part that counts through :func:`registered_counters`
cannot count a name missing here);
``docs/operating.md`` lists this registry (a test keeps the two equal), the Prometheus
exposition (:mod:`kvtier.cache.metrics`) and the engines' own stats read their names from
it. Names are plain ``[a-z0-9_]``; a family (``invalid_<reason>``) is one entry whose
members carry a suffix from a fixed list.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvtier.core.envelope import Rejection
from kvtier.core.storage import Counters

__all__ = [
    "BACKEND_CALLS",
    "COUNTERS",
    "DIRECTIONS",
    "READ_AT",
    "Cause",
    "CounterSpec",
    "causes_markdown",
    "counter_names",
    "counters_markdown",
    "registered_counters",
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
    """One counter: its name, who counts it, what it counts; ``suffixes`` for a family.

    A family counts ``name_<suffix>`` for each of ``suffixes``, and ``name`` in total
    unless ``total`` is False.
    """

    name: str
    counted_by: str
    meaning: str
    suffixes: tuple[str, ...] = ()
    total: bool = True

    def names(self) -> list[str]:
        """The counter's name (a family's total), and each member's for a family."""
        members = [f"{self.name}_{suffix}" for suffix in self.suffixes]
        return [self.name, *members] if self.total or not self.suffixes else members


def _counters(counted_by: str, specs: Iterable[tuple[str, str] | CounterSpec]) -> list[CounterSpec]:
    return [
        spec if isinstance(spec, CounterSpec) else CounterSpec(spec[0], counted_by, spec[1])
        for spec in specs
    ]


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
                ("hits", "Pages read and verified."),
                ("misses", "Pages asked for and not read (absent, or the call failed)."),
                CounterSpec(
                    "invalid",
                    _STORE,
                    "Pages read that failed envelope verification (a counted miss), by reason.",
                    _REASONS,
                ),
                ("puts", "Pages the backend stored."),
                ("put_failures", "Pages the backend did not store (refused, or the call failed)."),
                (
                    "put_tainted",
                    "Of those, pages whose save guard tripped before the put returned (their "
                    "memory was taken back, as a preempted vLLM request's blocks): any "
                    "written after the trip has an envelope that never verifies.",
                ),
                ("bytes_read", "Bytes of pages read and verified."),
                ("bytes_written", "Bytes of pages stored."),
                ("prefix_queries", "Prefix lookups (`prefix_hits`)."),
                ("prefix_pages", "Leading pages those lookups found stored."),
                CounterSpec(
                    "backend_errors",
                    _STORE,
                    "Backend calls that raised or answered malformed (the batch failed), by "
                    "operation.",
                    BACKEND_CALLS,
                ),
                CounterSpec(
                    "backend_timeouts",
                    _STORE,
                    "Backend calls that did not return within `backend_call_timeout_s` (the "
                    "batch failed; the call's thread is abandoned), by operation.",
                    BACKEND_CALLS,
                ),
                CounterSpec(
                    "backend_refused",
                    _STORE,
                    "Backend calls failed at once because `max_abandoned_calls` calls were "
                    "stuck, by operation.",
                    BACKEND_CALLS,
                ),
            ],
        )
    ),
    _CACHE: tuple(
        _counters(
            _CACHE,
            [
                ("host_hits", "Pages a prefetch found in the host pool."),
                ("host_misses", "Pages a prefetch did not find in the host pool."),
                ("host_evictions", "Host-pool pages evicted, least recently used first."),
                (
                    "storage_hits",
                    "Pages a prefetch found in storage (after missing the host pool).",
                ),
                ("storage_misses", "Pages a prefetch found in neither tier."),
                ("storage_pages_read", "Pages read from storage into the host pool and verified."),
                ("storage_pages_written", "Pages written to storage."),
                (
                    "storage_writes_skipped",
                    "Pages backed up but not written: this rank writes nothing (MLA ranks "
                    "other than 0).",
                ),
                (
                    "storage_write_backs",
                    "Dirty pages `write_back` queued for writing (evicted from the host pool, "
                    "or at close).",
                ),
                (
                    "storage_writes_inline",
                    "Pages written by the thread that queued them, because the write queue "
                    "was full.",
                ),
                (
                    "storage_writes_cancelled",
                    "Pages whose storage write was given up at close (`drain=False`, or "
                    "`close_timeout_s` passed).",
                ),
                ("pages_backed_up", "Pages backed up whole into the host pool."),
                (
                    "pages_backup_already_cached",
                    "Pages a backup skipped: the host pool held them already.",
                ),
                (
                    "pages_prefetched",
                    "Pages prefetches brought in from storage (the pages `storage_pages_read` "
                    "counts).",
                ),
                ("pages_loaded", "Pages loaded into the device pool."),
                (
                    "pages_cancelled",
                    "Pages of backups and prefetches given up before they were done (closed, "
                    "released, or after a failed page).",
                ),
                (
                    "pages_quarantined",
                    "Host pages kept out of reuse because a storage call using them timed "
                    "out (a read may still fill them, a write still read them): freed only "
                    "once the call returns.",
                ),
                CounterSpec(
                    "bytes",
                    _CACHE,
                    "Bytes moved, by direction.",
                    DIRECTIONS,
                    total=False,
                ),
                CounterSpec(
                    "busy_seconds",
                    _CACHE,
                    "Seconds spent moving those bytes, by direction (summed over workers).",
                    DIRECTIONS,
                    total=False,
                ),
                CounterSpec(
                    "failures",
                    _CACHE,
                    'Pages that failed, by cause (the causes above); `stats()["failures_total"]` '
                    "sums them.",
                    tuple(cause.value for cause in Cause),
                    total=False,
                ),
            ],
        )
    ),
    _TIER: tuple(
        _counters(
            _TIER,
            [
                ("promotions", "Pages copied up into a tier from a lower tier that served them."),
                ("cascades", "Pages written down into a tier from the tier above."),
                (
                    "drops",
                    "Pages that would have entered a tier but were dropped: a full cascade "
                    "queue (`tier_queue_pages`) or staging pool, or a write-back victim that "
                    "could not be handed down (or that its backend evicted on its own).",
                ),
                ("evictions", "Pages a tier evicted to make room."),
                (
                    "quota_evictions",
                    "Pages a tier evicted because their tenant was over its `quota_bytes`.",
                ),
                (
                    "failures",
                    "Calls to a tier that failed (the chain bypassed it), and pages a cascade "
                    "or promotion failed to write there.",
                ),
                ("admission_refused", "Pages a tier's admission policy kept out."),
                (
                    "quarantined_pages",
                    "Staging pages kept out of reuse because a cascade, write-back or "
                    "promotion call into or out of a tier timed out while using them: each "
                    "is reused only once the call returns.",
                ),
                (
                    "cancelled",
                    "Pages of queued or running cascades, write-backs and promotions (and "
                    "puts) not kept in a tier because their key was deleted or tainted "
                    "meanwhile (a copy written anyway is deleted once its call returned).",
                ),
                (
                    "bypasses",
                    "Lookups (`exists`, `get`) that skipped a tier because a call to it was "
                    "stuck past `backend_call_timeout_s`: the next tier answered.",
                ),
                ("get_seconds", "Seconds spent in a tier's reads."),
                ("get_calls", "Reads asked of a tier."),
                ("read_bytes", "Bytes of pages a tier served, to the engine or the chain."),
                (
                    "written_bytes",
                    "Bytes of pages stored in a tier (puts, cascades, write-backs, promotions).",
                ),
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
                ),
                (
                    "events_emitted",
                    "Page events (stored, promoted, evicted, removed) handed to subscribers.",
                ),
                (
                    "events_subscriber_errors",
                    "Times an event subscriber raised (its events are dropped).",
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


#: Where each part's counters are read.
READ_AT: Mapping[str, str] = {
    _STORE: '`PageStore.stats()`: a TieredCache\'s `stats()["page_store"]`, the vLLM '
    "worker's `store_<name>` (`kvtier_store_<name>` in vLLM's metrics), SGLang's "
    "`kvtier_stats()` (an extra pool's with its name first)",
    _CACHE: "`TieredCache.stats()`, a counter `<part>_<key>` as `stats()[part][key]` "
    '(`host_hits`: `stats()["host"]["hits"]`, `failures_queue_full`: '
    '`stats()["failures"]["queue_full"]`); the vLLM accelerator worker\'s `cache_<name>`',
    _TIER: 'Each tier\'s `TieredCache.stats()["tiers"][i][name]` (SGLang: '
    "`tier_stats()[pool][i][name]`)",
    _CHAIN: "`tenant_quota_evictions` as "
    '`TieredCache.stats()["tenants"][tenant]["quota_evictions"]`, `events_<key>` as '
    '`stats()["events"][key]`',
    _VLLM_SCHEDULER: "`kvtier_<name>` in vLLM's KV-connector metrics (scheduler side)",
    _VLLM_WORKER: "`kvtier_<name>` in vLLM's KV-connector metrics (each worker, summed)",
    _SGLANG: "`KvtierHiCacheStorage.kvtier_stats()`",
}


def counters_markdown() -> str:
    """The registry as docs/operating.md lists it: one table row per counter."""
    rows = ["| Counter | Counted by | Meaning |", "|---|---|---|"]
    for counted_by, specs in COUNTERS.items():
        for spec in specs:
            family = (
                f" Per member: `{spec.name}_<{'|'.join(spec.suffixes)}>`." if spec.suffixes else ""
            )
            rows.append(f"| `{spec.name}` | {counted_by} | {spec.meaning}{family} |")
    where = [f"- **{counted_by}**: {READ_AT[counted_by]}." for counted_by in COUNTERS]
    return "\n".join([*rows, "", *where])


def causes_markdown() -> str:
    """The failure causes as docs/operating.md lists them."""
    rows = ["| Cause | Pages that failed because |", "|---|---|"]
    rows += [f"| `{cause.value}` | {cause.meaning} |" for cause in Cause]
    return "\n".join(rows)
