"""The file backend: atomic pages on disk, LRU capacity, free-space guard, failure cases."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ByteSize

from kvtier.backends.file import FILE_SPEC, FileConfig, validate_file_plan
from kvtier.backends.file.backend import FileBackend
from kvtier.backends.filestore import compiled
from kvtier.backends.filestore import paths as fs_paths
from kvtier.backends.filestore import publish as fs_publish
from kvtier.backends.filestore import startup as fs_startup
from kvtier.backends.filestore import writes as fs_writes
from kvtier.backends.filestore.debris import Debris
from kvtier.backends.filestore.index import FileIndex
from kvtier.core.errors import ConfigError, InvalidFieldError, KvtierError, StorageError
from kvtier.core.extents import Extent, extent_of_view
from kvtier.core.geometry import KVGeometry
from kvtier.core.layout import Layout
from kvtier.core.specs import Feature
from kvtier.core.storage import BackendContext
from kvtier.testing import require

REGION = 4096


def make_page(fill: int, regions: int = 3, size: int = REGION) -> list[Extent]:
    """A page of ``regions`` separate buffers, every byte ``fill``."""
    return [extent_of_view(memoryview(bytearray([fill]) * size)) for _ in range(regions)]


def aligned_page(fill: int, regions: int = 3, size: int = REGION) -> list[Extent]:
    """A page of page-aligned (mmap) buffers, as O_DIRECT needs."""
    out = []
    for _ in range(regions):
        buf = mmap.mmap(-1, size)
        buf.write(bytes([fill]) * size)
        out.append(extent_of_view(memoryview(buf)))
    return out


def page_bytes(page: list[Extent]) -> bytes:
    return b"".join(bytes(e.view) for e in page)


def backend(root: Path, **options: object) -> FileBackend:
    options.setdefault("min_free_bytes", 0)
    return FileBackend(FileConfig(root=root, **options))  # type: ignore[arg-type]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "pages"


@pytest.fixture
def fb(root: Path) -> Iterator[FileBackend]:
    b = backend(root)
    yield b
    b.close()


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


# --- basics ---------------------------------------------------------------------------


def test_round_trip_miss_and_exists(fb: FileBackend) -> None:
    keys = [f"k{i}" for i in range(6)]
    assert fb.put(keys, [make_page(i) for i in range(6)]) == [True] * 6
    out = [make_page(255) for _ in range(7)]
    assert fb.get([*keys, "absent"], out) == [True] * 6 + [False]
    for i in range(6):
        assert page_bytes(out[i]) == bytes([i]) * 3 * REGION
    assert page_bytes(out[6]) == b"\xff" * 3 * REGION
    assert fb.exists(["k0", "absent", "k5"]) == [True, False, True]
    s = fb.stats()
    assert s["puts"] == 6 and s["hits"] == 6 and s["misses"] == 1 and s["pages"] == 6


def test_one_file_per_page_sharded_with_private_modes(fb: FileBackend, root: Path) -> None:
    fb.put(["alpha", "beta"], [make_page(1), make_page(2)])
    paths = files_under(root)
    assert [p.name for p in paths] == sorted(["alpha.kv", "beta.kv"])
    for p in paths:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
        assert p.stat().st_size == 3 * REGION
        assert p == fs_paths.page_path(fb.store, p.name[:-3])
        assert len(p.relative_to(fb.store).parts) == 3  # aa/bb/key.kv
    for d in [root, fb.store, *(p.parent for p in paths), *(p.parent.parent for p in paths)]:
        assert stat.S_IMODE(d.stat().st_mode) == 0o700


def test_overwrite_replaces_whole_page(fb: FileBackend) -> None:
    assert fb.put(["k"], [make_page(1)]) == [True]
    assert fb.put(["k"], [make_page(2, regions=2)]) == [True]
    out = make_page(0, regions=2)
    assert fb.get(["k"], [out]) == [True]
    assert page_bytes(out) == b"\x02" * 2 * REGION
    assert fb.stats()["bytes"] == 2 * REGION


def test_get_into_wrong_sized_page_is_a_miss(fb: FileBackend) -> None:
    fb.put(["k"], [make_page(1)])
    bigger = make_page(9, regions=4)
    assert fb.get(["k"], [bigger]) == [False]
    assert fb.stats()["get_size_mismatch"] == 1


def test_many_small_regions_beyond_iov_max(fb: FileBackend) -> None:
    page = make_page(7, regions=1500, size=16)
    for i, e in enumerate(page):
        e.view[:] = bytes([i % 251]) * 16
    assert fb.put(["many"], [page]) == [True]
    out = make_page(0, regions=1500, size=16)
    assert fb.get(["many"], [out]) == [True]
    assert page_bytes(out) == page_bytes(page)


def test_delete_and_clear(fb: FileBackend, root: Path) -> None:
    fb.put(["a", "b", "c"], [make_page(1), make_page(2), make_page(3)])
    assert fb.delete(["a", "a", "zz"]) == [True, False, False]
    assert fb.exists(["a", "b"]) == [False, True]
    fb.clear()
    assert fb.exists(["b", "c"]) == [False, False]
    assert files_under(root) == []
    assert fb.stats()["pages"] == 0


def test_clear_keeps_other_namespaces(root: Path) -> None:
    geometry = KVGeometry.mha(num_layers=1, num_kv_heads=1, head_dim=64, page_size=16)
    ctx_a = BackendContext(geometry, Layout.PAGE_FIRST, namespace="tenant-a")
    ctx_b = BackendContext(geometry, Layout.PAGE_FIRST, namespace="tenant-b")
    config = FileConfig(root=root, min_free_bytes=ByteSize(0))
    a, b = FileBackend(config, ctx_a), FileBackend(config, ctx_b)
    a.put(["k"], [make_page(1)])
    b.put(["k"], [make_page(2)])
    a.clear()
    out = make_page(0)
    assert a.exists(["k"]) == [False]
    assert b.get(["k"], [out]) == [True] and page_bytes(out) == b"\x02" * 3 * REGION


@pytest.mark.parametrize(
    "key", ["../escape", "a/b", "/abs", "", ".hidden", "x" * 400, "nul\0", "é", "a.kv", ".."]
)
def test_path_like_keys_are_refused_before_any_io(fb: FileBackend, root: Path, key: str) -> None:
    before = files_under(root.parent)
    calls: list[Callable[[], object]] = [
        lambda: fb.put([key], [make_page(1)]),
        lambda: fb.get([key], [make_page(1)]),
        lambda: fb.exists([key]),
        lambda: fb.delete([key]),
    ]
    for call in calls:
        with pytest.raises((KvtierError, ValueError)) as info:
            call()
        assert isinstance(info.value, KvtierError)
    assert files_under(root.parent) == before


def test_closed_backend_refuses_io(root: Path) -> None:
    b = backend(root)
    b.close()
    b.close()  # idempotent
    for call in (
        lambda: b.get(["k"], [make_page(1)]),
        lambda: b.put(["k"], [make_page(1)]),
        lambda: b.exists(["k"]),
        lambda: b.delete(["k"]),
        b.clear,
    ):
        with pytest.raises(StorageError, match="closed"):
            call()


# --- root directory -------------------------------------------------------------------


def test_existing_public_root_is_refused(tmp_path: Path) -> None:
    public = tmp_path / "public"
    public.mkdir(mode=0o755)
    public.chmod(0o755)
    with pytest.raises(ConfigError, match="chmod 700"):
        backend(public)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown a directory")
def test_root_owned_by_someone_else_is_refused(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 65534, 65534)
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        backend(foreign)


def test_root_that_is_a_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_bytes(b"")
    with pytest.raises(ConfigError, match="page directory"):
        backend(path)


def test_default_root_is_per_user_under_tempdir() -> None:
    root = FileConfig().root
    assert root.parent.name == f"kvtier-{os.geteuid()}"


def test_config_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="extra"):
        FileConfig.model_validate({"root": "/tmp/x", "fsycn": "page"})
    with pytest.raises(ValueError):
        FileConfig.model_validate({"fsync": "sometimes"})


# --- persistence, index, capacity -----------------------------------------------------


def test_index_is_rebuilt_from_disk_in_mtime_order(root: Path) -> None:
    b = backend(root)
    for i, key in enumerate(["old", "mid", "new"]):
        b.put([key], [make_page(i)])
        os.utime(fs_paths.page_path(b.store, key), (1000 + i, 1000 + i))
    b.close()
    again = backend(root)
    assert again.index.keys() == ["old", "mid", "new"]
    assert again.stats()["pages_found_at_start"] == 3
    out = make_page(0)
    assert again.get(["mid"], [out]) == [True] and page_bytes(out) == b"\x01" * 3 * REGION


def test_capacity_evicts_least_recently_used(root: Path) -> None:
    b = backend(root, capacity_bytes=3 * 3 * REGION)
    for i, key in enumerate(["a", "b", "c"]):  # one by one: a batch has no order of use
        b.put([key], [make_page(i)])
    assert b.get(["a"], [make_page(0)]) == [True]  # a is now most recently used
    assert b.put(["d"], [make_page(4)]) == [True]
    assert b.exists(["a", "b", "c", "d"]) == [True, False, True, True]
    assert not fs_paths.page_path(b.store, "b").exists()
    s = b.stats()
    assert s["evictions"] == 1 and s["bytes"] == 3 * 3 * REGION


def test_overwrite_within_capacity_evicts_nothing(root: Path) -> None:
    b = backend(root, capacity_bytes=2 * 3 * REGION)
    b.put(["a", "b"], [make_page(1), make_page(2)])
    assert b.put(["b"], [make_page(3)]) == [True]
    assert b.exists(["a", "b"]) == [True, True]
    assert b.stats()["evictions"] == 0


def test_page_larger_than_capacity_fails_that_put_only(root: Path) -> None:
    b = backend(root, capacity_bytes=2 * REGION)
    assert b.put(["big", "small"], [make_page(1), make_page(2, regions=1)]) == [False, True]
    assert b.stats()["put_failed_page_larger_than_capacity"] == 1
    assert files_under(root) == [fs_paths.page_path(b.store, "small")]


def test_min_free_space_guard_refuses_and_keeps_serving(root: Path) -> None:
    b = backend(root)
    b.put(["kept"], [make_page(1)])
    free = os.statvfs(root).f_bavail * os.statvfs(root).f_frsize
    guarded = backend(root, min_free_bytes=free * 2)  # can never be satisfied
    assert guarded.put(["new"], [make_page(2)]) == [False]
    # it evicted what it could (its LRU pages) before giving up, then kept serving
    assert guarded.stats()["put_failed_min_free_space"] == 1
    assert guarded.exists(["new"]) == [False]
    assert guarded.put(["x"], [make_page(3)]) == [False]
    assert list(root.rglob(".*.tmp")) == []


def test_a_batch_reservation_counts_its_own_pages_off_the_free_space(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = FileIndex(root, min_free_bytes=1000)
    looked_up: list[int] = []

    def free_bytes() -> int:  # what statvfs would say: nothing written yet
        looked_up.append(1)
        return 1250

    monkeypatch.setattr(index, "_free_bytes", free_bytes)
    refused = index.reserve_many([(f"k{i}", 100) for i in range(4)])
    # 1250 free: two pages of 100 leave 1050, a third would go below the 1000 kept free
    assert refused == [None, None, "min_free_space", "min_free_space"]
    assert looked_up == [1]  # one statvfs for the batch, not one per page
    index.commit_many([("k0", 100), ("k1", 100)])
    assert index.stored_bytes == 200 and len(index) == 2


def test_other_process_pages_found_by_stat_on_index_miss(root: Path) -> None:
    reader = backend(root)
    writer = backend(root)
    writer.put(["from-writer"], [make_page(5)])
    assert reader.exists(["from-writer"]) == [True]
    blind = backend(root, check_disk_on_miss=False)
    writer.put(["later"], [make_page(6)])
    assert blind.exists(["later"]) == [False]
    out = make_page(0)
    assert blind.get(["later"], [out]) == [True]  # get always tries the file
    assert blind.exists(["later"]) == [True]
    writer.delete(["later"])
    assert blind.get(["later"], [out]) == [False]  # gone: dropped from the index
    assert blind.exists(["later"]) == [False]
    writer.put(["third"], [make_page(7)])
    assert blind.rescan() == 2


# --- durability -----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["none", "page", "batch"])
def test_fsync_modes(root: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real_fdatasync, real_fsync_dir = os.fdatasync, fs_writes.fsync_dir

    def fdatasync(fd: int) -> None:
        synced.append("file")
        real_fdatasync(fd)

    def fsync_dir(directory: Path) -> None:
        synced.append("dir")
        real_fsync_dir(directory)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(fs_writes, "fsync_dir", fsync_dir)
    b = backend(root, fsync=mode, io_threads=1)
    keys = ["same-a", "same-b", "same-c"]
    assert b.put(keys, [make_page(1), make_page(2), make_page(3)]) == [True] * 3
    out = [make_page(0) for _ in keys]
    assert b.get(keys, out) == [True] * 3
    dirs = {fs_paths.page_path(b.store, k).parent for k in keys}
    if mode == "none":
        assert synced == []
    elif mode == "page":
        assert synced.count("file") == 3 and synced.count("dir") == 3
    else:
        assert synced.count("file") == 3 and synced.count("dir") == len(dirs)
        assert synced[:3] == ["file"] * 3  # every page is on disk before any rename


# --- O_DIRECT -------------------------------------------------------------------------


def test_validate_plan_refuses_unalignable_o_direct_with_reason() -> None:
    tiny = KVGeometry.mha(num_layers=2, num_kv_heads=1, head_dim=64, page_size=4)
    ctx = BackendContext(tiny, Layout.LAYER_FIRST)
    validate_file_plan(FileConfig(o_direct=False), ctx)
    with pytest.raises(InvalidFieldError, match="multiple of 4096") as info:
        validate_file_plan(FileConfig(o_direct=True), ctx)
    assert "512 bytes" in str(info.value) and "o_direct to false" in str(info.value)
    # layer_first cuts pages too small; page_first keeps a layer's 16 tokens together
    mid = KVGeometry.mha(num_layers=2, num_kv_heads=1, head_dim=64, page_size=16)
    with pytest.raises(InvalidFieldError, match="'page_first'"):
        validate_file_plan(FileConfig(o_direct=True), BackendContext(mid, Layout.LAYER_FIRST))
    validate_file_plan(FileConfig(o_direct=True), BackendContext(mid, Layout.PAGE_FIRST))
    big = KVGeometry.mha(num_layers=32, num_kv_heads=8, head_dim=128, page_size=64)
    for layout in Layout:
        validate_file_plan(FileConfig(o_direct=True), BackendContext(big, layout))


def test_o_direct_round_trip_and_unaligned_fallback(tmp_path: Path) -> None:
    try:
        b = backend(tmp_path / "direct", o_direct=True)
    except ConfigError as exc:
        pytest.skip(f"this filesystem has no O_DIRECT: {exc}")
    page = aligned_page(3)
    assert b.put(["d"], [page]) == [True]
    out = aligned_page(0)
    assert b.get(["d"], [out]) == [True] and page_bytes(out) == page_bytes(page)
    assert "o_direct_fallbacks" not in b.stats()
    odd = make_page(4, size=100)
    assert b.put(["odd"], [odd]) == [True]
    back = make_page(0, size=100)
    assert b.get(["odd"], [back]) == [True] and page_bytes(back) == page_bytes(odd)
    assert b.stats()["o_direct_fallbacks"] >= 1


# --- failures -------------------------------------------------------------------------


def test_injected_enospc_fails_that_put_leaves_nothing_and_keeps_serving(
    fb: FileBackend, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fb.put(["before"], [make_page(1)])
    real = os.pwritev
    calls = {"n": 0}

    def full_disk(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls["n"] += 1
        if calls["n"] == 2:
            real(fd, buffers[:1], offset)  # a partial write, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", full_disk)
    results = fb.put(["a", "b", "c"], [make_page(2), make_page(3), make_page(4)])
    assert results.count(False) == 1 and results.count(True) == 2
    assert fb.stats()["put_failed_no_space"] == 1
    assert list(root.rglob(".*.tmp")) == []
    monkeypatch.setattr(os, "pwritev", real)
    failed = ["a", "b", "c"][results.index(False)]
    assert fb.exists([failed]) == [False]
    assert fb.put([failed], [make_page(9)]) == [True]
    out = make_page(0)
    assert fb.get(["before"], [out]) == [True] and page_bytes(out) == b"\x01" * 3 * REGION


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mount_point)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_real_enospc_on_small_tmpfs(tiny_tmpfs: Path) -> None:
    b = backend(tiny_tmpfs / "root", io_threads=1)
    size = 96 * 1024  # 3 regions: 288 KiB per page; 1 MiB holds three
    keys = [f"p{i}" for i in range(5)]
    results = b.put(keys, [make_page(i, size=size) for i in range(5)])
    assert results[:3] == [True] * 3 and results[3:] == [False, False]
    assert b.stats()["put_failed_no_space"] == 2
    assert list(tiny_tmpfs.rglob(".*.tmp")) == []
    assert b.exists(keys) == [True, True, True, False, False]
    out = make_page(0, size=size)
    assert b.get(["p1"], [out]) == [True] and page_bytes(out) == b"\x01" * 3 * size
    b.delete(["p0"])
    assert b.put(["p3"], [make_page(3, size=size)]) == [True]  # space freed: serving again


def test_o_direct_refused_by_the_filesystem_fails_at_construction(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def no_direct(path: object, flags: int, *args: object, **kw: object) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", no_direct)
    with pytest.raises(ConfigError, match=r"refused O_DIRECT .*set o_direct to false"):
        backend(root, o_direct=True)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temp_files_are_removed_at_start_up(root: Path) -> None:
    b = backend(root)
    b.put(["k"], [make_page(1)])
    leaf = fs_paths.page_path(b.store, "k").parent
    stale = leaf / f".{dead_pid()}.1.1.tmp"
    stale.write_bytes(b"half a page")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        live = leaf / f".{sleeper.pid}.1.1.tmp"
        live.write_bytes(b"in flight")
        again = backend(root)
        assert not stale.exists()
        assert live.exists()  # a live writer's temp file is left alone
        assert again.exists(["k"]) == [True]
        assert again.stats()["debris_stale_temps"] == 1
        debris = Debris("file")
        assert fs_startup.sweep_store(b.store, debris, max_age=0) == [  # ... until too old
            ("k", 3 * REGION, fs_paths.page_path(b.store, "k").stat().st_mtime)
        ]
        assert not live.exists() and debris.stats()["debris_stale_temps"] == 1
    finally:
        sleeper.kill()
        sleeper.wait()


CHILD = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from kvtier.backends.file import FileConfig
    from kvtier.backends.file.backend import FileBackend
    from kvtier.core.extents import extent_of_view

    root, mode, key = sys.argv[1:4]
    fill, count, fsync = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
    size = 256 * 1024
    b = FileBackend(FileConfig(root=Path(root), min_free_bytes=0, io_threads=1, fsync=fsync))
    page = [extent_of_view(memoryview(bytearray([fill]) * size)) for _ in range(4)]
    if mode == "hang":
        real = os.pwritev
        def half_then_hang(fd, buffers, offset):
            real(fd, buffers[:2], offset)
            print("ready", flush=True)
            time.sleep(60)
        os.pwritev = half_then_hang
    print("start", flush=True)
    for _ in range(count):
        assert b.put([key], [page]) == [True]
    print("done", flush=True)
    """
)

