"""A second instance on the same store clears it, rescans it and writes, while the first
keeps working (``shared_processes``).

Instance A holds pages; instance B opens the same store (its start-up scan), clears it
while A puts from another thread, then writes pages of its own; instance C opens after
(a rescan). Every key read through A, B and C is one of its own versions or a miss; then
both A and B keep working: each puts new pages, and A, B and a fresh instance D serve
both sets byte for byte (they share one store).
"""

from __future__ import annotations

import threading

from kvtier.core.specs import Feature
from kvtier.testing.kit.faults_ledger import Ledger, settle
from kvtier.testing.kit.harness import Harness, KitEnv, require_feature

__all__ = ["SecondInstanceTests"]

_BATCH = 4
_ROUNDS = 6


class SecondInstanceTests:
    """``shared_processes``: another instance's clear and writes break nothing."""

    def test_kit_second_instance_clears_rescans_and_writes(self, kit: KitEnv) -> None:
        require_feature(kit, Feature.SHARED_PROCESSES)
        ledger = Ledger()
        a = kit.open(num_pages=4 * _BATCH)
        before, pages = a.keys(_BATCH), a.pool.allocate(_BATCH)
        a.fill(pages, seed=3000)
        assert ledger.put(a, before, pages) == [True] * _BATCH
        settle(a)
        b = kit.open(num_pages=4 * _BATCH, seed=1)
        errors: list[BaseException] = []
        during: list[str] = []

        def first_keeps_putting() -> None:
            try:
                for round_ in range(_ROUNDS):
                    keys = a.keys(_BATCH)
                    a.fill(pages, seed=3100 + round_)
                    ledger.put(a, keys, pages)  # may race the clear: True or False
                    during.extend(keys)
            except BaseException as exc:
                errors.append(exc)

        writer = threading.Thread(target=first_keeps_putting)
        writer.start()
        assert b.store.clear(), "the second instance's clear() failed"
        writer.join(60)
        assert not writer.is_alive() and not errors, errors
        settle(a)
        theirs, their_pages = b.keys(_BATCH), b.pool.allocate(_BATCH)
        b.fill(their_pages, seed=3200)
        assert ledger.put(b, theirs, their_pages) == [True] * _BATCH, (
            "the second instance cannot put after its clear"
        )
        settle(b)
        c = kit.open(num_pages=2 * _BATCH, seed=2)  # a rescan
        every = before + during + theirs
        for name, h in (("first", a), ("second", b), ("rescanned", c)):
            scratch = h.pool.allocate(_BATCH)
            ledger.check(h, h.store, every, scratch, where=f"{name} instance after a clear")
            h.pool.free(scratch)
        mine = _put_new(a, ledger, pages, seed=3300, who="the first instance")
        yours = _put_new(b, ledger, their_pages, seed=3400, who="the second instance")
        d = kit.open(num_pages=2 * _BATCH, seed=3)
        for name, h in (("first", a), ("second", b), ("fresh", d)):
            scratch = h.pool.allocate(_BATCH)
            ledger.check(
                h, h.store, mine + yours, scratch, where=f"{name} instance", must_hold=mine + yours
            )
            h.pool.free(scratch)


def _put_new(h: Harness, ledger: Ledger, pages: list[int], *, seed: int, who: str) -> list[str]:
    keys = h.keys(len(pages))
    h.fill(pages, seed=seed)
    assert ledger.put(h, keys, pages) == [True] * len(pages), (
        f"{who} stopped taking puts after the other instance's clear"
    )
    settle(h)
    return keys
