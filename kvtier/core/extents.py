"""Extents: a page as a list of memory regions, for scatter-gather I/O with no staging copy."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvtier.core.errors import ExtentError

__all__ = ["Extent", "copy_extents", "extent_of_tensor", "extent_of_view"]


class Extent(NamedTuple):
    """One contiguous memory region: a writable byte memoryview and its (pointer, length).

    ``view`` and ``ptr`` describe the same bytes; backends use whichever their I/O call
    takes (``os.preadv`` takes views, Mooncake and io_uring take pointers).
    """

    view: memoryview
    ptr: int
    length: int


def extent_of_tensor(tensor: torch.Tensor) -> Extent:
    """A zero-copy extent over a contiguous CPU tensor's bytes (pinned memory included)."""
    if tensor.device.type != "cpu":
        raise ExtentError(
            f"extents need host memory, got a tensor on {tensor.device}; copy it to the CPU "
            "(pinned memory is fine) first",
            value=str(tensor.device),
        )
    if not tensor.is_contiguous():
        raise ExtentError(
            f"extents need a contiguous tensor region, got strides {tuple(tensor.stride())}; "
            "pass tensor.contiguous() or one contiguous slice per extent",
            value=tuple(tensor.stride()),
        )
    length = tensor.numel() * tensor.element_size()
    ptr = tensor.data_ptr()
    view = (
        memoryview((ctypes.c_ubyte * length).from_address(ptr)).cast("B")
        if length
        else (memoryview(bytearray(0)))
    )
    return Extent(view, ptr, length)


def extent_of_view(view: memoryview) -> Extent:
    """An extent over a writable, contiguous byte memoryview."""
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if view.readonly:
        raise ExtentError(
            "extents must be writable so that gets can fill them in place; pass a "
            "memoryview of a bytearray or of writable memory",
            value=view,
        )
    length = view.nbytes
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(view)) if length else 0
    return Extent(view, ptr, length)


def copy_extents(source: Sequence[Extent], target: Sequence[Extent]) -> None:
    """Copy the bytes of ``source``'s regions, in order, into ``target``'s (the same total;
    the two may cut the page into regions differently)."""
    out = iter(target)
    dst, at = next(out).view, 0
    for region in source:
        src, done = region.view, 0
        while done < src.nbytes:
            if at == dst.nbytes:
                dst, at = next(out).view, 0
            n = min(src.nbytes - done, dst.nbytes - at)
            dst[at : at + n] = src[done : done + n]
            done += n
            at += n
