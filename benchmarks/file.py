"""File backend vs what users compare it with: raw pwritev / preadv, 1 and N threads.

    python benchmarks/file.py [--quick] [--reps R] [--dir PATH] [--sizes 8MiB,128KiB,16KiB]

For 8 MiB, 128 KiB and 16 KiB pages (see ``_common.SIZES_FULL``; ``--quick`` uses fewer
pages), through ``PageStore`` with full verification over a ``FileBackend`` with 4 I/O
threads, batch by batch, interleaved in one run with the raw baselines (one JSON line
each on stdout, a table on stderr; ``spread`` is the lowest and highest per-round ratio):

- ``put ... new``: new pages (temp file, atomic rename) vs raw ``open(O_EXCL) + pwritev``
  into new files in one thread (target 0.9) and on 4 threads (target 1.0);
- ``get ... warm``: page cache warm, vs raw ``open + preadv`` in one thread (target 0.9)
  and on 4 threads (target 1.0); ``... full vs header verify``: the same gets with
  header-only verification (target 0.9: the payload checksum costs at most 10 %);
- ``put ... overwrite``: replacing existing pages (still atomic) vs raw in-place
  ``pwritev`` over the same file (target 0.8);
- ``get ... cold``: every file written back and dropped from the page cache
  (``posix_fadvise(DONTNEED)``) just before its batch is read, vs raw cold reads in one
  thread (informational) and on 4 threads (target 1.0);
- ``exists 10000 keys``: the in-memory index vs one ``os.stat`` per key, ns per key.

The 1-thread lines carry ``overhead_us_per_page``: kvtier's time per page beyond the raw
system calls. Memory is allocated and touched once and reused by every round.
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

from _common import SIZES_FULL, SIZES_QUICK, page_path_suite

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
    parser.add_argument("--sizes", default=None, help="page sizes, e.g. 128KiB,16KiB")
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
    sizes = SIZES_QUICK if args.quick else SIZES_FULL
    if args.sizes:
        wanted = set(args.sizes.split(","))
        sizes = tuple(s for s in sizes if s.label in wanted)
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
