"""TieredCache does what its resolved plan says, and all of it.

- The key namespace includes the host-pool layout: two caches of one model on one root
  but with different layouts never read or overwrite each other's pages.
- An operation the config did not declare is refused with an error naming it and how to
  declare it (start-up never checked that the IO backend and layout can run it).
- Per-layer backup (``backup(keys, slots, layer=i)``, for layer-sharded pools) is
  bit-exact through the host pool and storage, in every layout with every IO backend
  that declares it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_cache import GEOMETRY, JOIN, cache_registry, make_cache, slots

from kvtier.cache import TieredCache
from kvtier.core.errors import OperationNotDeclaredError, TransferError
from kvtier.core.geometry import AttentionKind
from kvtier.core.layout import Layout, layouts_for
from kvtier.core.specs import Operation
from kvtier.plugins.registry import Registry
from kvtier.testing.content import check_pages, fill_pages

MLA_GEOMETRY: dict[str, Any] = {
    "attention": "mla",
    "num_layers": 3,
    "kv_lora_rank": 8,
    "qk_rope_head_dim": 8,
    "dtype": "bfloat16",
    "page_size": 4,
}
TOKENS = list(range(1000, 1000 + 4 * 6))  # six pages


@pytest.fixture
def registry() -> Registry:
    return cache_registry()


@pytest.fixture
def opened() -> Iterator[list[TieredCache]]:
    caches: list[TieredCache] = []
    yield caches
    for cache in caches:
        cache.close()


def _file_cache(
    registry: Registry, opened: list[TieredCache], root: Path, **config: Any
) -> TieredCache:
    cache = make_cache(registry, backend="file", extra_config={"root": str(root)}, **config)
    opened.append(cache)
    return cache


def _back_up(cache: TieredCache, keys: list[str]) -> None:
    where = slots(0, len(keys), cache.geometry.page_size)
    fill_pages(cache.device_pool, keys, where)
    handle = cache.backup(keys, where)
    assert handle.wait(JOIN) and handle.ok, handle
    assert cache.flush(JOIN)


def _load_from_storage(cache: TieredCache, keys: list[str]) -> list[bool]:
    """Load ``keys`` into zeroed device slots; which pages hold their key's exact bytes."""
    cache.device_pool.zero_()  # type: ignore[attr-defined]
    where = slots(40, len(keys), cache.geometry.page_size)
    loaded = cache.load(keys, where)
    good = check_pages(cache.device_pool, keys[:loaded], where[: loaded * 4])
    return good + [False] * (len(keys) - loaded)


# --- layouts on one root -------------------------------------------------------------------


def test_two_layouts_on_one_root_never_share_pages(
    registry: Registry, opened: list[TieredCache], tmp_path: Path
) -> None:
    root = tmp_path / "shared"
    first = _file_cache(registry, opened, root, layout="page_first")
    second = _file_cache(registry, opened, root, layout="layer_first")
    first_keys, second_keys = first.keys(TOKENS), second.keys(TOKENS)
    assert not set(first_keys) & set(second_keys)  # same model and tokens, other layout
    _back_up(first, first_keys)
    # the other layout finds nothing to load, so it never reads a page it cannot use ...
    assert second.page_store.exists(second_keys) == [False] * 6
    handle = second.prefetch(second_keys)
    assert handle.planned_pages == 0
    handle.release()
    assert second.stats()["page_store"]["invalid"] == 0
    # ... and its own pages of the same tokens leave the first layout's pages alone
    _back_up(second, second_keys)
    for cache, keys in ((first, first_keys), (second, second_keys)):
        fresh = _file_cache(registry, opened, root, layout=cache.plan.layout.value)
        assert _load_from_storage(fresh, keys) == [True] * 6
        store = fresh.stats()["page_store"]
        assert store["hits"] == 6 and store["invalid"] == 0
    stores = sorted(p.name for p in root.iterdir())
    assert stores == sorted([first.plan.context.namespace, second.plan.context.namespace])


# --- undeclared operations -----------------------------------------------------------------


