"""The scheduler side of kvtier's vLLM connector: prefix hits, and what the workers do.

:class:`SchedulerSide` keys each request's full blocks with the plan's keyer (chained over
token ids, in the request's tenant namespace), counts how many blocks beyond vLLM's own
hit are stored, plans their loads into the blocks vLLM allocates, plans the store of every
newly computed full block, and learns from the workers' reports which pages are stored
and which failed to load. It reads a request through the attributes vLLM's ``Request``
has (``request_id``, ``all_token_ids``, ``num_computed_tokens``, ``cache_salt``, and what
else changes its KV: ``lora_request``, ``mm_features``, ``prompt_embeds``, see
:mod:`.inputs`) and imports nothing from vLLM, so it is tested without an engine too.
A request with an input that cannot be keyed is kept away from kvtier: no hit, no store.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from kvtier.core.capabilities import ResolvedPlan
from kvtier.core.errors import StorageError, UnkeyableInputError
from kvtier.core.extents import Extent
from kvtier.core.keys import PageKeyer, layout_namespace, rank_suffix
from kvtier.core.layout import Layout
from kvtier.core.metrics import zeroed
from kvtier.core.pagestore import PageStore
from kvtier.core.storage import Counters
from kvtier.integrations.vllm.inputs import AdapterIdentities, page_extras
from kvtier.integrations.vllm.messages import PageOp, Report, StepWork
from kvtier.integrations.vllm.settings import VLLMSection, tenant_of

__all__ = ["NoPages", "RequestLike", "SchedulerSide", "TenantKeyers"]

log = logging.getLogger("kvtier.vllm")


class NoPages:
    """The scheduler's page memory: it asks ``exists`` only and never moves a page."""

    def __init__(self, layout: Layout) -> None:
        self._layout = layout

    @property
    def layout(self) -> Layout:
        return self._layout

    def extents(self, page: int) -> list[Extent]:
        raise StorageError(
            f"the scheduler-side kvtier connector holds no KV pages (page {page} asked); "
            "loads and stores run in the workers",
            value=page,
        )

    def header_extent(self, page: int) -> Extent:
        return self.extents(page)[0]

    def page_buffers(self, page: int) -> list[Extent]:
        return self.extents(page)


class RequestLike(Protocol):
    """What the scheduler side reads of vLLM's ``Request``."""

    request_id: str
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> Sequence[int]: ...


class TenantKeyers:
    """The plan's page keyer per tenant and adapter: the section's tenant plus a request's
    cache salt, and the request's LoRA adapter identity (see :mod:`.inputs`).

    Keys are base keys (no rank suffix); each worker appends its own rank's suffix.
    """

    def __init__(self, plan: ResolvedPlan, tenant: str | None) -> None:
        self._plan = plan
        self._tenant = tenant
        self._keyers: dict[tuple[str | None, str | None], PageKeyer] = {}

    def __call__(self, cache_salt: str | None, adapter: str | None = None) -> PageKeyer:
        keyer = self._keyers.get((cache_salt, adapter))
        if keyer is None:
            plan = self._plan
            namespace = plan.namespace
            if cache_salt is not None or adapter is not None:
                model = plan.config.model
                if adapter is not None:
                    model = f"{model}|lora={adapter}"
                namespace = layout_namespace(
                    model,
                    plan.layout,
                    plan.geometry.fingerprint,
                    tenant_of(self._tenant, cache_salt),
                )
            keyer = self._keyers[(cache_salt, adapter)] = PageKeyer(
                namespace, plan.geometry.page_size, plan.geometry.attention
            )
        return keyer


