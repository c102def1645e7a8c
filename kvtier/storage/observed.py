"""A tier's eviction policy, watched by the chain: what leaves the tier is known as it
leaves (the chain's eviction, the backend's own, or a removal), pinned pages are never
victims, and pages the chain did not describe (rebuilt at start-up, adopted from another
process) get their tenant."""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvtier.core.policy import EvictionPolicy, PageInfo, never_pinned
from kvtier.storage.pins import PinSet

__all__ = ["Departure", "ObservedEviction"]

#: Descriptions the chain gave a tier's policy, kept until the page's insert.
_DESCRIBED_KEEP = 1 << 14


class Departure(enum.Enum):
    """How a page left a tier."""

    #: deleted (by the caller, a taint, the chain undoing a write): not an eviction
    REMOVED = "removed"
    #: a victim the chain's space manager picked (:meth:`ObservedEviction.pick`)
    EVICTED = "evicted"
    #: evicted without the chain choosing it: the backend's own capacity (a backend that
    #: does not report its space) or a reclaim it reported (a shared store's master)
    EXTERNAL = "external"


class ObservedEviction(EvictionPolicy):
    """A tier's eviction policy, watched: each removal is told to ``on_removed`` with
    its :class:`Departure` (the chain's victims, the backend's own, or a removal).

    ``owned``: the chain's space manager owns the tier's space
    (:attr:`~kvtier.core.policy.EvictionPolicy.space_owned`): the backend must make no room
    on its own, and :meth:`choose_victims` (the backend's call) answers nothing, counted in
    :attr:`refused_choices`; the manager picks through :meth:`pick`.

    It also adds what the chain knows to every call the tier's backend makes: a pinned
    key (``pins``) is never a victim, and a page inserted without the chain describing it
    (the backend rebuilt its index at start-up, or adopted a page another process wrote)
    is described with the tenant of its key's namespace (``tenant_of``), so quotas count
    pages stored before a restart.
    """

    def __init__(
        self,
        inner: EvictionPolicy,
        on_removed: Callable[[str, Departure], None],
        *,
        pins: PinSet | None = None,
        tenant_of: Callable[[str], str | None] | None = None,
        tokens: int = 0,
        owned: bool = False,
    ) -> None:
        self.inner = inner
        self._on_removed = on_removed
        self._pins = pins
        self._tenant_of = tenant_of
        self._tokens = tokens
        self.space_owned = owned
        #: Victims the chain picked, and those the backend chose or reclaimed itself.
        self._chosen: set[str] = set()
        self._external: set[str] = set()
        #: Pages about to be put, inserted ahead so the policy weighs them (see :meth:`pick`).
        self._provisional: set[str] = set()
        #: Times a backend asked for victims of a tier whose space the chain owns.
        self.refused_choices = 0
        self._described: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def describe(self, key: str, info: PageInfo) -> None:
        if self._tenant_of is not None:
            with self._lock:
                described = self._described
                described[key] = None
                described.move_to_end(key)
                if len(described) > _DESCRIBED_KEEP:
                    described.popitem(last=False)
        self.inner.describe(key, info)

    def record_insert(self, key: str, nbytes: int) -> None:
        if self._provisional:
            with self._lock:
                self._provisional.discard(key)
        tenant_of = self._tenant_of
        if tenant_of is not None:
            with self._lock:
                told = key in self._described
                if told:
                    del self._described[key]
            if not told:
                tenant = tenant_of(key)
                if tenant is not None and key not in self.inner:
                    self.inner.describe(key, PageInfo(tokens=self._tokens, tenant=tenant))
        self.inner.record_insert(key, nbytes)

    def record_access(self, key: str) -> None:
        self.inner.record_access(key)

    def record_remove(self, key: str) -> None:
        with self._lock:
            ahead = key in self._provisional
            self._provisional.discard(key)
        if ahead:  # inserted ahead of its put, never stored: not a departure
            self.inner.record_remove(key)
            return
        with self._lock:
            if key in self._chosen:
                how = Departure.EVICTED
            elif key in self._external:
                how = Departure.EXTERNAL
            else:
                how = Departure.REMOVED
            self._chosen.discard(key)
            self._external.discard(key)
        known = key in self.inner
        self.inner.record_remove(key)
        if known:
            self._on_removed(key, how)

    def record_reclaimed(self, key: str) -> None:
        with self._lock:
            self._chosen.discard(key)
            self._external.add(key)
        self.record_remove(key)

    def choose_victims(
        self,
        nbytes: int,
        *,
        pinned: Callable[[str], bool] = never_pinned,
        tenant: str | None = None,
    ) -> list[str]:
        """The backend's own call: its victims (external evictions), or none when the
        chain owns the tier's space (counted in :attr:`refused_choices`)."""
        if self.space_owned:
            with self._lock:
                self.refused_choices += 1
            return []
        victims = self._choose(nbytes, pinned, tenant)
        with self._lock:
            self._external.update(victims)
        return victims

    def pick(
        self,
        nbytes: int,
        *,
        pinned: Callable[[str], bool] = never_pinned,
        tenant: str | None = None,
        incoming: Sequence[tuple[str, int]] = (),
    ) -> list[str]:
        """The chain's call: victims for ``nbytes`` (never a pinned key), evictions when
        they leave (see :meth:`forget_choice` for those that stay).

        ``incoming`` (key, bytes): pages about to be put, inserted ahead so the policy
        weighs them with the tier's own (as if each had landed: a policy may rather keep
        what the tier holds). A victim among them is not to be written (:meth:`withdraw`
        it); the others stay provisional until the backend records their insert, or are
        withdrawn when their put fails."""
        if incoming:
            with self._lock:
                self._provisional.update(key for key, _ in incoming)
            for key, size in incoming:
                self.inner.record_insert(key, size)
        victims = self._choose(nbytes, pinned, tenant)
        with self._lock:
            self._chosen.update(key for key in victims if key not in self._provisional)
        return victims

    def rank(self, nbytes: int, *, pinned: Callable[[str], bool] = never_pinned) -> list[str]:
        """The victims the policy would pick for ``nbytes`` (never a pinned key), without
        choosing them: to weigh a backend's units (see :meth:`claim`)."""
        return self._choose(nbytes, pinned, None)

    def claim(self, keys: Iterable[str]) -> None:
        """``keys`` are the chain's victims (a unit the manager reclaims drops them):
        evictions when they leave (see :meth:`forget_choice` for those that stay)."""
        with self._lock:
            self._chosen.update(keys)

    def is_pinned(self, key: str) -> bool:
        """Whether a reader holds ``key`` (it must not leave the tier now)."""
        pins = self._pins
        return pins is not None and key in pins

    def withdraw(self, keys: Iterable[str]) -> None:
        """Pages inserted ahead (:meth:`pick`) that will not land: out of the policy."""
        for key in keys:
            with self._lock:
                if key not in self._provisional:
                    continue
                self._provisional.discard(key)
            self.inner.record_remove(key)

    def landed(self, key: str) -> bool:
        """Whether ``key`` is in the tier (not only inserted ahead of its put)."""
        return key in self.inner and key not in self._provisional

    def _choose(self, nbytes: int, pinned: Callable[[str], bool], tenant: str | None) -> list[str]:
        pins = self._pins
        check = pinned
        if pins is not None and len(pins):

            def check(key: str) -> bool:
                return key in pins or pinned(key)

        return self.inner.choose_victims(nbytes, pinned=check, tenant=tenant)

    def forget_choice(self, keys: Iterable[str]) -> None:
        """Victims that were chosen but stay (a later removal of them is no eviction)."""
        with self._lock:
            self._chosen.difference_update(keys)

    def __contains__(self, key: object) -> bool:
        return key in self.inner

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def tenant_bytes(self, tenant: str | None) -> int:
        return self.inner.tenant_bytes(tenant)
