"""File backend vs raw os.pwritev / os.preadv of the same bytes; verification cost.

    python benchmarks/file.py [--quick] [--pages N] [--reps R] [--dir PATH]

Cases (one JSON line each on stdout, a table on stderr):

- ``put NxMiB new``: ``FileBackend.put`` of new pages (temp file, rename) vs raw
  ``open(O_CREAT) + pwritev`` of the same regions into new files. Target 0.9.
- ``get NxMiB warm``: ``FileBackend.get`` vs raw ``open + preadv`` (page cache warm) into
  the same host-pool pages (the bytes are equal; the tests check correctness). Target 0.9.
- ``put NxMiB overwrite``: replacing existing pages (exchange + unlink) vs raw
  ``open(O_TRUNC) + pwritev``. Informational.
- ``get NxMiB batched``: one ``get`` call per 16 pages on the backend's thread pool vs the
  same raw reads one by one. Informational.
- ``get full vs header verify``: ``PageStore.get`` with the full payload checksum vs
  header-only verification. Target 0.9 (full costs at most 10 %).
- ``get batched 16 full (N checksum threads) vs header``: the same with 16-page calls and
  the PageStore's checksum threads. Informational.
- ``exists 10000 keys``: the in-memory index vs one ``os.stat`` per key, ns per key
  (ratio = stat time / index time). Informational.

Both sides run in this process, page by page, alternating which goes first, after a
warm-up round; each figure is the median over ``--reps`` rounds. Pages are the 8B-class
geometry (32 layers, 8 KV heads, head dim 128, bf16, 64 tokens: 8 MiB + 4 KiB envelope).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvtier.backends.file import FileConfig
from kvtier.backends.file.backend import FileBackend
from kvtier.backends.filestore import paths as fs_paths
from kvtier.core.geometry import KVGeometry
from kvtier.core.host_pool import HostPool
from kvtier.core.keys import Namespace, PageKeyer
from kvtier.core.pagestore import PageStore

GEOMETRY = KVGeometry.mha(num_layers=32, num_kv_heads=8, head_dim=128, page_size=64)
LAYOUT = "page_first_direct"
GB = 1e9


def emit(case: str, ours: float, baseline: float, name: str, target: float | None) -> None:
    line = {
        "bench": "file",
        "case": case,
        "ours": round(ours, 3),
        "baseline": round(baseline, 3),
        "baseline_name": name,
        "unit": "GB/s",
        "ratio": round(ours / baseline, 3) if baseline else None,
        "target": target,
    }
    print(json.dumps(line), flush=True)
    status = (
        ""
        if target is None
        else ("  ok" if line["ratio"] and line["ratio"] >= target else "  BELOW TARGET")
    )
    print(
        f"{case:<34} ours {ours:7.2f} GB/s   {name:<22} {baseline:7.2f} GB/s   "
        f"ratio {line['ratio']}{status}",
        file=sys.stderr,
    )


def raw_write(path: Path, regions: list[memoryview], flags: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | flags, 0o600)
    try:
        os.pwritev(fd, regions, 0)
    finally:
        os.close(fd)


def raw_read(path: Path, regions: list[memoryview]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if os.preadv(fd, regions, 0) != sum(r.nbytes for r in regions):
            raise SystemExit(f"short raw read of {path}")
    finally:
        os.close(fd)


def interleaved(
    n: int,
    ours: Callable[[int], None],
    raw: Callable[[int], None],
    before: Callable[[], None] | None = None,
) -> tuple[float, float]:
    """One round over ``n`` items, alternating which side goes first; total seconds each."""
    if before is not None:
        before()
    t_ours = t_raw = 0.0
    clock = time.perf_counter
    for i in range(n):
        sides = ((ours, "o"), (raw, "r")) if i % 2 == 0 else ((raw, "r"), (ours, "o"))
        for fn, which in sides:
            t0 = clock()
            fn(i)
            dt = clock() - t0
            if which == "o":
                t_ours += dt
            else:
                t_raw += dt
    return t_ours, t_raw


def rounds(reps: int, run: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    """Warm-up, then ``reps`` rounds; median seconds of each side."""
    run()
    ours, raw = [], []
    for _ in range(reps):
        o, r = run()
        ours.append(o)
        raw.append(r)
    return statistics.median(ours), statistics.median(raw)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 pages, 3 rounds (< 1 minute)")
    parser.add_argument("--pages", type=int, default=None, help="pages (default 256)")
    parser.add_argument("--reps", type=int, default=None, help="timed rounds (default 5)")
    parser.add_argument("--dir", default=None, help="directory for the files (default: tmp)")
    args = parser.parse_args()
    pages = args.pages or (32 if args.quick else 256)
    reps = args.reps or (3 if args.quick else 5)
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-file-", dir=args.dir))
    try:
        return run(pages, reps, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(pages: int, reps: int, work: Path) -> int:
    # memory allocated and touched once, reused by every round
    host = HostPool(GEOMETRY, LAYOUT, num_pages=pages, pin_memory=False)
    generator = torch.Generator().manual_seed(0)
    for page in range(pages):
        for extent in host.page_buffers(page):
            raw = torch.frombuffer(extent.view, dtype=torch.uint8)
            raw.random_(0, 256, generator=generator)
    page_ids = host.allocate(pages)
    keyer = PageKeyer(Namespace("bench-file", GEOMETRY.fingerprint), GEOMETRY.page_size)
    tokens = torch.randint(0, 128_000, (pages * GEOMETRY.page_size,), generator=generator)
    keys = keyer.keys(tokens.tolist())
    backend = FileBackend(FileConfig(root=work / "store", min_free_bytes=0, io_threads=4))
    store = PageStore(backend, host, fingerprint=GEOMETRY.fingerprint, verify="full")
    header_store = PageStore(backend, host, fingerprint=GEOMETRY.fingerprint, verify="header")
    buffers = [host.page_buffers(p) for p in page_ids]
    regions = [[e.view for e in b] for b in buffers]
    stored = sum(e.length for e in buffers[0])
    total = pages * stored
    raw_dir = work / "raw"
    raw_dir.mkdir(mode=0o700)
    raw_paths = [raw_dir / f"{i}.page" for i in range(pages)]
    label = f"{pages}x{GEOMETRY.bytes_per_page >> 20}MiB"
    print(
        f"file backend benchmark: {pages} pages x {stored} bytes, {reps} rounds, in {work}",
        file=sys.stderr,
    )
    assert store.put(keys, page_ids) == [True] * pages  # valid envelopes in every header

    def remove_all() -> None:
        backend.delete(keys)
        for path in raw_paths:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def put_new(i: int) -> None:
        if backend.put([keys[i]], [buffers[i]]) != [True]:
            raise SystemExit(f"put of page {i} failed: {backend.stats()}")

    o, r = rounds(
        reps,
        lambda: interleaved(
            pages, put_new, lambda i: raw_write(raw_paths[i], regions[i], os.O_EXCL), remove_all
        ),
    )
    emit(f"put {label} new", total / o / GB, total / r / GB, "os.pwritev (new file)", 0.9)

    def get_one(i: int) -> None:
        if backend.get([keys[i]], [buffers[i]]) != [True]:
            raise SystemExit(f"get of page {i} failed: {backend.stats()}")

    o, r = rounds(
        reps, lambda: interleaved(pages, get_one, lambda i: raw_read(raw_paths[i], regions[i]))
    )
    emit(f"get {label} warm", total / o / GB, total / r / GB, "os.preadv", 0.9)

    o, r = rounds(
        reps,
        lambda: interleaved(
            pages, put_new, lambda i: raw_write(raw_paths[i], regions[i], os.O_TRUNC)
        ),
    )
    emit(f"put {label} overwrite", total / o / GB, total / r / GB, "os.pwritev (O_TRUNC)", None)

    batch = 16
    groups = [list(range(i, min(i + batch, pages))) for i in range(0, pages, batch)]

    def get_group(g: int) -> None:
        idx = groups[g]
        if backend.get([keys[i] for i in idx], [buffers[i] for i in idx]) != [True] * len(idx):
            raise SystemExit("batched get failed")

    def raw_group(g: int) -> None:
        for i in groups[g]:
            raw_read(raw_paths[i], regions[i])

    o, r = rounds(reps, lambda: interleaved(len(groups), get_group, raw_group))
    emit(f"get {label} batched {batch}", total / o / GB, total / r / GB, "os.preadv", None)

    def full(i: int) -> None:
        if store.get([keys[i]], [page_ids[i]]) != [True]:
            raise SystemExit(f"verified get of page {i} failed: {store.stats()}")

    def header(i: int) -> None:
        if header_store.get([keys[i]], [page_ids[i]]) != [True]:
            raise SystemExit(f"header-verified get of page {i} failed: {header_store.stats()}")

    o, r = rounds(reps, lambda: interleaved(pages, full, header))
    emit("get full vs header verify", total / o / GB, total / r / GB, "header-only verify", 0.9)

    workers = max(2, min(4, os.cpu_count() or 2))
    threaded = PageStore(
        backend, host, fingerprint=GEOMETRY.fingerprint, verify="full", checksum_workers=workers
    )

    def full_group(g: int) -> None:
        idx = groups[g]
        if threaded.get([keys[i] for i in idx], [page_ids[i] for i in idx]) != [True] * len(idx):
            raise SystemExit("batched verified get failed")

    def header_group(g: int) -> None:
        idx = groups[g]
        got = header_store.get([keys[i] for i in idx], [page_ids[i] for i in idx])
        if got != [True] * len(idx):
            raise SystemExit("batched header-verified get failed")

    o, r = rounds(reps, lambda: interleaved(len(groups), full_group, header_group))
    emit(
        f"get batched {batch} full ({workers} checksum threads) vs header",
        total / o / GB,
        total / r / GB,
        "header-only verify",
        None,
    )
    threaded.close()
    exists_case(backend, keyer, reps)
    backend.close()
    return 0


def exists_case(backend: FileBackend, keyer: PageKeyer, reps: int) -> None:
    """``exists`` of indexed keys vs one ``os.stat`` per key (what a backend without an index
    pays), in nanoseconds per key."""
    n = 10_000
    keys = keyer.keys(list(range(n * GEOMETRY.page_size)))
    for key in keys:
        backend.index.touch(key, 1)  # indexed, as after a start-up scan
    paths = [fs_paths.page_path_str(os.fspath(backend.store), key) for key in keys]
    for path in paths[:: n // 100]:  # a few real files, the rest misses: both sides equal
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        Path(path).touch()

    def stat_all() -> None:
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.stat(path)

    ours, base = [], []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        backend.exists(keys)
        t1 = time.perf_counter()
        stat_all()
        t2 = time.perf_counter()
        ours.append((t1 - t0) / n * 1e9)
        base.append((t2 - t1) / n * 1e9)
    o, b = statistics.median(ours[1:]), statistics.median(base[1:])
    line = {
        "bench": "file",
        "case": f"exists {n} keys",
        "ours": round(o, 1),
        "baseline": round(b, 1),
        "baseline_name": "os.stat per key",
        "unit": "ns/key",
        "ratio": round(b / o, 1),
        "target": None,
    }
    print(json.dumps(line), flush=True)
    print(f"{line['case']:<34} ours {o:7.0f} ns/key   os.stat {b:7.0f} ns/key", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
