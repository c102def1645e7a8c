"""The device pool (L1) protocol an engine implements, a pool over buffers that exist, and
a plain torch implementation.

An engine's KV pool is per layer and indexed by token slot, as in SGLang's and vLLM's
pools: MHA exposes ``k_buffer(layer)`` and ``v_buffer(layer)`` shaped
``[num_slots, num_kv_heads, head_dim]``; MLA exposes ``latent_buffer(layer)`` shaped
``[num_slots, 1, kv_lora_rank + qk_rope_head_dim]``. Each buffer's last dim must be
contiguous (stride 1). IO backends copy raw bytes, so any supported dtype moves bit-exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from kvtier.core.errors import InvalidFieldError, TransferError
from kvtier.core.geometry import AttentionKind, KVGeometry

__all__ = [
    "BufferDevicePool",
    "DevicePool",
    "MHADevicePool",
    "MLADevicePool",
    "TorchDevicePool",
    "layer_buffers",
]


@runtime_checkable
class DevicePool(Protocol):
    """What every device pool exposes: its geometry, its token slot count and its device."""

    @property
    def geometry(self) -> KVGeometry: ...

    @property
    def num_slots(self) -> int: ...

    @property
    def device(self) -> torch.device: ...


@runtime_checkable
class MHADevicePool(DevicePool, Protocol):
    """An MHA/GQA device pool: separate per-layer K and V buffers."""

    def k_buffer(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s keys, ``[num_slots, num_kv_heads, head_dim]``."""
        ...

    def v_buffer(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s values, ``[num_slots, num_kv_heads, head_dim]``."""
        ...


@runtime_checkable
class MLADevicePool(DevicePool, Protocol):
    """An MLA device pool: one per-layer latent buffer."""

    def latent_buffer(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s latent vectors, ``[num_slots, 1, kv_lora_rank + rope_dim]``."""
        ...


def layer_buffers(pool: DevicePool, layer: int) -> tuple[torch.Tensor, ...]:
    """The buffers of one layer in canonical kv order ((K, V) or (latent,)), checked."""
    g = pool.geometry
    buffers: tuple[torch.Tensor, ...]
    names = ("k_buffer", "v_buffer") if g.attention is AttentionKind.MHA else ("latent_buffer",)
    methods = [getattr(pool, name, None) for name in names]
    if any(method is None for method in methods):
        raise TransferError(
            f"device pool {type(pool).__name__} has an {g.attention.value.upper()} geometry "
            f"but lacks {' / '.join(f'{name}(layer)' for name in names)}",
            value=pool,
        )
    buffers = tuple(method(layer) for method in methods if method is not None)
    expected = (pool.num_slots, g.num_kv_heads, g.head_dim)
    device = torch.device(pool.device)
    for buffer in buffers:
        if buffer.device.type != device.type:
            raise TransferError(
                f"device pool layer {layer} buffer is on {buffer.device}, but the pool says "
                f"its device is {device}",
                value=buffer.device,
            )
        if tuple(buffer.shape) != expected or buffer.dtype != g.dtype or buffer.stride(-1) != 1:
            raise TransferError(
                f"device pool layer {layer} buffer is {tuple(buffer.shape)} {buffer.dtype} "
                f"(last stride {buffer.stride(-1)}); expected {expected} {g.dtype} with a "
                "contiguous last dim",
                value=tuple(buffer.shape),
            )
    return buffers


class BufferDevicePool:
    """A device pool over per-layer buffers that already exist: ``buffers[kv][layer]``,
    (K, V) for MHA or (latent,) for MLA, each ``[num_slots, heads, dim]``.

    It answers the protocols for any pool whose memory someone else holds:
    :class:`TorchDevicePool` allocates its own, an engine adapter hands in views of its
    engine's KV cache (vLLM's paged pool). :func:`layer_buffers` checks the buffers.
    """

    def __init__(
        self,
        geometry: KVGeometry,
        num_slots: int,
        device: torch.device | str,
        buffers: Sequence[Sequence[torch.Tensor]],
    ) -> None:
        self._geometry = geometry
        self._num_slots = num_slots
        self._device = torch.device(device)
        self._buffers = tuple(tuple(per_layer) for per_layer in buffers)

    @property
    def geometry(self) -> KVGeometry:
        return self._geometry

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def device(self) -> torch.device:
        return self._device

    def _kind(self, wanted: AttentionKind, method: str) -> None:
        if self._geometry.attention is not wanted:
            raise TypeError(
                f"{method}() is for {wanted.value.upper()} pools; this pool is "
                f"{self._geometry.attention.value.upper()}"
            )

    def k_buffer(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s keys (MHA), ``[num_slots, num_kv_heads, head_dim]``."""
        self._kind(AttentionKind.MHA, "k_buffer")
        return self._buffers[0][layer]

    def v_buffer(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s values (MHA), ``[num_slots, num_kv_heads, head_dim]``."""
        self._kind(AttentionKind.MHA, "v_buffer")
        return self._buffers[1][layer]

    def latent_buffer(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s latent vectors (MLA), ``[num_slots, 1, latent]``."""
        self._kind(AttentionKind.MLA, "latent_buffer")
        return self._buffers[0][layer]


class TorchDevicePool(BufferDevicePool):
    """A device pool of plain torch tensors, one ``[layers, num_slots, heads, dim]`` per kv.

    Runs on any torch device; tests, benchmarks and the CLI use it. The per-layer buffers
    are views of one tensor, which lets IO backends move all layers in one copy.
    """

    def __init__(
        self, geometry: KVGeometry, num_slots: int, device: torch.device | str = "cpu"
    ) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots <= 0:
            raise InvalidFieldError(
                "num_slots", f"must be a positive integer, got {num_slots!r}", value=num_slots
            )
        g = geometry
        shape = (g.num_layers, num_slots, g.num_kv_heads, g.head_dim)
        #: One stacked tensor per kv: (K, V) for MHA, (latent,) for MLA.
        self.kv_tensors: tuple[torch.Tensor, ...] = tuple(
            torch.zeros(shape, dtype=g.dtype, device=device) for _ in range(g.kv_count)
        )
        super().__init__(g, num_slots, device, [t.unbind(0) for t in self.kv_tensors])

    def fill_random_(self, generator: torch.Generator | None = None) -> TorchDevicePool:
        """Fill every buffer with random bytes (any bit pattern, NaNs included); compare raw."""
        for tensor in self.kv_tensors:
            for layer in range(tensor.shape[0]):
                raw = tensor[layer].view(torch.uint8)
                if raw.device.type == "cpu":
                    raw.random_(0, 256, generator=generator)
                else:
                    noise = torch.empty(raw.shape, dtype=torch.uint8)
                    noise.random_(0, 256, generator=generator)
                    raw.copy_(noise)
        return self

    def zero_(self) -> TorchDevicePool:
        """Set every byte to zero."""
        for tensor in self.kv_tensors:
            tensor.view(torch.uint8).zero_()
        return self

    def __repr__(self) -> str:
        return (
            f"TorchDevicePool({self._geometry.describe()}, num_slots={self._num_slots}, "
            f"device={self._device})"
        )
