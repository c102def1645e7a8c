"""The memory reference backend: capacity, LRU order, atomic replacement."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvtier.backends.memory import MemoryConfig
from kvtier.backends.memory.backend import MemoryBackend
from kvtier.core.extents import Extent, extent_of_view


def _page(data: bytes) -> list[Extent]:
    half = len(data) // 2
    return [
        extent_of_view(memoryview(bytearray(data[:half]))),
        extent_of_view(memoryview(bytearray(data[half:]))),
    ]


def _read(backend: MemoryBackend, key: str, size: int) -> bytes | None:
    page = _page(bytes(size))
    ok = backend.get([key], [page])[0]
    return b"".join(bytes(e.view) for e in page) if ok else None


def test_capacity_evicts_least_recently_used_first() -> None:
    backend = MemoryBackend(MemoryConfig(capacity_bytes=300))
    assert backend.put(["a", "b", "c"], [_page(bytes([i]) * 100) for i in range(3)]) == [
        True,
        True,
        True,
    ]
    assert _read(backend, "a", 100) == b"\x00" * 100  # 'a' is now most recent
    assert backend.put(["d"], [_page(b"\x03" * 100)]) == [True]
    assert backend.exists(["a", "b", "c", "d"]) == [True, False, True, True]
    assert backend.stats()["evictions"] == 1
    assert backend.stats()["bytes"] == 300


def test_page_larger_than_capacity_fails_without_evicting() -> None:
    backend = MemoryBackend(MemoryConfig(capacity_bytes=100))
    backend.put(["small"], [_page(b"x" * 50)])
    assert backend.put(["huge"], [_page(b"y" * 200)]) == [False]
    assert backend.exists(["small", "huge"]) == [True, False]


def test_overwrite_replaces_and_short_object_is_a_miss() -> None:
    backend = MemoryBackend()
    backend.put(["k"], [_page(b"old!" * 4)])
    backend.put(["k"], [_page(b"new!" * 4)])
    assert _read(backend, "k", 16) == b"new!" * 4
    assert _read(backend, "k", 32) is None  # asks for more bytes than stored
    assert backend.delete(["k", "k"]) == [True, False]
    assert _read(backend, "k", 16) is None


def test_capacity_accepts_sizes_and_rejects_unknown_keys() -> None:
    assert MemoryConfig(capacity_bytes="1MiB").capacity_bytes == 1 << 20  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="extra"):
        MemoryConfig(capacity=5)  # type: ignore[call-arg]
