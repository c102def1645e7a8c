"""A chain of kvtier storage tiers behind SGLang's one HiCache storage backend.

Driven as the other SGLang tests are, through SGLang's own ``HiCacheController`` (its
backup and prefetch threads call kvtier) over SGLang's own host pools on the CPU: the
``kvtier`` section's ``tiers`` (a file tier over a file tier, or over a real Mooncake
master on loopback), SGLang's three write policies against the chain's ``write``, the
tiers' KV events as SGLang's ``BlockStored`` / ``BlockRemoved`` (taken, and published by
SGLang's own ``ZmqEventPublisher`` to a SUB socket that decodes them with msgspec as
SGLang's consumers do), tenant quotas, and the section's errors. These tests run in the
SGLang test environment (``tests/test_sglang_env.py`` runs them).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
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
    page_bytes,
    page_content,
    page_hashes,
    sglang_or_skip,
    starts,
    storage_config,
)
from sglang_host_pool import mha_host_pool as MHAHostPool
from sglang_host_pool import mla_host_pool as MLAHostPool

from kvtier.core.envelope import ENVELOPE_BYTES
from kvtier.core.errors import (
    InvalidFieldError,
    MissingFieldError,
    StorageError,
    UnknownKeyError,
    UnknownNameError,
)
from kvtier.storage.events import EventKind
from kvtier.testing import require
from kvtier.testing.mooncake import (
    MooncakeMaster,
    free_port,
    mooncake_unavailable_reason,
    use_client_env,
)

hs = sglang_or_skip()

from sglang.srt.disaggregation import kv_events as sk  # noqa: E402
from sglang.srt.mem_cache.utils import hash_str_to_int64  # noqa: E402

from kvtier.integrations.sglang import KvtierHiCacheStorage  # noqa: E402
from kvtier.integrations.sglang.events import hash_to_int64  # noqa: E402

#: How long a test waits for the chain's worker or a published batch.
WAIT_S = 30.0
DISK, EXTERNAL = sk.StorageMedium.DISK, sk.StorageMedium.EXTERNAL


def _file(root: Path, **options: Any) -> dict[str, Any]:
    return {"backend": "file", "extra_config": {"root": str(root), **options}}


def _section(tiers: list[dict[str, Any]] | None = None, **more: Any) -> dict[str, Any]:
    """SGLang's extra-config dict with a kvtier section of ``tiers`` (or ``more`` alone)."""
    kvtier = {**({"tiers": tiers} if tiers is not None else {}), **more}
    return {
        "backend_name": "kvtier",
        "module_path": MODULE_PATH,
        "class_name": CLASS_NAME,
        "interface_v1": 1,
        "kvtier": kvtier,
    }


def _page_capacity(pool: Any, pages: int) -> int:
    """``capacity_bytes`` for ``pages`` of ``pool``'s pages (each with its envelope)."""
    return pages * (page_bytes(pool) + ENVELOPE_BYTES)


@pytest.fixture
def attach() -> Iterator[Any]:
    """Attach kvtier to a host pool through SGLang's controller; closed afterwards."""
    made: list[Controller] = []

    def make(pool: Any, extra: dict[str, Any], **config: Any) -> Controller:
        write_policy = config.pop("write_policy", "write_through_selective")
        config.setdefault("model_name", f"test/{uuid.uuid4().hex[:10]}")
        cfg = storage_config(extra_config=extra, is_mla=is_mla(pool), layout=pool.layout, **config)
        controller = Controller.attach(cfg, pool, write_policy=write_policy)
        made.append(controller)
        return controller

    yield make
    for controller in made:
        controller.close()


@pytest.fixture(scope="module")
def mooncake_master() -> Iterator[MooncakeMaster]:
    """A Mooncake master and a 256 MiB storage node on loopback for this module."""
    require("mooncake", mooncake_unavailable_reason())  # KVTIER_REQUIRE_MOONCAKE=1: fail
    use_client_env()
    master = MooncakeMaster(storage_node_bytes=256 << 20).start()
    try:
        yield master
    finally:
        master.close()


