"""TieredCache under threads: overlapping prefixes, a randomly failing backend, shutdown.

Every page that reaches the device is checked byte for byte against the pattern its key
stands for, so a race that loads the wrong page, a torn page or a corrupt one fails here.
Every join and wait is bounded: a deadlock fails the test instead of hanging the suite.
"""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest
import torch
from test_cache import JOIN, cache_registry, make_cache

from kvtier.backends.memory import MemoryConfig
from kvtier.backends.memory.backend import MemoryBackend
from kvtier.cache import CacheClosedError, PrefetchHandle, TieredCache
from kvtier.testing.content import check_pages, fill_pages
from kvtier.testing.faults import FaultyBackend

PS = 4
REGION = 64  # token slots per thread and purpose (two regions per thread)
SYSTEM = list(range(16))  # a 4-page prompt every conversation shares


def _conversation_turns(seed: int, turns: int) -> list[list[int]]:
    """Token histories of one conversation: the shared prompt, then 2 pages per turn."""
    rng = random.Random(seed)
    history = list(SYSTEM)
    out = []
    for _ in range(turns):
        history = history + [rng.randrange(1000, 50_000) for _ in range(2 * PS)]
        out.append(list(history))
    return out


def _turn(cache: TieredCache, tokens: list[int], base: int, errors: list[str]) -> None:
    """One engine step: bring back the cached prefix, verify it, compute and back up the rest."""
    keys = cache.keys(tokens)
    loaded_slots = torch.arange(base, base + len(keys) * PS)
    handle = cache.prefetch(keys)
    loaded = cache.load(handle, loaded_slots)
    if not all(check_pages(cache.device_pool, keys[:loaded], loaded_slots[: loaded * PS])):
        errors.append(f"a loaded page differs from what its key holds ({loaded} pages)")
    new = keys[loaded:]
    if new:
        compute = torch.arange(base + REGION, base + REGION + len(new) * PS)
        fill_pages(cache.device_pool, new, compute)
        backup = cache.backup(new, compute)
        if not backup.wait_host(JOIN):
            errors.append("a backup never reached the host pool")


def _run_threads(cache: TieredCache, threads: int, conversations: int, turns: int) -> list[str]:
    errors: list[str] = []

    def worker(t: int) -> None:
        base = t * 2 * REGION
        try:
            convs = [_conversation_turns(t * 100 + c, turns) for c in range(conversations)]
            for turn in range(turns):
                for conv in convs:
                    _turn(cache, conv[turn], base, errors)
        except Exception as exc:  # reported, so the assertion below names it
            errors.append(f"thread {t}: {exc!r}")

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(JOIN)
    assert not [t for t in pool if t.is_alive()], "a worker thread hung"
    return errors


def _no_kvtier_threads() -> bool:
    return not [t for t in threading.enumerate() if t.name.startswith("kvtier-")]


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_threads_with_overlapping_prefixes_load_exact_pages(policy: str) -> None:
    cache = make_cache(
        cache_registry(),
        slots=6 * 2 * REGION,
        host_pages=40,  # far fewer than the working set: evictions and storage reads
        options={"write_policy": policy, "write_threshold": 1, "prefetch_policy": "wait_complete"},
    )
    try:
        errors = _run_threads(cache, threads=6, conversations=2, turns=4)
        assert errors == []
        assert cache.flush(JOIN)
        stats = cache.stats()
        assert stats["host"]["hits"] > 0
        assert stats["pages"]["loaded"] > 0
        assert stats["host"]["evictions"] > 0
        if policy != "write_through_selective":
            assert stats["storage"]["hits"] > 0
        # with 6 threads pinning up to 12 pages each, a 40-page pool may run out: that
        # fails those pages cleanly; nothing else may fail
        assert set(stats["failures"]) <= {"host_exhausted"}, stats["failures"]
        assert stats["host"]["pages"]["pinned"] == 0
    finally:
        assert cache.close(timeout=JOIN)
    assert _no_kvtier_threads()