def test_undeclared_operations_are_refused_naming_the_fix(registry: Registry) -> None:
    cache = make_cache(registry)  # declares backup_all and load_all (the default)
    try:
        keys = cache.keys(TOKENS[:8])
        where = slots(0, 2)
        with pytest.raises(OperationNotDeclaredError) as info:
            cache.backup(keys, where, layer=0)
        assert info.value.operation == "backup_layer"
        assert isinstance(info.value, TransferError)
        message = str(info.value)
        assert "backup(layer=0) is the 'backup_layer' operation" in message
        assert "declares: backup_all, load_all" in message
        assert "add 'backup_layer' to the engine config's 'operations'" in message
        handle = cache.backup(keys, where)
        assert handle.wait(JOIN) and handle.ok
        with pytest.raises(OperationNotDeclaredError, match=r"load\(layer=1\).*'load_layer'"):
            cache.load(keys, where, layer=1)
        assert cache.stats()["host"]["pages"]["pinned"] == 0
        assert cache.stats()["pages"]["loaded"] == 0
    finally:
        cache.close()
    layered_only = make_cache(registry, operations=["backup_layer", "load_layer"])
    try:
        keys = layered_only.keys(TOKENS[:8])
        with pytest.raises(OperationNotDeclaredError, match=r"backup\(\) is the 'backup_all'"):
            layered_only.backup(keys, slots(0, 2))
        with pytest.raises(OperationNotDeclaredError, match=r"load\(\) is the 'load_all'"):
            layered_only.load(keys, slots(0, 2))
    finally:
        layered_only.close()


def test_a_layer_out_of_range_is_refused_up_front(registry: Registry) -> None:
    cache = make_cache(registry, operations=["backup_layer", "load_all"])
    try:
        keys = cache.keys(TOKENS[:4])
        for bad in (2, -1, True):
            with pytest.raises(TransferError, match=r"out of range: the geometry has layers 0\.\."):
                cache.backup(keys, slots(0, 1), layer=bad)  # type: ignore[arg-type]
    finally:
        cache.close()


# --- per-layer backup ----------------------------------------------------------------------


def _layer_cases() -> list[tuple[str, str, str]]:
    return [
        (attention.value, layout.value, io)
        for attention in AttentionKind
        for layout in layouts_for(attention)
        for io in ("direct", "kernel")
    ]


@pytest.mark.parametrize(("attention", "layout", "io"), _layer_cases())
def test_backup_layer_by_layer_is_bit_exact(
    registry: Registry,
    opened: list[TieredCache],
    tmp_path: Path,
    attention: str,
    layout: str,
    io: str,
) -> None:
    geometry = MLA_GEOMETRY if attention == "mla" else {**GEOMETRY, "num_layers": 3}
    settings: dict[str, Any] = {
        "geometry": geometry,
        "layout": layout,
        "io_backend": io,
        "operations": ["backup_layer", "load_all"],
    }
    cache = _file_cache(registry, opened, tmp_path / "pages", **settings)
    assert cache.io_backend.supports(Operation.BACKUP_LAYER)
    ps, layers = cache.geometry.page_size, cache.geometry.num_layers
    keys = cache.keys(TOKENS)
    where = slots(0, len(keys), ps)
    fill_pages(cache.device_pool, keys, where)
    for layer in range(layers):
        handle = cache.backup(keys, where, layer=layer)
        assert handle.wait(JOIN) and handle.ok, handle
        assert handle.pages_copied == len(keys)
        if layer < layers - 1:  # a page is whole, so ready and written, at its last layer
            assert cache.stats()["pages"]["backed_up"] == 0
            assert cache.page_store.exists(keys) == [False] * len(keys)
    assert cache.flush(JOIN)
    assert cache.stats()["pages"]["backed_up"] == len(keys)
    assert cache.page_store.exists(keys) == [True] * len(keys)
    # from the host pool ...
    cache.device_pool.zero_()  # type: ignore[attr-defined]
    target = slots(40, len(keys), ps)
    assert cache.load(keys, target) == len(keys)
    assert all(check_pages(cache.device_pool, keys, target))
    assert cache.stats()["host"]["pages"]["pinned"] == 0
    # ... and from storage, in a cache that never saw the device pages
    fresh = _file_cache(registry, opened, tmp_path / "pages", **settings)
    assert _load_from_storage(fresh, keys) == [True] * len(keys)


def test_backup_layers_out_of_order_and_repeated(registry: Registry) -> None:
    cache = make_cache(registry, operations=["backup_layer", "load_all"])
    try:
        keys = cache.keys(TOKENS[:12])
        where = slots(0, 3)
        fill_pages(cache.device_pool, keys, where)
        for layer in (1, 1, 0):  # a repeated layer is copied again; the page waits for 0
            handle = cache.backup(keys, where, layer=layer)
            assert handle.wait(JOIN) and handle.ok
        assert cache.stats()["pages"]["backed_up"] == 3
        again = cache.backup(keys, where, layer=0)  # now cached: nothing to copy
        assert again.wait(JOIN) and again.pages_cached == 3 and again.pages_copied == 0
        cache.device_pool.zero_()  # type: ignore[attr-defined]
        target = slots(40, 3)
        assert cache.load(keys, target) == 3
        assert all(check_pages(cache.device_pool, keys, target))
    finally:
        cache.close()


