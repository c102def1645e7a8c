"""kvtier behind SGLang's HiCache ``dynamic`` storage backend, driven by SGLang's own classes.

Everything KV-related is the installed SGLang release's own code, on the CPU: its
``HiCacheStorage``, ``HiCacheStorageConfig`` and ``StorageBackendFactory`` (the ``dynamic``
loader), its host pools (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``) built from its
device pools (``MHATokenToKVPool``, ``MLATokenToKVPool``), its ``HiCacheController`` with
its storage threads, and its ``StorageMetrics``. Every data-path test puts operations on the
controller's queues where SGLang's scheduler puts them (:class:`sglang_host_pool.Controller`),
and the controller's backup and prefetch threads call kvtier. These tests run in the SGLang
test environment (``scripts/install-sglang.sh``; ``tests/test_sglang_env.py`` runs them).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang_host_pool import (
    CLASS_NAME,
    MODULE_PATH,
    Chain,
    Controller,
    fill_random,
    is_mla,
    page_content,
    page_hashes,
    radix_key,
    sglang_or_skip,
    starts,
    storage_config,
    zero_page,
)
from sglang_host_pool import mha_host_pool as MHAHostPool
from sglang_host_pool import mla_host_pool as MLAHostPool

from kvtier.backends.segment import SegmentConfig
from kvtier.core.errors import (
    BackendUnavailableError,
    ExtraConfigSyntaxError,
    InvalidFieldError,
    InvalidKeyError,
    MissingFieldError,
    PageError,
    UnknownKeyError,
    UnknownNameError,
    UnsupportedCombinationError,
)
from kvtier.testing import require

hs = sglang_or_skip()

from kvtier.integrations.sglang import KvtierHiCacheStorage  # noqa: E402

#: The built-in backends SGLang's real controller drives here (Mooncake: test_sglang_zero_copy).
BACKENDS = ["memory", "file", "uring", "segment"]
#: The ones that keep pages on a root other instances and processes share.
SHARED_ROOT = ("file", "uring", "segment")


def _uring_or_skip() -> None:
    from kvtier.backends.uring import URING_SPEC

    require("uring", URING_SPEC.unavailable_reason())


def extra_config(backend: str, root: Path | None, **section: Any) -> dict[str, Any]:
    """SGLang's extra-config dict for kvtier, as its controller hands it to the loader."""
    options: dict[str, Any] = {}
    if backend in SHARED_ROOT:
        assert root is not None
        options["root"] = str(root)
    kvtier = {"backend": backend, "extra_config": options, **section}
    return {
        "backend_name": "kvtier",
        "module_path": MODULE_PATH,
        "class_name": CLASS_NAME,
        "interface_v1": 1,
        "kvtier": kvtier,
    }


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "uring":
        _uring_or_skip()
    return str(request.param)


@pytest.fixture
def attach(tmp_path: Path) -> Any:
    """Attach kvtier to a host pool the way SGLang does; everything is closed afterwards."""
    made: list[Controller] = []

    def make(
        backend: str,
        pool: Any,
        *,
        root: Path | None = None,
        extra: dict[str, Any] | None = None,
        **config: Any,
    ) -> Controller:
        extra = extra or extra_config(backend, root or tmp_path / "store")
        cfg = storage_config(extra_config=extra, is_mla=is_mla(pool), layout=pool.layout, **config)
        controller = Controller.attach(cfg, pool)
        made.append(controller)
        return controller

    yield make
    for controller in made:
        controller.close()


