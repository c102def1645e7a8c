"""A chain's figures, merged from its tiers: a page store's counters summed, each tier's
own entry (its page store's and the chain's counters, occupancy, queue depth), the
bounded calls, and the backends' own stats."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvtier.core.pagestore import PageStore
from kvtier.core.storage import Counters
from kvtier.storage.cascade import Cascade
from kvtier.storage.tiers import TIER_COUNTERS, Tier

__all__ = ["backend_stats", "call_counts", "store_stats", "tier_stats"]


def store_stats(
    stores: Sequence[PageStore], counters: Counters | None = None
) -> dict[str, int | float]:
    """The page stores' counters summed over the tiers, and the chain's own prefix
    lookups (``counters``; a page store's names)."""
    if len(stores) == 1:
        return stores[0].stats()
    merged: dict[str, int | float] = {}
    for store in stores:
        for key, value in store.stats().items():
            merged[key] = merged.get(key, 0) + value
    chain = counters.snapshot() if counters is not None else {}
    for name in ("prefix_queries", "prefix_pages"):
        merged[name] = merged.get(name, 0) + chain.get(name, 0)
    return merged


def tier_stats(tiers: list[Tier], cascade: Cascade) -> list[dict[str, Any]]:
    """Each tier: its name, backend, page store counters, chain counters, the bytes
    read from and written to it (``bytes_read``, ``bytes_written``: its page stores'
    summed), occupancy, and the pages queued to be written into it."""
    out = []
    depths = cascade.depths()
    for tier in tiers:
        moved = cascade.staging_stats(tier)
        store = tier.store.stats()
        entry: dict[str, Any] = {
            "tier": tier.index,
            "name": tier.name,
            "backend": tier.plan.backend.name,
            "write": tier.plan.write,
            "promote": tier.plan.promote,
            "capacity_bytes": tier.plan.capacity_bytes,
            "occupancy_bytes": tier.eviction.nbytes if tier.eviction is not None else None,
            "queue_depth": depths[tier.index],
            "store": store,
        }
        counts: dict[str, int | float] = dict.fromkeys(TIER_COUNTERS, 0)
        counts.update(tier.counters.snapshot())
        # the page store's bytes, summed over the tier's page stores: every byte in and
        # out of the tier, the engine's and the chain's moves (one name per quantity)
        for name in ("bytes_read", "bytes_written"):
            counts[name] = store[name] + moved.get(name, 0)
        entry.update(counts)
        out.append(entry)
    return out


def call_counts(stores: Iterable[PageStore]) -> dict[str, Any]:
    """The bounded calls of every tier's page store, summed."""
    merged: dict[str, Any] = {"timed_out_by_operation": {}}
    for store in stores:
        for key, value in store.call_counts().items():
            if key == "timed_out_by_operation":
                for op, n in value.items():
                    merged[key][op] = merged[key].get(op, 0) + n
            else:
                merged[key] = merged.get(key, 0) + value
    return merged


def backend_stats(tiers: list[Tier], timeout: float | None = None) -> dict[str, Any]:
    """The first tier's backend stats, and each further tier's as ``tier<i>.<name>``."""
    out: dict[str, Any] = {}
    for tier in tiers:
        store = tier.store
        values = store.backend_stats() if timeout is None else store.backend_stats(timeout)
        if tier.index == 0:
            out.update(values)
        else:
            out.update({f"tier{tier.index}.{k}": v for k, v in values.items()})
    return out
