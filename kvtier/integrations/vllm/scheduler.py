"""The scheduler side of kvtier's vLLM connector: prefix hits, and what the workers do.

:class:`SchedulerSide` keys each request's full blocks with the plan's keyer (chained over
token ids, in the request's tenant namespace, one chain per KV cache group under vLLM's
hybrid allocator), counts how many blocks beyond vLLM's own hit are stored, plans their
loads into the blocks vLLM allocates, plans the store of every newly computed full block,
and learns from the workers' reports which pages are stored and which failed to load.

Lookups never block the scheduler thread for long: what the workers reported stored is
answered at once; the rest goes to the backend's ``exists`` on a lookup thread, in
growing chunks that stop at the first miss. :meth:`SchedulerSide.lookup` waits for it
``lookup_wait_s`` at most, then answers None ("ask again": vLLM skips the request for a
step), and a lookup unanswered after ``lookup_timeout_s`` is a miss. On vLLM's CPU engine
the loads are asynchronous: vLLM holds the request in ``WAITING_FOR_REMOTE_KVS`` until the
workers report the load ended, so a load never stalls a model step.

The workers' reports also carry their storage chains' events (:mod:`.events`): a page
the scheduler remembered stored is forgotten once no tier holds it (an eviction), so it is
never promised from memory; the same events become vLLM's KV events (``take_events``),
and say which tier a hit is read from (``get_external_cache_hit_sources``). A reset
(vLLM's ``reset_cache``) starts a new key epoch: nothing stored before it is served again.

Prefill and decode through the store: a saving engine hands on, with a finished request,
how many leading pages of it it holds or is storing (:meth:`SchedulerSide.handoff`, vLLM's
``kv_transfer_params`` ``{"kvtier_pages": N}``); a request that carries it is answered
"ask again" while fewer of those pages are found, at most ``handoff_timeout_s`` from its
first lookup (its producer's stores may still be in flight).

It reads a request through the attributes vLLM's ``Request`` has (``request_id``,
``all_token_ids``, ``num_computed_tokens``, ``cache_salt``, and what else changes its KV:
``lora_request``, ``mm_features``, ``prompt_embeds``, see :mod:`.inputs`) and imports
nothing from vLLM, so it is tested without an engine too. A request with an input that
cannot be keyed is kept away from kvtier: no hit, no store.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Protocol

from kvtier.core.capabilities import ResolvedPlan
from kvtier.core.errors import KvtierError, UnkeyableInputError
from kvtier.core.geometry import AttentionKind
from kvtier.core.keys import PageKeyer, rank_suffix
from kvtier.core.metrics import registered_counters, zeroed
from kvtier.core.store import ExistsLookup
from kvtier.integrations.vllm.events import (
    UNSPECIFIED,
    Describer,
    KVEventLog,
    TierLedger,
    hit_source,
    tier_medium,
)
from kvtier.integrations.vllm.inputs import AdapterIdentities, page_extras
from kvtier.integrations.vllm.messages import PageOp, Report, StepWork
from kvtier.integrations.vllm.plan import KVGroup, plan_strategy, request_namespace
from kvtier.integrations.vllm.settings import VLLMSection

__all__ = [
    "HANDOFF_KEY",
    "NULL_BLOCK",
    "RequestLike",
    "SchedulerSide",
    "TenantKeyers",
    "per_group",
]

log = logging.getLogger("kvtier.vllm")

#: vLLM's null block: its block pool reserves block 0 and hands it out for the blocks a
#: sliding-window group skips (out of the window). It holds no page.
NULL_BLOCK = 0
#: Pages in the first ``exists`` of a lookup; each next chunk doubles, and a lookup stops
#: at the first miss, so a long prompt with no hit costs one small call.
FIRST_CHUNK = 8
#: Threads that run lookups' ``exists`` (a stuck call holds one until its bound).
LOOKUP_THREADS = 2
#: How long the answer of a lookup started when vLLM admitted the request stays good
#: for a request that stopped short of its last page: past it, the request is looked up
#: anew when vLLM schedules it (another engine may have stored its pages since).
PREFETCH_FRESH_S = 0.25
#: The fewest failed pages the scheduler distrusts at once (``known_keys`` if larger).
MIN_BAD = 4096
#: What the first page of a request keyed after a reset folds into its key (with the
#: epoch's random token), so every page of a new epoch has a key no earlier page has.
EPOCH_TAG = b"kvtier-vllm-epoch:"
#: The key of vLLM's ``kv_transfer_params`` that hands a request from a producer engine
#: to a consumer: how many leading full pages of it the producer holds or is storing.
HANDOFF_KEY = "kvtier_pages"
#: How soon a handed-off request whose lookup came up short is looked up again.
HANDOFF_PROBE_S = 0.005


class RequestLike(Protocol):
    """What the scheduler side reads of vLLM's ``Request``."""

    request_id: str
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> Sequence[int]: ...


