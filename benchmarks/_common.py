"""Helpers the benchmark scripts share (imported from the scripts' own directory).

Besides :func:`interleaved_medians`, this holds the page-path suite that ``file.py`` and
``uring.py`` both run (:func:`page_path_suite`): the same pages, through ``PageStore``
with full verification and the backend under test, side by side in one run with what
users compare kvtier with: a raw ``os.pwritev`` / ``os.preadv`` loop in one thread, the
same raw calls on N threads (N = the backend's I/O threads, what LMCache's local-disk
backend does; each thread takes one contiguous slice of a batch, the cheapest
hand-off), raw in-place overwrites, and raw cold reads.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GB = 1e9


def interleaved_medians(cases: dict[str, Callable[[], float]], reps: int) -> dict[str, float]:
    """Warm every case up once, then ``reps`` rounds taking the cases in turn; medians.

    Interleaving keeps both sides of a comparison under the same machine conditions,
    which drift on shared VMs; each case returns one sample (seconds or a rate).
    """
    for case in cases.values():
        case()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps):
        for name, case in cases.items():
            samples[name].append(case())
    return {name: statistics.median(values) for name, values in samples.items()}


# --- raw baselines ---------------------------------------------------------------------


def raw_write(path: str, views: list[memoryview], flags: int) -> None:
    """One raw page write: open with ``flags`` (O_EXCL: a new file; 0: in place), pwritev."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | flags, 0o600)
    try:
        os.pwritev(fd, views, 0)
    finally:
        os.close(fd)


def raw_read(path: str, views: list[memoryview]) -> None:
    """One raw page read: open, preadv into the page's regions, close."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if os.preadv(fd, views, 0) != sum(v.nbytes for v in views):
            raise SystemExit(f"short raw read of {path}")
    finally:
        os.close(fd)


def drop_cache(paths: Sequence[str]) -> None:
    """Evict these (clean) files from the page cache; other processes' caches stay."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_files(paths: Sequence[str]) -> None:
    """Write these files back, so that :func:`drop_cache` can evict them."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --- output ----------------------------------------------------------------------------


def emit(
    bench: str,
    case: str,
    ours: list[float],
    base: list[float],
    name: str,
    target: float | None,
    *,
    unit: str = "GB/s",
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Print one JSON line (DESIGN.md's form) for per-round rates ``ours`` vs ``base``.

    ``ratio`` is the median of the per-round ratios (the two sides of a round ran under
    the same conditions); ``spread`` is their lowest and highest, so noise is visible.
    """
    ratios = [o / b for o, b in zip(ours, base, strict=True) if b]
    ratio = statistics.median(ratios) if ratios else None
    line: dict[str, Any] = {
        "bench": bench,
        "case": case,
        "ours": round(statistics.median(ours), 3),
        "baseline": round(statistics.median(base), 3),
        "baseline_name": name,
        "unit": unit,
        "ratio": None if ratio is None else round(ratio, 3),
        "target": target,
        "spread": [round(min(ratios), 3), round(max(ratios), 3)] if ratios else None,
        **(extra or {}),
    }
    print(json.dumps(line), flush=True)
    mark = ""
    if target is not None:
        mark = "  ok" if ratio is not None and ratio >= target else "  BELOW TARGET"
    spread = line["spread"] or ["-", "-"]
    target_text = "" if target is None else f" (target {target})"
    print(
        f"{case:<40} {line['ours']:8.2f} vs {line['baseline']:8.2f} {unit} {name:<30} "
        f"x{line['ratio']} [{spread[0]}-{spread[1]}]{target_text}{mark}",
        file=sys.stderr,
        flush=True,
    )
    return line


# --- the page-path suite ---------------------------------------------------------------


@dataclass(frozen=True)
class Size:
    """One page size of the suite: its label, geometry arguments, page count and batch."""

    label: str
    num_layers: int
    page_size: int
    pages: int
    batch: int


#: 8 MiB: the 8B-class page (32 layers x 8 heads x 128 x bf16 x 64 tokens); 128 KiB: the
#: same model at one token per page; 16 KiB: a per-layer slice (4 layers, one token).
SIZES_FULL: tuple[Size, ...] = (
    Size("8MiB", 32, 64, 64, 8),
    Size("128KiB", 32, 1, 1024, 32),
    Size("16KiB", 4, 1, 2048, 32),
)
SIZES_QUICK: tuple[Size, ...] = (
    Size("8MiB", 32, 64, 16, 8),
    Size("128KiB", 32, 1, 256, 32),
    Size("16KiB", 4, 1, 512, 32),
)


