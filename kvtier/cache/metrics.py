"""The Prometheus view of a TieredCache: ``kvtier_*`` metric families from one stats snapshot.

Each scrape reads one :meth:`TieredCache.stats` snapshot, so the exposition and
``stats()`` always agree. Every family is declared in :mod:`kvtier.core.metrics` (a
counter's on the counter, with its label and help) or :mod:`kvtier.core.families`; the
counters' families are generated from those declarations, and no family is built from a
name not declared there. Every series carries the cache's identity labels (``model``,
``rank``, ``tenant``, ``backend``). Names follow the serving-engine convention: a
``kvtier_`` prefix, ``_total`` on counters, base units (``_bytes``, ``_seconds``). Label
values that alerting needs (failure causes, rejection reasons, timed-out operations) are
emitted from the start with 0, so ``rate()`` sees the first increment. The backend's own
numeric ``stats()`` are exported generically as ``kvtier_backend_stat{name=...}``
(untyped: kvtier cannot know which are counters). docs/operating.md's list of metrics is
generated from the declarations. ``prometheus_client`` is imported only here, on demand.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from kvtier.cache.stats import LATENCY_BUCKETS, counter_values
from kvtier.core.errors import PrometheusMissingError
from kvtier.core.metrics import BACKEND_CALLS, Cause, family, series

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

#: Backend ``stats()`` keys that mean occupancy, each exported as its declared gauge too.
_OCCUPANCY = {
    "pages": "kvtier_storage_pages",
    "bytes": "kvtier_storage_bytes",
    "capacity_bytes": "kvtier_storage_capacity_bytes",
}


def _number(value: object) -> float | None:
    """``value`` as a float if it is a finite int or float (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


class _Families:
    """Builds declared metric families that carry one identity's labels (prometheus_client's)."""

    def __init__(self, identity: Mapping[str, str]) -> None:
        try:
            from prometheus_client import core
        except ImportError:
            raise PrometheusMissingError() from None
        self.core = core
        self.names = list(IDENTITY_LABELS)
        self.ident = [str(identity.get(name, "")) for name in IDENTITY_LABELS]

    def make(self, name: str) -> Any:
        """The empty family ``name``, as declared (an undeclared name raises)."""
        declared = family(name)
        build = {
            "counter": self.core.CounterMetricFamily,
            "gauge": self.core.GaugeMetricFamily,
            "histogram": self.core.HistogramMetricFamily,
            "untyped": self.core.UntypedMetricFamily,
        }[declared.kind]
        labels = [*self.names, *([declared.label] if declared.label else [])]
        return build(declared.name, declared.help, labels=labels)

    def by_label(self, family: Any, values: Mapping[str, float]) -> Any:
        for key, value in values.items():
            family.add_metric([*self.ident, key], value)
        return family

    def one(self, family: Any, value: float) -> Any:
        family.add_metric(self.ident, value)
        return family

    def tenant(self, name: str) -> list[str]:
        """The identity with ``name`` as its ``tenant`` label (a tenant's own series)."""
        at = IDENTITY_LABELS.index("tenant")
        return [*self.ident[:at], name, *self.ident[at + 1 :]]


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
            yield from _counter_families(f, "tiered_cache", counter_values(s))
            yield from _store_families(f, s["page_store"], s["backend_calls"], s["backend"])
            yield from _tier_families(f, s["tiers"])
            yield from _chain_families(f, s["events"], s["tenants"], s["tiers"])
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
    """A prometheus_client collector of one store's families: what every engine path
    (the vLLM connector's workers, the SGLang adapter) exposes of its storage, under the
    same names and labels as a TieredCache's (docs/operating.md). A storage chain's tiers
    are its tiers; a lone page store is tier ``0:<backend>``."""
    f = _Families(identity)

    class _Collector:
        """Reads the store's counters, its bounded calls and its backend's stats per scrape."""

        def collect(self) -> Iterator[Any]:
            stats = store.stats()
            yield from _store_families(f, stats, store.call_counts(), store.backend_stats())
            tier_stats = getattr(store, "tier_stats", None)
            if callable(tier_stats):
                tiers = tier_stats()
            else:
                tiers = [{"name": f"0:{identity.get('backend', '')}", "store": stats}]
            yield from _tier_families(f, tiers)

    return _Collector()


def _counter_families(
    f: _Families, counted_by: str, values: Mapping[str, Any], *, labels: str | None = None
) -> Iterator[Any]:
    """``counted_by``'s declared families whose label is ``labels`` (None: any but
    ``tier``, and none per tenant), each series the value of its counter in ``values``."""
    for name, members in series(counted_by).items():
        declared = family(name)
        if declared.per_tenant or (labels == "tier") != (declared.label == "tier"):
            continue
        built = f.make(name)
        for counter, value in members:
            number = float(values.get(counter, 0) or 0)
            if value is None:
                f.one(built, number)
            else:
                built.add_metric([*f.ident, value], number)
        yield built


def _store_families(
    f: _Families, store: Mapping[str, Any], calls: Mapping[str, Any], backend: Mapping[str, Any]
) -> Iterator[Any]:
    """A page store's counters (rejections, backend errors, timed-out and refused calls,
    prefix lookups), its bounded calls now, and its backend's stats."""
    yield from _counter_families(f, "page_store", store)
    yield f.one(f.make("kvtier_backend_late_returns"), calls["late_returns"])
    yield f.one(f.make("kvtier_backend_calls_stuck"), calls["stuck"])
    yield f.one(f.make("kvtier_backend_calls_stuck_max"), calls["max_abandoned"])
    numbers = {
        key: number
        for key, value in sorted(backend.items())
        if (number := _number(value)) is not None
    }
    for key, name in _OCCUPANCY.items():
        if key in numbers:
            yield f.one(f.make(name), numbers[key])
    yield f.by_label(f.make("kvtier_backend_stat"), numbers)
    yield f.one(f.make("kvtier_backend_stats_up"), 0 if "error" in backend else 1)


def _tier_value(tier: Mapping[str, Any], counter: str) -> float:
    """A counter of one tier's entry: the tier's own (``bytes_read`` summed over its page
    stores, the chain's counters), else its page store's."""
    value = tier.get(counter)
    if value is None:
        store = tier.get("store")
        value = store.get(counter, 0) if isinstance(store, Mapping) else 0
    return float(value or 0)


def _tier_families(f: _Families, tiers: list[dict[str, Any]]) -> Iterator[Any]:
    """The storage tiers' counters and gauges (label ``tier``: ``<index>:<backend>``)."""
    for counted_by in ("page_store", "storage_tier"):
        for name, members in series(counted_by).items():
            if family(name).label != "tier":
                continue
            built = f.make(name)
            for tier in tiers:
                for counter, _ in members:
                    built.add_metric([*f.ident, tier["name"]], _tier_value(tier, counter))
            yield built
    depth = f.make("kvtier_tier_queue_depth")
    occupancy = f.make("kvtier_tier_occupancy_bytes")
    for tier in tiers:
        depth.add_metric([*f.ident, tier["name"]], float(tier.get("queue_depth", 0)))
        if tier.get("occupancy_bytes") is not None:
            occupancy.add_metric([*f.ident, tier["name"]], float(tier["occupancy_bytes"]))
    yield depth
    yield occupancy


def _chain_families(
    f: _Families,
    events: Mapping[str, Any],
    tenants: Mapping[str, Any],
    tiers: list[dict[str, Any]],
) -> Iterator[Any]:
    """The storage chain's counters (its events; each tenant's, under the tenant's name as
    the identity's ``tenant`` label) and each tenant's bytes per tier."""
    values = {f"events_{key}": value for key, value in events.items()}
    yield from _counter_families(f, "storage_chain", values)
    for name, members in series("storage_chain").items():
        declared = family(name)
        if not declared.per_tenant:
            continue
        built = f.make(name)
        for tenant, entry in tenants.items():
            for counter, _ in members:
                built.add_metric(f.tenant(tenant), float(entry[counter.removeprefix("tenant_")]))
        yield built
    held = f.make("kvtier_tenant_bytes")
    for tenant, entry in tenants.items():
        for tier, nbytes in zip(tiers, entry["bytes"], strict=False):
            held.add_metric([*f.tenant(tenant), tier["name"]], float(nbytes))
    yield held


def _host_families(f: _Families, s: dict[str, Any]) -> Iterator[Any]:
    """A TieredCache's latency histograms, host pool and queues."""
    latency = f.make("kvtier_operation_latency_seconds")
    for op, h in s["latency_seconds"].items():
        cumulative, running = [], 0
        for bound, n in zip((*LATENCY_BUCKETS, float("inf")), h["buckets"], strict=True):
            running += n
            cumulative.append((_bound_text(bound), running))
        latency.add_metric([*f.ident, op], cumulative, h["sum"])
    yield latency
    pages = dict(s["host"]["pages"])
    pages["used"] = pages["total"] - pages["free"]
    yield f.by_label(f.make("kvtier_host_pages"), pages)
    page_bytes = s["page_bytes"]
    yield f.by_label(
        f.make("kvtier_host_bytes"),
        {"total": pages["total"] * page_bytes, "used": pages["used"] * page_bytes},
    )
    yield f.by_label(f.make("kvtier_queue_depth"), s["queues"])


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
