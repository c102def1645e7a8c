"""TieredCache statistics: counters and latency histograms.

Counters and histograms are plain thread-safe objects updated on the data path; a
snapshot is a nested dict for logs, ``--json`` and tests. The Prometheus view
(:mod:`kvtier.cache.metrics`) reads the same snapshot, so both views always agree. The
counters are the ``tiered_cache`` ones of :data:`kvtier.core.metrics.COUNTERS`, counted
under their registered names (counting a name missing there raises), and the snapshot's
nesting is generated from them by one rule (``host_hits`` is ``stats()["host"]["hits"]``,
a family's member ``bytes_storage_read`` is ``stats()["bytes"]["storage_read"]``).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Mapping
from typing import Any

from kvtier.core.metrics import COUNTERS, DIRECTIONS, registered_counters

__all__ = ["LATENCY_BUCKETS", "OPERATIONS", "CacheStats", "Histogram", "counter_values"]

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
        self._counters = registered_counters("tiered_cache")
        self.latency = {op: Histogram() for op in OPERATIONS}

    def add(self, name: str, amount: int = 1) -> None:
        """Add to a registered counter (pages, bytes, events)."""
        self._counters.add(name, amount)

    def busy(self, direction: str, seconds: float, nbytes: int) -> None:
        """Record a transfer of ``nbytes`` that took ``seconds``, for bytes and bandwidth."""
        self._counters.add(f"bytes_{direction}", nbytes)
        self._counters.add(f"busy_seconds_{direction}", seconds)

    def fail(self, cause: str, pages: int = 1) -> None:
        """Count ``pages`` failed for ``cause`` (a :class:`~kvtier.core.metrics.Cause` value)."""
        self._counters.add(f"failures_{cause}", pages)

    def get(self, name: str) -> int | float:
        """One counter's value (0 when never touched)."""
        return self._counters.snapshot().get(name, 0)

    def failures(self) -> dict[str, int]:
        """Failed pages by cause (the causes that failed any)."""
        return _failures(self._counters.snapshot())

    def snapshot(self) -> dict[str, Any]:
        """A nested dict: pages, hits per tier, bytes, bandwidth, latency, failures."""
        counts = self._counters.snapshot()

        def c(name: str) -> int:
            return int(counts.get(name, 0))

        def ratio(part: dict[str, Any]) -> float:
            asked = part["hits"] + part["misses"]
            return part["hits"] / asked if asked else 0.0

        # each counter ``<part>_<key>`` as ``[part][key]``, in the registry's order
        nested: dict[str, dict[str, Any]] = {}
        for spec in COUNTERS["tiered_cache"]:
            if not spec.suffixes:  # the by-member families (bytes, failures) follow
                part, key = spec.name.split("_", 1)
                nested.setdefault(part, {})[key] = c(spec.name)
        for tier in ("host", "storage"):
            nested[tier]["hit_rate"] = ratio(nested[tier])
        bytes_moved = {d: c(f"bytes_{d}") for d in DIRECTIONS}
        seconds = {d: float(counts.get(f"busy_seconds_{d}", 0.0)) for d in DIRECTIONS}
        failures = _failures(counts)
        return {
            **nested,
            "bytes": bytes_moved,
            "bandwidth_bytes_per_s": {
                d: bytes_moved[d] / seconds[d] if seconds[d] else 0.0 for d in DIRECTIONS
            },
            "busy_seconds": seconds,
            "latency_seconds": {op: h.snapshot() for op, h in self.latency.items()},
            "failures": failures,
            "failures_total": sum(failures.values()),
        }


def _failures(counts: dict[str, int | float]) -> dict[str, int]:
    """Failed pages by cause, from the ``failures_<cause>`` counters (in first-failure order)."""
    prefix = "failures_"
    return {
        name[len(prefix) :]: int(value) for name, value in counts.items() if name.startswith(prefix)
    }


def counter_values(snapshot: Mapping[str, Any]) -> dict[str, int | float]:
    """A snapshot's ``tiered_cache`` counters by registered name, read where
    :meth:`CacheStats.snapshot` nests them (``<part>_<key>`` as ``[part][key]``: ``host_hits``
    as ``["host"]["hits"]``; a family's member as ``[family][suffix]``: ``bytes_storage_read``
    as ``["bytes"]["storage_read"]``); 0 for one not there (a cause that never failed)."""
    out: dict[str, int | float] = {}
    for spec in COUNTERS["tiered_cache"]:
        if spec.suffixes:
            nested = snapshot.get(spec.name, {})
            for suffix in spec.suffixes:
                out[f"{spec.name}_{suffix}"] = nested.get(suffix, 0)
        else:
            part, key = spec.name.split("_", 1)
            out[spec.name] = snapshot.get(part, {}).get(key, 0)
    return out
