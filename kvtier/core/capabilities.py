"""From a config to objects: resolve it against the declarations, then build from the plan.

This module is the one path every consumer takes (TieredCache, the engine adapters, the
bench, the conformance kit):

1. :func:`resolve` is handed the registry's mappings (it imports nothing from
   ``kvtier.plugins``) and either returns a :class:`ResolvedPlan` that is known to work
   or raises a config error that lists what would. Nothing is allocated and no thread is
   started, so an impossible plan fails at start-up, not at the first transfer. The plan
   carries everything the objects need, computed once: the validated backend and IO
   backend configs, the key namespace (model, layout, geometry, tenant), the rank suffix
   and the :class:`BackendContext`; the backend's ``validate_plan`` has run.
2. :func:`build_backend` and :func:`build_io_backend` turn a plan into objects. They are
   the only code that calls a plugin's factory: a stray exception from it becomes a
   :class:`PluginError` naming the plugin, and a factory that returns the wrong type is
   refused. :func:`build_host_pool` and :func:`open_page_store` finish the stack.

``auto`` ordering
-----------------
For ``io_backend="auto"`` and/or ``layout="auto"`` every working (IO backend, layout)
pair is ranked by the IO backend's declared ``priority`` (higher first), then by
:data:`LAYOUT_PREFERENCE`, then by IO backend name, so the choice never depends on plugin
load order. The layout order prefers the fewest and largest copies and I/O requests:

1. ``page_first_direct``: each (page, layer) block is contiguous on the host, matching a
   device pool's per-layer page, so a page moves as whole-block copies, and a stored page
   is two extents (K, V) or one (MLA).
2. ``page_first``: a page is still two extents (K, V) for storage, but each host block
   interleaves layers per token, so a device <-> host copy is a strided copy per layer.
3. ``page_head``: head-major pages, useful for head-sharded storage; the most strided
   device <-> host copies of the four.
4. ``layer_first``: the device's own order, but each stored page splits into
   2 x layers small extents, the most I/O requests per page.

The ranking only orders combinations that already support every requested operation,
so an engine that needs, say, per-layer loads still gets a layout that can do them.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel

from kvtier.core.bounded import DEFAULT_CALL_TIMEOUT_S, DEFAULT_MAX_ABANDONED
from kvtier.core.config import AUTO, EngineConfig
from kvtier.core.errors import (
    InvalidFieldError,
    KvtierError,
    PluginError,
    UnknownNameError,
    UnsupportedCombinationError,
)
from kvtier.core.extents import Extent
from kvtier.core.geometry import AttentionKind, KVGeometry
from kvtier.core.host_pool import HostPool
from kvtier.core.io import IOBackend
from kvtier.core.keys import Namespace, PageKeyer, layout_namespace, rank_suffix
from kvtier.core.layout import Layout, layouts_for
from kvtier.core.pagestore import PageMemory, PageStore
from kvtier.core.renames import renamed_keywords
from kvtier.core.specs import BackendSpec, Feature, IOBackendSpec, Operation
from kvtier.core.storage import BackendContext, StorageBackend
from kvtier.core.tiers import policy_choice
from kvtier.core.validation import validate_model

__all__ = [
    "DEFAULT_HOST_BYTES",
    "LAYOUT_PREFERENCE",
    "ForeignPageMemory",
    "PolicyPlan",
    "ResolvedPlan",
    "TierPlan",
    "build_backend",
    "build_host_pool",
    "build_io_backend",
    "check_backend",
    "open_page_store",
    "resolve",
    "working_combinations",
]

log = logging.getLogger(__name__)

#: Layout order for ``auto`` among equally preferred IO backends; see the module docstring.
LAYOUT_PREFERENCE: tuple[Layout, ...] = (
    Layout.PAGE_FIRST_DIRECT,
    Layout.PAGE_FIRST,
    Layout.PAGE_HEAD,
    Layout.LAYER_FIRST,
)


#: The eviction policy a tier gets when its config names none (a backend's own default).
DEFAULT_EVICTION = "lru"
#: Host-pool size when the engine config gives neither ``host_pages`` nor ``host_bytes``.
DEFAULT_HOST_BYTES = 1 << 30


@dataclass(frozen=True)
class PolicyPlan:
    """A tier's policy, checked: its plugin's spec and its validated options (unbuilt)."""

    spec: Any  # kvtier.core.specs.PolicySpec
    options: dict[str, Any]
    #: Where the config names it (``tiers[1].admission``), for errors at build time.
    where: str

    @property
    def name(self) -> str:
        return str(self.spec.name)

    def build(self) -> Any:
        """A fresh policy instance (one per tier and per process)."""
        return self.spec.build(self.options)


@dataclass(frozen=True)
class TierPlan:
    """One storage tier of a plan: its backend and options, its context, its policies."""

    index: int
    backend: BackendSpec
    backend_config: BaseModel
    context: BackendContext
    eviction: PolicyPlan | None = None
    admission: PolicyPlan | None = None
    write: str = "through"
    promote: bool = True

    @property
    def name(self) -> str:
        """``<index>:<backend>`` (``0:file``), as stats and metrics name the tier."""
        return f"{self.index}:{self.backend.name}"

    @property
    def capacity_bytes(self) -> int | None:
        """The backend's configured capacity, where its options have one."""
        value = getattr(self.backend_config, "capacity_bytes", None)
        return int(value) if value is not None else None