PAGE_SIZE = 4 * 256 * 1024


def spawn(
    root: Path, mode: str, key: str, fill: int, count: int, fsync: str = "none"
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root), mode, key, str(fill), str(count), fsync],
        stdout=subprocess.PIPE,
        text=True,
    )


def kill_when_half_written(root: Path, key: str, fsync: str) -> None:
    """Start a writer of ``key``, wait until half its page is written, SIGKILL it."""
    with spawn(root, "hang", key, 2, 1, fsync) as child:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "start"
        assert child.stdout.readline().strip() == "ready"
        temps = list(root.rglob(".*.tmp"))
        assert len(temps) == 1 and temps[0].stat().st_size == PAGE_SIZE // 2
        os.kill(child.pid, signal.SIGKILL)
        child.wait()


# (the Python loop, stopped at a known point; tests/test_compiled_loop.py kills every loop,
# the compiled one and the io_uring ring included, at random points)
@pytest.mark.parametrize("fsync", ["none", "page"])
def test_writer_killed_mid_put_leaves_old_page_whole(root: Path, fsync: str) -> None:
    b = backend(root)
    b.put(["victim"], [make_page(1, regions=4, size=256 * 1024)])
    kill_when_half_written(root, "victim", fsync)
    out = make_page(0, regions=4, size=256 * 1024)
    assert b.get(["victim"], [out]) == [True]
    assert page_bytes(out) == b"\x01" * PAGE_SIZE  # the old page, whole
    backend(root)  # start-up removes the dead writer's temp file
    assert list(root.rglob(".*.tmp")) == []


