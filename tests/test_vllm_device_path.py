"""The vLLM connector's device path at the worker level: vLLM's accelerator KV layouts as
kvtier's device pool under a TieredCache, driven with the calls vLLM makes per step.

No vLLM import: the worker side needs none. The tensors are CPU tensors in the
accelerator layouts (and CUDA tensors where a GPU exists); the plan is resolved from
stand-ins of vLLM's config objects for an engine whose device is ``cuda``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvtier.core.device_pool import BufferDevicePool, MHADevicePool, layer_buffers
from kvtier.core.errors import UnsupportedCombinationError
from kvtier.integrations.vllm.device_worker import DeviceWorkerSide
from kvtier.integrations.vllm.messages import PageOp
from kvtier.integrations.vllm.paged import VLLMPagedPool, strategy_of
from kvtier.integrations.vllm.plan import BLOCK_TAG, DEVICE_TAG, plan_strategy, resolve_plan
from kvtier.integrations.vllm.settings import VLLMSection
from kvtier.plugins.manager import default_registry

BLOCK = 16
BLOCKS = 8
HEADS = 2
DIM = 64
NAMES = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
INDEX = {name: i for i, name in enumerate(NAMES)}

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ),
]


@dataclass
class FullAttentionSpec:
    """The fields of vLLM's FullAttentionSpec the plan reads (same class name)."""

    block_size: int = BLOCK
    num_kv_heads: int = HEADS
    head_size: int = DIM
    dtype: torch.dtype = torch.bfloat16
    sliding_window: int | None = None
    head_size_v: int | None = None


def _vllm_config(device: str) -> Any:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_load_failure_policy="recompute"),
        model_config=SimpleNamespace(use_mla=False, model="tiny", revision="r1"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        device_config=SimpleNamespace(device_type=device),
    )


def _kv_cache_config() -> Any:
    group = SimpleNamespace(kv_cache_spec=FullAttentionSpec(), layer_names=list(NAMES))
    return SimpleNamespace(num_blocks=BLOCKS, kv_cache_groups=[group])


def _section(root: Path, **section: Any) -> VLLMSection:
    return VLLMSection.model_validate(
        {"backend": "file", "extra_config": {"root": str(root)}, **section}
    )


def _plan(root: Path, device: str = "cuda", **section: Any) -> Any:
    return resolve_plan(
        _vllm_config(device),
        _kv_cache_config(),
        _section(root, **section),
        default_registry(),
        tp_rank=0,
    )


def _worker(root: Path, **section: Any) -> DeviceWorkerSide:
    return DeviceWorkerSide(_plan(root, **section), _section(root, **section))


def _nhd(device: str) -> torch.Tensor:
    """vLLM 0.32's per-layer view [B, H, N, 2D] over token-major (LBNHC) memory."""
    memory = torch.zeros(BLOCKS, BLOCK, HEADS, 2 * DIM, dtype=torch.bfloat16, device=device)
    return memory.permute(0, 2, 1, 3)


def _split(device: str) -> torch.Tensor:
    """FlashAttention-style [2, B, N, H, D]."""
    return torch.zeros(2, BLOCKS, BLOCK, HEADS, DIM, dtype=torch.bfloat16, device=device)


LAYOUTS = {"nhd": _nhd, "split": _split}


def _caches(layout: str, device: str) -> dict[str, torch.Tensor]:
    caches = {name: LAYOUTS[layout](device) for name in reversed(NAMES)}  # vLLM's order
    for tensor in caches.values():
        raw = torch.empty(tensor.shape, dtype=torch.int16).random_(-(1 << 15), 1 << 15)
        tensor.view(torch.int16).copy_(raw.to(device))  # any bit pattern, NaNs included
    return caches


def _block(tensor: torch.Tensor, block: int) -> torch.Tensor:
    """Block ``block`` of one layer's tensor, as raw int16 on the CPU."""
    part = tensor[:, block] if tensor.dim() == 5 else tensor[block]
    return part.view(torch.int16).cpu().clone()


