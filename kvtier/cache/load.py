"""Load: copy a prefetch handle's settled prefix from the host pool into device slots.

All layers at once, or one layer per call to overlap with the forward pass; the handle
stays pinned until every layer was loaded once. The device slots are checked here once
(the structure before any wait, then the range of the slots actually used) and the IO
backend is told so. On a CUDA pool the copies run on the cache's load stream; the handle
keeps their fences, and its pages stay pinned until they have passed.
"""

from __future__ import annotations

import time
from typing import Any

from kvtier.cache.context import CacheContext
from kvtier.cache.handles import PrefetchHandle
from kvtier.core.errors import TransferError
from kvtier.core.io import check_device_slots, check_slots_in_range
from kvtier.core.metrics import Cause
from kvtier.core.streams import Fence

__all__ = ["Loader"]


class Loader:
    """Loads settled prefetch prefixes into the device pool."""

    def __init__(self, ctx: CacheContext) -> None:
        self.ctx = ctx

    def load(
        self,
        handle: PrefetchHandle,
        device_slots: Any,
        layer: int | None,
        *,
        own: bool,
        ordered: bool = True,
    ) -> int:
        """Load ``handle``'s usable prefix into ``device_slots``; return the pages loaded.

        ``layer`` was checked by the caller. ``own``: the caller made the handle for this
        call, so it is released here whatever happens. ``ordered``: the caller's current
        stream waits for the copy (CUDA), and the handle is released once every layer
        was loaded; otherwise the caller orders and releases it (``TieredCache.load``).
        """
        ctx = self.ctx
        num_layers = ctx.geometry.num_layers
        try:
            ps = ctx.geometry.page_size
            slots = check_device_slots(device_slots, page_size=ps)
            pages = handle.host_pages()  # settles the handle per the prefetch policy
            count = min(len(pages), slots.numel() // ps)
            if count:
                used = slots[: count * ps]
                check_slots_in_range(used, ctx.device_pool.num_slots)
                t0 = time.monotonic()
                try:
                    copied = ctx.io_backend.load(
                        ctx.host_pool,
                        ctx.device_pool,
                        pages[:count],
                        used,
                        layer=layer,
                        checked=True,
                        stream=ctx.load_stream,  # after the caller's stream
                    )
                except TransferError:
                    raise
                except Exception as exc:
                    ctx.fail(Cause.HOST_TO_DEVICE, count, repr(exc))
                    raise
                if isinstance(copied, Fence):  # a plugin's own load() may return None
                    handle.add_fence(layer, copied)
                    if ordered:
                        copied.order()
                elapsed = time.monotonic() - t0  # on CUDA: the time to queue it
                ctx.stats.latency["load"].observe(elapsed)
                ctx.stats.busy("host_to_device", elapsed, ctx.bytes_moved(count, layer))
            if layer is None or handle.layer_loaded(layer) == num_layers:
                ctx.stats.add("pages_loaded", count)
            return count
        finally:
            if own or (ordered and (layer is None or handle.layers_loaded == num_layers)):
                handle.release()
