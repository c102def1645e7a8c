"""Segment backend vs raw one-file-per-page I/O and the packed-file floor, 16 KiB to 8 MiB.

    python benchmarks/segments.py [--quick] [--reps R] [--dir PATH] [--sizes 16KiB,8MiB]
                                  [--threads N] [--unbounded] [--no-file]

For 16 KiB, 128 KiB, 2 MiB and 8 MiB pages (``_common.SIZES_FULL``; ``--quick`` uses
fewer pages and 3 rounds), through ``PageStore`` with full verification over a
``SegmentBackend`` (defaults: 64 MiB segments, 4 I/O threads), batch by batch,
interleaved in one run (the order rotates and alternates direction batch by batch) with
the suite every page-path benchmark runs (``_common.page_path_suite``, the same as
``file.py`` and ``uring.py``):

- ``one file per page, 1 thread``: ``open + pwritev / preadv + close``, one thread;
- ``one file per page, N threads``: the same calls on N threads (N = the backend's
  ``io_threads``), one contiguous slice of each batch per thread;
- ``packed file, one call per batch``: ``pwritev`` / ``preadv`` of the same bytes into
  one pre-allocated file, pages back to back as a segment holds them: the physical floor
  of packed pages, with no envelope, no index, no record header;
- ``file backend``: the ``file`` backend through the same ``PageStore`` in the same
  rounds (informational; ``--no-file`` leaves it out).

Cases (one JSON line per case and side on stdout, DESIGN.md's form; a table on stderr;
``spread`` is the lowest and highest per-round ratio):

- ``put ... new``: new pages (the stores emptied, raw files removed, untimed, before each
  round; the floor writes into its pre-allocated file);
- ``get ... warm``: page cache warm (and ``... full vs header verify``);
- ``get ... cold``: every file written back, then dropped from the page cache
  (``posix_fadvise(DONTNEED)``) just before each side reads each batch (ours: every
  segment file);
- ``put ... overwrite``: the same keys again (ours and ``file`` keep every put atomic; the
  raw sides write in place, which is not).

Targets (goals, not gates; ``_common.target``): pages up to 128 KiB at least 1.0x both
raw one-file-per-page sides on every case and 0.8x the floor; 8 MiB pages 0.9x the floor.
``--unbounded`` runs the page stores without the per-call bound
(``backend_call_timeout_s: null``), which costs one thread hand-off per call (65-90 µs
here); the default keeps it, as engines run.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import Store, page_path_suite, pick_sizes

BENCH = "segments"


def segment_files(backend: Any, keys: Sequence[str]) -> list[str]:
    """Every segment file of the store: a batch may lie in any of them."""
    return [str(p) for p in sorted(Path(backend.config.root).rglob("*.seg"))]


def describe(backend: Any) -> str:
    stats = backend.stats()
    return (
        f"segment backend: {stats['segments']} segments, {stats['read_calls']} reads, "
        f"{stats['write_calls']} record writes, {stats['segments_reclaimed']} reclaimed"
    )


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

    from kvtier.backends.file import FileConfig
    from kvtier.backends.file.backend import FileBackend
    from kvtier.backends.segment import SegmentConfig
    from kvtier.backends.segment.backend import SegmentBackend

    threads = args.threads
    reps = args.reps or (3 if args.quick else 5)
    ours = Store(
        make=lambda root: SegmentBackend(
            SegmentConfig(root=root, min_free_bytes=0, io_threads=threads)
        ),
        files_of=segment_files,
        empty=lambda backend, keys: backend.clear(),
        describe=describe,
    )
    beside = (
        {}
        if args.no_file
        else {
            "file": Store(
                lambda root: FileBackend(
                    FileConfig(root=root, min_free_bytes=0, io_threads=threads)
                )
            )
        }
    )
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-segments-", dir=args.dir))
    try:
        page_path_suite(
            BENCH,
            ours,
            threads,
            work,
            sizes=pick_sizes(args.quick, args.sizes),
            reps=reps,
            cold_target=None,
            beside=beside,
            bounded=not args.unbounded,
        )
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