@dataclass(frozen=True)
class ResolvedPlan:
    """A config checked against the declarations: everything needed to build, nothing built."""

    config: EngineConfig
    geometry: KVGeometry
    backend: BackendSpec
    backend_config: BaseModel
    io_backend: IOBackendSpec
    io_config: BaseModel
    layout: Layout
    operations: frozenset[Operation]
    #: The key namespace: model, layout, geometry fingerprint and tenant.
    namespace: Namespace
    #: ``_r<rank>of<size>`` for MHA under tensor parallelism, else "".
    rank_suffix: str
    #: What the backend factory receives; its ``namespace`` is the store's scope, the
    #: namespace id plus the rank suffix (a rank's ``clear`` never touches another's).
    context: BackendContext
    #: What ``auto`` picked and why, one line each.
    notes: list[str] = field(default_factory=list)
    #: The chain of storage tiers, fastest first; the first is ``backend`` itself.
    tiers: tuple[TierPlan, ...] = ()
    #: Namespace id -> (tenant name, quota bytes or None) of every tenant the config names.
    tenants: Mapping[str, tuple[str, int | None]] = field(default_factory=dict)

    def storage_tiers(self) -> tuple[TierPlan, ...]:
        """The chain of storage tiers (a plan built by hand, without them: its backend)."""
        return self.tiers or (TierPlan(0, self.backend, self.backend_config, self.context),)

    def keyer(self) -> PageKeyer:
        """The page keyer of this plan: its namespace, page size, attention and rank."""
        return PageKeyer(
            self.namespace,
            self.geometry.page_size,
            self.geometry.attention,
            self.context.tp_rank,
            self.context.tp_size,
        )

    def declares(self, operation: Operation) -> bool:
        """Whether the engine config declared ``operation`` (so resolution checked it)."""
        return operation in self.operations

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly description (``kvtier check --json``)."""
        return {
            "backend": self.backend.name,
            "io_backend": self.io_backend.name,
            "layout": self.layout.value,
            "attention": self.geometry.attention.value,
            "operations": sorted(op.value for op in self.operations),
            "geometry": {
                "num_layers": self.geometry.num_layers,
                "num_kv_heads": self.geometry.num_kv_heads,
                "head_dim": self.geometry.head_dim,
                "dtype": self.config.dtype,
                "page_size": self.geometry.page_size,
                "bytes_per_page": self.geometry.bytes_per_page,
                "fingerprint": self.geometry.fingerprint,
            },
            "tp_rank": self.context.tp_rank,
            "tp_size": self.context.tp_size,
            "namespace": self.context.namespace,
            "io_config": self.io_config.model_dump(mode="json"),
            "verify": self.config.verify,
            "backend_config": self.backend_config.model_dump(mode="json"),
            "tiers": [
                {
                    "tier": tier.name,
                    "backend_config": tier.backend_config.model_dump(mode="json"),
                    "eviction": tier.eviction.name if tier.eviction is not None else None,
                    "admission": tier.admission.name if tier.admission is not None else None,
                    "write": tier.write,
                    "promote": tier.promote,
                }
                for tier in self.storage_tiers()
            ],
            "tenants": sorted(name for name, _ in self.tenants.values()),
            "notes": list(self.notes),
        }

    def summary(self) -> str:
        """A few aligned lines for the CLI and start-up logs."""
        ops = ", ".join(op.value for op in sorted(self.operations, key=_op_order))
        chosen_io = " (auto)" if self.config.io_backend == AUTO else ""
        chosen_layout = " (auto)" if self.config.layout == AUTO else ""
        backend_config = self.backend_config.model_dump(mode="json")
        rows = [
            ("backend", self.backend.name),
            ("io_backend", f"{self.io_backend.name}{chosen_io}"),
            ("layout", f"{self.layout.value}{chosen_layout}"),
            ("attention", self.geometry.attention.value),
            ("operations", ops),
            ("geometry", self.geometry.describe()),
            ("tp", f"rank {self.context.tp_rank} of {self.context.tp_size}"),
            ("namespace", self.context.namespace),
            ("verify", self.config.verify),
            ("backend config", _inline(backend_config)),
        ]
        for tier in self.tiers[1:] if len(self.tiers) > 1 else ():
            policies = ", ".join(
                f"{what} {plan.name}"
                for what, plan in (("eviction", tier.eviction), ("admission", tier.admission))
                if plan is not None
            )
            detail = f"write {tier.write}{', ' + policies if policies else ''}"
            rows.append((f"tier {tier.index}", f"{tier.backend.name} ({detail})"))
        lines = [f"{name:<15}{value}" for name, value in rows]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def _inline(values: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in values.items()) or "(none)"


def _op_order(op: Operation) -> int:
    return list(Operation).index(op)


def _combo(io_name: str, layout: Layout) -> str:
    return f"io_backend={io_name} layout={layout.value}"


def _io_allowed(backend: BackendSpec, io_name: str) -> bool:
    return backend.io_backends is None or io_name in backend.io_backends


def working_combinations(
    backend: BackendSpec,
    io_backends: Mapping[str, IOBackendSpec],
    attention: AttentionKind,
    operations: frozenset[Operation],
) -> list[tuple[IOBackendSpec, Layout]]:
    """Every available (IO backend, layout) that runs all ``operations``, best first."""
    if attention not in backend.attention or not operations <= backend.operations:
        return []
    layouts = [lay for lay in layouts_for(attention) if lay in backend.layouts]
    found = []
    for io in io_backends.values():
        if not _io_allowed(backend, io.name) or io.unavailable_reason() is not None:
            continue
        for layout in layouts:
            if all(io.supports(layout, attention, op) for op in operations):
                found.append((io, layout))
    found.sort(key=lambda c: (-c[0].priority, LAYOUT_PREFERENCE.index(c[1]), c[0].name))
    return found


def _names(values: Any) -> str:
    return ", ".join(sorted(str(v) for v in values)) or "(none)"


def _why_not(
    backend: BackendSpec,
    io: IOBackendSpec,
    layout: Layout,
    attention: AttentionKind,
    operations: frozenset[Operation],
) -> str:
    """The first reason an explicit (IO backend, layout) pair cannot run the plan."""
    if layout not in layouts_for(attention):
        return (
            f"layout {layout.value!r} does not exist for {attention.value.upper()} "
            f"(its layouts: {_names(lay.value for lay in layouts_for(attention))})"
        )
    if layout not in backend.layouts:
        return (
            f"backend {backend.name!r} does not support layout {layout.value!r} "
            f"(it supports: {_names(lay.value for lay in backend.layouts)})"
        )
    if not _io_allowed(backend, io.name):
        return (
            f"backend {backend.name!r} does not work with IO backend {io.name!r} "
            f"(it works with: {_names(backend.io_backends or ())})"
        )
    missing = sorted(
        (op for op in operations if not io.supports(layout, attention, op)), key=_op_order
    )
    return (
        f"IO backend {io.name!r} cannot run {', '.join(op.value for op in missing)} "
        f"with layout {layout.value!r} for {attention.value.upper()}"
    )


def _lookup(kind: str, name: str, specs: Mapping[str, Any]) -> Any:
    try:
        return specs[name]
    except KeyError:
        raise UnknownNameError(kind, name, specs) from None


def check_backend(
    config: EngineConfig,
    backends: Mapping[str, BackendSpec],
    io_backends: Mapping[str, IOBackendSpec],
    *,
    options_at: str = "extra_config",
    operations: bool = True,
) -> tuple[BackendSpec, BaseModel]:
    """The part of :func:`resolve` that needs no geometry: the backend and its options.

    Checks the backend's name and availability, that it supports the config's attention
    kind and operations, and validates its options (``config.extra_config``) against its
    config model; ``options_at`` is where the operator wrote them, for the errors. An
    engine adapter that learns the geometry only later (SGLang hands its host pool over
    after construction) calls this first, to fail at construction; :func:`resolve` runs it
    as its first step.
    """
    backend: BackendSpec = _lookup("backend", config.backend, backends)
    backend.ensure_available()
    attention = config.attention
    # (a lower tier moves whole pages only: the engine's operations are the first tier's)
    wanted = frozenset(config.operations) if operations else frozenset()

    def supported() -> list[str]:
        working = working_combinations(backend, io_backends, attention, wanted)
        return [_combo(io.name, lay) for io, lay in working]

    if attention not in backend.attention:
        raise UnsupportedCombinationError(
            f"backend {backend.name!r} does not support attention {attention.value!r} "
            f"(it supports: {_names(a.value for a in backend.attention)})",
            value=attention.value,
            supported=supported(),
        )
    unsupported_ops = wanted - backend.operations
    if unsupported_ops:
        raise UnsupportedCombinationError(
            f"backend {backend.name!r} does not support operation(s) "
            f"{_names(op.value for op in unsupported_ops)} "
            f"(it supports: {_names(op.value for op in backend.operations)})",
            value=sorted(op.value for op in unsupported_ops),
            supported=supported(),
        )
    backend_config = validate_model(
        backend.config_model,
        config.extra_config,
        where=options_at,
        label=f"{options_at} of backend {backend.name!r}",
    )
    return backend, backend_config


def _policy(
    choice: Any, kind: str, where: str, policies: Mapping[str, Any] | None
) -> PolicyPlan | None:
    """A tier's policy choice checked against the installed policy plugins."""
    chosen = policy_choice(choice)
    if chosen is None:
        # a tier's capacity goes through a policy the chain can see (quotas, write-back):
        # the built-in LRU, the backends' own default, when the registry has it
        default = (policies or {}).get(DEFAULT_EVICTION) if kind == "eviction" else None
        return PolicyPlan(default, {}, where) if default is not None else None
    name, options = chosen
    known = {n: spec for n, spec in (policies or {}).items() if spec.kind == kind}
    spec = _lookup(f"{kind} policy", name, known)
    validate_model(spec.config_model, options, where=where, label=f"{where} ({name!r})")
    return PolicyPlan(spec, options, where)