class SchedulerSide:
    """Prefix hits and per-step work of one vLLM scheduler (see the module docstring)."""

    def __init__(
        self,
        plan: ResolvedPlan,
        settings: VLLMSection,
        store: PageStore,
        *,
        loads: bool = True,
        saves: bool = True,
    ) -> None:
        self.plan = plan
        self.store = store
        self.keyers = TenantKeyers(plan, settings.tenant)
        self._loads_on = loads
        self._saves_on = saves
        self._limit = settings.known_keys
        self._ranks = int(plan.context.tp_size)
        self._page_size = plan.geometry.page_size
        #: Stored pages every rank reported, oldest first (bounded by ``known_keys``),
        #: and those some ranks reported so far.
        self._known: OrderedDict[str, None] = OrderedDict()
        self._confirming: dict[str, int] = {}
        #: Pages that failed to load: the backend's ``exists`` is not trusted for them
        #: until a worker stores them again.
        self._bad: set[str] = set()
        self._suffix0 = rank_suffix(plan.geometry.attention, 0, self._ranks)
        self.counters = Counters()
        self._adapters = AdapterIdentities()
        self._requests: dict[str, RequestLike] = {}
        self._keyer_of: dict[str, PageKeyer] = {}
        #: Requests with an input that cannot be keyed: never loaded or stored.
        self._unkeyed: set[str] = set()
        self._warned: set[str] = set()
        self._keys: dict[str, list[str]] = {}
        self._matched: dict[str, tuple[int, int]] = {}
        self._tables: dict[str, list[int]] = {}
        self._done: dict[str, int] = {}
        self._has_saves: set[str] = set()
        self._pending_loads: list[PageOp] = []

    # --- keys and hits ------------------------------------------------------------------

    def request_keys(self, request: RequestLike, pages: int) -> list[str]:
        """The base keys of ``request``'s first ``pages`` full pages (cached, extended).

        Raises :class:`UnkeyableInputError` for a request with an input that changes its
        KV but cannot be keyed (an adapter without local files, say).
        """
        keys = self._keys.setdefault(request.request_id, [])
        if len(keys) < pages:
            ps = self._page_size
            first = len(keys)
            tokens = list(request.all_token_ids[first * ps : pages * ps])
            extras = page_extras(request, first, pages, ps)
            keys.extend(
                self._keyer(request).keys(tokens, parent=keys[-1] if keys else None, extras=extras)
            )
        return keys[:pages]

    def _keyer(self, request: RequestLike) -> PageKeyer:
        """The keyer of ``request``'s namespace: its cache salt and adapter (kept)."""
        keyer = self._keyer_of.get(request.request_id)
        if keyer is None:
            adapter = self._adapters(getattr(request, "lora_request", None))
            keyer = self.keyers(getattr(request, "cache_salt", None), adapter)
            self._keyer_of[request.request_id] = keyer
        return keyer

    def _keyed(self, request: RequestLike, pages: int) -> list[str] | None:
        """:meth:`request_keys`, or None (the request refused, counted, logged once per
        reason) when an input of it cannot be keyed."""
        if request.request_id in self._unkeyed:
            return None
        try:
            return self.request_keys(request, pages)
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

    def stored_prefix(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are stored: known from the workers, else the backend."""
        count = 0
        while count < len(keys) and keys[count] in self._known:
            count += 1
        rest = keys[count:]
        if not rest:
            return count
        found = self.store.exists([key + self._suffix0 for key in rest])
        for key, stored in zip(rest, found, strict=True):
            if not (key in self._known or (stored and key not in self._bad)):
                break
            count += 1
        return count

    def add_request(self, request: RequestLike) -> None:
        """Remember ``request``: its token ids key its pages until it finishes."""
        self._requests[request.request_id] = request

    def matched_tokens(self, request: RequestLike, num_computed_tokens: int) -> int:
        """Tokens kvtier holds beyond vLLM's own hit: whole stored pages, one token left."""
        self._requests.setdefault(request.request_id, request)
        ps = self._page_size
        start = num_computed_tokens // ps
        usable = (len(request.all_token_ids) - 1) // ps
        if not self._loads_on or usable <= start:
            self._matched[request.request_id] = (start, 0)
            return 0
        keys = self._keyed(request, usable)
        if keys is None:
            self._matched[request.request_id] = (start, 0)
            return 0
        hits = self.stored_prefix(keys[start:])
        self._matched[request.request_id] = (start, hits)
        self.counters.add("lookup_requests")
        self.counters.add("lookup_pages", usable - start)
        self.counters.add("lookup_hit_pages", hits)
        return hits * ps

    def after_alloc(
        self, request: RequestLike, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Plan the load of the pages vLLM accepted, into the request's blocks."""
        req_id = request.request_id
        default = (request.num_computed_tokens // self._page_size, 0)
        start, _ = self._matched.pop(req_id, default)
        pages = num_external_tokens // self._page_size
        self._done[req_id] = start + pages
        if pages <= 0:
            return
        keys = self.request_keys(request, start + pages)[start:]
        self._pending_loads.append(
            PageOp(req_id, keys, list(block_ids[start : start + pages]), start)
        )
        self.counters.add("load_pages_planned", pages)

    # --- one step -----------------------------------------------------------------------

    def step(
        self,
        new: Iterable[tuple[str, Sequence[int], int]],
        cached: Iterable[tuple[str, Sequence[int] | None, bool, int]],
        scheduled: dict[str, int],
        preempted: Iterable[str],
    ) -> StepWork:
        """This step's work: planned loads, and every full page computed by its end.

        ``new`` holds (request id, block ids, computed tokens) of newly scheduled requests;
        ``cached`` (request id, new block ids or None, resumed, computed tokens) of the
        others; ``scheduled`` the tokens each computes this step.
        """
        work = StepWork(loads=self._pending_loads, preempted=sorted(preempted))
        self._pending_loads = []
        for req_id, blocks, computed in new:
            self._tables[req_id] = list(blocks)
            self._plan_save(work, req_id, computed + scheduled.get(req_id, 0))
        for req_id, new_blocks, resumed, computed in cached:
            if resumed:
                self._tables[req_id] = list(new_blocks or ())
            elif new_blocks:
                self._tables.setdefault(req_id, []).extend(new_blocks)
            self._plan_save(work, req_id, computed + scheduled.get(req_id, 0))
        return work

    def _plan_save(self, work: StepWork, req_id: str, computed: int) -> None:
        request = self._requests.get(req_id)
        if request is None or not self._saves_on:
            return
        table = self._tables.get(req_id, [])
        full = min(computed, len(request.all_token_ids), len(table) * self._page_size)
        full //= self._page_size
        done = self._done.get(req_id, 0)
        if full <= done:
            return
        keys = self._keyed(request, full)
        if keys is None:
            return
        self._done[req_id] = full
        todo = zip(keys[done:full], table[done:full], strict=True)
        pairs = [(k, b) for k, b in todo if k not in self._known]
        if pairs:
            work.saves.append(PageOp(req_id, [k for k, _ in pairs], [b for _, b in pairs], done))
            self._has_saves.add(req_id)
            self.counters.add("save_pages_planned", len(pairs))

    def learn(self, report: Report) -> None:
        """The workers' report: pages stored by every rank, pages that failed to load."""
        for key, count in report.stored.items():
            total = self._confirming.pop(key, 0) + count
            if total < self._ranks:
                self._confirming[key] = total
                continue
            self._bad.discard(key)
            if self._limit:
                self._known[key] = None
                self._known.move_to_end(key)
        while len(self._known) > self._limit:
            self._known.popitem(last=False)
        for key in report.failed:
            self._known.pop(key, None)
            self._confirming.pop(key, None)
            self._bad.add(key)
        for req_id, first in report.failed_from.items():
            if req_id in self._done:
                self._done[req_id] = min(self._done[req_id], first)

    def finished(self, req_id: str) -> bool:
        """Forget a finished request; True if its blocks must wait for its stores."""
        for table in (
            self._requests,
            self._keyer_of,
            self._keys,
            self._matched,
            self._tables,
            self._done,
        ):
            table.pop(req_id, None)
        self._unkeyed.discard(req_id)
        delay = req_id in self._has_saves
        self._has_saves.discard(req_id)
        return delay

    def stats(self) -> dict[str, Any]:
        """Cumulative counters."""
        stats: dict[str, Any] = zeroed("vllm_scheduler")
        stats.update(self.counters.snapshot())
        return stats
