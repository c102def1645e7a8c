"""Round trips: pages come back bit-exact, through the PageStore and the raw contract."""

from __future__ import annotations

import random

from kvtier.core.envelope import ENVELOPE_BYTES
from kvtier.testing.kit.harness import KitEnv, random_bytes

__all__ = ["RoundTripTests"]


class RoundTripTests:
    """Pages come back bit-exact, through the PageStore and through the raw contract."""

    def test_kit_round_trip(self, kit: KitEnv) -> None:
        h = kit.open()
        pages = h.pool.allocate(4)
        keys = h.keys(4)
        h.fill(pages, seed=1)
        expected = h.payloads(pages)
        assert h.store.put(keys, pages) == [True] * 4
        h.scribble(pages)
        assert h.store.get(keys, pages) == [True] * 4
        assert h.payloads(pages) == expected
        assert h.store.stats()["invalid"] == 0

    def test_kit_get_into_other_pages(self, kit: KitEnv) -> None:
        h = kit.open()
        src, dst = h.pool.allocate(3), h.pool.allocate(3)
        keys = h.keys(3)
        h.fill(src, seed=2)
        assert h.store.put(keys, src) == [True] * 3
        h.scribble(dst)
        assert h.store.get(keys, dst) == [True] * 3
        assert h.payloads(dst) == h.payloads(src)

    def test_kit_raw_regions_round_trip(self, kit: KitEnv) -> None:
        h = kit.open()
        a, b = h.pool.allocate(2)
        h.fill([a], seed=3)
        h.pool.header_extent(a).view[:] = random_bytes(random.Random(3), ENVELOPE_BYTES)
        (key,) = h.keys(1)
        assert h.backend.put([key], [h.pool.page_buffers(a)]) == [True]
        h.scribble([b])
        assert h.backend.get([key], [h.pool.page_buffers(b)]) == [True]
        got = b"".join(bytes(e.view) for e in h.pool.page_buffers(b))
        assert got == b"".join(bytes(e.view) for e in h.pool.page_buffers(a))

    def test_kit_empty_batches(self, kit: KitEnv) -> None:
        h = kit.open()
        assert h.backend.exists([]) == []
        assert h.backend.get([], []) == []
        assert h.backend.put([], []) == []
        assert h.backend.delete([]) == []

    def test_kit_stats_and_close(self, kit: KitEnv) -> None:
        h = kit.open()
        pages = h.pool.allocate(1)
        h.store.put(h.keys(1), pages)
        stats = h.backend.stats()
        assert isinstance(stats, dict)
        assert all(isinstance(k, str) and isinstance(v, (int, float)) for k, v in stats.items())
        h.backend.close()
        h.backend.close()  # idempotent
