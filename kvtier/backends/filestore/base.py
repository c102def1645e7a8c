"""The shell the ``file`` and ``uring`` backends share around their own ways of moving bytes.

:class:`FileStoreBackend` opens the store (:class:`~kvtier.backends.filestore.store.FileStore`),
owns the slice threads (:class:`~kvtier.backends.filestore.slices.Slices`) and the
compiled loop's spares (:class:`~kvtier.backends.filestore.compiled.Spares`), refuses
every call after ``close()`` with one error, answers ``exists`` / ``delete`` / ``clear``
/ ``rescan`` / ``stats`` from the store, and sends each batch either to the compiled loop
(a batch with envelopes, where ``_pageio`` is built and ``compiled_io`` is on) or to the
backend's own loop. A backend keeps only what is really its own: ``file`` its thread
pool's Python loop, ``uring`` its ring.
"""

from __future__ import annotations

import logging
import threading
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar, Generic, TypeAlias, TypeVar

from kvtier.backends.filestore import compiled, paths
from kvtier.backends.filestore.options import Durability, FileStoreOptions
from kvtier.backends.filestore.slices import Slices
from kvtier.backends.filestore.store import FileStore
from kvtier.core.envelope import BatchEnvelope
from kvtier.core.errors import StorageError
from kvtier.core.space import SpaceReport
from kvtier.core.storage import BackendContext, PageBuffers, StorageBackend

__all__ = ["BeforeWrite", "FileStoreBackend", "Keys", "OnFilled", "OnPayload", "Pages"]

ConfigT = TypeVar("ConfigT", bound=FileStoreOptions)

#: A batch: its keys, and each key's page (its regions, header slot first).
Keys: TypeAlias = Sequence[str]
Pages: TypeAlias = Sequence[PageBuffers]
#: The callbacks of :class:`~kvtier.core.pagestore.PerPageHooks`: page ``i`` filled, a
#: piece of its payload landed, page ``i`` about to be written.
OnFilled: TypeAlias = Callable[[int], object] | None
OnPayload: TypeAlias = Callable[[int, memoryview], object] | None
BeforeWrite: TypeAlias = Callable[[int], object] | None


