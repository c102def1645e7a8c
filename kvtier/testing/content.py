"""Deterministic KV content per page key, for the multiturn bench and the cache tests.

A simulated engine "computes" a page by filling its device slots with bytes derived from
the page key alone, so whoever loads the page later can check every byte it got without
keeping a copy: the content is regenerated from the key and compared.

The bytes are a random 4 KiB block seeded by the key, tiled over the page with each
4 KiB chunk shifted by its index (another key's page, a moved chunk or a flipped byte all
differ). They are built with ``bytes.translate`` and moved with buffer copies, and pages
are compared by xxh3-128 digests of each region, not with torch ops, whose thread pools
spin on a busy host and made verification dominate a benchmark run.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Sequence

import torch
import xxhash

from kvtier.core.device_pool import DevicePool, layer_buffers
from kvtier.core.extents import extent_of_tensor

__all__ = ["check_pages", "fill_pages", "page_bytes", "page_pattern"]

_BLOCK = 4096
_SHIFTS = [bytes((i + k) % 256 for i in range(256)) for k in range(256)]


def page_bytes(key: str, device_pool: DevicePool) -> bytearray:
    """The raw bytes page ``key`` holds, in ``[kv, layers, page_size, row]`` order."""
    g = device_pool.geometry
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    block = random.Random(seed).randbytes(_BLOCK)
    total = g.kv_count * g.num_layers * g.page_size * g.num_kv_heads * g.head_dim * g.itemsize
    # chunk c is the block shifted by 37 * c (mod 256): the shifts repeat every 256 chunks
    period = b"".join(block.translate(_SHIFTS[c * 37 % 256]) for c in range(256))
    data = bytearray(period * (total // len(period)) + period[: total % len(period)])
    return data


def page_pattern(key: str, device_pool: DevicePool) -> torch.Tensor:
    """:func:`page_bytes` as a ``[kv, layers, page_size, row_bytes]`` uint8 tensor."""
    g = device_pool.geometry
    row = g.num_kv_heads * g.head_dim * g.itemsize
    flat = torch.frombuffer(page_bytes(key, device_pool), dtype=torch.uint8)
    return flat.view(g.kv_count, g.num_layers, g.page_size, row)


def _raw_rows(buffer: torch.Tensor) -> torch.Tensor:
    """A ``[num_slots, H, D]`` buffer as ``[num_slots, H * D * itemsize]`` bytes."""
    return buffer.view(torch.uint8).reshape(buffer.shape[0], -1)


def _regions(device_pool: DevicePool, layers: Sequence[int]) -> list[tuple[int, torch.Tensor]]:
    """(offset of the region in a page's bytes / (page_size * row), rows) per layer and kv."""
    g = device_pool.geometry
    out = []
    for layer in layers:
        for kv, buffer in enumerate(layer_buffers(device_pool, layer)):
            out.append((kv * g.num_layers + layer, _raw_rows(buffer)))
    return out


def _run_start(slots: list[int]) -> int | None:
    """The first slot when ``slots`` is one ascending run (so a slice can stand in)."""
    start = slots[0]
    if slots[-1] - start == len(slots) - 1 and all(
        b - a == 1 for a, b in itertools.pairwise(slots)
    ):
        return start
    return None


def fill_pages(device_pool: DevicePool, keys: Sequence[str], slots: torch.Tensor) -> None:
    """Write each key's bytes into its page of token ``slots`` (``len(keys) * ps`` slots).

    The device pool's layer buffers must be contiguous (``TorchDevicePool``'s are).
    """
    g = device_pool.geometry
    ps = g.page_size
    index = slots.to(torch.int64).reshape(-1).tolist()
    regions = _regions(device_pool, range(g.num_layers))
    for i, key in enumerate(keys):
        data = memoryview(page_bytes(key, device_pool))
        page_slots = index[i * ps : (i + 1) * ps]
        start = _run_start(page_slots)
        for region, rows in regions:
            size = ps * rows.shape[1]
            source = data[region * size : (region + 1) * size]
            if start is not None and rows.device.type == "cpu":
                extent_of_tensor(rows[start : start + ps]).view[:] = source  # in place
            else:
                chunk = torch.frombuffer(bytearray(source), dtype=torch.uint8).view(ps, -1)
                where = torch.tensor(page_slots, dtype=torch.int64, device=rows.device)
                rows.index_copy_(0, where, chunk.to(rows.device))


def check_pages(
    device_pool: DevicePool,
    keys: Sequence[str],
    slots: torch.Tensor,
    *,
    layers: Sequence[int] | None = None,
) -> list[bool]:
    """For each key, whether its page of ``slots`` holds exactly the key's bytes."""
    g = device_pool.geometry
    ps = g.page_size
    index = slots.to(torch.int64).reshape(-1).tolist()
    regions = _regions(device_pool, range(g.num_layers) if layers is None else layers)
    result = []
    for i, key in enumerate(keys):
        data = memoryview(page_bytes(key, device_pool))
        page_slots = index[i * ps : (i + 1) * ps]
        start = _run_start(page_slots)
        ok = True
        for region, rows in regions:
            size = ps * rows.shape[1]
            if start is not None:
                got = rows[start : start + ps]
            else:
                where = torch.tensor(page_slots, dtype=torch.int64, device=rows.device)
                got = rows.index_select(0, where)
            got = got.cpu().contiguous()
            expected = data[region * size : (region + 1) * size]
            if xxhash.xxh3_128_digest(extent_of_tensor(got).view) != xxhash.xxh3_128_digest(
                expected
            ):
                ok = False
                break
        result.append(ok)
    return result