@pytest.mark.parametrize("fsync", ["none", "page"])
def test_writer_killed_before_first_publish_leaves_a_miss(root: Path, fsync: str) -> None:
    b = backend(root)
    kill_when_half_written(root, "fresh", fsync)
    assert b.exists(["fresh"]) == [False]
    assert b.get(["fresh"], [make_page(0, regions=4, size=256 * 1024)]) == [False]


def test_concurrent_writers_in_processes_never_tear_a_page(root: Path) -> None:
    reader = backend(root)
    writers = [spawn(root, "loop", "contested", fill, 40) for fill in (11, 22, 33)]
    seen: set[int] = set()
    out = make_page(0, regions=4, size=256 * 1024)
    deadline = time.monotonic() + 60
    try:
        while any(w.poll() is None for w in writers) and time.monotonic() < deadline:
            if reader.get(["contested"], [out]) == [True]:
                data = page_bytes(out)
                assert data == bytes([data[0]]) * PAGE_SIZE, "torn page"
                seen.add(data[0])
    finally:
        for w in writers:
            w.communicate(timeout=60)
    assert [w.returncode for w in writers] == [0, 0, 0]
    assert reader.get(["contested"], [out]) == [True]
    final = page_bytes(out)
    assert final[0] in (11, 22, 33) and final == bytes([final[0]]) * PAGE_SIZE
    assert seen <= {11, 22, 33}
    assert list(root.rglob(".*.tmp")) == []
    assert len(files_under(root)) == 1


