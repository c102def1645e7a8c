"""A tier's eviction policy, watched by the chain: what leaves the tier is known as it
leaves (an eviction or a removal), pinned pages are never victims, and pages the chain
did not describe (rebuilt at start-up, adopted from another process) get their tenant."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

from kvtier.core.policy import EvictionPolicy, PageInfo, never_pinned
from kvtier.storage.pins import PinSet

__all__ = ["ObservedEviction"]

#: Descriptions the chain gave a tier's policy, kept until the page's insert.
_DESCRIBED_KEEP = 1 << 14


class ObservedEviction(EvictionPolicy):
    """A tier's eviction policy, watched: removals right after a victim choice are
    evictions (an :class:`Event` and a count), other removals are removals.

    It also adds what the chain knows to every call the tier's backend makes: a pinned
    key (``pins``) is never a victim, and a page inserted without the chain describing it
    (the backend rebuilt its index at start-up, or adopted a page another process wrote)
    is described with the tenant of its key's namespace (``tenant_of``), so quotas count
    pages stored before a restart.
    """

    def __init__(
        self,
        inner: EvictionPolicy,
        on_removed: Callable[[str, bool], None],
        *,
        pins: PinSet | None = None,
        tenant_of: Callable[[str], str | None] | None = None,
        tokens: int = 0,
    ) -> None:
        self.inner = inner
        self._on_removed = on_removed
        self._pins = pins
        self._tenant_of = tenant_of
        self._tokens = tokens
        self._chosen: set[str] = set()
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
            evicted = key in self._chosen
            self._chosen.discard(key)
        known = key in self.inner
        self.inner.record_remove(key)
        if known:
            self._on_removed(key, evicted)

    def choose_victims(
        self,
        nbytes: int,
        *,
        pinned: Callable[[str], bool] = never_pinned,
        tenant: str | None = None,
    ) -> list[str]:
        pins = self._pins
        check = pinned
        if pins is not None and len(pins):

            def check(key: str) -> bool:
                return key in pins or pinned(key)

        victims = self.inner.choose_victims(nbytes, pinned=check, tenant=tenant)
        with self._lock:
            self._chosen.update(victims)
        return victims

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