def _step_save(worker: DeviceWorkerSide, saves: list[PageOp]) -> None:
    """What vLLM does in a step that computes new full blocks."""
    for name in NAMES:
        worker.save_layer(name, saves)  # save_kv_layer, after each attention layer
    worker.end_step(saves)  # wait_for_save


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "pages"


# --- the plan and the pool ---------------------------------------------------------------


def test_the_engines_device_picks_the_strategy_and_its_own_namespace(root: Path) -> None:
    device, host = _plan(root), _plan(root, device="cpu")
    assert (plan_strategy(device), plan_strategy(host)) == ("device", "host")
    assert device.config.model.endswith(DEVICE_TAG) and host.config.model.endswith(BLOCK_TAG)
    assert device.namespace != host.namespace  # their pages order bytes differently
    assert {op.value for op in device.operations} == {"load_layer", "backup_layer"}
    assert {op.value for op in host.operations} == {"load_all", "backup_all"}
    assert strategy_of([_nhd("cpu"), _split("cpu")]) == "device"
    host_blocks = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM, dtype=torch.bfloat16)
    assert strategy_of([host_blocks]) == "host"


@pytest.mark.parametrize("layout", ["nhd", "split"])
def test_the_pool_is_views_of_vllms_memory(layout: str) -> None:
    caches = _caches(layout, "cpu")
    plan = _plan(Path("/nonexistent"))
    layers = [(name, caches[name]) for name in NAMES]
    pool = VLLMPagedPool(layers, num_blocks=BLOCKS, geometry=plan.geometry)
    assert pool.num_slots == BLOCKS * BLOCK
    tensor = caches[NAMES[1]]
    k, v = pool.k_buffer(1), pool.v_buffer(1)
    assert tuple(k.shape) == (BLOCKS * BLOCK, HEADS, DIM) and k.stride(-1) == 1
    slot = 5 * BLOCK + 3  # block 5, token 3
    if layout == "split":
        want_k, want_v = tensor[0, 5, 3], tensor[1, 5, 3]
    else:
        want_k, want_v = tensor[5, :, 3, :DIM], tensor[5, :, 3, DIM:]
    assert k[slot].data_ptr() == want_k.data_ptr() and v[slot].data_ptr() == want_v.data_ptr()
    assert torch.equal(k[slot].view(torch.int16), want_k.view(torch.int16))
    k[slot].fill_(1.5)  # a load writes into vLLM's block itself
    assert bool((want_k == 1.5).all())


def test_the_pool_is_cores_device_pool_over_vllms_views() -> None:
    caches = _caches("nhd", "cpu")
    plan = _plan(Path("/nonexistent"))
    pool = VLLMPagedPool(
        [(name, caches[name]) for name in NAMES], num_blocks=BLOCKS, geometry=plan.geometry
    )
    assert isinstance(pool, BufferDevicePool) and isinstance(pool, MHADevicePool)
    assert pool.device == torch.device("cpu") and pool.geometry == plan.geometry
    assert [b.data_ptr() for b in layer_buffers(pool, 0)] == [
        pool.k_buffer(0).data_ptr(),
        pool.v_buffer(0).data_ptr(),
    ]
    with pytest.raises(TypeError, match="MLA pools"):
        pool.latent_buffer(0)


def test_a_kv_cache_of_another_layer_count_is_refused_on_either_path() -> None:
    caches = _caches("nhd", "cpu")
    plan = _plan(Path("/nonexistent"))
    layers = [(name, caches[name]) for name in NAMES][:-1]
    with pytest.raises(UnsupportedCombinationError, match="attention layers") as info:
        VLLMPagedPool(layers, num_blocks=BLOCKS, geometry=plan.geometry)
    assert info.value.value == len(layers)
    assert any("token-major" in way for way in info.value.supported)


