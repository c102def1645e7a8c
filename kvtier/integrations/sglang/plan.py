"""SGLang's storage config and host pools turned into kvtier plans and storage chains.

The one place the adapter resolves: :meth:`SGLangSetup.resolve` builds the plan of the KV
pool and of every extra pool (its chain of tiers and their policies included), and
:meth:`SGLangSetup.attach` opens its storage, through core's ``resolve()`` and the cache's
:func:`~kvtier.storage.open_store` (one page store per tier behind one
:class:`~kvtier.storage.StorageChain`; a single ``backend`` is a chain of one). Ranks are
spelt with core's :func:`~kvtier.core.keys.rank_suffix`; the namespaces are the ones stored
pages carry.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from kvtier.core.capabilities import ResolvedPlan, check_backend, resolve
from kvtier.core.config import EngineConfig, load_engine_config
from kvtier.core.errors import InvalidFieldError, UnsupportedCombinationError
from kvtier.core.geometry import AttentionKind
from kvtier.core.keys import rank_suffix
from kvtier.core.specs import BackendSpec
from kvtier.core.storage import Counters
from kvtier.integrations.sglang.model import model_name
from kvtier.integrations.sglang.pages import (
    HeadSlicePages,
    SGLangPages,
    SlotPages,
    StatePages,
    in_place_refusal,
    pool_geometry_fields,
    pool_layout,
    unsupported_pool,
)
from kvtier.integrations.sglang.pools import (
    AttachedPool,
    P,
    is_kv_shaped,
    is_per_rank,
    state_geometry_fields,
)
from kvtier.integrations.sglang.settings import LABEL, OPTIONS_AT, SECTION, SGLangSection
from kvtier.plugins.registry import Registry
from kvtier.storage import open_store

__all__ = ["SGLangSetup", "check_parallelism", "head_slices", "model_id", "rank_tag"]

log = logging.getLogger(__name__)

#: What a state pool must offer to be paged by value (SGLang's MambaPoolHost does).
_STATE_POOL_METHODS = (
    "page_size",
    "get_data_page",
    "get_dummy_flat_data_page",
    "set_from_flat_data_page",
)


def rank_tag(axis: str, rank: int, size: int) -> str:
    """``|<axis><rank>of<size>`` for a parallel axis of several ranks, else ``""``.

    Spelt from core's rank suffix (``_r<rank>of<size>``, empty for one rank), so a rank is
    written one way; the namespaces stored pages carry read ``|pp1of2``, ``|cp0of2`` and
    ``|tp1of2``, and must keep reading so.
    """
    suffix = rank_suffix(AttentionKind.MHA, int(rank), int(size))  # "": a single rank
    return f"|{axis}{suffix.removeprefix('_r')}" if suffix else ""


def model_id(settings: SGLangSection, config: Any, model: Any = None) -> str:
    """The model's part of the namespace: SGLang's model name (or the declared
    ``kvtier.model``) with a digest of what the server computes its KV with
    (:func:`~kvtier.integrations.sglang.model.model_name`: the published model settings
    ``model``, default this process's); then the pipeline stage and context-parallel
    rank, each where there are several."""
    name = model_name(config.model_name or "default", settings.model, model)
    pp = rank_tag("pp", getattr(config, "pp_rank", 0), getattr(config, "pp_size", 1))
    cp = rank_tag("cp", getattr(config, "attn_cp_rank", 0), getattr(config, "attn_cp_size", 1))
    return name + pp + cp


def head_slices(config: Any) -> int:
    """How many head slices each page is stored as: ``tp_lcm_size // tp_size`` where SGLang
    splits heads (``should_split_heads``: heterogeneous TP sizes sharing one store), else 1."""
    if not getattr(config, "should_split_heads", False):
        return 1
    lcm, size = getattr(config, "tp_lcm_size", None), int(config.tp_size)
    if config.is_mla_model:
        raise UnsupportedCombinationError(
            "SGLang asks storage to split heads (tp_lcm_size) of an MLA model, whose pages "
            "are the same on every rank and are not split",
            value="tp_lcm_size",
            supported=["tp_lcm_size only for MHA/GQA models (SGLang sets it so)"],
        )
    if not isinstance(lcm, int) or lcm <= size or lcm % size:
        raise InvalidFieldError(
            "tp_lcm_size",
            f"must be a multiple of --tp-size ({size}) above it to split heads, got {lcm!r}",
            value=lcm,
        )
    return lcm // size


def check_parallelism(config: Any) -> None:
    """Refuse the parallel set-ups whose pages kvtier cannot store (decode context
    parallelism), and a head split that names no valid ``tp_lcm_size``."""
    head_slices(config)
    if getattr(config, "dcp_size", 1) != 1:
        raise UnsupportedCombinationError(
            "SGLang decode context parallelism (DCP) splits each page across ranks; "
            "kvtier stores whole pages",
            value=config.dcp_size,
            supported=["decode context parallel size 1"],
        )


@dataclass(frozen=True)
class SGLangSetup:
    """One SGLang rank's kvtier set-up: what every pool's plan is resolved from."""

    settings: SGLangSection
    registry: Registry
    attention: AttentionKind
    #: The KV pool's model id (an extra pool's adds ``|pool=<name>``).
    model: str
    tp_rank: int
    tp_size: int
    #: The storage backend (the first tier's), checked (name, availability, options) at
    #: construction.
    spec: BackendSpec
    #: Head slices per KV page (SGLang's ``tp_lcm_size // tp_size``; 1: whole pages).
    slices: int = 1
    #: Every tier's backend, fastest first (``(spec,)`` for a single backend).
    specs: tuple[BackendSpec, ...] = ()

    @classmethod
    def for_rank(
        cls, config: Any, settings: SGLangSection, registry: Registry, published: Any = None
    ) -> SGLangSetup:
        """Check what needs no host pool, as ``resolve()`` will: SGLang constructs the
        storage first and hands its host pool over in ``register_mem_pool_host``. Every
        tier's backend is checked here (name, availability, attention kind, options, named
        as ``kvtier.tiers[i].extra_config``); layouts and policies when the pool comes.
        ``published``: SGLang's model settings (default: those published in this
        process); what cannot be keyed of them is refused here."""
        attention = AttentionKind.MLA if config.is_mla_model else AttentionKind.MHA
        model = model_id(settings, config, published)
        tp_rank, tp_size = int(config.tp_rank), int(config.tp_size)
        engine = _engine_config(settings, attention, model, tp_rank, tp_size)
        specs = []
        for index, tier in enumerate(engine.storage_tiers()):
            at = f"{SECTION}.tiers[{index}].extra_config" if settings.tiers else OPTIONS_AT
            spec, _ = check_backend(
                engine.model_copy(
                    update={"backend": tier.backend, "extra_config": tier.extra_config}
                ),
                registry.backends,
                registry.io_backends,
                options_at=at,
                operations=index == 0,  # a lower tier moves whole pages only
            )
            specs.append(spec)
        check_parallelism(config)
        slices = head_slices(config)
        return cls(
            settings, registry, attention, model, tp_rank, tp_size, specs[0], slices, tuple(specs)
        )

    def resolve(
        self,
        *,
        layout: str,
        model: str | None = None,
        rank: tuple[int, int] | None = None,
        **geometry: Any,
    ) -> ResolvedPlan:
        """The plan of one host pool: its layout, geometry fields, model id (default: the
        KV pool's) and TP ``rank`` (rank, size; default: this rank's). Every pool's plan
        comes from here."""
        tp_rank, tp_size = (self.tp_rank, self.tp_size) if rank is None else rank
        config = _engine_config(
            self.settings,
            self.attention,
            self.model if model is None else model,
            tp_rank,
            tp_size,
            layout=layout,
            **geometry,
        )
        return resolve(
            config,
            self.registry.backends,
            self.registry.io_backends,
            options_at=OPTIONS_AT,
            policies=self.registry.policies,
        )

    def attach(self, name: str, plan: ResolvedPlan, pages: P, *, writes: bool) -> AttachedPool[P]:
        """Open ``plan``'s storage chain over ``pages`` (the section's bounds and threads).

        A rank that does not write the pool (an MLA rank other than the storage writer)
        promotes nothing either: the writer, which reads the same shared pages, promotes
        them once, instead of every rank writing the same page into the tier above.
        """
        if not writes and len(plan.storage_tiers()) > 1:
            plan = dataclasses.replace(
                plan,
                tiers=tuple(dataclasses.replace(t, promote=False) for t in plan.storage_tiers()),
            )
        store = open_store(plan, pages, **self.settings.page_store_options())
        return AttachedPool(name, pages, store, plan, writes=writes)

    def kv_pool(self, pool: Any, *, writes: bool) -> AttachedPool[SGLangPages]:
        """SGLang's KV host pool, checked against the backend, with its storage chain."""
        if getattr(pool, "kv_buffer", None) is None:
            raise unsupported_pool(pool, "it has no kv_buffer (a logical-only anchor pool)")
        if getattr(pool, "dcp_size", 1) != 1:
            raise unsupported_pool(pool, "its pages are split by decode context parallelism")
        plan, pages = self._in_place(pool, self.model)
        return self.attach("kv", plan, pages, writes=writes)

    def kv_slices(self, pool: Any, *, writes: bool) -> list[AttachedPool[SGLangPages]]:
        """SGLang's KV host pool as its storage chains: one (whole pages), or one per head
        slice where SGLang splits heads (``tp_lcm_size``).

        Slice ``j`` of rank ``r`` is stored as the page of rank ``r * slices + j`` of a
        ``tp_lcm_size``-way instance would be: that rank's namespace, heads, geometry and
        rank suffix, in that rank's store, so instances of different TP sizes share pages.
        """
        if self.slices == 1:
            return [self.kv_pool(pool, writes=writes)]
        if getattr(pool, "kv_buffer", None) is None:
            raise unsupported_pool(pool, "it has no kv_buffer (a logical-only anchor pool)")
        layout = pool_layout(pool, self.attention)
        fields = pool_geometry_fields(pool, self.attention, self.settings.dtype)
        heads = fields["num_kv_heads"]
        if layout.value != "page_head" or heads % self.slices:
            raise UnsupportedCombinationError(
                f"SGLang asks storage to split each page into {self.slices} head slices "
                f"(tp_lcm_size), which needs the page_head layout and heads divisible by "
                f"{self.slices}; the host pool has layout {layout.value!r} and {heads} heads",
                value=layout.value,
                supported=["--hicache-mem-layout page_head with tp_lcm_size"],
            )
        fields["num_kv_heads"] = heads // self.slices
        lcm = self.tp_size * self.slices
        shards: list[AttachedPool[SGLangPages]] = []
        for index in range(self.slices):
            rank = (self.tp_rank * self.slices + index, lcm)
            plan = self.resolve(layout=layout.value, rank=rank, **fields)
            pages: SGLangPages = HeadSlicePages(
                pool, plan.layout, plan.geometry, index, self.slices
            )
            pages.extents(0)  # the pool's memory matches the geometry: checked now
            shards.append(self.attach("kv", plan, pages, writes=writes))
        return shards

    def extra_pool(
        self, name: str, pool: Any, *, writer: bool, counters: Counters
    ) -> AttachedPool[Any]:
        """A hybrid model's extra host pool (Mamba state, SWA KV), with its storage chain.

        Its namespace names the pool; where its pages differ per rank but core's rank
        suffix does not separate them (the Mamba state of an MLA model), the namespace
        carries the TP rank as well.
        """
        per_rank = is_per_rank(name, self.attention)
        model = f"{self.model}|pool={name}"
        if per_rank and not rank_suffix(self.attention, self.tp_rank, self.tp_size):
            model += rank_tag("tp", self.tp_rank, self.tp_size)
        writes = writer or per_rank
        if is_kv_shaped(pool):
            plan, pages = self._in_place(pool, model)
            return self.attach(name, plan, pages, writes=writes)
        missing = [attr for attr in _STATE_POOL_METHODS if not hasattr(pool, attr)]
        if missing:
            raise UnsupportedCombinationError(
                f"SGLang registered the extra host pool {name!r} "
                f"({type(pool).__name__}), which has no {', '.join(missing)}; kvtier "
                "stores extra pools that are KV-shaped (kv_buffer with heads, as SWA "
                "pools) or that page their state (as MambaPoolHost)",
                value=name,
                supported=["a Mamba or SWA host pool of SGLang's HostKVCache shape"],
            )
        dummy = pool.get_dummy_flat_data_page()
        page_bytes = int(dummy.numel() * dummy.element_size())
        fields = state_geometry_fields(name, pool, page_bytes, self.attention)
        refusal = in_place_refusal(pool, page_bytes)
        if refusal is not None:
            # by value the bytes are SGLang's flat data page; a namespace of their own
            # keeps them apart from pages served in place, whatever either's order
            model += "|by-value"
            counters.add("state_pools_by_value")
            log.warning(
                "kvtier: SGLang state pool %r (%s) cannot be served in place (%s); its "
                "pages are copied through SGLang's get_data_page / "
                "set_from_flat_data_page (counted as state_pages_copied)",
                name,
                type(pool).__name__,
                refusal,
            )
        plan = self.resolve(layout="page_first", model=model, **fields)
        state = SlotPages(pool, page_bytes) if refusal is None else StatePages(pool, page_bytes)
        return self.attach(name, plan, state, writes=writes)

    def _in_place(self, pool: Any, model: str) -> tuple[ResolvedPlan, SGLangPages]:
        """The plan and in-place pages of a KV-shaped pool, its memory checked now."""
        layout = pool_layout(pool, self.attention)
        fields = pool_geometry_fields(pool, self.attention, self.settings.dtype)
        plan = self.resolve(layout=layout.value, model=model, **fields)
        pages = SGLangPages(pool, plan.layout, plan.geometry)
        pages.extents(0)  # the pool's memory matches the geometry: checked now, not later
        return plan, pages


def _engine_config(
    settings: SGLangSection,
    attention: AttentionKind,
    model: str,
    tp_rank: int,
    tp_size: int,
    **plan: Any,
) -> EngineConfig:
    """kvtier's engine config for an SGLang rank; ``plan`` adds layout and geometry.

    The section's ``tiers`` (or its one ``backend`` and ``extra_config``) and ``tenants``
    are the engine config's, as any kvtier entry reads them.
    """
    storage: dict[str, Any] = (
        {"tiers": [tier.model_dump() for tier in settings.tiers]}
        if settings.tiers
        else {"backend": settings.backend, "extra_config": settings.extra_config}
    )
    return load_engine_config(
        {
            **storage,
            "tenants": {name: t.model_dump() for name, t in settings.tenants.items()},
            "attention": attention.value,
            "model": model,
            "tenant": settings.tenant,
            "verify": settings.verify,
            "tp_rank": tp_rank,
            "tp_size": tp_size,
            **plan,
        },
        source=LABEL,
    )
