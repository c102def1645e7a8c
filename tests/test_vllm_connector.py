"""The vLLM connector's production behaviour, at the scheduler and worker level (no vLLM).

What a real engine cannot show on demand is driven here with a backend whose calls can be
held or failed: a page is deleted only when it is proven bad; a load whose read timed out
keeps its request waiting until the backend lets go of the blocks; lookups answer "ask
again" instead of blocking, stop at the first miss and give up after their bound; saves
beyond the queue's bound are dropped, never waited for; a preemption waits for a store in
flight (bounded) or taints it; the scheduler's memories are bounded. Hybrid models (KV
cache groups: per-group keys and block ids, staging for sliding-window blocks) and MLA
(one writer rank, pages shared by every rank) are tested here at the worker level; the
models the CPU build runs also run in a real engine (``tests/test_vllm_production.py``).
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_cache import shared_backend
from test_vllm import BLOCK, ROOT, FullAttentionSpec, _kv_cache_config, _plan, _vllm_config

from kvtier.backends.memory import MemoryConfig
from kvtier.backends.memory.backend import MemoryBackend
from kvtier.core.envelope import ENVELOPE_BYTES
from kvtier.core.errors import InvalidFieldError, UnsupportedCombinationError
from kvtier.core.storage import PageBuffers, StorageBackend
from kvtier.integrations.vllm import VLLMSection, read_section
from kvtier.integrations.vllm.events import BlockInfo, TierLedger
from kvtier.integrations.vllm.messages import PageOp, Report
from kvtier.integrations.vllm.plan import geometry_fields, kv_groups, resolve_plan
from kvtier.integrations.vllm.rank import proves_bad
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.plugins.manager import default_registry
from kvtier.plugins.registry import Registry
from kvtier.storage import open_lookup

NAMES = ["model.layers.0.a", "model.layers.1.a"]
INDEX = {name: i for i, name in enumerate(NAMES)}
BOUND = 0.3


class GatedBackend(StorageBackend):
    """A memory backend whose chosen calls wait on a gate (or sleep) first."""

    def __init__(self) -> None:
        self.inner = MemoryBackend(MemoryConfig())
        self.gates: dict[str, threading.Event] = {}
        self.delay: dict[str, float] = {}
        self.calls: dict[str, list[list[str]]] = {}
        self.deleted: list[str] = []
        self._lock = threading.Lock()

    def hold(self, op: str) -> threading.Event:
        gate = self.gates[op] = threading.Event()
        return gate

    def _enter(self, op: str, keys: Sequence[str]) -> None:
        with self._lock:
            self.calls.setdefault(op, []).append(list(keys))
        if op in self.delay:
            time.sleep(self.delay[op])
        gate = self.gates.get(op)
        if gate is not None:
            gate.wait(30)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._enter("exists", keys)
        return self.inner.exists(keys)

    def get(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        self._enter("get", keys)
        return self.inner.get(keys, pages)

    def put(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        self._enter("put", keys)
        return self.inner.put(keys, pages)

    def delete(self, keys: Sequence[str]) -> list[bool]:
        self.deleted.extend(keys)
        return self.inner.delete(keys)

    def clear(self) -> None:
        self.inner.clear()

    def stats(self) -> dict[str, int | float]:
        return self.inner.stats()

    def close(self) -> None:
        for gate in self.gates.values():
            gate.set()


@pytest.fixture
def backend() -> Iterator[GatedBackend]:
    gated = GatedBackend()
    yield gated
    for gate in gated.gates.values():
        gate.set()


@pytest.fixture
def registry(backend: GatedBackend) -> Registry:
    return shared_backend(backend)


def _settings(**fields: Any) -> VLLMSection:
    return VLLMSection(**{"backend": "shared", "backend_call_timeout_s": BOUND, **fields})


def _worker(registry: Registry, *, groups: int = 1, plan: Any = None, **fields: Any) -> Any:
    settings = _settings(**fields)
    if plan is None:
        plan = resolve_plan(_vllm_config(), _kv_cache_config(), settings, registry, tp_rank=0)
    worker = WorkerSide(plan, settings, groups=groups)
    caches = {name: torch.randn(16, 2, BLOCK, 128).to(torch.bfloat16) for name in NAMES}
    worker.register(caches, INDEX, 16)
    worker.caches = caches
    return worker


def _saved(worker: Any, keys: list[str], blocks: list[int]) -> None:
    worker.submit_saves([PageOp("seed", keys, blocks, 0)])
    assert worker.flush()
    worker.take_report()
    worker.finished({"seed"})


def _wait(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# --- 1. a page is deleted only when it is proven bad -----------------------------------------


def test_the_page_store_says_which_pages_were_read_and_failed_verification(
    registry: Registry, backend: GatedBackend
) -> None:
    worker = _worker(registry)
    _saved(worker, ["k0", "k1"], [0, 1])
    stored = backend.inner._pages
    name = worker.names(["k1"])[0]
    page = bytearray(stored[name])
    page[-7] ^= 0x40
    stored[name] = bytes(page)
    verdicts: dict[int, str] = {}
    found = worker._store_get(worker.names(["k0", "k1", "k2"]), [4, 5, 6], None, verdicts)
    assert list(found) == [True, False, False]
    assert verdicts == {1: "corrupt_checksum"}  # k2 was never read: no verdict
    worker.close()


def test_verdicts_that_prove_a_page_bad() -> None:
    assert proves_bad("corrupt_checksum") and proves_bad("wrong_key") and proves_bad("bad_magic")
    # a newer kvtier on a shared store writes versions and checksums this one cannot read
    assert not proves_bad("unsupported_version") and not proves_bad("unknown_checksum")
    assert not proves_bad(None)


def test_only_a_page_that_failed_verification_is_deleted(
    registry: Registry, backend: GatedBackend
) -> None:
    worker = _worker(registry)
    _saved(worker, ["k0", "k1", "k2"], [0, 1, 2])
    stored = backend.inner._pages
    name = worker.names(["k1"])[0]
    stored[name] = stored[name][:-1] + bytes([stored[name][-1] ^ 1])
    worker.start_loads([PageOp("q", ["k0", "k1", "k2", "never"], [4, 5, 6, 7], 0)])
    assert worker.take_load_errors() == {5, 7}
    assert backend.deleted == [name]  # the missing page deletes nothing
    report = worker.take_report()
    assert report.failed == {"k1": 1, "never": 1} and report.failed_from == {"q": 1}
    assert worker.stats()["load_deleted_pages"] == 1
    worker.close()


def test_a_timed_out_read_deletes_nothing_and_holds_its_blocks_until_it_returns(
    registry: Registry, backend: GatedBackend
) -> None:
    worker = _worker(registry)
    _saved(worker, ["k0", "k1"], [0, 1])
    gate = backend.hold("get")
    t0 = time.monotonic()
    worker.start_loads([PageOp("q", ["k0", "k1"], [4, 5], 0)])
    _wait(lambda: not worker._loads[0].future.running() and worker._loads[0].future.done())
    assert time.monotonic() - t0 < BOUND + 2
    ended, failed = worker.poll_loads()
    assert (ended, failed) == (set(), set())  # the backend may still write into 4, 5
    assert worker.pop_load_errors() == {4, 5}  # vLLM learns now which blocks recompute
    assert backend.deleted == []
    stats = worker.stats()
    assert (stats["load_late_pages"], stats["store_backend_timeouts_get"]) == (2, 1)
    gate.set()  # the call returns at last: the blocks are free
    _wait(lambda: worker.poll_loads()[0] == {"q"})
    worker.close()


# --- 2. asynchronous loads ---------------------------------------------------------------------


def test_loads_end_per_request_and_failures_are_reported_as_vllm_takes_them(
    registry: Registry, backend: GatedBackend
) -> None:
    worker = _worker(registry)
    _saved(worker, ["k0", "k1", "k2"], [0, 1, 2])
    worker.start_loads(
        [
            PageOp("good", ["k0", "k1"], [4, 5], 0),
            PageOp("part", ["k0", "k1", "x2"], [6, 7, 8], 0),
            PageOp("none", ["y0", "y1"], [9, 10], 0),
        ]
    )
    _wait(lambda: worker._loads[0].future.done())
    ended, failed = worker.poll_loads()
    assert ended == {"good", "part", "none"}
    # a request with a page that did not land fails per request (vLLM looks it up again,
    # so only what landed is reported cached for it), and its blocks from the first bad
    # one are load errors in the same pass; a request whose pages all landed is not
    assert failed == {"part", "none"}
    assert worker.pop_load_errors() == {8, 9, 10}
    assert worker.take_report().failed_from == {"part": 2, "none": 0}
    stats = worker.stats()
    assert (stats["load_requests"], stats["load_failed_requests"]) == (3, 2)
    assert stats["store_hits"] == 2 and stats["load_copied_pages"] == 2  # read once each
    worker.close()


def test_loads_overlap_the_steps_that_run_meanwhile(
    registry: Registry, backend: GatedBackend
) -> None:
    worker = _worker(registry)
    _saved(worker, ["k0"], [0])
    backend.delay["get"] = 0.2
    worker.start_loads([PageOp("q", ["k0"], [4], 0)])
    for _ in range(3):  # three model steps while the read runs
        worker.step_began()
        time.sleep(0.05)
        worker.step_ended()
    _wait(lambda: worker.poll_loads()[0] == {"q"})
    stats = worker.stats()
    assert 0.1 <= stats["load_overlap_seconds"] <= stats["load_seconds"] + 0.01
    worker.close()


def test_a_step_without_a_forward_waits_briefly_for_a_load_to_end(
    registry: Registry, backend: GatedBackend
) -> None:
    worker = _worker(registry)
    _saved(worker, ["k0"], [0])
    backend.delay["get"] = 0.05
    worker.start_loads([PageOp("q", ["k0"], [4], 0)])
    assert worker.poll_loads() == (set(), set())  # a step with a forward: never waits
    t0 = time.monotonic()
    assert worker.poll_loads(wait_s=2.0) == ({"q"}, set())  # nothing else to do: waits
    assert time.monotonic() - t0 < 1.0
    worker.close()


def test_a_resumed_request_is_held_for_its_stores_again(registry: Registry) -> None:
    side, _ = _scheduler(registry)
    request = _Request("r", _tokens(3))
    keys = side.request_keys(request, 3)
    side.learn(Report(stored={keys[0]: 1}))
    assert side.matched_tokens(request, 0) == BLOCK
    side.after_alloc(request, ([1, 2, 3, 4],), BLOCK)  # an asynchronous load of page 0
    side.step([], [], {}, [])
    # loaded, then resumed after a preemption with its whole table: it stores pages 1, 2
    work = side.step([], [("r", ([5, 6, 7, 8],), True, BLOCK)], {"r": 2 * BLOCK}, [])
    assert [op.keys for op in work.saves] == [keys[1:3]]
    assert side.finished("r") is True  # vLLM keeps its blocks until they are stored
    side.close()


# --- 2. lookups off the scheduler thread -------------------------------------------------------


@dataclass
class _Request:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    lora_request: Any = None
    kv_transfer_params: Any = None


def _scheduler(registry: Registry, **fields: Any) -> tuple[SchedulerSide, Any]:
    settings = _settings(**fields)
    plan = resolve_plan(_vllm_config(), _kv_cache_config(), settings, registry, tp_rank=0)
    store = open_lookup(plan, **settings.page_store_options())
    return SchedulerSide(plan, settings, store), store


def _tokens(pages: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 499 + 1 for i in range(pages * BLOCK + 1)]


def test_a_slow_exists_is_asked_again_never_waited_for(
    registry: Registry, backend: GatedBackend
) -> None:
    side, _ = _scheduler(registry, lookup_wait_s=0.01)
    request = _Request("r", _tokens(4))
    keys = side.request_keys(request, 4)
    backend.inner._pages.update({k: bytearray() for k in keys[:2]})
    gate = backend.hold("exists")
    t0 = time.monotonic()
    assert side.lookup(request, 0) is None  # vLLM skips the request this step
    assert side.lookup(request, 0) is None
    assert time.monotonic() - t0 < 0.5
    gate.set()
    _wait(lambda: side.lookup(request, 0) is not None)
    assert side.stats()["lookup_deferred"] == 1
    assert side.stats()["lookup_hit_pages"] == 2
    side.close()


def test_a_lookup_stops_at_the_first_miss(registry: Registry, backend: GatedBackend) -> None:
    side, _ = _scheduler(registry)
    long = _Request("r", _tokens(30))
    keys = side.request_keys(long, 30)
    backend.inner._pages.update({k: b"" for k in keys[:3]})
    assert side.matched_tokens(long, 0) == 3 * BLOCK
    asked = [len(call) for call in backend.calls["exists"]]
    assert asked == [8]  # one call of the first chunk, not 30 keys
    backend.inner._pages.update({k: b"" for k in keys})
    assert side.matched_tokens(_Request("s", long.all_token_ids), 0) == 30 * BLOCK
    assert [len(call) for call in backend.calls["exists"]][1:] == [8, 16, 6]
    side.close()


def test_a_lookup_past_its_bound_is_a_miss(registry: Registry, backend: GatedBackend) -> None:
    side, _ = _scheduler(registry, lookup_wait_s=0.0, lookup_timeout_s=0.2)
    backend.hold("exists")
    request = _Request("r", _tokens(4))
    assert side.lookup(request, 0) is None
    time.sleep(0.25)
    assert side.lookup(request, 0) == 0
    assert side.stats()["lookup_timeouts"] == 1
    side.close()


def test_loads_are_asynchronous_on_the_cpu_engine_and_pages_known_answer_at_once(
    registry: Registry, backend: GatedBackend
) -> None:
    side, _ = _scheduler(registry)
    assert side.async_loads  # vLLM's CPU engine: WAITING_FOR_REMOTE_KVS between steps
    request = _Request("r", _tokens(3))
    keys = side.request_keys(request, 3)
    side.learn(Report(stored={key: 1 for key in keys}))
    backend.hold("exists")  # never asked: the workers reported every page stored
    assert side.lookup(request, 0) == 3 * BLOCK
    side.after_alloc(request, ([7, 8, 9, 10],), 3 * BLOCK)
    work = side.step([], [], {}, [])
    assert [(op.keys, op.blocks) for op in work.loads] == [(keys, [7, 8, 9])]
    assert side.finished("r") is False  # aborted while loading: vLLM frees it itself
    assert side.stats()["load_requests_planned"] == 1
    side.close()


def test_a_lookup_starts_when_vllm_admits_the_request(
    registry: Registry, backend: GatedBackend
) -> None:
    side, _ = _scheduler(registry)
    request = _Request("r", _tokens(4))
    keys = side.request_keys(request, 4)
    backend.inner._pages.update({k: b"" for k in keys[:3]})
    side.add_request(request)  # its exists runs while vLLM admits the others
    _wait(lambda: bool(backend.calls.get("exists")))
    gate = backend.hold("exists")  # a lookup asked now would wait: it is answered already
    _wait(lambda: side._lookups["r"].future.done())
    assert side.lookup(request, 0) == 3 * BLOCK
    assert side.stats()["lookup_deferred"] == 0
    gate.set()
    # vLLM's own hit is beyond where the early lookup stopped: looked up again from it
    later = _Request("s", _tokens(6, seed=3))
    keys = side.request_keys(later, 6)
    backend.inner._pages.update({k: b"" for k in keys[2:5]})
    side.add_request(later)
    _wait(lambda: side._lookups["s"].future.done())
    assert side.matched_tokens(later, 2 * BLOCK) == 3 * BLOCK
    assert [len(call) for call in backend.calls["exists"]][-2:] == [6, 4]
    # a request that cannot hold a whole page before its last token is not looked up
    side.add_request(_Request("t", _tokens(0)))
    assert "t" not in side._lookups
    side.close()


def test_the_schedulers_memories_are_bounded(registry: Registry) -> None:
    side, _ = _scheduler(registry, known_keys=10)
    side.learn(Report(failed={f"bad{i}": 1 for i in range(10_000)}))
    side.learn(Report(stored={f"half{i}": 1 for i in range(10_000)}))
    assert len(side._bad) == 4096 and len(side._known) == 10
    side.close()
    side2 = SchedulerSide(_plan(tp=2), _settings(known_keys=10), object())  # type: ignore[arg-type]
    side2.learn(Report(stored={f"half{i}": 1 for i in range(10_000)}))  # one rank of two
    assert len(side2._confirming) <= 4096


# --- 2. saves: bounded, never holding a finished request behind a slow backend ---------------


def test_saves_beyond_the_queue_bound_are_dropped_and_counted(
    registry: Registry, backend: GatedBackend
) -> None:
    worker = _worker(registry, max_save_pages=3)
    gate = backend.hold("put")
    worker.submit_saves([PageOp("a", ["a0", "a1"], [0, 1], 0)])
    _wait(lambda: bool(worker._writing))
    worker.submit_saves([PageOp("b", ["b0", "b1"], [2, 3], 0), PageOp("c", ["c0"], [4], 0)])
    worker.submit_saves([PageOp("d", ["d0", "d1", "d2"], [5, 6, 7], 0)])  # 3 queued: full
    assert worker.stats()["save_dropped_pages"] == 3
    assert worker.finished({"d"}) == {"d"}  # its blocks are not held for a dropped save
    gate.set()
    assert worker.flush()
    assert worker.finished({"a", "b", "c"}) == {"a", "b", "c"}
    assert set(worker.take_report().stored) == {"a0", "a1", "b0", "b1", "c0"}
    worker.close()


def test_a_merged_put_of_several_requests_tells_the_tiers_policy_each_pages_true_parent(
    backend: GatedBackend,
) -> None:
    from recording_policy import recorder, recording_registry

    shared_backend(backend)
    registry = recording_registry()
    settings = VLLMSection(
        tiers=[{"backend": "shared", "eviction": "recording"}], backend_call_timeout_s=10.0
    )
    plan = resolve_plan(_vllm_config(), _kv_cache_config(), settings, registry, tp_rank=0)
    side = SchedulerSide(plan, settings, object())  # type: ignore[arg-type]
    # b shares a's first page, computed side by side: a stores it, b stores its other two
    a = _Request("a", _tokens(3, seed=1))
    b = _Request("b", a.all_token_ids[:BLOCK] + _tokens(2, seed=2)[: 2 * BLOCK + 1])
    for request in (a, b):
        side.add_request(request)
        side.after_alloc(request, [], 0)
    work = side.step([("a", [1, 2, 3], 0), ("b", [4, 5, 6], 0)], [], {"a": 96, "b": 96}, [])
    keys_a, keys_b = side.request_keys(a, 3), side.request_keys(b, 3)
    assert keys_a[0] == keys_b[0]
    assert [(op.req_id, op.keys, op.parent) for op in work.saves] == [
        ("a", keys_a, None),
        ("b", keys_b[1:], keys_a[0]),
    ]
    worker = _worker(registry, plan=plan, backend_call_timeout_s=10.0)
    gate = backend.hold("put")
    worker.submit_saves([PageOp("first", ["z0"], [7], 0)])  # the writer waits in its put
    _wait(lambda: bool(worker._writing))
    worker.submit_saves(work.saves)  # both queued behind it: one put of the two requests
    gate.set()
    assert worker.flush()
    names_a, names_b = worker.names(keys_a), worker.names(keys_b)
    assert names_a + names_b[1:] in backend.calls["put"]
    told = recorder(worker.store)
    assert [told.parent_of(name) for name in names_a] == [None, names_a[0], names_a[1]]
    # b's second page follows the shared first one, not a's last page
    assert [told.parent_of(name) for name in names_b[1:]] == [names_b[0], names_b[1]]
    worker.close()


def test_a_step_without_a_forward_waits_for_finished_requests_stores(
    registry: Registry, backend: GatedBackend
) -> None:
    worker = _worker(registry)
    assert worker.finished({"none"}, wait_s=5.0) == set()  # nothing stored: no wait
    gate = backend.hold("put")
    worker.submit_saves([PageOp("r", ["k0"], [0], 0)])
    _wait(lambda: bool(worker._writing))
    t0 = time.monotonic()
    assert worker.finished({"r"}, wait_s=0.05) == set()  # bounded: vLLM asks again
    assert 0.04 <= time.monotonic() - t0 < 2
    threading.Timer(0.05, gate.set).start()
    assert worker.finished(set(), wait_s=5.0) == {"r"}  # the engine idles until it is done
    worker.close()


def test_the_storage_threads_yield_the_cores_to_the_model(
    registry: Registry, backend: GatedBackend
) -> None:
    import os

    if not hasattr(os, "getpriority"):
        pytest.skip("no per-thread priorities here")
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    before = set(threading.enumerate())
    worker = _worker(registry, storage_nice=5)
    _saved(worker, ["k0"], [0])
    worker.start_loads([PageOp("q", ["k0"], [4], 0)])
    worker.finish_loads()
    started = {t.name.split("_")[0]: t.native_id for t in set(threading.enumerate()) - before}
    for name in ("kvtier-vllm-save", "kvtier-vllm-load"):  # and what they started
        tid = started[name]
        assert tid is not None
        assert os.getpriority(os.PRIO_PROCESS, tid) == min(19, base + 5)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # the model's
    worker.close()


def test_a_timed_out_store_holds_its_finished_requests_blocks_until_it_returns(
    registry: Registry, backend: GatedBackend
) -> None:
    worker = _worker(registry)
    gate = backend.hold("put")
    worker.submit_saves([PageOp("r", ["k0"], [0], 0)])
    assert worker.flush()  # the put timed out: the writer went on
    assert worker.finished({"r"}) == set()  # the backend may still read block 0
    assert worker.stats()["save_late_pages"] == 1
    gate.set()
    _wait(lambda: worker.finished(set()) == {"r"})
    worker.close()


# --- 1. preemption waits for a store in flight, bounded, or drops it -------------------------


def test_preemption_drops_queued_stores_and_waits_for_the_one_in_flight(
    registry: Registry, backend: GatedBackend
) -> None:
    worker = _worker(registry, preempt_wait_s=5.0)
    backend.delay["put"] = 0.2  # under the call bound (0.3 s)
    worker.submit_saves([PageOp("p", ["p0"], [0], 0)])
    _wait(lambda: bool(worker._writing))
    worker.submit_saves([PageOp("p", ["p1"], [1], 1)])  # queued behind p0
    t0 = time.monotonic()
    worker.preempted({"p"})
    assert 0.05 < time.monotonic() - t0 < 2.0  # waited for p0, did not wait for p1
    stats = worker.stats()
    assert (stats["preempt_waits"], stats["save_dropped_pages"]) == (1, 1)
    assert worker.take_report().stored == {"p0": 1}
    worker.close()


def test_a_store_still_running_past_the_preemption_bound_is_tainted_and_deleted(
    registry: Registry, backend: GatedBackend
) -> None:
    worker = _worker(registry, preempt_wait_s=0.05, backend_call_timeout_s=5.0)
    gate = backend.hold("put")
    worker.submit_saves([PageOp("p", ["p0"], [0], 0)])
    _wait(lambda: bool(worker._writing))
    t0 = time.monotonic()
    worker.preempted({"p"})  # vLLM reuses block 0 right after this
    assert time.monotonic() - t0 < 1.0
    gate.set()
    assert worker.flush()
    stats = worker.stats()
    assert (stats["preempt_wait_timeouts"], stats["save_tainted_pages"]) == (1, 1)
    assert worker.take_report().stored == {}  # never reported stored ...
    assert backend.deleted == worker.names(["p0"])  # ... and deleted once written
    worker.close()


# --- 4. hybrid models (vLLM's hybrid allocator): groups --------------------------------------


@dataclass
class SlidingWindowSpec:
    block_size: int = BLOCK
    num_kv_heads: int = 2
    head_size: int = 64
    dtype: torch.dtype = torch.bfloat16
    sliding_window: int = 64
    head_size_v: int | None = None


@dataclass
class MLAAttentionSpec:
    block_size: int = BLOCK
    num_kv_heads: int = 1
    head_size: int = 576
    dtype: torch.dtype = torch.bfloat16
    head_size_v: int | None = 0


def _hybrid_config(num_blocks: int = 16) -> Any:
    groups = [
        SimpleNamespace(kv_cache_spec=SlidingWindowSpec(), layer_names=[NAMES[0]]),
        SimpleNamespace(kv_cache_spec=FullAttentionSpec(), layer_names=[NAMES[1]]),
    ]
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=groups)


def test_a_hybrid_models_groups_are_one_page_geometry_keyed_apart(registry: Registry) -> None:
    config = _hybrid_config()
    groups = kv_groups(config)
    assert [(g.kind, g.sliding_window, g.volatile) for g in groups] == [
        ("sliding_window", 64, True),
        ("full", None, False),
    ]
    assert geometry_fields(config)["num_layers"] == 1  # a page: one block, one position
    settings = _settings()
    plan = resolve_plan(_vllm_config(), config, settings, registry, tp_rank=0)
    side = SchedulerSide(plan, settings, object(), groups=groups)  # type: ignore[arg-type]
    request = _Request("r", _tokens(4))
    sliding, full = side.request_keys(request, 4, 0), side.request_keys(request, 4, 1)
    assert not set(sliding) & set(full)
    # the full-attention group keeps its keys apart from a one-group model's too
    assert not set(full) & set(SchedulerSide(plan, settings, object()).request_keys(request, 4))  # type: ignore[arg-type]


def test_a_hybrid_requests_loads_and_stores_follow_each_groups_blocks(registry: Registry) -> None:
    config = _hybrid_config()
    groups = kv_groups(config)
    settings = _settings()
    plan = resolve_plan(_vllm_config(), config, settings, registry, tp_rank=0)
    side = SchedulerSide(plan, settings, object(), groups=groups)  # type: ignore[arg-type]
    request = _Request("r", _tokens(4))
    sliding, full = side.request_keys(request, 4, 0), side.request_keys(request, 4, 1)
    side.learn(Report(stored={key: 1 for key in sliding + full}))
    assert side.lookup(request, 0) == 4 * BLOCK
    # the sliding-window group gets vLLM's null block (0) for blocks out of its window
    side.after_alloc(request, ([0, 0, 3, 4, 5], [6, 7, 8, 9, 10]), 4 * BLOCK)
    loads = side.step([], [], {}, []).loads
    assert [(op.group, op.keys, op.blocks, op.first) for op in loads] == [
        (0, sliding[2:], [3, 4], 2),
        (1, full, [6, 7, 8, 9], 0),
    ]
    other = _Request("s", _tokens(3, seed=5))
    side.add_request(other)
    side.after_alloc(other, ([], []), 0)
    work = side.step([("s", ([11, 12, 13], [14, 15, 1]), 0)], [], {"s": 3 * BLOCK}, [])
    assert [(op.group, op.blocks, op.stage) for op in work.saves] == [
        (0, [11, 12, 13], True),  # copied aside at once: vLLM frees them mid-request
        (1, [14, 15, 1], False),
    ]


def test_a_hybrid_worker_stages_sliding_window_pages_and_fails_per_request(
    registry: Registry, backend: GatedBackend
) -> None:
    config = _hybrid_config()
    settings = _settings(staging_pages=2)
    plan = resolve_plan(_vllm_config(), config, settings, registry, tp_rank=0)
    worker = WorkerSide(plan, settings, groups=2)
    memory = torch.randn(16, 2, BLOCK, 128).to(torch.bfloat16)
    worker.register({NAMES[0]: memory, NAMES[1]: memory}, INDEX, 16)  # groups overlay
    assert worker.pages.num_blocks == 16 and worker.pages.staging_pages == 2
    original = memory[3].clone()
    gate = backend.hold("put")
    worker.submit_saves([PageOp("r", ["s3"], [3], 3, 0, stage=True)])
    memory[3].zero_()  # vLLM reused block 3 at once; the staged copy is what is stored
    worker.submit_saves([PageOp("r", ["s4", "s5"], [4, 5], 4, 0, stage=True)])  # no room
    gate.set()
    assert worker.flush()
    stats = worker.stats()
    assert (stats["save_staged_pages"], stats["save_dropped_pages"]) == (1, 2)
    worker.start_loads([PageOp("q", ["s3"], [7], 0, 0), PageOp("q", ["f0"], [8], 0, 1)])
    _wait(lambda: worker._loads[0].future.done())
    assert torch.equal(memory[7].view(torch.int16), original.view(torch.int16))
    ended, failed = worker.poll_loads()
    # one group's page is missing: vLLM takes failures per request with several groups
    assert (ended, failed) == ({"q"}, {"q"}) and worker.pop_load_errors() == set()
    worker.close()


def test_kv_caches_kvtier_cannot_store_are_refused_with_what_works() -> None:
    @dataclass
    class ChunkedLocalAttentionSpec:
        block_size: int = BLOCK

    mixed = _kv_cache_config(FullAttentionSpec(), ChunkedLocalAttentionSpec())
    with pytest.raises(UnsupportedCombinationError, match="ChunkedLocalAttentionSpec"):
        kv_groups(mixed)
    with pytest.raises(UnsupportedCombinationError, match="beside others"):
        kv_groups(_kv_cache_config(MLAAttentionSpec(), FullAttentionSpec()))


# --- 4. MLA: one writer rank, pages shared by every rank ------------------------------------


def _mla_plan(registry: Registry, rank: int, tp: int = 2) -> Any:
    config = SimpleNamespace(
        num_blocks=16,
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=MLAAttentionSpec(), layer_names=NAMES)],
    )
    vllm_config = _vllm_config(tp=tp)
    vllm_config.model_config.hf_config = SimpleNamespace(kv_lora_rank=512)
    return resolve_plan(vllm_config, config, _settings(), registry, tp_rank=rank)


def test_mla_pages_are_written_by_one_rank_and_read_by_every_rank(
    registry: Registry, backend: GatedBackend
) -> None:
    plans = [_mla_plan(registry, rank) for rank in (0, 1)]
    assert plans[0].geometry.attention.value == "mla" and plans[0].geometry.head_dim == 576
    assert plans[0].rank_suffix == plans[1].rank_suffix == ""  # one key for every rank
    workers = []
    for plan in plans:
        worker = WorkerSide(plan, _settings(), groups=1)
        caches = {name: torch.randn(16, 1, BLOCK, 576).to(torch.bfloat16) for name in NAMES}
        worker.register(caches, INDEX, 16)
        worker.caches = caches
        workers.append(worker)
    writer, reader = workers
    for worker in workers:  # every rank gets the same step's work
        worker.submit_saves([PageOp("r", ["m0"], [2], 0)])
        assert worker.flush()
    assert writer.take_report().stored == {"m0": 1} and reader.take_report().stored == {}
    assert len(backend.calls["put"]) == 1
    assert reader.stats()["save_skipped_not_writer"] == 1
    assert reader.finished({"r"}) == {"r"} and writer.finished({"r"}) == {"r"}
    reader.start_loads([PageOp("q", ["m0"], [5], 0)])
    assert reader.take_load_errors() == set()
    for name in NAMES:
        assert torch.equal(
            reader.caches[name][5].view(torch.int16), writer.caches[name][2].view(torch.int16)
        )
    side = SchedulerSide(plans[0], _settings(), object())  # type: ignore[arg-type]
    request = _Request("r", _tokens(1))
    key = side.request_keys(request, 1)[0]
    side.learn(Report(stored={key: 1}))  # the writer's report is enough
    assert side.lookup(request, 0) == BLOCK
    for worker in workers:
        worker.close()


# --- 5. what the tiers hold: evictions, KV events, tiers, promotions, tenants, resets ---------


def _plan_of(settings: VLLMSection, registry: Registry | None = None) -> Any:
    return resolve_plan(
        _vllm_config(), _kv_cache_config(), settings, registry or default_registry(), tp_rank=0
    )


def _page_bytes(plan: Any) -> int:
    """What one page takes in a tier: its envelope and its payload."""
    return int(plan.geometry.bytes_per_page) + ENVELOPE_BYTES


def _registered(plan: Any, settings: VLLMSection) -> WorkerSide:
    worker = WorkerSide(plan, settings)
    caches = {name: torch.randn(16, 2, BLOCK, 128).to(torch.bfloat16) for name in NAMES}
    worker.register(caches, INDEX, 16)
    return worker


class _Absent:
    """The scheduler's store where nothing is stored (hits come from what it learnt)."""

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [False] * len(keys)