def per_group(block_ids: Any, groups: int) -> list[list[int]]:
    """vLLM's block ids as one list per KV cache group.

    vLLM hands one list per group (a tuple of lists); a single group's flat list is
    accepted too.
    """
    items = list(block_ids or ())
    if items and not isinstance(items[0], int):
        return [list(ids or ()) for ids in items]
    if groups > 1 and not items:
        return [[] for _ in range(groups)]
    return [items]


def _runs(indices: list[int], blocks: list[int]) -> list[tuple[int, int]]:
    """The (start, end) runs of consecutive page indices whose block is not the null block."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if blocks[i] == NULL_BLOCK:
            continue
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


class TenantKeyers:
    """The plan's page keyer per tenant, adapter and KV cache group: the section's tenant
    plus a request's cache salt, the request's LoRA adapter identity (see :mod:`.inputs`),
    and, under vLLM's hybrid allocator, the group (its pages hold other layers' KV).

    Keys are base keys (no rank suffix); each worker appends its own rank's suffix. A
    model with one group keeps the keys it always had.
    """

    def __init__(
        self, plan: ResolvedPlan, tenant: str | None, groups: Sequence[KVGroup] = ()
    ) -> None:
        self._plan = plan
        self._tenant = tenant
        self._tags = [group.tag() for group in groups] if len(groups) > 1 else []
        self._keyers: dict[tuple[str | None, str | None, int], PageKeyer] = {}

    def __call__(
        self, cache_salt: str | None, adapter: str | None = None, group: int = 0
    ) -> PageKeyer:
        keyer = self._keyers.get((cache_salt, adapter, group))
        if keyer is None:
            plan = self._plan
            tag = self._tags[group] if self._tags else None
            namespace = request_namespace(plan, self._tenant, cache_salt, adapter, tag)
            keyer = self._keyers[(cache_salt, adapter, group)] = PageKeyer(
                namespace, plan.geometry.page_size, plan.geometry.attention
            )
        return keyer


@dataclass
class _Lookup:
    """A lookup whose ``exists`` runs on a lookup thread."""

    start: int
    usable: int
    #: Pages known stored (from the workers' reports) from ``start`` on.
    known: int
    future: Future[int]
    deadline: float
    deferred: bool = False
    #: Started when vLLM admitted the request (from its first page), not when asked.
    early: bool = False
    started: float = 0.0


@dataclass
class _Handoff:
    """A request a producer engine handed off: the leading pages it announced."""

    pages: int
    #: The request's first lookup: it waits for the pages ``handoff_timeout_s`` from then.
    since: float
    #: No new lookup before this (the last one came up short a moment ago).
    probe_after: float = 0.0
    waited: bool = False


class _Bounded:
    """An insertion-ordered map that forgets its oldest entries beyond ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.items: OrderedDict[str, int] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self.items

    def __len__(self) -> int:
        return len(self.items)

    def put(self, key: str, value: int = 0) -> None:
        self.items[key] = value
        self.items.move_to_end(key)
        while len(self.items) > self.limit:
            self.items.popitem(last=False)

    def pop(self, key: str, default: int = 0) -> int:
        return self.items.pop(key, default)


