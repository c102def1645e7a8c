"""The ``mooncake`` backend against a real ``mooncake_master`` on loopback.

A session master (with a storage node holding the pages) serves most tests; the fault
tests start their own masters so that killing one disturbs nothing else. Without the
Mooncake package or binaries the tests skip, unless KVTIER_REQUIRE_MOONCAKE=1 (CI), where
they fail.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.backends.mooncake import MOONCAKE_SPEC, MooncakeConfig
from kvtier.core.envelope import ENVELOPE_BYTES
from kvtier.core.errors import ConfigError, StorageError
from kvtier.core.extents import extent_of_tensor
from kvtier.core.geometry import KVGeometry
from kvtier.core.host_pool import HostPool
from kvtier.core.layout import Layout
from kvtier.core.specs import Feature
from kvtier.core.storage import BackendContext, StorageBackend
from kvtier.core.validation import validate_model
from kvtier.testing import (
    BackendKit,
    ConcurrencyTests,
    DeleteClearTests,
    IntegrityTests,
    LayoutTests,
    MissTests,
    OverwriteTests,
    PrefixExistsTests,
    RoundTripTests,
    SharedProcessesTests,
    require,
)
from kvtier.testing.mooncake import (
    MooncakeMaster,
    free_port,
    mooncake_unavailable_reason,
    use_client_env,
)

pytestmark = pytest.mark.mooncake

GEOMETRY = KVGeometry.mha(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", page_size=16)
REPO = Path(__file__).resolve().parents[1]


def _config(address: str, **overrides: Any) -> MooncakeConfig:
    data: dict[str, Any] = {"master_address": address, "global_segment_size": 0}
    data.update(overrides)
    return MooncakeConfig(**data)


@pytest.fixture
def open_backend(mooncake_master: MooncakeMaster) -> Iterator[Any]:
    """Builds backends (fresh namespace each unless given) and closes them afterwards."""
    opened: list[StorageBackend] = []

    def build(
        *, namespace: str | None = None, layout: Layout = Layout.PAGE_FIRST, **overrides: Any
    ) -> Any:
        from kvtier.backends.mooncake.backend import MooncakeBackend

        address = overrides.pop("master_address", mooncake_master.address)
        context = BackendContext(
            GEOMETRY, layout, namespace=namespace or f"t-{uuid.uuid4().hex[:12]}"
        )
        backend = MooncakeBackend(_config(address, **overrides), context)
        opened.append(backend)
        return backend

    yield build
    for backend in reversed(opened):
        backend.close()


def _pool(layout: Layout, pages: int = 8) -> HostPool:
    return HostPool(GEOMETRY, layout, num_pages=pages, pin_memory=False)


def _fill(pool: HostPool, pages: list[int], seed: int) -> list[bytes]:
    """Fill header and payload regions of ``pages`` with seeded bytes; return them."""
    out = []
    for i, page in enumerate(pages):
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        for extent in pool.page_buffers(page):
            data = torch.randint(0, 256, (extent.length,), dtype=torch.uint8, generator=gen)
            extent.view[:] = data.numpy().tobytes()
        out.append(_content(pool, page))
    return out


def _content(pool: HostPool, page: int) -> bytes:
    return b"".join(bytes(e.view) for e in pool.page_buffers(page))


def _scribble(pool: HostPool, pages: list[int]) -> None:
    for page in pages:
        for extent in pool.page_buffers(page):
            extent.view[:] = b"\x5a" * extent.length


# --- declaration ----------------------------------------------------------------------


def test_declaring_does_not_import_mooncake() -> None:
    code = (
        "import sys, kvtier.backends.mooncake as m; "
        "print(int('mooncake' in sys.modules), m.MOONCAKE_SPEC.name)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.split() == ["0", "mooncake"]


def test_spec_is_registered_with_features_and_install_hint() -> None:
    from kvtier.plugins.manager import load_registry

    spec = load_registry().backend("mooncake")
    assert spec is MOONCAKE_SPEC
    assert spec.requires == ("mooncake",)
    assert spec.features == {
        Feature.SHARED_PROCESSES,
        Feature.SHARED_NODES,
        Feature.ZERO_COPY,
        Feature.REPORTS_SPACE,
    }
    assert "kvtier[mooncake]" in spec.install_hint
    assert "kvtier[mooncake-cpu]" in spec.install_hint
    assert isinstance(spec.factory, str)


def test_config_rejects_unknown_keys_and_bad_values() -> None:
    model = MOONCAKE_SPEC.config_model
    ok = validate_model(model, {"master_address": "10.0.0.5:50051"}, where="mooncake")
    assert isinstance(ok, MooncakeConfig)
    assert ok.metadata_server == "P2PHANDSHAKE" and ok.protocol == "tcp"
    assert ok.overwrite == "replace"
    parsed = validate_model(
        model,
        {"master_address": "m:1", "global_segment_size": "4GiB", "device_names": ["mlx5_0"]},
        where="mooncake",
    )
    assert parsed.global_segment_size == 4 << 30 and parsed.device_names == ("mlx5_0",)
    with pytest.raises(ConfigError, match="master_adress"):
        validate_model(model, {"master_adress": "h:1"}, where="mooncake")
    for bad in (
        {"master_address": "nohostport"},
        {"master_address": "h:70000"},
        {"master_address": "h:1", "protocol": "udp"},
        {"master_address": "h:1", "replica_num": 0},
        {"master_address": "h:1", "key_prefix": "a/b"},
        {"master_address": "h:1", "device_names": ["a,b"]},
        {"master_address": "h:1", "capacity_bytes": 0},
        {},
    ):
        with pytest.raises(ConfigError):
            validate_model(model, bad, where="mooncake")
    # Mooncake's own setup fails below 16 MiB with a bare INVALID_PARAMS: say so up front
    with pytest.raises(ConfigError, match=r"global_segment_size.*16 MiB.*'16MiB'"):
        validate_model(
            model, {"master_address": "h:1", "global_segment_size": "4MiB"}, where="mooncake"
        )
    assert validate_model(
        model, {"master_address": "h:1", "capacity_bytes": "8GiB"}, where="mooncake"
    ).capacity_bytes == (8 << 30)


# --- data path ------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [Layout.PAGE_FIRST, Layout.LAYER_FIRST])
def test_round_trip_multi_extent_pages(open_backend: Any, layout: Layout) -> None:
    backend = open_backend(layout=layout)
    pool = _pool(layout)
    backend.attach(pool)
    src, dst = pool.allocate(3), pool.allocate(3)
    assert len(pool.page_buffers(src[0])) >= 3  # header + K + V (+ more for layer_first)
    expected = _fill(pool, src, seed=1)
    keys = [f"rt-{i}" for i in range(3)]
    assert backend.put(keys, [pool.page_buffers(p) for p in src]) == [True] * 3
    _scribble(pool, dst)
    assert backend.get(keys, [pool.page_buffers(p) for p in dst]) == [True] * 3
    assert [_content(pool, p) for p in dst] == expected
    stats = backend.stats()
    assert stats["put_ok"] == 3 and stats["get_hits"] == 3
    assert stats.get("staged_pages", 0) == 0  # attached memory moves zero-copy


def test_round_trip_single_extent_page(open_backend: Any) -> None:
    backend = open_backend()
    memory = torch.empty(4 * (ENVELOPE_BYTES + 20000), dtype=torch.uint8)
    backend.register_memory([extent_of_tensor(memory)])
    size = ENVELOPE_BYTES + 20000
    src = extent_of_tensor(memory[:size])
    dst = extent_of_tensor(memory[size : 2 * size])
    src.view[:] = torch.randint(0, 256, (size,), dtype=torch.uint8).numpy().tobytes()
    assert backend.put(["one"], [[src]]) == [True]
    assert backend.get(["one"], [[dst]]) == [True]
    assert bytes(dst.view) == bytes(src.view)
    # adjacent extents are merged: two halves of one region round-trip the same object
    halves = [
        extent_of_tensor(memory[2 * size : 2 * size + 4096]),
        extent_of_tensor(memory[2 * size + 4096 : 3 * size]),
    ]
    assert backend.get(["one"], [halves]) == [True]
    assert bytes(halves[0].view) + bytes(halves[1].view) == bytes(src.view)


def test_exists_and_misses_are_ordinary(open_backend: Any) -> None:
    backend = open_backend()
    pool = _pool(Layout.PAGE_FIRST)
    backend.attach(pool)
    pages = pool.allocate(4)
    expected = _fill(pool, pages, seed=2)
    assert backend.put(["a", "c"], [pool.page_buffers(pages[0]), pool.page_buffers(pages[2])])
    assert backend.exists(["a", "b", "c", "d", "a"]) == [True, False, True, False, True]
    _scribble(pool, pages)
    got = backend.get(["a", "b", "c", "d"], [pool.page_buffers(p) for p in pages])
    assert got == [True, False, True, False]
    assert _content(pool, pages[0]) == expected[0] and _content(pool, pages[2]) == expected[2]
    stats = backend.stats()
    assert stats["get_misses"] == 2
    assert not [name for name in stats if "_failed." in name]
    assert backend.exists([]) == [] and backend.get([], []) == [] and backend.put([], []) == []


def test_page_of_another_size_is_a_counted_failure(open_backend: Any) -> None:
    backend = open_backend()
    pool = _pool(Layout.PAGE_FIRST)
    backend.attach(pool)
    (page,) = pool.allocate(1)
    assert backend.put(["k"], [pool.page_buffers(page)]) == [True]
    short = pool.page_buffers(page)[:-1]  # the buffers are smaller than the object
    assert backend.get(["k"], [short]) == [False]
    assert any(name.startswith("get_failed.") for name in backend.stats())


def test_overwrite_replace_gives_the_new_page(open_backend: Any) -> None:
    backend = open_backend()
    pool = _pool(Layout.PAGE_FIRST)
    backend.attach(pool)
    first, second, out = pool.allocate(3)
    old, new = _fill(pool, [first], seed=3)[0], _fill(pool, [second], seed=4)[0]
    assert backend.put(["k"], [pool.page_buffers(first)]) == [True]
    assert backend.put(["k"], [pool.page_buffers(second)]) == [True]
    assert backend.get(["k"], [pool.page_buffers(out)]) == [True]
    assert _content(pool, out) == new != old


def test_overwrite_keep_is_first_write_wins(open_backend: Any) -> None:
    backend = open_backend(overwrite="keep")
    pool = _pool(Layout.PAGE_FIRST)
    backend.attach(pool)
    first, second, out = pool.allocate(3)
    old = _fill(pool, [first], seed=5)[0]
    _fill(pool, [second], seed=6)
    assert backend.put(["k"], [pool.page_buffers(first)]) == [True]
    assert backend.put(["k"], [pool.page_buffers(second)]) == [True]
    assert backend.get(["k"], [pool.page_buffers(out)]) == [True]
    assert _content(pool, out) == old


def test_a_readers_lease_defers_a_delete_and_the_key_is_gone_for_this_client(
    open_backend: Any,
) -> None:
    backend = open_backend()
    other = open_backend(namespace=backend.context.namespace)  # another client, same keys
    pool = _pool(Layout.PAGE_FIRST)
    backend.attach(pool)
    other.attach(pool)
    first, second, out = pool.allocate(3)
    old = _fill(pool, [first], seed=7)[0]
    _fill(pool, [second], seed=8)
    assert backend.put(["k"], [pool.page_buffers(first)]) == [True]
    assert backend.get(["k"], [pool.page_buffers(out)]) == [True]  # takes a lease
    # Mooncake refuses to remove a leased object: this client hides it from then on
    assert backend.delete(["k"]) == [True]
    assert backend.exists(["k"]) == [False]
    _scribble(pool, [out])
    assert backend.get(["k"], [pool.page_buffers(out)]) == [False]
    # never put over the stale object (Mooncake would keep the old value)
    assert backend.put(["k"], [pool.page_buffers(second)]) == [False]
    stats = backend.stats()
    assert stats["delete_deferred"] == 1 and stats["put_failed.DELETE_PENDING"] == 1
    assert "delete_failed.OBJECT_HAS_LEASE" not in stats
    # another client sees the old object, whole, until the lease ends (the documented limit)
    _scribble(pool, [out])
    assert other.get(["k"], [pool.page_buffers(out)]) == [True]
    assert _content(pool, out) == old


def test_a_deferred_delete_is_retried_until_the_lease_ends() -> None:
    require("mooncake", mooncake_unavailable_reason())
    use_client_env()
    from kvtier.backends.mooncake.backend import MooncakeBackend

    master = MooncakeMaster(lease_ttl_ms=300).start()
    backend = None
    try:
        context = BackendContext(GEOMETRY, Layout.PAGE_FIRST, namespace="deferred")
        backend = MooncakeBackend(_config(master.address, global_segment_size=16 << 20), context)
        pool = _pool(Layout.PAGE_FIRST)
        backend.attach(pool)
        first, second, out = pool.allocate(3)
        _fill(pool, [first], seed=11)
        new = _fill(pool, [second], seed=12)[0]
        assert backend.put(["k"], [pool.page_buffers(first)]) == [True]
        assert backend.get(["k"], [pool.page_buffers(out)]) == [True]  # a 0.3 s lease
        assert backend.delete(["k"]) == [True]
        assert backend.stats()["delete_deferred"] == 1
        deadline = time.monotonic() + 10
        while backend.stats().get("delete_deferred_done", 0) == 0:
            assert time.monotonic() < deadline, "the deferred delete was never retried"
            assert backend.exists(["k"]) == [False]  # each call retries the removal
            time.sleep(0.05)
        # removed from the store: a put of the key stores the new page
        assert backend.put(["k"], [pool.page_buffers(second)]) == [True]
        _scribble(pool, [out])
        assert backend.get(["k"], [pool.page_buffers(out)]) == [True]
        assert _content(pool, out) == new
    finally:
        if backend is not None:
            backend.close()
        master.close()


def test_delete_and_clear_stay_in_their_namespace(open_backend: Any) -> None:
    ours = open_backend(namespace="ns-ours")
    theirs = open_backend(namespace="ns-theirs")
    pool = _pool(Layout.PAGE_FIRST)
    ours.attach(pool)
    theirs.attach(pool)
    (page,) = pool.allocate(1)
    buffers = pool.page_buffers(page)
    assert ours.put(["a", "b", "c"], [buffers] * 3) == [True] * 3
    assert theirs.put(["a", "z"], [buffers] * 2) == [True] * 2
    assert ours.delete(["a", "missing"]) == [True, False]
    assert ours.exists(["a", "b"]) == [False, True]
    assert theirs.exists(["a"]) == [True]
    ours.clear()
    assert ours.exists(["b", "c"]) == [False, False]
    assert theirs.exists(["a", "z"]) == [True, True]
    ours.clear()  # an empty namespace clears fine
    assert ours.put(["b"], [buffers]) == [True]
    theirs.clear()


def test_unregistered_memory_is_staged_and_counted(
    open_backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    backend = open_backend(staging_buffer_size=1 << 20)
    pool = _pool(Layout.PAGE_FIRST)  # never attached
    src, dst = pool.allocate(2), pool.allocate(2)
    expected = _fill(pool, src, seed=9)
    with caplog.at_level(logging.WARNING, logger="kvtier.backends.mooncake.backend"):
        assert backend.put(["s0", "s1"], [pool.page_buffers(p) for p in src]) == [True, True]
        assert backend.get(["s0", "s1"], [pool.page_buffers(p) for p in dst]) == [True, True]
    assert [_content(pool, p) for p in dst] == expected
    assert backend.stats()["staged_pages"] == 4
    assert sum("staging buffer" in r.getMessage() for r in caplog.records) == 1  # once


def test_unregistered_memory_refused_when_configured(open_backend: Any) -> None:
    backend = open_backend(unregistered_memory="error")
    pool = _pool(Layout.PAGE_FIRST)
    (page,) = pool.allocate(1)
    with pytest.raises(StorageError, match="attach"):
        backend.put(["k"], [pool.page_buffers(page)])


def test_two_processes_share_pages_through_one_master(
    open_backend: Any, mooncake_master: MooncakeMaster
) -> None:
    backend = open_backend(namespace="shared-ns")
    pool = _pool(Layout.LAYER_FIRST)
    backend.attach(pool)
    ours = pool.allocate(2)
    expected = _fill(pool, ours, seed=10)
    assert backend.put(["p0", "p1"], [pool.page_buffers(p) for p in ours]) == [True, True]
    child = textwrap.dedent(
        f"""
        import hashlib, json, sys, torch
        from kvtier.backends.mooncake.backend import MooncakeBackend
        from kvtier.backends.mooncake import MooncakeConfig
        from kvtier.core.geometry import KVGeometry
        from kvtier.core.host_pool import HostPool
        from kvtier.core.layout import Layout
        from kvtier.core.storage import BackendContext
        g = KVGeometry.mha(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16",
                           page_size=16)
        cfg = MooncakeConfig(master_address={mooncake_master.address!r}, global_segment_size=0)
        b = MooncakeBackend(cfg, BackendContext(g, Layout.LAYER_FIRST, namespace="shared-ns"))
        pool = HostPool(g, Layout.LAYER_FIRST, num_pages=4, pin_memory=False)
        b.attach(pool)
        pages = pool.allocate(4)
        got = b.get(["p0", "p1"], [pool.page_buffers(p) for p in pages[:2]])
        digests = [hashlib.sha256(b"".join(bytes(e.view) for e in pool.page_buffers(p)))
                   .hexdigest() for p in pages[:2]]
        for p in pages[2:]:
            for e in pool.page_buffers(p):
                e.view[:] = bytes([p * 7 % 251]) * e.length
        put = b.put(["q0", "q1"], [pool.page_buffers(p) for p in pages[2:]])
        b.close()
        print(json.dumps({{"got": got, "digests": digests, "put": put}}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", child],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    import hashlib

    assert report["got"] == [True, True]
    assert report["digests"] == [hashlib.sha256(e).hexdigest() for e in expected]
    assert report["put"] == [True, True]
    theirs = pool.allocate(2)
    assert backend.get(["q0", "q1"], [pool.page_buffers(p) for p in theirs]) == [True, True]
    for page, child_page in zip(theirs, (2, 3), strict=True):
        assert _content(pool, page) == bytes([child_page * 7 % 251]) * len(_content(pool, page))


# --- capacity -------------------------------------------------------------------------


def _page_bytes(pool: HostPool) -> int:
    return sum(e.length for e in pool.page_buffers(0))


def test_capacity_bytes_removes_this_clients_least_recently_used_pages(
    open_backend: Any,
) -> None:
    pool = _pool(Layout.PAGE_FIRST, pages=8)
    size = _page_bytes(pool)
    backend = open_backend(capacity_bytes=4 * size)
    backend.attach(pool)
    pages = pool.allocate(6)
    expected = _fill(pool, pages, seed=21)
    buffers = [pool.page_buffers(p) for p in pages]
    assert backend.put([f"k{i}" for i in range(4)], buffers[:4]) == [True] * 4
    (out,) = pool.allocate(1)
    assert backend.get(["k0"], [pool.page_buffers(out)]) == [True]  # k0 is now the newest
    assert backend.put(["k4", "k5"], buffers[4:]) == [True, True]
    assert backend.exists([f"k{i}" for i in range(6)]) == [True, False, False, True, True, True]
    stats = backend.stats()
    assert stats["capacity_evictions"] == 2
    assert stats["pages"] == 4 and stats["bytes"] == 4 * size
    assert stats["capacity_bytes"] == 4 * size
    assert not [k for k in stats if k.startswith("put_failed")]
    _scribble(pool, [out])
    assert backend.get(["k5"], [pool.page_buffers(out)]) == [True]
    assert _content(pool, out) == expected[5]


def test_capacity_refuses_a_put_that_cannot_fit_and_keeps_leased_pages(
    open_backend: Any,
) -> None:
    pool = _pool(Layout.PAGE_FIRST, pages=8)
    size = _page_bytes(pool)
    backend = open_backend(capacity_bytes=2 * size)
    backend.attach(pool)
    pages = pool.allocate(5)
    expected = _fill(pool, pages[:2], seed=31)
    buffers = [pool.page_buffers(p) for p in pages]
    assert backend.put(["a", "b"], buffers[:2]) == [True, True]
    assert backend.get(["a", "b"], buffers[3:5]) == [True, True]  # both leased now
    assert backend.put(["c"], buffers[2:3]) == [False]  # nothing can be removed for it
    stats = backend.stats()
    assert stats["put_failed.CAPACITY"] == 1
    assert stats["capacity_evict_failed.OBJECT_HAS_LEASE"] == 2  # a, then b: both tried
    assert backend.exists(["a", "b", "c"]) == [True, True, False]
    _scribble(pool, pages[3:5])
    assert backend.get(["a", "b"], buffers[3:5]) == [True, True]
    assert [_content(pool, p) for p in pages[3:5]] == expected  # the kept pages are whole

    tiny = open_backend(capacity_bytes=size - 1)
    tiny.attach(pool)
    assert tiny.put(["big"], buffers[:1]) == [False]
    assert tiny.stats()["put_failed.PAGE_LARGER_THAN_CAPACITY"] == 1


def test_capacity_skips_a_leased_victim_and_evicts_the_next_one(open_backend: Any) -> None:
    # another client's get leases k0, this client's least recently used page: the put
    # must remove the next unleased pages instead of failing
    pool = _pool(Layout.PAGE_FIRST, pages=8)
    size = _page_bytes(pool)
    namespace = f"t-{uuid.uuid4().hex[:12]}"
    backend = open_backend(namespace=namespace, capacity_bytes=4 * size)
    reader = open_backend(namespace=namespace)
    backend.attach(pool)
    reader.attach(pool)
    pages = pool.allocate(7)
    expected = _fill(pool, pages[:6], seed=41)
    buffers = [pool.page_buffers(p) for p in pages]
    assert backend.put([f"k{i}" for i in range(4)], buffers[:4]) == [True] * 4
    assert reader.get(["k0"], buffers[6:7]) == [True]  # leased; still this client's LRU
    assert backend.put(["k4"], buffers[4:5]) == [True]
    assert backend.put(["k5"], buffers[5:6]) == [True]
    assert backend.exists([f"k{i}" for i in range(6)]) == [True, False, False, True, True, True]
    stats = backend.stats()
    assert stats["capacity_evictions"] == 2
    assert stats["capacity_evict_failed.OBJECT_HAS_LEASE"] == 2  # k0 tried for each put
    assert stats["pages"] == 4 and stats["bytes"] == 4 * size
    assert not [k for k in stats if k.startswith("put_failed")]
    _scribble(pool, pages[6:7])
    assert backend.get(["k5"], buffers[6:7]) == [True]
    assert _content(pool, pages[6]) == expected[5]


def test_a_batch_evicts_past_a_leased_victim_for_every_page(open_backend: Any) -> None:
    pool = _pool(Layout.PAGE_FIRST, pages=8)
    size = _page_bytes(pool)
    namespace = f"t-{uuid.uuid4().hex[:12]}"
    backend = open_backend(namespace=namespace, capacity_bytes=4 * size)
    reader = open_backend(namespace=namespace)
    backend.attach(pool)
    reader.attach(pool)
    pages = pool.allocate(7)
    _fill(pool, pages[:6], seed=43)
    buffers = [pool.page_buffers(p) for p in pages]
    assert backend.put([f"k{i}" for i in range(4)], buffers[:4]) == [True] * 4
    assert reader.get(["k0"], buffers[6:7]) == [True]
    assert backend.put(["k4", "k5"], buffers[4:6]) == [True, True]
    assert backend.exists([f"k{i}" for i in range(6)]) == [True, False, False, True, True, True]
    assert backend.stats()["capacity_evictions"] == 2


#: 512 KiB pages, so a 16 MiB segment (Mooncake's minimum) holds about 30 of them
_BIG = {"num_layers": 8, "num_kv_heads": 8, "head_dim": 128, "dtype": "float16", "page_size": 16}


def test_a_full_store_refuses_puts_and_the_cache_keeps_serving(
    mooncake_master: MooncakeMaster,
) -> None:
    """Fill a master whose only segment is 16 MiB, through TieredCache: what kvtier does."""
    from kvtier.cache import TieredCache
    from kvtier.core.config import load_engine_config
    from kvtier.core.device_pool import TorchDevicePool
    from kvtier.plugins.manager import load_registry
    from kvtier.testing.content import check_pages, fill_pages

    master = MooncakeMaster().start()
    opened: list[TieredCache] = []

    def open_cache(segment: int) -> TieredCache:
        cfg = load_engine_config(
            {
                **_BIG,
                "backend": "mooncake",
                "host_pages": 64,
                "model": "fill-test",
                "extra_config": {"master_address": master.address, "global_segment_size": segment},
            }
        )
        device = TorchDevicePool(cfg.geometry(), 64 * 16)
        cache = TieredCache.open(cfg, device, registry=load_registry(autoload=False))
        opened.append(cache)
        return cache

    try:
        writer = open_cache(16 << 20)  # holds the store's only segment
        ps = 16
        requests = [writer.keys(list(range(r * 100_000, r * 100_000 + 16 * ps))) for r in range(3)]
        for r, keys in enumerate(requests):  # 48 pages of 512 KiB into ~30 pages of store
            where = torch.arange(r * 16 * ps, (r + 1) * 16 * ps)
            fill_pages(writer.device_pool, keys, where)
            handle = writer.backup(keys, where)
            assert handle.wait(60)
            assert handle.ok  # the host copy never depends on storage
        assert writer.flush(60)
        stats = writer.stats()
        refused = stats["backend"].get("put_failed.NO_AVAILABLE_HANDLE", 0)
        assert refused > 0, stats["backend"]  # the master said the store is full
        assert stats["failures"]["storage_put"] == refused  # each refused page, counted
        assert 0 < stats["storage"]["pages_written"] < 48
        assert stats["storage"]["pages_written"] + refused == 48
        try:
            text = writer.prometheus_text()
        except ImportError:
            text = None
        if text is not None:
            assert 'name="put_failed.NO_AVAILABLE_HANDLE"' in text

        # The writer keeps serving every page from its host pool, exact.
        writer.device_pool.zero_()  # type: ignore[attr-defined]
        for keys in requests:
            where = torch.arange(48 * ps, 64 * ps)
            assert writer.load(keys, where) == 16
            assert all(check_pages(writer.device_pool, keys, where))
        # ... and keeps backing up: the host copy works, the write is refused, counted.
        more = writer.keys(list(range(900_000, 900_000 + 4 * ps)))
        where = torch.arange(0, 4 * ps)
        fill_pages(writer.device_pool, more, where)
        handle = writer.backup(more, where)
        assert handle.wait(60) and handle.ok

        # Another client reads what the store holds: whole pages or misses, never garbage.
        reader = open_cache(0)
        reader.device_pool.zero_()  # type: ignore[attr-defined]
        loaded_total = 0
        for keys in requests:
            where = torch.arange(0, 16 * ps)
            loaded = reader.load(keys, where)
            assert all(check_pages(reader.device_pool, keys[:loaded], where[: loaded * ps]))
            loaded_total += loaded
        assert loaded_total > 0
        assert reader.stats()["page_store"]["invalid"] == 0
    finally:
        for cache in reversed(opened):
            cache.close()
        master.close()


# --- faults ---------------------------------------------------------------------------


def test_master_not_running_fails_fast_with_a_clear_error(open_backend: Any) -> None:
    port = free_port()  # nothing listens here
    with pytest.raises(StorageError, match=rf"127\.0\.0\.1:{port}.*setup_timeout_s") as info:
        open_backend(master_address=f"127.0.0.1:{port}", setup_timeout_s=0.5)
    assert "mooncake_master --rpc_address=127.0.0.1" in str(info.value)


def test_master_killed_mid_run_then_back(mooncake_master: MooncakeMaster) -> None:
    """Calls fail fast and counted while the master is gone; the client recovers after."""
    from kvtier.backends.mooncake.backend import MooncakeBackend

    master = MooncakeMaster().start()
    backend = None
    try:
        context = BackendContext(GEOMETRY, Layout.PAGE_FIRST, namespace="faults")
        config = _config(master.address, global_segment_size=16 << 20, retry_interval_s=0.2)
        backend = MooncakeBackend(config, context)
        pool = _pool(Layout.PAGE_FIRST)
        backend.attach(pool)
        pages = pool.allocate(2)
        buffers = [pool.page_buffers(p) for p in pages]
        expected = _fill(pool, pages[:1], seed=11)
        assert backend.put(["before"], buffers[:1]) == [True]

        master.kill()
        for _ in range(3):
            assert backend.put(["k0", "k1"], buffers) == [False, False]
            assert backend.get(["before", "k0"], buffers) == [False, False]
            assert backend.exists(["before"]) == [False]
            assert backend.delete(["before"]) == [False]
        stats = backend.stats()
        assert stats["master_up"] == 0
        assert sum(v for k, v in stats.items() if k.endswith("_failed.RPC_FAIL")) >= 1
        # after the first RPC_FAIL no call reaches Mooncake's slow retries
        assert sum(v for k, v in stats.items() if k.endswith("_failed.MASTER_UNREACHABLE")) >= 8
        with pytest.raises(StorageError, match="unreachable"):
            backend.clear()

        master.restart()
        deadline = time.monotonic() + 60
        recovered = False
        while time.monotonic() < deadline and not recovered:
            recovered = backend.put(["after"], buffers[:1]) == [True]
            if not recovered:
                time.sleep(0.25)
        assert recovered, backend.stats()
        assert backend.stats()["master_up"] == 1
        _scribble(pool, pages[1:])
        assert backend.get(["after"], buffers[1:]) == [True]
        assert _content(pool, pages[1]) == expected[0]
        # a restarted master knows no objects: what was stored before is a miss
        assert backend.exists(["before", "after"]) == [False, True]
    finally:
        if backend is not None:
            backend.close()
        master.close()


_CLOSE_CHILD = """
import json, sys, time
from kvtier.backends.mooncake.backend import MooncakeBackend
from kvtier.backends.mooncake import MooncakeConfig
from kvtier.core.geometry import KVGeometry
from kvtier.core.host_pool import HostPool
from kvtier.core.layout import Layout
from kvtier.core.storage import BackendContext
g = KVGeometry.mha(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", page_size=16)
cfg = MooncakeConfig(master_address=sys.argv[1], global_segment_size=16 << 20,
                     op_timeout_s=0.5)
b = MooncakeBackend(cfg, BackendContext(g, Layout.PAGE_FIRST, namespace="close"))
pool = HostPool(g, Layout.PAGE_FIRST, num_pages=2, pin_memory=False)
b.attach(pool)
(page,) = pool.allocate(1)
first = b.put(["k"], [pool.page_buffers(page)])
print("ready", flush=True)
sys.stdin.readline()  # the parent kills the master now
after = b.put(["k2"], [pool.page_buffers(page)])
t0 = time.monotonic()
b.close()
b.close()
print(json.dumps({"first": first, "after": after, "close_s": time.monotonic() - t0,
                  "stats": b.stats()}), flush=True)
sys.stdin.readline()  # the parent SIGKILLs us: Mooncake's exit teardown would block ~10 s
"""


def test_close_is_bounded_when_the_master_is_gone(mooncake_master: MooncakeMaster) -> None:
    master = MooncakeMaster().start()
    try:
        with subprocess.Popen(
            [sys.executable, "-c", _CLOSE_CHILD, master.address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=REPO,
        ) as child:
            try:
                assert child.stdout is not None and child.stdin is not None
                assert child.stdout.readline().strip() == "ready"
                master.kill()
                child.stdin.write("go\n")
                child.stdin.flush()
                report = json.loads(child.stdout.readline())
            finally:
                child.kill()
    finally:
        master.close()
    assert report["first"] == [True]
    assert report["after"] == [False]
    assert report["stats"]["close_deferred"] == 1
    assert report["stats"]["put_failed.RPC_FAIL"] == 1
    # Two closes: one probe of the dead master (op_timeout_s=0.5, refused at once on
    # loopback) and an idempotent no-op; Mooncake's own close would block ~10 s.
    assert report["close_s"] < 0.5 + 1.5, report


# --- the conformance kit --------------------------------------------------------------


class OnTheSessionMaster(BackendKit):
    """A kit class whose Mooncake backend uses the session's master on loopback."""

    backend_name = "mooncake"

    @pytest.fixture(autouse=True)
    def _master(self, mooncake_master: MooncakeMaster) -> None:
        self.master_address = mooncake_master.address

    def backend_config(self, tmp: Path) -> dict[str, Any]:
        return {"master_address": self.master_address, "global_segment_size": 0}


class TestMooncakeKit(
    OnTheSessionMaster,
    RoundTripTests,
    PrefixExistsTests,
    MissTests,
    OverwriteTests,
    DeleteClearTests,
    ConcurrencyTests,
    IntegrityTests,
    LayoutTests,
    SharedProcessesTests,
):
    """The kit against the session master: every mixin but PersistenceTests (Mooncake
    keeps pages in memory; the spec does not declare ``persistent``)."""


def test_docs_config_table_is_generated_from_the_model() -> None:
    from kvtier.core.config_docs import config_reference_markdown

    text = (REPO / "docs" / "mooncake.md").read_text()
    start = text.index("<!-- generated by")
    table = text[text.index("\n", start) + 1 : text.index("<!-- end generated -->")]
    assert table == config_reference_markdown(MooncakeConfig)


def test_every_mooncake_error_code_has_a_name() -> None:
    from kvtier.backends.mooncake.backend import ERROR_NAMES, error_name

    assert error_name(-704) == "OBJECT_NOT_FOUND"
    assert error_name(-706) == "OBJECT_HAS_LEASE"
    assert error_name(-900) == "RPC_FAIL"
    assert error_name(-12345) == "UNKNOWN_-12345"
    assert len(set(ERROR_NAMES.values())) == len(ERROR_NAMES)
