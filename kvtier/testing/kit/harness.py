"""The kit's harness: the backend under test behind a host pool and a PageStore.

:class:`BackendKit` is the fixture class a backend's test module subclasses; its ``kit``
fixture hands each test a :class:`KitEnv`, which builds backends through kvtier's one
construction path and opens each as a :class:`Harness`. The mixins in the sibling modules
use only what this module defines.
"""

from __future__ import annotations

import contextlib
import random
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pytest

from kvtier.core.capabilities import ResolvedPlan, build_host_pool, open_page_store, resolve
from kvtier.core.config import EngineConfig
from kvtier.core.errors import PluginError
from kvtier.core.geometry import AttentionKind, KVGeometry
from kvtier.core.host_pool import HostPool
from kvtier.core.io import DIRECT_SPEC, KERNEL_SPEC
from kvtier.core.keys import PageKeyer
from kvtier.core.layout import Layout, layouts_for
from kvtier.core.pagestore import PageMemory, PageStore, VerifyMode
from kvtier.core.specs import BackendSpec, Feature, IOBackendSpec, Operation
from kvtier.core.storage import StorageBackend
from kvtier.core.store import Store

if TYPE_CHECKING:
    from kvtier.plugins.registry import Registry

__all__ = [
    "BackendKit",
    "Harness",
    "KitEnv",
    "default_geometry",
    "expand_tmp",
    "geometry_fields",
    "load_kit_registry",
    "random_bytes",
    "require_feature",
    "whole_page_operations",
]

#: Small geometries, as engine-config fields, so the kit runs in seconds: 16 KiB MHA
#: pages, 8 KiB MLA pages.
_GEOMETRY_FIELDS: dict[AttentionKind, dict[str, Any]] = {
    AttentionKind.MHA: {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64},
    AttentionKind.MLA: {"num_layers": 2, "kv_lora_rank": 64, "qk_rope_head_dim": 64},
}
_PAGE_FIELDS: dict[str, Any] = {"dtype": "float16", "page_size": 16}
#: The transfers a kit plan declares when the backend supports them.
_WHOLE_PAGES = (Operation.BACKUP_ALL, Operation.LOAD_ALL)
_LAYOUT_PREFERENCE = (
    Layout.PAGE_FIRST,
    Layout.PAGE_FIRST_DIRECT,
    Layout.LAYER_FIRST,
    Layout.PAGE_HEAD,
)


def default_geometry(attention: AttentionKind) -> KVGeometry:
    """The kit's small geometry for ``attention``."""
    return EngineConfig.from_mapping(geometry_fields(attention)).geometry()


def geometry_fields(attention: AttentionKind) -> dict[str, Any]:
    """The engine-config fields of the kit's small geometry for ``attention`` (a chain's
    kit resolves its plans from them)."""
    kind = AttentionKind(attention)
    return {"attention": kind.value, **_GEOMETRY_FIELDS[kind], **_PAGE_FIELDS}


def whole_page_operations(specs: Sequence[BackendSpec]) -> list[Operation]:
    """The whole-page transfers a kit plan declares: those every spec supports (else all)."""
    wanted = [op for op in _WHOLE_PAGES if all(op in spec.operations for spec in specs)]
    return wanted or list(_WHOLE_PAGES)


def expand_tmp(value: Any, tmp: Path) -> Any:
    """``value`` with ``"{tmp}"`` in every string (nested in mappings and lists) as ``tmp``."""
    return _expand(value, tmp)


def random_bytes(rng: random.Random, n: int) -> bytes:
    """``n`` bytes drawn from ``rng``, so test data is the same on every run."""
    return rng.getrandbits(n * 8).to_bytes(n, "little") if n else b""


