"""The conformance kit: test mixins any storage backend runs to prove it keeps the contract.

A backend author writes one test module::

    from kvtier.testing import BackendKit, ConformanceTests

    class TestMyBackend(BackendKit, ConformanceTests):
        backend_name = "my_backend"
        extra_config = {"path": "{tmp}/pages.db"}   # "{tmp}": a fresh directory per test

The kit builds the backend the way kvtier does, through the one construction path
(registry -> :func:`~kvtier.core.capabilities.resolve`, which validates the config and runs
``validate_plan`` -> :func:`~kvtier.core.capabilities.open_page_store`, which calls the
factory), puts a small host pool and a :class:`PageStore` in front of it and checks:
round trips, prefix ``exists``, misses, overwrites, delete and clear, concurrent puts,
corrupt / truncated / foreign pages (through :class:`FaultyBackend`), every declared
layout and attention kind, and, when the spec declares them, persistence across reopen
and sharing between processes. A test is skipped only when the backend's
spec says it lacks what the test needs.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import subprocess
import sys
import threading
import types
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pytest

from kvtier.core.capabilities import ResolvedPlan, build_host_pool, open_page_store, resolve
from kvtier.core.config import EngineConfig
from kvtier.core.envelope import ENVELOPE_BYTES
from kvtier.core.errors import PluginError
from kvtier.core.geometry import AttentionKind, KVGeometry, dtype_name
from kvtier.core.host_pool import HostPool
from kvtier.core.io import DIRECT_SPEC, KERNEL_SPEC
from kvtier.core.keys import PageKeyer
from kvtier.core.layout import Layout, layouts_for
from kvtier.core.pagestore import PageStore, VerifyMode
from kvtier.core.specs import BackendSpec, Feature, IOBackendSpec, Operation
from kvtier.core.storage import StorageBackend
from kvtier.testing.faults import FaultyBackend

if TYPE_CHECKING:
    from kvtier.plugins.registry import Registry

__all__ = [
    "BackendKit",
    "ConcurrencyTests",
    "ConformanceTests",
    "DeleteClearTests",
    "Harness",
    "IntegrityTests",
    "KitEnv",
    "LayoutTests",
    "MissTests",
    "OverwriteTests",
    "PersistenceTests",
    "PrefixExistsTests",
    "RoundTripTests",
    "SharedProcessesTests",
    "default_geometry",
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
    kind = AttentionKind(attention)
    fields = {"attention": kind.value, **_GEOMETRY_FIELDS[kind], **_PAGE_FIELDS}
    return EngineConfig.from_mapping(fields).geometry()


def _random_bytes(rng: random.Random, n: int) -> bytes:
    return rng.getrandbits(n * 8).to_bytes(n, "little") if n else b""


@dataclass
class Harness:
    """One backend behind a host pool and a PageStore, with helpers to make test data."""

    backend: StorageBackend
    pool: HostPool
    store: PageStore
    keyer: PageKeyer
    geometry: KVGeometry
    layout: Layout
    seed: int = 0
    _tokens: int = field(default=0, repr=False)

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
                extent.view[:] = _random_bytes(rng, extent.length)

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

    def store_with(self, backend: StorageBackend, verify: VerifyMode = "full") -> PageStore:
        """Another PageStore over this pool (a wrapped backend, another verify mode)."""
        return PageStore(backend, self.pool, fingerprint=self.geometry.fingerprint, verify=verify)


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
        self._opened: list[StorageBackend] = []

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
        self._opened.append(store.backend)
        return Harness(store.backend, pool, store, plan.keyer(), plan.geometry, plan.layout, seed)

    def close_all(self) -> None:
        for backend in reversed(self._opened):
            with contextlib.suppress(Exception):
                backend.close()
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
        return _load_spec(self.backend_name, self.plugins)

    @pytest.fixture
    def kit(self, kit_spec: BackendSpec, tmp_path: Path) -> Iterator[KitEnv]:
        """Builds this test's backends and closes them afterwards."""
        tmp = tmp_path / "kit"
        tmp.mkdir(mode=0o700)
        io_backends = _load_registry(self.plugins).io_backends
        env = KitEnv(kit_spec, self.backend_config(tmp), self.plugins, tmp, io_backends)
        try:
            yield env
        finally:
            env.close_all()


