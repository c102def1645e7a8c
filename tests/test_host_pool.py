"""Host pool: aligned zero-copy extents in every layout, header slots, sizing, allocator."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from kvtier.core.envelope import ENVELOPE_BYTES
from kvtier.core.errors import InvalidFieldError, PageError, PoolExhaustedError
from kvtier.core.geometry import AttentionKind, KVGeometry
from kvtier.core.host_pool import HostPool, aligned_empty
from kvtier.core.layout import Layout, extent_bytes, extent_count, extents_aligned, layouts_for

TINY_MHA = KVGeometry.mha(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)
TINY_MLA = KVGeometry.mla(
    num_layers=2, kv_lora_rank=8, qk_rope_head_dim=4, dtype="bfloat16", page_size=4
)
# 4096 bytes per (page, layer, kv): every layout's extents are aligned
ALIGNED_MHA = KVGeometry.mha(
    num_layers=2, num_kv_heads=2, head_dim=128, dtype="float16", page_size=8
)
GEOMETRIES = [TINY_MHA, TINY_MLA, ALIGNED_MHA]
CASES = [
    pytest.param(g, layout, id=f"{name}-{layout.value}")
    for g, name in zip(GEOMETRIES, ["mha", "mla", "mha4k"], strict=True)
    for layout in layouts_for(g.attention)
]


def _expected_blocks(pool: HostPool, page: int) -> list[torch.Tensor]:
    """The page's regions straight from the documented axis order of ``pool.buffer``."""
    g, ps = pool.geometry, pool.geometry.page_size
    buf = pool.buffer if g.attention is AttentionKind.MHA else pool.buffer.unsqueeze(0)
    blocks = []
    for c in range(g.kv_count):
        if pool.layout is Layout.LAYER_FIRST:
            blocks += [buf[c, layer, page * ps : (page + 1) * ps] for layer in range(g.num_layers)]
        elif pool.layout is Layout.PAGE_FIRST:
            blocks.append(buf[c, page * ps : (page + 1) * ps])
        else:
            blocks.append(buf[c, page])
    return blocks


@pytest.mark.parametrize(("geometry", "layout"), CASES)
def test_extents_are_the_layouts_page_regions_zero_copy(
    geometry: KVGeometry, layout: Layout
) -> None:
    pool = HostPool(geometry, layout, num_pages=3)
    assert pool.page_bytes == geometry.bytes_per_page
    pool.buffer.view(torch.uint8).copy_(
        torch.randint(0, 256, pool.buffer.view(torch.uint8).shape, dtype=torch.uint8)
    )
    for page in range(pool.num_pages):
        extents = pool.extents(page)
        assert len(extents) == extent_count(geometry, layout)
        assert sum(e.length for e in extents) == geometry.bytes_per_page
        assert {e.length for e in extents} == {extent_bytes(geometry, layout)}
        for extent, block in zip(extents, _expected_blocks(pool, page), strict=True):
            assert extent.ptr == block.data_ptr()
            assert bytes(extent.view) == block.contiguous().view(torch.uint8).numpy().tobytes()
        # writing through the extent changes the pool: zero-copy
        extents[0].view[:4] = b"\x01\x02\x03\x04"
        first = _expected_blocks(pool, page)[0].reshape(-1).view(torch.uint8)
        assert first[:4].tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize(("geometry", "layout"), CASES)
def test_alignment_matches_the_layouts_promise(geometry: KVGeometry, layout: Layout) -> None:
    pool = HostPool(geometry, layout, num_pages=5)
    ptrs = [e.ptr for page in range(pool.num_pages) for e in pool.extents(page)]
    if extents_aligned(geometry, layout):
        assert all(ptr % 4096 == 0 for ptr in ptrs)
    else:
        assert any(ptr % 4096 for ptr in ptrs)
    # the first extent of each kv region (K and V) always starts aligned
    per_kv = extent_count(geometry, layout) // geometry.kv_count
    assert all(pool.extents(0)[c * per_kv].ptr % 4096 == 0 for c in range(geometry.kv_count))
    for page in range(pool.num_pages):
        header = pool.header_extent(page)
        assert header.length == ENVELOPE_BYTES and header.ptr % 4096 == 0
    assert all(region.ptr % 4096 == 0 for region in pool.memory_regions())


