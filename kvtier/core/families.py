"""The Prometheus families kvtier exposes, declared once: name, type, labels and help.

A counter's family is named on its declaration in :data:`kvtier.core.metrics.COUNTERS`;
the families here are the rest: gauges, the latency histogram, the bounded calls' view
and the backend's own numbers. The exposition (:mod:`kvtier.cache.metrics`) builds no
family that is not declared (:func:`kvtier.core.metrics.family` refuses an undeclared
name), and docs/operating.md's list of metrics is generated from the declarations.
Also here: how SGLang's ``StorageMetrics`` fields are filled, declared once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "OTHER_FAMILIES",
    "STORAGE_METRICS",
    "Family",
    "FamilyKind",
    "StorageMetricsField",
]

#: The Prometheus types kvtier emits.
FamilyKind = Literal["counter", "gauge", "histogram", "untyped"]


@dataclass(frozen=True)
class Family:
    """One Prometheus family: ``name`` (``kvtier_`` prefix; a counter's samples add
    ``_total``), its type, ``help`` (empty for a counter's own family: the counter's
    meaning is its help) and ``label``, the one label its series differ by besides the
    identity labels. ``per_tenant``: each series carries a configured tenant's name as
    the identity's ``tenant`` label."""

    name: str
    kind: FamilyKind = "counter"
    help: str = ""
    label: str | None = None
    per_tenant: bool = False

    @property
    def sample_name(self) -> str:
        """The name its samples carry (``kvtier_host_hits_total`` for a counter)."""
        return f"{self.name}_total" if self.kind == "counter" else self.name

    @property
    def labels(self) -> tuple[str, ...]:
        """The labels its series add to the identity's, as docs list them."""
        return (*(("tenant",) if self.per_tenant else ()), *((self.label,) if self.label else ()))


def _tier(name: str, help: str = "") -> Family:
    return Family(f"kvtier_tier_{name}", help=help, label="tier")


#: Families whose members several counters are (``label``: each counter's value).
PAGES = Family(
    "kvtier_pages",
    help="Pages handled, by operation: each a `tiered_cache` counter (the counters "
    "list below names each one's `operation`).",
    label="operation",
)
TIER_READ_BYTES = _tier(
    "read_bytes",
    "Bytes of pages read out of a tier: those it served, and those the chain read to "
    "cascade them or hand them down (write-back); the page store's `bytes_read`, summed "
    "over the tier's page stores.",
)
TIER_WRITTEN_BYTES = _tier(
    "written_bytes",
    "Bytes of pages stored in a tier (puts, cascades, write-backs, promotions); the page "
    "store's `bytes_written`, summed over the tier's page stores.",
)

#: Every family that is no registered counter, in the order docs list them.
OTHER_FAMILIES: tuple[Family, ...] = (
    Family(
        "kvtier_backend_late_returns",
        help="Abandoned backend calls that returned after all (their thread serves again).",
    ),
    Family(
        "kvtier_backend_calls_stuck",
        "gauge",
        "Backend calls past their bound that have not returned yet (each holds one thread "
        "and the host pages it was using).",
    ),
    Family(
        "kvtier_backend_calls_stuck_max",
        "gauge",
        "`max_abandoned_calls`: at this many stuck calls, every backend call is refused.",
    ),
    Family(
        "kvtier_operation_latency_seconds",
        "histogram",
        "Latency of cache operations: `backup`, `device_to_host`, `storage_put`, "
        "`prefetch`, `storage_get`, `load` (as `_bucket`, `_sum`, `_count`).",
        "operation",
    ),
    Family(
        "kvtier_host_pages",
        "gauge",
        "Host-pool pages: `total`, `free`, `used` (total - free), `cached` (keyed), "
        "`pinned`, `pending` (being filled), `dirty` (write_back owes a write).",
        "state",
    ),
    Family("kvtier_host_bytes", "gauge", "Host-pool page bytes: `total`, `used`.", "state"),
    Family(
        "kvtier_queue_depth",
        "gauge",
        "Operations waiting in the `transfer`, `read` and `write` queues.",
        "queue",
    ),
    Family(
        "kvtier_storage_pages",
        "gauge",
        "Pages the backend holds, where its `stats()` reports `pages` (file, io_uring, "
        "memory; mooncake: the pages this client put and has not seen removed).",
    ),
    Family(
        "kvtier_storage_bytes",
        "gauge",
        "Bytes the backend holds, where its `stats()` reports `bytes`.",
    ),
    Family(
        "kvtier_storage_capacity_bytes",
        "gauge",
        "The backend's capacity, where its `stats()` reports `capacity_bytes` (mooncake "
        "with `capacity_bytes` set).",
    ),
    Family(
        "kvtier_backend_stat",
        "untyped",
        "Every number the backend's own `stats()` returns, by name: Mooncake's "
        "`put_failed.NO_AVAILABLE_HANDLE`, the file index's `evictions`, `debris_*`, a "
        "plugin's counters. Untyped because kvtier cannot know which are counters; most "
        "are. The one family whose series kvtier does not name: a backend's names are its own.",
        "name",
    ),
    Family(
        "kvtier_backend_stats_up",
        "gauge",
        "1 if the backend's `stats()` answered this scrape (within 2 s), else 0.",
    ),
    Family(
        "kvtier_tier_queue_depth",
        "gauge",
        "Pages queued on the chain's worker to be written into this tier (cascades, "
        "write-backs, promotions); 0 for a tier nothing is queued for.",
        "tier",
    ),
    Family(
        "kvtier_tier_occupancy_bytes",
        "gauge",
        "Bytes a tier holds, as its eviction policy counts them.",
        "tier",
    ),
    Family(
        "kvtier_tenant_bytes",
        "gauge",
        "Bytes of a configured tenant's pages in each tier.",
        "tier",
        per_tenant=True,
    ),
)


@dataclass(frozen=True)
class StorageMetricsField:
    """One field of SGLang's ``StorageMetrics``: what each prefetch or backup call adds to it."""

    field: str
    direction: Literal["prefetch", "backup"]
    quantity: Literal["pages", "bandwidth"]
    meaning: str


#: SGLang's ``StorageMetrics`` fields, each a window of one value per call since SGLang
#: last asked (``get_stats``).
STORAGE_METRICS: tuple[StorageMetricsField, ...] = (
    StorageMetricsField(
        "prefetch_pgs", "prefetch", "pages", "Pages each prefetch call read (storage to host)."
    ),
    StorageMetricsField(
        "backup_pgs", "backup", "pages", "Pages each backup call wrote (host to storage)."
    ),
    StorageMetricsField(
        "prefetch_bandwidth", "prefetch", "bandwidth", "GB/s of each prefetch call."
    ),
    StorageMetricsField("backup_bandwidth", "backup", "bandwidth", "GB/s of each backup call."),
)