def _load_registry(plugins: Sequence[tuple[str, object]]) -> Registry:
    """A fresh registry, as kvtier loads one; listed plugins replace entry-point discovery."""
    from kvtier.plugins.manager import load_registry

    autoload = False if plugins else None  # None: as KVTIER_DISABLE_PLUGIN_AUTOLOAD says
    return load_registry(autoload=autoload, plugins=plugins)


def _load_spec(name: str, plugins: Sequence[tuple[str, object]]) -> BackendSpec:
    """Look ``name`` up in a fresh registry (see :func:`_load_registry`)."""
    return _load_registry(plugins).backend(name)


def _require(env: KitEnv, feature: Feature) -> None:
    if feature not in env.spec.features:
        pytest.skip(f"backend {env.spec.name!r} does not declare feature {feature.value!r}")


# --- the mixins -----------------------------------------------------------------------


class RoundTripTests:
    """Pages come back bit-exact, through the PageStore and through the raw contract."""

    def test_kit_round_trip(self, kit: KitEnv) -> None:
        h = kit.open()
        pages = h.pool.allocate(4)
        keys = h.keys(4)
        h.fill(pages, seed=1)
        expected = h.payloads(pages)
        assert h.store.put(keys, pages) == [True] * 4
        h.scribble(pages)
        assert h.store.get(keys, pages) == [True] * 4
        assert h.payloads(pages) == expected
        assert h.store.stats()["invalid"] == 0

    def test_kit_get_into_other_pages(self, kit: KitEnv) -> None:
        h = kit.open()
        src, dst = h.pool.allocate(3), h.pool.allocate(3)
        keys = h.keys(3)
        h.fill(src, seed=2)
        assert h.store.put(keys, src) == [True] * 3
        h.scribble(dst)
        assert h.store.get(keys, dst) == [True] * 3
        assert h.payloads(dst) == h.payloads(src)

    def test_kit_raw_regions_round_trip(self, kit: KitEnv) -> None:
        h = kit.open()
        a, b = h.pool.allocate(2)
        h.fill([a], seed=3)
        h.pool.header_extent(a).view[:] = _random_bytes(random.Random(3), ENVELOPE_BYTES)
        (key,) = h.keys(1)
        assert h.backend.put([key], [h.pool.page_buffers(a)]) == [True]
        h.scribble([b])
        assert h.backend.get([key], [h.pool.page_buffers(b)]) == [True]
        got = b"".join(bytes(e.view) for e in h.pool.page_buffers(b))
        assert got == b"".join(bytes(e.view) for e in h.pool.page_buffers(a))

    def test_kit_empty_batches(self, kit: KitEnv) -> None:
        h = kit.open()
        assert h.backend.exists([]) == []
        assert h.backend.get([], []) == []
        assert h.backend.put([], []) == []
        assert h.backend.delete([]) == []

    def test_kit_stats_and_close(self, kit: KitEnv) -> None:
        h = kit.open()
        pages = h.pool.allocate(1)
        h.store.put(h.keys(1), pages)
        stats = h.backend.stats()
        assert isinstance(stats, dict)
        assert all(isinstance(k, str) and isinstance(v, (int, float)) for k, v in stats.items())
        h.backend.close()
        h.backend.close()  # idempotent