@pytest.mark.parametrize(("geometry", "layout"), CASES)
def test_pages_and_headers_never_overlap_and_lie_in_the_registered_regions(
    geometry: KVGeometry, layout: Layout
) -> None:
    pool = HostPool(geometry, layout, num_pages=4)
    payload, headers = pool.memory_regions()
    spans = []
    for page in range(pool.num_pages):
        header, *extents = pool.page_buffers(page)
        assert header == pool.header_extent(page)
        assert (
            headers.ptr <= header.ptr and header.ptr + header.length <= headers.ptr + headers.length
        )
        for e in extents:
            assert payload.ptr <= e.ptr and e.ptr + e.length <= payload.ptr + payload.length
        spans += [(e.ptr, e.ptr + e.length) for e in (header, *extents)]
    spans.sort()
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start
    assert pool.nbytes == payload.length + headers.length


def test_headers_start_zeroed_and_extent_lists_are_cached_copies() -> None:
    pool = HostPool(TINY_MHA, "page_first", num_pages=2)
    assert bytes(pool.header_extent(1).view) == bytes(ENVELOPE_BYTES)
    first = pool.extents(0)
    first.clear()
    assert len(pool.extents(0)) == 2
    assert pool.extents(0)[0].view is pool.extents(0)[0].view  # built once


def test_zero_clears_every_payload_byte_and_no_header() -> None:
    pool = HostPool(TINY_MLA, "page_first_direct", num_pages=3)
    for page in range(3):
        for extent in pool.page_buffers(page):
            extent.view[:] = b"\xff" * extent.length
    assert pool.zero_() is pool
    for page in range(3):
        header, *extents = pool.page_buffers(page)
        assert all(not any(e.view) for e in extents)
        assert all(byte == 0xFF for byte in header.view)


def test_extents_of_a_page_outside_the_pool_are_refused() -> None:
    pool = HostPool(TINY_MHA, "layer_first", num_pages=2)
    for bad in (2, -1):
        with pytest.raises(PageError, match=r"pages 0\.\.1"):
            pool.extents(bad)
    with pytest.raises(PageError, match=r"host page True is not an int: .* pages 0\.\.1"):
        pool.header_extent(True)


def test_aligned_empty_is_aligned() -> None:
    for size in (1, 100, 4096, 10_000):
        _, slab = aligned_empty(size)
        assert slab.data_ptr() % 4096 == 0 and slab.numel() == size


# --- sizing ---------------------------------------------------------------------------


def test_sized_in_bytes_counts_padding_and_headers() -> None:
    per_page = 2 * 4096 + ENVELOPE_BYTES  # page_first_direct pads each kv page to 4096
    pool = HostPool(TINY_MHA, "page_first_direct", size_bytes=per_page * 3 + 17)
    assert pool.num_pages == 3
    assert HostPool(ALIGNED_MHA, "layer_first", size_bytes=10**6).num_pages == 10**6 // (
        ALIGNED_MHA.bytes_per_page + ENVELOPE_BYTES
    )
    for size in range(12_288, 60_000, 997):  # dense regions round up to 4096: never over budget
        pool = HostPool(TINY_MHA, "page_first", size_bytes=size)
        assert pool.nbytes <= size


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "exactly one of num_pages or size_bytes"),
        ({"num_pages": 2, "size_bytes": 10**6}, "exactly one of num_pages or size_bytes"),
        ({"num_pages": 0}, "num_pages: must be a positive integer"),
        ({"num_pages": 2.0}, "num_pages: must be a positive integer"),
        ({"size_bytes": 100}, "hold no page"),
    ],
)
def test_bad_sizes_are_refused_clearly(kwargs: dict, match: str) -> None:
    with pytest.raises(InvalidFieldError, match=match):
        HostPool(TINY_MHA, "page_first", **kwargs)


