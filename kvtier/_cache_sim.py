"""Deterministic KV content per page key, for the multiturn bench and the cache tests.

A simulated engine "computes" a page by filling its device slots with bytes derived from
the page key alone, so whoever loads the page later can check every byte it got without
keeping a copy: the content is regenerated from the key and compared as raw bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from kvtier.core.device_pool import DevicePool, layer_buffers

__all__ = ["check_pages", "fill_pages", "page_pattern"]


def page_pattern(key: str, device_pool: DevicePool) -> torch.Tensor:
    """The raw bytes page ``key`` holds: ``[kv, layers, page_size, row_bytes]`` uint8."""
    g = device_pool.geometry
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    generator = torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
    row = g.num_kv_heads * g.head_dim * g.itemsize
    shape = (g.kv_count, g.num_layers, g.page_size, row)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)


def _raw_rows(buffer: torch.Tensor) -> torch.Tensor:
    """A ``[num_slots, H, D]`` buffer as ``[num_slots, H * D * itemsize]`` bytes."""
    return buffer.view(torch.uint8).reshape(buffer.shape[0], -1)


def fill_pages(device_pool: DevicePool, keys: Sequence[str], slots: torch.Tensor) -> None:
    """Write each key's pattern into its page of token ``slots`` (``len(keys) * ps`` slots)."""
    ps = device_pool.geometry.page_size
    patterns = [page_pattern(key, device_pool) for key in keys]
    if not patterns:
        return
    stacked = torch.stack(patterns)  # [pages, kv, layers, ps, row]
    index = slots.to(torch.int64).reshape(len(keys), ps)
    for layer in range(device_pool.geometry.num_layers):
        buffers = layer_buffers(device_pool, layer)
        for kv, buffer in enumerate(buffers):
            rows = _raw_rows(buffer)
            data = stacked[:, kv, layer].reshape(-1, rows.shape[1])
            rows.index_copy_(0, index.reshape(-1).to(rows.device), data.to(rows.device))


def check_pages(
    device_pool: DevicePool,
    keys: Sequence[str],
    slots: torch.Tensor,
    *,
    layers: Sequence[int] | None = None,
) -> list[bool]:
    """For each key, whether its page of ``slots`` holds exactly the key's pattern."""
    g = device_pool.geometry
    ps = g.page_size
    index = slots.to(torch.int64).reshape(-1)
    result = []
    chosen = range(g.num_layers) if layers is None else layers
    per_layer = {layer: layer_buffers(device_pool, layer) for layer in chosen}
    for i, key in enumerate(keys):
        expected = page_pattern(key, device_pool)
        page_slots = index[i * ps : (i + 1) * ps]
        ok = True
        for layer, buffers in per_layer.items():
            for kv, buffer in enumerate(buffers):
                got = _raw_rows(buffer).index_select(0, page_slots.to(buffer.device)).cpu()
                if not torch.equal(got, expected[kv, layer]):
                    ok = False
        result.append(ok)
    return result