# --- round trips, as vLLM drives the worker ---------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["nhd", "split"])
def test_blocks_round_trip_bit_exact_through_storage_layer_by_layer(
    root: Path, layout: str, device: str
) -> None:
    caches = _caches(layout, device)
    worker = _worker(root)
    worker.register(caches, INDEX, BLOCKS)
    saves = [PageOp("r", ["k0", "k1", "k2"], [1, 2, 3], 0)]
    expected = {name: [_block(caches[name], b) for b in (1, 2, 3)] for name in NAMES}
    _step_save(worker, saves)
    assert worker.flush(30)
    assert worker.finished({"r"}) == {"r"}  # device -> host copies done: blocks free
    assert worker.take_report().stored == {"k0": 1, "k1": 1, "k2": 1}
    stats = worker.stats()
    assert (stats["save_stored_pages"], stats["cache_storage_pages_written"]) == (3, 3)
    worker.close()

    # A new process on the same root: the pages come from storage, not the host pool.
    for tensor in caches.values():
        tensor.zero_()
    worker = _worker(root)
    worker.register(caches, INDEX, BLOCKS)
    worker.start_loads([PageOp("q", ["k0", "k1", "k2"], [5, 6, 7], 0)])  # start_load_kv
    worker.wait_layer(NAMES[0])
    # Layer 0 is in place before layer 0's attention. On CPU layer 1 is not loaded yet;
    # on CUDA its copy is queued behind layer 0's on the load stream, overlapping layer
    # 0's compute (the model's stream waits for layer 1 at its own wait).
    for i, block in enumerate((5, 6, 7)):
        assert torch.equal(_block(caches[NAMES[0]], block), expected[NAMES[0]][i])
        if device == "cpu":
            assert not _block(caches[NAMES[1]], block).any()
    worker.wait_layer(NAMES[1])
    for name in NAMES:
        for i, block in enumerate((5, 6, 7)):
            assert torch.equal(_block(caches[name], block), expected[name][i]), (name, block)
    assert not _block(caches[NAMES[0]], 4).any()  # neighbours untouched
    assert worker.take_load_errors() == set()
    stats = worker.stats()
    assert (stats["load_hit_pages"], stats["cache_storage_pages_read"]) == (3, 3)
    assert stats["cache_pages_loaded"] == 3
    worker.close()


def test_without_per_layer_operations_the_first_layer_loads_all_and_the_step_end_saves(
    root: Path,
) -> None:
    section = {"operations": ["load_all", "backup_all"]}
    caches = _caches("nhd", "cpu")
    worker = _worker(root, **section)
    worker.register(caches, INDEX, BLOCKS)
    saves = [PageOp("r", ["k0", "k1"], [1, 2], 0)]
    for name in NAMES:
        worker.save_layer(name, saves)
    # Nothing was copied per layer: a change made before wait_for_save is what is stored.
    caches[NAMES[1]][2].fill_(3.0)
    expected = {name: [_block(caches[name], b) for b in (1, 2)] for name in NAMES}
    worker.end_step(saves)
    assert worker.flush(30)
    assert worker.take_report().stored == {"k0": 1, "k1": 1}
    worker.close()

    for tensor in caches.values():
        tensor.zero_()
    worker = _worker(root, **section)
    worker.register(caches, INDEX, BLOCKS)
    worker.start_loads([PageOp("q", ["k0", "k1"], [4, 5], 0)])
    worker.wait_layer(NAMES[0])  # every layer, at the first layer's wait
    for name in NAMES:
        for i, block in enumerate((4, 5)):
            assert torch.equal(_block(caches[name], block), expected[name][i]), (name, block)
    assert worker.take_load_errors() == set()
    worker.close()


def test_blocks_stay_held_until_their_host_copy_is_done(root: Path) -> None:
    caches = _caches("split", "cpu")
    worker = _worker(root)
    worker.register(caches, INDEX, BLOCKS)
    saves = [PageOp("r", ["k0"], [1], 0)]
    worker.save_layer(NAMES[0], saves)
    assert worker.finished({"r"}) == set()  # layer 1 not even sent: vLLM keeps the blocks
    worker.save_layer(NAMES[1], saves)
    worker.end_step(saves)
    assert worker.flush(30)
    assert worker.finished(set()) == {"r"}  # reported once the copies are done
    assert worker.finished({"other"}) == set()  # a request without stores is not held
    worker.close()