def _resolve_tiers(
    config: EngineConfig,
    first: tuple[BackendSpec, BaseModel],
    backends: Mapping[str, BackendSpec],
    io_backends: Mapping[str, IOBackendSpec],
    context: BackendContext,
    policies: Mapping[str, Any] | None,
) -> tuple[TierPlan, ...]:
    """Every tier checked like the first backend: name, availability, attention kind,
    the plan's layout, its options, its own plan check and its policies."""
    tiers = config.storage_tiers()
    chained = bool(config.tiers)
    plans: list[TierPlan] = []
    for index, tier in enumerate(tiers):
        at = f"tiers[{index}]" if chained else ""
        if index == 0:
            backend, backend_config = first
            if tier.admission is not None:
                raise UnsupportedCombinationError(
                    "tiers[0].admission: the first tier stores every page the engine backs "
                    "up (its result is the engine's); filter what reaches storage with the "
                    "cache's write policy instead",
                    value=tier.admission,
                    supported=[
                        '"admission" on tiers[1] and below',
                        'CacheOptions(write_policy="write_through_selective", write_threshold=N)',
                    ],
                )
        else:
            backend, backend_config = check_backend(
                config.model_copy(
                    update={"backend": tier.backend, "extra_config": tier.extra_config}
                ),
                backends,
                io_backends,
                options_at=f"{at}.extra_config",
                operations=False,
            )
            if context.layout not in backend.layouts:
                raise UnsupportedCombinationError(
                    f"{at}: backend {backend.name!r} cannot store layout "
                    f"{context.layout.value!r}, which the first tier's IO backend uses (it "
                    f"stores: {_names(lay.value for lay in backend.layouts)})",
                    value=backend.name,
                    supported=[lay.value for lay in backend.layouts],
                )
            if backend.validate_plan is not None:
                _plugin_call(
                    backend, "validate_plan", backend.validate_plan, backend_config, context
                )
        plans.append(
            TierPlan(
                index=index,
                backend=backend,
                backend_config=backend_config,
                context=context,
                eviction=_policy(tier.eviction, "eviction", f"{at}.eviction".lstrip("."), policies),
                admission=_policy(
                    tier.admission, "admission", f"{at}.admission".lstrip("."), policies
                ),
                write=tier.write,
                promote=tier.promote,
            )
        )
    for above, plan in itertools.pairwise(plans):
        if plan.write == "back" and above.capacity_bytes is None:
            raise UnsupportedCombinationError(
                f"tiers[{plan.index}].write: 'back' moves a page into this tier only when "
                f"tiers[{above.index}] (backend {above.backend.name!r}) evicts it to stay "
                "within its capacity_bytes, and that tier has none, so this tier would never "
                "receive a page (pages its backend drops on its own are not written back)",
                value=plan.write,
                supported=[
                    f"capacity_bytes in tiers[{above.index}].extra_config",
                    f'"write": "through" on tiers[{plan.index}]',
                ],
            )
        if plan.write == "back" and Feature.EXACT_EVICTION not in above.backend.features:
            _refuse_write_back_under(above, plan, backends)
        if plan.write == "back" and above.eviction is None:
            raise UnsupportedCombinationError(
                f"tiers[{plan.index}].write: 'back' receives the pages the chain evicts from "
                f"tiers[{above.index}], but that tier has no eviction policy (the plan was "
                "resolved without the installed policies), so its backend would drop pages "
                "on its own and they would be lost",
                value=plan.write,
                supported=[
                    "resolve(..., policies=registry.policies) (kvtier's load_registry)",
                    f'"write": "through" on tiers[{plan.index}]',
                ],
            )
    return tuple(plans)


