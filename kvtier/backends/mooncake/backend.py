"""The ``mooncake`` backend's client: kvtier's storage contract over Mooncake's store API.

Each page's regions are put and got with Mooncake's multi-buffer batch calls straight
from the host pool's registered memory, so no bytes are copied in Python. Adjacent regions
are merged first; a batch whose pages are each one run uses the single-buffer calls
(``batch_put_from`` / ``batch_get_into``), which Mooncake serves faster. Pages outside
registered memory take the same calls through a staging buffer
(:mod:`kvtier.backends.mooncake.staging`); a put and a get share one path either way.

What Mooncake does differently from the contract is handled here:

* Mooncake keeps the old value when a key is put again. With ``overwrite="replace"``
  (default) a put removes the key first; a reader's lease (a get protects an object from
  removal for the master's ``default_kv_lease_ttl``) makes that put fail, counted, rather
  than keep stale data while claiming success. ``overwrite="keep"``: first write wins.
* Every negative return code becomes a per-key False, counted under its Mooncake name
  (``put_failed.NO_AVAILABLE_HANDLE``, :mod:`kvtier.backends.mooncake.codes`);
  OBJECT_NOT_FOUND on get is an ordinary miss.
* A master that stops answering makes Mooncake's calls take seconds each; after the first
  RPC_FAIL every call fails at once (``*_failed.MASTER_UNREACHABLE``) until a TCP probe
  finds the master's port open again, at most every ``retry_interval_s``
  (:mod:`kvtier.backends.mooncake.guard`).
* Mooncake's setup() retries a missing master for ~90 s; the port is probed first and a
  missing master is a :class:`StorageError` within ``setup_timeout_s``.
* With the master gone, Mooncake's close() blocks ~10 s holding the GIL; close() then
  leaves the client to Mooncake's exit-time teardown and returns at once.
* A full store refuses puts (``put_failed.NO_AVAILABLE_HANDLE``): the page is not stored,
  nothing partial is. ``capacity_bytes`` bounds what this client keeps below that: the
  pages the eviction policy chooses are removed first, least recently used first by
  default (``BackendContext.eviction``; :mod:`kvtier.backends.mooncake.occupancy`). In a
  storage chain the tier's space manager makes that room instead (this backend reports
  its space, :mod:`kvtier.core.space`) and a put that does not fit is refused here
  (``put_failed.CAPACITY``); objects the master evicted on its own are reported to the
  policy as reclaimed when a get or exists finds them gone.
* A reader's lease also refuses a delete. Such a key is answered as missing by this client
  from then on, never put over, and its removal is retried on the next calls until
  Mooncake removes it (``delete_deferred``, ``delete_deferred_done``;
  :mod:`kvtier.backends.mooncake.removals`).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.backends.mooncake.codes import (
    ERROR_NAMES,
    MASTER_UNREACHABLE,
    OBJECT_HAS_LEASE,
    OBJECT_NOT_FOUND,
    REPLICA_IS_NOT_READY,
    RPC_FAIL,
    error_name,
)
from kvtier.backends.mooncake.config import MooncakeConfig, parse_master_address
from kvtier.backends.mooncake.guard import MasterGuard, reachable
from kvtier.backends.mooncake.occupancy import Occupancy
from kvtier.backends.mooncake.probe import INSTALL_HINT
from kvtier.backends.mooncake.regions import Plan, Regions
from kvtier.backends.mooncake.removals import DeferredRemovals
from kvtier.backends.mooncake.staging import Direction, StagingBuffer
from kvtier.core.errors import BackendUnavailableError, StorageError
from kvtier.core.extents import Extent
from kvtier.core.space import SpaceReport
from kvtier.core.storage import BackendContext, Counters, PageBuffers, StorageBackend

if TYPE_CHECKING:
    from kvtier.core.host_pool import HostPool

#: ERROR_NAMES and error_name live in codes.py; still importable from here, as before.
__all__ = ["ERROR_NAMES", "MooncakeBackend", "error_name"]

log = logging.getLogger(__name__)

#: Clients whose close() was skipped because the master was gone. Dropping the last
#: reference would run Mooncake's blocking teardown now; Mooncake runs it at exit instead.
_DEFERRED: list[Any] = []

#: ECMAScript regex syntax characters, escaped in clear()'s prefix pattern.
_REGEX_SYNTAX = frozenset("^$\\.*+?()[]{}|/")


def _regex_literal(text: str) -> str:
    return "".join("\\" + ch if ch in _REGEX_SYNTAX else ch for ch in text)


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
        self._guard = MasterGuard(host, port, config.op_timeout_s, config.retry_interval_s, log)
        self._prefix = f"{config.key_prefix}/{context.namespace}/"
        self._counters = Counters()
        cap = config.capacity_bytes
        self._occupancy = Occupancy(
            None if cap is None else int(cap), eviction=context.eviction, prefix=self._prefix
        )
        #: held across admission and put when capacity_bytes is set, so puts do not race
        self._capacity_lock = threading.Lock()
        #: deletes a reader's lease refused: hidden, and retried on later calls
        self._removals = DeferredRemovals()
        self._regions = Regions()
        self._region_lock = threading.Lock()
        self._staging = StagingBuffer(config, self.register_memory, self._counters, log)
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
        while not reachable(host, port, min(1.0, max(0.05, deadline - time.monotonic()))):
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
        if not reachable(self._guard.host, self._guard.port, self.config.op_timeout_s):
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

    def _object_keys(self, op: str, keys: Sequence[str]) -> list[str] | None:
        """An exists/delete batch's object keys; None for no keys or the master known down."""
        if not keys or not self._check_call(op, keys, None):
            return None
        return self._keys(keys)

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

    def _retry_removals(self) -> None:
        """Retry the deletes a lease refused (one batch_remove while any is pending)."""
        if len(self._removals):
            client = self._live_client()
            done = self._removals.retry(lambda okeys: client.batch_remove(okeys, False))
            self._counters.add("delete_deferred_done", done)

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
        """Remove the policy's victims among this client's pages until ``incoming`` fits
        or none is removable.

        A victim that Mooncake refuses to remove (a reader's lease, most often) stays,
        still counts, and is pinned for the rest of this call; the policy's next choice is
        tried instead, so one leased page never fails a put that other pages could make
        room for.
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

    def _make_room(
        self, okeys: list[str], plans: list[Plan], results: list[bool], candidates: list[int]
    ) -> list[int]:
        """Under capacity_bytes: remove the policy's victims; the pages that now fit."""
        capacity = self._occupancy.capacity_bytes
        assert capacity is not None
        idx: list[int] = []
        for i in candidates:
            plan = plans[i]
            if plan.total > capacity:
                self._counters.add("put_failed.PAGE_LARGER_THAN_CAPACITY")
            else:
                idx.append(i)
        incoming = [(okeys[i], plans[i].total) for i in idx]
        if not self._occupancy.eviction.space_owned:  # else the chain made the room
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
        okeys = self._object_keys("exists", keys)
        if okeys is None:
            return [False] * len(keys)
        self._retry_removals()
        hidden = self._removals.hidden(okeys)
        # a deleted key still leased is not even asked: asking renews the lease that kept it
        asked = [k for k, deleted in zip(okeys, hidden, strict=True) if not deleted]
        codes = self._live_client().batch_is_exist(asked) if asked else []
        for code in codes:
            if code < 0:
                self._record("exists", code)
        self._occupancy.reclaimed(k for k, code in zip(asked, codes, strict=True) if code == 0)
        answers = iter(codes)
        return [False if deleted else next(answers) == 1 for deleted in hidden]

    def put(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        """Store each page's regions as one object, zero-copy from registered memory."""
        return self._batch("put", keys, pages)

    def get(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        """Fill each page's regions in place from its object; a missing key is a miss."""
        return self._batch("get", keys, pages)

    # --- moving pages, either way: zero-copy, or through the staging buffer ---------

    def _batch(
        self, op: Direction, keys: Sequence[str], pages: Sequence[PageBuffers]
    ) -> list[bool]:
        """One put or get: the batch validated, each page planned, then moved.

        Under capacity_bytes a put's pages are admitted first (this client's LRU pages
        evicted to make room), all under the capacity lock so that puts do not race.
        """
        results = [False] * len(keys)
        if not self._check_call(op, keys, pages) or not keys:
            return results
        okeys = self._keys(keys)
        self._retry_removals()
        hidden = self._removals.hidden(okeys)
        live = [i for i, deleted in enumerate(hidden) if not deleted]
        if len(live) < len(keys):  # deleted, the old object still leased: a miss, no put
            name = "get_misses" if op == "get" else "put_failed.DELETE_PENDING"
            self._counters.add(name, len(keys) - len(live))
        plans = [self._regions.plan(page) for page in pages]
        if op == "get" or self._occupancy.capacity_bytes is None:
            self._move(op, okeys, plans, pages, results, live)
            return results
        with self._capacity_lock:
            admitted = self._make_room(okeys, plans, results, live)
            self._move(op, okeys, plans, pages, results, admitted)
        return results

    def _move(
        self,
        op: Direction,
        okeys: list[str],
        plans: list[Plan],
        pages: Sequence[PageBuffers],
        results: list[bool],
        idx: list[int],
    ) -> None:
        """Move pages ``idx``: registered ones zero-copy in one batch, the rest staged.

        A put then records the pages stored, in page order (this client's LRU order).
        """
        direct = [i for i in idx if plans[i].registered]
        staged = [i for i in idx if not plans[i].registered]
        if direct:
            self._send(op, okeys, plans, results, direct)
        if staged and not self._guard.down:

            def send_staged(chunk: list[int], runs: dict[int, Plan]) -> bool:
                sent = self._send(op, okeys, runs, results, chunk)
                if sent:
                    self._counters.add("staged_pages", len(chunk))
                # a get stops once the master is down; a put learns it at its next remove
                return sent is not None and (op == "put" or not self._guard.down)

            self._staging.run(op, plans, pages, results, staged, send_staged)
        elif staged:
            self._counters.add(f"{op}_failed.{MASTER_UNREACHABLE}", len(staged))
        if op == "put":
            for i in idx:
                if results[i]:
                    self._occupancy.stored(okeys[i], plans[i].total)

    def _send(
        self,
        op: Direction,
        okeys: list[str],
        runs: Sequence[Plan] | Mapping[int, Plan],
        results: list[bool],
        idx: list[int],
    ) -> list[int] | None:
        """One batch call for pages ``idx``, page i being ``runs[i]``; the indices sent.

        A replacing put removes the old objects first: None (counted) if that finds the
        master down.
        """
        if op == "put":
            idx = self._remove_for_put(okeys, results, idx)
            if self._guard.down:
                self._counters.add(f"put_failed.{MASTER_UNREACHABLE}", len(idx))
                return None
            if not idx:
                return idx
        codes = self._transfer(op, [okeys[i] for i in idx], [runs[i] for i in idx])
        if op == "put":
            self._settle_puts(codes, idx, runs, results)
        else:
            self._settle_gets(codes, idx, runs, results, okeys)
        return idx

    def _transfer(self, op: Direction, keys: list[str], batch: list[Plan]) -> Sequence[int]:
        """One Mooncake batch call: the single-buffer form when each page is one run (faster)."""
        client = self._live_client()
        codes: Sequence[int]
        if all(len(plan.ptrs) == 1 for plan in batch):
            ptrs = [plan.ptrs[0] for plan in batch]
            sizes = [plan.total for plan in batch]
            if op == "put":
                codes = client.batch_put_from(keys, ptrs, sizes, self._replicate)
            else:
                codes = client.batch_get_into(keys, ptrs, sizes)
        else:
            ptr_lists = [plan.ptrs for plan in batch]
            size_lists = [plan.sizes for plan in batch]
            if op == "put":
                codes = client.batch_put_from_multi_buffers(
                    keys, ptr_lists, size_lists, self._replicate
                )
            else:
                codes = client.batch_get_into_multi_buffers(keys, ptr_lists, size_lists)
        return codes

    def _settle_puts(
        self,
        codes: Sequence[int],
        idx: list[int],
        runs: Sequence[Plan] | Mapping[int, Plan],
        results: list[bool],
    ) -> None:
        written = 0
        for i, code in zip(idx, codes, strict=True):
            if code >= 0:
                results[i] = True
                written += runs[i].total
            else:
                self._record("put", code)
        self._counters.add("put_ok", sum(1 for i in idx if results[i]))
        self._counters.add("bytes_written", written)

    def _settle_gets(
        self,
        codes: Sequence[int],
        idx: list[int],
        runs: Sequence[Plan] | Mapping[int, Plan],
        results: list[bool],
        okeys: list[str],
    ) -> None:
        read = 0
        gone: list[str] = []
        for i, code in zip(idx, codes, strict=True):
            if code == runs[i].total:
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
        self._occupancy.reclaimed(gone)
        self._occupancy.touch(okeys[i] for i in idx if results[i])

    # --- the rest of the contract ---------------------------------------------------

    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove each key; a key a reader holds a lease on stays and is counted."""
        okeys = self._object_keys("delete", keys)
        if okeys is None:
            return [False] * len(keys)
        codes = self._live_client().batch_remove(okeys, False)
        out: list[bool] = []
        leased: list[str] = []
        for okey, code in zip(okeys, codes, strict=True):
            if code >= 0:
                self._counters.add("delete_ok")
            elif code == OBJECT_NOT_FOUND:
                self._counters.add("delete_missing")
            elif code == OBJECT_HAS_LEASE:  # hidden now, removed when the lease ends
                leased.append(okey)
                self._counters.add("delete_deferred")
            else:
                self._record("delete", code)
            out.append(code >= 0 or code == OBJECT_HAS_LEASE)
        self._removals.add(leased)
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
        self._removals.clear()

    def space(self) -> SpaceReport:
        """This client's bytes in the store and the room left within ``capacity_bytes``
        (:mod:`kvtier.core.space`; a chain's space manager picks the victims)."""
        return self._occupancy.space()

    def page_cost(self, nbytes: int) -> int:
        """A page costs its object's bytes, as ``capacity_bytes`` counts them (the
        master's own allocation overhead is its own, outside this client's bound)."""
        return nbytes

    def stats(self) -> dict[str, int | float]:
        """Counters (hits, misses, bytes, failures by Mooncake error name) and master state."""
        stats = self._counters.snapshot()
        stats["master_up"] = 0 if self._guard.down else 1
        stats["registered_regions"] = len(self._regions)
        stats["pages"], stats["bytes"] = self._occupancy.snapshot()
        if self._occupancy.capacity_bytes is not None:
            stats["capacity_bytes"] = self._occupancy.capacity_bytes
        return stats
