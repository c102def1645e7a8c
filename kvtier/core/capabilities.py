"""Capability resolution: check a config against what the backends declared, before building.

:func:`resolve` is handed the registry's mappings (it imports nothing from
``kvtier.plugins``) and either returns a :class:`ResolvedPlan` that is known to work or
raises a config error that lists what would. Nothing is allocated and no thread is
started here, so an impossible plan fails at start-up, not at the first transfer.

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

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from kvtier.core.config import AUTO, EngineConfig, validate_model
from kvtier.core.errors import (
    ConfigError,
    PluginError,
    UnknownNameError,
    UnsupportedCombinationError,
)
from kvtier.core.geometry import AttentionKind, KVGeometry
from kvtier.core.keys import Namespace
from kvtier.core.layout import Layout, layouts_for
from kvtier.core.specs import BackendSpec, IOBackendSpec, Operation
from kvtier.core.storage import BackendContext

__all__ = ["LAYOUT_PREFERENCE", "ResolvedPlan", "namespace_for", "resolve", "working_combinations"]

log = logging.getLogger(__name__)

#: Layout order for ``auto`` among equally preferred IO backends; see the module docstring.
LAYOUT_PREFERENCE: tuple[Layout, ...] = (
    Layout.PAGE_FIRST_DIRECT,
    Layout.PAGE_FIRST,
    Layout.PAGE_HEAD,
    Layout.LAYER_FIRST,
)


def namespace_for(model: str, fingerprint: str, tenant: str | None) -> str:
    """The key namespace id of (model, geometry, tenant): the one :mod:`kvtier.core.keys` uses."""
    return Namespace(model, fingerprint, tenant).id


@dataclass(frozen=True)
class ResolvedPlan:
    """A config checked against the declarations: everything needed to build, nothing built."""

    config: EngineConfig
    geometry: KVGeometry
    backend: BackendSpec
    backend_config: BaseModel
    io_backend: IOBackendSpec
    layout: Layout
    operations: frozenset[Operation]
    context: BackendContext
    #: What ``auto`` picked and why, one line each.
    notes: list[str] = field(default_factory=list)

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
            "verify": self.config.verify,
            "backend_config": self.backend_config.model_dump(mode="json"),
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


def resolve(
    config: EngineConfig,
    backends: Mapping[str, BackendSpec],
    io_backends: Mapping[str, IOBackendSpec],
) -> ResolvedPlan:
    """Check ``config`` against the declarations and return the plan, or raise ConfigError.

    Order: names, availability, geometry, backend capabilities, extra-config, the
    (IO backend, layout) pair (``auto`` picks the best working one), the backend's own
    ``validate_plan``. Nothing is allocated.
    """
    backend: BackendSpec = _lookup("backend", config.backend, backends)
    backend.ensure_available()
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

    if attention not in backend.attention:
        raise UnsupportedCombinationError(
            f"backend {backend.name!r} does not support attention {attention.value!r} "
            f"(it supports: {_names(a.value for a in backend.attention)})",
            value=attention.value,
            supported=supported,
        )
    unsupported_ops = operations - backend.operations
    if unsupported_ops:
        raise UnsupportedCombinationError(
            f"backend {backend.name!r} does not support operation(s) "
            f"{_names(op.value for op in unsupported_ops)} "
            f"(it supports: {_names(op.value for op in backend.operations)})",
            value=sorted(op.value for op in unsupported_ops),
            supported=supported,
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

    backend_config = validate_model(
        backend.config_model,
        config.extra_config,
        where="extra_config",
        label=f"extra_config of backend {backend.name!r}",
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

    context = BackendContext(
        geometry=geometry,
        layout=layout,
        tp_rank=config.tp_rank,
        tp_size=config.tp_size,
        namespace=namespace_for(config.model, geometry.fingerprint, config.tenant),
    )
    if backend.validate_plan is not None:
        try:
            backend.validate_plan(backend_config, context)
        except ConfigError:
            raise
        except Exception as exc:
            raise PluginError(
                f"backend {backend.name!r}: validate_plan raised {exc!r} instead of a "
                f"ConfigError; this is a bug in the plugin that declares it",
                value=exc,
            ) from exc
    return ResolvedPlan(
        config=config,
        geometry=geometry,
        backend=backend,
        backend_config=backend_config,
        io_backend=io,
        layout=layout,
        operations=operations,
        context=context,
        notes=notes,
    )
