"""The one bounded event log the engine adapters keep their KV events in.

:class:`~kvtier.integrations.kv_events.BoundedLog` holds what vLLM's workers
(:class:`~kvtier.integrations.kv_events.TierEventFeed`), vLLM's scheduler
(:class:`~kvtier.integrations.vllm.events.KVEventLog`) and SGLang
(:class:`~kvtier.integrations.sglang.events.KVEventLog`, through its storage in
``tests/test_sglang_tiers.py``) keep between two takes.
"""

from __future__ import annotations

import threading

from kvtier.core.storage import Counters
from kvtier.integrations.kv_events import BoundedLog, TierEventFeed
from kvtier.integrations.vllm.events import BlockInfo, KVEventLog
from kvtier.storage.events import Event, EventKind, EventStream


def test_a_bounded_log_keeps_the_newest_rows_and_counts_the_ones_it_dropped() -> None:
    counters = Counters()
    log: BoundedLog[int] = BoundedLog(3, counters, "rows_dropped")
    log.extend([1, 2])
    log.extend([])
    assert counters.snapshot().get("rows_dropped", 0) == 0
    log.extend([3, 4, 5])
    assert log.take() == [3, 4, 5]
    assert counters.snapshot()["rows_dropped"] == 2
    assert log.take() == []
    log.extend([6])
    assert log.take() == [6]
    assert counters.snapshot()["rows_dropped"] == 2


def test_a_bounded_log_of_no_capacity_still_keeps_the_newest_row() -> None:
    counters = Counters()
    log: BoundedLog[str] = BoundedLog(0, counters, "rows_dropped")
    assert log.capacity == 1
    log.extend(["a", "b"])
    assert log.take() == ["b"]
    assert counters.snapshot()["rows_dropped"] == 1


def test_rows_from_many_threads_are_each_kept_or_counted_once() -> None:
    counters = Counters()
    log: BoundedLog[tuple[int, int]] = BoundedLog(500, counters, "rows_dropped")
    threads, batches, rows = 8, 50, 7
    start = threading.Barrier(threads)

    def write(writer: int) -> None:
        start.wait(timeout=10)
        for batch in range(batches):
            log.extend([(writer, batch * rows + i) for i in range(rows)])

    workers = [threading.Thread(target=write, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=10)
    kept = log.take()
    assert len(kept) == log.capacity
    assert len(kept) + counters.snapshot()["rows_dropped"] == threads * batches * rows
    # each writer's rows stay in the order it wrote them
    for writer in range(threads):
        mine = [row for who, row in kept if who == writer]
        assert mine == sorted(mine)


def _event(kind: EventKind, key: str, tier: int = 0) -> Event:
    return Event(kind, tier, f"{tier}:memory", key, None, 4096)


def test_vllm_workers_feed_keeps_its_own_keys_in_a_bounded_log() -> None:
    stream = EventStream()
    counters = Counters()
    feed = TierEventFeed(
        stream,
        lambda name: name.removesuffix("_r0of2") if name.endswith("_r0of2") else None,
        capacity=2,
        counters=counters,
        dropped_counter="tier_events_dropped",
    )
    stream.emit(
        [
            _event(EventKind.STORED, "a_r0of2"),
            _event(EventKind.STORED, "a_r1of2"),  # another rank's: left out
            _event(EventKind.PROMOTED, "b_r0of2", tier=1),
            _event(EventKind.EVICTED, "c_r0of2"),
        ]
    )
    assert feed.take() == [(True, 1, "b"), (False, 0, "c")]
    assert counters.snapshot()["tier_events_dropped"] == 1
    feed.close()
    stream.emit([_event(EventKind.STORED, "d_r0of2")])
    assert feed.take() == []


def test_the_vllm_schedulers_events_are_bounded_by_the_same_log() -> None:
    counters = Counters()
    events = KVEventLog(["KVTIER:0:memory"], 16, capacity=2, hashes=8, counters=counters)
    for i, key in enumerate("abc"):
        events.describe(key, 0, BlockInfo(100 + i, 99 + i if i else None))
        events.changed(key, 0, held=True)
    taken = events.take()
    # the oldest change was dropped; the two kept ones extend one chain: one BlockStored
    assert [(kind, fields["block_hashes"]) for kind, fields in taken] == [
        ("BlockStored", [101, 102])
    ]
    assert counters.snapshot()["vllm_events_dropped"] == 1
    assert events.take() == []