@dataclass
class Harness:
    """One backend behind a host pool and a PageStore, with helpers to make test data."""

    backend: StorageBackend
    pool: HostPool
    store: Store
    keyer: PageKeyer
    geometry: KVGeometry
    layout: Layout
    seed: int = 0
    _tokens: int = field(default=0, repr=False)
    #: Closes a store this harness made with the env's stores (see :meth:`store_with`).
    _adopt: Callable[[Store], Store] | None = field(default=None, repr=False)

    def keys(self, n: int) -> list[str]:
        """``n`` chained page keys of a fresh random token sequence (unique per call)."""
        rng = random.Random(f"{self.seed}-{self._tokens}")
        self._tokens += 1
        tokens = [rng.randrange(0, 128_000) for _ in range(n * self.geometry.page_size)]
        return self.keyer.keys(tokens)

    def fill(self, pages: Sequence[int], seed: int) -> None:
        """Fill the pages' payload with bytes drawn from ``seed`` and each page's position."""
        for i, page in enumerate(pages):
            rng = random.Random(f"{seed}-{i}")
            for extent in self.pool.extents(page):
                extent.view[:] = random_bytes(rng, extent.length)

    def scribble(self, pages: Sequence[int]) -> None:
        """Overwrite payloads with a pattern, so stale data can never pass for a good read."""
        for page in pages:
            for extent in self.pool.extents(page):
                extent.view[:] = b"\xa5" * extent.length

    def payload(self, page: int) -> bytes:
        """The page's payload bytes, in canonical order."""
        return b"".join(bytes(e.view) for e in self.pool.extents(page))

    def payloads(self, pages: Sequence[int]) -> list[bytes]:
        return [self.payload(page) for page in pages]

    def store_with(
        self,
        backend: StorageBackend,
        verify: VerifyMode = "full",
        *,
        pool: PageMemory | None = None,
        fingerprint: str | None = None,
    ) -> PageStore:
        """Another PageStore over ``backend`` (this one's, or a wrapper of it): over this
        pool or ``pool``, this geometry's fingerprint or ``fingerprint``, another verify
        mode. It leaves the backend to the harness's own store, and closes (its threads)
        with the env's stores."""
        store = PageStore(
            backend,
            self.pool if pool is None else pool,
            fingerprint=self.geometry.fingerprint if fingerprint is None else fingerprint,
            verify=verify,
            owns_backend=False,
        )
        if self._adopt is not None:
            self._adopt(store)
        return store


class KitEnv:
    """Builds backends for one test from the kit's settings; closes them at teardown."""

    def __init__(
        self,
        spec: BackendSpec,
        config: Mapping[str, Any],
        plugins: Sequence[tuple[str, object]],
        tmp: Path,
        io_backends: Mapping[str, IOBackendSpec] | None = None,
    ) -> None:
        self.spec = spec
        self.config = dict(config)
        self.plugins = tuple(plugins)
        self.tmp = tmp
        #: The IO backends plans are resolved against (the registry's; default built-ins).
        builtin = {spec.name: spec for spec in (DIRECT_SPEC, KERNEL_SPEC)}
        self.io_backends = dict(builtin if io_backends is None else io_backends)
        self.model = f"kit-{secrets.token_hex(4)}"
        self._opened: list[Store] = []

    def supports(self, attention: AttentionKind, layout: Layout) -> bool:
        """Whether the spec declares this attention kind and layout."""
        return attention in self.spec.attention and layout in self.spec.layouts

    def default_attention(self) -> AttentionKind:
        if AttentionKind.MHA in self.spec.attention:
            return AttentionKind.MHA
        return min(self.spec.attention, key=lambda a: a.value)

    def default_layout(self, attention: AttentionKind) -> Layout:
        for layout in _LAYOUT_PREFERENCE:
            if layout in layouts_for(attention) and layout in self.spec.layouts:
                return layout
        pytest.skip(f"backend {self.spec.name!r} declares no layout for {attention.value}")

    def plan(
        self, attention: AttentionKind, layout: Layout, *, verify: VerifyMode = "full"
    ) -> ResolvedPlan:
        """The plan kvtier resolves for this backend, its options, ``attention`` and ``layout``."""
        operations = [op for op in _WHOLE_PAGES if op in self.spec.operations] or list(_WHOLE_PAGES)
        config = EngineConfig.from_mapping(
            {
                "backend": self.spec.name,
                "layout": Layout(layout).value,
                "attention": AttentionKind(attention).value,
                **_GEOMETRY_FIELDS[AttentionKind(attention)],
                **_PAGE_FIELDS,
                "operations": [op.value for op in operations],
                "model": self.model,
                "verify": verify,
                "extra_config": self.config,
            }
        )
        return resolve(config, {self.spec.name: self.spec}, self.io_backends)

    def open(
        self,
        *,
        attention: AttentionKind | None = None,
        layout: Layout | None = None,
        num_pages: int = 16,
        verify: VerifyMode = "full",
        seed: int = 0,
    ) -> Harness:
        """A fresh backend with a host pool of ``num_pages`` and a PageStore in front."""
        attention = attention or self.default_attention()
        layout = layout or self.default_layout(attention)
        try:
            plan = self.plan(attention, layout, verify=verify)
            pool = build_host_pool(plan, num_pages=num_pages, pin_memory=False)
            store = open_page_store(plan, pool)
        except PluginError as exc:  # a bug in the backend's plugin: it fails the kit
            raise AssertionError(f"backend {self.spec.name!r} fails the kit: {exc}") from exc
        self._opened.append(store)
        return Harness(
            store.backend,
            pool,
            store,
            plan.keyer(),
            plan.geometry,
            plan.layout,
            seed,
            _adopt=self.adopt,
        )

    def adopt(self, store: Store) -> Store:
        """Close ``store`` with the stores this env opened (a store a mixin put in front of
        one of them); returns it."""
        self._opened.append(store)
        return store

    def close_all(self) -> None:
        """Close every store opened (each closes its backend, once)."""
        for store in reversed(self._opened):
            with contextlib.suppress(Exception):
                store.close()
        self._opened.clear()


