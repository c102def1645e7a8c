"""Helpers the benchmark scripts share (imported from the scripts' own directory).

Besides :func:`interleaved_medians`, this holds the page-path suite that ``file.py``,
``uring.py`` and ``segments.py`` all run (:func:`page_path_suite`): the same pages,
through ``PageStore`` with full verification and the backend under test, side by side
in one run with what users compare kvtier with and with the physical floor:

- ``raw1``: one file per page, ``open + pwritev / preadv + close``, in one thread;
- ``rawN``: the same raw calls on N threads (N = the backend's I/O threads, what
  LMCache's local-disk backend does; each thread takes one contiguous slice of a batch,
  the cheapest hand-off);
- ``aio``: one file per page through glibc's POSIX AIO (``lio_listio``, every region a
  request, run by glibc's own N threads, no GIL between requests; ``_aio.py``): what
  NVIDIA NIXL's POSIX backend does, the strongest raw thread-pool side (left out where
  glibc's AIO does not load);
- ``floor``: ``pwritev`` / ``preadv`` of the same bytes into one pre-allocated file, one
  call per batch, pages back to back (:class:`PackedFile`): what packed pages cost with
  no envelope, no index and no file per page;

for puts of new pages, warm gets, cold gets (page cache dropped) and overwrites, at
16 KiB, 128 KiB, 2 MiB and 8 MiB pages (:data:`SIZES_FULL`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _aio import PosixAio
from _aio import available as aio_available

GB = 1e9


def interleaved_medians(cases: dict[str, Callable[[], float]], reps: int) -> dict[str, float]:
    """Warm every case up once, then ``reps`` rounds taking the cases in turn; medians.

    Interleaving keeps both sides of a comparison under the same machine conditions,
    which drift on shared VMs; each case returns one sample (seconds or a rate).
    """
    for case in cases.values():
        case()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps):
        for name, case in cases.items():
            samples[name].append(case())
    return {name: statistics.median(values) for name, values in samples.items()}


# --- raw baselines ---------------------------------------------------------------------


def raw_write(path: str, views: list[memoryview], flags: int) -> None:
    """One raw page write: open with ``flags`` (O_EXCL: a new file; 0: in place), pwritev."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | flags, 0o600)
    try:
        os.pwritev(fd, views, 0)
    finally:
        os.close(fd)


def raw_read(path: str, views: list[memoryview]) -> None:
    """One raw page read: open, preadv into the page's regions, close."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if os.preadv(fd, views, 0) != sum(v.nbytes for v in views):
            raise SystemExit(f"short raw read of {path}")
    finally:
        os.close(fd)


def drop_cache(paths: Sequence[str]) -> None:
    """Evict these (clean) files from the page cache; other processes' caches stay."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_files(paths: Sequence[str]) -> None:
    """Write these files back, so that :func:`drop_cache` can evict them."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --- output ----------------------------------------------------------------------------


def emit(
    bench: str,
    case: str,
    ours: list[float],
    base: list[float],
    name: str,
    target: float | None,
    *,
    unit: str = "GB/s",
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Print one JSON line (DESIGN.md's form) for per-round rates ``ours`` vs ``base``.

    ``ratio`` is the median of the per-round ratios (the two sides of a round ran under
    the same conditions); ``spread`` is their lowest and highest, so noise is visible.
    """
    ratios = [o / b for o, b in zip(ours, base, strict=True) if b]
    ratio = statistics.median(ratios) if ratios else None
    line: dict[str, Any] = {
        "bench": bench,
        "case": case,
        "ours": round(statistics.median(ours), 3),
        "baseline": round(statistics.median(base), 3),
        "baseline_name": name,
        "unit": unit,
        "ratio": None if ratio is None else round(ratio, 3),
        "target": target,
        "spread": [round(min(ratios), 3), round(max(ratios), 3)] if ratios else None,
        **(extra or {}),
    }
    print(json.dumps(line), flush=True)
    mark = ""
    if target is not None:
        mark = "  ok" if ratio is not None and ratio >= target else "  BELOW TARGET"
    spread = line["spread"] or ["-", "-"]
    target_text = "" if target is None else f" (target {target})"
    print(
        f"{case:<40} {line['ours']:8.2f} vs {line['baseline']:8.2f} {unit} {name:<30} "
        f"x{line['ratio']} [{spread[0]}-{spread[1]}]{target_text}{mark}",
        file=sys.stderr,
        flush=True,
    )
    return line


# --- the page-path suite ---------------------------------------------------------------


