"""The kit itself: it fails broken backends, skips only undeclared features; FaultyBackend."""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import pkgutil
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import kvtier.testing
import kvtier.testing.kit
from kvtier.backends.memory import MemoryConfig
from kvtier.backends.memory.backend import MemoryBackend
from kvtier.core.errors import InvalidFieldError
from kvtier.core.extents import extent_of_view
from kvtier.core.specs import ALL_ATTENTION, ALL_LAYOUTS, ALL_OPERATIONS, BackendSpec, Feature
from kvtier.core.storage import PageBuffers, StorageBackend
from kvtier.testing import (
    CascadeCancelTests,
    ConcurrencyTests,
    DeleteClearTests,
    FaultyBackend,
    FullDiskTests,
    InjectedFault,
    IntegrityTests,
    KillInFlightTests,
    KillMidWriteTests,
    KitEnv,
    LateCallTests,
    PersistenceTests,
    RoundTripTests,
    SecondInstanceTests,
    SharedProcessesTests,
    faults,
)
from kvtier.testing.kit.harness import load_kit_registry


def env_for(
    tmp_path: Path, factory: Callable[..., Any], features: frozenset[Feature] = frozenset()
) -> KitEnv:
    spec = BackendSpec(
        name="broken",
        factory=factory,
        config_model=MemoryConfig,
        layouts=ALL_LAYOUTS,
        attention=ALL_ATTENTION,
        operations=ALL_OPERATIONS,
        features=features,
    )
    return KitEnv(spec, {}, (), tmp_path)


@pytest.fixture
def closing() -> Iterator[list[KitEnv]]:
    envs: list[KitEnv] = []
    yield envs
    for env in envs:
        env.close_all()


