"""Every engine path bounds its backend calls: a backend that hangs never hangs the engine.

The page store carries the bound (``backend_call_timeout_s``), so the vLLM connector's
CPU worker, accelerator worker (a TieredCache) and scheduler and the SGLang adapter get it
as TieredCache does (``tests/test_cache_bounded.py``). Each test hangs one backend call
forever (until teardown) and shows the engine's call returns within the bound, the batch
failed and the failure counted under the page store's names
(``backend_timeouts_<operation>``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_cache import shared_backend
from test_cache_bounded import HangingBackend

from kvtier.plugins.registry import Registry

BOUND = 0.3
SLACK = 2.0  # what a shared 2-core CI host may add to a bound
JOIN = 20.0  # waits that end when the work does: a bug fails, never hangs


@pytest.fixture
def backend() -> Iterator[HangingBackend]:
    hanging = HangingBackend()
    yield hanging
    hanging.release.set()  # let the abandoned call threads end


@pytest.fixture
def registry(backend: HangingBackend) -> Registry:
    return shared_backend(backend)


def _quickly(started: float) -> None:
    took = time.monotonic() - started
    assert took < BOUND + SLACK, took


# --- vLLM: the CPU worker and the scheduler ---------------------------------------------


def _vllm_plan(registry: Registry) -> tuple[Any, Any]:
    from test_vllm import _kv_cache_config, _vllm_config

    from kvtier.integrations.vllm import VLLMSection
    from kvtier.integrations.vllm.plan import resolve_plan

    settings = VLLMSection(backend="shared", backend_call_timeout_s=BOUND)
    plan = resolve_plan(_vllm_config(), _kv_cache_config(), settings, registry, tp_rank=0)
    return plan, settings


def test_vllm_worker_loads_and_stores_return_within_the_bound(
    backend: HangingBackend, registry: Registry
) -> None:
    from kvtier.integrations.vllm.messages import PageOp
    from kvtier.integrations.vllm.worker import WorkerSide

    plan, settings = _vllm_plan(registry)
    worker = WorkerSide(plan, settings)
    caches = {f"model.layers.{i}.a": torch.randn(8, 2, 32, 128).to(torch.bfloat16) for i in (0, 1)}
    worker.register(caches, {"model.layers.0.a": 0, "model.layers.1.a": 1}, 8)
    try:
        worker.submit_saves([PageOp("r", ["k0", "k1"], [0, 1], 0)])
        worker.flush()
        assert worker.take_report().stored == {"k0": 1, "k1": 1}

        backend.hang.add("get")
        t0 = time.monotonic()
        worker.start_loads([PageOp("q", ["k0", "k1"], [4, 5], 0)])
        assert worker.take_load_errors() == {4, 5}  # vLLM recomputes them
        _quickly(t0)

        backend.hang.add("put")
        t0 = time.monotonic()
        worker.submit_saves([PageOp("s", ["k2"], [2], 0)])
        worker.flush()
        _quickly(t0)
        assert worker.take_report().stored == {}
        stats = worker.stats()
        assert stats["store_backend_timeouts_get"] == 1
        assert stats["store_backend_timeouts_put"] == 1
        assert stats["save_failed_pages"] == 1
    finally:
        backend.release.set()
        worker.close()


def test_vllm_scheduler_lookup_returns_within_the_bound(
    backend: HangingBackend, registry: Registry
) -> None:
    from kvtier.integrations.vllm.scheduler import SchedulerSide
    from kvtier.storage import open_lookup

    plan, settings = _vllm_plan(registry)
    store = open_lookup(plan, **settings.page_store_options())
    side = SchedulerSide(plan, settings, store)
    request = type("R", (), {"request_id": "r", "num_computed_tokens": 0})()
    request.all_token_ids = list(range(1, 3 * 32 + 2))
    backend.hang.add("exists")
    try:
        t0 = time.monotonic()
        assert side.matched_tokens(request, 0) == 0  # storage could not answer: a miss
        _quickly(t0)
        assert store.stats()["backend_timeouts_exists"] == 1
    finally:
        backend.release.set()
        store.close()


# --- vLLM: the accelerator worker (a TieredCache over vLLM's blocks) --------------------


def _device_worker(registry: Registry) -> Any:
    from test_vllm_device_path import BLOCKS, INDEX, _caches, _kv_cache_config, _vllm_config

    from kvtier.integrations.vllm import VLLMSection
    from kvtier.integrations.vllm.device_worker import DeviceWorkerSide
    from kvtier.integrations.vllm.plan import resolve_plan

    settings = VLLMSection(backend="shared", backend_call_timeout_s=BOUND)
    plan = resolve_plan(_vllm_config("cuda"), _kv_cache_config(), settings, registry, tp_rank=0)
    worker = DeviceWorkerSide(plan, settings)
    worker.register(_caches("nhd", "cpu"), INDEX, BLOCKS)
    return worker


def test_vllm_device_worker_loads_and_stores_return_within_the_bound(
    backend: HangingBackend, registry: Registry
) -> None:
    from test_vllm_device_path import NAMES, _step_save

    from kvtier.integrations.vllm.messages import PageOp

    first = _device_worker(registry)
    try:
        _step_save(first, [PageOp("r", ["k0", "k1"], [1, 2], 0)])
        assert first.flush(JOIN)
        assert first.take_report().stored == {"k0": 1, "k1": 1}
    finally:
        first.close()  # the pages stay in the backend; a new worker has none in its host pool

    worker = _device_worker(registry)
    try:
        backend.hang.add("get")
        t0 = time.monotonic()
        worker.start_loads([PageOp("q", ["k0", "k1"], [4, 5], 0)])  # start_load_kv
        for name in NAMES:
            worker.wait_layer(name)  # wait_for_layer_load
        _quickly(t0)
        assert worker.take_load_errors() == {4, 5}  # vLLM recomputes them

        backend.hang.add("exists")
        t0 = time.monotonic()
        worker.start_loads([PageOp("e", ["k0"], [6], 0)])
        for name in NAMES:
            worker.wait_layer(name)
        _quickly(t0)
        assert worker.take_load_errors() == {6}

        backend.hang.add("put")
        t0 = time.monotonic()
        _step_save(worker, [PageOp("s", ["k2"], [3], 0)])  # save_kv_layer, wait_for_save
        done = worker.finished({"s"})  # get_finished, each step until the host copy is done
        while not done and time.monotonic() - t0 < BOUND + SLACK:
            time.sleep(0.01)
            done = worker.finished(set())
        assert done == {"s"}  # vLLM frees the block: the storage write needs it no more
        _quickly(t0)
        t0 = time.monotonic()
        assert worker.flush(JOIN)  # the storage write fails within the bound
        _quickly(t0)
        # never reported stored: the scheduler must not promise a page storage lacks
        assert worker.take_report().stored == {}
        stats = worker.stats()
        for op in ("exists", "get", "put"):
            assert stats[f"cache_page_store_backend_timeouts_{op}"] == 1, op
        assert stats["cache_failures_backend_timeout"] == 2 + 1 + 1  # pages: get, exists, put
        assert stats["cache_storage_pages_written"] == 0
        assert stats["load_failed_pages"] == 2 and stats["load_skipped_pages"] == 1
    finally:
        backend.release.set()
        worker.close()


# --- SGLang ----------------------------------------------------------------------------


@pytest.fixture
def sglang_storage(
    backend: HangingBackend, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    from sglang_host_pool import Controller, MHAHostPool, sglang_or_skip, storage_config

    sglang_or_skip()
    import kvtier.integrations.sglang.storage as adapter

    monkeypatch.setattr(adapter, "default_registry", lambda: registry)
    extra = {
        "backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang",
        "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1,
        "kvtier": {"backend": "shared", "backend_call_timeout_s": BOUND},
    }
    pool = MHAHostPool()
    controller = Controller.attach(storage_config(extra_config=extra), pool)
    yield controller
    backend.release.set()
    controller.storage.close()


def test_sglang_storage_calls_return_within_the_bound(
    backend: HangingBackend, sglang_storage: Any
) -> None:
    from test_sglang import _fill, _hashes

    controller = sglang_storage
    pool = controller.pool
    hashes = _hashes(2, 16)
    indices, _ = _fill(pool, 2)
    assert controller.backup(hashes, indices) == 32
    for op in ("exists", "get", "put"):
        backend.hang.add(op)
    storage = controller.storage
    t0 = time.monotonic()
    assert storage.batch_exists(hashes) == 0
    _quickly(t0)
    t0 = time.monotonic()
    assert storage.batch_get_v1(hashes, pool.alloc(32)) == [False, False]
    _quickly(t0)
    t0 = time.monotonic()
    assert storage.batch_set_v1(hashes, indices) == [False, False]
    _quickly(t0)
    stats = storage.kvtier_stats()
    for op in ("exists", "get", "put"):
        assert stats[f"backend_timeouts_{op}"] == 1, op


def test_sglang_clear_returns_within_the_bound(
    backend: HangingBackend, sglang_storage: Any, tmp_path: Path
) -> None:
    backend.hang.add("clear")
    t0 = time.monotonic()
    sglang_storage.storage.clear()
    _quickly(t0)
    stats = sglang_storage.storage.kvtier_stats()
    assert stats["clear_failures"] == 1 and stats["backend_timeouts_clear"] == 1
