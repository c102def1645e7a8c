"""vLLM's paged KV tensors on an accelerator as kvtier's device pool, without a copy.

vLLM 0.32 hands ``register_kv_caches`` one tensor per attention layer. Its accelerator
backends' tensor is the logical ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
view (``[B, H, N, C]``, K and V side by side in ``C``) whose strides follow the resolved
``KVCacheLayout``; FlashAttention and Triton run the token-major ``LBNHC`` (``NHD``)
layout, where a block's tokens are evenly spaced. Older FlashAttention-style caches are
``[2, num_blocks, block_size, num_kv_heads, head_size]``. Both give, per layer, a K and a V
buffer ``[num_slots, num_kv_heads, head_size]`` (slot = block * block_size + offset) as
strided views of vLLM's memory: :class:`VLLMPagedPool` implements kvtier's
``MHADevicePool`` over them, so ``TieredCache`` moves pages through its IO backend.

MLA models (DeepSeek-style latent KV) keep one latent per token and no K/V split: per
layer ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``, which becomes the
``MLADevicePool`` buffer ``latent_buffer(layer)`` ``[num_slots, 1, latent]``, a view too.

Under vLLM's hybrid allocator the KV cache groups overlay the same memory: layers of
different groups at one position alias one tensor (:func:`positions_of`), and the pool
has one layer per distinct position, so a page is a block across every position,
whichever group owns the block (only its key names the group).

:func:`strategy_of` tells this path from the CPU backend's (``LBHNC`` blocks in host
memory, stored in place by :mod:`.blocks`); a layout neither handles is refused at
start-up with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from kvtier.core.device_pool import BufferDevicePool
from kvtier.core.geometry import AttentionKind, KVGeometry
from kvtier.integrations.vllm.blocks import SUPPORTED as HOST_SUPPORTED
from kvtier.integrations.vllm.blocks import (
    check_layer_count,
    layer_positions,
    memory_region,
    refuse,
)

__all__ = [
    "DEVICE_SUPPORTED",
    "Strategy",
    "VLLMPagedPool",
    "block_slots",
    "positions_of",
    "strategy_of",
]

#: What the device path takes, as start-up errors list it.
DEVICE_SUPPORTED = [
    "vLLM's accelerator attention backends with a token-major KV cache layout (LBNHC, "
    "VLLM_KV_CACHE_LAYOUT=NHD; FlashAttention, Triton): per layer [num_blocks, "
    "num_kv_heads, block_size, 2 * head_size] with a block's tokens evenly spaced, MHA/GQA, "
    "one group of full attention or hybrid (full and sliding-window groups of one head "
    "shape and dtype)",
    "FlashAttention-style per layer [2, num_blocks, block_size, num_kv_heads, head_size]",
    "vLLM's accelerator MLA backends: per layer [num_blocks, block_size, kv_lora_rank + "
    "qk_rope_head_dim] (one latent per token), one group",
]

#: ``"host"``: vLLM's CPU blocks, stored in place; ``"device"``: through ``TieredCache``.
Strategy = Literal["host", "device"]


#: What a refused KV cache lists: the CPU strategy's layouts and the device path's.
_EITHER = [*HOST_SUPPORTED, *DEVICE_SUPPORTED]


def _host_blocks(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is in the CPU backend's layout: host memory, contiguous blocks."""
    return tensor.device.type == "cpu" and tensor.dim() == 4 and tensor[0].is_contiguous()


def strategy_of(tensors: Sequence[torch.Tensor]) -> Strategy:
    """The worker strategy for vLLM's KV tensors: by device, then by layout."""
    if tensors and all(_host_blocks(tensor) for tensor in tensors):
        return "host"
    return "device"


def _slot_major(x: torch.Tensor, name: str, what: str) -> torch.Tensor:
    """``x`` ``[B, N, H, E]`` as ``[B * N, H, E]``, a view; refused if tokens are uneven."""
    blocks, tokens, heads, width = x.shape
    s_block, s_token, s_head, s_last = x.stride()
    if s_last != 1 or (blocks > 1 and s_block != tokens * s_token):
        raise refuse(
            f"vLLM KV cache: layer {name!r} ({what}) has a token stride of {s_token} and a "
            f"block stride of {s_block} elements, so its tokens are not evenly spaced across "
            "blocks (a head-major LBHNC / HND or block-outermost layout): no [num_slots, "
            "heads, dim] view exists without a copy; run vLLM with VLLM_KV_CACHE_LAYOUT=NHD",
            tuple(x.stride()),
            _EITHER,
        )
    return x.as_strided((blocks * tokens, heads, width), (s_token, s_head, 1), x.storage_offset())


