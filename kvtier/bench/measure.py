"""What the single workload measures per path: timings, and the target a ratio must reach.

A :class:`Timing` holds one path's calls over the timed rounds (how many pages one call
moves is part of it, so a p50 is never read without knowing what one call was) and how
many of its pages failed; a path with a failed page gets no ratio, since a time taken
by failing calls says nothing about the path.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.bench.options import GB
from kvtier.core.specs import BackendSpec, Feature

__all__ = [
    "LOCAL_DISK_TARGET",
    "THREADS_TARGET",
    "Timing",
    "percentile",
    "ratio",
    "ratio_target",
]

#: The ``kvtier / raw`` ratio a backend that stores pages as local files must reach: its
#: index, atomic publication and envelope (checksum included: it is computed as the
#: bytes land) may cost at most 10 % against a raw ``os.pwritev`` / ``os.preadv`` loop of
#: the same bytes in one thread (the target ``benchmarks/file.py`` sets).
LOCAL_DISK_TARGET = 0.9
#: The ratio to raw calls spread over as many threads as the backend uses (what LMCache's
#: local-disk pool does): at least as fast.
THREADS_TARGET = 1.0


@dataclass
class Timing:
    """One path's per-call durations over all timed rounds, and its failed pages."""

    bytes_per_round: int
    pages_per_call: int
    calls: list[float] = field(default_factory=list)
    rounds: list[float] = field(default_factory=list)
    failed_pages: int = 0

    def add_round(self, total: float, calls: Sequence[float]) -> None:
        """Record one timed round: its total time and each call's time."""
        self.rounds.append(total)
        self.calls.extend(calls)

    def summary(self) -> dict[str, float | int]:
        """GB/s (median over rounds), p50 / p99 latency of one call in ms, what a call is."""
        rates = [self.bytes_per_round / t / GB for t in self.rounds if t > 0]
        calls = sorted(self.calls)
        return {
            "gbps": round(statistics.median(rates), 3) if rates else 0.0,
            "p50_ms": round(percentile(calls, 50) * 1e3, 3),
            "p99_ms": round(percentile(calls, 99) * 1e3, 3),
            "pages_per_call": self.pages_per_call,
            "failed_pages": self.failed_pages,
        }


def percentile(values: Sequence[float], pct: float) -> float:
    """The ``pct`` percentile of sorted ``values`` (linear interpolation), 0 when empty."""
    if not values:
        return 0.0
    rank = (len(values) - 1) * pct / 100
    low = int(rank)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (rank - low)


def ratio(ours: Timing, raw: Timing) -> float | None:
    """ours / raw GB/s; None when either side had a failed page or measured nothing."""
    if ours.failed_pages or raw.failed_pages:
        return None
    mine, theirs = ours.summary()["gbps"], raw.summary()["gbps"]
    if not mine or not theirs:
        return None
    return round(mine / theirs, 3)


def ratio_target(
    spec: BackendSpec, verify: str, *, threads: bool = False
) -> tuple[dict[str, float | None], str]:
    """The ``kvtier / raw`` ratio ``spec``'s backend should reach per operation, and why.

    The raw side writes one file per page in the work directory. A persistent backend
    that is not shared across nodes stores pages as local files too, so the same disk is
    the yardstick: against one raw thread the backend may cost 10 %
    (``benchmarks/file.py``'s target), checksums included under either ``verify`` mode
    (they are computed as the bytes land); against raw calls on as many threads as it
    uses (``threads``) it must be at least as fast. Any other backend (host memory, a
    network store) moves bytes on another medium, and its ratio is for information only.
    """
    local = Feature.PERSISTENT in spec.features and Feature.SHARED_NODES not in spec.features
    if not local:
        return {"put": None, "get": None}, (
            f"no target: raw I/O writes local files and {spec.name!r} stores elsewhere, so "
            "the ratio is for information"
        )
    target = THREADS_TARGET if threads else LOCAL_DISK_TARGET
    checks = "its checksums" if verify == "full" else "its header checks"
    if threads:
        why = "target: at least as fast as raw I/O spread over as many threads"
    else:
        why = (
            f"targets: a backend on local disk, {checks} included, may cost "
            f"{1 - LOCAL_DISK_TARGET:.0%} against raw I/O of the same bytes in one thread"
        )
    return {"put": target, "get": target}, why
