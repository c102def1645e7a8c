"""Asking which pages a plan's storage holds, without page memory: :func:`open_lookup`
opens every tier's page store over :class:`NoPages` and answers ``exists`` across them
(what a scheduler asks), with no staging, no cascade and no worker.

:func:`exists_across` is the one fan-out of ``exists`` over tiers, shared with the chain.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvtier.core.bounded import DEFAULT_CALL_TIMEOUT_S, DEFAULT_MAX_ABANDONED, Outcome
from kvtier.core.capabilities import ResolvedPlan, open_page_store
from kvtier.core.errors import StorageError
from kvtier.core.extents import Extent
from kvtier.core.layout import Layout
from kvtier.core.pagestore import BatchResult, PageStore
from kvtier.core.renames import renamed_keywords
from kvtier.storage.stats import call_counts, store_stats

__all__ = ["ExistsView", "NoPages", "exists_across", "open_lookup"]


def exists_across(
    stores: Sequence[PageStore],
    keys: Sequence[str],
    failed: Callable[[int], None] | None = None,
) -> BatchResult:
    """Whether any of ``stores`` (tiers, fastest first) holds each key: one batched call
    per tier, for the keys not found above. A tier whose call fails counts as holding
    none of them (``failed(index)`` is told); a single tier's failed answer is returned."""
    keys = list(keys)
    found = [False] * len(keys)
    todo = list(range(len(keys)))
    for index, store in enumerate(stores):
        if not todo:
            break
        answer = store.exists([keys[i] for i in todo])
        if answer.outcome is not Outcome.OK:
            if failed is not None:
                failed(index)
            if len(stores) == 1:
                return answer
            continue
        rest = []
        for i, ok in zip(todo, answer, strict=True):
            if ok:
                found[i] = True
            else:
                rest.append(i)
        todo = rest
    return BatchResult(found)


class NoPages:
    """The page memory of storage that is only asked ``exists``: it never moves a page."""

    def __init__(self, layout: Layout) -> None:
        self._layout = layout

    @property
    def layout(self) -> Layout:
        return self._layout

    def extents(self, page: int) -> list[Extent]:
        raise StorageError(
            f"this kvtier storage was opened for lookups only and holds no KV pages (page "
            f"{page} asked); open it with kvtier.storage.open_store over a page memory to "
            "move pages",
            value=page,
        )

    def header_extent(self, page: int) -> Extent:
        return self.extents(page)[0]

    def page_buffers(self, page: int) -> list[Extent]:
        return self.extents(page)


class ExistsView:
    """A plan's tiers, asked which keys they hold (an
    :class:`~kvtier.core.store.ExistsLookup`); nothing is read, written or evicted."""

    def __init__(self, stores: list[PageStore]) -> None:
        self.stores = stores

    def exists(self, keys: Sequence[str]) -> BatchResult:
        """Whether any tier holds each key."""
        return exists_across(self.stores, keys)

    def prefix_hits(self, keys: Sequence[str]) -> int:
        """How many leading keys some tier holds."""
        if len(self.stores) == 1:
            return self.stores[0].prefix_hits(keys)
        return self.exists(keys).leading()

    def stats(self) -> dict[str, int | float]:
        """The page stores' counters, summed over the tiers."""
        return store_stats(self.stores)

    def call_counts(self) -> dict[str, Any]:
        """The bounded calls of every tier, summed (as a chain sums them)."""
        return call_counts(self.stores)

    def close(self, timeout: float | None = None) -> bool:
        """Close every tier's backend."""
        return all([store.close(timeout) for store in reversed(self.stores)])


@renamed_keywords
def open_lookup(
    plan: ResolvedPlan,
    *,
    checksum_workers: int = 1,
    backend_call_timeout_s: float | None = DEFAULT_CALL_TIMEOUT_S,
    max_abandoned_calls: int = DEFAULT_MAX_ABANDONED,
) -> ExistsView:
    """Open every storage tier of ``plan`` for ``exists`` only (see the module docstring).

    Each tier's backend gets its eviction policy as :func:`~kvtier.storage.open_store`
    gives it (a backend may need one to open); a tier that fails to open closes the ones
    opened before it. ``checksum_workers`` is accepted (and unused) so the engines' page
    store options can be passed as they are.
    """
    del checksum_workers  # nothing is checked: no page is read
    memory = NoPages(plan.layout)
    stores: list[PageStore] = []
    try:
        for tier_plan in plan.storage_tiers():
            eviction = tier_plan.eviction.build() if tier_plan.eviction is not None else None
            stores.append(
                open_page_store(
                    plan,
                    memory,
                    backend_call_timeout_s=backend_call_timeout_s,
                    max_abandoned_calls=max_abandoned_calls,
                    tier=tier_plan.index,
                    eviction=eviction,
                )
            )
    except BaseException:
        for store in reversed(stores):
            store.close()
        raise
    return ExistsView(stores)