def test_a_page_the_backend_evicts_is_forgotten_and_never_promised() -> None:
    settings = VLLMSection(backend="memory", extra_config={"capacity_bytes": 1})
    page = _page_bytes(_plan_of(settings))
    settings = VLLMSection(backend="memory", extra_config={"capacity_bytes": 3 * page + 100})
    plan = _plan_of(settings)
    worker = _registered(plan, settings)
    side = SchedulerSide(plan, settings, _Absent())
    request = _Request("r", _tokens(5))
    keys = side.request_keys(request, 5)
    worker.submit_saves([PageOp("r", keys[:3], [0, 1, 2], 0)])
    assert worker.flush()
    side.learn(worker.take_report())
    # stored in this process: a hit from the scheduler's memory (its store holds nothing)
    assert side.matched_tokens(_Request("a", request.all_token_ids), 0) == 3 * BLOCK
    worker.submit_saves([PageOp("r", keys[3:], [3, 4], 3)])  # the backend evicts 0 and 1
    assert worker.flush()
    report = worker.take_report()
    assert [(held, key) for _, held, _, key in report.events if not held] == [
        (False, keys[0]),
        (False, keys[1]),
    ]
    side.learn(report)
    # page 0 left storage: nothing is promised, though the scheduler stored all five
    assert side.matched_tokens(_Request("b", request.all_token_ids), 0) == 0
    assert side.stats()["known_forgotten"] == 2
    worker.close()