def _refuse_write_back_under(
    above: TierPlan, plan: TierPlan, backends: Mapping[str, BackendSpec]
) -> None:
    """A ``write: back`` tier under one whose backend reclaims space on its own: the
    chain hands a page down only when it evicts the page itself, so every page that
    backend removes alone (a master's memory pressure) would be lost."""
    exact = sorted(
        name for name, spec in backends.items() if Feature.EXACT_EVICTION in spec.features
    )
    raise UnsupportedCombinationError(
        f"tiers[{plan.index}].write: 'back' receives a page only when the chain evicts it "
        f"from tiers[{above.index}], but that tier's backend {above.backend.name!r} reclaims "
        f"space on its own (it does not declare {Feature.EXACT_EVICTION.value!r}): the "
        "pages it removes by itself would never be handed down, and would be lost",
        value=above.backend.name,
        supported=[
            f'"write": "through" on tiers[{plan.index}] (every page reaches it at once)',
            f"a backend that evicts only what the chain tells it in tiers[{above.index}]: "
            f"{', '.join(exact) if exact else '(none installed)'}",
        ],
    )


def _tenants(
    config: EngineConfig, layout: Layout, fingerprint: str
) -> dict[str, tuple[str, int | None]]:
    """Namespace id -> (tenant, quota) of the config's own tenant and each it names."""
    out: dict[str, tuple[str, int | None]] = {}
    for name, limits in config.tenants.items():
        namespace = layout_namespace(config.model, layout, fingerprint, name)
        quota = int(limits.quota_bytes) if limits.quota_bytes is not None else None
        out[namespace.id] = (name, quota)
    return out


