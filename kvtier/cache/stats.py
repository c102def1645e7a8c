"""TieredCache statistics: counters, latency histograms, and the optional Prometheus view.

Counters and histograms are plain thread-safe objects updated on the data path; a
snapshot is a nested dict for logs, ``--json`` and tests. The Prometheus collector reads
the same snapshot, so both views always agree; ``prometheus_client`` is imported only when
an exposition is asked for.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterator
from typing import Any

from kvtier.core.errors import PrometheusMissingError

__all__ = [
    "LATENCY_BUCKETS",
    "CacheStats",
    "Histogram",
    "prometheus_collector",
    "prometheus_text",
]

#: Upper bounds, in seconds, of the latency histogram buckets (the last is +Inf).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

#: The latency histograms a cache keeps, one per operation.
OPERATIONS = ("backup", "device_to_host", "storage_put", "prefetch", "storage_get", "load")


class Histogram:
    """A fixed-bucket latency histogram (seconds), cheap to observe from many threads."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self._counts = [0] * (len(buckets) + 1)
        self._sum = 0.0
        self._count = 0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        """Record one duration."""
        index = bisect.bisect_left(self.buckets, seconds)
        with self._lock:
            self._counts[index] += 1
            self._sum += seconds
            self._count += 1

    def snapshot(self) -> dict[str, Any]:
        """Count, sum, per-bucket counts (not cumulative) and p50 / p99 estimates."""
        with self._lock:
            counts = list(self._counts)
            total, count = self._sum, self._count
        return {
            "count": count,
            "sum": total,
            "buckets": counts,
            "p50": _quantile(self.buckets, counts, count, 0.5),
            "p99": _quantile(self.buckets, counts, count, 0.99),
        }


def _quantile(bounds: tuple[float, ...], counts: list[int], total: int, q: float) -> float | None:
    """The upper bound of the bucket holding quantile ``q`` (None when empty)."""
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, n in enumerate(counts):
        seen += n
        if seen >= rank and n:
            return bounds[i] if i < len(bounds) else float("inf")
    return float("inf")


class CacheStats:
    """Every counter and histogram of one TieredCache."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._seconds: dict[str, float] = {}
        self._failures: dict[str, int] = {}
        self.latency = {op: Histogram() for op in OPERATIONS}

    def add(self, name: str, amount: int = 1) -> None:
        """Add to a named counter (pages, bytes, events)."""
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + amount

    def busy(self, name: str, seconds: float, nbytes: int) -> None:
        """Record a transfer of ``nbytes`` that took ``seconds``, for bytes and bandwidth."""
        with self._lock:
            self._counts[f"bytes_{name}"] = self._counts.get(f"bytes_{name}", 0) + nbytes
            self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    def fail(self, cause: str, pages: int = 1) -> None:
        """Count ``pages`` failed for ``cause`` (queue_full, host_exhausted, backend, ...)."""
        with self._lock:
            self._failures[cause] = self._failures.get(cause, 0) + pages

    def get(self, name: str) -> int:
        """One counter's value (0 when never touched)."""
        with self._lock:
            return self._counts.get(name, 0)

    def failures(self) -> dict[str, int]:
        """Failed pages by cause."""
        with self._lock:
            return dict(self._failures)

    def snapshot(self) -> dict[str, Any]:
        """A nested dict: pages, hits per tier, bytes, bandwidth, latency, failures."""
        with self._lock:
            counts = dict(self._counts)
            seconds = dict(self._seconds)
            failures = dict(self._failures)

        def c(name: str) -> int:
            return counts.get(name, 0)

        host_q = c("host_hits") + c("host_misses")
        storage_q = c("storage_hits") + c("storage_misses")
        bytes_moved = {
            name: c(f"bytes_{name}")
            for name in ("device_to_host", "host_to_device", "storage_read", "storage_write")
        }
        bandwidth = {
            name: (bytes_moved[name] / seconds[name]) if seconds.get(name) else 0.0
            for name in bytes_moved
        }
        return {
            "host": {
                "hits": c("host_hits"),
                "misses": c("host_misses"),
                "hit_rate": c("host_hits") / host_q if host_q else 0.0,
                "evictions": c("evictions"),
            },
            "storage": {
                "hits": c("storage_hits"),
                "misses": c("storage_misses"),
                "hit_rate": c("storage_hits") / storage_q if storage_q else 0.0,
                "pages_read": c("storage_pages_read"),
                "pages_written": c("storage_pages_written"),
                "writes_skipped": c("storage_writes_skipped"),
                "write_backs": c("write_backs"),
            },
            "pages": {
                "backed_up": c("pages_backed_up"),
                "backup_already_cached": c("backup_already_cached"),
                "prefetched": c("pages_prefetched"),
                "loaded": c("pages_loaded"),
                "cancelled": c("pages_cancelled"),
            },
            "bytes": bytes_moved,
            "bandwidth_bytes_per_s": bandwidth,
            "latency_seconds": {op: h.snapshot() for op, h in self.latency.items()},
            "failures": failures,
            "failures_total": sum(failures.values()),
        }


def prometheus_collector(
    snapshot: Callable[[], dict[str, Any]], gauges: Callable[[], dict[str, dict[str, int]]]
) -> Any:
    """A prometheus_client collector over a cache's stats (import of prometheus_client here)."""
    try:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )
    except ImportError:
        raise PrometheusMissingError() from None

    class _Collector:
        """Reads one stats snapshot per scrape and yields kvtier_* metric families."""

        def collect(self) -> Iterator[Any]:
            s = snapshot()
            for tier in ("host", "storage"):
                for what in ("hits", "misses"):
                    family = CounterMetricFamily(
                        f"kvtier_{tier}_{what}",
                        f"Pages looked up in the {tier} tier that were {what}.",
                    )
                    family.add_metric([], s[tier][what])
                    yield family
            evictions = CounterMetricFamily(
                "kvtier_host_evictions", "Host-pool pages evicted (LRU)."
            )
            evictions.add_metric([], s["host"]["evictions"])
            yield evictions
            pages = CounterMetricFamily(
                "kvtier_pages", "Pages handled, by operation.", labels=["operation"]
            )
            for op, value in s["pages"].items():
                pages.add_metric([op], value)
            pages.add_metric(["storage_read"], s["storage"]["pages_read"])
            pages.add_metric(["storage_write"], s["storage"]["pages_written"])
            yield pages
            moved = CounterMetricFamily(
                "kvtier_transferred_bytes", "Bytes moved, by direction.", labels=["direction"]
            )
            for direction, value in s["bytes"].items():
                moved.add_metric([direction], value)
            yield moved
            failures = CounterMetricFamily(
                "kvtier_failures", "Failed pages, by cause.", labels=["cause"]
            )
            for cause, value in sorted(s["failures"].items()):
                failures.add_metric([cause], value)
            yield failures
            latency = HistogramMetricFamily(
                "kvtier_operation_latency_seconds",
                "Latency of cache operations.",
                labels=["operation"],
            )
            for op, h in s["latency_seconds"].items():
                cumulative, running = [], 0
                for bound, n in zip((*LATENCY_BUCKETS, float("inf")), h["buckets"], strict=True):
                    running += n
                    cumulative.append((_bound_text(bound), running))
                latency.add_metric([op], cumulative, h["sum"])
            yield latency
            for name, values in gauges().items():
                gauge = GaugeMetricFamily(
                    f"kvtier_{name}", f"Current {name.replace('_', ' ')}.", labels=["state"]
                )
                for state, value in values.items():
                    gauge.add_metric([state], value)
                yield gauge

    return _Collector()


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
