"""kvtier behind SGLang's HiCache (zero-copy v1 path) vs raw os.pwritev / os.preadv.

Usage: ``python benchmarks/sglang.py [--quick] [--root DIR] [--reps N]``. One JSON object
per line on stdout, a table on stderr.

Pages of 8 MiB (MHA, 32 layers, 8 KV heads, head_dim 128, bf16, 64 tokens, SGLang's
default ``page_first`` layout): 256 of them, 32 with ``--quick``. Our side is the path a
SGLang server takes: ``StorageBackendFactory.create_backend("dynamic", ...)`` builds
``KvtierHiCacheStorage`` on the ``file`` backend, and the cache controller's calls move the
pages (``batch_set_v1`` for backup, ``batch_exists`` + ``batch_get_v1`` for prefetch, in
SGLang's batches of 128), with the envelope and full checksum verification on. The
baseline moves the very same regions (each page's 4096-byte envelope slot and its K and V
blocks in the host pool) with one ``open`` + ``os.pwritev`` / ``os.preadv`` + ``close``
per page file, one request at a time in this thread. Cases:

- ``put``: write every page (ours replaces the previous repetition's pages atomically);
- ``get warm``: read every page back with the files in the page cache, every page's
  payload checksum verified (the default, ``verify: full``);
- ``get warm, verify=header``: the same files read with ``verify: header`` (envelope
  header checked, payload checksum skipped), to show what the checksum costs; no target;
- ``get warm, generic path``: the same through SGLang's generic path (no
  ``interface_v1``: a fresh tensor per page and copies), for comparison, no target.

The host pool is the test stand-in with SGLang's ``MHATokenToKVPoolHost`` buffer shapes
(``tests/sglang_host_pool.py``; the real class needs GPU dependencies to import). Both sides
run interleaved in each repetition after a warm-up; the median is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# This file is named sglang.py: drop its folder from the path so that `sglang` is SGLang.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent / "tests"))

import sglang_host_pool as shp  # noqa: E402

MiB = 1024 * 1024
TARGET = 0.85


def _extra(root: Path, *, zero_copy: bool, section: dict[str, Any]) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "backend_name": "kvtier",
        "module_path": shp.MODULE_PATH,
        "class_name": shp.CLASS_NAME,
        "kvtier": {"backend": "file", "extra_config": {"root": str(root)}, **section},
    }
    if zero_copy:
        extra["interface_v1"] = 1
    return extra


def _raw_put(paths: list[Path], pages: list[list[Any]]) -> None:
    for path, regions in zip(paths, pages, strict=True):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.pwritev(fd, [r.view for r in regions], 0)
        finally:
            os.close(fd)


def _raw_get(paths: list[Path], pages: list[list[Any]]) -> None:
    for path, regions in zip(paths, pages, strict=True):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.preadv(fd, [r.view for r in regions], 0)
        finally:
            os.close(fd)


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 pages, 3 repetitions")
    parser.add_argument("--root", type=Path, default=None, help="directory for the files")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions")
    parser.add_argument("--only", default="", help="run only cases containing this text")
    parser.add_argument("--checksum-workers", type=int, default=None)
    parser.add_argument("--io-threads", type=int, default=None, help="file backend threads")
    args = parser.parse_args()
    section: dict[str, Any] = {}
    if args.checksum_workers is not None:
        section["checksum_workers"] = args.checksum_workers
    count = 32 if args.quick else 256
    reps = args.reps or (3 if args.quick else 5)

    os.environ.setdefault("KVTIER_DISABLE_PLUGIN_AUTOLOAD", "1")
    shp.load_sglang()
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-sglang-", dir=args.root))
    try:
        pool = shp.MHAHostPool(
            layer_num=32,
            head_num=8,
            head_dim=128,
            page_size=64,
            pages=count,
            layout="page_first",
        )
        ps = pool.page_size
        page_mib = pool.page_bytes() / MiB
        indices = pool.alloc(count * ps)
        for i in range(count):
            pool.fill_random(int(indices[i * ps]), i)
        hashes = shp.page_hashes(list(range(count * ps)), ps)

        def attach(name: str, *, zero_copy: bool, verify: str = "full") -> shp.Controller:
            extra = _extra(workdir / name, zero_copy=zero_copy, section=section)
            extra["kvtier"]["verify"] = verify
            if args.io_threads is not None:
                extra["kvtier"]["extra_config"]["io_threads"] = args.io_threads
            controller = shp.Controller.attach(shp.storage_config(extra_config=extra), pool)
            assert isinstance(controller.storage, HiCacheStorage)
            return controller

        ours = attach("ours", zero_copy=True)
        header_only = attach("ours", zero_copy=True, verify="header")  # the same files
        generic = attach("generic", zero_copy=False)
        pages = [ours.storage._require().pages.page_buffers(i) for i in range(count)]
        raw_dir = workdir / "raw"
        raw_dir.mkdir()
        raw_paths = [raw_dir / f"page-{i:05d}" for i in range(count)]
        nbytes = sum(r.length for regions in pages for r in regions)

        def our_put() -> None:
            assert ours.backup(hashes, indices) == count * ps

        def our_get() -> None:
            assert ours.prefetch(ours.hit_query(hashes), indices) == count

        def header_get() -> None:
            assert header_only.prefetch(header_only.hit_query(hashes), indices) == count

        def generic_get() -> None:
            assert generic.prefetch(generic.hit_query(hashes), indices) == count

        # warm-up: every file written and read once, every buffer touched
        our_put()
        _raw_put(raw_paths, pages)
        assert generic.backup(hashes, indices) == count * ps
        our_get()
        _raw_get(raw_paths, pages)
        generic_get()

        cases: list[tuple[str, Callable[[], None], Callable[[], None], str, float | None]] = [
            ("put", our_put, lambda: _raw_put(raw_paths, pages), "os.pwritev", TARGET),
            ("get warm", our_get, lambda: _raw_get(raw_paths, pages), "os.preadv", TARGET),
            (
                "get warm, verify=header",
                header_get,
                lambda: _raw_get(raw_paths, pages),
                "os.preadv",
                None,
            ),
            (
                "get warm, generic path",
                generic_get,
                lambda: _raw_get(raw_paths, pages),
                "os.preadv",
                None,
            ),
        ]
        rows = []
        for case, mine, raw, raw_name, target in cases:
            if args.only not in case:
                continue
            times_ours: list[float] = []
            times_raw: list[float] = []
            for rep in range(reps):
                if rep % 2:
                    times_raw.append(_timed(raw))
                    times_ours.append(_timed(mine))
                else:
                    times_ours.append(_timed(mine))
                    times_raw.append(_timed(raw))
            ours_gbs = nbytes / statistics.median(times_ours) / 1e9
            raw_gbs = nbytes / statistics.median(times_raw) / 1e9
            row = {
                "bench": "sglang",
                "case": f"{case} {count}x{page_mib:g}MiB",
                "ours": round(ours_gbs, 3),
                "baseline": round(raw_gbs, 3),
                "baseline_name": raw_name,
                "unit": "GB/s",
                "ratio": round(ours_gbs / raw_gbs, 3),
                "target": target,
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
        stats = ours.storage.kvtier_stats()
        assert stats["invalid"] == 0 and stats["backend_errors"] == 0, stats
        print(f"{'case':<36}{'kvtier GB/s':>12}{'raw GB/s':>10}{'ratio':>8}", file=sys.stderr)
        for row in rows:
            print(
                f"{row['case']:<36}{row['ours']:>12.2f}{row['baseline']:>10.2f}"
                f"{row['ratio']:>8.2f}",
                file=sys.stderr,
            )
        for controller in (ours, header_only, generic):
            controller.storage.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