def resolve(
    config: EngineConfig,
    backends: Mapping[str, BackendSpec],
    io_backends: Mapping[str, IOBackendSpec],
    *,
    options_at: str = "extra_config",
    policies: Mapping[str, Any] | None = None,
) -> ResolvedPlan:
    """Check ``config`` against the declarations and return the plan, or raise ConfigError.

    Order: the backend (:func:`check_backend`: name, availability, attention kind,
    operations, its options, named in errors by ``options_at``), the IO backend's name,
    the geometry, the (IO backend, layout) pair (``auto`` picks the best working one),
    the backend's own ``validate_plan``, then every further storage tier and every tier's
    policies (``policies``: the registry's, by name), named in errors as ``tiers[i]``.
    Nothing is allocated.
    """
    if config.tiers:
        first = config.tiers[0]
        config = config.model_copy(
            update={"backend": first.backend, "extra_config": first.extra_config}
        )
        options_at = "tiers[0].extra_config"
    backend, backend_config = check_backend(config, backends, io_backends, options_at=options_at)
    explicit_io: IOBackendSpec | None = None
    if config.io_backend != AUTO:
        explicit_io = _lookup("IO backend", config.io_backend, io_backends)
        explicit_io.ensure_available()

    geometry = config.geometry()
    attention = geometry.attention
    operations = frozenset(config.operations)
    layout_wanted = None if config.layout == AUTO else Layout(config.layout)

    working = working_combinations(backend, io_backends, attention, operations)
    supported = [_combo(io.name, lay) for io, lay in working]
    ops_text = ", ".join(op.value for op in sorted(operations, key=_op_order))
    plan_text = (
        f"backend {backend.name!r} with attention {attention.value!r} and operations {ops_text}"
    )

    if layout_wanted is not None and layout_wanted not in layouts_for(attention):
        raise UnsupportedCombinationError(
            f"layout {layout_wanted.value!r} does not exist for {attention.value.upper()} "
            f"(its layouts: {_names(lay.value for lay in layouts_for(attention))})",
            value=layout_wanted.value,
            supported=supported,
        )
    if explicit_io is not None and not _io_allowed(backend, explicit_io.name):
        raise UnsupportedCombinationError(
            f"backend {backend.name!r} does not work with IO backend {explicit_io.name!r} "
            f"(it works with: {_names(backend.io_backends or ())})",
            value=explicit_io.name,
            supported=supported,
        )

    candidates = [
        (io, lay)
        for io, lay in working
        if (explicit_io is None or io.name == explicit_io.name)
        and (layout_wanted is None or lay is layout_wanted)
    ]
    notes: list[str] = []
    if not candidates:
        if explicit_io is not None and layout_wanted is not None:
            reason = _why_not(backend, explicit_io, layout_wanted, attention, operations)
        elif explicit_io is not None:
            reason = f"IO backend {explicit_io.name!r} has no layout that runs {plan_text}"
        elif layout_wanted is not None:
            reason = f"no IO backend runs {plan_text} with layout {layout_wanted.value!r}"
        elif not io_backends:
            reason = f"no IO backend is installed, so nothing can run {plan_text}"
        else:
            reason = f"no installed IO backend and layout run {plan_text}"
        raise UnsupportedCombinationError(
            reason, value=(config.io_backend, config.layout), supported=supported
        )
    io, layout = candidates[0]
    if explicit_io is None or layout_wanted is None:
        picked = []
        if explicit_io is None:
            picked.append(f"io_backend={io.name} (priority {io.priority})")
        if layout_wanted is None:
            picked.append(f"layout={layout.value}")
        others = len(candidates) - 1
        note = (
            f"auto picked {' '.join(picked)} for {plan_text}; "
            f"{others} other working combination{'s' if others != 1 else ''}"
        )
        notes.append(note)
        log.info("kvtier: %s", note)

    namespace = layout_namespace(config.model, layout, geometry.fingerprint, config.tenant)
    suffix = rank_suffix(attention, config.tp_rank, config.tp_size)
    context = BackendContext(
        geometry=geometry,
        layout=layout,
        tp_rank=config.tp_rank,
        tp_size=config.tp_size,
        namespace=namespace.id + suffix,
    )
    io_config = validate_model(
        io.config_model, {}, where="io_backend", label=f"config of IO backend {io.name!r}"
    )
    if backend.validate_plan is not None:
        _plugin_call(backend, "validate_plan", backend.validate_plan, backend_config, context)
    tiers = _resolve_tiers(
        config, (backend, backend_config), backends, io_backends, context, policies
    )
    return ResolvedPlan(
        config=config,
        geometry=geometry,
        backend=backend,
        backend_config=backend_config,
        io_backend=io,
        io_config=io_config,
        layout=layout,
        operations=operations,
        namespace=namespace,
        rank_suffix=suffix,
        context=context,
        notes=notes,
        tiers=tiers,
        tenants=_tenants(config, layout, geometry.fingerprint),
    )


