"""The host pool (L2): aligned, optionally pinned host memory in one layout, plus a page allocator.

Memory is two slabs, each starting on a 4096-byte boundary: the payload slab holding the
pool tensor (one region per kv, each aligned; see :mod:`kvtier.core.layout` for when every
extent is aligned too) and a header slab with one :data:`ENVELOPE_BYTES` slot per page for
the integrity envelope. Storage backends see a page as
``[header_extent(page), *extents(page)]``; the extent lists are built once and cached.
"""

from __future__ import annotations

import heapq
import threading
import weakref
from collections.abc import Iterable

import torch

from kvtier.core.envelope import ENVELOPE_BYTES
from kvtier.core.errors import InvalidFieldError, KvtierError, PageError, PoolExhaustedError
from kvtier.core.extents import Extent, extent_of_tensor
from kvtier.core.geometry import KVGeometry
from kvtier.core.layout import (
    ALIGNMENT,
    Layout,
    align_up,
    check_layout,
    has_page_axis,
    page_blocks,
    page_view,
    pool_shape,
    region_stride_bytes,
)

__all__ = ["HostPool", "aligned_empty", "check_host_page"]


#: Pools from this size up are pinned by registering ordinary memory with CUDA
#: (``cudaHostRegister``) rather than taken from torch's pinned allocator, which rounds
#: each block up to a power of two: a 40 GiB pool would pin 64 GiB.
REGISTER_FROM_BYTES = 64 << 20


