"""The io_uring backend: ring engine, file-format interop, atomicity, errors, O_DIRECT, GIL.

Tests that need io_uring skip with the reason where liburing is missing or the kernel
forbids io_uring, and fail instead under ``KVTIER_REQUIRE_URING=1`` (set in ``.ci/run``).
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import logging
import mmap
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ByteSize, ValidationError

from kvtier.backends.file import FileConfig
from kvtier.backends.file.backend import FileBackend
from kvtier.backends.filestore import paths as fs_paths
from kvtier.backends.filestore import publish as fs_publish
from kvtier.backends.uring import URING_SPEC, UringConfig, validate_uring_plan
from kvtier.backends.uring.backend import UringBackend
from kvtier.core.errors import (
    BackendUnavailableError,
    InvalidFieldError,
    KvtierError,
    StorageError,
)
from kvtier.core.extents import Extent, extent_of_view
from kvtier.core.geometry import KVGeometry
from kvtier.core.layout import Layout
from kvtier.core.storage import BackendContext
from kvtier.testing import BackendKit, ConformanceTests, require

pytestmark = pytest.mark.uring


def _require_uring() -> None:
    require("uring", URING_SPEC.unavailable_reason())


@pytest.fixture
def uring_ok() -> None:
    """Skip (or, under KVTIER_REQUIRE_URING=1, fail) where io_uring cannot run."""
    _require_uring()


@pytest.fixture
def make(uring_ok: None, tmp_path: Path) -> Iterator[Callable[..., UringBackend]]:
    """Build uring backends on ``tmp_path/root`` (overrides as keyword args); closes them."""
    built: list[UringBackend] = []

    def build(**overrides: Any) -> UringBackend:
        options: dict[str, Any] = {"root": tmp_path / "root", "min_free_bytes": 0}
        options.update(overrides)
        backend = UringBackend(UringConfig(**options))
        built.append(backend)
        return backend

    yield build
    for backend in built:
        backend.close()


def _page(data: bytes, cuts: tuple[int, ...] = ()) -> list[Extent]:
    """A page over fresh buffers holding ``data``, cut into regions at ``cuts``."""
    bounds = [0, *cuts, len(data)]
    return [extent_of_view(memoryview(bytearray(data[a:b]))) for a, b in itertools.pairwise(bounds)]


def _blank(size: int, cuts: tuple[int, ...] = ()) -> list[Extent]:
    return _page(bytes(size), cuts)


def _joined(page: list[Extent]) -> bytes:
    return b"".join(bytes(e.view) for e in page)


def _data(seed: int, size: int) -> bytes:
    return (bytes([seed % 251]) + os.urandom(15)) * (size // 16) + bytes(size % 16)


def _temps(root: Path) -> list[Path]:
    return [p for p in root.rglob(f"*{fs_paths.TEMP_SUFFIX}")]


# --- declaration and availability (no io_uring needed) ---------------------------------


def test_declaring_the_plugin_imports_no_liburing() -> None:
    code = (
        "import sys, kvtier.backends.uring as u\n"
        "assert u.URING_SPEC.factory.endswith(':UringBackend')\n"
        "assert 'liburing' not in sys.modules, 'liburing imported at declaration'\n"
        "assert 'kvtier.backends.uring.ring' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_registered_through_the_hook_with_features_and_hint() -> None:
    from kvtier.plugins.manager import load_registry

    spec = load_registry(autoload=False).backend("uring")
    assert spec.requires == ("liburing",)
    assert spec.install_hint == "pip install 'kvtier[uring]'"
    assert {str(f) for f in spec.features} == {
        "persistent",
        "shared_processes",
        "zero_copy",
        "exact_eviction",
        "reports_space",
    }
    assert spec.config_model is UringConfig


def test_missing_module_is_reported_with_the_install_hint() -> None:
    spec = dataclasses.replace(URING_SPEC, requires=("liburing_not_installed_here",))
    assert "liburing_not_installed_here" in (spec.unavailable_reason() or "")
    with pytest.raises(BackendUnavailableError, match=r"pip install 'kvtier\[uring\]'"):
        spec.load_factory()


def test_a_failing_probe_makes_resolution_fail_with_its_reason() -> None:
    spec = dataclasses.replace(URING_SPEC, probe=lambda: "io_uring_setup is forbidden (EPERM)")
    with pytest.raises(BackendUnavailableError) as info:
        spec.ensure_available()
    assert info.value.reason == "io_uring_setup is forbidden (EPERM)"
    assert "uring" in str(info.value) and "EPERM" in str(info.value)


def test_forbidden_io_uring_is_listed_and_refused_at_resolution(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvtier import cli
    from kvtier.backends.uring import probe
    from kvtier.core.capabilities import resolve
    from kvtier.core.config import load_engine_config
    from kvtier.plugins.manager import load_registry

    reason = "io_uring_setup is forbidden here (EPERM): a seccomp profile blocks it"
    monkeypatch.setattr(probe, "_probe_uncached", lambda: reason)
    probe.probe_io_uring.cache_clear()
    try:
        registry = load_registry(autoload=False)
        config = load_engine_config(
            '{"backend": "uring", "num_layers": 2, "num_kv_heads": 2, "head_dim": 64}'
        )
        with pytest.raises(BackendUnavailableError) as info:
            resolve(config, registry.backends, registry.io_backends)
        assert info.value.reason == reason
        assert "pip install 'kvtier[uring]'" in str(info.value)
        cli.main(["backends"], registry=registry)
        listing = capsys.readouterr().out
        assert "uring" in listing and "EPERM" in listing
        with pytest.raises(BackendUnavailableError, match="EPERM"):
            UringBackend(UringConfig())  # built directly, it refuses too
    finally:
        probe.probe_io_uring.cache_clear()


@pytest.mark.parametrize(
    ("code", "expected"),
    [(errno.EPERM, "forbidden"), (errno.ENOSYS, "no io_uring"), (errno.ENOMEM, "failed")],
)
def test_probe_explains_setup_errors(
    uring_ok: None, monkeypatch: pytest.MonkeyPatch, code: int, expected: str
) -> None:
    import liburing

    from kvtier.backends.uring import probe

    def refuse(*args: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(liburing, "io_uring_queue_init", refuse)
    monkeypatch.setattr(liburing, "io_uring_queue_exit", lambda ring: None)
    monkeypatch.setattr(probe, "_sysctl_disabled", lambda: None)
    reason = probe._probe_uncached()
    assert reason is not None and expected in reason


def test_config_rejects_unknown_keys_and_bad_queue_depth(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="extra"):
        UringConfig(root=tmp_path, queue_deph=8)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="queue_depth"):
        UringConfig(root=tmp_path, queue_depth=0)
    with pytest.raises(ValidationError, match="fsync"):
        UringConfig(root=tmp_path, fsync="always")  # type: ignore[arg-type]


def test_config_mirrors_the_file_backend_fields() -> None:
    shared = set(FileConfig.model_fields) - {"io_threads"}
    assert shared <= set(UringConfig.model_fields)
    assert UringConfig().root == FileConfig().root  # same default store, same format


def test_every_option_is_documented() -> None:
    doc = (Path(__file__).parent.parent / "docs" / "choosing-a-backend.md").read_text()
    for name, field in UringConfig.model_fields.items():
        assert f"| `{name}` |" in doc, f"docs/choosing-a-backend.md lacks option {name!r}"
        assert field.description, f"UringConfig.{name} has no description"


def test_o_direct_plan_is_refused_when_extents_cannot_align() -> None:
    odd = KVGeometry.mha(num_layers=2, num_kv_heads=1, head_dim=6, dtype="float16", page_size=3)
    context = BackendContext(geometry=odd, layout=Layout.PAGE_FIRST)
    with pytest.raises(InvalidFieldError, match=r"uring\.o_direct"):
        validate_uring_plan(UringConfig(o_direct=True), context)
    validate_uring_plan(UringConfig(o_direct=False), context)


# --- the ring engine ---------------------------------------------------------------------


@pytest.fixture
def ring(uring_ok: None) -> Iterator[Any]:
    from kvtier.backends.uring.ring import Ring

    r = Ring(4)
    yield r
    r.close()


def test_ring_keeps_at_most_queue_depth_in_flight(uring_ok: None, tmp_path: Path) -> None:
    from kvtier.backends.uring.ring import IORequest, Op, Ring

    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    os.write(fd, os.urandom(64 * 1024))
    for depth in (1, 3, 8):
        ring = Ring(depth)
        buffers = [bytearray(1024) for _ in range(40)]
        requests = [
            IORequest(Op.READ, fd, [memoryview(b)], offset=i * 1024) for i, b in enumerate(buffers)
        ]
        ring.run(requests)
        ring.close()
        assert all(r.ok for r in requests)
        assert ring.peak_inflight == depth  # reached, never exceeded
    os.close(fd)


def test_ring_consumes_requests_lazily(ring: Any, tmp_path: Path) -> None:
    from kvtier.backends.uring.ring import IORequest, Op

    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    os.write(fd, b"x" * 4096)
    outstanding = 0
    most = 0

    def requests() -> Iterator[IORequest]:
        nonlocal outstanding, most
        for _ in range(30):
            outstanding += 1
            most = max(most, outstanding)
            yield IORequest(Op.READ, fd, [memoryview(bytearray(16))])

    def done(request: IORequest) -> None:
        nonlocal outstanding
        outstanding -= 1

    ring.run(requests(), done)
    os.close(fd)
    assert outstanding == 0
    assert most <= ring.queue_depth + 1  # the generator runs at most one ahead


def test_ring_maps_errors_to_their_request_only(ring: Any, tmp_path: Path) -> None:
    from kvtier.backends.uring.ring import IORequest, Op

    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    good = [IORequest(Op.WRITE, fd, [memoryview(b"abcd")], offset=4 * i) for i in range(5)]
    bad_fd = os.open(tmp_path / "g", os.O_RDONLY | os.O_CREAT, 0o600)  # not writable
    bad = IORequest(Op.WRITE, bad_fd, [memoryview(b"zz")])
    closed = IORequest(Op.READ, 987654, [memoryview(bytearray(2))])
    ring.run([*good[:2], bad, closed, *good[2:]])
    assert all(r.ok for r in good)
    assert bad.error == errno.EBADF and closed.error == errno.EBADF
    assert os.pread(fd, 20, 0) == b"abcd" * 5
    os.close(fd)
    os.close(bad_fd)


def test_ring_opens_files_and_reports_a_failed_open(ring: Any, tmp_path: Path) -> None:
    from kvtier.backends.uring.ring import IORequest, Op

    path = str(tmp_path / "new")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    made = IORequest(Op.OPEN, -1, paths=(path, path), open_flags=flags, mode=0o600)
    missing = str(tmp_path / "no" / "such")
    failed = IORequest(Op.OPEN, -1, paths=(missing, missing), open_flags=flags)
    again = IORequest(Op.OPEN, -1, paths=(path, path), open_flags=flags)
    ring.run([made, failed])
    assert made.ok and made.result >= 0
    assert os.write(made.result, b"xy") == 2
    os.close(made.result)
    assert Path(path).read_bytes() == b"xy" and (Path(path).stat().st_mode & 0o777) == 0o600
    assert failed.error == errno.ENOENT and failed.result == -1 and not failed.ok
    ring.run([again])  # O_EXCL: an existing file is refused
    assert again.error == errno.EEXIST and again.result == -1


def test_ring_short_read_at_end_of_file_is_not_ok(ring: Any, tmp_path: Path) -> None:
    from kvtier.backends.uring.ring import IORequest, Op

    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    os.write(fd, b"12345")
    out = bytearray(8)
    request = IORequest(Op.READ, fd, [memoryview(out)[:3], memoryview(out)[3:]])
    ring.run([request])
    os.close(fd)
    assert (request.done, request.error, request.ok) == (5, 0, False)
    assert bytes(out[:5]) == b"12345"


def test_ring_resubmits_the_rest_of_a_short_read(ring: Any) -> None:
    from kvtier.backends.uring.ring import IORequest, Op

    read_fd, write_fd = os.pipe()
    os.write(write_fd, b"abc")  # available at submission: the first read returns 3 bytes
    later = threading.Timer(0.05, lambda: os.write(write_fd, b"defghij"))
    later.start()
    out = bytearray(10)
    request = IORequest(Op.READ, read_fd, [memoryview(out)[:4], memoryview(out)[4:]])
    ring.run([request])
    later.join()
    os.close(read_fd)
    os.close(write_fd)
    assert request.ok and bytes(out) == b"abcdefghij"
    assert ring.resubmitted >= 1


def test_ring_handles_more_regions_than_iov_max(ring: Any, tmp_path: Path) -> None:
    from kvtier.backends.uring.ring import IOV_MAX, IORequest, Op

    count = IOV_MAX * 2 + 7
    src = bytearray(os.urandom(count * 3))
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    write = IORequest(Op.WRITE, fd, [memoryview(src)[i : i + 3] for i in range(0, len(src), 3)])
    ring.run([write])
    dst = bytearray(len(src))
    read = IORequest(Op.READ, fd, [memoryview(dst)[i : i + 3] for i in range(0, len(dst), 3)])
    ring.run([read])
    os.close(fd)
    assert write.ok and read.ok and dst == src


def test_waiting_releases_the_gil(ring: Any) -> None:
    """The read completes only when another Python thread has run 200k iterations."""
    from kvtier.backends.uring.ring import IORequest, Op

    read_fd, write_fd = os.pipe()
    # A watchdog outside Python writes 'W' after 20 s, so a held GIL fails instead of hanging.
    watchdog = subprocess.Popen(
        ["sh", "-c", f"sleep 20; printf W >&{write_fd}"], pass_fds=[write_fd]
    )
    counter = 0

    def spin() -> None:
        nonlocal counter
        while counter < 200_000:
            counter += 1
        os.write(write_fd, b"C")

    thread = threading.Thread(target=spin)
    out = bytearray(1)
    request = IORequest(Op.READ, read_fd, [memoryview(out)])
    thread.start()
    try:
        ring.run([request])
    finally:
        watchdog.kill()
        watchdog.wait()
        thread.join()
        os.close(read_fd)
        os.close(write_fd)
    assert request.ok
    assert bytes(out) == b"C", "the other thread could not run while the ring waited"


def test_ring_refuses_use_after_close(uring_ok: None) -> None:
    from kvtier.backends.uring.ring import Ring

    r = Ring(2)
    r.close()
    r.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        r.run([])


# --- the backend -------------------------------------------------------------------------


def test_round_trip_multi_extent_pages(make: Callable[..., UringBackend]) -> None:
    backend = make(queue_depth=4)
    cuts = (4096, 4096 + 1000, 4096 + 1000 + 3)
    datas = [_data(i, 4096 + 5000 + i) for i in range(25)]
    keys = [f"page-{i}" for i in range(25)]
    assert backend.put(keys, [_page(d, cuts) for d in datas]) == [True] * 25
    outs = [_blank(len(d), cuts) for d in datas]
    assert backend.get(keys, outs) == [True] * 25
    assert [_joined(o) for o in outs] == datas
    assert backend.exists([*keys[:2], "absent"]) == [True, True, False]
    stats = backend.stats()
    assert stats["hits"] == 25 and stats["pages"] == 25 and stats["bytes"] == sum(map(len, datas))


def test_large_pages_are_read_in_parts_in_flight_together(
    make: Callable[..., UringBackend],
) -> None:
    from kvtier.backends.uring.backend import READ_PART

    backend = make(queue_depth=8)
    size = 3 * READ_PART + 12345  # four parts, the last one short
    cuts = (4096, 4096 + READ_PART // 3)
    datas = [_data(i, size) for i in range(3)]
    keys = [f"big-{i}" for i in range(3)]
    assert backend.put(keys, [_page(d, cuts) for d in datas]) == [True] * 3
    ring = backend._rings.ring()
    before = ring.submitted
    outs = [_blank(size, cuts) for _ in datas]
    filled: list[int] = []
    assert backend.get_with(keys, outs, filled.append) == [True] * 3
    assert [_joined(o) for o in outs] == datas
    assert sorted(filled) == [0, 1, 2]  # each page once, after all its parts landed
    assert ring.submitted - before >= 3 * 4
    assert ring.peak_inflight > 1
    with open(fs_paths.page_path(backend.store, keys[1]), "r+b") as f:
        f.seek(3 * READ_PART + 7)  # a byte of the last part, read back as written
        f.write(b"\xff")
    outs = [_blank(size, cuts) for _ in datas]
    assert backend.get(keys, outs) == [True] * 3
    assert _joined(outs[1])[3 * READ_PART + 7] == 0xFF


def test_misses_and_wrong_sizes_are_false(make: Callable[..., UringBackend]) -> None:
    backend = make()
    assert backend.put(["a"], [_page(b"x" * 100)]) == [True]
    small, big, right = _blank(50), _blank(200), _blank(100)
    assert backend.get(["a", "a", "a", "nope"], [small, big, right, _blank(8)]) == [
        False,
        False,
        True,
        False,
    ]
    assert _joined(right) == b"x" * 100
    assert backend.stats()["get_size_mismatch"] == 2 and backend.stats()["misses"] == 1


def test_truncated_page_reads_as_false(make: Callable[..., UringBackend]) -> None:
    backend = make()
    assert backend.put(["t"], [_page(b"y" * 9000, (4096,))]) == [True]
    os.truncate(fs_paths.page_path(backend.store, "t"), 5000)
    out = _blank(9000, (4096,))
    assert backend.get(["t"], [out]) == [False]


def test_invalid_keys_raise_before_any_io(make: Callable[..., UringBackend]) -> None:
    backend = make()
    for bad in ("../escape", "a/b", "", "k" * 500):
        with pytest.raises(KvtierError, match="key"):
            backend.put([bad], [_page(b"z")])
        with pytest.raises(KvtierError, match="key"):
            backend.get([bad], [_blank(1)])
        with pytest.raises(KvtierError, match="key"):
            backend.exists([bad])
    assert list(backend.store.rglob("*")) == []


@pytest.mark.parametrize("queue_depth", [1, 3])
@pytest.mark.parametrize("fsync", ["none", "page", "batch"])
def test_each_durability_mode_publishes_whole_pages(
    make: Callable[..., UringBackend], fsync: str, queue_depth: int
) -> None:
    backend = make(fsync=fsync, queue_depth=queue_depth)
    datas = [_data(i, 7000) for i in range(10)]
    keys = [f"d{i}" for i in range(10)]
    assert backend.put(keys, [_page(d, (4096,)) for d in datas]) == [True] * 10
    assert _temps(backend.store) == []
    for key, data in zip(keys, datas, strict=True):
        path = fs_paths.page_path(backend.store, key)
        assert path.read_bytes() == data
        assert (path.stat().st_mode & 0o777) == fs_paths.FILE_MODE


def test_root_is_private(make: Callable[..., UringBackend], tmp_path: Path) -> None:
    backend = make()
    assert backend.put(["p"], [_page(b"1" * 10)]) == [True]
    for directory in [tmp_path / "root", backend.store, *backend.store.rglob("*")]:
        if directory.is_dir():
            assert (directory.stat().st_mode & 0o777) == fs_paths.DIR_MODE


@pytest.mark.parametrize("writer", ["file", "uring"])
def test_a_root_written_by_one_backend_is_read_by_the_other(
    make: Callable[..., UringBackend], tmp_path: Path, writer: str
) -> None:
    root = tmp_path / "root"
    datas = [_data(i, 4096 + 3000 * (i + 1)) for i in range(12)]
    keys = [f"x{i}" for i in range(12)]
    file_backend = FileBackend(FileConfig(root=root, min_free_bytes=ByteSize(0)))
    try:
        if writer == "file":
            assert file_backend.put(keys, [_page(d, (4096,)) for d in datas]) == [True] * 12
            reader: Any = make()  # built afterwards: finds the pages by scanning
        else:
            assert make().put(keys, [_page(d, (4096,)) for d in datas]) == [True] * 12
            reader = FileBackend(FileConfig(root=root, min_free_bytes=ByteSize(0)))
        assert reader.exists(keys) == [True] * 12
        outs = [_blank(len(d), (4096,)) for d in datas]
        assert reader.get(keys, outs) == [True] * 12
        assert [_joined(o) for o in outs] == datas
        assert reader.stats()["pages"] == 12
        if writer == "uring":
            reader.close()
    finally:
        file_backend.close()


def test_publish_happens_only_after_the_whole_page_is_written(
    make: Callable[..., UringBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    """New pages are renamed, replacements exchanged (never a rename over a page, which
    makes ext4 write the new file back); both only once the page is whole. The Python
    steps (compiled_io off), whose calls can be watched here; the C steps' calls are
    watched by the preloaded shim of test_compiled_loop.py's swap tests."""
    backend = make(queue_depth=2, fsync="page", compiled_io=False)
    seen: list[tuple[str, bool, bytes]] = []
    real_replace = os.replace
    real_exchange = fs_publish._exchange

    def checking_replace(src: Any, dst: Any, **kwargs: Any) -> None:
        if str(dst).startswith(str(backend.store)):
            seen.append(("rename", Path(dst).exists(), Path(src).read_bytes()))
        real_replace(src, dst, **kwargs)

    def checking_exchange(tmp: Any, final: Any) -> bool | None:
        if Path(final).exists():
            seen.append(("exchange", True, Path(tmp).read_bytes()))
        return real_exchange(tmp, final)

    monkeypatch.setattr(os, "replace", checking_replace)
    monkeypatch.setattr(fs_publish, "_exchange", checking_exchange)
    keys = [f"w{i}" for i in range(6)]
    for version in range(2):
        datas = [_data(10 * version + i, 12000) for i in range(6)]
        seen.clear()
        assert backend.put(keys, [_page(d, (4096, 5000)) for d in datas]) == [True] * 6
        assert sorted(body for _, _, body in seen) == sorted(datas)
        assert {how for how, _, _ in seen} == ({"rename"} if version == 0 else {"exchange"})
        assert all(existed == (version == 1) for _, existed, _ in seen)
        assert [fs_paths.page_path(backend.store, k).read_bytes() for k in keys] == datas
    assert _temps(backend.store) == []


