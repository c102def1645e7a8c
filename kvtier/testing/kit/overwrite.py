"""Overwrites: a second put of a key replaces the page, whole."""

from __future__ import annotations

from kvtier.testing.kit.harness import KitEnv

__all__ = ["OverwriteTests"]


class OverwriteTests:
    """A second put of a key replaces the page; a get returns the new one, whole."""

    def test_kit_overwrite(self, kit: KitEnv) -> None:
        h = kit.open()
        (key,) = h.keys(1)
        first, second, out = h.pool.allocate(3)
        h.fill([first], seed=6)
        h.fill([second], seed=7)
        assert h.store.put([key], [first]) == [True]
        assert h.store.put([key], [second]) == [True]
        h.scribble([out])
        assert h.store.get([key], [out]) == [True]
        assert h.payload(out) == h.payload(second) != h.payload(first)

    def test_kit_same_key_twice_in_one_batch(self, kit: KitEnv) -> None:
        h = kit.open()
        (key,) = h.keys(1)
        a, b, out = h.pool.allocate(3)
        h.fill([a], seed=8)
        h.fill([b], seed=9)
        assert h.store.put([key, key], [a, b]) == [True, True]
        assert h.store.get([key], [out]) == [True]
        assert h.payload(out) in (h.payload(a), h.payload(b))