class SchedulerSide:
    """Prefix hits and per-step work of one vLLM scheduler (see the module docstring)."""

    def __init__(
        self,
        plan: ResolvedPlan,
        settings: VLLMSection,
        store: ExistsLookup,
        *,
        loads: bool = True,
        saves: bool = True,
        groups: Sequence[KVGroup] | None = None,
        async_loads: bool | None = None,
        describe: Describer | None = None,
    ) -> None:
        self.plan = plan
        self.store = store
        self.groups = list(groups) if groups else [KVGroup(0, _kind(plan), ())]
        self.keyers = TenantKeyers(plan, settings.tenant, self.groups)
        self._loads_on = loads
        self._saves_on = saves
        #: Loads run between steps (``load_async``) on vLLM's CPU engine, and on the
        #: accelerator path where ``device_loads`` says so (hybrid models by default);
        #: otherwise the accelerator path loads layer by layer inside the step.
        if async_loads is None:
            async_loads = plan_strategy(plan) == "host" or settings.async_device_loads(
                len(self.groups)
            )
        self.async_loads = async_loads
        self._limit = settings.known_keys
        self._wait_s = float(settings.lookup_wait_s)
        self._timeout_s = float(settings.lookup_timeout_s)
        self._handoff_s = float(settings.handoff_timeout_s)
        mla = plan.geometry.attention is AttentionKind.MLA
        #: Ranks that report a page before it counts as stored: MLA pages are written by
        #: one rank and shared by all (no rank suffix).
        self._ranks = 1 if mla else int(plan.context.tp_size)
        self._page_size = plan.geometry.page_size
        #: Stored pages every rank reported, oldest first (bounded by ``known_keys``),
        #: and those some ranks reported so far (bounded too).
        self._known: OrderedDict[str, None] = OrderedDict()
        bound = max(self._limit, MIN_BAD)
        self._confirming = _Bounded(bound)
        #: Pages that failed to load: the backend's ``exists`` is not trusted for them
        #: until a worker stores them again (bounded: the oldest are trusted again).
        self._bad = _Bounded(bound)
        self._suffix0 = rank_suffix(plan.geometry.attention, 0, int(plan.context.tp_size))
        self.counters = registered_counters("vllm_scheduler")
        self._adapters = AdapterIdentities()
        self._requests: dict[str, RequestLike] = {}
        self._keyer_of: dict[str, list[PageKeyer]] = {}
        #: Requests with an input that cannot be keyed: never loaded or stored.
        self._unkeyed: set[str] = set()
        self._warned: set[str] = set()
        self._keys: dict[str, list[list[str]]] = {}
        self._matched: dict[str, tuple[int, int]] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._tables: dict[str, list[list[int]]] = {}
        self._done: dict[str, int] = {}
        self._has_saves: set[str] = set()
        #: Per request, the first page from which its pages up to ``_done`` are held by
        #: kvtier (its loaded hits and planned stores), and the first page a store of it
        #: skipped (a null block): what a producer announces (:meth:`handoff`).
        self._held_from: dict[str, int] = {}
        self._holes: dict[str, int] = {}
        #: Requests a producer handed off (None: none, or no longer waited for).
        self._handoffs: dict[str, _Handoff | None] = {}
        #: Requests whose asynchronous load the workers have not reported ended.
        self._loading: set[str] = set()
        self._pending_loads: list[PageOp] = []
        #: Keys planned for storing in the step being built.
        self._step_keys: set[str] = set()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        tiers = plan.storage_tiers()
        #: What the tiers hold, from the workers' events (bounded like ``known_keys``).
        self._ledger = TierLedger(len(tiers), self._ranks, bound)
        self._sources_of_tiers = [hit_source(tier) for tier in tiers]
        #: Tokens of each request's planned load, by the tier it is read from.
        self._sources: dict[str, dict[str, int]] = {}
        #: vLLM's KV events, when vLLM publishes them (``describe`` reads vLLM's blocks).
        self._describe = describe
        self.events: KVEventLog | None = None
        if describe is not None:
            self.events = KVEventLog(
                [tier_medium(tier) for tier in tiers],
                self._page_size,
                capacity=max(1, settings.events_buffer),
                hashes=bound,
                counters=self.counters,
            )
        #: The key epoch (a reset starts a new one; None before the first reset).
        self._epoch: bytes | None = None
        #: Requests admitted before the last reset: they store nothing and hit nothing.
        self._stale: set[str] = set()
        #: Pages a worker's load is promoting into a faster tier -> until when a lookup
        #: of them waits ("ask again") for the promotion to land.
        self._promoting: dict[str, float] = {}
        self._promotion_waits: set[str] = set()

    # --- keys and hits ------------------------------------------------------------------

    def request_keys(self, request: RequestLike, pages: int, group: int = 0) -> list[str]:
        """The base keys of ``request``'s first ``pages`` full pages in KV cache group
        ``group`` (cached, extended).

        Raises :class:`UnkeyableInputError` for a request with an input that changes its
        KV but cannot be keyed (an adapter without local files, say).
        """
        return self._group_keys(request, pages)[group][:pages]

    def _group_keys(self, request: RequestLike, pages: int) -> list[list[str]]:
        chains = self._keys.setdefault(request.request_id, [[] for _ in self.groups])
        have = len(chains[0])
        if have < pages:
            ps = self._page_size
            tokens = list(request.all_token_ids[have * ps : pages * ps])
            extras = page_extras(request, have, pages, ps)
            if self._epoch is not None and have == 0:
                # after a reset: the first page's key, and through the chain every other,
                # is the new epoch's (what else changes a page's KV: the weights, say)
                extras = list(extras) if extras is not None else [None] * (pages - have)
                extras[0] = EPOCH_TAG + self._epoch + (extras[0] or b"")
            for keyer, keys in zip(self._keyers(request), chains, strict=True):
                keys.extend(keyer.keys(tokens, parent=keys[-1] if keys else None, extras=extras))
        return chains

    def _keyers(self, request: RequestLike) -> list[PageKeyer]:
        """The keyers of ``request``'s namespace, one per group: its salt and adapter."""
        keyers = self._keyer_of.get(request.request_id)
        if keyers is None:
            adapter = self._adapters(getattr(request, "lora_request", None))
            salt = getattr(request, "cache_salt", None)
            keyers = [self.keyers(salt, adapter, group.index) for group in self.groups]
            self._keyer_of[request.request_id] = keyers
        return keyers

    def _keyed(self, request: RequestLike, pages: int) -> list[list[str]] | None:
        """Every group's keys of the first ``pages`` pages, or None (the request refused,
        counted, logged once per reason) when an input of it cannot be keyed."""
        if request.request_id in self._unkeyed:
            return None
        try:
            return [keys[:pages] for keys in self._group_keys(request, pages)]
        except UnkeyableInputError as exc:
            self._unkeyed.add(request.request_id)
            self.counters.add("requests_unkeyed")
            if str(exc) not in self._warned:
                self._warned.add(str(exc))
                log.warning(
                    "kvtier: requests like %s are served without kvtier (counted as "
                    "requests_unkeyed): %s",
                    request.request_id,
                    exc,
                )
            return None

    def _remember(self, key: str) -> None:
        """A page every rank stored: a hit from memory until a tier is seen losing it."""
        if self._limit:
            self._known[key] = None
            self._known.move_to_end(key)
            while len(self._known) > self._limit:
                self._known.popitem(last=False)

    def _describe_pages(
        self, request: RequestLike, chains: Iterable[tuple[int, list[str]]], lo: int, hi: int
    ) -> None:
        """Tell the KV event log what vLLM's blocks ``lo``..``hi`` of ``request`` are (the
        pages of each (group, keys) in ``chains``)."""
        if self.events is None or self._describe is None or hi <= lo:
            return
        infos = self._describe(request, lo, hi)
        for group, chain in chains:
            for i, info in enumerate(infos[: max(0, min(hi, len(chain)) - lo)]):
                self.events.describe(chain[lo + i], group, info)

    def _sources_of(self, keys: list[list[str]], start: int, end: int) -> dict[str, int]:
        """Tokens of pages ``start``..``end`` by the tier a load reads them from (vLLM's
        ``CacheHitSource`` values): the tier that holds the page whole (of several groups',
        the slowest), or ``external_unspecified`` where no event said which."""
        sources: dict[str, int] = {}
        single = len(self._sources_of_tiers) == 1
        for page in range(start, end):
            if single:
                source = self._sources_of_tiers[0]
            else:
                tiers = [self._ledger.tier_of(chain[page]) for chain in keys]
                known = [tier for tier in tiers if tier is not None]
                source = (
                    self._sources_of_tiers[max(known)] if len(known) == len(tiers) else UNSPECIFIED
                )
            sources[source] = sources.get(source, 0) + self._page_size
        return sources

    def _trusted(self, keys: list[list[str]], page: int) -> bool:
        return all(chain[page] in self._known for chain in keys)

    def _distrusted(self, keys: list[list[str]], page: int) -> bool:
        return any(chain[page] in self._bad for chain in keys)

    def _probe_names(self, keys: list[list[str]], start: int, end: int) -> list[list[str]]:
        """Per page from ``start`` to ``end``, the storage names (rank 0's) of every group."""
        return [[chain[i] + self._suffix0 for chain in keys] for i in range(start, end)]

    def _submit(self, pages: list[list[str]], deadline: float) -> Future[int]:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    LOOKUP_THREADS, thread_name_prefix="kvtier-vllm-lookup"
                )
            return self._pool.submit(self._probe, pages, deadline)

    def _probe(self, pages: list[list[str]], deadline: float) -> int:
        """On a lookup thread: how many leading ``pages`` are stored in every group.

        ``exists`` in chunks of :data:`FIRST_CHUNK` pages, doubling, stopping at the first
        miss or when ``deadline`` passed (the answer was given up on)."""
        found = 0
        size = FIRST_CHUNK
        while found < len(pages) and time.monotonic() < deadline:
            chunk = pages[found : found + size]
            names = [name for page in chunk for name in page]
            self.counters.add("lookup_exists_keys", len(names))
            try:
                results = list(self.store.exists(names))
            except KvtierError as exc:  # bad keys; backend errors are already False
                log.warning("kvtier: a lookup's exists raised %s; counted as a miss", exc)
                return found
            at = 0
            for page in chunk:
                if not all(results[at : at + len(page)]):
                    return found
                at += len(page)
                found += 1
            size *= 2
        return found

    def add_request(self, request: RequestLike) -> None:
        """Remember ``request`` (its token ids key its pages until it finishes) and start
        its lookup.

        The lookup starts from the first page (vLLM's own hit is not known yet), so its
        ``exists`` runs while vLLM admits the other requests, and the lookups of requests
        admitted together run side by side: :meth:`lookup` then finds the answer ready
        instead of waiting for each request's in turn on the scheduler thread.
        """
        self._requests[request.request_id] = request
        req_id = request.request_id
        usable = (len(request.all_token_ids) - 1) // self._page_size
        if not self._loads_on or usable <= 0 or req_id in self._stale or req_id in self._lookups:
            return
        keys = self._keyed(request, usable)
        if keys is not None:
            self._lookups[req_id] = self._begin(keys, 0, usable, early=True)

    def lookup(self, request: RequestLike, num_computed_tokens: int) -> int | None:
        """Tokens kvtier holds beyond vLLM's own hit (whole stored pages, one token left),
        or None while the backend's ``exists`` is still running ("ask again")."""
        return self._lookup(request, num_computed_tokens, self._wait_s)

    def matched_tokens(self, request: RequestLike, num_computed_tokens: int) -> int:
        """:meth:`lookup`, waiting for the answer (at most ``lookup_timeout_s``, or until a
        promotion of the request's pages landed, or a handed-off request's pages were
        found: at most ``handoff_timeout_s``)."""
        while True:
            answer = self._lookup(request, num_computed_tokens, self._timeout_s)
            if answer is not None:
                return answer
            time.sleep(0.001)  # a promotion or a handoff in flight: its bound ends the wait

    def _lookup(self, request: RequestLike, num_computed_tokens: int, wait: float) -> int | None:
        req_id = request.request_id
        self._requests.setdefault(req_id, request)
        ps = self._page_size
        start = num_computed_tokens // ps
        usable = (len(request.all_token_ids) - 1) // ps
        if not self._loads_on or usable <= start or req_id in self._stale:
            return self._answer(req_id, start, 0, counted=False)
        keys = self._keyed(request, usable)
        if keys is None:
            return self._answer(req_id, start, 0, counted=False)
        pending = self._lookups.get(req_id)
        if pending is not None and (pending.start > start or pending.usable != usable):
            del self._lookups[req_id]  # vLLM's own hit shrank: look again from there
            pending = None
        handoff = self._handoff_of(request)
        if pending is None:
            if handoff is not None and time.monotonic() < handoff.probe_after:
                return None  # its pages were looked for a moment ago: not again yet
            pending = self._lookups[req_id] = self._begin(keys, start, usable)
        asked = time.monotonic()
        try:
            found = pending.future.result(timeout=wait) if wait > 0 else None
        except FutureTimeout:
            found = None
        if found is None and pending.future.done():
            found = pending.future.result()
        if found is None:
            if time.monotonic() < pending.deadline:
                if not pending.deferred:
                    pending.deferred = True
                    self.counters.add("lookup_deferred")
                return None
            self.counters.add("lookup_timeouts")
            pending.early = False  # a miss, not looked up again
            found = 0
        del self._lookups[req_id]
        end = pending.known + found
        if pending.early and end < usable:
            if end < start or time.monotonic() - pending.started > PREFETCH_FRESH_S:
                # it stopped before vLLM's own hit, or long ago: look again from the hit
                left = max(0.0, wait - (time.monotonic() - asked))
                return self._lookup(request, num_computed_tokens, left)
            while end < usable and self._trusted(keys, end):  # stored since it ran
                end += 1
        # a worker may have reported a page bad while the lookup ran
        end = next((i for i in range(start, end) if self._distrusted(keys, i)), end)
        if handoff is not None and self._awaits(req_id, handoff, keys, max(start, end), usable):
            return None
        return self._settled(req_id, keys, start, max(start, end))

    def _handoff_of(self, request: RequestLike) -> _Handoff | None:
        """The pages a producer engine announced for ``request`` (its ``kv_transfer_params``
        carry :data:`HANDOFF_KEY`), from its first lookup on; None if none. A value that is
        not a non-negative int is logged, counted (``handoff_invalid``) and ignored."""
        req_id = request.request_id
        if req_id in self._handoffs:
            return self._handoffs[req_id]
        handoff = None
        params = getattr(request, "kv_transfer_params", None)
        if isinstance(params, Mapping) and HANDOFF_KEY in params:
            pages = params[HANDOFF_KEY]
            if type(pages) is not int or pages < 0:
                self.counters.add("handoff_invalid")
                level = logging.DEBUG if HANDOFF_KEY in self._warned else logging.WARNING
                self._warned.add(HANDOFF_KEY)
                log.log(
                    level,
                    "kvtier: request %s has kv_transfer_params %s=%r, not a page count; "
                    "served as if not handed off (counted as handoff_invalid)",
                    req_id,
                    HANDOFF_KEY,
                    pages,
                )
            elif pages and self._handoff_s > 0:
                handoff = _Handoff(pages, time.monotonic())
        self._handoffs[req_id] = handoff
        return handoff

    def _awaits(
        self, req_id: str, handoff: _Handoff, keys: list[list[str]], end: int, usable: int
    ) -> bool:
        """Whether a handed-off request waits ("ask again") for a page its producer
        announced that the lookup did not find (``end``, the first one): until it is
        found, reported bad (never waited for), or ``handoff_timeout_s`` passed since
        the request's first lookup (then the rest is recomputed; ``handoff_timeouts``)."""
        if end < min(handoff.pages, usable) and not self._distrusted(keys, end):
            now = time.monotonic()
            if now - handoff.since < self._handoff_s:
                if not handoff.waited:
                    handoff.waited = True
                    self.counters.add("handoff_waits")
                handoff.probe_after = now + HANDOFF_PROBE_S
                return True
            self.counters.add("handoff_timeouts")
        self._handoffs[req_id] = None  # settled: not waited for again
        return False

    def _begin(
        self, keys: list[list[str]], start: int, usable: int, *, early: bool = False
    ) -> _Lookup:
        """A lookup of pages ``start``..``usable``: those the workers reported stored are
        counted at once, the rest go to ``exists`` on a lookup thread (a future already
        done when memory answers it all)."""
        known = start
        while known < usable and self._trusted(keys, known):
            known += 1
        limit = next((i for i in range(known, usable) if self._distrusted(keys, i)), usable)
        now = time.monotonic()
        deadline = now + self._timeout_s
        if known >= limit:
            future: Future[int] = Future()
            future.set_result(0)
        else:
            future = self._submit(self._probe_names(keys, known, limit), deadline)
        return _Lookup(start, usable, known, future, deadline, early=early, started=now)

    def _settled(self, req_id: str, keys: list[list[str]], start: int, end: int) -> int | None:
        """The answer for pages ``start``..``end`` found stored, or None ("ask again") while
        a worker's load promotes one of them into a faster tier (at most until the
        promotion's bound): the load then reads it from there."""
        if self._promoting:
            now = time.monotonic()
            busy = any(
                self._promoting.get(chain[i], 0.0) > now
                for i in range(start, end)
                for chain in keys
            )
            if busy:
                if req_id not in self._promotion_waits:
                    self._promotion_waits.add(req_id)
                    self.counters.add("lookup_promoting")
                return None
        self._promotion_waits.discard(req_id)
        return self._answer(req_id, start, end - start)

    def _answer(self, req_id: str, start: int, hits: int, *, counted: bool = True) -> int:
        self._matched[req_id] = (start, hits)
        if counted:
            request = self._requests[req_id]
            usable = (len(request.all_token_ids) - 1) // self._page_size
            self.counters.add("lookup_requests")
            self.counters.add("lookup_pages", usable - start)
            self.counters.add("lookup_hit_pages", hits)
        return hits * self._page_size

    def after_alloc(self, request: RequestLike, block_ids: Any, num_external_tokens: int) -> None:
        """Plan the load of the pages vLLM accepted, into the request's blocks (one list
        of block ids per KV cache group, or one flat list for a single group)."""
        req_id = request.request_id
        default = (request.num_computed_tokens // self._page_size, 0)
        start, _ = self._matched.pop(req_id, default)
        pages = num_external_tokens // self._page_size
        self._done[req_id] = start + pages
        self._held_from[req_id] = start  # below it: vLLM's own hit, held only if known
        self._holes.pop(req_id, None)
        if pages <= 0:
            return
        keys = self._keyed(request, start + pages)
        if keys is None:  # pragma: no cover - an unkeyed request is never offered a hit
            return
        tables = per_group(block_ids, len(self.groups))
        planned = 0
        for group, (chain, blocks) in enumerate(zip(keys, tables, strict=True)):
            for lo, hi in _runs(list(range(start, start + pages)), blocks):
                self._pending_loads.append(
                    PageOp(req_id, chain[lo:hi], list(blocks[lo:hi]), lo, group)
                )
                planned += hi - lo
        self.counters.add("load_pages_planned", planned)
        self._sources[req_id] = self._sources_of(keys, start, start + pages)
        self._describe_pages(request, enumerate(keys), start, start + pages)
        if self.async_loads:
            self._loading.add(req_id)
            self.counters.add("load_requests_planned")

    # --- one step -----------------------------------------------------------------------

    def step(
        self,
        new: Iterable[tuple[str, Any, int]],
        cached: Iterable[tuple[str, Any, bool, int]],
        scheduled: dict[str, int],
        preempted: Iterable[str],
    ) -> StepWork:
        """This step's work: planned loads, and every full page computed by its end.

        ``new`` holds (request id, block ids, computed tokens) of newly scheduled requests;
        ``cached`` (request id, new block ids or None, resumed, computed tokens) of the
        others; ``scheduled`` the tokens each computes this step. Block ids are one list
        per KV cache group (or one flat list for a single group).
        """
        groups = len(self.groups)
        gone = sorted(preempted)
        for req_id in gone:  # its blocks are vLLM's again; a resumed request plans anew
            self._has_saves.discard(req_id)
            # its queued stores are dropped: what it planned is held only if known stored
            self._held_from[req_id] = self._done.get(req_id, 0)
        self.counters.add("requests_preempted", len(gone))
        work = StepWork(loads=self._pending_loads, preempted=gone)
        self._pending_loads = []
        self._step_keys = set()
        for req_id, blocks, computed in new:
            self._loading.discard(req_id)  # scheduled: its load (if any) has ended
            self._tables[req_id] = per_group(blocks, groups)
            self._plan_save(work, req_id, computed + scheduled.get(req_id, 0))
        for req_id, new_blocks, resumed, computed in cached:
            fresh = per_group(new_blocks, groups)
            if resumed:  # a preempted request back (after a load of its own, maybe)
                self._loading.discard(req_id)
                self._tables[req_id] = fresh
            elif new_blocks:
                tables = self._tables.setdefault(req_id, [[] for _ in range(groups)])
                for table, extra in zip(tables, fresh, strict=True):
                    table.extend(extra)
            self._plan_save(work, req_id, computed + scheduled.get(req_id, 0))
        return work

    def _plan_save(self, work: StepWork, req_id: str, computed: int) -> None:
        request = self._requests.get(req_id)
        if request is None or not self._saves_on or req_id in self._stale:
            return
        tables = self._tables.get(req_id) or [[] for _ in self.groups]
        rows = min(len(table) for table in tables)
        full = min(computed, len(request.all_token_ids), rows * self._page_size)
        full //= self._page_size
        done = self._done.get(req_id, 0)
        if full <= done:
            return
        keys = self._keyed(request, full)
        if keys is None:
            return
        self._done[req_id] = full
        planned = 0
        planning = self._step_keys
        for group, (chain, table) in enumerate(zip(keys, tables, strict=True)):
            # a page another request of this step stores too (a shared prefix computed
            # side by side) is stored once
            todo = [
                i
                for i in range(done, full)
                if chain[i] not in self._known and chain[i] not in planning
            ]
            planning.update(chain[i] for i in todo)
            hole = next((i for i in todo if table[i] == NULL_BLOCK), None)
            if hole is not None:  # never stored in this group
                self._holes[req_id] = min(hole, self._holes.get(req_id, hole))
            if todo:
                self._describe_pages(request, [(group, chain)], todo[0], todo[-1] + 1)
            for lo, hi in _runs(todo, table):
                work.saves.append(
                    PageOp(
                        req_id,
                        chain[lo:hi],
                        table[lo:hi],
                        lo,
                        group,
                        stage=self.groups[group].volatile,
                        parent=chain[lo - 1] if lo else None,
                    )
                )
                planned += hi - lo
        if planned:
            self._has_saves.add(req_id)
            self.counters.add("save_pages_planned", planned)

    def handoff(self, req_id: str) -> dict[str, Any] | None:
        """What a saving engine hands on with a finished request (vLLM's
        ``kv_transfer_params`` of its output): ``{"kvtier_pages": N}``, N the leading full
        pages of it this engine holds or is storing; None when there is none.

        Call it before :meth:`finished`. Conservative: a page counts if every rank
        reported it stored (and no tier was seen losing it), or if this request loaded it
        or planned its store since its last admission or preemption and no worker reported
        it bad; a store skipped (a null block) ends the count. A store the workers drop or
        fail in the request's last step is not known yet: the consumer's wait for it ends
        at its ``handoff_timeout_s``.
        """
        keys = self._keys.get(req_id)
        if not self._saves_on or not keys or req_id in self._stale or req_id in self._unkeyed:
            return None
        lo = self._held_from.get(req_id, 0)
        hi = min(self._done.get(req_id, 0), self._holes.get(req_id, len(keys[0])))
        held = 0
        while held < len(keys[0]) and (
            self._trusted(keys, held) or (lo <= held < hi and not self._distrusted(keys, held))
        ):
            held += 1
        if not held:
            return None
        self.counters.add("handoff_announced_pages", held)
        return {HANDOFF_KEY: held}

    def learn(self, report: Report) -> None:
        """The workers' report: pages stored by every rank, pages that failed to load, and
        their storage chains' events (what each tier now holds, or no longer)."""
        ledger = self._ledger
        for key, count in report.stored.items():
            total = self._confirming.pop(key, 0) + count
            if total < self._ranks:
                self._confirming.put(key, total)
                continue
            self._bad.pop(key)
            if ledger.held(key) is not False:  # not evicted since (its events came first)
                self._remember(key)
        for key in report.failed:
            self._known.pop(key, None)
            self._confirming.pop(key)
            self._bad.put(key)
        for req_id, first in report.failed_from.items():
            if req_id in self._done:
                self._done[req_id] = min(self._done[req_id], first)
        if report.promoting:
            now = time.monotonic()
            if len(self._promoting) > self._ledger.limit:
                self._promoting = {k: t for k, t in self._promoting.items() if t > now}
            until = now + self._timeout_s
            for key in report.promoting:
                self._promoting[key] = until
        for rank, held, tier, key in report.events:
            if held:  # a promotion landed (or the page was stored again): no more waiting
                self._promoting.pop(key, None)
            change = ledger.apply(rank, held, tier, key)
            if change is None:
                continue
            if self.events is not None:
                self.events.changed(key, tier, change)
            if change:  # stored or promoted whole: a verified copy, trusted again
                self._bad.pop(key)
                self._remember(key)
            elif key in self._known and not ledger.held(key):
                # no tier holds it any more: never promised from memory again
                del self._known[key]
                self.counters.add("known_forgotten")

    def take_events(self) -> list[tuple[str, dict[str, Any]]]:
        """vLLM's KV events of the tiers since the last call (see :class:`KVEventLog`);
        none unless vLLM publishes KV events."""
        return self.events.take() if self.events is not None else []

    def hit_sources(self, req_id: str, tokens: int) -> dict[str, int]:
        """The ``tokens`` of ``req_id``'s planned load by the tier they are read from
        (vLLM's ``CacheHitSource`` values); what the plan does not cover is unspecified."""
        sources = {k: v for k, v in self._sources.get(req_id, {}).items() if v}
        covered = sum(sources.values())
        if covered != tokens:
            if covered > tokens:
                return {UNSPECIFIED: tokens} if tokens else {}
            sources[UNSPECIFIED] = sources.get(UNSPECIFIED, 0) + tokens - covered
        return sources

    def reset(self) -> bool:
        """vLLM's ``reset_cache``: start a new key epoch, and forget what was learnt.

        Every request keyed from now on has keys no page stored before has (its first
        page's key folds in a fresh random token, and every later key chains on it), so
        nothing stored before the reset is served again, whatever a weight update did to
        the KV; nothing is deleted (on a shared store other engines still serve those
        pages rightly, and this engine's age out). Requests admitted before the reset load
        what was planned for them but store nothing more and hit nothing on a later
        lookup. vLLM is told the tiers no longer hold the pages it knew (``BlockRemoved``).
        """
        self._epoch = os.urandom(16)
        self._stale.update(self._requests)
        self._lookups.clear()
        if self.events is not None:
            for key, tier in list(self._ledger.whole()):
                self.events.changed(key, tier, False)
            self.events.forget()
        self._ledger.clear()
        self._promoting.clear()
        self._known.clear()
        self._confirming.items.clear()
        self._bad.items.clear()
        self.counters.add("resets")
        return True

    def loads_ended(self, req_ids: Iterable[str]) -> None:
        """The workers report these requests' loads ended (vLLM's ``finished_recving``)."""
        self._loading.difference_update(req_ids)

    def finished(self, req_id: str) -> bool:
        """Forget a finished request; True if its blocks must wait for its stores.

        A request aborted while its load runs is not held here: vLLM keeps its blocks
        until the load is reported ended, and then frees them itself.
        """
        for table in (
            self._requests,
            self._keyer_of,
            self._keys,
            self._matched,
            self._tables,
            self._done,
            self._lookups,
            self._sources,
            self._held_from,
            self._holes,
            self._handoffs,
        ):
            table.pop(req_id, None)
        self._unkeyed.discard(req_id)
        self._stale.discard(req_id)
        self._promotion_waits.discard(req_id)
        delay = req_id in self._has_saves and req_id not in self._loading
        self._has_saves.discard(req_id)
        self._loading.discard(req_id)
        return delay

    def stats(self) -> dict[str, Any]:
        """Cumulative counters."""
        stats: dict[str, Any] = zeroed("vllm_scheduler")
        stats.update(self.counters.snapshot())
        return stats

    def close(self) -> None:
        """Stop the lookup threads and close the page store. Idempotent."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        self.store.close()


def _kind(plan: ResolvedPlan) -> Any:
    return "mla" if plan.geometry.attention is AttentionKind.MLA else "full"
