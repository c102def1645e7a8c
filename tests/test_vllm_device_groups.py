"""The vLLM connector's device path for MLA and hybrid (several KV cache groups) models:
vLLM's accelerator KV tensors of those models as kvtier's device pool, driven with the
calls vLLM makes per step.

No vLLM import. The tensors are CPU tensors in the accelerator layouts (and CUDA tensors
where a GPU exists); plans are resolved from stand-ins of vLLM's config objects for an
engine whose device is ``cuda``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_vllm_device_path import BLOCK, DEVICES, DIM, HEADS, FullAttentionSpec

from kvtier.core.device_pool import MLADevicePool
from kvtier.core.errors import InvalidFieldError, UnsupportedCombinationError
from kvtier.integrations.vllm.device_worker import DeviceWorkerSide
from kvtier.integrations.vllm.messages import PageOp
from kvtier.integrations.vllm.plan import kv_groups, resolve_plan
from kvtier.integrations.vllm.settings import VLLMSection
from kvtier.plugins.manager import default_registry

BLOCKS = 12
RANK, ROPE = 64, 32  # a small MLA latent: kv_lora_rank + qk_rope_head_dim
LATENT = RANK + ROPE


@dataclass
class SlidingWindowSpec:
    """The fields of vLLM's SlidingWindowSpec the plan reads (same class name)."""

    block_size: int = BLOCK
    num_kv_heads: int = HEADS
    head_size: int = DIM
    dtype: torch.dtype = torch.bfloat16
    sliding_window: int = 64
    head_size_v: int | None = None


@dataclass
class MLAAttentionSpec:
    """The fields of vLLM's MLAAttentionSpec the plan reads (same class name)."""

    block_size: int = BLOCK
    num_kv_heads: int = 1
    head_size: int = LATENT
    dtype: torch.dtype = torch.bfloat16
    head_size_v: int | None = 0


def _vllm_config(tp: int = 1) -> Any:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_load_failure_policy="recompute"),
        model_config=SimpleNamespace(
            use_mla=False,
            model="tiny",
            revision="r1",
            hf_config=SimpleNamespace(kv_lora_rank=RANK),
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        device_config=SimpleNamespace(device_type="cuda"),
    )


def _section(root: Path, **section: Any) -> VLLMSection:
    return VLLMSection.model_validate(
        {"backend": "file", "extra_config": {"root": str(root)}, **section}
    )


def _groups_config(*groups: tuple[Any, list[str]]) -> Any:
    return SimpleNamespace(
        num_blocks=BLOCKS,
        kv_cache_groups=[
            SimpleNamespace(kv_cache_spec=spec, layer_names=names) for spec, names in groups
        ],
    )


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """Fill ``tensor`` with any bit pattern (NaNs included); compare raw."""
    bits = torch.empty(tensor.shape, dtype=torch.int16).random_(-(1 << 15), 1 << 15)
    tensor.view(torch.int16).copy_(bits.to(tensor.device))
    return tensor


def _bits(part: torch.Tensor) -> torch.Tensor:
    return part.view(torch.int16).cpu().clone()


# --- MLA -----------------------------------------------------------------------------------

MLA_NAMES = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
MLA_INDEX = {name: i for i, name in enumerate(MLA_NAMES)}


def _mla_config() -> Any:
    return _groups_config((MLAAttentionSpec(), list(MLA_NAMES)))


def _mla_worker(root: Path, rank: int, tp: int = 2, **section: Any) -> DeviceWorkerSide:
    settings = _section(root, **section)
    plan = resolve_plan(_vllm_config(tp), _mla_config(), settings, default_registry(), tp_rank=rank)
    return DeviceWorkerSide(plan, settings)


def _mla_caches(device: str) -> dict[str, torch.Tensor]:
    """vLLM's accelerator MLA KV cache: per layer [num_blocks, block_size, latent]."""
    return {
        name: _raw(torch.zeros(BLOCKS, BLOCK, LATENT, dtype=torch.bfloat16, device=device))
        for name in reversed(MLA_NAMES)  # vLLM's order, not the model's
    }


