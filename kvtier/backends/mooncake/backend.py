"""The ``mooncake`` backend's client: kvtier's storage contract over Mooncake's store API.

Each page's regions are put and got with Mooncake's multi-buffer batch calls straight
from the host pool's registered memory, so no bytes are copied in Python. Adjacent regions
are merged first; a batch whose pages are each one run uses the single-buffer calls
(``batch_put_from`` / ``batch_get_into``), which Mooncake serves faster.

What Mooncake does differently from the contract is handled here:

* Mooncake keeps the old value when a key is put again. With ``overwrite="replace"``
  (default) a put removes the key first; a reader's lease (a get protects an object from
  removal for the master's ``default_kv_lease_ttl``) makes that put fail, counted, rather
  than keep stale data while claiming success. ``overwrite="keep"``: first write wins.
* Every negative return code becomes a per-key False, counted under its Mooncake name
  (``put_failed.NO_AVAILABLE_HANDLE``); OBJECT_NOT_FOUND on get is an ordinary miss.
* A master that stops answering makes Mooncake's calls take seconds each; after the first
  RPC_FAIL every call fails at once (``*_failed.MASTER_UNREACHABLE``) until a TCP probe
  finds the master's port open again, at most every ``retry_interval_s``.
* Mooncake's setup() retries a missing master for ~90 s; the port is probed first and a
  missing master is a :class:`StorageError` within ``setup_timeout_s``.
* With the master gone, Mooncake's close() blocks ~10 s holding the GIL; close() then
  leaves the client to Mooncake's exit-time teardown and returns at once.
* A full store refuses puts (``put_failed.NO_AVAILABLE_HANDLE``): the page is not stored,
  nothing partial is. ``capacity_bytes`` bounds what this client keeps below that: its
  least recently used pages are removed first (:mod:`kvtier.backends.mooncake.occupancy`).
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from kvtier.backends.mooncake.config import MooncakeConfig, parse_master_address
from kvtier.backends.mooncake.occupancy import Occupancy
from kvtier.backends.mooncake.probe import INSTALL_HINT
from kvtier.core.errors import BackendUnavailableError, StorageError
from kvtier.core.extents import Extent
from kvtier.core.storage import BackendContext, Counters, PageBuffers, StorageBackend

if TYPE_CHECKING:
    from kvtier.core.host_pool import HostPool

__all__ = ["ERROR_NAMES", "MooncakeBackend", "error_name"]

log = logging.getLogger(__name__)

#: Mooncake's ErrorCode values (mooncake-store/include/types.h) by number.
ERROR_NAMES: dict[int, str] = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -100: "SHARD_INDEX_OUT_OF_RANGE",
    -101: "SEGMENT_NOT_FOUND",
    -102: "SEGMENT_ALREADY_EXISTS",
    -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -300: "INVALID_VERSION",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -708: "OBJECT_HAS_REPLICATION_TASK",
    -709: "OBJECT_NO_REPLICATION_TASK",
    -710: "REPLICA_NOT_FOUND",
    -711: "REPLICA_ALREADY_EXISTS",
    -712: "REPLICA_IS_GONE",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -1000: "ETCD_OPERATION_ERROR",
    -1001: "ETCD_KEY_NOT_EXIST",
    -1002: "ETCD_TRANSACTION_FAIL",
    -1003: "ETCD_CTX_CANCELLED",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
    -1011: "UNAVAILABLE_IN_CURRENT_MODE",
    -1100: "FILE_NOT_FOUND",
    -1101: "FILE_OPEN_FAIL",
    -1102: "FILE_READ_FAIL",
    -1103: "FILE_WRITE_FAIL",
    -1104: "FILE_INVALID_BUFFER",
    -1105: "FILE_LOCK_FAIL",
    -1106: "FILE_INVALID_HANDLE",
    -1200: "BUCKET_NOT_FOUND",
    -1201: "BUCKET_ALREADY_EXISTS",
    -1202: "KEYS_EXCEED_BUCKET_LIMIT",
    -1203: "KEYS_ULTRA_LIMIT",
    -1300: "UNABLE_OFFLOAD",
    -1301: "UNABLE_OFFLOADING",
    -1400: "TASK_NOT_FOUND",
    -1401: "TASK_PENDING_LIMIT_EXCEEDED",
}
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
RPC_FAIL = -900
MASTER_UNREACHABLE = "MASTER_UNREACHABLE"

#: Clients whose close() was skipped because the master was gone. Dropping the last
#: reference would run Mooncake's blocking teardown now; Mooncake runs it at exit instead.
_DEFERRED: list[Any] = []

#: ECMAScript regex syntax characters, escaped in clear()'s prefix pattern.
_REGEX_SYNTAX = frozenset("^$\\.*+?()[]{}|/")


def error_name(code: int) -> str:
    """Mooncake's name for a negative return code (``UNKNOWN_<code>`` if it is new)."""
    return ERROR_NAMES.get(int(code), f"UNKNOWN_{int(code)}")


