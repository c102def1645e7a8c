"""TieredCache's own cost: framework overhead per page, and prefetch + load next to its parts.

Usage: ``python benchmarks/cache_overhead.py [--quick]``. One JSON object per line on stdout:

- ``overhead per page``: small pages (so copies are cheap and the framework shows) go
  through the whole cycle an engine drives -- page keys from tokens, ``backup`` with
  write_through (device -> host -> envelope -> memory backend), host pool emptied,
  ``prefetch`` from storage, ``load`` -- and the same bytes through the raw parts alone
  (IO backend backup, memory backend put of the same extents, memory backend get, IO
  backend load). The cache runs one batch per call here, so its parts run one after
  the other like the raw side's and no overlap hides cost. Overhead = (cycle - raw
  parts) / pages: keys, index, pins, envelope write and verify, queues and threads.
  Reported in us/page against the 50 us budget (``ratio`` = 50 / ours, ``target`` 1.0),
  twice: in wall time (what an engine waits, including thread hand-offs, which a busy
  host stretches) and in CPU time of all threads (the work itself, steady under load).
- ``prefetch+load``: 8 MiB pages (an 8B-class geometry) read from the memory backend
  into the host pool and loaded into the device pool through the cache, in GB/s, next to
  the sum of the raw parts (memory backend get + IO backend load) timed in the same run.
- ``backup write_through``: the same pages backed up through the cache (device -> host
  -> storage) next to IO backend backup + memory backend put.

Both sides run interleaved after a warm-up; each figure is the median of several rounds.
Buffers are allocated and touched once and reused. A table goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import interleaved_medians

from kvtier.backends.memory import MemoryConfig
from kvtier.backends.memory.backend import MemoryBackend
from kvtier.cache import TieredCache
from kvtier.core.config import load_engine_config
from kvtier.core.device_pool import TorchDevicePool
from kvtier.core.specs import ALL_ATTENTION, ALL_LAYOUTS, ALL_OPERATIONS, BackendSpec
from kvtier.core.storage import BackendContext, StorageBackend
from kvtier.plugins.hookspecs import hookimpl
from kvtier.plugins.manager import load_registry
from kvtier.plugins.registry import Registry
from kvtier.testing.content import fill_pages

BUDGET_US = 50.0

SMALL = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 64, "dtype": "bfloat16", "page_size": 16}
LARGE = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16", "page_size": 64}


class _Bench:
    """Holds the memory backend instance the benchmark's ``bench_memory`` factory returns."""

    backend: StorageBackend | None = None


def _factory(config: Any, context: BackendContext) -> StorageBackend:
    assert _Bench.backend is not None
    return _Bench.backend


class _Plugin:
    @staticmethod
    @hookimpl
    def kvtier_register_backends(register: Any) -> None:
        register(
            BackendSpec(
                name="bench_memory",
                factory=_factory,
                layouts=ALL_LAYOUTS,
                attention=ALL_ATTENTION,
                operations=ALL_OPERATIONS,
            )
        )


def _registry() -> Registry:
    return load_registry(autoload=False, plugins=[("bench", _Plugin)])


def _open(geometry: dict[str, Any], pages: int, options: dict[str, Any]) -> TieredCache:
    """A cache over a CPU device pool of ``pages`` pages and a memory backend we can reach."""
    _Bench.backend = MemoryBackend(MemoryConfig(capacity_bytes=64 << 30))
    config = load_engine_config(
        {**geometry, "backend": "bench_memory", "io_backend": "direct", "host_pages": pages}
    )
    device = TorchDevicePool(config.geometry(), pages * geometry["page_size"])
    return TieredCache.open(config, device, options=options, registry=_registry())


