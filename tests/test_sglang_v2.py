"""SGLang's v2 storage calls for hybrid models: KV plus Mamba-state and sliding-window pools.

All SGLang's own: ``HiCacheStorage`` (the adapter's base), the ``dynamic`` loader, the host
pools on the CPU (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` for KV and for the
sliding-window layers, as ``build_hybrid_swa_group`` builds the SWA pool, and
``MambaPoolHost`` for the state), grouped in its ``HostPoolGroup`` under its
``HybridCacheController``, which registers every pool (``register_mem_host_pool_v2``) and
whose backup and prefetch threads move the extra pools with ``batch_set_v2``,
``batch_exists_v2`` and ``batch_get_v2``; the v2 types (``PoolTransfer``, ``PoolName``,
``PoolHitPolicy``, ``PoolTransferResult``, ``count_pool_hits``); and SGLang's ``HiCacheFile``
as the reference for the hit policies.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang_host_pool import (
    CLASS_NAME,
    MODULE_PATH,
    Chain,
    HybridController,
    fill_random,
    page_content,
    page_hashes,
    sglang_or_skip,
    storage_config,
    zero_page,
)
from sglang_host_pool import mamba_host_pool as MambaHostPool
from sglang_host_pool import mha_host_pool as MHAHostPool
from sglang_host_pool import mla_host_pool as MLAHostPool

from kvtier.backends.segment import SegmentConfig
from kvtier.core.errors import StorageError, UnsupportedCombinationError
from kvtier.testing import require
from kvtier.testing.mooncake import MooncakeMaster, mooncake_unavailable_reason, use_client_env

hs = sglang_or_skip()

from kvtier.integrations.sglang import KvtierHiCacheStorage  # noqa: E402

MAMBA, SWA, KV = hs.PoolName.MAMBA, hs.PoolName.SWA, hs.PoolName.KV
TRAILING, ALL = hs.PoolHitPolicy.TRAILING_PAGES, hs.PoolHitPolicy.ALL_PAGES
PS = 4  # tokens per KV page


def _uring_or_skip() -> None:
    from kvtier.backends.uring import URING_SPEC

    require("uring", URING_SPEC.unavailable_reason())


@pytest.fixture(params=["memory", "file", "uring", "segment"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "uring":
        _uring_or_skip()
    return str(request.param)


@pytest.fixture(scope="module")
def mooncake_master() -> Iterator[MooncakeMaster]:
    """A Mooncake master and a storage node on loopback for this module."""
    require("mooncake", mooncake_unavailable_reason())
    use_client_env()
    master = MooncakeMaster(storage_node_bytes=256 << 20).start()
    try:
        yield master
    finally:
        master.close()


class Hybrid:
    """A hybrid model's storage as SGLang's HybridCacheController attaches it."""

    def __init__(
        self,
        backend: str,
        root: Path,
        *,
        mla: bool = False,
        options: dict[str, Any] | None = None,
        side_states: bool = False,
        section: dict[str, Any] | None = None,
        **config: Any,
    ) -> None:
        if options is None:
            options = {"root": str(root)} if backend in ("file", "uring", "segment") else {}
        extra = {
            "backend_name": "kvtier",
            "module_path": MODULE_PATH,
            "class_name": CLASS_NAME,
            "interface_v1": 1,
            # ``section``: the whole kvtier section instead (a chain of ``tiers``, say)
            "kvtier": section or {"backend": backend, "extra_config": options},
        }
        self.kv: Any = MLAHostPool(page_size=PS) if mla else MHAHostPool(page_size=PS)
        self.mamba = MambaHostPool(side_states=side_states)
        self.swa: Any = (
            MLAHostPool(layer_num=2, page_size=PS, pages=16)
            if mla
            else MHAHostPool(layer_num=2, head_num=1, page_size=PS, pages=16)
        )
        cfg = storage_config(extra_config=extra, is_mla=mla, layout=self.kv.layout, **config)
        # SGLang's HybridCacheController: attach_storage_backend registers the anchor pool,
        # then every entry of the HostPoolGroup with register_mem_host_pool_v2
        self.controller = HybridController.attach_group(
            cfg, self.kv, [(MAMBA, self.mamba), (SWA, self.swa)]
        )
        self.storage: KvtierHiCacheStorage = self.controller.storage

    def close(self) -> None:
        self.controller.close()


@pytest.fixture
def hybrid(tmp_path: Path) -> Any:
    made: list[Hybrid] = []

    def make(backend: str, **kwargs: Any) -> Hybrid:
        made.append(Hybrid(backend, tmp_path / "store", **kwargs))
        return made[-1]

    yield make
    for item in made:
        item.close()


def _hashes(count: int, salt: int = 0) -> Chain:
    return page_hashes(list(range(salt, salt + count * PS)), PS)


def _store(h: Hybrid, hashes: list[str]) -> dict[str, Any]:
    """Back up 4 KV pages, Mamba states after pages 2 and 4, SWA pages 3-4 (a 2-page window),
    through the hybrid controller's backup thread: two write_storage calls, as the radix
    tree backs up a node and then its child (``prefix_keys``: the parent's hashes)."""
    kv_idx = h.kv.alloc(4 * PS)
    kv_data = [fill_random(h.kv, int(kv_idx[i * PS]), i) for i in range(4)]
    slots = h.mamba.alloc(2)
    mamba_data = [fill_random(h.mamba, int(s), 10 + i) for i, s in enumerate(slots)]
    swa_idx = h.swa.alloc(2 * PS)
    swa_data = [fill_random(h.swa, int(swa_idx[i * PS]), 20 + i) for i in range(2)]
    parent = [
        hs.PoolTransfer(name=MAMBA, host_indices=slots[:1], keys=hashes[1:2], hit_policy=TRAILING)
    ]
    assert h.controller.backup(hashes[:2], kv_idx[: 2 * PS], extra_pools=parent) == 2 * PS
    child = [
        hs.PoolTransfer(name=MAMBA, host_indices=slots[1:], keys=hashes[3:4], hit_policy=TRAILING),
        hs.PoolTransfer(name=SWA, host_indices=swa_idx, keys=hashes[2:4], hit_policy=TRAILING),
    ]
    done = h.controller.backup(
        hashes[2:4], kv_idx[2 * PS :], prefix_keys=hashes[:2], extra_pools=child
    )
    assert done == 2 * PS
    stats = h.storage.kvtier_stats()
    assert stats["mamba_puts"] >= 2 and stats["swa_puts"] >= 2, stats
    return {"kv": kv_data, "mamba": mamba_data, "swa": swa_data}


def _query(pools: tuple[Any, ...] = (MAMBA, SWA)) -> list[Any]:
    """The placeholder transfers of a prefetch's hit query (keys fix the trailing window)."""
    window = {MAMBA: 1, SWA: 2}
    return [
        hs.PoolTransfer(name=p, keys=["__placeholder__"] * window[p], hit_policy=TRAILING)
        for p in pools
    ]


def _file_of(h: Hybrid, pool: str, key: str) -> Any:
    """The stored object of ``key`` in ``pool`` ('kv' or an extra pool): a file or a buffer."""
    store = h.storage._require().store if pool == "kv" else h.storage._pool(pool).store
    name = (
        h.storage._keys(h.storage._require(), [key])[0]
        if pool == "kv"
        else h.storage._pool(pool).keys([key])[0]
    )
    backend = store.backend
    if isinstance(getattr(backend, "config", None), SegmentConfig):
        return _segment_page(Path(backend.config.root), name)
    if hasattr(backend, "store"):
        from kvtier.backends.filestore.paths import page_path

        return page_path(Path(backend.store), name)
    return backend._pages, name


def _segment_page(root: Path, key: str) -> tuple[Path, int, int]:
    """(segment file, offset, length) of ``key``'s live page, from the record headers."""
    from kvtier.backends.segment import format as fmt

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
                if entry.live and entry.key == key:
                    return path, at, entry.length
                at += entry.length
            offset = record.end
    raise AssertionError(f"no live page of {key} under {root}")


def _flip(h: Hybrid, pool: str, key: str) -> None:
    where = _file_of(h, pool, key)
    if isinstance(where, Path):
        raw = bytearray(where.read_bytes())
        raw[len(raw) - 7] ^= 0x10
        where.write_bytes(bytes(raw))
    elif isinstance(where[0], Path):  # a page inside a segment file
        path, offset, length = where
        with open(path, "r+b") as f:
            f.seek(offset + length - 7)
            byte = f.read(1)[0]
            f.seek(offset + length - 7)
            f.write(bytes([byte ^ 0x10]))
    else:
        pages, name = where
        pages[name][len(pages[name]) - 7] ^= 0x10


@pytest.fixture(params=["memory", "file", "uring", "segment", "mooncake"])
def any_backend(request: pytest.FixtureRequest) -> dict[str, Any]:
    """A backend name and its options (Mooncake: the master on loopback)."""
    if request.param == "uring":
        _uring_or_skip()
    if request.param == "mooncake":
        master = request.getfixturevalue("mooncake_master")
        options = {"master_address": master.address, "global_segment_size": 0}
        return {"backend": "mooncake", "options": options}
    return {"backend": request.param}


def test_hybrid_round_trip_is_bit_exact(any_backend: dict[str, Any], hybrid: Any) -> None:
    h = hybrid(**any_backend)
    backend = any_backend["backend"]
    hashes = _hashes(4)
    data = _store(h, hashes)
    result = h.storage.batch_exists_v2(hashes, _query(), hs.HiCacheStorageExtraInfo())
    assert isinstance(result, hs.PoolTransferResult)
    # Mamba allows lengths 2 and 4, the SWA window (pages 3-4) only 4
    assert result.kv_hit_pages == 4
    assert result.restorable_prefix_pages == [4]
    assert result.extra_pool_hit_pages == {KV: 4, MAMBA: 4, SWA: 4}
    # the hybrid controller's prefetch thread asks the same (batch_exists_v2) ...
    operation = h.controller.query(hashes, extra_pools=_query())
    assert operation.hash_value == hashes and operation.storage_hit_count == 4 * PS
    # ... the scheduler gives the hit fresh host slots in every pool ...
    kv_target = h.kv.alloc(4 * PS)
    slot = h.mamba.alloc(1)
    swa_target = h.swa.alloc(2 * PS)
    mamba_transfer, swa_transfer = operation.pool_transfers
    mamba_transfer.host_indices, swa_transfer.host_indices = slot, swa_target
    # ... and its prefetch I/O thread loads KV (batch_get_v1), then the trailing state
    # and window of the hit (batch_get_v2, keys re-aligned by _sync_trailing_keys)
    assert h.controller.prefetch(operation.hash_value, kv_target, operation=operation) == 4
    assert mamba_transfer.keys == hashes[3:4] and swa_transfer.keys == hashes[2:4]
    assert h.controller.pool_hits[MAMBA.value] == 1
    assert h.controller.pool_hits[SWA.value] == 2
    for i in range(4):
        assert torch.equal(page_content(h.kv, int(kv_target[i * PS])), data["kv"][i])
    assert torch.equal(page_content(h.mamba, int(slot[0])), data["mamba"][1])
    for i in range(2):
        assert torch.equal(page_content(h.swa, int(swa_target[i * PS])), data["swa"][i])
    # the earlier Mamba checkpoint (after page 2) round-trips too: a hit of 2 pages
    operation = h.controller.query(_hashes(2), extra_pools=_query((MAMBA,)))
    assert operation.storage_hit_count == 2 * PS
    slot2 = h.mamba.alloc(1)
    operation.pool_transfers[0].host_indices = slot2
    assert h.controller.prefetch(operation.hash_value, h.kv.alloc(2 * PS), operation=operation) == 2
    assert torch.equal(page_content(h.mamba, int(slot2[0])), data["mamba"][0])
    stats = h.storage.kvtier_stats()
    assert stats["mamba_hits"] == 2 and stats["swa_hits"] == 2 and stats["hits"] == 6
    assert stats["mamba_invalid"] == stats["swa_invalid"] == stats["invalid"] == 0
    # every pool in place: Mamba slots through SGLang's get_page_buffer_meta runs
    assert stats.get("state_pages_copied", 0) == 0 and h.storage._pool(MAMBA).in_place
    if backend == "mooncake":
        # the pools' buffers are registered like the KV pool's: nothing staged
        for prefix in ("", "swa_", "mamba_"):
            assert stats.get(f"{prefix}backend_staged_pages", 0) == 0, stats
            assert stats[f"{prefix}backend_registered_regions"] >= 2, stats


def test_every_pool_is_a_chain_of_the_sections_tiers(hybrid: Any, tmp_path: Path) -> None:
    """The KV, Mamba and SWA pools each sit behind the section's chain: their pages cascade
    into the second tier, and with the first tier emptied the hybrid controller's threads
    load every pool, bit-exact, from the second."""
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    tiers = [
        {"backend": "file", "extra_config": {"root": str(fast)}},
        {"backend": "file", "extra_config": {"root": str(slow)}},
    ]
    h = hybrid("file", section={"tiers": tiers})
    hashes = _hashes(4)
    data = _store(h, hashes)
    assert h.storage.flush_tiers(30.0)
    stats = h.storage.tier_stats()
    assert set(stats) == {"kv", "mamba", "swa"}
    for name, pages in (("kv", 4), ("mamba", 2), ("swa", 2)):
        assert [t["name"] for t in stats[name]] == ["0:file", "1:file"]
        assert stats[name][1]["cascades"] == pages, (name, stats[name])
    for page in fast.rglob("*.kv"):
        page.unlink()
    operation = h.controller.query(hashes, extra_pools=_query())
    assert operation.storage_hit_count == 4 * PS
    kv_target, slot, swa_target = h.kv.alloc(4 * PS), h.mamba.alloc(1), h.swa.alloc(2 * PS)
    mamba_transfer, swa_transfer = operation.pool_transfers
    mamba_transfer.host_indices, swa_transfer.host_indices = slot, swa_target
    assert h.controller.prefetch(operation.hash_value, kv_target, operation=operation) == 4
    for i in range(4):
        assert torch.equal(page_content(h.kv, int(kv_target[i * PS])), data["kv"][i])
    assert torch.equal(page_content(h.mamba, int(slot[0])), data["mamba"][1])
    for i in range(2):
        assert torch.equal(page_content(h.swa, int(swa_target[i * PS])), data["swa"][i])
    assert h.storage.flush_tiers(30.0)
    promoted = {name: h.storage.tier_stats()[name][0]["promotions"] for name in stats}
    assert promoted == {"kv": 4, "mamba": 1, "swa": 2}


def test_state_pool_without_zero_copy_meta_moves_by_value(
    backend: str, hybrid: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.integrations.sglang"):
        h = hybrid(backend, side_states=True)
    assert "'mamba' (MambaPoolHost) cannot be served in place" in caplog.text
    assert "slot side states" in caplog.text
    mamba = h.storage._pool(MAMBA)
    assert not mamba.in_place and "|by-value" in mamba.plan.namespace.model
    hashes = _hashes(4)
    data = _store(h, hashes)
    assert h.storage.batch_exists_v2(hashes, _query()).kv_hit_pages == 4
    slot = h.mamba.alloc(2)
    got = h.storage.batch_get_v2(
        [hs.PoolTransfer(name=MAMBA, host_indices=slot, keys=hashes[1::2], hit_policy=TRAILING)]
    )
    assert got == {MAMBA: [True, True]}
    for i in range(2):
        assert torch.equal(page_content(h.mamba, int(slot[i])), data["mamba"][i])
    # a bad page never reaches the slot: it is filled from a verified copy only
    _flip(h, "mamba", hashes[3])
    zero_page(h.mamba, int(slot[1]))
    got = h.storage.batch_get_v2(
        [hs.PoolTransfer(name=MAMBA, host_indices=slot[1:], keys=hashes[3:], hit_policy=TRAILING)]
    )
    assert got == {MAMBA: [False]}
    assert not page_content(h.mamba, int(slot[1])).any()
    stats = h.storage.kvtier_stats()
    assert stats["state_pools_by_value"] == 1
    assert stats["state_pages_copied"] == 2 + 2  # 2 stored, 2 loaded (the bad one is not)
    assert stats["mamba_invalid_corrupt_checksum"] == 1


def test_each_pool_has_its_own_namespace_and_geometry(backend: str, hybrid: Any) -> None:
    h = hybrid(backend)
    kv_plan = h.storage._require().plan
    plans = {name: h.storage._pool(name).plan for name in (MAMBA, SWA)}
    ids = {kv_plan.namespace.id, *(p.namespace.id for p in plans.values())}
    assert len(ids) == 3
    prints = {kv_plan.geometry.fingerprint, *(p.geometry.fingerprint for p in plans.values())}
    assert len(prints) == 3
    assert plans[MAMBA].geometry.bytes_per_page == h.mamba.size_per_token
    assert plans[SWA].geometry.num_layers == 2 and plans[SWA].layout.value == h.swa.layout
    assert "pool=mamba" in plans[MAMBA].namespace.model
    assert h.storage._pool(MAMBA).keys(["ab"]) != h.storage._keys(h.storage._require(), ["ab"])


def test_hit_needs_every_pool(backend: str, hybrid: Any) -> None:
    h = hybrid(backend)
    hashes = _hashes(4)
    _store(h, hashes)
    mamba = h.storage._pool(MAMBA)
    # drop the Mamba state after page 4: only the checkpoint after page 2 is left
    assert mamba.store.delete(mamba.keys(hashes[3:4])) == [True]
    result = h.storage.batch_exists_v2(hashes, _query((MAMBA,)))
    assert result.kv_hit_pages == 2
    assert result.restorable_prefix_pages == [2]
    assert result.extra_pool_hit_pages == {KV: 4, MAMBA: 2}
    # with the SWA window (pages 3-4 only) no length satisfies both
    assert h.storage.batch_exists_v2(hashes, _query()).kv_hit_pages == 0
    # without extra pools the KV prefix alone answers, as batch_exists does
    assert h.storage.batch_exists_v2(hashes, []).kv_hit_pages == 4


def test_all_pages_policy_cuts_at_the_first_missing_page(backend: str, hybrid: Any) -> None:
    h = hybrid(backend)
    hashes = _hashes(4)
    _store(h, hashes)
    indexer = MHAHostPool(layer_num=1, head_num=1, head_dim=16, page_size=PS, pages=8)
    h.storage.register_mem_host_pool_v2(indexer, hs.PoolName.INDEXER)
    idx = indexer.alloc(4 * PS)
    for i in range(4):
        fill_random(indexer, int(idx[i * PS]), 30 + i)
    stored = h.storage.batch_set_v2(
        [hs.PoolTransfer(name=hs.PoolName.INDEXER, host_indices=idx, keys=hashes)]
    )
    assert stored == {hs.PoolName.INDEXER: [True] * 4}
    pool = h.storage._pool(hs.PoolName.INDEXER)
    query = [hs.PoolTransfer(name=hs.PoolName.INDEXER, keys=hashes, hit_policy=ALL)]
    assert h.storage.batch_exists_v2(hashes, query).kv_hit_pages == 4
    pool.store.delete(pool.keys(hashes[1:2]))
    result = h.storage.batch_exists_v2(hashes, query)
    assert result.kv_hit_pages == 1 and result.restorable_prefix_pages == [1]


def test_flipped_state_bit_is_a_counted_miss(backend: str, hybrid: Any) -> None:
    h = hybrid(backend)
    hashes = _hashes(4)
    _store(h, hashes)
    _flip(h, "mamba", hashes[3])
    _flip(h, "swa", hashes[2])
    # exists answers from the index; reading is what finds the page bad
    assert h.storage.batch_exists_v2(hashes, _query()).kv_hit_pages == 4
    slot = h.mamba.alloc(1)
    swa_target = h.swa.alloc(2 * PS)
    got = h.storage.batch_get_v2(
        [
            hs.PoolTransfer(name=MAMBA, host_indices=slot, keys=hashes[3:4], hit_policy=TRAILING),
            hs.PoolTransfer(
                name=SWA, host_indices=swa_target, keys=hashes[2:4], hit_policy=TRAILING
            ),
        ]
    )
    # the bad SWA page is the first of the window, so the whole window is a miss
    assert got == {MAMBA: [False], SWA: [False, False]}
    assert hs.count_pool_hits(got) == {MAMBA: 0, SWA: 0}
    stats = h.storage.kvtier_stats()
    assert stats["mamba_invalid"] == 1 and stats["mamba_invalid_corrupt_checksum"] == 1
    assert stats["swa_invalid"] == 1
    assert stats["invalid"] == 0  # the KV pool's pages are untouched


@pytest.mark.parametrize("store", ["memory", "file"])
def test_a_state_page_never_passes_for_a_kv_page(store: str, hybrid: Any) -> None:
    h = hybrid(store)
    hashes = _hashes(4)
    _store(h, hashes)
    state, kv = _file_of(h, "mamba", hashes[3]), _file_of(h, "kv", hashes[3])
    if isinstance(state, Path):
        kv.write_bytes(state.read_bytes())
    else:
        kv[0][kv[1]] = bytearray(state[0][state[1]])
    target = h.kv.alloc(4 * PS)
    assert h.controller.prefetch(hashes, target) == 3
    stats = h.storage.kvtier_stats()
    # a foreign-length object is a miss, a same-length one fails the envelope: never data
    assert stats["hits"] == 3 and stats["invalid"] + stats["misses"] == 1


def test_mamba_state_is_per_rank_under_mla(hybrid: Any) -> None:
    ranks = [hybrid("memory", mla=True, tp_rank=r, tp_size=2) for r in range(2)]
    assert not ranks[1].controller.config.is_storage_writer
    mamba = [r.storage._pool(MAMBA) for r in ranks]
    swa = [r.storage._pool(SWA) for r in ranks]
    assert mamba[0].plan.namespace.id != mamba[1].plan.namespace.id
    assert swa[0].plan.namespace.id == swa[1].plan.namespace.id  # shared, like MLA KV
    hashes = _hashes(2)
    slot = ranks[1].mamba.alloc(1)
    fill_random(ranks[1].mamba, int(slot[0]), 3)
    idx = ranks[1].swa.alloc(PS)
    out = ranks[1].storage.batch_set_v2(
        [
            hs.PoolTransfer(name=MAMBA, host_indices=slot, keys=hashes[1:], hit_policy=TRAILING),
            hs.PoolTransfer(name=SWA, host_indices=idx, keys=hashes[1:], hit_policy=TRAILING),
        ]
    )
    assert out == {MAMBA: [True], SWA: [True]}
    stats = ranks[1].storage.kvtier_stats()
    assert stats["mamba_puts"] == 1  # every rank writes its own state shard
    assert stats["swa_puts"] == 0 and stats["skipped_not_writer"] == 1  # the writer does


def test_index_mismatch_moves_nothing_and_is_counted(
    hybrid: Any, caplog: pytest.LogCaptureFixture
) -> None:
    h = hybrid("memory")
    hashes = _hashes(2)
    slots = h.mamba.alloc(1)
    with caplog.at_level(logging.WARNING, logger="kvtier.integrations.sglang"):
        out = h.storage.batch_set_v2(
            [hs.PoolTransfer(name=MAMBA, host_indices=slots, keys=hashes, hit_policy=TRAILING)]
        )
    assert out == {MAMBA: [False, False]}
    assert h.storage.kvtier_stats()["v2_index_mismatch"] == 1
    assert h.storage.kvtier_stats()["mamba_puts"] == 0
    assert "2 'mamba' pages" in caplog.text


def test_refusals_name_what_is_missing(hybrid: Any, tmp_path: Path) -> None:
    h = hybrid("memory")
    hashes = _hashes(2)
    with pytest.raises(StorageError, match=r"'indexer'.*never registered"):
        h.storage.batch_exists_v2(hashes, [hs.PoolTransfer(name=hs.PoolName.INDEXER, keys=hashes)])
    with pytest.raises(UnsupportedCombinationError, match="block_groups"):
        h.storage.batch_exists_v2(
            hashes,
            [hs.PoolTransfer(name=MAMBA, keys=hashes, hit_policy=hs.PoolHitPolicy.BLOCK_GROUPS)],
        )
    with pytest.raises(UnsupportedCombinationError, match=r"mamba.*get_data_page"):
        h.storage.register_mem_host_pool_v2(object(), MAMBA)
    fresh = KvtierHiCacheStorage(h.controller.config)
    with pytest.raises(StorageError, match="before the KV pool"):
        fresh.register_mem_host_pool_v2(MambaHostPool(), MAMBA)
    fresh.close()


QUERIES = [
    [(MAMBA, TRAILING, 1)],
    [(SWA, TRAILING, 2)],
    [(MAMBA, TRAILING, 1), (SWA, TRAILING, 2)],
    [(SWA, TRAILING, 3), (MAMBA, TRAILING, 1)],
    [(SWA, ALL, 1)],
    [(MAMBA, ALL, 1), (SWA, TRAILING, 2)],
]


@pytest.mark.parametrize("seed", range(8))
def test_hit_answers_match_sglangs_own_file_backend(seed: int, hybrid: Any, tmp_path: Path) -> None:
    """SGLang's HiCacheFile is the reference for the hit policies: same pages, same answer."""
    import random

    h = hybrid("file")
    ref_config = storage_config(extra_config={}, model_name="test/reference")
    ref = hs.HiCacheFile(ref_config, file_path=str(tmp_path / "reference"))
    ref.register_mem_pool_host(h.kv)
    for pool, name in ((h.kv, KV), (h.mamba, MAMBA), (h.swa, SWA)):
        ref.register_mem_host_pool_v2(pool, name)
    gen = random.Random(seed)
    count = 6
    hashes = _hashes(count, salt=1000 * seed)
    kv_idx, slots, swa_idx = h.kv.alloc(count * PS), h.mamba.alloc(count), h.swa.alloc(count * PS)
    for i, key in enumerate(hashes):
        if gen.random() < 0.9:
            fill_random(h.kv, int(kv_idx[i * PS]), i)
            page = kv_idx[i * PS : (i + 1) * PS]
            assert h.storage.batch_set_v1([key], page) == [True]
            assert ref.set(key, h.kv.get_data_page(int(page[0])))
        for name, present, indices in (
            (MAMBA, 0.5, slots[i : i + 1]),
            (SWA, 0.7, swa_idx[i * PS : (i + 1) * PS]),
        ):
            if gen.random() < present:
                transfer = hs.PoolTransfer(name=name, host_indices=indices, keys=[key])
                assert h.storage.batch_set_v2([transfer]) == {name: [True]}
                assert ref.batch_set_v2([transfer]) == {name: [True]}
    for query in QUERIES:
        transfers = [
            hs.PoolTransfer(name=name, keys=["__placeholder__"] * n, hit_policy=policy)
            for name, policy, n in query
        ]
        ours = h.storage.batch_exists_v2(hashes, transfers)
        theirs = ref.batch_exists_v2(hashes, transfers)
        assert (
            ours.kv_hit_pages,
            ours.restorable_prefix_pages,
            ours.extra_pool_hit_pages,
        ) == (
            theirs.kv_hit_pages,
            theirs.restorable_prefix_pages,
            theirs.extra_pool_hit_pages,
        ), query


# --- key stability: the namespaces and keys stored pages were written under ------------------

#: An SGLang page hash, as its controller passes it.
RAW = "0f" * 32
#: Keys and namespace models computed by the adapter before its split into modules
#: (``settings``, ``plan``, ``pools``, ``metrics``, ``storage``): pages stored then must be
#: found now. Per case: the storage config, then per pool its namespace model and key.
KNOWN_KEYS: dict[str, tuple[dict[str, Any], dict[str, tuple[str, str]]]] = {
    "mha-tp1": (
        {},
        {
            "kv": ("test/model|page_first", f"42d28b76b0a03c93-x-{RAW}"),
            "mamba": ("test/model|pool=mamba|page_first", f"748c78684386170e-x-{RAW}"),
            "swa": ("test/model|pool=swa|page_first", f"64efb61149a4f405-x-{RAW}"),
        },
    ),
    "mha-tp2-rank1": (
        {"tp_rank": 1, "tp_size": 2},
        {
            "kv": ("test/model|page_first", f"42d28b76b0a03c93-x-{RAW}_r1of2"),
            "mamba": ("test/model|pool=mamba|page_first", f"748c78684386170e-x-{RAW}_r1of2"),
            "swa": ("test/model|pool=swa|page_first", f"64efb61149a4f405-x-{RAW}_r1of2"),
        },
    ),
    "mla-tp2-rank1": (
        {"mla": True, "tp_rank": 1, "tp_size": 2},
        {
            "kv": ("test/model|page_first", f"cdf79cd7c5f071be-x-{RAW}"),
            "mamba": ("test/model|pool=mamba|tp1of2|page_first", f"b74814a444e94023-x-{RAW}"),
            "swa": ("test/model|pool=swa|page_first", f"af73c9265c1149ed-x-{RAW}"),
        },
    ),
    "mla-tp2-rank1-cp2-rank1": (
        {"mla": True, "tp_rank": 1, "tp_size": 2, "cp": (1, 2)},
        {
            "kv": ("test/model|cp1of2|page_first", f"8d75a6028ce02b2a-x-{RAW}"),
            "mamba": (
                "test/model|cp1of2|pool=mamba|tp1of2|page_first",
                f"c6ce19f4970e5233-x-{RAW}",
            ),
            "swa": ("test/model|cp1of2|pool=swa|page_first", f"3f5a1dd5d2ab01be-x-{RAW}"),
        },
    ),
    "mha-tp4-rank3-pp2-rank1-cp2-rank0-tenant": (
        {"tp_rank": 3, "tp_size": 4, "pp": (1, 2), "cp": (0, 2), "tenant": "team-a"},
        {
            "kv": ("test/model|pp1of2|cp0of2|page_first", f"1ea311c7384943d9-x-{RAW}_r3of4"),
            "mamba": (
                "test/model|pp1of2|cp0of2|pool=mamba|page_first",
                f"307e1bec74f2fb99-x-{RAW}_r3of4",
            ),
            "swa": (
                "test/model|pp1of2|cp0of2|pool=swa|page_first",
                f"2e1579f37df30b4b-x-{RAW}_r3of4",
            ),
        },
    ),
    "mha-layer-first-declared-model": (
        {"layout": "layer_first", "model": "my-model"},
        {
            "kv": ("my-model|layer_first", f"50502bb23ccd9653-x-{RAW}"),
            "mamba": ("my-model|pool=mamba|page_first", f"d7817faee0972e36-x-{RAW}"),
            "swa": ("my-model|pool=swa|page_first", f"779d93446dff01cd-x-{RAW}"),
        },
    ),
    "mla-tp2-rank0-mamba-by-value": (
        {"mla": True, "tp_rank": 0, "tp_size": 2, "side_states": True},
        {
            "kv": ("test/model|page_first", f"cdf79cd7c5f071be-x-{RAW}"),
            "mamba": (
                "test/model|pool=mamba|tp0of2|by-value|page_first",
                f"0a6f7d676f663684-x-{RAW}",
            ),
            "swa": ("test/model|pool=swa|page_first", f"af73c9265c1149ed-x-{RAW}"),
        },
    ),
    "mha-tp2-rank0-mamba-by-value": (
        {"tp_rank": 0, "tp_size": 2, "side_states": True},
        {
            "kv": ("test/model|page_first", f"42d28b76b0a03c93-x-{RAW}_r0of2"),
            "mamba": (
                "test/model|pool=mamba|by-value|page_first",
                f"9e3ee1c6af43a3e2-x-{RAW}_r0of2",
            ),
            "swa": ("test/model|pool=swa|page_first", f"64efb61149a4f405-x-{RAW}_r0of2"),
        },
    ),
}


@pytest.mark.parametrize("case", sorted(KNOWN_KEYS))
def test_keys_and_namespaces_are_the_ones_stored_pages_carry(case: str) -> None:
    config, expected = KNOWN_KEYS[case]
    mla, layout = bool(config.get("mla")), str(config.get("layout", "page_first"))
    section = {"backend": "memory", **{k: config[k] for k in ("tenant", "model") if k in config}}
    extra = {
        "backend_name": "kvtier",
        "module_path": MODULE_PATH,
        "class_name": CLASS_NAME,
        "interface_v1": 1,
        "kvtier": section,
    }
    kv: Any = (
        MLAHostPool(page_size=PS, layout=layout)
        if mla
        else MHAHostPool(page_size=PS, layout=layout)
    )
    cfg = storage_config(
        extra_config=extra,
        is_mla=mla,
        tp_rank=config.get("tp_rank", 0),
        tp_size=config.get("tp_size", 1),
        layout=layout,
    )
    cfg.pp_rank, cfg.pp_size = config.get("pp", (0, 1))
    cfg.attn_cp_rank, cfg.attn_cp_size = config.get("cp", (0, 1))
    # what attach_storage_backend does (the pipeline and context-parallel ranks come from
    # process groups a one-process test has not got)
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    storage = StorageBackendFactory.create_backend("dynamic", cfg, kv)
    storage.register_mem_pool_host(kv)
    try:
        swa: Any = (
            MLAHostPool(layer_num=2, page_size=PS, pages=16)
            if mla
            else MHAHostPool(layer_num=2, head_num=1, page_size=PS, pages=16)
        )
        mamba = MambaHostPool(side_states=bool(config.get("side_states")))
        storage.register_mem_host_pool_v2(mamba, MAMBA)
        storage.register_mem_host_pool_v2(swa, SWA)
        pools = {"kv": storage._require(), "mamba": storage._pool(MAMBA), "swa": storage._pool(SWA)}
        got = {name: (p.plan.namespace.model, p.keys([RAW])[0]) for name, p in pools.items()}
        assert got == expected
        for pool in pools.values():  # the store's scope: the namespace id and rank suffix
            assert pool.plan.context.namespace == pool.plan.namespace.id + pool.plan.rank_suffix
    finally:
        storage.close()
