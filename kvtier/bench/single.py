"""The ``single`` workload: back up and restore pages through every tier, verify every byte.

With no arguments: an 8B-class geometry (32 layers, 8 KV heads, head dim 128, bfloat16,
64 tokens per page = 8 MiB per page), 64 pages of random KV in a torch device pool (CUDA
when present, else CPU), the 'file' backend and then the 'segment' store beside it, each
in a fresh temporary directory (removed afterwards), reported side by side
(``--backend`` names others; ``--config`` a chain of tiers). Each round backs the pages
up device -> host pool (IO backend) -> storage (envelope + backend) as new pages, wipes
the host and device copies, reads them back storage -> host -> device and compares every
byte with the original. The same bytes also go through raw os.pwritev / os.preadv (one
file per page, the raw reads landing in a host pool of their own), batch by batch and
alternating which side goes first, so the report shows kvtier's storage path (envelope
checksums included) next to the raw vectored path. A warm-up round is not timed.

Each round stores its pages under keys of its own (the tokens differ per round) after
emptying the bench's namespace with the backend's ``clear()``. So a put never lands on a
key that an earlier get read: a backend that protects a page it just served (Mooncake's
read lease refuses to remove it for a few seconds) or keeps the first write of a key
cannot fail the put or serve last round's page, and the store holds one round of pages.

Several backends run one after the other, each a complete run with raw sides of its own
(so each ratio compares sides measured together); every option and every backend's plan
is checked before the first one starts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from kvtier.bench.checks import (
    check_device_runs,
    check_disk,
    check_memory,
    check_plot,
    check_seed,
    make_workdir,
    resolve_device,
)
from kvtier.bench.measure import Timing
from kvtier.bench.options import (
    backend_names,
    chain_options,
    check_workload_options,
    engine_config,
    temporary_root,
    temporary_tier_roots,
)
from kvtier.bench.progress import Progress
from kvtier.bench.single_report import BenchResult
from kvtier.core.bounded import Outcome
from kvtier.core.capabilities import (
    ResolvedPlan,
    build_host_pool,
    build_io_backend,
    open_page_store,
    resolve,
)
from kvtier.core.device_pool import TorchDevicePool
from kvtier.core.envelope import ENVELOPE_BYTES
from kvtier.core.errors import InvalidFieldError, StorageError
from kvtier.core.extra_config import parse_extra_config
from kvtier.core.host_pool import HostPool
from kvtier.core.layout import region_stride_bytes
from kvtier.core.store import Store
from kvtier.storage import StorageChain, open_store

if TYPE_CHECKING:
    from kvtier.core.extents import Extent
    from kvtier.plugins.registry import Registry

__all__ = ["DEFAULT_BATCH", "DEFAULT_RAW_THREADS", "EPILOG", "BenchResult", "run_bench"]

#: Pages per put/get call unless --batch says otherwise: engines move pages in batches
#: (SGLang's HiCache a request's pages, vLLM a step's blocks), and a backend spreads a
#: batch over its I/O threads.
DEFAULT_BATCH = 8
#: Threads of the second raw baseline when the backend has no ``io_threads`` of its own.
DEFAULT_RAW_THREADS = 4

#: The examples ``kvtier bench --help`` ends with.
EPILOG = """\
examples:
  kvtier bench                                   # file, then segment: temp dirs, 64 x 8 MiB pages
  kvtier bench --pages 256 --batch 16 --json     # bigger run, batched calls, JSON on stdout
  kvtier bench --backend memory
  kvtier bench --backend file,segment,uring --workdir /mnt/nvme   # three, on that disk
  kvtier bench --backend file --extra-config '{"root": "/mnt/nvme/kv", "fsync": "batch"}'
  kvtier bench --config @chain.json              # a chain of tiers, e.g. {"tiers": [
                                                 #   {"backend": "memory"}, {"backend": "segment"}]}
  kvtier bench --attention mla --num-layers 61 --layout page_first
  kvtier bench --layout layer_first --io-backend kernel --device cpu
  kvtier bench --workload multiturn --plot run.png

