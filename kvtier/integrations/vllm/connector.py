"""``KvtierConnector``: vLLM's KV-connector API (``KVConnectorBase_V1``) on any kvtier backend.

vLLM builds one connector in its scheduler (``KVConnectorRole.SCHEDULER``) and one in each
worker (``KVConnectorRole.WORKER``). Both resolve the ``kvtier`` section through kvtier's
one construction path (:func:`.plan.resolve_plan`, then the storage chain's
:func:`~kvtier.storage.open_store`: one page store per tier), so every configuration
mistake stops the engine at start-up with kvtier's error. This module is the glue to vLLM's classes;
the scheduler's logic lives in :mod:`.scheduler`, the worker's in :mod:`.worker`.

Scheduler: :meth:`get_num_new_matched_tokens` counts the stored pages beyond vLLM's own
prefix-cache hit (answering "ask again" while the backend's ``exists`` runs off the
scheduler thread) and, on vLLM's CPU engine, has them loaded asynchronously;
:meth:`update_state_after_alloc` plans their load;
:meth:`build_connector_meta` hands the workers the step's loads and stores;
:meth:`update_connector_output` learns what the workers stored and failed to load;
:meth:`request_finished` (:meth:`request_finished_all_groups` under vLLM's hybrid
allocator, ``SupportsHMA``) keeps a request's blocks until its pages are stored and, on
a saving engine, hands on how many leading pages it holds (``kv_transfer_params``
``kvtier_pages``), which a consumer engine's lookup waits for.

The tiers the router can see: the workers report their storage chains' events (stored,
promoted, evicted, removed, per tier); :meth:`take_events` hands them to vLLM's KV event
publisher as ``BlockStored`` / ``BlockRemoved`` under vLLM's own block hashes, with
``medium`` naming kvtier's tier; :meth:`get_external_cache_hit_sources` says which tier a
hit is read from; :meth:`build_prom_metrics` registers kvtier's counters with vLLM's
Prometheus metrics; :meth:`reset_cache` starts a new key epoch.

Worker: the strategy follows vLLM's device, and :meth:`register_kv_caches` checks that
the KV tensors vLLM hands over fit it: vLLM's CPU blocks in host memory become kvtier
pages in place (:mod:`.worker`); KV caches on an accelerator become kvtier's device pool
under a ``TieredCache`` (:mod:`.device_worker`), loaded per layer in
:meth:`wait_for_layer_load` and backed up per layer in :meth:`save_kv_layer`.
:meth:`start_load_kv` starts the step's loads and :meth:`wait_for_save` ends the step's
stores; :meth:`get_transfer_results` reports the requests whose loads ended (failed ones
too, per request where vLLM wants it so) and those whose stores are done;
:meth:`get_block_ids_with_load_errors` hands vLLM the blocks to recompute in the same
pass. Counters reach vLLM's metrics through :meth:`get_kv_connector_stats`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvtier.core.capabilities import ResolvedPlan
from kvtier.core.errors import KvtierError
from kvtier.core.metrics import vllm_metrics
from kvtier.integrations.vllm.device_worker import DeviceWorkerSide
from kvtier.integrations.vllm.events import BlockInfo, Describer, event_locality, tier_medium
from kvtier.integrations.vllm.messages import Report, StepWork
from kvtier.integrations.vllm.plan import KVGroup, kv_groups, plan_strategy, resolve_plan
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.settings import SECTION, VLLMSection, read_section
from kvtier.integrations.vllm.worker import WorkerSide, header_verify_refused
from kvtier.plugins.manager import default_registry
from kvtier.storage import open_lookup

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
        KVConnectorWorkerMetadata,
        SupportsHMA,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
except ImportError as exc:  # pragma: no cover - exercised only without vLLM
    raise ImportError(
        "kvtier.integrations.vllm.KvtierConnector needs vLLM's KV-connector API "
        f"(vllm.distributed.kv_transfer.kv_connector.v1), which failed to import: {exc}. "
        "Install the extra with `pip install 'kvtier[vllm]'` in your vLLM environment"
    ) from exc

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "KvtierConnector",
    "KvtierConnectorMetadata",
    "KvtierConnectorStats",
    "KvtierPromMetrics",
    "KvtierWorkerMetadata",
]

log = logging.getLogger("kvtier.vllm")


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's work, from the scheduler to every worker."""

    work: StepWork = field(default_factory=StepWork)


