"""The staging buffer: pages outside registered memory are copied through it, either way.

Mooncake moves bytes zero-copy only to and from memory registered with it; a page
elsewhere (a backend used without ``attach``) costs one copy, counted as ``staged_pages``.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Literal

import torch

from kvtier.backends.mooncake.config import MooncakeConfig
from kvtier.backends.mooncake.regions import Plan
from kvtier.core.errors import StorageError
from kvtier.core.extents import Extent
from kvtier.core.storage import Counters, PageBuffers

__all__ = ["Direction", "Send", "StagingBuffer"]

#: Which way bytes move: ``put`` into Mooncake, ``get`` out of it.
Direction = Literal["put", "get"]

#: Moves one chunk of page indices to or from Mooncake, each page being the one run
#: ``runs[i]`` inside the buffer; returns False to stop before the next chunk.
Send = Callable[[list[int], dict[int, Plan]], bool]


def _copy(page: PageBuffers, ptr: int, into_buffer: bool) -> None:
    """Copy ``page``'s extents, in order, into the buffer at ``ptr`` or out of it."""
    for extent in page:
        if extent.length > 0:
            if into_buffer:
                ctypes.memmove(ptr, extent.ptr, extent.length)
            else:
                ctypes.memmove(extent.ptr, ptr, extent.length)
            ptr += extent.length


class StagingBuffer:
    """One registered buffer (allocated on first use) that staged batches take turns in.

    ``register`` registers its memory with Mooncake; ``log`` is the backend's logger, so
    the one-time warning keeps the name operators filter on.
    """

    def __init__(
        self,
        config: MooncakeConfig,
        register: Callable[[Iterable[Extent]], None],
        counters: Counters,
        log: logging.Logger,
    ) -> None:
        self.config = config
        self._register = register
        self._counters = counters
        self._log = log
        self._tensor: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._warned = False

    def run(
        self,
        op: Direction,
        plans: Sequence[Plan],
        pages: Sequence[PageBuffers],
        results: list[bool],
        idx: list[int],
        send: Send,
    ) -> None:
        """Move pages ``idx`` a bufferful at a time: copy in (put), ``send``, copy out (get).

        A get copies out only the pages ``send`` marked done in ``results``; a page larger
        than the buffer fails (``<op>_failed.PAGE_LARGER_THAN_STAGING_BUFFER``).
        """
        with self._lock:
            for chunk in self._chunks(op, plans, results, idx):
                assert self._tensor is not None
                ptr = self._tensor.data_ptr()
                runs: dict[int, Plan] = {}
                for i in chunk:
                    total = plans[i].total
                    runs[i] = Plan([ptr], [total], total, True)
                    ptr += total
                if op == "put":
                    for i in chunk:
                        _copy(pages[i], runs[i].ptrs[0], into_buffer=True)
                go_on = send(chunk, runs)
                if op == "get":
                    for i in chunk:
                        if results[i]:
                            _copy(pages[i], runs[i].ptrs[0], into_buffer=False)
                if not go_on:
                    return

    def _chunks(
        self, op: Direction, plans: Sequence[Plan], results: list[bool], idx: list[int]
    ) -> Iterator[list[int]]:
        """Groups of page indices that fit in the staging buffer together."""
        chunk: list[int] = []
        used = 0
        for i in idx:
            need = plans[i].total
            if self._buffer(need) is None:
                results[i] = False
                self._counters.add(f"{op}_failed.PAGE_LARGER_THAN_STAGING_BUFFER")
                continue
            if used + need > int(self.config.staging_buffer_size):
                yield chunk
                chunk, used = [], 0
            chunk.append(i)
            used += need
        if chunk:
            yield chunk

    def _buffer(self, nbytes: int) -> torch.Tensor | None:
        """The registered staging buffer (allocated once), or None if a page cannot fit."""
        if self.config.unregistered_memory == "error":
            raise StorageError(
                "page memory is not registered with Mooncake; call attach(host_pool) "
                "before put/get, or set unregistered_memory='stage'"
            )
        if nbytes > int(self.config.staging_buffer_size):
            return None
        if self._tensor is None:
            size = int(self.config.staging_buffer_size)
            staging = torch.empty(size, dtype=torch.uint8)
            staging.fill_(0)  # touch it once, so the first staged page pays no page faults
            self._register([Extent(memoryview(b""), staging.data_ptr(), size)])
            self._tensor = staging
        if not self._warned:
            self._warned = True
            self._log.warning(
                "pages outside registered memory are copied through a %d-byte staging "
                "buffer (one extra copy each, counted as staged_pages); call "
                "attach(host_pool) to move them zero-copy",
                int(self.config.staging_buffer_size),
            )
        return self._tensor