def test_pages_missing_a_layer_are_given_up_at_close(registry: Registry) -> None:
    cache = make_cache(registry, operations=["backup_layer", "load_all"])
    keys = cache.keys(TOKENS[:8])
    handle = cache.backup(keys, slots(0, 2), layer=0)  # layer 1 never comes
    assert handle.wait(JOIN) and handle.ok
    counts = cache.stats()["host"]["pages"]
    assert counts["pinned"] == 2  # held for the missing layer
    prefetch = cache.prefetch(keys)
    assert prefetch.ready_pages == 0  # a page without all its layers is never served
    prefetch.release()
    assert cache.close()
    assert cache.stats()["pages"]["cancelled"] >= 2
    assert cache.stats()["host"]["pages"]["pinned"] == 0


def test_layouts_without_a_page_axis_still_load_per_layer_backups(
    registry: Registry, opened: list[TieredCache], tmp_path: Path
) -> None:
    # page_first interleaves layers per token: each layer's copy is strided on the host
    settings: dict[str, Any] = {"layout": "page_first", "operations": ["backup_layer"]}
    cache = _file_cache(registry, opened, tmp_path / "p", **settings)
    assert cache.plan.layout is Layout.PAGE_FIRST
    keys = cache.keys(TOKENS[:8])
    where = slots(0, 2)
    fill_pages(cache.device_pool, keys, where)
    for layer in range(cache.geometry.num_layers):
        assert cache.backup(keys, where, layer=layer).wait(JOIN)
    assert cache.flush(JOIN)
    with pytest.raises(OperationNotDeclaredError, match="'load_all'"):
        cache.load(keys, where)  # this cache only backs up; another one loads
    reader = _file_cache(
        registry, opened, tmp_path / "p", layout="page_first", operations=["load_all"]
    )
    assert _load_from_storage(reader, keys) == [True, True]
    assert torch.count_nonzero(reader.device_pool.kv_tensors[0]) > 0  # type: ignore[attr-defined]


# --- one device-slot validator -------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        torch.arange(8, dtype=torch.float32),
        torch.arange(8).view(2, 4),
        torch.arange(5),
        torch.arange(10_000, 10_008),
        torch.arange(-1, 7),
        list(range(8)),
    ],
    ids=["float", "2-D", "count", "too-high", "negative", "list"],
)
def test_the_cache_and_the_io_backend_report_a_slot_fault_alike(
    registry: Registry, bad: Any
) -> None:
    cache = make_cache(registry)
    try:
        keys = cache.keys(TOKENS[:8])
        with pytest.raises(TransferError) as from_cache:
            cache.backup(keys, bad)
        pages = cache.host_pool.allocate(2)
        with pytest.raises(TransferError) as from_io:
            cache.io_backend.backup(cache.device_pool, cache.host_pool, bad, pages)
        assert str(from_cache.value) == str(from_io.value)
        assert type(from_cache.value.value) is type(from_io.value.value)
    finally:
        cache.close()


def test_each_cache_call_checks_its_slots_and_layer_once(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache checks a call's slots and layer; the IO backend it calls does not again."""
    import kvtier.cache.load as load_module
    import kvtier.cache.tiered as tiered_module
    import kvtier.core.io as io_module

    calls: dict[str, int] = {"slots": 0, "range": 0, "layer": 0}

    def counting(name: str, real: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return real(*args, **kwargs)

        return wrapper

    checks = {
        "check_device_slots": "slots",
        "check_slots_in_range": "range",
        "check_layer": "layer",
    }
    real = {attr: getattr(io_module, attr) for attr in checks}
    for module in (io_module, tiered_module, load_module):
        for attr, name in checks.items():
            if hasattr(module, attr):
                monkeypatch.setattr(module, attr, counting(name, real[attr]))
    every = ["backup_all", "backup_layer", "load_all", "load_layer"]
    cache = make_cache(registry, operations=every)
    try:
        keys = cache.keys(TOKENS[:8])
        fill_pages(cache.device_pool, keys, slots(0, 2))
        for layer in (None, 1):
            calls.update(slots=0, range=0, layer=0)
            assert cache.backup(keys, slots(0, 2), layer=layer).wait(JOIN)
            assert calls == {"slots": 1, "range": 1, "layer": 0 if layer is None else 1}
        for layer in (None, 1):
            calls.update(slots=0, range=0, layer=0)
            assert cache.load(cache.prefetch(keys), slots(10, 2), layer=layer) == 2
            assert calls == {"slots": 1, "range": 1, "layer": 0 if layer is None else 1}
    finally:
        cache.close()
