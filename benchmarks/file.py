"""File backend vs raw one-file-per-page I/O (1 and N threads) and the packed-file floor.

    python benchmarks/file.py [--quick] [--reps R] [--dir PATH] [--sizes 16KiB,2MiB]

For 16 KiB, 128 KiB, 2 MiB and 8 MiB pages (``_common.SIZES_FULL``; ``--quick`` uses
fewer pages and 3 rounds), through ``PageStore`` with full verification over a
``FileBackend`` with 4 I/O threads, batch by batch, interleaved in one run (the order
rotates and alternates direction batch by batch) with three raw sides moving the same
bytes between the same host-pool pages (``_common.page_path_suite``):

- ``one file per page, 1 thread``: ``open + pwritev / preadv + close`` per page;
- ``one file per page, 4 threads``: the same calls spread over 4 threads (LMCache's
  local-disk pool; the backend's I/O threads);
- ``packed file, one call per batch``: ``pwritev`` / ``preadv`` of a batch's pages back
  to back in one pre-allocated file: the physical floor of packed pages.

Cases (one JSON line per case and side on stdout, DESIGN.md's form, with ``spread``: the
lowest and highest per-round ratio; a table on stderr):

- ``put ... new``: new pages (temp file, atomic rename; the store and the raw files
  emptied before each round, untimed; the floor writes into its pre-allocated file);
- ``get ... warm``: page cache warm; ``... full vs header verify``: the same gets with
  header-only verification (the payload checksum's cost);
- ``get ... cold``: every file written back, then dropped from the page cache
  (``posix_fadvise(DONTNEED)``) just before each side reads each batch;
- ``put ... overwrite``: replacing existing pages (still atomic) vs raw writes in place;
- ``exists 10000 keys``: the in-memory index vs one ``os.stat`` per key, ns per key.

Targets (goals, not gates; ``_common.target``): pages up to 128 KiB at least 1.0x both
one-file-per-page sides on every case and 0.8x the floor; larger pages 0.9x one raw
thread on puts and warm gets, 0.8x on overwrites, 1.0x raw on 4 threads; 8 MiB 0.9x the
floor. The 1-thread lines carry ``overhead_us_per_page``: kvtier's time per page beyond
the raw system calls. Memory is allocated and touched once and reused by every round.
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
from pathlib import Path

from _common import page_path_suite, pick_sizes

from kvtier.backends.file import FileConfig
from kvtier.backends.file.backend import FileBackend
from kvtier.backends.filestore import paths as fs_paths
from kvtier.core.geometry import KVGeometry
from kvtier.core.keys import Namespace, PageKeyer

GEOMETRY = KVGeometry.mha(num_layers=32, num_kv_heads=8, head_dim=128, page_size=64)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer pages, 3 rounds")
    parser.add_argument("--reps", type=int, default=None, help="timed rounds (default 5)")
    parser.add_argument("--dir", default=None, help="directory for the files (default: tmp)")
    parser.add_argument("--sizes", default=None, help="page sizes, e.g. 16KiB,2MiB")
    parser.add_argument(
        "--threads", type=int, default=None, help="io_threads (default: the backend's)"
    )
    parser.add_argument(
        "--python-loop", action="store_true", help="compiled_io false: the Python page loop"
    )
    args = parser.parse_args()
    threads = args.threads or FileConfig().io_threads
    compiled_io = not args.python_loop
    reps = args.reps or (3 if args.quick else 5)
    sizes = pick_sizes(args.quick, args.sizes)
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-file-", dir=args.dir))
    try:

        def make(root: Path) -> FileBackend:
            config = FileConfig(
                root=root, min_free_bytes=0, io_threads=threads, compiled_io=compiled_io
            )
            return FileBackend(config)

        page_path_suite("file", make, threads, work, sizes=sizes, reps=reps, cold_target=None)
        backend = make(work / "exists")
        keyer = PageKeyer(Namespace("bench-file", GEOMETRY.fingerprint), GEOMETRY.page_size)
        exists_case(backend, keyer, reps)
        backend.close()
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


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
