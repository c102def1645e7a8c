"""The device pool over buffers that exist, which the torch pool and engine adapters share."""

from __future__ import annotations

import pytest
import torch

from kvtier.core.device_pool import (
    BufferDevicePool,
    MLADevicePool,
    TorchDevicePool,
    layer_buffers,
)
from kvtier.core.geometry import KVGeometry

MHA = KVGeometry.mha(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)
MLA = KVGeometry.mla(
    num_layers=2, kv_lora_rank=12, qk_rope_head_dim=4, dtype="bfloat16", page_size=4
)
SLOTS = 16


def test_a_pool_over_given_buffers_serves_those_very_buffers() -> None:
    keys = [torch.zeros(SLOTS, 2, 8, dtype=torch.float16) for _ in range(3)]
    values = [torch.ones(SLOTS, 2, 8, dtype=torch.float16) for _ in range(3)]
    pool = BufferDevicePool(MHA, SLOTS, "cpu", (keys, values))
    assert (pool.geometry, pool.num_slots, pool.device) == (MHA, SLOTS, torch.device("cpu"))
    for layer in range(3):
        assert pool.k_buffer(layer) is keys[layer] and pool.v_buffer(layer) is values[layer]
        assert layer_buffers(pool, layer) == (keys[layer], values[layer])
    with pytest.raises(TypeError, match=r"latent_buffer\(\) is for MLA pools; this pool is MHA"):
        pool.latent_buffer(0)


def test_an_mla_pool_over_given_buffers_serves_latents_only() -> None:
    latents = [torch.zeros(SLOTS, 1, 16, dtype=torch.bfloat16) for _ in range(2)]
    pool = BufferDevicePool(MLA, SLOTS, torch.device("cpu"), (latents,))
    assert isinstance(pool, MLADevicePool)
    assert layer_buffers(pool, 1) == (latents[1],)
    with pytest.raises(TypeError, match=r"k_buffer\(\) is for MHA pools; this pool is MLA"):
        pool.k_buffer(0)


@pytest.mark.parametrize("geometry", [MHA, MLA], ids=["mha", "mla"])
def test_the_torch_pools_layers_are_views_of_its_stacked_tensors(geometry: KVGeometry) -> None:
    pool = TorchDevicePool(geometry, SLOTS).fill_random_(torch.Generator().manual_seed(3))
    assert isinstance(pool, BufferDevicePool)
    for layer in range(geometry.num_layers):
        buffers = layer_buffers(pool, layer)
        assert len(buffers) == len(pool.kv_tensors)
        for buffer, stacked in zip(buffers, pool.kv_tensors, strict=True):
            assert buffer.data_ptr() == stacked[layer].data_ptr()
            buffer.view(torch.uint8).fill_(7)  # a load into a layer lands in the stack
            assert bool((stacked[layer].view(torch.uint8) == 7).all())
    pool.zero_()
    assert all(int(buffer.view(torch.uint8).max()) == 0 for buffer in layer_buffers(pool, 0))