def _mooncake(master: MooncakeMaster) -> dict[str, Any]:
    return {
        "backend": "mooncake",
        "extra_config": {"master_address": master.address, "global_segment_size": 0},
    }


def _fill(pool: Any, count: int, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    indices = pool.alloc(count * pool.page_size)
    assert indices is not None
    data = [fill_random(pool, int(indices[i * pool.page_size]), seed + i) for i in range(count)]
    return indices, data


def _hashes(count: int, page_size: int, salt: int = 0) -> Chain:
    return page_hashes(list(range(salt, salt + count * page_size)), page_size)


def _chain(controller: Controller) -> Any:
    """The KV pool's storage chain behind SGLang's storage backend."""
    storage: KvtierHiCacheStorage = controller.storage
    return storage._require().store


def _in_tier(controller: Controller, tier: int, hashes: list[str]) -> list[bool]:
    """Which of SGLang's pages tier ``tier`` holds (asked of that tier alone)."""
    state = controller.storage._require()
    return list(_chain(controller).tiers[tier].store.exists(state.keys(hashes)))


def _load_and_check(controller: Controller, hashes: Chain, data: list[Any]) -> None:
    """The prefetch thread's hit query and load, into fresh host pages: every byte right."""
    pool = controller.pool
    assert controller.hit_query(hashes) == hashes
    target = pool.alloc(len(hashes) * pool.page_size)
    assert controller.prefetch(hashes, target) == len(hashes)
    for start, expected in zip(starts(pool, target), data, strict=True):
        assert torch.equal(page_content(pool, start), expected)


# --- one storage backend entry, several tiers behind it ----------------------------------------


def test_a_chain_of_tiers_behind_sglangs_one_storage_backend(attach: Any, tmp_path: Path) -> None:
    pool = MHAHostPool()
    controller = attach(pool, _section([_file(tmp_path / "fast"), _file(tmp_path / "slow")]))
    storage = controller.storage
    assert storage.settings.backend == "file" and len(storage.settings.tiers) == 2
    indices, data = _fill(pool, 4)
    hashes = _hashes(4, pool.page_size)
    assert controller.backup(hashes, indices) == 4 * pool.page_size
    assert storage.flush_tiers(WAIT_S)
    assert _in_tier(controller, 0, hashes) == [True] * 4
    assert _in_tier(controller, 1, hashes) == [True] * 4
    assert controller.hit_query(hashes) == hashes
    _load_and_check(controller, hashes, data)
    kv = storage.tier_stats()["kv"]
    assert [t["name"] for t in kv] == ["0:file", "1:file"]
    assert kv[1]["cascades"] == 4 and kv[1]["drops"] == 0 and kv[0]["store"]["hits"] == 4


def test_file_over_mooncake_a_restart_hits_from_mooncake_and_promotes(
    attach: Any, tmp_path: Path, mooncake_master: MooncakeMaster
) -> None:
    """Pages land in the file tier and in Mooncake; a new server whose file tier is empty
    (a new node, a wiped disk) finds them in Mooncake, loads them bit-exact through
    SGLang's prefetch thread, and promotes them into its file tier."""
    root = tmp_path / "nvme"
    extra = _section([_file(root), _mooncake(mooncake_master)])
    model = f"test/{uuid.uuid4().hex[:10]}"
    pool = MHAHostPool()
    first = attach(pool, extra, model_name=model)
    indices, data = _fill(pool, 4, seed=3)
    hashes = _hashes(4, pool.page_size, salt=77)
    assert first.backup(hashes, indices) == 4 * pool.page_size
    assert first.storage.flush_tiers(WAIT_S)
    assert _in_tier(first, 0, hashes) == [True] * 4
    assert _in_tier(first, 1, hashes) == [True] * 4
    first.close()
    for page in root.rglob("*.kv"):
        page.unlink()
    again = attach(MHAHostPool(), extra, model_name=model)
    assert _in_tier(again, 0, hashes) == [False] * 4
    seen: list[Any] = []
    _chain(again).events.subscribe(seen.extend)
    assert again.hit_query(hashes) == hashes  # the prefix is found in Mooncake
    _load_and_check(again, hashes, data)
    assert again.storage.flush_tiers(WAIT_S)
    assert _in_tier(again, 0, hashes) == [True] * 4  # promoted into the file tier
    keys = set(again.storage._require().keys(hashes))
    assert {e.key for e in seen if e.kind is EventKind.PROMOTED and e.tier == 0} == keys
    kv = again.storage.tier_stats()["kv"]
    assert kv[0]["promotions"] == 4 and kv[1]["store"]["hits"] == 4
    stats = again.storage.kvtier_stats()
    assert stats["invalid"] == 0 and stats.get("backend_tier1.staged_pages", 0) == 0


def test_extra_pools_and_head_slices_each_get_the_chain(attach: Any, tmp_path: Path) -> None:
    """Every store the adapter opens is a chain of the section's tiers: here the KV pool's
    head slices under SGLang's heterogeneous TP (``tp_lcm_size``); extra pools of hybrid
    models in ``test_sglang_v2.py``."""
    extra = _section([_file(tmp_path / "fast"), _file(tmp_path / "slow")])
    extra["tp_lcm_size"] = 2
    pool = MHAHostPool(layout="page_head", head_num=4)
    controller = attach(pool, extra)
    assert controller.config.should_split_heads
    shards = controller.storage._kv()
    assert len(shards) == 2
    assert all([t.name for t in s.store.tiers] == ["0:file", "1:file"] for s in shards)
    indices, data = _fill(pool, 2)
    hashes = _hashes(2, pool.page_size)
    assert controller.backup(hashes, indices) == 2 * pool.page_size
    assert controller.storage.flush_tiers(WAIT_S)
    for shard in shards:
        assert list(shard.store.tiers[1].store.exists(shard.keys(hashes))) == [True, True]
    _load_and_check(controller, hashes, data)


def test_a_non_writer_rank_promotes_nothing(attach: Any, tmp_path: Path) -> None:
    """MLA pages are shared by every rank: the storage writer promotes them, once."""
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    extra = _section([_file(fast), _file(slow)])
    pools = [MLAHostPool(), MLAHostPool()]
    model = f"test/{uuid.uuid4().hex[:10]}"
    writer = attach(pools[0], extra, model_name=model, tp_rank=0, tp_size=2)
    indices, data = _fill(pools[0], 2)
    hashes = _hashes(2, 16)
    assert writer.backup(hashes, indices) == 32
    assert writer.storage.flush_tiers(WAIT_S)
    for page in fast.rglob("*.kv"):
        page.unlink()
    reader = attach(pools[1], extra, model_name=model, tp_rank=1, tp_size=2)
    assert not reader.config.is_storage_writer
    _load_and_check(reader, hashes, data)
    assert reader.storage.flush_tiers(WAIT_S)
    assert reader.storage.tier_stats()["kv"][0]["promotions"] == 0
    assert not any(fast.rglob("*.kv"))


# --- SGLang's write policies and the chain's write ---------------------------------------------


def _backed_up_by(policy: str, requests: dict[str, int]) -> list[str]:
    """The requests SGLang backs up to storage, in order, under its ``--hicache-write-policy``.

    SGLang's radix cache copies a node's KV from the device to the host pool, and on that
    copy's acknowledgement backs the node up to storage (``write_backup_storage`` after
    ``writing_check``), so the policy decides which pages reach ``batch_set_v1`` and when:
    ``write_through`` on the node's first insert (``write_through_threshold`` 1),
    ``write_through_selective`` once it was hit twice (threshold 2), ``write_back`` only
    when the device evicts it. ``requests`` maps a request to how often its prefix was
    seen, in arrival order; the device evicts them in that order (LRU) once all arrived.
    """
    if policy == "write_through":
        return list(requests)
    if policy == "write_through_selective":
        return [name for name, seen in requests.items() if seen >= 2]
    assert policy == "write_back"
    return list(requests)  # at eviction, after every request ran


@pytest.mark.parametrize("write", ["through", "back"])
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_sglang_write_policy_with_the_chains_write(
    policy: str, write: str, attach: Any, tmp_path: Path
) -> None:
    """What SGLang backs up enters the first tier at once; it reaches the second tier at
    once under ``write: through``, and under ``write: back`` only when the first tier
    evicts it (here it holds 4 pages): no page is lost either way."""
    pool = MHAHostPool(pages=64)
    capacity = _page_capacity(pool, 4)
    tiers = [
        _file(tmp_path / "fast", capacity_bytes=capacity),
        {**_file(tmp_path / "slow"), "write": write, "promote": write == "through"},
    ]
    controller = attach(pool, _section(tiers), write_policy=policy)
    assert controller.controller.write_policy == policy
    requests = {"a": 2, "b": 1, "c": 2}  # a and c hit twice, b once
    chains = {name: _hashes(2, pool.page_size, salt=1000 * i) for i, name in enumerate(requests)}
    written = {}
    for name in _backed_up_by(policy, requests):
        indices, written[name] = _fill(pool, 2, seed=10 * len(written))
        assert controller.backup(chains[name], indices) == 2 * pool.page_size
        # each node's cascade is read back before the next arrives (a cascade's read-back
        # counts as a use of the page in the first tier's LRU)
        assert controller.storage.flush_tiers(WAIT_S)
    stored = [h for name in written for h in chains[name]]  # oldest first
    fast, slow = _in_tier(controller, 0, stored), _in_tier(controller, 1, stored)
    kept = min(4, len(stored))
    assert fast == [False] * (len(stored) - kept) + [True] * kept  # LRU keeps the newest
    if write == "through":
        assert slow == [True] * len(stored)
    else:  # exactly the pages the first tier evicted went down
        assert slow == [not f for f in fast]
    kv = controller.storage.tier_stats()["kv"]
    assert kv[1]["write"] == write and kv[0]["evictions"] == len(stored) - kept
    for name in requests:
        found = controller.hit_query(chains[name])
        assert found == (chains[name] if name in written else []), (policy, name)
    for name, data in written.items():
        _load_and_check(controller, chains[name], data)


# --- the tiers' KV events, as SGLang's KV events -------------------------------------------------


def test_event_ids_are_sglangs_own() -> None:
    """``hash_to_int64`` is SGLang's ``hash_str_to_int64``, and a page's id is the one SGLang's
    own event recorder gives the same page of a radix-tree node."""
    from sglang.srt.mem_cache.events import KVCacheEventRecorder
    from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

    for page_hash in [*_hashes(8, 16), "0" * 64, "f" * 64, "8" + "0" * 63, "7" + "f" * 63, "ab"]:
        assert hash_to_int64(page_hash) == hash_str_to_int64(page_hash), page_hash
    assert hash_to_int64("not-hex") is None
    root, node = TreeNode(), TreeNode()
    root.key, root.hash_value = RadixKey([]), []
    node.key, node.parent = RadixKey(list(range(3 * 16))), root
    recorder = KVCacheEventRecorder(enabled=True, page_size=16)
    recorder.record_store(node, medium=DISK)
    (theirs,) = recorder.take()
    assert theirs.block_hashes == [hash_to_int64(h) for h in _hashes(3, 16)]


def _stores(events: list[Any], medium: Any) -> list[Any]:
    return [e for e in events if isinstance(e, sk.BlockStored) and e.medium == medium]


def _chained(stores: list[Any]) -> list[int]:
    """The block hashes of a run of BlockStored, checked to form one chain: each event's
    parent is the hash before its first (None for the very first)."""
    chain: list[int] = []
    for event in stores:
        assert event.parent_block_hash == (chain[-1] if chain else None), (event, chain)
        chain += event.block_hashes
    return chain


def _removals(events: list[Any], medium: Any) -> list[int]:
    return [
        h
        for e in events
        if isinstance(e, sk.BlockRemoved) and e.medium == medium
        for h in e.block_hashes
    ]


def test_take_kv_events_maps_each_tier_to_its_medium(
    attach: Any, tmp_path: Path, mooncake_master: MooncakeMaster
) -> None:
    """A local file tier's events are DISK, Mooncake's (shared_nodes) EXTERNAL; a backup is
    one BlockStored per tier chaining its pages (the first one's parent from
    ``prefix_keys``), evictions and removals BlockRemoved of their tier."""
    pool = MHAHostPool(pages=64)
    tiers = [_file(tmp_path / "fast", capacity_bytes=_page_capacity(pool, 4))]
    controller = attach(pool, _section([*tiers, _mooncake(mooncake_master)]))
    storage = controller.storage
    assert storage.take_kv_events() == []
    hashes = _hashes(6, pool.page_size)
    ids = [hash_str_to_int64(h) for h in hashes]
    indices, _ = _fill(pool, 6)
    ps = pool.page_size
    # a node, then its child (prefix_keys: the node's hashes), as the radix tree backs up
    assert controller.backup(hashes[:3], indices[: 3 * ps]) == 3 * ps
    assert storage.flush_tiers(WAIT_S)
    assert controller.backup(hashes[3:], indices[3 * ps :], prefix_keys=hashes[:3]) == 3 * ps
    assert storage.flush_tiers(WAIT_S)
    events = storage.take_kv_events()
    disk, external = _stores(events, DISK), _stores(events, EXTERNAL)
    assert _chained(disk) == ids and _chained(external) == ids  # one chain in each tier
    assert len(disk) == len(external) == 2  # a BlockStored per backup, its pages coalesced
    for event in disk + external:
        assert event.token_ids == [] and event.block_size == ps and event.lora_id is None
    evicted = _removals(events, DISK)  # the file tier holds 4 pages: 2 of the first node's
    assert len(evicted) == 2 and set(evicted) < set(ids[:3])
    assert _removals(events, EXTERNAL) == []
    assert storage.take_kv_events() == []  # drained
    storage.clear()  # SGLang's cache flush: every tier's copies go
    events = storage.take_kv_events()
    assert sorted(_removals(events, DISK)) == sorted(set(ids) - set(evicted))
    assert sorted(_removals(events, EXTERNAL)) == sorted(ids)
    stats = storage.kvtier_stats()
    assert stats["kv_events_emitted"] == 6 + 6 + 2 + 4 + 6
    assert stats["kv_events_dropped"] == stats["kv_events_unmapped"] == 0


def test_the_event_buffer_is_bounded_and_counts_what_it_drops(attach: Any, tmp_path: Path) -> None:
    pool = MHAHostPool()
    controller = attach(pool, _section(backend="memory", kv_events_buffer=4))
    hashes = _hashes(6, pool.page_size)
    assert controller.backup(hashes, _fill(pool, 6)[0]) == 6 * pool.page_size
    (event,) = controller.storage.take_kv_events()
    assert event.block_hashes == [hash_str_to_int64(h) for h in hashes[2:]]  # the newest
    assert controller.storage.kvtier_stats()["kv_events_dropped"] == 2
    off = attach(MHAHostPool(), _section(backend="memory", kv_events_buffer=0))
    assert off.backup(hashes, _fill(off.pool, 6)[0]) == 6 * pool.page_size
    assert off.storage.take_kv_events() == []


class Subscriber:
    """A SUB socket reading a KV-event stream as SGLang's consumers do: ``(topic, seq,
    payload)`` frames, each payload a msgpack ``KVEventBatch`` decoded with msgspec."""

    def __init__(self, endpoint: str, topic: str) -> None:
        import msgspec
        import zmq

        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.socket.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=sk.KVEventBatch)
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.seqs: list[int] = []

    def receive(self, until: Any, timeout: float = WAIT_S) -> list[Any]:
        """Events of every batch received, until ``until(events)`` holds."""
        events: list[Any] = []
        deadline = time.monotonic() + timeout
        while not until(events):
            left = deadline - time.monotonic()
            assert left > 0, f"no such events within {timeout}s: {events}"
            if self.poller.poll(int(left * 1000)):
                _topic, seq, payload = self.socket.recv_multipart()
                self.seqs.append(int.from_bytes(seq, "big"))
                batch = self.decoder.decode(payload)
                assert batch.attn_dp_rank == 0
                events.extend(batch.events)
        return events

    def close(self) -> None:
        self.socket.close(linger=0)


