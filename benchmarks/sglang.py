"""kvtier behind SGLang's own HiCacheController and host pool, vs SGLang's own HiCacheFile
behind the same, and vs raw os.pwritev / os.preadv.

Usage: ``python benchmarks/sglang.py [--quick] [--root DIR] [--reps N]``. One JSON object
per line on stdout, a table on stderr. It needs SGLang's KV classes, which import only in the
SGLang test environment (``scripts/install-sglang.sh``: ``.venv-sglang``); started with
another python it runs itself again with that environment's.

Pages of 8 MiB (MHA, 32 layers, 8 KV heads, head_dim 128, bf16, 64 tokens, SGLang's
default ``page_first`` layout): 256 of them, 32 with ``--quick``, in SGLang's own
``MHATokenToKVPoolHost`` (built from its ``MHATokenToKVPool`` on the CPU, unpinned). Each
side is attached to SGLang's own ``HiCacheController`` the way a server attaches it, and
every transfer goes through the controller's threads: ``write_storage`` -> the backup
thread, ``prefetch`` -> the prefetch thread's hit query, a prefetch operation -> the
prefetch I/O thread; the benchmark waits for the controller's acknowledgements. Ours is
``--hicache-storage-backend dynamic`` with kvtier on its ``file`` backend and
``"interface_v1": 1`` (the controller calls ``batch_set_v1`` / ``batch_exists`` /
``batch_get_v1``), envelope and full checksum verification on. The peer is
``--hicache-storage-backend file`` (SGLang's ``HiCacheFile``), for which the controller
takes its generic page path (``batch_set`` of ``get_data_page`` tensors, ``batch_get`` into
``get_dummy_flat_data_page`` tensors copied back with ``set_from_flat_data_page``).

Every get loads into host pages zeroed beforehand (untimed) and every byte is compared with
what was stored (untimed, an xxh3-128 digest per page), on both sides. Cases:

- ``put vs HiCacheFile``: both stores emptied (untimed) before each repetition, since
  ``HiCacheFile`` skips keys it already has; target 1.1;
- ``get warm vs HiCacheFile``: files in the page cache; target 2.0;
- ``get cold vs HiCacheFile``: every file of both stores written back and evicted from the
  page cache (``posix_fadvise(DONTNEED)``, untimed) before each repetition; no target;
- ``exists vs HiCacheFile``: the prefetch thread's hit query over every page (``ms``, the
  ratio is HiCacheFile's time over ours); no target;
- ``put`` / ``get warm`` against raw ``open`` + ``os.pwritev`` / ``os.preadv`` + ``close``
  of the same regions (each page's 4096-byte envelope slot and its K and V blocks in the
  host pool), one page at a time in this thread; target 0.85;
- ``get warm, verify=header`` and ``get warm, generic path`` (kvtier without
  ``interface_v1``), against the same raw reads, for comparison; no target.

Both sides run interleaved in each repetition after a warm-up; the median is reported.
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


def _in_sglang_env() -> None:
    """Run again with the SGLang environment's python where SGLang's KV classes are absent."""
    try:
        shp.load_kv_classes()
    except ImportError as exc:
        python = shp.VENV / "bin" / "python"
        if shp.in_sglang_env() or not python.exists():
            raise SystemExit(
                f"benchmarks/sglang.py needs SGLang's KV classes ({exc}); run "
                "scripts/install-sglang.sh, which makes the SGLang environment "
                f"{shp.VENV}"
            ) from None
        os.execv(str(python), [str(python), __file__, *sys.argv[1:]])


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
    """One measured case: our side, the baseline, and untimed steps before and after each run."""

    name: str
    ours: Callable[[], None]
    baseline: Callable[[], None]
    baseline_name: str
    target: float | None
    setup: Callable[[], None] | None = None
    #: checks what a run of either side left in the host pool (untimed)
    check: Callable[[], None] | None = None
    #: "GB/s" (higher is better) or "ms" (a time: the ratio is baseline over ours)
    unit: str = "GB/s"


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _digests(pool: Any, starts: list[int]) -> list[bytes]:
    """An xxh3-128 digest of each page's bytes in the host pool."""
    import xxhash

    return [xxhash.xxh3_128_digest(shp.page_content(pool, s).numpy()) for s in starts]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 pages, 3 repetitions")
    parser.add_argument("--root", type=Path, default=None, help="directory for the files")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions")
    parser.add_argument("--only", default="", help="run only cases containing this text")
    parser.add_argument("--checksum-workers", type=int, default=None)
    parser.add_argument("--io-threads", type=int, default=None, help="file backend threads")
    args = parser.parse_args()
    _in_sglang_env()
    section: dict[str, Any] = {}
    if args.checksum_workers is not None:
        section["checksum_workers"] = args.checksum_workers
    count = 32 if args.quick else 256
    reps = args.reps or (3 if args.quick else 5)

    os.environ.setdefault("KVTIER_DISABLE_PLUGIN_AUTOLOAD", "1")
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorage
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    from kvtier.integrations.sglang import KvtierHiCacheStorage

    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-sglang-", dir=args.root))
    controllers: list[shp.Controller] = []
    try:
        pool = shp.mha_host_pool(
            layer_num=32, head_num=8, head_dim=128, page_size=64, pages=count, layout="page_first"
        )
        assert type(pool) is MHATokenToKVPoolHost
        ps = pool.page_size
        page_mib = shp.page_bytes(pool) / MiB
        indices = pool.alloc(count * ps)
        starts = shp.starts(pool, indices)
        for i, start in enumerate(starts):
            shp.fill_random(pool, start, i)
        stored = _digests(pool, starts)
        chain = shp.page_hashes(list(range(count * ps)), ps)

        def attach(name: str, *, zero_copy: bool, verify: str = "full") -> shp.Controller:
            extra = _extra(workdir / name, zero_copy=zero_copy, section=section)
            extra["kvtier"]["verify"] = verify
            if args.io_threads is not None:
                extra["kvtier"]["extra_config"]["io_threads"] = args.io_threads
            controller = shp.Controller.attach(shp.storage_config(extra_config=extra), pool)
            assert isinstance(controller.storage, KvtierHiCacheStorage)
            assert controller.zero_copy == zero_copy
            controllers.append(controller)
            return controller

        def attach_peer() -> shp.Controller:
            extra = {"file_storage_path": str(workdir / "peer")}
            config = shp.storage_config(extra_config=extra)
            controller = shp.Controller.attach(config, pool, backend="file")
            assert type(controller.storage) is HiCacheFile and not controller.zero_copy
            controllers.append(controller)
            return controller

        ours = attach("ours", zero_copy=True)
        peer = attach_peer()
        header_only = attach("ours", zero_copy=True, verify="header")  # the same files
        generic = attach("generic", zero_copy=False)
        assert isinstance(peer.storage, HiCacheStorage)
        pages = [ours.storage._require().pages.page_buffers(i) for i in range(count)]
        raw_dir = workdir / "raw"
        raw_dir.mkdir()
        raw_paths = [raw_dir / f"page-{i:05d}" for i in range(count)]
        nbytes = sum(r.length for regions in pages for r in regions)
        peer_bytes = count * shp.page_bytes(pool)

        def put(side: shp.Controller) -> Callable[[], None]:
            def run() -> None:
                assert side.backup(chain, indices) == count * ps

            return run

        def get(side: shp.Controller) -> Callable[[], None]:
            def run() -> None:
                assert side.prefetch(chain, indices) == count

            return run

        def exists(side: shp.Controller) -> Callable[[], None]:
            def run() -> None:
                assert side.hit_query(chain) == chain

            return run

        def zero_pool() -> None:
            for start in starts:
                shp.zero_page(pool, start)

        def check_pool() -> None:
            got = _digests(pool, starts)
            bad = [i for i, (a, b) in enumerate(zip(got, stored, strict=True)) if a != b]
            assert not bad, f"pages {bad[:8]} came back with other bytes"

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
            zero_pool()

        # warm-up: every file written and read once (every byte checked), every buffer touched
        for side in (peer, ours, generic):
            put(side)()
            zero_pool()
            get(side)()
            check_pool()
        _raw_put(raw_paths, pages)
        _raw_get(raw_paths, pages)
        check_pool()

        raw_put = lambda: _raw_put(raw_paths, pages)  # noqa: E731
        raw_get = lambda: _raw_get(raw_paths, pages)  # noqa: E731
        peer_name = "sglang HiCacheFile (generic path)"
        cases: list[Case] = [
            Case("put vs HiCacheFile", put(ours), put(peer), peer_name, 1.1, empty_both),
            Case(
                "get warm vs HiCacheFile",
                get(ours),
                get(peer),
                peer_name,
                2.0,
                zero_pool,
                check_pool,
            ),
            Case(
                "get cold vs HiCacheFile",
                get(ours),
                get(peer),
                peer_name,
                None,
                evict_both,
                check_pool,
            ),
            Case("exists vs HiCacheFile", exists(ours), exists(peer), peer_name, None, unit="ms"),
            Case("put", put(ours), raw_put, "os.pwritev", TARGET),
            Case("get warm", get(ours), raw_get, "os.preadv", TARGET, zero_pool, check_pool),
            Case(
                "get warm, verify=header",
                get(header_only),
                raw_get,
                "os.preadv",
                None,
                zero_pool,
                check_pool,
            ),
            Case(
                "get warm, generic path",
                get(generic),
                raw_get,
                "os.preadv",
                None,
                zero_pool,
                check_pool,
            ),
        ]
        rows = []
        for case in cases:
            if args.only not in case.name:
                continue
            times_ours: list[float] = []
            times_base: list[float] = []
            for rep in range(reps):
                order = [(times_base, case.baseline), (times_ours, case.ours)]
                for times, fn in order if rep % 2 else order[::-1]:
                    if case.setup is not None:
                        case.setup()
                    times.append(_timed(fn))
                    if case.check is not None:
                        case.check()
            if case.setup is empty_both:
                # the put case emptied both stores: leave every page stored for the gets
                put(ours)()
                put(peer)()
            t_ours, t_base = statistics.median(times_ours), statistics.median(times_base)
            if case.unit == "ms":
                mine, base, ratio = t_ours * 1e3, t_base * 1e3, t_base / t_ours
            else:
                base_bytes = peer_bytes if "HiCacheFile" in case.name else nbytes
                mine, base = nbytes / t_ours / 1e9, base_bytes / t_base / 1e9
                ratio = mine / base
            row = {
                "bench": "sglang",
                "case": f"{case.name} {count}x{page_mib:g}MiB",
                "ours": round(mine, 3),
                "baseline": round(base, 3),
                "baseline_name": case.baseline_name,
                "unit": case.unit,
                "ratio": round(ratio, 3),
                "target": case.target,
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
        stats = ours.storage.kvtier_stats()
        assert stats["invalid"] == 0 and stats["backend_errors"] == 0, stats
        assert stats.get("backend_staged_pages", 0) == 0, stats
        print(
            f"{'case':<44}{'kvtier':>10}{'baseline':>10}{'unit':>6}{'ratio':>8}  baseline",
            file=sys.stderr,
        )
        for row in rows:
            print(
                f"{row['case']:<44}{row['ours']:>10.2f}{row['baseline']:>10.2f}"
                f"{row['unit']:>6}{row['ratio']:>8.2f}  {row['baseline_name']}",
                file=sys.stderr,
            )
    finally:
        for controller in controllers:
            controller.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
