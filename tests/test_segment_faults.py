"""The segment backend under faults: failed writes, kills, full disks, other instances.

Each test drives one fault through the segment store and checks, with every byte
compared, that no page is wrong, that every page a put acknowledged is still there where
the store promises it, and that the store keeps working once the fault is gone:

- a write that fails half-way (``ENOSPC`` from ``pwritev``) is stepped over: the store
  keeps appending, the segment is sealed and reclaimed, and another opener finds every
  page the writer serves;
- another instance's ``clear`` on the shared root does not stop this one's puts;
- ``fsync: "batch"``: a put acknowledged while an earlier put was still writing survives
  a SIGKILL of the process (the scan looks past the unfinished record);
- a kill at any point of a compaction leaves every live page, in its newest version;
- on a full disk (a real, small tmpfs) the put that triggers a compaction is stored;
- a batch that runs out of space half-way says which pages are stored, page by page;
- a segment hard-linked from outside the root is never written into.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_segment import (
    STORED,
    Rig,
    _check_hits,
    _disk_bytes,
    _put_all,
    _rig,
    _segments,
)

from kvtier.backends.segment import compiled
from kvtier.backends.segment import format as fmt
from kvtier.backends.segment import writer as seg_writer

TESTS = Path(__file__).resolve().parent
#: Pages per put batch in these tests (one record each while a segment has room).
BATCH = 8
#: The segment size these tests configure (the smallest allowed).
SEGMENT = 1 << 20


def _record_bytes(pages: int) -> int:
    """Bytes a record of ``pages`` test pages takes in a segment, padding included."""
    return fmt.align(fmt.header_bytes(pages) + pages * STORED)


def _per_segment() -> int:
    """Pages a segment takes when they come in records of :data:`BATCH`."""
    return (SEGMENT - fmt.SEGMENT_HEADER_BYTES) // _record_bytes(BATCH) * BATCH


@pytest.fixture
def rigs() -> Iterator[list[Rig]]:
    """The rigs a test opened (``_rig``), closed after it."""
    opened: list[Rig] = []
    yield opened
    for rig in opened:
        rig.close()


def _seeds(keys: list[str], base: int) -> list[int]:
    return [base + i for i in range(len(keys))]


class FailingWrites:
    """``os.pwritev`` (the Python loop's page writes) and the compiled path's record write
    that, once armed, write the first region (compiled: the first page) of one call and
    then fail with ``ENOSPC`` (a disk that fills mid-record): the Python loop at its next
    call, the compiled write in the same call, which is the whole record's data."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.real = os.pwritev
        self.real_compiled = compiled.write
        self.armed = 0
        self.fail_next = False
        self.failed = 0
        monkeypatch.setattr(os, "pwritev", self)
        monkeypatch.setattr(compiled, "write", self.compiled_write)

    def arm(self) -> None:
        self.armed = 1

    def _fail(self) -> None:
        self.failed += 1
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    def __call__(self, fd: int, buffers: Any, offset: int, *flags: int) -> int:
        if self.fail_next:
            self.fail_next = False
            self._fail()
        if self.armed:
            self.armed -= 1
            self.fail_next = True
            return self.real(fd, list(buffers)[:1], offset, *flags)
        return self.real(fd, buffers, offset, *flags)

    def compiled_write(
        self, fd: int, offset: int, keys: Any, pages: list[Any], static: bytes
    ) -> None:
        if self.armed:
            self.armed -= 1
            self.real_compiled(fd, offset, keys[:1], pages[:1], static)
            self._fail()
        self.real_compiled(fd, offset, keys, pages, static)


# --- item 6: one failed write, another instance's clear ---------------------------------


def test_a_failed_write_is_stepped_over_sealed_and_reclaimed(
    rigs: list[Rig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    rig = _rig(rigs, root, segment_bytes="1MiB", capacity_bytes="2MiB")
    writes = FailingWrites(monkeypatch)
    keys = rig.keys(120)
    seeds = _seeds(keys, 500)
    assert _put_all(rig, keys[:BATCH], seeds[:BATCH]) == [True] * BATCH
    (failing,) = _segments(root)
    writes.arm()
    assert _put_all(rig, keys[BATCH : 2 * BATCH], seeds[BATCH : 2 * BATCH]) == [False] * BATCH
    assert writes.failed == 1
    assert rig.backend.stats()["put_failed_no_space"] == BATCH
    assert rig.store.exists(keys[BATCH : 2 * BATCH]) == [False] * BATCH
    # the store keeps taking pages, and another opener finds every page this one serves
    # (the pages after the failed record too)
    later = keys[2 * BATCH : 6 * BATCH]
    assert _put_all(rig, later, seeds[2 * BATCH : 6 * BATCH]) == [True] * len(later)
    other = _rig(rigs, root, segment_bytes="1MiB", capacity_bytes="2MiB")
    served = [k for k, ok in zip(keys, rig.store.exists(keys), strict=True) if ok]
    assert len(served) == 5 * BATCH
    assert other.store.exists(served) == [True] * len(served)
    assert _check_hits(other, keys, seeds) == len(served)
    other.close()
    rigs.remove(other)
    # the failed segment was sealed, so it is reclaimed like any other: capacity holds
    rest = keys[6 * BATCH :]
    assert _put_all(rig, rest, seeds[6 * BATCH :]) == [True] * len(rest)
    assert failing not in _segments(root)
    assert _disk_bytes(root) <= 2 << 20
    assert rig.backend.stats()["segments_reclaimed"] >= 1
    assert _check_hits(rig, rest[-BATCH:], seeds[-BATCH:]) == BATCH


def test_another_instances_clear_does_not_stop_this_ones_puts(
    rigs: list[Rig], tmp_path: Path
) -> None:
    root = tmp_path / "root"
    first = _rig(rigs, root)
    second = _rig(rigs, root)
    before, after, last = first.keys(8, 1), first.keys(8, 2), first.keys(8, 3)
    assert _put_all(first, before, _seeds(before, 0)) == [True] * 8
    assert second.store.exists(before) == [True] * 8
    second.backend.clear()  # removes every segment, the first instance's active one too
    assert _segments(root) == []
    # the first instance notices (its active segment is gone) and starts a new one
    assert _put_all(first, after, _seeds(after, 100)) == [True] * 8
    assert _check_hits(first, after, _seeds(after, 100)) == 8
    first.backend.rescan()  # (the old segment's descriptor closes: nothing writes into it)
    assert _put_all(first, last, _seeds(last, 200)) == [True] * 8
    assert first.store.exists(before) == [False] * 8  # cleared by the other instance
    assert first.backend.stats()["segments_removed_by_others"] >= 1
    # and what it stored is on disk, for every opener
    fresh = _rig(rigs, root)
    assert fresh.store.exists(before) == [False] * 8
    assert _check_hits(fresh, after + last, _seeds(after, 100) + _seeds(last, 200)) == 16


# --- item 7: a put acknowledged under fsync batch survives a kill -----------------------


def _child(job: dict[str, Any]) -> subprocess.Popen[str]:
    """A child process running :func:`_child_main` on ``job``."""
    code = (
        f"import sys; sys.path.insert(0, {str(TESTS)!r}); "
        "from test_segment_faults import _child_main; _child_main()"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(job)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )


def _kill_self(*_: object, **__: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _child_main() -> None:
    """The child's side: open a rig on the job's root and run the job's mode."""
    job = json.loads(sys.argv[1])
    rig = Rig(Path(job["root"]), **job["options"])
    mode = job["mode"]
    if mode == "concurrent":
        _child_concurrent(rig, job)
    elif mode == "compaction":
        _child_compaction(rig, job)
    raise SystemExit(f"not killed: {rig.backend.stats()}")


def _child_concurrent(rig: Rig, job: dict[str, Any]) -> None:
    """Put A stops mid-write (its pages written, by the Python loop or the compiled
    path, its header not); put B, reserved after it, completes (acknowledged under
    ``fsync: "batch"``); then this process dies."""
    writing, never = threading.Event(), threading.Event()
    real = os.pwritev
    stalled = threading.local()

    def pwritev(fd: int, buffers: Any, offset: int, *flags: int) -> int:
        done = real(fd, buffers, offset, *flags)
        if getattr(stalled, "on", False):
            writing.set()
            never.wait()  # mid-put forever: its header is never written
        return done

    real_compiled = compiled.write

    def compiled_write(fd: int, offset: int, *rest: Any) -> None:
        real_compiled(fd, offset, *rest)
        if getattr(stalled, "on", False):
            writing.set()
            never.wait()

    os.pwritev = pwritev  # type: ignore[assignment]
    compiled.write = compiled_write  # type: ignore[assignment]

    def put_a() -> None:
        stalled.on = True
        _put_all(rig, job["a"], job["a_seeds"])

    threading.Thread(target=put_a, daemon=True).start()
    assert writing.wait(60)
    assert _put_all(rig, job["b"], job["b_seeds"]) == [True] * len(job["b"])
    print("acknowledged", flush=True)
    never.wait(60)


def _child_compaction(rig: Rig, job: dict[str, Any]) -> None:
    """Fill a segment, overwrite most of it (it becomes mostly dead), then keep putting
    until a new segment starts and compacts it; die at the job's point of compaction:
    while copying its live pages, just before or after it leaves (unlinked, or, as this
    instance is alone, renamed to become the next segment's file), or while writing into
    the segment made of its file (its old records still past the new ones)."""
    point = job["point"]
    if point == "copying":
        seg_writer.copy_range = _kill_self  # type: ignore[assignment]
    elif point in ("before_unlink", "after_unlink"):
        real = os.unlink
        real_rename = os.rename

        def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
            segment = fmt.segment_of_name(os.fspath(path)) is not None
            if segment and point == "before_unlink":
                _kill_self()
            real(path, *args, **kwargs)
            if segment and point == "after_unlink":
                _kill_self()

        def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            spared = fmt.segment_of_name(os.fspath(src)) is not None  # a segment leaving
            if spared and point == "before_unlink":
                _kill_self()
            real_rename(src, dst, *args, **kwargs)
            if spared and point == "after_unlink":
                _kill_self()

        os.unlink = unlink  # type: ignore[assignment]
        os.rename = rename  # type: ignore[assignment]
    assert _put_all(rig, job["keys"], job["seeds"]) == [True] * len(job["keys"])
    assert _put_all(rig, job["over"], job["over_seeds"]) == [True] * len(job["over"])
    in_reused = 0
    for i, key in enumerate(job["more"]):
        assert _put_all(rig, [key], [job["more_seeds"][i]]) == [True]
        print(key, flush=True)  # acknowledged
        if point == "writing_reused" and rig.backend.stats()["segments_reused"]:
            in_reused += 1
            if in_reused == 3:
                _kill_self()


def test_an_acknowledged_put_survives_a_kill_while_an_earlier_put_is_writing(
    rigs: list[Rig], tmp_path: Path
) -> None:
    root = tmp_path / "root"
    probe = Rig(root)
    a, b = probe.keys(BATCH, 1), probe.keys(BATCH, 2)
    probe.close()
    options = {"fsync": "batch", "io_threads": 1}
    job = {
        "root": str(root),
        "options": options,
        "mode": "concurrent",
        "a": a,
        "a_seeds": _seeds(a, 0),
        "b": b,
        "b_seeds": _seeds(b, 100),
    }
    child = _child(job)
    assert child.stdout is not None
    line = child.stdout.readline().strip()
    child.send_signal(signal.SIGKILL)
    _, err = child.communicate(timeout=60)
    assert line == "acknowledged", err
    rig = _rig(rigs, root, **options)
    # B was acknowledged after its fdatasync: it is there, whole; A never was: misses
    assert _check_hits(rig, b, _seeds(b, 100)) == BATCH
    assert rig.store.exists(a) == [False] * BATCH
    stats = rig.backend.stats()
    assert stats["holes_skipped"] == 1 and stats["segments_torn"] == 1
    # and the store keeps serving
    assert _put_all(rig, a, _seeds(a, 200)) == [True] * BATCH
    assert _check_hits(rig, a, _seeds(a, 200)) == BATCH


def test_a_scan_looks_past_a_hole_and_never_indexes_it(rigs: list[Rig], tmp_path: Path) -> None:
    root = tmp_path / "root"
    rig = Rig(root)
    batches = [rig.keys(BATCH, n) for n in range(4)]
    for n, keys in enumerate(batches):
        assert _put_all(rig, keys, _seeds(keys, 100 * n)) == [True] * BATCH
    rig.close()
    (seg,) = _segments(root)
    record = _record_bytes(BATCH)
    second = fmt.SEGMENT_HEADER_BYTES + record
    with open(seg, "r+b") as f:  # the second record's header never written
        f.seek(second)
        f.write(bytes(fmt.header_bytes(BATCH)))
        f.seek(second + 2 * record)  # the fourth one's torn
        f.write(b"\x00" * 16)
    again = _rig(rigs, root)
    found = [again.store.exists(keys) for keys in batches]
    assert found == [[True] * BATCH, [False] * BATCH, [True] * BATCH, [False] * BATCH]
    assert _check_hits(again, batches[2], _seeds(batches[2], 200)) == BATCH
    stats = again.backend.stats()
    assert stats["holes_skipped"] == 2 and stats["segments_torn"] == 1


# --- item 8: a kill during compaction ---------------------------------------------------


@pytest.mark.parametrize("point", ["copying", "before_unlink", "after_unlink", "writing_reused"])
def test_a_kill_during_compaction_keeps_every_live_page_in_its_newest_version(
    rigs: list[Rig], tmp_path: Path, point: str
) -> None:
    root = tmp_path / "root"
    options = {"fsync": "batch", "segment_bytes": "1MiB"}
    probe = Rig(root, **options)
    per_segment = _per_segment()
    keys, more = probe.keys(per_segment, 1), probe.keys(2 * per_segment, 2)
    probe.close()
    over = keys[: per_segment * 5 // 6]  # the first segment becomes more than 75 % dead
    job = {
        "root": str(root),
        "options": options,
        "mode": "compaction",
        "point": point,
        "keys": keys,
        "seeds": _seeds(keys, 0),
        "over": over,
        "over_seeds": _seeds(over, 1000),
        "more": more,
        "more_seeds": _seeds(more, 2000),
    }
    child = _child(job)
    out, err = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGKILL, f"compaction never ran ({point}): {err}"
    acknowledged = set(out.split())
    assert acknowledged, err
    rig = _rig(rigs, root, **options)
    newest = dict(zip(keys, _seeds(keys, 0), strict=True))
    newest.update(zip(over, _seeds(over, 1000), strict=True))
    newest.update(
        (k, s) for k, s in zip(more, _seeds(more, 2000), strict=True) if k in acknowledged
    )
    assert _check_hits(rig, list(newest), list(newest.values())) == len(newest)
    # a second opening after the store wrote again agrees
    assert _put_all(rig, more, _seeds(more, 3000)) == [True] * len(more)
    rig.close()
    rigs.remove(rig)
    again = _rig(rigs, root, **options)
    newest.update(zip(more, _seeds(more, 3000), strict=True))
    assert _check_hits(again, list(newest), list(newest.values())) == len(newest)


# --- item 9: a full disk, a batch out of space, hard links --------------------------------


def test_a_batch_that_runs_out_of_space_is_true_page_by_page(
    rigs: list[Rig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    rig = _rig(rigs, root, segment_bytes="1MiB")
    first = rig.keys(_per_segment() - BATCH // 2, 1)
    assert _put_all(rig, first, _seeds(first, 0)) == [True] * len(first)
    batch = rig.keys(2 * BATCH, 2)
    seeds = _seeds(batch, 100)
    real = os.pwritev
    real_compiled = compiled.write
    calls: list[int] = []

    def second_record_fails(fd: int, buffers: Any, offset: int, *flags: int) -> int:
        calls.append(fd)
        if len(set(calls)) > 1:  # the batch's second record, in a new segment
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(fd, buffers, offset, *flags)

    def second_record_fails_compiled(fd: int, offset: int, *rest: Any) -> None:
        calls.append(fd)
        if len(set(calls)) > 1:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        real_compiled(fd, offset, *rest)

    monkeypatch.setattr(os, "pwritev", second_record_fails)
    monkeypatch.setattr(compiled, "write", second_record_fails_compiled)
    results = _put_all(rig, batch, seeds, batch=2 * BATCH)
    stored = results.count(True)
    assert 0 < stored < 2 * BATCH, results
    assert results == [True] * stored + [False] * (2 * BATCH - stored)
    # exactly the pages reported stored are served, each with its own bytes
    assert rig.store.exists(batch) == results
    assert _check_hits(rig, batch, seeds) == stored
    monkeypatch.setattr(os, "pwritev", real)
    monkeypatch.setattr(compiled, "write", real_compiled)
    fresh = _rig(rigs, root, segment_bytes="1MiB")
    assert fresh.store.exists(batch) == results
    assert _put_all(rig, batch, seeds) == [True] * 2 * BATCH  # and the store goes on


def test_a_hard_linked_segment_is_never_written_into(rigs: list[Rig], tmp_path: Path) -> None:
    root = tmp_path / "root"
    rig = Rig(root)
    sealed_keys = rig.keys(2 * BATCH, 1)
    assert _put_all(rig, sealed_keys, _seeds(sealed_keys, 0)) == [True] * 2 * BATCH
    rig.close()
    again = _rig(rigs, root)
    active_keys = again.keys(2 * BATCH, 2)
    assert _put_all(again, active_keys, _seeds(active_keys, 100)) == [True] * 2 * BATCH
    sealed, active = _segments(root)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.link(sealed, outside / "sealed.seg")
    os.link(active, outside / "active.seg")
    before = {p: p.read_bytes() for p in outside.iterdir()}
    # appends go to a new segment; a delete and an overwrite write no DEAD mark or erasure
    # into a linked file (the segment leaves the store instead: its pages are dropped)
    later = again.keys(BATCH, 3)
    assert _put_all(again, later, _seeds(later, 200)) == [True] * BATCH
    assert again.backend.delete(sealed_keys[:1]) == [True]
    assert _put_all(again, active_keys[:2], _seeds(active_keys[:2], 300)) == [True] * 2
    assert {p: p.read_bytes() for p in outside.iterdir()} == before
    assert again.backend.stats()["segments_linked"] >= 2
    assert again.store.exists(sealed_keys[:1]) == [False]
    assert _check_hits(again, active_keys[:2], _seeds(active_keys[:2], 300)) == 2
    assert _check_hits(again, later, _seeds(later, 200)) == BATCH
    # a fresh opener agrees: the deleted page stays deleted, the new ones are there
    fresh = _rig(rigs, root)
    assert fresh.store.exists(sealed_keys[:1]) == [False]
    assert _check_hits(fresh, active_keys[:2], _seeds(active_keys[:2], 300)) == 2
    assert _check_hits(fresh, later, _seeds(later, 200)) == BATCH
    assert {p: p.read_bytes() for p in outside.iterdir()} == before


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """A tmpfs of a given size, mounted for the test (a real full disk)."""
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        point = tmp_path / f"tmpfs{len(mounted)}"
        point.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(point)],
            capture_output=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


def test_on_a_full_disk_the_put_that_starts_a_compaction_is_stored(
    rigs: list[Rig], small_tmpfs: Callable[[int], Path]
) -> None:
    disk = small_tmpfs(8 << 20)
    root = disk / "root"
    rig = _rig(rigs, root, segment_bytes="1MiB")
    per_segment = _per_segment()
    keys = rig.keys(per_segment, 1)
    assert _put_all(rig, keys, _seeds(keys, 0)) == [True] * per_segment
    over = keys[: per_segment * 5 // 6]  # the first segment becomes mostly dead...
    assert _put_all(rig, over, _seeds(over, 1000)) == [True] * len(over)
    # ... then the disk fills up, up to the end of the segment being written
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            try:
                os.write(fd, bytes(4096))
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                break
    finally:
        os.close(fd)
    segments = _segments(root)
    more = rig.keys(per_segment, 2)
    results = _put_all(rig, more, _seeds(more, 2000))
    # the first batch finds no room in the active segment; the next one starts a segment,
    # which needs the mostly dead one's space: its few live pages are given up (counted
    # evictions) rather than the put
    assert results[:BATCH] == [False] * BATCH
    assert results[BATCH:] == [True] * (len(more) - BATCH), rig.backend.stats()
    stats = rig.backend.stats()
    assert stats["put_failed_no_space"] == BATCH and stats["segments_compacted"] == 1
    assert segments[0] not in _segments(root)
    newest = _seeds(keys, 0)[len(over) :]
    hits = _check_hits(rig, over + keys[len(over) :], _seeds(over, 1000) + newest)
    assert hits + stats["evictions"] == len(keys)
    assert _check_hits(rig, more[BATCH:], _seeds(more, 2000)[BATCH:]) == len(more) - BATCH
    everything = keys + more
    fresh = _rig(rigs, root, segment_bytes="1MiB")
    assert fresh.store.exists(everything) == rig.store.exists(everything)
