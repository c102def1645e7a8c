"""The Prometheus view of a TieredCache: ``kvtier_*`` metric families from one stats snapshot.

Each scrape reads one :meth:`TieredCache.stats` snapshot, so the exposition and
``stats()`` always agree. Every series carries the cache's identity labels (``model``,
``rank``, ``tenant``, ``backend``). Names follow the serving-engine convention: a
``kvtier_`` prefix, ``_total`` on counters, base units (``_bytes``, ``_seconds``). Label
values that alerting needs (failure causes, rejection reasons, timed-out operations) are
emitted from the start with 0, so ``rate()`` sees the first increment. The backend's own
numeric ``stats()`` are exported generically as ``kvtier_backend_stat{name=...}``
(untyped: kvtier cannot know which are counters). docs/operating.md lists every metric;
a test keeps the two in step. ``prometheus_client`` is imported only here, on demand.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from kvtier.cache.stats import LATENCY_BUCKETS
from kvtier.core.envelope import Rejection
from kvtier.core.errors import PrometheusMissingError
from kvtier.core.metrics import BACKEND_CALLS, COUNTERS, Cause

if TYPE_CHECKING:
    from kvtier.core.capabilities import ResolvedPlan
    from kvtier.core.store import Store

__all__ = [
    "BACKEND_CALLS",
    "FAILURE_CAUSES",
    "IDENTITY_LABELS",
    "identity_of",
    "prometheus_collector",
    "prometheus_text",
    "store_collector",
]

#: The labels every series carries, in this order.
IDENTITY_LABELS = ("model", "rank", "tenant", "backend")

#: Failure causes a cache counts (``stats()["failures"]``), emitted with 0 from the start.
FAILURE_CAUSES = tuple(cause.value for cause in Cause)

#: Backend ``stats()`` keys that mean occupancy, exported as their own gauges too.
_OCCUPANCY = {
    "pages": ("kvtier_storage_pages", "Pages the backend holds (where it knows)."),
    "bytes": ("kvtier_storage_bytes", "Bytes the backend holds (where it knows)."),
    "capacity_bytes": (
        "kvtier_storage_capacity_bytes",
        "The backend's configured capacity in bytes (where it has one).",
    ),
}


def _number(value: object) -> float | None:
    """``value`` as a float if it is a finite int or float (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


class _Families:
    """Builds metric families that carry one identity's labels (prometheus_client's)."""

    def __init__(self, identity: Mapping[str, str]) -> None:
        try:
            from prometheus_client import core
        except ImportError:
            raise PrometheusMissingError() from None
        self.core = core
        self.names = list(IDENTITY_LABELS)
        self.ident = [str(identity.get(name, "")) for name in IDENTITY_LABELS]

    def counter(self, name: str, doc: str, label: str | None = None) -> Any:
        return self.core.CounterMetricFamily(name, doc, labels=self._labels(label))

    def gauge(self, name: str, doc: str, label: str | None = None) -> Any:
        return self.core.GaugeMetricFamily(name, doc, labels=self._labels(label))

    def untyped(self, name: str, doc: str, label: str) -> Any:
        return self.core.UntypedMetricFamily(name, doc, labels=self._labels(label))

    def histogram(self, name: str, doc: str, label: str) -> Any:
        return self.core.HistogramMetricFamily(name, doc, labels=self._labels(label))

    def by_label(self, family: Any, values: Mapping[str, float]) -> Any:
        for key, value in values.items():
            family.add_metric([*self.ident, key], value)
        return family

    def one(self, family: Any, value: float) -> Any:
        family.add_metric(self.ident, value)
        return family

    def _labels(self, label: str | None) -> list[str]:
        return [*self.names, *([label] if label else [])]


def prometheus_collector(
    snapshot: Callable[[], dict[str, Any]], identity: Mapping[str, str]
) -> Any:
    """A prometheus_client collector over ``snapshot()`` (a TieredCache.stats() dict).

    ``identity`` gives the value of each of :data:`IDENTITY_LABELS`.
    """
    f = _Families(identity)

    class _Collector:
        """Reads one stats snapshot per scrape and yields the kvtier_* metric families."""

        def collect(self) -> Iterator[Any]:
            s = snapshot()
            yield from _cache_families(f, s)
            yield from _store_families(f, s["page_store"], s["backend_calls"], s["backend"])
            yield from _tier_families(f, s["tiers"], s["tenants"])
            yield from _host_families(f, s)

    return _Collector()


def identity_of(plan: ResolvedPlan) -> dict[str, str]:
    """The identity labels of the caches and stores a plan builds."""
    cfg = plan.config
    return {
        "model": cfg.model,
        "rank": str(cfg.tp_rank),
        "tenant": cfg.tenant or "",
        "backend": plan.backend.name,
    }


def store_collector(store: Store, identity: Mapping[str, str]) -> Any:
    """A prometheus_client collector of one page store's families: what every engine path
    (the vLLM connector's workers, the SGLang adapter) exposes of its storage tier, under
    the same names and labels as a TieredCache's (docs/operating.md)."""
    f = _Families(identity)

    class _Collector:
        """Reads the store's counters, its bounded calls and its backend's stats per scrape."""

        def collect(self) -> Iterator[Any]:
            yield from _store_families(f, store.stats(), store.call_counts(), store.backend_stats())

    return _Collector()


def _cache_families(f: _Families, s: dict[str, Any]) -> Iterator[Any]:
    """A TieredCache's lookups, pages, bytes and failures."""
    for tier in ("host", "storage"):
        for what in ("hits", "misses"):
            yield f.one(
                f.counter(
                    f"kvtier_{tier}_{what}",
                    f"Pages looked up in the {tier} tier that were {what}.",
                ),
                s[tier][what],
            )
    yield f.one(
        f.counter("kvtier_host_evictions", "Host-pool pages evicted (LRU)."),
        s["host"]["evictions"],
    )
    yield f.by_label(
        f.counter("kvtier_pages", "Pages handled, by operation.", "operation"),
        {
            **s["pages"],
            "storage_read": s["storage"]["pages_read"],
            "storage_write": s["storage"]["pages_written"],
            "storage_write_skipped": s["storage"]["writes_skipped"],
            "storage_write_inline": s["storage"]["writes_inline"],
            "storage_write_cancelled": s["storage"]["writes_cancelled"],
            "write_back": s["storage"]["write_backs"],
        },
    )
    yield f.by_label(
        f.counter("kvtier_transferred_bytes", "Bytes moved, by direction.", "direction"),
        s["bytes"],
    )
    yield f.by_label(
        f.counter(
            "kvtier_transfer_seconds",
            "Seconds spent moving bytes, by direction (summed over workers).",
            "direction",
        ),
        {d: s["busy_seconds"].get(d, 0.0) for d in s["bytes"]},
    )
    failures = dict.fromkeys(FAILURE_CAUSES, 0)
    failures.update(s["failures"])
    yield f.by_label(f.counter("kvtier_failures", "Failed pages, by cause.", "cause"), failures)


def _store_families(
    f: _Families, store: Mapping[str, Any], calls: Mapping[str, Any], backend: Mapping[str, Any]
) -> Iterator[Any]:
    """A page store's rejections, backend errors and bounded calls, and its backend's stats."""
    yield f.by_label(
        f.counter(
            "kvtier_page_rejections",
            "Stored pages that failed verification and were served as misses, by reason.",
            "reason",
        ),
        {r.value: store.get(f"invalid_{r.value}", 0) for r in Rejection},
    )
    yield f.by_label(
        f.counter(
            "kvtier_backend_errors",
            "Backend calls that raised or answered malformed (the batch failed), by operation.",
            "operation",
        ),
        {op: store.get(f"backend_errors_{op}", 0) for op in ("exists", "get", "put", "delete")},
    )
    timeouts = dict.fromkeys(BACKEND_CALLS, 0)
    timeouts.update(calls["timed_out_by_operation"])
    yield f.by_label(
        f.counter(
            "kvtier_backend_call_timeouts",
            "Backend calls that did not return within backend_call_timeout_s; "
            "their operations failed and their threads were abandoned.",
            "operation",
        ),
        timeouts,
    )
    yield f.one(
        f.counter(
            "kvtier_backend_calls_refused",
            "Backend calls failed at once because max_abandoned_calls calls were stuck.",
        ),
        calls["refused"],
    )
    yield f.one(
        f.counter(
            "kvtier_backend_late_returns", "Abandoned backend calls that returned after all."
        ),
        calls["late_returns"],
    )
    yield f.one(
        f.gauge(
            "kvtier_backend_calls_stuck",
            "Backend calls past their bound that have not returned yet.",
        ),
        calls["stuck"],
    )
    yield f.one(
        f.gauge(
            "kvtier_backend_calls_stuck_max",
            "max_abandoned_calls: stuck calls beyond which every call is refused.",
        ),
        calls["max_abandoned"],
    )
    numbers = {
        key: number
        for key, value in sorted(backend.items())
        if (number := _number(value)) is not None
    }
    for key, (name, doc) in _OCCUPANCY.items():
        if key in numbers:
            yield f.one(f.gauge(name, doc), numbers[key])
    yield f.by_label(
        f.untyped(
            "kvtier_backend_stat",
            "The backend's own stats() numbers (counters and gauges), by name.",
            "name",
        ),
        numbers,
    )
    yield f.one(
        f.gauge(
            "kvtier_backend_stats_up", "1 if the backend's stats() answered this scrape, else 0."
        ),
        0 if "error" in backend else 1,
    )


#: The page store's counters that each tier's series carry too (the engine's reads).
_TIER_STORE_COUNTERS = ("hits", "misses")


def _tier_counters() -> Iterator[tuple[str, tuple[str, ...], str]]:
    """(series, path in a tier's stats, help) of every per-tier counter: the page store's
    above and the chain's own (``storage_tier`` in kvtier.core.metrics.COUNTERS)."""
    store = {spec.name: spec.meaning for spec in COUNTERS["page_store"]}
    for name in _TIER_STORE_COUNTERS:
        yield f"kvtier_tier_{name}", ("store", name), store[name]
    for spec in COUNTERS["storage_tier"]:
        yield f"kvtier_tier_{spec.name}", (spec.name,), spec.meaning


def _tier_families(
    f: _Families, tiers: list[dict[str, Any]], tenants: Mapping[str, Any]
) -> Iterator[Any]:
    """The storage chain's tiers (label ``tier``: ``<index>:<backend>``) and tenants."""
    for name, path, doc in _tier_counters():
        family = f.counter(name, doc, "tier")
        for tier in tiers:
            value: Any = tier
            for part in path:
                value = value.get(part, 0) if isinstance(value, Mapping) else 0
            family.add_metric([*f.ident, tier["name"]], float(value or 0))
        yield family
    depth = f.gauge(
        "kvtier_tier_queue_depth", "Pages waiting to be written into this tier.", "tier"
    )
    occupancy = f.gauge(
        "kvtier_tier_occupancy_bytes",
        "Bytes this tier holds, as its eviction policy counts them.",
        "tier",
    )
    for tier in tiers:
        depth.add_metric([*f.ident, tier["name"]], float(tier.get("queue_depth", 0)))
        if tier.get("occupancy_bytes") is not None:
            occupancy.add_metric([*f.ident, tier["name"]], float(tier["occupancy_bytes"]))
    yield depth
    yield occupancy
    # a tenant's series carry its name as the identity's ``tenant`` label (not a second one)
    held = f.gauge("kvtier_tenant_bytes", "Bytes of a tenant's pages in a tier.", "tier")
    quota = f.counter(
        "kvtier_tenant_quota_evictions",
        "A tenant's own pages evicted because it was over its quota_bytes.",
    )
    at = IDENTITY_LABELS.index("tenant")
    for tenant, entry in tenants.items():
        ident = [*f.ident[:at], tenant, *f.ident[at + 1 :]]
        for tier, nbytes in zip(tiers, entry["bytes"], strict=False):
            held.add_metric([*ident, tier["name"]], float(nbytes))
        quota.add_metric(ident, float(entry["quota_evictions"]))
    yield held
    yield quota


def _host_families(f: _Families, s: dict[str, Any]) -> Iterator[Any]:
    """A TieredCache's latency histograms, host pool and queues."""
    latency = f.histogram(
        "kvtier_operation_latency_seconds", "Latency of cache operations.", "operation"
    )
    for op, h in s["latency_seconds"].items():
        cumulative, running = [], 0
        for bound, n in zip((*LATENCY_BUCKETS, float("inf")), h["buckets"], strict=True):
            running += n
            cumulative.append((_bound_text(bound), running))
        latency.add_metric([*f.ident, op], cumulative, h["sum"])
    yield latency
    pages = dict(s["host"]["pages"])
    pages["used"] = pages["total"] - pages["free"]
    yield f.by_label(f.gauge("kvtier_host_pages", "Host-pool pages, by state.", "state"), pages)
    page_bytes = s["page_bytes"]
    yield f.by_label(
        f.gauge("kvtier_host_bytes", "Host-pool page bytes, by state.", "state"),
        {"total": pages["total"] * page_bytes, "used": pages["used"] * page_bytes},
    )
    yield f.by_label(
        f.gauge("kvtier_queue_depth", "Operations waiting, by queue.", "queue"), s["queues"]
    )


def _bound_text(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


def prometheus_text(collector: Any) -> str:
    """One collector's metrics in the Prometheus text exposition format."""
    try:
        from prometheus_client import CollectorRegistry, generate_latest
    except ImportError:
        raise PrometheusMissingError() from None
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode("utf-8")
