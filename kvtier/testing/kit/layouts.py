"""Layouts: every declared (attention, layout) pair round-trips."""

from __future__ import annotations

import pytest

from kvtier.core.geometry import AttentionKind
from kvtier.core.layout import Layout, layouts_for
from kvtier.testing.kit.harness import KitEnv

__all__ = ["LayoutTests"]


class LayoutTests:
    """Every declared (attention, layout) round-trips; undeclared ones are skipped."""

    @pytest.mark.parametrize(
        ("attention", "layout"),
        [(a, lay) for a in AttentionKind for lay in layouts_for(a)],
        ids=lambda v: str(v),
    )
    def test_kit_layout_round_trip(
        self, kit: KitEnv, attention: AttentionKind, layout: Layout
    ) -> None:
        if not kit.supports(attention, layout):
            pytest.skip(f"backend {kit.spec.name!r} does not declare {attention}/{layout}")
        h = kit.open(attention=attention, layout=layout)
        keys, pages = h.keys(3), h.pool.allocate(3)
        h.fill(pages, seed=13)
        expected = h.payloads(pages)
        assert h.store.put(keys, pages) == [True] * 3
        h.scribble(pages)
        assert h.store.get(keys, pages) == [True] * 3
        assert h.payloads(pages) == expected
