"""The tiered cache an engine embeds: device (L1) <-> host pool (L2) <-> storage (L3).

:class:`TieredCache` (in :mod:`kvtier.cache.tiered`) is a facade; each job has a module:
opening (``opening``), backup and per-layer assembly (``backup``), write policies and
storage writes (``writes``), prefetch and the fetch worker (``prefetch``), loading into
device slots (``load``), all sharing one ``context.CacheContext``; beside them the host
pool's key index (``index``), the worker threads (``workers``), the statistics
(``stats``) and their Prometheus view (``metrics``), the scheduling options (``options``)
and the handles it returns (``handles``). Backend calls are bounded in the core
(:mod:`kvtier.core.bounded`, through the page store).
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