@dataclass
class KvtierWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """One worker's report, summed over the workers by vLLM."""

    report: Report = field(default_factory=Report)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KvtierWorkerMetadata:
        """The sum of two workers' reports (a page is stored once every rank stored it)."""
        if not isinstance(other, KvtierWorkerMetadata):
            return self
        return KvtierWorkerMetadata(self.report.merged(other.report))


@dataclass
class KvtierConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """kvtier's counters since the last report, summed over ranks and intervals."""

    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> KvtierConnectorStats:
        merged = dict(self.data)
        for key, value in (other.data or {}).items():
            if isinstance(value, (int, float)):
                merged[key] = merged.get(key, 0) + value
        return KvtierConnectorStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        return {key: value for key, value in sorted(self.data.items()) if value}

    def is_empty(self) -> bool:
        return not any(self.data.values())


#: The prefix of kvtier's series in vLLM's Prometheus metrics (``vllm:kvtier_load_hit_pages``).
PROM_PREFIX = "vllm:"
_PROM_NAME = re.compile(r"kvtier_[a-z0-9_]+")


class KvtierPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """kvtier's counters as vLLM Prometheus counters, one series per counter and engine.

    vLLM hands :meth:`observe` what :meth:`KvtierConnector.get_kv_connector_stats`
    reported (summed over the workers and the scheduler): the counters' growth since the
    last report, so each adds to a counter ``vllm:kvtier_<name>`` (exposed with the
    ``_total`` suffix) labelled as vLLM labels its own (model name, engine). The counters
    are generated from kvtier's registry (:func:`kvtier.core.metrics.vllm_metrics`) and
    created at start-up; a reported name that is not declared there (a rate, a gauge, a
    backend's own number) is left out, never made a counter on first sight.
    """

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, Any] = {}
        for name, documentation in vllm_metrics().items():
            self._counter(name, documentation)

    def _counter(self, name: str, documentation: str) -> Any:
        """The counter of ``name`` (None for a name whose series another one already has:
        Prometheus strips a ``_total`` suffix, so ``x`` and ``x_total`` are one series)."""
        if name in self.counters:
            return self.counters[name]
        try:
            counter = self._counter_cls(
                name=PROM_PREFIX + name,
                documentation=documentation,
                labelnames=self._labelnames,
            )
        except ValueError as exc:  # a duplicated series: counted once, under the first
            log.warning("kvtier: %s is not exposed to Prometheus: %s", name, exc)
            counter = None
        self.counters[name] = counter
        return counter

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues.get(engine_idx)
        if labels is None:
            return
        for name, value in (transfer_stats_data or {}).items():
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or value <= 0
                or not _PROM_NAME.fullmatch(name)
            ):
                continue  # a counter never decreases; a name vLLM cannot carry is left out
            counter = self.counters.get(name)  # only declared counters (created above)
            if counter is not None:
                counter.labels(*labels).inc(value)