def test_published_kv_events_reach_a_subscriber(
    attach: Any, tmp_path: Path, mooncake_master: MooncakeMaster
) -> None:
    """``kv_events_endpoint``: SGLang's own ZmqEventPublisher publishes the tiers' events;
    a subscriber decodes BlockStored per tier for the pages SGLang's backup thread stored,
    and BlockRemoved for an eviction and for SGLang's cache flush."""
    port = free_port()
    pool = MHAHostPool(pages=64)
    tiers = [_file(tmp_path / "fast", capacity_bytes=_page_capacity(pool, 3))]
    extra = _section(
        [*tiers, _mooncake(mooncake_master)],
        kv_events_endpoint=f"tcp://*:{port}",
        kv_events_topic="kvtier-l3",
    )
    controller = attach(pool, extra)
    sub = Subscriber(f"tcp://127.0.0.1:{port}", "kvtier-l3")
    try:
        time.sleep(0.5)  # a SUB socket sees only what is published after it joined
        hashes = _hashes(4, pool.page_size, salt=5)
        ids = [hash_str_to_int64(h) for h in hashes]
        indices = _fill(pool, 4)[0]
        ps = pool.page_size
        assert controller.backup(hashes[:2], indices[: 2 * ps]) == 2 * ps
        assert controller.storage.flush_tiers(WAIT_S)
        assert controller.backup(hashes[2:], indices[2 * ps :], prefix_keys=hashes[:2]) == 2 * ps

        def stored_everywhere(events: list[Any]) -> bool:
            return all(
                sorted(h for e in _stores(events, m) for h in e.block_hashes) == sorted(ids)
                for m in (DISK, EXTERNAL)
            ) and bool(_removals(events, DISK))

        events = sub.receive(stored_everywhere)
        assert _chained(_stores(events, DISK)) == ids
        assert _chained(_stores(events, EXTERNAL)) == ids
        (evicted,) = _removals(events, DISK)  # the file tier holds 3 pages
        assert evicted in ids[:2]
        for event in _stores(events, DISK) + _stores(events, EXTERNAL):
            assert event.token_ids == [] and event.block_size == pool.page_size
        controller.storage.clear()
        removed = sub.receive(lambda ev: sorted(_removals(ev, EXTERNAL)) == sorted(ids))
        assert sorted(_removals(removed, DISK)) == sorted(set(ids) - {evicted})
        assert sub.seqs == sorted(sub.seqs)  # the publisher's sequence numbers, in order
    finally:
        sub.close()
    assert controller.storage.kvtier_stats()["kv_events_publish_errors"] == 0


