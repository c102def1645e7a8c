"""What the SGLang adapter reports: SGLang's StorageMetrics windows and kvtier's counters.

SGLang's ``StorageMetricsCollector`` accepts only its own ``StorageMetrics`` class, which
lives in a module that needs SGLang's serving stack; where that module cannot be imported,
a class with the same fields stands in (one WARNING, counted as ``metrics_fallback``).
Which window fills which field is declared once (:data:`kvtier.core.families.STORAGE_METRICS`);
the stand-in's fields and :meth:`TransferWindows.take` are generated from it.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Literal

from kvtier.core.families import STORAGE_METRICS
from kvtier.core.metrics import zeroed
from kvtier.core.storage import Counters
from kvtier.integrations.sglang.pools import AttachedPool
from kvtier.integrations.sglang.settings import DOCS

__all__ = [
    "StorageMetricsShape",
    "TransferWindows",
    "kvtier_stats",
    "storage_metrics_class",
]

log = logging.getLogger(__name__)

#: SGLang's two transfer directions: host <- storage, and host -> storage.
Direction = Literal["prefetch", "backup"]


#: SGLang's StorageMetrics fields (a list each), for SGLang builds whose metrics module is
#: absent: generated from the declared fields.
StorageMetricsShape: type = make_dataclass(
    "StorageMetricsShape",
    [(spec.field, list[Any], field(default_factory=list)) for spec in STORAGE_METRICS],
)
StorageMetricsShape.__module__ = __name__
StorageMetricsShape.__doc__ = (
    "SGLang's StorageMetrics fields, for SGLang builds whose metrics module is absent."
)


@functools.lru_cache(maxsize=1)
def storage_metrics_class() -> Any:
    """SGLang's StorageMetrics, or the same fields in our class (one WARNING) without it."""
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics
    except Exception as exc:  # SGLang without its serving stack: same fields, our class
        log.warning(
            "kvtier: SGLang's metrics module (sglang.srt.observability.metrics_collector) "
            "failed to import (%r), so get_stats() returns kvtier's class with the same "
            "fields; SGLang's StorageMetricsCollector would refuse it. A full SGLang "
            "install has the module (%s)",
            exc,
            DOCS,
        )
        return StorageMetricsShape
    return StorageMetrics


@dataclass
class _Window:
    """One direction's pages and GB/s per call since SGLang last asked."""

    pages: list[int] = field(default_factory=list)
    bandwidth: list[float] = field(default_factory=list)


class TransferWindows:
    """Pages and GB/s of each prefetch and backup call, until SGLang's ``get_stats``.

    ``enabled`` is SGLang's ``enable_storage_metrics``: off, nothing is recorded.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()
        self._windows = {"prefetch": _Window(), "backup": _Window()}

    def record(self, direction: Direction, pages: int, nbytes: int, seconds: float) -> None:
        """One call that moved ``pages`` pages (``nbytes`` bytes) in ``seconds``."""
        if not self.enabled or pages == 0:
            return
        with self._lock:
            window = self._windows[direction]
            window.pages.append(pages)
            window.bandwidth.append(nbytes / max(seconds, 1e-9) / 1e9)

    def take(self) -> Any:
        """A fresh SGLang StorageMetrics holding the windows, which start over."""
        metrics = storage_metrics_class()()  # SGLang's collector asserts that exact class
        with self._lock:
            windows = self._windows
            self._windows = {"prefetch": _Window(), "backup": _Window()}
        for spec in STORAGE_METRICS:
            getattr(metrics, spec.field).extend(getattr(windows[spec.direction], spec.quantity))
        return metrics


def kvtier_stats(
    counters: Counters, kv: Sequence[AttachedPool[Any]], extra: Iterable[AttachedPool[Any]]
) -> dict[str, int | float]:
    """kvtier's counters: the adapter's, the KV pool's page stores and backends
    (``backend_*``; summed over the head slices where SGLang splits heads, so they count
    stored objects), and each extra pool's under its name (``mamba_invalid``,
    ``mamba_backend_puts``)."""
    stats = zeroed("sglang")
    stats["metrics_fallback"] = int(storage_metrics_class() is StorageMetricsShape)
    stats.update(counters.snapshot())
    kv_stats: dict[str, int | float] = {}
    for shard in kv:
        for name, value in shard.stats().items():
            kv_stats[name] = kv_stats.get(name, 0) + value
    stats.update(kv_stats)
    for pool in extra:
        stats.update(pool.stats(f"{pool.name}_"))
    return stats