class _Rounds:
    """Per-round seconds of several sides, each timed batch by batch in rotating order.

    The order also alternates direction batch by batch: a side that reads the same files
    into the same pages as the side just before it finds them in the CPU caches, so in
    one direction only the side after would always get that head start.
    """

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
        clock = time.perf_counter
        for g in range(self.groups):
            shift = (g // 2) % len(names)
            order = names[shift:] + names[:shift]
            for name in order if g % 2 == 0 else order[::-1]:
                if before is not None:
                    before(name, g)
                t0 = clock()
                self.sides[name](g)
                totals[name] += clock() - t0
        if record:
            for name in names:
                self.seconds[name].append(totals[name])

    def rates(self, name: str, nbytes: int) -> list[float]:
        return [nbytes / s / GB for s in self.seconds[name]]


def page_path_suite(
    bench: str,
    make_backend: Callable[[Path], Any],
    threads: int,
    work: Path,
    *,
    sizes: Sequence[Size],
    reps: int,
    cold_target: float | None,
) -> list[dict[str, Any]]:
    """Every case of every size, ours vs the raw baselines; the JSON lines printed.

    ``make_backend(root)`` builds the backend under test; ``threads`` is its number of I/O
    threads (the raw N-thread baseline uses as many). All sides move the same bytes from
    and into the same host-pool pages, allocated and touched once.
    """
    lines: list[dict[str, Any]] = []
    pool = ThreadPoolExecutor(threads, thread_name_prefix="raw")
    try:
        for size in sizes:
            lines.extend(
                _one_size(bench, make_backend, threads, work, size, reps, cold_target, pool)
            )
    finally:
        pool.shutdown()
    return lines


def _one_size(
    bench: str,
    make_backend: Callable[[Path], Any],
    threads: int,
    work: Path,
    size: Size,
    reps: int,
    cold_target: float | None,
    pool: ThreadPoolExecutor,
) -> list[dict[str, Any]]:
    """The suite's cases for one page size; the JSON lines printed."""
    import torch

    from kvtier.backends.filestore import paths as fs_paths
    from kvtier.core.geometry import KVGeometry
    from kvtier.core.host_pool import HostPool
    from kvtier.core.keys import Namespace, PageKeyer
    from kvtier.core.pagestore import PageStore

    geometry = KVGeometry.mha(
        num_layers=size.num_layers,
        num_kv_heads=8,
        head_dim=128,
        page_size=size.page_size,
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
    root = work / f"store-{size.label}"
    backend = make_backend(root)
    full = PageStore(backend, host, fingerprint=geometry.fingerprint, verify="full")
    header = PageStore(backend, host, fingerprint=geometry.fingerprint, verify="header")
    views = [[e.view for e in host.page_buffers(p)] for p in ids]
    stored = sum(v.nbytes for v in views[0])
    total = n * stored
    raw_dir = work / f"raw-{size.label}"
    raw_dir.mkdir(mode=0o700)
    raw1 = [f"{raw_dir}/a{i}" for i in range(n)]
    rawn = [f"{raw_dir}/b{i}" for i in range(n)]
    groups = [list(range(i, min(i + size.batch, n))) for i in range(0, n, size.batch)]
    gk = [[keys[i] for i in g] for g in groups]
    gp = [[ids[i] for i in g] for g in groups]
    label = f"{n}x{size.label}"
    print(
        f"{bench}: {label} ({stored} bytes stored each), batches of {size.batch}, "
        f"{reps} rounds, {threads} threads",
        file=sys.stderr,
    )

    def check(ok: list[bool], what: str, stats: Callable[[], Any]) -> None:
        if not all(ok):
            raise SystemExit(f"{what} failed: {stats()}")

    def seq_write(files: list[str], flags: int) -> Callable[[int], None]:
        def run(g: int) -> None:
            for i in groups[g]:
                raw_write(files[i], views[i], flags)

        return run

    def spread(g: int, one: Callable[[int], None]) -> None:
        # one contiguous slice per thread, this thread working the first: the
        # cheapest way to keep N raw requests going (one hand-off per thread)
        idx = groups[g]
        cut = [len(idx) * t // threads for t in range(threads + 1)]

        def work(t: int) -> None:
            for i in idx[cut[t] : cut[t + 1]]:
                one(i)

        futures = [pool.submit(work, t) for t in range(1, threads)]
        work(0)
        for future in futures:
            future.result()

    def par_write(files: list[str], flags: int) -> Callable[[int], None]:
        def run(g: int) -> None:
            spread(g, lambda i: raw_write(files[i], views[i], flags))

        return run

    def seq_read(files: list[str]) -> Callable[[int], None]:
        def run(g: int) -> None:
            for i in groups[g]:
                raw_read(files[i], views[i])

        return run

    def par_read(files: list[str]) -> Callable[[int], None]:
        def run(g: int) -> None:
            spread(g, lambda i: raw_read(files[i], views[i]))

        return run

    def put(g: int) -> None:
        check(full.put(gk[g], gp[g]), "put", full.stats)

    def get_full(g: int) -> None:
        check(full.get(gk[g], gp[g]), "verified get", full.stats)

    def get_header(g: int) -> None:
        check(header.get(gk[g], gp[g]), "header-verified get", header.stats)

    def remove_all() -> None:
        backend.delete(keys)
        for path in raw1 + rawn:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    excl = os.O_EXCL
    # 1. puts of new pages
    puts = _Rounds(
        {"ours": put, "raw1": seq_write(raw1, excl), "rawn": par_write(rawn, excl)},
        len(groups),
    )
    for rep in range(reps + 1):
        puts.round(remove_all, record=rep > 0)
    # 2. warm gets, full and header-only verification
    gets = _Rounds(
        {"ours": get_full, "header": get_header, "raw1": seq_read(raw1), "rawn": par_read(raw1)},
        len(groups),
    )
    for rep in range(reps + 1):
        gets.round(record=rep > 0)
    # 3. overwrites of existing pages (raw: in place, no truncation)
    overwrites = _Rounds({"ours": put, "raw1": seq_write(raw1, 0)}, len(groups))
    for rep in range(reps + 1):
        overwrites.round(record=rep > 0)
    # 4. cold gets: every file written back, then dropped just before it is read
    ours_files = [fs_paths.page_path_str(os.fspath(backend.store), k) for k in keys]
    fsync_files(ours_files + raw1)
    files_of = {"ours": ours_files, "raw1": raw1, "rawn": raw1}
    colds = _Rounds({"ours": get_full, "raw1": seq_read(raw1), "rawn": par_read(raw1)}, len(groups))

    def drop(name: str, g: int) -> None:
        drop_cache([files_of[name][i] for i in groups[g]])

    for rep in range(reps + 1):
        colds.round(before=drop, record=rep > 0)

    def rate(r: _Rounds, name: str) -> list[float]:
        return r.rates(name, total)

    def overhead(r: _Rounds, base: str) -> dict[str, float]:
        ours_s = statistics.median(r.seconds["ours"])
        base_s = statistics.median(r.seconds[base])
        return {"overhead_us_per_page": round((ours_s - base_s) / n * 1e6, 1)}

    raw1_name, rawn_name = "os.pwritev, 1 thread", f"os.pwritev, {threads} threads"
    out = [
        emit(
            bench,
            f"put {label} new",
            rate(puts, "ours"),
            rate(puts, "raw1"),
            raw1_name,
            0.9,
            extra=overhead(puts, "raw1"),
        ),
        emit(bench, f"put {label} new", rate(puts, "ours"), rate(puts, "rawn"), rawn_name, 1.0),
        emit(
            bench,
            f"get {label} warm",
            rate(gets, "ours"),
            rate(gets, "raw1"),
            "os.preadv, 1 thread",
            0.9,
            extra=overhead(gets, "raw1"),
        ),
        emit(
            bench,
            f"get {label} warm",
            rate(gets, "ours"),
            rate(gets, "rawn"),
            f"os.preadv, {threads} threads",
            1.0,
        ),
        emit(
            bench,
            f"get {label} warm full vs header verify",
            rate(gets, "ours"),
            rate(gets, "header"),
            "header-only verify",
            0.9,
        ),
        emit(
            bench,
            f"put {label} overwrite",
            rate(overwrites, "ours"),
            rate(overwrites, "raw1"),
            "os.pwritev in place, 1 thread",
            0.8,
        ),
        emit(
            bench,
            f"get {label} cold",
            rate(colds, "ours"),
            rate(colds, "raw1"),
            "os.preadv cold, 1 thread",
            cold_target,
        ),
        emit(
            bench,
            f"get {label} cold",
            rate(colds, "ours"),
            rate(colds, "rawn"),
            f"os.preadv cold, {threads} threads",
            1.0,
        ),
    ]
    full.close()
    header.close()
    backend.close()
    shutil.rmtree(raw_dir, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    return out
