"""``delete`` and ``clear``: keys go away, and the store keeps serving."""

from __future__ import annotations

from kvtier.testing.kit.harness import KitEnv

__all__ = ["DeleteClearTests"]


class DeleteClearTests:
    """``delete`` removes keys and says which were there; ``clear`` empties the store."""

    def test_kit_delete(self, kit: KitEnv) -> None:
        h = kit.open()
        keys = h.keys(3)
        pages = h.pool.allocate(3)
        assert h.store.put(keys, pages) == [True] * 3
        assert h.backend.delete(keys[:2]) == [True, True]
        assert h.backend.delete(keys[:1]) == [False]
        assert h.backend.exists(keys) == [False, False, True]
        assert h.store.get(keys, pages) == [False, False, True]

    def test_kit_clear(self, kit: KitEnv) -> None:
        h = kit.open()
        keys = h.keys(4)
        pages = h.pool.allocate(4)
        assert h.store.put(keys, pages) == [True] * 4
        h.backend.clear()
        assert h.backend.exists(keys) == [False] * 4
        assert h.store.get(keys, pages) == [False] * 4
        h.backend.clear()  # clearing an empty store is fine
        assert h.store.put(keys[:1], pages[:1]) == [True]  # and it keeps serving
        assert h.backend.exists(keys[:1]) == [True]
