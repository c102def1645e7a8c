"""Late calls: a backend call that stalls past the bound and then completes.

A :class:`~kvtier.testing.faults.CallGate` holds the backend's first put (or get) past a
short ``backend_call_timeout_s``; the store reports the call timed out, and, as
:meth:`PageStore.put` / :meth:`PageStore.get` say, the caller keeps the call's pages out
of reuse until ``on_late`` runs. Meanwhile the pool's other pages are recycled through
many puts and gets of other keys; then the held call is released and completes, on the
pages it was given. Afterwards every key read back, through the store and (for a chain)
through each tier on its own, holds one of its own versions or is a miss: never another
key's bytes. Through a chain the held call is the lowest tier's (the cascade or the read
from below), so the chain's own staging pages are what must not be recycled early.
The store then keeps working.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from typing import Any, ClassVar

import pytest

from kvtier.core.bounded import Outcome
from kvtier.testing.faults import CallGate
from kvtier.testing.kit.faults_ledger import (
    Ledger,
    bounded,
    cascades_on_put,
    is_chain,
    lowest_backend,
    settle,
    views,
)
from kvtier.testing.kit.harness import Harness, KitEnv

__all__ = ["LateCallTests", "LateCascadeReadTests"]

#: Pages of the held call, and pages per recycling put.
_HELD = 4
_BATCH = 4
#: How long a test waits for a held call to reach the gate, or to return once released.
_WAIT_S = 30.0


class LateCallTests:
    """A call stalled past the bound completes late: no key ever loads another's bytes."""

    #: The call bound the stalled store runs under (seconds).
    late_bound_s: ClassVar[float] = 0.5
    #: Recycling puts while the call is held (each of ``_BATCH`` pages).
    late_rounds: ClassVar[int] = 12

    def test_kit_late_write_never_publishes_another_keys_bytes(self, kit: KitEnv) -> None:
        h = bounded(kit, self.late_bound_s, num_pages=4 * _HELD + 2 * _BATCH)
        if is_chain(h.store) and not cascades_on_put(h):
            pytest.skip("this chain's lowest tier is written on eviction only (write: back)")
        ledger = Ledger()
        held_keys, held = h.keys(_HELD), h.pool.allocate(_HELD)
        h.fill(held, seed=500)
        late = threading.Event()
        with CallGate(lowest_backend(h), "put") as gate:
            payloads = h.payloads(held)
            ledger.offered(held_keys, payloads)
            first = h.store.put(held_keys, held, on_late=lambda _r: late.set())
            ledger.acknowledge(held_keys, payloads, first)
            assert gate.wait_stalled(_WAIT_S), "the put never reached the backend"
            quarantined = first.outcome is Outcome.TIMED_OUT
            if not quarantined:  # a chain: the first tier took it, the cascade is held
                assert is_chain(h.store), f"a held put did not time out: {first.outcome}"
                settle(h)  # the worker gave up on the held cascade: it timed out
            recycled = h.pool.allocate(_BATCH)
            # the pages of the held call are the caller's again only after on_late
            reuse = recycled + ([] if quarantined else held)
            keys = _recycle(h, ledger, reuse, self.late_rounds)
            settle(h)  # a chain's recycled cascades went through its staging pages
            gate.release()
            assert gate.wait_returned(_WAIT_S), "the held put never returned"
            if quarantined:
                assert late.wait(_WAIT_S), "on_late never ran after the held put returned"
                keys += _recycle(h, ledger, held, 2)  # now they may be reused
        settle(h)
        _check_all(h, ledger, held_keys + keys)
        _keeps_working(h, ledger)

    def test_kit_late_read_never_fills_another_keys_page(self, kit: KitEnv) -> None:
        h = bounded(kit, self.late_bound_s, num_pages=4 * _HELD + 2 * _BATCH)
        if is_chain(h.store) and not cascades_on_put(h):
            pytest.skip("this chain's lowest tier is written on eviction only (write: back)")
        ledger = Ledger()
        keys, pages = h.keys(_HELD), h.pool.allocate(_HELD)
        h.fill(pages, seed=600)
        assert ledger.put(h, keys, pages) == [True] * _HELD
        settle(h)
        _only_below(h, keys)  # a chain reads them from its lowest tier
        out = h.pool.allocate(_HELD)
        h.scribble(out)
        late = threading.Event()
        with CallGate(lowest_backend(h), "get") as gate:
            first = h.store.get(keys, out, on_late=lambda _r: late.set())
            assert gate.wait_stalled(_WAIT_S), "the get never reached the backend"
            assert first.outcome is Outcome.TIMED_OUT, f"a held get did not time out: {first}"
            # meanwhile: the key's page is replaced, other pages recycled through puts
            h.fill(pages, seed=601)
            ledger.put(h, keys[:1], pages[:1])
            more = _recycle(h, ledger, h.pool.allocate(_BATCH), self.late_rounds)
            gate.release()
            assert gate.wait_returned(_WAIT_S), "the held get never returned"
            assert late.wait(_WAIT_S), "on_late never ran after the held get returned"
        settle(h)
        # the pages of the late read are free again: fill them with other keys
        other, sources = h.keys(_HELD), h.pool.allocate(_HELD)
        h.fill(sources, seed=602)
        assert ledger.put(h, other, sources) == [True] * _HELD
        h.scribble(out)
        assert h.store.get(other, out) == [True] * _HELD
        assert h.payloads(out) == h.payloads(sources)
        _check_all(h, ledger, keys + more + other)
        _keeps_working(h, ledger)