class FileStoreBackend(StorageBackend, Generic[ConfigT]):
    """A backend on the on-disk scheme of :mod:`kvtier.backends.filestore`.

    A subclass names itself (:attr:`name`), says with which ``fsync`` settings the
    compiled loop writes its pages (:attr:`compiled_puts`), and provides its own loop:
    ``_get_own`` / ``_put_own`` for every batch the compiled loop does not take,
    ``_get_compiled`` for what follows the compiled loop's page-cache pass,
    ``_put_one_own`` for a page the compiled loop could not write, and ``_close_own``.
    """

    #: The backend's name in errors, log lines and thread names ("file", "uring").
    name: ClassVar[str]
    #: The ``fsync`` settings under which a put with envelopes goes to the compiled loop.
    compiled_puts: ClassVar[frozenset[Durability]]

    def __init__(
        self, config: ConfigT, context: BackendContext | None, log: logging.Logger, *, threads: int
    ) -> None:
        self.config = config
        self.context = context
        namespace = context.namespace if context is not None else "default"
        eviction = context.eviction if context is not None else None
        # opened, swept, indexed; capacity evicts through the context's policy, if any
        self._fs = FileStore(config, namespace, self.name, log, eviction=eviction)
        self.store = self._fs.path
        self._store_str = self._fs.path_str
        self.index = self._fs.index
        self._counters = self._fs.counters
        self._warn_once = self._fs.warn_once
        #: Threads a batch is cut over, one slice each (the caller works the first).
        self._slices = Slices(threads, f"kvtier-{self.name}")
        #: Per writing thread, the file a replaced page left (the compiled write loop).
        self._spares = compiled.Spares()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def checks_envelopes(self) -> bool:
        """Whether this backend writes and checks envelopes in the compiled loop (built,
        and ``compiled_io`` on); :class:`~kvtier.core.pagestore.PageStore` asks."""
        return self.config.compiled_io and compiled.available()

    # --- checks ----------------------------------------------------------------------

    def _check_open(self) -> None:
        """Refuse a call after ``close()``: the threads and spares are gone."""
        if self._closed:
            raise StorageError(
                f"the {self.name} backend is closed; build a new one to use {self.store} again",
                value=str(self.store),
            )

    def _check_batch(self, what: str, keys: Keys, pages: Pages) -> None:
        """Check a get's or put's keys and page count, then that the backend is open."""
        paths.check_keys(keys)
        if len(keys) != len(pages):
            raise StorageError(f"{what}: {len(keys)} keys but {len(pages)} pages", value=keys)
        self._check_open()

    # --- the contract ----------------------------------------------------------------

    def exists(self, keys: Keys) -> list[bool]:
        # One lock for the batch; only keys missing from the index are checked (and
        # stat'ed): an indexed key was checked when it got there.
        self._check_open()
        return self.index.contains_many(keys)

    def get(self, keys: Keys, pages: Pages) -> list[bool]:
        return self.get_with(keys, pages, None)

    def get_with(
        self,
        keys: Keys,
        pages: Pages,
        on_filled: OnFilled,
        on_payload: OnPayload = None,
        *,
        envelope: BatchEnvelope | None = None,
    ) -> list[bool]:
        """``get``, calling ``on_filled(i)`` in the thread that just filled page ``i``.

        The core verifies a page there, while its bytes are still in that core's cache.
        With ``envelope`` (see :class:`~kvtier.core.pagestore.EnvelopeHooks`) and the
        compiled loop, the envelopes are checked in the loop instead, and the batch is
        first read from the page cache alone; the pages that would wait for the disk then
        go to the backend's blocking path (``_get_compiled``). Otherwise the backend's own
        loop reads the batch (``_get_own``), handing it ``on_payload``.
        """
        self._check_batch("get", keys, pages)
        if envelope is not None and self.checks_envelopes:
            return self._get_compiled(keys, pages, envelope, on_filled)
        return self._get_own(keys, pages, on_filled, on_payload)

    def put(self, keys: Keys, pages: Pages) -> list[bool]:
        return self.put_with(keys, pages, None)

    def put_with(
        self,
        keys: Keys,
        pages: Pages,
        before_write: BeforeWrite,
        *,
        envelope: BatchEnvelope | None = None,
    ) -> list[bool]:
        """``put``, calling ``before_write(i)`` in the thread about to write page ``i``.

        The core writes the page's envelope there, just before the same bytes are
        copied into the page cache. With ``envelope``, the compiled loop and an
        ``fsync`` setting in :attr:`compiled_puts`, the envelopes are written in the
        compiled loop instead (:meth:`_put_compiled`); otherwise the backend's own loop
        writes the batch (``_put_own``). Either way each page is published by the
        protocol of :mod:`~kvtier.backends.filestore.publish`.
        """
        self._check_batch("put", keys, pages)
        if (
            envelope is not None
            and self.config.fsync in self.compiled_puts
            and self.checks_envelopes
        ):
            return self._put_compiled(keys, pages, before_write, envelope)
        return self._put_own(keys, pages, before_write)

    def _put_compiled(
        self, keys: Keys, pages: Pages, before_write: BeforeWrite, envelope: BatchEnvelope
    ) -> list[bool]:
        """``put_with`` through the compiled loop, one slice per thread (at most
        ``_compiled_put_threads``).

        A page the loop wrote but left under its temp name (something other than a page
        held the name) is published by :meth:`FileStore.publish_page`, which removes the
        debris and runs the same C steps; a page it could not write goes
        through the backend's own loop (``_put_one_own``), which repairs what it can
        (debris shard directories, stale temp names). For ``fsync: "page"`` each
        published page's directory is fsynced in the thread that wrote it.
        """
        page_sync = self.config.fsync == "page"

        def publish(i: int, tmp: str, final: str, nbytes: int) -> bool:
            return self._fs.publish_page(keys[i], tmp, final, nbytes, sync_dir=page_sync)

        def fallback(i: int) -> bool:
            return self._put_one_own(keys, pages, i, before_write)

        def run(lo: int, hi: int) -> list[bool]:
            done = compiled.write_slice(
                self._fs,
                keys,
                pages,
                lo,
                hi,
                envelope,
                datasync=self.config.fsync != "none",
                publish=publish,
                fallback=fallback,
                spares=self._spares,
            )
            if page_sync:
                store = self._store_str
                published = [i for i, ok in zip(range(lo, hi), done, strict=True) if ok]
                self._fs.sync_dirs(paths.page_path_unchecked(store, keys[i]) for i in published)
            return done

        return self._slices.spread(run, len(keys), self._compiled_put_threads(keys, pages))

    def delete(self, keys: Keys) -> list[bool]:
        self._check_open()
        return self._fs.delete(keys)

    def clear(self) -> None:
        self._check_open()
        self._fs.clear()

    def rescan(self) -> int:
        """Sweep the store and rebuild the index from disk (pages other processes wrote)."""
        return self._fs.rescan()

    def stats(self) -> dict[str, int | float]:
        return self._fs.stats()

    def close(self) -> None:
        """Stop the backend's own machinery, drop its spares, stop its threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._close_own()
        self._spares.close()
        self._slices.close()

    # --- what each backend provides ---------------------------------------------------

    @abstractmethod
    def _get_own(
        self, keys: Keys, pages: Pages, on_filled: OnFilled, on_payload: OnPayload
    ) -> list[bool]:
        """A get through the backend's own loop (keys checked, the backend open)."""

    @abstractmethod
    def _get_compiled(
        self, keys: Keys, pages: Pages, envelope: BatchEnvelope, on_filled: OnFilled
    ) -> list[bool]:
        """A get with envelopes checked in the compiled loop (keys checked, open)."""

    @abstractmethod
    def _put_own(self, keys: Keys, pages: Pages, before_write: BeforeWrite) -> list[bool]:
        """A put through the backend's own loop (keys checked, the backend open)."""

    @abstractmethod
    def _put_one_own(self, keys: Keys, pages: Pages, i: int, before_write: BeforeWrite) -> bool:
        """Page ``i`` through the backend's own loop, after the compiled loop failed it
        before publishing (``before_write(i)`` writes its envelope)."""

    @abstractmethod
    def _compiled_put_threads(self, keys: Keys, pages: Pages) -> int | None:
        """The most threads a compiled put of ``pages`` is spread over (None: all)."""

    def _close_own(self) -> None:
        """Release what only this backend holds (before the spares and threads go)."""

    # --- space (kvtier.core.space: the chain's space manager owns it) ------------------

    def space(self) -> SpaceReport:
        """The store's bytes and the room left within capacity and the free-space guard."""
        return self.index.space()

    def page_cost(self, nbytes: int) -> int:
        """What a page of ``nbytes`` takes off that room (its file's size)."""
        return self.index.page_cost(nbytes)
