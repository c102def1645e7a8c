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

_BLOCK = 4096


def page_pattern(key: str, device_pool: DevicePool) -> torch.Tensor:
    """The raw bytes page ``key`` holds: ``[kv, layers, page_size, row_bytes]`` uint8.

    A random 4 KiB block seeded by the key, tiled over the page with each 4 KiB chunk
    shifted by its index, so another key's page, a moved chunk or a flipped byte all
    differ, and an 8 MiB page costs a copy rather than 8 M random draws.
    """
    g = device_pool.geometry
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    generator = torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
    row = g.num_kv_heads * g.head_dim * g.itemsize
    shape = (g.kv_count, g.num_layers, g.page_size, row)
    total = g.kv_count * g.num_layers * g.page_size * row
    chunks = -(-total // _BLOCK)
    block = torch.randint(0, 256, (_BLOCK,), dtype=torch.uint8, generator=generator)
    tiled = block.repeat(chunks).view(chunks, _BLOCK)
    tiled += (torch.arange(chunks, dtype=torch.int32) * 37 % 256).to(torch.uint8)[:, None]
    return tiled.view(-1)[:total].view(shape)


def _raw_rows(buffer: torch.Tensor) -> torch.Tensor:
    """A ``[num_slots, H, D]`` buffer as ``[num_slots, H * D * itemsize]`` bytes."""
    return buffer.view(torch.uint8).reshape(buffer.shape[0], -1)


def _expected(device_pool: DevicePool, keys: Sequence[str]) -> torch.Tensor:
    """Patterns of ``keys`` as ``[layers, kv, pages * page_size, row_bytes]``."""
    stacked = torch.stack([page_pattern(key, device_pool) for key in keys])
    pages, kv, layers, ps, row = stacked.shape
    return stacked.permute(2, 1, 0, 3, 4).reshape(layers, kv, pages * ps, row)


def _span(slots: torch.Tensor) -> tuple[int, int] | None:
    """(start, stop) when ``slots`` is one ascending run, so a slice can replace indexing."""
    if not slots.numel():
        return None
    start = int(slots[0])
    stop = start + slots.numel()
    if int(slots[-1]) == stop - 1 and torch.equal(slots, torch.arange(start, stop)):
        return start, stop
    return None


def fill_pages(device_pool: DevicePool, keys: Sequence[str], slots: torch.Tensor) -> None:
    """Write each key's pattern into its page of token ``slots`` (``len(keys) * ps`` slots)."""
    if not keys:
        return
    expected = _expected(device_pool, keys)
    index = slots.to(torch.int64).reshape(-1).cpu()
    span = _span(index)
    for layer in range(device_pool.geometry.num_layers):
        for kv, buffer in enumerate(layer_buffers(device_pool, layer)):
            rows = _raw_rows(buffer)
            data = expected[layer, kv].to(rows.device)
            if span is not None:
                rows[span[0] : span[1]].copy_(data)
            else:
                rows.index_copy_(0, index.to(rows.device), data)


def check_pages(
    device_pool: DevicePool,
    keys: Sequence[str],
    slots: torch.Tensor,
    *,
    layers: Sequence[int] | None = None,
) -> list[bool]:
    """For each key, whether its page of ``slots`` holds exactly the key's pattern."""
    if not keys:
        return []
    g = device_pool.geometry
    pages = len(keys)
    expected = _expected(device_pool, keys)
    index = slots.to(torch.int64).reshape(-1).cpu()
    span = _span(index)
    ok = torch.ones(pages, dtype=torch.bool)
    for layer in range(g.num_layers) if layers is None else layers:
        for kv, buffer in enumerate(layer_buffers(device_pool, layer)):
            rows = _raw_rows(buffer)
            if span is not None:
                got = rows[span[0] : span[1]].cpu()
            else:
                got = rows.index_select(0, index.to(rows.device)).cpu()
            same = got.reshape(pages, -1) == expected[layer, kv].reshape(pages, -1)
            ok &= same.all(dim=1)
    return [bool(v) for v in ok]