def test_concurrent_puts_of_one_key_from_threads(fb: FileBackend) -> None:
    # every put reports True: a page another thread published over one's own in the
    # moment after its move is a page of the key (publish.py, step 4), told by the header
    # slot's leading bytes, the same in every page here as an envelope's would be
    keys = ["same"] * 16
    pages = [
        [*make_page(0, regions=1), *make_page(i, regions=1, size=64 * 1024)] for i in range(16)
    ]
    assert fb.put(keys, pages) == [True] * 16
    out = [*make_page(0, regions=1), *make_page(0, regions=1, size=64 * 1024)]
    assert fb.get(["same"], [out]) == [True]
    data = page_bytes(out[1:])
    assert data == bytes([data[0]]) * len(data)
    assert fb.stats()["pages"] == 1


# --- registration ---------------------------------------------------------------------


def test_registered_through_the_hook_with_features() -> None:
    from kvtier.plugins.manager import load_registry

    spec = load_registry(autoload=False).backend("file")
    assert spec is FILE_SPEC
    assert spec.features == {
        Feature.PERSISTENT,
        Feature.SHARED_PROCESSES,
        Feature.ZERO_COPY,
        Feature.EXACT_EVICTION,
        Feature.REPORTS_SPACE,
    }
    assert spec.validate_plan is validate_file_plan
    assert spec.unavailable_reason() is None


