"""The host pool's key index: LRU eviction, pins, write-back victims, failed entries."""

from __future__ import annotations

import threading

import pytest

from kvtier.cache.index import Entry, EntryState, HostIndex
from kvtier.core.geometry import KVGeometry
from kvtier.core.host_pool import HostPool


def pool(pages: int) -> HostPool:
    geometry = KVGeometry.mha(num_layers=1, num_kv_heads=1, head_dim=8, page_size=2)
    return HostPool(geometry, "page_first_direct", num_pages=pages)


class Writes:
    """Collects the dirty victims an insert hands over."""

    def __init__(self) -> None:
        self.victims: list[Entry] = []

    def __call__(self, victims: list[Entry]) -> None:
        self.victims += victims


def ready(index: HostIndex, keys: list[str], writes: Writes | None = None) -> list[Entry]:
    placed = index.insert(keys, on_victims=writes or Writes())
    entries = [entry for entry, new in placed if new]
    index.mark_ready(entries)
    index.release(entries)
    return entries


def test_least_recently_used_unpinned_page_goes_first() -> None:
    index = HostIndex(pool(3))
    ready(index, ["a", "b", "c"])
    index.release(index.acquire_prefix(["a"]))  # a is now the most recent
    held = index.acquire_prefix(["b"])  # b is pinned
    ready(index, ["d"])
    assert [index.contains(k) for k in "abcd"] == [True, True, False, True]
    index.release(held)


def test_pinned_pages_are_never_evicted_and_exhaustion_is_a_short_answer() -> None:
    index = HostIndex(pool(2))
    ready(index, ["a", "b"])
    held = index.acquire_prefix(["a", "b"])
    placed = index.insert(["c", "d"], wait_s=0.01, on_victims=Writes())
    assert placed == []  # nothing could be placed, after a bounded wait
    assert index.contains("a") and index.contains("b")
    index.release(held)
    placed = index.insert(["c"], on_victims=Writes())
    assert [new for _, new in placed] == [True]


def test_failed_entry_leaves_the_index_and_frees_its_page_at_the_last_pin() -> None:
    host = pool(2)
    index = HostIndex(host)
    placed = index.insert(["a"], pins=2, on_victims=Writes())
    entry = placed[0][0]
    index.mark_failed([entry])
    assert entry.state is EntryState.FAILED and not index.contains("a")
    index.release([entry])
    assert host.num_free == 1
    index.release([entry])
    assert host.num_free == 2
    with pytest.raises(RuntimeError, match="released more often"):
        index.release([entry])


def test_write_back_victims_are_written_before_their_pages_are_reused() -> None:
    host = pool(4)
    index = HostIndex(host, write_back=True)
    dirty = ready(index, ["a", "b", "c", "d"])
    index.mark_dirty(dirty)
    writes = Writes()
    placed = index.insert(["e", "f"], on_victims=writes)
    assert placed == []  # no clean page; two dirty ones are being written instead
    assert [v.key for v in writes.victims] == ["a", "b"]  # exactly as many as needed
    assert all(v.writing and v.evict_after_write for v in writes.victims)
    index.finish_write(writes.victims, [True, True])
    assert not index.contains("a") and not index.contains("b")
    assert host.num_free == 2
    placed = index.insert(["e", "f"], on_victims=Writes())
    assert [new for _, new in placed] == [True, True]


def test_insert_waits_for_write_backs_it_started_within_its_bound() -> None:
    index = HostIndex(pool(2), write_back=True)
    index.mark_dirty(ready(index, ["a", "b"]))

    def writer(victims: list[Entry]) -> None:
        def finish() -> None:
            index.finish_write(victims, [True] * len(victims))

        threading.Thread(target=finish).start()

    placed = index.insert(["c", "d"], wait_s=10.0, on_victims=writer)
    assert [(e.key, new) for e, new in placed] == [("c", True), ("d", True)]


def test_claims_write_each_page_once() -> None:
    index = HostIndex(pool(2))
    entries = ready(index, ["a", "b"])
    first = index.claim_writes(entries)
    assert index.claim_writes(entries) == []  # already being written
    index.finish_write(first, [True, False])
    assert index.claim_writes(entries) == [entries[1]]  # a is stored, b failed: b again
