"""The segment backend: the conformance kit, crashes mid-append, reclamation, processes.

Besides the kit (with the defaults, one thread and ``fsync: "batch"``), these tests
check what the segment format promises on its own: a batch put is one record and comes
back in one read; a writer killed between a record's data and its header (or at any
moment) leaves misses, never wrong bytes, and the store reopens; readers racing
reclamation see the old page or a miss; two processes append to one root at once and
read each other's pages; capacity holds and segments go in the policy's order (oldest
first without one); debris in the root is survived; the last writer wins, across
processes and restarts; a delete stays deleted.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.backends.segment import SEGMENT_SPEC, SegmentConfig
from kvtier.backends.segment import format as fmt
from kvtier.backends.segment.backend import SegmentBackend
from kvtier.core.errors import InvalidFieldError, InvalidKeyError, StorageError
from kvtier.core.geometry import KVGeometry
from kvtier.core.host_pool import HostPool
from kvtier.core.keys import Namespace, PageKeyer
from kvtier.core.layout import Layout
from kvtier.core.pagestore import PageStore
from kvtier.core.policy import EvictionPolicy, LRUPolicy
from kvtier.core.specs import Feature
from kvtier.core.storage import BackendContext
from kvtier.core.validation import validate_model
from kvtier.testing import BackendKit, ConformanceTests

ROOT = Path(__file__).resolve().parents[1]
#: 16 KiB pages (20 KiB stored with the envelope slot), as the kit's.
GEOMETRY = KVGeometry.mha(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16)
STORED = GEOMETRY.bytes_per_page + 4096
LAYOUT = "page_first"
NAMESPACE = "ns-segment-test"


class TestSegmentBackendKit(BackendKit, ConformanceTests):
    backend_name = "segment"
    extra_config = {"root": "{tmp}/segments", "min_free_bytes": 0, "segment_bytes": "1MiB"}


class TestSegmentBackendKitPythonLoop(BackendKit, ConformanceTests):
    """The same contract with the compiled data path off (the loop used where it is not
    built)."""

    backend_name = "segment"
    extra_config = {"root": "{tmp}/segments", "min_free_bytes": 0, "compiled_io": False}


class TestSegmentBackendKitOneThreadFsync(BackendKit, ConformanceTests):
    backend_name = "segment"
    extra_config = {
        "root": "{tmp}/segments",
        "min_free_bytes": 0,
        "io_threads": 1,
        "fsync": "batch",
    }


# --- helpers ---------------------------------------------------------------------------


class Rig:
    """A segment backend on ``root`` behind a host pool and a PageStore."""

    def __init__(
        self, root: Path, *, pages: int = 64, policy: EvictionPolicy | None = None, **options: Any
    ) -> None:
        config = SegmentConfig.model_validate({"root": root, "min_free_bytes": 0, **options})
        context = BackendContext(GEOMETRY, Layout(LAYOUT), namespace=NAMESPACE, eviction=policy)
        self.backend = SegmentBackend(config, context)
        self.pool = HostPool(GEOMETRY, LAYOUT, num_pages=pages, pin_memory=False)
        self.store = PageStore(
            self.backend, self.pool, fingerprint=GEOMETRY.fingerprint, backend_call_timeout_s=None
        )
        self.keyer = PageKeyer(Namespace("segment-test", GEOMETRY.fingerprint), 16)

    def keys(self, n: int, seed: int = 0) -> list[str]:
        rng = random.Random(seed)
        return self.keyer.keys([rng.randrange(128_000) for _ in range(n * 16)])

    def fill(self, pages: list[int], seeds: list[int]) -> None:
        for page, seed in zip(pages, seeds, strict=True):
            _fill(self.pool, page, seed)

    def payload(self, page: int) -> bytes:
        return b"".join(bytes(e.view) for e in self.pool.extents(page))

    def close(self) -> None:
        self.store.close()


def _fill(pool: HostPool, page: int, seed: int) -> None:
    rng = random.Random(seed)
    for extent in pool.extents(page):
        extent.view[:] = rng.getrandbits(extent.length * 8).to_bytes(extent.length, "little")


def _expected(seed: int) -> bytes:
    pool = HostPool(GEOMETRY, LAYOUT, num_pages=1, pin_memory=False)
    _fill(pool, 0, seed)
    return b"".join(bytes(e.view) for e in pool.extents(0))


@pytest.fixture
def rigs(tmp_path: Path) -> Iterator[list[Rig]]:
    opened: list[Rig] = []
    yield opened
    for rig in opened:
        rig.close()


def _rig(rigs: list[Rig], root: Path, **options: Any) -> Rig:
    rig = Rig(root, **options)
    rigs.append(rig)
    return rig


def _segments(root: Path) -> list[Path]:
    return sorted((root / NAMESPACE).glob("*.seg"))


def _disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in _segments(root))


#: The child processes' side: a rig on a root, seeded pages, driven by a JSON job.
CHILD = textwrap.dedent(
    """
    import json, os, signal, sys, zlib
    sys.path.insert(0, {tests!r})
    from test_segment import Rig, _fill
    from kvtier.backends.segment import format as fmt
    job = json.loads(sys.argv[1])
    rig = Rig(__import__("pathlib").Path(job["root"]), pages=64, **job.get("options", {{}}))
    def put(keys, seeds):
        for lo in range(0, len(keys), 8):
            ks, ss = keys[lo:lo + 8], seeds[lo:lo + 8]
            pages = rig.pool.allocate(len(ks))
            rig.fill(pages, ss)
            assert rig.store.put(ks, pages) == [True] * len(ks), rig.backend.stats()
            rig.pool.free(pages)
    def check(keys, seeds):
        from test_segment import _expected
        pages = rig.pool.allocate(len(keys))
        got = rig.store.get(keys, pages)
        for ok, page, seed in zip(got, pages, seeds):
            if ok:
                assert rig.payload(page) == _expected(seed)
        rig.pool.free(pages)
        return sum(got)
    mode = job["mode"]
    if mode == "put":
        put(job["keys"], job["seeds"])
    elif mode == "kill_before_header":
        put(job["keys"], job["seeds"])
        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        fmt.pack_record_header = die
        put(job["more_keys"], job["more_seeds"])
    elif mode == "loop":
        n = 0
        while True:
            keys = rig.keys(8, seed=1000 + n)
            put(keys, [zlib.crc32(k.encode()) % 100000 for k in keys])
            n += 1
            if n == 1:
                print("started", flush=True)
    elif mode == "both":
        assert check(job["theirs"], job["their_seeds"]) == len(job["theirs"])
        put(job["keys"], job["seeds"])
        print("written", flush=True)
        sys.stdin.readline()
        assert rig.store.exists(job["later"]) == [True] * len(job["later"])
        assert check(job["later"], job["later_seeds"]) == len(job["later"])
    rig.close()
    print("done", flush=True)
    """
).format(tests=str(ROOT / "tests"))


def _child(root: Path, mode: str, **job: Any) -> subprocess.Popen[str]:
    job = {"root": str(root), "mode": mode, **job}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(job)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )


def _get_all(rig: Rig, keys: list[str]) -> list[bool]:
    out: list[bool] = []
    for lo in range(0, len(keys), 16):
        pages = rig.pool.allocate(len(keys[lo : lo + 16]))
        out.extend(rig.store.get(keys[lo : lo + 16], pages))
        rig.pool.free(pages)
    return out


def _put_all(rig: Rig, keys: list[str], seeds: list[int], batch: int = 8) -> list[bool]:
    out: list[bool] = []
    for lo in range(0, len(keys), batch):
        pages = rig.pool.allocate(len(keys[lo : lo + batch]))
        rig.fill(pages, seeds[lo : lo + batch])
        out.extend(rig.store.put(keys[lo : lo + batch], pages))
        rig.pool.free(pages)
    return out


def _check_hits(rig: Rig, keys: list[str], seeds: list[int]) -> int:
    """Every page found holds exactly its key's bytes; how many were found."""
    found = 0
    for key, seed in zip(keys, seeds, strict=True):
        (page,) = rig.pool.allocate(1)
        if rig.store.get([key], [page]) == [True]:
            assert rig.payload(page) == _expected(seed), f"wrong bytes for {key}"
            found += 1
        rig.pool.free([page])
    assert rig.store.stats()["invalid"] == 0
    return found


