"""The single workload's result: the ``--json`` object and the table a person reads.

The table says what each column measures (GB/s over a round, the latency of one call and
how many pages that call moves), prints the target next to each ``kvtier / raw`` ratio,
names the verification in use, and, when anything failed, says so before anything else
and withholds the ratio of the path that failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.bench.measure import Timing, ratio, ratio_target
from kvtier.core.capabilities import ResolvedPlan

__all__ = ["MAX_LISTED_FAILURES", "VERIFY_MODES", "BenchResult"]

#: How many failures the table lists before it says how many more there were.
MAX_LISTED_FAILURES = 20

#: What each ``--verify`` mode checks on a get, as the table explains it.
VERIFY_MODES = {
    "full": "every page's envelope header and payload checksum are checked on each get",
    "header": "only each page's envelope header is checked on get, not its payload checksum",
}


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
    failures: list[str]
    put: Timing
    get: Timing
    backup: Timing
    load: Timing
    raw_put: Timing | None
    raw_get: Timing | None
    #: the second raw baseline: the same calls spread over ``raw_threads`` threads
    raw_threads: int
    raw_put_threads: Timing | None
    raw_get_threads: Timing | None
    backend_stats: dict[str, int | float]
    store_stats: dict[str, int | float]
    workdir: str
    #: why the ratio compares two different disks, when it does
    raw_note: str | None = None
    #: the backends of the chain's tiers, fastest first, when ``--config`` gave a chain
    tiers: list[str] = field(default_factory=list)
    #: the other backends of the same command, run after this one on the same pages
    beside: list[BenchResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every page of every round came back bit-exact, and nothing failed (in this run
        and in every run ``beside`` it)."""
        return not self.failures and all(other.ok for other in self.beside)

    @property
    def name(self) -> str:
        """The backend, or ``chain memory -> segment`` for a chain of tiers."""
        return "chain " + " -> ".join(self.tiers) if self.tiers else self.plan.backend.name

    def _paths(self) -> dict[str, Timing]:
        paths = {
            "device_to_host": self.backup,
            "put": self.put,
            "get": self.get,
            "host_to_device": self.load,
        }
        if self.raw_put is not None and self.raw_get is not None:
            paths["raw_put"], paths["raw_get"] = self.raw_put, self.raw_get
        if self.raw_put_threads is not None and self.raw_get_threads is not None:
            paths["raw_put_threads"] = self.raw_put_threads
            paths["raw_get_threads"] = self.raw_get_threads
        return paths

    def failed_paths(self) -> dict[str, int]:
        """Failed pages per path, for the paths that had any."""
        return {name: t.failed_pages for name, t in self._paths().items() if t.failed_pages}

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` object; a ratio is null where a side of it failed.

        With other backends run beside this one, ``beside`` lists their objects (the same
        keys) and ``ok`` is true only when every one of them is; ``failures`` and the
        rest are this backend's own.
        """
        targets, why = ratio_target(self.plan.backend, self.plan.config.verify)
        out: dict[str, Any] = {
            "bench": "kvtier",
            "ok": self.ok,
            "failure_count": len(self.failures),
            "failed_pages": self.failed_paths(),
            "failures": self.failures,
            "backend": self.plan.backend.name,
            **({"tiers": list(self.tiers)} if self.tiers else {}),
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
            **{name: t.summary() for name, t in self._paths().items()},
            "notes": list(self.plan.notes) + ([self.raw_note] if self.raw_note else []),
        }
        if self.raw_put is not None and self.raw_get is not None:
            out["ratio"] = {
                "put": ratio(self.put, self.raw_put),
                "get": ratio(self.get, self.raw_get),
            }
            out["target"] = targets
            out["target_reason"] = why
        if self.raw_put_threads is not None and self.raw_get_threads is not None:
            targets_n, why_n = ratio_target(
                self.plan.backend, self.plan.config.verify, threads=True
            )
            out["raw_threads"] = self.raw_threads
            out["ratio_threads"] = {
                "put": ratio(self.put, self.raw_put_threads),
                "get": ratio(self.get, self.raw_get_threads),
            }
            out["target_threads"] = targets_n
            out["target_threads_reason"] = why_n
        out["backend_stats"] = self.backend_stats
        out["store_stats"] = self.store_stats
        if self.beside:
            out["beside"] = [other.to_dict() for other in self.beside]
        return out

    def report(self) -> str:
        """The human-readable table (failures first, when there are any); with backends
        beside this one, each one's table after it and then a side-by-side summary."""
        if not self.beside:
            return self.table()
        runs = [self, *self.beside]
        lines = [run.table() for run in runs]
        lines.append(self._side_by_side(runs))
        return "\n\n".join(lines)

    def _side_by_side(self, runs: list[BenchResult]) -> str:
        """One line per backend: put and get GB/s and each ratio to raw, as in its table."""
        threads = {run.raw_threads for run in runs if run.raw_put_threads is not None}
        n = f"{threads.pop()} threads" if len(threads) == 1 else "N threads"
        width = max(len("backend"), *(len(run.name) for run in runs)) + 2
        head = f"  {'backend':<{width}}{'put GB/s':>9}{'get GB/s':>10}"
        if any(run.raw_put is not None for run in runs):
            head += f"   {'kvtier / raw (put, get)':<26}kvtier / raw, {n} (put, get)"
        lines = [
            "side by side: "
            + " and ".join(run.name for run in runs)
            + ", the same pages, one run after the other",
            head,
        ]
        for run in runs:
            d = run.to_dict()
            line = f"  {run.name:<{width}}{d['put']['gbps']:>9.2f}{d['get']['gbps']:>10.2f}"
            if "ratio" in d:
                one = ", ".join(_times(d["ratio"][op]) for op in ("put", "get"))
                many = ", ".join(
                    _times(d.get("ratio_threads", {}).get(op)) for op in ("put", "get")
                )
                line += f"   {one:<26}{many}"
            lines.append(line + ("  FAILED" if run.failures else ""))
        if any(run.raw_put is not None for run in runs):
            lines.append(
                "  each backend's ratios compare it with raw I/O measured in its own run; "
                "p50 / p99 are in its table above"
            )
        return "\n".join(lines)

    def table(self) -> str:
        """This backend's table (failures first, when there are any)."""
        d = self.to_dict()
        g = self.plan.geometry
        lines = self._failure_head(d)
        what = f"{self.name} backend" if not self.tiers else self.name
        lines += [
            f"kvtier bench: {what}, io {d['io_backend']}, layout {d['layout']}, "
            f"device {d['device']}",
            f"  geometry   {g.describe()}",
            f"  workload   {self.pages} pages x {self.page_bytes / 2**20:.2f} MiB per round "
            f"(+{self.stored_bytes - self.page_bytes} B envelope each when stored), "
            f"{self.rounds} timed round(s) after an untimed warm-up",
            f"  verify     {d['verify']}: {VERIFY_MODES.get(d['verify'], '')}; and after "
            "every round each byte on the device is compared with the original",
            "",
            f"  {'path':<30}{'GB/s':>8}{'p50 ms':>9}{'p99 ms':>9}  one call moves",
        ]
        rows = [
            ("device -> host (backup)", "device_to_host"),
            ("host -> storage (put)", "put"),
            ("storage -> host (get)", "get"),
            ("host -> device (load)", "host_to_device"),
        ]
        if "raw_put" in d:
            rows += [("raw os.pwritev", "raw_put"), ("raw os.preadv", "raw_get")]
        if "raw_put_threads" in d:
            n = d["raw_threads"]
            rows += [
                (f"raw os.pwritev, {n} threads", "raw_put_threads"),
                (f"raw os.preadv, {n} threads", "raw_get_threads"),
            ]
        for label, key in rows:
            s = d[key]
            pages = s["pages_per_call"]
            what = f"{pages} page{'s' if pages != 1 else ''}"
            if key in ("device_to_host", "host_to_device"):
                what += " (a whole round)"
            flag = f"  FAILED: {s['failed_pages']} page(s)" if s["failed_pages"] else ""
            lines.append(
                f"  {label:<30}{s['gbps']:>8.2f}{s['p50_ms']:>9.2f}{s['p99_ms']:>9.2f}  "
                f"{what:<22}{flag}".rstrip()
            )
        lines += [
            "  GB/s: a round's bytes over its time, median of the timed rounds; p50 / p99:",
            "  the latency of one call, which moves the pages in the last column",
        ]
        if "ratio" in d:
            ratios = "   ".join(
                self._ratio_text(op, d["ratio"][op], d["target"][op]) for op in ("put", "get")
            )
            lines += ["", f"  kvtier / raw   {ratios}", f"                 {d['target_reason']}"]
        if "ratio_threads" in d:
            ratios = "   ".join(
                self._ratio_text(op, d["ratio_threads"][op], d["target_threads"][op])
                for op in ("put", "get")
            )
            lines += [
                f"  kvtier / raw, {d['raw_threads']} threads   {ratios}",
                f"                 {d['target_threads_reason']}",
            ]
        lines.append("")
        if not self.failures:
            lines.append(
                f"  verified: all {self.pages} pages bit-exact after device -> storage -> "
                f"device, every round"
            )
        else:
            lines += self._failure_list()
        lines += [f"  note: {n}" for n in d["notes"]]
        return "\n".join(lines)

    def _failure_head(self, d: dict[str, Any]) -> list[str]:
        if not self.failures:
            return []
        failed = ", ".join(f"{name} {n}" for name, n in d["failed_pages"].items())
        timed = f"; failed pages in the timed rounds: {failed}" if failed else ""
        withheld = [
            op
            for op in ("put", "get")
            if op in d.get("ratio", {})
            and (d["ratio"][op] is None or d.get("ratio_threads", {}).get(op, 0) is None)
        ]
        ratio = f"; no {' or '.join(withheld)} ratio" if withheld else ""
        return [
            f"kvtier bench: FAILED: {len(self.failures)} problem(s), listed below{timed}{ratio}",
            "",
        ]

    def _ratio_text(self, op: str, value: float | None, target: float | None) -> str:
        if value is None:
            return f"{op} n/a (failed {op}s measure nothing)"
        text = f"{op} {value:.2f}x"
        if target is not None:
            text += f" (target {target:.2f}x: {'ok' if value >= target else 'BELOW TARGET'})"
        return text

    def _failure_list(self) -> list[str]:
        lines = [f"  FAILED: {len(self.failures)} problem(s):"]
        lines += [f"    - {f}" for f in self.failures[:MAX_LISTED_FAILURES]]
        more = len(self.failures) - MAX_LISTED_FAILURES
        if more > 0:
            lines.append(f"    ... and {more} more (--json lists them all)")
        counters = {**self.store_stats, **self.backend_stats}
        causes = [
            f"{name}={value}"
            for name, value in sorted(counters.items())
            if value and ("fail" in name or "invalid" in name or "error" in name)
        ]
        if causes:
            lines.append(f"  counters: {', '.join(causes)}")
        return lines


def _times(value: float | None) -> str:
    """``0.93x``, or ``n/a`` where a failed side gives no ratio."""
    return "n/a" if value is None else f"{value:.2f}x"
