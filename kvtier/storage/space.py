"""One tier's space and the one decider of what leaves it: the :class:`SpaceManager`.

Every put into a tier goes through its manager (the first tier's put, the cascade's
writes, write-backs, promotions and re-offers). Where the tier's backend reports its space
(:class:`~kvtier.core.space.ReportsSpace`, ``Feature.REPORTS_SPACE``), the manager owns it:
before the put it asks the backend how much room is left and what a page costs, picks
victims through the tier's eviction policy (never a pinned page, nor one of the put's own
or one being written), hands them down first when the tier below is ``write: back``,
deletes them, and reserves the room the put takes until the put returns, so concurrent
puts never both count the same free bytes. The backend never evicts on its own; a put
that still does not fit is refused there (counted by the backend).

Where the backend's space comes back a unit at a time (the segment store,
:class:`~kvtier.core.space.ReclaimsUnits`), deleting a page frees nothing: the manager
instead weighs the units (what each gives back less the live pages the policy would
keep, the cost of rewriting them), hands the pages it drops down to a ``write: back``
tier below, and tells the backend which unit to reclaim and which pages to keep. Pages
put into such a tier always enter it (the policy is not offered them ahead, as it is for
a tier that evicts page by page).

Tenant quotas go through the manager too (:meth:`SpaceManager.enforce_quota`).

The documented exception, a backend that does not report its space (a third party's): it
keeps evicting through the policy handed to it, and the manager makes room only above a
``write: back`` tier, within the tier's ``capacity_bytes`` as the policy counts it,
holding the tier's lock across the put. Whatever leaves a tier is told to
:meth:`SpaceManager.removed` with its :class:`~kvtier.storage.observed.Departure`; an
eviction the manager did not choose (``evictions_external``: such a backend's own, or a
reclaim a shared store reported) above a ``write: back`` tier was never handed down: a
counted drop of the tier below.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import cast

from kvtier.core.bounded import Outcome
from kvtier.core.pagestore import BatchResult, PageStore
from kvtier.core.saveguard import SaveGuard
from kvtier.core.space import ReclaimsUnits, ReportsSpace
from kvtier.storage.events import EventKind
from kvtier.storage.late import MakeLate, put_call
from kvtier.storage.observed import Departure
from kvtier.storage.tiers import ChainParts, Tier
from kvtier.storage.units import HandDown, UnitRoom

__all__ = ["HandDown", "SpaceManager"]

log = logging.getLogger("kvtier.cache")


#: Rounds of pick-and-delete for one put before the rest is refused room (each round
#: asks the backend again: a victim may free less than the policy counted).
_ROUNDS = 8


class SpaceManager:
    """The space of one tier: the only decider of its victims (see the module docstring)."""

    def __init__(self, parts: ChainParts, tier: Tier, hand_down: HandDown) -> None:
        self.parts = parts
        self.tier = tier
        self._hand_down = hand_down
        eviction = tier.eviction
        #: The backend, where the manager owns its space (None: the backend's own).
        self.reports: ReportsSpace | None = None
        #: Room made a unit at a time, where the backend's space comes back so (segment).
        self.units: UnitRoom | None = None
        if eviction is not None and eviction.space_owned:
            self.reports = cast(ReportsSpace, tier.store.backend)
            if isinstance(self.reports, ReclaimsUnits):
                self.units = UnitRoom(parts, tier, self.reports, hand_down)
        #: One room decision at a time (and, without a report, one put).
        self._lock = threading.Lock()
        #: The keys puts in flight write (how many puts each): never victims, and each
        #: not yet in the tier takes a page's room until it lands.
        self._writing: dict[str, int] = {}
        self.quota_evictions: dict[str, int] = {}
        self._lost_warned = False

    @property
    def owned(self) -> bool:
        """Whether this manager owns the tier's space (its backend reports it)."""
        return self.reports is not None

    # --- puts ----------------------------------------------------------------------------

    def put(
        self,
        store: PageStore,
        keys: list[str],
        pages: list[int],
        *,
        late: MakeLate,
        must: bool,
        guards: Sequence[SaveGuard | None] | None = None,
    ) -> tuple[BatchResult, int, list[str]]:
        """Put into the tier (through ``store``, its page store or its staging sibling)
        in parts that fit, each after its room was made. ``must``: the caller's pages,
        put whatever happens to victims that could not be handed down (they are lost,
        counted drops below) and whether room was found (the backend refuses what does
        not fit). A page the policy evicts on arrival (it keeps the tier's own pages
        rather than it, see :meth:`ObservedEviction.pick`) is not written: a counted drop
        of the tier and a False (the caller's pages too: reported stored, a page in no
        tier would send a reader to a miss); so is a page that finds no room, unless
        ``must``. Returns the results, the drops, and the caller's pages evicted on
        arrival.
        ``late`` makes each call's late side (see :func:`~kvtier.storage.late.put_call`)."""
        tier = self.tier
        capacity = tier.plan.capacity_bytes
        if self.reports is None and (
            self.parts.back_below(tier) is None or capacity is None or tier.eviction is None
        ):
            return put_call(store, keys, pages, late, guards), 0, []
        step = self._step()
        results: list[bool] = []
        dropped = 0
        arrived: list[str] = []
        for start in range(0, len(keys), step):
            end = min(len(keys), start + step)
            part = keys[start:end]
            mine = None if guards is None else guards[start:end]
            answer, outcome, lost, gone = self._put_part(
                store, part, pages[start:end], mine, late, must
            )
            if must:
                arrived += gone
            if lost:
                dropped += lost
                tier.counters.add("drops", lost)
            results += answer
            if outcome is not Outcome.OK:
                results += [False] * (len(keys) - len(results))
                return BatchResult(results, outcome), dropped, arrived
        return BatchResult(results), dropped, arrived

    def _put_part(
        self,
        store: PageStore,
        part: list[str],
        pages: list[int],
        guards: Sequence[SaveGuard | None] | None,
        late: MakeLate,
        must: bool,
    ) -> tuple[list[bool], Outcome, int, list[str]]:
        """Make room for ``part`` and put what may enter: each page's result, the call's
        outcome, how many pages were not written (drops) and those the policy evicted on
        arrival."""
        eviction = self.tier.eviction
        with self._lock:
            chosen, refused = self._room(part, force=must)
            names = [part[i] for i in chosen]
            sources = [pages[i] for i in chosen]
            mine = None if guards is None else [guards[i] for i in chosen]
            if self.reports is None:  # the policy counts a page once it landed: hold on
                answer = put_call(store, names, sources, late, mine)
            else:
                self._reserve(names)
        if self.reports is not None:
            assert eviction is not None
            answer = BatchResult([False] * len(names))
            try:
                answer = put_call(store, names, sources, late, mine)
            finally:
                with self._lock:
                    self._release(names)
                eviction.withdraw(key for key, ok in zip(names, answer, strict=True) if not ok)
        results = [False] * len(part)
        for i, ok in zip(chosen, answer, strict=True):
            results[i] = ok
        # (a page never written answers False, the caller's too: it is in no tier)
        return results, answer.outcome, len(part) - len(chosen), [part[i] for i in refused]

    def _step(self) -> int:
        """Pages per part: what the tier holds at most (all of them: no bound)."""
        page_bytes = self.parts.page_bytes
        if self.reports is None:
            return max(1, (self.tier.plan.capacity_bytes or 0) // page_bytes)
        capacity = self.reports.space().capacity_bytes
        if capacity is None:
            return 1 << 30
        return max(1, capacity // max(1, self.reports.page_cost(page_bytes)))

    def _reserve(self, keys: list[str]) -> None:
        for key in keys:
            self._writing[key] = self._writing.get(key, 0) + 1

    def _release(self, keys: list[str]) -> None:
        for key in keys:
            left = self._writing.pop(key) - 1
            if left:
                self._writing[key] = left

    # --- room ----------------------------------------------------------------------------

    def _pinned(self, keys: list[str]) -> Callable[[str], bool]:
        mine, writing = set(keys), self._writing
        return lambda key: key in mine or key in writing

    def _room(self, keys: list[str], *, force: bool) -> tuple[list[int], list[int]]:
        """Under the lock: make room for ``keys``. Returns the positions to put (all
        with ``force``: the backend refuses what still does not fit) and those the policy
        evicted on arrival (never written). The keys not in the tier are offered to the
        policy with its pages (unless a write-back tier below is owed its victims, which
        only a page in the tier can be handed down as)."""
        everything = list(range(len(keys)))
        if self.reports is None:
            return everything[: self._room_counted(keys, force=force)], []
        reports, eviction = self.reports, self.tier.eviction
        assert eviction is not None  # an owned tier has its policy
        cost = reports.page_cost(self.parts.page_bytes)
        writing = self._writing
        new = [key for key in dict.fromkeys(keys) if key not in eviction and key not in writing]
        # a unit backend appends every put, an overwrite too (the old copy turns dead)
        need = cost * (len(dict.fromkeys(keys)) if self.units is not None else len(new))
        free, capacity = self._free(cost)
        if capacity is not None and cost > capacity:  # never fits: evict nothing for it
            return (everything if force else []), []
        if free is None or need <= free:
            return everything, []
        refused: set[str] = set()
        if self.units is not None:
            free = self.units.make_room(set(keys), need, free, lambda: self._free(cost)[0], writing)
        else:
            need, free = self._evict_pages(keys, new, need, free, cost, refused, force=force)
        put = [i for i, key in enumerate(keys) if key not in refused]
        gone = [i for i, key in enumerate(keys) if key in refused]
        if force or free is None or need <= free:
            return put, gone
        short = -(-(need - free) // max(1, cost))  # pages that find no room
        fit = put[: max(0, len(put) - short)]
        eviction.withdraw(keys[i] for i in put[len(fit) :])
        return fit, gone

    def _evict_pages(
        self,
        keys: list[str],
        new: list[str],
        need: int,
        free: int,
        cost: int,
        refused: set[str],
        *,
        force: bool,
    ) -> tuple[int, int | None]:
        """Under the lock: evict page by page, through the policy, until ``need`` bytes
        are free or nothing more leaves. ``new`` (the keys not in the tier) are offered to
        the policy ahead; those it evicts on arrival go into ``refused`` (never written)
        and out of ``need``. Returns what is still needed and the room left."""
        eviction = self.tier.eviction
        assert eviction is not None
        writing = self._writing
        arriving = set(new)
        offer = []
        if self.parts.back_below(self.tier) is None:
            offer = [(key, self.parts.page_bytes) for key in new]
        held = set(keys) - arriving

        def pinned(key: str) -> bool:
            return key in held or key in writing

        room: int | None = free
        rounds = 0
        while room is not None and need > room and rounds < _ROUNDS:
            victims = eviction.pick(need - room, pinned=pinned, incoming=offer)
            offer = []  # inserted ahead once
            early = [key for key in victims if key in arriving and key not in refused]
            eviction.withdraw(early)
            refused.update(early)
            need -= cost * len(early)
            removed = self.evict([key for key in victims if key not in arriving], force=force)
            later = self._free(cost)[0]
            if later is None or not (early or removed):
                room = later
                break
            room, rounds = later, rounds + 1
        return need, room

    def _free(self, cost: int) -> tuple[int | None, int | None]:
        """The room the backend reports, less what the puts in flight will take (their
        pages not in the tier yet, counted before the backend is asked: a page landing
        meanwhile is counted twice, never not at all), and the backend's capacity."""
        assert self.reports is not None and self.tier.eviction is not None
        eviction = self.tier.eviction
        pending = cost * sum(1 for key in self._writing if not eviction.landed(key))
        report = self.reports.space()
        free = None if report.free_bytes is None else report.free_bytes - pending
        return free, report.capacity_bytes

    def _room_counted(self, keys: list[str], *, force: bool) -> int:
        """Above a write-back tier, without a report: room within ``capacity_bytes`` as
        the policy counts the tier's pages; how many of ``keys`` fit (all with ``force``)."""
        eviction, capacity = self.tier.eviction, self.tier.plan.capacity_bytes
        assert eviction is not None and capacity is not None
        page_bytes = self.parts.page_bytes
        incoming = sum(page_bytes for key in keys if key not in eviction)
        excess = eviction.nbytes + incoming - capacity
        if excess <= 0:
            return len(keys)
        victims = eviction.pick(excess, pinned=self._pinned(keys))
        removed = self.evict(victims, force=force)
        if force:
            return len(keys)
        short = excess - page_bytes * len(removed)
        if short <= 0:
            return len(keys)
        return max(0, len(keys) - -(-short // page_bytes))

    def enforce_quota(self, keys: list[str]) -> set[str]:
        """Evict a tenant's own pages from the tier before ``keys`` take it over its quota;
        the keys refused because even then they would not fit (a put larger than the
        quota keeps its first pages: a prefix's later pages are worthless without them),
        counted as ``quota_refused``."""
        tier, tenants = self.tier, self.parts.tenants
        eviction = tier.eviction
        if eviction is None or not tenants:
            return set()
        page_bytes = self.parts.page_bytes
        incoming: dict[str, list[str]] = {}
        quotas: dict[str, int] = {}
        for key in keys:
            chosen = tenants.quota_of(key)
            if chosen is not None and key not in eviction:
                incoming.setdefault(chosen[0], []).append(key)
                quotas[chosen[0]] = chosen[1]
        refused: set[str] = set()
        for tenant, new in incoming.items():
            removed: list[str] = []
            with self._lock:
                excess = eviction.tenant_bytes(tenant) + page_bytes * len(new) - quotas[tenant]
                if excess <= 0:
                    continue
                victims = eviction.pick(excess, pinned=self._pinned(keys), tenant=tenant)
                if victims:
                    removed = self.evict(victims, force=True)
            if removed:
                tier.counters.add("quota_evictions", len(removed))
                with self.parts.lock:
                    count = self.quota_evictions.get(tenant, 0) + len(removed)
                    self.quota_evictions[tenant] = count
            short = excess - page_bytes * len(removed)
            if short > 0:
                over = min(len(new), -(-short // page_bytes))
                refused.update(new[len(new) - over :])
                tier.counters.add("quota_refused", over)
        return refused

    # --- what leaves -----------------------------------------------------------------------

    def evict(self, victims: list[str], *, force: bool) -> list[str]:
        """Remove ``victims`` (picked through :meth:`ObservedEviction.pick`) from the tier;
        above a write-back tier, each is handed down first. One that cannot be handed down
        is removed anyway with ``force`` (a counted drop of the tier below), else it stays.
        Returns the victims removed."""
        if not victims:
            return []
        tier, eviction = self.tier, self.tier.eviction
        assert eviction is not None
        below = self.parts.back_below(tier)
        if below is not None:
            moved = self._hand_down(tier, below, victims)
            gone = set(moved)
            stay = [key for key in victims if key not in gone]
            if stay and not force:
                eviction.forget_choice(stay)
                victims = moved
            elif stay:
                below.counters.add("drops", len(stay))  # lost: counted where it was owed
        if not victims:
            return []
        answer = tier.store.delete(victims)
        kept = [key for key, ok in zip(victims, answer, strict=True) if not ok]
        if kept:  # not removed now: a later removal of them is no eviction of this one
            eviction.forget_choice(kept)
        return victims if not kept else [key for key in victims if key not in set(kept)]

    def removed(self, key: str, how: Departure) -> None:
        """``key`` left the tier (see :class:`Departure`): count it, emit it.

        An eviction the manager did not choose above a write-back tier was not written
        back: a counted drop of the tier below (warned once).
        """
        parts, tier = self.parts, self.tier
        if how is Departure.REMOVED:
            parts.emit(EventKind.REMOVED, tier, [key])
            return
        tier.counters.add("evictions")
        if how is Departure.EXTERNAL:
            tier.counters.add("evictions_external")
            below = parts.back_below(tier)
            if below is not None:
                below.counters.add("drops")
                with parts.lock:
                    first, self._lost_warned = not self._lost_warned, True
                if first:
                    log.warning(
                        "kvtier: tier %s lost a page it did not choose to evict (its "
                        "backend's own capacity or reclaim) that write-back tier %s never "
                        "received; later such pages are counted in that tier's drops only",
                        tier.name,
                        below.name,
                    )
        parts.emit(EventKind.EVICTED, tier, [key])