@pytest.mark.parametrize("prefetch_policy", ["best_effort", "timeout"])
def test_randomly_failing_backend_never_corrupts_and_never_hangs(prefetch_policy: str) -> None:
    faulty = FaultyBackend(
        MemoryBackend(MemoryConfig()),
        seed=7,
        fail_rate=0.1,
        error_rate=0.05,
        bit_flip_rate=0.15,
        truncate_rate=0.05,
    )
    cache = make_cache(
        cache_registry(),
        instance=faulty,
        slots=6 * 2 * REGION,
        host_pages=32,
        options={"prefetch_policy": prefetch_policy, "batch_pages": 4},
    )
    try:
        errors = _run_threads(cache, threads=6, conversations=2, turns=4)
        assert errors == []
        assert cache.flush(JOIN)
        assert sum(faulty.injected.values()) > 0
        stats = cache.stats()
        assert stats["page_store"]["backend_errors"] > 0  # raised calls were caught
        assert stats["host"]["pages"]["pinned"] == 0
    finally:
        assert cache.close(timeout=JOIN)
    assert _no_kvtier_threads()


def test_corrupt_pages_from_storage_are_misses_not_data() -> None:
    faulty = FaultyBackend(MemoryBackend(MemoryConfig()), seed=3, bit_flip_rate=1.0)
    cache = make_cache(cache_registry(), instance=faulty, host_pages=8)
    try:
        keys = cache.keys(list(range(32)))  # 8 pages
        where = torch.arange(0, 32)
        fill_pages(cache.device_pool, keys, where)
        assert cache.backup(keys, where).wait(JOIN)
        other = cache.keys(list(range(500, 532)))
        fill_pages(cache.device_pool, other, torch.arange(32, 64))
        assert cache.backup(other, torch.arange(32, 64)).wait(JOIN)  # evicts ``keys``
        cache.device_pool.zero_()  # type: ignore[attr-defined]
        handle = cache.prefetch(keys)
        handle.wait(JOIN)
        assert cache.load(handle, torch.arange(100, 132)) == 0  # every read was flipped
        assert cache.stats()["page_store"]["invalid"] >= 1
        assert cache.stats()["failures"]["storage_get"] >= 1
        assert torch.count_nonzero(cache.device_pool.kv_tensors[0][:, 100:132]) == 0  # type: ignore[attr-defined]
    finally:
        cache.close()


@pytest.mark.parametrize("drain", [False, True])
def test_shutdown_under_load_leaves_no_threads_and_no_stuck_handles(drain: bool) -> None:
    faulty = FaultyBackend(MemoryBackend(MemoryConfig()), seed=11, delay=0.002, fail_rate=0.05)
    cache = make_cache(
        cache_registry(),
        instance=faulty,
        slots=4 * 2 * REGION,
        host_pages=24,
        options={"write_policy": "write_back", "queue_size": 8},
    )
    handles: list[Any] = []
    errors: list[str] = []
    started = threading.Barrier(5)

    def worker(t: int) -> None:
        base = t * 2 * REGION
        started.wait(JOIN)
        turn = 0
        try:
            while True:
                tokens = _conversation_turns(t * 10 + turn % 3, 1 + turn % 5)[-1]
                keys = cache.keys(tokens)
                where = torch.arange(base + REGION, base + REGION + len(keys) * PS)
                fill_pages(cache.device_pool, keys, where)
                handles.append(cache.backup(keys, where))
                prefetched = cache.prefetch(keys)
                handles.append(prefetched)
                cache.load(prefetched, torch.arange(base, base + len(keys) * PS))
                turn += 1
        except CacheClosedError:
            return
        except Exception as exc:
            errors.append(f"thread {t}: {exc!r}")

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in pool:
        thread.start()
    started.wait(JOIN)
    while len(handles) < 40 and all(t.is_alive() for t in pool):
        threading.Event().wait(0.005)
    assert cache.close(drain=drain, timeout=JOIN)
    for thread in pool:
        thread.join(JOIN)
    assert not [t for t in pool if t.is_alive()]
    assert errors == []
    assert _no_kvtier_threads()
    for handle in handles:
        if isinstance(handle, PrefetchHandle):
            handle.wait(JOIN)
            assert handle.done
        else:
            assert handle.wait(JOIN), handle