@pytest.mark.parametrize(
    ("queue_depth", "batch", "submit_async", "inline"),
    [
        (1, 4, "auto", True),  # nothing can overlap: plain pwritev
        (8, 1, "auto", True),  # a one-page put: plain pwritev
        (8, 4, "auto", False),  # several pages in flight: the ring
        (1, 4, "never", False),  # an explicit mode keeps every write in the ring
        (1, 4, "always", False),
    ],
)
def test_writes_that_cannot_overlap_are_plain_pwritev(
    make: Callable[..., UringBackend],
    monkeypatch: pytest.MonkeyPatch,
    queue_depth: int,
    batch: int,
    submit_async: str,
    inline: bool,
) -> None:
    from kvtier.backends.uring import ring

    backend = make(queue_depth=queue_depth, submit_async=submit_async)
    ring_ops: list[Any] = []
    real_prepare = ring.Ring._prepare

    def recording(self: Any, request: Any, views: Any, offset: int) -> None:
        ring_ops.append(request.op)
        real_prepare(self, request, views, offset)

    monkeypatch.setattr(ring.Ring, "_prepare", recording)
    datas = [_data(i, 9000) for i in range(batch)]
    keys = [f"i{i}" for i in range(batch)]
    assert backend.put(keys, [_page(d, (4096, 5000)) for d in datas]) == [True] * batch
    assert (ring.Op.WRITE not in ring_ops) == inline
    assert [fs_paths.page_path(backend.store, k).read_bytes() for k in keys] == datas
    outs = [_blank(9000, (4096,)) for _ in keys]
    assert backend.get(keys, outs) == [True] * batch  # reads still go through the ring
    assert [_joined(o) for o in outs] == datas
    assert ring.Op.READ in ring_ops


