"""The policy contract: which pages leave a full tier (eviction) and which enter it (admission).

A storage tier (a backend's capacity, a tier of the chain) keeps its pages and asks its
:class:`EvictionPolicy` which to remove when it is full; a boundary of the chain asks its
:class:`AdmissionPolicy` whether a page enters the tier below at all. A policy never
removes anything itself: it is told what happened (``record_insert``, ``record_access``,
``record_remove``) and answers questions (``choose_victims``, ``admit``), so the tier that
holds the pages stays their only owner.

A KV cache knows what a generic cache does not, and tells it with :meth:`describe`: a
page's parent (a child page is useless without it), the tokens it holds (the cost of
recomputing it) and its tenant (quotas are per tenant). Describing is optional: a policy
that ignores it still works, and a caller that never describes still gets one.

Threads: every policy instance is used from several threads at once (the engine's
scheduler, the backup and prefetch workers). kvtier's built-ins take one lock per call
(but for describing a page not resident yet: one dict store, atomic, checked again after
it; see :meth:`PageBook.hold_unlocked`); a plugin must be as safe. ``choose_victims``
calls ``pinned`` while holding its lock, so a ``pinned`` callback must not call back into
the policy.

:class:`LRUPolicy`, the reference eviction policy, lives here rather than among the other
built-ins (:mod:`kvtier.policies`) because every backend's capacity uses it when it is
given no policy, and backends import only the core. So do the frames the built-ins share:
:class:`LockedEviction` (the lock, and the calls that only take it) and
:class:`BookEviction` (that, over a :class:`PageBook`).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pydantic import BaseModel

__all__ = [
    "AdmissionPolicy",
    "BookEviction",
    "EvictionPolicy",
    "LRUPolicy",
    "LockedEviction",
    "PageBook",
    "PageInfo",
    "never_pinned",
]


@dataclass(frozen=True)
class PageInfo:
    """What a KV cache knows of a page and a generic cache does not."""

    #: The key of the page before it in its prefix (None: the first page of a prefix).
    parent: str | None = None
    #: Tokens the page holds; recomputing it costs in proportion (0: unknown).
    tokens: int = 0
    #: Whose page it is; quotas are per tenant (None: no tenant).
    tenant: str | None = None


def never_pinned(key: str) -> bool:
    """The default ``pinned`` of :meth:`EvictionPolicy.choose_victims`: nothing is pinned."""
    return False


class EvictionPolicy(ABC):
    """Chooses which pages leave one tier when it is full.

    The tier records what happens to its pages; when it needs room it asks
    :meth:`choose_victims`, removes each victim itself and records the removal. Sizes are
    in bytes, as the tier counts them. Thread-safe (see the module docstring).
    """

    #: Whether something outside the backend owns the tier's space (a storage chain's
    #: space manager, see :mod:`kvtier.core.space`): a backend handed such a policy never
    #: makes room on its own (it asks for no victims; a put that does not fit is refused).
    space_owned: bool = False

    def describe(self, key: str, info: PageInfo) -> None:  # noqa: B027 - optional knowledge
        """Tell the policy what the cache knows of ``key``; may come before record_insert."""

    def record_reclaimed(self, key: str) -> None:
        """``key`` left the tier on the backend's own (or its shared store's) account,
        neither chosen as a victim nor deleted: a master's memory pressure, found out later.
        By default a removal; a storage chain counts it as an external eviction."""
        self.record_remove(key)

    @abstractmethod
    def record_insert(self, key: str, nbytes: int) -> None:
        """``key`` is now in the tier with ``nbytes`` (a new page, or a re-written one)."""

    @abstractmethod
    def record_access(self, key: str) -> None:
        """A hit on the resident page ``key``; a key the policy does not hold is ignored."""

    @abstractmethod
    def record_remove(self, key: str) -> None:
        """``key`` left the tier (evicted, deleted, found invalid); unknown keys are ignored."""

    @abstractmethod
    def choose_victims(
        self,
        nbytes: int,
        *,
        pinned: Callable[[str], bool] = never_pinned,
        tenant: str | None = None,
    ) -> list[str]:
        """Keys whose removal frees at least ``nbytes``, as few as the policy can.

        Never a key for which ``pinned(key)`` is True; with ``tenant``, only that
        tenant's pages. Removes nothing: the caller removes each victim and calls
        :meth:`record_remove`. Frees less than asked (maybe nothing) when nothing else is
        removable.
        """

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is a resident page the policy tracks."""

    @abstractmethod
    def __len__(self) -> int:
        """How many resident pages the policy tracks."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of the resident pages the policy tracks."""

    @abstractmethod
    def tenant_bytes(self, tenant: str | None) -> int:
        """Resident bytes of ``tenant``'s pages (None: of the pages without a tenant)."""