def _regex_literal(text: str) -> str:
    return "".join("\\" + ch if ch in _REGEX_SYNTAX else ch for ch in text)


def _probe(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _route_address(host: str, port: int) -> str:
    """The local address of the route to ``host`` (no packet is sent), or 127.0.0.1."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        if not infos:
            return "127.0.0.1"
        family, _, _, _, sockaddr = infos[0]
        if family == socket.AF_INET and str(sockaddr[0]).startswith("127."):
            return "127.0.0.1"
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(sockaddr)
            return str(sock.getsockname()[0])
    except OSError:
        return "127.0.0.1"


class _Plan(NamedTuple):
    """One page as Mooncake sees it: merged (pointer, size) runs and their total."""

    ptrs: list[int]
    sizes: list[int]
    total: int
    registered: bool


class _Regions:
    """Registered memory, sorted, for an O(log n) 'is this run inside one region' check.

    Copy-on-write: ``add`` (under the caller's lock) swaps in new tuples, so readers on
    other threads never see a half-updated list.
    """

    def __init__(self) -> None:
        self._spans: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())

    def covers(self, ptr: int, size: int) -> bool:
        starts, ends = self._spans
        i = bisect.bisect_right(starts, ptr) - 1
        return i >= 0 and ptr + size <= ends[i]

    def add(self, ptr: int, size: int) -> None:
        starts, ends = self._spans
        i = bisect.bisect_right(starts, ptr)
        self._spans = (
            (*starts[:i], ptr, *starts[i:]),
            (*ends[:i], ptr + size, *ends[i:]),
        )

    def __len__(self) -> int:
        return len(self._spans[0])


class _MasterGuard:
    """Whether the master answers. After an RPC_FAIL calls fail at once until it is back."""

    def __init__(self, host: str, port: int, probe_timeout: float, interval: float) -> None:
        self.host, self.port = host, port
        self.probe_timeout = probe_timeout
        self.interval = interval
        self.down = False
        self._last_probe = 0.0
        self._lock = threading.Lock()

    def allow(self) -> bool:
        """True if a call may go to Mooncake now; probes a down master at most per interval."""
        with self._lock:
            if not self.down:
                return True
            now = time.monotonic()
            if now - self._last_probe < self.interval:
                return False
            self._last_probe = now
        if _probe(self.host, self.port, self.probe_timeout):
            with self._lock:
                if self.down:
                    log.info("Mooncake master %s:%d accepts connections again", *self.addr)
                self.down = False
            return True
        return False

    @property
    def addr(self) -> tuple[str, int]:
        return self.host, self.port

    def trip(self) -> bool:
        """Mark the master down; True if it was up (the caller logs once per outage)."""
        with self._lock:
            was_up = not self.down
            self.down = True
            self._last_probe = time.monotonic()
            return was_up


def _import_mooncake() -> Any:
    try:
        import mooncake.store as store
    except ImportError as exc:
        raise BackendUnavailableError(
            "backend", "mooncake", f"cannot import mooncake.store: {exc}", INSTALL_HINT
        ) from exc
    return store


class MooncakeBackend(StorageBackend):
    """kvtier's storage contract over one Mooncake client (see the module docstring)."""

    def __init__(self, config: MooncakeConfig, context: BackendContext) -> None:
        self.config = config
        self.context = context
        self._mc = _import_mooncake()
        host, port = parse_master_address(config.master_address)
        self._guard = _MasterGuard(host, port, config.op_timeout_s, config.retry_interval_s)
        self._prefix = f"{config.key_prefix}/{context.namespace}/"
        self._counters = Counters()
        cap = config.capacity_bytes
        self._occupancy = Occupancy(None if cap is None else int(cap))
        #: held across admission and put when capacity_bytes is set, so puts do not race
        self._capacity_lock = threading.Lock()
        self._regions = _Regions()
        self._region_lock = threading.Lock()
        self._staging: torch.Tensor | None = None
        self._staging_lock = threading.Lock()
        self._warned_staging = False
        self._closed = False
        self._replicate = self._mc.ReplicateConfig()
        self._replicate.replica_num = config.replica_num
        self.local_hostname = config.local_hostname or _route_address(host, port)
        self._client: Any = None
        self._client = self._connect(host, port)

    # --- start-up and shutdown ------------------------------------------------------

    def _connect(self, host: str, port: int) -> Any:
        cfg = self.config
        deadline = time.monotonic() + cfg.setup_timeout_s
        while not _probe(host, port, min(1.0, max(0.05, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise StorageError(
                    f"Mooncake master {cfg.master_address} is not accepting connections "
                    f"(waited {cfg.setup_timeout_s:g} s, setup_timeout_s); start it with "
                    f"'mooncake_master --rpc_address={host} --rpc_port={port}' or point "
                    "master_address at a running master",
                    value=cfg.master_address,
                )
            time.sleep(0.1)
        client = self._mc.MooncakeDistributedStore()
        rc = client.setup(
            self.local_hostname,
            cfg.metadata_server,
            int(cfg.global_segment_size),
            int(cfg.local_buffer_size),
            cfg.protocol,
            ",".join(cfg.device_names),
            cfg.master_address,
        )
        if rc != 0:
            raise StorageError(
                f"Mooncake client setup against master {cfg.master_address} failed with "
                f"{rc} ({error_name(rc)}); check metadata_server={cfg.metadata_server!r}, "
                f"protocol={cfg.protocol!r}, local_hostname={self.local_hostname!r} and "
                "that global_segment_size fits in memory",
                value=rc,
            )
        return client

    def close(self) -> None:
        """Close the client; with the master gone, leave it to Mooncake's exit teardown."""
        if self._closed:
            return
        self._closed = True
        client, self._client = self._client, None
        if client is None:
            return
        if not _probe(self._guard.host, self._guard.port, self.config.op_timeout_s):
            _DEFERRED.append(client)
            self._counters.add("close_deferred")
            log.warning(
                "Mooncake master %s is unreachable: closing its client would block ~10 s, "
                "so Mooncake's own teardown runs at process exit instead",
                self.config.master_address,
            )
            return
        rc = client.close()
        if rc != 0:
            self._counters.add(f"close_failed.{error_name(rc)}")

    # --- memory registration --------------------------------------------------------

    def attach(self, pool: HostPool) -> None:
        """Register the host pool's memory regions once, for zero-copy puts and gets."""
        self.register_memory(pool.memory_regions())

    def register_memory(self, regions: Iterable[Extent]) -> None:
        """Register memory regions with Mooncake (skipping ones already registered)."""
        client = self._live_client()
        with self._region_lock:
            for region in regions:
                if region.length <= 0 or self._regions.covers(region.ptr, region.length):
                    continue
                rc = client.register_buffer(region.ptr, region.length)
                if rc != 0:
                    raise StorageError(
                        f"Mooncake register_buffer({region.length} bytes) failed with {rc} "
                        f"({error_name(rc)}); for rdma the memory must be pinnable "
                        "(check ulimit -l)",
                        value=rc,
                    )
                self._regions.add(region.ptr, region.length)

    def _live_client(self) -> Any:
        if self._client is None:
            raise StorageError("the mooncake backend is closed; build a new one")
        return self._client

    # --- helpers --------------------------------------------------------------------

    def _keys(self, keys: Sequence[str]) -> list[str]:
        prefix = self._prefix
        return [prefix + key for key in keys]

    def _plan(self, page: PageBuffers) -> _Plan:
        ptrs: list[int] = []
        sizes: list[int] = []
        for extent in page:
            if extent.length <= 0:
                continue
            if ptrs and ptrs[-1] + sizes[-1] == extent.ptr:
                sizes[-1] += extent.length
            else:
                ptrs.append(extent.ptr)
                sizes.append(extent.length)
        regions = self._regions
        registered = all(regions.covers(p, n) for p, n in zip(ptrs, sizes, strict=True))
        return _Plan(ptrs, sizes, sum(sizes), registered)

    def _check_call(self, op: str, keys: Sequence[str], pages: Sequence[Any] | None) -> bool:
        """Validate a batch; False (all counted as failed) if the master is known down."""
        if pages is not None and len(keys) != len(pages):
            raise StorageError(
                f"{op}: {len(keys)} keys but {len(pages)} pages; pass one page per key",
                value=(len(keys), len(pages)),
            )
        self._live_client()
        if self._guard.allow():
            return True
        self._counters.add(f"{op}_failed.{MASTER_UNREACHABLE}", len(keys))
        return False

    def _record(self, op: str, code: int) -> None:
        name = error_name(code)
        self._counters.add(f"{op}_failed.{name}")
        if code == RPC_FAIL and self._guard.trip():
            log.warning(
                "Mooncake master %s stopped answering (RPC_FAIL); calls fail at once until "
                "it accepts connections again (probed every %g s)",
                self.config.master_address,
                self.config.retry_interval_s,
            )

    def _staging_buffer(self, nbytes: int) -> torch.Tensor | None:
        """The registered staging buffer (allocated once), or None if a page cannot fit."""
        if self.config.unregistered_memory == "error":
            raise StorageError(
                "page memory is not registered with Mooncake; call attach(host_pool) "
                "before put/get, or set unregistered_memory='stage'"
            )
        if nbytes > int(self.config.staging_buffer_size):
            return None
        if self._staging is None:
            size = int(self.config.staging_buffer_size)
            staging = torch.empty(size, dtype=torch.uint8)
            staging.fill_(0)  # touch it once, so the first staged page pays no page faults
            self.register_memory([Extent(memoryview(b""), staging.data_ptr(), size)])
            self._staging = staging
        if not self._warned_staging:
            self._warned_staging = True
            log.warning(
                "pages outside registered memory are copied through a %d-byte staging "
                "buffer (one extra copy each, counted as staged_pages); call "
                "attach(host_pool) to move them zero-copy",
                int(self.config.staging_buffer_size),
            )
        return self._staging

    def _remove_for_put(self, okeys: list[str], results: list[bool], idx: list[int]) -> list[int]:
        """Remove existing objects before a replacing put; the indices that may proceed."""
        if self.config.overwrite == "keep" or not idx:
            return idx
        codes = self._live_client().batch_remove([okeys[i] for i in idx], False)
        go: list[int] = []
        for i, code in zip(idx, codes, strict=True):
            if code >= 0 or code in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):
                # REPLICA_IS_NOT_READY: another writer is putting this key right now;
                # put anyway, and whichever whole page Mooncake keeps is the answer.
                go.append(i)
            else:
                results[i] = False
                self._record("put", code)
        self._occupancy.forget(okeys[i] for i in go)  # the old objects are gone
        return go

    def _evict_for(self, incoming: list[tuple[str, int]]) -> None:
        """Remove this client's LRU pages until ``incoming`` fits or none is removable.

        A victim that Mooncake refuses to remove (a reader's lease, most often) stays and
        still counts; the next least recently used one is tried instead, so one leased
        page never fails a put that other pages could make room for.
        """
        keep = {key for key, _size in incoming}
        while excess := self._occupancy.excess(incoming):
            victims = self._occupancy.victims(excess, keep)
            if not victims:
                return
            codes = self._live_client().batch_remove(victims, False)
            gone = []
            for key, code in zip(victims, codes, strict=True):
                if code >= 0 or code == OBJECT_NOT_FOUND:
                    gone.append(key)
                else:  # e.g. a reader's lease: the page stays, and still counts
                    keep.add(key)
                    self._record("capacity_evict", code)
            self._occupancy.forget(gone)
            self._counters.add("capacity_evictions", len(gone))

    def _make_room(self, okeys: list[str], plans: list[_Plan], results: list[bool]) -> list[int]:
        """Under capacity_bytes: remove this client's LRU pages; the pages that now fit."""
        capacity = self._occupancy.capacity_bytes
        assert capacity is not None
        idx: list[int] = []
        for i, plan in enumerate(plans):
            if plan.total > capacity:
                self._counters.add("put_failed.PAGE_LARGER_THAN_CAPACITY")
            else:
                idx.append(i)
        incoming = [(okeys[i], plans[i].total) for i in idx]
        self._evict_for(incoming)
        admitted: list[int] = []
        fits: list[tuple[str, int]] = []
        for i, pair in zip(idx, incoming, strict=True):
            if self._occupancy.excess([*fits, pair]) == 0:
                admitted.append(i)
                fits.append(pair)
            else:
                results[i] = False
                self._counters.add("put_failed.CAPACITY")
        return admitted

    # --- the contract ---------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored, from one batch_is_exist call."""
        if not keys:
            return []
        if not self._check_call("exists", keys, None):
            return [False] * len(keys)
        okeys = self._keys(keys)
        codes = self._live_client().batch_is_exist(okeys)
        out: list[bool] = []
        for code in codes:
            if code < 0:
                self._record("exists", code)
            out.append(code == 1)
        self._occupancy.forget(k for k, code in zip(okeys, codes, strict=True) if code == 0)
        return out

    def put(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        """Store each page's regions as one object, zero-copy from registered memory."""
        if not keys:
            self._check_call("put", keys, pages)
            return []
        if not self._check_call("put", keys, pages):
            return [False] * len(keys)
        okeys = self._keys(keys)
        plans = [self._plan(page) for page in pages]
        results = [False] * len(keys)
        if self._occupancy.capacity_bytes is None:
            self._put_batch(okeys, plans, pages, results, list(range(len(keys))))
            return results
        with self._capacity_lock:
            self._put_batch(okeys, plans, pages, results, self._make_room(okeys, plans, results))
        return results

    def _put_batch(
        self,
        okeys: list[str],
        plans: list[_Plan],
        pages: Sequence[PageBuffers],
        results: list[bool],
        idx: list[int],
    ) -> None:
        direct = [i for i in idx if plans[i].registered]
        staged = [i for i in idx if not plans[i].registered]
        self._put_direct(okeys, plans, results, direct)
        if staged and not self._guard.down:
            self._put_staged(okeys, plans, pages, results, staged)
        elif staged:
            self._counters.add(f"put_failed.{MASTER_UNREACHABLE}", len(staged))
        for i in idx:
            if results[i]:
                self._occupancy.stored(okeys[i], plans[i].total)

    def _put_direct(
        self, okeys: list[str], plans: list[_Plan], results: list[bool], idx: list[int]
    ) -> None:
        if not idx:
            return
        idx = self._remove_for_put(okeys, results, idx)
        if self._guard.down:
            self._counters.add(f"put_failed.{MASTER_UNREACHABLE}", len(idx))
            return
        if not idx:
            return
        client = self._live_client()
        batch_keys = [okeys[i] for i in idx]
        if all(len(plans[i].ptrs) == 1 for i in idx):  # one run each: the single-buffer call
            codes = client.batch_put_from(
                batch_keys,
                [plans[i].ptrs[0] for i in idx],
                [plans[i].total for i in idx],
                self._replicate,
            )
        else:
            codes = client.batch_put_from_multi_buffers(
                batch_keys,
                [plans[i].ptrs for i in idx],
                [plans[i].sizes for i in idx],
                self._replicate,
            )
        self._settle_puts(codes, idx, plans, results)

    def _settle_puts(
        self, codes: Sequence[int], idx: list[int], plans: list[_Plan], results: list[bool]
    ) -> None:
        written = 0
        for i, code in zip(idx, codes, strict=True):
            if code >= 0:
                results[i] = True
                written += plans[i].total
            else:
                self._record("put", code)
        self._counters.add("put_ok", sum(1 for i in idx if results[i]))
        self._counters.add("bytes_written", written)

    def _put_staged(
        self,
        okeys: list[str],
        plans: list[_Plan],
        pages: Sequence[PageBuffers],
        results: list[bool],
        idx: list[int],
    ) -> None:
        with self._staging_lock:
            for chunk in self._staging_chunks(plans, results, idx, "put"):
                assert self._staging is not None
                base = self._staging.data_ptr()
                ptrs, offset = [], 0
                for i in chunk:
                    ptrs.append(base + offset)
                    for extent in pages[i]:
                        if extent.length > 0:
                            ctypes.memmove(base + offset, extent.ptr, extent.length)
                            offset += extent.length
                go = self._remove_for_put(okeys, results, chunk)
                if self._guard.down:
                    self._counters.add(f"put_failed.{MASTER_UNREACHABLE}", len(go))
                    return
                if not go:
                    continue
                keep = {i: p for i, p in zip(chunk, ptrs, strict=True)}
                codes = self._live_client().batch_put_from(
                    [okeys[i] for i in go],
                    [keep[i] for i in go],
                    [plans[i].total for i in go],
                    self._replicate,
                )
                self._settle_puts(codes, go, plans, results)
                self._counters.add("staged_pages", len(chunk))

    def _staging_chunks(
        self, plans: list[_Plan], results: list[bool], idx: list[int], op: str
    ) -> Iterable[list[int]]:
        """Groups of page indices that fit in the staging buffer together."""
        chunk: list[int] = []
        used = 0
        for i in idx:
            need = plans[i].total
            if self._staging_buffer(need) is None:
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

    def get(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        """Fill each page's regions in place from its object; a missing key is a miss."""
        if not keys:
            self._check_call("get", keys, pages)
            return []
        if not self._check_call("get", keys, pages):
            return [False] * len(keys)
        okeys = self._keys(keys)
        plans = [self._plan(page) for page in pages]
        results = [False] * len(keys)
        direct = [i for i, plan in enumerate(plans) if plan.registered]
        staged = [i for i, plan in enumerate(plans) if not plan.registered]
        if direct:
            client = self._live_client()
            batch_keys = [okeys[i] for i in direct]
            if all(len(plans[i].ptrs) == 1 for i in direct):
                codes = client.batch_get_into(
                    batch_keys, [plans[i].ptrs[0] for i in direct], [plans[i].total for i in direct]
                )
            else:
                codes = client.batch_get_into_multi_buffers(
                    batch_keys, [plans[i].ptrs for i in direct], [plans[i].sizes for i in direct]
                )
            self._settle_gets(codes, direct, plans, results, okeys)
        if staged and not self._guard.down:
            self._get_staged(okeys, plans, pages, results, staged)
        elif staged:
            self._counters.add(f"get_failed.{MASTER_UNREACHABLE}", len(staged))
        return results

    def _settle_gets(
        self,
        codes: Sequence[int],
        idx: list[int],
        plans: list[_Plan],
        results: list[bool],
        okeys: list[str],
    ) -> None:
        read = 0
        gone: list[str] = []
        for i, code in zip(idx, codes, strict=True):
            if code == plans[i].total:
                results[i] = True
                read += code
            elif code == OBJECT_NOT_FOUND:
                self._counters.add("get_misses")
                gone.append(okeys[i])
            elif code < 0:
                self._record("get", code)
            else:
                self._counters.add("get_failed.SIZE_MISMATCH")
        self._counters.add("get_hits", sum(1 for i in idx if results[i]))
        self._counters.add("bytes_read", read)
        self._occupancy.forget(gone)
        self._occupancy.touch(okeys[i] for i in idx if results[i])

    def _get_staged(
        self,
        okeys: list[str],
        plans: list[_Plan],
        pages: Sequence[PageBuffers],
        results: list[bool],
        idx: list[int],
    ) -> None:
        with self._staging_lock:
            for chunk in self._staging_chunks(plans, results, idx, "get"):
                assert self._staging is not None
                base = self._staging.data_ptr()
                ptrs, offset = [], 0
                for i in chunk:
                    ptrs.append(base + offset)
                    offset += plans[i].total
                codes = self._live_client().batch_get_into(
                    [okeys[i] for i in chunk], ptrs, [plans[i].total for i in chunk]
                )
                self._settle_gets(codes, chunk, plans, results, okeys)
                self._counters.add("staged_pages", len(chunk))
                for i, ptr in zip(chunk, ptrs, strict=True):
                    if not results[i]:
                        continue
                    for extent in pages[i]:
                        if extent.length > 0:
                            ctypes.memmove(extent.ptr, ptr, extent.length)
                            ptr += extent.length
                if self._guard.down:
                    return

    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove each key; a key a reader holds a lease on stays and is counted."""
        if not keys:
            return []
        if not self._check_call("delete", keys, None):
            return [False] * len(keys)
        okeys = self._keys(keys)
        codes = self._live_client().batch_remove(okeys, False)
        out: list[bool] = []
        for code in codes:
            if code >= 0:
                self._counters.add("delete_ok")
            elif code == OBJECT_NOT_FOUND:
                self._counters.add("delete_missing")
            else:
                self._record("delete", code)
            out.append(code >= 0)
        self._occupancy.forget(
            k for k, code in zip(okeys, codes, strict=True) if code >= 0 or code == OBJECT_NOT_FOUND
        )
        return out

    def clear(self) -> None:
        """Remove every object under this backend's '<key_prefix>/<namespace>/' prefix."""
        if not self._check_call("clear", ["*"], None):
            raise StorageError(
                f"clear(): Mooncake master {self.config.master_address} is unreachable; "
                "nothing was removed"
            )
        pattern = "^" + _regex_literal(self._prefix)
        code = self._live_client().remove_by_regex(pattern, True)
        if code < 0:
            self._record("clear", code)
            raise StorageError(
                f"clear(): Mooncake remove_by_regex({pattern!r}) failed with {code} "
                f"({error_name(code)})",
                value=code,
            )
        self._counters.add("cleared", code)
        self._occupancy.clear()

    def stats(self) -> dict[str, int | float]:
        """Counters (hits, misses, bytes, failures by Mooncake error name) and master state."""
        stats = self._counters.snapshot()
        stats["master_up"] = 0 if self._guard.down else 1
        stats["registered_regions"] = len(self._regions)
        stats["pages"], stats["bytes"] = self._occupancy.snapshot()
        if self._occupancy.capacity_bytes is not None:
            stats["capacity_bytes"] = self._occupancy.capacity_bytes
        return stats
