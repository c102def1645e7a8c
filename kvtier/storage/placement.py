"""Where a page goes: descriptions for the tiers' policies, admission (and its re-offers
after hits), promotions, and the hand-down of a write-back tier's upper tier's victims.
What leaves a tier (room for a put, tenant quotas) is its space manager's decision
(:mod:`kvtier.storage.space`); this module routes its puts and removals to it.

A description tells a policy each page's parent (:mod:`kvtier.storage.parents`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvtier.core.pagestore import BatchResult, PageStore
from kvtier.core.policy import PageInfo
from kvtier.core.saveguard import SaveGuard
from kvtier.storage.cascade import Cascade, Job
from kvtier.storage.events import EventKind
from kvtier.storage.fences import Ticket
from kvtier.storage.late import LateWrite, MakeLate, undo_revoked
from kvtier.storage.observed import Departure
from kvtier.storage.parents import ParentMemo, batch_parents
from kvtier.storage.space import SpaceManager
from kvtier.storage.tiers import ChainParts, Tier, keys_where

__all__ = ["Placement"]

log = logging.getLogger("kvtier.cache")

#: Keys a tier's admission refused that a later hit may offer again, per tier.
_REFUSED_KEEP = 1 << 16


class Placement:
    """The chain's placement decisions over its tiers (see the module docstring)."""

    def __init__(self, parts: ChainParts, cascade: Cascade) -> None:
        self.parts = parts
        self.cascade = cascade
        tiers = parts.tiers
        self._refused: list[OrderedDict[str, None]] = [OrderedDict() for _ in tiers]
        #: Per tier: the one decider of what leaves it (:mod:`kvtier.storage.space`).
        self.spaces = [SpaceManager(parts, tier, self._hand_down) for tier in tiers]
        #: The parents pages were described with, for their later moves.
        self.parents = ParentMemo()

    # --- policies: descriptions, quotas, admission ----------------------------------------

    def describe(
        self, tier: Tier, keys: Sequence[str], parents: Sequence[str | None] | None = None
    ) -> None:
        """Tell ``tier``'s policies about pages about to enter it: each page's parent is
        its entry in ``parents`` (None: the key before it in ``keys``, see
        :func:`~kvtier.storage.parents.batch_parents`); remembered for its later moves."""
        if tier.eviction is None and tier.admission is None:
            return
        if parents is None:
            parents = batch_parents(keys)
        self.parents.remember(keys, parents)
        eviction, admission = tier.eviction, tier.admission
        tokens, tenant_of = self.parts.plan.geometry.page_size, self.parts.tenants.of
        for key, parent in zip(keys, parents, strict=True):
            info = PageInfo(parent=parent, tokens=tokens, tenant=tenant_of(key))
            if eviction is not None:
                eviction.describe(key, info)
            if admission is not None:
                admission.describe(key, info)

    def enforce_quota(self, tier: Tier, keys: list[str]) -> set[str]:
        """Evict a tenant's own pages from ``tier`` before it goes over its quota; the keys
        that would not fit even then, refused (the tier's space manager decides, see
        :meth:`SpaceManager.enforce_quota`)."""
        return self.spaces[tier.index].enforce_quota(keys)

    def admits(self, tier: Tier, key: str) -> bool:
        """Whether ``tier``'s admission takes ``key`` now (a refusal of a write-through
        tier is remembered: a later hit may offer the page again)."""
        admission = tier.admission
        if admission is None:
            return True
        admission.record_access(key)
        if admission.admit(key, self.parts.page_bytes):
            return True
        tier.counters.add("admission_refused")
        if tier.plan.write == "through":  # a later hit may offer it again
            refused = self._refused[tier.index]
            with self.parts.lock:
                refused[key] = None
                if len(refused) > _REFUSED_KEEP:
                    refused.popitem(last=False)
        return False

    def written(self, tier: Tier, keys: list[str]) -> None:
        """``keys`` entered ``tier``: no longer refused there."""
        refused = self._refused[tier.index]
        if refused and keys:
            with self.parts.lock:
                for key in keys:
                    refused.pop(key, None)

    def tenant_stats(self) -> dict[str, dict[str, Any]]:
        """Per configured tenant: bytes per tier and quota evictions."""
        out: dict[str, dict[str, Any]] = {}
        tiers = self.parts.tiers
        for name, quota in self.parts.tenants.quotas():
            out[name] = {
                "quota_bytes": quota,
                "bytes": [
                    tier.eviction.tenant_bytes(name) if tier.eviction is not None else 0
                    for tier in tiers
                ],
                "quota_evictions": sum(space.quota_evictions.get(name, 0) for space in self.spaces),
            }
        return out

    # --- after a hit: promotions and re-offers ----------------------------------------------

    def after_hit(
        self, keys: list[str], pages: list[int], source: dict[int, int], ticket: Ticket
    ) -> None:
        """The pages a lower tier served (``source``: position -> tier): promote them to
        the tiers above, and offer a page again to a tier whose admission refused it
        before and admits it now."""
        self._promote(keys, pages, source, ticket)
        self._record_hits(keys, pages, source, ticket)

    def _promote(
        self, keys: list[str], pages: list[int], source: dict[int, int], ticket: Ticket
    ) -> None:
        """Copy the pages a lower tier served into staging, to write them up."""
        tiers = self.parts.tiers
        by_tier: dict[int, list[int]] = {}
        for i, tier_index in source.items():
            if tier_index > 0 and tiers[tier_index].plan.promote:
                by_tier.setdefault(tier_index, []).append(i)
        for tier_index, positions in by_tier.items():
            above = list(range(tier_index))
            self.cascade.offer(
                keys,
                pages,
                positions,
                above,
                tier_index,
                EventKind.PROMOTED,
                ticket,
                parents=self.parents.parents_of([keys[i] for i in positions]),
            )

    def _record_hits(
        self, keys: list[str], pages: list[int], source: dict[int, int], ticket: Ticket
    ) -> None:
        """Tell the admission policies below the tier that served each page of the hit;
        a page one of them refused before and admits now is offered to it again."""
        parts = self.parts
        offers: dict[int, list[int]] = {}
        for i, served in source.items():
            for tier in parts.tiers[served + 1 :]:
                admission = tier.admission
                if admission is None:
                    continue
                admission.record_access(keys[i])
                refused = self._refused[tier.index]
                if keys[i] in refused and admission.admit(keys[i], parts.page_bytes):
                    with parts.lock:
                        refused.pop(keys[i], None)
                    offers.setdefault(tier.index, []).append(i)
        for target, positions in offers.items():
            targets = [target, *parts.through_below(target)]
            served = source[positions[0]]
            self.cascade.offer(
                keys,
                pages,
                positions,
                targets,
                served,
                EventKind.STORED,
                ticket,
                target,
                parents=self.parents.parents_of([keys[i] for i in positions]),
            )

    def write_staged(self, job: Job, tier: Tier, keys: list[str], staged: list[int]) -> list[str]:
        """The cascade's write of a job's staged pages into one target tier: through its
        admission, its tenants' quotas and the room a write-back tier below makes. Returns
        the keys settled there: written, refused by its admission, or deleted meanwhile
        (the others failed: timed out, an error, no room)."""
        parts = self.parts
        chosen = [
            (key, page)
            for key, page in zip(keys, staged, strict=True)
            if tier.index in job.admitted or self.admits(tier, key)
        ]
        names = [key for key, _ in chosen]
        admitted = set(names)
        refused = [key for key in keys if key not in admitted]
        if not chosen:
            return refused
        self.describe(tier, names, job.parents_of(names))
        over = self.spaces[tier.index].enforce_quota(names)
        if over:  # over its tenant's quota: settled as a refusal is, never written
            refused += [key for key in names if key in over]
            chosen = [(key, page) for key, page in chosen if key not in over]
            names = [key for key, _ in chosen]
            if not chosen:
                return refused
        ticket = job.ticket
        assert ticket is not None  # queued jobs have one until they finish

        def late(part: list[str], pages: list[int]) -> LateWrite:
            return LateWrite(parts.fences, parts.staging, tier, part, pages, ticket, None)

        results, dropped, _ = self.put_into(
            tier,
            self.cascade.staging_store(tier),
            names,
            [page for _, page in chosen],
            late=late,
            must=False,
        )
        undone = undo_revoked(parts.fences, tier, names, results, ticket)
        if undone:
            for i, key in enumerate(names):
                if key in undone:
                    results[i] = False
            dropped += len(undone)  # not a failure: cancelled, counted as such
        written = keys_where(names, results)
        tier.counters.add(
            "promotions" if job.kind is EventKind.PROMOTED else "cascades", len(written)
        )
        if len(written) + dropped < len(names):
            tier.counters.add("failures", len(names) - len(written) - dropped)
        self.written(tier, written)
        parts.emit(job.kind, tier, written)
        return refused + written + list(undone)

    # --- room: each tier's space manager ------------------------------------------------

    def put_into(
        self,
        tier: Tier,
        store: PageStore,
        keys: list[str],
        pages: list[int],
        *,
        late: MakeLate,
        must: bool,
        guards: Sequence[SaveGuard | None] | None = None,
    ) -> tuple[BatchResult, int, list[str]]:
        """Put into ``tier`` through its space manager (:meth:`SpaceManager.put`): room
        made first, victims handed down above a write-back tier; the results, the drops
        and the caller's pages evicted on arrival."""
        return self.spaces[tier.index].put(store, keys, pages, late=late, must=must, guards=guards)

    def _hand_down(
        self, tier: Tier, below: Tier, victims: list[str], *, now: bool = False
    ) -> list[str]:
        """Read ``victims`` into staging and queue them for ``below`` (and the
        write-through tiers under it); the victims queued. ``now``: written in this
        thread, as many at a time as staging holds (a whole segment's victims); the
        victims settled below (written, refused by its admission, or deleted meanwhile)."""
        if now:
            moved: list[str] = []
            step = max(1, self.parts.staging.pool.num_pages)
            for start in range(0, len(victims), step):
                moved += self._hand_down_part(tier, below, victims[start : start + step], True)
            return moved
        return self._hand_down_part(tier, below, victims, False)

    def _hand_down_part(self, tier: Tier, below: Tier, victims: list[str], now: bool) -> list[str]:
        """:meth:`_hand_down` of what staging holds at once: queued, or written ``now``."""
        fences = self.parts.fences
        ticket = fences.enter(victims)  # a delete from now on cancels the hand-down
        try:
            staged = self.cascade.stage_from(tier, victims)
            keys = [key for key, page in zip(victims, staged, strict=True) if page is not None]
            pages = [page for page in staged if page is not None]
            if not keys:
                return []
            targets = [below.index, *self.parts.through_below(below.index)]
            job = Job(keys, targets, tier.index, EventKind.STORED, staged=pages)
            job.parents = dict(zip(keys, self.parents.parents_of(keys), strict=True))
            if now:
                job.ticket = ticket
                return self.cascade.write_now(job)
            return keys[: self.cascade.submit(job, since=ticket)]
        finally:
            fences.leave(ticket)

    def removed(self, tier_index: int, key: str, how: Departure) -> None:
        """A page left tier ``tier_index``: its space manager counts and emits it."""
        self.spaces[tier_index].removed(key, how)
