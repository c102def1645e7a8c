"""Integrity: corrupt, truncated and foreign pages never reach the pool as data.

The damage is injected with :class:`~kvtier.testing.faults.FaultyBackend` around the
backend under test, or written beside it by a PageStore of another geometry or layout.
"""

from __future__ import annotations

import pytest

from kvtier.core.capabilities import build_host_pool
from kvtier.core.layout import layouts_for
from kvtier.testing.faults import FaultyBackend
from kvtier.testing.kit.harness import KitEnv

__all__ = ["IntegrityTests"]


class IntegrityTests:
    """Corrupt, truncated and foreign pages never reach the pool as data."""

    def test_kit_bit_flips_in_payload_are_rejected(self, kit: KitEnv) -> None:
        h = kit.open()
        keys, pages = h.keys(6), h.pool.allocate(6)
        h.fill(pages, seed=10)
        assert h.store.put(keys, pages) == [True] * 6
        faulty = FaultyBackend(h.backend, seed=1, bit_flip_rate=1.0, flip_in="payload")
        store = h.store_with(faulty)
        assert store.get(keys, pages) == [False] * 6
        assert store.stats()["invalid"] == 6
        assert store.stats()["invalid_corrupt_checksum"] == 6

    def test_kit_bit_flips_in_header_are_rejected_even_header_only(self, kit: KitEnv) -> None:
        h = kit.open()
        keys, pages = h.keys(6), h.pool.allocate(6)
        assert h.store.put(keys, pages) == [True] * 6
        faulty = FaultyBackend(h.backend, seed=2, bit_flip_rate=1.0, flip_in="header")
        store = h.store_with(faulty, verify="header")
        assert store.get(keys, pages) == [False] * 6
        assert store.stats()["invalid"] == 6

    def test_kit_truncated_pages_are_misses(self, kit: KitEnv) -> None:
        h = kit.open()
        keys, pages = h.keys(6), h.pool.allocate(6)
        h.fill(pages, seed=11)
        faulty = FaultyBackend(h.backend, seed=3, truncate_rate=1.0)
        h.store_with(faulty).put(keys, pages)  # the backend may accept or refuse them
        assert faulty.injected["truncations"] == 6
        h.scribble(pages)
        assert h.store.get(keys, pages) == [False] * 6

    def test_kit_random_faults_never_yield_bad_data(self, kit: KitEnv) -> None:
        h = kit.open(num_pages=24)
        keys, pages = h.keys(12), h.pool.allocate(12)
        h.fill(pages, seed=12)
        expected = h.payloads(pages)
        faulty = FaultyBackend(
            h.backend, seed=4, fail_rate=0.2, bit_flip_rate=0.3, truncate_rate=0.2
        )
        store = h.store_with(faulty)
        put = store.put(keys, pages)
        for _ in range(3):
            h.scribble(pages)
            got = store.get(keys, pages)
            for i, ok in enumerate(got):
                if ok:
                    assert put[i] and h.payload(pages[i]) == expected[i]
        assert sum(faulty.injected.values()) > 0

    def test_kit_backend_exceptions_are_contained(self, kit: KitEnv) -> None:
        h = kit.open()
        keys, pages = h.keys(3), h.pool.allocate(3)
        store = h.store_with(FaultyBackend(h.backend, error_rate=1.0))
        assert store.put(keys, pages) == [False] * 3
        assert store.get(keys, pages) == [False] * 3
        assert store.exists(keys) == [False] * 3
        assert store.stats()["backend_errors"] == 3

    def test_kit_foreign_geometry_is_rejected(self, kit: KitEnv) -> None:
        h = kit.open()
        keys, pages = h.keys(2), h.pool.allocate(2)
        foreign = h.store_with(h.backend, fingerprint="0123456789abcdef")
        assert foreign.put(keys, pages) == [True, True]
        assert h.store.get(keys, pages) == [False, False]
        assert h.store.stats()["invalid_wrong_geometry"] == 2

    def test_kit_page_stored_under_another_key_is_rejected(self, kit: KitEnv) -> None:
        h = kit.open()
        right, wrong = h.keys(2)
        page, out = h.pool.allocate(2)
        assert h.store.put([right], [page]) == [True]
        # the same bytes, envelope for ``right``, stored under ``wrong``
        assert h.backend.put([wrong], [h.pool.page_buffers(page)]) == [True]
        assert h.store.get([wrong], [out]) == [False]
        assert h.store.stats()["invalid_wrong_key"] == 1

    def test_kit_page_of_another_layout_is_rejected(self, kit: KitEnv) -> None:
        attention = kit.default_attention()
        declared = [lay for lay in layouts_for(attention) if kit.supports(attention, lay)]
        if len(declared) < 2:
            pytest.skip(f"backend {kit.spec.name!r} declares fewer than two layouts")
        h = kit.open(attention=attention, layout=declared[0])
        keys, pages = h.keys(2), h.pool.allocate(2)
        assert h.store.put(keys, pages) == [True, True]
        other = build_host_pool(kit.plan(attention, declared[1]), num_pages=2, pin_memory=False)
        store = h.store_with(h.backend, pool=other)
        assert store.get(keys, other.allocate(2)) == [False, False]
        assert store.stats()["invalid"] == 2