def test_factory_builds_from_validated_config(root: Path) -> None:
    geometry = KVGeometry.mha(num_layers=1, num_kv_heads=1, head_dim=64, dtype=torch.float16)
    config = FILE_SPEC.config_model.model_validate({"root": str(root), "min_free_bytes": 0})
    b = FILE_SPEC.load_factory()(config, BackendContext(geometry, Layout.PAGE_FIRST))
    assert isinstance(b, FileBackend)
    assert b.store == root / "default"
    b.close()


# --- publishing -----------------------------------------------------------------------


@pytest.mark.parametrize("compiled_steps", [True, False], ids=["c-steps", "python-steps"])
def test_publish_exchanges_over_an_existing_page(tmp_path: Path, compiled_steps: bool) -> None:
    if compiled_steps:
        require("compiled", None if compiled.available() else compiled.MISSING)
    final = tmp_path / "page.kv"
    for content in (b"old", b"new", b"newer"):
        fd, tmp = fs_paths.open_temp(final)
        os.write(fd, content)
        os.close(fd)
        fs_publish.publish(tmp, final, compiled=compiled_steps)
        assert final.read_bytes() == content
        assert sorted(p.name for p in tmp_path.iterdir()) == ["page.kv"]


def test_publish_falls_back_to_rename_without_exchange(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the Python steps' exchange (ctypes); the C steps' is refused by a preloaded shim in
    # test_compiled_loop.py's test_the_c_steps_fall_back_to_rename_without_exchange
    calls: list[int] = []

    def no_exchange(*args: object) -> int:
        calls.append(1)
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(fs_publish, "_renameat2", no_exchange)
    final = tmp_path / "page.kv"
    final.write_bytes(b"old")
    fd, tmp = fs_paths.open_temp(final)
    os.write(fd, b"new")
    os.close(fd)
    fs_publish.publish(tmp, final, compiled=False)
    assert final.read_bytes() == b"new" and calls == [1]
    assert fs_publish._renameat2 is None  # not tried again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.kv"]


@pytest.mark.parametrize("compiled_steps", [True, False], ids=["c-steps", "python-steps"])
@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "rename"])
@pytest.mark.parametrize("kind", ["dirs", "symlinks", "special"])
def test_publish_over_a_non_page_removes_and_counts_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiled_steps: bool, exchange: bool, kind: str
) -> None:
    # a directory, symlink or FIFO under the page's name: exchanged out and removed, or,
    # for a rename (no exchange here), removed first (the C steps hand it to Python and
    # run again); either way the page is published and the entry counted once
    if compiled_steps:
        require("compiled", None if compiled.available() else compiled.MISSING)
        assert compiled._pageio.SAME_PAGE_PREFIX == fs_publish.SAME_PAGE_PREFIX  # one rule
    if not exchange:
        monkeypatch.setattr(fs_publish, "_renameat2", None)
    final = tmp_path / "page.kv"
    if kind == "dirs":
        final.mkdir()
        (final / "inside").write_bytes(b"i")
    elif kind == "symlinks":
        final.symlink_to(tmp_path / "elsewhere")
    else:
        os.mkfifo(final)
    fd, tmp = fs_paths.open_temp(final)
    os.write(fd, b"new")
    written = fs_publish.file_id(fd)
    os.close(fd)
    debris = Debris("file")
    fs_publish.publish(tmp, final, debris=debris, written=written, compiled=compiled_steps)
    assert not final.is_symlink() and final.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.kv"]
    assert {name: n for name, n in debris.stats().items() if n} == {f"debris_{kind}": 1}


