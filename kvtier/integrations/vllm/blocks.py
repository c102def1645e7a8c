"""vLLM's paged KV cache seen as kvtier pages: one vLLM block (all layers) is one page.

On vLLM's CPU attention backend the KV cache lives in host memory, in the ``LBHNC``
layout: per layer one tensor ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``,
so a block of one layer is one contiguous run. A page's extents are those runs, one per
layer in layer order (adjacent runs merged), and backends read and write them in place:
no staging copy and no host pool in between. The envelope of each page sits in a slot of
a slab kept here, since vLLM's blocks have no header room.

Under vLLM's hybrid allocator the KV cache groups overlay the same memory (a block id
belongs to one group at a time): layers of different groups alias one tensor, so a page
is a block across the distinct layer *positions* (:func:`layer_positions`), whichever
group owns the block. Pages past the blocks are staging pages in a slab of their own,
for blocks vLLM frees while the request runs (a sliding-window group's): such a block is
copied there at the end of its step and stored from there.

Refused at start-up, with the reason: KV caches on an accelerator (an accelerator engine
takes the device strategy, :mod:`.device_worker`, chosen from vLLM's device), per-layer
tensors whose blocks are not contiguous (K and V split across the tensor, as the GPU
backends' ``[2, blocks, ...]`` shape is), and tensors that disagree with the geometry.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Mapping, Sequence

import torch

from kvtier.core.envelope import ENVELOPE_BYTES
from kvtier.core.errors import PageError, UnsupportedCombinationError
from kvtier.core.extents import Extent, extent_of_tensor
from kvtier.core.geometry import KVGeometry
from kvtier.core.host_pool import aligned_empty
from kvtier.core.layout import Layout

__all__ = [
    "SUPPORTED",
    "VLLMBlocks",
    "check_layer_count",
    "layer_positions",
    "memory_region",
    "order_layers",
    "refuse",
]

#: What this adapter stores, as start-up errors list it.
SUPPORTED = [
    "vLLM's CPU attention backend (CPU_ATTN, KV cache layout LBHNC): per layer "
    "[num_blocks, num_kv_heads, block_size, 2 * head_size], MHA/GQA, full attention or "
    "hybrid (full and sliding-window groups)",
    "vLLM's CPU MLA backend (CPU_MLA): per layer [num_blocks, 1, block_size, latent]",
]


#: Why the CPU strategy refuses a KV cache, as its errors end.
_IN_PLACE = "kvtier stores blocks that are one contiguous run per layer in host memory"


def refuse(
    what: str, value: object, supported: Sequence[str] = SUPPORTED
) -> UnsupportedCombinationError:
    """The start-up error for a vLLM setting or KV cache kvtier cannot store: ``what`` is
    wrong (the whole message), the offending ``value``, and what would work."""
    return UnsupportedCombinationError(what, value=value, supported=list(supported))


def check_layer_count(
    layers: Sequence[tuple[str, torch.Tensor]], geometry: KVGeometry, supported: Sequence[str]
) -> None:
    """Refuse KV cache tensors of another layer count than the model's geometry."""
    if len(layers) != geometry.num_layers:
        raise refuse(
            f"vLLM KV cache: vLLM registered {len(layers)} KV cache tensors for a model of "
            f"{geometry.num_layers} attention layers",
            len(layers),
            supported,
        )


def order_layers(
    kv_caches: Mapping[str, torch.Tensor], layer_index: dict[str, int]
) -> list[tuple[str, torch.Tensor]]:
    """The layers' tensors in model order (by ``layer_index``, else vLLM's order)."""
    names = list(kv_caches)
    if all(name in layer_index for name in names):
        names.sort(key=lambda name: layer_index[name])
    return [(name, kv_caches[name]) for name in names]


def memory_region(tensor: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """Where a layer's tensor lies: tensors that alias one another share it."""
    return (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))


