"""A chain's cascades and promotions of a key deleted (or tainted) meanwhile never land.

A :class:`~kvtier.testing.faults.CallGate` holds one write of the chain's worker, so the
jobs after it queue; keys whose job is queued, or whose own write is the one held, are
then deleted from the chain (or, where the chain has ``taint``, tainted) before the gate
opens. Once the worker has drained its queue no tier holds those keys and a lookup
misses them, while the keys left alone were written as usual. Three moments: a cascade
queued behind another (the lowest tier's put held), a cascade in flight (its own put
held), and a promotion queued (a read from below copies the page up; the first tier's
put held). A store that is not a chain skips these tests.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.testing.faults import CallGate
from kvtier.testing.kit.faults_ledger import Ledger, bounded, cascades_on_put, is_chain, settle
from kvtier.testing.kit.harness import Harness, KitEnv

__all__ = ["CascadeCancelTests"]

_BATCH = 4
#: The call bound while the gate holds the worker: long enough that the held call is
#: released before it times out.
_BOUND_S = 20.0
_WAIT_S = 30.0
_DONE = {"delete": "deleted", "taint": "tainted"}


class CascadeCancelTests:
    """Chains: queued or running cascades and promotions of deleted or tainted keys are
    cancelled: the keys appear in no tier afterwards."""

    def test_kit_deleted_key_never_cascades(self, kit: KitEnv) -> None:
        self._queued_cascade(kit, "delete")

    def test_kit_tainted_key_never_cascades(self, kit: KitEnv) -> None:
        self._queued_cascade(kit, "taint")

    def test_kit_deleted_key_in_flight_never_lands_below(self, kit: KitEnv) -> None:
        h, chain, remove = _chain(kit, "delete")
        ledger = Ledger()
        pages = h.pool.allocate(_BATCH)
        lowest = chain.tiers[-1]
        with CallGate(lowest.store.backend, "put") as gate:
            gone = h.keys(_BATCH)
            h.fill(pages, seed=4100)
            assert ledger.put(h, gone, pages) == [True] * _BATCH
            assert gate.wait_stalled(_WAIT_S), "the chain never cascaded to its lowest tier"
            remove(gone)  # while the cascade writing them is held mid-call
            gate.release()
            assert gate.wait_returned(_WAIT_S)
        settle(h)
        _nowhere(h, chain, gone, "deleted while their cascade was being written")
        _keeps_cascading(h, chain, ledger, pages)

    def test_kit_deleted_key_is_never_promoted(self, kit: KitEnv) -> None:
        self._queued_promotion(kit, "delete")

    def test_kit_tainted_key_is_never_promoted(self, kit: KitEnv) -> None:
        self._queued_promotion(kit, "taint")

    def _queued_cascade(self, kit: KitEnv, how: str) -> None:
        h, chain, remove = _chain(kit, how)
        ledger = Ledger()
        pages = h.pool.allocate(_BATCH)
        with CallGate(chain.tiers[-1].store.backend, "put") as gate:
            h.fill(pages, seed=4000)
            assert ledger.put(h, h.keys(_BATCH), pages) == [True] * _BATCH
            assert gate.wait_stalled(_WAIT_S), "the chain never cascaded to its lowest tier"
            gone = h.keys(_BATCH)
            h.fill(pages, seed=4001)
            assert ledger.put(h, gone, pages) == [True] * _BATCH
            remove(gone)  # their cascade is queued behind the held one
            gate.release()
            assert gate.wait_returned(_WAIT_S)
        settle(h)
        _nowhere(h, chain, gone, f"{_DONE[how]} while their cascade was queued")
        _keeps_cascading(h, chain, ledger, pages)

    def _queued_promotion(self, kit: KitEnv, how: str) -> None:
        h, chain, remove = _chain(kit, how)
        first = chain.tiers[0]
        ledger = Ledger()
        pages = h.pool.allocate(_BATCH)
        holder, gone = h.keys(_BATCH), h.keys(_BATCH)
        for seed, keys in enumerate((holder, gone)):
            h.fill(pages, seed=4200 + seed)
            assert ledger.put(h, keys, pages) == [True] * _BATCH
        settle(h)
        first.store.delete(holder + gone)  # now only the lowest tier holds them
        with CallGate(first.store.backend, "put") as gate:
            h.scribble(pages)
            assert list(h.store.get(holder, pages)) == [True] * _BATCH
            if not gate.wait_stalled(2.0):
                pytest.skip("this chain did not promote a page read from below")
            h.scribble(pages)
            assert list(h.store.get(gone, pages)) == [True] * _BATCH  # promotion queued
            remove(gone)
            gate.release()
            assert gate.wait_returned(_WAIT_S)
        settle(h)
        _nowhere(h, chain, gone, f"{_DONE[how]} while their promotion was queued")
        h.scribble(pages)
        ledger.check(h, h.store, holder, pages, where="the keys left alone", must_hold=holder)


def _chain(kit: KitEnv, how: str) -> tuple[Harness, Any, Any]:
    """A harness over a chain whose puts cascade, and the chain's ``delete`` or ``taint``;
    skips where the store is not such a chain."""
    h = bounded(kit, _BOUND_S, num_pages=4 * _BATCH)
    if not is_chain(h.store):
        pytest.skip(f"backend {kit.spec.name!r} is not a chain of tiers: nothing cascades")
    if not cascades_on_put(h):
        pytest.skip("this chain's lowest tier is written on eviction only (write: back)")
    chain: Any = h.store
    remove = getattr(chain, how, None)
    if remove is None:
        pytest.skip(f"this chain has no {how}()")
    return h, chain, remove


def _nowhere(h: Harness, chain: Any, keys: list[str], what: str) -> None:
    """No tier holds ``keys`` and a lookup misses them."""
    for tier in chain.tiers:
        found = list(tier.store.exists(keys))
        assert not any(found), (
            f"keys {what} are in tier {tier.index} ({tier.name}): "
            f"{[k for k, f in zip(keys, found, strict=True) if f]}"
        )
    pages = h.pool.allocate(len(keys))
    h.scribble(pages)
    assert list(h.store.get(keys, pages)) == [False] * len(keys), f"keys {what} are served"
    h.pool.free(pages)


def _keeps_cascading(h: Harness, chain: Any, ledger: Ledger, pages: list[int]) -> None:
    """New keys put now reach the lowest tier, byte for byte."""
    kept = h.keys(len(pages))
    h.fill(pages, seed=4300)
    assert ledger.put(h, kept, pages) == [True] * len(pages)
    settle(h)
    lowest = chain.tiers[-1]
    where = f"tier {lowest.index} after the cancelled writes"
    ledger.check(h, lowest.store, kept, pages, where=where, must_hold=kept)
