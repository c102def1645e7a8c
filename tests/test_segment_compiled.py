"""The segment backend's compiled data path against its Python loop.

Both paths write the same pages and envelopes and give the same verdicts: pages written
by one read back through the other; runs of nearby records come back in one read; a
damaged page in a run is rejected for its own reason while its neighbours are served;
large pages (written and read in hashed pieces) are checked the same way; a page another
process deleted is a miss.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvtier.backends.segment import compiled
from kvtier.backends.segment.backend import SegmentBackend
from kvtier.backends.segment.config import SegmentConfig
from kvtier.core.geometry import KVGeometry
from kvtier.core.host_pool import HostPool
from kvtier.core.keys import Namespace, PageKeyer
from kvtier.core.layout import Layout
from kvtier.core.pagestore import PageStore
from kvtier.core.storage import BackendContext

pytestmark = pytest.mark.skipif(
    not compiled.available(), reason="the compiled page loop (_pageio) was not built"
)

SMALL = KVGeometry.mha(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16)  # 16 KiB
#: 1 MiB pages: more than two pieces, so written and read in hashed pieces.
LARGE = KVGeometry.mha(num_layers=8, num_kv_heads=4, head_dim=128, page_size=64)
NAMESPACE = "ns-compiled"


class Side:
    """A segment backend on ``root`` (compiled path on or off) behind a PageStore."""

    def __init__(self, root: Path, geometry: KVGeometry, *, compiled_io: bool, **options: Any):
        config = SegmentConfig.model_validate(
            {"root": root, "min_free_bytes": 0, "compiled_io": compiled_io, **options}
        )
        context = BackendContext(geometry, Layout("page_first"), namespace=NAMESPACE)
        self.backend = SegmentBackend(config, context)
        self.pool = HostPool(geometry, "page_first", num_pages=32, pin_memory=False)
        self.store = PageStore(
            self.backend, self.pool, fingerprint=geometry.fingerprint, backend_call_timeout_s=None
        )
        self.keyer = PageKeyer(Namespace("compiled-test", geometry.fingerprint), 16)

    def keys(self, n: int, start: int = 0) -> list[str]:
        return self.keyer.keys(list(range(start * 16, (start + n) * 16)))

    def put(self, keys: list[str], seed: int) -> list[bytes]:
        pages = self.pool.allocate(len(keys))
        payloads = []
        for j, page in enumerate(pages):
            payloads.append(_fill(self.pool, page, seed + j))
        assert self.store.put(keys, pages) == [True] * len(keys)
        self.pool.free(pages)
        return payloads

    def get(self, keys: list[str]) -> tuple[list[bool], list[bytes]]:
        pages = self.pool.allocate(len(keys))
        found = self.store.get(keys, pages)
        payloads = [b"".join(bytes(e.view) for e in self.pool.extents(p)) for p in pages]
        self.pool.free(pages)
        return found, payloads

    def close(self) -> None:
        self.store.close()


def _fill(pool: HostPool, page: int, seed: int) -> bytes:
    out = []
    for extent in pool.extents(page):
        data = os.urandom(extent.length) if seed < 0 else bytes([seed % 251]) * extent.length
        extent.view[:] = data
        out.append(data)
    return b"".join(out)


@pytest.fixture
def sides(tmp_path: Path):  # type: ignore[no-untyped-def]
    opened: list[Side] = []

    def make(geometry: KVGeometry = SMALL, *, compiled_io: bool, **options: Any) -> Side:
        side = Side(tmp_path / "root", geometry, compiled_io=compiled_io, **options)
        opened.append(side)
        return side

    yield make
    for side in opened:
        side.close()


def _segment_file(tmp_path: Path) -> Path:
    (path,) = sorted((tmp_path / "root" / NAMESPACE).glob("*.seg"))
    return path


def _damage(path: Path, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), offset)
    finally:
        os.close(fd)


def test_the_compiled_path_is_what_a_page_store_uses(sides) -> None:  # type: ignore[no-untyped-def]
    assert sides(compiled_io=True).backend.checks_envelopes is True
    assert sides(compiled_io=False).backend.checks_envelopes is False


@pytest.mark.parametrize("geometry", [SMALL, LARGE], ids=["16KiB", "1MiB"])
@pytest.mark.parametrize("writer", [True, False], ids=["compiled-writes", "python-writes"])
def test_either_path_reads_what_the_other_wrote(sides, geometry: KVGeometry, writer: bool) -> None:  # type: ignore[no-untyped-def]
    write = sides(geometry, compiled_io=writer)
    read = sides(geometry, compiled_io=not writer)
    keys = write.keys(6)
    payloads = write.put(keys[:3], 1) + write.put(keys[3:], 7)
    read.backend.rescan()
    found, got = read.get(keys)
    assert found == [True] * 6
    assert got == payloads
    assert read.store.stats()["invalid"] == 0


def test_nearby_records_come_back_in_one_read(sides) -> None:  # type: ignore[no-untyped-def]
    side = sides(compiled_io=True)
    keys = side.keys(6)
    payloads = side.put(keys[:2], 1) + side.put(keys[2:4], 3) + side.put(keys[4:], 5)
    assert side.backend.stats()["write_calls"] == 3
    before = side.backend.stats()["read_calls"]
    found, got = side.get(keys)
    assert found == [True] * 6 and got == payloads
    # three records, a header apart each: one read
    assert side.backend.stats()["read_calls"] - before == 1


@pytest.mark.parametrize("geometry", [SMALL, LARGE], ids=["16KiB", "1MiB"])
@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_damaged_page_is_rejected_and_its_neighbours_served(  # type: ignore[no-untyped-def]
    sides, tmp_path: Path, geometry: KVGeometry, where: str
) -> None:
    side = sides(geometry, compiled_io=True)
    keys = side.keys(3)
    payloads = side.put(keys, 11)
    middle = side.backend._store.location(keys[1])
    assert middle is not None
    stored = middle[2]
    _damage(_segment_file(tmp_path), middle[1] + (stored - 100 if where == "payload" else 40))
    found, got = side.get(keys)
    assert found == [True, False, True]
    assert got[0] == payloads[0] and got[2] == payloads[2]
    stats = side.store.stats()
    reason = "invalid_corrupt_checksum" if where == "payload" else "invalid_corrupt_header"
    assert stats["invalid"] == 1 and stats[reason] == 1


def test_a_page_another_instance_deleted_is_a_miss(sides) -> None:  # type: ignore[no-untyped-def]
    reader = sides(compiled_io=True)
    keys = reader.keys(4)
    reader.put(keys, 21)
    other = sides(compiled_io=True)
    assert other.backend.delete([keys[2]]) == [True]
    found, _ = reader.get(keys)
    assert found == [True, True, False, True]
    assert reader.backend.stats()["get_gone"] == 1
    assert reader.store.stats()["invalid"] == 0


def test_a_write_that_fails_publishes_nothing(sides, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    side = sides(compiled_io=True)
    keys = side.keys(2)

    def refuse(*args: Any) -> None:
        raise OSError(28, os.strerror(28))

    monkeypatch.setattr(compiled, "write", refuse)
    pages = side.pool.allocate(2)
    assert side.store.put(keys, pages) == [False, False]
    assert side.backend.stats()["put_failed_no_space"] == 2
    monkeypatch.undo()
    assert side.store.exists(keys) == [False, False]


def test_the_compiled_calls_refuse_malformed_arguments(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        region = memoryview(bytearray(8192))
        with pytest.raises(ValueError, match="checked page key"):
            compiled.write(fd, 0, ["../x"], [[region[:4096], region[4096:]]], bytes(56))
        with pytest.raises(ValueError, match="differ in length"):
            compiled.read(
                [fd],
                [0, 1],
                ["a"],
                [[region[:4096], region[4096:]]],
                bytes(56),
                full=True,
                nowait=False,
            )
        with pytest.raises(ValueError, match="negative"):
            compiled.read(
                [fd],
                [-1],
                ["a"],
                [[region[:4096], region[4096:]]],
                bytes(56),
                full=True,
                nowait=False,
            )
    finally:
        os.close(fd)


#: The child's side of the file-size-limit test: the kernel refuses the compiled call's
#: writes past a limit (EFBIG), mid-record.
_LIMITED = """
import json, os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
sys.path.insert(0, {tests!r})
from pathlib import Path
from test_segment_compiled import SMALL, Side
side = Side(Path({root!r}), SMALL, compiled_io=True)
keys = side.keys(8)
side.put(keys[:2], 1)
(segment,) = Path({root!r}).rglob("*.seg")
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
# room for the next record's header and about one of its six pages
resource.setrlimit(resource.RLIMIT_FSIZE, (segment.stat().st_size + 4096 + 30000, hard))
pages = side.pool.allocate(6)
failed = side.store.put(keys[2:], pages)
side.pool.free(pages)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
stats = side.backend.stats()
side.put(keys[2:], 9)
print(json.dumps({{"failed": failed, "errors": stats["put_failed_errors"]}}))
side.close()
"""


def test_a_write_the_kernel_refuses_mid_record_publishes_nothing(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    root = tmp_path / "root"
    tests = str(Path(__file__).resolve().parent)
    child = subprocess.run(
        [sys.executable, "-c", _LIMITED.format(tests=tests, root=str(root))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    out = json.loads(child.stdout.strip().splitlines()[-1])
    assert out["failed"] == [False] * 6 and out["errors"] == 6
    # a fresh opener finds the first put and the retried one, every page whole
    side = Side(root, SMALL, compiled_io=True)
    try:
        found, _ = side.get(side.keys(8))
        assert found == [True] * 8
        assert side.store.stats()["invalid"] == 0
    finally:
        side.close()


@pytest.mark.parametrize("regions", [3, 1500], ids=["few-regions", "more-than-iov-max"])
def test_the_calls_round_trip_pages_of_any_number_of_regions(tmp_path: Path, regions: int) -> None:
    from kvtier.core.envelope import EnvelopeFormat

    keys = ["page-a", "page-b", "page-c"]
    static = EnvelopeFormat(SMALL.fingerprint, "page_first").batch(keys).static
    size = 96 if regions > 1000 else 96 * 500
    written = []
    pages = []
    for _ in range(3):
        slot = bytearray(4096)
        payload = [bytearray(os.urandom(size)) for _ in range(regions)]
        written.append(b"".join(payload))
        pages.append([memoryview(slot), *(memoryview(part) for part in payload)])
    fd = os.open(tmp_path / "seg", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        stored = 4096 + regions * size
        compiled.write(fd, 8192, keys, pages, static)
        assert os.fstat(fd).st_size == 8192 + 3 * stored
        back = [
            [memoryview(bytearray(4096)), *(memoryview(bytearray(size)) for _ in range(regions))]
            for _ in range(3)
        ]
        offsets = [8192 + j * stored for j in range(3)]
        codes, reads = compiled.read([fd] * 3, offsets, keys, back, static, full=True, nowait=False)
        assert codes == [compiled.OK] * 3
        assert reads == (3 if regions > 1000 else 1)
        assert [b"".join(bytes(v) for v in page[1:]) for page in back] == written
        last = offsets[1] + stored - 1  # the middle page's last byte, flipped
        os.pwrite(fd, bytes([os.pread(fd, 1, last)[0] ^ 0xFF]), last)
        codes, _ = compiled.read([fd] * 3, offsets, keys, back, static, full=True, nowait=False)
        assert codes == [compiled.OK, compiled.UNVERIFIED, compiled.OK]
        # another key's envelope at the same bytes is not this page's
        codes, _ = compiled.read(
            [fd], offsets[:1], ["page-x"], back[:1], static, full=True, nowait=False
        )
        assert codes == [compiled.UNVERIFIED]
    finally:
        os.close(fd)


def _tmpfs() -> Path | None:
    """/dev/shm where it is a tmpfs (no page-cache-only reads: RWF_NOWAIT is refused)."""
    shm = Path("/dev/shm")
    try:
        with open("/proc/mounts") as mounts:
            kinds = {line.split()[1]: line.split()[2] for line in mounts if len(line.split()) > 2}
    except OSError:
        return None
    return shm if kinds.get(str(shm)) == "tmpfs" and os.access(shm, os.W_OK) else None


@pytest.mark.skipif(_tmpfs() is None, reason="no writable tmpfs at /dev/shm")
@pytest.mark.parametrize("compiled_io", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("geometry", [SMALL, LARGE], ids=["16KiB", "1MiB"])
def test_a_filesystem_without_page_cache_only_reads_is_read_blocking(
    geometry: KVGeometry, compiled_io: bool
) -> None:
    import shutil
    import tempfile

    shm = _tmpfs()
    assert shm is not None
    root = Path(tempfile.mkdtemp(dir=shm, prefix="kvtier-test-"))
    side = Side(root, geometry, compiled_io=compiled_io)
    try:
        keys = side.keys(6)
        payloads = side.put(keys[:3], 1) + side.put(keys[3:], 4)
        for _ in range(2):  # the first get finds RWF_NOWAIT refused, the second knows
            found, got = side.get(keys)
            assert found == [True] * 6 and got == payloads
        assert side.backend.stats()["get_errors"] == 0
    finally:
        side.close()
        shutil.rmtree(root, ignore_errors=True)
