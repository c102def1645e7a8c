"""What the fault mixins share: a ledger of every byte put, and the views to check it in.

A :class:`Ledger` remembers, for every key a test put, each version some writer handed
to a put whole, and which puts were acknowledged. :meth:`Ledger.check` reads keys back
through a store and fails on any page that is not one of its key's own versions (another
key's bytes, a torn page, stale staging bytes): every byte is compared. The helpers open
a store with a short call bound, list the stores to read through (the store itself, and
each tier of a chain), let a chain's worker settle, and give the ``fsync`` modes a
backend's config model declares.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from typing import Any

from kvtier.core.pagestore import PageStore
from kvtier.testing.kit.harness import Harness, KitEnv

__all__ = [
    "Ledger",
    "bounded",
    "cascades_on_put",
    "fsync_modes",
    "is_chain",
    "lowest_backend",
    "reopen_with",
    "settle",
    "views",
]

#: How long a chain's worker may take to write what is queued.
SETTLE_S = 30.0


class Ledger:
    """Every version of every key a test put, and the keys whose put was acknowledged."""

    def __init__(self) -> None:
        self.versions: dict[str, list[bytes]] = {}
        self.acked: dict[str, bytes] = {}

    def offered(self, keys: Sequence[str], payloads: Sequence[bytes]) -> None:
        """Record that these payloads were handed to a put (they may land, whole or not)."""
        for key, payload in zip(keys, payloads, strict=True):
            self.versions.setdefault(key, [])
            if payload not in self.versions[key]:
                self.versions[key].append(payload)

    def put(self, h: Harness, keys: Sequence[str], pages: Sequence[int]) -> list[bool]:
        """Put through ``h.store``, recording what was offered and what was acknowledged."""
        payloads = h.payloads(pages)
        self.offered(keys, payloads)
        results = list(h.store.put(list(keys), list(pages)))
        self.acknowledge(keys, payloads, results)
        return results

    def acknowledge(
        self, keys: Sequence[str], payloads: Sequence[bytes], results: Sequence[bool]
    ) -> None:
        """Record the puts that returned True: the latest acknowledged version of each key."""
        for key, payload, ok in zip(keys, payloads, results, strict=True):
            if ok:
                self.acked[key] = payload

    def owner(self, payload: bytes) -> str | None:
        """The key one of whose versions ``payload`` is, if any (to name a wrong page)."""
        for key, versions in self.versions.items():
            if payload in versions:
                return key
        return None

    def check(
        self,
        h: Harness,
        store: Any,
        keys: Sequence[str],
        scratch: Sequence[int],
        *,
        where: str,
        must_hold: Sequence[str] = (),
    ) -> int:
        """Read ``keys`` through ``store`` into ``scratch`` pages; every hit must be one of
        its key's own versions, and every key in ``must_hold`` a hit. Returns the hits."""
        hits = 0
        keys = list(keys)
        for start in range(0, len(keys), len(scratch)):
            chunk = keys[start : start + len(scratch)]
            pages = list(scratch[: len(chunk)])
            h.scribble(pages)
            found = store.get(chunk, pages)
            for key, ok, payload in zip(chunk, found, h.payloads(pages), strict=True):
                if not ok:
                    assert key not in must_hold, (
                        f"{where}: page {key} was acknowledged and is gone (a miss)"
                    )
                    continue
                hits += 1
                if payload in self.versions.get(key, ()):
                    continue
                other = self.owner(payload)
                raise AssertionError(
                    f"{where}: page {key} loaded "
                    + (f"the bytes of page {other}" if other else "bytes no writer put whole")
                )
        return hits


def is_chain(store: Any) -> bool:
    """Whether ``store`` is a chain of tiers (it has ``tiers`` and ``flush``)."""
    return hasattr(store, "tiers") and hasattr(store, "flush")


def views(h: Harness) -> list[tuple[str, Any]]:
    """The stores to read a key back through: the harness's store, and for a chain each
    tier's own page store (a wrong page in a lower tier shows there first)."""
    out: list[tuple[str, Any]] = [("store", h.store)]
    if is_chain(h.store):
        chain: Any = h.store
        out += [(f"tier {t.index} ({t.name})", t.store) for t in chain.tiers]
    return out


def lowest_backend(h: Harness) -> Any:
    """The backend a fault goes into: the store's, or a chain's lowest tier's."""
    if is_chain(h.store):
        chain: Any = h.store
        return chain.tiers[-1].store.backend
    return h.backend


def cascades_on_put(h: Harness) -> bool:
    """Whether a put into the chain is written into its lowest tier by the worker (the
    tier is ``write: through``), not only when the tier above evicts it."""
    chain: Any = h.store
    return bool(chain.tiers[-1].plan.write != "back")


def settle(h: Harness, timeout: float = SETTLE_S) -> None:
    """Wait until a chain's worker has written what is queued (a page store: nothing)."""
    if is_chain(h.store):
        chain: Any = h.store
        assert chain.flush(timeout), f"the chain did not write its queue within {timeout} s"


def bounded(kit: KitEnv, bound_s: float, *, num_pages: int) -> Harness:
    """A harness whose store bounds every backend call by ``bound_s`` seconds.

    An env that opens chains (``open_bounded``) builds the chain with that bound; else the
    backend is opened as the kit opens it and a :class:`PageStore` with the bound put in
    front of it, as an engine configured with ``backend_call_timeout_s`` has one.
    """
    opener = getattr(kit, "open_bounded", None)
    if opener is not None:
        opened: Harness = opener(bound_s, num_pages=num_pages)
        return opened
    h = kit.open(num_pages=num_pages)
    store = PageStore(
        h.backend,
        h.pool,
        fingerprint=h.geometry.fingerprint,
        backend_call_timeout_s=bound_s,
        owns_backend=False,
    )
    return dataclasses.replace(h, store=kit.adopt(store))


def fsync_modes(kit: KitEnv) -> list[str | None]:
    """The ``fsync`` modes the backend's config model declares (a ``Literal`` field named
    ``fsync``); ``[None]`` (the config as given) when it declares none."""
    field = kit.spec.config_model.model_fields.get("fsync")
    if field is None:
        return [None]
    modes = [m for m in typing.get_args(field.annotation) if isinstance(m, str)]
    return list(modes) or [None]


def reopen_with(kit: KitEnv, **overrides: Any) -> KitEnv:
    """A kit env like ``kit`` (same spec, plugins, model, directory) with options changed."""
    factory = getattr(kit, "with_options", None)
    if factory is not None:
        env: KitEnv = factory(**overrides)
        return env
    env = KitEnv(kit.spec, {**kit.config, **overrides}, kit.plugins, kit.tmp, kit.io_backends)
    env.model = kit.model
    return env