class AdmissionPolicy(ABC):
    """Decides whether a page enters a tier at all (at a boundary of the chain).

    Thread-safe (see the module docstring).
    """

    def describe(self, key: str, info: PageInfo) -> None:  # noqa: B027 - optional knowledge
        """Tell the policy what the cache knows of ``key``."""

    @abstractmethod
    def record_access(self, key: str) -> None:
        """``key`` was looked up or offered at this boundary."""

    @abstractmethod
    def admit(self, key: str, nbytes: int) -> bool:
        """Whether ``key`` (a page of ``nbytes``) may enter the tier below."""


class PageBook:
    """The resident pages of one policy: sizes, tenants and the totals, for built-ins.

    Not locked: the policy that holds a book calls it under its own lock. Descriptions of
    pages not (yet) resident wait for their insert, the most recent ``pending`` of them
    only, so a caller that describes pages it never inserts cannot grow the book without
    bound. Pages without a tenant cost no tenant bookkeeping.
    """

    __slots__ = ("_by_tenant", "_pending_max", "_tenant", "pending", "sizes", "total")

    def __init__(self, pending: int = 4096) -> None:
        self.sizes: dict[str, int] = {}
        self.total = 0
        self._tenant: dict[str, str] = {}  # resident key -> its tenant, when it has one
        self._by_tenant: dict[str, int] = {}  # tenant -> resident bytes
        #: Descriptions of pages not resident yet, oldest first (see :meth:`describe`).
        self.pending: dict[str, PageInfo] = {}
        self._pending_max = pending

    def describe(self, key: str, info: PageInfo) -> bool:
        """Remember ``info``: a resident page's tenant now, else until its insert.

        True when ``key`` is resident (the caller may use the rest of ``info`` now).
        """
        size = self.sizes.get(key)
        if size is None:
            self.hold(key, info)
            return False
        self.pending.pop(key, None)  # (stored by hold_unlocked just before its insert)
        old = self._tenant.get(key)
        if old != info.tenant:
            self._add_tenant(old, -size)
            self._add_tenant(info.tenant, size)
            if info.tenant is None:
                del self._tenant[key]
            else:
                self._tenant[key] = info.tenant
        return True

    def hold_unlocked(self, key: str, info: PageInfo) -> bool:
        """:meth:`describe` without the policy's lock, for a page not resident: True when
        done. False when ``key`` is resident (or became so meanwhile): then the caller
        takes its lock and calls :meth:`describe`.

        Safe because each step is one dict operation (atomic) and an insert makes the page
        resident before it takes the description: either the insert, under the lock,
        finds the description, or the check after storing it sees the page resident and
        the caller applies it under the lock.
        """
        sizes = self.sizes
        if key in sizes:
            return False
        pending = self.pending
        pending[key] = info
        if key in sizes:
            return False
        while len(pending) > self._pending_max:  # the oldest descriptions go
            pending.pop(next(iter(pending)), None)
        return True

    def hold(self, key: str, info: PageInfo) -> None:
        """Keep the description of ``key``, not resident, until its insert."""
        pending = self.pending
        pending[key] = info
        while len(pending) > self._pending_max:  # the oldest descriptions go
            pending.pop(next(iter(pending)), None)

    def insert(self, key: str, nbytes: int) -> PageInfo | None:
        """Record ``key`` as resident with ``nbytes`` (new, or a new size); what was
        described of a new page before (None: nothing, or it was already resident)."""
        old = self.sizes.get(key)
        self.sizes[key] = nbytes
        if old is not None:
            self.total += nbytes - old
            self._add_tenant(self._tenant.get(key), nbytes - old)
            return None
        self.total += nbytes
        info = self.pending.pop(key, None)
        if info is not None and info.tenant is not None:
            self._tenant[key] = info.tenant
            self._add_tenant(info.tenant, nbytes)
        return info

    def insert_new(self, key: str, nbytes: int) -> PageInfo | None:
        """:meth:`insert` of a key the caller knows is not resident (a look-up less)."""
        self.sizes[key] = nbytes
        self.total += nbytes
        info = self.pending.pop(key, None)
        if info is not None and info.tenant is not None:
            self._tenant[key] = info.tenant
            self._add_tenant(info.tenant, nbytes)
        return info

    def remove(self, key: str) -> int | None:
        """Forget the resident ``key``; its size, or None when it was not resident."""
        size = self.sizes.pop(key, None)
        if size is None:
            return None
        self.total -= size
        if self._tenant:
            tenant = self._tenant.pop(key, None)
            if tenant is not None:
                self._add_tenant(tenant, -size)
        return size

    def tenant_of(self, key: str) -> str | None:
        """The tenant of the resident ``key`` (None: none, or not resident)."""
        return self._tenant.get(key)

    def tenant_bytes(self, tenant: str | None) -> int:
        """Resident bytes of ``tenant`` (None: of the pages without a tenant)."""
        if tenant is None:
            return self.total - sum(self._by_tenant.values())
        return self._by_tenant.get(tenant, 0)

    def eligible(self, key: str, tenant: str | None, pinned: Callable[[str], bool]) -> bool:
        """Whether ``key`` may be a victim: of ``tenant`` (when given) and not pinned."""
        if tenant is not None and self._tenant.get(key) != tenant:
            return False
        return not pinned(key)

    def pick(
        self,
        queues: Iterable[Iterable[str]],
        nbytes: int,
        pinned: Callable[[str], bool],
        tenant: str | None,
    ) -> list[str]:
        """Walk ``queues`` in order, each oldest first, taking eligible keys until they
        hold ``nbytes``: the usual body of ``choose_victims``."""
        victims: list[str] = []
        if nbytes <= 0:
            return victims
        freed = 0
        sizes = self.sizes
        plain = tenant is None and pinned is never_pinned
        for queue in queues:
            for key in queue:
                if plain or self.eligible(key, tenant, pinned):
                    victims.append(key)
                    freed += sizes[key]
                    if freed >= nbytes:
                        return victims
        return victims

    def _add_tenant(self, tenant: str | None, amount: int) -> None:
        if tenant is None or not amount:
            return
        value = self._by_tenant.get(tenant, 0) + amount
        if value:
            self._by_tenant[tenant] = value
        else:
            del self._by_tenant[tenant]


