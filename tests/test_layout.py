"""Layouts: shapes per attention kind, extent counts and sizes, the alignment promise."""

from __future__ import annotations

import pytest

from kvtier.core.errors import InvalidFieldError
from kvtier.core.geometry import AttentionKind, KVGeometry
from kvtier.core.layout import (
    Layout,
    block_aligned_layouts,
    check_layout,
    extent_bytes,
    extent_count,
    extents_aligned,
    extents_block_aligned,
    has_page_axis,
    is_page_major,
    layouts_for,
    page_axes,
    page_blocks,
    page_view,
    pool_shape,
    region_stride_bytes,
)

MHA = KVGeometry.mha(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)
MLA = KVGeometry.mla(
    num_layers=3, kv_lora_rank=8, qk_rope_head_dim=4, dtype="bfloat16", page_size=4
)


def test_layouts_per_attention() -> None:
    assert layouts_for(AttentionKind.MHA) == (
        Layout.LAYER_FIRST,
        Layout.PAGE_FIRST,
        Layout.PAGE_FIRST_DIRECT,
        Layout.PAGE_HEAD,
    )
    assert Layout.PAGE_HEAD not in layouts_for(AttentionKind.MLA)


@pytest.mark.parametrize(
    ("layout", "shape"),
    [
        ("layer_first", (2, 3, 20, 2, 8)),
        ("page_first", (2, 20, 3, 2, 8)),
        ("page_first_direct", (2, 5, 3, 4, 2, 8)),
        ("page_head", (2, 5, 2, 4, 3, 8)),
    ],
)
def test_mha_pool_shapes_follow_the_documented_axis_order(layout: str, shape: tuple) -> None:
    assert pool_shape(MHA, layout, 5) == shape


@pytest.mark.parametrize(
    ("layout", "shape"),
    [
        ("layer_first", (3, 20, 1, 12)),
        ("page_first", (20, 3, 1, 12)),
        ("page_first_direct", (5, 3, 4, 1, 12)),
    ],
)
def test_mla_pool_shapes_drop_the_kv_axis(layout: str, shape: tuple) -> None:
    assert pool_shape(MLA, layout, 5) == shape


def test_check_layout_refuses_page_head_for_mla_and_lists_what_works() -> None:
    with pytest.raises(InvalidFieldError, match="layer_first, page_first, page_first_direct"):
        check_layout(MLA, "page_head")


def test_check_layout_suggests_a_close_name() -> None:
    with pytest.raises(InvalidFieldError, match="did you mean 'page_first'"):
        check_layout(MHA, "page_frist")


@pytest.mark.parametrize("geometry", [MHA, MLA], ids=["mha", "mla"])
def test_extents_of_a_page_add_up_to_the_page(geometry: KVGeometry) -> None:
    for layout in layouts_for(geometry.attention):
        count = extent_count(geometry, layout)
        per_kv = 1 if is_page_major(layout) else geometry.num_layers
        assert count == geometry.kv_count * per_kv
        assert count * extent_bytes(geometry, layout) == geometry.bytes_per_page


def test_page_axis_layouts_pad_their_page_stride_to_4096() -> None:
    for layout in layouts_for(AttentionKind.MHA):
        stride = region_stride_bytes(MHA, layout)
        if has_page_axis(layout):
            assert stride % 4096 == 0 and stride >= MHA.bytes_per_page // 2
            assert extents_aligned(MHA, layout)
        else:
            assert stride == MHA.bytes_per_page // 2
            assert not extents_aligned(MHA, layout)  # 256-byte extents cannot all be aligned


def test_dense_layouts_are_aligned_when_extents_are_multiples_of_4096() -> None:
    big = KVGeometry.mha(
        num_layers=2, num_kv_heads=2, head_dim=128, dtype="float16", page_size=8
    )  # 4096 bytes per (page, layer, kv)
    assert all(extents_aligned(big, layout) for layout in layouts_for(AttentionKind.MHA))
    assert extents_aligned(big, "layer_first", 512)
    assert not extents_aligned(big, "layer_first", 3000)  # not a divisor of 4096


def test_block_aligned_layouts_exist_for_the_attention_kind() -> None:
    # MLA, 16 tokens of 576 fp16 values per layer: a page is 36864 bytes (9 x 4096), a
    # layer of it 18432 (4.5 x 4096); page_head does not exist for MLA, so it is never offered
    mla = KVGeometry.mla(
        num_layers=2, kv_lora_rank=512, qk_rope_head_dim=64, dtype="float16", page_size=16
    )
    assert not extents_block_aligned(mla, Layout.LAYER_FIRST)
    assert block_aligned_layouts(mla) == [Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT]
    # a padded page axis aligns where an extent starts, not its length
    odd = KVGeometry.mha(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4)
    assert extents_aligned(odd, Layout.PAGE_HEAD)
    assert not extents_block_aligned(odd, Layout.PAGE_HEAD)


def test_o_direct_plan_never_suggests_a_layout_the_model_lacks() -> None:
    from kvtier.backends.file import FileConfig, validate_file_plan
    from kvtier.core.storage import BackendContext

    mla = KVGeometry.mla(
        num_layers=2, kv_lora_rank=512, qk_rope_head_dim=64, dtype="float16", page_size=16
    )
    with pytest.raises(InvalidFieldError, match="18432 bytes") as info:
        validate_file_plan(FileConfig(o_direct=True), BackendContext(mla, Layout.LAYER_FIRST))
    message = str(info.value)
    assert "'page_first' or 'page_first_direct'" in message
    assert "page_head" not in message


@pytest.mark.parametrize("layout", list(Layout))
def test_page_view_and_blocks_are_views_of_the_pool(layout: Layout) -> None:
    import torch

    shape = pool_shape(MHA, layout, 5)[1:]  # one kv
    tensor = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float16).view(shape)
    view = page_view(tensor, MHA, layout)
    axes = page_axes(layout)
    sizes = {"layer": 3, "token": 4, "head": 2, "dim": 8}
    assert tuple(view.shape) == (5, *(sizes[a] for a in axes))
    assert view.data_ptr() == tensor.data_ptr()  # a view, no copy
    blocks = page_blocks(tensor, MHA, layout, 2)
    assert len(blocks) == extent_count(MHA, layout) // MHA.kv_count
    assert all(b.is_contiguous() for b in blocks)
    assert sum(b.numel() for b in blocks) * 2 == MHA.bytes_per_page // MHA.kv_count
    assert torch.equal(torch.cat([b.reshape(-1) for b in blocks]), view[2].reshape(-1))
