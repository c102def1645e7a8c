"""The tiered cache an engine embeds: device (L1) <-> host pool (L2) <-> storage (L3).

:class:`TieredCache` (in :mod:`kvtier.cache.tiered`) is the object; its parts each have a
module: the host pool's key index (``index``), the worker threads (``workers``), the
bounded backend calls (``bounded``), the statistics (``stats``) and their Prometheus view
(``metrics``), the scheduling options (``options``) and the handles it returns
(``handles``).
"""

from __future__ import annotations

from kvtier.cache.handles import BackupHandle, PrefetchHandle
from kvtier.cache.options import CacheOptions
from kvtier.cache.tiered import TieredCache, open_cache
from kvtier.core.errors import CacheClosedError

__all__ = [
    "BackupHandle",
    "CacheClosedError",
    "CacheOptions",
    "PrefetchHandle",
    "TieredCache",
    "open_cache",
]