def test_a_tier_holds_a_page_once_every_rank_holds_its_share() -> None:
    ledger = TierLedger(tiers=2, ranks=2, limit=8)
    assert ledger.apply(0, True, 0, "k") is None  # rank 0's heads only
    assert ledger.held("k") is False and ledger.held("never") is None
    assert ledger.apply(1, True, 0, "k") is True
    assert ledger.apply(1, True, 1, "k") is None and ledger.apply(0, True, 1, "k") is True
    assert ledger.tier_of("k") == 0
    assert ledger.apply(1, False, 0, "k") is False  # rank 1's share left tier 0
    assert (ledger.held("k"), ledger.tier_of("k")) == (True, 1)
    assert ledger.apply(0, False, 1, "never") is None  # nothing known changes
    for i in range(20):
        ledger.apply(0, True, 0, f"x{i}")
    assert len(ledger) == 8  # bounded: the oldest are forgotten


def _describe(request: Any, lo: int, hi: int) -> list[BlockInfo]:
    """vLLM's blocks as its scheduler would describe them (hashes h<i>, chained)."""
    tokens = request.all_token_ids
    return [
        BlockInfo(
            f"h{i}".encode(),
            f"h{i - 1}".encode() if i else None,
            tuple(tokens[i * BLOCK : (i + 1) * BLOCK]),
        )
        for i in range(lo, hi)
    ]


