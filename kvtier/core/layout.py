"""Host-pool layouts: how the host pool orders its memory.

Axis orders (MLA drops the leading kv axis):

- ``layer_first``        [kv, layer, token, head, dim]
- ``page_first``         [kv, token, layer, head, dim]
- ``page_first_direct``  [kv, page, layer, token-in-page, head, dim]
- ``page_head``          [kv, page, head, token-in-page, layer, dim]   (MHA only)
"""

from __future__ import annotations

import enum

from kvtier.core.geometry import AttentionKind

__all__ = ["Layout", "layouts_for"]


class Layout(str, enum.Enum):
    """The memory order of a host pool."""

    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    PAGE_FIRST_DIRECT = "page_first_direct"
    PAGE_HEAD = "page_head"

    def __str__(self) -> str:
        return self.value


_BY_ATTENTION: dict[AttentionKind, tuple[Layout, ...]] = {
    AttentionKind.MHA: (
        Layout.LAYER_FIRST,
        Layout.PAGE_FIRST,
        Layout.PAGE_FIRST_DIRECT,
        Layout.PAGE_HEAD,
    ),
    AttentionKind.MLA: (Layout.LAYER_FIRST, Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT),
}


def layouts_for(attention: AttentionKind) -> tuple[Layout, ...]:
    """The layouts a host pool can take for this attention kind."""
    return _BY_ATTENTION[AttentionKind(attention)]