The table: GB/s is a round's bytes over its time (median of the timed rounds); p50 / p99
are the latency of one call, and the last column says how many pages one call moves
(the device rows move a whole round in one call, the storage and raw rows --batch pages).
"kvtier / raw" compares the storage path with raw os.pwritev / os.preadv of the same
bytes in one thread, next to its target (a local-disk backend: 0.90, checksums
included; memory and network stores: none), and "kvtier / raw, N threads" with the same
raw calls spread over --raw-threads threads (target 1.00). A path with a failed page
gets no ratio.

With several backends each gets its own table (and raw sides of its own, measured in
its run), then one side-by-side summary; --json prints the first backend's object as
with one, its "beside" list holding the others' objects, and "ok" true only when every
backend's pages came back bit-exact.

The exit status is 0 when every page came back bit-exact, 1 when a page failed or
differed, 2 when an option or the configuration was rejected (the reason on stderr,
found before anything runs).
"""


# --- the raw side ---------------------------------------------------------------------


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


def _positive(name: str, value: int) -> None:
    if value <= 0:
        raise InvalidFieldError(name, f"must be a positive integer, got {value}", value=value)


def run_bench(
    args: argparse.Namespace,
    *,
    registry: Registry | None = None,
    progress_stream: IO[str] | None = None,
) -> BenchResult:
    """Check the options, resolve every backend's plan, build everything, run the rounds.

    Every mistake in the options raises ConfigError before anything is allocated; with
    several backends, before the first one runs. The first backend's result comes back,
    the others' in its ``beside``.
    """
    check_workload_options(args, "single")
    if args.batch is None:
        args.batch = min(DEFAULT_BATCH, args.pages) if args.pages > 0 else DEFAULT_BATCH
    for name in ("pages", "batch", "rounds"):
        _positive(f"--{name}", getattr(args, name))
    if args.batch > args.pages:
        raise InvalidFieldError(
            "--batch",
            f"{args.batch} pages per call is more than a round has (--pages {args.pages}); "
            f"use at most {args.pages}, or more --pages",
            value=args.batch,
        )
    check_seed(args.seed)
    check_plot(getattr(args, "plot", None), "single")
    device = resolve_device(args.device)
    if registry is None:
        from kvtier.plugins.manager import load_registry

        registry = load_registry()
    extra = parse_extra_config(args.extra_config, source="--extra-config")
    chain = chain_options(args)
    names = backend_names(args, "single", chain)
    if len(names) > 1 and "root" in extra:
        raise InvalidFieldError(
            "--extra-config",
            f"'root' would be shared by {len(names)} backends ({', '.join(names)}); give one "
            "--backend, or leave 'root' out and use --workdir DIR to put every backend's "
            "temporary root (and the raw side's files) on that disk",
            value=extra["root"],
        )
    workdir = make_workdir(args.workdir, "kvtier-bench-")
    try:
        runs = (
            [_prepare_chain(args, registry, chain, device, workdir)]
            if not names
            else [
                _prepare(args, registry, name, extra, chain, device, workdir, many=len(names) > 1)
                for name in names
            ]
        )
        stream = progress_stream or sys.stderr
        show = not args.no_progress and not args.json
        total = len(runs) * (args.rounds + 1) * args.pages * 2
        bar = Progress(total, stream, show, unit="page transfers")
        titled = len(runs) > 1
        try:
            results = [
                _run_plan(args, plan, device, workdir, bar, note, titled=titled)
                for plan, note in runs
            ]
        finally:
            bar.close()
        first = results[0]
        first.beside = results[1:]
        return first
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _prepare(
    args: argparse.Namespace,
    registry: Registry,
    backend: str,
    extra: dict[str, Any],
    chain: dict[str, Any],
    device: torch.device,
    workdir: Path,
    *,
    many: bool,
) -> tuple[ResolvedPlan, str | None]:
    """One backend's plan, checked against this machine; and the raw side's note, if any."""
    given = dict(extra)
    extra = temporary_root(
        registry, backend, extra, workdir, f"{backend}-pages" if many else "pages"
    )
    config = engine_config(
        args, extra, backend=backend, chain=chain, model="kvtier-bench", host_pages=args.pages
    )
    # with several backends, an option one of them refuses names that one
    where = {"options_at": f"--extra-config[{backend}]"} if many else {}
    plan = resolve(
        config, registry.backends, registry.io_backends, policies=registry.policies, **where
    )
    check_device_runs(device, plan.io_backend.name, plan.io_backend.devices)
    temp_roots = int("root" in extra and "root" not in given)
    _check_fits(args, plan, device, workdir, temp_roots=temp_roots)
    return plan, _raw_note(args, workdir, given.get("root"))


def _prepare_chain(
    args: argparse.Namespace,
    registry: Registry,
    chain: dict[str, Any],
    device: torch.device,
    workdir: Path,
) -> tuple[ResolvedPlan, str | None]:
    """The plan of ``--config``'s chain of tiers, checked; and the raw side's note."""
    chain, temp_roots = temporary_tier_roots(registry, chain, workdir)
    config = engine_config(args, {}, chain=chain, model="kvtier-bench", host_pages=args.pages)
    plan = resolve(config, registry.backends, registry.io_backends, policies=registry.policies)
    check_device_runs(device, plan.io_backend.name, plan.io_backend.devices)
    _check_fits(args, plan, device, workdir, temp_roots=temp_roots)
    first = config.tiers[0].extra_config.get("root")  # the first tier takes the puts
    given = first is not None and not Path(str(first)).is_relative_to(workdir)
    return plan, _raw_note(args, workdir, first if given else None)


def _raw_note(args: argparse.Namespace, workdir: Path, root: object) -> str | None:
    """Why the ratio compares two disks, when the backend's given root is on another."""
    if root is None or args.no_raw or _same_disk(workdir, root):
        return None
    return (
        f"the raw side writes to --workdir ({workdir.parent}), the backend to its "
        f"root ({root}) on another file system: the ratio compares the disks"
    )