def test_an_endpoint_that_cannot_be_opened_stops_the_server_at_start_up(attach: Any) -> None:
    import gc
    import warnings

    import zmq

    port = free_port()
    taken = zmq.Context.instance().socket(zmq.PUB)
    taken.bind(f"tcp://*:{port}")  # as SGLang's own publisher would hold its endpoint
    try:
        with warnings.catch_warnings():
            # SGLang's ZmqEventPublisher leaves the socket it could not bind to the GC
            warnings.simplefilter("ignore", ResourceWarning)
            with pytest.raises(StorageError, match="kv_events_endpoint") as info:
                extra = _section(backend="memory", kv_events_endpoint=f"tcp://*:{port}")
                attach(MHAHostPool(), extra)
            assert "apart from SGLang's own --kv-events-config" in str(info.value)
            del info
            gc.collect()
    finally:
        taken.close(linger=0)


def test_publish_kv_events_hands_a_batch_to_any_sglang_publisher(attach: Any) -> None:
    class Recording(sk.EventPublisher):
        def __init__(self) -> None:
            self.batches: list[Any] = []

        def publish(self, events: Any) -> None:
            self.batches.append(events)

        def shutdown(self) -> None:
            pass

    pool = MHAHostPool()
    controller = attach(pool, _section(backend="memory"))
    publisher = Recording()
    assert controller.storage.publish_kv_events(publisher) == 0 and not publisher.batches
    hashes = _hashes(2, pool.page_size)
    assert controller.backup(hashes, _fill(pool, 2)[0]) == 2 * pool.page_size
    assert controller.storage.publish_kv_events(publisher) == 1
    (batch,) = publisher.batches
    assert isinstance(batch, sk.KVEventBatch)
    assert batch.events[0].block_hashes == [hash_str_to_int64(h) for h in hashes]