def test_overwrite_and_concurrent_writers_leave_one_whole_page(
    make: Callable[..., UringBackend],
) -> None:
    # every put reports True: a page another writer published over one's own in the
    # moment after its move is a page of the key (publish.py, step 4), here told by the
    # header slot's leading bytes, the same in every version as an envelope's would be
    backend = make(queue_depth=4)
    header = bytes(range(256)) * 16  # the first region, 4096 bytes
    versions = [header + bytes([v]) * (50_000 - len(header)) for v in range(8)]
    errors: list[BaseException] = []

    def writer(version: bytes) -> None:
        try:
            for _ in range(5):
                assert backend.put(["hot"], [_page(version, (4096,))]) == [True]
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def reader() -> None:
        try:
            for _ in range(20):
                out = _blank(50_000, (4096,))
                if backend.get(["hot"], [out])[0]:
                    assert _joined(out) in versions
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(v,)) for v in versions]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    out = _blank(50_000, (4096,))
    assert backend.get(["hot"], [out]) == [True] and _joined(out) in versions
    assert _temps(backend.store) == []


def test_stale_temps_of_dead_writers_are_never_read_and_are_cleaned(
    make: Callable[..., UringBackend], tmp_path: Path
) -> None:
    first = make()
    assert first.put(["s"], [_page(b"a" * 100)]) == [True]
    final = fs_paths.page_path(first.store, "s")
    stale = final.parent / ".999999999.1.1.tmp"  # a writer that died mid-put
    stale.write_bytes(b"b" * 40)
    out = _blank(100)
    assert first.get(["s"], [out]) == [True] and _joined(out) == b"a" * 100
    make()  # a restart removes the temp file of the dead process
    assert not stale.exists()


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(mode=0o700)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
    )
    return done.returncode == 0