# --- building from a plan -----------------------------------------------------------------


def _origin(spec: BackendSpec | IOBackendSpec) -> str:
    """Where a spec's code lives, to name the plugin in an error."""
    factory = spec.factory
    if isinstance(factory, str):
        return factory.partition(":")[0]
    return getattr(factory, "__module__", None) or type(factory).__name__


def _plugin_call(spec: BackendSpec | IOBackendSpec, what: str, call: Any, *args: Any) -> Any:
    """Call a plugin's code; a stray (non-kvtier) exception becomes a PluginError."""
    try:
        return call(*args)
    except KvtierError:
        raise
    except Exception as exc:
        raise PluginError(
            f"{spec.kind} {spec.name!r}: {what} raised {exc!r} instead of a kvtier error; "
            f"this is a bug in the plugin that declares it (module {_origin(spec)!r})",
            value=exc,
        ) from exc


def _construct(spec: BackendSpec | IOBackendSpec, expected: type, *args: Any) -> Any:
    """The one call of a plugin factory: import it, call it, check what it returned."""
    factory = spec.load_factory()
    built = _plugin_call(spec, "its factory", factory, *args)
    if not isinstance(built, expected):
        raise PluginError(
            f"{spec.kind} {spec.name!r}: its factory returned {type(built).__name__}, not a "
            f"kvtier.{expected.__name__}; this is a bug in the plugin that declares it "
            f"(module {_origin(spec)!r})",
            value=spec.name,
        )
    return built