# --- tenants --------------------------------------------------------------------------------


def test_sglang_backups_tell_the_tiers_policy_each_pages_true_parent(
    attach: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each page SGLang backs up is described to the tier's policy with the page before it
    in SGLang's chain of hashes: a child node's first page with the last of its
    ``prefix_keys``, a sequence's first page (or one whose prefix SGLang does not pass)
    with none."""
    from recording_policy import recorder, recording_registry

    import kvtier.integrations.sglang.storage as sglang_storage

    monkeypatch.setattr(sglang_storage, "default_registry", recording_registry)
    pool = MHAHostPool(pages=64)
    controller = attach(pool, _section([{"backend": "memory", "eviction": "recording"}]))
    hashes, other = _hashes(5, pool.page_size), _hashes(2, pool.page_size, salt=7777)
    indices, _ = _fill(pool, 7)
    ps = pool.page_size
    assert controller.backup(hashes[:3], indices[: 3 * ps]) == 3 * ps
    assert controller.backup(hashes[3:], indices[3 * ps : 5 * ps], prefix_keys=hashes[:3]) == 2 * ps
    assert controller.backup(other, indices[5 * ps :]) == 2 * ps
    state = controller.storage._require()
    names = state.keys([*hashes, *other])
    told = recorder(_chain(controller))
    assert [told.parent_of(name) for name in names] == [
        None,
        *names[:4],  # the child's first page follows the node's last one
        None,  # another sequence's first page: not the page backed up before it
        names[5],
    ]


def test_a_tenants_quota_through_sglang(attach: Any, tmp_path: Path) -> None:
    """SGLang hands storage no tenant per request, so a server's pages are its
    ``kvtier.tenant``'s: over its ``quota_bytes`` in a tier its own oldest pages leave
    that tier first; another tenant's server on the same store keeps its pages."""
    root = tmp_path / "shared"
    pool_a, pool_b = MHAHostPool(pages=64), MHAHostPool(pages=64)
    quota = _page_capacity(pool_a, 3)
    tenants = {"team-a": {"quota_bytes": quota}, "team-b": {}}
    model = f"test/{uuid.uuid4().hex[:10]}"
    a = attach(pool_a, _section([_file(root)], tenant="team-a", tenants=tenants), model_name=model)
    b = attach(pool_b, _section([_file(root)], tenant="team-b", tenants=tenants), model_name=model)
    hashes = _hashes(5, pool_a.page_size)
    ps = pool_a.page_size
    assert b.backup(hashes, _fill(pool_b, 5, seed=50)[0]) == 5 * ps
    indices = _fill(pool_a, 5)[0]
    assert a.backup(hashes[:3], indices[: 3 * ps]) == 3 * ps  # team-a at its quota
    assert a.backup(hashes[3:], indices[3 * ps :], prefix_keys=hashes[:3]) == 2 * ps
    assert _in_tier(a, 0, hashes).count(True) == 3  # 2 of its first 3 pages made room
    assert _in_tier(a, 0, hashes[3:]) == [True, True]
    assert _in_tier(b, 0, hashes) == [True] * 5  # the other tenant's pages stay
    tenant = a.storage.tenant_stats()["team-a"]
    assert tenant["quota_evictions"] == 2 and tenant["bytes"] == [quota]
    assert tenant["quota_bytes"] == quota
    removed = _removals(a.storage.take_kv_events(), DISK)
    assert len(removed) == 2 and set(removed) < {hash_str_to_int64(h) for h in hashes[:3]}


def test_tenants_need_this_servers_tenant(attach: Any) -> None:
    for section in (
        {"backend": "memory", "tenants": {"team-a": {"quota_bytes": "1GiB"}}},
        {"backend": "memory", "tenant": "team-b", "tenants": {"team-a": {}}},
    ):
        with pytest.raises(ValueError) as info:
            attach(MHAHostPool(), _section(**section))
        error = info.value.__cause__
        assert isinstance(error, InvalidFieldError) and error.path == "kvtier.tenant"
        assert "SGLang hands storage no tenant per request" in str(error)


# --- the section's tiers, checked as the engine config checks them ------------------------------


def _create(section: dict[str, Any]) -> Any:
    """SGLang's factory call (the loader re-raises what the class raised)."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    return StorageBackendFactory.create_backend(
        "dynamic", storage_config(extra_config=_section(**section)), None
    )


def test_tier_mistakes_name_the_tier(tmp_path: Path) -> None:
    good = _file(tmp_path / "a")
    with pytest.raises(InvalidFieldError, match="not both") as both:
        _create({"backend": "file", "tiers": [good]})
    assert both.value.path == "kvtier.backend"
    with pytest.raises(UnknownKeyError, match=r"did you mean 'root'") as key:
        _create({"tiers": [good, {"backend": "file", "extra_config": {"roott": "/x"}}]})
    assert key.value.where == "kvtier.tiers[1].extra_config of backend 'file'"
    with pytest.raises(InvalidFieldError) as write:
        _create({"tiers": [good, {**good, "write": "around"}]})
    assert write.value.path == "kvtier.tiers[1].write"
    with pytest.raises(UnknownNameError, match="fiel"):
        _create({"tiers": [good, {"backend": "fiel"}]})
    with pytest.raises(MissingFieldError, match="or give `tiers`"):
        _create({})
    with pytest.raises(InvalidFieldError) as endpoint:
        _create({"backend": "memory", "kv_events_endpoint": "localhost:5557"})
    assert endpoint.value.path == "kvtier.kv_events_endpoint"


def test_an_unknown_policy_stops_the_server_at_start_up(attach: Any, tmp_path: Path) -> None:
    tiers = [_file(tmp_path / "a"), {**_file(tmp_path / "b"), "admission": "sometimes"}]
    with pytest.raises(ValueError) as info:
        attach(MHAHostPool(), _section(tiers))
    assert str(info.value).startswith("Failed to create storage backend: ")
    assert isinstance(info.value.__cause__, UnknownNameError)
    assert "tiers[1].admission" in str(info.value.__cause__) or "sometimes" in str(
        info.value.__cause__
    )