class _Setup:
    """One cache plus the raw parts over the same device pool, host pool and backend."""

    def __init__(self, geometry: dict[str, Any], pages: int, options: dict[str, Any]) -> None:
        self.cache = _open(geometry, pages, options)
        self.pages = pages
        #: wall time by default; time.process_time measures the CPU all threads spent
        self.clock: Callable[[], float] = time.perf_counter
        ps = geometry["page_size"]
        self.tokens = list(range(pages * ps))
        self.keys = self.cache.keys(self.tokens)
        self.slots = torch.arange(pages * ps)
        self.load_slots = self.slots.flip(0).reshape(pages, ps).flip(1).reshape(-1).clone()
        fill_pages(self.cache.device_pool, self.keys, self.slots)
        self.host_pages = self.cache.host_pool.allocate(pages)
        self.cache.host_pool.free(self.host_pages)
        self.raw_keys = [f"raw-{i}" for i in range(pages)]
        backend = self.cache.backend
        pool = self.cache.host_pool
        self.buffers = [pool.page_buffers(p) for p in self.host_pages]
        self.backend = backend
        self.cache_backup()  # storage holds the pages before the first timed prefetch
        self.raw_backup()

    # --- raw parts (timed) ------------------------------------------------------------

    def raw_backup(self) -> float:
        c = self.cache
        t0 = self.clock()
        c.io_backend.backup(c.device_pool, c.host_pool, self.slots, self.host_pages)
        self.backend.put(self.raw_keys, self.buffers)
        return self.clock() - t0

    def raw_get_load(self) -> float:
        c = self.cache
        t0 = self.clock()
        self.backend.get(self.raw_keys, self.buffers)
        c.io_backend.load(c.host_pool, c.device_pool, self.host_pages, self.load_slots)
        return self.clock() - t0

    # --- through the cache (timed) ----------------------------------------------------

    def forget(self) -> None:
        """Empty the host tier, so the next backup copies and writes every page again.

        Storage keeps its pages: the puts overwrite them, exactly as the raw side's puts
        overwrite theirs (deleting first would make the allocator return the memory and
        every put would fault it back in, a cost only one side would pay).
        """
        c = self.cache
        assert c.flush(60)
        c._index.drop_all()

    def cache_backup(self) -> float:
        self.forget()
        t0 = self.clock()
        keys = self.cache.keys(self.tokens)
        handle = self.cache.backup(keys, self.slots)
        handle.wait()
        elapsed = self.clock() - t0
        assert handle.ok and handle.pages_written == self.pages, handle
        return elapsed

    def cache_prefetch_load(self) -> float:
        c = self.cache
        assert c.flush(60)
        c._index.drop_all()  # pages stay in storage: the prefetch reads every one
        t0 = self.clock()
        handle = c.prefetch(self.keys)
        loaded = c.load(handle, self.load_slots)
        elapsed = self.clock() - t0
        assert loaded == self.pages, (loaded, handle)
        return elapsed

    def cycle(self) -> float:
        return self.cache_backup() + self.cache_prefetch_load()

    def raw_cycle(self) -> float:
        return self.raw_backup() + self.raw_get_load()

    def close(self) -> None:
        self.cache.close()


def _line(
    case: str,
    ours: float,
    baseline: float,
    name: str,
    unit: str,
    ratio: float,
    target: float | None,
) -> dict[str, Any]:
    return {
        "bench": "cache",
        "case": case,
        "ours": round(ours, 3),
        "baseline": round(baseline, 3),
        "baseline_name": name,
        "unit": unit,
        "ratio": round(ratio, 3),
        "target": target,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the cases and print one JSON line each; a table goes to stderr."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, under a minute")
    args = parser.parse_args(argv)
    reps = 3 if args.quick else 7
    lines = []

    small_pages = 512 if args.quick else 2048
    # One batch per call: the cache then runs its parts one after the other, as the raw
    # side does, so the difference is the framework's own work, not lost overlap.
    sequential = {"prefetch_policy": "wait_complete", "batch_pages": small_pages}
    small = _Setup(SMALL, small_pages, sequential)
    page_kib = small.cache.geometry.bytes_per_page // 1024
    try:
        for clock, label in ((time.perf_counter, "wall"), (time.process_time, "CPU")):
            small.clock = clock
            med = interleaved_medians({"cache": small.cycle, "raw": small.raw_cycle}, reps)
            overhead_us = max((med["cache"] - med["raw"]) / small_pages * 1e6, 1e-3)
            lines.append(
                _line(
                    f"overhead per page, {label} time ({small_pages} x {page_kib} KiB, "
                    "backup+prefetch+load)",
                    overhead_us,
                    BUDGET_US,
                    "budget 50 us/page",
                    "us/page",
                    BUDGET_US / overhead_us,
                    1.0,
                )
            )
    finally:
        small.close()

    large_pages = 16 if args.quick else 48
    options = {"prefetch_policy": "wait_complete", "batch_pages": 8}
    large = _Setup(LARGE, large_pages, options)
    try:
        nbytes = large_pages * large.cache.geometry.bytes_per_page
        med = interleaved_medians(
            {
                "prefetch_load": large.cache_prefetch_load,
                "raw_get_load": large.raw_get_load,
                "backup": large.cache_backup,
                "raw_backup": large.raw_backup,
            },
            reps,
        )
    finally:
        large.close()
    mib = LARGE["num_layers"] * 2 * 8 * 128 * 2 * 64 >> 20
    for case, ours_key, raw_key, raw_name in (
        ("prefetch+load", "prefetch_load", "raw_get_load", "memory get + io load (raw parts)"),
        ("backup write_through", "backup", "raw_backup", "io backup + memory put (raw parts)"),
    ):
        ours = nbytes / med[ours_key] / 1e9
        raw = nbytes / med[raw_key] / 1e9
        lines.append(
            _line(
                f"{case} {large_pages}x{mib}MiB",
                ours,
                raw,
                raw_name,
                "GB/s",
                ours / raw,
                None,
            )
        )

    print(f"{'case':<62} {'ours':>10} {'baseline':>10} {'unit':>8} {'ratio':>7}", file=sys.stderr)
    for line in lines:
        print(
            f"{line['case']:<62} {line['ours']:>10} {line['baseline']:>10} "
            f"{line['unit']:>8} {line['ratio']:>7}",
            file=sys.stderr,
        )
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
