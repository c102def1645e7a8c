"""The CUDA branches' order of events, checked on CPU with a recording stand-in for CUDA.

No GPU is at hand in CI, so the stream and event calls of the CUDA path are checked here
against a named stand-in: :class:`RecordingCuda` replaces ``torch.cuda``'s ``Event``,
``Stream``, ``current_stream`` and ``stream`` and makes :func:`kvtier.core.streams.is_cuda`
answer yes for the CPU pool. The copies themselves stay CPU copies; what is checked is
*who waits for what, on which stream, before what*: a backup's copy waits for the
model's stream and is waited for before its pages go on; a load is ordered where it is
used and waited for before its pages are unpinned; the vLLM device worker queues every
layer at the first layer and orders the model's stream per layer. ``tests/test_streams.py``
checks the same on a real GPU where one exists.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_streams import GEOMETRY, JOIN, LAYERED, backed_up, open_cache, slots

from kvtier.cache import TieredCache
from kvtier.core import io as io_module
from kvtier.core import streams as streams_module
from kvtier.integrations.vllm import device_worker as device_worker_module
from kvtier.testing.content import check_pages, fill_pages


class FakeStream:
    """A named stream: records the events it is told to wait for."""

    def __init__(self, cuda: RecordingCuda, name: str) -> None:
        self.cuda, self.name = cuda, name

    def wait_event(self, event: FakeEvent) -> None:
        self.cuda.log("wait", self.name, event.name)

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    """An event: recorded on a stream, done when the test says so (``done``)."""

    def __init__(self, cuda: RecordingCuda) -> None:
        self.cuda = cuda
        self.name = f"e{next(cuda.numbers)}"
        self.stream: str | None = None
        self.done = cuda.events_done

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.cuda.current_stream()
        self.stream = stream.name
        self.cuda.log("record", stream.name, self.name)
        self.cuda.events.append(self)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.cuda.log("sync", threading.current_thread().name, self.name)
        self.done = True


class RecordingCuda:
    """The stand-in for ``torch.cuda``'s stream API; ``calls`` lists what happened, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.events: list[FakeEvent] = []
        self.events_done = True
        self.numbers = iter(range(1_000_000))
        self._streams = 0
        self._local = threading.local()
        self._lock = threading.Lock()

    def log(self, what: str, where: str, event: str) -> None:
        with self._lock:
            self.calls.append((what, where, event))

    # --- the torch.cuda API the CUDA path calls ------------------------------------------

    def Event(self) -> FakeEvent:
        return FakeEvent(self)

    def Stream(self, device: Any = None) -> FakeStream:
        self._streams += 1
        return FakeStream(self, f"copy{self._streams}")

    def current_stream(self, device: Any = None) -> FakeStream:
        stack = getattr(self._local, "stack", None)
        if stack:
            return stack[-1]
        return FakeStream(self, "model" if threading.current_thread() is MAIN else "worker")

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(stream)
        self.log("enter", stream.name, "")
        try:
            yield
        finally:
            stack.pop()

    # --- reading the record -------------------------------------------------------------

    def index(self, what: str, where: str | None = None, event: str | None = None) -> int:
        for i, (w, s, e) in enumerate(self.calls):
            if w == what and (where is None or s == where) and (event is None or e == event):
                return i
        raise AssertionError(f"no {what} {where} {event} in {self.calls}")

    def recorded(self, stream: str) -> list[str]:
        return [e for w, s, e in self.calls if w == "record" and s == stream]