def _fill(pool: Any, count: int, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Allocate ``count`` host pages and fill them with random bytes."""
    indices = pool.alloc(count * pool.page_size)
    assert indices is not None
    data = [fill_random(pool, int(indices[i * pool.page_size]), seed + i) for i in range(count)]
    return indices, data


_starts = starts


def _hashes(count: int, page_size: int, salt: int = 0) -> Chain:
    """SGLang's storage hashes of ``count`` pages of tokens ``salt, salt + 1, ...``."""
    return page_hashes(list(range(salt, salt + count * page_size)), page_size)


@dataclass(frozen=True)
class SegmentPage:
    """Where one page lies in a segment file: its stored bytes (envelope slot, payload)."""

    path: Path
    offset: int
    length: int


def _segment_pages(root: Path) -> list[SegmentPage]:
    """Every live page of the segment files under ``root``, from their record headers."""
    from kvtier.backends.segment import format as fmt

    pages = []
    for path in sorted(root.rglob("*.seg")):
        data = path.read_bytes()
        found = fmt.parse_segment_header(data[: fmt.SEGMENT_HEADER_BYTES])
        assert found is not None, path
        offset = fmt.SEGMENT_HEADER_BYTES
        while offset < len(data):
            record, _ = fmt.parse_record(data[offset:], offset, found[0])
            if record is None:
                break
            at = offset + record.header_bytes
            for entry in record.entries:
                if entry.live:
                    pages.append(SegmentPage(path, at, entry.length))
                at += entry.length
            offset = record.end
    return pages


def _stored_pages(storage: KvtierHiCacheStorage) -> Callable[[], list[Any]]:
    """Where the backend keeps its page objects (files, pages in segment files, or the
    memory backend's buffers)."""
    backend = storage._require().store.backend
    if isinstance(getattr(backend, "config", None), SegmentConfig):
        return lambda: _segment_pages(Path(backend.config.root))
    if hasattr(backend, "store"):
        return lambda: sorted(Path(backend.store).rglob("*.kv"))
    return lambda: list(backend._pages.values())


# --- the loader and the data path ------------------------------------------------------------


def test_sglang_dynamic_loader_accepts_the_class(attach: Any) -> None:
    controller = attach("memory", MHAHostPool())
    assert isinstance(controller.storage, hs.HiCacheStorage)
    assert isinstance(controller.storage, KvtierHiCacheStorage)


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct", "page_head"])
def test_round_trip_mha(backend: str, layout: str, attach: Any) -> None:
    pool = MHAHostPool(layout=layout)
    controller = attach(backend, pool)
    indices, data = _fill(pool, 5)
    hashes = _hashes(5, pool.page_size)
    assert controller.backup(hashes, indices) == 5 * pool.page_size
    assert controller.hit_query(hashes) == hashes
    for start in _starts(pool, indices):
        zero_page(pool, start)
    # SGLang loads into freshly allocated host pages, not the ones it backed up from
    target = pool.alloc(5 * pool.page_size)
    assert controller.prefetch(hashes, target) == 5
    for start, expected in zip(_starts(pool, target), data, strict=True):
        assert torch.equal(page_content(pool, start), expected)
    stats = controller.storage.kvtier_stats()
    assert stats["hits"] == 5 and stats["puts"] == 5 and stats["invalid"] == 0


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
def test_round_trip_mla(backend: str, layout: str, attach: Any) -> None:
    pool = MLAHostPool(layout=layout)
    controller = attach(backend, pool)
    indices, data = _fill(pool, 3, seed=10)
    hashes = _hashes(3, pool.page_size, salt=7)
    assert controller.backup(hashes, indices) == 3 * pool.page_size
    target = pool.alloc(3 * pool.page_size)
    assert controller.prefetch(controller.hit_query(hashes), target) == 3
    for start, expected in zip(_starts(pool, target), data, strict=True):
        assert torch.equal(page_content(pool, start), expected)


def test_the_classes_driven_here_are_sglangs_own(attach: Any) -> None:
    import inspect

    import sglang
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.observability.metrics_collector import StorageMetrics
    from sglang_host_pool import device_pool_of

    installed = Path(sglang.__file__).resolve().parent
    mha, mla = MHAHostPool(), MLAHostPool()
    controller = attach("memory", mha)
    indices, _ = _fill(mha, 1)
    controller.backup(_hashes(1, 16), indices)
    driven = {
        MHATokenToKVPoolHost: mha,
        MLATokenToKVPoolHost: mla,
        MHATokenToKVPool: device_pool_of(mha),
        MLATokenToKVPool: device_pool_of(mla),
        HiCacheController: controller.controller,
        PagedTokenToKVPoolAllocator: controller.controller.mem_pool_device_allocator,
        StorageMetrics: controller.storage.get_stats(),
    }
    for cls, obj in driven.items():
        assert type(obj) is cls, (cls, type(obj))
        assert cls.__module__.startswith("sglang.srt."), cls
        assert Path(inspect.getfile(cls)).resolve().is_relative_to(installed), cls
    # the controller took SGLang's zero-copy path and runs its own storage threads
    assert controller.zero_copy
    assert controller.controller.backup_thread.is_alive()
    assert controller.controller.prefetch_io_aux_thread.is_alive()
    assert controller.storage.kvtier_stats()["metrics_fallback"] == 0


def test_prefix_hits(backend: str, attach: Any) -> None:
    pool = MHAHostPool()
    controller = attach(backend, pool)
    hashes = _hashes(6, pool.page_size)
    indices, _ = _fill(pool, 6)
    ps = pool.page_size
    assert controller.hit_query(hashes) == []
    # store pages 0, 1, 2 and 4: the prefix stops at the gap
    assert all(controller.storage.batch_set_v1(hashes[:3], indices[: 3 * ps]))
    assert all(controller.storage.batch_set_v1([hashes[4]], indices[4 * ps : 5 * ps]))
    assert controller.hit_query(hashes) == hashes[:3]
    assert controller.storage.batch_exists(hashes[4:5]) == 1
    assert controller.storage.exists(hashes[4]) and not controller.storage.exists(hashes[3])


def test_prefix_hits_span_sglang_batches(attach: Any) -> None:
    pool = MHAHostPool(page_size=1, head_dim=8, layer_num=2, pages=600)
    controller = attach("memory", pool)
    hashes = _hashes(300, 1)  # more than STORAGE_BATCH_SIZE (128): three batch_exists calls
    indices, _ = _fill(pool, 300)
    assert controller.backup(hashes[:200], indices[:200]) == 200
    assert controller.hit_query(hashes) == hashes[:200]
    expected = [page_content(pool, int(i)) for i in indices[:200]]
    target = pool.alloc(200)
    assert controller.prefetch(hashes[:200], target) == 200  # two batch_get_v1 calls
    for page, start in enumerate(target.tolist()):
        assert torch.equal(page_content(pool, start), expected[page])


def test_backup_and_prefetch_threads_run_together(attach: Any) -> None:
    import threading

    pool = MHAHostPool(pages=64)
    controller = attach("file", pool)
    old_indices, old_data = _fill(pool, 16, seed=1)
    old = _hashes(16, 16)
    assert controller.backup(old, old_indices) == 256
    new_indices, _ = _fill(pool, 16, seed=50)
    new = _hashes(16, 16, salt=10_000)
    target = pool.alloc(256)
    done: dict[str, int] = {}
    threads = [
        threading.Thread(target=lambda: done.update(backup=controller.backup(new, new_indices))),
        threading.Thread(target=lambda: done.update(loaded=controller.prefetch(old, target))),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert done == {"backup": 256, "loaded": 16}
    for start, expected in zip(_starts(pool, target), old_data, strict=True):
        assert torch.equal(page_content(pool, start), expected)
    assert controller.hit_query(new) == new


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_page_reads_as_a_miss(backend: str, damage: str, attach: Any) -> None:
    pool = MHAHostPool()
    controller = attach(backend, pool)
    indices, data = _fill(pool, 3)
    hashes = _hashes(3, pool.page_size)
    ps = pool.page_size
    storage = controller.storage
    # page 1 goes in first, so it is the one stored object to damage
    assert storage.batch_set_v1(hashes[1:2], indices[ps : 2 * ps]) == [True]
    (victim,) = _stored_pages(storage)()
    assert storage.batch_set_v1(hashes[::2], torch.cat([indices[:ps], indices[2 * ps :]]))
    if isinstance(victim, SegmentPage):
        # a segment file cannot be cut short without cutting every page after this one,
        # so "truncate" loses the page's last bytes as a torn append leaves them: zeros
        with open(victim.path, "r+b") as f:
            if damage == "flip":
                f.seek(victim.offset + victim.length // 2)
                byte = f.read(1)[0]
                f.seek(victim.offset + victim.length // 2)
                f.write(bytes([byte ^ 0x40]))
            else:
                f.seek(victim.offset + victim.length - 100)
                f.write(bytes(100))
    elif isinstance(victim, Path):
        raw = bytearray(victim.read_bytes())
        raw = raw[: len(raw) - 100] if damage == "truncate" else raw
        if damage == "flip":
            raw[len(raw) // 2] ^= 0x40
        victim.write_bytes(bytes(raw))
    elif damage == "flip":
        victim[len(victim) // 2] ^= 0x40
    else:
        del victim[len(victim) - 100 :]
    assert controller.hit_query(hashes) == hashes  # it exists; only reading finds it bad
    target = pool.alloc(3 * ps)
    assert controller.prefetch(hashes, target) == 1  # page 0 loads; the prefix ends at 1
    assert torch.equal(page_content(pool, int(target[0])), data[0])
    stats = storage.kvtier_stats()
    assert stats["hits"] == 2  # pages 0 and 2 were read in the same batch
    assert stats["invalid"] + stats["misses"] == 1
    if damage == "flip":
        assert stats["invalid_corrupt_checksum"] == 1


def test_path_like_key_is_rejected(backend: str, attach: Any, tmp_path: Path) -> None:
    pool = MHAHostPool()
    controller = attach(backend, pool, root=tmp_path / "store")
    indices, _ = _fill(pool, 1)
    storage = controller.storage
    for key in ("../x", "../../etc/passwd", "a/b", "", ".hidden", "X" * 10):
        with pytest.raises(InvalidKeyError):
            storage.batch_set_v1([key], indices)
        with pytest.raises(InvalidKeyError):
            storage.batch_get_v1([key], indices)
        with pytest.raises(InvalidKeyError):
            storage.batch_exists([key])
        with pytest.raises(InvalidKeyError):
            storage.set(key, pool.get_data_page(int(indices[0])))
    assert sorted(p.name for p in tmp_path.iterdir()) == (["store"] if backend != "memory" else [])
    assert storage.kvtier_stats()["puts"] == 0


def test_mla_single_writer(backend: str, attach: Any, tmp_path: Path) -> None:
    root = tmp_path / "shared"
    pools = [MLAHostPool(), MLAHostPool()]
    ranks = [attach(backend, pools[rank], root=root, tp_rank=rank, tp_size=2) for rank in range(2)]
    assert ranks[0].config.is_storage_writer and not ranks[1].config.is_storage_writer
    hashes = _hashes(2, 16)
    indices1, _ = _fill(pools[1], 2, seed=5)
    # rank 1 is not the writer: its batch_set_v1 stores nothing and says so in its stats
    assert ranks[1].storage.batch_set_v1(hashes, indices1) == [True, True]
    assert ranks[1].storage.kvtier_stats()["skipped_not_writer"] == 2
    assert ranks[1].storage.kvtier_stats()["puts"] == 0
    assert ranks[0].hit_query(hashes) == []
    ranks[1].storage.clear()  # a reader never clears the shared pages
    indices0, data = _fill(pools[0], 2, seed=9)
    assert ranks[0].backup(hashes, indices0) == 32
    assert ranks[1].backup(hashes, indices1) == 0  # the controller skips non-writers
    if backend == "memory":
        return  # the memory backend is private to one process' instance
    # both ranks read the one shared copy rank 0 wrote
    target = pools[1].alloc(32)
    assert ranks[1].prefetch(ranks[1].hit_query(hashes), target) == 2
    for start, expected in zip(_starts(pools[1], target), data, strict=True):
        assert torch.equal(page_content(pools[1], start), expected)


def test_mha_ranks_keep_their_own_pages(attach: Any, tmp_path: Path) -> None:
    root = tmp_path / "shared"
    pools = [MHAHostPool(), MHAHostPool()]
    ranks = [attach("file", pools[r], root=root, tp_rank=r, tp_size=2) for r in range(2)]
    hashes = _hashes(2, 16)  # the same tokens on both ranks, different heads
    written = []
    for rank, pool in enumerate(pools):
        indices, data = _fill(pool, 2, seed=rank * 100)
        written.append(data)
        assert ranks[rank].backup(hashes, indices) == 32
    for rank, pool in enumerate(pools):
        target = pool.alloc(32)
        assert ranks[rank].prefetch(hashes, target) == 2
        for start, expected in zip(_starts(pool, target), written[rank], strict=True):
            assert torch.equal(page_content(pool, start), expected)
    ranks[0].storage.clear()
    assert ranks[0].hit_query(hashes) == []
    assert ranks[1].hit_query(hashes) == hashes


def test_clear_removes_only_this_model(attach: Any, tmp_path: Path) -> None:
    root = tmp_path / "shared"
    pool_a, pool_b = MHAHostPool(), MHAHostPool()
    a = attach("file", pool_a, root=root, model_name="org/model-a")
    b = attach("file", pool_b, root=root, model_name="org/model-b")
    hashes = _hashes(2, 16)
    assert a.backup(hashes, _fill(pool_a, 2)[0]) == 32
    assert b.backup(hashes, _fill(pool_b, 2)[0]) == 32
    a.storage.clear()
    assert a.hit_query(hashes) == []
    assert b.hit_query(hashes) == hashes


def test_weights_changed_in_place_never_hit_the_old_pages(attach: Any, tmp_path: Path) -> None:
    # SGLang names the model by its path; weights retrained under that path are other KV
    model = tmp_path / "model"
    model.mkdir()
    weights = model / "model.safetensors"
    weights.write_bytes(b"weights v1")
    root = tmp_path / "shared"
    pool = MHAHostPool()
    before = attach("file", pool, root=root, model_name=str(model))
    hashes = _hashes(2, 16)
    assert before.backup(hashes, _fill(pool, 2)[0]) == 32
    assert (
        attach("file", MHAHostPool(), root=root, model_name=str(model)).hit_query(hashes) == hashes
    )
    weights.write_bytes(b"weights v2, retrained")
    after = attach("file", MHAHostPool(), root=root, model_name=str(model))
    assert after.hit_query(hashes) == []
    # a declared kvtier.model is the operator's name for the weights: it is kept as given
    declared = extra_config("file", root, model="llama@v1")
    first = attach("file", pool, extra=declared, model_name=str(model))
    assert first.backup(hashes, _fill(pool, 2)[0]) == 32
    weights.write_bytes(b"weights v3")
    assert (
        attach("file", MHAHostPool(), extra=declared, model_name=str(model)).hit_query(hashes)
        == hashes
    )


# --- tenants: SGLang's request namespace and kvtier's tenant ----------------------------------


def test_two_requests_of_different_namespaces_never_share_a_page(
    backend: str, attach: Any, tmp_path: Path
) -> None:
    """A request's ``cache_salt`` and ``extra_key`` (LoRA id) seed SGLang's storage hash chain
    (``storage_namespace_seed``); the controller's prefetch thread hashes the request's
    ``RadixKey`` itself, so another namespace's hit query finds none of the pages."""
    pool = MHAHostPool()
    controller = attach(backend, pool)
    tokens = list(range(3 * 16))
    team_a = Chain.of(radix_key(tokens, salt="team-a"), 16)
    indices, data = _fill(pool, 3)
    assert controller.backup(team_a, indices) == 48  # as the radix tree hashes its node
    assert controller.hit_query(team_a) == team_a
    others = [
        radix_key(tokens, salt="team-b"),
        radix_key(tokens),  # no namespace at all
        radix_key(tokens, extra_key="lora-1", salt="team-a"),  # same tenant, a LoRA adapter
        radix_key(tokens, extra_key="", salt="team-a"),
    ]
    for key in others:
        chain = Chain.of(key, 16)
        assert set(chain).isdisjoint(team_a)
        assert controller.hit_query(chain) == [], key
    target = pool.alloc(48)
    assert controller.prefetch(controller.hit_query(team_a), target) == 3
    for start, expected in zip(_starts(pool, target), data, strict=True):
        assert torch.equal(page_content(pool, start), expected)


def test_what_reaches_the_storage_of_a_request(
    attach: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang 0.5.23 hands storage no tenant: ``extra_info`` carries only ``prefix_keys``,
    so a request's namespace reaches kvtier as the seed of its page hashes."""
    pool = MHAHostPool()
    controller = attach("memory", pool)
    seen: list[Any] = []
    storage = controller.storage
    for name in ("batch_exists", "batch_get_v1", "batch_set_v1"):
        call = getattr(storage, name)

        def spy(*args: Any, _call: Any = call, **kwargs: Any) -> Any:
            seen.append(args[-1] if len(args) in (2, 3) and not kwargs else kwargs)
            return _call(*args, **kwargs)

        monkeypatch.setattr(storage, name, spy)
    chain = Chain.of(radix_key(range(32), salt="team-a"), 16)
    indices, _ = _fill(pool, 2)
    assert controller.backup(chain, indices) == 32
    assert controller.prefetch(controller.hit_query(chain), pool.alloc(32)) == 2
    assert len(seen) == 3
    for info in seen:
        assert isinstance(info, hs.HiCacheStorageExtraInfo)
        assert info.extra_info is None and info.prefix_keys is None


@pytest.mark.parametrize("backend", SHARED_ROOT)
def test_kvtier_tenants_never_share_a_page(backend: str, attach: Any, tmp_path: Path) -> None:
    """``kvtier.tenant`` keys every page of a server: two servers on one store with the same
    SGLang hashes (same tokens, no salt) each read only their own bytes."""
    if backend == "uring":
        _uring_or_skip()
    root = tmp_path / "shared"
    pools = {name: MHAHostPool() for name in ("team-a", "team-b")}
    servers = {
        name: attach(backend, pool, extra=extra_config(backend, root, tenant=name))
        for name, pool in pools.items()
    }
    hashes = _hashes(2, 16)
    assert servers["team-a"].backup(hashes, _fill(pools["team-a"], 2, seed=1)[0]) == 32
    assert servers["team-b"].hit_query(hashes) == []
    written = {}
    for name, seed in (("team-b", 2), ("team-a", 3)):
        indices, written[name] = _fill(pools[name], 2, seed=seed)
        assert servers[name].backup(hashes, indices) == 32
    for name, server in servers.items():
        pool = pools[name]
        target = pool.alloc(32)
        assert server.prefetch(server.hit_query(hashes), target) == 2
        for start, expected in zip(_starts(pool, target), written[name], strict=True):
            assert torch.equal(page_content(pool, start), expected)
    untenanted = attach(backend, MHAHostPool(), root=root)
    assert untenanted.hit_query(hashes) == []


def test_generic_path_interoperates_with_v1(
    backend: str, attach: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "store"
    generic_extra = extra_config(backend, root)
    del generic_extra["interface_v1"]
    pool = MHAHostPool(layout="layer_first")
    with caplog.at_level(logging.WARNING, logger="kvtier.integrations.sglang"):
        generic = attach(backend, pool, extra=generic_extra)
    assert "interface_v1" in caplog.text
    indices, data = _fill(pool, 3)
    hashes = _hashes(3, pool.page_size)
    assert generic.backup(hashes, indices) == 48
    assert generic.storage.kvtier_stats()["generic_path_pages"] == 3
    target = pool.alloc(48)
    assert generic.prefetch(hashes, target) == 3
    for start, expected in zip(_starts(pool, target), data, strict=True):
        assert torch.equal(page_content(pool, start), expected)
    if backend == "memory":
        return
    # a zero-copy instance over another pool reads what the generic path wrote
    other = MHAHostPool(layout="layer_first")
    v1 = attach(backend, other, root=root)
    target = other.alloc(48)
    assert v1.prefetch(v1.hit_query(hashes), target) == 3
    for start, expected in zip(_starts(other, target), data, strict=True):
        assert torch.equal(page_content(other, start), expected)


def test_legacy_get_of_a_missing_page_is_none(attach: Any) -> None:
    pool = MHAHostPool()
    storage = attach("memory", pool).storage
    page = pool.get_dummy_flat_data_page()
    assert storage.get(_hashes(1, 16)[0], page) is None
    assert storage.batch_get(_hashes(2, 16), [page, page.clone()]) == [None, None]


def test_get_stats_in_sglang_metrics_shape(attach: Any) -> None:
    pool = MHAHostPool()
    controller = attach("memory", pool)
    indices, _ = _fill(pool, 4)
    hashes = _hashes(4, 16)
    controller.backup(hashes, indices)
    controller.prefetch(hashes, pool.alloc(64))
    stats = controller.storage.get_stats()
    assert stats.backup_pgs == [4] and stats.prefetch_pgs == [4]
    assert len(stats.backup_bandwidth) == 1 and stats.backup_bandwidth[0] > 0
    assert len(stats.prefetch_bandwidth) == 1 and stats.prefetch_bandwidth[0] > 0
    again = controller.storage.get_stats()
    assert again.backup_pgs == [] and again.prefetch_pgs == []


def test_get_stats_says_whose_metrics_class_it_returns(
    attach: Any, caplog: pytest.LogCaptureFixture
) -> None:
    import importlib

    from kvtier.integrations.sglang import metrics as adapter_metrics

    adapter_metrics.storage_metrics_class.cache_clear()
    try:
        importlib.import_module("sglang.srt.observability.metrics_collector")
    except Exception as exc:  # SGLang's metrics module needs its serving stack
        reason: Exception | None = exc
    else:
        reason = None
    storage = attach("memory", MHAHostPool()).storage
    with caplog.at_level(logging.WARNING, logger="kvtier.integrations.sglang"):
        metrics, again = storage.get_stats(), storage.get_stats()
    warnings = [r for r in caplog.records if "metrics_collector" in r.getMessage()]
    if reason is None:  # a full SGLang: its own class, which its collector accepts
        from sglang.srt.observability.metrics_collector import StorageMetrics

        assert type(metrics) is StorageMetrics and not warnings
        assert storage.kvtier_stats()["metrics_fallback"] == 0
    else:  # the fallback is announced once, with the import error, and counted
        assert len(warnings) == 1 and repr(reason) in warnings[0].getMessage()
        assert type(metrics) is type(again) is adapter_metrics.StorageMetricsShape
        assert storage.kvtier_stats()["metrics_fallback"] == 1


def test_host_indices_must_be_whole_pages(attach: Any) -> None:
    pool = MHAHostPool()
    storage = attach("memory", pool).storage
    hashes = _hashes(2, 16)
    with pytest.raises(PageError, match="host indices"):
        storage.batch_set_v1(hashes, torch.arange(16))  # one page for two keys
    with pytest.raises(PageError, match="whole"):
        storage.batch_set_v1(hashes[:1], torch.arange(3, 19))  # not page-aligned
    with pytest.raises(PageError, match="whole"):
        storage.batch_get_v1(hashes[:1], torch.arange(pool.size, pool.size + 16))


def test_backend_failure_is_a_counted_false(attach: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = MHAHostPool()
    controller = attach("memory", pool)
    indices, _ = _fill(pool, 2)
    hashes = _hashes(2, 16)
    backend = controller.storage._require().store.backend

    def broken(*args: Any) -> Any:
        raise OSError("disk on fire")

    monkeypatch.setattr(backend, "put", broken)
    monkeypatch.setattr(backend, "exists", broken)
    assert controller.storage.batch_set_v1(hashes, indices) == [False, False]
    assert controller.backup(hashes, indices) == 0
    assert controller.storage.batch_exists(hashes) == 0
    assert controller.storage.kvtier_stats()["backend_errors"] == 3


# --- configuration errors, at construction or host-pool registration --------------------------


def _create(extra: dict[str, Any], **config: Any) -> Any:
    """SGLang's factory call; the loader re-raises what the class raised."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    cfg = storage_config(extra_config=extra, **config)
    return StorageBackendFactory.create_backend("dynamic", cfg, None)


def _with_section(section: Any) -> dict[str, Any]:
    extra = extra_config("memory", None)
    extra["kvtier"] = section
    return extra


def test_missing_section_names_the_fix() -> None:
    extra = extra_config("memory", None)
    extra["kvteir"] = extra.pop("kvtier")
    with pytest.raises(MissingFieldError, match=r"did you mean 'kvtier'") as info:
        _create(extra)
    assert info.value.path == "extra-config.kvtier"
    del extra["kvteir"]
    with pytest.raises(MissingFieldError, match=r"docs/sglang\.md"):
        _create(extra)


def test_unknown_section_key_lists_the_allowed_ones() -> None:
    with pytest.raises(UnknownKeyError, match=r"did you mean 'verify'") as info:
        _create(_with_section({"backend": "memory", "verfy": "full"}))
    assert info.value.where == "extra-config 'kvtier' section"
    assert "checksum_workers" in info.value.allowed


def test_missing_backend_and_wrong_types() -> None:
    with pytest.raises(MissingFieldError, match=r"kvtier\.backend"):
        _create(_with_section({}))
    with pytest.raises(InvalidFieldError, match=r"kvtier\.checksum_workers") as info:
        _create(_with_section({"backend": "memory", "checksum_workers": "2"}))
    assert info.value.path == "kvtier.checksum_workers"
    with pytest.raises(InvalidFieldError, match=r"kvtier\.verify"):
        _create(_with_section({"backend": "memory", "verify": "sometimes"}))


def test_unknown_backend_says_did_you_mean() -> None:
    with pytest.raises(UnknownNameError, match=r"did you mean 'file'"):
        _create(_with_section({"backend": "fiel"}))


def test_backend_options_are_validated_by_the_backend_model(tmp_path: Path) -> None:
    section = {"backend": "file", "extra_config": {"rooot": str(tmp_path)}}
    with pytest.raises(UnknownKeyError, match=r"did you mean 'root'") as info:
        _create(_with_section(section))
    assert info.value.where.startswith("kvtier.extra_config")
    section = {"backend": "file", "extra_config": {"io_threads": "many"}}
    with pytest.raises(InvalidFieldError, match=r"kvtier\.extra_config\.io_threads"):
        _create(_with_section(section))
    assert not (tmp_path / "kvtier").exists()


def test_section_as_json_text_and_toml_file(tmp_path: Path) -> None:
    with pytest.raises(ExtraConfigSyntaxError, match="line 1, column"):
        _create(_with_section("{'backend': 'memory'}"))
    storage = _create(_with_section(json.dumps({"backend": "memory", "verify": "header"})))
    assert storage.settings.verify == "header"
    toml = tmp_path / "kvtier.toml"
    toml.write_text('backend = "memory"\ntenant = "team-a"\n')
    assert _create(_with_section(f"@{toml}")).settings.tenant == "team-a"


def _refusal(info: pytest.ExceptionInfo[ValueError]) -> BaseException:
    """kvtier's error behind SGLang's controller, which re-raises a ValueError from the
    storage backend as ``Failed to create storage backend: <message>``."""
    assert str(info.value).startswith("Failed to create storage backend: ")
    assert info.value.__cause__ is not None
    return info.value.__cause__


def _lcm_extra(backend: str, root: Path, lcm: int, *, zero_copy: bool = True) -> dict[str, Any]:
    extra = extra_config(backend, root)
    extra["tp_lcm_size"] = lcm  # SGLang's controller pops it and decides should_split_heads
    if not zero_copy:
        del extra["interface_v1"]
    return extra


def _heads_of(pool: Any, page_start: int, first: int, count: int) -> torch.Tensor:
    """Bytes of heads ``[first, first + count)`` of a page_head page (K then V)."""
    page = pool.get_data_page(page_start, flat=False)[:, :, first : first + count]
    return page.contiguous().view(torch.uint8).flatten().clone()


@pytest.mark.parametrize("backend", SHARED_ROOT)
@pytest.mark.parametrize("zero_copy", [True, False], ids=["v1", "generic"])
def test_heterogeneous_tp_instances_share_pages(
    backend: str, zero_copy: bool, attach: Any, tmp_path: Path
) -> None:
    """SGLang's heterogeneous TP (``tp_lcm_size``): a TP-1 instance (4 KV heads) and a TP-2
    instance (2 heads per rank) on one store. SGLang's controller has the TP-1 rank split
    heads (``should_split_heads``), and kvtier stores each of its pages as the two pages
    the TP-2 ranks hold, so each side reads what the other wrote."""
    if backend == "uring":
        _uring_or_skip()
    root = tmp_path / "shared"
    whole = MHAHostPool(layout="page_head", head_num=4)
    one = attach(backend, whole, extra=_lcm_extra(backend, root, 2, zero_copy=zero_copy))
    assert one.config.should_split_heads and one.config.tp_lcm_size == 2
    halves = [MHAHostPool(layout="page_head", head_num=2) for _ in range(2)]
    two = [
        attach(
            backend,
            halves[r],
            extra=_lcm_extra(backend, root, 2, zero_copy=zero_copy),
            tp_rank=r,
            tp_size=2,
        )
        for r in range(2)
    ]
    assert not two[0].config.should_split_heads  # the widest instance keeps whole pages
    hashes = _hashes(3, 16)
    indices, _ = _fill(whole, 3, seed=4)
    assert one.backup(hashes, indices) == 48
    stats = one.storage.kvtier_stats()
    assert stats["puts"] == 6  # 3 pages, 2 head slices each
    for rank, (controller, pool) in enumerate(zip(two, halves, strict=True)):
        target = pool.alloc(48)
        assert controller.prefetch(controller.hit_query(hashes), target) == 3
        for src, dst in zip(_starts(whole, indices), _starts(pool, target), strict=True):
            assert torch.equal(page_content(pool, dst), _heads_of(whole, src, 2 * rank, 2))
    # and back: the TP-2 ranks write, the TP-1 instance reads whole pages
    other = _hashes(2, 16, salt=500)
    written = []
    for controller, pool in zip(two, halves, strict=True):
        got, _ = _fill(pool, 2, seed=len(written) + 20)
        written.append([page_content(pool, start) for start in _starts(pool, got)])
        assert controller.backup(other, got) == 32
    target = whole.alloc(32)
    assert one.prefetch(one.hit_query(other), target) == 2
    for page, start in enumerate(_starts(whole, target)):
        for rank in range(2):
            assert torch.equal(_heads_of(whole, start, 2 * rank, 2), written[rank][page])
    # one missing slice is a missing page: a TP-1 instance never loads half a page
    two[1].storage.clear()  # rank 1's store: the slices of heads 2-3 of every page
    extra = _lcm_extra(backend, root, 2, zero_copy=zero_copy)
    fresh = attach(backend, MHAHostPool(layout="page_head", head_num=4), extra=extra)
    assert fresh.hit_query(other) == [] and fresh.hit_query(hashes) == []
    assert fresh.storage.batch_exists(hashes) == 0


def test_split_heads_needs_page_head_and_mha(attach: Any) -> None:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    config = storage_config(extra_config=extra_config("memory", None))
    config.should_split_heads, config.tp_lcm_size = True, 2
    storage = StorageBackendFactory.create_backend("dynamic", config, None)
    try:
        with pytest.raises(UnsupportedCombinationError, match="page_head"):
            storage.register_mem_pool_host(MHAHostPool(layout="page_first"))
        with pytest.raises(UnsupportedCombinationError, match="heads divisible"):
            storage.register_mem_pool_host(MHAHostPool(layout="page_head", head_num=3))
    finally:
        storage.close()
    config.is_mla_model = True
    with pytest.raises(UnsupportedCombinationError, match="MLA"):
        StorageBackendFactory.create_backend("dynamic", config, None)
    config.is_mla_model, config.tp_size, config.tp_lcm_size = False, 2, 3
    with pytest.raises(InvalidFieldError, match="tp_lcm_size"):
        StorageBackendFactory.create_backend("dynamic", config, None)


def test_unavailable_backend_gives_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.core.specs import BackendSpec

    monkeypatch.setattr(BackendSpec, "unavailable_reason", lambda self: "no io_uring here")
    with pytest.raises(BackendUnavailableError, match="no io_uring here"):
        _create(_with_section({"backend": "uring"}))


def test_unsupported_host_pool_layout_is_refused_at_registration(attach: Any) -> None:
    # SGLang's own page_unified pool: its get_data_page and get_page_buffer_meta raise
    # "Unsupported layout: page_unified", so no SGLang storage backend can page it either
    pool = MHAHostPool(layout="page_unified", head_num=4, head_group_num=2)
    with pytest.raises(ValueError, match="Unsupported layout"):
        pool.get_data_page(0, flat=False)
    with pytest.raises(ValueError) as info:
        attach("memory", pool)
    error = _refusal(info)
    assert isinstance(error, UnsupportedCombinationError) and "page_unified" in str(error)
    assert "--hicache-mem-layout page_first" in str(error)


def test_raw_byte_pool_needs_the_kv_dtype(attach: Any, tmp_path: Path) -> None:
    pool = MHAHostPool(dtype=torch.float8_e4m3fn)  # SGLang keeps fp8 KV as raw bytes
    assert pool.dtype == torch.uint8
    with pytest.raises(ValueError) as info:
        attach("memory", pool)
    assert isinstance(_refusal(info), InvalidFieldError) and "float8_e4m3fn" in str(info.value)
    extra = extra_config("memory", None, dtype="fp8")
    controller = attach("memory", pool, extra=extra)
    indices, data = _fill(pool, 1)
    hashes = _hashes(1, 16)
    assert controller.backup(hashes, indices) == 16
    target = pool.alloc(16)
    assert controller.prefetch(hashes, target) == 1
    assert torch.equal(page_content(pool, int(target[0])), data[0])


def test_o_direct_plan_is_checked_at_registration(attach: Any, tmp_path: Path) -> None:
    extra = extra_config("file", tmp_path / "store")
    extra["kvtier"]["extra_config"]["o_direct"] = True
    pool = MHAHostPool(layout="layer_first", head_dim=8)  # 16 x 2 x 8 x 2 = 512-byte extents
    with pytest.raises(ValueError) as info:
        attach("file", pool, extra=extra)
    assert isinstance(_refusal(info), InvalidFieldError) and "O_DIRECT" in str(info.value)


def test_an_extra_pool_that_is_neither_kv_shaped_nor_paged_is_refused(attach: Any) -> None:
    storage = attach("memory", MHAHostPool()).storage
    with pytest.raises(UnsupportedCombinationError, match="mamba"):
        storage.register_mem_host_pool_v2(object(), "mamba")


def test_docs_list_every_section_field() -> None:
    from kvtier.core.config_docs import config_reference_markdown
    from kvtier.integrations.sglang import SGLangSection

    docs = (Path(__file__).resolve().parent.parent / "docs" / "sglang.md").read_text()
    assert config_reference_markdown(SGLangSection) in docs