@dataclass(frozen=True)
class Size:
    """One page size of the suite: its label, geometry arguments, page count and batch."""

    label: str
    num_layers: int
    page_size: int
    pages: int
    batch: int


#: 16 KiB: a per-layer slice (4 layers x 8 heads x 128 x bf16, one token, K and V); 128
#: KiB: an 8B-class model at one token per page; 2 MiB: vLLM's 16-token block of that
#: model; 8 MiB: 64 tokens (SGLang's and ``kvtier bench``'s default page of it).
SIZES_FULL: tuple[Size, ...] = (
    Size("16KiB", 4, 1, 4096, 32),
    Size("128KiB", 32, 1, 1024, 32),
    Size("2MiB", 32, 16, 128, 8),
    Size("8MiB", 32, 64, 64, 8),
)
SIZES_QUICK: tuple[Size, ...] = (
    Size("16KiB", 4, 1, 512, 32),
    Size("128KiB", 32, 1, 256, 32),
    Size("2MiB", 32, 16, 24, 8),
    Size("8MiB", 32, 64, 16, 8),
)


def pick_sizes(quick: bool, wanted: str | None) -> tuple[Size, ...]:
    """The suite's sizes (``--quick``: fewer pages), only those ``wanted`` names if given."""
    sizes = SIZES_QUICK if quick else SIZES_FULL
    if not wanted:
        return sizes
    names = set(wanted.split(","))
    unknown = names - {s.label for s in sizes}
    if unknown:
        raise SystemExit(
            f"unknown page size(s) {sorted(unknown)}; choose from {[s.label for s in sizes]}"
        )
    return tuple(s for s in sizes if s.label in names)


#: Stored bytes (payload + envelope) up to which a page counts as small for the targets.
SMALL_STORED = 132 << 10


def target(size: Size, stored: int, op: str, base: str, cold_raw1: float | None) -> float | None:
    """The ratio a case should reach (a goal, not a gate; issue 27's and the earlier ones).

    Small pages (up to 128 KiB): at least 1.0x raw one-file-per-page on every case and
    0.8x the packed floor. Larger pages: 0.9x one raw thread on puts and warm gets, 0.8x
    on overwrites (ours stay atomic, raw writes in place), ``cold_raw1`` on cold gets;
    1.0x raw on N threads; 8 MiB pages 0.9x the floor. Full verification at 0.9x
    header-only verification.
    """
    small = stored <= SMALL_STORED
    if base == "floor":
        return 0.8 if small else (0.9 if size.label == "8MiB" else None)
    if base == "header":
        return 0.9
    if base in ("rawn", "aio"):
        return 1.0
    if base != "raw1":
        return None  # another store: for information
    one = {"put": 0.9, "get": 0.9, "overwrite": 0.8}.get(op, cold_raw1)
    return max(1.0, one or 0.0) if small else one


