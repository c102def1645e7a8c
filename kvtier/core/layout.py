"""Host-pool layouts: how the host pool orders its memory.

Axis orders (MLA drops the leading kv axis):

- ``layer_first``        [kv, layer, token, head, dim]
- ``page_first``         [kv, token, layer, head, dim]
- ``page_first_direct``  [kv, page, layer, token-in-page, head, dim]
- ``page_head``          [kv, page, head, token-in-page, layer, dim]   (MHA only)

A page is ``page_size`` consecutive token slots. Its *extents* are the contiguous memory
regions that hold it, in canonical order (K before V, layer 0 first):

- page-major layouts (``page_first``, ``page_first_direct``, ``page_head``): one extent
  per kv (2 for MHA, 1 for MLA), each ``bytes_per_page / kv_count`` bytes;
- ``layer_first``: one extent per kv and layer (``2 x layers`` for MHA, ``layers`` for
  MLA), each ``bytes_per_page / (kv_count * layers)`` bytes.

Alignment (see :func:`extents_aligned`): the host pool starts every kv region at a
4096-byte boundary and pads the page stride of the layouts that have a page axis
(``page_first_direct``, ``page_head``) to a multiple of 4096, so their extents are always
4096-aligned. ``page_first`` and ``layer_first`` pack pages densely, so their extents are
aligned exactly when the extent size is a multiple of 4096.
"""

from __future__ import annotations

import enum

from kvtier.core.errors import InvalidFieldError
from kvtier.core.geometry import AttentionKind, KVGeometry

__all__ = [
    "ALIGNMENT",
    "Layout",
    "align_up",
    "check_layout",
    "extent_bytes",
    "extent_count",
    "extents_aligned",
    "has_page_axis",
    "is_page_major",
    "layouts_for",
    "pool_shape",
    "region_stride_bytes",
]

#: Alignment of host-pool memory in bytes (O_DIRECT and the page cache want 4096).
ALIGNMENT = 4096


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


def align_up(value: int, alignment: int = ALIGNMENT) -> int:
    """Round ``value`` up to a multiple of ``alignment``."""
    return -(-value // alignment) * alignment


def check_layout(geometry: KVGeometry, layout: Layout | str) -> Layout:
    """Return ``layout`` as a :class:`Layout` if it fits the geometry's attention kind."""
    allowed = layouts_for(geometry.attention)
    try:
        resolved = Layout(layout)
    except ValueError:
        from kvtier.core.errors import did_you_mean

        names = [item.value for item in allowed]
        raise InvalidFieldError(
            "layout",
            f"unknown layout {layout!r}{did_you_mean(str(layout), names)}; "
            f"{geometry.attention.value.upper()} supports: {', '.join(names)}",
            value=layout,
        ) from None
    if resolved not in allowed:
        raise InvalidFieldError(
            "layout",
            f"layout {resolved.value!r} does not exist for "
            f"{geometry.attention.value.upper()}; use one of: "
            f"{', '.join(item.value for item in allowed)}",
            value=resolved.value,
        )
    return resolved


def is_page_major(layout: Layout | str) -> bool:
    """True when one page of one kv is a single contiguous block (every layout but layer_first)."""
    return Layout(layout) is not Layout.LAYER_FIRST


def has_page_axis(layout: Layout | str) -> bool:
    """True for layouts with an explicit page axis, whose page stride the pool can pad."""
    return Layout(layout) in (Layout.PAGE_FIRST_DIRECT, Layout.PAGE_HEAD)


def pool_shape(geometry: KVGeometry, layout: Layout | str, num_pages: int) -> tuple[int, ...]:
    """The logical shape of a host pool of ``num_pages`` pages (MLA drops the kv axis)."""
    layout = check_layout(geometry, layout)
    g = geometry
    tokens = num_pages * g.page_size
    shape: tuple[int, ...]
    if layout is Layout.LAYER_FIRST:
        shape = (g.num_layers, tokens, g.num_kv_heads, g.head_dim)
    elif layout is Layout.PAGE_FIRST:
        shape = (tokens, g.num_layers, g.num_kv_heads, g.head_dim)
    elif layout is Layout.PAGE_FIRST_DIRECT:
        shape = (num_pages, g.num_layers, g.page_size, g.num_kv_heads, g.head_dim)
    else:
        shape = (num_pages, g.num_kv_heads, g.page_size, g.num_layers, g.head_dim)
    return (2, *shape) if g.attention is AttentionKind.MHA else shape


def extent_count(geometry: KVGeometry, layout: Layout | str) -> int:
    """How many extents one page has: kv_count, times layers for layer_first."""
    layout = check_layout(geometry, layout)
    per_kv = 1 if is_page_major(layout) else geometry.num_layers
    return geometry.kv_count * per_kv


def extent_bytes(geometry: KVGeometry, layout: Layout | str) -> int:
    """The size of each extent of a page (all extents of a page have the same size)."""
    return geometry.bytes_per_page // extent_count(geometry, layout)


def region_stride_bytes(geometry: KVGeometry, layout: Layout | str) -> int:
    """Bytes between consecutive pages of one kv in the host pool (padded for page axes)."""
    layout = check_layout(geometry, layout)
    per_kv_page = geometry.bytes_per_page // geometry.kv_count
    return align_up(per_kv_page) if has_page_axis(layout) else per_kv_page


def extents_aligned(geometry: KVGeometry, layout: Layout | str, alignment: int = ALIGNMENT) -> bool:
    """Whether every extent of every page of a host pool starts on an ``alignment`` boundary.

    Cheap and allocation-free, so a backend can check it at config time (O_DIRECT).
    """
    layout = check_layout(geometry, layout)
    if alignment <= 0 or ALIGNMENT % alignment:
        return False
    if has_page_axis(layout):
        return True
    return extent_bytes(geometry, layout) % alignment == 0
