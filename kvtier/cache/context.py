"""What the parts of a TieredCache share: its pools and store, host index, counters, workers.

The facade (:mod:`kvtier.cache.tiered`) builds one :class:`CacheContext` and hands it to
each part (backup, writes, prefetch, load), so no part reaches into another or into the
facade, and every part counts and logs a failure the same way (once per cause).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from kvtier.cache.index import HostIndex
from kvtier.cache.options import CacheOptions
from kvtier.cache.stats import CacheStats
from kvtier.cache.workers import WorkerGroup
from kvtier.core.bounded import Outcome
from kvtier.core.errors import PoolExhaustedError
from kvtier.core.geometry import KVGeometry
from kvtier.core.host_pool import HostPool
from kvtier.core.io import IOBackend
from kvtier.core.metrics import Cause
from kvtier.core.streams import CopyStream
from kvtier.storage import StorageChain

if TYPE_CHECKING:
    from kvtier.core.device_pool import DevicePool

__all__ = ["CacheContext"]

log = logging.getLogger("kvtier.cache")


class CacheContext:
    """One cache's shared state: parts built by the facade, counters, index, worker groups.

    ``closed`` and ``stop_at`` are set by the facade's ``close``; running jobs stop
    between batches once ``time.monotonic()`` passes ``stop_at``.
    """

    def __init__(
        self,
        *,
        geometry: KVGeometry,
        options: CacheOptions,
        device_pool: DevicePool,
        host_pool: HostPool,
        io_backend: IOBackend,
        page_store: StorageChain,
        writes_storage: bool,
    ) -> None:
        self.geometry = geometry
        self.options = options
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.io_backend = io_backend
        self.page_store = page_store
        #: Where device <-> host copies run: one stream per direction on a CUDA pool, so
        #: loads and backups overlap the model's kernels and each other (the calling
        #: thread elsewhere).
        self.load_stream = CopyStream(device_pool.device)
        self.save_stream = CopyStream(device_pool.device)
        #: MLA ranks hold the same latent: only rank 0 writes it to storage.
        self.writes_storage = writes_storage
        self.stats = CacheStats()
        self.index = HostIndex(
            host_pool,
            write_back=options.write_policy == "write_back",
            on_evicted=lambda n: self.stats.add("host_evictions", n),
        )
        self.closed = False
        self.stop_at = float("inf")
        self._logged: set[str] = set()
        self._log_lock = threading.Lock()
        size = options.queue_size
        self.transfer = WorkerGroup("transfer", 1, size, self.worker_error)
        self.reads = WorkerGroup("read", options.io_workers, size, self.worker_error)
        self.writes = WorkerGroup("write", options.write_workers, size, self.worker_error)

    @property
    def groups(self) -> tuple[WorkerGroup, WorkerGroup, WorkerGroup]:
        """The transfer, read and write worker groups."""
        return (self.transfer, self.reads, self.writes)

    def stopping(self) -> bool:
        """Whether close's bound has passed: running jobs stop between batches."""
        return time.monotonic() >= self.stop_at

    def bytes_moved(self, pages: int, layer: int | None) -> int:
        """Bytes ``pages`` pages take on one transfer (one layer's share where ``layer``)."""
        nbytes = pages * self.geometry.bytes_per_page
        return nbytes if layer is None else nbytes // self.geometry.num_layers

    def snapshot(self) -> dict[str, Any]:
        """The cache's ``stats()``: counters, host pages, queues, page store, backend, policies."""
        snap = self.stats.snapshot()
        snap["host"]["pages"] = self.index.counts()
        snap["page_bytes"] = self.geometry.bytes_per_page
        snap["queues"] = {
            "transfer": self.transfer.depth(),
            "read": self.reads.depth(),
            "write": self.writes.depth(),
        }
        snap["page_store"] = self.page_store.stats()
        snap["tiers"] = self.page_store.tier_stats()
        snap["tenants"] = self.page_store.tenant_stats()
        snap["events"] = self.page_store.events.counts()
        snap["backend"] = self.page_store.backend_stats()
        snap["backend_calls"] = self.page_store.call_counts()
        snap["policies"] = {
            "write": self.options.write_policy,
            "prefetch": self.options.prefetch_policy,
            "writes_storage": self.writes_storage,
        }
        return snap

    # --- failures -------------------------------------------------------------------------

    def fail(self, cause: Cause, pages: int, detail: str) -> None:
        """Count a failure by cause and log it the first time that cause occurs."""
        self.stats.fail(cause.value, pages)
        with self._log_lock:
            first = cause.value not in self._logged
            self._logged.add(cause.value)
        if first:
            log.warning(
                "kvtier cache: %s (%s); later %s failures are counted in stats()['failures'] only",
                cause.value,
                detail,
                cause.value,
            )

    def call_failed(self, outcome: Outcome, operation: str, pages: int) -> None:
        """A backend call that timed out or was refused: its operation's pages failed."""
        opts = self.options
        if outcome is Outcome.TIMED_OUT:
            bound = (
                f"close_timeout_s={opts.close_timeout_s}"
                if operation == "close"
                else f"backend_call_timeout_s={opts.backend_call_timeout_s}"
            )
            self.fail(
                Cause.BACKEND_TIMEOUT if operation != "close" else Cause.BACKEND_CLOSE,
                pages,
                f"a backend {operation} call did not return within {bound}",
            )
        else:
            self.fail(
                Cause.BACKEND_REFUSED,
                pages,
                f"a backend {operation} call was refused: max_abandoned_calls="
                f"{opts.max_abandoned_calls} calls are still stuck",
            )

    def fail_exhausted(self, pages: int) -> PoolExhaustedError:
        """Count ``pages`` no host page was found for; return the error a handle carries."""
        counts = self.index.counts()
        pinned, total = counts["pinned"], counts["total"]
        self.fail(Cause.HOST_EXHAUSTED, pages, f"{pinned} of {total} host pages are pinned")
        return PoolExhaustedError(
            f"host pool exhausted: no page for {pages} page(s); {pinned} of "
            f"{total} pages are pinned by prefetch handles or in-flight transfers. "
            "Load or release prefetch handles sooner, or grow host_pages / host_bytes",
            value=pages,
        )

    def worker_error(self, group: str, exc: BaseException) -> None:
        """A job raised on a worker of ``group``: count it, log it once."""
        self.fail(Cause(f"{group}_worker_error"), 1, f"{type(exc).__name__}: {exc}")
