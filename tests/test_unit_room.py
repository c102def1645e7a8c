"""UnitRoom above a write-back tier: a page a reclaimed unit loses is always below first.

A segment store drops a kept page it finds no room to rewrite (its capacity full of other
processes' active segments). So above a ``write: back`` tier every live page of the unit
is handed down before the reclaim, the kept ones too, but for the pages being written
now; and whatever the backend then drops was the chain's eviction, never a loss. The
stand-ins below (a backend, an eviction policy, the chain's parts) record the calls.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvtier.core.space import ReclaimUnit
from kvtier.storage.units import UnitRoom

LIVE = (("cold", 10), ("hot", 10), ("busy", 10))


class Eviction:
    """The tier's policy: ``cold`` goes first; the chosen victims are recorded."""

    def __init__(self) -> None:
        self.chosen: set[str] = set()

    def rank(self, nbytes: int, *, pinned: Any) -> list[str]:
        return ["cold"]

    def is_pinned(self, key: str) -> bool:
        return False

    def claim(self, keys: Any) -> None:
        self.chosen.update(keys)

    def forget_choice(self, keys: Any) -> None:
        self.chosen.difference_update(keys)


class Backend:
    """A unit store; without ``rewrites`` (no room left) a reclaim drops every live page."""

    def __init__(self, rewrites: bool) -> None:
        self.rewrites = rewrites
        self.kept: frozenset[str] | None = None
        self.taken = False

    def reclaim_units(self) -> list[ReclaimUnit]:
        return [] if self.taken else [ReclaimUnit(1, 30, LIVE)]

    def rewrite_budget(self) -> int:
        return 20

    def reclaim(self, unit: int, keep: frozenset[str]) -> list[str]:
        self.kept, self.taken = keep, True
        return [key for key, _ in LIVE if key not in keep or not self.rewrites]


def _room(rewrites: bool) -> tuple[UnitRoom, Backend, Eviction, list[list[str]]]:
    eviction, backend = Eviction(), Backend(rewrites)
    below = SimpleNamespace(name="below")
    handed: list[list[str]] = []

    def hand_down(tier: Any, to: Any, victims: list[str], *, now: bool = False) -> list[str]:
        assert to is below and now
        handed.append(list(victims))
        return list(victims)

    tier = SimpleNamespace(eviction=eviction, name="upper")
    parts = SimpleNamespace(back_below=lambda t: below)
    room = UnitRoom(parts, tier, backend, hand_down)  # type: ignore[arg-type]
    return room, backend, eviction, handed


def _make_room(room: UnitRoom) -> int | None:
    """Room for 25 bytes with none free; the reclaim frees 30. The put holds ``busy``."""
    return room.make_room({"busy"}, 25, 0, lambda: 30, ())


def test_kept_pages_are_handed_down_before_a_reclaim_that_may_drop_them() -> None:
    room, backend, eviction, handed = _room(rewrites=False)
    assert _make_room(room) == 30
    # the policy kept "hot" (within the rewrite budget) and the put holds "busy"; "cold"
    # and "hot" both went below first, "busy" (its new version is being written) did not
    assert handed == [["cold", "hot"]]
    assert backend.kept == frozenset({"hot", "busy"})
    # the backend dropped every page: "cold" and "hot" are the chain's evictions (safe
    # below), so neither departure is counted as a page lost to the write-back tier
    assert eviction.chosen == {"cold", "hot"}


def test_a_kept_page_the_backend_rewrites_stays_no_eviction() -> None:
    room, _backend, eviction, handed = _room(rewrites=True)
    assert _make_room(room) == 30
    assert handed == [["cold", "hot"]]
    assert eviction.chosen == {"cold"}  # "hot" stayed: a later removal is no eviction