class PrefixExistsTests:
    """``exists`` answers per key; the core's prefix hits stop at the first gap."""

    def test_kit_prefix_hits(self, kit: KitEnv) -> None:
        h = kit.open()
        keys = h.keys(8)
        pages = h.pool.allocate(8)
        h.fill(pages, seed=4)
        assert h.store.put(keys[:5], pages[:5]) == [True] * 5
        assert h.store.prefix_hits(keys) == 5
        assert h.store.exists(keys) == [True] * 5 + [False] * 3
        assert h.store.put([keys[7]], [pages[7]]) == [True]
        assert h.store.prefix_hits(keys) == 5
        assert h.backend.exists(keys) == [True] * 5 + [False, False, True]

    def test_kit_exists_repeated_keys(self, kit: KitEnv) -> None:
        h = kit.open()
        (key,) = h.keys(1)
        (other,) = h.keys(1)
        h.store.put([key], h.pool.allocate(1))
        assert h.backend.exists([key, other, key]) == [True, False, True]


class MissTests:
    """A missing key is an ordinary False, never an exception, in any batch position."""

    def test_kit_get_missing(self, kit: KitEnv) -> None:
        h = kit.open()
        pages = h.pool.allocate(3)
        assert h.store.get(h.keys(3), pages) == [False] * 3
        assert h.store.stats()["misses"] == 3
        assert h.store.stats()["backend_errors"] == 0

    def test_kit_mixed_hits_and_misses(self, kit: KitEnv) -> None:
        h = kit.open()
        keys = h.keys(6)
        pages = h.pool.allocate(6)
        h.fill(pages, seed=5)
        expected = h.payloads(pages)
        stored = [0, 2, 5]
        assert h.store.put([keys[i] for i in stored], [pages[i] for i in stored]) == [True] * 3
        h.scribble(pages)
        results = h.store.get(keys, pages)
        assert results == [i in stored for i in range(6)]
        for i in stored:
            assert h.payload(pages[i]) == expected[i]
        assert h.store.stats()["backend_errors"] == 0

    def test_kit_delete_missing(self, kit: KitEnv) -> None:
        h = kit.open()
        assert h.backend.delete(h.keys(2)) == [False, False]


class OverwriteTests:
    """A second put of a key replaces the page; a get returns the new one, whole."""

    def test_kit_overwrite(self, kit: KitEnv) -> None:
        h = kit.open()
        (key,) = h.keys(1)
        first, second, out = h.pool.allocate(3)
        h.fill([first], seed=6)
        h.fill([second], seed=7)
        assert h.store.put([key], [first]) == [True]
        assert h.store.put([key], [second]) == [True]
        h.scribble([out])
        assert h.store.get([key], [out]) == [True]
        assert h.payload(out) == h.payload(second) != h.payload(first)

    def test_kit_same_key_twice_in_one_batch(self, kit: KitEnv) -> None:
        h = kit.open()
        (key,) = h.keys(1)
        a, b, out = h.pool.allocate(3)
        h.fill([a], seed=8)
        h.fill([b], seed=9)
        assert h.store.put([key, key], [a, b]) == [True, True]
        assert h.store.get([key], [out]) == [True]
        assert h.payload(out) in (h.payload(a), h.payload(b))


class DeleteClearTests:
    """``delete`` removes keys and says which were there; ``clear`` empties the store."""

    def test_kit_delete(self, kit: KitEnv) -> None:
        h = kit.open()
        keys = h.keys(3)
        pages = h.pool.allocate(3)
        assert h.store.put(keys, pages) == [True] * 3
        assert h.backend.delete(keys[:2]) == [True, True]
        assert h.backend.delete(keys[:1]) == [False]
        assert h.backend.exists(keys) == [False, False, True]
        assert h.store.get(keys, pages) == [False, False, True]

    def test_kit_clear(self, kit: KitEnv) -> None:
        h = kit.open()
        keys = h.keys(4)
        pages = h.pool.allocate(4)
        assert h.store.put(keys, pages) == [True] * 4
        h.backend.clear()
        assert h.backend.exists(keys) == [False] * 4
        assert h.store.get(keys, pages) == [False] * 4
        h.backend.clear()  # clearing an empty store is fine
        assert h.store.put(keys[:1], pages[:1]) == [True]  # and it keeps serving
        assert h.backend.exists(keys[:1]) == [True]


