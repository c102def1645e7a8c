"""Misses: a missing key is an ordinary False, never an exception."""

from __future__ import annotations

from kvtier.testing.kit.harness import KitEnv

__all__ = ["MissTests"]


class MissTests:
    """A missing key is an ordinary False, never an exception, in any batch position."""

    def test_kit_get_missing(self, kit: KitEnv) -> None:
        h = kit.open()
        pages = h.pool.allocate(3)
        assert h.store.get(h.keys(3), pages) == [False] * 3
        assert h.store.stats()["misses"] == 3
        assert h.store.stats()["backend_errors"] == 0

    def test_kit_mixed_hits_and_misses(self, kit: KitEnv) -> None:
        h = kit.open()
        keys = h.keys(6)
        pages = h.pool.allocate(6)
        h.fill(pages, seed=5)
        expected = h.payloads(pages)
        stored = [0, 2, 5]
        assert h.store.put([keys[i] for i in stored], [pages[i] for i in stored]) == [True] * 3
        h.scribble(pages)
        results = h.store.get(keys, pages)
        assert results == [i in stored for i in range(6)]
        for i in stored:
            assert h.payload(pages[i]) == expected[i]
        assert h.store.stats()["backend_errors"] == 0

    def test_kit_delete_missing(self, kit: KitEnv) -> None:
        h = kit.open()
        assert h.backend.delete(h.keys(2)) == [False, False]