# --- the format and the data path ------------------------------------------------------


def test_spec_declares_what_the_backend_does() -> None:
    assert SEGMENT_SPEC.features == {
        Feature.PERSISTENT,
        Feature.SHARED_PROCESSES,
        Feature.ZERO_COPY,
        Feature.EXACT_EVICTION,
        Feature.REPORTS_SPACE,
    }
    assert SEGMENT_SPEC.unavailable_reason() is None


def test_a_batch_is_one_record_and_comes_back_in_one_read(rigs: list[Rig], tmp_path: Path) -> None:
    rig = _rig(rigs, tmp_path / "root")
    keys = rig.keys(8)
    pages = rig.pool.allocate(8)
    rig.fill(pages, list(range(8)))
    assert rig.store.put(keys, pages) == [True] * 8
    assert rig.backend.stats()["write_calls"] == 1
    out = rig.pool.allocate(8)
    before = rig.backend.stats()["read_calls"]
    assert rig.store.get(keys, out) == [True] * 8
    assert rig.backend.stats()["read_calls"] - before == 1
    assert [rig.payload(p) for p in out] == [_expected(i) for i in range(8)]
    # a prefix of the batch, or its middle, is one read too
    before = rig.backend.stats()["read_calls"]
    assert rig.store.get(keys[2:6], out[:4]) == [True] * 4
    assert rig.backend.stats()["read_calls"] - before == 1
    (seg,) = _segments(tmp_path / "root")
    assert stat.S_IMODE(seg.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "root" / NAMESPACE).stat().st_mode) == 0o700