def positions_of(
    layers: Sequence[tuple[str, torch.Tensor]],
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, int]]:
    """The distinct layer positions of ``layers`` (model order) and each layer name's
    position: under vLLM's hybrid allocator layers of different groups alias one tensor,
    and a position is moved once whichever group's layer asks for it."""
    positions = layer_positions(layers)
    where = {memory_region(tensor): i for i, (_, tensor) in enumerate(positions)}
    return positions, {name: where[memory_region(tensor)] for name, tensor in layers}


def _latent_view(tensor: torch.Tensor, name: str, latent: int) -> torch.Tensor:
    """One MLA layer's latents as a ``[num_slots, 1, latent]`` view of ``tensor``."""
    shape = tuple(tensor.shape)
    if tensor.dim() == 3 and shape[2] == latent:
        return _slot_major(tensor.unsqueeze(2), name, "[B, N, latent]")
    raise refuse(
        f"vLLM KV cache: MLA layer {name!r} has shape {shape}; expected [num_blocks, "
        f"block_size, {latent}] (kv_lora_rank + qk_rope_head_dim, one latent per token)",
        shape,
        _EITHER,
    )


def _kv_views(tensor: torch.Tensor, name: str, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V as ``[num_slots, heads, head_dim]`` views of ``tensor``."""
    shape = tuple(tensor.shape)
    if tensor.dim() == 5 and shape[0] == 2:
        k, v = (_slot_major(tensor[i], name, "[2, B, N, H, D]") for i in range(2))
        return k, v
    if tensor.dim() == 4 and shape[3] == 2 * head_dim:
        both = _slot_major(tensor.permute(0, 2, 1, 3), name, "[B, H, N, 2 * D]")
        return both[..., :head_dim], both[..., head_dim:]
    raise refuse(
        f"vLLM KV cache: layer {name!r} has shape {shape}; expected [num_blocks, "
        f"num_kv_heads, block_size, {2 * head_dim}] (vLLM 0.32) or [2, num_blocks, "
        f"block_size, num_kv_heads, {head_dim}]",
        shape,
        _EITHER,
    )


class VLLMPagedPool(BufferDevicePool):
    """kvtier's device pool over vLLM's per-layer KV tensors (views, no copy): MHA/GQA
    (K and V buffers) or MLA (one latent buffer), as the geometry says.

    Token slot ``block * block_size + offset`` is vLLM's block ``block``, token
    ``offset``, in every layer's buffers. ``layers`` are the distinct positions
    (:func:`positions_of`), in model order.
    """

    def __init__(
        self,
        layers: Sequence[tuple[str, torch.Tensor]],
        *,
        num_blocks: int,
        geometry: KVGeometry,
    ) -> None:
        check_layer_count(layers, geometry, _EITHER)
        g = geometry
        mla = g.attention is AttentionKind.MLA
        wanted = (num_blocks * g.page_size, g.num_kv_heads, g.head_dim)
        buffers: list[list[torch.Tensor]] = [[] for _ in range(g.kv_count)]
        device = layers[0][1].device if layers else torch.device("cpu")
        for name, tensor in layers:
            if tensor.device != device:
                raise refuse(
                    f"vLLM KV cache: layer {name!r} is on {tensor.device} but layer "
                    f"{layers[0][0]!r} on {device}; one device pool holds one device's KV",
                    str(tensor.device),
                    _EITHER,
                )
            if tensor.dtype != g.dtype:
                raise refuse(
                    f"vLLM KV cache: layer {name!r} holds {tensor.dtype}, but {g.describe()} "
                    f"is {g.dtype}",
                    str(tensor.dtype),
                    _EITHER,
                )
            views = (
                (_latent_view(tensor, name, g.head_dim),)
                if mla
                else _kv_views(tensor, name, g.head_dim)
            )
            if tuple(views[0].shape) != wanted:
                what = "latent buffer" if mla else "K/V buffers"
                dims = "1, latent" if mla else "num_kv_heads, head_dim"
                raise refuse(
                    f"vLLM KV cache: layer {name!r} gives {what} {tuple(views[0].shape)}; "
                    f"{num_blocks} blocks of {g.describe()} take {wanted} ([num_slots, "
                    f"{dims}])",
                    tuple(views[0].shape),
                    _EITHER,
                )
            for kv, view in zip(buffers, views, strict=True):
                kv.append(view)
        super().__init__(g, wanted[0], device, buffers)


def block_slots(blocks: Sequence[int], block_size: int) -> torch.Tensor:
    """The token slots of vLLM blocks, page ``i`` at ``[i * block_size, (i + 1) * block_size)``."""
    if not blocks:
        return torch.empty(0, dtype=torch.int64)
    base = torch.tensor(list(blocks), dtype=torch.int64).unsqueeze(1) * block_size
    return (base + torch.arange(block_size, dtype=torch.int64)).reshape(-1)