def test_docs_list_every_option_with_its_description() -> None:
    doc = (Path(__file__).parent.parent / "docs" / "file-backend.md").read_text()
    for name, info in FileConfig.model_fields.items():
        assert f"| `{name}` |" in doc, f"docs/file-backend.md lacks option {name}"
        assert info.description and info.description in doc, f"stale description of {name}"


def test_exists_looks_up_only_index_misses_and_refuses_bad_ones(root: Path) -> None:
    reader, writer = backend(root), backend(root)
    assert reader.put(["mine"], [make_page(1)]) == [True]
    assert writer.put(["theirs"], [make_page(2)]) == [True]
    link = fs_paths.page_path(reader.store, "link")
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(fs_paths.page_path(reader.store, "theirs"))  # never a page
    assert reader.exists(["mine", "theirs", "link", "absent"]) == [True, True, False, False]
    assert reader.stats()["pages"] == 2  # the other process's page was adopted
    with pytest.raises(KvtierError):
        reader.exists(["mine", "absent", "../etc/passwd"])


def test_exists_without_disk_lookups_still_refuses_bad_keys(root: Path) -> None:
    blind = backend(root, check_disk_on_miss=False)
    blind.put(["good"], [make_page(1)])
    assert blind.exists(["good", "absent"]) == [True, False]
    with pytest.raises(KvtierError):
        blind.exists(["good", "../etc/passwd"])


