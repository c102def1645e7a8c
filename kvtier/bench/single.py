"""The ``single`` workload: back up and restore pages through every tier, verify every byte.

With no arguments: an 8B-class geometry (32 layers, 8 KV heads, head dim 128, bfloat16,
64 tokens per page = 8 MiB per page), 64 pages of random KV in a torch device pool (CUDA
when present, else CPU), the 'file' backend in a fresh temporary directory (removed
afterwards). Each round backs the pages up device -> host pool (IO backend) -> storage
(envelope + backend) as new pages, wipes the host and device copies, reads them back
storage -> host -> device and compares every byte with the original. The same bytes also
go through raw os.pwritev / os.preadv (one file per page, the raw reads landing in a
host pool of their own), batch by batch and alternating which side goes first, so the
report shows kvtier's storage path (envelope checksums included) next to the raw
vectored path. A warm-up round is not timed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from kvtier.bench.options import GB, Progress, engine_config, temporary_root
from kvtier.core.capabilities import (
    ResolvedPlan,
    build_host_pool,
    build_io_backend,
    open_page_store,
    resolve,
)
from kvtier.core.config import parse_extra_config
from kvtier.core.device_pool import TorchDevicePool
from kvtier.core.errors import ConfigError, InvalidFieldError
from kvtier.core.host_pool import HostPool
from kvtier.core.pagestore import PageStore

if TYPE_CHECKING:
    from kvtier.core.extents import Extent
    from kvtier.plugins.registry import Registry

__all__ = ["EPILOG", "BenchResult", "run_bench"]

#: The examples ``kvtier bench --help`` ends with.
EPILOG = """\
examples:
  kvtier bench                                   # file backend in a temp dir, 64 x 8 MiB pages
  kvtier bench --pages 256 --batch 16 --json     # bigger run, batched calls, JSON on stdout
  kvtier bench --backend memory
  kvtier bench --extra-config '{"root": "/mnt/nvme/kv", "fsync": "batch"}'
  kvtier bench --attention mla --num-layers 61 --layout page_first
  kvtier bench --layout layer_first --io-backend kernel --device cpu

The exit status is 0 when every page came back bit-exact, 1 when a page failed or
differed, 2 when the configuration was rejected.
"""


# --- measurements ---------------------------------------------------------------------


@dataclass
class Timing:
    """Per-call durations of one operation over all timed rounds."""

    bytes_per_round: int
    calls: list[float] = field(default_factory=list)
    rounds: list[float] = field(default_factory=list)

    def add_round(self, total: float, calls: Sequence[float]) -> None:
        """Record one timed round: its total time and each call's time."""
        self.rounds.append(total)
        self.calls.extend(calls)

    def summary(self) -> dict[str, float]:
        """GB/s (median over rounds), p50 / p99 call latency in ms."""
        rates = [self.bytes_per_round / t / GB for t in self.rounds if t > 0]
        calls = sorted(self.calls)
        return {
            "gbps": round(statistics.median(rates), 3) if rates else 0.0,
            "p50_ms": round(_percentile(calls, 50) * 1e3, 3),
            "p99_ms": round(_percentile(calls, 99) * 1e3, 3),
        }


def _percentile(values: Sequence[float], pct: float) -> float:
    if not values:
        return 0.0
    rank = (len(values) - 1) * pct / 100
    low = int(rank)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (rank - low)