# --- failures: vLLM recomputes ----------------------------------------------------------------


def test_a_flipped_stored_bit_is_a_load_error_and_is_counted(root: Path) -> None:
    caches = _caches("nhd", "cpu")
    worker = _worker(root)
    worker.register(caches, INDEX, BLOCKS)
    _step_save(worker, [PageOp("r", ["k0", "k1", "k2"], [1, 2, 3], 0)])
    assert worker.flush(30)
    worker.close()
    page = next(root.rglob(f"*k1{worker.suffix}*"))
    raw = bytearray(page.read_bytes())
    raw[-100] ^= 1
    page.write_bytes(bytes(raw))
    expected0 = {name: _block(caches[name], 1) for name in NAMES}

    for tensor in caches.values():
        tensor.zero_()
    worker = _worker(root)
    worker.register(caches, INDEX, BLOCKS)
    worker.start_loads([PageOp("q", ["k0", "k1", "k2"], [5, 6, 7], 0)])
    for name in NAMES:
        worker.wait_layer(name)
    # Chained keys: the page after the bad one is of no use either; both recompute ...
    assert worker.take_load_errors() == {6, 7}
    report = worker.take_report()
    # ... but only the bad one is failed (distrusted by the scheduler); k2 was never read
    assert (report.failed, report.failed_from) == ({"k1": 1}, {"q": 1})
    for name in NAMES:
        assert torch.equal(_block(caches[name], 5), expected0[name])
        assert not _block(caches[name], 6).any()  # the bad page never reached the block
    stats = worker.stats()
    assert (stats["load_pages"], stats["load_hit_pages"], stats["load_failed_pages"]) == (3, 1, 1)
    assert stats["load_skipped_pages"] == 1
    assert stats["cache_failures_total"] >= 1
    # nothing is deleted on this path (the cache gives no per-page verdict): the good k2
    # stays, and the recomputed k1 is written over the bad one
    assert page.exists() and next(root.rglob(f"*k2{worker.suffix}*")).exists()
    worker.close()


def test_a_missing_page_is_a_load_error(root: Path) -> None:
    worker = _worker(root)
    worker.register(_caches("nhd", "cpu"), INDEX, BLOCKS)
    worker.start_loads([PageOp("q", ["never-stored"], [3], 0)])
    for name in NAMES:
        worker.wait_layer(name)
    assert worker.take_load_errors() == {3}
    assert worker.take_report().failed_from == {"q": 0}
    worker.close()


# --- start-up refusals --------------------------------------------------------------------------


def test_start_up_refuses_what_neither_strategy_handles(root: Path) -> None:
    # Head-major (LBHNC, HND) blocks on an accelerator engine: CPU-strategy memory.
    hnd = {n: torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM, dtype=torch.bfloat16) for n in NAMES}
    with pytest.raises(UnsupportedCombinationError, match="follows vLLM's device") as info:
        _worker(root).register(hnd, INDEX, BLOCKS)
    assert any("LBNHC" in line for line in info.value.supported)
    # Blocks outermost (BLNHC): a layer's tokens are not evenly spaced across blocks.
    shared = torch.zeros(BLOCKS, 2, BLOCK, HEADS, 2 * DIM, dtype=torch.bfloat16)
    outer = {n: shared[:, i].permute(0, 2, 1, 3) for i, n in enumerate(NAMES)}
    with pytest.raises(UnsupportedCombinationError, match="not evenly spaced"):
        _worker(root).register(outer, INDEX, BLOCKS)
    wrong_dtype = {n: _nhd("cpu").to(torch.float16) for n in NAMES}
    with pytest.raises(UnsupportedCombinationError, match=r"holds torch\.float16"):
        _worker(root).register(wrong_dtype, INDEX, BLOCKS)
    with pytest.raises(UnsupportedCombinationError, match="1 KV cache tensors"):
        _worker(root).register({NAMES[0]: _nhd("cpu")}, INDEX, BLOCKS)
    with pytest.raises(UnsupportedCombinationError, match="take"):
        _worker(root).register({n: _nhd("cpu") for n in NAMES}, INDEX, BLOCKS + 1)
    odd = {n: torch.zeros(BLOCKS, BLOCK, HEADS * DIM, dtype=torch.bfloat16) for n in NAMES}
    with pytest.raises(UnsupportedCombinationError, match="has shape"):
        _worker(root).register(odd, INDEX, BLOCKS)