def test_kv_events_say_what_each_tier_holds_under_vllms_block_hashes(tmp_path: Path) -> None:
    tiers = [{"backend": "memory"}, {"backend": "file", "extra_config": {"root": str(tmp_path)}}]
    settings = VLLMSection(tiers=tiers)  # type: ignore[arg-type]
    plan = _plan_of(settings)
    assert [tier.eviction is not None for tier in plan.storage_tiers()] == [True, True]
    side = SchedulerSide(plan, settings, _Absent(), describe=_describe)
    request = _Request("r", _tokens(3))
    side.add_request(request)
    side.after_alloc(request, [], 0)
    saves = side.step([("r", [1, 2, 3, 4], 0)], [], {"r": 3 * BLOCK + 1}, []).saves
    keys = [key for op in saves for key in op.keys]
    assert len(keys) == 3
    stored = [(0, True, 0, key) for key in keys] + [(0, True, 1, key) for key in keys]
    side.learn(Report(stored={key: 1 for key in keys}, events=stored))
    hashes = [b"h0", b"h1", b"h2"]
    common = {
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": request.all_token_ids[: 3 * BLOCK],
        "block_size": BLOCK,
        "lora_id": None,
        "lora_name": None,
        "extra_keys": None,
        "group_idx": 0,
    }
    assert side.take_events() == [
        ("BlockStored", {**common, "medium": "KVTIER:0:memory"}),
        ("BlockStored", {**common, "medium": "KVTIER:1:file"}),
    ]
    # tier 0 evicts page 0: a removal there; tier 1 still holds it, so it is still a hit
    side.learn(Report(events=[(0, False, 0, keys[0])]))
    removed = {"block_hashes": [b"h0"], "medium": "KVTIER:0:memory", "group_idx": 0}
    assert side.take_events() == [("BlockRemoved", removed)]
    other = _Request("o", request.all_token_ids)
    assert side.matched_tokens(other, 0) == 3 * BLOCK
    # a load reads each page from the fastest tier holding it: page 0 from the file tier
    side.after_alloc(other, [5, 6, 7, 8], 3 * BLOCK)
    assert side.hit_sources("o", 3 * BLOCK) == {"disk": BLOCK, "host": 2 * BLOCK}
    assert side.hit_sources("unknown", 2 * BLOCK) == {"external_unspecified": 2 * BLOCK}
    # tier 1 loses it too: no tier holds page 0, so it is never promised from memory
    side.learn(Report(events=[(0, False, 1, keys[0])]))
    assert side.matched_tokens(_Request("p", request.all_token_ids), 0) == 0
    assert side.stats()["known_forgotten"] == 1
    side.take_events()
    # vLLM's reset: vLLM hears the tiers no longer hold what they held for it, a request
    # keyed from now on has new keys, one admitted before stores nothing and hits nothing
    early = _Request("e", _tokens(3, seed=9))
    side.add_request(early)
    assert side.reset() is True
    assert sorted((f["medium"], h) for _, f in side.take_events() for h in f["block_hashes"]) == [
        ("KVTIER:0:memory", b"h1"),
        ("KVTIER:0:memory", b"h2"),
        ("KVTIER:1:file", b"h1"),
        ("KVTIER:1:file", b"h2"),
    ]
    assert not set(side.request_keys(_Request("n", request.all_token_ids), 3)) & set(keys)
    assert side.lookup(_Request("m", request.all_token_ids), 0) == 0
    assert side.step([("e", [9, 10, 11, 12], 0)], [], {"e": 3 * BLOCK + 1}, []).saves == []
    assert side.lookup(early, 0) == 0 and side.stats()["resets"] == 1