def _tier(plan: ResolvedPlan, tier: int) -> TierPlan:
    tiers = plan.storage_tiers()
    if not 0 <= tier < len(tiers):
        raise InvalidFieldError(
            "tier", f"must be in 0..{len(tiers) - 1} (the plan's tiers), got {tier}", value=tier
        )
    return tiers[tier]


def build_backend(plan: ResolvedPlan, tier: int = 0, *, eviction: Any = None) -> StorageBackend:
    """The storage backend of the plan's tier ``tier`` (the first: the plan's backend),
    built from its validated config and context; ``eviction``, a built policy, is the one
    its capacity goes through (``context.eviction``)."""
    chosen = _tier(plan, tier)
    context = chosen.context
    if eviction is not None:
        context = dataclasses.replace(context, eviction=eviction)
    backend: StorageBackend = _construct(
        chosen.backend, StorageBackend, chosen.backend_config, context
    )
    return backend


def build_io_backend(plan: ResolvedPlan) -> IOBackend:
    """The plan's IO backend, for its geometry and layout."""
    io: IOBackend = _construct(
        plan.io_backend, IOBackend, plan.io_config, plan.geometry, plan.layout
    )
    return io


def build_host_pool(
    plan: ResolvedPlan, *, num_pages: int | None = None, pin_memory: bool | None = None
) -> HostPool:
    """A host pool in the plan's layout: ``num_pages``, else the config's size.

    The config gives ``host_pages`` or ``host_bytes``; with neither the pool takes
    :data:`DEFAULT_HOST_BYTES`.
    """
    config = plan.config
    pages = num_pages if num_pages is not None else config.host_pages
    if pages is not None:
        return HostPool(plan.geometry, plan.layout, num_pages=pages, pin_memory=pin_memory)
    size = config.host_bytes or DEFAULT_HOST_BYTES
    return HostPool(plan.geometry, plan.layout, size_bytes=size, pin_memory=pin_memory)