MAIN = threading.main_thread()


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> RecordingCuda:
    fake = RecordingCuda()
    for name in ("Event", "Stream", "current_stream", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    for module in (streams_module, io_module, device_worker_module):
        monkeypatch.setattr(module, "is_cuda", lambda device: True)
    return fake


@pytest.fixture
def cache(cuda: RecordingCuda) -> Iterator[TieredCache]:
    """A cache over a CPU pool that takes the CUDA branches (opened once ``cuda`` stands in)."""
    c = open_cache("cpu", operations=LAYERED)
    yield c
    c.close()


def test_a_backup_copies_after_the_models_stream_and_is_waited_for_off_its_thread(
    cuda: RecordingCuda, cache: TieredCache
) -> None:
    save = cache._ctx.save_stream.stream.name
    keys = cache.keys(list(range(12)))
    where = slots(0, len(keys))
    fill_pages(cache.device_pool, keys, where)
    before = len(cuda.calls)
    handle = cache.backup(keys, where)
    # the call itself only marked the model's stream: nothing waited on the host
    produced = cuda.calls[before]
    assert produced[:2] == ("record", "model")
    assert handle.wait(JOIN) and handle.ok, handle
    waited = cuda.index("wait", save, produced[2])  # the save stream waits for it
    copied = cuda.recorded(save)[0]
    synced = cuda.index("sync", None, copied)
    assert before < waited < cuda.index("record", save, copied) < synced
    assert cuda.calls[synced][1] != "MainThread"  # the transfer worker waited
    assert not [c for c in cuda.calls if c[0] == "sync" and c[1] == "MainThread"]


def test_unordered_loads_are_ordered_per_layer_and_waited_for_before_unpinning(
    cuda: RecordingCuda, cache: TieredCache
) -> None:
    load = cache._ctx.load_stream.stream.name
    keys = backed_up(cache, range(12))
    cache.device_pool.zero_()  # type: ignore[attr-defined]
    target = slots(40, len(keys))
    handle = cache.prefetch(keys)
    cuda.events_done = False  # the copies are "still running" from here
    start = len(cuda.calls)
    for layer in range(GEOMETRY["num_layers"]):
        assert cache.load(handle, target, layer=layer, ordered=False) == len(keys)
    fences = cuda.recorded(load)
    assert len(fences) == GEOMETRY["num_layers"]
    # each copy waits for the model's stream as it was at the call
    for fence in fences:
        assert cuda.index("record", load, fence) > start
    assert not any(w == "wait" and s == "model" for w, s, _ in cuda.calls[start:])
    assert not handle.copies_done
    handle.order(1)  # before layer 1 runs: the model's stream waits for layer 1 only
    assert cuda.calls[-1] == ("wait", "model", fences[1])
    pinned = cache.stats()["host"]["pages"]["pinned"]
    assert pinned == len(keys)
    handle.release()  # waits for every copy, then unpins
    syncs = [e for w, _, e in cuda.calls if w == "sync"]
    assert set(fences) <= set(syncs)
    assert cache.stats()["host"]["pages"]["pinned"] == 0
    assert all(check_pages(cache.device_pool, keys, target))


def test_an_ordered_load_makes_the_callers_stream_wait(
    cuda: RecordingCuda, cache: TieredCache
) -> None:
    load = cache._ctx.load_stream.stream.name
    keys = backed_up(cache, range(8))
    handle = cache.prefetch(keys)
    cache.load(handle, slots(30, len(keys)))
    fence = cuda.recorded(load)[-1]
    assert cuda.index("wait", "model", fence) > cuda.index("record", load, fence)


# --- the vLLM device worker -----------------------------------------------------------------


def _device_worker(root: Path, **section: Any) -> Any:
    import test_vllm_device_path as device_path

    worker = device_path._worker(root, **section)
    caches = device_path._caches("nhd", "cpu")
    worker.register(caches, device_path.INDEX, device_path.BLOCKS)
    return worker, caches, device_path


def test_the_device_worker_queues_every_layer_first_and_orders_each_at_its_wait(
    cuda: RecordingCuda, tmp_path: Path
) -> None:
    from kvtier.integrations.vllm.messages import PageOp

    worker, _caches, device_path = _device_worker(tmp_path / "pages")
    try:
        assert worker._queue_ahead
        device_path._step_save(worker, [PageOp("r", ["k0", "k1"], [1, 2], 0)])
        assert worker.flush(30)
        load = worker.cache._ctx.load_stream.stream.name
        cuda.events_done = False
        worker.start_loads([PageOp("q", ["k0", "k1"], [5, 6], 0)])
        worker.wait_layer(device_path.NAMES[0])
        fences = cuda.recorded(load)
        assert len(fences) == worker.positions  # every layer queued at the first wait
        assert cuda.calls[-1] == ("wait", "model", fences[0])  # ordered on layer 0 only
        worker.wait_layer(device_path.NAMES[1])
        assert cuda.calls[-1] == ("wait", "model", fences[1])
        assert not [c for c in cuda.calls if c[0] == "sync" and c[2] in fences]
        worker.end_step([])  # the step's end releases the pages once the copies are done
        assert {e for w, _, e in cuda.calls if w == "sync"} >= set(fences)
        assert worker.take_load_errors() == set()
    finally:
        worker.close()


def test_an_async_load_ends_only_once_its_copy_has(cuda: RecordingCuda, tmp_path: Path) -> None:
    from kvtier.integrations.vllm.messages import PageOp

    worker, _caches, device_path = _device_worker(tmp_path / "pages", device_loads="async")
    try:
        device_path._step_save(worker, [PageOp("r", ["k0", "k1"], [1, 2], 0)])
        assert worker.flush(30)
        cuda.events_done = False
        worker.start_loads([PageOp("q", ["k0", "k1"], [5, 6], 0)])
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:  # the copy "runs": never reported ended
            assert worker.poll_loads(0.01) == (set(), set())
        load = worker.cache._ctx.load_stream.stream.name
        fences = cuda.recorded(load)
        assert fences  # queued, on the load stream, and nothing ordered the model on it
        assert not [c for c in cuda.calls if c[0] == "wait" and c[1] == "model"]
        for event in cuda.events:
            event.done = True  # the copy ended
        assert worker.poll_loads(1.0) == ({"q"}, set())
        assert worker.stats()["load_hit_pages"] == 2
    finally:
        worker.close()