class Rounds:
    """Per-round seconds of several sides, each timed batch by batch in rotating order.

    The order also alternates direction batch by batch: a side that reads the same files
    into the same pages as the side just before it finds them in the CPU caches, so in
    one direction only the side after would always get that head start.
    """

    def __init__(self, sides: dict[str, Callable[[int], Any]], groups: int) -> None:
        self.sides = sides
        self.groups = groups
        self.seconds: dict[str, list[float]] = {name: [] for name in sides}

    def round(
        self,
        before_round: Callable[[], Any] | None = None,
        before: Callable[[str, int], Any] | None = None,
        *,
        record: bool = True,
    ) -> None:
        if before_round is not None:
            before_round()
        names = list(self.sides)
        totals = dict.fromkeys(names, 0.0)
        clock = time.perf_counter
        for g in range(self.groups):
            shift = (g // 2) % len(names)
            order = names[shift:] + names[:shift]
            for name in order if g % 2 == 0 else order[::-1]:
                if before is not None:
                    before(name, g)
                t0 = clock()
                self.sides[name](g)
                totals[name] += clock() - t0
        if record:
            for name in names:
                self.seconds[name].append(totals[name])

    def run(
        self,
        reps: int,
        before_round: Callable[[], Any] | None = None,
        before: Callable[[str, int], Any] | None = None,
    ) -> Rounds:
        """One untimed warm-up round, then ``reps`` recorded ones."""
        for rep in range(reps + 1):
            self.round(before_round, before, record=rep > 0)
        return self

    def rates(self, name: str, nbytes: int) -> list[float]:
        return [nbytes / s / GB for s in self.seconds[name]]


class PackedFile:
    """The packed-page floor: one pre-allocated file, a batch one ``pwritev`` / ``preadv``.

    Page ``i`` lives at ``i * stored``, the pages of a batch back to back, as a segment
    holds them; no envelope, no index, no record header, no file per page. ``write`` and
    ``read`` move batch ``g``'s pages straight from and into the host pool's regions.
    """

    def __init__(
        self, path: str, stored: int, groups: Sequence[Sequence[int]], views: list[list[Any]]
    ) -> None:
        self.path, self.stored = path, stored
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.posix_fallocate(self.fd, 0, stored * sum(len(g) for g in groups))
        self.offset = [g[0] * stored for g in groups]
        self.length = [len(g) * stored for g in groups]
        self.flat = [[v for i in g for v in views[i]] for g in groups]

    def write(self, g: int) -> None:
        if os.pwritev(self.fd, self.flat[g], self.offset[g]) != self.length[g]:
            raise SystemExit(f"short pwritev into {self.path}")

    def read(self, g: int) -> None:
        if os.preadv(self.fd, self.flat[g], self.offset[g]) != self.length[g]:
            raise SystemExit(f"short preadv of {self.path}")

    def sync(self) -> None:
        os.fsync(self.fd)

    def drop(self, g: int) -> None:
        """Evict batch ``g``'s (clean) bytes from the page cache."""
        os.posix_fadvise(self.fd, self.offset[g], self.length[g], os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        os.close(self.fd)


def page_files(backend: Any, keys: Sequence[str]) -> list[str]:
    """The page files of ``keys`` in a one-file-per-page store (``file``, ``uring``)."""
    from kvtier.backends.filestore import paths as fs_paths

    store = os.fspath(backend.store)
    return [fs_paths.page_path_str(store, k) for k in keys]


@dataclass(frozen=True)
class Store:
    """A backend the suite drives through ``PageStore``: built on a root, emptied before
    each round of new puts, and the files to drop from the page cache before a cold read
    of some of its keys."""

    make: Callable[[Path], Any]
    files_of: Callable[[Any, Sequence[str]], list[str]] = page_files
    empty: Callable[[Any, Sequence[str]], Any] = lambda backend, keys: backend.delete(keys)
    describe: Callable[[Any], str] | None = None


def page_path_suite(
    bench: str,
    ours: Store | Callable[[Path], Any],
    threads: int,
    work: Path,
    *,
    sizes: Sequence[Size],
    reps: int,
    cold_target: float | None,
    beside: dict[str, Store] | None = None,
    bounded: bool = True,
) -> list[dict[str, Any]]:
    """Every case of every size, ours vs the raw sides and the floor; the JSON lines printed.

    ``ours`` builds the backend under test (a :class:`Store`, or just its maker for a
    one-file-per-page store); ``threads`` is its number of I/O threads (the raw N-thread
    side uses as many); ``beside`` names other stores run in the same rounds, for
    information; ``bounded=False`` runs the page stores without the per-call bound. All
    sides move the same bytes from and into the same host-pool pages, allocated and
    touched once.
    """
    subject = ours if isinstance(ours, Store) else Store(ours)
    lines: list[dict[str, Any]] = []
    pool = ThreadPoolExecutor(threads, thread_name_prefix="raw")
    try:
        for size in sizes:
            suite = _SizeSuite(bench, subject, beside or {}, threads, work, size, pool, bounded)
            try:
                lines.extend(suite.run(reps, cold_target))
            finally:
                suite.close()
    finally:
        pool.shutdown()
    return lines


class _SizeSuite:
    """The suite's sides and cases for one page size."""

    def __init__(
        self,
        bench: str,
        ours: Store,
        beside: dict[str, Store],
        threads: int,
        work: Path,
        size: Size,
        pool: ThreadPoolExecutor,
        bounded: bool,
    ) -> None:
        import torch

        from kvtier.core.geometry import KVGeometry
        from kvtier.core.host_pool import HostPool
        from kvtier.core.keys import Namespace, PageKeyer
        from kvtier.core.pagestore import PageStore

        self.bench, self.size, self.threads, self.pool = bench, size, threads, pool
        geometry = KVGeometry.mha(
            num_layers=size.num_layers, num_kv_heads=8, head_dim=128, page_size=size.page_size
        )
        n = self.n = size.pages
        host = HostPool(geometry, "page_first_direct", num_pages=n, pin_memory=False)
        generator = torch.Generator().manual_seed(0)
        for page in range(n):
            for extent in host.page_buffers(page):
                torch.frombuffer(extent.view, dtype=torch.uint8).random_(
                    0, 256, generator=generator
                )
        ids = host.allocate(n)
        keyer = PageKeyer(Namespace(f"bench-{size.label.lower()}", geometry.fingerprint), 1)
        self.keys = keyer.keys(list(range(n)))
        self.views = [[e.view for e in host.page_buffers(p)] for p in ids]
        self.stored = sum(v.nbytes for v in self.views[0])
        self.total = n * self.stored
        self.groups = [list(range(i, min(i + size.batch, n))) for i in range(0, n, size.batch)]
        self.gk = [[self.keys[i] for i in g] for g in self.groups]
        self.gp = [[ids[i] for i in g] for g in self.groups]
        bound: dict[str, Any] = {} if bounded else {"backend_call_timeout_s": None}
        self.stores: dict[str, tuple[Store, Any, Any]] = {}  # name -> (store, backend, pages)
        self.header: Any = None
        self.roots: list[Path] = []
        for name, store in {"ours": ours, **beside}.items():
            root = work / f"{name}-{size.label}"
            self.roots.append(root)
            backend = store.make(root)
            pages = PageStore(backend, host, fingerprint=geometry.fingerprint, **bound)
            self.stores[name] = (store, backend, pages)
            if name == "ours":
                self.header = PageStore(
                    backend, host, fingerprint=geometry.fingerprint, verify="header", **bound
                )
        self.raw_dir = work / f"raw-{size.label}"
        self.raw_dir.mkdir(mode=0o700)
        self.raw1 = [f"{self.raw_dir}/a{i}" for i in range(n)]
        self.rawn = [f"{self.raw_dir}/b{i}" for i in range(n)]
        self.rawa = [f"{self.raw_dir}/c{i}" for i in range(n)]
        self.aio = PosixAio(self.views, threads) if aio_available() else None
        self.packed = PackedFile(f"{self.raw_dir}/packed", self.stored, self.groups, self.views)
        self.label = f"{n}x{size.label}"
        print(
            f"{bench}: {self.label} ({self.stored} bytes stored each), batches of "
            f"{size.batch}, {threads} threads, {'bounded' if bounded else 'unbounded'} calls",
            file=sys.stderr,
        )

    # --- sides ----------------------------------------------------------------------------

    def _spread(self, g: int, one: Callable[[int], None]) -> None:
        # one contiguous slice per thread, this thread working the first: the cheapest
        # way to keep N raw requests going (one hand-off per thread)
        idx = self.groups[g]
        cut = [len(idx) * t // self.threads for t in range(self.threads + 1)]

        def work(t: int) -> None:
            for i in idx[cut[t] : cut[t + 1]]:
                one(i)

        futures = [self.pool.submit(work, t) for t in range(1, self.threads)]
        work(0)
        for future in futures:
            future.result()

    def _raw_write(self, files: list[str], flags: int, parallel: bool) -> Callable[[int], None]:
        views = self.views
        if parallel:
            return lambda g: self._spread(g, lambda i: raw_write(files[i], views[i], flags))

        def run(g: int) -> None:
            for i in self.groups[g]:
                raw_write(files[i], views[i], flags)

        return run

    def _raw_read(self, files: list[str], parallel: bool) -> Callable[[int], None]:
        views = self.views
        if parallel:
            return lambda g: self._spread(g, lambda i: raw_read(files[i], views[i]))

        def run(g: int) -> None:
            for i in self.groups[g]:
                raw_read(files[i], views[i])

        return run

    def _aio(self, write: bool) -> dict[str, Callable[[int], None]]:
        """The POSIX AIO side of a case (none where it does not load)."""
        aio = self.aio
        if aio is None:
            return {}
        return {"aio": lambda g: aio.move(self.rawa, self.groups[g], write=write)}

    def _put(self, name: str) -> Callable[[int], None]:
        _, backend, pages = self.stores[name]

        def run(g: int) -> None:
            if not all(pages.put(self.gk[g], self.gp[g])):
                raise SystemExit(f"{name}: put failed: {pages.stats()} {backend.stats()}")

        return run

    def _get(self, name: str, header: bool = False) -> Callable[[int], None]:
        _, backend, pages = self.stores[name]
        store = self.header if header else pages

        def run(g: int) -> None:
            if not all(store.get(self.gk[g], self.gp[g])):
                raise SystemExit(f"{name}: get failed: {store.stats()} {backend.stats()}")

        return run

    def _stores(self, side: Callable[[str], Callable[[int], None]]) -> dict[str, Any]:
        return {name: side(name) for name in self.stores}

    # --- cases ------------------------------------------------------------------------------

    def run(self, reps: int, cold_target: float | None) -> list[dict[str, Any]]:
        excl = os.O_EXCL
        packed = self.packed

        def empty_all() -> None:
            for store, backend, _ in self.stores.values():
                store.empty(backend, self.keys)
            for path in self.raw1 + self.rawn + self.rawa:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

        n_groups = len(self.groups)
        # 1. puts of new pages (the floor writes into its pre-allocated file)
        puts = Rounds(
            {
                **self._stores(self._put),
                "raw1": self._raw_write(self.raw1, excl, False),
                "rawn": self._raw_write(self.rawn, excl, True),
                **self._aio(True),
                "floor": packed.write,
            },
            n_groups,
        ).run(reps, empty_all)
        # 2. warm gets, full and header-only verification
        gets = Rounds(
            {
                **self._stores(self._get),
                "raw1": self._raw_read(self.raw1, False),
                "rawn": self._raw_read(self.rawn, True),
                **self._aio(False),
                "floor": packed.read,
                "header": self._get("ours", header=True),
            },
            n_groups,
        ).run(reps)
        # 3. overwrites of existing pages (ours stay atomic; raw and floor write in place)
        overwrites = Rounds(
            {
                **self._stores(self._put),
                "raw1": self._raw_write(self.raw1, 0, False),
                "rawn": self._raw_write(self.rawn, 0, True),
                **self._aio(True),
                "floor": packed.write,
            },
            n_groups,
        ).run(reps)
        # 4. cold gets: every file written back, then dropped just before each side reads
        # each batch
        store_files = {
            name: store.files_of(backend, self.keys)
            for name, (store, backend, _) in self.stores.items()
        }
        raw = self.raw1 + self.rawn + (self.rawa if self.aio is not None else [])
        fsync_files([f for files in store_files.values() for f in files] + raw)
        packed.sync()

        def drop(name: str, g: int) -> None:
            idx = self.groups[g]
            if name == "floor":
                packed.drop(g)
            elif name in ("raw1", "rawn", "aio"):
                files = {"raw1": self.raw1, "rawn": self.rawn, "aio": self.rawa}[name]
                drop_cache([files[i] for i in idx])
            else:
                store, backend, _ = self.stores[name]
                drop_cache(store.files_of(backend, self.gk[g]))

        colds = Rounds(
            {
                **self._stores(self._get),
                "raw1": self._raw_read(self.raw1, False),
                "rawn": self._raw_read(self.rawn, True),
                **self._aio(False),
                "floor": packed.read,
            },
            n_groups,
        ).run(reps, before=drop)
        out: list[dict[str, Any]] = []
        for op, case, rounds in (
            ("put", f"put {self.label} new", puts),
            ("get", f"get {self.label} warm", gets),
            ("cold", f"get {self.label} cold", colds),
            ("overwrite", f"put {self.label} overwrite", overwrites),
        ):
            out.extend(self._emit(op, case, rounds, cold_target))
        for name, (store, backend, _) in self.stores.items():
            if store.describe is not None:
                print(f"  {name}: {store.describe(backend)}", file=sys.stderr)
        return out

    def _emit(
        self, op: str, case: str, rounds: Rounds, cold_target: float | None
    ) -> list[dict[str, Any]]:
        write = op in ("put", "overwrite")
        call = "os.pwritev" if write else "os.preadv"
        how = {"put": "", "overwrite": " in place", "get": "", "cold": " cold"}[op]
        names = {
            "raw1": f"{call}{how}, one file per page, 1 thread",
            "rawn": f"{call}{how}, one file per page, {self.threads} threads",
            "aio": f"POSIX AIO{how} (glibc lio_listio), one file per page, {self.threads} threads",
            "floor": f"{call}{how}, packed file, one call per batch",
            "header": "header-only verify",
        }
        mine = rounds.rates("ours", self.total)
        out = []
        for base in rounds.seconds:
            if base == "ours":
                continue
            extra: dict[str, Any] = {}
            if base == "raw1":
                per_page = (
                    statistics.median(rounds.seconds["ours"])
                    - statistics.median(rounds.seconds["raw1"])
                ) / self.n
                extra = {"overhead_us_per_page": round(per_page * 1e6, 1)}
            text = case + (" full vs header verify" if base == "header" else "")
            out.append(
                emit(
                    self.bench,
                    text,
                    mine,
                    rounds.rates(base, self.total),
                    names.get(base, f"{base} backend"),
                    target(self.size, self.stored, op, base, cold_target),
                    extra=extra,
                )
            )
        return out

    def close(self) -> None:
        for _, backend, pages in self.stores.values():
            pages.close()
            backend.close()
        self.header.close()
        self.packed.close()
        for path in (self.raw_dir, *self.roots):
            shutil.rmtree(path, ignore_errors=True)
