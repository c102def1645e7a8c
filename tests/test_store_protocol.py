"""One contract for a store: a page store and a chain both offer kvtier.core.store.Store
(no caller casts one into the other), and a scheduler asks an exists-only view that holds
no page memory, no staging and no worker."""

from __future__ import annotations

import ast
import inspect
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_cache import GEOMETRY, cache_registry

from kvtier.core.capabilities import ResolvedPlan, build_host_pool, open_page_store, resolve
from kvtier.core.config import load_engine_config
from kvtier.core.errors import InvalidFieldError, StorageError
from kvtier.core.pagestore import PageStore
from kvtier.core.store import ExistsLookup, Store
from kvtier.storage import ExistsView, NoPages, StorageChain, open_lookup, open_store

ROOT = Path(__file__).resolve().parents[1]


def _plan(tmp_path: Path, tiers: list[dict[str, Any]]) -> ResolvedPlan:
    registry = cache_registry()
    config = load_engine_config({**GEOMETRY, "tiers": tiers})
    return resolve(config, registry.backends, registry.io_backends, policies=registry.policies)


def _file(root: Path) -> dict[str, Any]:
    return {"backend": "file", "extra_config": {"root": str(root), "min_free_bytes": 0}}


def _members(protocol: type) -> dict[str, Any]:
    """The methods and properties a protocol declares (its own and inherited)."""
    out: dict[str, Any] = {}
    for klass in reversed(protocol.__mro__):
        if klass in (object,) or not getattr(klass, "_is_protocol", False):
            continue
        for name, value in vars(klass).items():
            if not name.startswith("_"):
                out[name] = value
    return out


@pytest.mark.parametrize("opener", [open_page_store, open_store])
def test_a_page_store_and_a_chain_offer_every_call_of_the_store_protocol(
    tmp_path: Path, opener: Any
) -> None:
    plan = _plan(tmp_path, [_file(tmp_path / "root")])
    store = opener(plan, build_host_pool(plan, num_pages=2, pin_memory=False))
    try:
        implementation = type(store)
        assert implementation in (PageStore, StorageChain)
        for name, declared in _members(Store).items():
            assert hasattr(store, name), f"{implementation.__name__} lacks Store.{name}"
            if not inspect.isfunction(declared):
                continue
            offered = inspect.signature(getattr(implementation, name)).parameters
            for param in inspect.signature(declared).parameters.values():
                assert param.name in offered, f"{implementation.__name__}.{name}({param.name})"
                assert offered[param.name].kind == param.kind, (
                    f"{implementation.__name__}.{name}({param.name}) is {offered[param.name].kind}"
                )
                if param.default is not inspect.Parameter.empty:
                    assert offered[param.name].default is not inspect.Parameter.empty
    finally:
        store.close()


def _casts(source: str) -> list[int]:
    """Lines where ``source`` calls ``cast(<a store type>, ...)``."""
    stores = {"PageStore", "StorageChain", "Store"}
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "cast" and node.args:
            target = node.args[0]
            name = target.value if isinstance(target, ast.Constant) else getattr(target, "id", "")
            if name in stores:
                lines.append(node.lineno)
    return lines


def test_no_module_casts_one_store_into_another() -> None:
    assert _casts("y = 1\nx = cast('PageStore', chain)\n") == [2]  # the check can fail
    sources = [*(ROOT / "kvtier").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    offenders = {
        str(path.relative_to(ROOT)): lines
        for path in sources
        if (lines := _casts(path.read_text(encoding="utf-8")))
    }
    assert not offenders, f"take a kvtier.core.store.Store instead of casting: {offenders}"


@pytest.fixture
def two_tiers(tmp_path: Path) -> Iterator[tuple[ResolvedPlan, StorageChain]]:
    plan = _plan(tmp_path, [_file(tmp_path / "fast"), _file(tmp_path / "slow")])
    pool = build_host_pool(plan, num_pages=8, pin_memory=False)
    chain = open_store(plan, pool)
    yield plan, chain
    chain.close()


def _kvtier_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("kvtier-chain")}


def test_an_exists_view_answers_across_tiers_with_no_memory_and_no_worker(
    two_tiers: tuple[ResolvedPlan, StorageChain],
) -> None:
    plan, chain = two_tiers
    keys = plan.keyer().keys(list(range(4 * plan.geometry.page_size)))
    assert all(chain.put(keys[:2], [0, 1]))
    assert chain.flush(10.0)  # cascaded into the slow tier too
    assert all(chain.tiers[1].store.delete(keys[:1]))  # only the fast tier holds key 0
    assert all(chain.tiers[0].store.delete(keys[1:2]))  # only the slow tier holds key 1
    before = _kvtier_threads()
    view = open_lookup(plan, backend_call_timeout_s=5.0)
    try:
        assert isinstance(view, ExistsView)
        lookup: ExistsLookup = view
        assert list(lookup.exists(keys)) == [True, True, False, False]
        assert lookup.prefix_hits(keys) == 2
        assert _kvtier_threads() == before  # no cascade worker, no staging
        assert view.stats()["backend_errors"] == 0
    finally:
        assert view.close()


def test_the_exists_view_holds_no_pages_and_says_how_to_move_them(tmp_path: Path) -> None:
    plan = _plan(tmp_path, [_file(tmp_path / "only")])
    memory = NoPages(plan.layout)
    with pytest.raises(StorageError, match="open_store"):
        memory.page_buffers(3)
    store = open_page_store(plan, memory)
    try:
        keys = plan.keyer().keys(list(range(plan.geometry.page_size)))
        with pytest.raises(StorageError, match="lookups only"):
            store.put(keys, [0])  # there is no page to write: a caller's bug, said plainly
    finally:
        store.close()


def test_the_adapters_face_opens_storage_one_way() -> None:
    import kvtier.adapters as face

    assert face.open_store is open_store
    assert face.open_lookup is open_lookup
    assert not hasattr(face, "open_page_store")
    assert {"Store", "ExistsLookup"} <= set(face.__all__)


def test_the_old_name_of_the_call_bound_still_works_with_a_warning(tmp_path: Path) -> None:
    plan = _plan(tmp_path, [_file(tmp_path / "root")])
    pool = build_host_pool(plan, num_pages=2, pin_memory=False)
    with pytest.warns(DeprecationWarning, match="'call_timeout_s' is now called"):
        chain = open_store(plan, pool, call_timeout_s=2.5)
    try:
        assert chain.tiers[0].store.backend_call_timeout_s == 2.5
    finally:
        chain.close()
    with pytest.raises(InvalidFieldError, match="pass only 'backend_call_timeout_s'"):
        open_store(plan, pool, call_timeout_s=1.0, backend_call_timeout_s=2.0)