def _expand(value: Any, tmp: Path) -> Any:
    if isinstance(value, str):
        return value.replace("{tmp}", str(tmp))
    if isinstance(value, Mapping):
        return {k: _expand(v, tmp) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, tmp) for v in value]
    return value


class BackendKit:
    """The fixture class a backend's test module subclasses (with one or more mixins).

    Set ``backend_name``; set ``extra_config`` (``"{tmp}"`` in a string becomes a fresh
    per-test directory) or override :meth:`backend_config`; list plugin modules that are
    not installed through an entry point in ``plugins`` as ``(name, module)`` pairs.
    """

    backend_name: ClassVar[str] = ""
    extra_config: ClassVar[Mapping[str, Any]] = {}
    plugins: ClassVar[Sequence[tuple[str, object]]] = ()

    def backend_config(self, tmp: Path) -> dict[str, Any]:
        """The backend's extra-config for one test; ``tmp`` is a fresh private directory."""
        expanded = _expand(dict(self.extra_config), tmp)
        assert isinstance(expanded, dict)
        return expanded

    @pytest.fixture
    def kit_spec(self) -> BackendSpec:
        """The backend's spec, from a registry loaded as kvtier loads one."""
        if not self.backend_name:
            pytest.fail(f"{type(self).__name__} must set backend_name")
        return load_kit_registry(self.plugins).backend(self.backend_name)

    @pytest.fixture
    def kit(self, kit_spec: BackendSpec, tmp_path: Path) -> Iterator[KitEnv]:
        """Builds this test's backends and closes them afterwards."""
        tmp = tmp_path / "kit"
        tmp.mkdir(mode=0o700)
        io_backends = load_kit_registry(self.plugins).io_backends
        env = KitEnv(kit_spec, self.backend_config(tmp), self.plugins, tmp, io_backends)
        try:
            yield env
        finally:
            env.close_all()


def load_kit_registry(plugins: Sequence[tuple[str, object]]) -> Registry:
    """A fresh registry, as kvtier loads one; listed plugins replace entry-point discovery."""
    from kvtier.plugins.manager import load_registry

    autoload = False if plugins else None  # None: as KVTIER_DISABLE_PLUGIN_AUTOLOAD says
    return load_registry(autoload=autoload, plugins=plugins)


def require_feature(env: KitEnv, feature: Feature) -> None:
    """Skip the test unless the backend's spec declares ``feature`` (a test needs it)."""
    if feature not in env.spec.features:
        pytest.skip(f"backend {env.spec.name!r} does not declare feature {feature.value!r}")