class ConcurrencyTests:
    """Puts and gets from several threads at once: every page whole, no torn reads."""

    threads: ClassVar[int] = 6

    def test_kit_concurrent_puts(self, kit: KitEnv) -> None:
        h = kit.open(num_pages=4 * self.threads + self.threads)
        shared = h.keys(1)[0]
        work = [(h.keys(4), h.pool.allocate(4)) for _ in range(self.threads)]
        out = h.pool.allocate(self.threads)
        for i, (_keys, pages) in enumerate(work):
            h.fill(pages, seed=100 + i)
        expected = {
            k: h.payload(p) for keys, pages in work for k, p in zip(keys, pages, strict=True)
        }
        candidates = {h.payload(pages[0]) for _keys, pages in work}
        errors: list[BaseException] = []
        start = threading.Barrier(self.threads)

        def writer(keys: list[str], pages: list[int]) -> None:
            try:
                start.wait()
                assert h.store.put(keys, pages) == [True] * len(keys)
                assert h.store.put([shared], pages[:1]) == [True]
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=item) for item in work]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for keys, _pages in work:
            h.scribble(out[:4])
            assert h.store.get(keys, out[:4]) == [True] * 4
            assert h.payloads(out[:4]) == [expected[k] for k in keys]
        assert h.store.get([shared], out[:1]) == [True]
        assert h.payload(out[0]) in candidates

    def test_kit_readers_never_see_torn_pages(self, kit: KitEnv) -> None:
        h = kit.open(num_pages=12)
        (key,) = h.keys(1)
        sources = h.pool.allocate(4)
        for i, page in enumerate(sources):
            h.fill([page], seed=200 + i)
        versions = set(h.payloads(sources))
        assert h.store.put([key], sources[:1]) == [True]
        readers_out = h.pool.allocate(4)
        stop = threading.Event()
        errors: list[BaseException] = []

        def write() -> None:
            try:
                for round_ in range(30):
                    h.store.put([key], [sources[round_ % len(sources)]])
            except BaseException as exc:
                errors.append(exc)
            finally:
                stop.set()

        def read(page: int) -> None:
            try:
                while not stop.is_set():
                    if h.store.get([key], [page]) == [True]:
                        assert h.payload(page) in versions
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=write)]
        threads += [threading.Thread(target=read, args=(p,)) for p in readers_out]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert h.store.stats()["invalid"] == 0, "a reader saw a torn page"