def _same_disk(workdir: Path, root: object) -> bool:
    """Whether ``root`` (or its nearest existing parent) is on ``workdir``'s file system."""
    path = Path(str(root)).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return path.stat().st_dev == workdir.stat().st_dev
    except OSError:
        return True  # cannot tell: say nothing rather than guess


def _check_fits(
    args: argparse.Namespace,
    plan: ResolvedPlan,
    device: torch.device,
    workdir: Path,
    *,
    temp_roots: int,
) -> None:
    """Refuse a run whose pools do not fit in memory, or whose files do not fit on disk."""
    g = plan.geometry
    stored = g.kv_count * region_stride_bytes(g, plan.layout) + ENVELOPE_BYTES
    pools = 1 if args.no_raw else 2
    fix = "use fewer --pages or a smaller geometry (--num-layers, --page-size)"
    check_memory(
        args.pages * stored * pools,
        2 * args.pages * g.bytes_per_page,
        device,
        what="the host pool"
        + ("" if args.no_raw else ", the raw side's pool")
        + ", the device pool and the copy it is compared with",
        fix=fix,
    )
    files = (0 if args.no_raw else 1) + temp_roots
    if files:
        whose = "the backend's pages" if temp_roots < 2 else "each temporary tier's pages"
        check_disk(
            workdir,
            files * args.pages * stored,
            what=" and ".join(
                (["the raw side's files"] if not args.no_raw else [])
                + ([whose] if temp_roots else [])
            ),
            fix=fix + ", or a --workdir with more room",
        )


def _run_plan(
    args: argparse.Namespace,
    plan: ResolvedPlan,
    device: torch.device,
    workdir: Path,
    bar: Progress,
    raw_note: str | None,
    *,
    titled: bool = False,
) -> BenchResult:
    host = build_host_pool(plan)
    # A chain of tiers (or tenants' quotas) runs through the chain, as an engine's does;
    # one backend through its page store, the path the raw side is compared with.
    chained = bool(plan.config.tiers or plan.config.tenants)
    store: Store = open_store(plan, host) if chained else open_page_store(plan, host)
    bench: _Run | None = None
    try:
        bench = _Run(args, plan, store, device, workdir, bar, titled=titled)
        for round_ in range(args.rounds + 1):
            bench.round(round_)
        return bench.result(raw_note)
    finally:
        if bench is not None:
            bench.close()
        store.close()


