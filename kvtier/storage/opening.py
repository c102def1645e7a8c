"""Opening a plan's storage without a device: every tier's page store over one page
memory, the chain in front of them (:func:`open_store`)."""

from __future__ import annotations

from collections.abc import Callable

from kvtier.core.bounded import DEFAULT_CALL_TIMEOUT_S, DEFAULT_MAX_ABANDONED
from kvtier.core.capabilities import ResolvedPlan, open_page_store
from kvtier.core.errors import PluginError
from kvtier.core.pagestore import PageMemory, PageStore
from kvtier.core.renames import renamed_keywords
from kvtier.core.space import ReportsSpace
from kvtier.core.specs import Feature
from kvtier.storage.cascade import DEFAULT_QUEUE_PAGES
from kvtier.storage.chain import StorageChain
from kvtier.storage.observed import Departure, ObservedEviction
from kvtier.storage.pins import PinSet
from kvtier.storage.tiers import Tenants, Tier

__all__ = ["open_store"]


@renamed_keywords
def open_store(
    plan: ResolvedPlan,
    pool: PageMemory,
    *,
    checksum_workers: int = 1,
    backend_call_timeout_s: float | None = DEFAULT_CALL_TIMEOUT_S,
    max_abandoned_calls: int = DEFAULT_MAX_ABANDONED,
    queue_pages: int = DEFAULT_QUEUE_PAGES,
) -> StorageChain:
    """Open every storage tier of ``plan`` over ``pool`` and the chain in front of them.

    Each tier's eviction policy is built here and handed to its backend. A backend that
    reports its space (``Feature.REPORTS_SPACE``) is handed it owned: the tier's space
    manager alone chooses its victims (:mod:`kvtier.storage.space`); another backend's
    capacity evicts through it (and the chain's pins). A tier that fails to open closes
    the ones opened before it. ``queue_pages`` bounds the pages waiting to cascade or
    promote.
    """
    tiers: list[Tier] = []
    chain_box: list[StorageChain] = []
    pins = PinSet()
    tenants = Tenants(plan)

    def removed(index: int) -> Callable[[str, Departure], None]:
        def forward(key: str, how: Departure) -> None:
            if chain_box:
                chain_box[0].removed(index, key, how)

        return forward

    try:
        for tier_plan in plan.storage_tiers():
            eviction = None
            if tier_plan.eviction is not None:
                eviction = ObservedEviction(
                    tier_plan.eviction.build(),
                    removed(tier_plan.index),
                    pins=pins,
                    tenant_of=tenants.of if tenants else None,
                    tokens=plan.geometry.page_size,
                    owned=Feature.REPORTS_SPACE in tier_plan.backend.features,
                )
            store = open_page_store(
                plan,
                pool,
                checksum_workers=checksum_workers,
                backend_call_timeout_s=backend_call_timeout_s,
                max_abandoned_calls=max_abandoned_calls,
                tier=tier_plan.index,
                eviction=eviction,
            )
            _check_reports(tier_plan.backend.name, store, eviction)
            admission = tier_plan.admission.build() if tier_plan.admission is not None else None
            tiers.append(Tier(tier_plan, store, eviction, admission))
        chain = StorageChain(plan, tiers, pool, queue_pages=queue_pages, pins=pins)
    except BaseException:
        for tier in reversed(tiers):
            tier.store.close()
        raise
    chain_box.append(chain)
    return chain


def _check_reports(name: str, store: PageStore, eviction: ObservedEviction | None) -> None:
    """A backend that declares ``reports_space`` must implement it (it was handed an owned
    policy: it makes no room on its own, so a manager that cannot ask it would let the tier
    fill for good)."""
    backend = store.backend
    if eviction is None or not eviction.space_owned or isinstance(backend, ReportsSpace):
        return
    store.close()
    raise PluginError(
        f"backend {name!r} declares {Feature.REPORTS_SPACE.value!r} but "
        f"{type(backend).__name__} has no space() and page_cost() "
        "(kvtier.core.space.ReportsSpace): implement them, or drop the feature",
        value=name,
    )
