"""Prefix ``exists``: answers per key; the core's prefix hits stop at the first gap."""

from __future__ import annotations

from kvtier.testing.kit.harness import KitEnv

__all__ = ["PrefixExistsTests"]


class PrefixExistsTests:
    """``exists`` answers per key; the core's prefix hits stop at the first gap."""

    def test_kit_prefix_hits(self, kit: KitEnv) -> None:
        h = kit.open()
        keys = h.keys(8)
        pages = h.pool.allocate(8)
        h.fill(pages, seed=4)
        assert h.store.put(keys[:5], pages[:5]) == [True] * 5
        assert h.store.prefix_hits(keys) == 5
        assert h.store.exists(keys) == [True] * 5 + [False] * 3
        assert h.store.put([keys[7]], [pages[7]]) == [True]
        assert h.store.prefix_hits(keys) == 5
        assert h.backend.exists(keys) == [True] * 5 + [False, False, True]

    def test_kit_exists_repeated_keys(self, kit: KitEnv) -> None:
        h = kit.open()
        (key,) = h.keys(1)
        (other,) = h.keys(1)
        h.store.put([key], h.pool.allocate(1))
        assert h.backend.exists([key, other, key]) == [True, False, True]