def _describer(page_size: int, hash_block_size: int) -> Describer:
    """What vLLM's own ``BlockStored`` says of a request's blocks (its block hashes at
    ``page_size`` tokens a block, as vLLM publishes them; parent, tokens, LoRA and extra
    keys), for kvtier's KV events of the same blocks."""
    from vllm.v1.core.kv_cache_utils import (
        generate_block_hash_extra_keys,
        maybe_convert_block_hash,
        resolve_block_hashes,
        to_event_extra_keys,
    )

    def describe(request: Any, lo: int, hi: int) -> Sequence[BlockInfo]:
        hashes = resolve_block_hashes(request.block_hashes, hash_block_size, page_size)
        lora = getattr(request, "lora_request", None)
        lora_id = lora.adapter_id if lora is not None else None
        lora_name = lora.name if lora is not None else None
        tokens = request.all_token_ids
        out: list[BlockInfo] = []
        for i in range(lo, min(hi, len(hashes))):
            start, end = i * page_size, (i + 1) * page_size
            extra, _ = generate_block_hash_extra_keys(request, start, end, 0)
            untagged = to_event_extra_keys([extra]) if extra else None
            out.append(
                BlockInfo(
                    maybe_convert_block_hash(hashes[i]),
                    maybe_convert_block_hash(hashes[i - 1]) if i > 0 else None,
                    tuple(tokens[start:end]),
                    lora_id,
                    lora_name,
                    untagged[0] if untagged else None,
                )
            )
        return out

    return describe


