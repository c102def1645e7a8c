"""kvtier's one metrics vocabulary: every counter any part counts, with what it means.

Each counter is declared here once, by the part that counts it: the page store (every
engine path has one), a TieredCache's failures by :class:`Cause`, the vLLM connector's
scheduler and worker sides, the SGLang adapter. A new metric is added here, then counted;
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

__all__ = [
    "BACKEND_CALLS",
    "COUNTERS",
    "READ_AT",
    "Cause",
    "CounterSpec",
    "causes_markdown",
    "counter_names",
    "counters_markdown",
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

    A family counts ``name`` in total and ``name_<suffix>`` for each of ``suffixes``.
    """

    name: str
    counted_by: str
    meaning: str
    suffixes: tuple[str, ...] = ()

    def names(self) -> list[str]:
        """The counter's name, and each member's for a family."""
        return [self.name, *(f"{self.name}_{suffix}" for suffix in self.suffixes)]


def _counters(counted_by: str, specs: Iterable[tuple[str, str] | CounterSpec]) -> list[CounterSpec]:
    return [
        spec if isinstance(spec, CounterSpec) else CounterSpec(spec[0], counted_by, spec[1])
        for spec in specs
    ]


_REASONS = tuple(reason.value for reason in Rejection)
_STORE = "page_store"
_VLLM_SCHEDULER = "vllm_scheduler"
_VLLM_WORKER = "vllm_worker"
_SGLANG = "sglang"

#: Every counter, by who counts it (``page_store``, ``vllm_scheduler``, ``vllm_worker``,
#: ``sglang``). A TieredCache's counters are its nested ``stats()`` (docs/operating.md,
#: "Every metric"), with failures by :class:`Cause`.
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
                    "Requests reported to vLLM as failed loads (none of their pages verified, "
                    "or a hybrid model's): vLLM looks them up again and recomputes.",
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
                    "MLA pages this rank did not write: rank 0 writes the pages every rank "
                    "shares.",
                ),
                ("preempt_waits", "Preemptions that waited for a store of the request in flight."),
                (
                    "preempt_wait_timeouts",
                    "Of those, waits that passed `preempt_wait_s` (the store is tainted).",
                ),
            ],
        )
    ),
    _SGLANG: tuple(
        _counters(
            _SGLANG,
            [
                ("generic_path_pages", "Pages moved through SGLang's generic (copying) path."),
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
    """``counted_by``'s counters at 0 (a family's total only, unless ``families``), so a
    reader sees each from the start."""
    return {
        name: 0
        for spec in COUNTERS[counted_by]
        for name in (spec.names() if families else [spec.name])
    }


#: Where each part's counters are read.
READ_AT: Mapping[str, str] = {
    _STORE: '`PageStore.stats()`: a TieredCache\'s `stats()["page_store"]`, the vLLM '
    "worker's `store_<name>` (`kvtier_store_<name>` in vLLM's metrics), SGLang's "
    "`kvtier_stats()` (an extra pool's with its name first)",
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
