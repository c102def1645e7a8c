"""io_uring backend vs raw one-file-per-page I/O (1 and N threads), the packed-file floor
and the file backend.

Usage: ``python benchmarks/uring.py [--quick] [--root DIR] [--no-suite] [--no-sweep]``.
One JSON object per line on stdout (DESIGN.md's form, with ``spread``: the lowest and
highest per-round ratio), a table on stderr. Two parts, both in one run:

The page-path suite (``_common.page_path_suite``, the same cases as ``file.py`` and
``segments.py``): 16 KiB, 128 KiB, 2 MiB and 8 MiB pages through ``PageStore`` with full
verification over a ``UringBackend`` at its default queue depth (32), against raw one
file per page in one thread, the same raw calls on 4 threads (LMCache's local-disk pool;
the file backend's default I/O threads) and ``pwritev`` / ``preadv`` of the same bytes
into one pre-allocated file, one call per batch (the packed floor): new puts, warm gets
(and full vs header-only verification), cold gets (page cache dropped) and overwrites
(raw and floor in place). Targets as in ``_common.target``, and 1.2x one raw thread on
cold gets (the ring keeps several reads in flight).

Then the queue-depth sweep: for each page size (256 x 8 MiB, 4096 x 128 KiB; --quick uses
fewer pages) and each queue depth (1, 8, 32; --quick 1 and 32) it times:

- ``get ... cold``: the page cache of every page file is dropped before each repetition
  (``posix_fadvise(DONTNEED)`` per file, so other processes' caches are left alone);
- ``get ... o_direct``: O_DIRECT reads into 4096-aligned memory;
- ``put ...``: puts of new pages, buffered (fsync 'none') and O_DIRECT; before each
  timed put the previous pages are deleted and after it the dirty data is synced, both
  untimed, so every implementation starts from the same state.

The uring backend runs at queue depth q, the file backend with q I/O threads (its way of
keeping q requests in flight), the raw loop one request at a time in this thread. All
three move the same bytes between the same aligned host buffers and files, interleaved
in each repetition (in an order rotated from one repetition to the next) after a warm-up
round (an eighth of the pages); the median of the repetitions is reported, with the
spread of the per-repetition ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import mmap
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from _common import GB, emit, page_path_suite, pick_sizes

from kvtier.backends.file import FileConfig
from kvtier.backends.file.backend import FileBackend
from kvtier.backends.filestore import paths as fs_paths
from kvtier.backends.uring import UringConfig, probe_io_uring
from kvtier.backends.uring.backend import UringBackend
from kvtier.core.extents import Extent

HEADER = 4096
KiB = 1024
MiB = 1024 * KiB
#: Threads of the raw N-thread baseline of the suite (LMCache's local-disk pool).
SUITE_THREADS = 4


class Arena:
    """One 4096-aligned anonymous mapping, touched once, carved into page regions."""

    def __init__(self, size: int) -> None:
        self.map = mmap.mmap(-1, size)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        for offset in range(0, size, 4096):  # touch every page once, up front
            self.map[offset] = 1
        self.size = size

    def extent(self, offset: int, length: int) -> Extent:
        ptr = self.base + offset
        view = memoryview((ctypes.c_ubyte * length).from_address(ptr)).cast("B")
        return Extent(view, ptr, length)


def make_pages(arena: Arena, count: int, payload: int, slots: int) -> list[list[Extent]]:
    """``count`` pages of [header, K, V]; page i uses buffer slot i % slots."""
    page_bytes = HEADER + payload
    half = payload // 2
    regions = []
    for slot in range(slots):
        base = slot * page_bytes
        regions.append(
            [
                arena.extent(base, HEADER),
                arena.extent(base + HEADER, half),
                arena.extent(base + HEADER + half, payload - half),
            ]
        )
    return [regions[i % slots] for i in range(count)]


def drop_cache(paths: list[Path]) -> None:
    """Evict these files from the page cache (they must be clean)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(paths: list[Path], pages: list[list[Extent]], direct: bool) -> None:
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    for path, page in zip(paths, pages, strict=True):
        fd = os.open(path, flags)
        try:
            os.preadv(fd, [e.view for e in page], 0)
        finally:
            os.close(fd)