# --- index invariants under random operations ------------------------------------------

KEYS = [f"key{i}" for i in range(6)]
operations = st.lists(
    st.tuples(
        st.sampled_from(["put", "get", "delete", "reopen"]),
        st.sampled_from(KEYS),
        st.integers(min_value=1, max_value=3),
    ),
    max_size=25,
)


@settings(max_examples=25, deadline=None)
@given(ops=operations)
def test_index_matches_disk_and_capacity_under_random_operations(
    ops: list[tuple[str, str, int]],
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "pages"
        capacity = 5 * REGION
        b = backend(root, capacity_bytes=capacity, io_threads=1)
        model: dict[str, bytes] = {}  # what a get may return for each key
        for op, key, regions in ops:
            if op == "put":
                page = make_page(len(model) + regions, regions=regions)
                assert b.put([key], [page]) == [True]
                model[key] = page_bytes(page)
            elif op == "get" and key in model:
                out = make_page(0, regions=len(model[key]) // REGION)
                if b.get([key], [out]) == [True]:  # it may have been evicted
                    assert page_bytes(out) == model[key]
            elif op == "delete":
                b.delete([key])
                model.pop(key, None)
            elif op == "reopen":
                b.close()
                b = backend(root, capacity_bytes=capacity, io_threads=1)
            on_disk = {p.name[:-3]: p.stat().st_size for p in root.rglob("*.kv")}
            assert set(b.index.keys()) == set(on_disk)
            assert b.index.stored_bytes == sum(on_disk.values()) <= capacity
            assert set(on_disk) <= set(model)
            assert not list(root.rglob(".*.tmp"))
        b.close()


def test_temp_names_of_a_batch_are_fresh_and_next_to_their_pages(tmp_path: Path) -> None:
    finals = [f"{tmp_path}/a/b/k{i}.kv" for i in range(3)] + [f"{tmp_path}/c/d/k.kv"]
    first, second = fs_paths.temp_paths(finals), fs_paths.temp_paths(finals)
    one = fs_paths.temp_path(finals[0])
    names = [*first, *second, one]
    assert len(set(names)) == len(names)  # unique across calls and with temp_path
    for tmp, final in zip(first, finals, strict=True):
        assert os.path.dirname(tmp) == os.path.dirname(final)
        name = os.path.basename(tmp)
        assert name.startswith(f".{os.getpid()}.") and name.endswith(fs_paths.TEMP_SUFFIX)