class IntegrityTests:
    """Corrupt, truncated and foreign pages never reach the pool as data."""

    def test_kit_bit_flips_in_payload_are_rejected(self, kit: KitEnv) -> None:
        h = kit.open()
        keys, pages = h.keys(6), h.pool.allocate(6)
        h.fill(pages, seed=10)
        assert h.store.put(keys, pages) == [True] * 6
        faulty = FaultyBackend(h.backend, seed=1, bit_flip_rate=1.0, flip_in="payload")
        store = h.store_with(faulty)
        assert store.get(keys, pages) == [False] * 6
        assert store.stats()["invalid"] == 6
        assert store.stats()["invalid_corrupt_checksum"] == 6

    def test_kit_bit_flips_in_header_are_rejected_even_header_only(self, kit: KitEnv) -> None:
        h = kit.open()
        keys, pages = h.keys(6), h.pool.allocate(6)
        assert h.store.put(keys, pages) == [True] * 6
        faulty = FaultyBackend(h.backend, seed=2, bit_flip_rate=1.0, flip_in="header")
        store = h.store_with(faulty, verify="header")
        assert store.get(keys, pages) == [False] * 6
        assert store.stats()["invalid"] == 6

    def test_kit_truncated_pages_are_misses(self, kit: KitEnv) -> None:
        h = kit.open()
        keys, pages = h.keys(6), h.pool.allocate(6)
        h.fill(pages, seed=11)
        faulty = FaultyBackend(h.backend, seed=3, truncate_rate=1.0)
        h.store_with(faulty).put(keys, pages)  # the backend may accept or refuse them
        assert faulty.injected["truncations"] == 6
        h.scribble(pages)
        assert h.store.get(keys, pages) == [False] * 6

    def test_kit_random_faults_never_yield_bad_data(self, kit: KitEnv) -> None:
        h = kit.open(num_pages=24)
        keys, pages = h.keys(12), h.pool.allocate(12)
        h.fill(pages, seed=12)
        expected = h.payloads(pages)
        faulty = FaultyBackend(
            h.backend, seed=4, fail_rate=0.2, bit_flip_rate=0.3, truncate_rate=0.2
        )
        store = h.store_with(faulty)
        put = store.put(keys, pages)
        for _ in range(3):
            h.scribble(pages)
            got = store.get(keys, pages)
            for i, ok in enumerate(got):
                if ok:
                    assert put[i] and h.payload(pages[i]) == expected[i]
        assert sum(faulty.injected.values()) > 0

    def test_kit_backend_exceptions_are_contained(self, kit: KitEnv) -> None:
        h = kit.open()
        keys, pages = h.keys(3), h.pool.allocate(3)
        store = h.store_with(FaultyBackend(h.backend, error_rate=1.0))
        assert store.put(keys, pages) == [False] * 3
        assert store.get(keys, pages) == [False] * 3
        assert store.exists(keys) == [False] * 3
        assert store.stats()["backend_errors"] == 3

    def test_kit_foreign_geometry_is_rejected(self, kit: KitEnv) -> None:
        h = kit.open()
        keys, pages = h.keys(2), h.pool.allocate(2)
        foreign = PageStore(h.backend, h.pool, fingerprint="0123456789abcdef")
        assert foreign.put(keys, pages) == [True, True]
        assert h.store.get(keys, pages) == [False, False]
        assert h.store.stats()["invalid_wrong_geometry"] == 2

    def test_kit_page_stored_under_another_key_is_rejected(self, kit: KitEnv) -> None:
        h = kit.open()
        right, wrong = h.keys(2)
        page, out = h.pool.allocate(2)
        assert h.store.put([right], [page]) == [True]
        # the same bytes, envelope for ``right``, stored under ``wrong``
        assert h.backend.put([wrong], [h.pool.page_buffers(page)]) == [True]
        assert h.store.get([wrong], [out]) == [False]
        assert h.store.stats()["invalid_wrong_key"] == 1

    def test_kit_page_of_another_layout_is_rejected(self, kit: KitEnv) -> None:
        attention = kit.default_attention()
        declared = [lay for lay in layouts_for(attention) if kit.supports(attention, lay)]
        if len(declared) < 2:
            pytest.skip(f"backend {kit.spec.name!r} declares fewer than two layouts")
        h = kit.open(attention=attention, layout=declared[0])
        keys, pages = h.keys(2), h.pool.allocate(2)
        assert h.store.put(keys, pages) == [True, True]
        other = build_host_pool(kit.plan(attention, declared[1]), num_pages=2, pin_memory=False)
        store = PageStore(h.backend, other, fingerprint=h.geometry.fingerprint)
        assert store.get(keys, other.allocate(2)) == [False, False]
        assert store.stats()["invalid"] == 2


class LayoutTests:
    """Every declared (attention, layout) round-trips; undeclared ones are skipped."""

    @pytest.mark.parametrize(
        ("attention", "layout"),
        [(a, lay) for a in AttentionKind for lay in layouts_for(a)],
        ids=lambda v: str(v),
    )
    def test_kit_layout_round_trip(
        self, kit: KitEnv, attention: AttentionKind, layout: Layout
    ) -> None:
        if not kit.supports(attention, layout):
            pytest.skip(f"backend {kit.spec.name!r} does not declare {attention}/{layout}")
        h = kit.open(attention=attention, layout=layout)
        keys, pages = h.keys(3), h.pool.allocate(3)
        h.fill(pages, seed=13)
        expected = h.payloads(pages)
        assert h.store.put(keys, pages) == [True] * 3
        h.scribble(pages)
        assert h.store.get(keys, pages) == [True] * 3
        assert h.payloads(pages) == expected


