"""kvtier behind SGLang's HiCache (zero-copy v1 path) vs raw os.pwritev / os.preadv and
vs SGLang's own HiCacheFile.

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

Peer comparison, same pages, same run: SGLang's own ``HiCacheFile`` (``--hicache-storage-
backend file``), built by SGLang's ``StorageBackendFactory`` and driven through the generic
page path its cache controller takes for it (``batch_set`` of ``get_data_page`` tensors;
``batch_exists``, then ``batch_get`` into ``get_dummy_flat_data_page`` tensors copied back
with ``set_from_flat_data_page``). ``ratio`` is kvtier's v1 path (full verification on) over
``HiCacheFile``:

- ``put vs HiCacheFile``: both stores emptied (untimed) before each repetition, since
  ``HiCacheFile`` skips keys it already has; target 1.1;
- ``get warm vs HiCacheFile``: files in the page cache; target 2.0;
- ``get cold vs HiCacheFile``: every file of both stores written back and evicted from the
  page cache (``posix_fadvise(DONTNEED)``, untimed) before each repetition; no target.

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
from typing import Any, NamedTuple

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


class Case(NamedTuple):
    """One measured case: our side, the baseline, and an untimed step before each run."""

    name: str
    ours: Callable[[], None]
    baseline: Callable[[], None]
    baseline_name: str
    target: float | None
    setup: Callable[[], None] | None = None


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

        def attach_peer() -> shp.Controller:
            from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

            extra = {"file_storage_path": str(workdir / "peer")}
            config = shp.storage_config(extra_config=extra)
            storage = StorageBackendFactory.create_backend("file", config, pool)
            storage.register_mem_pool_host(pool)
            return shp.Controller(storage, config, pool, zero_copy=False)

        ours = attach("ours", zero_copy=True)
        peer = attach_peer()
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

        def peer_put() -> None:
            assert peer.backup(hashes, indices) == count * ps

        def peer_get() -> None:
            assert peer.prefetch(peer.hit_query(hashes), indices) == count

        def empty_both() -> None:
            ours.storage.clear()
            peer.storage.clear()

        def evict_both() -> None:
            files = [*(workdir / "ours").rglob("*.kv"), *(workdir / "peer").rglob("*.bin")]
            assert len(files) >= 2 * count, len(files)
            for path in files:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)

        # warm-up: every file written and read once, every buffer touched
        peer_put()
        peer_get()
        our_put()
        _raw_put(raw_paths, pages)
        assert generic.backup(hashes, indices) == count * ps
        our_get()
        _raw_get(raw_paths, pages)
        generic_get()

        raw_put = lambda: _raw_put(raw_paths, pages)  # noqa: E731
        raw_get = lambda: _raw_get(raw_paths, pages)  # noqa: E731
        peer_name = "sglang HiCacheFile (generic path)"
        cases: list[Case] = [
            Case("put", our_put, raw_put, "os.pwritev", TARGET),
            Case("get warm", our_get, raw_get, "os.preadv", TARGET),
            Case("get warm, verify=header", header_get, raw_get, "os.preadv", None),
            Case("get warm, generic path", generic_get, raw_get, "os.preadv", None),
            Case("put vs HiCacheFile", our_put, peer_put, peer_name, 1.1, empty_both),
            Case("get warm vs HiCacheFile", our_get, peer_get, peer_name, 2.0),
            Case("get cold vs HiCacheFile", our_get, peer_get, peer_name, None, evict_both),
        ]
        rows = []
        for case, mine, raw, raw_name, target, setup in cases:
            if args.only not in case:
                continue
            times_ours: list[float] = []
            times_raw: list[float] = []
            for rep in range(reps):
                order = [(times_raw, raw), (times_ours, mine)]
                for times, fn in order if rep % 2 else order[::-1]:
                    if setup is not None:
                        setup()
                    times.append(_timed(fn))
            if "vs HiCacheFile" in case:
                # the put case emptied both stores: leave every page stored for the gets
                our_put()
                peer_put()
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
        print(
            f"{'case':<40}{'kvtier GB/s':>12}{'baseline GB/s':>15}{'ratio':>8}  baseline",
            file=sys.stderr,
        )
        for row in rows:
            print(
                f"{row['case']:<40}{row['ours']:>12.2f}{row['baseline']:>15.2f}"
                f"{row['ratio']:>8.2f}  {row['baseline_name']}",
                file=sys.stderr,
            )
        for controller in (ours, header_only, generic):
            controller.storage.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