def _step(worker: DeviceWorkerSide, names: list[str], saves: list[PageOp]) -> None:
    """What vLLM does in a step that computes new full blocks."""
    for name in names:
        worker.save_layer(name, saves)  # save_kv_layer, after each attention layer
    worker.end_step(saves)  # wait_for_save


def _load(
    worker: DeviceWorkerSide, names: list[str], loads: list[PageOp]
) -> tuple[set[str], set[str]]:
    """What vLLM does in the steps that load hits: in the step, layer by layer; or, for
    asynchronous loads (hybrid models), over steps until the requests' loads ended.
    Returns the requests that ended and those failed per request (asynchronous only)."""
    worker.start_loads(loads)  # start_load_kv
    for name in names:  # a forward: of these requests, or (asynchronous) of others
        worker.wait_layer(name)  # wait_for_layer_load, before each attention layer
    if not worker.async_loads:
        return set(), set()
    waiting = {op.req_id for op in loads}
    ended: set[str] = set()
    failed: set[str] = set()
    deadline = time.monotonic() + 30
    while waiting - ended and time.monotonic() < deadline:
        done, bad = worker.poll_loads(0.01)  # get_finished's finished_recving, failed_recving
        ended |= done
        failed |= bad
    assert ended == waiting, "the asynchronous loads did not end in time"
    return ended, failed


@pytest.mark.parametrize("device", DEVICES)
def test_the_mla_pool_is_a_latent_view_of_vllms_memory(tmp_path: Path, device: str) -> None:
    caches = _mla_caches(device)
    worker = _mla_worker(tmp_path / "pages", 0)
    assert worker.plan.geometry.attention.value == "mla"
    assert worker.plan.geometry.head_dim == LATENT
    worker.register(caches, MLA_INDEX, BLOCKS)
    pool = worker.pool
    assert isinstance(pool, MLADevicePool)
    latent = pool.latent_buffer(1)
    assert tuple(latent.shape) == (BLOCKS * BLOCK, 1, LATENT)
    slot = 5 * BLOCK + 3  # block 5, token 3
    assert latent[slot, 0].data_ptr() == caches[MLA_NAMES[1]][5, 3].data_ptr()
    with pytest.raises(TypeError, match="MHA pools"):
        pool.k_buffer(0)
    worker.close()


@pytest.mark.parametrize("device", DEVICES)
def test_mla_pages_round_trip_bit_exact_written_by_rank_0_and_loaded_by_rank_1(
    tmp_path: Path, device: str
) -> None:
    root = tmp_path / "pages"
    writer, reader = _mla_worker(root, 0), _mla_worker(root, 1)
    assert writer.suffix == reader.suffix == ""  # one key on every rank
    mine, theirs = _mla_caches(device), _mla_caches(device)  # rank 1's bytes differ here
    writer.register(mine, MLA_INDEX, BLOCKS)
    reader.register(theirs, MLA_INDEX, BLOCKS)
    expected = {name: [_bits(mine[name][b]) for b in (1, 2, 3)] for name in MLA_NAMES}
    saves = [PageOp("r", ["m0", "m1", "m2"], [1, 2, 3], 0)]
    for worker in (writer, reader):  # every rank gets the same step's work
        _step(worker, MLA_NAMES, saves)
        assert worker.flush(30)
        assert worker.finished({"r"}) == {"r"}  # host copies done: vLLM frees the blocks
    assert writer.take_report().stored == {"m0": 1, "m1": 1, "m2": 1}
    assert reader.take_report().stored == {}  # rank 0 reports the shared pages
    w, r = writer.stats(), reader.stats()
    assert (w["save_stored_pages"], w["cache_storage_pages_written"]) == (3, 3)
    assert (r["save_skipped_not_writer"], r["cache_storage_pages_written"]) == (3, 0)
    assert r["save_stored_pages"] == 0
    assert len(list(root.rglob("*.kv"))) == 3  # rank 0's pages only
    writer.close()
    reader.close()

    # Both ranks in new processes, their blocks zeroed: every page comes from storage,
    # rank 0's bytes, on either rank.
    for rank in (0, 1):
        caches = _mla_caches(device)
        for tensor in caches.values():
            tensor.zero_()
        worker = _mla_worker(root, rank)
        worker.register(caches, MLA_INDEX, BLOCKS)
        worker.start_loads([PageOp("q", ["m0", "m1", "m2"], [7, 8, 9], 0)])
        worker.wait_layer(MLA_NAMES[0])
        for i, block in enumerate((7, 8, 9)):  # layer 0 in place; layer 1 not yet
            assert torch.equal(_bits(caches[MLA_NAMES[0]][block]), expected[MLA_NAMES[0]][i])
            assert not _bits(caches[MLA_NAMES[1]][block]).any()
        worker.wait_layer(MLA_NAMES[1])
        for name in MLA_NAMES:
            for i, block in enumerate((7, 8, 9)):
                assert torch.equal(_bits(caches[name][block]), expected[name][i]), (rank, name)
            assert not _bits(caches[name][6]).any()  # neighbours untouched
        assert worker.take_load_errors() == set()
        stats = worker.stats()
        assert (stats["load_hit_pages"], stats["cache_storage_pages_read"]) == (3, 3)
        worker.close()