def layer_positions(layers: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """One layer per distinct memory region, in order: layers that alias one tensor (the
    KV cache groups of vLLM's hybrid allocator overlay each other) are one position."""
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    out = []
    for name, tensor in layers:
        where = memory_region(tensor)
        if where not in seen:
            seen.add(where)
            out.append((name, tensor))
    return out


class VLLMBlocks:
    """kvtier's page view of vLLM's KV blocks: envelope slots here, payload in place.

    Page ``b`` is vLLM block ``b``; its extents are block ``b`` of every layer's tensor.
    """

    def __init__(
        self,
        layers: Sequence[tuple[str, torch.Tensor]],
        *,
        num_blocks: int,
        geometry: KVGeometry,
        layout: Layout,
        staging_pages: int = 0,
    ) -> None:
        check_layer_count(layers, geometry, SUPPORTED)
        per_layer = geometry.bytes_per_page // geometry.num_layers
        for name, tensor in layers:
            if tensor.device.type != "cpu":
                raise refuse(
                    f"vLLM KV cache: layer {name!r} keeps its KV cache on {tensor.device}, but "
                    "vLLM's device is the CPU; the CPU strategy stores blocks in host memory "
                    f"(accelerator engines take kvtier's device strategy); {_IN_PLACE}",
                    str(tensor.device),
                )
            block = tensor[0] if tensor.dim() > 1 else None
            if block is None or tensor.shape[0] != num_blocks or not block.is_contiguous():
                raise refuse(
                    f"vLLM KV cache: layer {name!r} has shape {tuple(tensor.shape)} and strides "
                    f"{tuple(tensor.stride())}, so a block is not one contiguous run "
                    f"(expected the block axis first, {num_blocks} blocks, each contiguous); "
                    f"{_IN_PLACE}",
                    tuple(tensor.shape),
                )
            nbytes = block.numel() * block.element_size()
            if nbytes != per_layer:
                raise refuse(
                    f"vLLM KV cache: a block of layer {name!r} holds {nbytes} bytes, but "
                    f"{geometry.describe()} takes {per_layer} bytes per block and layer; "
                    f"{_IN_PLACE}",
                    nbytes,
                )
        self.geometry = geometry
        self.num_blocks = num_blocks
        #: Pages ``num_blocks`` .. ``num_pages - 1`` are staging pages (see the module).
        self.staging_pages = staging_pages
        self.num_pages = num_blocks + staging_pages
        self._layout = layout
        self._tensors = [tensor for _, tensor in layers]
        #: One ENVELOPE_BYTES slot per page; untouched slots cost no memory.
        self._headers = aligned_empty(self.num_pages * ENVELOPE_BYTES)[1]
        self._staging = aligned_empty(max(1, staging_pages) * geometry.bytes_per_page)[1]
        self._cache: dict[int, list[Extent]] = {}
        self._header_cache: dict[int, Extent] = {}
        self._lock = threading.Lock()

    @property
    def layout(self) -> Layout:
        return self._layout

    def _check(self, page: int) -> None:
        if isinstance(page, bool) or not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise PageError(
                f"vLLM block {page!r} is out of range: the KV cache has blocks "
                f"0..{self.num_blocks - 1} (and {self.staging_pages} staging pages after them)",
                value=page,
            )

    def header_extent(self, page: int) -> Extent:
        """The envelope slot of block ``page`` (made once per page: a store or load of
        thousands of pages a second asks for it every time)."""
        slot = self._header_cache.get(page)
        if slot is None:
            self._check(page)
            start = page * ENVELOPE_BYTES
            slot = extent_of_tensor(self._headers[start : start + ENVELOPE_BYTES])
            with self._lock:
                self._header_cache[page] = slot
        return slot

    def extents(self, page: int) -> list[Extent]:
        """Block ``page`` of every layer, in layer order; adjacent runs merged."""
        cached = self._cache.get(page)
        if cached is None:
            self._check(page)
            if page >= self.num_blocks:  # a staging page: one run in the slab
                size = self.geometry.bytes_per_page
                view = self._staging[(page - self.num_blocks) * size :][:size]
                cached = [extent_of_tensor(view)]
                with self._lock:
                    self._cache[page] = cached
                return list(cached)
            runs: list[tuple[int, int]] = []
            for tensor in self._tensors:
                block = tensor[page]
                ptr, length = block.data_ptr(), block.numel() * block.element_size()
                if runs and runs[-1][0] + runs[-1][1] == ptr:
                    runs[-1] = (runs[-1][0], runs[-1][1] + length)
                else:
                    runs.append((ptr, length))
            cached = [_extent_at(ptr, length) for ptr, length in runs]
            with self._lock:
                self._cache[page] = cached
        return list(cached)

    def page_buffers(self, page: int) -> list[Extent]:
        """``[header_extent(page), *extents(page)]``: what the backend stores."""
        return [self.header_extent(page), *self.extents(page)]

    def copy_block(self, source: int, target: int) -> None:
        """Copy page ``source`` (every layer) over page ``target``, bit for bit (a vLLM
        block or a staging page, either way)."""
        self._check(source)
        self._check(target)
        if source < self.num_blocks and target < self.num_blocks:
            for tensor in self._tensors:
                tensor[target].copy_(tensor[source])
            return
        src, dst = self.extents(source), self.extents(target)
        i = j = at_src = at_dst = 0  # the pages hold the same bytes in the same order
        while i < len(src) and j < len(dst):
            length = min(src[i].length - at_src, dst[j].length - at_dst)
            ctypes.memmove(dst[j].ptr + at_dst, src[i].ptr + at_src, length)
            at_src += length
            at_dst += length
            if at_src == src[i].length:
                i, at_src = i + 1, 0
            if at_dst == dst[j].length:
                j, at_dst = j + 1, 0


def _extent_at(ptr: int, length: int) -> Extent:
    """An extent over ``length`` bytes of vLLM's KV memory at ``ptr`` (checked above)."""
    view = memoryview((ctypes.c_ubyte * length).from_address(ptr)).cast("B")
    return Extent(view, ptr, length)