def _raw_put(path: Path, regions: list[memoryview]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.pwritev(fd, regions, 0)
    finally:
        os.close(fd)


def _raw_get(path: Path, regions: list[memoryview]) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.preadv(fd, regions, 0)
    finally:
        os.close(fd)


# --- the run --------------------------------------------------------------------------


@dataclass
class BenchResult:
    """What ``kvtier bench`` measured; :meth:`to_dict` is the ``--json`` output."""

    plan: ResolvedPlan
    pages: int
    batch: int
    rounds: int
    device: str
    page_bytes: int
    stored_bytes: int
    ok: bool
    failures: list[str]
    put: Timing
    get: Timing
    backup: Timing
    load: Timing
    raw_put: Timing | None
    raw_get: Timing | None
    backend_stats: dict[str, int | float]
    store_stats: dict[str, int | float]
    workdir: str

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "bench": "kvtier",
            "ok": self.ok,
            "failures": self.failures,
            "backend": self.plan.backend.name,
            "io_backend": self.plan.io_backend.name,
            "layout": self.plan.layout.value,
            "device": self.device,
            "geometry": self.plan.to_dict()["geometry"],
            "verify": self.plan.config.verify,
            "pages": self.pages,
            "batch": self.batch,
            "rounds": self.rounds,
            "page_bytes": self.page_bytes,
            "stored_bytes_per_page": self.stored_bytes,
            "put": self.put.summary(),
            "get": self.get.summary(),
            "device_to_host": self.backup.summary(),
            "host_to_device": self.load.summary(),
            "notes": list(self.plan.notes),
        }
        if self.raw_put is not None and self.raw_get is not None:
            raw_put, raw_get = self.raw_put.summary(), self.raw_get.summary()
            out["raw_put"], out["raw_get"] = raw_put, raw_get
            out["ratio"] = {
                "put": _ratio(out["put"]["gbps"], raw_put["gbps"]),
                "get": _ratio(out["get"]["gbps"], raw_get["gbps"]),
            }
        out["backend_stats"] = self.backend_stats
        out["store_stats"] = self.store_stats
        return out

    def report(self) -> str:
        """A human-readable table."""
        d = self.to_dict()
        g = self.plan.geometry
        lines = [
            f"kvtier bench: {d['backend']} backend, io {d['io_backend']}, layout {d['layout']}, "
            f"device {d['device']}",
            f"  geometry   {g.describe()}",
            f"  workload   {self.pages} pages x {self.page_bytes / 2**20:.2f} MiB "
            f"(+{self.stored_bytes - self.page_bytes} B envelope), {self.batch} page(s) per "
            f"call, {self.rounds} timed round(s) after a warm-up, verify={d['verify']}",
            "",
            f"  {'path':<28}{'GB/s':>9}{'p50 ms':>10}{'p99 ms':>10}",
        ]
        rows = [
            ("device -> host (backup)", d["device_to_host"]),
            ("host -> storage (put)", d["put"]),
            ("storage -> host (get)", d["get"]),
            ("host -> device (load)", d["host_to_device"]),
        ]
        if "raw_put" in d:
            rows += [("raw os.pwritev", d["raw_put"]), ("raw os.preadv", d["raw_get"])]
        for name, s in rows:
            lines.append(f"  {name:<28}{s['gbps']:>9.2f}{s['p50_ms']:>10.2f}{s['p99_ms']:>10.2f}")
        if "ratio" in d:
            lines.append(
                f"\n  kvtier / raw: put {d['ratio']['put']:.2f}x, get {d['ratio']['get']:.2f}x"
            )
        lines.append("")
        if self.ok:
            lines.append(
                f"  verified: all {self.pages} pages bit-exact after device -> storage -> "
                f"device, every round"
            )
        else:
            lines.append(f"  FAILED: {len(self.failures)} problem(s):")
            lines += [f"    - {f}" for f in self.failures[:20]]
            counters = {**self.store_stats, **self.backend_stats}
            causes = [
                f"{name}={value}"
                for name, value in sorted(counters.items())
                if value and ("fail" in name or "invalid" in name or "error" in name)
            ]
            if causes:
                lines.append(f"  counters: {', '.join(causes)}")
        lines += [f"  note: {n}" for n in d["notes"]]
        return "\n".join(lines)


def _ratio(ours: float, raw: float) -> float:
    return round(ours / raw, 3) if raw > 0 else 0.0


def _positive(name: str, value: int) -> None:
    if value <= 0:
        raise InvalidFieldError(name, f"must be a positive integer, got {value}", value=value)


def run_bench(
    args: argparse.Namespace,
    *,
    registry: Registry | None = None,
    progress_stream: IO[str] | None = None,
) -> BenchResult:
    """Resolve the plan, build everything, run the rounds; raises ConfigError on bad input."""
    for name in ("pages", "batch", "rounds"):
        _positive(f"--{name}", getattr(args, name))
    if registry is None:
        from kvtier.plugins.manager import load_registry

        registry = load_registry()
    extra = parse_extra_config(args.extra_config, source="--extra-config")
    base = Path(args.workdir) if args.workdir else None
    if base is not None and not base.is_dir():
        raise ConfigError(f"--workdir {str(base)!r} is not a directory", value=str(base))
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=base))
    try:
        extra = temporary_root(registry, args.backend, extra, workdir)
        config = engine_config(args, extra, model="kvtier-bench", host_pages=args.pages)
        plan = resolve(config, registry.backends, registry.io_backends)
        return _run_plan(args, plan, workdir, progress_stream or sys.stderr)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run_plan(
    args: argparse.Namespace, plan: ResolvedPlan, workdir: Path, stream: IO[str]
) -> BenchResult:
    host = build_host_pool(plan)
    store = open_page_store(plan, host)
    try:
        bench = _Run(args, plan, store, workdir, stream)
        for round_ in range(args.rounds + 1):
            bench.round(round_)
        return bench.result()
    finally:
        store.backend.close()