def test_a_tainted_mla_reader_deletes_nothing_from_the_shared_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader rank's preempted copy is dropped from its host pool only: the pages in
    storage are rank 0's, which another rank's preemption must not delete."""
    from kvtier.cache.handles import BackupHandle

    root = tmp_path / "pages"
    writer, reader = _mla_worker(root, 0), _mla_worker(root, 1, preempt_wait_s=0.01)
    writer.register(_mla_caches("cpu"), MLA_INDEX, BLOCKS)
    reader.register(_mla_caches("cpu"), MLA_INDEX, BLOCKS)
    saves = [PageOp("p", ["m0", "m1"], [1, 2], 0)]
    _step(writer, MLA_NAMES, saves)
    assert writer.flush(30) and writer.take_report().stored == {"m0": 1, "m1": 1}
    monkeypatch.setattr(BackupHandle, "wait_host", lambda self, timeout=None: False)
    _step(reader, MLA_NAMES, saves)
    reader.preempted(["p"])
    monkeypatch.undo()
    assert reader.flush(30)
    assert reader.take_report().stored == {}
    assert reader.stats()["save_tainted_pages"] == 2
    assert len(list(root.rglob("*.kv"))) == 2  # rank 0's pages stay
    reader.close()
    writer.close()


# --- hybrid: a sliding-window and a full-attention group ------------------------------------

#: Model order: sliding, full, sliding, full; each pair shares one position (one tensor).
HYBRID_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
HYBRID_INDEX = {name: i for i, name in enumerate(HYBRID_NAMES)}
SLIDING, FULL = HYBRID_NAMES[0::2], HYBRID_NAMES[1::2]


def _hybrid_config() -> Any:
    return _groups_config((SlidingWindowSpec(), list(SLIDING)), (FullAttentionSpec(), list(FULL)))


def _hybrid_worker(root: Path, **section: Any) -> DeviceWorkerSide:
    settings = _section(root, **section)
    config = _hybrid_config()
    plan = resolve_plan(_vllm_config(), config, settings, default_registry(), tp_rank=0)
    groups = kv_groups(config)
    return DeviceWorkerSide(plan, settings, groups=len(groups), kv_groups=groups)


def _hybrid_caches(device: str) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """vLLM 0.32's per-layer [B, H, N, 2D] views over token-major memory; the two groups'
    layers at one position are views of the same memory (the hybrid allocator)."""
    memories = [
        _raw(torch.zeros(BLOCKS, BLOCK, HEADS, 2 * DIM, dtype=torch.bfloat16, device=device))
        for _ in range(2)
    ]
    caches = {name: memories[i // 2].permute(0, 2, 1, 3) for i, name in enumerate(HYBRID_NAMES)}
    return dict(reversed(caches.items())), memories


def _saves() -> list[PageOp]:
    return [
        PageOp("r", ["s0", "s1"], [1, 2], 0, 0, stage=True),  # sliding window: volatile
        PageOp("r", ["f0", "f1"], [3, 4], 0, 1),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_hybrid_pages_of_both_groups_round_trip_under_their_own_keys(
    tmp_path: Path, device: str
) -> None:
    root = tmp_path / "pages"
    caches, memories = _hybrid_caches(device)
    worker = _hybrid_worker(root)
    worker.register(caches, HYBRID_INDEX, BLOCKS)
    assert worker.positions == 2  # four layers, two positions
    assert worker.pool is not None and worker.pool.k_buffer(1).data_ptr() == memories[1].data_ptr()
    saves = _saves()
    worker.save_layer(HYBRID_NAMES[0], saves)  # the sliding layer at position 0 ran
    assert worker.cache is not None and worker.cache.flush(30)
    # ... then the full layer at position 0 writes its blocks' KV there: what a backup at
    # the sliding layer's call would have missed
    _raw(memories[0][3])
    for name in HYBRID_NAMES[1:]:
        worker.save_layer(name, saves)
    expected = {b: [_bits(memory[b]) for memory in memories] for b in (1, 2, 3, 4)}
    worker.end_step(saves)
    assert worker.flush(30)
    assert worker.finished({"r"}) == {"r"}
    assert worker.take_report().stored == {"s0": 1, "s1": 1, "f0": 1, "f1": 1}
    for key in ("s0", "s1", "f0", "f1"):
        assert len(list(root.rglob(f"*{key}*"))) == 1, key
    worker.close()

    caches, memories = _hybrid_caches(device)
    for memory in memories:
        memory.zero_()
    worker = _hybrid_worker(root)
    worker.register(caches, HYBRID_INDEX, BLOCKS)
    loads = [PageOp("q", ["s0", "s1"], [5, 6], 0, 0), PageOp("q", ["f0", "f1"], [7, 8], 0, 1)]
    assert worker.async_loads  # device_loads "auto": a hybrid model loads between steps
    assert _load(worker, HYBRID_NAMES, loads) == ({"q"}, set())
    for source, target in ((1, 5), (2, 6), (3, 7), (4, 8)):
        for position in (0, 1):
            got = _bits(memories[position][target])
            assert torch.equal(got, expected[source][position]), (target, position)
    assert worker.take_load_errors() == set()
    assert worker.take_report().failed == {}
    worker.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_sliding_window_save_is_host_copied_when_the_step_ends(
    tmp_path: Path, device: str
) -> None:
    root = tmp_path / "pages"
    caches, memories = _hybrid_caches(device)
    worker = _hybrid_worker(root, operations=["load_all", "backup_all"])
    worker.register(caches, HYBRID_INDEX, BLOCKS)
    expected = {b: [_bits(memory[b]) for memory in memories] for b in (1, 2)}
    saves = _saves()
    _step(worker, HYBRID_NAMES, saves)
    records = worker._in_flight["r"]
    assert [r.host_done() for r in records if r.op.stage] == [True]  # before returning
    for memory in memories:  # vLLM frees the window's blocks and reuses them at once
        memory[1:3].zero_()
    assert worker.flush(30)
    assert worker.take_report().stored == {"s0": 1, "s1": 1, "f0": 1, "f1": 1}
    worker.close()

    caches, memories = _hybrid_caches(device)
    worker = _hybrid_worker(root, operations=["load_all", "backup_all"])
    worker.register(caches, HYBRID_INDEX, BLOCKS)
    _load(worker, HYBRID_NAMES, [PageOp("q", ["s0", "s1"], [9, 10], 0, 0)])
    assert worker.take_load_errors() == set()
    for source, target in ((1, 9), (2, 10)):
        for position in (0, 1):
            got = _bits(memories[position][target])
            assert torch.equal(got, expected[source][position]), (target, position)
    worker.close()


def test_a_sliding_window_copy_late_at_the_step_end_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.cache.handles import BackupHandle

    root = tmp_path / "pages"
    caches, _ = _hybrid_caches("cpu")
    worker = _hybrid_worker(root, preempt_wait_s=0.01)
    worker.register(caches, HYBRID_INDEX, BLOCKS)
    monkeypatch.setattr(BackupHandle, "wait_host", lambda self, timeout=None: False)
    _step(worker, HYBRID_NAMES, _saves())  # returns once the bound passed
    monkeypatch.undo()
    assert worker.flush(30)
    # the window's pages may have been read from reused blocks: never reported, deleted
    assert worker.take_report().stored == {"f0": 1, "f1": 1}
    stats = worker.stats()
    assert stats["save_tainted_pages"] == 2 and stats["save_stored_pages"] == 2
    assert not list(root.rglob("*s0*")) and not list(root.rglob("*s1*"))
    assert worker.cache is not None
    with worker.cache.prefetch(worker.names(["s0", "s1"])) as handle:
        assert (handle.host_hits, handle.storage_hits) == (0, 0)
    worker.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_failed_load_of_one_group_is_reported_per_request(tmp_path: Path, device: str) -> None:
    root = tmp_path / "pages"
    caches, memories = _hybrid_caches(device)
    worker = _hybrid_worker(root)
    worker.register(caches, HYBRID_INDEX, BLOCKS)
    _step(worker, HYBRID_NAMES, [PageOp("r", ["s0"], [1], 0, 0, stage=True)])
    assert worker.flush(30)
    worker.take_report()
    expected = [_bits(memory[1]) for memory in memories]

    loads = [PageOp("q", ["s0"], [5], 0, 0), PageOp("q", ["f0", "f1"], [6, 7], 0, 1)]
    # vLLM takes no block errors with several groups: the request fails as a whole (vLLM
    # recomputes it), and the scheduler learns its first failed page
    assert _load(worker, HYBRID_NAMES, loads) == ({"q"}, {"q"})
    assert worker.take_load_errors() == set()
    report = worker.take_report()
    assert (report.failed, report.failed_from) == ({"f0": 1}, {"q": 0})
    for position in (0, 1):  # the other group's page loaded
        assert torch.equal(_bits(memories[position][5]), expected[position])
    stats = worker.stats()
    assert (stats["load_failed_requests"], stats["load_failed_pages"]) == (1, 1)
    assert stats["load_skipped_pages"] == 1
    worker.close()


def test_hybrid_models_refuse_in_step_loads(tmp_path: Path) -> None:
    """In the step, vLLM cannot be told a hybrid model's load failed: refused at start-up."""
    with pytest.raises(InvalidFieldError, match=r"device_loads.*'async' or 'auto'"):
        _hybrid_worker(tmp_path / "pages", device_loads="layerwise")
    assert _hybrid_worker(tmp_path / "pages", device_loads="async").async_loads