class LateCascadeReadTests:
    """Chains: the worker's read of the tier above, stalled past the bound, completes late
    into a staging page another cascade is writing: no key may go down with its bytes."""

    late_bound_s: ClassVar[float] = 0.5
    late_rounds: ClassVar[int] = 12

    def test_kit_late_source_read_never_feeds_a_cascade(self, kit: KitEnv) -> None:
        """Chains: the worker's read of a page from the tier above (to cascade it) stalls
        past the bound; the staging page it fills late must not carry another key down."""
        num_pages = 2 * _HELD + 2 * _BATCH + _staging_pages()
        h = bounded(kit, self.late_bound_s, num_pages=num_pages)
        if not is_chain(h.store):
            pytest.skip(f"backend {kit.spec.name!r} is not a chain: no cascade reads a tier")
        if not cascades_on_put(h):
            pytest.skip("this chain's lowest tier is written on eviction only (write: back)")
        chain: Any = h.store
        ledger = Ledger()
        held_keys, held = h.keys(_HELD), h.pool.allocate(_HELD)
        h.fill(held, seed=650)
        with CallGate(chain.tiers[0].store.backend, "get") as late_read:
            assert ledger.put(h, held_keys, held) == [True] * _HELD
            if not late_read.wait_stalled(2.0):
                pytest.skip("this chain cascades without reading the tier above back")
            settle(h)  # the worker gave up on the held read: it timed out
            # the next cascade stages its pages and its write below is held in turn ...
            with CallGate(chain.tiers[-1].store.backend, "put") as write:
                # a batch that takes every staging page, the late read's among them
                keys, pages = h.keys(_staging_pages()), h.pool.allocate(_staging_pages())
                h.fill(pages, seed=651)
                ledger.put(h, keys, pages)
                assert write.wait_stalled(_WAIT_S), "the chain never cascaded"
                # ... while the late read lands, in whatever page it was given
                late_read.release()
                assert late_read.wait_returned(_WAIT_S), "the held read never returned"
                write.release()
                assert write.wait_returned(_WAIT_S), "the held write never returned"
            settle(h)
            keys += _recycle(h, ledger, pages[:_BATCH], 2)
        settle(h)
        _check_all(h, ledger, held_keys + keys)
        _keeps_working(h, ledger)


def _staging_pages() -> int:
    """Pages in a kvtier chain's staging pool (where the worker stages what it moves)."""
    for module in ("kvtier.storage.staging", "kvtier.storage.cascade"):
        with contextlib.suppress(ImportError):
            found = getattr(importlib.import_module(module), "STAGING_PAGES", None)
            if isinstance(found, int):
                return found
    return 64


def _recycle(h: Harness, ledger: Ledger, pages: list[int], rounds: int) -> list[str]:
    """Put fresh keys through ``pages`` again and again (a seed each), reading some back."""
    keys: list[str] = []
    for round_ in range(rounds):
        batch = h.keys(len(pages))
        h.fill(pages, seed=700 + round_)
        ledger.put(h, batch, pages)
        keys += batch
    return keys


def _only_below(h: Harness, keys: list[str]) -> None:
    """For a chain: remove the keys from every tier but the lowest, so reads go there."""
    if not is_chain(h.store):
        return
    chain: Any = h.store
    for tier in chain.tiers[:-1]:
        tier.store.delete(keys)
    lowest = chain.tiers[-1].store
    assert list(lowest.exists(keys)) == [True] * len(keys), (
        "the chain's lowest tier does not hold the pages its cascade wrote"
    )


def _check_all(h: Harness, ledger: Ledger, keys: list[str]) -> None:
    """Every key, through the store and each tier: one of its own versions, or a miss."""
    scratch = h.pool.allocate(_BATCH)
    try:
        for where, store in views(h):
            ledger.check(h, store, keys, scratch, where=f"after a late call, {where}")
    finally:
        h.pool.free(scratch)


def _keeps_working(h: Harness, ledger: Ledger) -> None:
    """After the fault clears the store takes and serves new pages, byte for byte."""
    keys, pages = h.keys(_BATCH), h.pool.allocate(_BATCH)
    h.fill(pages, seed=800)
    expected = h.payloads(pages)
    assert ledger.put(h, keys, pages) == [True] * _BATCH, "the store stopped taking puts"
    h.scribble(pages)
    assert h.store.get(keys, pages) == [True] * _BATCH, "the store stopped serving pages"
    assert h.payloads(pages) == expected