class LockedEviction(EvictionPolicy):
    """The frame of kvtier's built-in eviction policies: one lock, taken once per call.

    A subclass keeps its state under the lock, taking it with ``self._acquire()`` and
    ``self._release()`` in ``try``/``finally`` (half what a ``with`` costs on each call),
    and writes the two answers that need nothing but the lock as :meth:`_victims` and
    :meth:`_tenant_bytes`, which this frame calls with the lock held.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._acquire, self._release = self._lock.acquire, self._lock.release

    def choose_victims(
        self,
        nbytes: int,
        *,
        pinned: Callable[[str], bool] = never_pinned,
        tenant: str | None = None,
    ) -> list[str]:
        self._acquire()
        try:
            return self._victims(nbytes, pinned, tenant)
        finally:
            self._release()

    @abstractmethod
    def _victims(self, nbytes: int, pinned: Callable[[str], bool], tenant: str | None) -> list[str]:
        """:meth:`choose_victims`, called with the lock held."""

    def tenant_bytes(self, tenant: str | None) -> int:
        self._acquire()
        try:
            return self._tenant_bytes(tenant)
        finally:
            self._release()

    @abstractmethod
    def _tenant_bytes(self, tenant: str | None) -> int:
        """:meth:`tenant_bytes`, called with the lock held."""


class BookEviction(LockedEviction):
    """A :class:`LockedEviction` whose resident pages are a :class:`PageBook` (``_book``).

    It answers what only the book knows (describing a page, whether a page is resident,
    how many, their bytes and a tenant's); a subclass keeps its order of the pages
    beside the book and writes the ``record_*`` calls and :meth:`_victims`.
    """

    def __init__(self) -> None:
        super().__init__()
        self._book = PageBook()

    def describe(self, key: str, info: PageInfo) -> None:
        if self._book.hold_unlocked(key, info):
            return
        self._acquire()
        try:
            self._book.describe(key, info)
        finally:
            self._release()

    def __contains__(self, key: object) -> bool:
        return key in self._book.sizes

    def __len__(self) -> int:
        return len(self._book.sizes)

    @property
    def nbytes(self) -> int:
        return self._book.total

    def _tenant_bytes(self, tenant: str | None) -> int:
        return self._book.tenant_bytes(tenant)


class LRUPolicy(BookEviction):
    """Least recently used first: inserts and hits move a page to the back of one queue.

    The reference eviction policy, and what a backend's ``capacity_bytes`` uses when no
    policy is given. One lock per call (describing a page not resident yet takes none: see
    :meth:`PageBook.hold_unlocked`); each call is O(1) but ``choose_victims``, which
    walks from the least recently used page past pinned pages and other tenants' pages.
    """

    def __init__(self, config: BaseModel | None = None) -> None:
        super().__init__()
        self.config = config
        self._order: OrderedDict[str, None] = OrderedDict()

    def record_insert(self, key: str, nbytes: int) -> None:
        self._acquire()
        try:
            self._book.insert(key, nbytes)
            self._order[key] = None
            self._order.move_to_end(key)
        finally:
            self._release()

    def record_access(self, key: str) -> None:
        self._acquire()
        try:
            if key in self._order:
                self._order.move_to_end(key)
        finally:
            self._release()

    def record_remove(self, key: str) -> None:
        self._acquire()
        try:
            if self._book.remove(key) is not None:
                del self._order[key]
        finally:
            self._release()

    def _victims(self, nbytes: int, pinned: Callable[[str], bool], tenant: str | None) -> list[str]:
        return self._book.pick((self._order,), nbytes, pinned, tenant)

    def order(self) -> list[str]:
        """The resident keys, least recently used first."""
        self._acquire()
        try:
            return list(self._order)
        finally:
            self._release()

    def __repr__(self) -> str:
        return f"LRUPolicy(pages={len(self)}, nbytes={self.nbytes})"