def aligned_empty(nbytes: int, *, pin_memory: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(backing, slab)``: a uint8 slab of ``nbytes`` starting on a 4096 boundary.

    torch aligns CPU tensors only to 64 bytes, so we over-allocate by 4096 and slice.
    Pinned memory from ``REGISTER_FROM_BYTES`` up is ordinary memory registered with CUDA
    (:func:`register_pinned`; unregistered when ``backing`` is freed); smaller slabs, or
    where registration fails, come page-aligned from the CUDA host allocator, tried at
    the exact size first since it rounds sizes up to a power of two. The slab's storage
    keeps ``backing`` alive.
    """
    if pin_memory and nbytes >= REGISTER_FROM_BYTES:
        backing = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8)
        offset = (-backing.data_ptr()) % ALIGNMENT
        slab = backing[offset : offset + nbytes]
        if register_pinned(backing):
            return backing, slab
        del backing, slab
    if pin_memory:
        exact = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if exact.data_ptr() % ALIGNMENT == 0:
            return exact, exact
        del exact
    backing = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, pin_memory=pin_memory)
    offset = (-backing.data_ptr()) % ALIGNMENT
    slab = backing[offset : offset + nbytes]
    return backing, slab


def register_pinned(tensor: torch.Tensor) -> bool:
    """Page-lock ``tensor``'s memory for DMA (``cudaHostRegister``) until it is freed.

    Returns False, pinning nothing, where CUDA refuses (no driver support, the locked
    memory limit): the caller then takes memory from torch's pinned allocator instead.
    """
    try:
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        ptr, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if int(cudart.cudaHostRegister(ptr, size, 0)) != 0:
            return False
    except (AttributeError, RuntimeError):
        return False
    weakref.finalize(tensor, _unregister, cudart, ptr)
    return True


def _unregister(cudart: object, ptr: int) -> None:
    """Undo :func:`register_pinned` (the memory is still there: the tensor is being freed)."""
    unregister = getattr(cudart, "cudaHostUnregister", None)
    if unregister is not None:
        unregister(ptr)


def check_host_page(page: object, num_pages: int, *, error: type[KvtierError] = PageError) -> int:
    """The one host-page-id check: ``page`` if it is an int in ``0..num_pages-1``.

    Otherwise raises ``error`` (PageError from the pool, TransferError from an IO backend)
    naming the bad id and the valid range, with the id as ``.value``.
    """
    if isinstance(page, bool) or not isinstance(page, int):
        fault = "is not an int"
    elif 0 <= page < num_pages:
        return page
    else:
        fault = "is out of range"
    raise error(
        f"host page {page!r} {fault}: the host pool has pages 0..{num_pages - 1}", value=page
    )


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidFieldError(name, f"must be a positive integer, got {value!r}", value=value)
    return value


class HostPool:
    """Host memory for ``num_pages`` KV pages in ``layout``, with a thread-safe page allocator.

    Size it with exactly one of ``num_pages`` or ``size_bytes`` (the budget for payload,
    page padding and envelope headers together). ``pin_memory=None`` pins when CUDA is
    available, so device copies can run asynchronously through DMA.
    """

    def __init__(
        self,
        geometry: KVGeometry,
        layout: Layout | str,
        *,
        num_pages: int | None = None,
        size_bytes: int | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        self.geometry = geometry
        self.layout = check_layout(geometry, layout)
        self.page_bytes = geometry.bytes_per_page
        kv = geometry.kv_count
        self._stride = region_stride_bytes(geometry, self.layout)  # bytes per page per kv
        footprint = kv * self._stride + ENVELOPE_BYTES
        if (num_pages is None) == (size_bytes is None):
            raise InvalidFieldError(
                "host_pool",
                "give exactly one of num_pages or size_bytes "
                f"(got num_pages={num_pages!r}, size_bytes={size_bytes!r}); "
                f"one page takes {footprint} bytes with its envelope header",
                value=(num_pages, size_bytes),
            )
        if num_pages is not None:
            self.num_pages = _positive_int("num_pages", num_pages)
        else:
            size = _positive_int("size_bytes", size_bytes)
            smallest = self._footprint(1, kv)
            if size < smallest:
                raise InvalidFieldError(
                    "size_bytes",
                    f"{size} bytes hold no page: one page of {geometry.describe()} in "
                    f"{self.layout.value} takes {smallest} bytes with its envelope header",
                    value=size,
                )
            pages = size // footprint
            while self._footprint(pages, kv) > size:
                pages -= 1  # dense layouts round each kv region up to 4096
            self.num_pages = pages
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        elif pin_memory and not torch.cuda.is_available():
            raise InvalidFieldError(
                "pin_memory",
                "pinned memory needs CUDA, which is not available here; "
                "pass pin_memory=None (auto) or False",
                value=pin_memory,
            )
        self.pin_memory = bool(pin_memory)
        self._build_memory(kv)
        self._lock = threading.Lock()
        self._free_heap = list(range(self.num_pages))  # already a valid min-heap
        self._free_set = set(self._free_heap)
        self._extent_cache: dict[int, tuple[Extent, ...]] = {}
        self._buffer_cache: dict[int, tuple[Extent, ...]] = {}

    # --- memory ---------------------------------------------------------------------

    def _footprint(self, num_pages: int, kv: int) -> int:
        """Bytes a pool of ``num_pages`` holds: kv regions (aligned) plus header slots."""
        region = num_pages * self._stride
        if not has_page_axis(self.layout):
            region = align_up(region)
        return kv * region + num_pages * ENVELOPE_BYTES

    def _build_memory(self, kv: int) -> None:
        g, n = self.geometry, self.num_pages
        itemsize = g.itemsize
        dense = not has_page_axis(self.layout)
        region = align_up(n * self._stride) if dense else n * self._stride
        self._region_bytes = region
        self._backing, self._payload = aligned_empty(kv * region, pin_memory=self.pin_memory)
        self._header_backing, self._headers = aligned_empty(
            n * ENVELOPE_BYTES, pin_memory=self.pin_memory
        )
        self._headers.zero_()
        shape = pool_shape(g, self.layout, n)
        per_kv_shape = shape[1:] if kv == 2 else shape
        per_page = g.bytes_per_page // kv
        kv_tensors = []
        for c in range(kv):
            raw = self._payload[c * region : (c + 1) * region]
            if has_page_axis(self.layout):
                rows = raw.view(n, self._stride)[:, :per_page]
                typed = rows.view(g.dtype).view(per_kv_shape)
            else:
                typed = raw[: n * per_page].view(g.dtype).view(per_kv_shape)
            kv_tensors.append(typed)
        self.kv_buffers: tuple[torch.Tensor, ...] = tuple(kv_tensors)
        if kv == 2:
            k = kv_tensors[0]
            # one tensor over both regions: the kv axis strides by the (aligned) region size
            self.buffer = k.as_strided(
                (2, *k.shape), (region // itemsize, *k.stride()), k.storage_offset()
            )
        else:
            self.buffer = kv_tensors[0]

    def page_view(self, kv: int) -> torch.Tensor:
        """One kv of the pool as ``[page, *page_axes(layout)]`` (a view, see layout.py)."""
        return page_view(self.kv_buffers[kv], self.geometry, self.layout)

    def _check_page(self, page: object) -> int:
        return check_host_page(page, self.num_pages)

    def extents(self, page: int) -> list[Extent]:
        """The page's memory regions in canonical order, zero-copy over the pool's memory."""
        page = self._check_page(page)
        cached = self._extent_cache.get(page)
        if cached is None:
            cached = tuple(
                extent_of_tensor(block)
                for tensor in self.kv_buffers
                for block in page_blocks(tensor, self.geometry, self.layout, page)
            )
            self._extent_cache[page] = cached
        return list(cached)

    def header_extent(self, page: int) -> Extent:
        """The page's envelope slot: ``ENVELOPE_BYTES`` bytes, 4096-aligned."""
        page = self._check_page(page)
        return self.page_buffers(page)[0]

    def page_buffers(self, page: int) -> list[Extent]:
        """``[header_extent(page), *extents(page)]``: what a storage backend stores."""
        # the cache holds only checked ids (a bool is never one: its type is not int)
        cached = self._buffer_cache.get(page) if type(page) is int else None
        if cached is None:
            page = self._check_page(page)
            header = self._headers[page * ENVELOPE_BYTES : (page + 1) * ENVELOPE_BYTES]
            cached = (extent_of_tensor(header), *self.extents(page))
            self._buffer_cache[page] = cached
        return list(cached)

    def memory_regions(self) -> list[Extent]:
        """The payload slab and the header slab, for backends that register memory once."""
        return [extent_of_tensor(self._payload), extent_of_tensor(self._headers)]

    def zero_(self) -> HostPool:
        """Zero every payload byte; also faults the memory in, so no transfer pays for it."""
        self._payload.zero_()
        return self

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the pool holds (payload slab, padding and headers)."""
        return int(self._payload.numel() + self._headers.numel())

    # --- allocator ------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages not currently allocated."""
        with self._lock:
            return len(self._free_heap)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free pages (lowest ids first, so neighbours tend to stay adjacent)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise PageError(f"allocate() needs a non-negative int, got {n!r}", value=n)
        with self._lock:
            free = len(self._free_heap)
            if n > free:
                raise PoolExhaustedError(
                    f"host pool exhausted: asked for {n} pages, {free} of {self.num_pages} "
                    f"are free; free pages first or grow the pool (num_pages / size_bytes; "
                    f"one page is {self.page_bytes} bytes)",
                    value=n,
                )
            pages = [heapq.heappop(self._free_heap) for _ in range(n)]
            self._free_set.difference_update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the pool; all are checked before any is freed."""
        pages = list(pages)
        for page in pages:
            self._check_page(page)
        with self._lock:
            seen: set[int] = set()
            for page in pages:
                if page in self._free_set or page in seen:
                    raise PageError(
                        f"page {page} is not allocated (double free?); nothing was freed",
                        value=page,
                    )
                seen.add(page)
            for page in pages:
                heapq.heappush(self._free_heap, page)
            self._free_set.update(pages)

    def __repr__(self) -> str:
        return (
            f"HostPool({self.geometry.describe()}, layout={self.layout.value}, "
            f"num_pages={self.num_pages}, pinned={self.pin_memory})"
        )