def test_a_load_from_a_lower_tier_promotes_and_a_lookup_waits_for_it(
    registry: Registry, backend: GatedBackend
) -> None:
    tiers = [{"backend": "shared"}, {"backend": "memory"}]
    settings = VLLMSection(tiers=tiers, backend_call_timeout_s=5.0)  # type: ignore[arg-type]
    plan = _plan_of(settings, registry)
    worker = _registered(plan, settings)
    side = SchedulerSide(plan, settings, open_lookup(plan, **settings.page_store_options()))
    request = _Request("r", _tokens(4))
    keys = side.request_keys(request, 4)
    worker.submit_saves([PageOp("r", keys, [0, 1, 2, 3], 0)])
    assert worker.flush()  # stored in tier 0, cascaded into tier 1
    report = worker.take_report()
    assert sorted((tier, key) for _, held, tier, key in report.events if held) == sorted(
        (tier, key) for tier in (0, 1) for key in keys
    )
    side.learn(report)
    for name in worker.names(keys[:2]):  # tier 0 lost pages 0 and 1; tier 1 holds them
        del backend.inner._pages[name]
    gate = backend.hold("put")  # the promotion into tier 0 waits
    worker.start_loads([PageOp("q", keys, [4, 5, 6, 7], 0)])
    _wait(lambda: worker.poll_loads()[0] == {"q"})
    assert worker.pop_load_errors() == set()  # every page served, two by tier 1
    report = worker.take_report()
    assert sorted(report.promoting) == sorted(keys[:2])
    side.learn(report)
    other = _Request("o", request.all_token_ids)
    assert side.lookup(other, 0) is None  # "ask again": the load would read tier 1 twice
    assert side.stats()["lookup_promoting"] == 1
    gate.set()
    assert worker.flush()
    report = worker.take_report()
    assert [(held, tier, key) for _, held, tier, key in report.events] == [
        (True, 0, keys[0]),
        (True, 0, keys[1]),
    ]
    side.learn(report)
    assert side.lookup(other, 0) == 4 * BLOCK
    worker.close()
    side.close()