class PersistenceTests:
    """``persistent``: pages survive closing the backend and building a new one."""

    def test_kit_survives_reopen(self, kit: KitEnv) -> None:
        _require(kit, Feature.PERSISTENT)
        h = kit.open()
        keys, pages = h.keys(3), h.pool.allocate(3)
        h.fill(pages, seed=14)
        expected = h.payloads(pages)
        assert h.store.put(keys, pages) == [True] * 3
        h.backend.close()
        again = kit.open()
        assert again.store.exists(keys) == [True] * 3
        out = again.pool.allocate(3)
        assert again.store.get(keys, out) == [True] * 3
        assert again.payloads(out) == expected


def _module_name(plugin: object) -> str:
    if isinstance(plugin, types.ModuleType):
        return plugin.__name__
    pytest.fail(
        f"plugin {plugin!r} is not a module; the shared-processes test loads plugins in a "
        "child process, so list them in BackendKit.plugins as (name, module) pairs"
    )


class SharedProcessesTests:
    """``shared_processes``: pages one process puts, another process finds and reads."""

    def test_kit_pages_from_another_process(self, kit: KitEnv) -> None:
        _require(kit, Feature.SHARED_PROCESSES)
        h = kit.open()  # opened first: the child's pages are not in its start-up state
        attention = h.geometry.attention
        keys = h.keys(3)
        job = {
            "backend": kit.spec.name,
            "config": kit.config,
            "plugins": [[name, _module_name(p)] for name, p in kit.plugins],
            "geometry": {
                "attention": attention.value,
                "num_layers": h.geometry.num_layers,
                "num_kv_heads": h.geometry.num_kv_heads,
                "head_dim": h.geometry.head_dim,
                "dtype": dtype_name(h.geometry.dtype),
                "page_size": h.geometry.page_size,
            },
            "layout": h.layout.value,
            "model": kit.model,
            "keys": keys,
            "seed": 15,
        }
        done = subprocess.run(
            [sys.executable, "-c", "from kvtier.testing.kit import _child_put; _child_put()"],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env={**os.environ, "PYTHONWARNINGS": "error"},
        )
        assert done.returncode == 0, f"child process failed:\n{done.stdout}\n{done.stderr}"
        pages = h.pool.allocate(3)
        h.fill(pages, seed=15)
        expected = h.payloads(pages)
        h.scribble(pages)
        assert h.store.exists(keys) == [True] * 3
        assert h.store.get(keys, pages) == [True] * 3
        assert h.payloads(pages) == expected


def _child_put() -> None:
    """Child side of :class:`SharedProcessesTests`: build the backend, put seeded pages."""
    import importlib

    job = json.loads(sys.stdin.read())
    plugins = [(name, importlib.import_module(module)) for name, module in job["plugins"]]
    registry = _load_registry(plugins)
    env = KitEnv(
        registry.backend(job["backend"]), job["config"], plugins, Path("."), registry.io_backends
    )
    env.model = job["model"]
    g = job["geometry"]
    geometry = KVGeometry(
        AttentionKind(g["attention"]),
        g["num_layers"],
        g["num_kv_heads"],
        g["head_dim"],
        g["dtype"],
        g["page_size"],
    )
    assert geometry == default_geometry(geometry.attention)
    h = env.open(attention=geometry.attention, layout=Layout(job["layout"]))
    pages = h.pool.allocate(len(job["keys"]))
    h.fill(pages, seed=job["seed"])
    results = h.store.put(job["keys"], pages)
    env.close_all()
    if results != [True] * len(pages):
        raise SystemExit(f"child put failed: {results}")


class ConformanceTests(
    RoundTripTests,
    PrefixExistsTests,
    MissTests,
    OverwriteTests,
    DeleteClearTests,
    ConcurrencyTests,
    IntegrityTests,
    LayoutTests,
    PersistenceTests,
    SharedProcessesTests,
):
    """Every mixin of the kit; what a backend's test class normally inherits."""
