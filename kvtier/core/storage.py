"""The storage backend contract: batched, byte-level, one result per key.

A storage backend moves bytes between host memory and wherever it keeps pages; it knows
nothing of tensors, layouts or the envelope. Each page arrives as a list of
:class:`~kvtier.core.extents.Extent` in a fixed order (the envelope header region, then
the page's extents); the backend stores their concatenation as one object and fills the
same regions in place on ``get``. Ordinary misses, a full disk or an unreachable server
are reported per key as ``False``; exceptions are for bugs and are caught and counted at
the core's boundary.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.core.errors import UnknownNameError
from kvtier.core.extents import Extent
from kvtier.core.geometry import KVGeometry
from kvtier.core.layout import Layout
from kvtier.core.policy import EvictionPolicy

if TYPE_CHECKING:
    from kvtier.core.host_pool import HostPool

__all__ = ["BackendContext", "Counters", "PageBuffers", "StorageBackend"]

#: One page's regions, in order. Their concatenation is the stored object.
PageBuffers = Sequence[Extent]


@dataclass(frozen=True)
class BackendContext:
    """What a backend factory learns about the engine besides its own config."""

    geometry: KVGeometry
    layout: Layout
    tp_rank: int = 0
    tp_size: int = 1
    #: A short, charset-safe id of the model / geometry / tenant, for backends that keep
    #: one store for several namespaces (``clear`` may use it).
    namespace: str = "default"
    extra: dict[str, Any] = field(default_factory=dict)
    #: The policy the backend's capacity evicts through (``capacity_bytes`` and the
    #: like): the backend records its pages' inserts, hits and removals in it and asks
    #: it for victims, unless its ``space_owned`` is True (a storage chain's space
    #: manager picks them, :mod:`kvtier.core.space`: the backend then refuses a put that
    #: does not fit). None: the backend's own LRU (the built-in ``lru`` policy). One
    #: instance serves one backend instance.
    eviction: EvictionPolicy | None = field(default=None, compare=False)


class Counters:
    """Thread-safe named counters, the usual body of ``stats()``.

    ``names``: the only names it counts, a part's registered counters
    (:func:`kvtier.core.metrics.registered_counters`); any other name raises
    :class:`~kvtier.core.errors.UnknownNameError` naming ``kind``, so a counter nobody
    registered fails where it is counted. None (a backend's own stats): any name.
    """

    def __init__(self, names: Iterable[str] | None = None, *, kind: str = "counter") -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int | float] = {}
        self._names = None if names is None else frozenset(names)
        self._kind = kind

    def add(self, name: str, amount: int | float = 1) -> None:
        self._check(name)
        with self._lock:
            self._values[name] = self._values.get(name, 0) + amount

    def set(self, name: str, value: int | float) -> None:
        self._check(name)
        with self._lock:
            self._values[name] = value

    def _check(self, name: str) -> None:
        if self._names is not None and name not in self._names:
            raise UnknownNameError(self._kind, name, self._names)

    def snapshot(self) -> dict[str, int | float]:
        with self._lock:
            return dict(self._values)


class StorageBackend(ABC):
    """Base class of storage backends. Every method is batched; results align with keys."""

    def attach(self, pool: HostPool) -> None:  # noqa: B027 - optional hook, no-op default
        """Register the host pool's memory once (RDMA, io_uring fixed buffers). Optional."""

    def register_memory(self, regions: Sequence[Extent]) -> None:  # noqa: B027 - optional hook
        """Register page memory kvtier did not allocate (an engine's own host pool). Optional.

        Called once, before any put or get, with the regions that hold every page the
        core will hand over; a backend that moves bytes zero-copy only from registered
        memory (Mooncake) registers them here.
        """

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored. Must be cheap: the core calls it for prefix hits."""

    @abstractmethod
    def get(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        """Fill each page's regions in order from its stored object.

        True only when every byte of the regions was filled; a missing key, a short
        object or an I/O error is False. The core verifies the envelope afterwards.
        """

    @abstractmethod
    def put(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        """Store the concatenation of each page's regions under its key, atomically.

        A reader must see the whole new object, the whole old one, or a miss. False
        when the page could not be stored (full disk, server down); nothing partial stays.
        """

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove each key; True if it was there and is gone."""

    @abstractmethod
    def clear(self) -> None:
        """Remove every page this backend instance stored (its namespace, not others')."""

    def stats(self) -> dict[str, int | float]:
        """Counters for operators: hits, misses, bytes, failures by cause."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook, no-op default
        """Release files, threads and registered memory. Idempotent."""

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