class _Run:
    """Everything one ``kvtier bench`` run holds: pools, store, keys, raw files, timings."""

    def __init__(
        self,
        args: argparse.Namespace,
        plan: ResolvedPlan,
        store: PageStore,
        workdir: Path,
        stream: IO[str],
    ) -> None:
        geometry = plan.geometry
        self.plan, self.store, self.workdir = plan, store, workdir
        self.backend = store.backend
        assert isinstance(store.pool, HostPool)
        self.host: HostPool = store.pool
        self.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.pages, self.rounds = args.pages, args.rounds
        self.batch = min(args.batch, args.pages)
        page_size = geometry.page_size
        self.mover = build_io_backend(plan)
        self.dev = TorchDevicePool(geometry, self.pages * page_size, self.device)
        self.dev.fill_random_(torch.Generator().manual_seed(args.seed))
        self.original = [t.clone() for t in self.dev.kv_tensors]
        keyer = plan.keyer()
        token_gen = torch.Generator().manual_seed(args.seed + 1)
        tokens = torch.randint(0, 128_000, (self.pages * page_size,), generator=token_gen)
        self.keys = keyer.keys(tokens.tolist())
        self.host_pages = self.host.allocate(self.pages)
        self.slots = torch.arange(self.pages * page_size, dtype=torch.int64, device=self.device)
        self.regions = [[e.view for e in self.host.page_buffers(p)] for p in self.host_pages]
        self.stored_bytes = sum(e.length for e in self.host.page_buffers(self.host_pages[0]))
        self.do_raw = not args.no_raw
        # The raw side reads into a host pool of its own, so neither side's reads can be
        # mistaken for the other's, and both land in memory wiped the same way.
        self.raw_host = build_host_pool(plan) if self.do_raw else None
        self.raw_into = (
            [
                [e.view for e in self.raw_host.page_buffers(p)]
                for p in self.raw_host.allocate(self.pages)
            ]
            if self.raw_host is not None
            else []
        )
        raw_dir = workdir / "raw"
        raw_dir.mkdir(mode=0o700)
        self.raw_paths = [raw_dir / f"{i}.page" for i in range(self.pages)]
        payload_round = self.pages * geometry.bytes_per_page
        stored_round = self.pages * self.stored_bytes
        self.put_t, self.get_t = Timing(stored_round), Timing(stored_round)
        self.backup_t, self.load_t = Timing(payload_round), Timing(payload_round)
        self.raw_put_t, self.raw_get_t = Timing(stored_round), Timing(stored_round)
        self.failures: list[str] = []
        self.batches = [
            (i, min(i + self.batch, self.pages)) for i in range(0, self.pages, self.batch)
        ]
        show = not args.no_progress and not args.json
        self.bar = Progress((self.rounds + 1) * self.pages * 2, stream, show)

    # --- one side, one batch: seconds taken ----------------------------------------------

    def _failed(self, label: str, template: str, lo: int, results: Sequence[object]) -> None:
        self.failures.extend(
            f"{label}: " + template.format(page=lo + i) for i, ok in enumerate(results) if not ok
        )

    def ours_put(self, lo: int, hi: int, label: str) -> float:
        t0 = time.perf_counter()
        results = self.store.put(self.keys[lo:hi], self.host_pages[lo:hi])
        elapsed = time.perf_counter() - t0
        self._failed(label, "put of page {page} failed", lo, results)
        return elapsed

    def raw_put(self, lo: int, hi: int, label: str) -> float:
        t0 = time.perf_counter()
        for i in range(lo, hi):
            _raw_put(self.raw_paths[i], self.regions[i])
        return time.perf_counter() - t0

    def ours_get(self, lo: int, hi: int, label: str) -> float:
        t0 = time.perf_counter()
        results = self.store.get(self.keys[lo:hi], self.host_pages[lo:hi])
        elapsed = time.perf_counter() - t0
        self._failed(label, "get of page {page} failed or was rejected", lo, results)
        return elapsed

    def raw_get(self, lo: int, hi: int, label: str) -> float:
        t0 = time.perf_counter()
        got = [_raw_get(self.raw_paths[i], self.raw_into[i]) for i in range(lo, hi)]
        elapsed = time.perf_counter() - t0
        self._failed(
            label, "raw read of page {page} was short", lo, [n == self.stored_bytes for n in got]
        )
        return elapsed

    def phase(
        self,
        ours: Callable[[int, int, str], float],
        raw: Callable[[int, int, str], float],
        label: str,
        what: str,
    ) -> tuple[list[float], list[float]]:
        """Both sides batch by batch, alternating which goes first; each call's seconds."""
        ours_calls: list[float] = []
        raw_calls: list[float] = []
        for n, (lo, hi) in enumerate(self.batches):
            if self.do_raw and n % 2:
                raw_calls.append(raw(lo, hi, label))
            ours_calls.append(ours(lo, hi, label))
            if self.do_raw and not n % 2:
                raw_calls.append(raw(lo, hi, label))
            self.bar.step(f"{label}: {what}", hi - lo)
        return ours_calls, raw_calls

    # --- a round -------------------------------------------------------------------------

    def round(self, number: int) -> None:
        """Device -> host -> storage, wipe, storage -> host -> device, compare; round 0 is
        the untimed warm-up."""
        timed = number > 0
        label = f"round {number}/{self.rounds}" if timed else "warm-up"
        # new pages every round: last round's pages are removed, untimed
        self.store.delete(self.keys)
        for path in self.raw_paths:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        t0 = time.perf_counter()
        self.mover.backup(self.dev, self.host, self.slots, self.host_pages)
        _sync(self.device)
        backup = time.perf_counter() - t0
        ours, raw = self.phase(self.ours_put, self.raw_put, label, "put")
        if timed:
            self.backup_t.add_round(backup, [backup])
            self.put_t.add_round(sum(ours), ours)
            self.raw_put_t.add_round(sum(raw), raw)
        # wipe every copy, so only what storage returns can pass
        self.dev.zero_()
        for pool in (self.host, self.raw_host):
            if pool is not None:
                for page in range(pool.num_pages):
                    _wipe(pool, page)
        ours, raw = self.phase(self.ours_get, self.raw_get, label, "get")
        t0 = time.perf_counter()
        self.mover.load(self.host, self.dev, self.host_pages, self.slots)
        _sync(self.device)
        load = time.perf_counter() - t0
        if timed:
            self.get_t.add_round(sum(ours), ours)
            self.raw_get_t.add_round(sum(raw), raw)
            self.load_t.add_round(load, [load])
        page_size = self.plan.geometry.page_size
        for kv, (now, before) in enumerate(zip(self.dev.kv_tensors, self.original, strict=True)):
            if not torch.equal(now.view(torch.uint8), before.view(torch.uint8)):
                bad = _first_bad_page(now, before, page_size)
                self.failures.append(
                    f"{label}: device data differs after the round trip "
                    f"(kv {kv}, first differing page {bad})"
                )

    def result(self) -> BenchResult:
        """The measurements; the stored pages are removed."""
        self.bar.close()
        result = BenchResult(
            plan=self.plan,
            pages=self.pages,
            batch=self.batch,
            rounds=self.rounds,
            device=str(self.dev.device),
            page_bytes=self.plan.geometry.bytes_per_page,
            stored_bytes=self.stored_bytes,
            ok=not self.failures,
            failures=self.failures,
            put=self.put_t,
            get=self.get_t,
            backup=self.backup_t,
            load=self.load_t,
            raw_put=self.raw_put_t if self.do_raw else None,
            raw_get=self.raw_get_t if self.do_raw else None,
            backend_stats=self.backend.stats(),
            store_stats=self.store.stats(),
            workdir=str(self.workdir),
        )
        self.backend.clear()
        return result


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _wipe(host: HostPool, page: int) -> None:
    extents: list[Extent] = host.page_buffers(page)
    for extent in extents:
        torch.frombuffer(extent.view, dtype=torch.uint8).fill_(0x5A)


def _first_bad_page(now: torch.Tensor, before: torch.Tensor, page_size: int) -> int:
    # [layers, slots, heads, dim]: compare slot by slot, report its page
    diff = (now.view(torch.uint8) != before.view(torch.uint8)).flatten(2).any(dim=2).any(dim=0)
    slot = int(diff.nonzero()[0, 0]) if bool(diff.any()) else -1
    return slot // page_size if slot >= 0 else -1
