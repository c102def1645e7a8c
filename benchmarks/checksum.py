"""Payload checksum candidates on 8 MiB pages, and what full verification costs a get.

Usage: ``python benchmarks/checksum.py [--quick] [--cpu-time]``. One JSON object per line on stdout:

- one line per checksum (xxh3_64, xxh3_128, xxh3_128 streamed over the extents of a
  page as the envelope does it, zlib.crc32, crc32c when installed): GB/s against a plain
  memory copy of the same bytes, the floor of any get;
- "get + full verify": raw ``os.preadv`` of warm-page-cache 8 MiB pages into the page's
  extents plus the envelope's payload checksum, against the same ``os.preadv`` alone,
  target 0.9 (full verification costs at most 10 % of get throughput);
- the same through :class:`~kvtier.core.pagestore.PageStore` over the memory and file
  backends, full verification (inline, and on 2 checksum threads) against header-only
  verification, target 0.9.

A table goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash
from _common import interleaved_medians

from kvtier.backends.file import FileConfig
from kvtier.backends.file.backend import FileBackend
from kvtier.backends.memory import MemoryConfig
from kvtier.backends.memory.backend import MemoryBackend
from kvtier.core.envelope import payload_checksum
from kvtier.core.geometry import KVGeometry
from kvtier.core.host_pool import HostPool
from kvtier.core.keys import Namespace, PageKeyer
from kvtier.core.layout import Layout
from kvtier.core.pagestore import PageStore
from kvtier.core.storage import StorageBackend

GEOMETRY = KVGeometry.mha(
    num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=64
)
PAGE_BYTES = GEOMETRY.bytes_per_page  # 8 MiB
EXTENTS_PER_PAGE = 2 * GEOMETRY.num_layers  # layer_first: K and V of every layer
FP = GEOMETRY.fingerprint


CLOCK: Callable[[], float] = time.perf_counter
SUFFIX = ""


def median_rate(fn: Callable[[], Any], nbytes: int) -> Callable[[], float]:
    def once() -> float:
        start = CLOCK()
        fn()
        return nbytes / (CLOCK() - start) / 1e9

    return once


def line(case: str, ours: float, base: float, base_name: str, target: float | None) -> dict:
    return {
        "bench": "checksum",
        "case": case + SUFFIX,
        "ours": round(ours, 2),
        "baseline": round(base, 2),
        "baseline_name": base_name,
        "unit": "GB/s",
        "ratio": round(ours / base, 3),
        "target": target,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer pages and repetitions")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with this process's CPU time (all threads) instead of wall time: "
        "steadier on a host shared with other jobs; for the threaded cases it then "
        "measures bytes per CPU-second (cost), not throughput",
    )
    args = parser.parse_args()
    global CLOCK, SUFFIX
    if args.cpu_time:
        CLOCK, SUFFIX = time.process_time, ", cpu time"
    pages = 8 if args.quick else 32
    reps = 5 if args.quick else 9
    total = pages * PAGE_BYTES

    # Buffers are allocated and touched once, then reused by every case. The host pool
    # holds an 8B-class geometry (32 layers, 8 KV heads of 128, bf16, 64-token pages:
    # 8 MiB per page) in layer_first, i.e. 64 extents of 128 KiB per page.
    pool = HostPool(GEOMETRY, Layout.LAYER_FIRST, num_pages=pages, pin_memory=False)
    payloads = [pool.extents(p) for p in range(pages)]
    for extents in payloads:
        for extent in extents:
            extent.view[:] = os.urandom(extent.length)
    memory = memoryview(bytearray(os.urandom(1 << 20)) * (total >> 20))
    flat = [memory[p * PAGE_BYTES : (p + 1) * PAGE_BYTES] for p in range(pages)]
    scratch = memoryview(bytearray(PAGE_BYTES))
    scratch[:] = flat[0]

    def each(fn: Callable[[memoryview], Any], views: list[memoryview]) -> Callable[[], None]:
        def run() -> None:
            for view in views:
                fn(view)

        return run

    def copy(view: memoryview) -> None:
        scratch[:] = view

    crc32c_fn: Callable[[memoryview], Any] | None = None
    try:
        import crc32c  # type: ignore[import-not-found]

        crc32c_fn = crc32c.crc32c
    except ImportError:
        print("crc32c not installed (pip install crc32c); skipped", file=sys.stderr)

    out = []
    # "hot": one 8 MiB buffer hashed over and over (it stays in cache); "streaming":
    # every page in turn, as many bytes as the get below (memory bandwidth decides).
    for regime, views in (("hot 1x8MiB", [flat[0]] * pages), (f"streaming {pages}x8MiB", flat)):
        algos: dict[str, Callable[[memoryview], Any]] = {
            "memcpy": copy,
            "xxh3_64": xxhash.xxh3_64_intdigest,
            "xxh3_128": xxhash.xxh3_128_intdigest,
            "zlib.crc32": zlib.crc32,
        }
        if crc32c_fn is not None:
            algos["crc32c"] = crc32c_fn
        cases = {name: median_rate(each(fn, views), total) for name, fn in algos.items()}
        if regime.startswith("streaming"):
            cases[f"xxh3_128 over {EXTENTS_PER_PAGE} extents/page (envelope)"] = median_rate(
                lambda: [payload_checksum(extents) for extents in payloads], total
            )
        rates = interleaved_medians(cases, reps)
        out += [
            line(f"{name}, {regime}", rate, rates["memcpy"], "memcpy of the same bytes", None)
            for name, rate in rates.items()
            if name != "memcpy"
        ]

    # Get = raw os.preadv from a warm page-cache file into the page's extents.
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp:
        path = os.path.join(tmp, "pages")
        with open(path, "wb") as f:
            for view in flat:
                f.write(view)
        fd = os.open(path, os.O_RDONLY)
        try:

            def preadv(verify: bool) -> Callable[[], None]:
                def run() -> None:
                    for p, extents in enumerate(payloads):
                        views = [e.view for e in extents]
                        os.preadv(fd, views, p * PAGE_BYTES)
                        if verify:
                            payload_checksum(extents)

                return run

            get_rates = interleaved_medians(
                {
                    "get": median_rate(preadv(False), total),
                    "get+verify": median_rate(preadv(True), total),
                },
                reps,
            )
        finally:
            os.close(fd)
    out.append(
        line(
            f"os.preadv + full verify, {pages}x8MiB warm",
            get_rates["get+verify"],
            get_rates["get"],
            "os.preadv alone",
            0.9,
        )
    )

    # The whole core path: PageStore over the memory and file backends (warm page
    # cache), full verification (inline and on 2 threads) against header-only.
    keys = PageKeyer(Namespace("bench", FP), 64).keys(list(range(64 * pages)))
    order = list(range(pages))
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp:
        backends: dict[str, StorageBackend] = {
            "memory": MemoryBackend(MemoryConfig(capacity_bytes=4 * total)),
            "file": FileBackend(FileConfig(root=Path(tmp) / "root", min_free_bytes=0)),
        }
        for name, backend in backends.items():
            full = PageStore(backend, pool, fingerprint=FP, verify="full")
            header = PageStore(backend, pool, fingerprint=FP, verify="header")
            threaded = PageStore(backend, pool, fingerprint=FP, checksum_workers=2)
            assert all(full.put(keys, order))
            rates = interleaved_medians(
                {
                    "full": median_rate(lambda s=full: s.get(keys, order), total),
                    "header": median_rate(lambda s=header: s.get(keys, order), total),
                    "full2": median_rate(lambda s=threaded: s.get(keys, order), total),
                },
                reps,
            )
            assert full.stats()["invalid"] == 0 and full.stats()["hits"] > 0
            for case, label in (("full", "full"), ("full2", "full on 2 checksum threads")):
                out.append(
                    line(
                        f"PageStore.get {name} backend, {label} vs header verify, {pages}x8MiB",
                        rates[case],
                        rates["header"],
                        "PageStore.get verify=header",
                        0.9,
                    )
                )
            threaded.close()
            backend.close()

    print(f"{'case':<96} {'ours':>7} {'base':>7} {'ratio':>6}  (GB/s)", file=sys.stderr)
    for entry in out:
        print(
            f"{entry['case']:<96} {entry['ours']:>7.2f} {entry['baseline']:>7.2f} "
            f"{entry['ratio']:>6.3f}",
            file=sys.stderr,
        )
        print(json.dumps(entry))


if __name__ == "__main__":
    main()
