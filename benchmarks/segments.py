"""Segment backend vs raw one-file-per-page I/O and the packed-file floor, 16 KiB to 8 MiB.

    python benchmarks/segments.py [--quick] [--reps R] [--dir PATH] [--sizes 16KiB,8MiB]
                                  [--unbounded] [--no-file]

For 16 KiB, 128 KiB, 2 MiB and 8 MiB pages, through ``PageStore`` with full verification
over a ``SegmentBackend`` (defaults: 64 MiB segments, 4 I/O threads), batch by batch,
interleaved in one run (the order rotates and alternates direction batch by batch) with:

- ``raw1``: one file per page, ``open + pwritev / preadv + close``, one thread;
- ``rawN``: the same calls on N threads (N = the backend's ``io_threads``), one contiguous
  slice of each batch per thread;
- ``floor``: ``pwritev`` / ``preadv`` of the same bytes into one pre-allocated file, one
  call per batch (pages back to back, as a segment holds them): the physical floor of
  packed pages, with no envelope, no index, no record header;
- ``file``: the ``file`` backend through the same ``PageStore`` (informational).

Cases (one JSON line per case and baseline on stdout, DESIGN.md's form; a table on
stderr; ``spread`` is the lowest and highest per-round ratio):

- ``put ... new``: new pages (the stores emptied, raw files removed, untimed, before each
  round; the floor writes into its pre-allocated file);
- ``get ... warm``: page cache warm;
- ``get ... cold``: every file written back, then dropped from the page cache
  (``posix_fadvise(DONTNEED)``) just before each side reads each batch;
- ``put ... overwrite``: the same keys again (ours and ``file`` keep every put atomic; the
  raw sides write in place, which is not).

Targets (goals, not gates): pages up to 128 KiB at least 1.0x both raw one-file-per-page
sides on every case and 0.8x the floor; 8 MiB pages 0.9x the floor. ``--unbounded`` runs
the page stores without the per-call bound (``backend_call_timeout_s: null``), which costs
one thread hand-off per call (65-90 µs here); the default keeps it, as engines run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import GB, drop_cache, emit, fsync_files, raw_read, raw_write

BENCH = "segments"


@dataclass(frozen=True)
class Size:
    """One page size: label, geometry (layers, tokens per page), pages, batch."""

    label: str
    num_layers: int
    page_size: int
    pages: int
    batch: int


#: 16 KiB: 4 layers x 8 heads x 128 x bf16 x 1 token (K and V); 128 KiB: 32 layers, one
#: token; 2 MiB: 32 layers, 16 tokens (vLLM's 16-token block of an 8B model is 2 MiB);
#: 8 MiB: 64 tokens.
SIZES_FULL = (
    Size("16KiB", 4, 1, 4096, 32),
    Size("128KiB", 32, 1, 1024, 32),
    Size("2MiB", 32, 16, 96, 8),
    Size("8MiB", 32, 64, 32, 8),
)
SIZES_QUICK = (
    Size("16KiB", 4, 1, 1024, 32),
    Size("128KiB", 32, 1, 256, 32),
    Size("2MiB", 32, 16, 24, 8),
    Size("8MiB", 32, 64, 8, 8),
)


class Rounds:
    """Per-round seconds of several sides, timed batch by batch in rotating order."""

    def __init__(self, sides: dict[str, Callable[[int], Any]], groups: int) -> None:
        self.sides = sides
        self.groups = groups
        self.seconds: dict[str, list[float]] = {name: [] for name in sides}

    def round(
        self,
        before_round: Callable[[], Any] | None = None,
        before: Callable[[str, int], Any] | None = None,
        *,
        record: bool = True,
    ) -> None:
        if before_round is not None:
            before_round()
        names = list(self.sides)
        totals = dict.fromkeys(names, 0.0)
        for g in range(self.groups):
            shift = (g // 2) % len(names)
            order = names[shift:] + names[:shift]
            for name in order if g % 2 == 0 else order[::-1]:
                if before is not None:
                    before(name, g)
                t0 = time.perf_counter()
                self.sides[name](g)
                totals[name] += time.perf_counter() - t0
        if record:
            for name in names:
                self.seconds[name].append(totals[name])

    def rates(self, name: str, nbytes: int) -> list[float]:
        return [nbytes / s / GB for s in self.seconds[name]]


def one_size(
    size: Size, work: Path, reps: int, threads: int, *, bounded: bool, with_file: bool
) -> list[dict[str, Any]]:
    """Every case of one page size; the JSON lines printed."""
    import torch

    from kvtier.backends.file import FileConfig
    from kvtier.backends.file.backend import FileBackend
    from kvtier.backends.filestore import paths as fs_paths
    from kvtier.backends.segment import SegmentConfig
    from kvtier.backends.segment.backend import SegmentBackend
    from kvtier.core.geometry import KVGeometry
    from kvtier.core.host_pool import HostPool
    from kvtier.core.keys import Namespace, PageKeyer
    from kvtier.core.pagestore import PageStore

    geometry = KVGeometry.mha(
        num_layers=size.num_layers, num_kv_heads=8, head_dim=128, page_size=size.page_size
    )
    n = size.pages
    host = HostPool(geometry, "page_first_direct", num_pages=n, pin_memory=False)
    generator = torch.Generator().manual_seed(0)
    for page in range(n):
        for extent in host.page_buffers(page):
            torch.frombuffer(extent.view, dtype=torch.uint8).random_(0, 256, generator=generator)
    ids = host.allocate(n)
    keyer = PageKeyer(Namespace(f"bench-{size.label.lower()}", geometry.fingerprint), 1)
    keys = keyer.keys(list(range(n)))
    seg_root = work / f"segments-{size.label}"
    segment = SegmentBackend(SegmentConfig(root=seg_root, min_free_bytes=0, io_threads=threads))
    bound: dict[str, Any] = {} if bounded else {"call_timeout_s": None}
    ours = PageStore(segment, host, fingerprint=geometry.fingerprint, **bound)
    file_backend = (
        FileBackend(
            FileConfig(root=work / f"file-{size.label}", min_free_bytes=0, io_threads=threads)
        )
        if with_file
        else None
    )
    theirs = (
        PageStore(file_backend, host, fingerprint=geometry.fingerprint, **bound)
        if file_backend is not None
        else None
    )
    views = [[e.view for e in host.page_buffers(p)] for p in ids]
    stored = sum(v.nbytes for v in views[0])
    total = n * stored
    raw_dir = work / f"raw-{size.label}"
    raw_dir.mkdir(mode=0o700)
    raw1 = [f"{raw_dir}/a{i}" for i in range(n)]
    rawn = [f"{raw_dir}/b{i}" for i in range(n)]
    packed = f"{raw_dir}/packed"
    packed_fd = os.open(packed, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    os.posix_fallocate(packed_fd, 0, total)
    groups = [list(range(i, min(i + size.batch, n))) for i in range(0, n, size.batch)]
    gk = [[keys[i] for i in g] for g in groups]
    gp = [[ids[i] for i in g] for g in groups]
    flat = [[v for i in g for v in views[i]] for g in groups]
    pool = ThreadPoolExecutor(threads, thread_name_prefix="raw")
    label = f"{n}x{size.label}"
    print(
        f"{BENCH}: {label} ({stored} bytes stored each), batches of {size.batch}, {reps} "
        f"rounds, {threads} threads, {'bounded' if bounded else 'unbounded'} calls",
        file=sys.stderr,
    )

    def check(ok: Sequence[bool], what: str, store: PageStore) -> None:
        if not all(ok):
            raise SystemExit(f"{what} failed: {store.stats()} {store.backend.stats()}")

    def spread(g: int, one: Callable[[int], None]) -> None:
        idx = groups[g]
        cut = [len(idx) * t // threads for t in range(threads + 1)]

        def work_slice(t: int) -> None:
            for i in idx[cut[t] : cut[t + 1]]:
                one(i)

        futures = [pool.submit(work_slice, t) for t in range(1, threads)]
        work_slice(0)
        for future in futures:
            future.result()

    def put_side(store: PageStore) -> Callable[[int], None]:
        return lambda g: check(store.put(gk[g], gp[g]), "put", store)

    def get_side(store: PageStore) -> Callable[[int], None]:
        return lambda g: check(store.get(gk[g], gp[g]), "get", store)

    def raw_write_side(files: list[str], flags: int, parallel: bool) -> Callable[[int], None]:
        if parallel:
            return lambda g: spread(g, lambda i: raw_write(files[i], views[i], flags))
        return lambda g: [raw_write(files[i], views[i], flags) for i in groups[g]]

    def raw_read_side(files: list[str], parallel: bool) -> Callable[[int], None]:
        if parallel:
            return lambda g: spread(g, lambda i: raw_read(files[i], views[i]))
        return lambda g: [raw_read(files[i], views[i]) for i in groups[g]]

    def floor_write(g: int) -> None:
        if os.pwritev(packed_fd, flat[g], groups[g][0] * stored) != len(groups[g]) * stored:
            raise SystemExit("short pwritev into the packed file")

    def floor_read(g: int) -> None:
        if os.preadv(packed_fd, flat[g], groups[g][0] * stored) != len(groups[g]) * stored:
            raise SystemExit("short preadv of the packed file")

    def sides(
        store_side: Callable[[PageStore], Callable[[int], None]],
        raw: tuple[Callable[[int], None], Callable[[int], None]],
        floor: Callable[[int], None],
    ) -> dict[str, Callable[[int], None]]:
        out = {"ours": store_side(ours), "raw1": raw[0], "rawn": raw[1], "floor": floor}
        if theirs is not None:
            out["file"] = store_side(theirs)
        return out

    def empty_all() -> None:
        segment.clear()
        if file_backend is not None:
            file_backend.clear()
        for path in raw1 + rawn:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    excl = os.O_EXCL
    puts = Rounds(
        sides(
            put_side,
            (raw_write_side(raw1, excl, False), raw_write_side(rawn, excl, True)),
            floor_write,
        ),
        len(groups),
    )
    for rep in range(reps + 1):
        puts.round(empty_all, record=rep > 0)
    gets = Rounds(
        sides(get_side, (raw_read_side(raw1, False), raw_read_side(rawn, True)), floor_read),
        len(groups),
    )
    for rep in range(reps + 1):
        gets.round(record=rep > 0)
    overwrites = Rounds(
        sides(
            put_side, (raw_write_side(raw1, 0, False), raw_write_side(rawn, 0, True)), floor_write
        ),
        len(groups),
    )
    for rep in range(reps + 1):
        overwrites.round(record=rep > 0)

    def segment_files() -> list[str]:
        return [str(p) for p in sorted(seg_root.rglob("*.seg"))]

    file_pages = (
        [fs_paths.page_path_str(os.fspath(file_backend.store), k) for k in keys]
        if file_backend is not None
        else []
    )
    fsync_files(segment_files() + file_pages + raw1 + rawn + [packed])

    def drop(name: str, g: int) -> None:
        if name == "ours":
            drop_cache(segment_files())
        elif name == "file":
            drop_cache([file_pages[i] for i in groups[g]])
        elif name == "raw1":
            drop_cache([raw1[i] for i in groups[g]])
        elif name == "rawn":
            drop_cache([rawn[i] for i in groups[g]])
        else:
            os.posix_fadvise(
                packed_fd, groups[g][0] * stored, len(groups[g]) * stored, os.POSIX_FADV_DONTNEED
            )

    colds = Rounds(
        sides(get_side, (raw_read_side(raw1, False), raw_read_side(rawn, True)), floor_read),
        len(groups),
    )
    for rep in range(reps + 1):
        colds.round(before=drop, record=rep > 0)

    small = stored <= (132 << 10)
    floor_target = 0.8 if small else (0.9 if size.label == "8MiB" else None)
    raw_target = 1.0 if small else None
    names = {
        "raw1": "one file per page, 1 thread",
        "rawn": f"one file per page, {threads} threads",
        "floor": "packed file, one call per batch",
        "file": "file backend",
    }
    out: list[dict[str, Any]] = []
    for case, rounds in (
        (f"put {label} new", puts),
        (f"get {label} warm", gets),
        (f"get {label} cold", colds),
        (f"put {label} overwrite", overwrites),
    ):
        mine = rounds.rates("ours", total)
        for base in ("raw1", "rawn", "floor", "file"):
            if base not in rounds.seconds:
                continue
            target = {"raw1": raw_target, "rawn": raw_target, "floor": floor_target}.get(base)
            extra = {}
            if base == "raw1":
                us = (
                    statistics.median(rounds.seconds["ours"])
                    - statistics.median(rounds.seconds["raw1"])
                ) / n
                extra = {"overhead_us_per_page": round(us * 1e6, 1)}
            out.append(
                emit(BENCH, case, mine, rounds.rates(base, total), names[base], target, extra=extra)
            )
    stats = segment.stats()
    print(
        f"  segment backend: {stats['segments']} segments, {stats['read_calls']} reads, "
        f"{stats['write_calls']} record writes, {stats['segments_reclaimed']} reclaimed",
        file=sys.stderr,
    )
    ours.close()
    if theirs is not None:
        theirs.close()
    pool.shutdown()
    os.close(packed_fd)
    shutil.rmtree(raw_dir, ignore_errors=True)
    shutil.rmtree(seg_root, ignore_errors=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer pages, 3 rounds")
    parser.add_argument("--reps", type=int, default=None, help="timed rounds (default 5)")
    parser.add_argument("--dir", default=None, help="directory for the files (default: tmp)")
    parser.add_argument("--sizes", default=None, help="page sizes, e.g. 16KiB,8MiB")
    parser.add_argument("--threads", type=int, default=4, help="io_threads and raw N (4)")
    parser.add_argument(
        "--unbounded", action="store_true", help="page stores without the per-call bound"
    )
    parser.add_argument("--no-file", action="store_true", help="skip the file backend side")
    args = parser.parse_args()
    reps = args.reps or (3 if args.quick else 5)
    sizes = SIZES_QUICK if args.quick else SIZES_FULL
    if args.sizes:
        wanted = set(args.sizes.split(","))
        sizes = tuple(s for s in sizes if s.label in wanted)
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-segments-", dir=args.dir))
    try:
        for size in sizes:
            one_size(
                size,
                work,
                reps,
                args.threads,
                bounded=not args.unbounded,
                with_file=not args.no_file,
            )
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