def _kv_events_on(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV cache events (``--kv-events-config``)."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(getattr(config, "enable_kv_cache_events", False))


def _tp_rank(role: KVConnectorRole) -> int:
    if role is KVConnectorRole.SCHEDULER:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _layer_index(names: list[str]) -> dict[str, int]:
    """vLLM's layer index of each KV cache name, or {} when a name has none."""
    try:
        from vllm.model_executor.models.utils import extract_layer_index

        return {name: int(extract_layer_index(name)) for name in names}
    except (ImportError, ValueError, AssertionError):  # no index in a name: vLLM's order
        return {}


#: The layout the accelerator path needs (a block's tokens evenly spaced, token-major).
DEVICE_KV_LAYOUT = "NHD"
#: In a step without a forward (only loads in flight, or finished requests' stores), how
#: long the worker waits for a load to end, or a finished request's stores, before
#: answering vLLM: the engine has nothing else to do, and an answer now saves it
#: spinning through empty steps (each one holding the interpreter lock the writer needs).
IDLE_LOAD_WAIT_S = 0.01
_LAYER_OPERATIONS = {"load_layer", "backup_layer"}


def _section_of(extra_config: Any) -> dict[str, Any]:
    """The ``kvtier`` section as far as it parses (for vLLM's class-level hooks, which run
    before the connector is built; a section that does not parse fails at start-up)."""
    section = (extra_config or {}).get(SECTION) if isinstance(extra_config, dict) else None
    if isinstance(section, str) and not section.startswith("@"):
        try:
            section = json.loads(section)
        except ValueError:
            return {}
    return section if isinstance(section, dict) else {}


class KvtierConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """vLLM KV connector on a kvtier storage backend (file, uring, mooncake, plugins)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        registry = default_registry()
        try:
            self.settings: VLLMSection = read_section(
                transfer.kv_connector_extra_config, registry.backends
            )
            self.plan: ResolvedPlan = resolve_plan(
                vllm_config, kv_cache_config, self.settings, registry, tp_rank=_tp_rank(role)
            )
            if plan_strategy(self.plan) != "device":  # both roles refuse it at start-up
                refused = header_verify_refused(self.plan.config.verify)
                if refused is not None:
                    raise refused
            #: vLLM's KV cache groups (several under its hybrid allocator).
            self.groups: list[KVGroup] = kv_groups(kv_cache_config)
            self.scheduler: SchedulerSide | None = None
            #: By vLLM's device; register_kv_caches checks the tensors it hands over agree.
            self.worker: WorkerSide | DeviceWorkerSide | None = None
            groups = len(self.groups)
            if role is KVConnectorRole.SCHEDULER:
                # every tier's exists; the scheduler never reads or writes a page
                store = open_lookup(self.plan, **self.settings.page_store_options())
                self._events_on = _kv_events_on(vllm_config)
                #: vLLM's ``locality`` of each tier's events, by medium
                self._localities = {
                    tier_medium(tier): event_locality(tier) for tier in self.plan.storage_tiers()
                }
                self.scheduler = SchedulerSide(
                    self.plan,
                    self.settings,
                    store,
                    loads=bool(transfer.is_kv_consumer),
                    saves=bool(transfer.is_kv_producer),
                    groups=self.groups,
                    describe=self._describe if self._events_on else None,
                )
            elif plan_strategy(self.plan) == "device":
                self.worker = DeviceWorkerSide(
                    self.plan, self.settings, groups=groups, kv_groups=self.groups
                )
            else:
                self.worker = WorkerSide(self.plan, self.settings, groups=groups)
        except KvtierError as exc:
            log.error("kvtier: vLLM KV connector configuration refused: %s", exc)
            raise
        self._reported: dict[str, Any] = {}
        self._idle_step = False
        #: vLLM's ``hash_block_size`` (the scheduler's block pool says it; default the page)
        self._hash_block_size = int(self.plan.geometry.page_size)
        self._describer: Describer | None = None
        log.info(
            "kvtier: vLLM %s connector on backend %r, %s, namespace %s, verify %s",
            "scheduler" if self.scheduler is not None else "worker",
            self.plan.backend.name,
            self.plan.geometry.describe(),
            self.plan.context.namespace,
            self.plan.config.verify,
        )

    def _side(self) -> SchedulerSide:
        assert self.scheduler is not None, "a scheduler-side call on a worker connector"
        return self.scheduler

    def _worker(self) -> WorkerSide | DeviceWorkerSide:
        assert self.worker is not None, "a worker-side call on the scheduler's connector"
        return self.worker

    # --- scheduler side ---------------------------------------------------------------

    def _describe(self, request: Any, lo: int, hi: int) -> Sequence[BlockInfo]:
        """vLLM's description of a request's blocks ``lo``..``hi`` (for KV events)."""
        if self._describer is None:
            self._describer = _describer(int(self.plan.geometry.page_size), self._hash_block_size)
        return self._describer(request, lo, hi)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        """Learn the block size vLLM hashes requests' blocks at (its router knows blocks by
        those hashes; kvtier's KV events name its pages by them)."""
        super().bind_gpu_block_pool(gpu_block_pool)
        size = getattr(gpu_block_pool, "hash_block_size", None)
        if isinstance(size, int) and size > 0:
            self._hash_block_size = size
            self._describer = None

    def on_new_request(self, request: Request) -> None:
        """Remember the request: its token ids key its pages until it finishes."""
        self._side().add_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens kvtier holds beyond vLLM's own hit, and whether they load asynchronously
        (vLLM's CPU engine: between steps); None while the lookup runs ("ask again")."""
        side = self._side()
        tokens = side.lookup(request, num_computed_tokens)
        if tokens is None:
            return None, False
        return tokens, bool(tokens) and side.async_loads

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Plan the load of the accepted pages into the request's blocks (every group's)."""
        block_ids = blocks.get_block_ids() if num_external_tokens > 0 else ()
        self._side().after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvtierConnectorMetadata:
        """This step's loads, and every full page computed by the end of this step."""
        cached = scheduler_output.scheduled_cached_reqs
        work = self._side().step(
            new=(
                (new.req_id, new.block_ids, new.num_computed_tokens)
                for new in scheduler_output.scheduled_new_reqs
            ),
            cached=(
                (
                    req_id,
                    blocks,
                    req_id in cached.resumed_req_ids,
                    cached.num_computed_tokens[i],
                )
                for i, (req_id, blocks) in enumerate(
                    zip(cached.req_ids, cached.new_block_ids, strict=True)
                )
            ),
            scheduled=scheduler_output.num_scheduled_tokens,
            preempted=scheduler_output.preempted_req_ids or (),
        )
        return KvtierConnectorMetadata(work)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Learn which pages the workers stored and which failed to load, and which
        requests' loads ended."""
        side = self._side()
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KvtierWorkerMetadata):
            side.learn(meta.report)
        side.loads_ended(getattr(connector_output, "finished_recving", None) or ())

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Free the blocks now, or once the workers stored this request's pages; a saving
        engine hands on ``{"kvtier_pages": N}`` (the request output's
        ``kv_transfer_params``) for a consumer engine to wait for (docs/vllm.md, prefill
        and decode through the store)."""
        return self._finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """:meth:`request_finished` under vLLM's hybrid allocator (every group's blocks)."""
        return self._finished(request)

    def _finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        side = self._side()
        params = side.handoff(request.request_id)
        return side.finished(request.request_id), params

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """The request's kvtier hit by the tier a load reads it from: ``disk`` (file,
        uring, segment), ``host`` (the memory backend), ``external_unspecified`` (a store
        other hosts share, or a page of a chain no event has placed yet)."""
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        if num_external_tokens <= 0:
            return {}
        sources = self._side().hit_sources(request.request_id, num_external_tokens)
        return {CacheHitSource(name): tokens for name, tokens in sources.items()}

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The tiers' page events since the last call, as vLLM's ``BlockStored`` /
        ``BlockRemoved`` (``medium`` ``KVTIER:<index>:<backend>``); vLLM's scheduler
        publishes them with its own. None unless vLLM publishes KV events."""
        if self.scheduler is None:
            return ()
        rows = self.scheduler.take_events()
        if not rows:
            return ()
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        classes = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved}
        if "locality" in getattr(BlockStored, "__struct_fields__", ()):  # vLLM >= 0.32
            for _, fields in rows:
                fields["locality"] = self._localities.get(fields["medium"])
        return [classes[kind](**fields) for kind, fields in rows]

    def reset_cache(self) -> bool | None:
        """vLLM's connector reset (``reset_prefix_cache(reset_connector=True)``, as after a
        weight update): a new key epoch, so nothing stored before is served again; nothing
        is deleted (see :meth:`SchedulerSide.reset`). None on a worker."""
        if self.scheduler is None:
            return None
        done = self.scheduler.reset()
        log.info("kvtier: connector cache reset: a new key epoch; stored pages are kept")
        return done

    # --- worker side ------------------------------------------------------------------

    def _work(self) -> StepWork:
        meta = self._get_connector_metadata()
        return meta.work if isinstance(meta, KvtierConnectorMetadata) else StepWork()

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No (vLLM 0.33 asks; 0.32 never does): kvtier keeps views of the device KV cache,
        taken once at :meth:`register_kv_caches`, which sleep mode frees and remaps. vLLM
        then refuses sleep mode with this connector at start-up, rather than let a load
        or a save reach memory that moved."""
        return False

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take vLLM's KV tensors as kvtier pages; refuse a layout kvtier cannot store."""
        config = self._kv_cache_config
        try:
            self._worker().register(
                kv_caches, _layer_index(list(kv_caches)), int(config.num_blocks)
            )
        except KvtierError as exc:
            log.error("kvtier: vLLM KV cache refused: %s", exc)
            raise

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start reading this step's pages into their vLLM blocks (CPU: asynchronously,
        for requests vLLM holds until :meth:`get_transfer_results` reports them)."""
        #: A step without a forward: the engine has only loads to wait for.
        self._idle_step = getattr(forward_context, "attn_metadata", None) is None
        self._worker().start_loads(self._work().loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Accelerator: block until this layer of the step's pages is in place. CPU:
        nothing, the loads are asynchronous and no running request waits for one."""
        worker = self._worker()
        if isinstance(worker, DeviceWorkerSide):
            worker.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Accelerator: back this layer up. CPU: nothing, a page is stored whole at the end."""
        worker = self._worker()
        if isinstance(worker, DeviceWorkerSide):
            worker.save_layer(layer_name, self._work().saves)

    def wait_for_save(self) -> None:
        """End the step's stores; the copies and writes run while the model does."""
        worker = self._worker()
        if isinstance(worker, DeviceWorkerSide):
            worker.end_step(self._work().saves)
            return
        worker.submit_saves(self._work().saves)
        worker.step_ended()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before a model step: finish (bounded) or drop the stores of preempted requests
        before vLLM reuses their blocks."""
        worker = self._worker()
        if isinstance(worker, WorkerSide):
            worker.step_began()
        if isinstance(kv_connector_metadata, KvtierConnectorMetadata):
            worker.preempted(kv_connector_metadata.work.preempted)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Requests whose loads ended (failed ones too, and those vLLM should take as
        failed per request), and finished requests whose stores are done."""
        worker = self._worker()
        ended: set[str] = set()
        failed: set[str] = set()
        if not isinstance(worker, WorkerSide):
            sending = worker.finished(finished_req_ids)
            if worker.async_loads:
                idle, self._idle_step = self._idle_step, False
                ended, failed = worker.poll_loads(IDLE_LOAD_WAIT_S if idle else 0.0)
        else:
            idle, self._idle_step = self._idle_step, False
            # an idle step waits for what it waits on: a load if one runs, else stores
            wait = IDLE_LOAD_WAIT_S if idle else 0.0
            sending = worker.finished(finished_req_ids, 0.0 if worker.loading else wait)
            ended, failed = worker.poll_loads(wait if not sending else 0.0)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=ended, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """:meth:`get_transfer_results` as (stores done, loads ended), for older callers."""
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose page was missing or failed verification: vLLM recomputes them.

        CPU: those of the loads :meth:`get_transfer_results` reported this pass (or
        earlier); never waits. Accelerator: the step's loads, settled."""
        worker = self._worker()
        if isinstance(worker, WorkerSide):
            return worker.pop_load_errors()
        return worker.take_load_errors()

    def get_kv_connector_kv_cache_events(self) -> None:
        """None: a worker's tier events reach the scheduler in its worker metadata
        (:meth:`build_connector_worker_meta`), where vLLM's block hashes are known, and
        vLLM publishes them from :meth:`take_events`."""
        return None

    def build_connector_worker_meta(self) -> KvtierWorkerMetadata | None:
        """What this rank stored and failed to load since the last step, and its storage
        chain's events."""
        report = self._worker().take_report()
        return KvtierWorkerMetadata(report) if report else None

    # --- both sides -------------------------------------------------------------------

    def kvtier_stats(self) -> dict[str, Any]:
        """Cumulative counters of this side (the worker's include the page store's)."""
        if self.scheduler is not None:
            return self.scheduler.stats()
        return self._worker().stats()

    def prometheus_collector(self) -> Any:
        """A worker's prometheus_client collector of its storage tier (``kvtier_*`` families,
        as a TieredCache's; docs/operating.md). Register it with the worker's registry."""
        return self._worker().prometheus_collector()

    def get_kv_connector_stats(self) -> KvtierConnectorStats | None:
        """kvtier's counters since the last call, for vLLM's metrics (``kvtier_*``)."""
        now = self.kvtier_stats()
        delta = {
            f"kvtier_{k}": v - self._reported.get(k, 0)
            for k, v in now.items()
            if isinstance(v, (int, float)) and v != self._reported.get(k, 0)
        }
        self._reported = now
        return KvtierConnectorStats(data=delta) if delta else None

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvtierPromMetrics:
        """kvtier's counters as vLLM Prometheus counters (``vllm:kvtier_<name>_total``)."""
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KvtierConnectorStats | None:
        """vLLM's hook to rebuild the stats object from its aggregated data."""
        return KvtierConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        """Finish queued stores, then close the backend. Idempotent."""
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.close()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """``NHD`` on an accelerator: the device path views a block's tokens as evenly
        spaced slots, which the head-major layout breaks. None on vLLM's CPU engine."""
        device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu")
        return None if str(device or "cpu") == "cpu" else DEVICE_KV_LAYOUT

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True with per-layer loads or backups (the accelerator path's default): those
        run in ``wait_for_layer_load`` / ``save_kv_layer``, which a full CUDA graph skips."""
        operations = _section_of(extra_config).get("operations", _LAYER_OPERATIONS)
        return bool(set(operations or ()) & _LAYER_OPERATIONS)

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache, not a hand-off: a store lost to preemption is only a later miss."""
        return False