def test_cold_reads_of_scattered_runs(rigs: list[Rig], tmp_path: Path) -> None:
    rig = _rig(rigs, tmp_path / "root", pages=96)
    keys = rig.keys(64)
    assert _put_all(rig, keys, list(range(64))) == [True] * 64
    (seg,) = _segments(tmp_path / "root")
    fd = os.open(seg, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    # every other batch of 8: four runs, read from disk (the page-cache pass leaves them)
    wanted = [i for lo in range(0, 64, 16) for i in range(lo, lo + 8)]
    pages = rig.pool.allocate(len(wanted))
    before = rig.backend.stats()["read_calls"]
    assert rig.store.get([keys[i] for i in wanted], pages) == [True] * len(wanted)
    assert rig.backend.stats()["read_calls"] - before == 4
    assert [rig.payload(p) for p in pages] == [_expected(i) for i in wanted]


def test_record_headers_round_trip_and_reject_damage() -> None:
    keys = ["a1", "b-2_x", "c" * 160]
    header = fmt.pack_record_header(7, keys, [10, 11, 12], [100, 200, 300])
    assert len(header) == fmt.header_bytes(3) and len(header) % fmt.ALIGN == 0
    record, need = fmt.parse_record(header, 4096, 7)
    assert record is not None and need == 0
    assert [e.key for e in record.entries] == keys
    assert record.data_bytes == 600 and record.end == fmt.align(4096 + len(header) + 600)
    assert fmt.parse_record(header, 4096, 8) == (None, -1)  # another segment's record
    assert fmt.parse_record(bytes(len(header)), 4096, 7) == (None, -1)  # nothing published
    for cut in (10, fmt.FIXED_BYTES + 5):
        assert fmt.parse_record(header[:cut], 4096, 7)[0] is None  # a torn header
    flipped = bytearray(header)
    flipped[fmt.FIXED_BYTES + 20] ^= 1
    assert fmt.parse_record(bytes(flipped), 4096, 7) == (None, -1)
    dead = bytearray(header)
    dead[fmt.state_offset(0, 3, 1)] = fmt.DEAD
    record, _ = fmt.parse_record(bytes(dead), 4096, 7)
    assert record is not None and [e.live for e in record.entries] == [True, False, True]


def test_keys_are_checked_before_anything_is_stored(rigs: list[Rig], tmp_path: Path) -> None:
    rig = _rig(rigs, tmp_path / "root")
    page = rig.pool.page_buffers(rig.pool.allocate(1)[0])
    for bad in ("../x", "A", "", "x" * 161):
        with pytest.raises(InvalidKeyError):
            rig.backend.put([bad], [page])
        with pytest.raises(InvalidKeyError):
            rig.backend.exists([bad])
    with pytest.raises(StorageError, match="2 keys but 1 pages"):
        rig.backend.get(["a", "b"], [page])


def test_config_errors_name_the_field_and_the_fix() -> None:
    with pytest.raises(InvalidFieldError, match=r"capacity_bytes.*at least twice segment_bytes"):
        validate_model(
            SegmentConfig,
            {"capacity_bytes": "3MiB", "segment_bytes": "2MiB"},
            where="extra_config",
        )
    with pytest.raises(InvalidFieldError, match="segment_bytes"):
        validate_model(SegmentConfig, {"segment_bytes": 4096}, where="extra_config")


def test_the_docs_options_table_is_the_config_model() -> None:
    doc = (ROOT / "docs" / "segment-backend.md").read_text(encoding="utf-8")
    doc = doc.split("## Options", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(\w+)` \|[^|]*\|[^|]*\| (.*?) \|$", doc, re.M))
    assert set(rows) == set(SegmentConfig.model_fields)
    for name, info in SegmentConfig.model_fields.items():
        assert rows[name] == info.description, name


def test_a_page_larger_than_a_segment_gets_one_of_its_own(rigs: list[Rig], tmp_path: Path) -> None:
    big = KVGeometry.mha(num_layers=4, num_kv_heads=8, head_dim=128, page_size=256)
    assert big.bytes_per_page > 1 << 20
    backend = SegmentBackend(
        SegmentConfig.model_validate(
            {"root": tmp_path / "root", "segment_bytes": "1MiB", "min_free_bytes": 0}
        ),
        BackendContext(big, Layout(LAYOUT), namespace=NAMESPACE),
    )
    pool = HostPool(big, LAYOUT, num_pages=7, pin_memory=False)
    store = PageStore(backend, pool, fingerprint=big.fingerprint)
    keys = [f"big-{i}" for i in range(3)]
    pages = pool.allocate(3)
    for i, page in enumerate(pages):
        _fill(pool, page, i)
    payloads = [b"".join(bytes(e.view) for e in pool.extents(p)) for p in pages]
    assert store.put(keys, pages) == [True] * 3
    out = pool.allocate(1)
    for key, expected in zip(keys, payloads, strict=True):
        assert store.get([key], out) == [True]
        assert b"".join(bytes(e.view) for e in pool.extents(out[0])) == expected
    assert len(_segments(tmp_path / "root")) == 3
    # cold, in one batch: the page-cache pass stops at the first piece on disk and the
    # blocking pass resumes there, each piece handed to the core's checksum once
    for seg in _segments(tmp_path / "root"):
        fd = os.open(seg, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 4 << 20, 0, os.POSIX_FADV_DONTNEED)  # the second half of each
        os.close(fd)
    out = pool.allocate(3)
    assert store.get(keys, out) == [True] * 3
    assert [b"".join(bytes(e.view) for e in pool.extents(p)) for p in out] == payloads
    assert store.stats()["invalid"] == 0
    store.close()


# --- crashes ---------------------------------------------------------------------------


def test_sigkill_between_data_and_header_leaves_a_miss_and_the_store_reopens(
    rigs: list[Rig], tmp_path: Path
) -> None:
    root = tmp_path / "root"
    probe = Rig(root)
    first, more = probe.keys(16, seed=1), probe.keys(8, seed=2)
    probe.close()
    child = _child(
        root,
        "kill_before_header",
        keys=first,
        seeds=list(range(16)),
        more_keys=more,
        more_seeds=list(range(100, 108)),
    )
    _, err = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGKILL, err
    (seg,) = _segments(root)
    # the killed put's pages were written after the last published record
    assert seg.stat().st_size > 4096 + fmt.header_bytes(8) * 2 + 16 * STORED
    rig = _rig(rigs, root)
    assert rig.store.exists(first) == [True] * 16
    assert rig.store.exists(more) == [False] * 8
    assert _check_hits(rig, first, list(range(16))) == 16
    assert _get_all(rig, more) == [False] * 8
    assert rig.backend.stats()["segments_torn"] == 1
    # the store keeps serving: those keys can be put again, into a new segment
    assert _put_all(rig, more, list(range(100, 108))) == [True] * 8
    assert _check_hits(rig, more, list(range(100, 108))) == 8
    assert len(_segments(root)) == 2


def test_sigkill_at_any_moment_never_yields_wrong_bytes(rigs: list[Rig], tmp_path: Path) -> None:
    root = tmp_path / "root"
    for attempt in range(3):
        child = _child(root, "loop", options={"segment_bytes": "1MiB"})
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "started", child.stderr
        time.sleep(0.05 + 0.1 * attempt + random.random() * 0.1)
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
        rig = Rig(root)
        keys = [k for n in range(400) for k in rig.keys(8, seed=1000 + n)]
        found = _check_hits(rig, keys, [zlib.crc32(k.encode()) % 100000 for k in keys])
        assert found >= 8
        assert rig.backend.stats()["pages"] >= found
        rig.close()


def test_torn_and_truncated_tails_are_misses(rigs: list[Rig], tmp_path: Path) -> None:
    root = tmp_path / "root"
    rig = Rig(root)
    keys = rig.keys(24)
    assert _put_all(rig, keys, list(range(24))) == [True] * 24
    rig.close()
    (seg,) = _segments(root)
    size = seg.stat().st_size
    # cut the last record's data short, then append a torn header after it
    with open(seg, "r+b") as f:
        f.truncate(size - STORED // 2)
        f.seek(0, os.SEEK_END)
        f.write(b"\x00" * (-f.tell() % 4096) + fmt.pack_record_header(1, ["k"], [1], [9])[:30])
    rig = _rig(rigs, root)
    assert rig.store.exists(keys) == [True] * 16 + [False] * 8
    assert _check_hits(rig, keys, list(range(24))) == 16
    assert rig.backend.stats()["segments_torn"] == 1


# --- reclamation -----------------------------------------------------------------------


def test_capacity_holds_and_the_oldest_segment_goes_first(rigs: list[Rig], tmp_path: Path) -> None:
    root = tmp_path / "root"
    rig = _rig(rigs, root, segment_bytes="1MiB", capacity_bytes="3MiB")
    keys = rig.keys(400)
    seeds = list(range(400))
    for lo in range(0, 400, 8):
        assert _put_all(rig, keys[lo : lo + 8], seeds[lo : lo + 8]) == [True] * 8
        assert _disk_bytes(root) <= 3 << 20
        assert rig.backend.stats()["segment_bytes"] <= 3 << 20
    found = rig.store.exists(keys)
    # FIFO by segment: what is left is a suffix of the puts
    first = found.index(True)
    assert all(found[first:]) and not any(found[:first])
    assert 60 < sum(found) < 160
    stats = rig.backend.stats()
    assert stats["segments_reclaimed"] >= 3 and stats["evictions"] == 400 - sum(found)
    assert _check_hits(rig, keys[first:], seeds[first:]) == sum(found)


def test_with_a_policy_hot_pages_are_rewritten_and_cold_ones_dropped(
    rigs: list[Rig], tmp_path: Path
) -> None:
    root = tmp_path / "root"
    policy = LRUPolicy()
    rig = _rig(rigs, root, policy=policy, segment_bytes="1MiB", capacity_bytes="3MiB")
    keys = rig.keys(400)
    seeds = list(range(400))
    hot = keys[:8]
    assert _put_all(rig, hot, seeds[:8]) == [True] * 8
    for lo in range(8, 400, 8):
        assert _put_all(rig, keys[lo : lo + 8], seeds[lo : lo + 8]) == [True] * 8
        assert _get_all(rig, hot) == [True] * 8  # kept hot: the policy never picks them
        assert _disk_bytes(root) <= 3 << 20
    stats = rig.backend.stats()
    assert stats["pages_rewritten"] >= 8 and stats["evictions"] > 0
    assert _check_hits(rig, hot, seeds[:8]) == 8
    assert len(policy) == stats["pages"] == sum(rig.store.exists(keys))
    assert policy.nbytes == stats["bytes"]


def test_overwrites_do_not_grow_the_store_without_bound(rigs: list[Rig], tmp_path: Path) -> None:
    root = tmp_path / "root"
    rig = _rig(rigs, root, segment_bytes="1MiB")
    keys = rig.keys(40)
    for round_ in range(12):
        assert _put_all(rig, keys, [round_ * 100 + i for i in range(40)]) == [True] * 40
    stats = rig.backend.stats()
    assert stats["segments_compacted"] >= 3 and stats["evictions"] == 0
    assert _disk_bytes(root) <= 3 << 20  # 12 rounds are ~10 MiB of appends
    assert _check_hits(rig, keys, [1100 + i for i in range(40)]) == 40


def _all_bytes(root: Path) -> int:
    """Every file's bytes in the namespace, hidden ones too (a spare, the instances file)."""
    return sum(p.stat().st_size for p in (root / NAMESPACE).iterdir() if p.is_file())


def test_an_instance_alone_writes_new_segments_into_dead_ones_files(
    rigs: list[Rig], tmp_path: Path
) -> None:
    root = tmp_path / "root"
    rig = _rig(rigs, root, segment_bytes="1MiB", capacity_bytes="3MiB")
    keys = rig.keys(40)
    for round_ in range(12):
        assert _put_all(rig, keys, [round_ * 100 + i for i in range(40)]) == [True] * 40
        assert _all_bytes(root) <= (3 << 20) + 4096  # a spare counts against capacity
    stats = rig.backend.stats()
    assert stats["segments_reused"] >= 3 and stats["evictions"] == 0
    assert _check_hits(rig, keys, [1100 + i for i in range(40)]) == 40
    # past capacity the oldest segment is reclaimed, its pages dropped: its file too
    # becomes the next segment, and the bound holds on disk
    more = rig.keys(160, seed=1)
    for lo in range(0, 160, 40):
        assert _put_all(rig, more[lo : lo + 40], list(range(lo, lo + 40))) == [True] * 40
        assert _all_bytes(root) <= (3 << 20) + 4096
    after = rig.backend.stats()
    assert after["segments_reclaimed"] >= 1 and after["segments_reused"] > stats["segments_reused"]
    assert _check_hits(rig, more[-40:], list(range(120, 160))) == 40
    keys, seeds = more[-40:], list(range(120, 160))
    inodes = {p.stat().st_ino for p in _segments(root)}
    rig.close()
    rigs.remove(rig)
    # sealed at close, every reused segment was cut at its records' end: a fresh opener
    # finds every newest page and no hole
    again = _rig(rigs, root, segment_bytes="1MiB", capacity_bytes="3MiB")
    assert _check_hits(again, keys, seeds) == 40
    fresh = again.backend.stats()
    assert fresh["segments_torn"] == 0 and fresh["holes_skipped"] == 0
    assert {p.stat().st_ino for p in _segments(root)} == inodes
    assert not [p for p in (root / NAMESPACE).iterdir() if p.name.endswith(".tmp")]


def test_no_segment_file_is_reused_while_another_instance_is_open(
    rigs: list[Rig], tmp_path: Path
) -> None:
    root = tmp_path / "root"
    rig = _rig(rigs, root, segment_bytes="1MiB")
    other = _rig(rigs, root, segment_bytes="1MiB")
    keys = rig.keys(40)
    for round_ in range(8):
        seeds = [round_ * 100 + i for i in range(40)]
        assert _put_all(rig, keys, seeds) == [True] * 40
        other.backend.rescan()
        assert _check_hits(other, keys, seeds) == 40  # the other reads every newest page
    stats = rig.backend.stats()
    assert stats["segments_compacted"] >= 2 and stats["segments_reused"] == 0
    other.close()
    rigs.remove(other)
    for round_ in range(8, 12):
        assert _put_all(rig, keys, [round_ * 100 + i for i in range(40)]) == [True] * 40
    assert rig.backend.stats()["segments_reused"] >= 1  # alone again


@pytest.mark.parametrize("policy", [None, "lru"])
def test_readers_racing_reclamation_see_the_old_page_or_a_miss(
    rigs: list[Rig], tmp_path: Path, policy: str | None
) -> None:
    rig = _rig(
        rigs,
        tmp_path / "root",
        pages=96,
        policy=LRUPolicy() if policy else None,
        segment_bytes="1MiB",
        capacity_bytes="2MiB",
    )
    keys = rig.keys(600)
    seeds = [1000 + i for i in range(600)]
    expected = {k: _expected(s) for k, s in zip(keys, seeds, strict=True)}
    written: list[str] = []
    stop = threading.Event()
    errors: list[BaseException] = []
    hits = [0]

    def write() -> None:
        try:
            for lo in range(0, len(keys), 8):
                assert _put_all(rig, keys[lo : lo + 8], seeds[lo : lo + 8]) == [True] * 8
                written.extend(keys[lo : lo + 8])
        except BaseException as exc:
            errors.append(exc)
        finally:
            stop.set()

    def read() -> None:
        rng = random.Random(threading.get_ident())
        pages = rig.pool.allocate(8)
        try:
            while not stop.is_set():
                if len(written) < 8:
                    continue
                start = rng.randrange(len(written) - 7)
                batch = written[start : start + 8]
                got = rig.store.get(batch, pages)
                for ok, page, key in zip(got, pages, batch, strict=True):
                    if ok:
                        assert rig.payload(page) == expected[key]
                        hits[0] += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert rig.store.stats()["invalid"] == 0
    assert rig.backend.stats()["segments_reclaimed"] >= 5
    assert hits[0] > 0


# --- several processes -----------------------------------------------------------------


def test_two_processes_append_at_once_and_read_each_others_pages(
    rigs: list[Rig], tmp_path: Path
) -> None:
    root = tmp_path / "root"
    rig = _rig(rigs, root)
    mine_before, theirs, mine_later = rig.keys(16, 1), rig.keys(40, 2), rig.keys(40, 3)
    assert _put_all(rig, mine_before, list(range(16))) == [True] * 16
    child = _child(
        root,
        "both",
        theirs=mine_before,
        their_seeds=list(range(16)),
        keys=theirs,
        seeds=list(range(100, 140)),
        later=mine_later,
        later_seeds=list(range(200, 240)),
    )
    assert child.stdout is not None and child.stdin is not None
    # both append at once: this process into its segment, the child into its own
    assert _put_all(rig, mine_later, list(range(200, 240)), batch=4) == [True] * 40
    assert child.stdout.readline().strip() == "written", child.stderr.read() if child.stderr else ""
    assert rig.store.exists(theirs) == [True] * 40
    assert _check_hits(rig, theirs, list(range(100, 140))) == 40
    child.stdin.write("go\n")
    child.stdin.flush()
    _, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert len(_segments(root)) == 2
    # another opening (the child's segment sealed, this rig's still written) finds all
    again = _rig(rigs, root)
    assert again.store.exists(mine_before + theirs + mine_later) == [True] * 96


def test_the_last_writer_wins_across_processes_and_restarts(
    rigs: list[Rig], tmp_path: Path
) -> None:
    root = tmp_path / "root"
    rig = _rig(rigs, root)
    keys = rig.keys(8)
    assert _put_all(rig, keys, list(range(8))) == [True] * 8
    child = _child(root, "put", keys=keys, seeds=list(range(50, 58)))
    _, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    rig.backend.rescan()
    assert _check_hits(rig, keys, list(range(50, 58))) == 8
    assert _put_all(rig, keys[:4], list(range(70, 74))) == [True] * 4
    rig.close()
    rigs.remove(rig)
    again = _rig(rigs, root)
    assert _check_hits(again, keys, [70, 71, 72, 73, 54, 55, 56, 57]) == 8


def test_a_deleted_page_stays_deleted_after_overwrites_and_restarts(
    rigs: list[Rig], tmp_path: Path
) -> None:
    root = tmp_path / "root"
    rig = Rig(root)
    keys = rig.keys(8)
    for round_ in range(3):
        assert _put_all(rig, keys, [round_ * 10 + i for i in range(8)]) == [True] * 8
    assert rig.backend.delete(keys[:3]) == [True] * 3
    assert rig.backend.delete(keys[:1]) == [False]
    rig.close()
    again = _rig(rigs, root)
    assert again.store.exists(keys) == [False] * 3 + [True] * 5
    assert _check_hits(again, keys[3:], [20 + i for i in range(3, 8)]) == 5


# --- debris ----------------------------------------------------------------------------


def test_debris_in_the_root_is_survived(rigs: list[Rig], tmp_path: Path) -> None:
    root = tmp_path / "root"
    rig = Rig(root)
    keys = rig.keys(16)
    assert _put_all(rig, keys, list(range(16))) == [True] * 16
    rig.close()
    store = root / NAMESPACE
    (seg,) = _segments(root)
    # a copy of the segment cut in its second record: its first record still serves
    (store / fmt.segment_name(1, 1)).write_bytes(b"")  # a zero-length segment
    (store / fmt.segment_name(2, 2)).write_bytes(b"not a segment" * 400)
    (store / "stray.txt").write_text("hello")
    (store / "a-dir").mkdir()
    (store / "a-dir" / "inner").write_text("x")
    os.symlink("/etc/passwd", store / "link.seg")
    os.symlink(seg, store / fmt.segment_name(3, 3))
    os.mkfifo(store / "fifo")
    (store / fmt.temp_name(4, 4, 999_999_999)).write_bytes(b"half a segment")
    os.chmod(seg, 0o644)
    rig = _rig(rigs, root)
    stats = rig.backend.stats()
    assert stats["debris_foreign_files"] == 3  # the stray file and the two bad segments
    assert stats["segments_bad"] == 2
    assert stats["debris_dirs"] == 1 and stats["debris_symlinks"] == 2
    assert stats["debris_special"] == 1 and stats["debris_stale_temps"] == 1
    assert stats["debris_modes_fixed"] == 1
    assert sorted(p.name for p in store.iterdir()) == [fmt.INSTANCES, seg.name]
    assert _check_hits(rig, keys, list(range(16))) == 16


def test_a_truncated_segment_serves_its_intact_records(rigs: list[Rig], tmp_path: Path) -> None:
    root = tmp_path / "root"
    rig = Rig(root)
    keys = rig.keys(16)
    assert _put_all(rig, keys, list(range(16))) == [True] * 16
    rig.close()
    (seg,) = _segments(root)
    with open(seg, "r+b") as f:
        f.truncate(4096 + fmt.header_bytes(8) + 8 * STORED + 100)  # into the 2nd header
    rig = _rig(rigs, root)
    assert rig.store.exists(keys) == [True] * 8 + [False] * 8
    assert _check_hits(rig, keys, list(range(16))) == 8
    # truncated under a running store: the pages past the end are misses, then gone
    with open(seg, "r+b") as f:
        f.truncate(4096 + fmt.header_bytes(8) + 4 * STORED)
    assert _check_hits(rig, keys[:8], list(range(8))) == 4
    assert rig.store.exists(keys[:8]) == [True] * 4 + [False] * 4