@runtime_checkable
class ForeignPageMemory(PageMemory, Protocol):
    """Page memory kvtier did not allocate, that can name the regions holding its pages."""

    def memory_regions(self) -> list[Extent]: ...


@renamed_keywords
def open_page_store(
    plan: ResolvedPlan,
    pool: PageMemory,
    *,
    checksum_workers: int = 1,
    backend_call_timeout_s: float | None = DEFAULT_CALL_TIMEOUT_S,
    max_abandoned_calls: int = DEFAULT_MAX_ABANDONED,
    tier: int = 0,
    eviction: Any = None,
) -> PageStore:
    """Build the plan's backend and put a :class:`PageStore` over ``pool`` in front of it.

    ``tier`` and ``eviction``: the tier of the plan's chain to build, and the built policy
    its capacity goes through (see :func:`build_backend`); a whole chain is opened by
    ``kvtier.storage.open_store``, which calls this once per tier.

    A kvtier :class:`HostPool` is attached to the backend first (backends that register
    memory, such as Mooncake, do it once here). Foreign page memory (an engine's own host
    pool, served through :class:`ForeignPageMemory`) goes to the backend's
    ``register_memory(regions)`` instead. The store owns the backend (``store.close()``
    closes it) and bounds every call to it by ``backend_call_timeout_s``; if anything fails here,
    the backend is closed before the error propagates.
    """
    spec = _tier(plan, tier).backend
    backend = build_backend(plan, tier, eviction=eviction)
    try:
        if isinstance(pool, HostPool):
            _plugin_call(spec, "attach", backend.attach, pool)
        elif isinstance(pool, ForeignPageMemory):
            regions = pool.memory_regions()
            _plugin_call(spec, "register_memory", backend.register_memory, regions)
        return PageStore(
            backend,
            pool,
            fingerprint=plan.geometry.fingerprint,
            verify=plan.config.verify,
            checksum_workers=checksum_workers,
            backend_call_timeout_s=backend_call_timeout_s,
            max_abandoned_calls=max_abandoned_calls,
        )
    except BaseException:
        backend.close()
        raise