def test_a_tenants_quota_covers_the_requests_salted_with_its_name() -> None:
    settings = VLLMSection(backend="memory")
    page = _page_bytes(_plan_of(settings))
    settings = VLLMSection(
        backend="memory",
        tenant="a",
        tenants={"a": {}, "b": {"quota_bytes": 2 * page}},  # type: ignore[dict-item]
    )
    plan = _plan_of(settings)
    worker = _registered(plan, settings)
    side = SchedulerSide(plan, settings, _Absent())
    salted, plain = _Request("b", _tokens(4), cache_salt="b"), _Request("a", _tokens(4, seed=1))
    of_b, of_a = side.request_keys(salted, 4), side.request_keys(plain, 4)
    for op in (
        PageOp("b", of_b[:2], [0, 1], 0),
        PageOp("a", of_a, [4, 5, 6, 7], 0),
        PageOp("b", of_b[2:], [2, 3], 2),
    ):
        worker.submit_saves([op])
        assert worker.flush()
    evicted = [key for _, held, _, key in worker.take_report().events if not held]
    assert evicted == of_b[:2]  # b's own oldest pages, never a's
    assert worker.store is not None
    assert worker.store.tenant_stats()["b"]["quota_evictions"] == 2
    worker.close()


def test_the_section_takes_tiers_and_tenants_as_every_entry_does() -> None:
    section = read_section(
        {"kvtier": {"tiers": [{"backend": "memory"}, {"backend": "file"}], "tenant": "a"}},
        default_registry().backends,
    )
    assert section.backend == "memory" and [t.backend for t in section.tiers] == ["memory", "file"]
    with pytest.raises(InvalidFieldError, match="not both"):
        read_section(
            {"kvtier": {"backend": "file", "tiers": [{"backend": "memory"}]}},
            default_registry().backends,
        )


