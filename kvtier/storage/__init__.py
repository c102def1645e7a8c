"""The storage layer: a plan's tiers behind one page memory, with the page store's API.

:func:`open_store` opens them (no device needed) and returns a :class:`StorageChain`;
:func:`open_lookup` opens them for ``exists`` only (a scheduler's :class:`ExistsView`);
each job of the chain has a module: routing of get, exists, put, delete (``chain``), the
cascade queue, its worker and staging (``cascade``, ``staging``, ``late``), placement:
write-back, quotas, admission, promotions (``placement``), the figures (``stats``); beside
them a tier's watched eviction policy (``observed``), pins (``pins``), key fences
(``fences``) and the events of pages entering and leaving tiers (``events``).
"""

from __future__ import annotations

from kvtier.storage.chain import StorageChain
from kvtier.storage.lookup import ExistsView, NoPages, open_lookup
from kvtier.storage.opening import open_store
from kvtier.storage.tiers import Tier

__all__ = ["ExistsView", "NoPages", "StorageChain", "Tier", "open_lookup", "open_store"]
