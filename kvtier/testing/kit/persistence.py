"""Persistence (``Feature.PERSISTENT``): pages survive closing and reopening."""

from __future__ import annotations

from kvtier.core.specs import Feature
from kvtier.testing.kit.harness import KitEnv, require_feature

__all__ = ["PersistenceTests"]


class PersistenceTests:
    """``persistent``: pages survive closing the backend and building a new one."""

    def test_kit_survives_reopen(self, kit: KitEnv) -> None:
        require_feature(kit, Feature.PERSISTENT)
        h = kit.open()
        keys, pages = h.keys(3), h.pool.allocate(3)
        h.fill(pages, seed=14)
        expected = h.payloads(pages)
        assert h.store.put(keys, pages) == [True] * 3
        h.backend.close()
        again = kit.open()
        assert again.store.exists(keys) == [True] * 3
        out = again.pool.allocate(3)
        assert again.store.get(keys, out) == [True] * 3
        assert again.payloads(out) == expected