# --- the connector's class-level declarations (vLLM's environment) -----------------------------


def test_the_connector_declares_hma_layout_and_piecewise_graphs(tmp_path: Path) -> None:
    from test_vllm import _vllm_python

    python = _vllm_python()
    code = """
from types import SimpleNamespace
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
from kvtier.integrations.vllm import KvtierConnector as C
assert supports_hma(C)
gpu = SimpleNamespace(device_config=SimpleNamespace(device_type="cuda"))
cpu = SimpleNamespace(device_config=SimpleNamespace(device_type="cpu"))
assert C.get_required_kvcache_layout(gpu) == "NHD"
assert C.get_required_kvcache_layout(cpu) is None
assert C.requires_piecewise_for_cudagraph({"kvtier": {"backend": "file"}})
assert C.requires_piecewise_for_cudagraph({"kvtier": '{"backend": "file"}'})
ops = {"kvtier": {"backend": "file", "operations": ["load_all", "backup_all"]}}
assert not C.requires_piecewise_for_cudagraph(ops)
print("ok")
"""
    proc = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


def test_the_connector_registers_kvtiers_counters_with_vllms_prometheus() -> None:
    """vLLM's Prometheus logger builds the connector's metrics from the class and feeds
    them what ``get_kv_connector_stats`` reported (summed): each kvtier counter grows a
    ``vllm:kvtier_<name>`` series with vLLM's labels."""
    from test_vllm import _vllm_python

    code = """
from types import SimpleNamespace
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, generate_latest
from kvtier.integrations.vllm import KvtierConnector as C
config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}))
types = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
metrics = C.build_prom_metrics(config, types, ["model_name", "engine"], {0: ["tiny", "0"]})
names = {m.name for m in REGISTRY.collect()}
assert "vllm:kvtier_load_hit_pages" in names
assert "vllm:kvtier_store_invalid_corrupt_checksum" in names
assert "vllm:kvtier_cache_host_hits" in names  # the accelerator path's, from the start
stats = C.build_kv_connector_stats({"kvtier_load_hit_pages": 8, "kvtier_store_hits": 8})
metrics.observe(stats.data, 0)
metrics.observe({"kvtier_load_hit_pages": 2, "kvtier_lookup_hit_pages": 0}, 0)
text = generate_latest().decode()
assert 'vllm:kvtier_load_hit_pages_total{engine="0",model_name="tiny"} 10.0' in text, text
assert 'vllm:kvtier_store_hits_total{engine="0",model_name="tiny"} 8.0' in text
assert 'vllm:kvtier_lookup_hit_pages_total{engine="0"' not in text  # nothing counted yet
# a name kvtier's registry does not declare (a rate) is never made a counter
metrics.observe({"kvtier_cache_host_hit_rate": 0.5, "kvtier_cache_host_hits": 3}, 0)
text = generate_latest().decode()
assert "kvtier_cache_host_hit_rate" not in text
assert 'vllm:kvtier_cache_host_hits_total{engine="0",model_name="tiny"} 3.0' in text
print("ok")
"""
    proc = subprocess.run(
        [str(_vllm_python()), "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_one_put_of_several_requests_lays_each_requests_pages_side_by_side(
    backend: GatedBackend, registry: Registry
) -> None:
    # a's saves of two steps, with b's between them, queued while the writer is busy: the
    # next put holds a's pages together (a segment store writes a put as one record, so
    # a later hit on a's prefix is one read), each request's in its own order
    worker = _worker(registry, backend_call_timeout_s=10.0)
    gate = backend.hold("put")
    worker.submit_saves([PageOp("first", ["z0"], [7], 0)])  # the writer waits in its put
    _wait(lambda: bool(worker._writing))
    worker.submit_saves([PageOp("a", ["a0", "a1"], [1, 2], 0)])
    worker.submit_saves([PageOp("b", ["b0"], [3], 0)])
    worker.submit_saves([PageOp("a", ["a2"], [4], 2, parent="a1")])
    gate.set()
    assert worker.flush()
    assert worker.names(["a0", "a1", "a2", "b0"]) in backend.calls["put"]
    worker.close()


# --- prefill and decode through the store: the handoff ------------------------------------------


def _side(registry: Registry, *, loads: bool = True, saves: bool = True, **fields: Any) -> Any:
    settings = _settings(**fields)
    plan = resolve_plan(_vllm_config(), _kv_cache_config(), settings, registry, tp_rank=0)
    store = open_lookup(plan, **settings.page_store_options())
    return SchedulerSide(plan, settings, store, loads=loads, saves=saves)


def _prefilled(side: SchedulerSide, request: _Request, blocks: list[int]) -> None:
    """vLLM admits ``request``, finds nothing, and computes its whole prompt in one step."""
    side.add_request(request)
    assert side.matched_tokens(request, 0) == 0
    side.after_alloc(request, (blocks,), 0)
    side.step([(request.request_id, (blocks,), 0)], [], {request.request_id: 4 * BLOCK + 1}, [])


def test_a_producer_hands_on_the_pages_it_holds_or_is_storing(registry: Registry) -> None:
    producer = _side(registry, loads=False)
    request = _Request("r", _tokens(4))
    keys = producer.request_keys(request, 4)
    producer.learn(Report(stored={keys[0]: 1}))  # stored earlier: not stored again, counted
    _prefilled(producer, request, [1, 2, 3, 4, 5])
    assert producer.handoff("r") == {"kvtier_pages": 4}  # 1 stored, 3 in flight
    producer.step([], [], {}, ["r"])  # preempted: its queued stores are dropped
    assert producer.handoff("r") == {"kvtier_pages": 1}
    assert producer.finished("r") is False
    # a page a worker reported bad ends the count; nothing saved: nothing handed on
    other = _Request("s", _tokens(4, seed=1))
    _prefilled(producer, other, [6, 7, 8, 9, 10])
    producer.learn(Report(failed={producer.request_keys(other, 4)[2]: 1}))
    assert producer.handoff("s") == {"kvtier_pages": 2}
    short = _Request("t", _tokens(0))
    producer.add_request(short)
    assert producer.handoff("t") is None
    assert producer.stats()["handoff_announced_pages"] == 4 + 1 + 2
    producer.close()
    consumer = _side(registry, saves=False)
    _prefilled(consumer, _Request("r", _tokens(4)), [1, 2, 3, 4, 5])
    assert consumer.handoff("r") is None
    consumer.close()


def test_the_connector_returns_the_handoff_as_vllms_kv_transfer_params() -> None:
    from test_vllm import _vllm_python

    code = """
from types import SimpleNamespace
from kvtier.integrations.vllm import KvtierConnector as C
class Side:
    def handoff(self, req_id):
        return {"kvtier_pages": 3} if req_id == "r" else None
    def finished(self, req_id):
        return True
connector = C.__new__(C)
connector.scheduler = Side()
assert connector.request_finished(SimpleNamespace(request_id="r"), [1]) == (
    True, {"kvtier_pages": 3}
)
assert connector.request_finished_all_groups(SimpleNamespace(request_id="s"), ([1],)) == (
    True, None
)
print("ok")
"""
    proc = subprocess.run(
        [str(_vllm_python()), "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def _answer(side: SchedulerSide, request: _Request) -> int:
    """The first answer of a lookup other than "ask again" (vLLM asks each step)."""
    deadline = time.monotonic() + 10
    while (answer := side.lookup(request, 0)) is None:
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)
    return answer


def test_a_handed_off_request_waits_for_the_announced_pages(
    registry: Registry, backend: GatedBackend
) -> None:
    from kvtier.integrations.vllm.scheduler import HANDOFF_PROBE_S

    side = _side(registry, handoff_timeout_s=5.0)
    request = _Request("r", _tokens(4), kv_transfer_params={"kvtier_pages": 4})
    keys = side.request_keys(request, 4)
    backend.inner._pages.update({k: b"" for k in keys[:2]})  # the others are in flight
    side.add_request(request)
    _wait(lambda: side.lookup(request, 0) is None and side.stats()["handoff_waits"] == 1)
    calls = len(backend.calls["exists"])
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.05:  # vLLM asks again each step: no probe storm
        assert side.lookup(request, 0) is None
    assert len(backend.calls["exists"]) - calls <= 0.05 / HANDOFF_PROBE_S + 2
    backend.inner._pages.update({k: b"" for k in keys[2:]})  # the producer's stores landed
    assert _answer(side, request) == 4 * BLOCK
    stats = side.stats()
    assert (stats["handoff_waits"], stats["handoff_timeouts"]) == (1, 0)
    side.close()


def test_past_its_bound_a_handed_off_request_loads_what_was_found(
    registry: Registry, backend: GatedBackend
) -> None:
    side = _side(registry, handoff_timeout_s=0.2)
    request = _Request("r", _tokens(4), kv_transfer_params={"kvtier_pages": 9})
    keys = side.request_keys(request, 4)
    backend.inner._pages.update({k: b"" for k in keys[:2]})  # the rest was never stored
    t0 = time.monotonic()
    assert _answer(side, request) == 2 * BLOCK  # recomputes pages 2 and 3
    assert time.monotonic() - t0 >= 0.2
    stats = side.stats()
    assert (stats["handoff_waits"], stats["handoff_timeouts"]) == (1, 1)
    side.close()


def test_a_malformed_handoff_is_counted_and_ignored(
    registry: Registry, backend: GatedBackend, caplog: pytest.LogCaptureFixture
) -> None:
    side = _side(registry, handoff_timeout_s=30.0)
    tokens = _tokens(4)
    backend.inner._pages.update({k: b"" for k in side.request_keys(_Request("k", tokens), 2)})
    t0 = time.monotonic()
    for i, value in enumerate(["4", -1, True, 2.0, None]):
        request = _Request(f"r{i}", tokens, kv_transfer_params={"kvtier_pages": value})
        assert side.matched_tokens(request, 0) == 2 * BLOCK  # never waited for
    assert time.monotonic() - t0 < 5
    assert side.matched_tokens(_Request("x", tokens, kv_transfer_params="junk"), 0) == 2 * BLOCK
    stats = side.stats()
    assert (stats["handoff_invalid"], stats["handoff_waits"]) == (5, 0)
    assert "handoff_invalid" in caplog.text
    side.close()


def test_a_page_reported_bad_is_never_waited_for_nor_served(
    registry: Registry, backend: GatedBackend
) -> None:
    side = _side(registry, handoff_timeout_s=30.0)
    request = _Request("r", _tokens(4), kv_transfer_params={"kvtier_pages": 4})
    keys = side.request_keys(request, 4)
    backend.inner._pages.update({k: b"" for k in keys})
    side.learn(Report(failed={keys[2]: 1}))  # a worker's load found it corrupt
    t0 = time.monotonic()  # stored again, yet not served: 2 pages, at once
    assert side.matched_tokens(request, 0) == 2 * BLOCK
    assert time.monotonic() - t0 < 5 and side.stats()["handoff_waits"] == 0
    # page 1 still in flight, page 2 bad: waited for up to page 1 only
    del backend.inner._pages[keys[1]]
    late = _Request("s", request.all_token_ids, kv_transfer_params={"kvtier_pages": 4})
    _wait(lambda: side.lookup(late, 0) is None and side.stats()["handoff_waits"] == 1)
    backend.inner._pages[keys[1]] = bytearray()
    assert _answer(side, late) == 2 * BLOCK
    assert side.stats()["handoff_timeouts"] == 0
    side.close()