# --- what is still refused -------------------------------------------------------------------


def test_what_the_device_path_still_refuses_names_what_works(tmp_path: Path) -> None:
    root = tmp_path / "pages"
    settings = _section(root)
    mla = resolve_plan(_vllm_config(), _mla_config(), settings, default_registry(), tp_rank=0)
    # MLA beside other groups (or a sliding-window MLA): one group of MLA is stored
    with pytest.raises(UnsupportedCombinationError, match="one group of MLA") as info:
        DeviceWorkerSide(mla, settings, groups=2)
    assert any("MLA backends" in way for way in info.value.supported)
    # groups of different head shapes: no one page geometry
    mixed = _groups_config(
        (SlidingWindowSpec(head_size=2 * DIM), list(SLIDING)), (FullAttentionSpec(), list(FULL))
    )
    with pytest.raises(UnsupportedCombinationError, match="differ in heads"):
        resolve_plan(_vllm_config(), mixed, settings, default_registry(), tp_rank=0)
    # an MLA cache that is not one latent per token
    worker = DeviceWorkerSide(mla, settings)
    odd = {n: torch.zeros(BLOCKS, BLOCK, LATENT + 8, dtype=torch.bfloat16) for n in MLA_NAMES}
    with pytest.raises(UnsupportedCombinationError, match="MLA layer") as info:
        worker.register(odd, MLA_INDEX, BLOCKS)
    assert info.value.value == (BLOCKS, BLOCK, LATENT + 8)
    # groups that do not match the count vLLM gave
    hybrid = resolve_plan(_vllm_config(), _hybrid_config(), settings, default_registry(), tp_rank=0)
    with pytest.raises(UnsupportedCombinationError, match="1 KV cache groups given"):
        DeviceWorkerSide(hybrid, settings, groups=2, kv_groups=kv_groups(_hybrid_config())[:1])
