"""TieredCache statistics: counters and latency histograms.

Counters and histograms are plain thread-safe objects updated on the data path; a
snapshot is a nested dict for logs, ``--json`` and tests. The Prometheus view
(:mod:`kvtier.cache.metrics`) reads the same snapshot, so both views always agree.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

__all__ = ["LATENCY_BUCKETS", "OPERATIONS", "CacheStats", "Histogram"]

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
            "busy_seconds": {name: seconds.get(name, 0.0) for name in bytes_moved},
            "latency_seconds": {op: h.snapshot() for op, h in self.latency.items()},
            "failures": failures,
            "failures_total": sum(failures.values()),
        }