class LyingGet(MemoryBackend):
    """Says a get succeeded without filling anything."""

    def get(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        return [key in self._pages for key in keys]


class TornPut(MemoryBackend):
    """Overwrites a stored page region by region, in place: readers can see a mix."""

    def put(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        for key, page in zip(keys, pages, strict=True):
            size = sum(e.length for e in page)
            with self._lock:
                blob = self._pages.setdefault(key, bytearray(size))
            offset = 0
            for extent in page:
                blob[offset : offset + extent.length] = extent.view
                offset += extent.length
                time.sleep(0.0005)
        return [True] * len(keys)


class ForgetfulClear(MemoryBackend):
    """``clear`` that does nothing."""

    def clear(self) -> None:
        pass


def test_kit_fails_a_backend_that_lies_about_gets(tmp_path: Path, closing: list[KitEnv]) -> None:
    env = env_for(tmp_path, lambda config, context: LyingGet(config, context))
    closing.append(env)
    with pytest.raises(AssertionError):
        RoundTripTests().test_kit_round_trip(env)


def test_kit_fails_a_backend_with_torn_puts(tmp_path: Path, closing: list[KitEnv]) -> None:
    env = env_for(tmp_path, lambda config, context: TornPut(config, context))
    closing.append(env)
    with pytest.raises(AssertionError, match="torn"):
        ConcurrencyTests().test_kit_readers_never_see_torn_pages(env)


def test_kit_fails_a_clear_that_keeps_pages(tmp_path: Path, closing: list[KitEnv]) -> None:
    env = env_for(tmp_path, lambda config, context: ForgetfulClear(config, context))
    closing.append(env)
    with pytest.raises(AssertionError):
        DeleteClearTests().test_kit_clear(env)


def test_kit_fails_a_false_persistence_claim(tmp_path: Path, closing: list[KitEnv]) -> None:
    env = env_for(tmp_path, MemoryBackend, frozenset({Feature.PERSISTENT}))
    closing.append(env)
    with pytest.raises(AssertionError):
        PersistenceTests().test_kit_survives_reopen(env)


def test_kit_skips_only_undeclared_features(tmp_path: Path, closing: list[KitEnv]) -> None:
    env = env_for(tmp_path, MemoryBackend)
    closing.append(env)
    with pytest.raises(pytest.skip.Exception, match="persistent"):
        PersistenceTests().test_kit_survives_reopen(env)
    with pytest.raises(pytest.skip.Exception, match="shared_processes"):
        SharedProcessesTests().test_kit_pages_from_another_process(env)
    IntegrityTests().test_kit_truncated_pages_are_misses(env)  # no feature needed: runs


def test_kit_rejects_a_factory_that_builds_no_backend(
    tmp_path: Path, closing: list[KitEnv]
) -> None:
    env = env_for(tmp_path, lambda config, context: object())
    closing.append(env)
    with pytest.raises(AssertionError, match=r"not a kvtier\.StorageBackend"):
        env.open()


# --- the kit's layout -----------------------------------------------------------------

KIT_MODULES = sorted(
    f"kvtier.testing.kit.{info.name}" for info in pkgutil.iter_modules(kvtier.testing.kit.__path__)
)


def test_the_kit_has_the_same_face_from_both_doors() -> None:
    kit_names = set(kvtier.testing.kit.__all__) - {"default_geometry"}
    assert kit_names <= set(kvtier.testing.__all__)
    for name in kvtier.testing.kit.__all__:  # defined in a module of the kit, not its face
        assert getattr(kvtier.testing.kit, name).__module__ in KIT_MODULES, name
    for name in kit_names:
        assert getattr(kvtier.testing, name) is getattr(kvtier.testing.kit, name)


@pytest.mark.parametrize("module", KIT_MODULES)
def test_every_kit_module_gets_assertion_rewriting(
    module: str, request: pytest.FixtureRequest
) -> None:
    if request.config.getoption("assertmode") != "rewrite":
        pytest.skip("pytest runs with --assert=plain")
    from _pytest.assertion.rewrite import AssertionRewritingHook

    loaded = importlib.import_module(module)
    assert isinstance(loaded.__loader__, AssertionRewritingHook), module


def test_the_child_side_of_the_shared_processes_test_imports_by_its_path() -> None:
    code = "from kvtier.testing.kit.shared_processes import _child_put; print(_child_put.__doc__)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "SharedProcessesTests" in done.stdout


# --- FaultyBackend --------------------------------------------------------------------


def page(fill: int, size: int = 4096, regions: int = 2) -> list[Any]:
    return [extent_of_view(memoryview(bytearray([fill]) * size)) for _ in range(regions)]


def flat(p: list[Any]) -> bytes:
    return b"".join(bytes(e.view) for e in p)


def test_faulty_rates_are_checked() -> None:
    with pytest.raises(InvalidFieldError, match="fail_rate"):
        FaultyBackend(MemoryBackend(), fail_rate=1.5)
    with pytest.raises(InvalidFieldError, match="delay"):
        FaultyBackend(MemoryBackend(), delay=-1)
    with pytest.raises(InvalidFieldError, match="flip_in"):
        FaultyBackend(MemoryBackend(), flip_in="middle")  # type: ignore[arg-type]


def test_faulty_passes_through_when_quiet() -> None:
    faulty = FaultyBackend(MemoryBackend())
    assert faulty.put(["a"], [page(1)]) == [True]
    out = page(0)
    assert faulty.get(["a"], [out]) == [True] and flat(out) == flat(page(1))
    assert faulty.exists(["a", "b"]) == [True, False]
    assert faulty.delete(["a"]) == [True]
    assert faulty.injected == {}


def test_faulty_flips_exactly_one_bit_in_the_chosen_region() -> None:
    inner = MemoryBackend()
    inner.put(["a"], [page(0)])
    for where, region in (("header", 0), ("payload", 1)):
        faulty = FaultyBackend(inner, seed=7, bit_flip_rate=1.0, flip_in=where)  # type: ignore[arg-type]
        out = page(0)
        assert faulty.get(["a"], [out]) == [True]
        changed = [sum(bin(b).count("1") for b in bytes(e.view)) for e in out]
        assert sum(changed) == 1 and changed[region] == 1
        if where == "header":
            assert any(bytes(out[0].view)[:104])  # inside the header proper


def test_faulty_truncates_what_it_stores() -> None:
    inner = MemoryBackend()
    faulty = FaultyBackend(inner, seed=3, truncate_rate=1.0)
    assert faulty.put(["a"], [page(5)]) == [True]
    assert inner.stats()["bytes"] < 2 * 4096
    assert inner.get(["a"], [page(0)]) == [False]  # a short object is a miss


def test_faulty_failures_are_seeded_and_replayable() -> None:
    def run() -> list[bool]:
        faulty = FaultyBackend(MemoryBackend(), seed=42, fail_rate=0.5)
        return faulty.put([f"k{i}" for i in range(32)], [page(i, size=16) for i in range(32)])

    first = run()
    assert first == run()
    assert 0 < first.count(True) < 32


def test_faulty_failed_put_stores_nothing() -> None:
    inner = MemoryBackend()
    faulty = FaultyBackend(inner, seed=1, fail_rate=1.0)
    assert faulty.put(["a", "b"], [page(1), page(2)]) == [False, False]
    assert inner.exists(["a", "b"]) == [False, False]
    assert faulty.stats()["injected_put_failures"] == 2


def test_faulty_errors_and_delays(monkeypatch: pytest.MonkeyPatch) -> None:
    faulty = FaultyBackend(MemoryBackend(), error_rate=1.0)
    with pytest.raises(InjectedFault, match="exists"):
        faulty.exists(["a"])
    slept: list[float] = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    slow = FaultyBackend(MemoryBackend(), delay=0.25)
    slow.put(["a"], [page(1)])
    slow.get(["a"], [page(0)])
    assert slept == [0.25, 0.25]


# --- kill mid-write -------------------------------------------------------------------

#: A plugin module (written out for the child process to import by name): a backend that
#: overwrites each page's file in place, region by region, so a writer killed between two
#: regions leaves a page whose header looks whole over a mix of old and new bytes.
IN_PLACE_PLUGIN = """
import os
import time

from pydantic import BaseModel, ConfigDict

from kvtier import hookimpl
from kvtier.core.specs import ALL_ATTENTION, ALL_LAYOUTS, ALL_OPERATIONS, BackendSpec, Feature
from kvtier.core.storage import StorageBackend


class InPlaceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    root: str


class InPlaceBackend(StorageBackend):
    def __init__(self, config, context=None):
        self.root = config.root
        os.makedirs(self.root, mode=0o700, exist_ok=True)

    def _path(self, key):
        return os.path.join(self.root, key)

    def exists(self, keys):
        return [os.path.exists(self._path(k)) for k in keys]

    def get(self, keys, pages):
        out = []
        for key, page in zip(keys, pages):
            try:
                fd = os.open(self._path(key), os.O_RDONLY)
            except FileNotFoundError:
                out.append(False)
                continue
            try:
                want = sum(e.length for e in page)
                out.append(os.preadv(fd, [e.view for e in page], 0) == want)
            finally:
                os.close(fd)
        return out

    def put(self, keys, pages):
        for key, page in zip(keys, pages):
            fd = os.open(self._path(key), os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                offset = 0
                for extent in page:  # in place, one region at a time: not atomic
                    os.pwrite(fd, extent.view, offset)
                    offset += extent.length
                    time.sleep(0.002)
            finally:
                os.close(fd)
        return [True] * len(keys)

    def delete(self, keys):
        done = []
        for key in keys:
            try:
                os.unlink(self._path(key))
                done.append(True)
            except FileNotFoundError:
                done.append(False)
        return done

    def clear(self):
        for name in os.listdir(self.root):
            os.unlink(os.path.join(self.root, name))


@hookimpl
def kvtier_register_backends(register):
    register(
        BackendSpec(
            name="in_place",
            factory=InPlaceBackend,
            config_model=InPlaceConfig,
            layouts=ALL_LAYOUTS,
            attention=ALL_ATTENTION,
            operations=ALL_OPERATIONS,
            features=frozenset({Feature.PERSISTENT, Feature.SHARED_PROCESSES}),
        )
    )
"""


def test_kit_fails_a_backend_a_killed_writer_leaves_torn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, closing: list[KitEnv]
) -> None:
    # the child process imports the plugin by name, as it imports a real one
    (tmp_path / "kit_in_place_plugin.py").write_text(IN_PLACE_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    plugin = importlib.import_module("kit_in_place_plugin")
    registry = load_kit_registry([("in-place", plugin)])
    store = tmp_path / "store"
    env = KitEnv(
        registry.backend("in_place"),
        {"root": str(store)},
        [("in-place", plugin)],
        tmp_path,
        registry.io_backends,
    )
    closing.append(env)
    with pytest.raises(AssertionError, match="torn pages after a writer was killed mid-put"):
        KillMidWriteTests().test_kit_writer_killed_mid_put_leaves_whole_pages_or_misses(env)


def test_kit_kill_mid_write_needs_both_features(tmp_path: Path, closing: list[KitEnv]) -> None:
    for features, missing in (
        (frozenset(), "persistent"),
        (frozenset({Feature.PERSISTENT}), "shared_processes"),
    ):
        env = env_for(tmp_path, MemoryBackend, features)
        closing.append(env)
        with pytest.raises(pytest.skip.Exception, match=missing):
            KillMidWriteTests().test_kit_writer_killed_mid_put_leaves_whole_pages_or_misses(env)


# --- the fault campaign's tools and mixins ------------------------------------------------


def test_call_gate_holds_the_first_call_then_lets_it_complete() -> None:
    backend = MemoryBackend(MemoryConfig())
    data = page(7)
    with faults.CallGate(backend, "put") as gate:
        done: list[list[bool]] = []
        worker = threading.Thread(target=lambda: done.append(backend.put(["k"], [data])))
        worker.start()
        assert gate.wait_stalled(10)
        assert backend.exists(["k"]) == [False]  # held at the door: nothing stored yet
        assert backend.put(["j"], [page(8)]) == [True]  # only the first call is held
        gate.release()
        assert gate.wait_returned(10)
        worker.join(10)
    assert done == [[True]] and gate.stalled == 1
    assert "put" not in vars(backend)  # taken off the instance
    out = page(0)
    assert backend.get(["k"], [out]) == [True] and flat(out) == flat(data)


def test_call_gate_refuses_an_unknown_call() -> None:
    with pytest.raises(InvalidFieldError, match="op"):
        faults.CallGate(MemoryBackend(MemoryConfig()), "delete")  # type: ignore[arg-type]


def test_os_faults_fail_the_nth_write_call_once_and_restore_os(tmp_path: Path) -> None:
    saved = os.pwrite
    target = tmp_path / "f"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with faults.OSFaults(fail_at=2, errno=errno.EIO) as fault:
            assert os.pwrite(fd, b"a", 0) == 1
            with pytest.raises(OSError) as raised:
                os.pwrite(fd, b"b", 1)
            assert os.pwrite(fd, b"c", 1) == 1
        assert raised.value.errno == errno.EIO and fault.failed == "pwrite"
        assert fault.calls == ["pwrite", "pwrite", "pwrite"]
        assert fault.reached.is_set()
    finally:
        os.close(fd)
    assert os.pwrite is saved
    assert target.read_bytes() == b"ac"


class PageFiles(StorageBackend):
    """Each page a file written through ``os`` (temporary file, then ``os.replace``), and
    the failures the fault campaign must find, switched on one by one."""

    def __init__(self, root: Path, *, all_or_nothing: bool = False, clear_root: bool = False):
        self.root = root
        self.all_or_nothing = all_or_nothing  # a failure reports every page False
        self.clear_root = clear_root  # clear() removes the root: other instances break
        os.makedirs(root, mode=0o700, exist_ok=True)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [(self.root / k).exists() for k in keys]

    def get(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        out = []
        for key, buffers in zip(keys, pages, strict=True):
            try:
                data = (self.root / key).read_bytes()
            except OSError:
                out.append(False)
                continue
            offset = 0
            for extent in buffers:
                extent.view[:] = data[offset : offset + extent.length]
                offset += extent.length
            out.append(offset == len(data))
        return out

    def put(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        out = []
        for key, buffers in zip(keys, pages, strict=True):
            tmp = self.root / f".{key}.tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    os.pwritev(fd, [e.view for e in buffers], 0)
                finally:
                    os.close(fd)
                os.replace(tmp, self.root / key)
                out.append(True)
            except OSError:
                if self.all_or_nothing:
                    return [False] * len(keys)
                out.append(False)
        return out

    def delete(self, keys: Sequence[str]) -> list[bool]:
        done = []
        for key in keys:
            try:
                os.unlink(self.root / key)
                done.append(True)
            except FileNotFoundError:
                done.append(False)
        return done

    def clear(self) -> None:
        if self.clear_root:
            gone = self.root.with_name(f"{self.root.name}.cleared-{os.getpid()}-{id(self)}")
            os.rename(self.root, gone)  # the root itself goes: no instance can write now
            shutil.rmtree(gone, ignore_errors=True)
            return
        for name in os.listdir(self.root):
            if not name.startswith("."):  # a put's temporary file is its writer's
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.root / name)


def files_env(tmp_path: Path, **broken: bool) -> KitEnv:
    root = tmp_path / "pages"
    return env_for(
        tmp_path,
        lambda config, context: PageFiles(root, **broken),
        frozenset({Feature.PERSISTENT, Feature.SHARED_PROCESSES}),
    )


def test_the_fault_campaign_passes_a_sound_backend(tmp_path: Path, closing: list[KitEnv]) -> None:
    env = files_env(tmp_path)
    closing.append(env)
    FullDiskTests().test_kit_put_fails_at_every_os_step(env, "ENOSPC")
    SecondInstanceTests().test_kit_second_instance_clears_rescans_and_writes(env)
    LateCallTests().test_kit_late_write_never_publishes_another_keys_bytes(env)
    LateCallTests().test_kit_late_read_never_fills_another_keys_page(env)


def test_the_full_disk_mixin_fails_a_put_that_is_not_true_page_by_page(
    tmp_path: Path, closing: list[KitEnv]
) -> None:
    env = files_env(tmp_path, all_or_nothing=True)
    closing.append(env)
    with pytest.raises(AssertionError, match="true page by page"):
        FullDiskTests().test_kit_put_fails_at_every_os_step(env, "ENOSPC")


def test_the_second_instance_mixin_fails_a_clear_that_breaks_the_first(
    tmp_path: Path, closing: list[KitEnv]
) -> None:
    env = files_env(tmp_path, clear_root=True)
    closing.append(env)
    with pytest.raises(AssertionError, match=r"stopped taking puts|cannot put"):
        SecondInstanceTests().test_kit_second_instance_clears_rescans_and_writes(env)


class SharedPages(MemoryBackend):
    """Stores a page by reference and copies it at get: it keeps using a put's pages."""

    def put(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        with self._lock:
            for key, buffers in zip(keys, pages, strict=True):
                self._pages[key] = buffers  # type: ignore[assignment]
        return [True] * len(keys)

    def get(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        out = []
        for key, buffers in zip(keys, pages, strict=True):
            with self._lock:
                source = self._pages.get(key)
            if source is None:
                out.append(False)
                continue
            data = b"".join(bytes(e.view) for e in source)  # type: ignore[union-attr]
            offset = 0
            for extent in buffers:
                extent.view[:] = data[offset : offset + extent.length]
                offset += extent.length
            out.append(True)
        return out


def test_the_late_call_mixin_fails_a_backend_that_keeps_using_the_pages(
    tmp_path: Path, closing: list[KitEnv]
) -> None:
    # the envelope turns the recycled bytes into a counted miss, so what fails is the
    # store no longer holding pages it acknowledged... or serving them: either way, no pass
    env = env_for(tmp_path, lambda config, context: SharedPages(config, context))
    closing.append(env)
    with pytest.raises(AssertionError):
        LateCallTests().test_kit_late_read_never_fills_another_keys_page(env)


def test_the_campaign_skips_what_the_spec_does_not_declare(
    tmp_path: Path, closing: list[KitEnv]
) -> None:
    env = env_for(tmp_path, MemoryBackend)
    closing.append(env)
    with pytest.raises(pytest.skip.Exception, match="persistent"):
        KillInFlightTests().test_kit_kill_with_puts_in_flight_loses_no_acknowledged_page(env)
    with pytest.raises(pytest.skip.Exception, match="shared_processes"):
        SecondInstanceTests().test_kit_second_instance_clears_rescans_and_writes(env)
    with pytest.raises(pytest.skip.Exception, match="not a chain"):
        CascadeCancelTests().test_kit_deleted_key_never_cascades(env)


def test_the_fsync_modes_come_from_the_config_model(tmp_path: Path) -> None:
    from kvtier.testing.kit.faults_ledger import fsync_modes

    registry = load_kit_registry(())
    for name, modes in (("file", ["none", "page", "batch"]), ("segment", ["none", "batch"])):
        env = KitEnv(registry.backend(name), {}, (), tmp_path)
        assert fsync_modes(env) == modes
    assert fsync_modes(KitEnv(registry.backend("memory"), {}, (), tmp_path)) == [None]


def test_the_kill_mixins_child_imports_by_its_path() -> None:
    code = "from kvtier.testing.kit.faults_kill import _child_puts; print(_child_puts.__doc__)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "acknowledged" in done.stdout