def test_start_up_refuses_operations_that_cannot_serve_vllm(root: Path) -> None:
    with pytest.raises(UnsupportedCombinationError, match="lacks a load or a backup"):
        _plan(root, operations=["backup_layer"])


def test_device_only_settings_on_the_cpu_engine_are_named_in_one_warning(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="kvtier.vllm"):
        plan = _plan(root, device="cpu", host_pages=8)
    assert plan_strategy(plan) == "host"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "kvtier.host_pages" in warnings[0]
    assert plan.config.host_pages is None  # the CPU strategy has no host pool


# --- preemption: bounded waits ----------------------------------------------------------------


def test_a_preempted_requests_copy_still_running_past_the_bound_is_dropped(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.cache.handles import BackupHandle

    caches = _caches("nhd", "cpu")
    worker = _worker(root, preempt_wait_s=0.01)
    worker.register(caches, INDEX, BLOCKS)
    # the device -> host copy has not finished when vLLM preempts the request
    monkeypatch.setattr(BackupHandle, "wait_host", lambda self, timeout=None: False)
    _step_save(worker, [PageOp("p", ["k0", "k1"], [1, 2], 0)])
    worker.preempted(["p"])  # returns at once: vLLM reuses blocks 1 and 2 now
    monkeypatch.undo()
    assert worker.flush(30)
    assert worker.take_report().stored == {}  # never reported stored ...
    stats = worker.stats()
    assert (stats["preempt_wait_timeouts"], stats["save_tainted_pages"]) == (1, 2)
    assert not list(root.rglob("*.kv"))  # ... and deleted once written
    # ... and gone from the host pool (L2) too: the copy may have read reused blocks, so
    # no later load may serve it from there (it would pass every check: mixed KV)
    assert worker.cache is not None
    with worker.cache.prefetch(worker.names(["k0", "k1"])) as handle:
        assert (handle.host_hits, handle.storage_hits) == (0, 0)
    worker.start_loads([PageOp("q", ["k0", "k1"], [5, 6], 0)])
    assert worker.take_load_errors() == {5, 6}  # vLLM recomputes both
    worker.close()


def test_a_backup_that_runs_after_the_preemption_is_dropped_from_the_host_pool(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tainted backup's job had not even started when vLLM preempted the request: its
    pages enter the host pool after the preemption, and leave it when the backup ends."""
    from kvtier.cache.handles import BackupHandle

    caches = _caches("nhd", "cpu")
    worker = _worker(root, preempt_wait_s=0.01)
    worker.register(caches, INDEX, BLOCKS)
    monkeypatch.setattr(BackupHandle, "wait_host", lambda self, timeout=None: False)
    assert worker.cache is not None
    discarded: list[list[str]] = []
    discard = worker.cache.discard
    gate_open = False

    def late_discard(keys: Any) -> int:  # the first drop runs before the job: a no-op
        discarded.append(list(keys))
        return discard(keys) if gate_open else 0

    monkeypatch.setattr(worker.cache, "discard", late_discard)
    _step_save(worker, [PageOp("p", ["k0", "k1"], [1, 2], 0)])
    worker.preempted(["p"])
    gate_open = True
    assert worker.flush(30)
    worker.take_report()  # settles the backup: dropped from host pool and storage
    monkeypatch.undo()
    assert discarded == [worker.names(["k0", "k1"])] * 2
    with worker.cache.prefetch(worker.names(["k0", "k1"])) as handle:
        assert (handle.host_hits, handle.storage_hits) == (0, 0)
    assert not list(root.rglob("*.kv"))
    worker.close()


# --- loads between steps (device_loads "async", vLLM's load_async) ----------------------------


def _until_loaded(worker: DeviceWorkerSide, req_ids: set[str]) -> tuple[set[str], set[str]]:
    """What vLLM's get_finished sees over the steps until ``req_ids``' loads ended."""
    ended: set[str] = set()
    failed: set[str] = set()
    deadline = time.monotonic() + 30
    while req_ids - ended and time.monotonic() < deadline:
        done, bad = worker.poll_loads(0.01)
        ended |= done
        failed |= bad
    return ended, failed


@pytest.mark.parametrize("device", DEVICES)
def test_async_loads_end_between_steps_with_every_byte_in_place(root: Path, device: str) -> None:
    caches = _caches("nhd", device)
    worker = _worker(root, device_loads="async")
    assert worker.async_loads
    worker.register(caches, INDEX, BLOCKS)
    _step_save(worker, [PageOp("r", ["k0", "k1", "k2"], [1, 2, 3], 0)])
    assert worker.flush(30)
    expected = {name: [_block(caches[name], b) for b in (1, 2, 3)] for name in NAMES}
    worker.close()

    for tensor in caches.values():
        tensor.zero_()
    worker = _worker(root, device_loads="async")
    worker.register(caches, INDEX, BLOCKS)
    worker.start_loads([PageOp("q", ["k0", "k1", "k2"], [5, 6, 7], 0)])
    for name in NAMES:  # this step's forward is of other requests: nothing waits for q
        worker.wait_layer(name)
    worker.end_step([])
    assert worker.loading
    assert _until_loaded(worker, {"q"}) == ({"q"}, set())
    assert not worker.loading
    if device == "cuda":
        torch.cuda.synchronize()
    for name in NAMES:
        for i, block in enumerate((5, 6, 7)):
            assert torch.equal(_block(caches[name], block), expected[name][i]), (name, block)
    assert worker.take_load_errors() == set()
    assert worker.stats()["load_hit_pages"] == 3
    assert worker.cache is not None and worker.cache.stats()["host"]["pages"]["pinned"] == 0
    worker.close()


def test_an_async_load_of_a_missing_page_ends_with_its_blocks_as_errors(root: Path) -> None:
    worker = _worker(root, device_loads="async")
    worker.register(_caches("nhd", "cpu"), INDEX, BLOCKS)
    _step_save(worker, [PageOp("r", ["k0"], [1], 0)])
    assert worker.flush(30)
    worker.start_loads([PageOp("q", ["k0", "never-stored", "k2"], [3, 4, 5], 0)])
    # one KV cache group: vLLM takes the failed blocks and recomputes from them
    assert _until_loaded(worker, {"q"}) == ({"q"}, set())
    assert worker.take_load_errors() == {4, 5}
    assert worker.take_report().failed_from == {"q": 1}
    worker.close()


def test_a_request_loading_in_two_runs_ends_with_its_last_one(root: Path) -> None:
    worker = _worker(root, device_loads="async")
    worker.register(_caches("nhd", "cpu"), INDEX, BLOCKS)
    _step_save(worker, [PageOp("r", ["k0", "k1"], [1, 2], 0)])
    assert worker.flush(30)
    worker.start_loads([PageOp("q", ["k0"], [4], 0), PageOp("q", ["k1"], [6], 1)])
    assert _until_loaded(worker, {"q"}) == ({"q"}, set())
    assert worker.stats()["load_hit_pages"] == 2
    assert worker.poll_loads() == (set(), set())  # reported once
    worker.close()


def test_the_scheduler_offers_async_loads_where_the_worker_runs_them(root: Path) -> None:
    from kvtier.integrations.vllm.scheduler import SchedulerSide

    for mode, expected in (("async", True), ("layerwise", False), ("auto", False)):
        plan = _plan(root, device_loads=mode)
        side = SchedulerSide(plan, _section(root, device_loads=mode), store=None)  # type: ignore[arg-type]
        assert side.async_loads is expected, mode