@pytest.mark.parametrize("submit_async", ["auto", "never"])  # pwritev inline / the ring
def test_enospc_fails_only_that_page_and_leaves_nothing_partial(
    make: Callable[..., UringBackend],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    submit_async: str,
) -> None:
    mount = tmp_path / "small"
    mounted = _mount_tmpfs(mount, "512k")
    try:
        if mounted:
            backend = make(root=mount / "root", submit_async=submit_async)
        elif submit_async != "auto":  # the ring creates the temp file itself
            pytest.skip("cannot mount a small tmpfs here to fill")
        else:  # no mount here: writes of the second page land in /dev/full (ENOSPC)
            backend = make(submit_async=submit_async)
            real_open_temp = fs_paths.open_temp

            def full_for_big(final: Path, *, o_direct: bool = False) -> tuple[int, Path]:
                fd, tmp = real_open_temp(final, o_direct=o_direct)
                if final.name.startswith("big"):
                    os.close(fd)
                    return os.open("/dev/full", os.O_WRONLY), tmp
                return fd, tmp

            monkeypatch.setattr(fs_paths, "open_temp", full_for_big)
        small = _data(1, 100_000)
        assert backend.put(["small1"], [_page(small, (4096,))]) == [True]
        with caplog.at_level(logging.WARNING, logger="kvtier.backends.uring"):
            assert backend.put(["big"], [_page(bytes(2_000_000), (4096,))]) == [False]
        assert backend.put(["small2"], [_page(small, (4096,))]) == [True]
        assert backend.exists(["small1", "big", "small2"]) == [True, False, True]
        assert backend.stats()["put_failed_no_space"] == 1
        assert _temps(backend.store) == []
        assert not fs_paths.page_path(backend.store, "big").exists()
        assert any("full" in r.getMessage() for r in caplog.records)
        out = _blank(len(small), (4096,))  # still serving
        assert backend.get(["small1"], [out]) == [True] and _joined(out) == small
        assert backend.put(["small3"], [_page(small, (4096,))]) == [True]
        backend.close()
    finally:
        if mounted:
            subprocess.run(["umount", str(mount)], check=False)


