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
aligned exactly when the extent size is a multiple of 4096. O_DIRECT also needs every
extent's length to be a multiple of the block (:func:`extents_block_aligned`).

This module is the one home of layout knowledge: the host pool, the IO backends, the
storage backends and the engine adapters ask it for shapes, axis orders, extents and
lengths rather than deriving them again.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from kvtier.core.errors import InvalidFieldError, did_you_mean
from kvtier.core.geometry import AttentionKind, KVGeometry

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALIGNMENT",
    "PAGE_AXES",
    "Layout",
    "align_up",
    "block_aligned_layouts",
    "check_layout",
    "extent_bytes",
    "extent_count",
    "extents_aligned",
    "extents_block_aligned",
    "has_page_axis",
    "is_page_major",
    "layouts_for",
    "page_axes",
    "page_blocks",
    "page_view",
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


def extents_block_aligned(
    geometry: KVGeometry, layout: Layout | str, alignment: int = ALIGNMENT
) -> bool:
    """Whether every extent starts *and* ends on an ``alignment`` boundary (O_DIRECT's rule)."""
    return (
        extents_aligned(geometry, layout, alignment)
        and extent_bytes(geometry, layout) % alignment == 0
    )


def block_aligned_layouts(geometry: KVGeometry, alignment: int = ALIGNMENT) -> list[Layout]:
    """The layouts of the geometry's attention kind whose extents are all block aligned."""
    return [
        layout
        for layout in layouts_for(geometry.attention)
        if extents_block_aligned(geometry, layout, alignment)
    ]


#: Axis order of one page of one kv in the host pool, per layout (``page_view``'s order
#: after its leading page axis).
PAGE_AXES: dict[Layout, tuple[str, ...]] = {
    Layout.LAYER_FIRST: ("layer", "token", "head", "dim"),
    Layout.PAGE_FIRST: ("token", "layer", "head", "dim"),
    Layout.PAGE_FIRST_DIRECT: ("layer", "token", "head", "dim"),
    Layout.PAGE_HEAD: ("head", "token", "layer", "dim"),
}


def page_axes(layout: Layout | str, *, without_layer: bool = False) -> tuple[str, ...]:
    """The axis order of one page of one kv (optionally with the layer axis dropped)."""
    axes = PAGE_AXES[Layout(layout)]
    return tuple(a for a in axes if a != "layer") if without_layer else axes


def page_view(tensor: torch.Tensor, geometry: KVGeometry, layout: Layout | str) -> torch.Tensor:
    """One kv of a pool (``pool_shape`` without the kv axis) as ``[page, *page_axes]``.

    A view, never a copy: ``page_view(...)[p]`` is page ``p`` of that kv in place.
    """
    layout = Layout(layout)
    g = geometry
    if layout is Layout.LAYER_FIRST:
        layers, tokens = tensor.shape[0], tensor.shape[1]
        pages = tokens // g.page_size
        return tensor.view(layers, pages, g.page_size, *tensor.shape[2:]).movedim(1, 0)
    if layout is Layout.PAGE_FIRST:
        pages = tensor.shape[0] // g.page_size
        return tensor.view(pages, g.page_size, *tensor.shape[1:])
    return tensor


def page_blocks(
    tensor: torch.Tensor, geometry: KVGeometry, layout: Layout | str, page: int
) -> list[torch.Tensor]:
    """The contiguous blocks of page ``page`` in one kv tensor: its extents, in order.

    One block for the page-major layouts; one per layer for ``layer_first``.
    """
    block = page_view(tensor, geometry, layout)[page]
    return list(block.unbind(0)) if Layout(layout) is Layout.LAYER_FIRST else [block]