def test_layout_must_fit_the_attention_kind() -> None:
    with pytest.raises(InvalidFieldError, match="page_head"):
        HostPool(TINY_MLA, "page_head", num_pages=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works where CUDA exists")
def test_pinning_without_cuda_is_refused_and_auto_does_not_pin() -> None:
    with pytest.raises(InvalidFieldError, match="pin_memory"):
        HostPool(TINY_MHA, "page_first", num_pages=1, pin_memory=True)
    assert HostPool(TINY_MHA, "page_first", num_pages=1).pin_memory is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_pins_when_cuda_is_available() -> None:
    pool = HostPool(TINY_MHA, "page_first", num_pages=1)
    assert pool.pin_memory and pool.buffer.is_pinned()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_large_pools_are_pinned_by_registration_at_their_own_size() -> None:
    from kvtier.core.host_pool import REGISTER_FROM_BYTES

    size = REGISTER_FROM_BYTES + (REGISTER_FROM_BYTES >> 1)  # 1.5x: no power of two
    pool = HostPool(TINY_MHA, "page_first", size_bytes=size)
    assert pool.pin_memory and pool.buffer.is_pinned()
    assert pool.nbytes <= size
    # registered memory, not torch's pinned allocator (which would round up to 2x)
    assert pool._backing.numel() <= pool._payload.numel() + 4096
    device = torch.empty(pool._payload.numel(), dtype=torch.uint8, device="cuda")
    device.random_(0, 256)
    pool._payload.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(pool._payload.cuda(), device)


# --- allocator ------------------------------------------------------------------------


def test_allocate_free_and_exhaustion() -> None:
    pool = HostPool(TINY_MHA, "page_first", num_pages=4)
    assert pool.num_free == 4
    assert pool.allocate(0) == []
    first = pool.allocate(3)
    assert first == [0, 1, 2] and pool.num_free == 1
    with pytest.raises(PoolExhaustedError, match=r"asked for 2 pages, 1 of 4 are free") as info:
        pool.allocate(2)
    assert "grow the pool" in str(info.value) and info.value.value == 2
    assert pool.num_free == 1  # the failed call took nothing
    pool.free([1])
    assert sorted(pool.allocate(2)) == [1, 3]


def test_free_checks_everything_before_freeing_anything() -> None:
    pool = HostPool(TINY_MHA, "page_first", num_pages=4)
    pages = pool.allocate(2)
    with pytest.raises(PageError, match="page 3 is not allocated"):
        pool.free([pages[0], 3])
    assert pool.num_free == 2
    with pytest.raises(PageError, match="out of range"):
        pool.free([pages[0], 4])
    with pytest.raises(PageError, match="page 0 is not allocated"):
        pool.free([0, 0])
    assert pool.num_free == 2
    pool.free(pages)
    with pytest.raises(PageError, match="double free"):
        pool.free([pages[0]])
    for bad in (-1, "1", 1.0):
        with pytest.raises(PageError):
            pool.free([bad])  # type: ignore[list-item]
    with pytest.raises(PageError, match="non-negative int"):
        pool.allocate(-1)


def test_allocator_is_thread_safe() -> None:
    pool = HostPool(TINY_MHA, "page_first", num_pages=400)
    taken: list[list[int]] = []

    def worker() -> None:
        mine = []
        for _ in range(50):
            mine += pool.allocate(2)
            pool.free(mine[-1:])
            mine.pop()
        taken.append(mine)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    everything = [p for mine in taken for p in mine]
    assert len(everything) == len(set(everything)) == 200
    assert pool.num_free == 200
