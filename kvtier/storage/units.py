"""Room in a tier whose backend frees space a whole unit at a time: :class:`UnitRoom`.

Deleting a page of a segment store frees nothing until its whole segment goes, so the
tier's space manager (:mod:`kvtier.storage.space`) makes room there by reclaiming units
(:class:`~kvtier.core.space.ReclaimsUnits`): it weighs each sealed unit by what it gives
back less the live pages the policy would keep (rewriting them is the cost), hands the
pages it drops down to a ``write: back`` tier below, then tells the backend which unit to
reclaim and which pages to keep. The dropped pages are the chain's victims (evictions),
never the backend's own choice. A backend may drop a kept page it finds no room to
rewrite (a segment store whose capacity the other processes' active segments fill), so
above a write-back tier the kept pages are handed down too (all but the pages being
written now): such a drop then loses nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Protocol

from kvtier.core.space import ReclaimsUnits, ReclaimUnit
from kvtier.storage.tiers import ChainParts, Tier

__all__ = ["HandDown", "UnitRoom"]

#: Units reclaimed for one put at most before the rest is refused room.
_ROUNDS = 8


class HandDown(Protocol):
    """Reads victims of a tier into staging and queues them for the write-back tier
    below (``now``: writes them in this thread, a staging's worth at a time); returns the
    victims handed down (Placement's hand-down)."""

    def __call__(
        self, tier: Tier, below: Tier, victims: list[str], *, now: bool = False
    ) -> list[str]: ...


class UnitRoom:
    """Makes room in one tier by reclaiming its backend's units (see the module)."""

    def __init__(
        self, parts: ChainParts, tier: Tier, backend: ReclaimsUnits, hand_down: HandDown
    ) -> None:
        self.parts = parts
        self.tier = tier
        self.backend = backend
        self._hand_down = hand_down

    def make_room(
        self,
        held: Collection[str],
        need: int,
        free: int,
        free_now: Callable[[], int | None],
        writing: Collection[str],
    ) -> int | None:
        """Under the tier's lock: reclaim units, best first, until ``need`` bytes are
        free (``free_now`` asks again) or none is left to try; the room left then (None:
        no bound). ``held`` (the put's own keys) and ``writing`` are never dropped, nor a
        page that could not be handed down (see :meth:`_hand_down_drops`)."""
        eviction = self.tier.eviction
        assert eviction is not None  # an owned tier has its policy

        def pinned(key: str) -> bool:
            return key in held or key in writing or eviction.is_pinned(key)

        tried: set[int] = set()
        room: int | None = free
        rounds = 0
        while room is not None and need > room and rounds < _ROUNDS:
            candidates = [u for u in self.backend.reclaim_units() if u.unit not in tried]
            if not candidates:
                break
            unit, keep = self._best(candidates, pinned)
            tried.add(unit.unit)
            drop, copied = self._hand_down_drops(
                unit, keep, lambda key: key in held or key in writing
            )
            chosen = [*drop, *copied]  # evictions if they leave: both are safe below
            eviction.claim(chosen)
            dropped = self.backend.reclaim(unit.unit, frozenset(keep))
            if dropped is None:  # another process holds it, or it is gone: try the next
                eviction.forget_choice(chosen)
                continue
            eviction.forget_choice(set(chosen) - set(dropped))
            room, rounds = free_now(), rounds + 1
        return room

    def _hand_down_drops(
        self, unit: ReclaimUnit, keep: set[str], busy: Callable[[str], bool]
    ) -> tuple[list[str], list[str]]:
        """The unit's pages to drop, written into a ``write: back`` tier below first, and
        the kept pages written there too. A page to drop that could not be handed down
        (its read or write failed, or timed out) is added to ``keep``: rewritten rather
        than dropped, even for the engine's own put (the put is refused room instead, if
        the rewrite leaves none: a False). Kept pages are handed down as well, but for
        ``busy`` ones (the put's own, writes in flight: their version here is about to
        be replaced), since the backend drops a kept page it finds no room to rewrite."""
        drop = [key for key, _ in unit.live if key not in keep]
        below = self.parts.back_below(self.tier)
        if below is None:
            return drop, []
        kept = [key for key, _ in unit.live if key in keep and not busy(key)]
        if not drop and not kept:
            return drop, []
        moved = set(self._hand_down(self.tier, below, [*drop, *kept], now=True))
        keep.update(key for key in drop if key not in moved)
        return [key for key in drop if key in moved], [key for key in kept if key in moved]

    def _best(
        self, units: list[ReclaimUnit], pinned: Callable[[str], bool]
    ) -> tuple[ReclaimUnit, set[str]]:
        """The unit that gives back the most for the least rewriting, and the pages to
        keep of it: the pinned ones, then those the policy would not evict first, in the
        unit's order, within the backend's rewrite budget. The oldest among equals."""
        eviction = self.tier.eviction
        assert eviction is not None
        cold = set(eviction.rank(max(u.nbytes for u in units), pinned=pinned))
        budget = self.backend.rewrite_budget()
        best: tuple[int, int] | None = None
        chosen: tuple[ReclaimUnit, set[str]] = (units[0], set())
        for unit in units:
            keep = {key for key, _ in unit.live if pinned(key)}
            left = budget - sum(size for key, size in unit.live if key in keep)
            for key, size in unit.live:
                if key not in cold and key not in keep and size <= left:
                    keep.add(key)
                    left -= size
            kept = sum(size for key, size in unit.live if key in keep)
            score = (unit.nbytes - kept, -unit.unit)
            if best is None or score > best:
                best, chosen = score, (unit, keep)
        return chosen
