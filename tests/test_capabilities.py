"""Capability resolution against small declared specs: errors list what works, auto picks."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

from kvtier.core.capabilities import (
    LAYOUT_PREFERENCE,
    build_backend,
    build_host_pool,
    build_io_backend,
    open_page_store,
    resolve,
    working_combinations,
)
from kvtier.core.config import EngineConfig
from kvtier.core.errors import (
    BackendUnavailableError,
    InvalidFieldError,
    MissingFieldError,
    PluginError,
    StorageError,
    UnknownKeyError,
    UnknownNameError,
    UnsupportedCombinationError,
)
from kvtier.core.geometry import AttentionKind
from kvtier.core.keys import Namespace, layout_namespace
from kvtier.core.layout import Layout
from kvtier.core.specs import (
    ALL_ATTENTION,
    ALL_LAYOUTS,
    ALL_OPERATIONS,
    BackendSpec,
    Capability,
    IOBackendSpec,
    Operation,
)
from kvtier.core.storage import BackendContext, StorageBackend

MHA = AttentionKind.MHA
MLA = AttentionKind.MLA
ALL_OPS = tuple(Operation)
WHOLE = (Operation.BACKUP_ALL, Operation.LOAD_ALL)


class MemOpts(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    capacity_bytes: int = 1 << 20


def caps(layouts: Any, attentions: Any, ops: Any) -> frozenset[Capability]:
    return frozenset(
        Capability(lay, att, op) for lay in layouts for att in attentions for op in ops
    )


def _factory(*args: Any) -> None:
    return None


# fast: whole-page transfers only, for page_first_direct and page_first, high priority.
FAST = IOBackendSpec(
    name="fast",
    factory=_factory,
    priority=10,
    capabilities=caps([Layout.PAGE_FIRST_DIRECT, Layout.PAGE_FIRST], [MHA, MLA], WHOLE),
)
# slow: everything, low priority.
SLOW = IOBackendSpec(
    name="slow", factory=_factory, priority=0, capabilities=caps(list(Layout), [MHA, MLA], ALL_OPS)
)
# broken: would do everything, but its dependency is missing.
BROKEN = IOBackendSpec(
    name="broken",
    factory="kvtier_no_such_mod:X",
    priority=99,
    requires=("kvtier_no_such_mod",),
    install_hint="pip install broken-io",
    capabilities=caps(list(Layout), [MHA, MLA], ALL_OPS),
)

EVERYTHING: dict[str, Any] = {
    "layouts": ALL_LAYOUTS,
    "attention": ALL_ATTENTION,
    "operations": ALL_OPERATIONS,
}
MEM = BackendSpec(name="mem", factory=_factory, config_model=MemOpts, **EVERYTHING)
PICKY = BackendSpec(
    name="picky",
    factory=_factory,
    layouts=frozenset({Layout.LAYER_FIRST}),
    io_backends=frozenset({"slow"}),
    attention=frozenset({MHA}),
    operations=frozenset(WHOLE),
)
NEEDS = BackendSpec(
    name="needs",
    factory="kvtier_no_such_mod:B",
    requires=("kvtier_no_such_mod",),
    install_hint="pip install 'kvtier[needs]'",
)

BACKENDS = {s.name: s for s in (MEM, PICKY, NEEDS)}
IO = {s.name: s for s in (FAST, SLOW, BROKEN)}


def config(**fields: Any) -> EngineConfig:
    base: dict[str, Any] = {"backend": "mem", "num_layers": 4, "num_kv_heads": 2, "head_dim": 64}
    if fields.get("attention") == "mla":
        base = {"backend": "mem", "num_layers": 4, "kv_lora_rank": 16, "qk_rope_head_dim": 8}
    base.update(fields)
    return EngineConfig.from_mapping(base)


def test_layout_preference_covers_every_layout() -> None:
    assert sorted(LAYOUT_PREFERENCE) == sorted(Layout)


# --- names and availability ------------------------------------------------------------


def test_unknown_backend_lists_installed_and_suggests() -> None:
    with pytest.raises(UnknownNameError) as info:
        resolve(config(backend="memm"), BACKENDS, IO)
    assert str(info.value) == (
        "unknown backend 'memm' (did you mean 'mem'?); available: 'mem', 'needs', 'picky'"
    )
    assert info.value.value == "memm"


def test_unknown_io_backend() -> None:
    with pytest.raises(UnknownNameError) as info:
        resolve(config(io_backend="fsat"), BACKENDS, IO)
    assert "unknown IO backend 'fsat' (did you mean 'fast'?)" in str(info.value)
    assert "available: 'broken', 'fast', 'slow'" in str(info.value)


def test_unavailable_backend_names_the_install_hint() -> None:
    with pytest.raises(BackendUnavailableError) as info:
        resolve(config(backend="needs"), BACKENDS, IO)
    assert str(info.value) == (
        "backend 'needs' is unavailable: missing Python module(s) kvtier_no_such_mod; "
        "pip install 'kvtier[needs]'"
    )


def test_unavailable_io_backend_explicit() -> None:
    with pytest.raises(
        BackendUnavailableError, match=r"IO backend 'broken' is unavailable.*pip install broken-io"
    ):
        resolve(config(io_backend="broken"), BACKENDS, IO)


def test_unavailable_io_backend_is_never_picked_by_auto() -> None:
    plan = resolve(config(operations=list(ALL_OPS)), BACKENDS, IO)
    assert plan.io_backend is SLOW  # BROKEN has the highest priority but cannot run here


# --- auto --------------------------------------------------------------------------------


def test_auto_picks_priority_then_layout(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvtier"):
        plan = resolve(config(), BACKENDS, IO)
    assert plan.io_backend is FAST
    assert plan.layout is Layout.PAGE_FIRST_DIRECT
    assert plan.notes == [
        "auto picked io_backend=fast (priority 10) layout=page_first_direct for backend 'mem' "
        "with attention 'mha' and operations backup_all, load_all; 5 other working "
        "combinations"
    ]
    assert plan.notes[0] in caplog.text
    assert any(r.levelno == logging.INFO for r in caplog.records)


def test_auto_respects_requested_operations() -> None:
    plan = resolve(config(operations=["backup_all", "load_all", "load_layer"]), BACKENDS, IO)
    assert (plan.io_backend, plan.layout) == (SLOW, Layout.PAGE_FIRST_DIRECT)
    assert plan.operations == frozenset(
        {Operation.BACKUP_ALL, Operation.LOAD_ALL, Operation.LOAD_LAYER}
    )


def test_auto_layout_with_explicit_io_backend() -> None:
    plan = resolve(config(io_backend="slow"), BACKENDS, IO)
    assert plan.layout is Layout.PAGE_FIRST_DIRECT
    assert plan.notes[0].startswith("auto picked layout=page_first_direct for")


def test_auto_io_backend_with_explicit_layout() -> None:
    plan = resolve(config(layout="layer_first"), BACKENDS, IO)
    assert plan.io_backend is SLOW
    assert plan.notes[0].startswith("auto picked io_backend=slow (priority 0) for")


def test_auto_is_deterministic_regardless_of_registration_order() -> None:
    twin = IOBackendSpec(
        name="afast", factory=_factory, priority=10, capabilities=FAST.capabilities
    )
    forward = {s.name: s for s in (FAST, twin, SLOW)}
    backward = dict(reversed(list(forward.items())))
    assert resolve(config(), BACKENDS, forward).io_backend is twin
    assert resolve(config(), BACKENDS, backward).io_backend is twin


def test_explicit_everything_has_no_notes() -> None:
    plan = resolve(config(io_backend="fast", layout="page_first"), BACKENDS, IO)
    assert (plan.io_backend, plan.layout, plan.notes) == (FAST, Layout.PAGE_FIRST, [])


def test_mla_auto() -> None:
    plan = resolve(config(attention="mla"), BACKENDS, IO)
    assert plan.geometry.attention is MLA
    assert plan.layout is Layout.PAGE_FIRST_DIRECT


# --- unsupported combinations ------------------------------------------------------------


def test_io_backend_cannot_run_an_operation_lists_what_works() -> None:
    with pytest.raises(UnsupportedCombinationError) as info:
        resolve(
            config(io_backend="fast", layout="page_first", operations=["backup_all", "load_layer"]),
            BACKENDS,
            IO,
        )
    err = info.value
    assert str(err).startswith(
        "IO backend 'fast' cannot run load_layer with layout 'page_first' for MHA\n"
        "Combinations that would work:\n"
        "  io_backend=slow layout=page_first_direct\n"
    )
    assert err.supported == (
        "io_backend=slow layout=page_first_direct",
        "io_backend=slow layout=page_first",
        "io_backend=slow layout=page_head",
        "io_backend=slow layout=layer_first",
    )


def test_io_backend_without_the_layout() -> None:
    with pytest.raises(UnsupportedCombinationError) as info:
        resolve(config(io_backend="fast", layout="layer_first"), BACKENDS, IO)
    assert "IO backend 'fast' cannot run backup_all, load_all with layout 'layer_first'" in str(
        info.value
    )
    assert "io_backend=fast layout=page_first_direct" in info.value.supported
    assert "io_backend=slow layout=layer_first" in info.value.supported


def test_explicit_io_backend_with_no_working_layout() -> None:
    with pytest.raises(UnsupportedCombinationError) as info:
        resolve(config(io_backend="fast", operations=["load_layer"]), BACKENDS, IO)
    assert str(info.value).startswith(
        "IO backend 'fast' has no layout that runs backend 'mem' "
        "with attention 'mha' and operations load_layer"
    )
    assert info.value.supported[0] == "io_backend=slow layout=page_first_direct"


def test_layout_that_does_not_exist_for_mla() -> None:
    with pytest.raises(UnsupportedCombinationError) as info:
        resolve(config(attention="mla", layout="page_head"), BACKENDS, IO)
    assert str(info.value).startswith(
        "layout 'page_head' does not exist for MLA (its layouts: layer_first, page_first, "
        "page_first_direct)"
    )
    assert "io_backend=fast layout=page_first_direct" in info.value.supported
    assert not any("page_head" in s for s in info.value.supported)


def test_backend_layouts_and_io_backends_restrict() -> None:
    plan = resolve(config(backend="picky"), BACKENDS, IO)
    assert (plan.io_backend, plan.layout) == (SLOW, Layout.LAYER_FIRST)
    with pytest.raises(UnsupportedCombinationError) as info:
        resolve(config(backend="picky", io_backend="fast"), BACKENDS, IO)
    assert "backend 'picky' does not work with IO backend 'fast' (it works with: slow)" in str(
        info.value
    )
    assert info.value.supported == ("io_backend=slow layout=layer_first",)
    with pytest.raises(
        UnsupportedCombinationError, match="backend 'picky' does not support layout 'page_first'"
    ):
        resolve(config(backend="picky", io_backend="slow", layout="page_first"), BACKENDS, IO)


def test_backend_attention_restricts() -> None:
    with pytest.raises(UnsupportedCombinationError) as info:
        resolve(config(backend="picky", attention="mla"), BACKENDS, IO)
    assert str(info.value).startswith(
        "backend 'picky' does not support attention 'mla' (it supports: mha)"
    )
    assert info.value.supported == ()
    assert "Combinations that would work:\n  (none)" in str(info.value)


def test_backend_operations_restrict() -> None:
    with pytest.raises(UnsupportedCombinationError) as info:
        resolve(config(backend="picky", operations=["backup_all", "backup_layer"]), BACKENDS, IO)
    assert (
        "backend 'picky' does not support operation(s) backup_layer (it supports: "
        "backup_all, load_all)"
    ) in str(info.value)


def test_no_io_backends_installed() -> None:
    with pytest.raises(UnsupportedCombinationError, match="no IO backend is installed"):
        resolve(config(), BACKENDS, {})


# --- extra-config, geometry, validate_plan ------------------------------------------------


def test_extra_config_validated_with_field_path() -> None:
    with pytest.raises(InvalidFieldError) as info:
        resolve(config(extra_config='{"capacity_bytes": "big"}'), BACKENDS, IO)
    assert info.value.path == "extra_config.capacity_bytes"
    assert "got 'big'" in str(info.value)


def test_extra_config_unknown_key() -> None:
    with pytest.raises(UnknownKeyError) as info:
        resolve(config(extra_config={"capacity": 1}), BACKENDS, IO)
    assert str(info.value) == (
        "unknown key 'capacity' in extra_config of backend 'mem' (did you mean "
        "'capacity_bytes'?); allowed keys: 'capacity_bytes'"
    )


def test_backend_config_is_the_validated_model() -> None:
    plan = resolve(config(extra_config={"capacity_bytes": 5}), BACKENDS, IO)
    assert isinstance(plan.backend_config, MemOpts)
    assert plan.backend_config.capacity_bytes == 5


def test_missing_geometry() -> None:
    with pytest.raises(MissingFieldError, match="head_dim: required field is missing"):
        resolve(EngineConfig(backend="mem", num_layers=2, num_kv_heads=1), BACKENDS, IO)


def test_validate_plan_sees_config_and_context() -> None:
    seen: list[tuple[Any, BackendContext]] = []

    def check(cfg: Any, context: BackendContext) -> None:
        seen.append((cfg, context))
        if context.layout is not Layout.LAYER_FIRST:
            raise InvalidFieldError("extra_config.o_direct", "needs layout layer_first")

    spec = BackendSpec(
        name="checked", factory=_factory, config_model=MemOpts, validate_plan=check, **EVERYTHING
    )
    with pytest.raises(InvalidFieldError, match="needs layout layer_first"):
        resolve(config(backend="checked"), {"checked": spec}, IO)
    plan = resolve(config(backend="checked", layout="layer_first"), {"checked": spec}, IO)
    cfg, context = seen[-1]
    assert cfg is plan.backend_config and context is plan.context


def test_validate_plan_raising_a_bug_is_a_plugin_error() -> None:
    def check(cfg: Any, context: BackendContext) -> None:
        raise TypeError("oops")

    spec = BackendSpec(name="buggy", factory=_factory, validate_plan=check, **EVERYTHING)
    with pytest.raises(PluginError, match="backend 'buggy': validate_plan raised TypeError"):
        resolve(config(backend="buggy"), {"buggy": spec}, IO)


# --- the plan ----------------------------------------------------------------------------


def test_context_and_namespace() -> None:
    plan = resolve(config(tp_rank=1, tp_size=4, model="llama", tenant="t1"), BACKENDS, IO)
    ctx = plan.context
    assert (ctx.tp_rank, ctx.tp_size, ctx.layout, ctx.geometry) == (
        1,
        4,
        plan.layout,
        plan.geometry,
    )
    # the namespace is (model, layout, geometry, tenant), computed once; the store's scope
    # adds the rank suffix, so one MHA rank's clear() never removes another rank's pages
    fingerprint = plan.geometry.fingerprint
    assert plan.namespace == layout_namespace("llama", plan.layout, fingerprint, "t1")
    assert plan.namespace == Namespace(f"llama|{plan.layout.value}", fingerprint, "t1")
    assert plan.rank_suffix == "_r1of4"
    assert ctx.namespace == plan.namespace.id + "_r1of4"
    other = resolve(config(tp_rank=1, tp_size=4, model="llama", tenant="t2"), BACKENDS, IO)
    assert other.context.namespace != ctx.namespace
    relaid = resolve(
        config(tp_rank=1, tp_size=4, model="llama", tenant="t1", layout="layer_first"),
        BACKENDS,
        IO,
    )
    assert relaid.layout is not plan.layout and relaid.namespace != plan.namespace
    tokens = list(range(64 * 2))
    assert not set(relaid.keyer().keys(tokens)) & set(plan.keyer().keys(tokens))
    keys = plan.keyer().keys(tokens)
    assert len(keys) == 2 and all(k.startswith(plan.namespace.id) for k in keys)
    assert all(k.endswith("_r1of4") for k in keys)
    mla = resolve(config(attention="mla", tp_rank=1, tp_size=4), BACKENDS, IO)
    assert mla.rank_suffix == "" and mla.context.namespace == mla.namespace.id


def test_summary_and_json() -> None:
    plan = resolve(config(extra_config={"capacity_bytes": 5}), BACKENDS, IO)
    summary = plan.summary()
    assert "backend        mem" in summary
    assert "io_backend     fast (auto)" in summary
    assert "layout         page_first_direct (auto)" in summary
    assert "operations     backup_all, load_all" in summary
    assert "backend config capacity_bytes=5" in summary
    assert f"namespace      {plan.context.namespace}" in summary
    assert "note: auto picked" in summary
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["io_backend"] == "fast" and data["layout"] == "page_first_direct"
    assert data["backend_config"] == {"capacity_bytes": 5}
    assert data["geometry"]["bytes_per_page"] == plan.geometry.bytes_per_page


# --- conservative declarations -----------------------------------------------------------


def test_a_spec_that_declares_nothing_supports_nothing() -> None:
    bare = BackendSpec(name="bare", factory=_factory)
    assert (bare.layouts, bare.attention, bare.operations) == (frozenset(),) * 3
    for attention in ("mha", "mla"):
        assert working_combinations(bare, IO, AttentionKind(attention), frozenset(WHOLE)) == []
        with pytest.raises(UnsupportedCombinationError, match="does not support attention"):
            resolve(config(backend="bare", attention=attention), {"bare": bare}, IO)
    # declaring the attention kind alone is not enough: layouts and operations are listed too
    mha_only = BackendSpec(name="half", factory=_factory, attention=frozenset({MHA}))
    with pytest.raises(UnsupportedCombinationError, match=r"does not support operation\(s\)"):
        resolve(config(backend="half"), {"half": mha_only}, IO)
    no_layout = BackendSpec(
        name="nolayout", factory=_factory, attention=frozenset({MHA}), operations=ALL_OPERATIONS
    )
    with pytest.raises(UnsupportedCombinationError) as info:
        resolve(config(backend="nolayout"), {"nolayout": no_layout}, IO)
    assert info.value.supported == ()


def test_an_io_spec_that_declares_nothing_executes_nothing() -> None:
    idle = IOBackendSpec(name="idle", factory=_factory, priority=100)
    assert idle.capabilities == frozenset()
    plan = resolve(config(), BACKENDS, {**IO, "idle": idle})
    assert plan.io_backend.name != "idle"  # the highest priority, but it runs nothing
    with pytest.raises(UnsupportedCombinationError, match="IO backend 'idle' has no layout"):
        resolve(config(io_backend="idle"), BACKENDS, {"idle": idle})


# --- building from the plan: the one door to a plugin's factory ---------------------------


class _Recorder(StorageBackend):
    """A do-nothing backend that records attach and close."""

    def __init__(self, config: Any = None, context: Any = None, attach_error: bool = False):
        self.context = context
        self.attached: list[Any] = []
        self.closed = 0
        self.attach_error = attach_error

    def attach(self, pool: Any) -> None:
        if self.attach_error:
            raise RuntimeError("cannot register memory")
        self.attached.append(pool)

    def exists(self, keys: Any) -> list[bool]:
        return [False] * len(keys)

    def get(self, keys: Any, pages: Any) -> list[bool]:
        return [False] * len(keys)

    def put(self, keys: Any, pages: Any) -> list[bool]:
        return [False] * len(keys)

    def delete(self, keys: Any) -> list[bool]:
        return [False] * len(keys)

    def clear(self) -> None:
        pass

    def close(self) -> None:
        self.closed += 1


def _spec_with(factory: Any) -> dict[str, BackendSpec]:
    return {"made": BackendSpec(name="made", factory=factory, **EVERYTHING)}


def test_build_backend_passes_the_plan_and_checks_the_result() -> None:
    seen: list[Any] = []

    def factory(cfg: Any, context: BackendContext) -> StorageBackend:
        seen.append((cfg, context))
        return _Recorder(cfg, context)

    plan = resolve(config(backend="made", model="m", tenant="t"), _spec_with(factory), IO)
    backend = build_backend(plan)
    assert isinstance(backend, _Recorder)
    assert seen == [(plan.backend_config, plan.context)]


def test_a_stray_factory_exception_is_a_plugin_error_naming_the_plugin() -> None:
    def broken(cfg: Any, context: Any) -> Any:
        raise KeyError("endpoint")

    plan = resolve(config(backend="made"), _spec_with(broken), IO)
    with pytest.raises(PluginError) as info:
        build_backend(plan)
    message = str(info.value)
    assert "backend 'made': its factory raised KeyError('endpoint')" in message
    assert f"module {__name__!r}" in message
    assert isinstance(info.value.__cause__, KeyError)


def test_a_kvtier_error_from_a_factory_passes_through() -> None:
    def refuses(cfg: Any, context: Any) -> Any:
        raise StorageError("the master at 127.0.0.1:1 is not answering", value=1)

    plan = resolve(config(backend="made"), _spec_with(refuses), IO)
    with pytest.raises(StorageError, match="not answering"):
        build_backend(plan)


def test_a_factory_returning_something_else_is_refused() -> None:
    plan = resolve(config(backend="made"), _spec_with(lambda cfg, ctx: {"not": "a backend"}), IO)
    with pytest.raises(PluginError, match=r"returned dict, not a kvtier\.StorageBackend"):
        build_backend(plan)
    # the same door for IO backends
    odd_io = IOBackendSpec(
        name="odd", factory=lambda *a: object(), capabilities=SLOW.capabilities, priority=50
    )
    plan = resolve(config(), BACKENDS, {"odd": odd_io})
    with pytest.raises(PluginError, match=r"IO backend 'odd': its factory returned object"):
        build_io_backend(plan)


def test_build_io_backend_and_host_pool_follow_the_plan() -> None:
    from kvtier.core.io import DIRECT_SPEC, KERNEL_SPEC, IOBackend

    builtin = {s.name: s for s in (DIRECT_SPEC, KERNEL_SPEC)}
    plan = resolve(config(layout="page_head", host_pages=3), BACKENDS, builtin)
    io = build_io_backend(plan)
    assert isinstance(io, IOBackend) and io.layout is Layout.PAGE_HEAD
    assert io.name == plan.io_backend.name
    pool = build_host_pool(plan, pin_memory=False)
    assert (pool.num_pages, pool.layout, pool.geometry) == (3, Layout.PAGE_HEAD, plan.geometry)
    assert build_host_pool(plan, num_pages=2, pin_memory=False).num_pages == 2
    sized = resolve(config(host_bytes=10 * plan.geometry.bytes_per_page), BACKENDS, builtin)
    assert 0 < build_host_pool(sized, pin_memory=False).num_pages < 10  # headers take room


def test_open_page_store_attaches_the_pool_and_closes_the_backend_on_failure() -> None:
    made: list[_Recorder] = []

    def factory(cfg: Any, context: Any) -> StorageBackend:
        made.append(_Recorder(cfg, context, attach_error=len(made) == 1))
        return made[-1]

    plan = resolve(config(backend="made", verify="header", host_pages=2), _spec_with(factory), IO)
    pool = build_host_pool(plan, pin_memory=False)
    store = open_page_store(plan, pool, checksum_workers=2)
    assert store.backend is made[0] and made[0].attached == [pool]
    assert (store.verify, store.fingerprint, store.checksum_workers) == (
        "header",
        plan.geometry.fingerprint,
        2,
    )
    with pytest.raises(PluginError, match=r"backend 'made': attach raised RuntimeError"):
        open_page_store(plan, pool)
    assert made[1].closed == 1
