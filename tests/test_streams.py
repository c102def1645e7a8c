"""Copy streams and fences: loads and backups that run beside the model's kernels.

The CPU tests check the contract every device keeps (a copy off CUDA is over when the
call returns; ``ordered=False`` leaves the handle pinned until it is released). The CUDA
tests check what only a GPU shows: copies queued on the cache's streams wait for the
kernels that wrote their source, the caller's stream waits for a load only where told,
and nothing on the hot path synchronises the device.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvtier.cache import TieredCache
from kvtier.core.config import load_engine_config
from kvtier.core.device_pool import TorchDevicePool
from kvtier.core.host_pool import HostPool
from kvtier.core.io import DIRECT_SPEC, KERNEL_SPEC
from kvtier.core.layout import Layout
from kvtier.core.streams import PASSED, CopyStream, Fence, current_fence
from kvtier.plugins.manager import load_registry
from kvtier.testing.content import check_pages, fill_pages

JOIN = 20.0
GEOMETRY: dict[str, Any] = {
    "num_layers": 3,
    "num_kv_heads": 2,
    "head_dim": 16,
    "dtype": "bfloat16",
    "page_size": 4,
}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
LAYERED = ["backup_all", "load_all", "load_layer", "backup_layer"]


def open_cache(device: str, **config: Any) -> TieredCache:
    settings = {"backend": "memory", **GEOMETRY, "host_pages": 64, **config}
    engine = load_engine_config(settings)
    pool = TorchDevicePool(engine.geometry(), 512, device)
    return TieredCache.open(engine, pool, registry=load_registry())


@pytest.fixture(params=DEVICES)
def cache(request: pytest.FixtureRequest) -> Iterator[TieredCache]:
    c = open_cache(request.param, operations=LAYERED)
    yield c
    c.close()


def slots(start: int, pages: int, ps: int = 4) -> torch.Tensor:
    return torch.arange(start * ps, (start + pages) * ps, dtype=torch.int64)


def backed_up(cache: TieredCache, tokens: range, start: int = 0) -> list[str]:
    keys = cache.keys(list(tokens))
    where = slots(start, len(keys))
    fill_pages(cache.device_pool, keys, where)
    handle = cache.backup(keys, where)
    assert handle.wait(JOIN) and handle.ok, handle
    return keys


# --- every device ---------------------------------------------------------------------


def test_off_cuda_streams_run_on_the_calling_thread_and_fences_have_passed() -> None:
    stream = CopyStream("cpu")
    assert stream.stream is None
    with stream.active(after=PASSED):
        pass
    fence = stream.fence()
    assert fence is PASSED and fence.passed
    fence.synchronize()  # returns at once
    fence.order()
    assert current_fence("cpu") is PASSED


@pytest.mark.parametrize("spec", [DIRECT_SPEC, KERNEL_SPEC], ids=lambda s: s.name)
def test_io_backend_calls_return_a_fence(spec: Any) -> None:
    engine = load_engine_config({"backend": "memory", **GEOMETRY})
    g = engine.geometry()
    io = spec.factory(None, g, Layout.LAYER_FIRST)
    device = TorchDevicePool(g, 64).fill_random_(torch.Generator().manual_seed(1))
    host = HostPool(g, Layout.LAYER_FIRST, num_pages=8)
    assert isinstance(io.backup(device, host, slots(2, 3), [0, 1, 2]), Fence)
    before = [t.clone() for t in device.kv_tensors]
    device.zero_()
    fence = io.load(host, device, [0, 1, 2], slots(2, 3), stream=CopyStream("cpu"))
    assert fence.passed  # off CUDA, done when the call returns
    for a, b in zip(before, device.kv_tensors, strict=True):
        assert torch.equal(a[:, 8:20].view(torch.uint8), b[:, 8:20].view(torch.uint8))


def test_unordered_loads_keep_the_handle_pinned_until_released(cache: TieredCache) -> None:
    keys = backed_up(cache, range(20))
    cache.device_pool.zero_()  # type: ignore[attr-defined]
    where = slots(40, len(keys))
    handle = cache.prefetch(keys)
    for layer in range(cache.geometry.num_layers):
        assert cache.load(handle, where, layer=layer, ordered=False) == len(keys)
    assert cache.stats()["host"]["pages"]["pinned"] == len(keys)  # not released yet
    for layer in range(cache.geometry.num_layers):
        handle.order(layer)
    assert all(check_pages(cache.device_pool, keys, where))
    handle.release()
    assert cache.stats()["host"]["pages"]["pinned"] == 0


def test_ordered_loads_release_after_the_last_layer(cache: TieredCache) -> None:
    keys = backed_up(cache, range(12))
    cache.device_pool.zero_()  # type: ignore[attr-defined]
    where = slots(30, len(keys))
    handle = cache.prefetch(keys)
    for layer in range(cache.geometry.num_layers):
        cache.load(handle, where, layer=layer)
    assert cache.stats()["host"]["pages"]["pinned"] == 0
    assert all(check_pages(cache.device_pool, keys, where))


# --- CUDA only -----------------------------------------------------------------------


@CUDA
def test_cuda_host_pool_is_pinned_and_streams_are_not_the_current_one() -> None:
    c = open_cache("cuda", operations=LAYERED)
    try:
        assert c.host_pool.pin_memory
        current = torch.cuda.current_stream()
        assert c._ctx.load_stream.stream != current
        assert c._ctx.save_stream.stream != c._ctx.load_stream.stream
    finally:
        c.close()


@CUDA
def test_a_backup_waits_for_the_kernels_that_wrote_its_pages() -> None:
    """The save stream must start after the model's stream: a backup queued right after
    slow kernels that write the pages still copies their final values."""
    c = open_cache("cuda", operations=LAYERED)
    try:
        keys = c.keys(list(range(16)))
        where = slots(0, len(keys))
        pool = c.device_pool
        assert isinstance(pool, TorchDevicePool)
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(8):  # keep the model's stream busy for a while
            big = big @ big
            big = big / big.norm()
        for tensor in pool.kv_tensors:  # written last, on the model's stream
            tensor[:, : where.numel()].view(torch.uint8).fill_(0x5A)
        handle = c.backup(keys, where)
        assert handle.wait(JOIN) and handle.ok, handle
        for tensor in pool.kv_tensors:
            tensor.view(torch.uint8).zero_()
        torch.cuda.synchronize()
        assert c.load(keys, slots(50, len(keys))) == len(keys)
        torch.cuda.synchronize()
        for tensor in pool.kv_tensors:
            loaded = tensor[:, 200 : 200 + where.numel()].view(torch.uint8)
            assert bool((loaded == 0x5A).all())
    finally:
        c.close()


@CUDA
def test_per_layer_loads_are_ordered_only_where_told() -> None:
    c = open_cache("cuda", operations=LAYERED)
    try:
        keys = backed_up(c, range(24))
        c.device_pool.zero_()  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        where = slots(60, len(keys))
        handle = c.prefetch(keys)
        handle.wait(JOIN)
        with _no_sync():
            for layer in range(c.geometry.num_layers):
                c.load(handle, where, layer=layer, ordered=False)
            for layer in range(c.geometry.num_layers):
                handle.order(layer)
        torch.cuda.current_stream().synchronize()
        assert all(check_pages(c.device_pool, keys, where))
        handle.release()
        assert c.stats()["host"]["pages"]["pinned"] == 0
    finally:
        c.close()


@CUDA
@pytest.mark.parametrize("spec", [DIRECT_SPEC, KERNEL_SPEC], ids=lambda s: s.name)
@pytest.mark.parametrize("layout", list(Layout), ids=lambda lay: lay.value)
def test_cuda_copies_on_a_stream_round_trip_scattered_pages(spec: Any, layout: Layout) -> None:
    engine = load_engine_config({"backend": "memory", **GEOMETRY})
    g = engine.geometry()
    io = spec.factory(None, g, layout)
    gen = torch.Generator().manual_seed(5)
    source = TorchDevicePool(g, 256, "cuda").fill_random_(gen)
    target = TorchDevicePool(g, 256, "cuda")
    host = HostPool(g, layout, num_pages=16)
    assert host.pin_memory
    device_pages = [9, 2, 30, 31, 32, 7, 11]  # a block table: scattered, with one run
    src = torch.cat([slots(p, 1) for p in device_pages])
    dst = torch.cat([slots(p, 1) for p in reversed(device_pages)])
    host_pages = [3, 4, 5, 0, 1, 12, 13]
    save, load = CopyStream("cuda"), CopyStream("cuda")
    with _no_sync():
        copied = io.backup(source, host, src, host_pages, stream=save)
    copied.synchronize()
    with _no_sync():
        fence = io.load(host, target, host_pages, dst, stream=load)
    fence.order()
    torch.cuda.current_stream().synchronize()
    for a, b in zip(source.kv_tensors, target.kv_tensors, strict=True):
        raw_a, raw_b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(raw_a[:, src.cuda()], raw_b[:, dst.cuda()])


class _no_sync:
    """Fail on any operation that synchronises the device (torch's sync debug mode)."""

    def __enter__(self) -> None:
        self._before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_sync_debug_mode(self._before)
