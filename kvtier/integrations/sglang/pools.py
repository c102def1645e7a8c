"""The host pools kvtier serves for SGLang, each behind its own plan and storage chain.

:class:`AttachedPool` is one registered host pool: the KV pool (``register_mem_pool_host``)
or an extra pool of a hybrid model (``register_mem_host_pool_v2``: Mamba state,
sliding-window KV). Each has its own plan, built like the KV pool's
(:mod:`kvtier.integrations.sglang.plan`): its own key namespace (an extra pool's model id
carries ``pool=<name>``), geometry and fingerprint, and the same envelope, verified on
every get. A KV-shaped pool (an SWA pool: ``kv_buffer`` with heads) is served in place like
the KV pool; a state pool (Mamba) is served in place through its ``get_page_buffer_meta``
runs, or, where it has none, moved by value through SGLang's ``get_data_page`` /
``set_from_flat_data_page``; its page is described as a one-layer geometry of its bytes.
The v2 hit rules (``restorable_prefixes``, ``leading_run``) live here too, and each
stored page's parent (``chain_parents``: the page before it in SGLang's chain of page
hashes), which the pool's storage chain tells its tiers' policies.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from kvtier.core.bounded import Outcome
from kvtier.core.capabilities import ResolvedPlan
from kvtier.core.errors import UnsupportedCombinationError
from kvtier.core.geometry import AttentionKind
from kvtier.core.keys import external_key
from kvtier.core.metrics import registered_counters
from kvtier.core.pagestore import BatchResult
from kvtier.core.saveguard import SaveGuard
from kvtier.core.storage import Counters
from kvtier.integrations.sglang.pages import SGLangPages, SlotPages, StatePages
from kvtier.storage import StorageChain

__all__ = [
    "AttachedPool",
    "LateHold",
    "chain_parents",
    "first_slots",
    "is_kv_shaped",
    "is_per_rank",
    "leading_count",
    "leading_run",
    "restorable_prefixes",
    "state_geometry_fields",
]

#: The pool SGLang shards by TP rank even when the model's MLA KV is replicated.
_PER_RANK_POOLS = frozenset({"mamba"})
#: The dtype that describes a state page byte by byte (kvtier moves it as raw bytes).
_STATE_DTYPE = "float8_e4m3fn"


def chain_parents(keys: Sequence[str], prefix_keys: Sequence[str] | None) -> list[str | None]:
    """Each of SGLang's page hashes' parent: the hash before it in its sequence.

    One SGLang backup call stores consecutive pages of one sequence (``prefix_keys +
    keys`` is one contiguous chain, SGLang's ``HiCacheStorageExtraInfo``), so a page's
    parent is the key before it, and the first page's the last of ``prefix_keys``; None
    where SGLang passes no prefix keys (``hicache_storage_pass_prefix_keys`` off: the
    first page's parent is not known) or the call starts its sequence.
    """
    if not keys:
        return []
    first = prefix_keys[-1] if prefix_keys else None
    return [first, *keys[:-1]]


def is_kv_shaped(pool: Any) -> bool:
    """Whether a host pool keeps KV-shaped pages in one CPU ``kv_buffer`` (served in place)."""
    buffer = getattr(pool, "kv_buffer", None)
    return isinstance(buffer, torch.Tensor) and (
        hasattr(pool, "head_num") or hasattr(pool, "kv_cache_dim")
    )


def is_per_rank(name: str, attention: AttentionKind) -> bool:
    """Whether each TP rank holds its own pages of this pool (MHA: all; MLA: Mamba only)."""
    return attention is AttentionKind.MHA or name in _PER_RANK_POOLS


def state_geometry_fields(
    name: str, pool: Any, page_bytes: int, attention: AttentionKind
) -> dict[str, Any]:
    """Engine-config geometry of a flat state page: one layer of ``page_bytes`` raw bytes."""
    page_size = int(pool.page_size)
    base = {"dtype": _STATE_DTYPE, "num_layers": 1, "page_size": page_size}
    if attention is AttentionKind.MLA:
        width, rest = divmod(page_bytes, page_size)
        if rest == 0 and width >= 2:
            return {**base, "kv_lora_rank": width - 1, "qk_rope_head_dim": 1}
    else:
        head_dim, rest = divmod(page_bytes, 2 * page_size)
        if rest == 0 and head_dim >= 1:
            return {**base, "num_kv_heads": 1, "head_dim": head_dim}
    raise UnsupportedCombinationError(
        f"SGLang host pool {name!r} ({type(pool).__name__}) has pages of {page_bytes} bytes "
        f"for page_size {page_size}; kvtier stores state pages whose bytes divide evenly "
        f"into {'2 x ' if attention is AttentionKind.MHA else ''}page_size",
        value=page_bytes,
        supported=["Mamba and SWA host pools whose page bytes are a multiple of the above"],
    )


class LateHold:
    """What one bounded call was given of kvtier's own memory (scratch pages), freed by
    ``release`` once no call can touch it: at once if the call returned in time, else
    only when the late call returns (its ``on_late``: :meth:`returned`).

    :meth:`timed_out` and :meth:`returned` may come in either order (the call may return
    between its timeout and its caller's look at the outcome).
    """

    def __init__(self, release: Callable[[], None]) -> None:
        self._release = release
        self._lock = threading.Lock()
        self._returned = False
        self._held = False

    def timed_out(self) -> bool:
        """The call timed out: hold the memory until it returns; False if it already did
        (the caller releases then, as after a call that returned in time)."""
        with self._lock:
            if self._returned:
                return False
            self._held = True
            return True

    def returned(self, result: Any) -> None:
        """The call's ``on_late``: it returned at last; release what it held."""
        with self._lock:
            self._returned = True
            held, self._held = self._held, False
        if held:
            self._release()


def late_safe_call(
    store: StorageChain,
    op: str,
    names: list[str],
    ids: list[int],
    counters: Counters,
    *,
    release: Callable[[], None] | None = None,
    guard: bool = False,
    parents: Sequence[str | None] | None = None,
) -> tuple[BatchResult, bool]:
    """Get or put (``op``) pages ``ids`` so that a call timing out never leaves memory
    that may be reused under the late call; returns the result and whether ``release``
    is deferred to the late call's return (the caller must not run it then).

    ``release`` frees kvtier's own memory the call was given (scratch pages): after a
    timeout it runs only when the late call returns, and the pages count as
    ``scratch_pages_quarantined``. ``guard`` (a put from memory SGLang takes back as soon
    as this returns) seals each page under a :class:`~kvtier.core.saveguard.SaveGuard`
    tripped at the timeout: a late write then lands as a page that never verifies.
    ``parents``: a put's pages' real parents, as storage keys (see :func:`chain_parents`).
    """
    hold = LateHold(release) if release is not None else None
    on_late = hold.returned if hold is not None else None
    guards = [SaveGuard() for _ in ids] if guard and op == "put" else None
    if op == "put":
        result = store.put(names, ids, on_late=on_late, guards=guards, parents=parents)
    else:
        result = store.get(names, ids, on_late=on_late)
    if result.outcome is not Outcome.TIMED_OUT:
        return result, False
    for one in guards or []:
        one.trip()  # before SGLang may reuse the memory: no seal over its new bytes
    if hold is not None and hold.timed_out():
        counters.add("scratch_pages_quarantined", len(ids))
        return result, True
    return result, False


#: How a pool's pages are served: in place (KV-shaped, or state runs), or by value.
P = TypeVar("P", bound=SGLangPages | SlotPages | StatePages)


@dataclass
class AttachedPool(Generic[P]):
    """One registered host pool with its plan and storage: the KV pool, or an extra one.

    ``store`` is the pool's :class:`~kvtier.storage.StorageChain` (its tiers behind
    the page store's API; a single backend is a chain of one).
    """

    #: SGLang's name for the pool: ``"kv"``, ``"mamba"``, ``"swa"``, ...
    name: str
    pages: P
    store: StorageChain
    plan: ResolvedPlan
    #: Whether this rank writes the pool's pages (its own pages, or the shared writer).
    writes: bool
    closed: bool = False
    #: What this pool's transfers count themselves (``scratch_pages_quarantined``,
    #: ``pages_staged``).
    counters: Counters = field(default_factory=lambda: registered_counters("sglang"))

    @property
    def in_place(self) -> bool:
        return not isinstance(self.pages, StatePages)

    @property
    def bounded(self) -> bool:
        """Whether a call to some tier may time out (``backend_call_timeout_s`` set) and
        then still use the pages it was given: then a get never fills SGLang's pages in
        place (it is staged) and a put of them is guarded (see ``docs/sglang.md``)."""
        return any(tier.store.backend_call_timeout_s is not None for tier in self.store.tiers)

    def transfer(
        self,
        op: str,
        names: list[str],
        ids: list[int],
        parents: Sequence[str | None] | None = None,
    ) -> list[bool]:
        """Get or put SGLang's in-place pages ``ids`` under this pool's keys ``names``
        (a put's ``parents``: each page's parent, as this pool's keys, see
        :meth:`parent_names`).

        Unbounded calls move them in place. Bounded ones may time out and complete late,
        when SGLang already reuses its pages: a get then reads into kvtier's own scratch
        pages and copies each verified page in (a late read fills only scratch, held until
        it returns); a put is guarded, so a late write of reused memory never verifies.
        """
        pages = self.pages
        assert not isinstance(pages, StatePages)
        if not names:
            return []
        if not self.bounded:
            if op == "get":
                return self.store.get(names, ids)
            return self.store.put(names, ids, parents=parents)
        if op == "put":
            return late_safe_call(
                self.store, op, names, ids, self.counters, guard=True, parents=parents
            )[0]
        tensors = pages.take_spare(len(ids))
        scratch = pages.add_scratch(tensors)

        def release() -> None:
            pages.drop_scratch(scratch)
            pages.give_spare(tensors)

        try:
            result, held = late_safe_call(
                self.store, op, names, scratch, self.counters, release=release
            )
        except BaseException:
            release()
            raise
        if held:
            return result
        try:
            for source, page, ok in zip(scratch, ids, result, strict=True):
                if ok:
                    pages.copy_in(source, page)
            self.counters.add("pages_staged", sum(result))
        finally:
            release()
        return result

    def keys(self, raw: Sequence[str]) -> list[str]:
        """SGLang's page hashes in this pool's namespace, with the plan's rank suffix."""
        return [external_key(self.plan.namespace, key, self.plan.rank_suffix) for key in raw]

    def parent_names(self, raw: Sequence[str | None]) -> list[str | None]:
        """SGLang's parent page hashes (:func:`chain_parents`) as this pool's keys."""
        return [None if parent is None else self.keys([parent])[0] for parent in raw]

    def raw_of(self, key: str) -> str | None:
        """SGLang's page hash inside one of this pool's keys (the inverse of :meth:`keys`:
        ``<namespace id>-x-<hash><rank suffix>``), or None for a key of another namespace."""
        prefix, suffix = f"{self.plan.namespace.id}-x-", self.plan.rank_suffix
        if not key.startswith(prefix) or not key.endswith(suffix) or len(key) <= len(prefix):
            return None
        raw = key[len(prefix) : len(key) - len(suffix)]
        return raw or None

    def move(
        self,
        op: str,
        keys: list[str],
        host_indices: Any,
        firsts: list[int],
        parents: Sequence[str | None] | None = None,
    ) -> list[bool]:
        """Get or put (``op``) the pages at SGLang's ``host_indices`` (``firsts``: each
        page's first slot): in place, or by value for a state pool that names no memory.
        A put's ``parents`` are SGLang's page hashes (:func:`chain_parents`).

        By value, a get is a leading run and only verified pages reach the pool (through
        SGLang's ``set_from_flat_data_page``).
        """
        if not keys:
            return []
        names = self.keys(keys)
        named = None if parents is None else self.parent_names(parents)
        pages = self.pages
        if not isinstance(pages, StatePages):
            return self.transfer(op, names, pages.pages_of(host_indices, len(keys)), named)
        host = pages.host_pool
        if op == "put":
            tensors = [
                host.get_data_page(first, flat=True).contiguous().view(torch.uint8)
                for first in firsts
            ]
        else:
            tensors = [host.get_dummy_flat_data_page().view(torch.uint8) for _ in firsts]
        ids = pages.add(tensors)
        held = False
        try:
            # a put's tensor may be a view of SGLang's pool: guarded as an in-place put
            answer, held = late_safe_call(
                self.store,
                op,
                names,
                ids,
                self.counters,
                release=lambda: pages.drop(ids),
                guard=self.bounded,
                parents=named if op == "put" else None,
            )
            results: list[bool] = answer if op == "put" else leading_run(answer)
        finally:
            if not held:  # else the late call still uses them: dropped when it returns
                pages.drop(ids)
        if op == "get":
            for first, tensor, ok in zip(firsts, tensors, results, strict=True):
                if ok:
                    host.set_from_flat_data_page(first, tensor)
        return results

    def stats(self, prefix: str = "") -> dict[str, int | float]:
        """The page stores' counters (summed over the tiers) and the backends'
        (``backend_*``; a lower tier's as ``backend_tier<i>.<name>``), under ``prefix``."""
        stats = {f"{prefix}{k}": v for k, v in self.store.stats().items()}
        stats.update({f"{prefix}{k}": v for k, v in self.counters.snapshot().items()})
        backend = self.store.backend_stats()
        stats.update({f"{prefix}backend_{k}": v for k, v in backend.items()})
        return stats

    def close(self) -> None:
        """Close the storage chain (its worker, every tier and its backend). Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.store.close()


def first_slots(page_size: int, host_indices: Any, count: int) -> list[int] | None:
    """The first host slot of each of ``count`` pages, or None where SGLang's
    ``host_indices`` do not hold ``page_size`` indices per page (its v2 contract)."""
    got = 0 if host_indices is None else int(torch.as_tensor(host_indices).numel())
    if got != count * page_size:
        return None
    flat = torch.as_tensor(host_indices).reshape(-1).to(device="cpu", dtype=torch.int64)
    return [int(i) for i in flat[::page_size].tolist()] if count else []


def restorable_prefixes(
    present: Sequence[bool], policy: str, trailing: int
) -> tuple[set[int], int]:
    """The prefix lengths (in pages) a pool allows, and its own boundary.

    ``present[i]`` says whether the pool's page ``i`` of the KV hit is stored.
    ``all_pages``: every page up to the length. ``trailing_pages``: the last ``trailing``.
    """
    if policy == "all_pages":
        boundary = leading_count(present)
        return set(range(1, boundary + 1)), boundary
    if policy == "trailing_pages":
        window = max(1, trailing)
        allowed = {
            length
            for length in range(1, len(present) + 1)
            if all(present[max(0, length - window) : length])
        }
        return allowed, max(allowed, default=0)
    raise UnsupportedCombinationError(
        f"SGLang asked for hit policy {policy!r}; kvtier's v2 storage answers "
        "'all_pages' and 'trailing_pages'",
        value=policy,
        supported=["all_pages", "trailing_pages"],
    )


def leading_count(results: Sequence[bool]) -> int:
    """How many leading entries are True."""
    for i, ok in enumerate(results):
        if not ok:
            return i
    return len(results)


def leading_run(results: Sequence[bool]) -> list[bool]:
    """``results`` with everything after the first False also False: a prefix breaks there."""
    count = leading_count(results)
    return [True] * count + [False] * (len(results) - count)