def raw_write(paths: list[Path], pages: list[list[Extent]], direct: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    for path, page in zip(paths, pages, strict=True):
        fd = os.open(path, flags, 0o600)
        try:
            os.pwritev(fd, [e.view for e in page], 0)
        finally:
            os.close(fd)


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@contextlib.contextmanager
def backends(root: Path, depth: int, direct: bool) -> Iterator[tuple[UringBackend, FileBackend]]:
    uring = UringBackend(
        UringConfig(root=root, queue_depth=depth, o_direct=direct, min_free_bytes=0)
    )
    file = FileBackend(
        FileConfig(root=root, io_threads=min(depth, 64), o_direct=direct, min_free_bytes=0)
    )
    try:
        yield uring, file
    finally:
        uring.close()
        file.close()


def measure(
    run: dict[str, Callable[[int], Any]],
    before: Callable[[str], Any],
    count: int,
    reps: int,
    after: Callable[[], Any] | None = None,
) -> dict[str, list[float]]:
    """Seconds per repetition per implementation; ``run[name](n)`` moves the first n pages.

    One warm-up round moves an eighth of the pages; then ``reps`` rounds move all of them,
    the implementations interleaved within each round, and the order rotated from round
    to round so that no implementation always follows the same one; ``before(name)`` and
    ``after()`` run untimed around each timed call.
    """
    times: dict[str, list[float]] = {name: [] for name in run}
    names = list(run)
    for rep in range(reps + 1):
        n = count if rep else max(1, count // 8)
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            before(name)
            elapsed = timed(lambda fn=run[name], n=n: fn(n))
            if after is not None:
                after()
            if rep:
                times[name].append(elapsed)
    return times


def bench_size(
    root: Path,
    arena: Arena,
    label: str,
    count: int,
    payload: int,
    slots: int,
    depths: list[int],
    reps: int,
    modes: list[str],
    ops: set[str],
) -> None:
    """Every get and put case (of ``ops``) of one page size."""
    pages = make_pages(arena, count, payload, slots)
    nbytes = count * (HEADER + payload)
    keys = [f"{label.lower()}-{i}" for i in range(count)]
    raw_dir = root / "raw"
    raw_dir.mkdir(exist_ok=True, mode=0o700)
    raw_paths = [raw_dir / f"{label}-{i}" for i in range(count)]
    small = payload <= 256 * KiB
    # Write the data set once for each reader, synced so it can be dropped from the cache.
    with backends(root, 32, False) as (uring, _file):
        assert all(uring.put(keys, pages))
        paths = [fs_paths.page_path(uring.store, key) for key in keys]
    raw_write(raw_paths, pages, False)
    os.sync()
    for mode in modes if "get" in ops else []:
        direct = mode == "o_direct"
        for depth in depths:
            with backends(root, depth, direct) as (uring, file):
                run: dict[str, Callable[[int], Any]] = {
                    "uring": lambda n, u=uring: u.get(keys[:n], pages[:n]),
                    "file": lambda n, f=file: f.get(keys[:n], pages[:n]),
                    "raw": lambda n, d=direct: raw_read(raw_paths[:n], pages[:n], d),
                }

                def cold(name: str, direct: bool = direct) -> None:
                    if not direct:
                        drop_cache(raw_paths if name == "raw" else paths)

                seconds = measure(run, cold, count, reps)
            rates = {name: [nbytes / s / GB for s in t] for name, t in seconds.items()}
            case = f"get {count}x{label} {mode} qd{depth}"
            target = 1.2 if small and depth >= 8 else 0.9
            threads = f"file backend ({min(depth, 64)} threads)"
            emit("uring", case, rates["uring"], rates["file"], threads, target)
            emit("uring", case, rates["uring"], rates["raw"], "os.preadv loop", None)
    for mode in modes if "put" in ops else []:
        direct = mode == "o_direct"
        for depth in depths:
            with backends(root, depth, direct) as (uring, file):
                run = {
                    "uring": lambda n, u=uring: u.put(keys[:n], pages[:n]),
                    "file": lambda n, f=file: f.put(keys[:n], pages[:n]),
                    "raw": lambda n, d=direct: raw_write(raw_paths[:n], pages[:n], d),
                }
                removers: dict[str, Callable[[], Any]] = {
                    "uring": lambda u=uring: u.delete(keys),
                    "file": lambda f=file: f.delete(keys),
                    "raw": lambda: [p.unlink(missing_ok=True) for p in raw_paths],
                }

                def fresh(name: str, removers: dict[str, Callable[[], Any]] = removers) -> None:
                    # New pages every time (a backup writes new keys), starting from a clean
                    # page cache; untimed.
                    removers[name]()
                    os.sync()

                # os.sync after each timed put (untimed): uring and file share their keys,
                # so without it each would delete the other's still-dirty pages just before
                # its own run and find the freed page cache warm, while the other finds
                # written-back pages: on this VM that alone moved 8 MiB puts 0.2x-5x.
                seconds = measure(run, fresh, count, reps, after=os.sync)
            rates = {name: [nbytes / s / GB for s in t] for name, t in seconds.items()}
            case = f"put {count}x{label} {'buffered' if mode == 'cold' else mode} qd{depth}"
            threads = f"file backend ({min(depth, 64)} threads)"
            emit("uring", case, rates["uring"], rates["file"], threads, 0.9)
            emit("uring", case, rates["uring"], rates["raw"], "os.pwritev loop", None)
    shutil.rmtree(raw_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="reduced sizes, under a minute")
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="directory on the disk to measure (default: a temp dir)",
    )
    parser.add_argument(
        "--depths", default=None, help="queue depths, comma-separated (default 1,8,32; quick 1,32)"
    )
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per case")
    parser.add_argument("--ops", default="get,put", help="operations: get, put or both")
    parser.add_argument(
        "--sizes",
        default="16KiB,128KiB,2MiB,8MiB",
        help="page sizes (the queue-depth sweep runs 128KiB and 8MiB only)",
    )
    parser.add_argument("--modes", default=None, help="cold (buffered), o_direct or both")
    parser.add_argument(
        "--count-scale", type=float, default=1.0, help="scale the page counts (e.g. 0.25)"
    )
    parser.add_argument("--no-suite", action="store_true", help="skip the page-path suite")
    parser.add_argument("--no-sweep", action="store_true", help="skip the queue-depth sweep")
    args = parser.parse_args(argv)
    reason = probe_io_uring()
    if reason is not None:
        print(f"io_uring unavailable: {reason}", file=sys.stderr)
        return 2
    depths = [int(d) for d in (args.depths or ("1,32" if args.quick else "1,8,32")).split(",")]
    parent = args.root or Path(tempfile.gettempdir())
    root = Path(tempfile.mkdtemp(prefix="kvtier-uring-bench-", dir=parent))
    os.chmod(root, 0o700)
    if args.quick:
        sizes = [("8MiB", 16, 8 * MiB, 16), ("128KiB", 512, 128 * KiB, 512)]
        reps = args.reps or 2
        modes = ["cold"]
    else:
        sizes = [("8MiB", 256, 8 * MiB, 48), ("128KiB", 4096, 128 * KiB, 4096)]
        reps = args.reps or 3
        modes = ["cold", "o_direct"]
    if args.modes:
        modes = args.modes.split(",")
    wanted = set(args.sizes.split(","))
    sizes = [
        (label, max(8, int(count * args.count_scale)), payload, slots)
        for label, count, payload, slots in sizes
        if label in wanted
    ]
    sizes = [(label, count, payload, min(slots, count)) for label, count, payload, slots in sizes]
    ops = set(args.ops.split(","))
    arena = Arena(max(slots * (HEADER + payload) for _, _, payload, slots in sizes))
    need = max(count * (HEADER + payload) for _, count, payload, _ in sizes) * 2
    free = shutil.disk_usage(parent).free
    if free < need * 1.5:
        print(
            f"need about {need >> 20} MiB free under {parent}, have {free >> 20}", file=sys.stderr
        )
        return 2
    try:
        if not args.no_suite:
            suite_sizes = pick_sizes(args.quick, ",".join(sorted(wanted)))

            def make(store_root: Path) -> UringBackend:
                return UringBackend(UringConfig(root=store_root, min_free_bytes=0))

            page_path_suite(
                "uring",
                make,
                SUITE_THREADS,
                root,
                sizes=suite_sizes,
                reps=args.reps or 3,
                cold_target=1.2,
            )
        for label, count, payload, slots in [] if args.no_sweep else sizes:
            bench_size(root, arena, label, count, payload, slots, depths, reps, modes, ops)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