def test_a_bug_mid_batch_leaves_no_temp_files_or_descriptors(
    make: Callable[..., UringBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = make(queue_depth=2, capacity_bytes=10 * 5000)
    datas = [_data(i, 5000) for i in range(6)]
    real_temp_path = fs_paths.temp_path
    calls = 0

    def failing_temp_path(final: Path) -> Path:
        nonlocal calls
        calls += 1
        if calls == 4:
            raise RuntimeError("injected bug")
        return real_temp_path(final)

    backend.get(["warm"], [_blank(1)])  # the ring exists before counting descriptors
    fds_before = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(fs_paths, "temp_path", failing_temp_path)
    with pytest.raises(RuntimeError, match="injected"):
        backend.put([f"b{i}" for i in range(6)], [_page(d) for d in datas])
    monkeypatch.setattr(fs_paths, "temp_path", real_temp_path)
    assert _temps(backend.store) == []
    assert len(os.listdir("/proc/self/fd")) == fds_before
    # Nothing stays reserved: the full capacity is usable again.
    keys = [f"c{i}" for i in range(10)]
    assert backend.put(keys, [_page(_data(i, 5000)) for i in range(10)]) == [True] * 10
    assert backend.exists(keys) == [True] * 10


def test_ring_survives_a_failing_callback(ring: Any, tmp_path: Path) -> None:
    from kvtier.backends.uring.ring import IORequest, Op

    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    os.write(fd, b"z" * 4096)

    def boom(request: IORequest) -> None:
        raise ValueError("callback bug")

    requests = [IORequest(Op.READ, fd, [memoryview(bytearray(64))]) for _ in range(10)]
    with pytest.raises(ValueError, match="callback bug"):
        ring.run(requests, boom)
    again = IORequest(Op.READ, fd, [memoryview(bytearray(64))])
    ring.run([again])
    os.close(fd)
    assert again.ok and not ring.closed


def test_capacity_evicts_least_recently_used(make: Callable[..., UringBackend]) -> None:
    backend = make(capacity_bytes=3000)
    assert backend.put(["a", "b", "c"], [_page(bytes([i]) * 1000) for i in range(3)]) == [True] * 3
    assert backend.get(["a"], [_blank(1000)]) == [True]
    assert backend.put(["d"], [_page(b"d" * 1000)]) == [True]
    assert backend.exists(["a", "b", "c", "d"]) == [True, False, True, True]
    assert backend.stats()["evictions"] == 1


@pytest.mark.parametrize("fsync", ["none", "page", "batch"])
def test_a_batch_is_ranked_in_its_own_order_whatever_order_the_ring_completes_it(
    make: Callable[..., UringBackend], tmp_path: Path, fsync: str
) -> None:
    """The ring completes a batch's writes in any order; the eviction policy must still
    see them inserted in the order given (a CI run once evicted the third of three)."""
    keys = [f"k{i:02d}" for i in range(24)]
    for round_ in range(5):
        backend = make(root=tmp_path / f"{fsync}{round_}", capacity_bytes=24 * 1000, fsync=fsync)
        pages = [_page(bytes([i]) * 1000) for i in range(len(keys))]
        assert backend.put(keys, pages) == [True] * len(keys)
        assert backend.put(["late"], [_page(b"z" * 1000)]) == [True]
        assert backend.exists(keys) == [False] + [True] * (len(keys) - 1)


def test_delete_clear_and_close(make: Callable[..., UringBackend]) -> None:
    backend = make()
    assert backend.put(["a", "b"], [_page(b"1" * 10), _page(b"2" * 10)]) == [True, True]
    assert backend.delete(["a", "a", "zz"]) == [True, False, False]
    assert backend.exists(["a", "b"]) == [False, True]
    backend.clear()
    assert backend.exists(["b"]) == [False] and backend.stats()["pages"] == 0
    backend.close()
    backend.close()
    with pytest.raises(StorageError, match="closed"):
        backend.get(["b"], [_blank(10)])


def test_both_backends_refuse_calls_after_close_with_the_same_error(
    make: Callable[..., UringBackend], tmp_path: Path
) -> None:
    file_backend = FileBackend(FileConfig(root=tmp_path / "file", min_free_bytes=ByteSize(0)))
    refusals: dict[str, set[str]] = {}
    for backend in (file_backend, make()):
        assert backend.put(["a"], [_page(b"1" * 10)]) == [True]
        backend.close()
        backend.close()  # idempotent
        calls: list[tuple[Callable[..., object], tuple[Any, ...]]] = [
            (backend.exists, (["a"],)),
            (backend.get, (["a"], [_blank(10)])),
            (backend.get_with, (["a"], [_blank(10)], None)),
            (backend.put, (["b"], [_page(b"2" * 10)])),
            (backend.put_with, (["b"], [_page(b"2" * 10)], None)),
            (backend.delete, (["a"],)),
            (backend.clear, ()),
        ]
        seen = refusals.setdefault(backend.name, set())
        for call, args in calls:
            with pytest.raises(StorageError) as info:
                call(*args)
            assert info.value.value == str(backend.store)
            seen.add(str(info.value).replace(str(backend.store), "<store>"))
        assert backend.stats()["puts"] == 1  # what it did stays readable
        assert fs_paths.page_path(backend.store, "a").is_file()  # nothing was removed
    assert refusals == {
        name: {f"the {name} backend is closed; build a new one to use <store> again"}
        for name in ("file", "uring")
    }


def test_threads_each_use_their_own_ring(make: Callable[..., UringBackend]) -> None:
    backend = make(queue_depth=2)
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            keys = [f"t{worker}-{i}" for i in range(10)]
            datas = [_data(worker * 10 + i, 5000) for i in range(10)]
            assert backend.put(keys, [_page(d, (4096,)) for d in datas]) == [True] * 10
            outs = [_blank(5000, (4096,)) for _ in datas]
            assert backend.get(keys, outs) == [True] * 10
            assert [_joined(o) for o in outs] == datas
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(backend._rings._rings) >= 4


def _aligned_page(data: bytes, cuts: tuple[int, ...]) -> tuple[list[Extent], mmap.mmap]:
    """A page over 4096-aligned anonymous memory (mmap is page-aligned)."""
    area = mmap.mmap(-1, len(data))
    area[:] = data
    whole = memoryview(area)
    bounds = [0, *cuts, len(data)]
    return [extent_of_view(whole[a:b]) for a, b in itertools.pairwise(bounds)], area


def test_o_direct_reads_and_writes_aligned_memory(
    make: Callable[..., UringBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = make(o_direct=True, queue_depth=4)
    opened: list[int] = []
    real_open = os.open

    def recording_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd = real_open(path, flags, *args, **kwargs)
        if str(path).startswith(str(backend.store)):
            opened.append(flags)  # only opens that succeeded
        return fd

    real_ring_open = UringBackend._open

    def recording_ring_open(put: Any) -> Any:  # temp files created through the ring
        request = real_ring_open(put)
        opened.append(request.open_flags)
        return request

    monkeypatch.setattr(os, "open", recording_open)
    monkeypatch.setattr(UringBackend, "_open", staticmethod(recording_ring_open))
    cuts = (4096, 4096 + 8192)
    datas = [_data(i, 4096 + 8192 + 16384) for i in range(6)]
    keep = []
    pages = []
    for d in datas:
        page, area = _aligned_page(d, cuts)
        pages.append(page)
        keep.append(area)
    keys = [f"o{i}" for i in range(6)]
    assert backend.put(keys, pages) == [True] * 6
    outs = []
    for d in datas:
        page, area = _aligned_page(bytes(len(d)), cuts)
        outs.append(page)
        keep.append(area)
    assert backend.get(keys, outs) == [True] * 6
    assert [_joined(o) for o in outs] == datas
    # 6 reads, 6 creates (and a retry of each create that first made its shard dirs)
    assert len(opened) in (12, 18) and all(flags & os.O_DIRECT for flags in opened)
    assert backend.stats().get("o_direct_fallbacks", 0) == 0


def test_o_direct_with_unaligned_memory_falls_back_loudly(
    make: Callable[..., UringBackend], caplog: pytest.LogCaptureFixture
) -> None:
    backend = make(o_direct=True)
    with caplog.at_level(logging.WARNING, logger="kvtier.backends.uring"):
        assert backend.put(["u"], [_page(b"q" * 5000, (100,))]) == [True]
        out = _blank(5000, (100,))
        assert backend.get(["u"], [out]) == [True]
    assert _joined(out) == b"q" * 5000
    assert backend.stats()["o_direct_fallbacks"] == 2
    assert sum("aligned" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("submit_async", ["auto", "always", "never"])
def test_another_thread_keeps_running_during_a_large_batch(
    make: Callable[..., UringBackend], submit_async: str
) -> None:
    """While a batch waits on the disk, the GIL is free: a counting thread advances."""
    backend = make(queue_depth=8, fsync="page", submit_async=submit_async)
    datas = [_data(i, 1024 * 1024) for i in range(32)]
    keys = [f"g{i}" for i in range(32)]
    stop = threading.Event()
    counter = 0

    def spin() -> None:
        nonlocal counter
        while not stop.is_set():
            counter += 1

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        before = counter
        assert backend.put(keys, [_page(d, (4096,)) for d in datas]) == [True] * 32
        during_put = counter - before
        for key in keys:  # synced pages: drop them so the reads wait on the disk
            fd = os.open(fs_paths.page_path(backend.store, key), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        outs = [_blank(len(d), (4096,)) for d in datas]
        before = counter
        assert backend.get(keys, outs) == [True] * 32
        during_get = counter - before
    finally:
        stop.set()
        thread.join()
    assert [_joined(o) for o in outs] == datas
    assert during_put > 0 and during_get > 0


def test_pages_through_the_pagestore_reject_corruption(
    make: Callable[..., UringBackend],
) -> None:
    from kvtier.core.pagestore import PageStore

    class Pool:
        layout = Layout.PAGE_FIRST

        def __init__(self, pages: int) -> None:
            self.buffers = [
                [bytearray(4096), bytearray(6000), bytearray(6000)] for _ in range(pages)
            ]

        def header_extent(self, page: int) -> Extent:
            return extent_of_view(memoryview(self.buffers[page][0]))

        def extents(self, page: int) -> list[Extent]:
            return [extent_of_view(memoryview(b)) for b in self.buffers[page][1:]]

        def page_buffers(self, page: int) -> list[Extent]:
            return [self.header_extent(page), *self.extents(page)]

    backend = make()
    source, target = Pool(3), Pool(3)
    for page in range(3):
        for buffer in source.buffers[page][1:]:
            buffer[:] = os.urandom(len(buffer))
    keys = ["pa", "pb", "pc"]
    assert PageStore(backend, source, fingerprint="geo1").put(keys, [0, 1, 2]) == [True] * 3
    flipped = fs_paths.page_path(backend.store, "pb")
    raw = bytearray(flipped.read_bytes())
    raw[4096 + 10] ^= 0x01
    flipped.write_bytes(bytes(raw))
    os.truncate(fs_paths.page_path(backend.store, "pc"), 4096 + 100)
    store = PageStore(backend, target, fingerprint="geo1")
    assert store.get(keys, [0, 1, 2]) == [True, False, False]
    assert target.buffers[0][1:] == source.buffers[0][1:]
    assert store.stats()["invalid"] == 1 and store.stats()["misses"] == 1


# --- the conformance kit -----------------------------------------------------------------


class TestUringBackendKit(BackendKit, ConformanceTests):
    backend_name = "uring"
    extra_config = {"root": "{tmp}/pages", "min_free_bytes": 0, "queue_depth": 8}

    @pytest.fixture(autouse=True)
    def _needs_uring(self) -> None:
        _require_uring()


class TestUringBackendKitODirect(BackendKit, ConformanceTests):
    """The same kit with O_DIRECT on (the kit's host pools are 4096-aligned)."""

    backend_name = "uring"
    extra_config = {
        "root": "{tmp}/pages",
        "min_free_bytes": 0,
        "queue_depth": 4,
        "o_direct": True,
        "fsync": "batch",
    }

    @pytest.fixture(autouse=True)
    def _needs_uring(self) -> None:
        _require_uring()