class _Run:
    """Everything one ``kvtier bench`` run holds: pools, store, keys, raw files, timings."""

    def __init__(
        self,
        args: argparse.Namespace,
        plan: ResolvedPlan,
        store: Store,
        device: torch.device,
        workdir: Path,
        bar: Progress,
        *,
        titled: bool = False,
    ) -> None:
        geometry = plan.geometry
        self.plan, self.store, self.workdir = plan, store, workdir
        self.backend = store.backend
        self.chain = store if isinstance(store, StorageChain) else None
        #: what the progress line calls this run, when several run
        self.title = f"{_describe_backend(plan)}, " if titled else ""
        assert isinstance(store.pool, HostPool)
        self.host: HostPool = store.pool
        self.device = str(device)
        self.pages, self.rounds, self.seed = args.pages, args.rounds, args.seed
        self.batch = args.batch
        page_size = geometry.page_size
        self.mover = build_io_backend(plan)
        self.dev = TorchDevicePool(geometry, self.pages * page_size, device)
        self.dev.fill_random_(torch.Generator().manual_seed(args.seed))
        self.original = [t.clone() for t in self.dev.kv_tensors]
        self.keyer = plan.keyer()
        self.keys: list[str] = []
        self.host_pages = self.host.allocate(self.pages)
        self.slots = torch.arange(self.pages * page_size, dtype=torch.int64, device=device)
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
        raw_dir = Path(tempfile.mkdtemp(prefix="raw-", dir=workdir))
        self.raw_paths = [raw_dir / f"{i}.page" for i in range(self.pages)]
        self.raw_threads = args.raw_threads or int(
            getattr(plan.backend_config, "io_threads", DEFAULT_RAW_THREADS)
        )
        self.raw_paths_n = [raw_dir / f"{i}.threads.page" for i in range(self.pages)]
        self.raw_pool = (
            ThreadPoolExecutor(self.raw_threads - 1, thread_name_prefix="kvtier-bench-raw")
            if self.do_raw and self.raw_threads > 1
            else None
        )
        payload_round = self.pages * geometry.bytes_per_page
        stored_round = self.pages * self.stored_bytes
        self.put_t = Timing(stored_round, self.batch)
        self.get_t = Timing(stored_round, self.batch)
        self.backup_t = Timing(payload_round, self.pages)
        self.load_t = Timing(payload_round, self.pages)
        self.raw_put_t = Timing(stored_round, self.batch)
        self.raw_get_t = Timing(stored_round, self.batch)
        self.raw_put_n_t = Timing(stored_round, self.batch)
        self.raw_get_n_t = Timing(stored_round, self.batch)
        self.failures: list[str] = []
        self.timed = False
        self.batches = [
            (i, min(i + self.batch, self.pages)) for i in range(0, self.pages, self.batch)
        ]
        self.bar = bar

    def _round_keys(self, number: int) -> list[str]:
        """Round ``number``'s keys: tokens of its own, so no key is stored twice in a run."""
        page_size = self.plan.geometry.page_size
        gen = torch.Generator().manual_seed(self.seed + 1 + number)
        tokens = torch.randint(0, 128_000, (self.pages * page_size,), generator=gen)
        return self.keyer.keys(tokens.tolist())

    # --- one side, one batch: seconds taken ----------------------------------------------

    def _failed(
        self, timing: Timing, label: str, template: str, lo: int, results: Sequence[object]
    ) -> None:
        bad = [lo + i for i, ok in enumerate(results) if not ok]
        self.failures.extend(f"{label}: " + template.format(page=page) for page in bad)
        if self.timed:
            timing.failed_pages += len(bad)

    def _late(self, result: object) -> None:
        """Every call's ``on_late``: the call holds it, and so this run and its host pages,
        until a call that timed out returns (the memory is never freed under it)."""

    def _stop_if_late(self, results: Sequence[object], op: str, lo: int, hi: int) -> None:
        """Stop the run when a call timed out: the late call may still read or fill host
        pages ``lo..hi``, which every later round reuses, so no later timing or check of
        them could be trusted (the pages are never reused while it may still run)."""
        if getattr(results, "outcome", Outcome.OK) is not Outcome.TIMED_OUT:
            return
        raise StorageError(
            f"bench: a {op} of host pages {lo}..{hi - 1} did not return within the backend "
            "call bound (backend_call_timeout_s); the late call may still use those pages, "
            "which every later round reuses, so the run stops here rather than time or "
            "check them. Bench a backend (or disk) that answers within the bound",
            value=op,
        )

    def ours_put(self, lo: int, hi: int, label: str) -> float:
        t0 = time.perf_counter()
        results = self.store.put(self.keys[lo:hi], self.host_pages[lo:hi], on_late=self._late)
        elapsed = time.perf_counter() - t0
        self._stop_if_late(results, "put", lo, hi)
        self._failed(self.put_t, label, "put of page {page} failed", lo, results)
        return elapsed

    def raw_put(self, lo: int, hi: int, label: str) -> float:
        t0 = time.perf_counter()
        for i in range(lo, hi):
            _raw_put(self.raw_paths[i], self.regions[i])
        return time.perf_counter() - t0

    def _spread(self, lo: int, hi: int, one: Callable[[int], object]) -> list[object]:
        """``one(i)`` for ``lo <= i < hi``, one contiguous slice per raw thread (the calling
        thread works the first): the cheapest way to keep that many raw calls going."""
        n = min(self.raw_threads, hi - lo)
        cut = [lo + (hi - lo) * t // n for t in range(n + 1)]

        def work(t: int) -> list[object]:
            return [one(i) for i in range(cut[t], cut[t + 1])]

        futures = [self.raw_pool.submit(work, t) for t in range(1, n)] if self.raw_pool else []
        done = work(0)
        for future in futures:
            done.extend(future.result())
        return done

    def raw_put_n(self, lo: int, hi: int, label: str) -> float:
        t0 = time.perf_counter()
        self._spread(lo, hi, lambda i: _raw_put(self.raw_paths_n[i], self.regions[i]))
        return time.perf_counter() - t0

    def ours_get(self, lo: int, hi: int, label: str) -> float:
        t0 = time.perf_counter()
        results = self.store.get(self.keys[lo:hi], self.host_pages[lo:hi], on_late=self._late)
        elapsed = time.perf_counter() - t0
        self._stop_if_late(results, "get", lo, hi)
        self._failed(self.get_t, label, "get of page {page} failed or was rejected", lo, results)
        return elapsed

    def raw_get(self, lo: int, hi: int, label: str) -> float:
        t0 = time.perf_counter()
        got = [_raw_get(self.raw_paths[i], self.raw_into[i]) for i in range(lo, hi)]
        elapsed = time.perf_counter() - t0
        short = [n == self.stored_bytes for n in got]
        self._failed(self.raw_get_t, label, "raw read of page {page} was short", lo, short)
        return elapsed

    def raw_get_n(self, lo: int, hi: int, label: str) -> float:
        t0 = time.perf_counter()
        got = self._spread(lo, hi, lambda i: _raw_get(self.raw_paths_n[i], self.raw_into[i]))
        elapsed = time.perf_counter() - t0
        short = [n == self.stored_bytes for n in got]
        template = f"raw read of page {{page}} on {self.raw_threads} threads was short"
        self._failed(self.raw_get_n_t, label, template, lo, short)
        return elapsed

    def phase(
        self,
        sides: list[Callable[[int, int, str], float]],
        label: str,
        what: str,
    ) -> list[list[float]]:
        """Every side batch by batch, rotating which goes first; each side's call seconds.

        The order also alternates direction batch by batch, so no side always runs right
        after another (and finds its pages in the CPU caches). ``sides[0]`` is ours; the
        raw sides run only when the raw side is on."""
        sides = sides if self.do_raw else sides[:1]
        calls: list[list[float]] = [[] for _ in sides]
        for n, (lo, hi) in enumerate(self.batches):
            first = (n // 2) % len(sides)
            order = [*range(first, len(sides)), *range(first)]
            for k in order if n % 2 == 0 else order[::-1]:
                calls[k].append(sides[k](lo, hi, label))
            self.bar.step(f"{label}: {what}", hi - lo)
        return calls + [[] for _ in range(3 - len(calls))]

    # --- a round -------------------------------------------------------------------------

    def round(self, number: int) -> None:
        """Device -> host -> storage, wipe, storage -> host -> device, compare; round 0 is
        the untimed warm-up."""
        self.timed = timed = number > 0
        label = self.title + (f"round {number}/{self.rounds}" if timed else "warm-up")
        # new pages every round, untimed: last round's are cleared, this round's keys are new
        self._clear()
        self.keys = self._round_keys(number)
        for path in (*self.raw_paths, *self.raw_paths_n):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        t0 = time.perf_counter()
        self.mover.backup(self.dev, self.host, self.slots, self.host_pages)
        _sync(self.device)
        backup = time.perf_counter() - t0
        ours, raw, raw_n = self.phase([self.ours_put, self.raw_put, self.raw_put_n], label, "put")
        if timed:
            self.backup_t.add_round(backup, [backup])
            self.put_t.add_round(sum(ours), ours)
            self.raw_put_t.add_round(sum(raw), raw)
            self.raw_put_n_t.add_round(sum(raw_n), raw_n)
        # wipe every copy, so only what storage returns can pass
        self.dev.zero_()
        for pool in (self.host, self.raw_host):
            if pool is not None:
                for page in range(pool.num_pages):
                    _wipe(pool, page)
        ours, raw, raw_n = self.phase([self.ours_get, self.raw_get, self.raw_get_n], label, "get")
        t0 = time.perf_counter()
        self.mover.load(self.host, self.dev, self.host_pages, self.slots)
        _sync(self.device)
        load = time.perf_counter() - t0
        if timed:
            self.get_t.add_round(sum(ours), ours)
            self.raw_get_t.add_round(sum(raw), raw)
            self.raw_get_n_t.add_round(sum(raw_n), raw_n)
            self.load_t.add_round(load, [load])
        page_size = self.plan.geometry.page_size
        for kv, (now, before) in enumerate(zip(self.dev.kv_tensors, self.original, strict=True)):
            if not torch.equal(now.view(torch.uint8), before.view(torch.uint8)):
                bad = _first_bad_page(now, before, page_size)
                self.failures.append(
                    f"{label}: device data differs after the round trip "
                    f"(kv {kv}, first differing page {bad})"
                )

    def _clear(self) -> None:
        """Remove the stored pages: the backend's, or every tier's once the cascade is done."""
        if self.chain is None:
            self.backend.clear()
            return
        self.chain.flush()
        if not self.chain.clear():
            self.failures.append("clearing the chain's tiers failed (see the tier counters)")

    def close(self) -> None:
        """Stop the raw side's threads and remove its files."""
        if self.raw_pool is not None:
            self.raw_pool.shutdown()
        shutil.rmtree(self.raw_paths[0].parent, ignore_errors=True)

    def result(self, raw_note: str | None) -> BenchResult:
        """The measurements; the stored pages are removed."""
        if self.chain is not None:
            self.chain.flush()
        backend_stats = self.backend.stats() if self.chain is None else self.chain.backend_stats()
        result = BenchResult(
            plan=self.plan,
            pages=self.pages,
            batch=self.batch,
            rounds=self.rounds,
            device=str(self.dev.device),
            page_bytes=self.plan.geometry.bytes_per_page,
            stored_bytes=self.stored_bytes,
            failures=self.failures,
            put=self.put_t,
            get=self.get_t,
            backup=self.backup_t,
            load=self.load_t,
            raw_put=self.raw_put_t if self.do_raw else None,
            raw_get=self.raw_get_t if self.do_raw else None,
            raw_threads=self.raw_threads,
            raw_put_threads=self.raw_put_n_t if self.do_raw else None,
            raw_get_threads=self.raw_get_n_t if self.do_raw else None,
            backend_stats=backend_stats,
            store_stats=self.store.stats(),
            workdir=str(self.workdir),
            raw_note=raw_note,
            tiers=[t.backend for t in self.plan.config.tiers],
        )
        self._clear()
        return result


def _describe_backend(plan: ResolvedPlan) -> str:
    """``file``, or ``chain memory -> segment`` for a chain of tiers."""
    if plan.config.tiers:
        return "chain " + " -> ".join(t.backend for t in plan.config.tiers)
    return plan.backend.name


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
